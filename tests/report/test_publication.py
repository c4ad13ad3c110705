"""What a run publishes (issue 49): nothing that other runs move, no claim that checkpoints
are covered, and the adjacency that is true of what is published (N published exactly).

Owns invariant `published-from-dp-only` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from llmdp.config.schema import recipe_from_dict
from tests.helpers import tiny_tokenizer_dir, write_notes


def _finished_run(tmp_path, name: str, **privacy) -> str:
    """A finished full-weights run made by the worker loop in this process (no Ray), with a
    checkpoint where Ray would put it; every run under one ``tmp_path`` trains on the same
    corpus and records in the same ledgers' database (one dataset ledger)."""
    from llmdp.report.build import write_report
    from llmdp.run.launch import prepare
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    data = tmp_path / "notes.jsonl"
    if not data.exists():
        write_notes(data, 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0,
                    "ledger": str(tmp_path / "ledger.sqlite"), **privacy},
        "optim": {"name": "sgd", "lr": 5e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 4, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 3},
        "output": {"dir": str(tmp_path / "runs"), "name": name},
    }
    prep = prepare(recipe_from_dict(raw), log=lambda *a: None)
    ckpt = os.path.join(prep.run_dir, "checkpoints", "checkpoint_000000")
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    write_report(prep.run_dir)
    return prep.run_dir


def _export(run_dir, to) -> dict[str, str]:
    """The export's files (text only; the PNG is drawn from the report's curve), minus the
    export time stamp."""
    from llmdp.hub.export import export_run

    export_run(run_dir, to, log=lambda *a: None)
    out = {}
    for root, _, files in os.walk(to):
        for n in files:
            p = os.path.join(root, n)
            if n.endswith((".json", ".md", ".jsonl")):
                text = open(p, encoding="utf-8").read()
                if n == "llmdp_export.json":
                    text = json.dumps({k: v for k, v in json.loads(text).items() if k != "exported_at"})
                out[os.path.relpath(p, to)] = text
    return out


@pytest.fixture(scope="module")
def dpsgd_run(tmp_path_factory):
    return _finished_run(tmp_path_factory.mktemp("dpsgd"), "dpsgd")


# ----------------------------------------------------------------------------- item 1


def test_another_runs_release_on_the_dataset_changes_nothing_a_run_publishes(tmp_path):
    """A dataset-wide total (ε spent on the dataset, what remains of its budget) depends on
    every other run's releases (a random sweep's K among them): the export of a run, its
    publishable report included, is the same whether or not another run released on the
    same dataset after it."""
    from llmdp.record.publish import publishable_report
    from llmdp.report.build import build_report, write_report

    a = _finished_run(tmp_path, "a")
    before = _export(a, tmp_path / "export-1")
    local = build_report(a)
    assert local["dataset_ledger"]["epsilon_spent"] == pytest.approx(local["epsilon"], rel=1e-6)
    _finished_run(tmp_path, "b")  # another run's releases on the same dataset ledger
    moved = build_report(a)
    # the local (internal) report still holds the dataset-wide total, and it moved
    assert moved["dataset_ledger"]["epsilon_spent"] > local["dataset_ledger"]["epsilon_spent"] * 1.1
    assert publishable_report(moved) == publishable_report(local)
    write_report(a)  # the stored report rebuilt after the other run (`llmdp privacy report`)
    after = _export(a, tmp_path / "export-2")
    assert sorted(after) == sorted(before)
    for name in before:
        assert after[name] == before[name], name
    assert "dataset_ledger" not in json.loads(after["privacy_report.json"])


# ----------------------------------------------------------------------------- item 8


def _assert_checkpoints_not_covered(report: dict, card_text: str, correlated: bool) -> None:
    out = report["mechanism_output"]
    assert "checkpoint" not in out.split("covered")[0] or "not covered" in out
    assert "every checkpoint are covered" not in out and "every checkpoint is covered" not in out
    assert "internal" in report["checkpoints"] and "not covered" in report["checkpoints"]
    assert "optimizer state" in report["checkpoints"]
    assert ("noise" in report["checkpoints"]) == correlated
    assert "the model checkpoints" not in report["dp_setting"]
    assert report["checkpoints"] in card_text


def test_checkpoints_are_internal_and_never_said_to_be_covered(dpsgd_run, tmp_path):
    """The report and the card name only the final model's weights (and the DP releases) as
    covered; checkpoints are internal (optimizer state, non-DP counters, and for a
    correlated mechanism the secret state of its noise stream); the export copies none."""
    from llmdp.record import checkpoints

    corr = _finished_run(tmp_path, "corr", mechanism="banded-mf", sampler="cyclic-poisson", bands=3)
    for run, correlated in ((dpsgd_run, False), (corr, True)):
        report = json.load(open(os.path.join(run, "privacy_report.json")))
        md = open(os.path.join(run, "privacy_report.md"), encoding="utf-8").read()
        assert report["checkpoints"] in md
        files = _export(run, tmp_path / f"export-{os.path.basename(run)}")
        pub = json.loads(files["privacy_report.json"])
        _assert_checkpoints_not_covered(pub, files["README.md"], correlated)
        assert report["checkpoints"] in files["privacy_report.md"]
        every = [os.path.relpath(os.path.join(r, n), tmp_path / f"export-{os.path.basename(run)}")
                 for r, _, ns in os.walk(tmp_path / f"export-{os.path.basename(run)}") for n in ns]
        assert not [f for f in every if f in (checkpoints.FULL, checkpoints.META) or "checkpoint" in f]
        from safetensors import safe_open

        with safe_open(str(tmp_path / f"export-{os.path.basename(run)}" / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert not [k for k in keys if "noise" in k or "stream" in k or "mf" in k.split(".")]
        assert "nonfinite_steps" not in json.dumps(files)


# ----------------------------------------------------------------------------- item 9


def test_the_stated_adjacency_is_true_of_a_published_n(dpsgd_run, tmp_path):
    """N is published exactly: a Poisson run states zero-out adjacency (N the same in both
    datasets; the same ε as add-or-remove's for a Poisson-subsampled Gaussian) and says N,
    q and δ are treated as public; the card states the same."""
    report = json.load(open(os.path.join(dpsgd_run, "privacy_report.json")))
    assert report["accounting_relation"] == "add_or_remove_one"
    adj = report["adjacency"]
    assert adj.startswith("zero-out") and "same ε as add-or-remove" in adj
    assert "N the same in both" in adj
    public = report["published_counts"]
    assert f"N = {report['dataset_size']}" in public and "public" in public
    assert "q" in public and "δ" in public
    md = open(os.path.join(dpsgd_run, "privacy_report.md"), encoding="utf-8").read()
    assert adj in md and public in md
    files = _export(dpsgd_run, tmp_path / "export")
    pub = json.loads(files["privacy_report.json"])
    assert pub["adjacency"] == adj and pub["published_counts"] == public
    assert adj in files["README.md"] and public in files["README.md"]
    assert "add_or_remove_one" in files["README.md"]


def _plan(**kw):
    base = {"relation": "add_or_remove_one", "sampler": "poisson", "mechanism": "dp-sgd",
            "dataset_size": 123, "correlated": False}
    return SimpleNamespace(**{**base, **kw})


def test_adjacency_by_sampler_and_relation_and_the_evaluation_count():
    """Zero-out gives add-or-remove's ε only where a null unit changes nothing but its own
    contribution: not under truncated Poisson (a null unit takes a slot under the cap), which
    is stated as add-or-remove with N declared public (the only relation dp-accounting
    accounts it under). Replace-one keeps N by definition. A held-out count published exactly
    (eval.count: public) is named as public too; an unknown relation is refused by name."""
    from llmdp.report.adjacency import adjacency, published_counts

    for sampler in ("poisson", "cyclic-poisson", "fixed-cycle"):
        assert adjacency(_plan(sampler=sampler), "a unit").startswith("zero-out")
    trunc = adjacency(_plan(sampler="truncated-poisson"), "a unit")
    assert trunc.startswith("add-or-remove") and "N treated as public" in trunc
    assert "zero-out" not in trunc
    assert "held-out" not in published_counts(_plan(), {})
    counted = published_counts(_plan(), {"dp_eval": {"count": "public"}})
    assert "held-out" in counted and "public" in counted
    assert "held-out" not in published_counts(_plan(), {"dp_eval": {"count": "noised"}})
    assert adjacency(_plan(relation="replace_one"), "a unit").startswith("replace-one")
    with pytest.raises(ValueError, match="truncated"):
        adjacency(_plan(relation="replace_one", sampler="truncated-poisson"), "a unit")
    with pytest.raises(ValueError, match="swap_two"):
        adjacency(_plan(relation="swap_two"), "a unit")
