"""Budget arithmetic over ledger records: ε spent per privacy unit, holds, what fits.

Pure functions over the records of a dataset ledger (`llmdp.privacy.ledger.database`); the ledger
service (`llmdp.privacy.ledger.service`) calls them inside the transaction that records each hold
and each block, and reports and the CLI call them on records they read.

"ε spent" is per unit definition (`unit_key` of each record's ``meta.unit``). An (ε, δ)
guarantee is a statement about one adjacency: composing a sequence-level and a user-level
release gives a number that is a guarantee for neither (a user may own many sequences, so
the sequence-level ε says nothing per user without a group-privacy conversion). llmdp makes
no such conversion: only releases of the same unit definition are composed
(`split_by_unit`); releases for other units are listed beside the number as "not composed:
different privacy unit", never silently added or dropped.

A *budget belongs to the dataset* (`DatasetBudget`): a ``budget`` record in its ledger states
(ε, δ, accountant, privacy unit), set by ``llmdp privacy ledger set-budget`` or by the first
budgeted release, changed only by that command (a new record naming the old budget). Every
release on the dataset is checked against the budget in force (`recorded_budget`), whatever
the launching recipe says (`budget_refusal`, `recipe_mismatch`, `steps_fit`). A budgeted
dataset has one unit definition: a release for another unit is refused (its ε would not be
bounded by the budget's), and a budget cannot be set on a ledger that already holds releases
for another unit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from llmdp.config.choices import Accountant, Mechanism
from llmdp.privacy import accounting as _acc
from llmdp.privacy.accounting import event_from_json
from llmdp.privacy.ledger.records import is_step_release, net_records, release_entries

__all__ = ["NOT_COMPOSED", "unit_key", "split_by_unit", "release_entries_of", "unit_epsilon",
           "not_composed", "steps_within_budget", "live_holds", "hold_entries", "unused_hold_entries",
           "holder_alive",
           "budget_status", "BUDGET_KIND", "DatasetBudget", "recorded_budget", "budget_record",
           "budget_refusal", "recipe_mismatch", "budget_label", "check_release", "first_budget_record",
           "who", "steps_fit", "dataset_epsilon", "SET_BUDGET_CMD"]

# How a release for another privacy unit is listed next to a unit's "ε spent".
NOT_COMPOSED = "not composed: different privacy unit"
_UNKNOWN_UNIT = "not recorded"


def unit_key(unit) -> str:
    """The privacy unit *definition* of a ledger record, from its ``meta`` (or ``meta["unit"]``,
    or a unit key already): what "one unit" is, whatever its contribution bound.

    "document": one record; "user (records sharing 'f')": one value of user field f;
    "a sequence of L tokens (...)": one packed row, the description training stores. Two
    runs with different row caps per document still protect the same unit (one record);
    a document and a user, or sequences of different lengths, are different units.
    A record with no unit information gets "not recorded" (composed with nothing).
    """
    if isinstance(unit, str):
        return unit
    u = dict(unit or {})
    if "unit" in u and isinstance(u["unit"], dict):
        u = dict(u["unit"])
    kind = u.get("kind")
    if kind == "document":
        return "document"
    if kind == "user":
        return f"user (records sharing {u.get('user_field')!r})"
    if kind == "sequence":
        if u.get("sequence_length") is not None:
            how = ("attention masked at document boundaries" if u.get("document_masking")
                   else "packed across document boundaries")
            return f"a sequence of {int(u['sequence_length'])} tokens ({how})"
        return u.get("description") or "sequence (length not recorded)"
    return _UNKNOWN_UNIT


def _releases(records) -> list[dict]:
    """The release records, counts net of voids (`llmdp.privacy.ledger.records.net_records`)."""
    return [r for r in net_records(records) if r.get("kind") == "release" and r.get("count")]


def split_by_unit(records, unit) -> tuple[list[dict], list[dict]]:
    """(releases for ``unit``'s definition, releases for other units) among ledger
    ``records`` (`unit_key`; a record with no unit information is never composed)."""
    key = unit_key(unit)
    same, other = [], []
    for r in _releases(records):
        k = unit_key(r.get("meta"))
        (same if k == key and k != _UNKNOWN_UNIT else other).append(r)
    return same, other


def release_entries_of(records, where: str = "ledger") -> list:
    """``(event, count)`` of release records, consecutive identical events merged
    (`llmdp.privacy.ledger.records.release_entries`)."""
    return release_entries(enumerate(records, 1), where)


def unit_epsilon(records, unit, delta: float, accountant: str) -> float:
    """ε at δ of the releases in ``records`` made for ``unit``'s definition, thresholded
    releases (private tokenizers) included with their δ (`accountant.epsilon_with_threshold`)."""
    same, _ = split_by_unit(records, unit)
    return _acc.epsilon_with_threshold(release_entries_of(same), delta,
                                       _acc.threshold_delta(same), accountant)


def not_composed(records, unit) -> list[dict]:
    """The releases for other units than ``unit``, as listed beside its "ε spent"."""
    _, other = split_by_unit(records, unit)
    out: dict[tuple, dict] = {}  # one line per (run, unit, mechanism), counts summed
    for r in other:
        k = (r.get("run_id"), unit_key(r.get("meta")), (r.get("meta") or {}).get("mechanism", Mechanism.DP_SGD))
        row = out.setdefault(k, {"run_id": k[0], "unit": k[1], "mechanism": k[2], "count": 0,
                                 "status": NOT_COMPOSED})
        row["count"] += int(r["count"])
    return list(out.values())


def steps_within_budget(entries, event, budget: float, delta: float, accountant: str,
                        upper: int, delta_threshold: float = 0.0) -> int:
    """The largest k in [0, upper] with ε(entries + k × event) <= budget (dp-accounting;
    ``delta_threshold``: that of thresholded releases among ``entries``)."""
    def fits(k: int) -> bool:
        return _acc.epsilon_with_threshold(
            _merged(list(entries) + ([(event, k)] if k else [])), delta, delta_threshold,
            accountant) <= budget

    if upper <= 0 or fits(upper):  # one composition in the common case
        return max(0, upper)
    if not fits(0):
        return 0
    lo, hi = 0, upper  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------- holds
# A run with a budget *holds* the ε of its remaining planned steps from its start: a "hold"
# record (steps, event, unit, and the run's lock file), ended by "hold_end". Admitting a
# hold or a release checks  ε(releases + the unused part of every live hold + the new
# request) <= budget  in one transaction, so a second run cannot start on budget that the
# first will spend, and no set of concurrent runs ever crosses the budget. A hold whose run
# died (its lock file is free) is ended by the next transaction that meets it (a "hold_end"
# with ``hold_of``: the dead run's id, outside that run's records).


def live_holds(records) -> dict[str, dict]:
    """run_id -> {"hold": record, "used": steps released by that run since the hold,
    "evals_used": its DP evaluations since} for the holds not ended."""
    holds: dict[str, dict] = {}
    for r in net_records(records):  # steps reserved that never ran (voids) were not used
        rid = r.get("run_id")
        if r.get("kind") == "hold":
            holds[rid] = {"hold": r, "used": 0, "evals_used": 0}
        elif r.get("kind") == "hold_end":
            holds.pop(r.get("hold_of", rid), None)
        elif r.get("kind") == "release" and rid in holds:
            if is_step_release(r):
                holds[rid]["used"] += int(r.get("count") or 0)
            else:
                holds[rid]["evals_used"] += int(r.get("count") or 0)
    return holds


def unused_hold_entries(h: dict, steps: bool = True, evals: bool = True) -> list:
    """``(event, unused count)`` of one live hold: its steps, and its DP evaluations (a hold
    also covers the run's planned evaluations: ``eval_event`` × ``eval_releases``)."""
    rec = h["hold"]
    out = []
    unused = int(rec["steps"]) - h["used"]
    if steps and unused > 0:
        out.append((event_from_json(rec["event"]), unused))
    left = int(rec.get("eval_releases") or 0) - h.get("evals_used", 0)
    if evals and rec.get("eval_event") and left > 0:
        out.append((event_from_json(rec["eval_event"]), left))
    return out


def hold_entries(holds: dict[str, dict], unit, exclude: str | None = None) -> list:
    """``(event, unused count)`` of the live holds for ``unit``'s definition (except
    ``exclude``'s run): their unused steps and DP evaluations."""
    key = unit_key(unit)
    out = []
    for rid, h in holds.items():
        if rid == exclude or unit_key(h["hold"].get("meta")) != key:
            continue
        out += unused_hold_entries(h)
    return out


def holder_alive(lock: dict | None) -> bool:
    """Whether the run that wrote a hold still runs: its lock file is locked (by it). Not
    decidable (the file is on another machine's disk): alive."""
    import fcntl
    import socket

    if not lock or not lock.get("path"):
        return True
    path = lock["path"]
    if not os.path.exists(path):
        if lock.get("host") == socket.gethostname() and lock.get("pid"):
            return _pid_alive(int(lock["pid"]))
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # also releases a lock we just took
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_name_of_hold(hold: dict) -> str | None:
    """The ``output.name`` of the run that wrote a hold: its lock file is ``.<name>.lock``
    beside the run directory (None when the hold names no lock)."""
    path = (hold.get("lock") or {}).get("path")
    base = os.path.basename(path) if isinstance(path, str) else ""
    return base[1:-len(".lock")] if base.startswith(".") and base.endswith(".lock") else None


def budget_status(records, budget: float | None, delta: float, accountant: str, unit,
                  location: str | None = None, dataset_id: str | None = None) -> dict:
    """ε spent so far for ``unit``'s definition among a dataset ledger's ``records``, what
    remains of ``budget`` (a budget for that unit), what live runs hold of it, and the
    releases for other units, listed as not composed."""
    spent = unit_epsilon(records, unit, delta, accountant)
    same, _ = split_by_unit(records, unit)
    live = [{"run_id": rid, "steps_unused": int(h["hold"]["steps"]) - h["used"],
             **({"name": run_name_of_hold(h["hold"])} if run_name_of_hold(h["hold"]) else {})}
            for rid, h in live_holds(records).items()
            if unit_key(h["hold"].get("meta")) == unit_key(unit)]
    return {"ledger": location, "dataset_id": dataset_id, "unit": unit_key(unit),
            "epsilon_spent": spent, "budget_epsilon": budget,
            "epsilon_remaining": None if budget is None else max(0.0, budget - spent),
            "over_budget": budget is not None and spent > budget,
            "delta": delta, "accountant": accountant,
            "releases_composed": len(same), "not_composed": not_composed(records, unit),
            "live_holds": live,
            "held_steps": sum(max(0, h["steps_unused"]) for h in live),
            "composition": "releases for this privacy unit only: an ε for one unit definition "
                           "is no guarantee for another (no group-privacy conversion is made)"}


# ---------------------------------------------------------------------------- the dataset's budget
# A budget is a property of the dataset, recorded in its ledger (a "budget" record): the
# recipes that name the dataset do not set it, except the first budgeted release, which
# records its recipe's. Checking every release against the recorded budget, inside the
# transaction that records the release, is what makes the budget a bound on the dataset:
# a check against "the budget of the recipe at hand" lets a run with no budget, a larger
# one or another δ spend what another run's budget was meant to cap (issue 29, item 2).

BUDGET_KIND = "budget"
SET_BUDGET_CMD = "llmdp privacy ledger set-budget"


@dataclass(frozen=True)
class DatasetBudget:
    """A dataset's privacy budget: the composed ε at ``delta`` (by ``accountant``) of every
    release on the dataset for the privacy unit definition ``unit`` (a run's
    ``meta["unit"]``; compared by `unit_key`) may not exceed ``epsilon``."""

    epsilon: float
    delta: float
    accountant: str
    unit: dict = field(default_factory=dict)

    def __post_init__(self):
        if not (isinstance(self.epsilon, (int, float)) and math.isfinite(self.epsilon)
                and self.epsilon > 0):
            raise ValueError(f"a budget's ε must be a finite number > 0, got {self.epsilon!r}")
        if not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise ValueError(f"a budget's δ must be in (0, 1), got {self.delta!r}")
        if Accountant.get(self.accountant) is None:
            raise ValueError(f"a budget's accountant must be one of {list(Accountant)}, "
                             f"got {self.accountant!r}")
        if unit_key(self.unit) == _UNKNOWN_UNIT:
            raise ValueError(f"a budget needs a privacy unit definition (its 'kind'), got "
                             f"{self.unit!r}")

    @property
    def key(self) -> str:
        return unit_key(self.unit)

    def terms(self) -> str:
        return f"ε = {self.epsilon:g} at δ = {self.delta:.3g} ({self.accountant})"

    def describe(self) -> str:
        return f"{self.terms()} for the privacy unit {self.key!r}"

    def differences(self, other: DatasetBudget) -> list[str]:
        """Which of ε, δ, accountant differ (the unit is compared apart: `unit_key`)."""
        out = []
        if not math.isclose(self.epsilon, other.epsilon, rel_tol=1e-12, abs_tol=0.0):
            out.append("ε")
        if not math.isclose(self.delta, other.delta, rel_tol=1e-12, abs_tol=0.0):
            out.append("δ")
        if self.accountant != other.accountant:
            out.append("accountant")
        return out

    def to_record(self) -> dict:
        return {"epsilon": float(self.epsilon), "delta": float(self.delta),
                "accountant": self.accountant, "unit": dict(self.unit), "unit_key": self.key}

    @classmethod
    def from_record(cls, rec: dict) -> DatasetBudget:
        return cls(epsilon=float(rec["epsilon"]), delta=float(rec["delta"]),
                   accountant=rec["accountant"], unit=dict(rec.get("unit") or {}))


def budget_record(records) -> dict | None:
    """The ``budget`` record in force among a dataset ledger's records (the last one)."""
    last = None
    for r in records:
        if r.get("kind") == BUDGET_KIND:
            last = r
    return last


def recorded_budget(records) -> DatasetBudget | None:
    """The dataset's budget in force (None: the dataset has none)."""
    rec = budget_record(records)
    return None if rec is None else DatasetBudget.from_record(rec)


def budget_label(budget: DatasetBudget, recipe: DatasetBudget | None,
                 prefix: str = "privacy") -> str:
    """How a message names the budget it checked: the recipe's key when the recipe states
    this budget, else the dataset's recorded budget (and what the recipe says)."""
    if recipe is not None and not recipe.differences(budget):
        return f"{prefix}.budget_epsilon={budget.epsilon:g}"
    return (f"the dataset's budget ε = {budget.epsilon:g} (recorded in its ledger; "
            + (f"this recipe sets no {prefix}.budget_epsilon" if recipe is None else
               f"this recipe's {prefix}.budget_epsilon={recipe.epsilon:g} is not it") + ")")


def _ledger_name(dataset_id: str, where: str | None) -> str:
    return f"the dataset ledger {dataset_id!r}" + (f" ({where})" if where else "")


def _others(rows: list[dict]) -> str:
    shown = "; ".join(f"{x['run_id']}: {x['count']} {x['mechanism']} release(s) for {x['unit']!r}"
                      for x in rows[:3])
    return shown + (f"; and {len(rows) - 3} more" if len(rows) > 3 else "")


def budget_refusal(records, unit, *, recipe: DatasetBudget | None, dataset_id: str,
                   where: str | None = None) -> tuple[DatasetBudget | None, str | None]:
    """The budget a new release for ``unit`` on this dataset is checked against, and why it
    may not be made at all (None: it may, within that budget).

    The recorded budget, whatever ``recipe`` (the launching recipe's budget, or None) says;
    a release for another unit definition than the budget's is refused. With no recorded
    budget: ``recipe``'s (the caller records it with the release, in the same transaction),
    refused when the ledger holds releases for another unit (a budget for one unit cannot
    bound them); with neither: ``(None, None)``, no budget."""
    name = _ledger_name(dataset_id, where)
    key = unit_key(unit)
    rec = recorded_budget(records)
    if rec is not None:
        if key != rec.key:
            return rec, (
                f"{name} has a privacy budget for the privacy unit {rec.key!r} ({rec.terms()}), "
                f"and this release is for the privacy unit {key!r}: a budgeted dataset has one "
                f"privacy unit definition (an ε for one says nothing about another, and llmdp "
                f"makes no group-privacy conversion). Use the budget's unit (data.unit, "
                f"data.sequence_length, data.document_masking, data.user_field), or change the "
                f"budget's unit with `{SET_BUDGET_CMD} --dataset {dataset_id} --unit ...` "
                f"(possible only while the ledger holds no release for another unit)")
        return rec, None
    if recipe is None:
        return None, None
    other = not_composed(records, recipe.unit)
    if other:
        return recipe, (
            f"{name} holds releases for other privacy units than {recipe.key!r} "
            f"({_others(other)}); a budget for {recipe.key!r} would not bound them (an ε for one "
            f"unit definition says nothing about another, and llmdp makes no group-privacy "
            f"conversion), so this dataset cannot be given one. Train with the unit of the "
            f"earlier releases, or without privacy.budget_epsilon")
    return recipe, None


def recipe_mismatch(records, recipe: DatasetBudget | None, *, dataset_id: str,
                    where: str | None = None, prefix: str = "privacy") -> str | None:
    """Why a launch whose recipe states ``recipe`` is refused on a dataset whose recorded
    budget differs in ε, δ or accountant (None: no budget recorded, none stated, or the same).
    A recipe cannot change the dataset's budget; only `SET_BUDGET_CMD` can."""
    rec_raw = budget_record(records)
    if rec_raw is None or recipe is None:
        return None
    rec = DatasetBudget.from_record(rec_raw)
    diff = rec.differences(recipe)
    if not diff:
        return None
    return (
        f"{prefix}.budget_epsilon={recipe.epsilon:g} (at {prefix}.delta = {recipe.delta:.3g}, "
        f"{prefix}.accountant: {recipe.accountant}) is not the budget of "
        f"{_ledger_name(dataset_id, where)}: that is {rec.describe()}, recorded "
        f"{rec_raw.get('time')} by {rec_raw.get('by') or rec_raw.get('set_by')} (they differ in "
        f"{', '.join(diff)}). A budget belongs to the dataset, not to a recipe: state the "
        f"dataset's budget in the recipe ({prefix}.budget_epsilon: {rec.epsilon:g}, "
        f"{prefix}.delta: {rec.delta:.3g}, {prefix}.accountant: {rec.accountant}) or remove "
        f"{prefix}.budget_epsilon (the run is then checked against the dataset's budget), or "
        f"change the dataset's budget with `{SET_BUDGET_CMD} --dataset {dataset_id} --epsilon "
        f"{recipe.epsilon:g} --delta {recipe.delta:.3g} --accountant {recipe.accountant} "
        f"--reason ...` (recorded in the ledger)")


def _merged(entries) -> list:
    """``(event, count)`` entries with equal events summed (composition is commutative): the
    same releases give the same ε however they are grouped into records and holds."""
    out: list[list] = []
    for event, count in entries:
        for row in out:
            if row[0] == event:
                row[1] += int(count)
                break
        else:
            out.append([event, int(count)])
    return [(e, c) for e, c in out if c]


def dataset_epsilon(records, budget: DatasetBudget, *, exclude: str | None = None, extra=(),
                    extra_threshold: float = 0.0) -> float:
    """ε, at the budget's δ by its accountant, of every release on the dataset for the
    budget's unit + the unused part of every live hold for it (except ``exclude``'s) +
    ``extra``: what `steps_fit` compares with the budget (for messages)."""
    same, _ = split_by_unit(records, budget.unit)
    base = (release_entries_of(same) + hold_entries(live_holds(records), budget.unit, exclude)
            + list(extra))
    thr = 1.0 - (1.0 - _acc.threshold_delta(same)) * (1.0 - float(extra_threshold))
    return _acc.epsilon_with_threshold(_merged(base), budget.delta, thr, budget.accountant)


def steps_fit(records, budget: DatasetBudget, event, want: int, *, exclude: str | None = None,
              extra=(), extra_threshold: float = 0.0) -> int:
    """The largest k in [0, want] such that ε(every release on the dataset for the budget's
    unit + the unused part of every live hold for it, except ``exclude``'s + ``extra`` +
    k × ``event``) <= the budget, at the budget's δ by its accountant (thresholded releases
    with their δ; ``extra_threshold``: that of a thresholded ``event``)."""
    same, _ = split_by_unit(records, budget.unit)
    base = (release_entries_of(same) + hold_entries(live_holds(records), budget.unit, exclude)
            + list(extra))
    thr = 1.0 - (1.0 - _acc.threshold_delta(same)) * (1.0 - float(extra_threshold))
    return steps_within_budget(_merged(base), event, budget.epsilon, budget.delta,
                               budget.accountant, want, thr)


def who() -> str:
    """user@host, recorded with what a person (or a run) set: a budget, a repair."""
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


def first_budget_record(budget: DatasetBudget, set_by: str) -> dict:
    """The ``budget`` record the first budgeted release on a dataset writes, in its own
    transaction (its recipe's budget). Not a record of any run (``run_id`` None)."""
    return {"kind": BUDGET_KIND, **budget.to_record(), "previous": None, "set_by": set_by,
            "by": who(), "reason": "", "run_id": None}


def check_release(records, unit, event, *, recipe: DatasetBudget | None, dataset_id: str,
                  where: str | None = None, extra_threshold: float = 0.0,
                  what: str = "this release") -> tuple[DatasetBudget | None, str | None]:
    """One release (``event``, once) for ``unit`` on a dataset, checked as every release is:
    the recipe's stated budget against the recorded one (`recipe_mismatch`), the unit
    (`budget_refusal`), and ε(releases + live holds + it) <= the budget (`steps_fit`).
    Returns (the budget to record with it: the recipe's when the dataset has none yet, else
    None; why it is refused, or None)."""
    why = recipe_mismatch(records, recipe, dataset_id=dataset_id, where=where)
    budget, refused = budget_refusal(records, unit, recipe=recipe, dataset_id=dataset_id, where=where)
    if why or refused:
        return None, why or refused
    if budget is None:
        return None, None
    if steps_fit(records, budget, event, 1, extra_threshold=extra_threshold) < 1:
        spent = unit_epsilon(records, budget.unit, budget.delta, budget.accountant)
        after = dataset_epsilon(records, budget, extra=[(event, 1)], extra_threshold=extra_threshold)
        return None, (
            f"{budget_label(budget, recipe)}: {_ledger_name(dataset_id, where)} has spent ε = "
            f"{spent:.4f} at δ = {budget.delta:.3g}; with what live runs hold and {what} it would "
            f"be {after:.4f}. Lower privacy.target_epsilon or raise the dataset's budget "
            f"(`{SET_BUDGET_CMD} --dataset {dataset_id} --epsilon ...`, recorded)")
    return (budget if budget_record(records) is None else None), None
