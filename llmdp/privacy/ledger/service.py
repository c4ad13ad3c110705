"""The ledger service: the single writer of a run's DP releases, and the budget keeper.

One ledger per *dataset* (``data.dataset_id``) in the ledgers' database
(`llmdp.privacy.ledger.database`: ``$LLMDP_HOME/ledger.sqlite`` or ``privacy.ledger``) records every
release made on that data: every run, every attempt, private tokenizers. The run directory
keeps its own ``ledger.jsonl`` with this run's records (what the run's report composes),
written inside the same database transaction. A :class:`LedgerService` writes both,
write-ahead (DESIGN, invariant `write-ahead-ledger`): rank 0 asks it to :meth:`admit` a step before the step starts and
to :meth:`ensure` it before the update is applied; no other process writes.

Under Ray it runs as a named actor on the driver's node (``ray.remote(LedgerService)``),
so every attempt of every worker group records through the same writer; its state is the
database, so a new driver (a re-launch) picks up exactly where the ledger stands.

Budget: a budget belongs to the dataset, not to the recipe that names it. The dataset
ledger's ``budget`` record (ε, δ, accountant, privacy unit; `llmdp.privacy.ledger.budget.DatasetBudget`)
is set by ``llmdp privacy ledger set-budget`` or by the first budgeted release (its recipe's
``privacy.budget_epsilon``, δ and accountant). Every release on the dataset, of every run
whatever its recipe says (no budget, another one), is checked against it: the composed ε, at
the budget's δ, of every release for the budget's unit, plus what live runs hold, plus the
release may not exceed it; checked inside the transaction that records each hold, each block
and each DP evaluation, inside a run's own hold too. A launch whose recipe states another
budget, and a release for another privacy unit, are refused.

"ε spent" is per privacy unit definition; the arithmetic (ε spent, holds, how many steps
fit) is pure functions over ledger records, in `llmdp.privacy.ledger.budget` (and, for a separate
evaluation source's ledger, `llmdp.privacy.ledger.eval_source`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets

from llmdp.privacy import accounting as _acc
from llmdp.privacy.accounting import event_from_json
from llmdp.privacy.accounting import release_entries as prior_entries
from llmdp.privacy.ledger import eval_source as _eval_source
from llmdp.privacy.ledger import (
    records as _ledger,  # append_line looked up at each call (tests patch it)
)
from llmdp.privacy.ledger.budget import (
    _UNKNOWN_UNIT,
    SET_BUDGET_CMD,
    DatasetBudget,
    budget_label,
    budget_record,
    budget_refusal,
    budget_status,
    dataset_epsilon,
    first_budget_record,
    holder_alive,
    live_holds,
    recipe_mismatch,
    recorded_budget,
    release_entries_of,
    steps_fit,
    steps_within_budget,
    unit_key,
    unused_hold_entries,
)
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.location import describe_location
from llmdp.privacy.ledger.records import (
    EVAL_MECHANISM,
    RUN_REPAIR_HINT,
    VOID_KIND,
    Ledger,
    LedgerError,
    is_step_release,
    net_records,
    step_count,
)

__all__ = ["BudgetError", "LedgerService", "cross_check", "open_dataset",
           "run_ledger_problems"]


class BudgetError(RuntimeError):
    """The dataset's privacy budget does not allow what was asked."""



def open_dataset(db, dataset_id: str, *, sha256: str, source: str, name: str, log=print,
                 legacy_jsonl: list[str] = (), declared: bool = True,
                 members: frozenset[str] = frozenset(), distinct: dict | None = None) -> dict:
    """Make sure ``dataset_id``'s ledger exists and knows this content hash: a new ledger
    starts with a "dataset" record; a new hash of known data is a "data_version" record
    (the same budget: a modified copy of the data is the same individuals unless the user
    declares a new ``data.dataset_id``). Legacy JSONL ledgers are imported once.

    A derived id (``declared`` False, `llmdp.data.ids`) is looked up by its
    spelling: a ledger started under an earlier spelling of the same source (e.g.
    ``hub:OrgName/Notes`` for ``hub:orgname/notes``) *is* this dataset's ledger and is kept;
    two such ledgers are refused (`ConfigError`, naming them). A new ledger whose data looks
    like another ledger's (`_similar_ledgers`: the same content hash, or files in common
    with it, ``members``: the real paths of the local files it reads) is refused unless
    ``data.dataset_id`` is declared (then a warning): one dataset, one budget. The same
    source name with other content is a warning only. ``distinct`` ({"distinct_from",
    "distinct_reason"}: the recipe's declaration that this data is not that of those
    ledgers, `dataset.open_dataset_ledger`) is recorded in a new ledger's record.

    Returns {"dataset_id" (the ledger opened), "new": bool, "versions": n, "similar": [...]}."""
    if not declared:
        dataset_id = _derived_ledger(db, dataset_id, log)
    # Looked for before the transaction when the ledger is new (it may list folders: not
    # while holding the database's write lock); a hint read, so no lock is needed.
    similar = (None if dataset_id in db.ledgers() else
               _similar_ledgers(db, dataset_id, sha256, name, members, source))
    with db.transaction(dataset_id, full=True) as tx:
        recs = tx.records
        known = [r for r in recs if r["kind"] in ("dataset", "data_version")]
        out = {"dataset_id": dataset_id, "new": not known, "versions": len(known), "similar": []}
        if not known:
            if similar is None:
                similar = _similar_ledgers(db, dataset_id, sha256, name, members, source)
            blocking = [s for s in similar if s["blocks"]]
            if blocking and not declared:
                raise _lookalike_refusal(dataset_id, blocking)
            tx.append({"kind": "dataset", "dataset_id": dataset_id, "sha256": sha256,
                       "source": source, "name": name, "similar_to": [s["ledger"] for s in similar],
                       **(distinct or {})})
        elif sha256 not in {r.get("sha256") for r in known}:
            tx.append({"kind": "data_version", "sha256": sha256, "source": source, "name": name})
            log(f"note: the data of dataset {dataset_id!r} changed since its ledger was started "
                f"({len(known)} earlier version(s)); it is charged to the same budget. If it holds "
                f"different individuals, declare a new data.dataset_id")
            out["versions"] += 1
    similar = similar if out["new"] else []
    for s in similar:
        log(f"warning: starting a new ledger for dataset {dataset_id!r}, but the ledger "
            f"{s['ledger']!r} holds data that looks like it ({s['why']}). If they are the same "
            f"individuals, set data.dataset_id: {s['ledger']} so that one budget covers both")
    out["similar"] = similar
    for path in legacy_jsonl:
        if path and os.path.exists(path):
            n = db.import_jsonl(dataset_id, path, log=log)
            if n:
                log(f"imported {n} release record(s) from the JSONL ledger {path} (written by an "
                    f"earlier llmdp) into the dataset ledger {dataset_id!r}, once")
    return out


def _derived_ledger(db, dataset_id: str, log) -> str:
    """The ledger of a derived id: the one whose stored id is a spelling of it
    (`dataset_ids.canonical_id`), kept under its stored id; ``dataset_id`` when none is."""
    from llmdp.config.validate import ConfigError
    from llmdp.data.ids import canonical_id

    same = [i for i in db.ledgers() if i == dataset_id or canonical_id(i) == dataset_id]
    if len(same) > 1:
        shown = ", ".join(repr(i) for i in same)
        raise ConfigError(
            f"the data's dataset ledger is {dataset_id!r}, but {len(same)} ledgers in "
            f"{db.where} are spellings of it ({shown}), started by an earlier llmdp that did "
            f"not normalize dataset ids: the releases on this data are split between them, and "
            f"a budget on one does not count the others'. Set data.dataset_id to one of them "
            f"to go on with that ledger, knowing that the others' releases are not counted in "
            f"it (`llmdp privacy ledger verify --dataset ID` shows each one's releases)",
            key="data.dataset_id")
    if same and same[0] != dataset_id:
        log(f"note: the dataset ledger of this data was started as {same[0]!r} (an earlier "
            f"spelling of {dataset_id!r}); it stays that ledger")
        return same[0]
    return dataset_id


def _lookalike_refusal(dataset_id: str, similar: list[dict]):
    from llmdp.config.validate import ConfigError

    first = similar[0]["ledger"]
    shown = "; ".join(f"{s['ledger']!r} ({s['why']})" for s in similar)
    others = (" (the other ledger(s) named keep their releases apart: only one of them can be "
              "declared)" if len(similar) > 1 else "")
    return ConfigError(
        f"this data would start a new dataset ledger {dataset_id!r}, but its data looks like "
        f"the data of the ledger(s) {shown}. One dataset must have one ledger, or its budget "
        f"does not count every release on it. If they hold the same individuals, set "
        f"data.dataset_id: {first} so that this run is charged to that ledger{others}; if this "
        f"data is about other individuals, declare a new data.dataset_id for it",
        key="data.dataset_id")


def _similar_ledgers(db, dataset_id: str, sha256: str, name: str,
                     members: frozenset[str] = frozenset(), source: str | None = None) -> list[dict]:
    """Other ledgers whose data looks like this one's (read without verification: their
    records are checked whenever they are used). ``blocks``: the same content hash, or
    overlapping sources (`dataset_ids.overlap`: files in common, a URI or Hub id inside the
    other); else the same source name with other content (a hint only)."""
    import json as _json

    from llmdp.data.ids import canonical_id, overlap

    conn = db._connect()
    cur = conn.cursor()
    db._exec(cur, "SELECT ledger, body FROM llmdp_records WHERE ledger <> ? AND "
                  "(body LIKE ? OR body LIKE ?)", (dataset_id, '%"kind":"dataset"%',
                                                    '%"kind":"data_version"%'))
    seen: dict[str, tuple[str, bool]] = {}
    for ledger, body in cur.fetchall():
        try:
            rec = _json.loads(body)
        except ValueError:
            continue
        if rec.get("sha256") == sha256:
            seen[ledger] = ("the same content hash", True)
        elif name and rec.get("name") == name and ledger not in seen:
            seen[ledger] = (f"the same source name {name!r}, other content", False)
    mine = canonical_id(source or dataset_id)
    for ledger in db.ledgers():
        if ledger == dataset_id or (ledger in seen and seen[ledger][1]):
            continue
        other = canonical_id(ledger)
        why = "the same source" if other == mine else overlap(mine, members, other)
        if why is not None:
            seen[ledger] = (f"overlapping sources: {why}", True)
    return [{"ledger": ledger, "why": why, "blocks": blocks}
            for ledger, (why, blocks) in seen.items()]


class LedgerService:
    """The single writer of one run's releases: to the dataset ledger (the database, in one
    transaction with the budget check) and to the run's ``ledger.jsonl`` (inside the same
    transaction, before it commits).

    ``hold(steps)``: (budget) hold the run's remaining steps, or raise `BudgetError`.
    ``admit(step)`` -> ``(ok, message)``: whether global step ``step`` may run (False once
    the budget, or the target after failures, would be crossed). ``ensure(step)``: the
    step's event is durable in both ledgers (a new block is reserved when needed).
    ``start_attempt()`` after every (re)start of the worker group: re-executed steps are
    counted again. ``end()``: the run's hold ends.

    The budget checked is the dataset's (its ledger's ``budget`` record), whatever
    ``budget_epsilon`` says; ``budget_epsilon`` (with ``delta`` and ``accountant``) is the
    recipe's statement: recorded as the dataset's budget by the first budgeted release, and a
    launch (`hold`) whose statement differs from the recorded budget is refused.
    ``eval_ledger`` (``{"dataset_id", "meta"}``): a separate private evaluation source's own
    dataset ledger, in the same database: each DP evaluation is recorded (and checked against
    its budget) there too.
    """

    def __init__(self, *, location: str, dataset_id: str, run_ledger: str, run_id: str, meta: dict,
                 block_size: int, total_steps: int, event_json: dict, delta: float,
                 accountant: str, budget_epsilon: float | None = None,
                 target_epsilon: float | None = None, prior_releases=(),
                 allow_exceed_target: bool = False, lock: dict | None = None,
                 eval_event_json: dict | None = None, eval_releases: int = 0,
                 eval_ledger: dict | None = None, head_log: str | None = None,
                 accountant_delta: float | None = None):
        self.location, self.dataset_id = location, dataset_id
        self.run_ledger = os.path.abspath(run_ledger)
        self.run_id, self.meta = run_id, dict(meta)
        self.block_size, self.total_steps = int(block_size), int(total_steps)
        self.event_json = event_json
        self.event = event_from_json(event_json)
        self.delta, self.accountant, self.budget = float(delta), accountant, budget_epsilon
        # δ is the published δ (a budget's identity); ε is composed at the accountant's δ, less
        # the noise generator's truncated tails of this run (`llmdp.privacy.noise.tail`).
        self.acc_delta = float(delta if accountant_delta is None else accountant_delta)
        self.tail = max(0.0, self.delta - self.acc_delta)
        self.target = target_epsilon
        self.prior = list(prior_releases)
        self.allow_exceed_target = bool(allow_exceed_target)
        self.lock = lock
        # The run's DP evaluations (llmdp.evaluation.dp): `eval_releases` planned releases of
        # `eval_event_json` each, part of the plan that privacy.target_epsilon covers.
        self.eval_event_json = eval_event_json
        self.eval_event = event_from_json(eval_event_json) if eval_event_json else None
        self.eval_releases = int(eval_releases) if eval_event_json else 0
        # The evaluation source's own ledger (None: the evaluation data is the training
        # data's, e.g. a held-out fraction; its releases are in this ledger already).
        self.eval_ledger = (dict(eval_ledger) if eval_ledger and self.eval_event is not None
                            and eval_ledger.get("dataset_id") != dataset_id else None)
        if budget_epsilon is not None and unit_key(self.meta) == _UNKNOWN_UNIT:
            raise ValueError(
                f"privacy.budget_epsilon={budget_epsilon:g} needs the run's privacy unit in the ledger "
                f"meta (meta['unit'] with its 'kind'), got meta={self.meta!r}: a budget is per unit "
                f"definition")
        # head_log: resolved on the driver (`dataset.open_dataset_ledger`), so that a
        # Ray actor with another $LLMDP_HOME anchors to the same log. Every record of this
        # run names its ledger.jsonl (an anchor too: `llmdp.privacy.ledger.anchors`).
        self.db = LedgerDB(location, head_log=head_log)
        self.db.run_ledgers[run_id] = self.run_ledger
        # This attempt's blocks: [start, end) and the hash of the release that reserved it.
        self._reserved: list[tuple[int, int, str]] = []
        self._closed: str | None = None  # why this attempt may release no more steps
        self._stopped: str | None = None
        self._refused: str | None = None  # why the dataset's budget refuses this run's releases
        self.attempt: str | None = None
        self.attempts = 0

    # ------------------------------------------------------------------ reading
    def records(self) -> list[dict]:
        return self.db.records(self.dataset_id)

    def status(self, records=None) -> dict:
        """ε spent on the dataset for this run's unit and what remains of the dataset's budget
        (at the budget's δ, by its accountant; without one, at this run's δ)."""
        records = self.records() if records is None else records
        recorded = budget_record(records)
        b = recorded_budget(records) or self._recipe_budget()
        where = describe_location(self.location)
        if b is None:
            st = budget_status(records, None, self.acc_delta, self.accountant, self.meta, where,
                               self.dataset_id)
        else:
            st = budget_status(records, b.epsilon, b.delta - self.tail, b.accountant, self.meta, where,
                               self.dataset_id)
        return {**st, "budget": None if b is None else b.to_record(),
                "budget_recorded": recorded is not None,
                "budget_label": None if b is None else self._budget_label(b)}

    def _mine(self, records) -> list[dict]:
        """This run's records, release counts net of its voids (`ledger.net_records`)."""
        return [r for r in net_records(records) if r.get("run_id") == self.run_id]

    # ------------------------------------------------------------------ budget
    def _recipe_budget(self) -> DatasetBudget | None:
        """The budget this run's recipe states (None: it states none)."""
        if self.budget is None:
            return None
        return DatasetBudget(float(self.budget), self.delta, self.accountant,
                             dict(self.meta.get("unit") or {}))

    def _budget_label(self, b: DatasetBudget) -> str:
        return budget_label(b, self._recipe_budget())

    def _composed(self, budget: DatasetBudget) -> DatasetBudget:
        """The budget as compositions use it: ε at its δ less this run's noise tails."""
        return dataclasses.replace(budget, delta=budget.delta - self.tail) if self.tail else budget

    def _in_force(self, tx) -> tuple[DatasetBudget | None, str | None]:
        """The budget this run's releases are checked against now, and why they may not be
        made at all (`budget.budget_refusal`: a release for another unit than the budget's)."""
        return budget_refusal(tx.records, self.meta, recipe=self._recipe_budget(),
                              dataset_id=self.dataset_id, where=describe_location(self.location))

    def _record_budget(self, tx, budget: DatasetBudget) -> None:
        """The first budgeted release on a dataset records its recipe's budget, in the
        transaction of that release (a no-op once a budget is recorded). Not a record of the
        run (run_id None): the run's chain and ledger.jsonl hold its releases only."""
        if budget_record(tx.records) is None:
            tx.append(first_budget_record(budget, f"run {self.run_id} (privacy.budget_epsilon)"))

    def _end_dead_holds(self, tx) -> None:
        """End the holds of runs that died (their lock file is free), in this transaction."""
        for rid, h in live_holds(tx.records).items():
            if rid != self.run_id and not holder_alive(h["hold"].get("lock")):
                # Not a record of the dead run (run_id None): its ledger.jsonl and its run
                # chain stay whole, and it can resume.
                tx.append({"kind": "hold_end", "run_id": None, "hold_of": rid,
                           "reason": "the run holding it is gone (its lock file is free)",
                           "ended_by": self.run_id})

    def _budget_allows(self, tx, want: int, hold: bool = False) -> int:
        """Steps of ``want`` that fit in the dataset's budget now (inside the transaction):
        ε(every release on the dataset for the budget's unit + the unused part of every other
        live hold + this run's reserved evaluations + the steps) <= the budget, at its δ.

        Checked inside this run's own hold too: a hold keeps other runs off the budget this
        run will spend, it is no licence to release unchecked (the dataset's total may have
        grown outside every hold since: an imported ledger, a run that held nothing when the
        budget was set, a changed budget). Sets ``self._refused`` when no step of this run
        may be released on this dataset at all (another privacy unit than the budget's)."""
        self._refused = None
        if want <= 0:
            return want
        budget, why = self._in_force(tx)
        if budget is None:
            return want
        if why is not None:
            self._refused = why
            return 0
        self._end_dead_holds(tx)
        recs = tx.records
        extra = []
        if hold:
            if self.eval_event is not None and self._evals_left(recs):
                extra.append((self.eval_event, self._evals_left(recs)))  # held with the steps
        else:
            mine = live_holds(recs).get(self.run_id)
            if mine is not None:  # the hold's evaluations stay reserved
                extra += unused_hold_entries(mine, steps=False)
        return steps_fit(recs, self._composed(budget), self.event, want, exclude=self.run_id, extra=extra)

    def _target_allows(self, records, want: int) -> int:
        """Steps of ``want`` that keep this run's ε within privacy.target_epsilon (unless
        failures may exceed it: privacy.allow_exceed_target_on_failure)."""
        if self.target is None or self.allow_exceed_target or want <= 0:
            return want
        mine = [r for r in self._mine(records) if r.get("kind") == "release"]
        done = step_count(mine)
        if done + want <= self.total_steps and self._evals_within_plan(mine):
            return want  # within the plan: ε <= the planned ε <= the target

        p_entries, p_thr = prior_entries(self.prior)
        base = p_entries + release_entries_of(mine)
        if self.eval_event is not None and self._evals_left(records):
            base += [(self.eval_event, self._evals_left(records))]  # room for the evaluations
        return steps_within_budget(base, self.event, self.target, self.acc_delta, self.accountant,
                                   want, p_thr)

    # ------------------------------------------------------------------ DP evaluations
    def _evals_done(self, records) -> int:
        return sum(int(r.get("count") or 0) for r in self._mine(records)
                   if r.get("kind") == "release" and not is_step_release(r))

    def _evals_left(self, records) -> int:
        return max(0, self.eval_releases - self._evals_done(records))

    def _evals_within_plan(self, mine) -> bool:
        return self._evals_done(mine) <= self.eval_releases

    def _eval_hold(self, records) -> dict:
        """What a budget hold adds for the run's planned DP evaluations not yet released."""
        if self.eval_event is None:
            return {}
        return {"eval_event": self.eval_event_json, "eval_releases": self._evals_left(records)}

    def _eval_refusal(self, tx) -> str | None:
        """Why one more DP evaluation may not be released now (None: it may)."""
        recs = tx.records
        mine = [r for r in self._mine(recs) if r.get("kind") == "release"]
        one = [(self.eval_event, 1)]
        if self.target is not None and not self.allow_exceed_target and not (
                self._evals_done(recs) < self.eval_releases and step_count(mine) <= self.total_steps):
            p_entries, p_thr = prior_entries(self.prior)
            eps = _acc.epsilon_with_threshold(p_entries + release_entries_of(mine) + one,
                                              self.acc_delta, p_thr, self.accountant)
            if eps > self.target:
                return (f"privacy.target_epsilon={self.target:g}: this DP evaluation would take "
                        f"the run's ε to {eps:.4f} (failures re-executed steps or evaluations); "
                        f"it was not released. Set privacy.allow_exceed_target_on_failure: true "
                        f"to release it anyway")
        budget, why = self._in_force(tx)
        if why is not None:
            return why
        if budget is not None:
            # The dataset's total, checked again inside this run's hold too (`_budget_allows`);
            # the hold's unused steps stay reserved.
            h = live_holds(recs).get(self.run_id)
            extra = unused_hold_entries(h, evals=False) if h is not None else []
            if steps_fit(recs, self._composed(budget), self.eval_event, 1, exclude=self.run_id,
                         extra=extra) < 1:
                eps = dataset_epsilon(recs, self._composed(budget), exclude=self.run_id, extra=extra + one)
                return (f"{self._budget_label(budget)}: this DP evaluation would take "
                        f"the dataset ledger {self.dataset_id!r} to ε = {eps:.4f} at δ = "
                        f"{budget.delta:.3g} (with what live runs hold); it was not released")
        return None

    def check_eval_source(self) -> dict | None:
        """At launch: the evaluation source's own ledger (if any) has room in its budget for
        this run's DP evaluations not yet recorded there (`eval_source.launch_refusal`), else
        `BudgetError`. Returns its status."""
        if self.eval_ledger is None:
            return None
        eid = self.eval_ledger["dataset_id"]
        records = self.db.records(eid)
        done = sum(int(r.get("count") or 0) for r in records
                   if r.get("kind") == "release" and r.get("run_id") == self.run_id)
        status, why = _eval_source.launch_refusal(
            records, meta=_eval_source.eval_meta(self.meta, self.eval_ledger), event=self.eval_event,
            left=max(0, self.eval_releases - done), dataset_id=eid,
            where=describe_location(self.location), delta=self.acc_delta, accountant=self.accountant)
        if why is not None:
            raise BudgetError(why)
        return status

    def release_eval(self, step: int) -> tuple[bool, str]:
        """Write-ahead: one DP evaluation (after ``step`` steps) durable in both ledgers
        before its noisy value is computed: ``(True, "")``; or ``(False, why)`` when the
        target or the budget would be crossed (nothing is recorded)."""
        if self.eval_event is None:
            raise LedgerError("release_eval: this run plans no DP evaluation")
        if self.attempt is None:
            self.start_attempt()
        also = {}
        if self.eval_ledger is not None:
            # The evaluation source's own ledger first (its releases on that data), then this
            # run's: both durable before the noisy value exists. A refusal between the two
            # (a concurrent run took this dataset's budget) leaves the first over-counting,
            # never under-counting. Not a line of this run's ledger.jsonl: the run's report
            # composes each release once, from this dataset's record.
            with self.db.transaction(self.dataset_id) as tx:  # checked first: nothing written
                why = self._eval_refusal(tx)
            if why is not None:
                return False, why
            eid = self.eval_ledger["dataset_id"]
            meta = _eval_source.eval_meta(self.meta, self.eval_ledger)
            with self.db.transaction(eid) as etx:
                why = _eval_source.release_refusal(etx.records, meta=meta, event=self.eval_event,
                                                   dataset_id=eid, where=describe_location(self.location))
                if why is None:
                    erec = etx.append({
                        "kind": "release", "event": self.eval_event_json, "count": 1,
                        "first_step": None, "eval_step": int(step), "run_id": self.run_id,
                        "attempt": self.attempt, "training_dataset_id": self.dataset_id,
                        "meta": meta})
            if why is not None:
                return False, why
            also = {"also_recorded_in": {"dataset_id": eid, "seq": erec["seq"], "hash": erec["hash"]}}
        with self.db.transaction(self.dataset_id) as tx:
            why = self._eval_refusal(tx)
            if why is None:
                rec = tx.append({"kind": "release", "event": self.eval_event_json, "count": 1,
                                 "first_step": None, "eval_step": int(step), "run_id": self.run_id,
                                 "attempt": self.attempt,
                                 "meta": {**self.meta, "mechanism": EVAL_MECHANISM}, **also})
                self._append_run_line(rec)
        if why is not None and also:
            why += (f" (it was recorded in the evaluation source's ledger "
                    f"{self.eval_ledger['dataset_id']!r} first, which now over-counts by one)")
        return (why is None), why or ""

    def hold(self, steps: int, need: int | None = None) -> dict:
        """At launch: hold ``steps`` (this run's remaining planned steps) of the dataset's
        budget, or as many as fit if at least ``need`` do (default: all); returns the status
        with ``"held"`` (0: nothing held, ``"fit"`` says how many would have fit). A dataset
        without a budget, and a recipe that states none: nothing is held. A budgeted dataset
        holds this run's steps whatever its recipe says. Raises `BudgetError` when the recipe
        states another budget than the recorded one, or the run's privacy unit is not the
        budget's. The first budgeted launch records its recipe's budget with its hold."""
        need = int(steps) if need is None else int(need)
        with self.db.transaction(self.dataset_id, full=True) as tx:
            mismatch = recipe_mismatch(tx.records, self._recipe_budget(), dataset_id=self.dataset_id,
                                       where=describe_location(self.location))
            if mismatch is not None:
                raise BudgetError(mismatch)
            budget, why = self._in_force(tx)
            if why is not None:
                raise BudgetError(why)
            fit, held = int(steps), 0
            set_now = budget is not None and budget_record(tx.records) is None
            if budget is not None:
                fit = self._budget_allows(tx, int(steps), hold=True)
                held = fit if fit >= max(1, need) else 0
            if held:
                self._record_budget(tx, budget)
                rec = tx.append({"kind": "hold", "run_id": self.run_id, "steps": int(held),
                                 "event": self.event_json, "meta": self.meta, "lock": self.lock,
                                 "budget_epsilon": budget.epsilon, "budget_delta": budget.delta,
                                 **self._eval_hold(tx.records)})
                self._append_run_line(rec)
            records = list(tx.records)
        # What the dataset will be at once this run has released what it holds (with what
        # other live runs hold): the figure a user reads the budget line for.
        after = None if not held or budget is None else dataset_epsilon(records, self._composed(budget))
        return {**self.status(records), "held": held, "fit": fit,
                "budget_set_now": bool(held and set_now), "epsilon_after_run": after}

    def end(self, reason: str = "run ended") -> None:
        """End this run's hold (if any): what it did not use goes back to the budget."""
        with self.db.transaction(self.dataset_id) as tx:
            if self.run_id in live_holds(tx.records):
                rec = tx.append({"kind": "hold_end", "run_id": self.run_id, "reason": reason})
                self._append_run_line(rec)

    # ------------------------------------------------------------------ writing
    def _append_run_line(self, rec: dict) -> None:
        # Inside the database transaction, before it commits: a crash in between leaves a
        # line the database lacks (detected), never a release the run's file lacks.
        _ledger.append_line(self.run_ledger, rec)

    def position(self) -> dict:
        """Where the ledgers stand (stored in every checkpoint): this attempt, the end of its
        last reserved block, and this run's records (count, last hash) in ledger.jsonl."""
        recs = Ledger(self.run_ledger).records() if os.path.exists(self.run_ledger) else []
        return {
            "attempt": self.attempt,
            "reserved_until": max((b for _, b, _ in self._reserved), default=0),
            "run_steps_recorded": step_count(recs),
            "run_records": len(recs),
            "run_last_hash": recs[-1].get("hash") if recs else None,
            "dataset_id": self.dataset_id,
        }

    def released_after(self, position: dict | None) -> bool:
        """Whether this run's ledger holds a release after ``position`` (a checkpoint's
        `position`): True when it does, or when it cannot tell (no position, another run's
        or dataset's, or records that differ from those the position counted)."""
        if not isinstance(position, dict) or position.get("dataset_id") != self.dataset_id:
            return True
        recs = Ledger(self.run_ledger).records() if os.path.exists(self.run_ledger) else []
        n = position.get("run_records")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(recs):
            return True
        if (recs[n - 1].get("hash") if n else None) != position.get("run_last_hash"):
            return True
        return any(r.get("kind") == "release" for r in recs[n:])

    def start_attempt(self) -> str:
        # 128 random bits: unique across launches (the report counts attempts by id, so two
        # launches in one process and one second must differ), and published (ledger,
        # report): no time or pid in it, which would tell when and where the run went on.
        self.attempt = secrets.token_hex(16)
        self.attempts += 1
        self._reserved = []
        self._stopped = None
        self._closed = None
        return self.attempt

    def _covered(self, step: int) -> bool:
        return any(a <= step < b for a, b, _ in self._reserved)

    def void_unrun(self, step: int, reason: str, attempt: str | None = None) -> dict:
        """A graceful stop after ``step`` steps: this attempt runs no step any more, and the
        steps it reserved from ``step`` on never ran. Each such remainder of a block becomes a
        ``void`` record (`llmdp.privacy.ledger.records`: counts are net of it), in one transaction per
        call, and leaves this attempt's reservation in the same call: the service is the
        only gate before every step (`admit` / `ensure`), and it refuses every step of this
        attempt from now on (`LedgerError`), so no process can release a voided step. Asked
        by rank 0 once every worker has finished step ``step - 1`` and stopped (the workers
        step together: no update is applied without rank 0's reduction). ``attempt``: the
        caller's attempt (`start_attempt`'s id); a caller whose attempt is over is refused,
        so that no one voids another attempt's reservation. Returns ``{"steps_voided",
        "attempt"}``."""
        if self.attempt is None:
            self.start_attempt()
        if attempt is not None and attempt != self.attempt:
            # Asked by the rank 0 of an attempt that is over (a new one started since): the
            # reservation here is the new attempt's, whose steps may be running. Nothing is voided.
            raise LedgerError(f"void_unrun: attempt {attempt} of run {self.run_id} is over "
                              f"(attempt {self.attempt} runs now); nothing was voided")
        step = int(step)
        self._closed = reason
        rest = [(max(a, step), b, h) for a, b, h in self._reserved if b > step]
        if rest:
            with self.db.transaction(self.dataset_id) as tx:
                for a, b, h in rest:
                    rec = tx.append({"kind": VOID_KIND, "release": h, "first_step": a, "steps": b - a,
                                     "event": self.event_json, "run_id": self.run_id,
                                     "attempt": self.attempt, "meta": self.meta, "reason": reason})
                    self._append_run_line(rec)
        self._reserved = [(a, min(b, step), h) for a, b, h in self._reserved if a < step]
        return {"steps_voided": sum(b - a for a, b, _ in rest), "attempt": self.attempt}

    def _stop_message(self, step: int, why: str, records) -> str:
        if why == "budget" and self._refused is not None:
            return (f"{self._refused}. The run stopped before step {step + 1} of "
                    f"{self.total_steps} and saved its state")
        if why == "budget":
            st = self.status(records)
            holders = [h["run_id"] for h in st["live_holds"] if h["run_id"] != self.run_id]
            return (
                f"{st['budget_label']} reached on the dataset ledger "
                f"{self.dataset_id!r} ({st['ledger']}): ε spent = {st['epsilon_spent']:.4f} at "
                f"δ = {st['delta']:.3g} for the privacy unit {st['unit']!r}"
                + (f", and run(s) {', '.join(holders)} hold the rest" if holders else "")
                + f"; one more step of this run would cross it. The run stopped before step "
                f"{step + 1} of {self.total_steps} and saved its state; raise the dataset's "
                f"budget (`{SET_BUDGET_CMD} --dataset {self.dataset_id} --epsilon ...`, "
                f"recorded) or train on data with budget left")
        done = step_count(self._mine(records))
        return (
            f"privacy.target_epsilon={self.target:g} reached: failures, or stops at once (a "
            f"second Ctrl-C, a killed process), made this run re-execute steps ({done} steps in "
            f"its ledger for {step} completed; a first Ctrl-C loses none), and one more step would "
            f"take ε past the target. The run stopped before step {step + 1} of "
            f"{self.total_steps}; its report states ε. To finish anyway (ε above the target, "
            f"stated first in the report), set privacy.allow_exceed_target_on_failure: true")

    def target_refusal(self, step: int) -> str | None:
        """Read only, before a launch starts its workers: why privacy.target_epsilon refuses
        step ``step`` already (the ledger holds steps re-executed after failures or forced
        stops), else None. A resumed run that could not run a single step is told so without
        starting Ray; the budget's own refusal comes from `hold`."""
        records = self.records()
        if self._target_allows(records, 1) >= 1:
            return None
        return self._stop_message(int(step), "target", records)

    def admit(self, step: int) -> tuple[bool, str]:
        # Asked whatever the recipe says: the dataset's budget (recorded in its ledger, maybe
        # by another run or `llmdp privacy ledger set-budget` while this one runs) applies.
        if self._closed is None and self._covered(step):
            return True, ""
        ok = self.ensure(step, stop_ok=True)
        return (True, "") if ok or self._covered(step) else (False, self._stopped)

    def ensure(self, step: int, stop_ok: bool = False) -> bool:
        """Write-ahead: ``step`` durable in both ledgers before its update is applied. True
        if a block was reserved now."""
        if self.attempt is None:
            self.start_attempt()
        if self._closed is not None:
            raise LedgerError(f"step {step}: this attempt of run {self.run_id} was stopped "
                              f"({self._closed}) and voided the steps it had not run; it "
                              f"releases no step any more (a new attempt resumes the run)")
        if self._covered(step):
            return False
        if step >= self.total_steps:
            raise LedgerError(f"step {step} is beyond the planned total_steps={self.total_steps}: "
                              "the privacy budget covers only the planned steps")
        want = min(self.block_size, self.total_steps - step)
        with self.db.transaction(self.dataset_id) as tx:
            by_target = self._target_allows(tx.records, want)
            count = self._budget_allows(tx, by_target)
            if count >= 1:
                recipe = self._recipe_budget()
                if recipe is not None:
                    self._record_budget(tx, recipe)  # the first budgeted release
                rec = tx.append({"kind": "release", "event": self.event_json, "count": int(count),
                                 "first_step": step, "run_id": self.run_id,
                                 "attempt": self.attempt, "meta": self.meta})
                self._append_run_line(rec)
                block = rec["hash"]
            records = tx.records
        if count < 1:
            self._stopped = self._stop_message(step, "budget" if by_target >= 1 else "target", records)
            if stop_ok:
                return False
            raise BudgetError(self._stopped)
        self._reserved.append((step, step + count, block))
        return True


def cross_check(run_records: list[dict], dataset_records: list[dict], run_id: str,
                run_ledger: str = "ledger.jsonl", dataset: str = "the dataset ledger") -> list[str]:
    """Problems between a run's ``ledger.jsonl`` records and the dataset ledger's (both
    verified): every line of the run's file must be the dataset ledger's record of the same
    seq and hash, and every record of the run in the dataset ledger must be in the file (a
    deleted last line leaves a valid run chain; the dataset ledger still has it)."""
    if not run_records or "hash" not in run_records[0]:
        return []  # a legacy run ledger: nothing to compare by hash
    by_hash = {r["hash"]: r for r in dataset_records}
    problems = []
    hint = RUN_REPAIR_HINT.format(run_dir=os.path.dirname(run_ledger) or ".")
    for i, r in enumerate(run_records, 1):
        if r["hash"] not in by_hash:
            problems.append(
                f"{run_ledger}: line {i} (record {r.get('seq')}) is not in {dataset}: written by "
                f"a reservation whose transaction did not commit (a crash), or not by llmdp. {hint}")
    have = {r["hash"] for r in run_records}
    missing = [r for r in dataset_records if r.get("run_id") == run_id and r["hash"] not in have]
    if missing:
        steps = sum(int(r.get("count") or 0) for r in missing if r.get("kind") == "release")
        problems.append(
            f"{run_ledger} lacks {len(missing)} of this run's record(s) that {dataset} holds "
            f"(records {', '.join(str(r['seq']) for r in missing[:5])}; {steps} step(s)): lines "
            f"were deleted, or a crash came between the database and the file. {hint}")
    return problems


def run_ledger_problems(run_ledger: str, run_id: str, location: str, dataset_id: str) -> list[str]:
    """Problems of a run's ``ledger.jsonl``, read on its own and cross-checked against its
    dataset ledger (`cross_check`). The dataset ledger is read first and must be intact (a
    run's file is repaired from it): its damage raises `LedgerError`."""
    db = LedgerDB(location, read_only=True)
    try:
        records = db.records(dataset_id)
    finally:
        db.close()
    try:
        run_records = Ledger(run_ledger).records()
    except LedgerError as e:
        return [str(e)]
    return cross_check(run_records, records, run_id, run_ledger,
                       f"the dataset ledger {dataset_id!r}")
