"""`llmdp train RECIPE --dry-run` (issue 51): the plan of the run the same command would
make (N, q, σ, T, ε at δ, the truncation, the DP evaluation's noise, the budget), with no
ledger entry, no hold and no run folder; its N, σ and ε are the real run's."""

from __future__ import annotations

import json
import math
import os

import pytest

from llmdp.cli import main
from tests.cli.test_bad_input import ledger_rows
from tests.helpers import TINY_MODEL_YAML, tiny_tokenizer_dir, write_notes

RECIPE = TINY_MODEL_YAML + """data: {{path: notes.jsonl, sequence_length: 16, unit: user,
       user_field: user_id, max_rows_per_unit: 1, eval: {{fraction: 0.2}}}}
privacy: {{target_epsilon: 4.0, max_grad_norm: 0.5, delta: 1.0e-3, budget_epsilon: 20.0}}
optim: {{name: sgd, lr: 0.5, schedule: constant}}
train: {{expected_batch_size: 4, steps: 3, physical_batch_size: 4, checkpoint_every: 3,
        eval_every: 3}}
eval: {{epsilon: 0.5, loss_bound: 8.0, allow_noisy: true, prompts: []}}
scaling: {{num_workers: 1, cpus_per_worker: 1}}
output: {{dir: runs, name: dry}}
"""


@pytest.fixture()
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    write_notes(tmp_path / "notes.jsonl", 60)
    (tmp_path / "r.yaml").write_text(RECIPE.format(tok=tiny_tokenizer_dir()))
    return "r.yaml"


def _dry(recipe, capsys, *overrides) -> tuple[dict, str]:
    from llmdp.config.schema import load_recipe
    from llmdp.run.preflight import dry_run

    lines: list[str] = []
    out = dry_run(load_recipe(recipe, list(overrides)), log=lines.append)
    return out, "\n".join(lines)


def test_a_dry_run_plans_without_a_trace(tmp_path, recipe, capsys):
    """Through the command line: exit 0, the plan printed, nothing written but the caches."""
    assert main(["train", recipe, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dry run: N=" in text and "sigma=" in text and "epsilon=" in text, text
    assert "truncation: " in text and "budget: " in text and "DP evaluation: " in text, text
    assert "memory per worker: about " in text, text
    assert ledger_rows() is None  # no dataset ledger started, nothing held or recorded
    assert not os.path.exists(tmp_path / "runs" / "dry")
    assert not os.path.exists(tmp_path / "runs" / ".dry.lock")


def test_a_dry_run_says_what_the_run_will_be(tmp_path, recipe, capsys):
    """The dry run's N, q, σ, T, ε are prepare's (the launch's planning, before Ray), its
    truncation counts say every user was cut (a user's notes are longer than one row of 16
    tokens), and its budget line is the dataset's."""
    from llmdp.config.schema import load_recipe
    from llmdp.run.launch import prepare

    out, text = _dry(recipe, capsys)
    n = out["dataset_size"]
    t = out["truncation"]
    assert t["unit_kind"] == "user" and t["units"] >= n and 0.5 < t["share"] < 1, t
    assert f"truncation: {t['units']} users are longer than data.max_rows_per_unit=1" in text
    assert "Raise data.max_rows_per_unit" in text
    assert out["dp_eval_std"] is not None and out["dp_eval_std"]["loss"] > 0
    assert out["budget"]["budget_epsilon"] == 20.0 and out["budget"]["epsilon_spent"] == 0.0
    assert math.isclose(out["budget"]["epsilon_after_run"], out["epsilon"], rel_tol=1e-6)
    assert ledger_rows() is None
    spec = prepare(load_recipe(recipe, []), log=lambda *a: None)  # writes the run folder
    assert n == spec.plan.dataset_size and out["steps"] == spec.plan.steps
    assert out["noise_multiplier"] == spec.plan.noise_multiplier
    assert out["sampling_probability"] == spec.plan.sampling_probability
    assert out["epsilon"] == spec.epsilon_planned and out["delta"] == spec.plan.delta


def test_a_dry_run_names_hyperparameters_chosen_at_zero_epsilon(tmp_path, recipe, capsys):
    """A recipe that takes its hyper-parameters from a public sweep's file says, before it
    runs, which values and where they came from (the demo's does: its lr); one without says
    nothing of it."""
    from llmdp.tune.public import write_best_file

    best = {"name": "pub-trial-1", "point": ["optim.lr=0.25"], "held_out_loss": 2.5,
            "simulated": {"noise_multiplier": 0.63, "noise_std_per_step": 0.0025}}
    write_best_file("tuned.yaml", best, {"source": "<local>/public.jsonl",
                                         "selection": "lowest"}, "pub")
    out, text = _dry(recipe, capsys, "train.hyperparameters_from=tuned.yaml", "optim.lr=0.25")
    assert out["hyperparameters"]["values"] == {"optim.lr": 0.25}
    assert ("hyper-parameters: hyper-parameters optim.lr=0.25 were chosen by the sweep 'pub' on "
            "data declared public (<local>/public.jsonl), each trial with the DP noise of a "
            "private run simulated (σ = 0.63, σC/B = 0.0025), at zero privacy cost") in text
    out, text = _dry(recipe, capsys)
    assert "hyperparameters" not in out and "hyper-parameters" not in text


def test_a_dry_run_counts_what_the_dataset_has_spent(tmp_path, recipe, capsys):
    """After a run's steps are in the dataset ledger, the dry run of another run on it
    states what was spent and what would be left, still reading the ledger only."""
    from llmdp.config.schema import load_recipe
    from llmdp.run.launch import prepare
    from tests.helpers import simulate_steps

    spec = prepare(load_recipe(recipe, ["output.name=first"]), log=lambda *a: None)
    from llmdp.run.launch import check_budget

    check_budget(spec.ledger, spec.plan, remaining=spec.plan.steps, resuming=False,
                 log=lambda *a: None)
    simulate_steps(spec)
    rows = ledger_rows()
    out, text = _dry(recipe, capsys)
    b = out["budget"]
    assert ledger_rows() == rows
    assert 0 < b["epsilon_spent"] < b["epsilon_after_run"] <= 20.0
    assert math.isclose(b["epsilon_left"], 20.0 - b["epsilon_spent"])
    assert f"has spent ε = {b['epsilon_spent']:.4f} of its budget 20" in text, text


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_the_dry_run_is_the_real_run(tmp_path, recipe, capsys):
    """A tiny real run on Ray: its report's N, σ and ε are the dry run's, and its launch
    prints the same truncation line. On a Ray that outlives it, the run starts Ray Train's
    placement-group cleaner, and never the actor for Ray Datasets it does not use; on a
    local Ray (the tests' shared one is started as a launch starts its own) nor the
    preemption watcher."""
    import ray._private.state as ray_state

    out, text = _dry(recipe, capsys)
    capsys.readouterr()
    before = set(ray_state.actors())
    assert main(["train", recipe]) == 0
    started = {a["ActorClassName"] for k, a in ray_state.actors().items() if k not in before}
    assert {"RayTrainWorker", "LedgerService", "PlacementGroupCleaner"} <= started, started
    assert not started & {"DatasetManager", "PreemptionWatcher"}, started
    printed = capsys.readouterr().out
    trunc = next(x for x in text.splitlines() if x.startswith("truncation: "))
    assert trunc in printed, printed
    rep = json.load(open(tmp_path / "runs" / "dry" / "privacy_report.json"))
    assert rep["status"] == "complete"
    assert rep["dataset_size"] == out["dataset_size"]
    assert rep["noise_multiplier"] == out["noise_multiplier"]
    assert math.isclose(rep["epsilon"], out["epsilon"], rel_tol=1e-6), (rep["epsilon"], out["epsilon"])
    assert rep["delta"] == out["delta"]
