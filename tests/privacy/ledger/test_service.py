"""The ledger service: the single writer of a run's releases (dataset ledger and ledger.jsonl),
and the budget keeper: largest number of steps that fits, per privacy unit, holds of
concurrent runs, and the target after failures. Every ε is checked against dp-accounting
called directly."""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import subprocess

import dp_accounting
import pytest

from llmdp.privacy.accounting.accountant import RDP_ORDERS
from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.budget import NOT_COMPOSED, budget_status, steps_within_budget, unit_key
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.records import (
    Ledger,
    LedgerError,
    check_record,
    net_records,
    release_entries,
    step_count,
)
from llmdp.privacy.ledger.service import BudgetError, LedgerService, cross_check

Q, SIGMA, DELTA = 0.01, 1.0, 1e-5
EV = dpsgd_step_event(Q, SIGMA)  # a DP-SGD step
# The budget logic is the same for any event; a Gaussian's ε is computed in milliseconds
# (a subsampled Gaussian's takes ~0.3 s), which keeps the searches below fast.
G = dp_accounting.GaussianDpEvent(20.0)
DS = "ds-1"

SEQ = {"kind": "sequence", "sequence_length": 24, "max_rows_per_unit": 1, "document_masking": False,
       "user_field": None, "description": "a sequence of 24 tokens (packed across document boundaries)"}
USER = {"kind": "user", "sequence_length": 24, "max_rows_per_unit": 2, "document_masking": False,
        "user_field": "user_id", "description": "a user: all records sharing 'user_id'"}


def direct_eps(count_by_event, accountant="pld", delta=DELTA):
    """ε of the composition, from dp-accounting directly (llmdp's RDP orders)."""
    if accountant == "pld":
        acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    else:
        acc = dp_accounting.rdp.RdpAccountant(
            orders=RDP_ORDERS, neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for event, count in count_by_event:
        acc.compose(event, count)
    return acc.get_epsilon(delta)


def location(tmp_path) -> str:
    return str(tmp_path / "ledger.sqlite")


def service(tmp_path, *, name="run", budget=None, total=20, block=4, unit=SEQ, event=G,
            accountant="rdp", **kw) -> LedgerService:
    return LedgerService(
        location=location(tmp_path), dataset_id=DS, run_ledger=str(tmp_path / name / "ledger.jsonl"),
        run_id=name, meta={"unit": unit, "mechanism": "dp-sgd"}, block_size=block, total_steps=total,
        event_json=event_to_json(event), delta=DELTA, accountant=accountant, budget_epsilon=budget,
        **kw)


def records(tmp_path) -> list[dict]:
    return LedgerDB(location(tmp_path)).records(DS)


def release(tmp_path, event, count, run_id, unit, extra=None) -> dict:
    """A release recorded in the dataset ledger by another writer (an earlier run, a
    private tokenizer)."""
    rec = {"kind": "release", "event": event_to_json(event), "count": count, "first_step": 0,
           "run_id": run_id, "attempt": "1", "meta": {"unit": unit, "mechanism": "dp-sgd"}}
    if extra is not None:
        rec["extra"] = extra
    return LedgerDB(location(tmp_path)).append(DS, rec)


def run_steps(svc, steps) -> list[int]:
    """Admit and reserve ``steps`` until one is refused; the steps admitted."""
    done = []
    for step in steps:
        ok, _ = svc.admit(step)
        if not ok:
            break
        svc.ensure(step)
        done.append(step)
    return done


# ------------------------------------------------------------------ the largest k that fits

@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_steps_within_budget_is_the_largest_that_fits(acc):
    prior = [(dpsgd_step_event(0.02, 0.8), 30)] if acc == "rdp" else [(G, 30)]
    k_true = 57 if acc == "rdp" else 9  # PLD evaluations are slower: a short search
    upper = 80 if acc == "rdp" else 12
    budget = direct_eps(prior + [(EV, k_true)], acc) * (1 + 1e-9)
    k = steps_within_budget(prior, EV, budget, DELTA, acc, upper=upper)
    assert direct_eps(prior + [(EV, k)], acc) <= budget < direct_eps(prior + [(EV, k + 1)], acc)
    assert k == k_true
    if acc == "rdp":
        assert steps_within_budget(prior, EV, direct_eps(prior, acc) * 0.99, DELTA, acc, upper) == 0
        assert steps_within_budget(prior, EV, 1e9, DELTA, acc, upper) == upper
        assert steps_within_budget(prior, EV, 1e9, DELTA, acc, 0) == 0


# ------------------------------------------------------------------ the budget

def test_budget_shortens_the_last_block_and_refuses_the_crossing_step(tmp_path):
    # Another run spent 7 steps on this dataset; the budget fits 10 more of ours.
    other = service(tmp_path, name="other", total=7, block=7)
    other.start_attempt()
    other.ensure(0)
    budget = direct_eps([(G, 17)], "rdp") * (1 + 1e-9)
    s = service(tmp_path, budget=budget)
    st = s.hold(20, need=1)  # a resumed run: as many as fit
    assert (st["held"], st["fit"]) == (10, 10)
    assert st["epsilon_spent"] == pytest.approx(direct_eps([(G, 7)], "rdp"), rel=1e-9)
    s.start_attempt()
    admitted = []
    for step in range(20):
        ok, why = s.admit(step)
        if not ok:
            assert "privacy.budget_epsilon=" in why and f"before step {step + 1} of 20" in why
            assert f"ε spent = {direct_eps([(G, 17)], 'rdp'):.4f}" in why
            assert "for the privacy unit 'a sequence of 24 tokens" in why
            break
        s.ensure(step)
        admitted.append(step)
    assert admitted == list(range(10))
    recs = Ledger(tmp_path / "run" / "ledger.jsonl").records()
    releases = [(r["first_step"], r["count"]) for r in recs if r["kind"] == "release"]
    assert releases == [(0, 4), (4, 4), (8, 2)]  # the last block cut at 10
    assert recs[0]["kind"] == "hold" and recs[0]["steps"] == 10
    assert direct_eps([(G, 17)], "rdp") <= budget
    assert s.status()["epsilon_spent"] == pytest.approx(direct_eps([(G, 17)], "rdp"), rel=1e-9)
    with pytest.raises(BudgetError, match="privacy.budget_epsilon="):
        s.ensure(10)
    # A new run whose whole plan does not fit is refused before it starts: nothing held.
    st = service(tmp_path, name="late", budget=budget, total=5).hold(5)
    assert (st["held"], st["fit"]) == (0, 0)
    assert not [r for r in records(tmp_path) if r.get("run_id") == "late"]


def test_budget_counts_a_private_tokenizer_release_with_its_threshold_delta(tmp_path):
    """A thresholded release (private tokenizer) in the dataset ledger: composed with its
    delta_threshold, ε(δ - d) - log(1 - d), per dp-accounting."""
    tok_event, d_thr = dp_accounting.GaussianDpEvent(3.0), 4e-6
    release(tmp_path, tok_event, 1, "tokenizer-x", SEQ, extra={"delta_threshold": d_thr})

    def composed(k):
        return direct_eps([(tok_event, 1)] + ([(G, k)] if k else []), delta=DELTA - d_thr) \
            - math.log1p(-d_thr)

    st = budget_status(records(tmp_path), None, DELTA, "pld", {"unit": SEQ})
    assert st["epsilon_spent"] == pytest.approx(composed(0), rel=1e-9)
    k_true = 6
    budget = composed(k_true) * (1 + 1e-9)
    # Without the threshold's delta the budget would let more steps through.
    assert direct_eps([(tok_event, 1), (G, k_true + 1)]) <= budget
    st = service(tmp_path, budget=budget, total=10, block=2, accountant="pld").hold(10, need=1)
    assert (st["fit"], st["held"]) == (k_true, k_true)
    assert composed(k_true) <= budget < composed(k_true + 1)


# ------------------------------------------------------------------ budgets per privacy unit

def test_unit_key_separates_unit_definitions_not_bounds():
    assert unit_key({"unit": USER}) == unit_key({"kind": "user", "user_field": "user_id"})
    assert unit_key({"kind": "user", "user_field": "patient"}) != unit_key(USER)
    assert unit_key({"kind": "document", "max_rows_per_unit": 2}) == unit_key({"kind": "document"})
    assert unit_key(SEQ) != unit_key({**SEQ, "sequence_length": 48}) != unit_key(USER)
    assert unit_key({"unit": SEQ}) != unit_key({"kind": "document"})
    assert unit_key({}) == "not recorded"


def _user_and_sequence_ledger(tmp_path):
    """A sequence-level run (30 releases of a Gaussian, σ=5) and a user-level run (5 of
    σ=20) interleaved in one dataset ledger."""
    seq_ev = dp_accounting.GaussianDpEvent(5.0)
    release(tmp_path, seq_ev, 10, "seq-run", SEQ)
    release(tmp_path, G, 5, "user-run", USER)
    release(tmp_path, seq_ev, 20, "seq-run", SEQ)
    return seq_ev, G


def test_budget_for_user_runs_counts_only_user_releases(tmp_path):
    seq_ev, user_ev = _user_and_sequence_ledger(tmp_path)
    acc = "rdp"
    user_only = direct_eps([(user_ev, 5)], acc)
    everything = direct_eps([(seq_ev, 30), (user_ev, 5)], acc)
    assert everything > 1.5 * user_only  # composing both would be a different number
    st = budget_status(records(tmp_path), None, DELTA, acc, {"unit": USER}, location(tmp_path), DS)
    assert st["epsilon_spent"] == pytest.approx(user_only, rel=1e-9)
    assert st["releases_composed"] == 1 and (st["ledger"], st["dataset_id"]) == (location(tmp_path), DS)
    assert st["not_composed"] == [{"run_id": "seq-run", "unit": "a sequence of 24 tokens (packed "
                                   "across document boundaries)", "mechanism": "dp-sgd", "count": 30,
                                   "status": NOT_COMPOSED}]
    seq_st = budget_status(records(tmp_path), None, DELTA, acc, {"unit": SEQ})
    assert seq_st["epsilon_spent"] == pytest.approx(direct_eps([(seq_ev, 30)], acc), rel=1e-9)
    assert [x["run_id"] for x in seq_st["not_composed"]] == ["user-run"]

    # A budget for either unit cannot be set on this ledger: the other unit's releases would
    # not be bounded by it (no group-privacy conversion; issue 29 item 7). Nothing is written.
    before = records(tmp_path)
    for name, unit, ev in (("new-user", USER, user_ev), ("new-seq", SEQ, seq_ev)):
        s = service(tmp_path, name=name, budget=everything * 10, total=8, block=2, unit=unit,
                    event=ev, accountant=acc)
        with pytest.raises(BudgetError) as e:
            s.hold(8, need=1)
        msg = str(e.value)
        assert "holds releases for other privacy units than " + repr(unit_key(unit)) in msg
        other = "user (records sharing 'user_id')" if unit is SEQ else \
            "a sequence of 24 tokens (packed across document boundaries)"
        assert other in msg and "cannot be given one" in msg, msg
        s.start_attempt()
        assert not s.admit(0)[0]  # nor a release without a hold
    assert records(tmp_path) == before
    # Without a budget, both units keep releasing on this dataset, composed apart.
    s = service(tmp_path, name="new", total=4, block=2, unit=USER, event=user_ev, accountant=acc)
    assert s.hold(4)["held"] == 0
    s.start_attempt()
    assert run_steps(s, range(4)) == list(range(4))
    assert s.status()["epsilon_spent"] == pytest.approx(direct_eps([(user_ev, 9)], acc), rel=1e-9)


def test_a_budget_needs_the_runs_unit(tmp_path):
    with pytest.raises(ValueError, match=r"privacy.budget_epsilon=5 needs the run's privacy unit"
                                         r".*meta\['unit'\]"):
        LedgerService(location=location(tmp_path), dataset_id=DS, run_ledger=str(tmp_path / "r.jsonl"),
                      run_id="r", meta={}, block_size=2, total_steps=8, event_json=event_to_json(EV),
                      delta=DELTA, accountant="pld", budget_epsilon=5.0)


def test_report_composes_the_runs_unit_and_lists_the_others(tmp_path):
    """The report's dataset-ledger ε is that of the run's unit (dp-accounting directly); the
    other unit's run is listed as not composed. A budget is refused on this dataset (it would
    not bound the other unit's releases: issue 29 item 7), so the run holds nothing."""
    import yaml

    from llmdp.privacy.plan import make_plan
    from llmdp.report.build import build_report
    from llmdp.report.render import render_markdown

    seq_ev = dpsgd_step_event(0.02, 0.8)
    release(tmp_path, seq_ev, 30, "seq-run", SEQ)
    run = tmp_path / "user-run"
    plan = make_plan(dataset_size=100, expected_batch_size=1, max_grad_norm=1.0, steps=5,
                     noise_multiplier=SIGMA, delta=DELTA)
    assert plan.step_event() == EV
    with pytest.raises(BudgetError, match="holds releases for other privacy units"):
        service(tmp_path, name="user-run", budget=3.0, total=5, block=5, unit=USER, event=EV,
                accountant="rdp").hold(5)
    s = service(tmp_path, name="user-run", total=5, block=5, unit=USER, event=EV, accountant="rdp")
    assert s.hold(5)["held"] == 0
    s.start_attempt()
    assert run_steps(s, range(5)) == list(range(5))
    s.end("run ended")
    assert [r["kind"] for r in Ledger(run / "ledger.jsonl").records()] == ["release"]
    (run / "config.yaml").write_text(yaml.safe_dump({
        "privacy": {"rng": "secure"}, "model": {"init": "tiny", "tokenizer": None},
        "data": {"unit": "user", "user_field": "user_id", "sequence_length": 24, "max_rows_per_unit": 2}}))
    (run / "plan.json").write_text(json.dumps({
        "plan": plan.to_dict(), "run_id": "user-run",
        "dataset_ledger": {"location": location(tmp_path), "dataset_id": DS},
        "budget_epsilon": None, "tokenizer": {"kind": "external"}}))
    r = build_report(str(run))
    d = r["dataset_ledger"]
    eps = direct_eps([(EV, 5)])
    assert d["cross_checked"] and d["unit"] == "user (records sharing 'user_id')"
    assert d["epsilon_spent"] == pytest.approx(eps, rel=1e-9)
    assert d["budget_epsilon"] is None and d["epsilon_remaining"] is None
    assert [(x["run_id"], x["status"]) for x in d["not_composed"]] == [("seq-run", NOT_COMPOSED)]
    assert d["live_holds"] == []
    assert r["epsilon"] == pytest.approx(eps, rel=1e-9)
    md = render_markdown(r)
    assert "this run's unit, user (records sharing 'user_id')" in md
    assert "seq-run (dp-sgd, 30 step(s), unit a sequence of 24 tokens" in md
    assert "not composed: different privacy unit" in md


# ------------------------------------------------------------------ holds of concurrent runs

def test_a_run_cannot_start_on_budget_another_run_holds(tmp_path):
    budget = direct_eps([(G, 10)], "rdp") * (1 + 1e-9)
    a = service(tmp_path, name="a", budget=budget, total=10, block=2)
    b = service(tmp_path, name="b", budget=budget, total=5, block=5)
    assert a.hold(10)["held"] == 10
    st = b.hold(5)
    assert (st["held"], st["fit"]) == (0, 0)
    assert st["live_holds"] == [{"run_id": "a", "steps_unused": 10}] and st["held_steps"] == 10
    assert st["epsilon_spent"] == 0.0  # nothing released yet: held only
    a.start_attempt()
    assert run_steps(a, range(4)) == [0, 1, 2, 3]
    st = b.hold(5)
    assert st["held"] == 0 and st["live_holds"] == [{"run_id": "a", "steps_unused": 6}]
    a.end("run ended")
    # What a did not use goes back to the budget: 6 of the 10 steps remain.
    st = b.hold(5)
    assert st["held"] == 5 and st["live_holds"] == [{"run_id": "b", "steps_unused": 5}]
    assert st["epsilon_spent"] == pytest.approx(direct_eps([(G, 4)], "rdp"), rel=1e-9)
    b.start_attempt()
    assert run_steps(b, range(5)) == list(range(5))
    kinds = [(r["kind"], r["run_id"]) for r in records(tmp_path)]
    # The first budgeted launch recorded its budget (not a record of run a).
    assert kinds == [("budget", None), ("hold", "a"), ("release", "a"), ("release", "a"),
                     ("hold_end", "a"), ("hold", "b"), ("release", "b")]
    assert direct_eps([(G, 9)], "rdp") <= budget
    for name in "ab":  # each run's ledger.jsonl holds exactly its records
        path = tmp_path / name / "ledger.jsonl"
        assert cross_check(Ledger(path).records(), records(tmp_path), name, str(path)) == []


def test_the_hold_of_a_dead_run_is_ended_by_the_next_transaction(tmp_path):
    budget = direct_eps([(G, 10)], "rdp") * (1 + 1e-9)
    lock_file = tmp_path / "a.lock"
    lock_file.write_text("")
    lock = {"path": str(lock_file), "host": socket.gethostname(), "pid": os.getpid()}
    a = service(tmp_path, name="a", budget=budget, total=10, block=2, lock=lock)
    b = service(tmp_path, name="b", budget=budget, total=5, block=5)
    held_lock = os.open(lock_file, os.O_RDONLY)
    fcntl.flock(held_lock, fcntl.LOCK_EX)  # a runs: its lock file is locked
    try:
        assert a.hold(10)["held"] == 10
        a.start_attempt()
        assert run_steps(a, range(2)) == [0, 1]
        assert b.hold(5)["held"] == 0
        assert not [r for r in records(tmp_path) if r["kind"] == "hold_end"]
    finally:
        os.close(held_lock)  # a dies: nobody holds its lock file
    st = b.hold(5)
    assert st["held"] == 5
    ends = [r for r in records(tmp_path) if r["kind"] == "hold_end"]
    assert len(ends) == 1 and ends[0]["ended_by"] == "b" and "lock file is free" in ends[0]["reason"]
    assert ends[0]["hold_of"] == "a" and ends[0]["run_id"] is None  # not a record of run a
    assert st["live_holds"] == [{"run_id": "b", "steps_unused": 5}]
    # The dead run's ledger.jsonl still matches the dataset ledger, and it can resume.
    path = tmp_path / "a" / "ledger.jsonl"
    assert cross_check(Ledger(path).records(), records(tmp_path), "a", str(path)) == []
    a2 = service(tmp_path, name="a", budget=budget, total=10, block=2, lock=lock)
    st = a2.hold(8, need=1)
    assert st["held"] == 3  # 10 - a's 2 - b's 5 held
    a2.start_attempt()
    assert run_steps(a2, range(2, 10)) == [2, 3, 4]
    assert cross_check(Ledger(path).records(), records(tmp_path), "a", str(path)) == []


def test_a_hold_whose_process_is_gone_is_ended(tmp_path):
    """The lock file is gone too: the holder's pid on this host decides."""
    p = subprocess.Popen(["true"])
    p.wait()
    lock = {"path": str(tmp_path / "gone.lock"), "host": socket.gethostname(), "pid": p.pid}
    budget = direct_eps([(G, 10)], "rdp") * (1 + 1e-9)
    a = service(tmp_path, name="a", budget=budget, total=10, lock=lock)
    assert a.hold(10)["held"] == 10
    b = service(tmp_path, name="b", budget=budget, total=5)
    assert b.hold(5)["held"] == 5
    # ... and a lock on another host is not decidable here: alive.
    c = service(tmp_path, name="c", budget=budget, total=5,
                lock={"path": "/nonexistent/c.lock", "host": "elsewhere", "pid": p.pid})
    assert c.hold(5)["held"] == 5
    d = service(tmp_path, name="d", budget=budget, total=1)
    assert d.hold(1)["held"] == 0
    assert {r["hold_of"] for r in records(tmp_path) if r["kind"] == "hold_end"} == {"a"}


# ------------------------------------------------------------------ the target after failures

def test_restarts_stop_at_the_target_unless_allowed(tmp_path):
    total, acc = 8, "rdp"
    target = direct_eps([(G, 10)], acc) * (1 + 1e-9)  # room for 2 re-executed steps
    s = service(tmp_path, total=total, block=4, accountant=acc, target_epsilon=target)
    s.start_attempt()
    assert run_steps(s, range(total)) == list(range(total))
    # A failure: the worker group restarts from the checkpoint at step 4 and re-executes.
    s.start_attempt()
    assert run_steps(s, range(4, total)) == [4, 5]  # the block is cut at the target
    ok, why = s.admit(6)
    assert not ok
    assert f"privacy.target_epsilon={target:g} reached" in why
    assert "(10 steps in its ledger for 6 completed; a first Ctrl-C loses none)" in why
    assert "before step 7 of 8" in why
    assert "privacy.allow_exceed_target_on_failure: true" in why
    with pytest.raises(BudgetError, match="privacy.target_epsilon="):
        s.ensure(6)
    recs = records(tmp_path)
    assert [(r["first_step"], r["count"]) for r in recs] == [(0, 4), (4, 4), (4, 2)]
    eps = s.status()["epsilon_spent"]
    assert eps == pytest.approx(direct_eps([(G, 10)], acc), rel=1e-9) and eps <= target
    assert direct_eps([(G, 11)], acc) > target
    # Allowed to exceed it: the run finishes, ε above the target.
    s2 = service(tmp_path, total=total, block=4, accountant=acc, target_epsilon=target,
                 allow_exceed_target=True)
    s2.start_attempt()
    assert run_steps(s2, range(6, total)) == [6, 7]
    eps = s2.status()["epsilon_spent"]
    assert eps == pytest.approx(direct_eps([(G, 12)], acc), rel=1e-9) and eps > target
    path = tmp_path / "run" / "ledger.jsonl"
    assert cross_check(Ledger(path).records(), records(tmp_path), "run", str(path)) == []


# ------------------------------------------------------------------ a graceful stop (the first Ctrl-C)

def test_a_graceful_stop_voids_the_unrun_steps_and_the_resumed_run_reaches_its_target(tmp_path):
    """Issue 30 item 1: a run calibrated to its target, stopped after step 6 inside the block
    [4, 8) and resumed from its checkpoint at 6, finishes at the target. Without the void
    the ledger would hold 10 steps for 8 and refuse the last 2 ("target reached")."""
    total, acc = 8, "rdp"
    target = direct_eps([(G, total)], acc) * (1 + 1e-9)  # no room for one step more
    s = service(tmp_path, total=total, block=4, accountant=acc, target_epsilon=target)
    s.start_attempt()
    assert run_steps(s, range(6)) == list(range(6))  # blocks [0, 4) and [4, 8) reserved
    first = s.attempt
    assert s.void_unrun(6, "interrupted", attempt=first)["steps_voided"] == 2
    with pytest.raises(LedgerError, match="was stopped .*releases no step any more"):
        s.ensure(6)  # the attempt that voided steps 6, 7 can never release them
    recs = records(tmp_path)
    void = [r for r in recs if r["kind"] == "void"]
    assert [(v["first_step"], v["steps"]) for v in void] == [(6, 2)]
    assert void[0]["release"] == [r for r in recs if r["kind"] == "release"][1]["hash"]
    assert step_count(recs) == 6 and s.position()["run_steps_recorded"] == 6
    assert s.status()["epsilon_spent"] == pytest.approx(direct_eps([(G, 6)], acc), rel=1e-9)
    # The resumed attempt: steps 6 and 7 fit in the target again.
    s.start_attempt()
    # The first attempt's rank 0, were it still alive, could not void the new attempt's steps.
    with pytest.raises(LedgerError, match="is over .*nothing was voided"):
        s.void_unrun(6, "late", attempt=first)
    assert run_steps(s, range(6, total)) == [6, 7]
    eps = s.status()["epsilon_spent"]
    assert eps == pytest.approx(direct_eps([(G, total)], acc), rel=1e-9) and eps <= target
    path = tmp_path / "run" / "ledger.jsonl"
    run_records = Ledger(path).records()
    assert cross_check(run_records, records(tmp_path), "run", str(path)) == []
    assert [c for _, c in Ledger(path).entries()] == [total]


def test_a_void_frees_its_steps_in_the_budget_and_the_hold(tmp_path):
    """A budgeted run's hold counts only the steps that ran; the dataset's ε spent too, and
    another run can use what was voided."""
    budget = direct_eps([(G, 10)], "rdp") * (1 + 1e-9)
    a = service(tmp_path, name="a", budget=budget, total=10, block=4)
    assert a.hold(10)["held"] == 10
    a.start_attempt()
    assert run_steps(a, range(5)) == list(range(5))  # [0, 4) and [4, 8) reserved
    assert a.void_unrun(5, "interrupted")["steps_voided"] == 3
    a.end("launch ended: interrupted")
    b = service(tmp_path, name="b", budget=budget, total=5, block=5)
    assert b.hold(5)["held"] == 5  # 5 ran, 5 left: without the void only 2 would fit
    assert b.status()["epsilon_spent"] == pytest.approx(direct_eps([(G, 5)], "rdp"), rel=1e-9)


def _rec(kind, h, **kw):
    return {"kind": kind, "hash": h, "run_id": "r", **kw}


def test_net_records_never_take_off_more_than_the_voided_range_of_a_release_it_reads():
    """Malformed or partial voids over-count, never under-count: overlapping voids take a
    step off once; a void reaching past its release takes off only the release's steps; a
    void of another run, or of a release not among the records read, takes off nothing."""
    ev = event_to_json(G)
    rel = _rec("release", "a" * 64, first_step=10, count=10, event=ev)
    voids = [_rec("void", "b" * 64, release="a" * 64, first_step=14, steps=4, event=ev),
             _rec("void", "c" * 64, release="a" * 64, first_step=16, steps=10, event=ev),  # 16..19 count
             {**_rec("void", "d" * 64, release="a" * 64, first_step=10, steps=2, event=ev), "run_id": "x"},
             _rec("void", "e" * 64, release="f" * 64, first_step=0, steps=5, event=ev)]
    net = net_records([rel, *voids])
    assert [r["kind"] for r in net] == ["release"]
    assert net[0]["count"] == 4 and net[0]["voided"] == 6  # steps 14..19 never ran
    assert step_count([rel, *voids]) == 4 == step_count(net)  # idempotent
    assert step_count(voids) == 0 and net_records(voids) == []
    assert release_entries(enumerate([rel, *voids], 1), "x")[0][1] == 4
    # the release filtered out (a subset read): its voids take nothing off anything
    other = _rec("release", "9" * 64, first_step=0, count=3, event=ev)
    assert step_count([other, *voids]) == 3


@pytest.mark.parametrize("bad, why", [
    ({"release": "short", "first_step": 0, "steps": 1}, "release's hash"),
    ({"release": "a" * 64, "first_step": -1, "steps": 1}, "first_step=-1"),
    ({"release": "a" * 64, "first_step": 0, "steps": 0}, "steps=0"),
    ({"release": "a" * 64, "first_step": 0, "steps": 1.5}, "steps=1.5"),
])
def test_a_malformed_void_is_not_a_record(bad, why):
    rec = {"kind": "void", "seq": 1, "prev": "0" * 64, "ledger": DS, "event": event_to_json(G), **bad}
    assert why in (check_record(rec) or "")


def test_two_launches_in_one_process_and_one_second_are_two_attempts(tmp_path, monkeypatch):
    """A relaunch in the same process within the same second (an in-process resume) is a new
    attempt: its id differs from the earlier launch's, so the report counts two."""
    import time

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.25)
    ids = []
    for _ in range(2):
        s = service(tmp_path)  # a fresh service per launch, as the driver makes
        ids.append(s.start_attempt())
        s.ensure(0)
        s.db.close()
    assert ids[0] != ids[1]
    assert len({r["attempt"] for r in records(tmp_path) if r.get("kind") == "release"}) == 2


def test_an_attempt_id_is_random_and_carries_no_time_or_pid(tmp_path, monkeypatch):
    """Attempt ids are published (ledger, report): they say nothing about when or by which
    process a run was launched, only 128 random bits (issue 49 (a))."""
    import re
    import time

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.25)
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    s = service(tmp_path)
    ids = [s.start_attempt(), s.start_attempt()]
    for a in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", a), a
        assert "1800000000" not in a  # (a pid's digits could occur in 128 random bits)
    assert ids[0] != ids[1]
