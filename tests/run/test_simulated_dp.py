"""Tuning at zero ε with the private run's noise (issue 54 item 1): ``privacy.simulate: true``
on data declared public runs the DP mechanism of a private run — clipping at C, noise at the
σ calibrated for that run's N (``privacy.simulate_units``) and target, its B, T and
mechanism — on the public proxy, and records nothing: no ledger, no ε, nothing exported.
A public sweep of such a recipe selects hyper-parameters tuned for that noise, and the
private recipe that takes them says so."""

from __future__ import annotations

import json
import os

import pytest

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.run.test_public_data import _in_process, dp_recipe, public_recipe
from tests.train.test_loop import prepared_config

PRIVATE_UNITS = 5000  # the private corpus the proxy stands for (more units than the proxy's)


def simulated_raw(tmp_path, name="sim", **privacy) -> dict:
    raw = to_dict(public_recipe(tmp_path, name=name))
    raw["privacy"] = {"dp": True, "simulate": True, "target_epsilon": 4.0, "max_grad_norm": 0.5,
                      "delta": 1e-4, "accountant": "rdp", "ledger": str(tmp_path / "ledgers.sqlite"),
                      **privacy}
    raw["optim"] = {"name": "sgd", "lr": 0.5, "momentum": 0.9, "schedule": "constant"}
    return raw


def test_simulate_is_for_data_declared_public_and_records_nothing_it_cannot(tmp_path):
    raw = simulated_raw(tmp_path)
    cfg = recipe_from_dict(raw)
    assert cfg.privacy.simulate and cfg.data.public and cfg.privacy.dp
    assert recipe_from_dict(to_dict(cfg)) == cfg

    priv = to_dict(dp_recipe(tmp_path))
    priv["privacy"]["simulate"] = True  # private data: a real DP run, never a simulation
    with pytest.raises(ConfigError, match=r"privacy.simulate: true simulates DP on data declared "
                                          r"public .* remove privacy.simulate"):
        recipe_from_dict(priv)
    with pytest.raises(ConfigError, match=r"privacy.simulate: true simulates the DP mechanism, but "
                                          r"privacy.dp is false"):
        recipe_from_dict({**raw, "privacy": {**raw["privacy"], "dp": False, "target_epsilon": None}})
    with pytest.raises(ConfigError, match=r"privacy.budget_epsilon: 8 with privacy.simulate: true"):
        recipe_from_dict({**raw, "privacy": {**raw["privacy"], "budget_epsilon": 8.0}})
    with pytest.raises(ConfigError, match=r"output.push_to: 'me/m' with privacy.simulate: true"):
        recipe_from_dict({**raw, "output": {**raw["output"], "push_to": "me/m"}})
    with pytest.raises(ConfigError, match=r"privacy.simulate_units: 9 is only for a simulated run"):
        recipe_from_dict({**priv, "privacy": {**priv["privacy"], "simulate": False, "simulate_units": 9}})
    # public data with DP but without the simulation: the refusal names both ways out
    with pytest.raises(ConfigError, match=r"set privacy.dp: false as well .* or privacy.simulate: "
                                          r"true to simulate a private run's DP noise"):
        recipe_from_dict({**raw, "privacy": {**raw["privacy"], "simulate": False}})


def test_the_simulated_sigma_is_the_private_runs(tmp_path):
    """σ, C, B, T of a simulated run are the private run's: planned for the private N and
    target (dp-accounting's calibration, by make_plan called directly), and with DP
    evaluations planned, the σ the private recipe itself gets; the proxy's own N sets q."""
    from llmdp.privacy.plan import make_plan
    from llmdp.run.preflight import dry_run

    cfg = recipe_from_dict(simulated_raw(tmp_path, simulate_units=PRIVATE_UNITS))
    lines = []
    dry = dry_run(cfg, log=lines.append)  # the dry run says what the run will simulate
    spec = prepared_config(cfg)
    plan, n_train = spec.plan, spec.data_stats["parameters_trainable"]
    assert dry["epsilon"] is None and dry["budget"] is None
    assert dry["noise_multiplier"] == plan.noise_multiplier
    assert any(x.startswith("dry run: simulated DP on data declared public") and
               f"for {PRIVATE_UNITS} units); no ε, no ledger" in x for x in lines), lines
    direct = make_plan(dataset_size=PRIVATE_UNITS, expected_batch_size=8, max_grad_norm=0.5, steps=6,
                       delta=1e-4, target_epsilon=4.0, accountant="rdp", noise_coordinates=n_train)
    assert plan.noise_multiplier == direct.noise_multiplier and plan.noise_multiplier > 0.3
    from llmdp.data.store import open_store

    proxy_n = open_store(spec.paths.store_dir).num_units  # the proxy corpus's own units
    assert plan.dataset_size == proxy_n < PRIVATE_UNITS
    assert plan.sampling_probability == pytest.approx(8 / plan.dataset_size, rel=1e-15)
    assert (plan.max_grad_norm, plan.expected_batch_size, plan.steps) == (0.5, 8.0, 6)
    assert spec.dp and spec.simulated and spec.ledger is None and spec.dataset_ledger is None
    assert spec.eval_plan is None and spec.prior_releases == ()

    # Without simulate_units the private run is this corpus's own: with DP evaluations in
    # the private recipe (their ε is part of the target), σ is the private recipe's to the bit.
    raw = simulated_raw(tmp_path, name="sim2")
    raw["data"]["eval"] = {"fraction": 0.2}
    raw["eval"] = {"epsilon": 0.5, "allow_noisy": True}
    sim = prepared_config(recipe_from_dict(raw))
    # (before the private run is prepared: after it, the data is recorded as private and
    # its declaration as public is refused)
    raw3 = simulated_raw(tmp_path, name="sim3")
    raw3["data"]["eval"] = {"fraction": 0.2}  # the same units, no DP evaluation
    alone = prepared_config(recipe_from_dict(raw3))
    priv = to_dict(dp_recipe(tmp_path, name="private"))
    priv["privacy"] = {k: v for k, v in raw["privacy"].items() if k != "simulate"}
    priv["data"]["eval"], priv["eval"], priv["optim"] = {"fraction": 0.2}, raw["eval"], raw["optim"]
    real = prepared_config(recipe_from_dict(priv))
    assert real.eval_plan is not None and sim.eval_plan is None  # the simulation runs none
    # the data is now recorded as private: a simulation on it would escape its ledger
    with pytest.raises(ConfigError, match=r"data.public: true, but .* is recorded as private data"):
        prepared_config(recipe_from_dict({**raw3, "output": {**raw3["output"], "name": "sim4"}}))
    assert sim.plan.noise_multiplier == real.plan.noise_multiplier
    assert sim.plan.dataset_size == real.plan.dataset_size
    # the evaluations' share of ε makes the private run's σ larger than training alone's
    assert alone.plan.dataset_size == sim.plan.dataset_size
    assert sim.plan.noise_multiplier > alone.plan.noise_multiplier


def test_a_simulated_run_adds_the_private_runs_noise_and_records_nothing(tmp_path, monkeypatch):
    from llmdp.hub.export import ExportError, export_run
    from llmdp.report.build import write_report
    from llmdp.synthetic.source import GenerateError, load_source
    from llmdp.train import privatize

    stds = []
    real = privatize.dp_noise.add_noise_

    def spy(tensors, key, std, *a, **kw):
        stds.append(std)
        return real(tensors, key, std, *a, **kw)

    monkeypatch.setattr(privatize.dp_noise, "add_noise_", spy)
    raw = simulated_raw(tmp_path, simulate_units=PRIVATE_UNITS)
    raw["data"]["eval"] = {"fraction": 0.2}
    spec = prepared_config(recipe_from_dict(raw))
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
    rep = write_report(spec.run_dir)
    sigma = spec.plan.noise_multiplier
    assert stds == [sigma * 0.5] * 6  # σC, once per step: the private run's noise
    metrics = [json.loads(x) for x in open(spec.paths.metrics, encoding="utf-8")]
    steps = [m for m in metrics if "step" in m and "train_loss" in m]
    assert len(steps) == 6 and all("worker0_clipped_fraction" in m for m in steps)  # clipped

    assert not os.path.exists(tmp_path / "ledgers.sqlite")  # no database, nothing spent
    assert not os.path.exists(os.path.join(spec.run_dir, "ledger.jsonl"))
    info = json.load(open(os.path.join(spec.run_dir, "plan.json"), encoding="utf-8"))
    assert info["epsilon_planned"] is None and info["epsilon_planned_training_only"] is None
    assert info["simulated"] == {
        "private_units": PRIVATE_UNITS, "target_epsilon": 4.0, "noise_multiplier": sigma,
        "max_grad_norm": 0.5, "expected_batch_size": 8.0, "steps": 6, "mechanism": "dp-sgd",
        "noise_std_per_step": sigma * 0.5 / 8}
    assert rep["epsilon"] is None and rep["dp"] is False and rep["simulated"] == info["simulated"]
    assert rep["noise_multiplier"] == sigma and rep["evaluation"]["internal"]
    md = open(os.path.join(spec.run_dir, "privacy_report.md"), encoding="utf-8").read()
    assert md.startswith("DECLARED PUBLIC DATA") and "| Privacy | none: simulated DP" in md
    # its first line says how it trained: the noise simulated, not "without DP"
    for first in (md.splitlines()[0], info["declared_public"], rep["banner"]):
        assert "trained with a private run's DP noise simulated" in first
        assert "trained without DP" not in first
    assert f"the σ of a private run of {PRIVATE_UNITS} units at privacy.target_epsilon = 4" in md
    with pytest.raises(ExportError, match=r"is a simulated run \(privacy.simulate: true\)"):
        export_run(spec.run_dir, tmp_path / "export", log=lambda *a: None)
    with pytest.raises(GenerateError, match=r"privacy.simulate is true"):
        load_source(spec.run_dir)


def test_a_simulated_sweep_tunes_for_the_private_noise_and_says_so_in_the_private_report(tmp_path):
    import yaml

    from llmdp.report.build import build_report
    from llmdp.tune.sweep import run_sweep

    raw = simulated_raw(tmp_path, simulate_units=PRIVATE_UNITS)
    raw["data"]["eval"] = {"fraction": 0.2}
    best = tmp_path / "tuned" / "best.yaml"
    lines = []
    state = run_sweep(recipe_from_dict(raw), ["optim.lr=0.05,0.5"], log=lines.append,
                      run_trial=_in_process(tmp_path), write_best=str(best))
    assert not os.path.exists(tmp_path / "ledgers.sqlite")
    assert "2 simulated-DP trial(s)" in lines[1] and state["simulated"] is True
    assert state["privacy"].startswith("none: every trial ran the DP mechanism of the private run")
    sims = [t["simulated"] for t in state["trials"]]
    assert sims[0] == sims[1] and sims[0]["private_units"] == PRIVATE_UNITS
    doc = yaml.safe_load(best.read_text(encoding="utf-8"))
    assert doc["simulated_noise"] == sims[0] and doc["epsilon"] == 0.0

    priv = to_dict(dp_recipe(tmp_path, name="tuned"))
    priv["train"]["hyperparameters_from"] = "tuned/best.yaml"
    del priv["optim"]["lr"]
    spec = prepared_config(recipe_from_dict(priv, base_dir=tmp_path))
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt-tuned")))
    note = build_report(spec.run_dir)["hyperparameters"]
    assert note["simulated_noise"] == sims[0]
    assert (f"each trial with the DP noise of a private run simulated (σ = "
            f"{sims[0]['noise_multiplier']:.4g}, σC/B = {sims[0]['noise_std_per_step']:.4g}), at "
            f"zero privacy cost") in note["note"]
