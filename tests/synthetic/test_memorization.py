"""The memorization check (internal): it finds a planted verbatim copy of a training record,
reports the k-gram match rate exactly, compares with a NON-PRIVATE baseline's samples, and
sees a reproduced audit canary."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from llmdp.cli import main
from llmdp.synthetic.generate import generate
from llmdp.synthetic.memorization import BANNER, Corpus, overlap
from tests.synthetic._runs import lines, make_run

QUIET = {"progress": False, "log": lambda *a: None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("m")
    return {"dp": make_run(base / "dp"), "baseline": make_run(base / "bl", dp=False, name="bl")}


def test_overlap_is_exact_on_known_sequences():
    train = Corpus([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [20, 21, 22]])
    # record 0 shares 1..6 (6 tokens); record 1 shares [21, 22] only; nothing crosses a
    # document boundary ([10, 20] is not a training bigram)
    synth = Corpus([[9, 1, 2, 3, 4, 5, 6, 0], [10, 20, 21, 22]])
    r = overlap(synth, train, k=3)
    assert r["longest_shared_tokens"] == 6
    assert r["longest_example"] == {"synthetic_record": 0, "training_record": 0, "tokens": 6}
    # 3-grams: record 0 has 6 windows, 4 shared; record 1 has 2 windows, 1 shared ([20 21 22])
    assert r["kgram_windows"] == 8 and r["kgram_match_rate"] == 5 / 8
    assert r["records_with_kgram_match"] == 2
    assert overlap(Corpus([[30, 31]]), train, k=3)["longest_shared_tokens"] == 0


def test_the_check_finds_a_planted_verbatim_copy_of_a_training_record(runs, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    generate(runs["dp"], out=out, num_records=8, max_new_tokens=20, **QUIET)
    clean = main(["synthetic", "check", str(out), runs["dp"]])
    assert clean == 0
    before = json.load(open(str(out) + ".memorization.internal.json"))
    assert before["internal"] == BANNER and "INTERNAL" in capsys.readouterr().out
    # plant a training record, verbatim, as synthetic record 5
    import yaml

    data = yaml.safe_load(open(os.path.join(runs["dp"], "config.yaml")))["data"]["path"]
    victim = json.loads(open(data).readlines()[3])["text"]
    recs = [json.loads(x) for x in lines(out)]
    recs[5]["text"] = victim
    planted = tmp_path / "planted.jsonl"
    planted.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    assert main(["synthetic", "check", str(planted), runs["dp"]]) == 0
    after = json.load(open(str(planted) + ".memorization.internal.json"))["dp_model"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(runs["dp"], "model"))
    n = len(tok(victim, add_special_tokens=False)["input_ids"])
    assert after["longest_shared_tokens"] >= n > before["dp_model"]["longest_shared_tokens"]
    assert after["longest_example"]["synthetic_record"] == 5 and after["longest_example_verified"]
    assert after["records_with_kgram_match"] >= 1
    assert after["kgram_match_rate"] > before["dp_model"]["kgram_match_rate"]


def test_generate_memorization_with_a_baseline_and_canaries(runs, tmp_path):
    from llmdp.audit.canaries import Canaries, write_canaries

    # the run had input canaries (an `llmdp audit` run keeps them in audit/canaries.jsonl)
    run = str(tmp_path / "audited")
    import shutil

    shutil.copytree(runs["dp"], run)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(run, "model"))
    prompt = "zq vvx kkj plo"
    rows = (np.asarray(tok(prompt, add_special_tokens=False)["input_ids"], np.int32),
            np.asarray(tok("never seen anywhere qqq", add_special_tokens=False)["input_ids"], np.int32))
    os.makedirs(os.path.join(run, "audit"))
    write_canaries(os.path.join(run, "audit", "canaries.jsonl"),
                   Canaries(rows=rows, kinds=("random", "random"), included=np.array([True, False])))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompt + "\n", encoding="utf-8")  # every record starts with canary 0
    out = tmp_path / "s.jsonl"
    logged = []
    res = generate(run, out=out, num_records=6, max_new_tokens=10, prompts=prompts,
                   memorization=True, baseline=runs["baseline"], progress=False, log=logged.append)
    report = json.load(open(res["memorization"]))
    assert report["internal"] == BANNER and any("INTERNAL" in m for m in logged)
    assert report["canaries"]["canaries"] == 2 and report["canaries"]["reproduced"] == 1
    assert report["canaries"]["reproduced_included"] == 1 and report["canaries"]["reproduced_left_out"] == 0
    bl = report["non_private_baseline"]
    assert bl["records"] == 6 and bl["k"] == 8 and "longest_shared_tokens" in bl
    # the internal numbers are not in the card (it travels with the corpus)
    card = open(tmp_path / "synthetic_data_card.json").read()
    assert "longest_shared_tokens" not in card and "canaries" not in card


def test_the_baseline_must_be_the_non_private_run(runs, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    generate(runs["dp"], out=out, num_records=2, max_new_tokens=10, **QUIET)
    rc = main(["synthetic", "check", str(out), runs["dp"], "--baseline", runs["dp"]])
    err = capsys.readouterr().err
    assert rc == 2 and "--baseline" in err and "privacy.dp is not false" in err and "Traceback" not in err
