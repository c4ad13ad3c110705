"""`llmdp synthetic quality --dp-epsilon`: MAUVE against the private held-out split as one
Gaussian release of a histogram, recorded in the dataset ledger before any noise exists,
within the dataset's budget, into the card with its own (ε, δ)."""

from __future__ import annotations

import json
import math
import os

import dp_accounting
import numpy as np
import pytest

from llmdp.cli import main
from llmdp.synthetic import dp_quality
from llmdp.synthetic.generate import generate
from llmdp.synthetic.mauve import fit_quantizer, frontier_area
from tests.synthetic._runs import make_run

QUIET = {"progress": False, "log": lambda *a: None}
FAST = ["--steps", "2", "--batch-size", "4", "--max-rows", "40"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dpq")
    dp = make_run(base / "dp", eval_fraction=0.25)
    out = base / "synth" / "s.jsonl"
    generate(dp, out=out, num_records=12, max_new_tokens=20, **QUIET)
    return {"dp": dp, "file": str(out), "base": base}


def _ledger_releases(run_dir):
    from llmdp.privacy.ledger import LedgerDB

    cfg = json.load(open(os.path.join(run_dir, "privacy_report.json"), encoding="utf-8"))
    ds = cfg["dataset_ledger"]["dataset_id"]
    import yaml

    loc = yaml.safe_load(open(os.path.join(run_dir, "config.yaml"), encoding="utf-8"))["privacy"]["ledger"]
    db = LedgerDB(loc)
    try:
        with db.transaction(ds) as tx:
            return [r for r in tx.records if r.get("kind") == "release"], ds, loc
    finally:
        db.close()


@pytest.mark.parametrize("rows_per_unit", [1, 3])
def test_one_unit_moves_the_histogram_by_at_most_the_sensitivity(rows_per_unit):
    """Neighbour test of the private statistic: H on D and on D minus one unit (every unit
    in turn) differ by at most Δ = 1 in L2, and H with one unit replaced by another (a
    displacement under data.eval.max_units) by at most √2."""
    g = np.random.default_rng(rows_per_unit)
    U, k = 9, 5
    counts = g.integers(1, rows_per_unit + 1, U)
    unit_of_row = np.repeat(np.arange(U), counts)
    labels = g.integers(0, k, len(unit_of_row))
    full = dp_quality.unit_histogram(labels, unit_of_row, U, k)
    assert math.isclose(full.sum(), U)  # each unit adds 1 in all
    worst = 0.0
    for u in range(U):
        keep = unit_of_row != u
        relabel = np.searchsorted(np.setdiff1d(np.arange(U), [u]), unit_of_row[keep])
        minus = dp_quality.unit_histogram(labels[keep], relabel, U - 1, k)
        worst = max(worst, float(np.linalg.norm(full - minus)))
        # replaced: unit u's rows all moved to another bucket (its worst case)
        moved = labels.copy()
        moved[unit_of_row == u] = (labels[unit_of_row == u] + 1) % k
        swap = dp_quality.unit_histogram(moved, unit_of_row, U, k)
        assert np.linalg.norm(full - swap) <= math.sqrt(2) + 1e-12
    assert worst <= 1.0 + 1e-12 and worst > 0


def test_the_noise_is_calibrated_with_dp_accounting():
    """σ's one Gaussian release has ε ≤ the target at δ (dp-accounting's PLD called
    directly), and a slightly smaller σ would not."""
    for target, delta in ((1.0, 1e-5), (0.3, 1e-6)):
        sigma, eps = dp_quality.calibrate(target, delta, "pld")
        acc = dp_accounting.pld.PLDAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(sigma))
        direct = acc.get_epsilon(delta)
        assert math.isclose(eps, direct, rel_tol=1e-9) and eps <= target
        acc = dp_accounting.pld.PLDAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(sigma * 0.99))
        assert acc.get_epsilon(delta) > target


def test_the_buckets_come_from_the_synthetic_rows_alone():
    """The quantizer is a function of the synthetic embeddings: fitted twice, the same
    buckets; the held-out rows are only assigned; equal histograms give MAUVE 1."""
    g = np.random.default_rng(0)
    synth = g.normal(size=(60, 8))
    a, b = fit_quantizer(synth, seed=1), fit_quantizer(synth[::-1].copy(), seed=1)
    held = g.normal(size=(30, 8))
    assert np.array_equal(a.assign(held), b.assign(held))
    hp = np.bincount(a.assign(synth), minlength=a.num_buckets) / 60.0
    assert math.isclose(frontier_area(hp, hp), 1.0, rel_tol=1e-9)


def test_the_release_is_recorded_and_goes_into_the_card(runs, monkeypatch, capsys):
    monkeypatch.setenv("XDG_DATA_HOME", str(runs["base"] / "registry"))
    before, ds, _ = _ledger_releases(runs["dp"])
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--dp-epsilon", "1.0", *FAST]) == 0
    assert "[dp] MAUVE synthetic vs held out dp" in capsys.readouterr().out
    after, _, _ = _ledger_releases(runs["dp"])
    assert len(after) == len(before) + 1
    rec = after[-1]
    assert rec["meta"]["mechanism"] == dp_quality.MECHANISM
    r = json.load(open(runs["file"] + ".quality.dp.json", encoding="utf-8"))["mauve_vs_held_out"]
    assert r["label"] == "dp" and 0.0 <= r["mauve"] <= 1.0 and r["epsilon"] <= 1.0
    assert rec["event"]["noise_multiplier"] == r["noise_multiplier"] and r["ledger"]["dataset_id"] == ds
    assert r["sensitivity"] == 1.0  # no data.eval.max_units
    card = os.path.join(os.path.dirname(runs["file"]), "synthetic_data_card.json")
    c = json.load(open(card, encoding="utf-8"))
    assert c["quality_dp"]["epsilon"] == r["epsilon"] and c["quality_dp"]["mauve"] == r["mauve"]
    md = open(card.replace(".json", ".md"), encoding="utf-8").read()
    assert "DP release on the private held-out split" in md and f"{r['epsilon']:.4f}" in md


def test_the_release_is_durable_before_any_noise(runs, monkeypatch):
    """Write-ahead: a failure after the ledger record (here: the noise itself) leaves the
    release recorded (it counts) and no output."""
    from llmdp.synthetic.quality import quality

    monkeypatch.setenv("XDG_DATA_HOME", str(runs["base"] / "registry"))
    before, _, _ = _ledger_releases(runs["dp"])
    real = dp_quality.release_mauve

    def boom(*a, **k):
        def noise(n, std):
            raise RuntimeError("the noise failed")
        return real(*a, **{**k, "noise": noise})

    monkeypatch.setattr(dp_quality, "release_mauve", boom)
    out = runs["file"] + ".quality.dp.json"
    if os.path.exists(out):
        os.remove(out)
    with pytest.raises(RuntimeError, match="the noise failed"):
        quality(runs["file"], runs["dp"], dp_epsilon=0.5, steps=2, batch_size=4, max_rows=40,
                log=lambda *a: None)
    after, _, _ = _ledger_releases(runs["dp"])
    assert len(after) == len(before) + 1 and not os.path.exists(out)


def test_the_noise_free_score_stays_out_of_the_public_files(runs, monkeypatch):
    """The exact histogram's score and the held-out count (internal) are in the internal
    file only, not in the DP file nor the card."""
    from llmdp.synthetic.quality import quality

    monkeypatch.setenv("XDG_DATA_HOME", str(runs["base"] / "registry"))
    quality(runs["file"], runs["dp"], dp_epsilon=2.0, steps=2, batch_size=4, max_rows=40,
            log=lambda *a: None)
    internal = json.load(open(runs["file"] + ".quality.internal.json", encoding="utf-8"))
    assert "internal_noise_free" in internal["mauve"]["synthetic_vs_held_out_dp"]
    dp_file = open(runs["file"] + ".quality.dp.json", encoding="utf-8").read()
    card = open(os.path.join(os.path.dirname(runs["file"]), "synthetic_data_card.json"), encoding="utf-8").read()
    assert "noise_free" not in dp_file and "noise_free" not in card
    # the number of held-out units is a private count: internal only
    assert internal["mauve"]["synthetic_vs_held_out_dp"]["held_out_units"] > 0
    assert "held_out_units" not in dp_file and "held_out_units" not in card


def test_a_release_over_the_dataset_budget_is_refused(runs, monkeypatch, capsys):
    """(Last: it sets the dataset's budget.) The dataset's budget holds: with it set just above what is spent, a release at
    ε = 5 is refused with one message, and nothing is recorded."""
    monkeypatch.setenv("XDG_DATA_HOME", str(runs["base"] / "registry"))
    before, ds, loc = _ledger_releases(runs["dp"])
    rep = json.load(open(os.path.join(runs["dp"], "privacy_report.json"), encoding="utf-8"))
    from llmdp.privacy.ledger import LedgerDB, budget_status  # noqa: F401
    spent = rep["dataset_ledger"]["epsilon_spent"]
    # what the earlier tests of this module released is spent too: take it from the ledger
    from llmdp.privacy import accounting as acc
    entries = [(acc.event_from_json(r["event"]), r["count"]) for r in before]
    spent = max(spent, acc.epsilon(entries, rep["delta"], "pld"))
    assert main(["privacy", "ledger", "set-budget", "--dataset", ds, "--epsilon",
                 f"{spent * 1.01 + 0.01:.6f}", "--delta", repr(rep["delta"]), "--ledger", loc]) == 0
    capsys.readouterr()
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--dp-epsilon", "5", *FAST]) == 2
    err = capsys.readouterr().err
    assert "--dp-epsilon 5" in err and "nothing was released" in err and "Traceback" not in err
    after, _, _ = _ledger_releases(runs["dp"])
    assert len(after) == len(before)
