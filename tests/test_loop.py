"""The whole worker loop in one process (no Ray): ledger write-ahead, crash, resume."""

from __future__ import annotations

import json
import os

import pytest
import torch

from llmdp.config import recipe_from_dict, to_dict
from llmdp.privacy.ledger import Ledger
from llmdp.worker import LocalContext, train_loop_per_worker
from tests.helpers import tiny_tokenizer_dir, write_notes


def make_recipe(tmp_path, **train):
    data = write_notes(tmp_path / "notes.jsonl", 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 2, "log_every": 1, **train},
        "output": {"dir": str(tmp_path / "runs"), "name": "t"},
    }
    return recipe_from_dict(raw)


def prepared_config(cfg):
    from llmdp.trainer import prepare

    return prepare(cfg, log=lambda *a: None)


class Crash(RuntimeError):
    pass


def test_crash_after_ledger_write_leaves_every_applied_step_counted(tmp_path, monkeypatch):
    cfg = make_recipe(tmp_path)
    prep = prepared_config(cfg)
    wc = prep.worker_config()
    ckpt = str(tmp_path / "ckpt")
    applied = {"n": 0}
    real_step = torch.optim.AdamW.step

    def step_or_crash(self, *a, **k):
        if applied["n"] == 3:  # the 4th update never happens: its ledger line was written
            raise Crash("node lost")
        applied["n"] += 1
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_or_crash)
    with pytest.raises(Crash):
        train_loop_per_worker(wc, LocalContext(checkpoint_dir=ckpt))
    ledger = Ledger(os.path.join(prep.run_dir, "ledger.jsonl"))
    assert ledger.total_count() >= applied["n"] == 3

    # Resume from the last checkpoint (step 2): steps 2..5 run again, fresh randomness.
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    train_loop_per_worker(wc, LocalContext(checkpoint_dir=ckpt))
    executed = 3 + (6 - 2)
    assert Ledger(os.path.join(prep.run_dir, "ledger.jsonl")).total_count() >= executed
    # Block reservation: lines, not one per step.
    assert len(ledger.records()) < executed
    assert os.path.exists(os.path.join(prep.run_dir, "model", "config.json"))


def test_local_loop_writes_metrics_and_a_report_matching_dp_accounting(tmp_path):
    import dp_accounting

    from llmdp.report import write_report

    cfg = make_recipe(tmp_path)
    prep = prepared_config(cfg)
    train_loop_per_worker(prep.worker_config(), LocalContext())
    rep = write_report(prep.run_dir)
    q, T = prep.plan.sampling_probability, prep.plan.steps
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), T)
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct = acc.compose(event).get_epsilon(1e-4)
    assert rep["steps"] == T
    assert rep["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert rep["status"] == "complete"
    lines = [json.loads(x) for x in open(os.path.join(prep.run_dir, "metrics.jsonl"))]
    steps = [x["step"] for x in lines if "event" not in x]
    assert steps == list(range(1, T + 1))
    for x in lines:  # secrets stay secret: no sampled indices, no per-unit norms
        assert not {"indices", "sample", "norms"} & set(x)
    assert os.path.exists(os.path.join(prep.run_dir, "privacy_report.png"))
    assert to_dict(cfg)["privacy"]["rng"] == rep["rng_mode"] == "secure"
