"""`llmdp privacy ledger list|verify|repair|end-hold|import|set-budget`: the dataset ledgers
from the command line.

Exit status: 0 when everything checked is intact (or was repaired), 2 with one message when a
ledger is damaged or an argument is wrong (the CLI prints `LedgerError`/`ValueError`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from llmdp.config.choices import Accountant
from llmdp.privacy.ledger.budget import (
    BUDGET_KIND,
    DatasetBudget,
    budget_record,
    dataset_epsilon,
    holder_alive,
    live_holds,
    not_composed,
    recorded_budget,
    split_by_unit,
    unit_epsilon,
    unit_key,
    who,
)
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.location import resolve_location
from llmdp.privacy.ledger.records import (
    LEDGER_FILENAME,
    LedgerError,
    append_line,
    is_step_release,
    net_records,
)
from llmdp.privacy.ledger.service import run_ledger_problems


def _db(location: str | None, read_only: bool):
    loc = resolve_location(location)
    return LedgerDB(loc, read_only=read_only)


# A run directory's plan.json, as `llmdp.record.rundir.RunDir(run_dir).info` reads it (the
# command line passes that reader in: run directories are a layer above the ledgers).
RunInfo = Callable[[str], dict]


def _run_info(run_dir: str, read_info: RunInfo) -> tuple[dict, str]:
    info = read_info(run_dir)  # NotARunDirectory (a ValueError) without plan.json
    d = info.get("dataset_ledger")
    if not isinstance(d, dict):
        raise ValueError(f"{run_dir}: a run of an earlier llmdp (its dataset ledger is the JSONL "
                         f"file {d}); import that file with `llmdp privacy ledger import`")
    return info, d["location"]


def _per_unit(recs, delta: float, accountant: Accountant = Accountant.PLD) -> str:
    """ε spent at ``delta`` for every privacy unit definition the ledger's releases name."""
    units = {}
    for r in recs:
        if r.get("kind") == "release" and (r.get("meta") or {}).get("unit"):
            units.setdefault(unit_key(r["meta"]), r["meta"])
    return "; ".join(f"ε spent {unit_epsilon(recs, m, delta, accountant):.4f} at δ = {delta:g} "
                     f"({accountant}) for the privacy unit {k!r}" for k, m in units.items())


def _summary(ledger: str, st, delta: float | None = None) -> str:
    recs = st.records
    rel = [r for r in net_records(recs) if r["kind"] == "release"]  # net of voids
    runs = {r.get("run_id") for r in rel}
    holds = live_holds(recs)
    budget = recorded_budget(recs)
    steps = sum(int(r["count"]) for r in rel if is_step_release(r))
    others = sum(int(r["count"]) for r in rel if not is_step_release(r))
    return (f"{ledger}: intact, {len(recs)} record(s), {len(rel)} release record(s) "
            f"({steps} training step(s)"
            + (f", {others} other release(s): DP evaluations, tokenizers" if others else "")
            + f") by {len(runs)} run(s)"
            + (f", {st.excused} damaged record(s) excused by repairs" if st.excused else "")
            + (f", live hold(s): {', '.join(holds)}" if holds else "")
            + (f", budget {budget.describe()}, ε spent "
               f"{unit_epsilon(recs, budget.unit, budget.delta, budget.accountant):.4f}"
               if budget is not None else ", no budget")
            + (f"; {_per_unit(recs, delta)}" if delta is not None and rel else "")
            + (_at_default_delta(recs, rel) if delta is None and budget is None and rel else ""))


def _at_default_delta(recs, rel) -> str:
    """A ledger without a budget, listed without --delta: ε spent at llmdp's default δ for
    the largest N its releases name (the δ a recipe without privacy.delta is planned at;
    the larger N, the smaller δ and the larger ε), else nothing."""
    from llmdp.privacy.plan import default_delta  # lazy: only this line needs the planner

    sizes = [int(n) for r in rel for n in [(r.get("meta") or {}).get("dataset_size")]
             if isinstance(n, int) and not isinstance(n, bool) and n >= 1]
    if not sizes:
        return ""
    return (f"; {_per_unit(recs, default_delta(max(sizes)))} (llmdp's default δ for N = "
            f"{max(sizes)}; --delta D for another)")


def _delta_arg(value: str) -> float:
    try:
        d = float(value)
    except ValueError:
        raise ValueError(f"--delta: {value!r} is not a number") from None
    if not 0 < d < 1:
        raise ValueError(f"--delta: {value} is not in (0, 1)")
    return d


def verify_run(run_dir: str, location: str | None, read_info: RunInfo) -> list[str]:
    """Problems of a run's ledger.jsonl, checked on its own and against its dataset ledger
    (raises `LedgerError` if the dataset ledger itself is damaged)."""
    info, loc = _run_info(run_dir, read_info)
    return run_ledger_problems(os.path.join(run_dir, LEDGER_FILENAME), info.get("run_id"),
                               resolve_location(location or loc), info["dataset_ledger"]["dataset_id"])


def main(args, read_info: RunInfo) -> int:
    """``llmdp privacy ledger ARGS``; ``read_info``: a run directory's plan.json (`RunInfo`)."""
    cmd = args.ledger_command
    if cmd == "list":
        delta = None if getattr(args, "delta", None) is None else _delta_arg(args.delta)
        db = _db(args.ledger, read_only=True)
        try:
            ids = db.ledgers()
            print(f"ledgers in {db.where}: {len(ids)}")
            for i in ids:
                try:
                    print("  " + _summary(i, db.read(i), delta))
                except LedgerError as e:
                    print(f"  {i}: DAMAGED ({str(e).split(' is damaged: ')[-1].split('. Nothing')[0]})")
        finally:
            db.close()
        return 0
    if cmd == "verify":
        if args.run_dir:
            problems = verify_run(args.run_dir, args.ledger, read_info)
            if problems:
                raise LedgerError("; ".join(problems))
            print(f"{os.path.join(args.run_dir, LEDGER_FILENAME)}: intact, and every record is in "
                  f"its dataset ledger, which holds no other record of this run")
            return 0
        db = _db(args.ledger, read_only=True)
        try:
            ids = [args.dataset] if args.dataset else db.ledgers()
            if args.dataset and args.dataset not in db.ledgers():
                raise ValueError(f"--dataset {args.dataset!r}: no such ledger in {db.where} "
                                 f"(`llmdp privacy ledger list` shows them)")
            damaged = []
            for i in ids:
                try:
                    print(_summary(i, db.read(i)))
                except LedgerError as e:
                    damaged.append(str(e))
            if damaged:
                raise LedgerError("\n".join(damaged))
            print(f"checked against the head log {db.heads.path} and the runs' ledger.jsonl "
                  f"files the records name")
        finally:
            db.close()
        return 0
    if cmd == "repair":
        if args.run_dir:
            return _repair_run(args.run_dir, args.ledger, args.reason, read_info)
        if not args.dataset:
            raise ValueError("llmdp privacy ledger repair: give a RUN_DIR (rewrite its "
                             "ledger.jsonl) or --dataset ID (a damaged dataset ledger)")
        db = _db(args.ledger, read_only=False)
        try:
            rec = db.repair(args.dataset, acknowledge_loss=args.acknowledge_loss, reason=args.reason)
        finally:
            db.close()
        if rec is None:
            print(f"{args.dataset}: intact; nothing to repair")
            return 0
        print(f"{args.dataset}: repaired by record {rec['seq']}: {rec['records_lost']} damaged "
              f"record(s) excused and no longer counted (acknowledged loss, recorded)")
        return 0
    if cmd == "end-hold":
        db = _db(args.ledger, read_only=False)
        try:
            with db.transaction(args.dataset, full=True) as tx:
                hold = live_holds(tx.records).get(args.run_id)
                if hold is None:
                    raise ValueError(f"{args.run_id!r} holds nothing in the dataset ledger "
                                     f"{args.dataset!r} (`llmdp privacy ledger verify --dataset "
                                     f"{args.dataset}` lists the live holds)")
                lock = hold["hold"].get("lock") or {}
                if lock.get("path") and os.path.exists(lock["path"]) and holder_alive(lock):
                    raise ValueError(f"run {args.run_id!r} is alive (its lock file {lock['path']} "
                                     f"is held by PID {lock.get('pid')} on {lock.get('host')}); "
                                     f"its hold ends when its launch ends")
                tx.append({"kind": "hold_end", "run_id": None, "hold_of": args.run_id,
                           "reason": f"ended by hand: {args.reason}".rstrip(": "), "by": _who()})
        finally:
            db.close()
        print(f"{args.dataset}: the hold of run {args.run_id} ended (recorded)")
        return 0
    if cmd == "set-budget":
        return set_budget(args)
    if cmd == "import":
        db = _db(args.ledger, read_only=False)
        try:
            n = db.import_jsonl(args.dataset, args.file)
        finally:
            db.close()
        print(f"imported {n} release record(s) from {args.file} into {args.dataset!r}"
              if n else f"{args.file}: imported before; nothing to do")
        return 0
    raise ValueError(f"unknown ledger command {cmd!r}")


def _repair_run(run_dir: str, location: str | None, reason: str, read_info: RunInfo) -> int:
    """Rewrite a run's ledger.jsonl from its dataset ledger (which must be intact): the
    damaged file is kept beside it, and the repair is recorded in the dataset ledger."""
    problems = verify_run(run_dir, location, read_info)
    if not problems:
        print(f"{os.path.join(run_dir, LEDGER_FILENAME)}: intact; nothing to repair")
        return 0
    info, loc = _run_info(run_dir, read_info)
    ds, run_id = info["dataset_ledger"]["dataset_id"], info["run_id"]
    path = os.path.join(run_dir, LEDGER_FILENAME)
    db = _db(location or loc, read_only=False)
    try:
        with db.transaction(ds, full=True) as tx:
            # Links to this run's records that a repair of the dataset ledger excused (they
            # are no longer counted): the rewritten file lacks them, and says so.
            gaps, last = [], None
            for r in tx.records:
                if r.get("run_id") == run_id:
                    if r.get("run_prev") != last:
                        gaps.append({"after": last, "link": r.get("run_prev")})
                    last = r["hash"]
            tx.append({"kind": "repair", "run_id": run_id, "target": "run ledger",
                       "excused": [], "run_links_excused": gaps, "problems": problems[:5],
                       "reason": reason, "by": _who()})
            mine = [r for r in tx.records if r.get("run_id") == run_id]
            kept = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
            if os.path.exists(path):
                os.replace(path, kept)
            for r in mine:
                append_line(path, r)
    finally:
        db.close()
    print(f"{path}: rewritten from the dataset ledger {ds!r} ({len(mine)} record(s), the repair "
          f"included); the damaged file is {kept}")
    return 0


def _number(flag: str, text, *, integer: bool = False):
    if text is None:
        return None
    try:
        v = int(text) if integer else float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{flag}: {text!r} is not {'an integer' if integer else 'a number'}") from None
    if not math.isfinite(v):
        raise ValueError(f"{flag}: {text!r} is not a finite number")
    return v


def _unit_from_args(args) -> dict | None:
    """The privacy unit definition given by --unit (with --user-field / --sequence-length /
    --document-masking), as a run's ``meta["unit"]`` states it (`budget.unit_key`)."""
    kind = args.unit
    length = _number("--sequence-length", args.sequence_length, integer=True)
    if kind is None:
        if args.user_field is not None or length is not None or args.document_masking:
            raise ValueError("--user-field / --sequence-length / --document-masking describe a "
                             "privacy unit: give --unit too (document, user or sequence)")
        return None
    if kind not in ("document", "user", "sequence"):
        raise ValueError(f"--unit: {kind!r} is not one of ['document', 'user', 'sequence']")
    if kind != "user" and args.user_field is not None:
        raise ValueError(f"--user-field: only with --unit user (got --unit {kind})")
    if kind != "sequence" and (length is not None or args.document_masking):
        raise ValueError(f"--sequence-length / --document-masking: only with --unit sequence "
                         f"(got --unit {kind})")
    if kind == "document":
        return {"kind": "document"}
    if kind == "user":
        if not args.user_field:
            raise ValueError("--unit user: give --user-field (the record field naming the user, "
                             "data.user_field in the recipes)")
        return {"kind": "user", "user_field": args.user_field}
    if length is None or length < 1:
        raise ValueError("--unit sequence: give --sequence-length L >= 1 (data.sequence_length in "
                         "the recipes; add --document-masking if they set data.document_masking)")
    return {"kind": "sequence", "sequence_length": length,
            "document_masking": bool(args.document_masking)}


def _unit_of_releases(records) -> dict | None:
    """The unit definition of the ledger's releases when they all have one and the same."""
    units = {}
    for r in records:
        if r.get("kind") == "release" and r.get("count"):
            meta = r.get("meta") or {}
            units.setdefault(unit_key(meta), meta.get("unit"))
    if len(units) == 1:
        (key, unit), = units.items()
        if key != "not recorded" and isinstance(unit, dict):
            return unit
    return None


def set_budget(args) -> int:
    """``llmdp privacy ledger set-budget --dataset ID --epsilon E [--delta D] [--accountant A]
    [--unit ...] [--reason ...] [--create]``: set or change the dataset's budget, a ``budget``
    record in its ledger naming the old budget (who, when, why). The only way to change a
    budget once set (a recipe cannot). Refused: a budget below what the dataset has spent and
    what live runs hold (at the new δ, by the new accountant), and a unit definition other
    than that of releases already in the ledger (a budget for one unit cannot bound them)."""
    if not args.dataset:
        raise ValueError("llmdp privacy ledger set-budget: give --dataset ID (the data.dataset_id "
                         "whose budget it is; `llmdp privacy ledger list` shows them)")
    eps = _number("--epsilon", args.epsilon)
    if eps is None:
        raise ValueError("llmdp privacy ledger set-budget: give --epsilon E (the dataset's budget, "
                         "a number > 0)")
    if eps <= 0:
        raise ValueError(f"--epsilon: {args.epsilon} is not > 0")
    delta = _number("--delta", args.delta)
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"--delta: {args.delta} is not in (0, 1)")
    if args.accountant is not None and Accountant.get(args.accountant) is None:
        raise ValueError(f"--accountant: {args.accountant!r} is not one of {list(Accountant)}")
    unit = _unit_from_args(args)
    db = _db(args.ledger, read_only=False)
    try:
        if args.dataset not in db.ledgers() and not args.create:
            raise ValueError(f"--dataset {args.dataset!r}: no such ledger in {db.where} (`llmdp "
                             f"privacy ledger list` shows them); add --create to start its ledger "
                             f"with this budget, before any run on it")
        with db.transaction(args.dataset, full=True) as tx:
            recs = tx.records
            old_raw = budget_record(recs)
            old = recorded_budget(recs)
            if delta is None and old is None:
                raise ValueError("--delta: required when the dataset has no budget yet (the δ "
                                 "at which ε is composed; the recipes' privacy.delta)")
            unit = unit or (old.unit if old is not None else _unit_of_releases(recs))
            if unit is None:
                raise ValueError("--unit: required when the dataset has no budget yet and its "
                                 "ledger holds no release to take the privacy unit from (document; "
                                 "user --user-field F; sequence --sequence-length L)")
            new = DatasetBudget(eps, delta if delta is not None else old.delta,
                                args.accountant or (old.accountant if old is not None else Accountant.PLD),
                                unit)
            if old is not None and not old.differences(new) and old.key == new.key:
                print(f"{args.dataset}: the budget is already {new.describe()}; nothing recorded")
                return 0
            other = not_composed(recs, new.unit)
            if other:
                units = sorted({x["unit"] for x in other})
                raise ValueError(
                    f"--unit: the dataset ledger {args.dataset!r} holds releases for other privacy "
                    f"units than {new.key!r} ({', '.join(repr(u) for u in units)}); a budget for "
                    f"{new.key!r} would not bound them (no group-privacy conversion is made). "
                    f"Give the unit of its releases")
            same, _ = split_by_unit(recs, new.unit)
            spent = unit_epsilon(recs, new.unit, new.delta, new.accountant)
            with_holds = dataset_epsilon(recs, new)
            if with_holds > new.epsilon:
                holds = live_holds(recs)
                raise ValueError(
                    f"--epsilon {eps:g}: the dataset ledger {args.dataset!r} has spent ε = "
                    f"{spent:.4f} at δ = {new.delta:.3g} ({new.accountant}) for the privacy unit "
                    f"{new.key!r}"
                    + (f", {with_holds:.4f} with what the live run(s) {', '.join(holds)} hold"
                       if holds else "")
                    + f": a budget below that is already spent. Give --epsilon of at least "
                    f"{with_holds:.4f}"
                    + (" (or end the holds of runs that died: `llmdp privacy ledger end-hold`)"
                       if holds else ""))
            rec = tx.append({"kind": BUDGET_KIND, **new.to_record(),
                             "previous": None if old_raw is None else {
                                 k: old_raw.get(k) for k in ("epsilon", "delta", "accountant",
                                                             "unit_key", "seq")},
                             "set_by": "llmdp privacy ledger set-budget", "by": who(),
                             "reason": args.reason or ""})
    finally:
        db.close()
    was = "none" if old is None else old.describe()
    print(f"{args.dataset}: budget {new.describe()} (was: {was}); ε spent {spent:.4f} "
          f"({len(same)} release record(s)); recorded as record {rec['seq']}")
    return 0


def _who() -> str:
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"
