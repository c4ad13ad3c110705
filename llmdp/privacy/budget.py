"""Budget arithmetic over ledger records: ε spent per privacy unit, holds, what fits.

Pure functions over the records of a dataset ledger (`llmdp.privacy.ledgerdb`); the ledger
service (`llmdp.privacy.service`) calls them inside the transaction that records each hold
and each block, and reports and the CLI call them on records they read.

Budgets and "ε spent" are per unit definition (`unit_key` of each record's ``meta.unit``).
An (ε, δ) guarantee is a statement about one adjacency: composing a sequence-level and a
user-level release gives a number that is a guarantee for neither (a user may own many
sequences, so the sequence-level ε says nothing per user without a group-privacy
conversion). llmdp makes no such conversion: only releases of the same unit definition
are composed (`split_by_unit`); releases for other units are listed beside the number as
"not composed: different privacy unit", never silently added or dropped.
"""

from __future__ import annotations

import os

from llmdp.privacy import accountant as _acc
from llmdp.privacy.events import event_from_json
from llmdp.privacy.ledger import is_step_release, release_entries

__all__ = ["NOT_COMPOSED", "unit_key", "split_by_unit", "release_entries_of", "unit_epsilon",
           "not_composed", "steps_within_budget", "live_holds", "hold_entries", "unused_hold_entries",
           "holder_alive",
           "budget_status"]

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


def steps_within_budget(entries, event, budget: float, delta: float, accountant: str,
                        upper: int, delta_threshold: float = 0.0) -> int:
    """The largest k in [0, upper] with ε(entries + k × event) <= budget (dp-accounting;
    ``delta_threshold``: that of thresholded releases among ``entries``)."""
    def fits(k: int) -> bool:
        return _acc.epsilon_with_threshold(
            list(entries) + ([(event, k)] if k else []), delta, delta_threshold, accountant) <= budget

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
    for r in records:
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


def unused_hold_entries(h: dict) -> list:
    """``(event, unused count)`` of one live hold: its steps, and its DP evaluations (a hold
    also covers the run's planned evaluations: ``eval_event`` × ``eval_releases``)."""
    rec = h["hold"]
    out = []
    unused = int(rec["steps"]) - h["used"]
    if unused > 0:
        out.append((event_from_json(rec["event"]), unused))
    evals = int(rec.get("eval_releases") or 0) - h.get("evals_used", 0)
    if rec.get("eval_event") and evals > 0:
        out.append((event_from_json(rec["eval_event"]), evals))
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


def budget_status(records, budget: float | None, delta: float, accountant: str, unit,
                  location: str | None = None, dataset_id: str | None = None) -> dict:
    """ε spent so far for ``unit``'s definition among a dataset ledger's ``records``, what
    remains of ``budget`` (a budget for that unit), what live runs hold of it, and the
    releases for other units, listed as not composed."""
    spent = unit_epsilon(records, unit, delta, accountant)
    same, _ = split_by_unit(records, unit)
    live = [{"run_id": rid, "steps_unused": int(h["hold"]["steps"]) - h["used"]}
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
