"""Correlated noise through the whole worker loop in one process (no Ray): the cyclic
sampler, the ledger's rounds (write-ahead, counted again after a failure), the report."""

from __future__ import annotations

import math
import os

import dp_accounting
import pytest
import torch

from llmdp.privacy.ledger import Ledger
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.test_loop import Crash, make_recipe, prepared_config


def mf_recipe(tmp_path, **privacy):
    cfg = make_recipe(tmp_path, steps=9, expected_batch_size=4, checkpoint_every=3)
    import dataclasses

    return dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, **privacy))


def _direct(event, count, delta):
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return acc.compose(dp_accounting.SelfComposedDpEvent(event, count)).get_epsilon(delta)


def test_banded_mf_run_releases_rounds_and_reports_the_amplified_epsilon(tmp_path):
    from llmdp.report.build import write_report

    cfg = mf_recipe(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=3)
    prep = prepared_config(cfg)
    plan = prep.plan
    assert (plan.cycle, plan.ledger_steps) == (3, 3)
    train_loop_per_worker(prep, LocalContext())
    records = Ledger(os.path.join(prep.run_dir, "ledger.jsonl")).records()
    releases = [r for r in records if r.get("kind") == "release"]
    assert sum(r["count"] for r in releases) == 3  # rounds, not steps
    assert all(r["meta"]["mechanism"] == "banded-mf" for r in releases)
    commit = releases[0]["meta"]["mf"]
    assert commit["strategy_sha256"] == plan.factorization().digest()
    assert (commit["bands"], commit["cycle"], commit["steps"], commit["rounds"]) == (3, 3, 9, 3)
    rep = write_report(prep.run_dir)
    q_g = plan.expected_batch_size * 3 / plan.dataset_size
    event = dp_accounting.PoissonSampledDpEvent(q_g, dp_accounting.GaussianDpEvent(1.0))
    assert rep["epsilon"] == pytest.approx(_direct(event, 3, plan.accountant_delta), rel=1e-6)
    assert rep["status"] == "complete"
    assert "cyclic Poisson" in rep["sampling"]["assumed"]
    assert rep["correlated_noise"]["mechanism"] == "banded-mf"


def test_blt_fixed_cycle_run_completes_with_one_record_per_block(tmp_path):
    from llmdp.report.build import write_report

    cfg = mf_recipe(tmp_path, mechanism="blt", sampler="fixed-cycle", cycle=3)
    prep = prepared_config(cfg)
    train_loop_per_worker(prep, LocalContext())
    rep = write_report(prep.run_dir)
    assert rep["status"] == "complete" and rep["steps"] == 3
    plan = prep.plan
    want = _direct(dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(
        plan.noise_multiplier * plan.round_factor)), 3, plan.accountant_delta)
    assert rep["epsilon"] == pytest.approx(want, rel=1e-6)


def test_a_crash_starts_a_new_segment_and_its_rounds_are_counted_again(tmp_path, monkeypatch):
    """The attempt after a failure may re-run steps whose rows were released: it restarts
    the mechanism (a fresh segment) and the ledger counts the rounds it begins again."""
    cfg = mf_recipe(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=3)
    prep = prepared_config(cfg)
    ckpt = str(tmp_path / "ckpt")
    applied = {"n": 0}
    real_step = torch.optim.AdamW.step

    def step_or_crash(self, *a, **k):
        if applied["n"] == 5:  # the 6th update never happens (checkpoint after step 3)
            raise Crash("node lost")
        applied["n"] += 1
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_or_crash)
    with pytest.raises(Crash):
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    segments = []
    from llmdp.train import correlated

    real_new = correlated.StepNoise.new_segment

    def spy(self):
        segments.append(self.stream)  # None: the stream is bound afresh (zero state)
        return real_new(self)

    monkeypatch.setattr(correlated.StepNoise, "new_segment", spy)
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    assert segments == [None]
    led = Ledger(os.path.join(prep.run_dir, "ledger.jsonl"))
    # the second attempt reserved again from the round of its first step (step 3: round 1)
    firsts = [(r["attempt"], r["first_step"]) for r in led.records() if r.get("kind") == "release"]
    second = [f for a, f in firsts if a != firsts[0][0]]
    assert second and second[0] == 1
    # attempt 1 began rounds 0 and 1 (steps 0..5); attempt 2 (from step 3) rounds 1 and 2
    assert led.total_count() >= 2 + 2
    from llmdp.report.build import write_report

    rep = write_report(prep.run_dir)
    plan = prep.plan
    event = plan.step_event()
    assert rep["epsilon"] == pytest.approx(_direct(event, led.total_count(), plan.accountant_delta),
                                           rel=1e-6)
    assert rep["epsilon"] > plan.epsilon()
    assert math.isfinite(rep["epsilon"])
