"""The ledger service: the single writer of a run's DP releases, and the budget keeper.

One ledger per *dataset* (``privacy.ledger``; default ``<cache>/ledgers/<source sha>.jsonl``)
records every release made on that data: every run, every attempt, private tokenizers.
The run directory keeps its own ``ledger.jsonl`` with this run's releases only (what the
run's report composes). A :class:`LedgerService` writes both, write-ahead (DESIGN §3.5):
rank 0 asks it to :meth:`admit` a step before the step starts and to :meth:`ensure` it
before the update is applied; no other process writes.

Under Ray it runs as a named actor on the driver's node (``ray.remote(LedgerService)``),
so every attempt of every worker group records through the same writer; its state is the
files, so a new driver (a re-launch) picks up exactly where the ledger stands.

Budget (``privacy.budget_epsilon``): the composed ε (at the plan's δ) of the dataset
ledger's releases *for this run's privacy unit* may not exceed it.

Budgets and "ε spent" are per unit definition (`unit_key` of each record's ``meta.unit``).
An (ε, δ) guarantee is a statement about one adjacency: composing a sequence-level and a
user-level release gives a number that is a guarantee for neither (a user may own many
sequences, so the sequence-level ε says nothing per user without a group-privacy
conversion). llmdp makes no such conversion: only releases of the same unit definition
are composed (`split_by_unit`); releases for other units are listed beside the number as
"not composed: different privacy unit", never silently added or dropped. These are pure
functions over ledger records, so they carry over to any other ledger store. At start the service computes how many more steps of
this run's event fit (a binary search over dp-accounting compositions); a step beyond
that is not admitted, and the run stops cleanly before it. Blocks of the write-ahead
reservation are shortened so that a reservation never crosses the budget either.
"""

from __future__ import annotations

import os
import time

from llmdp.privacy import accountant as _acc
from llmdp.privacy.events import event_from_json
from llmdp.privacy.ledger import Ledger, LedgerWriter, release_entries

__all__ = ["BudgetError", "LedgerService", "steps_within_budget", "budget_status", "ledger_epsilon",
           "unit_key", "split_by_unit", "release_entries_of", "unit_epsilon", "NOT_COMPOSED"]

# How a release for another privacy unit is listed next to a unit's "ε spent".
NOT_COMPOSED = "not composed: different privacy unit"
_UNKNOWN_UNIT = "not recorded"


class BudgetError(RuntimeError):
    """The dataset's privacy budget does not allow what was asked."""


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
    return [r for r in records if r.get("kind") == "release" and r.get("count")]


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
    (`llmdp.privacy.ledger.release_entries`)."""
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
        k = (r.get("run_id"), unit_key(r.get("meta")), (r.get("meta") or {}).get("mechanism", "dp-sgd"))
        row = out.setdefault(k, {"run_id": k[0], "unit": k[1], "mechanism": k[2], "count": 0,
                                 "status": NOT_COMPOSED})
        row["count"] += int(r["count"])
    return list(out.values())


def _records(path: str) -> list[dict]:
    return Ledger(path).records() if os.path.exists(path) else []


def ledger_epsilon(path: str, delta: float, accountant: str, unit) -> float:
    """ε at δ of the releases for ``unit``'s definition in the ledger at ``path`` (`unit_epsilon`)."""
    return unit_epsilon(_records(path), unit, delta, accountant)


def steps_within_budget(entries, event, budget: float, delta: float, accountant: str,
                        upper: int, delta_threshold: float = 0.0) -> int:
    """The largest k in [0, upper] with ε(entries + k × event) <= budget (dp-accounting;
    ``delta_threshold``: that of thresholded releases among ``entries``)."""
    def fits(k: int) -> bool:
        return _acc.epsilon_with_threshold(
            list(entries) + ([(event, k)] if k else []), delta, delta_threshold, accountant) <= budget

    if not fits(0):
        return 0
    if fits(upper):
        return upper
    lo, hi = 0, upper  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def budget_status(path: str, budget: float | None, delta: float, accountant: str, unit) -> dict:
    """ε spent so far for ``unit``'s definition in the dataset ledger at ``path``, what
    remains of ``budget`` (a budget for that unit), and the releases for other units,
    listed as not composed."""
    records = _records(path)
    spent = unit_epsilon(records, unit, delta, accountant)
    same, _ = split_by_unit(records, unit)
    return {"ledger": path, "unit": unit_key(unit), "epsilon_spent": spent, "budget_epsilon": budget,
            "epsilon_remaining": None if budget is None else max(0.0, budget - spent),
            "delta": delta, "accountant": accountant,
            "releases_composed": len(same), "not_composed": not_composed(records, unit),
            "composition": "releases for this privacy unit only: an ε for one unit definition "
                           "is no guarantee for another (no group-privacy conversion is made)"}


class LedgerService:
    """Single writer of one run's releases to the dataset ledger and the run ledger.

    ``admit(step)`` -> ``(ok, message)``: whether global step ``step`` may run (False once
    the budget would be crossed). ``ensure(step)``: the step's event is durable in both
    ledgers (a new block is reserved when needed). ``start_attempt()`` after every
    (re)start of the worker group: new writers, so re-executed steps are counted again.
    """

    def __init__(self, *, dataset_ledger: str, run_ledger: str, run_id: str, meta: dict,
                 block_size: int, total_steps: int, event_json: dict, delta: float,
                 accountant: str, budget_epsilon: float | None = None,
                 allowance: int | None = None):
        self.dataset_ledger = os.path.abspath(dataset_ledger)
        self.run_ledger = os.path.abspath(run_ledger)
        self.run_id, self.meta = run_id, dict(meta)
        self.block_size, self.total_steps = int(block_size), int(total_steps)
        self.event = event_from_json(event_json)
        self.delta, self.accountant, self.budget = float(delta), accountant, budget_epsilon
        self._writers: tuple[LedgerWriter, LedgerWriter] | None = None
        # Steps (ledger counts) the budget still allows; the driver passes the number its
        # start-up check just computed, so the search runs once per launch.
        self._allowance: int | None = allowance if budget_epsilon is not None else None
        if budget_epsilon is not None and unit_key(self.meta) == _UNKNOWN_UNIT:
            raise ValueError(
                f"privacy.budget_epsilon={budget_epsilon:g} needs the run's privacy unit in the ledger "
                f"meta (meta['unit'] with its 'kind'), got meta={self.meta!r}: a budget is per unit "
                f"definition")
        self._reserved: list[tuple[int, int]] = []  # this attempt's blocks [start, end)
        self.attempts = 0

    # ------------------------------------------------------------------ budget
    def allowance(self) -> int | None:
        """Ledger counts of this run's event that still fit in the budget (None: no budget)."""
        if self.budget is None:
            return None
        if self._allowance is None:
            same, _ = split_by_unit(_records(self.dataset_ledger), self.meta)
            self._allowance = steps_within_budget(
                release_entries_of(same), self.event, self.budget, self.delta,
                self.accountant, self.total_steps, _acc.threshold_delta(same))
        return self._allowance

    def status(self) -> dict:
        return budget_status(self.dataset_ledger, self.budget, self.delta, self.accountant, self.meta)

    # ------------------------------------------------------------------ writing
    def position(self) -> dict:
        """Where the ledgers stand (stored in every checkpoint): steps recorded for this run,
        the end of this attempt's last reserved block, and the dataset ledger's total."""
        return {
            "attempt": self._writers[0].attempt if self._writers else None,
            "reserved_until": max((b for _, b in self._reserved), default=0),
            "run_steps_recorded": Ledger(self.run_ledger).total_count() if os.path.exists(self.run_ledger) else 0,
            "dataset_steps_recorded": (Ledger(self.dataset_ledger).total_count()
                                       if os.path.exists(self.dataset_ledger) else 0),
        }

    def start_attempt(self) -> str:
        attempt = f"{int(time.time())}-{os.getpid()}-{self.attempts}"
        self.attempts += 1
        self._writers = tuple(
            LedgerWriter(path, run_id=self.run_id, attempt=attempt, meta=self.meta,
                         block_size=self.block_size, total_steps=self.total_steps)
            for path in (self.dataset_ledger, self.run_ledger))
        self._reserved = []
        return attempt

    def _block(self, step: int) -> int:
        """Length of the block a new reservation at ``step`` would take (0: none fits)."""
        count = min(self.block_size, self.total_steps - step)
        allowed = self.allowance()
        return count if allowed is None else min(count, allowed)

    def admit(self, step: int) -> tuple[bool, str]:
        if any(a <= step < b for a, b in self._reserved):
            return True, ""
        if self._block(step) >= 1:
            return True, ""
        st = self.status()
        return False, (
            f"privacy.budget_epsilon={self.budget:g} reached on the dataset ledger {self.dataset_ledger}: "
            f"ε spent = {st['epsilon_spent']:.4f} at δ = {self.delta:.3g} for the privacy unit "
            f"{st['unit']!r}; one more step of this run "
            f"would cross it. The run stopped before step {step + 1} of {self.total_steps} and saved "
            f"its state; raise privacy.budget_epsilon or train on data with budget left"
        )

    def ensure(self, step: int) -> bool:
        """Write-ahead: ``step`` durable in both ledgers before its update is applied."""
        if self._writers is None:
            self.start_attempt()
        if any(a <= step < b for a, b in self._reserved):
            return False
        count = self._block(step)
        if count < 1:
            raise RuntimeError(f"step {step} was not admitted: the privacy budget is spent")
        for w in self._writers:
            # One reservation of `count` steps in each ledger: dataset ledger first, so a
            # crash in between over-counts the budget rather than under-counts it.
            w.append(self.event, count, first_step=step)
        self._reserved.append((step, step + count))
        if self._allowance is not None:
            self._allowance -= count
        return True
