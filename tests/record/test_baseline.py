"""privacy.dp: false, the NON-PRIVATE baseline of a recipe (llmdp.record.baseline): the same
sampling, micro-batching and optimizer with no clipping and no noise; labelled NON-PRIVATE
everywhere, recorded in no ledger, never exported, resumable."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import pytest
import torch

from llmdp.base.losses import row_losses
from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import (
    clip_factors,
    per_unit_gradients_autograd,
    per_unit_gradients_func,
)
from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.location import resolve_location
from llmdp.privacy.plan import DPPlan, PlanError, make_plan
from llmdp.record.baseline import BANNER, NON_PRIVATE
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.clipping.test_engine import make_batch, tiny_llama
from tests.train.test_loop import make_recipe, prepared_config


def baseline_recipe(tmp_path, name="base", **privacy):
    raw = to_dict(make_recipe(tmp_path))
    # target_epsilon / noise_multiplier may stay in the recipe: ignored with dp false
    raw["privacy"].update({"dp": False, **privacy})
    raw["output"]["name"] = name
    return recipe_from_dict(raw)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def dataset_id(cfg):
    return "path:" + os.path.realpath(cfg.data.path)


# ----------------------------------------------------------------------------- the plan


def test_a_baseline_plan_has_no_noise_no_epsilon_and_no_event():
    kw = dict(dataset_size=100, expected_batch_size=8, max_grad_norm=1.0, steps=5)
    p = make_plan(**kw, dp=False)
    assert (p.dp, p.noise_multiplier, p.target_epsilon, p.noise_std) == (False, 0.0, None, 0.0)
    assert p.clip_bound == math.inf and p.max_grad_norm == 1.0  # C recorded, not applied
    assert p.epsilon() == math.inf and p.epsilon_estimate() == math.inf
    with pytest.raises(PlanError, match=r"NON-PRIVATE baseline \(privacy.dp: false\).*no DP event"):
        p.step_event()
    d = json.loads(json.dumps(p.to_dict()))  # plan.json
    assert d["dp"] is False and DPPlan.from_dict(d) == p
    # A DP plan's record is as before the field existed; it reads back as dp=True.
    q = make_plan(**kw, noise_multiplier=1.0)
    assert "dp" not in q.to_dict() and DPPlan.from_dict(q.to_dict()).dp is True
    assert q.clip_bound == 1.0
    with pytest.raises(PlanError, match="adds no noise"):
        make_plan(**kw, noise_multiplier=1.0, dp=False)
    for bad in ({"noise_multiplier": 1.0}, {"target_epsilon": 2.0}):
        with pytest.raises(PlanError, match=r"non-private plan \(dp=False\).*no noise \(0\) and no ε"):
            DPPlan.from_dict({**d, **bad})
    with pytest.raises(PlanError, match="dp must be true or false"):
        DPPlan.from_dict({**d, "dp": "no"})
    with pytest.raises(PlanError, match="max_batch_size is required"):
        make_plan(**kw, sampler="truncated-poisson", dp=False)
    t = make_plan(**kw, sampler="truncated-poisson", max_batch_size=20, dp=False)
    assert t.truncation_cost is None and t.truncation_probability > 0


def test_clip_factors_with_an_infinite_bound_are_one_for_finite_norms_and_zero_otherwise():
    norms = torch.tensor([0.0, 1e-30, 3.0, 1e30, math.inf, math.nan], dtype=torch.float64)
    assert clip_factors(norms, math.inf).tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("sinks", [False, True], ids=["p.grad", "grad_buffers"])
@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_engine_with_an_infinite_bound_adds_the_unclipped_sum(mode, sinks):
    """GhostClipper(model, inf) adds Σ_u g_u (torch.func per-unit gradients, float64), in
    both modes, into p.grad or into the buffers fsdp uses."""
    model = tiny_llama()
    batch = make_batch([0, 0, 1, -1, 2, 3])
    inputs = {k: v for k, v in batch.items() if k != "row_units"}
    per_unit = per_unit_gradients_func(model, lambda call, row: row_losses(call, row)[0], inputs,
                                       batch["row_units"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([per_unit[n].reshape(per_unit[n].shape[0], -1) for n in names], 1)
    assert flat.norm(dim=1).min() > 1.0  # any finite C of 1 would have scaled every unit
    bufs = ({n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
            if sinks else None)
    clipper = GhostClipper(model, math.inf, mode=mode, grad_buffers=bufs)
    norms = clipper.backward(row_losses(model, batch), batch["row_units"])
    torch.testing.assert_close(norms, flat.norm(dim=1), rtol=1e-10, atol=0)
    for n, p in model.named_parameters():
        got = bufs[n] if sinks else p.grad
        torch.testing.assert_close(got, per_unit[n].sum(0), rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------- the config


def test_config_refuses_publishing_a_budget_and_a_dp_evaluation_with_dp_false(tmp_path):
    raw = to_dict(baseline_recipe(tmp_path))
    recipe_from_dict(raw)  # noise_multiplier present with dp false: ignored, accepted
    with pytest.raises(ConfigError, match=r"output.push_to: 'org/m' with privacy.dp: false.*"
                                          r"NON-PRIVATE.*never exported") as e:
        recipe_from_dict({**raw, "output": {**raw["output"], "push_to": "org/m"}})
    assert e.value.key == "output.push_to"
    with pytest.raises(ConfigError, match=r"privacy.budget_epsilon: 3 is set but privacy.dp is "
                                          r"false") as e:
        recipe_from_dict({**raw, "privacy": {**raw["privacy"], "budget_epsilon": 3.0}})
    assert e.value.key == "privacy.budget_epsilon"
    with pytest.raises(ConfigError, match=r"privacy.max_batch_size: required.*dp is false"):
        recipe_from_dict({**raw, "privacy": {**raw["privacy"], "sampler": "truncated-poisson"}})
    # A DP evaluation in the recipe is ignored by a baseline (tests/evaluation/test_evaluation.py runs one).
    recipe_from_dict({**raw, "data": {**raw["data"], "eval": {"fraction": 0.1}},
                      "eval": {**raw["eval"], "epsilon": 0.5}})
    # The same recipe with dp true may publish.
    dp = {**raw, "privacy": {**raw["privacy"], "dp": True}}
    recipe_from_dict({**dp, "output": {**dp["output"], "push_to": "org/m"}})


# ----------------------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory):
    """A baseline run to completion, in process, with its own ledgers' database path."""
    tmp = tmp_path_factory.mktemp("baseline")
    location = str(tmp / "ledgers.sqlite")
    cfg = baseline_recipe(tmp, ledger=location)
    spec = prepared_config(cfg)
    ckpt = str(tmp / "ckpt")
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=ckpt))
    from llmdp.report.build import write_report

    report = write_report(spec.run_dir)
    return {"cfg": cfg, "spec": spec, "report": report, "location": location, "ckpt": ckpt}


def test_a_baseline_run_records_nothing_in_any_ledger(baseline_run):
    spec, cfg = baseline_run["spec"], baseline_run["cfg"]
    assert spec.dp is False and spec.ledger is None and spec.dataset_ledger is None
    assert spec.prior_releases == ()
    assert not os.path.exists(os.path.join(spec.run_dir, "ledger.jsonl"))
    # The recipe's ledgers' database was never even created; opened now, it holds nothing.
    assert not os.path.exists(baseline_run["location"])
    db = LedgerDB(resolve_location(baseline_run["location"]))
    try:
        assert db.ledgers() == []
    finally:
        db.close()
    # Nor is the dataset in the default database ($LLMDP_HOME/ledger.sqlite).
    db = LedgerDB(resolve_location(None))
    try:
        assert dataset_id(cfg) not in db.ledgers()
    finally:
        db.close()
    state = torch.load(glob.glob(os.path.join(baseline_run["ckpt"], "state.pt"))[0],
                       weights_only=True)
    assert state["ledger"] is None and state["step"] == spec.plan.steps


def test_a_baseline_is_labelled_non_private_in_metrics_plan_and_report(baseline_run):
    spec, rep = baseline_run["spec"], baseline_run["report"]
    lines = metrics(spec.run_dir)
    starts = [m for m in lines if m.get("event") == "start"]
    steps = [m for m in lines if "event" not in m]
    assert len(starts) == 1 and [m["step"] for m in steps] == list(range(1, spec.plan.steps + 1))
    assert all(m["privacy"] == NON_PRIVATE for m in starts + steps)
    assert all(m["worker0_clipped_fraction"] == 0 for m in steps)  # nothing is clipped
    with open(os.path.join(spec.run_dir, "plan.json"), encoding="utf-8") as f:
        info = json.load(f)
    assert info["privacy"] == NON_PRIVATE and info["plan"]["dp"] is False
    assert info["epsilon_planned"] is None and info["dataset_ledger"] is None
    assert info["plan"]["noise_multiplier"] == 0.0
    assert rep["dp"] is False and rep["privacy"] == NON_PRIVATE and rep["banner"] == BANNER
    assert rep["epsilon"] is None and rep["delta"] is None and rep["ledger"] is None
    assert not rep.get("epsilon_curve") and "plot_error" not in rep
    assert rep["status"] == "complete" and rep["steps_completed"] == spec.plan.steps
    assert rep["dataset_size"] == spec.plan.dataset_size
    assert "epsilon_by_accountant" not in rep and "dataset_ledger" not in rep
    with open(os.path.join(spec.run_dir, "privacy_report.json"), encoding="utf-8") as f:
        assert json.load(f)["dp"] is False
    with open(os.path.join(spec.run_dir, "privacy_report.md"), encoding="utf-8") as f:
        md = f.read()
    assert md.splitlines()[0] == BANNER
    assert "Guarantee:" not in md and "## Ledger" not in md and "ε =" not in md
    assert os.path.exists(os.path.join(spec.run_dir, "privacy_report.png"))


def test_the_progress_bar_says_non_private_and_shows_no_epsilon(baseline_run, capsys):
    from llmdp.run.progress import Progress

    spec = baseline_run["spec"]
    bar = Progress(spec.paths.metrics, spec.plan, ledger_path=os.path.join(spec.run_dir, "nope"))
    bar._offset = 0  # read the finished run's metrics from the start
    bar.stop.set()
    bar.run()
    out = capsys.readouterr().out
    assert NON_PRIVATE in out and "dp-sgd" not in out and "eps=" not in out
    assert f"{spec.plan.steps}/{spec.plan.steps}" in out


def test_export_refuses_a_baseline_even_unverified(baseline_run, tmp_path):
    from llmdp.hub.export import ExportError, export_run, verify_run

    run_dir = baseline_run["spec"].run_dir
    for allow in (False, True):
        with pytest.raises(ExportError) as e:
            export_run(run_dir, tmp_path / "out", allow_unverified=allow, log=lambda *a: None)
        msg = str(e.value)
        assert run_dir in msg and "NON-PRIVATE baseline (privacy.dp: false)" in msg
        assert "cannot be exported" in msg and "--allow-unverified" in msg
    with pytest.raises(ExportError, match="NON-PRIVATE baseline"):
        verify_run(run_dir)
    assert not os.path.exists(tmp_path / "out")


def test_epsilon_planned_of_a_baseline_asks_no_accountant(baseline_run, monkeypatch):
    import llmdp.record.spec

    def no(*a, **k):
        raise AssertionError("the accountant was asked for a baseline")

    monkeypatch.setattr(llmdp.record.spec, "composed_epsilon", no)
    spec = dataclasses.replace(baseline_run["spec"])  # a fresh cached_property
    assert spec.epsilon_planned == math.inf
    rec = spec.plan_record()
    assert rec["epsilon_planned"] is None and rec["epsilon_planned_training_only"] is None
    assert spec.with_ledger_actor("x") is spec


# ----------------------------------------------------------------------------- resume


class Crash(RuntimeError):
    pass


def test_a_baseline_resumes_from_its_checkpoint_and_a_dp_switch_is_another_recipe(tmp_path, monkeypatch):
    from llmdp.report.build import write_report

    cfg = baseline_recipe(tmp_path)
    spec = prepared_config(cfg)
    ckpt = str(tmp_path / "ckpt")
    real_step, applied = torch.optim.AdamW.step, {"n": 0}

    def step_or_crash(self, *a, **k):
        if applied["n"] == 3:
            raise Crash("node lost")
        applied["n"] += 1
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_or_crash)
    with pytest.raises(Crash):
        train_loop_per_worker(spec, LocalContext(checkpoint_dir=ckpt))
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    spec = prepared_config(cfg)  # the same recipe: a resume
    out = train_loop_per_worker(spec, LocalContext(checkpoint_dir=ckpt))
    assert out == {"steps": spec.plan.steps}
    lines = metrics(spec.run_dir)
    assert [m["step"] for m in lines if m.get("event") == "start"] == [0, 2]  # from step 2
    # steps 1-3 ran, step 4 crashed before its update; steps 3-6 ran again after the resume
    assert [m["step"] for m in lines if "event" not in m] == [1, 2, 3, 3, 4, 5, 6]
    rep = write_report(spec.run_dir)
    assert rep["status"] == "complete" and rep["starts"] == 2 and rep["epsilon"] is None
    assert not os.path.exists(os.path.join(spec.run_dir, "ledger.jsonl"))
    # privacy.dp is a resume key: the DP recipe may not continue this run, nor the reverse.
    raw = to_dict(cfg)
    raw["privacy"]["dp"] = True
    with pytest.raises(ConfigError, match=r"different recipe \(privacy.dp: False -> True\)"):
        prepared_config(recipe_from_dict(raw))


def test_a_run_directory_of_an_earlier_llmdp_is_a_dp_run(tmp_path):
    """A config.yaml written before privacy.dp existed is a DP run's: a baseline may not
    resume it."""
    import yaml

    dp_cfg = make_recipe(tmp_path)
    prepared_config(dp_cfg)
    path = os.path.join(dp_cfg.run_dir, "config.yaml")
    old = yaml.safe_load(open(path, encoding="utf-8"))
    del old["privacy"]["dp"]
    yaml.safe_dump(old, open(path, "w", encoding="utf-8"))
    with pytest.raises(ConfigError, match=r"privacy.dp: True -> False"):
        prepared_config(baseline_recipe(tmp_path, name="t"))


# ----------------------------------------------------------------------------- numerics


def _captured_step(spec, step_keys, monkeypatch):
    """(initial state, the gradient the optimizer receives at step 0) of a fresh setup, with
    the step's keys fixed to ``step_keys``."""
    from llmdp.train.loop import dp_step, setup
    from llmdp.train.step import StepKeys

    monkeypatch.setattr(StepKeys, "draw", classmethod(lambda cls, *a, **k: step_keys))
    got, real = {}, torch.optim.AdamW.step

    def capture(self, *a, **k):  # the gradient the update is made of
        got.update({n: p.grad.detach().clone() for n, p in zip(run.names, run.clipper.params)})
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", capture)  # before the scheduler wraps it
        run = setup(spec, LocalContext())
        init = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        dp_step(run, 0)
    return init, got


@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_a_baseline_step_is_the_unclipped_sum_over_qN_without_noise(tmp_path, monkeypatch, mode):
    """One step's gradient, float64: Σ_u g_u ÷ qN over the step's Poisson sample, computed
    here by autograd of the summed unit losses; units far above privacy.max_grad_norm are
    not clipped; two different noise keys give the identical update. The same recipe with
    dp true (control) clips and noises: its gradients differ."""
    from llmdp.train.models import load_model
    from llmdp.train.step import StepKeys

    C = 1e-3

    def recipe(dp, name):
        raw = to_dict(make_recipe(tmp_path))
        raw["model"]["dtype"] = "float64"
        raw["privacy"].update({"dp": dp, "max_grad_norm": C, "clipping_mode": mode})
        raw["train"]["expected_batch_size"] = 24  # several units per step
        raw["output"]["name"] = name
        return recipe_from_dict(raw)

    spec = prepared_config(recipe(False, "base"))
    plan = spec.plan
    sampler = plan.make_sampler(plan.dataset_size)
    keys = None
    for i in range(50):  # a sample key whose Poisson draw has several units
        k = StepKeys.from_step_key(bytes([i]) * 32)
        if len(sampler.sample_with_info(k.sample)[0]) >= 3:
            keys = k
            break
    assert keys is not None
    other = StepKeys(sample=keys.sample, noise=bytes(32))
    assert other.noise != keys.noise
    init, got = _captured_step(spec, keys, monkeypatch)
    _, got2 = _captured_step(spec, other, monkeypatch)
    assert got.keys() == got2.keys() and got
    for n in got:
        assert got[n].dtype == torch.float64
        assert torch.equal(got[n], got2[n]), n  # no noise: the noise key changes nothing

    # Independently: the same units' rows, the summed normalized losses, one autograd pass.
    from llmdp.data.store import open_store

    sample = sampler.sample_with_info(keys.sample)[0]
    batch = open_store(spec.paths.store_dir).rows(sample)
    model, _ = load_model(spec.cfg.model, cache_dir=spec.paths.model_cache)
    model.load_state_dict(init)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(params) == set(got)
    losses = row_losses(model, batch)
    keep = batch["row_units"] >= 0
    per_unit = per_unit_gradients_autograd(losses, list(params.values()), batch["row_units"],
                                           retain_graph=True)
    norms = torch.cat([g.reshape(g.shape[0], -1) for g in per_unit], 1).norm(dim=1)
    assert len(norms) == len(sample) and norms.min() > 100 * C  # clipping would scale each
    grads = torch.autograd.grad(losses[keep].sum(), list(params.values()))
    qN = plan.sampling_probability * plan.dataset_size
    for (n, _), g in zip(params.items(), grads):
        torch.testing.assert_close(got[n], g / qN, rtol=1e-10, atol=1e-14)

    # Control: the DP recipe, same sample, clips (C) and noises (σ = 1).
    dp_spec = prepared_config(recipe(True, "dp"))
    _, dp1 = _captured_step(dp_spec, keys, monkeypatch)
    _, dp2 = _captured_step(dp_spec, other, monkeypatch)
    assert any(not torch.equal(dp1[n], dp2[n]) for n in dp1)
    assert all(not torch.allclose(dp1[n], got[n]) for n in dp1)
