"""`llmdp compare`: the table and the privacy-utility plot, from hand-written reports."""

from __future__ import annotations

import json
import os
import stat

import pytest

from llmdp.cli import main
from llmdp.report.compare import compare, plot


def _recipe(seed=0, lr=1e-3, steps=6, model=None, **privacy):
    """A resolved recipe's fields that compare reads (config.yaml)."""
    return {"model": {"name_or_path": model, "init": "pretrained" if model else "tiny",
                      "tiny": {"seed": seed}},
            "data": {"path": "/d/a.jsonl"}, "privacy": {"target_epsilon": 1.0, **privacy},
            "optim": {"name": "adamw", "lr": lr}, "train": {"steps": steps, "seed": seed},
            "output": {"dir": "/runs", "name": f"r{seed}"}}


def _run(root, name, report, recipe=None):
    d = root / name
    d.mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps({"run_id": name, "plan": {}}))
    if report is not None:
        (d / "privacy_report.json").write_text(json.dumps(report))
    if recipe is not None:
        (d / "config.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    return d


def _internal(step, loss, acc):
    return {"step": step, "loss": loss, "perplexity": 2.718281828 ** loss, "accuracy": acc,
            "units": 40}


DP_LOW = {"dp": True, "epsilon": 1.0, "delta": 1e-5, "steps_completed": 6, "status": "complete",
          "evaluation": {"internal": [_internal(3, 3.9, 0.10), _internal(6, 3.25, 0.21)],
                         "dp": [{"step": 3, "loss": 4.0, "loss_std": 0.2, "accuracy": 0.1,
                                 "accuracy_std": 0.02, "count": 40.2, "noise_multiplier": 3.0},
                                {"step": 6, "loss": 3.4, "loss_std": 0.125, "accuracy": 0.19,
                                 "accuracy_std": 0.015, "count": 39.1, "noise_multiplier": 3.0}]}}
DP_HIGH = {"epsilon": 8.0, "delta": 1e-5, "steps_completed": 6, "status": "complete",
           "evaluation": {"internal": [_internal(6, 2.75, 0.3)],
                          "dp": [{"step": 6, "loss": 2.8, "loss_std": 0.0625, "accuracy": 0.29,
                                  "accuracy_std": 0.01}]}}
BASELINE = {"dp": False, "epsilon": None, "delta": None, "steps_completed": 6, "status": "complete",
            "evaluation": {"internal": [_internal(6, 2.125, 0.4)]}}
NO_EVAL = {"dp": True, "epsilon": 4.0, "delta": 1e-5, "steps_completed": 5, "status": "complete"}


PUBLIC_START = {"kind": "public", "run_id": "pre-1", "shown": "<local>/model"}


def _seed_runs(tmp_path, specs, accuracy=lambda start: 0.2):
    """One run folder per (entry, seed): ``specs`` maps an entry's name to (ε or None for a
    baseline, its final held-out loss per seed, its starting model or None, the loss before
    the first step); each run's recipe differs from its entry's others by the seed only."""
    def report(eps, loss, start, before):
        return {"dp": eps is not None, "epsilon": eps, "delta": 1e-6 if eps else None,
                "steps_completed": 6, "status": "complete", "starting_model": start,
                "dataset_ledger": {"dataset_id": "path:/d/a"} if eps else None,
                "evaluation": {"internal": [_internal(0, before, 0.01),
                                            _internal(6, loss, accuracy(start))]}}

    return [_run(tmp_path, f"{name}-{i}", report(eps, loss, start, before),
                 _recipe(seed=i, target_epsilon=eps, dp=eps is not None,
                         model="/m/pre-1" if start else None))
            for name, (eps, losses, start, before) in specs.items() for i, loss in enumerate(losses)]


@pytest.fixture
def runs(tmp_path):
    return [_run(tmp_path, "dp-low", DP_LOW), _run(tmp_path, "dp-high", DP_HIGH),
            _run(tmp_path, "baseline", BASELINE), _run(tmp_path, "no-eval", NO_EVAL)]


def test_table_lists_each_run_with_its_final_metrics(runs, capsys):
    assert main(["compare", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in
             ("dp-low", "dp-high", "baseline", "no-eval")}
    low = lines["dp-low"]
    # the final entries (step 6), not the first ones
    assert "1.0000 (1e-05)" in low and "3.2500 (internal)" in low and "0.2100" in low
    assert "3.4000 ± 0.1250" in low and "0.1900 ± 0.0150" in low and "3.9000" not in low
    assert "8.0000 (1e-05)" in lines["dp-high"] and "2.8000 ± 0.0625" in lines["dp-high"]
    base = lines["baseline"]
    assert "NON-PRIVATE" in base and "2.1250 (internal)" in base and "(1e-05)" not in base
    assert base.split()[1] == "NON-PRIVATE" and lines["dp-low"].split()[1] == "DP"
    # a run without evaluation metrics is still listed, with dashes
    assert lines["no-eval"].count("–") >= 4 and "4.0000 (1e-05)" in lines["no-eval"]
    assert "no evaluation metrics in no-eval" in out


def test_plot_draws_the_curve_and_a_non_private_line(runs, tmp_path):
    rows = compare(runs, log=lambda *a: None)
    drawn = plot(rows, str(tmp_path / "pu.png"))
    assert [(e, loss) for e, loss, _ in drawn["heldout"]] == [(1.0, 3.25), (8.0, 2.75)]
    assert [(e, loss, sd) for e, loss, sd, _ in drawn["dp_eval"]] == [(1.0, 3.4, 0.125),
                                                                      (8.0, 2.8, 0.0625)]
    assert len(drawn["non_private"]) == 1
    loss, label = drawn["non_private"][0]
    assert loss == 2.125 and label.startswith("NON-PRIVATE (baseline")
    png = (tmp_path / "pu.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_cli_writes_the_png(runs, tmp_path, capsys):
    out = tmp_path / "plots" / "curve.png"
    assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert f"plot: {out}" in capsys.readouterr().out


def test_the_png_is_owner_only_whatever_the_umask_and_replaces_an_open_one(runs, tmp_path):
    """The plot holds internal metrics: written 0600 (its new folder 0700) under the usual
    umask 022, and a world-readable plot already at --out is replaced by an owner-only one;
    nothing else is left in the folder."""
    out = tmp_path / "plots" / "curve.png"
    old = os.umask(0o022)
    try:
        assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(out.parent).st_mode) == 0o700
        os.chmod(out, 0o644)
        assert main(["compare", *map(str, runs), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert out.read_bytes()[:4] == b"\x89PNG" and os.listdir(out.parent) == ["curve.png"]


def test_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path, runs, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(runs[0]), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmdp: error: ") and "not a run directory" in err and "empty" in err


def test_a_run_without_a_report_is_a_clear_error(tmp_path, capsys):
    d = _run(tmp_path, "crashed", None)
    assert main(["compare", str(d)]) == 2
    err = capsys.readouterr().err
    assert "no privacy_report.json" in err and "llmdp privacy report" in err


def test_error_bars_stay_in_the_metric_range_and_datasets_are_not_joined(tmp_path):
    """Issue 30 items 3 and 13: a noisy DP loss near 0 gets a bar that stops at 0 (not at a
    loss of -2.4); runs on different datasets or at different δ are separate curves."""
    def dp_run(eps, loss, sd, dataset, delta=1e-5):
        return {"dp": True, "epsilon": eps, "delta": delta, "steps_completed": 6,
                "status": "complete", "dataset_ledger": {"dataset_id": dataset},
                "evaluation": {"dp": [{"step": 6, "loss": loss, "loss_std": sd, "accuracy": 0.5,
                                       "accuracy_std": 0.1, "loss_bound": 8.0}]}}

    runs = [_run(tmp_path, "a1", dp_run(1.0, 1.2, 3.6, "path:/d/a")),
            _run(tmp_path, "a2", dp_run(4.0, 7.0, 3.0, "path:/d/a")),
            _run(tmp_path, "b1", dp_run(2.0, 5.0, 0.5, "path:/d/b")),
            _run(tmp_path, "a3", dp_run(3.0, 4.0, 0.2, "path:/d/a", delta=1e-6))]
    rows = compare(runs, log=lambda *a: None)
    drawn = plot(rows, str(tmp_path / "pu.png"))
    bars = dict(zip([run for *_, run in drawn["dp_eval"]], drawn["dp_eval_bars"]))
    assert bars["a1"] == (1.2, 3.6) and bars["a2"] == (3.0, 1.0) and bars["b1"] == (0.5, 0.5)
    assert sorted(map(tuple, drawn["groups"])) == [("path:/d/a", 1e-6, "random weights"),
                                                    ("path:/d/a", 1e-5, "random weights"),
                                                    ("path:/d/b", 1e-5, "random weights")]


def test_seeds_are_pooled_per_starting_model_and_each_start_is_its_own_curve(tmp_path, capsys):
    """Issue 32 item 5: runs that differ only by seed are one point (mean ± sample sd, with
    min and max), per starting model; the two starts are two curves and two NON-PRIVATE
    lines; the held-out loss before the first step is the starting model untouched."""
    public = PUBLIC_START
    specs = {"s-e1": (1.0, [5.9, 6.0, 6.1], None, 7.6), "s-e8": (7.9998, [5.4, 5.5, 5.6], None, 7.6),
             "s-np": (None, [3.9, 4.0], None, 7.6),
             "p-e1": (1.0001, [3.4, 3.6, 3.5], public, 3.9), "p-e8": (8.0, [3.1, 3.2, 3.0], public, 3.9),
             "p-np": (None, [2.9, 3.0, 3.1], public, 3.9)}
    paths = _seed_runs(tmp_path, specs, accuracy=lambda start: 0.2 if start else 0.1)
    rows = compare(paths, log=print)
    out = capsys.readouterr().out
    assert "runs that differ only by seed pooled" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("public run pre-1") and "8.0000" in ln)
    assert "3.1000 ± 0.1000 [3.0000, 3.2000]" in line and " 3 " in line and "3.9000, 0.0100" in line
    from llmdp.report.compare import summarize

    pooled = {(s["start"], s["dp"], s["epsilon"] and round(s["epsilon"])): s for s in summarize(rows)}
    s = pooled[("random weights", True, 8)]
    assert s["n"] == 3 and abs(s["loss"] - 5.5) < 1e-12 and abs(s["loss_sd"] - 0.1) < 1e-12
    assert abs(s["epsilon"] - 7.9998) < 1e-12 and abs(s["before_loss"] - 7.6) < 1e-12
    base = pooled[("random weights", False, None)]
    assert base["n"] == 2 and abs(base["loss_sd"] - 0.5 ** 0.5 * 0.1) < 1e-12
    drawn = plot(rows, str(tmp_path / "pu.png"))
    assert sorted(g[2] for g in drawn["groups"]) == ["public run pre-1", "random weights"]
    means = sorted((start, round(e), round(m, 12), round(sd, 12), n)
                   for e, m, sd, n, start in drawn["heldout_mean"])
    assert means == [("public run pre-1", 1, 3.5, 0.1, 3), ("public run pre-1", 8, 3.1, 0.1, 3),
                     ("random weights", 1, 6.0, 0.1, 3), ("random weights", 8, 5.5, 0.1, 3)]
    labels = sorted(label for _, label in drawn["non_private"])
    assert len(labels) == 2 and "mean ± sd of 3 runs, from public run pre-1" in labels[1]
    assert "mean ± sd of 2 runs, from random weights" in labels[0]
    assert (tmp_path / "pu.png").read_bytes()[:4] == b"\x89PNG"


def test_only_seed_replicates_are_pooled(tmp_path, capsys):
    """Issue 51 item 5: sweep trials at two learning rates, or runs of 8 and 24 steps, at the
    same ε are not seed replicates: they are separate entries, and the summary names the
    fields they differ in; runs whose recipes differ only by their seeds (and name) are
    pooled; a run without config.yaml is never pooled."""
    def report(loss):
        return {"dp": True, "epsilon": 1.0, "delta": 1e-6, "steps_completed": 8,
                "status": "complete", "dataset_ledger": {"dataset_id": "path:/d/a"},
                "evaluation": {"internal": [_internal(8, loss, 0.1)]}}

    paths = [_run(tmp_path, "lr3", report(7.631), _recipe(lr=1e-3, steps=8)),
             _run(tmp_path, "lr2", report(7.646), _recipe(lr=1e-2, steps=8)),
             _run(tmp_path, "s24", report(7.2), _recipe(lr=1e-3, steps=24)),
             _run(tmp_path, "s24-seed1", report(7.4), _recipe(seed=1, lr=1e-3, steps=24)),
             _run(tmp_path, "old", report(7.0))]
    from llmdp.report.compare import summarize

    rows = compare(paths, log=print)
    pooled = sorted(summarize(rows), key=lambda s: s["runs"])
    assert [s["runs"] for s in pooled] == [["lr2"], ["lr3"], ["old"], ["s24", "s24-seed1"]]
    assert pooled[3]["n"] == 2 and abs(pooled[3]["loss"] - 7.3) < 1e-12
    assert pooled[0]["differs"] == {"optim.lr": 1e-2, "train.steps": 8}
    assert pooled[2]["differs"] is None
    out = capsys.readouterr().out
    summary = out.split("runs that differ only by seed pooled")[1]
    assert "optim.lr=0.01, train.steps=8" in summary and "optim.lr=0.001, train.steps=24" in summary
    assert "no config.yaml: not pooled" in summary
    assert not any(" 4 " in ln or " 3 " in ln for ln in summary.splitlines())


def test_the_fraction_of_the_non_private_gain_recovered(tmp_path, capsys):
    """Issue 54 item 4: per starting model, each DP entry's (start − DP) / (start −
    NON-PRIVATE) with its three losses (pooled means); a start from which the baseline
    gained nothing gets no fraction."""
    from llmdp.report.compare import gain_recovered, summarize

    public = PUBLIC_START
    specs = {"p-e1": (1.0, [3.4, 3.6], public, 3.9), "p-e8": (8.0, [3.1, 3.2, 3.0], public, 3.9),
             "p-np": (None, [2.9, 3.1], public, 3.9),
             "s-e8": (8.0, [7.0], None, 7.6), "s-np": (None, [7.7], None, 7.6)}
    paths = _seed_runs(tmp_path, specs)
    rows = compare(paths, log=print)
    out = capsys.readouterr().out
    gains = {(g["start"], round(g["epsilon"])): g for g in gain_recovered(summarize(rows))}
    g8 = gains[("public run pre-1", 8)]
    assert (g8["start_loss"], round(g8["dp_loss"], 12), round(g8["non_private_loss"], 12)) == (3.9, 3.1, 3.0)
    assert g8["fraction"] == pytest.approx((3.9 - 3.1) / (3.9 - 3.0), rel=1e-12)
    assert gains[("public run pre-1", 1)]["fraction"] == pytest.approx((3.9 - 3.5) / 0.9, rel=1e-12)
    assert gains[("random weights", 8)]["fraction"] is None  # the baseline got worse: no gain
    assert "fraction of the non-private gain recovered" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("public run pre-1") and "88.9%" in ln)
    assert "3.9000" in line and "3.1000" in line and "3.0000" in line


def test_the_report_states_the_gain_against_a_given_baseline(tmp_path, capsys):
    """Issue 54 item 4: `llmdp privacy report RUN --baseline BASELINE` adds the fraction of
    the baseline's gain the DP run recovers to the local report (its three losses as the
    runs' own reports give them), never to the publishable one; a DP run given as the
    baseline is one message."""
    from llmdp.config.schema import recipe_from_dict, to_dict
    from llmdp.record.publish import publishable_report
    from llmdp.report.build import write_report
    from llmdp.report.compare import load_run
    from llmdp.train.loop import LocalContext, train_loop_per_worker
    from tests.train.test_loop import make_recipe, prepared_config

    dirs = {}
    for name, dp in (("dp", True), ("base", False)):
        raw = to_dict(make_recipe(tmp_path))
        raw["data"]["eval"] = {"fraction": 0.25}
        raw["train"]["eval_every"] = 3
        raw["output"]["name"] = name
        if not dp:
            raw["privacy"] = {"dp": False}
        prep = prepared_config(recipe_from_dict(raw))
        train_loop_per_worker(prep, LocalContext())
        write_report(prep.run_dir)  # what `llmdp train`'s driver writes at the end
        dirs[name] = prep.run_dir
    assert main(["privacy", "report", dirs["dp"], "--baseline", dirs["base"], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    g = report["non_private_gain"]
    run, base = load_run(dirs["dp"]), load_run(dirs["base"])
    assert (g["start_loss"], g["dp_loss"], g["non_private_loss"]) == (
        run["before"]["loss"], run["heldout"]["loss"], base["heldout"]["loss"])
    if g["start_loss"] - g["non_private_loss"] > 0:
        assert g["fraction"] == pytest.approx((g["start_loss"] - g["dp_loss"])
                                              / (g["start_loss"] - g["non_private_loss"]), rel=1e-12)
    else:
        assert g["fraction"] is None
    md = open(os.path.join(dirs["dp"], "privacy_report.md"), encoding="utf-8").read()
    assert "Fraction of the non-private gain recovered (internal: do not publish)" in md
    assert "non_private_gain" not in publishable_report(report)
    assert main(["privacy", "report", dirs["dp"], "--baseline", dirs["dp"]]) == 2
    assert "a DP run; give a NON-PRIVATE baseline" in capsys.readouterr().err
