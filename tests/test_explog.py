"""``logging.backend``: a local experiment log of the run's metrics, DP releases under dp/,
metrics computed on private data without DP under internal/ with the warning (issue 51)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.train.explog import WARNING, split
from tests.test_loop import make_recipe, prepared_config


def test_records_are_split_into_dp_releases_and_internal_metrics():
    assert split({"step": 3, "train_loss": 2.5, "lr": 0.1, "sample_truncated": False,
                  "privacy": "NON-PRIVATE"}) == {"internal/train/train_loss": 2.5,
                                                  "internal/train/lr": 0.1}
    assert split({"event": "eval", "step": 2, "loss": 1.5, "data": "held-out"}) == \
        {"internal/eval/loss": 1.5}
    assert split({"event": "dp_eval", "step": 6, "loss": 1.25, "epsilon": 0.5}) == \
        {"dp/eval/loss": 1.25, "dp/eval/epsilon": 0.5}
    assert split({"event": "dp_eval", "step": 6, "refused": "budget"}) == {}
    assert split({"event": "start", "step": 0, "time": 1.0}) == {}


def test_a_tensorboard_log_holds_both_kinds_and_says_which_must_not_be_published(tmp_path, capsys):
    """A local run (one process) with logging.backend: tensorboard and a DP evaluation:
    the event files in the run directory hold internal/train/* at every step, the DP
    evaluation's release under dp/eval/*, and the warning as text; the warning is printed
    once. Read back with TensorBoard's own EventAccumulator."""
    pytest.importorskip("tensorboard")  # an optional extra: pip install 'llmdp[tensorboard]'
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llmdp.train.loop import LocalContext, train_loop_per_worker

    raw = to_dict(make_recipe(tmp_path))
    raw["logging"] = {"backend": "tensorboard"}
    raw["data"]["eval"] = {"fraction": 0.25}
    raw["eval"] = {"epsilon": 1.0, "loss_bound": 8.0, "count": "public"}
    prep = prepared_config(recipe_from_dict(raw))
    train_loop_per_worker(prep, LocalContext())
    assert capsys.readouterr().out.count(WARNING) == 1
    acc = EventAccumulator(os.path.join(prep.run_dir, "tensorboard"),
                           size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("internal/train/train_loss")] == list(range(1, 7))
    dp = [t for t in scalars if t.startswith("dp/")]
    assert "dp/eval/loss" in dp
    assert all(t.startswith(("internal/", "dp/")) for t in scalars)
    text = acc.Tensors("WARNING/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "WITHOUT differential privacy" in text and "must not be published" in text


def test_a_backend_whose_package_is_missing_is_one_message_with_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    raw = {"model": {"init": "tiny", "tokenizer": "tok"}, "data": {"path": "x.jsonl"},
           "privacy": {"noise_multiplier": 1.0, "delta": 1e-5},
           "optim": {"name": "sgd", "lr": 0.1}, "train": {"expected_batch_size": 4, "steps": 1},
           "output": {"name": "t"}, "logging": {"backend": "mlflow"}}
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(raw)
    msg = str(e.value)
    assert "logging.backend" in msg and "'mlflow'" in msg and "pip install 'llmdp[mlflow]'" in msg
    raw["logging"] = {"backend": "wandb"}
    with pytest.raises(ConfigError, match=r"logging\.backend.*wandb"):
        recipe_from_dict(raw)
