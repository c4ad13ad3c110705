"""A budget belongs to the dataset (issue 29, items 2 and 7).

Item 2: run A holds 600 steps under ``budget_epsilon: 2.0`` at δ = 1e-5; a concurrent run B
with no budget, with budget 5.0, or with budget 2.0 at δ = 1e-2 used to release 1,500 more
steps (the dataset ended at ε = 2.9355), because each release was checked against the
budget of the recipe at hand, if any. Here A and B are two real OS processes, each with its
own `LedgerService` and database connection on one SQLite ledger; B is refused at launch
and stopped when it releases anyway, A completes its 600 steps, and the ledger's ε, composed
by dp-accounting directly from its records, never exceeds 2.0. A's blocks inside its own
hold are checked against the dataset's total too: after another process imports an earlier
ledger's 1,500 steps, A stops instead of releasing "inside its hold".

Item 7: a budgeted dataset has one privacy unit definition; runs for a user, a document, a
sequence of 128 and of 127 tokens each used to hold and release 600 steps under the same
budget (each unit key at ε 1.75). The second unit is now refused, naming both units; an
unbudgeted dataset still takes all four.

Processes come from multiprocessing's "forkserver" context (as in test_ledger_stress.py):
fresh processes that imported llmdp once, no inherited connection or lock.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import dp_accounting
import pytest

from llmdp.data.units import UnitSpec
from llmdp.privacy.accounting.accountant import RDP_ORDERS
from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.budget import unit_key
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.service import BudgetError, LedgerService
from tests.helpers import Command, forkserver

Q, SIGMA, DELTA, BUDGET = 0.01, 1.0, 1e-5, 2.0
A_STEPS, B_STEPS, BLOCK = 600, 1500, 100
EVJ = event_to_json(dpsgd_step_event(Q, SIGMA))
DS = "notes"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WAIT_S = 240  # a process still waiting then is stuck: the test fails


def meta(**unit) -> dict:
    """A run's ledger meta as `trainer.prepare` writes it (the unit's dict and description)."""
    spec = UnitSpec(**unit)
    return {"unit": {**spec.to_dict(), "description": spec.describe()}, "mechanism": "dp-sgd"}


DOC = meta(kind="document", max_rows_per_unit=2, sequence_length=128)


def rdp_epsilon(records, delta=DELTA) -> float:
    """ε at ``delta`` of a ledger's releases, composed by dp-accounting's RdpAccountant from
    the records' event fields (no llmdp code between the ledger and the accountant)."""
    acc = dp_accounting.rdp.RdpAccountant(
        orders=list(RDP_ORDERS), neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for r in records:
        if r["kind"] == "release":
            ev = r["event"]
            assert ev["class_name"] == "PoissonSampledDpEvent"
            inner = ev["event"]
            assert inner["class_name"] == "GaussianDpEvent"
            acc.compose(dp_accounting.PoissonSampledDpEvent(
                ev["sampling_probability"], dp_accounting.GaussianDpEvent(inner["noise_multiplier"])),
                int(r["count"]))
    return float(acc.get_epsilon(delta))


def service(location, run_id, *, total, budget=None, delta=DELTA, run_meta=DOC, root=None):
    root = root or os.path.dirname(location)
    return LedgerService(
        location=location, dataset_id=DS, run_ledger=os.path.join(root, run_id, "ledger.jsonl"),
        run_id=run_id, meta=run_meta, block_size=BLOCK, total_steps=total, event_json=EVJ,
        delta=delta, accountant="rdp", budget_epsilon=budget)


def release_all(svc, total: int, out: dict, pause_at=None, pause=None) -> None:
    """Admit and reserve every step until one is refused (what a run's worker loop does)."""
    svc.start_attempt()
    out.setdefault("steps", 0)
    for step in range(total):
        if pause_at is not None and step == pause_at:
            pause()
        ok, message = svc.admit(step)
        if not ok:
            out["stopped_at"], out["message"] = step, message
            return
        svc.ensure(step)
        out["steps"] += 1


def _run_a(location: str, held, b_done, result: str) -> None:
    """Run A: holds its 600 steps under budget 2.0 at δ = 1e-5, releases half, waits for B
    to have tried everything, releases the rest."""
    out: dict = {"error": None}
    try:
        svc = service(location, "a", total=A_STEPS, budget=BUDGET)
        out["held"] = svc.hold(A_STEPS)["held"]
        held.set()
        release_all(svc, A_STEPS, out, pause_at=A_STEPS // 2,
                    pause=lambda: out.__setitem__("b_finished", b_done.wait(WAIT_S)))
        svc.end("run ended")
        svc.db.close()
    except BaseException:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    finally:
        held.set()
    Path(result).write_text(json.dumps(out))


def _run_b(location: str, budget, delta: float, held, b_done, result: str) -> None:
    """Run B, launched while A holds: its launch (`hold`, what `trainer.check_budget` does),
    then releases regardless (what a run whose launch skipped the check, as a run without a
    budget did, would release)."""
    out: dict = {"error": None, "refused": None}
    try:
        assert held.wait(WAIT_S), "A never held"
        svc = service(location, "b", total=B_STEPS, budget=budget, delta=delta)
        try:
            st = svc.hold(B_STEPS)
            out["hold"] = {"held": st["held"], "fit": st["fit"], "label": st.get("budget_label")}
        except BudgetError as e:
            out["refused"] = str(e)
        release_all(svc, B_STEPS, out)
        svc.end("run ended")
        svc.db.close()
    except BaseException:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    finally:
        b_done.set()
    Path(result).write_text(json.dumps(out))


def _two_processes(location: str, tmp_path: Path, b_budget, b_delta) -> tuple[dict, dict]:
    ctx = forkserver()  # this module and llmdp imported once, in the server
    held, b_done = ctx.Event(), ctx.Event()
    res = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [ctx.Process(target=_run_a, args=(location, held, b_done, str(res[0])), daemon=True),
             ctx.Process(target=_run_b, args=(location, b_budget, b_delta, held, b_done, str(res[1])),
                         daemon=True)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(WAIT_S)
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join()
    assert not stuck, "a process was stuck"
    a, b = (json.loads(r.read_text()) for r in res)
    assert a["error"] is None, a["error"]
    assert b["error"] is None, b["error"]
    return a, b


@pytest.mark.parametrize("b_budget, b_delta", [(None, DELTA), (5.0, DELTA), (2.0, 1e-2)],
                         ids=["no-budget", "budget-5", "budget-2-at-delta-1e-2"])
def test_a_concurrent_run_cannot_overspend_another_runs_budget(tmp_path, b_budget, b_delta):
    location = str(tmp_path / "ledger.sqlite")
    a, b = _two_processes(location, tmp_path, b_budget, b_delta)
    records = LedgerDB(location).records(DS)
    # The dataset never exceeds its budget (dp-accounting on the ledger's events).
    eps = rdp_epsilon(records)
    b_steps = sum(r["count"] for r in records if r["kind"] == "release" and r["run_id"] == "b")
    assert eps <= BUDGET, f"the dataset is at ε = {eps:.4f} after B's {b_steps} steps"
    # A held and completed its plan: B never took what A holds.
    assert a["held"] == A_STEPS and a["steps"] == A_STEPS and a["b_finished"], a
    # B: refused at launch, naming the dataset's budget; what it then released fit beside A's
    # hold (each block checked against the dataset's budget) and it was stopped.
    if b_budget is None:
        assert b["hold"]["held"] == 0 and b["hold"]["fit"] < B_STEPS, b
        assert "this recipe sets no privacy.budget_epsilon" in b["hold"]["label"]
    else:
        msg = b["refused"]
        assert msg and f"privacy.budget_epsilon={b_budget:g} (at privacy.delta = {b_delta:.3g}" in msg
        assert f"ε = {BUDGET:g} at δ = {DELTA:.3g} (rdp)" in msg  # the recorded one, named
        assert "llmdp privacy ledger set-budget --dataset notes" in msg
        assert ("differ in ε" in msg) if b_budget != BUDGET else ("differ in δ" in msg)
    assert b["steps"] < B_STEPS and b["stopped_at"] == b["steps"], b
    assert "reached on the dataset ledger 'notes'" in b["message"], b["message"]
    assert b_steps == b["steps"]
    # Not a step more would have fit: the budget binds (dp-accounting again).
    more = records + [{"kind": "release", "event": json.loads(json.dumps(EVJ)), "count": 1}]
    assert rdp_epsilon(more) > BUDGET
    # One budget record: set by A's launch, not by any of B's recipes.
    budgets = [r for r in records if r["kind"] == "budget"]
    assert len(budgets) == 1 and budgets[0]["epsilon"] == BUDGET and budgets[0]["delta"] == DELTA
    assert "run a" in budgets[0]["set_by"] and budgets[0]["unit_key"] == "document"


def _legacy_ledger(path: Path, steps: int) -> Path:
    path.write_text(json.dumps({"kind": "release", "event": EVJ, "count": steps, "run_id": "old",
                                "attempt": "1", "meta": DOC}) + "\n")
    return path


def test_releases_inside_a_runs_own_hold_are_checked_against_the_dataset(tmp_path):
    """A's hold was granted; then another process records 1,500 earlier steps on the dataset
    (an earlier llmdp's ledger, imported: a fact, recorded unchecked). A's next block, inside
    its hold, is checked against the dataset's total and refused: A stops."""
    location = str(tmp_path / "ledger.sqlite")
    a = service(location, "a", total=A_STEPS, budget=BUDGET, root=str(tmp_path))
    assert a.hold(A_STEPS)["held"] == A_STEPS
    out: dict = {}
    release_all(a, 2 * BLOCK, out)
    assert out["steps"] == 2 * BLOCK
    legacy = _legacy_ledger(tmp_path / "old.jsonl", B_STEPS)
    cmd = Command(["privacy", "ledger", "import", str(legacy), "--dataset", DS, "--ledger", location],
                  cwd=REPO, log=tmp_path / "import.log")  # `llmdp`, forked from the forkserver
    assert cmd.wait(timeout=WAIT_S) == 0, cmd.output()
    ok, why = a.admit(2 * BLOCK)  # step 200 of 600: inside A's hold
    assert not ok
    assert "privacy.budget_epsilon=2 reached on the dataset ledger 'notes'" in why, why
    assert "before step 201 of 600" in why
    with pytest.raises(BudgetError):
        a.ensure(2 * BLOCK)
    records = LedgerDB(location).records(DS)
    assert sum(r["count"] for r in records if r["kind"] == "release" and r["run_id"] == "a") == 2 * BLOCK
    # What A released is within the budget by itself; the import took the dataset past it.
    assert rdp_epsilon([r for r in records if r.get("run_id") == "a"]) <= BUDGET < rdp_epsilon(records)


# ------------------------------------------------------------------ item 7: one unit per budget

UNITS = {
    "user": meta(kind="user", user_field="user_id", max_rows_per_unit=4, sequence_length=128),
    "document": DOC,
    "sequence 128": meta(kind="sequence", sequence_length=128),
    "sequence 127": meta(kind="sequence", sequence_length=127),
}


def test_a_budgeted_dataset_has_one_privacy_unit(tmp_path):
    location = str(tmp_path / "ledger.sqlite")
    keys = [unit_key(m) for m in UNITS.values()]
    assert len(set(keys)) == 4
    first, *others = UNITS
    a = service(location, first, total=A_STEPS, budget=BUDGET, run_meta=UNITS[first])
    assert a.hold(A_STEPS)["held"] == A_STEPS
    out: dict = {}
    release_all(a, A_STEPS, out)
    a.end()
    assert out["steps"] == A_STEPS
    before = LedgerDB(location).records(DS)
    assert rdp_epsilon(before) == pytest.approx(1.7477, abs=1e-4)  # the 1.75
    for name in others:
        for budget in (BUDGET, None):  # with the dataset's budget stated, or none
            s = service(location, f"{name}-{budget}", total=A_STEPS, budget=budget,
                        run_meta=UNITS[name])
            with pytest.raises(BudgetError) as e:
                s.hold(A_STEPS)
            msg = str(e.value)
            assert f"a privacy budget for the privacy unit {unit_key(UNITS[first])!r}" in msg, msg
            assert f"this release is for the privacy unit {unit_key(UNITS[name])!r}" in msg, msg
            assert "one privacy unit definition" in msg
            # Released anyway (a launch that skipped the check): refused, stopped at once.
            stop: dict = {}
            release_all(s, A_STEPS, stop)
            assert stop["steps"] == 0 and unit_key(UNITS[name]) in stop["message"]
    assert LedgerDB(location).records(DS) == before


def test_an_unbudgeted_dataset_takes_every_unit(tmp_path):
    location = str(tmp_path / "ledger.sqlite")
    for name, m in UNITS.items():
        s = service(location, name, total=2 * BLOCK, run_meta=m)
        assert s.hold(2 * BLOCK)["held"] == 0  # nothing to hold: no budget
        out: dict = {}
        release_all(s, 2 * BLOCK, out)
        assert out["steps"] == 2 * BLOCK
    records = LedgerDB(location).records(DS)
    assert {unit_key(r["meta"]) for r in records if r["kind"] == "release"} == set(
        unit_key(m) for m in UNITS.values())
    # ... and a budget can no longer be set on it: no unit's budget would bound the others.
    s = service(location, "late", total=BLOCK, budget=100.0, run_meta=UNITS["user"])
    with pytest.raises(BudgetError, match="holds releases for other privacy units"):
        s.hold(BLOCK)
