"""`llmdp tokenizer train`: the recipe, the write-ahead ledger record, the folder, the
composition into a training run's guarantee, and the refusals."""

import json
import math
import os
import shutil
from collections import Counter

import dp_accounting
import pytest
import yaml
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from llmdp.config.schema import (
    ConfigError,
    load_recipe,
    load_tokenizer_recipe,
    tokenizer_recipe_from_dict,
)
from llmdp.privacy.accounting.accountant import threshold_delta
from llmdp.privacy.rng.keys import seeded_key
from llmdp.tokenizer import private as tp
from llmdp.tokenizer.train import corpus_units, record_texts, tokenizer_for_run, train_tokenizer
from tests.helpers import dataset_entries, dataset_records, simulate_steps, write_notes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_TOKENIZER_RECIPE = os.path.join(REPO, "tokenizers", "demo-private.yaml")
DEMO_TRAIN_RECIPE = os.path.join(REPO, "recipes", "tiny-cpu-private-tokenizer.yaml")
N_NOTES = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokcorpus")
    return write_notes(d / "notes.jsonl", N_NOTES, seed=0)


def _recipe(tmp_path, corpus, **privacy):
    return {
        "data": {"path": str(corpus), "text_field": "text", "unit": "document"},
        "privacy": {"target_epsilon": 4.0, "max_words_per_unit": 64,
                    "ledger": str(tmp_path / "ledger.sqlite"), **privacy},
        "tokenizer": {"model_type": "bpe", "vocab_size": 600},
        "output": {"dir": str(tmp_path / "tokenizers"), "name": "tok"},
    }


def _train(tmp_path, corpus, **privacy):
    cfg = tokenizer_recipe_from_dict(_recipe(tmp_path, corpus, **privacy))
    return cfg, train_tokenizer(cfg, log=lambda *_: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("tok")
    old = os.umask(0o002)  # a permissive umask (issue 37)
    try:
        cfg, info = _train(tmp, corpus)
    finally:
        os.umask(old)
    return tmp, cfg, info


# ----------------------------------------------------------------------------- the job


def test_release_is_recorded_and_described(trained):
    tmp, cfg, info = trained
    recs = [r for r in dataset_records(tmp / "ledger.sqlite", cfg.data.path) if r["kind"] == "release"]
    assert len(recs) == 1
    rec = recs[0]
    p = info["privacy"]
    sigma, tau, k = p["noise_std"], p["threshold"], p["max_words_per_unit"]
    assert k == 64 and rec["count"] == 1
    assert rec["meta"]["mechanism"] == "private-tokenizer"
    assert rec["meta"]["unit"]["kind"] == "document" and rec["meta"]["dataset_size"] == N_NOTES
    # The event is the Gaussian mechanism of multiplier sigma / sqrt(K); the threshold's
    # delta is K * Phi_bar((tau - 1) / sigma), stored with it.
    assert dataset_entries(tmp / "ledger.sqlite", cfg.data.path) == [(dp_accounting.GaussianDpEvent(sigma / math.sqrt(k)), 1)]
    d_thr = k * 0.5 * math.erfc((tau - 1) / sigma / math.sqrt(2))
    assert rec["extra"]["delta_threshold"] == pytest.approx(d_thr, rel=1e-6)
    assert threshold_delta(recs) == pytest.approx(d_thr, rel=1e-12)
    # delta defaults to a power of ten below 1/(10 N); epsilon of the release within target
    assert p["delta"] == 1e-4
    acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.GaussianDpEvent(sigma / math.sqrt(k)))
    direct = acc.get_epsilon(p["delta"] - d_thr) - math.log1p(-d_thr)
    assert p["epsilon"] == pytest.approx(direct, rel=1e-9)
    assert direct <= 4.0 + 1e-9
    assert info["dp"] is True and info["data"]["num_units"] == N_NOTES
    assert info["data"]["sha256"] and info["released_words"] > 50


def test_folder_loads_offline_and_round_trips(trained, corpus):
    from transformers import AutoTokenizer

    tmp, cfg, info = trained
    tok = AutoTokenizer.from_pretrained(cfg.out_dir)
    assert len(tok) == info["vocab_size_actual"] > 300
    assert [tok.convert_tokens_to_ids(t) for t in tp.SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = json.loads(open(corpus).readline())["text"] + " Ünïcødé ✓ 漢字"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids  # byte fallback
    assert tok.decode(ids) == text
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(cfg.out_dir, "spm.model"))
    assert sp.encode(text) == ids


def test_folder_holds_the_release_and_public_configuration_only(trained, corpus, tmp_path):
    """DESIGN, invariant `only-dp-outputs-leave`: the folder may be published: no hash of the corpus, no exact count of
    its records or units, no path of the dataset ledger. Those stay beside the folder for
    training runs on this machine; a copy of the folder alone has none of them."""
    import hashlib

    from llmdp._fs import too_open
    from llmdp.tokenizer.train import INFO_FILE, private_facts_path, read_tokenizer_info

    tmp, cfg, info = trained
    sha = hashlib.sha256(open(corpus, "rb").read()).hexdigest()
    assert info["data"]["sha256"] == sha and info["data"]["num_records"] == N_NOTES  # local view
    # at rest (issue 37): the folder, a DP release, is ordinary (umask 002 here); what stays
    # beside it and the dataset ledger are owner-only
    assert os.stat(cfg.out_dir).st_mode & 0o777 == 0o775
    assert all(os.stat(os.path.join(r, n)).st_mode & 0o777 == 0o664
               for r, _, ns in os.walk(cfg.out_dir) for n in ns)
    assert too_open(private_facts_path(cfg.out_dir)) == [] and too_open(str(tmp / "ledger.sqlite")) == []
    assert os.path.exists(private_facts_path(cfg.out_dir))
    names = (b"sha256", b"num_records", b"num_units", b"dataset_fingerprint")
    files = [os.path.join(r, n) for r, _, ns in os.walk(cfg.out_dir) for n in ns]
    assert INFO_FILE in {os.path.basename(f) for f in files}
    for path in files:
        data = open(path, "rb").read()
        assert sha[:12].encode() not in data.lower(), path
        assert not any(n in data for n in names), path
    on_disk = json.load(open(os.path.join(cfg.out_dir, INFO_FILE)))
    assert on_disk["privacy"]["release_id"] == info["privacy"]["release_id"]
    assert "ledger" not in on_disk["privacy"] and info["privacy"]["ledger"]  # the path: local only
    assert on_disk["data"] == {"unit": "document", "user_field": None, "source": info["data"]["source"]}
    # The local facts: beside the folder, not in it; merged back by read_tokenizer_info.
    from llmdp.tokenizer.train import private_facts_path

    facts = private_facts_path(cfg.out_dir)
    assert os.path.dirname(facts) == os.path.dirname(os.path.abspath(cfg.out_dir))
    assert read_tokenizer_info(cfg.out_dir)["data"]["num_units"] == N_NOTES
    copy = tmp_path / "copied-tok"
    shutil.copytree(cfg.out_dir, copy)
    assert "sha256" not in read_tokenizer_info(copy)["data"]


def test_second_launch_does_nothing_and_other_recipe_is_refused(trained):
    tmp, cfg, info = trained
    before = dataset_records(tmp / "ledger.sqlite", cfg.data.path)
    again = train_tokenizer(cfg, log=lambda *_: None)
    assert again["privacy"]["release_id"] == info["privacy"]["release_id"]
    assert dataset_records(tmp / "ledger.sqlite", cfg.data.path) == before  # no second release
    other = tokenizer_recipe_from_dict({**_recipe(tmp, cfg.data.path), "tokenizer": {"vocab_size": 700}})
    with pytest.raises(ConfigError, match=r"output\.name.*different recipe"):
        train_tokenizer(other, log=lambda *_: None)
    assert dataset_records(tmp / "ledger.sqlite", cfg.data.path) == before


def test_budget_refuses_before_recording(tmp_path, corpus):
    from llmdp.privacy.ledger.service import BudgetError

    with pytest.raises(BudgetError, match=r"privacy\.budget_epsilon=3"):
        _train(tmp_path, corpus, budget_epsilon=3.0)
    assert dataset_entries(tmp_path / "ledger.sqlite", corpus) == []
    assert not (tmp_path / "tokenizers" / "tok").exists()


def test_the_datasets_budget_checks_a_tokenizer_whatever_its_recipe_says(tmp_path, corpus):
    """Issue 29 item 2: a private tokenizer's release is checked against the dataset's budget
    (its ledger's): without a budget in its recipe it is refused when it does not fit; with
    another budget, or for another privacy unit, it is refused naming both."""
    from llmdp.cli import main
    from llmdp.privacy.ledger.service import BudgetError

    db, ds = str(tmp_path / "ledger.sqlite"), "path:" + os.path.realpath(corpus)

    def set_budget(*args):
        assert main(["privacy", "ledger", "set-budget", "--dataset", ds, "--ledger", db, "--create",
                     "--epsilon", "3", "--delta", "1e-4", *args]) == 0

    set_budget("--unit", "document")
    with pytest.raises(BudgetError, match=r"the dataset's budget ε = 3 \(recorded in its ledger; this "
                                          r"recipe sets no privacy.budget_epsilon\).*it would be"):
        _train(tmp_path, corpus)
    with pytest.raises(BudgetError, match=r"privacy.budget_epsilon=10 .*is not the budget of the "
                                          r"dataset ledger .*ε = 3 at δ = 0.0001 \(pld\)"):
        _train(tmp_path, corpus, budget_epsilon=10.0)
    set_budget("--unit", "user", "--user-field", "user_id")  # no release yet: the unit may change
    with pytest.raises(BudgetError, match=r"budget for the privacy unit \"user \(records sharing "
                                          r"'user_id'\)\".*this release is for the privacy unit 'document'"):
        _train(tmp_path, corpus)
    assert dataset_entries(tmp_path / "ledger.sqlite", corpus) == []
    assert not (tmp_path / "tokenizers" / "tok").exists()


def test_user_units_group_records(tmp_path, corpus):
    cfg = tokenizer_recipe_from_dict({**_recipe(tmp_path, corpus),
                                      "data": {"path": str(corpus), "unit": "user", "user_field": "user_id"}})
    units, info = corpus_units(cfg)
    rows = [json.loads(line) for line in open(corpus)]
    users = Counter(r["user_id"] for r in rows)
    assert info["num_units"] == len(users) == len(units) and info["num_records"] == N_NOTES
    assert sorted(map(len, units)) == sorted(
        sum(len(r["text"].split()) for r in rows if r["user_id"] == u) for u in users)


def test_record_texts_of_each_format():
    assert record_texts({"text": "a b"}) == ["a b"]
    assert record_texts({"m": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                        messages_field="m") == ["hi", "yo"]
    assert record_texts({"p": "q?", "r": "a."}, prompt_field="p", response_field="r") == ["q?", "a."]


def test_tokenizer_recipe_errors(tmp_path, corpus):
    base = _recipe(tmp_path, corpus)
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon: required"):
        tokenizer_recipe_from_dict({**base, "privacy": {"max_words_per_unit": 8}})
    with pytest.raises(ConfigError, match=r"data\.user_field: required"):
        tokenizer_recipe_from_dict({**base, "data": {"path": str(corpus), "unit": "user"}})
    with pytest.raises(ConfigError, match=r"data\.unit.*'sequence'"):
        tokenizer_recipe_from_dict({**base, "data": {"path": str(corpus), "unit": "sequence"}})
    with pytest.raises(ConfigError, match=r"privacy\.max_word_per_unit: unknown key; did you mean "
                                          r"'privacy\.max_words_per_unit'"):
        tokenizer_recipe_from_dict({**base, "privacy": {"target_epsilon": 1, "max_word_per_unit": 3}})
    with pytest.raises(ConfigError, match="training recipe"):
        load_tokenizer_recipe(os.path.join(REPO, "recipes", "tiny-cpu.yaml"))
    cfg = load_tokenizer_recipe(DEMO_TOKENIZER_RECIPE, ["privacy.target_epsilon=3"])
    assert cfg.privacy.target_epsilon == 3 and cfg.output.name == "demo-private"


def test_cli(tmp_path, corpus, capsys):
    from llmdp.cli import main

    recipe = tmp_path / "t.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, corpus)))
    assert main(["tokenizer", "train", str(recipe), "tokenizer.vocab_size=500"]) == 0
    out = capsys.readouterr().out
    assert "recorded in the dataset ledger" in out and "words released" in out
    assert json.load(open(tmp_path / "tokenizers" / "tok" / "llmdp_tokenizer.json"))["dp"] is True
    assert main(["tokenizer", "train", str(recipe), "privacy.dp=false"]) == 2
    assert "target_epsilon" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the demo's settings


def test_single_unit_words_never_in_the_vocabulary_at_demo_settings(tmp_path):
    """At the demo's (epsilon, delta, K), over many seeded runs on a corpus of synthetic
    notes, no word held by a single note is released, so no such word is a piece of the
    vocabulary; words held by many notes are (the test cannot pass vacuously)."""
    from llmdp.data.synthetic import generate_clinical_notes
    from llmdp.privacy.plan import default_delta

    demo = load_tokenizer_recipe(DEMO_TOKENIZER_RECIPE)
    k = demo.privacy.max_words_per_unit
    n_demo = demo.data.synthetic.num_documents
    delta = demo.privacy.delta or default_delta(n_demo)
    sigma, tau, _ = tp.calibrate_tokenizer_noise(demo.privacy.target_epsilon, delta, k)
    units = [tp.unit_words(r["text"]) for r in generate_clinical_notes(1000, 3)]
    df = Counter(w for u in units for w in set(u))
    single = {w for w, c in df.items() if c == 1}
    assert len(single) > 1000  # names, record numbers, dates, values
    frequent = {w for w, c in df.items() if c >= 900}
    assert len(frequent) > 5
    released_any = set()
    for run in range(12):
        counts = tp.dp_word_counts(units, max_words_per_unit=k, noise_multiplier=sigma,
                                   threshold=tau, key=seeded_key(run, 0, "demo-canary"))
        assert not single & set(counts)
        assert frequent <= set(counts)
        released_any |= set(counts)
    # One trained vocabulary: its pieces come from released words only, so a single-note
    # word is a piece only if it also begins a word that several notes hold.
    out = tp.train_sentencepiece_from_counts(counts, vocab_size=demo.tokenizer.vocab_size,
                                             out_dir=tmp_path / "tok", model_type=demo.tokenizer.model_type)
    from transformers import AutoTokenizer

    vocab = set(AutoTokenizer.from_pretrained(out).get_vocab())
    shared_prefixes = {w[:i] for w, c in df.items() if c >= 2 for i in range(1, len(w) + 1)}
    leaked = [w for w in single if "▁" + w in vocab and w not in shared_prefixes]
    assert leaked == []
    assert any("▁" + w in vocab for w in frequent)


# ----------------------------------------------------------------------------- use in training


def _train_cfg(tok_dir, corpus, tmp_path, *overrides):
    return load_recipe(DEMO_TRAIN_RECIPE, [
        f"model.tokenizer={tok_dir}", f"data.path={corpus}", "data.synthetic=null",
        f"output.dir={tmp_path / 'runs'}", "train.expected_batch_size=32", "train.steps=12",
        "optim.warmup_steps=2", "train.checkpoint_every=4", *overrides])


def test_non_dp_private_tokenizer_is_refused(tmp_path, corpus):
    cfg, info = _train(tmp_path, corpus, dp=False, target_epsilon=None)
    assert info["dp"] is False and info["trained_on_private_data"] is True
    assert not (tmp_path / "ledger.sqlite").exists()  # nothing DP was released
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path)
    with pytest.raises(ConfigError, match=r"model\.tokenizer:.*WITHOUT differential privacy"):
        tokenizer_for_run(train_cfg.model, train_cfg.data, data_sha256="x")
    from llmdp.run.launch import prepare

    with pytest.raises(ConfigError, match=r"model\.tokenizer:.*WITHOUT differential privacy"):
        prepare(train_cfg, log=lambda *_: None)
    assert not os.path.exists(os.path.join(train_cfg.run_dir, "plan.json"))


def test_unit_mismatch_other_data_and_pretrained_rules(trained, corpus, tmp_path):
    tmp, cfg, info = trained
    sha = info["data"]["sha256"]
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path, "data.unit=sequence")
    with pytest.raises(ConfigError, match=r"data\.unit: 'sequence'.*'document' units"):
        tokenizer_for_run(train_cfg.model, train_cfg.data, data_sha256=sha)
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path, "data.unit=user", "data.user_field=user_id")
    with pytest.raises(ConfigError, match=r"data\.unit: 'user'"):
        tokenizer_for_run(train_cfg.model, train_cfg.data, data_sha256=sha)
    same = tokenizer_for_run(_train_cfg(cfg.out_dir, corpus, tmp_path).model,
                             _train_cfg(cfg.out_dir, corpus, tmp_path).data, data_sha256=sha)
    assert same["compose"] and same["release"]["release_id"] == info["privacy"]["release_id"]
    # Another source (a different file hash): composed by default, never "independent".
    other = tokenizer_for_run(_train_cfg(cfg.out_dir, corpus, tmp_path).model,
                              _train_cfg(cfg.out_dir, corpus, tmp_path).data, data_sha256="0" * 64)
    assert other["kind"] == "private-dp" and other["compose"] and other["tokenizer_data"] == "same"
    assert other["release"]["release_id"] == info["privacy"]["release_id"]
    assert "composed into this run's guarantee (model.tokenizer_data: same, the default" in other["summary"]
    assert "independent" not in other["summary"].split("declare")[0]
    # ... with the unit check too (the message offers the declaration).
    seq = _train_cfg(cfg.out_dir, corpus, tmp_path, "data.unit=sequence")
    with pytest.raises(ConfigError, match=r"data\.unit: 'sequence'.*declare model\.tokenizer_data: independent"):
        tokenizer_for_run(seq.model, seq.data, data_sha256="0" * 64)
    # Declared independent: not composed, and worded so.
    ind = _train_cfg(cfg.out_dir, corpus, tmp_path, "model.tokenizer_data=independent")
    other = tokenizer_for_run(ind.model, ind.data, data_sha256="0" * 64)
    assert other["kind"] == "private-dp" and not other["compose"] and other["release"] is None
    assert other["summary"].endswith("not composed: declared independent by model.tokenizer_data; "
                                     "if the two sources share individuals, the ε add up")
    # ... which the same source (same file contents) contradicts.
    with pytest.raises(ConfigError, match=r"model\.tokenizer_data: 'independent', but .* this very data source"):
        tokenizer_for_run(ind.model, ind.data, data_sha256=sha)
    with pytest.raises(ConfigError, match=r"privacy\.delta"):
        tokenizer_for_run(train_cfg.model, _train_cfg(cfg.out_dir, corpus, tmp_path).data,
                          data_sha256=sha, delta=info["privacy"]["delta_threshold"] / 2)
    pre = _train_cfg(cfg.out_dir, corpus, tmp_path, "model.init=pretrained",
                     f"model.name_or_path={tmp_path}")
    with pytest.raises(ConfigError, match=r"model\.base_tokenizer: required"):
        tokenizer_for_run(pre.model, pre.data, data_sha256=sha)
    missing = _train_cfg(str(tmp_path / "nope"), corpus, tmp_path)
    with pytest.raises(ConfigError, match=r"model\.tokenizer:.*does not exist.*llmdp tokenizer train"):
        tokenizer_for_run(missing.model, missing.data, data_sha256=sha)


def test_training_composes_the_tokenizer_release(trained, corpus, tmp_path, monkeypatch):
    """prepare() calibrates sigma for the composition; the report's epsilon equals
    dp-accounting on the composed events (PLD and RDP), with the threshold's delta."""
    from llmdp.report.build import build_report
    from llmdp.run.launch import prepare

    tmp, cfg, info = trained
    # The run's dataset ledger is not the tokenizer's file: the release is copied there.
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))  # this test's own ledgers
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path, "privacy.target_epsilon=6")
    prepared = prepare(train_cfg, log=lambda *_: None)
    plan = prepared.plan
    p = info["privacy"]
    tok_event = dp_accounting.GaussianDpEvent(p["noise_std"] / math.sqrt(p["max_words_per_unit"]))
    d_thr = p["delta_threshold"]
    ds = prepared.ledger.service["dataset_id"]
    assert dataset_entries(None, dataset_id=ds) == [(tok_event, 1)]
    assert threshold_delta(dataset_records(None, dataset_id=ds)) == pytest.approx(d_thr, rel=1e-12)
    from llmdp.tokenizer.train import ensure_release_recorded

    plan_info = json.load(open(os.path.join(prepared.run_dir, "plan.json")))
    # What a re-launch does: the release is there already, nothing is copied again.
    assert not ensure_release_recorded(plan_info["prior_releases"][0], {
        "location": prepared.ledger.service["location"], "dataset_id": ds}, {})
    assert dataset_entries(None, dataset_id=ds) == [(tok_event, 1)]

    simulate_steps(prepared)  # the run's steps, as the ledger service writes them
    report = build_report(prepared.run_dir)

    def direct(acc, sigma, delta):
        acc.compose(dp_accounting.ComposedDpEvent([
            tok_event,
            dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
                plan.sampling_probability, dp_accounting.GaussianDpEvent(sigma)), plan.steps)]))
        return acc.get_epsilon(delta - d_thr) - math.log1p(-d_thr)

    rel = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    want = direct(PLDAccountant(rel), plan.noise_multiplier, plan.accountant_delta)
    assert report["epsilon"] == pytest.approx(want, rel=1e-9)
    assert report["epsilon_by_accountant"]["rdp"] == pytest.approx(
        direct(RdpAccountant(), plan.noise_multiplier, plan.accountant_delta), rel=1e-9)
    assert report["epsilon"] <= 6.0 + 1e-9
    # sigma is the smallest (to the calibration's tolerance) that meets the target
    assert direct(PLDAccountant(rel), plan.noise_multiplier * (1 - 3e-3), plan.accountant_delta) > 6.0
    assert report["epsilon_training_only"] < report["epsilon"]
    assert report["tokenizer"]["kind"] == "private-dp" and report["tokenizer"]["composed_into_guarantee"]
    assert "trained from scratch" in report["tokenizer"]["model_vocabulary"]
    mech = [r["mechanism"] for r in report["ledger"]["releases"]]
    assert mech[0] == "private-tokenizer" and set(mech[1:]) == {"dp-sgd"}
    # The dataset ledger (budget) holds the tokenizer's release and the steps, accounted
    # with the threshold's delta: the same composition as the run's.
    assert report["dataset_ledger"]["epsilon_spent"] == pytest.approx(want, rel=1e-9)
    from llmdp.report.render import render_markdown

    md = render_markdown(report)
    assert "private-tokenizer" in md and "training steps alone" in md
    shutil.rmtree(prepared.run_dir)


def test_pretrained_model_adapted_to_the_private_tokenizer(trained, corpus, tmp_path, monkeypatch):
    """A pretrained checkpoint (its own byte-level tokenizer) fine-tuned with the private
    tokenizer: the embeddings are rebuilt for the new vocabulary and the report says so."""
    from transformers import AutoTokenizer

    from llmdp.report.build import build_report
    from llmdp.run.launch import prepare
    from llmdp.train.models import build_tiny_model
    from tests.helpers import tiny_model_config

    tmp, cfg, info = trained
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))  # this test's own ledgers
    base_tok_dir = os.path.join(REPO, "tokenizers", "demo-public")
    base = AutoTokenizer.from_pretrained(base_tok_dir)
    ckpt = build_tiny_model(tmp_path / "pretrained", tiny_model_config("llama"), len(base),
                            base.pad_token_id, base.bos_token_id, base.eos_token_id)
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path, "model.init=pretrained",
                           f"model.name_or_path={ckpt}", f"model.base_tokenizer={base_tok_dir}",
                           "model.lora.r=4", "output.name=adapted")
    prepared = prepare(train_cfg, log=lambda *_: None)
    plan_info = json.load(open(os.path.join(prepared.run_dir, "plan.json")))
    stats = plan_info["tokenizer"]["vocab_adaptation"]
    assert stats["vocab_size_new"] == info["vocab_size_actual"] == plan_info["tokenizer"]["vocab_size"]
    assert stats["vocab_size_base"] == len(base)
    assert stats["copied"] + stats["mean_of_pieces"] + stats["special"] + stats["fallback"] == stats["vocab_size_new"]
    assert stats["copied"] > 100  # many private pieces are exactly one public token
    assert plan_info["prior_releases"][0]["release_id"] == info["privacy"]["release_id"]
    report = build_report(prepared.run_dir)
    assert "adapted to the private tokenizer" in report["tokenizer"]["model_vocabulary"]
    assert report["tokenizer"]["vocab_adaptation"] == stats


# ----------------------------------------------------------------------------- issue 12, items 4 and 7


def _report_after_steps(train_cfg):
    """prepare() the run, write its steps to its ledger as the ledger service does, and
    build its report (no training: the report is a function of the ledger and plan)."""
    from llmdp.report.build import build_report
    from llmdp.run.launch import prepare

    prepared = prepare(train_cfg, log=lambda *_: None)
    simulate_steps(prepared)
    return prepared, build_report(prepared.run_dir)


def _tok_event(info):
    p = info["privacy"]
    return dp_accounting.GaussianDpEvent(p["noise_std"] / math.sqrt(p["max_words_per_unit"])), p["delta_threshold"]


def _training_event(plan):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        plan.sampling_probability, dp_accounting.GaussianDpEvent(plan.noise_multiplier)), plan.steps)


@pytest.fixture(scope="module")
def other_corpus(tmp_path_factory):
    """Another file (other notes): llmdp cannot tell whether it holds the same people."""
    return write_notes(tmp_path_factory.mktemp("othercorpus") / "other.jsonl", N_NOTES, seed=1)


def test_tokenizer_on_another_source_is_composed_by_default(trained, other_corpus, tmp_path, monkeypatch):
    """model.tokenizer_data: same (default): a DP tokenizer trained on another file is
    composed into the run's guarantee; ε equals dp-accounting on the composition."""
    tmp, cfg, info = trained
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))  # this test's own ledgers
    prepared, report = _report_after_steps(
        _train_cfg(cfg.out_dir, other_corpus, tmp_path, "privacy.noise_multiplier=1.5",
                   "privacy.target_epsilon=null"))
    plan = prepared.plan
    tok_event, d_thr = _tok_event(info)
    acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.ComposedDpEvent([tok_event, _training_event(plan)]))
    assert report["epsilon"] == pytest.approx(
        acc.get_epsilon(plan.accountant_delta - d_thr) - math.log1p(-d_thr), rel=1e-9)
    acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert report["epsilon_training_only"] == pytest.approx(
        acc.compose(_training_event(plan)).get_epsilon(plan.accountant_delta), rel=1e-9)
    assert report["epsilon"] > report["epsilon_training_only"]
    t = report["tokenizer"]
    assert t["composed_into_guarantee"] and t["tokenizer_data"] == "same"
    assert "another data source, which may share individuals" in t["note"]
    assert "model.tokenizer_data: same, the default" in t["note"]
    assert not any("independent" in x for x in report["data_accesses_not_covered"])
    # The release is in this data's ledger (its budget) too.
    assert (tok_event, 1) in dataset_entries(None, dataset_id=prepared.ledger.service["dataset_id"])


def test_tokenizer_declared_independent_is_not_composed_and_said_so(trained, other_corpus, tmp_path,
                                                                     monkeypatch):
    from llmdp.report.render import render_markdown

    tmp, cfg, info = trained
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))  # this test's own ledgers
    prepared, report = _report_after_steps(
        _train_cfg(cfg.out_dir, other_corpus, tmp_path, "privacy.noise_multiplier=1.5",
                   "privacy.target_epsilon=null", "model.tokenizer_data=independent"))
    plan = prepared.plan
    acc = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    alone = acc.compose(_training_event(plan)).get_epsilon(plan.accountant_delta)
    assert report["epsilon"] == pytest.approx(alone, rel=1e-9)
    wording = ("not composed: declared independent by model.tokenizer_data; if the two sources "
               "share individuals, the ε add up")
    t = report["tokenizer"]
    assert not t["composed_into_guarantee"] and t["tokenizer_data"] == "independent"
    assert wording in t["note"] and t["composition"].startswith("not composed: declared independent")
    assert any(wording in x for x in report["data_accesses_not_covered"])
    assert "covered by its own guarantee" not in json.dumps(report)
    assert wording in render_markdown(report)
    tok_event, _ = _tok_event(info)
    assert tok_event not in [e for e, _ in dataset_entries(None, dataset_id=prepared.ledger.service["dataset_id"])]


def test_tokenizer_data_is_validated():
    with pytest.raises(ConfigError, match=r"model\.tokenizer_data: 'indep' is not one of \['same', 'independent'\]"):
        load_recipe(DEMO_TRAIN_RECIPE, ["model.tokenizer_data=indep"])


@pytest.fixture(scope="module")
def seeded_tokenizer(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("seededtok")
    with pytest.MonkeyPatch.context() as mp:
        # its own registry of ledger databases: a second DP release on the corpus in another
        # database than `trained`'s is refused where both are listed (issue 49 item 3)
        mp.setenv("XDG_DATA_HOME", str(tmp))
        cfg, info = _train(tmp, corpus, rng="seeded", seed=7)
    assert info["privacy"]["rng"] == "seeded"
    return tmp, cfg, info


def test_seeded_tokenizer_release_is_labelled_seeded(seeded_tokenizer, corpus, tmp_path, monkeypatch):
    """Issue 12 item 4: a run on a secure RNG with a seeded private tokenizer is reported
    as seeded, with the warning, not "RNG: secure"."""
    from llmdp.report.render import render_markdown

    tmp, cfg, info = seeded_tokenizer
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))  # this test's own ledgers
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path, "privacy.noise_multiplier=1.5",
                           "privacy.target_epsilon=null")
    assert train_cfg.privacy.rng == "secure"
    _, report = _report_after_steps(train_cfg)
    assert report["rng_mode"] == "seeded" and report["tokenizer"]["rng"] == "seeded"
    assert "NO privacy guarantee against anyone who knows that seed" in report["rng_warning"]
    assert "private tokenizer" in report["rng_warning"]
    md = render_markdown(report)
    assert "| RNG mode | seeded |" in md and "> **Warning:**" in md
    # Declared independent (not composed) changes nothing: the vocabulary is in the model.
    ind = _train_cfg(cfg.out_dir, write_notes(tmp_path / "o.jsonl", 50, seed=3), tmp_path,
                     "privacy.noise_multiplier=1.5", "privacy.target_epsilon=null",
                     "model.tokenizer_data=independent", "output.name=ind",
                     "privacy.delta=1e-3")  # 50 documents: δ must be given (N < 100)
    _, report = _report_after_steps(ind)
    assert report["rng_mode"] == "seeded" and "private tokenizer" in report["rng_warning"]


def test_seeded_tokenizer_run_is_refused_by_export(seeded_tokenizer, corpus, tmp_path, monkeypatch):
    from llmdp.hub.export import ExportError, export_run
    from llmdp.report.build import write_report
    from llmdp.run.launch import prepare
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    tmp, cfg, info = seeded_tokenizer
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))  # this test's own ledgers
    train_cfg = _train_cfg(cfg.out_dir, corpus, tmp_path, "privacy.noise_multiplier=1.5",
                           "privacy.target_epsilon=null", "train.steps=2", "train.checkpoint_every=2",
                           "train.expected_batch_size=8", "train.physical_batch_size=8",
                           "data.sequence_length=32", "optim.warmup_steps=0", "model.tiny.hidden_size=16",
                           "model.tiny.num_layers=1", "model.tiny.intermediate_size=32",
                           "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1")
    prep = prepare(train_cfg, log=lambda *_: None)
    ckpt = os.path.join(prep.run_dir, "checkpoints", "checkpoint_000000")
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    report = write_report(prep.run_dir)
    assert report["status"] == "complete" and report["rng_mode"] == "seeded"
    with pytest.raises(ExportError, match=r"seeded RNG \(the private tokenizer .*privacy\.rng: seeded\)"):
        export_run(prep.run_dir, tmp_path / "out", log=lambda *a: None)
    # A report written before this check (saying "secure") does not get it through either.
    stored = json.load(open(os.path.join(prep.run_dir, "privacy_report.json")))
    stored.update(rng_mode="secure", rng_warning=None)
    json.dump(stored, open(os.path.join(prep.run_dir, "privacy_report.json"), "w"))
    with pytest.raises(ExportError, match=r"seeded RNG \(the private tokenizer"):
        export_run(prep.run_dir, tmp_path / "out2", log=lambda *a: None)


def test_two_seeded_tokenizer_releases_draw_different_noise(tmp_path, corpus, monkeypatch):
    """Issue 49 item 6: the seeded key names the release (its run id), so two releases with
    one seed (on neighbouring corpora, say) never share noise that differencing cancels."""
    from llmdp.tokenizer import private as tp

    seen, real = [], tp.dp_word_counts
    monkeypatch.setattr(tp, "dp_word_counts", lambda *a, **k: seen.append(k["key"]) or real(*a, **k))
    for i in range(2):  # one ledger, two output folders
        raw = _recipe(tmp_path, corpus, rng="seeded", seed=7)
        raw["output"]["name"] = f"tok{i}"
        train_tokenizer(tokenizer_recipe_from_dict(raw), log=lambda *_: None)
    assert len(seen) == 2 and seen[0] != seen[1]
