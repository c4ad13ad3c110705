"""Held-out evaluation, DP evaluation, generations (issue: know what the model is worth)."""

from __future__ import annotations

import json
import math
import os

import dp_accounting
import numpy as np
import pytest
import torch

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.data.holdout import Holdout, split_units
from llmdp.evaluation import dp as dp_eval
from llmdp.evaluation.metrics import evaluate
from llmdp.privacy.ledger.records import EVAL_MECHANISM, Ledger, is_step_release
from llmdp.privacy.rng import keys
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.helpers import dataset_records, tiny_tokenizer_dir, write_notes


def eval_recipe(tmp_path, *, eval_data=None, evaluation=None, **train):
    data = write_notes(tmp_path / "notes.jsonl", 60)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(), "dtype": "float64",
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24,
                 "eval": eval_data if eval_data is not None else {"fraction": 0.2}},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4,
                    "ledger": str(tmp_path / "ledger.sqlite")},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 2, **train},
        "eval": evaluation if evaluation is not None else {},
        "output": {"dir": str(tmp_path / "runs"), "name": "t"},
    }
    return recipe_from_dict(raw)


def prepared(cfg):
    from llmdp.run.launch import prepare

    return prepare(cfg, log=lambda *a: None)


def unit_contents(store) -> list[bytes]:
    out = []
    for u in range(store.num_units):
        b = store.rows([u], width=None)
        out.append(b["input_ids"].numpy().tobytes() + b["labels"].numpy().tobytes())
    return out


# ----------------------------------------------------------------------------- the split


def test_held_out_units_are_disjoint_from_training_and_stable_across_launches(tmp_path):
    cfg = eval_recipe(tmp_path)
    a = prepared(cfg)
    train, held = unit_contents(open_(a.paths.store_dir)), unit_contents(open_(a.paths.eval_store_dir))
    assert held and train
    assert not set(train) & set(held)
    # N and q cover the training units only.
    assert a.plan.dataset_size == len(train)
    # A re-launch (resume) plans the same split: the same stores, the same N.
    b = prepared(cfg)
    assert (b.paths.store_dir, b.paths.eval_store_dir) == (a.paths.store_dir, a.paths.eval_store_dir)
    assert unit_contents(open_(b.paths.eval_store_dir)) == held
    plan = json.load(open(os.path.join(a.run_dir, "plan.json")))
    assert plan["eval_data"] == "private" and plan["data"]["eval_units"] == len(held)


def open_(path):
    from llmdp.data.store import open_store

    return open_store(path)




def test_split_is_by_keyed_content_hash_and_neighbour_stable():
    from llmdp.data.units import UnitArrays, select_units

    rng = np.random.default_rng(0)
    n = 400
    lens = rng.integers(4, 12, size=n)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = rng.integers(0, 1000, size=int(offsets[-1])).astype(np.int32)
    units = UnitArrays(tokens, np.ones_like(tokens, dtype=np.uint8), offsets,
                       np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int32))
    h = Holdout(fraction=0.25, key="k1")
    train, ev = split_units(units, h)
    assert train.num_units + ev.num_units == n and 0.15 * n < ev.num_units < 0.35 * n

    def rows(u):
        return {u.tokens[u.row_offsets[i]:u.row_offsets[i + 1]].tobytes() for i in range(u.num_rows)}

    assert not rows(train) & rows(ev)
    # D minus one unit: every other unit lands on the same side.
    for drop in (0, 7, n - 1):
        keep = np.delete(np.arange(n), drop)
        t2, e2 = split_units(select_units(units, keep), h)
        gone = units.tokens[units.row_offsets[drop]:units.row_offsets[drop + 1]].tobytes()
        assert rows(t2) == rows(train) - {gone} and rows(e2) == rows(ev) - {gone}
    # Another key, another split.
    _, ev_other = split_units(units, Holdout(fraction=0.25, key="k2"))
    assert rows(ev_other) != rows(ev)
    # max_units: the held-out units with the smallest hashes, a subset of the same split.
    _, ev_cap = split_units(units, Holdout(fraction=0.25, key="k1", max_units=10))
    assert ev_cap.num_units == 10 and rows(ev_cap) <= rows(ev)


# ----------------------------------------------------------------------------- the metric


def test_eval_loss_and_accuracy_equal_a_direct_computation(tmp_path):
    from llmdp.record.spec import RunSpec  # noqa: F401
    from llmdp.train.models import load_model

    cfg = eval_recipe(tmp_path)
    spec = prepared(cfg)
    store = open_(spec.paths.eval_store_dir)
    model, _ = load_model(cfg.model, cache_dir=spec.paths.model_cache)
    assert next(model.parameters()).dtype == torch.float64
    metrics, mine = evaluate(model, store, torch.device("cpu"), 0, 1, 4)
    # Direct: each unit on its own, full-width rows, log-softmax by hand.
    losses, accs, nll, tokens = [], [], 0.0, 0
    with torch.no_grad():
        for u in range(store.num_units):
            b = store.rows([u], width=None)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            labels = b["labels"][:, 1:]
            m = labels != -100
            tok_nll = -lp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[m]
            correct = (logits[:, :-1].argmax(-1) == labels)[m]
            losses.append(float(tok_nll.mean()))
            accs.append(float(correct.double().mean()))
            nll += float(tok_nll.sum())
            tokens += int(m.sum())
    assert metrics["units"] == store.num_units and metrics["tokens"] == tokens
    assert metrics["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(np.mean(accs), rel=1e-6, abs=1e-12)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert sorted(mine["loss"]) == pytest.approx(sorted(losses), rel=1e-6)


# ----------------------------------------------------------------------------- DP evaluation


def _plan(count="public", z=2.0, L=8.0):
    return dp_eval.DpEvalPlan(noise_multiplier=z, releases=1, loss_bound=L, count=count,
                              delta=1e-5, accountant="pld", steps=(10,))


@pytest.mark.parametrize("count", ["public", "noised"])
def test_released_values_have_the_stated_noise(count):
    plan = _plan(count)
    n, L = 500, plan.loss_bound
    sums = np.array([n * 3.0 / L, n * 0.4, n], dtype=np.float64)  # mean loss 3, accuracy 0.4
    M = 3000
    draws = [dp_eval.release(sums, plan, keys.seeded_key(7, i, "eval"), 10) for i in range(M)]
    loss = np.array([d["loss"] for d in draws])
    acc = np.array([d["accuracy"] for d in draws])
    k = 2 if count == "public" else 3
    assert plan.sensitivity == pytest.approx(math.sqrt(k))
    sd_loss = plan.noise_multiplier * math.sqrt(k) * L / n  # σ·(range)/count per aggregate
    sd_acc = plan.noise_multiplier * math.sqrt(k) * 1.0 / n
    assert draws[0]["loss_std"] == pytest.approx(sd_loss, rel=0.05)
    if count == "public":
        assert draws[0]["loss_std"] == pytest.approx(sd_loss) and {d["count"] for d in draws} == {n}
        se = 4 / math.sqrt(2 * (M - 1))  # 4 standard errors of a sample std, relative
        assert abs(loss.std(ddof=1) / sd_loss - 1) < se
        assert abs(acc.std(ddof=1) / sd_acc - 1) < se
        assert abs(loss.mean() - 3.0) < 4 * sd_loss / math.sqrt(M)
        assert abs(acc.mean() - 0.4) < 4 * sd_acc / math.sqrt(M)
    else:
        cnt = np.array([d["count"] for d in draws])
        sd_cnt = plan.noise_multiplier * math.sqrt(3)
        assert abs(cnt.std(ddof=1) / sd_cnt - 1) < 4 / math.sqrt(2 * (M - 1))
        assert abs(cnt.mean() - n) < 4 * sd_cnt / math.sqrt(M)
        # The ratio's spread is the numerator's (count noise is second order here).
        assert abs(loss.std(ddof=1) / sd_loss - 1) < 0.1
    # Reproducible only with the key: another key gives other values.
    again = dp_eval.release(sums, plan, keys.seeded_key(7, 0, "eval"), 10)
    assert again["loss"] == draws[0]["loss"]
    assert dp_eval.release(sums, plan, keys.seeded_key(8, 0, "eval"), 10)["loss"] != draws[0]["loss"]


def test_dp_eval_sums_change_by_at_most_the_sensitivity_between_neighbours():
    rng = np.random.default_rng(1)
    L = 5.0
    loss = np.concatenate([rng.uniform(0, 12, 50), [np.nan, np.inf, 1e9, -3.0]])
    acc = rng.uniform(0, 1, loss.size)
    acc[-2] = 1.0  # loss 1e9 (clipped to L) and accuracy 1: the extreme unit
    full = dp_eval.normalized_sums(loss, acc, L)
    for k in (2, 3):  # eval.count public: loss, accuracy; noised: and the count
        worst = 0.0
        for u in range(loss.size):
            less = dp_eval.normalized_sums(np.delete(loss, u), np.delete(acc, u), L)
            d = (full - less)[:k]
            worst = max(worst, float(np.linalg.norm(d)))
        assert worst == pytest.approx(math.sqrt(k), rel=1e-12)  # reached, never exceeded


def test_eval_calibration_equals_dp_accounting():
    plan = dp_eval.plan_dp_eval(epsilon=0.7, noise_multiplier=None, steps=(3, 9), total_steps=12,
                                loss_bound=6.0, count="noised", delta=1e-5, accountant="pld")
    assert plan.steps == (3, 9, 12) and plan.releases == 3
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(plan.noise_multiplier), 3)
    eps = acc.get_epsilon(1e-5)
    assert eps <= 0.7 and eps == pytest.approx(0.7, rel=2e-3)
    with pytest.raises(ValueError, match="eval.epsilon"):
        dp_eval.plan_dp_eval(epsilon=500.0, noise_multiplier=None, steps=(), total_steps=5,
                             loss_bound=6.0, count="noised", delta=1e-5, accountant="pld")


# ----------------------------------------------------------------------------- the whole run


def _six_steps_and_two_evals(spec) -> float:
    """ε at δ = 1e-4 of 6 Poisson-sampled steps at σ = 1 and 2 DP evaluations at z = 3, by
    dp-accounting directly."""
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(spec.plan.sampling_probability,
                                                    dp_accounting.GaussianDpEvent(1.0)), 6)
    acc.compose(dp_accounting.GaussianDpEvent(3.0), 2)
    return acc.get_epsilon(1e-4)


def test_run_records_exactly_the_declared_eval_events_and_reports_their_composition(tmp_path):
    from llmdp.record.publish import publishable_report
    from llmdp.report.build import write_report

    cfg = eval_recipe(tmp_path, eval_every=2,
                      evaluation={"noise_multiplier": 3.0, "steps": [4], "prompts": ["Chief complaint:"],
                                  "max_new_tokens": 5})
    spec = prepared(cfg)
    assert spec.eval_plan.steps == (4, 6) and spec.eval_plan.releases == 2
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
    recs = Ledger(os.path.join(spec.run_dir, "ledger.jsonl")).records()
    evals = [r for r in recs if r["kind"] == "release" and not is_step_release(r)]
    assert [r["eval_step"] for r in evals] == [4, 6]
    assert all(r["count"] == 1 and r["meta"]["mechanism"] == EVAL_MECHANISM for r in evals)
    assert all(r["event"]["class_name"] == "GaussianDpEvent" and r["event"]["noise_multiplier"] == 3.0
               for r in evals)
    assert sum(r["count"] for r in recs if is_step_release(r)) == 6
    # The dataset ledger holds the same records.
    ds = {r["hash"] for r in dataset_records(tmp_path / "ledger.sqlite", cfg.data.path)}
    assert {r["hash"] for r in evals} <= ds

    metrics = [json.loads(x) for x in open(spec.paths.metrics)]
    held = [m for m in metrics if m.get("event") == "eval"]
    assert [m["step"] for m in held] == [0, 2, 4, 6]
    dp = [m for m in metrics if m.get("event") == "dp_eval"]
    assert [m["step"] for m in dp] == [4, 6] and all("loss" in m for m in dp)

    report = write_report(spec.run_dir)
    assert report["epsilon"] == pytest.approx(_six_steps_and_two_evals(spec), rel=1e-6)
    assert report["steps"] == 6
    ev = report["evaluation"]
    assert [m["step"] for m in ev["internal"]] == [0, 2, 4, 6] and [m["step"] for m in ev["dp"]] == [4, 6]
    assert ev["dp_plan"]["releases_recorded"] == 2
    assert len(ev["generations"]) == 1 and ev["generations"][0]["prompt"] == "Chief complaint:"
    md = open(os.path.join(spec.run_dir, "privacy_report.md")).read()
    assert "DP evaluation on held-out units" in md and "Generations from public prompts" in md
    # Published: the DP evaluation and the generations, never the internal held-out metrics.
    pub = publishable_report(report)
    assert "internal" not in pub["evaluation"] and pub["evaluation"]["dp"] == ev["dp"]


def test_public_eval_source_is_published_and_needs_no_dp(tmp_path):
    public = write_notes(tmp_path / "public.jsonl", 12, seed=5)
    cfg = eval_recipe(tmp_path, eval_data={"path": str(public), "public": True, "max_units": 20})
    spec = prepared(cfg)
    assert spec.eval_plan is None and open_(spec.paths.eval_store_dir).num_units == 20
    with pytest.raises(ConfigError, match="declared public"):
        eval_recipe(tmp_path, eval_data={"path": str(public), "public": True},
                    evaluation={"epsilon": 0.5})


def test_dp_evaluations_on_a_private_eval_source_are_in_its_own_ledger(tmp_path):
    """Issue 29 item 4: a separate private evaluation source (data.eval.path, public: false)
    is data about individuals with its own dataset ledger. Each DP evaluation is recorded
    there too (its budget checked), and once in the training data's ledger and the run's
    ledger.jsonl (the run's report composes it once); a later budgeted run on the evaluation
    file starts from what the evaluations spent, not from 0; a budget on the evaluation file
    that the planned evaluations do not fit refuses the launch."""
    from llmdp.privacy.ledger.budget import unit_epsilon
    from llmdp.privacy.ledger.service import BudgetError
    from llmdp.report.build import write_report

    private = write_notes(tmp_path / "eval_notes.jsonl", 20, seed=7)
    cfg = eval_recipe(tmp_path, eval_data={"path": str(private), "public": False},
                      evaluation={"noise_multiplier": 3.0, "steps": [4]})
    spec = prepared(cfg)
    assert spec.eval_plan.releases == 2
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
    loc = tmp_path / "ledger.sqlite"
    on_eval = dataset_records(loc, private)
    assert on_eval[0]["kind"] == "dataset"  # the evaluation file's own ledger
    evals = [r for r in on_eval if r["kind"] == "release"]
    assert [r["eval_step"] for r in evals] == [4, 6]
    assert all(r["count"] == 1 and r["meta"]["mechanism"] == EVAL_MECHANISM
               and r["event"] == {"module_name": "dp_accounting.dp_event",
                                  "class_name": "GaussianDpEvent", "noise_multiplier": 3.0}
               and r["run_id"] == spec.run_id
               and r["meta"]["dataset_size"] == spec.data_stats["eval_units"] for r in evals)
    # The training data's ledger and the run's ledger.jsonl: each evaluation once, naming its
    # record in the evaluation source's ledger.
    on_train = [r for r in dataset_records(loc, cfg.data.path)
                if r["kind"] == "release" and not is_step_release(r)]
    assert [r["also_recorded_in"]["hash"] for r in on_train] == [r["hash"] for r in evals]
    run = [r for r in Ledger(os.path.join(spec.run_dir, "ledger.jsonl")).records()
           if r["kind"] == "release" and not is_step_release(r)]
    assert [r["hash"] for r in run] == [r["hash"] for r in on_train]
    report = write_report(spec.run_dir)
    assert report["epsilon"] == pytest.approx(_six_steps_and_two_evals(spec), rel=1e-6)
    assert report["evaluation"]["dp_plan"]["releases_recorded"] == 2
    # The evaluation source's ledger shows its ε: the two evaluations (dp-accounting).
    eps_eval = dp_accounting.pld.PLDAccountant().compose(
        dp_accounting.GaussianDpEvent(3.0), 2).get_epsilon(1e-4)
    assert unit_epsilon(on_eval, evals[0]["meta"], 1e-4, "pld") == pytest.approx(eps_eval, rel=1e-6)
    assert eps_eval > 0.1

    # A later budgeted run on the evaluation file starts from that ε.
    raw = to_dict(eval_recipe(tmp_path))
    raw["data"] = {"path": str(private), "sequence_length": 24}
    raw["train"]["expected_batch_size"] = 4
    raw["privacy"]["budget_epsilon"] = 50.0
    raw["output"]["name"] = "on-eval"
    lines = []
    from llmdp.run.launch import prepare

    on_eval_run = prepare(recipe_from_dict(raw), log=lines.append)
    said = [x for x in lines if x.startswith("budget: ")]
    assert said and said[0].startswith("budget: ε spent on this dataset for the privacy unit ") \
        and f"' = {eps_eval:.4f} of 50" in said[0], said

    # With the evaluation file's budget just above what is spent (that run ended), a run whose
    # DP evaluations do not fit in it is refused at launch, naming the evaluation source.
    on_eval_run.ledger.open().end("ended")
    from llmdp.cli import main

    assert main(["privacy", "ledger", "set-budget", "--dataset", "path:" + os.path.realpath(private),
                 "--epsilon", f"{eps_eval * 1.01:.6f}", "--ledger", str(loc)]) == 0
    again = eval_recipe(tmp_path, eval_data={"path": str(private), "public": False},
                        evaluation={"noise_multiplier": 3.0, "steps": [2, 4]})
    again = recipe_from_dict({**to_dict(again), "output": {**to_dict(again)["output"], "name": "t2"}})
    before = dataset_records(loc, private)
    with pytest.raises(BudgetError, match=r"the evaluation source \(data.eval\) has its own dataset "
                                          r"ledger .*with the budget ε = [0-9.]+ at δ = 0.0001.*"
                                          r"3 DP evaluation\(s\) would take it to ε = "):
        prepared(again)
    assert dataset_records(loc, private) == before


@pytest.mark.parametrize("raw, match", [
    ({"train": {"eval_every": 5}}, "train.eval_every: 5 needs held-out data"),
    ({"eval": {"epsilon": 1.0}}, "a DP evaluation needs held-out data"),
    ({"data": {"eval": {"fraction": 0.1, "path": "x.jsonl"}}}, "data.eval.fraction / data.eval.path"),
    ({"data": {"eval": {"path": "x.jsonl"}}}, "data.eval.public: required"),
    ({"data": {"eval": {"fraction": 0.1, "public": True}}}, "only for a separate source"),
    ({"data": {"eval": {"fraction": 0.1}}, "eval": {"steps": [3]}}, "neither eval.epsilon"),
    ({"data": {"eval": {"fraction": 0.1}}, "eval": {"epsilon": 1, "steps": [99]}}, "beyond train.steps"),
    ({"data": {"eval": {"fraction": 1.5}}}, "data.eval.fraction"),
    ({"data": {"eval": {"fraction": 0.1, "dataset_id": "x"}}}, "data.eval.dataset_id: 'x' names"),
    ({"data": {"eval": {"path": "x.jsonl", "public": True, "dataset_id": "x"}}}, "public data has none"),
])
def test_eval_config_errors_name_the_key(tmp_path, raw, match):
    base = {"model": {"init": "tiny", "tokenizer": "./tok"}, "data": {"path": "d.jsonl"},
            "privacy": {"noise_multiplier": 1.0}, "train": {"steps": 10}}
    for section, values in raw.items():
        base[section] = {**base.get(section, {}), **values}
    with pytest.raises(ConfigError, match=match):
        recipe_from_dict(base, base_dir=str(tmp_path))


def test_a_baseline_evaluates_held_out_data_without_any_release(tmp_path):
    """privacy.dp false runs the DP recipe as it is: the DP evaluation is ignored, the
    held-out metrics are computed (internal), nothing is recorded in any ledger."""
    from llmdp.report.build import write_report

    cfg = eval_recipe(tmp_path, evaluation={"epsilon": 0.5})
    cfg = recipe_from_dict({**to_dict(cfg),
                            "privacy": {"dp": False, "delta": 1e-4,
                                        "ledger": str(tmp_path / "ledger.sqlite")}})
    spec = prepared(cfg)
    assert spec.eval_plan is None and spec.paths.eval_store_dir is not None
    train_loop_per_worker(spec, LocalContext())
    assert not os.path.exists(os.path.join(spec.run_dir, "ledger.jsonl"))
    report = write_report(spec.run_dir)
    ev = report["evaluation"]
    assert [m["step"] for m in ev["internal"]] == [0, 6] and ev["dp"] == []
    metrics = [json.loads(x) for x in open(spec.paths.metrics)]
    assert all(m.get("privacy") == "NON-PRIVATE" for m in metrics if m.get("event") == "eval")


def test_expected_std_is_the_std_the_releases_have():
    """Issue 30 item 3: the std stated at plan time is the spread of the released metrics
    (Monte Carlo over keys, count public: no second-order count noise)."""
    plan = _plan("public", z=1.5, L=6.0)
    n = 400
    sd = plan.expected_std(n)
    sums = np.array([n * 2.5 / plan.loss_bound, n * 0.5, n], dtype=np.float64)
    M = 2000
    draws = [dp_eval.release(sums, plan, keys.seeded_key(11, i, "eval"), 10) for i in range(M)]
    se = 4 / math.sqrt(2 * (M - 1))
    assert abs(np.std([d["loss"] for d in draws], ddof=1) / sd["loss"] - 1) < se
    assert abs(np.std([d["accuracy"] for d in draws], ddof=1) / sd["accuracy"] - 1) < se
    assert sd["fraction_of_range"] == pytest.approx(sd["accuracy"]) == pytest.approx(sd["loss"] / 6.0)


def test_with_a_noised_count_the_plan_states_the_stds_the_releases_will_state():
    """Issue 51 item 10: with eval.count: noised a release divides by the noised count, so
    the std it states is L·s/ñ: the plan said ± 8.76 and the release ± 122.6. The plan now
    states the central 95% of the stated stds (and L·s/n, their median), and its console
    line says so; a public count has no such range."""
    from types import SimpleNamespace

    from llmdp.run.planning import _check_dp_eval_noise

    plan = _plan("noised", z=10.0, L=8.0)
    n = 40  # s = 10·√3 ≈ 17: the count's noise is not small against n
    sd = plan.expected_std(n)
    sums = np.array([n * 3.0 / plan.loss_bound, n * 0.4, n], dtype=np.float64)
    M = 2000
    stated = np.array([dp_eval.release(sums, plan, keys.seeded_key(12, i, "eval"), 10)["loss_std"]
                       for i in range(M)])
    lo, hi = sd["loss_range"]
    inside = np.mean((stated >= lo) & (stated <= hi))
    assert abs(inside - 0.95) < 4 * math.sqrt(0.95 * 0.05 / M)
    assert abs(np.mean(stated <= sd["loss"]) - 0.5) < 4 * math.sqrt(0.25 / M)  # the median
    assert hi > 4 * sd["loss"]  # far from the single figure it stated before
    lines: list[str] = []
    _check_dp_eval_noise(SimpleNamespace(eval=SimpleNamespace(allow_noisy=True)), plan, n,
                         lines.append)
    assert f"loss ± {lo:.3g} to ± {hi:.3g}" in lines[0] and "noised count" in lines[0]
    assert "loss_range" not in _plan("public").expected_std(n)


def test_a_dp_evaluation_that_would_be_mostly_noise_is_refused_at_plan_time(tmp_path):
    """Issue 30 item 3: a small held-out set whose DP release's std dwarfs the metric's
    range is refused, naming the numbers and the fixes; eval.allow_noisy releases it."""
    evaluation = {"noise_multiplier": 40.0, "count": "public"}
    cfg = eval_recipe(tmp_path, evaluation=evaluation)
    with pytest.raises(ConfigError, match=r"(?s)eval: the DP evaluation would be mostly noise: "
                                          r"with \d+ held-out unit.*Hold out at least \d+ units.*"
                                          r"eval.allow_noisy: true"):
        prepared(cfg)
    lines = []
    cfg = eval_recipe(tmp_path, evaluation={**evaluation, "allow_noisy": True})
    from llmdp.run.launch import prepare

    spec = prepare(cfg, log=lines.append)
    units = open_(spec.paths.eval_store_dir).num_units
    want = spec.eval_plan.expected_std(units)
    assert want["fraction_of_range"] > dp_eval.NOISY_EVAL_FRACTION
    assert any(f"accuracy ± {want['accuracy']:.3g}" in x for x in lines), lines


def test_the_noisy_evaluation_refusal_keeps_a_noised_count_private(tmp_path):
    """Issue 49 (b): with eval.count: noised the held-out count is private, so the refusal
    states neither it nor a std computed from it (which would give it back), only the
    public threshold and the fixes; with eval.count: public it names the count."""
    from llmdp.run.launch import prepare

    cfg = eval_recipe(tmp_path, evaluation={"noise_multiplier": 40.0, "allow_noisy": True})
    spec = prepare(cfg, log=lambda *a: None)
    units = open_(spec.paths.eval_store_dir).num_units
    sd = spec.eval_plan.expected_std(units)
    cfg = eval_recipe(tmp_path, evaluation={"noise_multiplier": 40.0, "count": "noised"})
    with pytest.raises(ConfigError) as e:
        prepared(cfg)
    msg = str(e.value)
    assert "eval.count: noised" in msg and "Hold out at least" in msg and "eval.allow_noisy" in msg
    for private in (f"{units} held-out", f"± {sd['loss']:.3g}", f"± {sd['accuracy']:.3g}",
                    f"{sd['fraction_of_range']:.0%}"):
        assert private not in msg, (private, msg)
    cfg = eval_recipe(tmp_path, evaluation={"noise_multiplier": 40.0, "count": "public"})
    with pytest.raises(ConfigError, match=rf"with {units} held-out unit"):
        prepared(cfg)


def test_dp_metrics_are_published_with_their_std_everywhere():
    """Issue 30 items 3 and 13: the card's model-index carries each DP metric's noise std (in
    its name and as a metric argument), the markdown table has a std for every DP column,
    and a whitespace-only generation is shown as such, not as "(empty)"."""
    from llmdp.evaluation.report import evaluation_markdown
    from llmdp.report.card import _eval_results

    m = {"step": 50, "loss": 5.5, "perplexity": math.exp(5.5), "accuracy": 0.2, "count": 700.0,
         "count_kind": "noised", "loss_std": 0.13, "accuracy_std": 0.016}
    ev = {"dp": [m], "generations": [{"prompt": "Chief complaint:", "greedy": "\n  ", "sampled": ""}],
          "generation_settings": {"temperature": 0.8, "top_p": 0.95, "seed": 0, "max_new_tokens": 8}}
    res = _eval_results(ev, "m", {"epsilon": 8.0})["eval_results"]
    by = {r.metric_type: r for r in res}
    assert by["loss"].metric_args == {"dp_noise_std": 0.13} and "± 0.13" in by["loss"].metric_name
    assert by["accuracy"].metric_args == {"dp_noise_std": 0.016}
    assert by["perplexity"].metric_args["dp_noise_std"] == pytest.approx(math.exp(5.5) * 0.13)
    md = "\n".join(evaluation_markdown(ev))
    row = next(x for x in md.splitlines() if x.startswith("| 50 |"))
    assert row.count("±") == 3, row
    assert "greedy: (whitespace only: `'\\n  '`)" in md and "sampled: (empty)" in md, md


def test_the_console_ends_with_the_dp_evaluation(tmp_path, monkeypatch):
    """Issue 30 items 3 and 13: `llmdp train` prints the last DP evaluation with its std
    (the report's numbers), not only the internal held-out loss. The worker loop runs
    in-process here (Ray's launch is the e2e tests' business)."""
    import llmdp.run.launch

    monkeypatch.setattr(llmdp.run.launch, "_fit", lambda prepared, log, interrupts=None: train_loop_per_worker(
        prepared, LocalContext(checkpoint_dir=str(tmp_path / "ckpt"))))
    cfg = eval_recipe(tmp_path, evaluation={"noise_multiplier": 3.0})
    lines = []
    run_dir = llmdp.run.launch.run(cfg, log=lines.append)
    rep = json.load(open(os.path.join(run_dir, "privacy_report.json")))
    m = rep["evaluation"]["dp"][-1]
    want = (f"DP evaluation after step 6 (released with DP, publishable): loss {m['loss']:.4f} ± "
            f"{m['loss_std']:.4f}, token accuracy {m['accuracy']:.4f} ± {m['accuracy_std']:.4f}")
    assert any(x.startswith(want) for x in lines), lines


def test_epsilon_training_only_is_the_steps_alone_as_planned(tmp_path):
    """Issue 30 item 13: privacy_report.json's epsilon_training_only counted the DP
    evaluations while plan.json's epsilon_planned_training_only does not; both are the
    training steps alone (dp-accounting on the step releases, called directly)."""
    from llmdp.privacy.accounting.events import event_from_json
    from llmdp.report.build import write_report

    cfg = eval_recipe(tmp_path, evaluation={"noise_multiplier": 3.0})
    spec = prepared(cfg)
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
    rep = write_report(spec.run_dir)
    plan = json.load(open(os.path.join(spec.run_dir, "plan.json")))
    recs = Ledger(os.path.join(spec.run_dir, "ledger.jsonl")).records()
    steps = [r for r in recs if r["kind"] == "release" and is_step_release(r)]
    events = [dp_accounting.SelfComposedDpEvent(event_from_json(r["event"]), r["count"]) for r in steps]
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    want = acc.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(rep["delta_accountant"])
    assert rep["epsilon_training_only"] == pytest.approx(want, rel=1e-9)
    assert rep["epsilon_training_only"] == pytest.approx(plan["epsilon_planned_training_only"], rel=1e-9)
    assert rep["epsilon"] > rep["epsilon_training_only"]
