"""`llmdp synthetic quality`: MAUVE and train-on-synthetic / test-on-real against the run's
held-out split, every number labelled internal (or dp: the run's own DP evaluation), in a
file of its own beside the corpus; the card is never touched."""

from __future__ import annotations

import json
import os

import pytest

from llmdp.cli import main
from llmdp.synthetic.generate import generate
from llmdp.synthetic.quality import BANNER
from tests.synthetic._runs import make_run

QUIET = {"progress": False, "log": lambda *a: None}
FAST = ["--steps", "3", "--batch-size", "4", "--max-rows", "40"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("q")
    from tests.helpers import write_notes

    data = write_notes(base / "notes.jsonl", 30)
    dp = make_run(base / "dp", data=data, eval_fraction=0.2)
    bl = make_run(base / "bl", data=data, eval_fraction=0.2, dp=False, name="bl")
    out = base / "synth" / "s.jsonl"
    generate(dp, out=out, num_records=12, max_new_tokens=20, **QUIET)
    return {"dp": dp, "baseline": bl, "file": str(out), "base": base}


def test_quality_writes_internal_numbers_beside_the_file_and_leaves_the_card(runs, capsys):
    card = os.path.join(os.path.dirname(runs["file"]), "synthetic_data_card.json")
    before = open(card, encoding="utf-8").read()
    assert main(["synthetic", "quality", runs["file"], runs["dp"], *FAST]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(BANNER) and "[internal] MAUVE synthetic vs held out" in printed
    r = json.load(open(runs["file"] + ".quality.internal.json", encoding="utf-8"))
    assert r["internal"] == BANNER
    m = r["mauve"]["synthetic_vs_held_out"]
    assert m["label"] == "internal" and 0.0 <= m["mauve"] <= 1.0
    assert r["mauve"]["reference_training_vs_held_out"]["label"] == "internal"
    losses = r["held_out_loss"]
    assert set(losses) == {"starting_model", "dp_model", "train_on_synthetic"}
    assert all(v["label"] == "internal" and v["loss"] > 0 for v in losses.values())
    assert r["train_on_synthetic"]["dp"] is False and r["train_on_synthetic"]["steps"] == 3
    # the synthetic data card is exactly what generate wrote: no quality number went in
    assert open(card, encoding="utf-8").read() == before
    assert "mauve" not in before.lower() and "held_out" not in before


def test_fine_tuning_on_the_synthetic_corpus_moves_the_held_out_loss(runs):
    from llmdp.synthetic.quality import quality

    r = quality(runs["file"], runs["dp"], steps=5, lr=5e-2, batch_size=4, max_rows=40,
                log=lambda *a: None)
    losses = r["held_out_loss"]
    assert losses["train_on_synthetic"]["loss"] != losses["starting_model"]["loss"]
    assert r["train_on_synthetic"]["last_loss"] < r["train_on_synthetic"]["first_loss"]
    # deterministic under the seed
    again = quality(runs["file"], runs["dp"], steps=5, lr=5e-2, batch_size=4, max_rows=40,
                    log=lambda *a: None)
    assert again["mauve"] == r["mauve"]
    assert again["held_out_loss"]["train_on_synthetic"] == losses["train_on_synthetic"]


def test_the_non_private_baseline_is_compared_and_labelled_internal(runs):
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--baseline", runs["baseline"],
                 *FAST]) == 0
    r = json.load(open(runs["file"] + ".quality.internal.json", encoding="utf-8"))
    assert r["held_out_loss"]["non_private_baseline"]["label"] == "internal"
    assert r["held_out_loss"]["train_on_non_private_samples"]["label"] == "internal"
    assert r["mauve"]["non_private_samples_vs_held_out"]["label"] == "internal"


def test_refusals_are_one_message(runs, tmp_path, capsys):
    # a run that held nothing out: nothing real to compare with
    noeval = make_run(tmp_path / "ne")
    f = tmp_path / "ne.jsonl"
    generate(noeval, out=f, num_records=2, max_new_tokens=8, **QUIET)
    assert main(["synthetic", "quality", str(f), noeval]) == 2
    err = capsys.readouterr().err
    assert "data.eval is not set" in err and "Traceback" not in err
    # the baseline as RUN_DIR: not a DP model
    assert main(["synthetic", "quality", runs["file"], runs["baseline"]]) == 2
    assert "NON-PRIVATE" in capsys.readouterr().err
    # a DP run given as --baseline
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--baseline", runs["dp"]]) == 2
    assert "privacy.dp is not false" in capsys.readouterr().err
    # a baseline on other data: its held-out units would not be the DP run's
    other = make_run(tmp_path / "ob", dp=False, name="ob", eval_fraction=0.2)
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--baseline", other]) == 2
    assert "data.path" in capsys.readouterr().err
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err
    assert main(["synthetic", "quality", str(tmp_path / "nope.jsonl"), runs["dp"]]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_public_reference_gives_a_public_mauve_in_the_card(runs, tmp_path):
    """--reference: MAUVE of the corpus against a file declared public, labelled public,
    written to FILE.quality.public.json and to the synthetic data card (JSON and Markdown);
    the held-out numbers stay internal and out of the card."""
    from tests.helpers import write_notes

    ref = write_notes(tmp_path / "public_notes.jsonl", 20, seed=7)
    card = os.path.join(os.path.dirname(runs["file"]), "synthetic_data_card.json")
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--reference", str(ref), *FAST]) == 0
    pub = json.load(open(runs["file"] + ".quality.public.json", encoding="utf-8"))
    m = pub["mauve_vs_public_reference"]
    assert pub["label"] == m["label"] == "public" and 0.0 <= m["mauve"] <= 1.0
    assert m["reference"]["sha256"] and "public" in m["reference"]["declared"]
    c = json.load(open(card, encoding="utf-8"))
    assert c["quality_public"]["mauve_vs_public_reference"]["mauve"] == m["mauve"]
    md = open(card.replace(".json", ".md"), encoding="utf-8").read()
    assert "## Quality (public" in md and f"{m['mauve']:.4f}" in md
    # nothing computed on the held-out split went into the card
    assert "held_out" not in json.dumps(c) and "internal" not in json.dumps(c["quality_public"]).lower()
    r = json.load(open(runs["file"] + ".quality.internal.json", encoding="utf-8"))
    assert r["mauve"]["synthetic_vs_held_out"]["label"] == "internal"
    assert r["mauve"]["synthetic_vs_public_reference"]["mauve"] == m["mauve"]


def test_a_private_reference_is_refused(runs, capsys):
    """--reference naming the recipe's private training data: refused before anything is
    computed, one message naming the flag."""
    import yaml

    cfg = yaml.safe_load(open(os.path.join(runs["dp"], "config.yaml"), encoding="utf-8"))
    assert main(["synthetic", "quality", runs["file"], runs["dp"], "--reference",
                 cfg["data"]["path"], *FAST]) == 2
    err = capsys.readouterr().err
    assert "--reference" in err and "private" in err and "Traceback" not in err
