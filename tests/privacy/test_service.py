"""The ledger service: one writer for the dataset and run ledgers, and the budget."""

from __future__ import annotations

import dp_accounting
import pytest

from llmdp.privacy.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger import Ledger
from llmdp.privacy.service import LedgerService, steps_within_budget

Q, SIGMA, DELTA = 0.01, 1.0, 1e-5


def direct_eps(count_by_event, accountant="pld"):
    acc = (dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
           if accountant == "pld" else dp_accounting.rdp.RdpAccountant())
    for event, count in count_by_event:
        acc.compose(event, count)
    return acc.get_epsilon(DELTA)


def service(tmp_path, *, budget=None, total=20, block=4, name="run"):
    return LedgerService(
        dataset_ledger=str(tmp_path / "dataset.jsonl"), run_ledger=str(tmp_path / name / "ledger.jsonl"),
        run_id=name, meta={"unit": {"kind": "sequence"}}, block_size=block, total_steps=total,
        event_json=event_to_json(dpsgd_step_event(Q, SIGMA)), delta=DELTA, accountant="pld",
        budget_epsilon=budget)


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_steps_within_budget_is_the_largest_that_fits(acc):
    ev = dpsgd_step_event(Q, SIGMA)
    prior = [(dpsgd_step_event(0.02, 0.8), 30)]
    k_true = 57 if acc == "rdp" else 9  # PLD evaluations cost ~1 s each: a short search
    upper = 80 if acc == "rdp" else 12
    budget = direct_eps(prior + [(ev, k_true)], acc) * (1 + 1e-9)
    k = steps_within_budget(prior, ev, budget, DELTA, acc, upper=upper)
    assert direct_eps(prior + [(ev, k)], acc) <= budget < direct_eps(prior + [(ev, k + 1)], acc)
    assert k == k_true
    if acc == "rdp":
        assert steps_within_budget(prior, ev, direct_eps(prior, acc) * 0.99, DELTA, acc, upper) == 0
        assert steps_within_budget(prior, ev, 1e9, DELTA, acc, upper) == upper


def test_writes_both_ledgers_write_ahead_in_blocks(tmp_path):
    s = service(tmp_path)
    s.start_attempt()
    for step in range(10):
        assert s.admit(step) == (True, "")
        s.ensure(step)
    for path in (tmp_path / "dataset.jsonl", tmp_path / "run" / "ledger.jsonl"):
        recs = Ledger(path).records()
        assert [(r["first_step"], r["count"]) for r in recs] == [(0, 4), (4, 4), (8, 4)]
    pos = s.position()
    assert (pos["reserved_until"], pos["run_steps_recorded"], pos["dataset_steps_recorded"]) == (12, 12, 12)
    # A second attempt (a resume from step 6) counts re-executed steps again.
    s.start_attempt()
    s.ensure(6)
    assert Ledger(tmp_path / "dataset.jsonl").total_count() == 16


def test_budget_shortens_the_last_block_and_refuses_the_crossing_step(tmp_path):
    ev = dpsgd_step_event(Q, SIGMA)
    # Another run already spent 7 steps on this dataset; the budget fits 10 more of ours.
    other = service(tmp_path, name="other", total=7, block=7)
    other.start_attempt()
    other.ensure(0)
    budget = direct_eps([(ev, 17)]) * (1 + 1e-9)
    s = service(tmp_path, budget=budget)
    assert s.allowance() == 10
    s.start_attempt()
    admitted = []
    for step in range(20):
        ok, why = s.admit(step)
        if not ok:
            assert "privacy.budget_epsilon=" in why and f"before step {step + 1} of 20" in why
            assert f"ε spent = {direct_eps([(ev, 17)]):.4f}" in why
            break
        s.ensure(step)
        admitted.append(step)
    assert admitted == list(range(10))
    recs = Ledger(tmp_path / "run" / "ledger.jsonl").records()
    assert [(r["first_step"], r["count"]) for r in recs] == [(0, 4), (4, 4), (8, 2)]  # cut at 10
    total = Ledger(tmp_path / "dataset.jsonl").entries()
    assert direct_eps(total) <= budget
    with pytest.raises(RuntimeError, match="not admitted"):
        s.ensure(10)


def test_a_precomputed_allowance_is_used_as_is(tmp_path):
    """The driver's start-up search result is handed over: no second search, same limit."""
    # budget_epsilon=1e9 would allow every step; the handed-over allowance of 3 binds.
    handed = LedgerService(
        dataset_ledger=str(tmp_path / "dataset.jsonl"), run_ledger=str(tmp_path / "r" / "ledger.jsonl"),
        run_id="r", meta={}, block_size=4, total_steps=20,
        event_json=event_to_json(dpsgd_step_event(Q, SIGMA)), delta=DELTA, accountant="pld",
        budget_epsilon=1e9, allowance=3)
    handed.start_attempt()
    assert [handed.admit(k)[0] for k in range(3)] == [True] * 3
    for k in range(3):
        handed.ensure(k)
    assert handed.admit(3)[0] is False
    assert Ledger(tmp_path / "r" / "ledger.jsonl").total_count() == 3


def test_budget_counts_a_private_tokenizer_release_with_its_threshold_delta(tmp_path):
    """A thresholded release (private tokenizer) in the dataset ledger: the budget keeper
    composes it with its delta_threshold, eps(delta - d) - log(1 - d), per dp-accounting."""
    import math

    from llmdp.privacy.ledger import LedgerWriter
    from llmdp.privacy.service import budget_status

    tok_event, d_thr = dp_accounting.GaussianDpEvent(3.0), 4e-6
    LedgerWriter(tmp_path / "dataset.jsonl", run_id="tokenizer-x", attempt="1", meta={},
                 block_size=1, total_steps=1).append(tok_event, 1, extra={"delta_threshold": d_thr})

    def composed(k):
        acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(tok_event)
        if k:
            acc.compose(dpsgd_step_event(Q, SIGMA), k)
        return acc.get_epsilon(DELTA - d_thr) - math.log1p(-d_thr)

    st = budget_status(str(tmp_path / "dataset.jsonl"), None, DELTA, "pld")
    assert st["epsilon_spent"] == pytest.approx(composed(0), rel=1e-9)
    k_true = 6
    budget = composed(k_true) * (1 + 1e-9)
    # Without the threshold's delta the budget would let more steps through.
    assert direct_eps([(tok_event, 1), (dpsgd_step_event(Q, SIGMA), k_true + 1)]) <= budget
    s = service(tmp_path, budget=budget, total=10, block=2)
    assert s.allowance() == k_true
    assert composed(k_true) <= budget < composed(k_true + 1)
