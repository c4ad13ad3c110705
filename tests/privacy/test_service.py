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
        run_id="r", meta={"unit": {"kind": "sequence"}}, block_size=4, total_steps=20,
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
    LedgerWriter(tmp_path / "dataset.jsonl", run_id="tokenizer-x", attempt="1",
                 meta={"unit": {"kind": "sequence"}},
                 block_size=1, total_steps=1).append(tok_event, 1, extra={"delta_threshold": d_thr})

    def composed(k):
        acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(tok_event)
        if k:
            acc.compose(dpsgd_step_event(Q, SIGMA), k)
        return acc.get_epsilon(DELTA - d_thr) - math.log1p(-d_thr)

    st = budget_status(str(tmp_path / "dataset.jsonl"), None, DELTA, "pld", {"kind": "sequence"})
    assert st["epsilon_spent"] == pytest.approx(composed(0), rel=1e-9)
    k_true = 6
    budget = composed(k_true) * (1 + 1e-9)
    # Without the threshold's delta the budget would let more steps through.
    assert direct_eps([(tok_event, 1), (dpsgd_step_event(Q, SIGMA), k_true + 1)]) <= budget
    s = service(tmp_path, budget=budget, total=10, block=2)
    assert s.allowance() == k_true
    assert composed(k_true) <= budget < composed(k_true + 1)


# ---- budgets are per privacy unit definition (issue 12 item 6)

SEQ = {"kind": "sequence", "sequence_length": 24, "max_rows_per_unit": 1, "document_masking": False,
       "user_field": None, "description": "a sequence of 24 tokens (packed across document boundaries)"}
USER = {"kind": "user", "sequence_length": 24, "max_rows_per_unit": 2, "document_masking": False,
        "user_field": "user_id", "description": "a user: all records sharing 'user_id'"}


def test_unit_key_separates_unit_definitions_not_bounds():
    from llmdp.privacy.service import unit_key

    assert unit_key({"unit": USER}) == unit_key({"kind": "user", "user_field": "user_id"})
    assert unit_key({"kind": "user", "user_field": "patient"}) != unit_key(USER)
    assert unit_key({"kind": "document", "max_rows_per_unit": 2}) == unit_key({"kind": "document"})
    assert unit_key(SEQ) != unit_key({**SEQ, "sequence_length": 48}) != unit_key(USER)
    assert unit_key({"unit": SEQ}) != unit_key({"kind": "document"})
    assert unit_key({}) == "not recorded"


def _user_and_sequence_ledger(tmp_path):
    """A dataset ledger with a sequence-level run (30 steps, q=0.02, sigma=0.8) and a
    user-level run (5 steps of Q, SIGMA) interleaved, as two runs on one dataset leave it."""
    from llmdp.privacy.ledger import LedgerWriter

    path = tmp_path / "dataset.jsonl"
    seq_ev, user_ev = dpsgd_step_event(0.02, 0.8), dpsgd_step_event(Q, SIGMA)
    seq = LedgerWriter(path, run_id="seq-run", attempt="1", meta={"unit": SEQ, "mechanism": "dp-sgd"},
                       block_size=10, total_steps=30)
    usr = LedgerWriter(path, run_id="user-run", attempt="1", meta={"unit": USER, "mechanism": "dp-sgd"},
                       block_size=5, total_steps=5)
    seq.append(seq_ev, 10, first_step=0)
    usr.append(user_ev, 5, first_step=0)
    seq.append(seq_ev, 20, first_step=10)
    return path, seq_ev, user_ev


def test_budget_for_user_runs_counts_only_user_releases(tmp_path):
    from llmdp.privacy.service import NOT_COMPOSED, budget_status

    path, seq_ev, user_ev = _user_and_sequence_ledger(tmp_path)
    acc = "rdp"  # fast; the same functions serve PLD (test_report_... below)
    user_only = direct_eps([(user_ev, 5)], acc)
    everything = direct_eps([(seq_ev, 10), (user_ev, 5), (seq_ev, 20)], acc)
    assert everything > 1.5 * user_only  # composing both would be a different number
    st = budget_status(str(path), None, DELTA, acc, {"unit": USER})
    assert st["epsilon_spent"] == pytest.approx(user_only, rel=1e-9)
    assert st["releases_composed"] == 1
    assert st["not_composed"] == [{"run_id": "seq-run", "unit": "a sequence of 24 tokens (packed across "
                                   "document boundaries)", "mechanism": "dp-sgd", "count": 30,
                                   "status": NOT_COMPOSED}]
    seq_st = budget_status(str(path), None, DELTA, acc, {"unit": SEQ})
    assert seq_st["epsilon_spent"] == pytest.approx(direct_eps([(seq_ev, 30)], acc), rel=1e-9)
    assert [x["run_id"] for x in seq_st["not_composed"]] == ["user-run"]

    # A new user-level run under a budget: the allowance is dp-accounting on the user
    # releases plus k of its steps, the sequence run's 30 steps not composed.
    k_true = 4
    budget = direct_eps([(user_ev, 5 + k_true)], acc) * (1 + 1e-9)
    assert budget < everything  # had the sequence releases been composed, nothing would fit
    s = LedgerService(
        dataset_ledger=str(path), run_ledger=str(tmp_path / "new" / "ledger.jsonl"), run_id="new",
        meta={"unit": USER}, block_size=2, total_steps=8, event_json=event_to_json(user_ev),
        delta=DELTA, accountant=acc, budget_epsilon=budget)
    assert s.allowance() == k_true
    assert direct_eps([(user_ev, 5 + k_true)], acc) <= budget < direct_eps([(user_ev, 5 + k_true + 1)], acc)
    # The refusal names the unit whose budget it is.
    s.start_attempt()
    for step in range(k_true):
        assert s.admit(step)[0]
        s.ensure(step)
    ok, why = s.admit(k_true)
    assert not ok and "for the privacy unit \"user (records sharing 'user_id')\"" in why


def test_a_budget_needs_the_runs_unit(tmp_path):
    with pytest.raises(ValueError, match=r"privacy.budget_epsilon=5 needs the run's privacy unit.*meta\['unit'\]"):
        LedgerService(
            dataset_ledger=str(tmp_path / "d.jsonl"), run_ledger=str(tmp_path / "r.jsonl"), run_id="r",
            meta={}, block_size=2, total_steps=8, event_json=event_to_json(dpsgd_step_event(Q, SIGMA)),
            delta=DELTA, accountant="pld", budget_epsilon=5.0)


def test_report_composes_the_runs_unit_and_lists_the_others(tmp_path):
    """The report's dataset-ledger ε is that of the run's unit (dp-accounting directly);
    the other unit's run is listed as not composed, in JSON and Markdown."""
    import json

    import yaml

    from llmdp.privacy.ledger import LedgerWriter
    from llmdp.privacy.plan import make_plan
    from llmdp.report import build_report, render_markdown

    path, seq_ev, user_ev = _user_and_sequence_ledger(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    plan = make_plan(dataset_size=100, expected_batch_size=1, max_grad_norm=1.0, steps=5,
                     noise_multiplier=SIGMA, delta=DELTA)
    assert plan.step_event() == user_ev
    (run / "config.yaml").write_text(yaml.safe_dump({
        "privacy": {"rng": "secure"}, "model": {"init": "tiny", "tokenizer": None},
        "data": {"unit": "user", "user_field": "user_id", "sequence_length": 24, "max_rows_per_unit": 2}}))
    (run / "plan.json").write_text(json.dumps({
        "plan": plan.to_dict(), "run_id": "user-run", "dataset_ledger": str(path),
        "budget_epsilon": 3.0, "tokenizer": {"kind": "external"}}))
    LedgerWriter(run / "ledger.jsonl", run_id="user-run", attempt="1",
                 meta={"unit": USER, "mechanism": "dp-sgd"}, block_size=5, total_steps=5).append(
        user_ev, 5, first_step=0)
    r = build_report(str(run))
    d = r["dataset_ledger"]
    assert d["unit"] == "user (records sharing 'user_id')"
    assert d["epsilon_spent"] == pytest.approx(direct_eps([(user_ev, 5)]), rel=1e-9)
    assert d["epsilon_remaining"] == pytest.approx(3.0 - direct_eps([(user_ev, 5)]), rel=1e-9)
    assert [(x["run_id"], x["status"]) for x in d["not_composed"]] == [
        ("seq-run", "not composed: different privacy unit")]
    md = render_markdown(r)
    assert "this run's unit, user (records sharing 'user_id')" in md
    assert "seq-run (dp-sgd, 30 release(s), unit a sequence of 24 tokens" in md
    assert "not composed: different privacy unit" in md
