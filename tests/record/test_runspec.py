"""The run spec (issue 16 item 1): `prepare` returns one frozen, picklable RunSpec; Ray ships
it as it is; the run never reads plan.json back; plan.json is written once and read through
RunDir."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle

import pytest

from llmdp.record.rundir import NotARunDirectory, RunDir
from llmdp.record.spec import LedgerSpec, RunPaths, RunSpec
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.train.test_loop import make_recipe, prepared_config


@pytest.fixture
def spec(tmp_path) -> RunSpec:
    return prepared_config(make_recipe(tmp_path, steps=2, checkpoint_every=1))


def test_run_spec_round_trips_through_pickle_and_cloudpickle(spec):
    from ray import cloudpickle

    from llmdp.train.loop import ray_entry

    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again is not spec
    assert again.cfg == spec.cfg and again.plan == spec.plan and again.paths == spec.paths
    assert dict(again.ledger.service) == dict(spec.ledger.service)
    # What the driver hands TorchTrainer: the entry point bound to the spec (Ray's cloudpickle).
    entry = cloudpickle.loads(cloudpickle.dumps(functools.partial(ray_entry, spec)))
    assert entry.func is ray_entry and entry.args == (spec,)
    with_actor = spec.with_ledger_actor("llmdp-ledger-x")
    assert pickle.loads(pickle.dumps(with_actor)).ledger.actor == "llmdp-ledger-x"


def test_a_worker_unpickles_the_train_function_without_the_drivers_modules(spec, tmp_path):
    """What a Ray Train worker does first: unpickle the train function the driver ships
    (`launch._fit`). In a fresh interpreter that imports the training loop and the run
    spec's classes, and none of the driver's modules (its launch, planning, export), nor
    dp-accounting and the scipy it loads (~1 CPU-s a worker): a worker accounts nothing
    (the ledger's writer and the driver do)."""
    import subprocess
    import sys

    from ray import cloudpickle

    from llmdp.run import launch

    blob = tmp_path / "train_fn.pkl"
    blob.write_bytes(cloudpickle.dumps(functools.partial(launch.ray_entry, spec)))
    code = ("import pickle, sys; fn = pickle.load(open(sys.argv[1], 'rb')); "
            "print(fn.func.__module__, fn.args[0].run_id, "
            "sorted(m for m in sys.modules if m.startswith(('llmdp.run', 'llmdp.hub')) "
            "or m.split('.')[0] in ('dp_accounting', 'scipy')))")
    done = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["llmdp.train.loop", spec.run_id, "[]"], done.stdout


def test_run_spec_is_frozen_and_typed(spec):
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.run_id = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.paths.run_dir = "/elsewhere"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.cfg.train.steps = 99  # type: ignore[misc]
    assert spec.with_ledger_actor("a").ledger.actor == "a" and spec.ledger.actor is None
    assert all(os.path.isabs(p) for p in (spec.paths.run_dir, spec.paths.store_dir, spec.paths.model_cache))
    with pytest.raises(ValueError, match="RunPaths.store_dir: 'units' is not an absolute path"):
        RunPaths(run_dir="/r", store_dir="units", model_cache="/m")


def test_every_dp_run_asks_its_ledger_before_each_block():
    """The dataset's budget is in its ledger, not in the recipe (issue 29 item 2): a run with
    no budget and no target asks too (the dataset may be budgeted, now or while it runs)."""
    base = {"budget_epsilon": None, "target_epsilon": None, "allow_exceed_target": False}
    assert LedgerSpec(base).admits
    assert LedgerSpec({**base, "budget_epsilon": 3.0}).admits
    assert LedgerSpec({**base, "target_epsilon": 3.0, "allow_exceed_target": True}).admits


def test_plan_json_is_the_spec_record_written_once(spec, tmp_path):
    rd = RunDir(spec.run_dir)
    on_disk = json.loads(open(rd.plan_path).read())
    assert on_disk == json.loads(json.dumps(spec.plan_record()))
    assert rd.plan == spec.plan and rd.run_id() == spec.run_id
    assert rd.prior_releases == list(spec.prior_releases) and rd.info["tokenizer"] == json.loads(json.dumps(dict(spec.tokenizer)))
    before = os.stat(rd.plan_path)
    again = prepared_config(make_recipe(tmp_path, steps=2, checkpoint_every=1))  # a re-launch
    after = os.stat(rd.plan_path)
    assert again.run_id == spec.run_id and again.plan == spec.plan
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    # A different plan is refused, and the file is left as it was.
    other = {**spec.plan_record(), "plan": {**spec.plan.to_dict(), "noise_multiplier": 2.0}}
    with pytest.raises(ValueError, match="holds a different plan"):
        RunDir(spec.run_dir).write_plan(other)
    assert json.loads(open(rd.plan_path).read()) == on_disk


def test_the_run_never_reads_plan_json_back(spec):
    """The workers read the spec: a run whose plan.json is gone still trains (plan.json is
    output, read only by the report, the export and the CLI)."""
    os.remove(RunDir(spec.run_dir).plan_path)
    out = train_loop_per_worker(spec, LocalContext())
    assert out == {"steps": 2}
    assert os.path.exists(os.path.join(spec.run_dir, "model", "config.json"))
    assert not RunDir(spec.run_dir).exists()


def test_run_dir_reader_names_a_folder_without_a_run(tmp_path):
    rd = RunDir(tmp_path)
    assert not rd.exists() and rd.run_id() is None and rd.resume_point() is None
    with pytest.raises(NotARunDirectory, match=r"not a run directory \(no plan.json\)"):
        rd.info  # noqa: B018
    with pytest.raises(KeyError):
        rd.require(KeyError)
    (tmp_path / "plan.json").write_text("{not json")
    assert RunDir(tmp_path).run_id() is None


def test_the_checkpoint_ray_train_restores_is_the_one_its_snapshot_names(tmp_path):
    """A driver killed between a worker's upload of a checkpoint and its registration by
    Ray Train's controller leaves a newer folder than the one Ray Train resumes from."""
    import torch

    rd = RunDir(tmp_path)
    for name, step in (("checkpoint_2026-01-01_00-00-01.0", 3), ("checkpoint_2026-01-01_00-00-02.0", 6)):
        os.makedirs(tmp_path / "checkpoints" / name)
        torch.save({"step": step}, tmp_path / "checkpoints" / name / "state.pt")
    assert rd.checkpoint_step() == 6  # no snapshot (a run written without Ray): the newest
    snapshot = tmp_path / "checkpoints" / "checkpoint_manager_snapshot.json"
    snapshot.write_text(json.dumps({"latest_checkpoint_result": {
        "checkpoint_dir_name": "checkpoint_2026-01-01_00-00-01.0", "metrics": {"step": 3}}}))
    assert rd.checkpoint_step() == 3
    assert rd.latest_checkpoint().endswith("checkpoint_2026-01-01_00-00-01.0")
    snapshot.write_text(json.dumps({"latest_checkpoint_result": None}))  # nothing registered
    assert rd.latest_checkpoint() is None and rd.checkpoint_step() == 0


def test_a_relaunch_goes_on_with_the_first_sigma_when_its_search_finds_one_as_good(
        tmp_path, monkeypatch):
    """Another σ search (a new version's, another machine's last bits) finds a σ within
    twice the search's tolerance of the first launch's: the re-launch goes on with the
    first σ, the one its releases so far were made at (plan.json as it was, its ε within
    the target); a σ further off is a different plan, refused as before."""
    from llmdp.config.schema import recipe_from_dict, to_dict
    from llmdp.privacy import plan as plan_module
    from llmdp.privacy.accounting import SIGMA_RTOL, epsilon_for

    raw = to_dict(make_recipe(tmp_path, steps=2, checkpoint_every=1))
    raw["privacy"] = {"target_epsilon": 4.0, "max_grad_norm": 1.0, "delta": 1e-4,
                      "accountant": "rdp"}
    first = prepared_config(recipe_from_dict(raw))
    on_disk = open(RunDir(first.run_dir).plan_path).read()
    real = plan_module.calibrate_curve

    for factor in (1 + 1.5 * SIGMA_RTOL, 1 - 1.5 * SIGMA_RTOL):
        monkeypatch.setattr(plan_module, "calibrate_curve",
                            lambda *a, f=factor, **k: real(*a, **k) * f)
        again = prepared_config(recipe_from_dict(raw))
        assert again.plan == first.plan and again.run_id == first.run_id
        assert open(RunDir(first.run_dir).plan_path).read() == on_disk
    p = first.plan
    assert epsilon_for(p.sampling_probability, p.noise_multiplier, p.steps, p.accountant_delta,
                       p.accountant) <= 4.0

    monkeypatch.setattr(plan_module, "calibrate_curve",
                        lambda *a, **k: real(*a, **k) * (1 + 3 * SIGMA_RTOL))
    with pytest.raises(ValueError, match="holds a different plan"):
        prepared_config(recipe_from_dict(raw))
    assert open(RunDir(first.run_dir).plan_path).read() == on_disk
