"""End to end on Ray Train: `llmdp train` with two CPU workers, then the report."""

from __future__ import annotations

import json
import os

import dp_accounting
import pytest

from llmdp.cli import main
from tests.helpers import TINY_MODEL_YAML, tiny_tokenizer_dir, write_notes

pytestmark = pytest.mark.slow

RECIPE = TINY_MODEL_YAML + """data: {{path: notes.jsonl, sequence_length: 32}}
privacy: {{target_epsilon: 4.0, max_grad_norm: 0.5}}
optim: {{name: sgd, lr: 0.5, schedule: constant}}
train: {{expected_batch_size: 12, steps: 6, physical_batch_size: 4, checkpoint_every: 3}}
scaling: {{num_workers: 2}}
output: {{dir: runs, name: e2e}}
"""


# The second run takes the most involved path: user units of several rows with document
# masking, sampled by truncated Poisson, its unit store built on Ray Data (a shuffle by user
# key over several shards).
USER_UNITS = ["data.unit=user", "data.user_field=user_id", "data.max_rows_per_unit=2",
              "data.document_masking=true", "privacy.sampler=truncated-poisson",
              "train.expected_batch_size=6", "data.preprocess=ray",
              "data.preprocess_memory_mb=3", "data.preprocess_workers=2",
              "privacy.delta=1e-3"]  # 16 users: δ must be given below N = 100


# (sequence units on two Ray workers: tests/run/test_multinode.py runs them, on two nodes)
@pytest.mark.parametrize("unit", ["user"])
def test_two_ray_workers_train_and_report(tmp_path, monkeypatch, capsys, unit):
    import ray
    from transformers import AutoModelForCausalLM

    from llmdp._fs import too_open

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))  # this run's unit stores alone
    write_notes(tmp_path / "notes.jsonl", 80)
    (tmp_path / "r.yaml").write_text(RECIPE.format(tok=tiny_tokenizer_dir()))
    # The actors this launch's own Ray ran, read just before the launch shuts it down: not
    # Ray Train's placement-group cleaner (that Ray ends with the run) nor its preemption
    # watcher (a one-node Ray has no node to drain), nor the actor for Ray Datasets (the
    # run gives Ray Train none); and that Ray's raylet started no idle workers ahead of use.
    import ray._private.state as ray_state

    started, system, shutdown = set(), {}, ray.shutdown

    def read_then_shutdown(*a, **k):
        if ray.is_initialized():
            started.update(x["ActorClassName"] for x in ray_state.actors().values())
            system.update(ray_state.state.get_system_config())
        return shutdown(*a, **k)

    monkeypatch.setattr(ray, "shutdown", read_then_shutdown)
    old = os.umask(0o022 if unit == "sequence" else 0o002)  # a permissive umask (issue 37)
    try:
        assert main(["train", "r.yaml", *(USER_UNITS if unit == "user" else [])]) == 0
    finally:
        os.umask(old)
    assert not ray.is_initialized()  # the driver shut down the Ray it started
    assert {"RayTrainWorker", "SynchronizationActor", "LedgerService"} <= started, started
    assert not started & {"PlacementGroupCleaner", "PreemptionWatcher", "DatasetManager"}, started
    assert system["enable_worker_prestart"] is False is system["prestart_worker_first_driver"]
    run_dir = tmp_path / "runs" / "e2e"
    # Private data at rest: the run folder (checkpoints, metrics), the unit stores (user
    # units: built by Ray Data tasks) and the ledger are owner-only.
    home = os.environ["LLMDP_HOME"]
    private = [str(tmp_path / "runs"), str(tmp_path / "cache"), os.path.join(home, "ledger.sqlite"),
               os.path.join(home, "heads")]
    assert os.path.exists(private[2]) and os.listdir(tmp_path / "cache" / "units")
    assert [p for w in private for p in too_open(w)] == []
    capsys.readouterr()

    assert main(["privacy", "report", str(run_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for key in ("epsilon", "delta", "accountant", "unit", "adjacency", "steps", "noise_multiplier",
                "sampling_probability", "max_grad_norm"):
        assert key in rep
    assert rep["steps"] == 6 and rep["status"] == "complete" and rep["unit"] == unit
    if unit == "user":
        assert rep["unit_size"]["max_rows_per_unit"] == 2 and rep["unit_size"]["document_masking"]
        assert "built on Ray Data in" in rep["unit_formation"]
        assert "Unit formation" in open(run_dir / "privacy_report.md").read()
        assert rep["dataset_size"] == rep["data_statistics"]["num_users"]
        step = dp_accounting.TruncatedSubsampledGaussianDpEvent(
            rep["dataset_size"] + 1, rep["sampling_probability"], rep["sampling"]["max_batch_size"],
            rep["noise_multiplier"])
    else:
        step = dp_accounting.PoissonSampledDpEvent(
            rep["sampling_probability"], dp_accounting.GaussianDpEvent(rep["noise_multiplier"]))
    event = dp_accounting.SelfComposedDpEvent(step, 6)
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct = acc.compose(event).get_epsilon(rep["delta_accountant"])  # δ less the noise tails
    assert rep["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert rep["epsilon"] <= 4.0

    metrics = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics if "event" not in m] == [1, 2, 3, 4, 5, 6]
    assert next(m for m in metrics if m.get("event") == "start")["world_size"] == 2
    steps = [m for m in metrics if "event" not in m]
    # totals over both workers: rank 0 holds about half of every step's units
    assert sum(m["units"] for m in steps) > sum(m["worker0_units"] for m in steps) > 0
    assert all(m["tokens_per_s"] >= m["worker0_tokens_per_s"] > 0 for m in steps if m["worker0_units"])
    assert all(m["tokens_per_s_per_worker"] == pytest.approx(m["tokens_per_s"] / 2) for m in steps)
    for name in ("config.yaml", "ledger.jsonl", "privacy_report.md", "privacy_report.png", "plan.json"):
        assert os.path.exists(run_dir / name), name
    assert any(d.startswith("checkpoint_") for d in os.listdir(run_dir / "checkpoints"))
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model.config.num_hidden_layers == 1


TOKENIZER_RECIPE = """
data: {path: notes.jsonl, unit: document}
privacy: {target_epsilon: 4.0, max_words_per_unit: 64}
tokenizer: {vocab_size: 400}
output: {dir: tokenizers, name: private}
"""


# On the test process's one Ray (conftest.shared_ray): the fault reaches the workers
# through the run's own environment (localray.run_env), as a fresh Ray's would.
@pytest.mark.usefixtures("shared_ray")
def test_private_tokenizer_then_a_run_whose_worker_fails_one_guarantee(tmp_path, monkeypatch, capsys):
    """`llmdp tokenizer train`, then `llmdp train` with that tokenizer on two Ray workers,
    worker 1 raising at step 5 (after the ledger write): Ray restarts the group from the
    step-3 checkpoint; the run finishes, the ledger counts every executed step, the report
    composes the tokenizer's release with all of them and says what the failure cost, and a
    second launch does nothing. (fsdp's sharded checkpoints through a restart:
    tests/run/test_multinode.py, on two nodes.)"""
    import math

    from transformers import AutoModelForCausalLM

    from llmdp.hub.export import verify_run
    from llmdp.privacy.ledger.records import Ledger
    from llmdp.record import checkpoints
    from llmdp.record.rundir import RunDir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))  # this data's own dataset ledger
    write_notes(tmp_path / "notes.jsonl", 80)
    (tmp_path / "t.yaml").write_text(TOKENIZER_RECIPE)
    assert main(["tokenizer", "train", "t.yaml"]) == 0
    tok = json.load(open(tmp_path / "tokenizers" / "private" / "llmdp_tokenizer.json"))
    (tmp_path / "r.yaml").write_text(RECIPE.format(tok=tmp_path / "tokenizers" / "private"))
    marker = tmp_path / "fault-happened"
    monkeypatch.setenv("LLMDP_FAULT", f"step=4,rank=1,marker={marker}")
    # The failure re-executes steps; the user allowed ε past the target for it (else the run
    # stops at the target: tests/privacy/ledger/test_ledger_runs.py).
    argv = ["train", "r.yaml", "data.unit=document", "data.max_rows_per_unit=2",
            "privacy.target_epsilon=6", "privacy.delta=1e-3",  # 80 documents: δ given
            "train.max_failures=1", "privacy.allow_exceed_target_on_failure=true",
            "scaling.strategy=replicated"]
    assert main(argv) == 0
    assert marker.exists(), "the fault was injected"
    run_dir = tmp_path / "runs" / "e2e"
    assert checkpoints.read_meta(RunDir(run_dir).latest_checkpoint())["step"] == 6
    starts = [json.loads(x) for x in open(run_dir / "metrics.jsonl") if '"start"' in x]
    assert [s["step"] for s in starts] == [0, 3]  # resumed from the last checkpoint
    steps = [r for r in Ledger(run_dir / "ledger.jsonl").records()
             if r["kind"] == "release" and r["meta"]["mechanism"] == "dp-sgd"]
    # blocks of 3: [0,3) and [3,6) by the first attempt, [3,6) again by the second
    assert [(r["first_step"], r["count"]) for r in steps] == [(0, 3), (3, 3), (3, 3)]
    assert len({r["attempt"] for r in steps}) == 2
    capsys.readouterr()
    assert main(["privacy", "report", str(run_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "complete" and rep["tokenizer"]["composed_into_guarantee"]
    assert rep["steps_completed"] == 6 and rep["steps"] == 9
    assert rep["attempts"] == 2 and rep["steps_lost_to_failures"] == 3
    assert rep["exceeds_target"] is None or "allow_exceed_target_on_failure: true" in rep["exceeds_target"]
    # The plan met the target with the tokenizer composed; the report counts all 9 steps.
    assert json.loads((run_dir / "plan.json").read_text())["epsilon_planned"] <= 6.0
    p = tok["privacy"]
    d_thr = p["delta_threshold"]
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(p["noise_std"] / math.sqrt(p["max_words_per_unit"])),
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            rep["sampling_probability"], dp_accounting.GaussianDpEvent(rep["noise_multiplier"])), 9)])
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct = acc.compose(event).get_epsilon(rep["delta_accountant"] - d_thr) - math.log1p(-d_thr)
    assert rep["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert [r["mechanism"] for r in rep["ledger"]["releases"]][:2] == ["private-tokenizer", "dp-sgd"]
    assert rep["ledger"]["releases"][0]["run_id"] == p["run_id"]
    # the dataset ledger (budget) holds both, and the model has the tokenizer's vocabulary
    assert rep["dataset_ledger"]["epsilon_spent"] == pytest.approx(rep["epsilon"], rel=1e-6)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model.get_input_embeddings().num_embeddings == tok["vocab_size_actual"]
    # the final model is the last checkpoint's (the only complaint: the failure's extra steps)
    problems, _ = verify_run(str(run_dir))
    assert not any("checkpoint" in p for p in problems), problems

    before = Ledger(run_dir / "ledger.jsonl").records()
    monkeypatch.delenv("LLMDP_FAULT")
    assert main(argv) == 0
    assert "already complete (6 of 6 steps" in capsys.readouterr().out
    assert Ledger(run_dir / "ledger.jsonl").records() == before  # nothing released again
