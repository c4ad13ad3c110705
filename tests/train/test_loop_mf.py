"""Correlated noise through the whole worker loop in one process (no Ray): the cyclic
sampler, the ledger's rounds (write-ahead, counted again after a failure), the report."""

from __future__ import annotations

import math
import os

import dp_accounting
import pytest
import torch

from llmdp.privacy.ledger.records import Ledger
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.train.test_loop import Crash, make_recipe, prepared_config


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


def _segments(prep) -> list[dict]:
    import json

    with open(prep.paths.metrics, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("event") == "noise_segment"]


def _final(prep) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(prep.run_dir, "model", "model.safetensors"))


def _seeded(tmp_path, name):
    """The banded recipe with seeded sampling and noise (one data file, one dataset ledger;
    each its own run). Two runs draw alike only under `_same_draws`."""
    import dataclasses

    cfg = mf_recipe(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=3,
                    rng="seeded", seed=7)
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=name))


def _same_draws(monkeypatch) -> None:
    """Every run and attempt in this test keys its seeded draws alike, so that a resumed run
    compares bit for bit with an uninterrupted one. A real seeded run keys them by its run id
    and attempt (`loop.seeded_scope`, issue 49 item 6): a resumed attempt draws fresh keys,
    as a secure run does, and its model is not the uninterrupted run's."""
    from llmdp.train import loop

    monkeypatch.setattr(loop, "seeded_scope", lambda run: setattr(run, "key_scope", ("same", "1")))


def _crash_at(monkeypatch, n: int) -> None:
    """The optimizer's (n+1)-th update of this launch raises `Crash` (its rows were released)."""
    applied = {"n": 0}
    real_step = torch.optim.AdamW.step

    def step_or_crash(self, *a, **k):
        if applied["n"] == n:
            raise Crash("node lost")
        applied["n"] += 1
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_or_crash)


def _ctrl_c_before(monkeypatch, prep, step: int) -> None:
    """The driver's first Ctrl-C (its stop request) lands before step ``step`` of this launch."""
    from llmdp.record.rundir import STOP_REQUEST
    from llmdp.train import loop

    def request(run, at):
        if at == str(step):
            with open(os.path.join(prep.run_dir, STOP_REQUEST), "w") as f:
                f.write("ctrl-c\n")

    monkeypatch.setattr(loop, "maybe_wait_for_ctrl_c", request)


def _clear_stop(monkeypatch, prep) -> None:
    from llmdp.record.rundir import STOP_REQUEST
    from llmdp.train import loop
    from llmdp.train.testhooks import maybe_wait_for_ctrl_c

    os.remove(os.path.join(prep.run_dir, STOP_REQUEST))  # as the driver does when it ends
    monkeypatch.setattr(loop, "maybe_wait_for_ctrl_c", maybe_wait_for_ctrl_c)


def test_a_crash_starts_a_new_segment_and_its_rounds_are_counted_again(tmp_path, monkeypatch):
    """The attempt after a failure may re-run steps whose rows were released: it restarts
    the mechanism (a fresh segment) and the ledger counts the rounds it begins again."""
    _same_draws(monkeypatch)  # the models below differ by the segment, not by the keys
    prep = prepared_config(_seeded(tmp_path, "crash"))
    ckpt = str(tmp_path / "ckpt")
    real_step = torch.optim.AdamW.step
    _crash_at(monkeypatch, 5)  # the 6th update never happens (checkpoint after step 3)
    with pytest.raises(Crash):
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    # the checkpoint held the stream at row 3; the resumed attempt restarted it at row 0
    assert _segments(prep) == [{"event": "noise_segment", "step": 3, "continued": False, "row": 0}]
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
    # said in the ledger's unit: rounds, not steps (the plot's axis too)
    assert f"the ledger records {led.total_count()} rounds of 3 steps (the plan: 3)" in rep["exceeds_target"]
    from llmdp.report.render import _epsilon_panel

    class Axis:
        def __getattr__(self, name):
            return lambda *a, **k: setattr(self, "said_" + name, a)

    ax = Axis()
    _epsilon_panel(ax, rep["epsilon_curve"], rep)
    assert ax.said_set_xlabel == ("rounds recorded in the ledger (3 steps each)",)
    # a new segment is another mechanism: not the uninterrupted run's model
    whole = prepared_config(_seeded(tmp_path, "whole"))
    train_loop_per_worker(whole, LocalContext(checkpoint_dir=str(tmp_path / "ckpt_whole")))
    a, b = _final(prep), _final(whole)
    assert any(not torch.equal(a[n], b[n]) for n in a)


def test_ctrl_c_and_resume_continue_the_segment_bit_for_bit(tmp_path, monkeypatch):
    """A graceful stop mid-round (before step 4 of rounds 0-2, 3 steps each) checkpoints the
    stream's state; the resumed attempt continues it: the final model is the uninterrupted
    run's, bit for bit, given the same draws. The round the stop split is counted by both
    attempts (4 rounds)."""
    _same_draws(monkeypatch)
    whole = prepared_config(_seeded(tmp_path, "whole"))
    train_loop_per_worker(whole, LocalContext(checkpoint_dir=str(tmp_path / "ckpt_whole")))
    prep = prepared_config(_seeded(tmp_path, "split"))
    ckpt = str(tmp_path / "ckpt")
    _ctrl_c_before(monkeypatch, prep, 4)
    assert train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))["steps"] == 4
    _clear_stop(monkeypatch, prep)
    from llmdp.record import checkpoints

    meta = checkpoints.read_meta(ckpt)
    assert (meta["step"], meta["graceful"], meta["noise"]["t"]) == (4, True, 4)
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    assert _segments(prep) == [{"event": "noise_segment", "step": 4, "continued": True, "row": 4}]
    # what the decision rests on: the position's count and hash must be this ledger's
    svc, pos = prep.ledger.open(), meta["ledger"]
    assert pos["run_records"] >= 2 and svc.released_after(pos)  # the second attempt's releases
    assert svc.released_after(None) and svc.released_after({**pos, "run_last_hash": "0" * 64})
    assert svc.released_after({**pos, "run_records": 10**6})
    a, b = _final(prep), _final(whole)
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    led = Ledger(os.path.join(prep.run_dir, "ledger.jsonl"))
    assert led.total_count() == 4  # rounds 0, 1 (first attempt), 1 again, 2 (second)
    from llmdp.report.build import write_report

    rep = write_report(prep.run_dir)
    assert rep["epsilon"] == pytest.approx(
        _direct(prep.plan.step_event(), 4, prep.plan.accountant_delta), rel=1e-6)


def test_a_release_after_the_graceful_checkpoint_forces_a_new_segment(tmp_path, monkeypatch):
    """Ctrl-C before step 4; the next attempt continues the segment, releases steps 4 and 5
    and crashes before its next checkpoint (step 6); the one after resumes the same
    graceful checkpoint, but the ledger shows releases after it: a new segment."""
    prep = prepared_config(_seeded(tmp_path, "twice"))
    ckpt = str(tmp_path / "ckpt")
    _ctrl_c_before(monkeypatch, prep, 4)
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    _clear_stop(monkeypatch, prep)
    real_step = torch.optim.AdamW.step
    _crash_at(monkeypatch, 1)
    with pytest.raises(Crash):
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    assert [(r["step"], r["continued"]) for r in _segments(prep)] == [(4, True), (4, False)]
