"""``logging.backend``: a local experiment log of the run's metrics, DP releases under dp/,
metrics computed on private data without DP under internal/ with the warning (issue 51)."""

from __future__ import annotations

import importlib.util
import os
import stat

import pytest

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.train.explog import WARNING, mlflow_key, split, tracking_uri
from tests.train.test_loop import make_recipe, prepared_config


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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prep = _dp_eval_run(tmp_path, "tensorboard")
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


def _dp_eval_run(tmp_path, backend):
    """A local run (one process) with ``logging.backend`` and a DP evaluation at the end."""
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    raw = to_dict(make_recipe(tmp_path))
    raw["logging"] = {"backend": backend}
    raw["data"]["eval"] = {"fraction": 0.25}
    raw["eval"] = {"epsilon": 1.0, "loss_bound": 8.0, "count": "public"}
    prep = prepared_config(recipe_from_dict(raw))
    train_loop_per_worker(prep, LocalContext())
    return prep


def test_an_mlflow_log_is_a_local_store_in_the_run_directory_read_back_by_mlflow(
        tmp_path, capsys, monkeypatch):
    """logging.backend: mlflow writes a local SQLite store in <run>/mlruns (no server, nothing
    in the working directory, owner-only like the run, MLflow's telemetry off), read back
    with MLflow's own client: internal/train/* at every step, the DP evaluation's release
    under dp/eval/*, and the warning as a parameter and a tag."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    prep = _dp_eval_run(tmp_path, "mlflow")
    assert capsys.readouterr().out.count(WARNING) == 1
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    store = os.path.join(prep.run_dir, "mlruns")
    assert os.listdir(store) == ["mlflow.db"]
    assert stat.S_IMODE(os.stat(os.path.join(store, "mlflow.db")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert set(os.listdir(tmp_path)) - before <= {"runs", "notes.jsonl"}  # the run, its data
    client = MlflowClient(tracking_uri=tracking_uri(store))
    exp = client.get_experiment_by_name(prep.cfg.output.name)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["WARNING"] == WARNING and run.data.tags["llmdp.warning"] == WARNING
    assert run.data.params["dp"] == "True" and "max_grad_norm" in run.data.params
    rid = run.info.run_id
    loss = client.get_metric_history(rid, "internal/train/train_loss")
    assert sorted(m.step for m in loss) == list(range(1, 7))
    keys = set(run.data.metrics)
    assert "dp/eval/loss" in keys and all(k.startswith(("internal/", "dp/")) for k in keys)
    dp_steps = {m.step for m in client.get_metric_history(rid, "dp/eval/loss")}
    assert dp_steps == {6}
    assert exp.artifact_location.startswith("file:" + store)


def test_a_metric_name_mlflow_refuses_is_made_valid():
    assert mlflow_key("internal/train/train_loss") == "internal/train/train_loss"
    assert mlflow_key("dp/eval/loss@L=8 (p:50)") == "dp/eval/loss_L_8 _p_50_"


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
    for hidden, backend in (("alembic", "mlflow"), ("tensorboard", "tensorboard")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, h=hidden: None if name == h else real(name, *a))
        raw["logging"] = {"backend": backend}
        with pytest.raises(ConfigError) as e:
            recipe_from_dict(raw)
        assert f"{backend!r} needs the Python package(s) {hidden}," in str(e.value)
        assert f"pip install 'llmdp[{backend}]'" in str(e.value)
    raw["logging"] = {"backend": "wandb"}
    with pytest.raises(ConfigError, match=r"logging\.backend.*wandb"):
        recipe_from_dict(raw)


def test_a_failing_experiment_log_never_stops_the_run(tmp_path, monkeypatch, capsys):
    """Issue 51: a write the experiment log refuses (here: a full disk from the third record
    on, and at close) is one warning; the run completes every step, metrics.jsonl has every
    record and the report is complete."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    from llmdp.report.build import write_report

    calls = {"n": 0}
    real = SummaryWriter.add_scalar

    def add_scalar(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    def close(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    monkeypatch.setattr(SummaryWriter, "close", close)
    prep = _dp_eval_run(tmp_path, "tensorboard")
    err = capsys.readouterr().err
    assert err.count("writing the experiment log failed (OSError") == 1, err
    lines = [json.loads(x) for x in open(os.path.join(prep.run_dir, "metrics.jsonl"))]
    assert [x["step"] for x in lines if "train_loss" in x] == list(range(1, 7))
    warned = [x for x in lines if x.get("event") == "warning"]
    assert len(warned) == 1 and warned[0]["internal"] and "goes on without it" in warned[0]["message"]
    assert write_report(prep.run_dir)["status"] == "complete"
