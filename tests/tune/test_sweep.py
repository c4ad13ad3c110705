"""`llmdp sweep`: the grid, the random draw, the sweep's cost against dp-accounting called
directly, the budget refusal before any trial, and the selection by DP evaluation only.

Trials are run by an injected runner that writes a report (no Ray); planning is the real
`planning.plan_run` on a tiny model. The end-to-end test on Ray is marked slow."""

from __future__ import annotations

import json
import math
import pathlib
import random
import re

import dp_accounting
import pytest
import yaml
from dp_accounting import dp_event

from llmdp.cli import main
from llmdp.config.schema import ConfigError, SweepConfig, recipe_from_dict
from llmdp.privacy.accounting.accountant import RDP_ORDERS
from llmdp.privacy.accounting.events import event_to_json
from llmdp.privacy.ledger.service import BudgetError, LedgerService
from llmdp.tune.cost import sweep_cost
from llmdp.tune.grid import draw_random_trials, resolve_sweep
from llmdp.tune.sweep import SWEEP_JSON, run_sweep, select_trial
from tests.helpers import TINY_MODEL_YAML, tiny_tokenizer_dir, write_notes

REL = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
DELTA = 1e-4


def raw_recipe(tmp_path, **sections):
    notes = tmp_path / "notes.jsonl"
    if not notes.exists():
        write_notes(notes, 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(notes), "sequence_length": 24, "dataset_id": "notes",
                 "eval": {"fraction": 0.2}},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": DELTA,
                    "ledger": str(tmp_path / "ledger.sqlite")},
        "eval": {"noise_multiplier": 4.0},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 2},
        "output": {"dir": str(tmp_path / "runs"), "name": "sw"},
    }
    for name, values in sections.items():
        if values is None:
            raw.pop(name, None)
        else:
            raw[name] = {**raw.get(name, {}), **values}
    return raw


def recipe(tmp_path, **sections):
    return recipe_from_dict(raw_recipe(tmp_path, **sections))


UNIT = {"unit": {"kind": "sequence", "sequence_length": 24, "max_rows_per_unit": 1,
                 "document_masking": False, "user_field": None}}
TRIAL_STEP = dp_accounting.PoissonSampledDpEvent(0.03, dp_accounting.GaussianDpEvent(1.2))


class FakeTrials:
    """A trial runner without Ray: it records its releases in the dataset ledger and the
    trial's ledger.jsonl through a `LedgerService` (6 steps of ``TRIAL_STEP``), writes
    plan.json (with ``prior`` as its earlier releases), the report with its evaluation
    sections, model/, and records every call; a finished trial is not run again (like
    `trainer.run`). ``metrics[lr] = (internal loss, DP eval loss)``."""

    def __init__(self, metrics: dict | None = None, prior: list | None = None):
        self.metrics = metrics or {}
        self.prior = prior or []
        self.calls: list[tuple[str, float]] = []

    def __call__(self, cfg, log=print):
        assert cfg.sweep is None
        self.calls.append((cfg.output.name, cfg.optim.lr))
        d = pathlib.Path(cfg.run_dir)
        if (d / "privacy_report.json").exists():
            return str(d)  # already complete
        internal, dp, *std = self.metrics.get(cfg.optim.lr, (2.0, 2.0))
        std = std[0] if std else 0.1
        (d / "model").mkdir(parents=True, exist_ok=True)
        svc = LedgerService(location=cfg.privacy.ledger, dataset_id=cfg.data.dataset_id,
                            run_ledger=str(d / "ledger.jsonl"), run_id=cfg.output.name, meta=UNIT,
                            block_size=6, total_steps=6, event_json=event_to_json(TRIAL_STEP),
                            delta=DELTA, accountant="pld")
        svc.ensure(0)
        svc.db.close()
        (d / "plan.json").write_text(json.dumps({"run_id": cfg.output.name, "plan": {},
                                                 "prior_releases": self.prior}))
        (d / "privacy_report.json").write_text(json.dumps({
            "status": "complete", "epsilon": 1.5, "delta": DELTA, "steps_completed": 6,
            "evaluation": {
                "internal": [{"step": 6, "loss": internal, "perplexity": math.exp(internal),
                              "accuracy": 0.5, "units": 10}],
                "dp": [{"step": 3, "loss": 0.0, "loss_std": 0.1},  # not the last: never read
                       {"step": 6, "loss": dp, "loss_std": std, "accuracy": 0.4,
                        "accuracy_std": 0.02, "count": 10.3, "noise_multiplier": 4.0}]}}))
        return str(d)


def never(*a, **k):
    raise AssertionError("must not be called")


# ---------------------------------------------------------------------- the grid
def test_grid_is_the_cartesian_product_of_values_read_as_yaml():
    spec = resolve_sweep(None, ["optim.lr=0.001,0.5", "eval.steps=[1,2],[3]",
                                "privacy.clipping_mode='two-pass',auto"])
    assert [a.values for a in spec.axes] == [(0.001, 0.5), ([1, 2], [3]), ("two-pass", "auto")]
    points = spec.points()
    assert len(points) == 8 and len(set(points)) == 8
    assert points[0] == ("optim.lr=0.001", "eval.steps=[1,2]", "privacy.clipping_mode='two-pass'")
    assert points[-1] == ("optim.lr=0.5", "eval.steps=[3]", "privacy.clipping_mode=auto")
    assert points[1] == ("optim.lr=0.001", "eval.steps=[1,2]", "privacy.clipping_mode=auto")


def test_command_line_entries_replace_the_recipes_entry_for_their_key():
    section = SweepConfig(grid=("optim.lr=1,2", "train.steps=4,5"))
    spec = resolve_sweep(section, ["optim.lr=3", "optim.weight_decay=0,0.1"])
    assert [(a.key, a.values) for a in spec.axes] == [
        ("optim.lr", (3,)), ("train.steps", (4, 5)), ("optim.weight_decay", (0, 0.1))]
    assert spec.axes[0].where == "--grid 'optim.lr=3'" and spec.axes[1].where == "sweep.grid[1]"
    assert len(spec.points()) == 4


@pytest.mark.parametrize("entry,words", [
    ("optim.lr", ["--grid 'optim.lr'", "key=v1,v2"]),
    ("optim.lr=", ["--grid 'optim.lr='", "key=v1,v2"]),
    ("optim.lr=1,,2", ["--grid 'optim.lr=1,,2'", "empty value"]),
    ("optim.nope=1,2", ["--grid 'optim.nope=1,2'", "optim.nope"]),
    ("output.name=a,b", ["--grid 'output.name=a,b'", "cannot be swept"]),
    ("optim.lr=0.1,0.1", ["--grid 'optim.lr=0.1,0.1'", "listed twice"]),
    ("optim.lr=[1,2", ["--grid 'optim.lr=[1,2'", "not valid YAML"]),
])
def test_bad_grid_entries_name_the_flag(entry, words):
    with pytest.raises(ConfigError) as e:
        resolve_sweep(None, [entry])
    for w in words:
        assert w in str(e.value)


def test_bad_sweep_settings_name_the_key_or_the_flag():
    with pytest.raises(ConfigError, match=r"sweep\.grid\[1\].*listed twice"):
        resolve_sweep(SweepConfig(grid=("optim.lr=1,2", "train.steps=3,3")))
    with pytest.raises(ConfigError, match="--trials random needs --mean-trials"):
        resolve_sweep(None, ["optim.lr=1,2"], trials="random")
    with pytest.raises(ConfigError, match="--mean-trials 0.5.*>= 1"):
        resolve_sweep(None, ["optim.lr=1,2"], trials="random", mean_trials=0.5)
    with pytest.raises(ConfigError, match="--mean-trials 3: only used with random"):
        resolve_sweep(None, ["optim.lr=1,2"], mean_trials=3)
    with pytest.raises(ConfigError, match="no grid to try"):
        resolve_sweep(None, [])
    # a random search of one configuration (repetitions) is allowed
    assert resolve_sweep(None, [], trials="random", mean_trials=2).points() == [()]


def test_a_bad_value_names_its_grid_point_before_anything_runs(tmp_path):
    cfg = recipe(tmp_path)
    with pytest.raises(ConfigError, match=r"grid point \(optim.lr=-1\).*optim.lr"):
        run_sweep(cfg, ["optim.lr=0.1,-1"], log=lambda *a: None, run_trial=never, plan_trial=never)


def test_every_trial_needs_a_dp_evaluation(tmp_path):
    with pytest.raises(ConfigError, match="eval.epsilon: not set in the recipe.*DP evaluation"):
        run_sweep(recipe(tmp_path, eval=None), ["optim.lr=0.1,0.2"], log=lambda *a: None,
                  run_trial=never, plan_trial=never)
    # one grid point that switches it off is named
    cfg = recipe(tmp_path, eval={"epsilon": 0.5, "noise_multiplier": None})
    with pytest.raises(ConfigError, match=r"grid point \(eval.epsilon=null\)"):
        run_sweep(cfg, ["eval.epsilon=0.5,null"], log=lambda *a: None, run_trial=never,
                  plan_trial=never)
    with pytest.raises(ConfigError, match="privacy.dp: false"):
        run_sweep(recipe(tmp_path), ["privacy.dp=true,false"], log=lambda *a: None,
                  run_trial=never, plan_trial=never)


def test_a_seeded_sweep_is_refused(tmp_path):
    """Issue 49 item 6: sweep.md states bounds (a)/(b) over every trial's model; with a seed
    in the recipe whoever knows it recomputes every trial's noise, so no bound holds: a
    sweep's trials draw from the OS (a seeded run is for tests and reproducing one run)."""
    cfg = recipe(tmp_path, privacy={"rng": "seeded", "seed": 3})
    with pytest.raises(ConfigError, match=r"privacy.rng: seeded in the recipe.*privacy.rng: secure"):
        run_sweep(cfg, ["optim.lr=0.1,0.2"], log=lambda *a: None, run_trial=never, plan_trial=never)
    with pytest.raises(ConfigError, match=r"privacy.rng: seeded in the grid point"):
        run_sweep(recipe(tmp_path), ["privacy.rng=seeded", "privacy.seed=3", "optim.lr=0.1,0.2"],
                  log=lambda *a: None, run_trial=never, plan_trial=never)


def test_cli_errors_name_the_flag(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw_recipe(tmp_path)))
    assert main(["sweep", str(path), "--grid", "optim.nope=1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmdp: error: --grid 'optim.nope=1,2'") and "optim.nope" in err
    assert main(["sweep", str(path), "--grid", "optim.lr=1,2", "--trials", "random"]) == 2
    assert "--mean-trials" in capsys.readouterr().err


# ---------------------------------------------------------------------- the cost
STEP = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1))
EVAL = dp_accounting.GaussianDpEvent(6.0)
TOKENIZER = dp_accounting.GaussianDpEvent(4.0)


def pld_epsilon(event, delta=DELTA):
    acc = dp_accounting.pld.PLDAccountant(REL, value_discretization_interval=1e-4)
    return acc.compose(event).get_epsilon(delta)


def test_composition_equals_dp_accounting_with_earlier_releases_once():
    trials = [[(STEP, 50), (EVAL, 1)], [(STEP, 50), (EVAL, 1)], [(STEP, 30), (EVAL, 1)]]
    cost = sweep_cost(trials, [(TOKENIZER, 1)], DELTA, "pld")
    direct = pld_epsilon(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(STEP, 130), dp_accounting.SelfComposedDpEvent(EVAL, 3),
        TOKENIZER]))
    assert cost["composition"]["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert cost["repeat_and_select"] is None and cost["composition"]["trials"] == 3
    # the tokenizer once, not per trial: composing it three times is measurably larger
    per_trial = pld_epsilon(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(STEP, 130), dp_accounting.SelfComposedDpEvent(EVAL, 3),
        dp_accounting.SelfComposedDpEvent(TOKENIZER, 3)]))
    assert per_trial > direct * 1.01
    # and every trial counts: two trials are measurably cheaper
    assert sweep_cost(trials[:2], [(TOKENIZER, 1)], DELTA)["composition"]["epsilon"] < direct / 1.01


def test_composition_with_a_thresholded_earlier_release():
    d_thr = 1e-6
    cost = sweep_cost([[(STEP, 50)]] * 2, [(TOKENIZER, 1)], DELTA, "pld",
                      prior_delta_threshold=d_thr)
    event = dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(STEP, 100), TOKENIZER])
    direct = pld_epsilon(event, DELTA - d_thr) - math.log1p(-d_thr)
    assert cost["composition"]["epsilon"] == pytest.approx(direct, rel=1e-6)


@pytest.mark.parametrize("shape", [math.inf, 1.0])
def test_random_search_equals_rdp_repeat_and_select(shape):
    one = [(STEP, 50), (EVAL, 1)]
    cost = sweep_cost([one, one], [(TOKENIZER, 1)], DELTA, "pld", random=(3.0, shape))
    rs = cost["repeat_and_select"]
    acc = dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=REL)
    acc.compose(TOKENIZER)
    acc.compose(dp_event.RepeatAndSelectDpEvent(dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(STEP, 50), dp_accounting.SelfComposedDpEvent(EVAL, 1)]),
        3.0, shape))
    assert rs["epsilon"] == pytest.approx(acc.get_epsilon(DELTA), rel=1e-6)
    assert rs["accountant"] == "rdp" and "ONLY the selected trial" in rs["covers"]
    assert rs["distribution"] == ("poisson" if math.isinf(shape) else "geometric")
    other = sweep_cost([one], [(TOKENIZER, 1)], DELTA, random=(3.0, 1.0 if math.isinf(shape) else math.inf))
    assert abs(other["repeat_and_select"]["epsilon"] - rs["epsilon"]) > 1e-3  # the shape matters


def test_random_search_of_trials_with_truncated_sampling_is_refused():
    trunc = dp_accounting.TruncatedSubsampledGaussianDpEvent(1001, 0.02, 40, 1.1)
    with pytest.raises(ConfigError, match="truncated"):
        sweep_cost([[(trunc, 10)]], [], DELTA, "pld", random=(2.0, math.inf))
    assert sweep_cost([[(trunc, 10)]], [], DELTA, "pld")["composition"]["epsilon"] > 0


def test_random_sweep_whose_grid_changes_the_releases_is_refused(tmp_path):
    cfg = recipe(tmp_path)
    runner = FakeTrials()
    with pytest.raises(ConfigError, match=r"same DP releases.*train.steps=4.*train.steps=6"):
        run_sweep(cfg, ["train.steps=4,6"], trials="random", mean_trials=2, log=lambda *a: None,
                  run_trial=runner, rng=random.Random(0))
    assert runner.calls == []
    assert not (tmp_path / "runs" / "sw-sweep" / SWEEP_JSON).exists()


# ---------------------------------------------------------------------- budget
def test_budget_refusal_happens_before_any_trial(tmp_path):
    cfg_raw = raw_recipe(tmp_path)
    # Earlier releases on the same dataset and unit, written by a ledger service.
    earlier = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(0.9))
    svc = LedgerService(location=cfg_raw["privacy"]["ledger"], dataset_id="notes",
                        run_ledger=str(tmp_path / "earlier" / "ledger.jsonl"), run_id="earlier",
                        meta=UNIT, block_size=40, total_steps=40,
                        event_json=event_to_json(earlier), delta=DELTA, accountant="pld")
    svc.ensure(0)
    svc.db.close()
    spent = pld_epsilon(dp_accounting.SelfComposedDpEvent(earlier, 40))

    runner = FakeTrials()
    tight = recipe(tmp_path, privacy={"budget_epsilon": spent * 1.001})
    with pytest.raises(BudgetError) as e:
        run_sweep(tight, ["optim.lr=0.01,0.02"], log=lambda *a: None, run_trial=runner)
    msg = str(e.value)
    assert runner.calls == [] and "No trial was run" in msg
    assert f"ε = {spent:.4f}" in msg and "2 trial(s)" in msg and f"{spent * 1.001:g}" in msg
    assert not (tmp_path / "runs" / "sw-trial-0").exists()

    # The same sweep with room for it starts its trials (the refusal above was the budget's).
    roomy = recipe(tmp_path, privacy={"budget_epsilon": spent + 20})
    state = run_sweep(roomy, ["optim.lr=0.01,0.02"], log=lambda *a: None, run_trial=runner)
    assert [n for n, _ in runner.calls] == ["sw-trial-0", "sw-trial-1"]
    (b,) = state["budget"].values()
    # at the δ the trials' ledger services check at: δ less their noise tails
    assert 0.9 * DELTA < b["delta"] < DELTA
    assert b["epsilon_spent"] == pytest.approx(
        pld_epsilon(dp_accounting.SelfComposedDpEvent(earlier, 40), b["delta"]), rel=1e-9)
    assert spent < b["epsilon_with_sweep"] <= spent + 20


# ---------------------------------------------------------------------- selection
def test_selection_reads_only_the_dp_evaluation(tmp_path):
    # lr 0.01 has the best internal (non-DP) loss, lr 0.02 the best DP eval loss.
    runner = FakeTrials({0.01: (1.0, 3.0), 0.02: (2.0, 2.5), 0.03: (1.5, 2.9)})
    state = run_sweep(recipe(tmp_path), ["optim.lr=0.01,0.02,0.03"], log=lambda *a: None,
                      run_trial=runner)
    assert runner.calls == [("sw-trial-0", 0.01), ("sw-trial-1", 0.02), ("sw-trial-2", 0.03)]
    sel = state["selected"]
    assert sel["name"] == "sw-trial-1" and sel["overrides"] == ["optim.lr=0.02"]
    assert sel["dp_eval"]["loss"] == 2.5 and sel["dp_eval"]["loss_std"] == 0.1
    saved = json.loads((tmp_path / "runs" / "sw-sweep" / SWEEP_JSON).read_text())
    assert saved["selected"]["name"] == "sw-trial-1" and saved["status"] == "complete"
    assert [t["epsilon"] for t in saved["trials"]] == [1.5] * 3
    md = (tmp_path / "runs" / "sw-sweep" / "sweep.md").read_text()
    assert "**Selected:** trial 1 (optim.lr=0.02)" in md and "2.5000 ± 0.1000" in md
    assert "(a) every trial composed" in md and "(b)" not in md


def test_a_sweep_does_not_select_on_noise(tmp_path):
    """Issue 30 item 3, end to end: trials whose DP losses differ by less than their std are
    not selected between; the console and sweep.md say why."""
    runner = FakeTrials({0.01: (1.0, 5.19, 2.94), 0.02: (2.0, 8.0, 3.47)})
    lines = []
    state = run_sweep(recipe(tmp_path), ["optim.lr=0.01,0.02"], log=lines.append, run_trial=runner)
    assert state["selected"] is None and "made by the noise" in state["selection_refused"]
    assert any(x.startswith("no trial selected: ") for x in lines), lines
    md = (tmp_path / "runs" / "sw-sweep" / "sweep.md").read_text()
    assert "**Selected:** none: the trials' DP evaluation losses span 2.81" in md


def test_the_cost_composes_every_trials_ledger_and_the_tokenizer_once(tmp_path):
    d_thr = 1e-7
    tokenizer = {"event": event_to_json(TOKENIZER), "count": 1, "release_id": "tok1",
                 "run_id": "tokenizer-tok1", "extra": {"delta_threshold": d_thr}}
    runner = FakeTrials(prior=[tokenizer])  # every trial builds on the same private tokenizer
    plans = []

    def plan_trial(c, log=print):
        from llmdp.run.planning import plan_run

        plans.append(plan_run(c, log=log))
        return plans[-1]

    state = run_sweep(recipe(tmp_path), ["optim.lr=0.01,0.02,0.03"], log=lambda *a: None,
                      run_trial=runner, plan_trial=plan_trial)
    # δ less the three trials' noise tails (18 steps at the plan's σ and parameter count;
    # the fake trials record no DP evaluation): item 8 of issue 29 for the sweep's bound (a).
    from llmdp.privacy.noise.tail import truncation_delta_per_step

    k, sigma = plans[0].plan.noise_coordinates, plans[0].plan.noise_multiplier
    d_acc = (DELTA - 18 * truncation_delta_per_step(k, sigma)) * (1 - 18 * k * 2.0**-106)
    assert state["cost"]["composition"]["delta_accountant"] == pytest.approx(d_acc, rel=1e-12)
    event = dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(TRIAL_STEP, 18),
                                           TOKENIZER])
    direct = pld_epsilon(event, d_acc - d_thr) - math.log1p(-d_thr)
    assert state["cost"]["composition"]["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert state["cost"]["delta"] == DELTA
    assert [r["release_id"] for r in state["earlier_releases"]] == ["tok1"]


def test_select_trial_skips_trials_without_a_dp_evaluation():
    rows = [{"trial": 0, "dp_eval": None}, {"trial": 1, "dp_eval": {"loss": float("nan")}},
            {"trial": 2, "dp_eval": {"loss": 3.0}}, {"trial": 3, "dp_eval": {"loss": 3.0}}]
    assert select_trial(rows)["trial"] == 2
    assert select_trial(rows[:2]) is None


# ---------------------------------------------------------------------- random draw
def test_the_draw_is_reproducible_only_with_an_injected_generator(monkeypatch):
    a = [draw_random_trials(3, "poisson", 5, random.Random(s)) for s in range(20)]
    assert a == [draw_random_trials(3, "poisson", 5, random.Random(s)) for s in range(20)]
    made = []

    class Recording(random.Random):
        def __init__(self, *args):
            made.append(args)
            super().__init__(1)

    monkeypatch.setattr("llmdp.tune.grid._random.SystemRandom", Recording)
    draw_random_trials(3, "geometric", 5)
    assert made == [()]  # no seed: OS entropy (SystemRandom)


@pytest.mark.parametrize("dist", ["poisson", "geometric"])
def test_the_number_of_trials_has_the_accounted_distribution(dist):
    # 4000 draws of K with mean 3: the sample mean's std is sqrt(3/4000) = 0.027 (Poisson)
    # and sqrt(6/4000) = 0.039 (geometric); tolerances are > 5 of them.
    rng = random.Random(12345)
    ks = [len(draw_random_trials(3, dist, 4, rng)) for _ in range(4000)]
    assert sum(ks) / len(ks) == pytest.approx(3.0, abs=0.2)
    if dist == "poisson":  # P(K = 0) = e^-3 = 0.0498 (std of the frequency 0.0034)
        assert ks.count(0) / len(ks) == pytest.approx(math.exp(-3), abs=0.02)
    else:  # geometric on 1, 2, ...: P(K = 1) = 1/3 (std 0.0075)
        assert min(ks) == 1 and ks.count(1) / len(ks) == pytest.approx(1 / 3, abs=0.04)
    points = [p for _ in range(500) for p in draw_random_trials(3, dist, 4, rng)]
    for j in range(4):  # uniform grid points: 1/4 each (std < 0.011)
        assert points.count(j) / len(points) == pytest.approx(0.25, abs=0.06)


class Exploding(random.Random):
    def random(self):
        raise AssertionError("a resumed sweep must not draw again")

    def expovariate(self, *a):
        raise AssertionError("a resumed sweep must not draw again")


def test_the_draw_is_persisted_and_a_rerun_resumes_it(tmp_path):
    cfg = recipe(tmp_path)
    grid = ["optim.lr=0.01,0.02,0.03"]
    runner = FakeTrials()
    first = run_sweep(cfg, grid, trials="random", mean_trials=3, distribution="geometric",
                      log=lambda *a: None, run_trial=runner, rng=random.Random(4))
    k = first["draw"]["K"]
    assert k == len(first["trial_points"]) >= 1 and "tests only" in first["draw"]["entropy"]
    names = first["trial_names"]  # random ids: a name does not say how many trials ran
    assert len(set(names)) == k and all(re.fullmatch(r"sw-trial-[0-9a-f]{8}", n) for n in names)
    assert [n for n, _ in runner.calls] == names
    lrs = [0.01, 0.02, 0.03]
    assert [lr for _, lr in runner.calls] == [lrs[j] for j in first["trial_points"]]
    rs = first["cost"]["repeat_and_select"]
    assert rs["mean_trials"] == 3 and rs["shape"] == 1.0 and rs["epsilon"] > 0

    runner.calls.clear()
    again = run_sweep(cfg, grid, trials="random", mean_trials=3, distribution="geometric",
                      log=lambda *a: None, run_trial=runner, rng=Exploding())
    assert again["trial_points"] == first["trial_points"] and again["draw"] == first["draw"]
    assert again["trial_names"] == names and [n for n, _ in runner.calls] == names

    with pytest.raises(ConfigError, match="another grid"):
        run_sweep(cfg, ["optim.lr=0.01,0.02"], trials="random", mean_trials=3,
                  distribution="geometric", log=lambda *a: None, run_trial=never, rng=Exploding())


def test_a_poisson_draw_of_no_trial_runs_nothing(tmp_path):
    seed = next(s for s in range(100) if not draw_random_trials(1, "poisson", 2, random.Random(s)))
    state = run_sweep(recipe(tmp_path), ["optim.lr=0.01,0.02"], trials="random", mean_trials=1,
                      log=lambda *a: None, run_trial=never, rng=random.Random(seed))
    assert state["draw"]["K"] == 0 and state["trials"] == [] and state["trial_points"] == []
    assert state["selected"] is None and state["cost"]["composition"]["epsilon"] == 0.0
    assert state["cost"]["repeat_and_select"]["epsilon"] > 0


# ---------------------------------------------------------------------- publishing (b)
def _random_sweep(tmp_path, seed, logs):
    """A geometric random sweep of mean 3 over two points; DP eval loss 2.5 at lr 0.01 and
    3.0 at lr 0.02, so the selected trial's point is lr 0.01 whatever K (seed 1 draws K = 1
    trial at point 0, seed 6 draws K = 4 at points 0, 0, 1, 1)."""
    runner = FakeTrials({0.01: (1.0, 2.5), 0.02: (1.0, 3.0)})
    state = run_sweep(recipe(tmp_path), ["optim.lr=0.01,0.02"], trials="random", mean_trials=3,
                      distribution="geometric", log=logs.append, run_trial=runner,
                      rng=random.Random(seed))
    return state, tmp_path / "runs" / "sw-sweep"


def test_a_random_sweep_publishes_nothing_that_reveals_k(tmp_path):
    """Bound (b) holds with K hidden: sweep.md and sweep.json (the publishable part) are the
    same whatever K was drawn (K = 1 and K = 4 here) once the selected trial's random name is
    masked: no count, no per-trial line, no trial index, no bound (a), no other trial's name.
    K, every trial and (a) are in sweep.internal.{json,md}, marked internal; the console
    never prints K."""
    outputs = []
    for seed, k in ((1, 1), (6, 4)):
        logs: list[str] = []
        state, d = _random_sweep(tmp_path / f"k{k}", seed, logs)
        assert state["draw"]["K"] == k and len(state["trials"]) == k
        sel = state["selected"]
        assert sel["overrides"] == ["optim.lr=0.01"]
        texts = {f: (d / f).read_text() for f in ("sweep.json", "sweep.md")}
        for text in texts.values():
            for other in state["trial_names"]:
                assert other == sel["name"] or other not in text  # no other trial is named
            assert not re.search(r"\bK = \d|trial\(s\)|trials: \d|\| \d+ \|", text)
        pub = json.loads(texts["sweep.json"])
        assert pub["publishable"] is True and pub["bound"] == "b"
        assert "draw" not in pub and "trials" not in pub and "trial_points" not in pub
        assert "composition" not in pub["cost"] and "trial" not in pub["selected"]
        assert pub["cost"]["repeat_and_select"]["epsilon"] == state["cost"]["repeat_and_select"]["epsilon"]
        masked = {f: t.replace(sel["run_dir"], "<RUN>").replace(sel["name"], "<NAME>")
                  for f, t in texts.items()}
        outputs.append(masked)
        internal = json.loads((d / "sweep.internal.json").read_text())
        assert internal["draw"]["K"] == k and "INTERNAL" in internal["internal"].upper()
        md = (d / "sweep.internal.md").read_text()
        assert md.startswith("# Sweep sw (INTERNAL)") and "not for publication under bound (b)" in md
        assert f"K = {k} trial(s) drawn" in md
        console = "\n".join(logs)
        assert not re.search(r"\bK = \d|\d+ trial\(s\)|trial \d+ of \d+", console), console
        assert "sweep.internal.md" in console and "INTERNAL" in console
    assert outputs[0] == outputs[1]  # K = 1 and K = 4: the same publishable files


def test_when_a_is_smaller_the_internal_report_says_a_is_the_better_statement(tmp_path):
    """K = 1 trial: composing it, (a), is below the repeat-and-select bound (b). sweep.internal.md
    says (a) is the better statement and that under (a) every file may be published; the
    publishable files do not say it (which bound is smaller depends on K)."""
    state, d = _random_sweep(tmp_path, 1, [])
    a = state["cost"]["composition"]["epsilon"]
    b = state["cost"]["repeat_and_select"]["epsilon"]
    assert a < b and state["publication"]["a_is_better"]
    md = (d / "sweep.internal.md").read_text()
    assert "**(a) is the better statement here**" in md and f"ε = {a:.4f}" in md
    assert "Publish under (a): then every file may be published" in md
    assert "the bound you chose" not in md
    for f in ("sweep.md", "sweep.json"):
        assert "better statement" not in (d / f).read_text()
    # With (a) above (b) (many trials), the comparison says so instead.
    from llmdp.tune.sweep import publication, render_markdown

    big = {**state, "cost": {**state["cost"], "composition": {**state["cost"]["composition"],
                                                            "epsilon": b + 1.0}}}
    big["publication"] = publication(big)
    assert big["publication"]["a_is_better"] is False
    md = render_markdown(big)
    assert "(b) is the smaller ε here" in md and "better statement" not in md


def test_a_grid_sweep_may_publish_everything_under_a(tmp_path):
    state = run_sweep(recipe(tmp_path), ["optim.lr=0.01,0.02"], log=lambda *a: None,
                      run_trial=FakeTrials())
    d = tmp_path / "runs" / "sw-sweep"
    assert state["publication"]["bound"] == "a" and not (d / "sweep.internal.json").exists()
    md = (d / "sweep.md").read_text()
    assert "everything here may be published" in md and "INTERNAL" not in md


# ---------------------------------------------------------------------- end to end (Ray)
E2E_RECIPE = TINY_MODEL_YAML + """data: {{path: notes.jsonl, sequence_length: 32, eval: {{fraction: 0.2}}}}
privacy: {{target_epsilon: 8.0, max_grad_norm: 0.5, accountant: rdp}}  # (RDP: planned at once; PLD: test_e2e)
eval: {{epsilon: 4.0}}  # noise std well below the trials' spread, so one is selected
optim: {{name: sgd, lr: 0.5, schedule: constant}}
train: {{expected_batch_size: 96, steps: 4, physical_batch_size: 32, checkpoint_every: 2}}  # (lr 3 gains ~0.6 over lr 0.01 in 4 steps; at B = 12 the step noise made the gain random)
scaling: {{num_workers: 1}}
output: {{dir: runs, name: e2e}}
"""


@pytest.mark.slow
def test_sweep_of_two_trials_on_ray(tmp_path, monkeypatch, capsys):
    """`llmdp sweep` with two tiny trials through the real trainer: each a DP run with a DP
    evaluation, the selection by DP eval loss, the cost equal to dp-accounting on the two
    ledgers, and a re-run that runs nothing again. (Needs the held-out evaluation.)"""
    import ray

    from llmdp.privacy.ledger.records import Ledger

    monkeypatch.chdir(tmp_path)
    write_notes(tmp_path / "notes.jsonl", 80)
    (tmp_path / "r.yaml").write_text(E2E_RECIPE.format(tok=tiny_tokenizer_dir()))
    argv = ["sweep", "r.yaml", "--grid", "optim.lr=0.01,3.0"]
    assert main(argv) == 0
    assert not ray.is_initialized()  # every trial shut down the Ray it started
    state = json.loads((tmp_path / "runs" / "e2e-sweep" / SWEEP_JSON).read_text())
    assert state["status"] == "complete" and len(state["trials"]) == 2
    losses = []
    acc = dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=REL)
    for i, t in enumerate(state["trials"]):
        run_dir = tmp_path / "runs" / f"e2e-trial-{i}"
        report = json.loads((run_dir / "privacy_report.json").read_text())
        assert t["run_dir"] == str(run_dir) and report["status"] == "complete"
        assert t["dp_eval"]["loss"] == report["evaluation"]["dp"][-1]["loss"]
        losses.append(t["dp_eval"]["loss"])
        for event, count in Ledger(run_dir / "ledger.jsonl").entries():
            acc.compose(dp_accounting.SelfComposedDpEvent(event, count))
    assert state["selected"]["trial"] == losses.index(min(losses))
    cost = state["cost"]
    d_acc = cost["composition"]["delta_accountant"]  # δ less the trials' noise tails
    assert 0.9 * cost["delta"] < d_acc < cost["delta"]
    assert cost["composition"]["epsilon"] == pytest.approx(acc.get_epsilon(d_acc), rel=1e-6)
    assert (tmp_path / "runs" / "e2e-sweep" / "sweep.md").exists()

    capsys.readouterr()
    assert main(argv) == 0  # resumed: both trials already complete
    assert capsys.readouterr().out.count("already complete") == 2


def test_the_readme_sweep_commands_parse(monkeypatch):
    import os
    import shlex

    from llmdp.cli import build_parser
    from llmdp.config.schema import load_recipe

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(repo)
    text = open(os.path.join(repo, "README.md"), encoding="utf-8").read()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("llmdp sweep ")]
    assert len(lines) >= 2
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])
        cfg = load_recipe(args.recipe, args.overrides)
        spec = resolve_sweep(cfg.sweep, args.grid, args.trials, args.mean_trials, args.distribution)
        assert spec.points()


def test_no_trial_is_selected_on_noise():
    """Issue 30 item 3: a selection between DP losses whose noise std exceeds their spread is
    refused (the issue's case: 5.19 ± 2.94 against 8.00 ± 3.47); well-separated trials are
    selected as before."""
    from llmdp.tune.sweep import selection_refusal

    noisy = [{"trial": 0, "dp_eval": {"loss": 5.19, "loss_std": 2.94}},
             {"trial": 1, "dp_eval": {"loss": 8.00, "loss_std": 3.47}}]
    why = selection_refusal(noisy)
    assert why and "span 2.81" in why and "± 3.47" in why
    clear = [{"trial": 0, "dp_eval": {"loss": 5.19, "loss_std": 0.13}},
             {"trial": 1, "dp_eval": {"loss": 5.60, "loss_std": 0.12}}]
    assert selection_refusal(clear) is None and select_trial(clear)["trial"] == 0
    assert selection_refusal(noisy[:1]) is None  # one trial: nothing to choose between
