"""Bad input through the user's path (`llmdp train recipe key=value`): one message that names
the file, the line/record and the field, exit code 2, no traceback, and nothing left behind
(no runs/<name>/ directory, no dataset-ledger line).

Issue 12, items 9 and 10 and "no empty run dir".
"""

from __future__ import annotations

import json
import os

import pytest

from llmdp.cli import main
from tests.helpers import tiny_tokenizer_dir, write_notes

TINY = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 32, "max_position_embeddings": 64}


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    return tmp_path


def write_recipe(workdir, data: dict, model: dict | None = None, name: str = "r") -> str:
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(), "tiny": TINY, **(model or {})},
        "data": {"sequence_length": 16, **data},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-3},
        "optim": {"schedule": "constant"},
        "train": {"expected_batch_size": 2, "steps": 2, "physical_batch_size": 2},
        "output": {"dir": "runs"},
    }
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return str(path)


def ledger_rows() -> int | None:
    """The records of every dataset ledger in $LLMDP_HOME's database (None: no database),
    read with sqlite3 itself (nothing of llmdp's that could create or register it)."""
    import sqlite3

    path = os.path.join(os.environ["LLMDP_HOME"], "ledger.sqlite")
    if not os.path.exists(path):
        return None
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT COUNT(*) FROM llmdp_records").fetchone()[0]
    finally:
        conn.close()


def train_fails(workdir, capsys, recipe: str, *overrides: str) -> str:
    """Runs `llmdp train`; asserts one clean error and nothing left behind (no run folder,
    no lock file, no new dataset-ledger record); returns stderr."""
    before = ledger_rows()
    rc = main(["train", recipe, *overrides])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert err.count("llmdp: error:") == 1, err
    err = err[err.index("llmdp: error:"):]  # (after any progress bar of the data loading)
    assert err.count("\n") == 1, err
    name = os.path.splitext(os.path.basename(recipe))[0]
    assert not os.path.exists(workdir / "runs" / name), os.listdir(workdir / "runs")
    # Issue 30 item 12: a refused launch leaves no lock file either.
    assert not os.path.exists(workdir / "runs" / f".{name}.lock"), os.listdir(workdir / "runs")
    ledgers = workdir / "cache" / "ledgers"
    assert not ledgers.exists() or not any(
        p.stat().st_size for p in ledgers.iterdir()), list(ledgers.iterdir())
    assert ledger_rows() == before  # issue 51: nothing spent, reserved or started
    return err


def write_lines(path, lines) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


GOOD = [{"text": f"note number {i} about the patient and the visit"} for i in range(6)]


# ------------------------------------------------------------------------- item 10


def test_empty_jsonl(workdir, capsys):
    data = workdir / "empty.jsonl"
    data.write_text("")
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "empty.jsonl"}))
    assert str(data) in err and "data.path" in err and "no records" in err, err


@pytest.mark.parametrize("ext,content", [(".txt", "a note about the visit\n"),
                                         (".jsonl", json.dumps(GOOD[0]) + "\n")])
@pytest.mark.parametrize("blank", ["", "  \n\n"])
def test_an_empty_file_in_a_folder_is_named(workdir, capsys, ext, content, blank):
    """Issue 30 item 11: a folder's empty (or blank) file stops the run, naming the file,
    as an empty single file does; it is never skipped silently."""
    folder = workdir / "notes"
    folder.mkdir()
    for i in range(3):
        (folder / f"n{i}{ext}").write_text(content)
    (folder / f"zz-empty{ext}").write_text(blank)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes"}))
    assert f"zz-empty{ext}" in err and "no records" in err, err


def test_plan_chunks_names_an_empty_file(tmp_path):
    """The same on the Ray Data path's chunk planner."""
    from llmdp.config.schema import ConfigError
    from llmdp.data.chunks import plan_chunks

    (tmp_path / "a.txt").write_text("one note\n")
    (tmp_path / "b.txt").write_text("\n \n")
    with pytest.raises(ConfigError, match="b.txt holds no data"):
        plan_chunks(str(tmp_path), "auto", "file", 1 << 20)


def test_malformed_jsonl_line_names_the_right_line(workdir, capsys):
    lines = [json.dumps(r) for r in GOOD]
    lines.insert(3, '{"text": "unterminated')  # line 4
    write_lines(workdir / "bad.jsonl", lines)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "bad.jsonl"}))
    assert f"{workdir / 'bad.jsonl'}:4" in err and "not valid JSON" in err, err
    assert ":5" not in err and ":3:" not in err, err


def test_non_utf8_bytes_name_file_and_line(workdir, capsys):
    lines = [json.dumps(r) for r in GOOD]
    with open(workdir / "latin1.jsonl", "wb") as f:
        for i, line in enumerate(lines):
            if i == 2:  # line 3 holds Latin-1 bytes
                f.write(json.dumps({"text": "caf"}).encode()[:-2] + b"\xe9\"}\n")
            else:
                f.write(line.encode() + b"\n")
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "latin1.jsonl"}))
    assert f"{workdir / 'latin1.jsonl'}:3" in err and "UTF-8" in err, err


def test_non_utf8_text_file(workdir, capsys):
    (workdir / "notes").mkdir()
    (workdir / "notes" / "a.txt").write_text("a fine note\n")
    (workdir / "notes" / "b.txt").write_bytes(b"first line\nsecond \xff line\n")
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes"}))
    assert f"{workdir / 'notes' / 'b.txt'}:2" in err and "UTF-8" in err, err


@pytest.mark.parametrize("value", ["./no-such-tokenizer", "tokenizers/x/y", "runs/tok"])
def test_missing_relative_tokenizer_path_is_not_sent_to_a_hub(workdir, capsys, monkeypatch, value):
    import transformers

    (workdir / "runs").mkdir()  # "runs/tok": its parent exists, so it is a path
    write_lines(workdir / "ok.jsonl", GOOD)
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(name, *a, **k):
        calls.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "ok.jsonl"}),
                      f"model.tokenizer={value}")
    assert "model.tokenizer" in err and "does not exist" in err, err
    assert os.path.normpath(os.path.join(workdir, value)) in err, err
    assert calls == [], calls


# ------------------------------------------------------------------------- item 9


def test_missing_text_field_is_refused(workdir, capsys):
    write_lines(workdir / "d.jsonl", GOOD[:2] + [{"body": "no text here"}] + GOOD[2:])
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "d.jsonl"}))
    assert f"{workdir / 'd.jsonl'}:3" in err and "data.text_field='text'" in err, err
    assert "data.on_bad_record" in err, err


def test_number_in_text_field_is_refused(workdir, capsys):
    write_lines(workdir / "d.jsonl", GOOD[:4] + [{"text": 12345}] + GOOD[4:])
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "d.jsonl"}))
    assert f"{workdir / 'd.jsonl'}:5" in err and "data.text_field='text'" in err, err
    assert "int" in err and "data.on_bad_record" in err, err


def test_all_empty_texts_are_refused_for_sequence_units(workdir, capsys):
    write_lines(workdir / "d.jsonl", [{"text": ""}] * 5)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "d.jsonl"}))
    assert f"{workdir / 'd.jsonl'}:1" in err and "empty" in err, err


def test_unknown_chat_role_is_refused(workdir, capsys):
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(5)]
    chats[2]["messages"][1]["role"] = "assitant"
    write_lines(workdir / "c.jsonl", chats)
    err = train_fails(workdir, capsys, write_recipe(
        workdir, {"path": "c.jsonl", "messages_field": "messages", "chat_template": "none"}))
    assert f"{workdir / 'c.jsonl'}:3" in err and "'assitant'" in err, err
    assert "data.messages_field" in err, err


def test_bad_text_file_choice_is_refused(workdir, capsys):
    (workdir / "notes").mkdir()
    (workdir / "notes" / "a.txt").write_text("one\ntwo\n")
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes"}),
                      "data.text_split=sentence")
    assert "data.text_split" in err and "'sentence'" in err, err


# ------------------------------------------------------------------------- run dir


def test_validation_error_after_data_loading_leaves_no_run_dir(workdir, capsys):
    write_notes(workdir / "notes.jsonl", 4)
    # 4 documents give fewer units than the expected batch size: refused after the data
    # were loaded and tokenized.
    recipe = write_recipe(workdir, {"path": "notes.jsonl", "unit": "document",
                                    "max_rows_per_unit": 1})
    err = train_fails(workdir, capsys, recipe, "train.expected_batch_size=50")
    assert "train.expected_batch_size" in err, err


def test_text_folder_gives_one_document_unit_per_file_and_the_report_says_so(workdir):
    """Issue 12 item 9: 12 note files of several lines each are 12 document units (not one
    per line), and the report states how records were read."""
    from llmdp.config.schema import load_recipe
    from llmdp.report.build import write_report
    from llmdp.run.launch import prepare

    (workdir / "notes").mkdir()
    for i in range(12):
        (workdir / "notes" / f"{i:03d}.txt").write_text(
            f"Note {i}.\nThe patient was seen.\n\nPlan: follow up in {i} weeks.\n")
    recipe = write_recipe(workdir, {"path": "notes", "unit": "document", "max_rows_per_unit": 2})
    prep = prepare(load_recipe(recipe, []), log=lambda *a: None)
    assert prep.plan.dataset_size == 12 and prep.data_stats["num_records"] == 12
    report = write_report(prep.run_dir)
    assert "one record per text file (data.text_split=file)" in report["records"]
    assert "data.on_bad_record=error" in report["records"]
    with open(os.path.join(prep.run_dir, "privacy_report.md"), encoding="utf-8") as f:
        assert "one record per text file (data.text_split=file)" in f.read()
    lines = prepare(load_recipe(recipe, ["data.text_split=line", "output.name=lines"]),
                    log=lambda *a: None)
    assert lines.plan.dataset_size == 36
    para = prepare(load_recipe(recipe, ["data.text_split=paragraph", "output.name=para"]),
                   log=lambda *a: None)
    assert para.plan.dataset_size == 24


def test_max_units_cap_is_refused_with_the_replacement(workdir, capsys):
    """Issue 12 item 8d: a cap by count is not add/remove-one relative to the corpus."""
    write_lines(workdir / "ok.jsonl", GOOD)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "ok.jsonl"}),
                      "data.max_units=3")
    assert "data.max_units: 3" in err and "data.unit_fraction" in err and "replace-one" in err, err


def test_unit_fraction_is_stated_in_the_record_description():
    from llmdp.data.sources import describe_records

    text = describe_records({"path": None, "unit_fraction": 0.25, "on_bad_record": "skip"})
    assert "data.unit_fraction=0.25" in text and "add/remove-one" in text
    assert "data.on_bad_record=skip" in text


def test_unknown_bare_tokenizer_name_is_one_message(workdir, capsys):
    """A bare name (a possible Hub id) that is neither a folder nor loadable offline."""
    write_lines(workdir / "ok.jsonl", GOOD)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "ok.jsonl"}),
                      "model.tokenizer=no-such-tokenizer-xyz")
    assert "model.tokenizer: 'no-such-tokenizer-xyz' is not a local folder and not in the Hugging Face cache" in err, err


@pytest.mark.parametrize("value,is_path", [
    ("meta-llama/Llama-3.2-1B", False), ("gpt2", False), ("Qwen/Qwen2.5-7B-Instruct", False),
    ("./tok", True), ("../tok", True), ("tokenizers/x/y", True), ("runs/tok", True),
    ("my tok", True), ("org/name/", True), ("org--x/name", True),
])
def test_hub_ids_stay_ids_and_paths_become_paths(workdir, value, is_path):
    from llmdp.config.schema import load_recipe

    (workdir / "runs").mkdir()
    write_lines(workdir / "ok.jsonl", GOOD)
    cfg = load_recipe(write_recipe(workdir, {"path": "ok.jsonl"}), [f"model.tokenizer={value}"])
    expected = os.path.normpath(os.path.join(workdir, value)) if is_path else value
    assert cfg.model.tokenizer == expected


@pytest.mark.parametrize("home", ["", "sub", "sub/deeper"])
def test_an_llmdp_home_that_cannot_be_created_is_named(workdir, capsys, monkeypatch, home):
    """Issue 30 item 5: LLMDP_HOME that cannot be created (under a file, say) gets one
    message naming it and the fix, not a FileNotFoundError / NotADirectoryError traceback."""
    (workdir / "file").write_text("not a folder")
    write_lines(workdir / "notes.jsonl", GOOD)
    bad = workdir / "file" / home if home else workdir / "file"  # the file itself, or under it
    monkeypatch.setenv("LLMDP_HOME", str(bad))
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes.jsonl"}))
    assert "LLMDP_HOME" in err and str(bad) in err, err


@pytest.mark.parametrize("offline", [True, False])
def test_an_uncached_hub_model_offline_gets_one_message_at_once(workdir, capsys, monkeypatch, offline):
    """Issue 30 item 4: `model.name_or_path=meta-llama/Llama-3.2-1B` on an air-gapped machine
    (offline mode, or a Hub that cannot be reached) stops at once with one message saying
    how to bring the model over: no minute of retries, no transformers OSError traceback."""
    import time

    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")  # refused at once
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hf-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(workdir / "hf-cache"))
    write_lines(workdir / "notes.jsonl", GOOD)
    recipe = write_recipe(workdir, {"path": "notes.jsonl"})
    raw = json.loads(open(recipe).read())
    raw["model"] = {"init": "pretrained", "name_or_path": "meta-llama/Llama-3.2-1B"}
    open(recipe, "w").write(json.dumps(raw))
    t0 = time.monotonic()
    err = train_fails(workdir, capsys, recipe)
    assert time.monotonic() - t0 < 30  # not a minute of retries (it takes about a second)
    assert "model.name_or_path: 'meta-llama/Llama-3.2-1B' is not a local folder" in err, err
    assert ("offline mode is on" if offline else "the Hub cannot be reached") in err, err
    assert "hf download meta-llama/Llama-3.2-1B --local-dir DIR" in err, err


def test_a_tiny_corpus_needs_an_explicit_delta(workdir, capsys):
    """Issue 30 item 9: with privacy.delta unset, a corpus of a few units is refused (a
    default δ would be 1e-3 or more), naming N, the minimum and the fix."""
    write_lines(workdir / "notes.jsonl", GOOD)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes.jsonl"}),
                      "privacy.delta=null")
    assert "privacy.delta: not set" in err and "sequence unit(s), fewer than 100" in err, err
    assert "set privacy.delta yourself" in err, err


def test_a_default_delta_is_said(tmp_path):
    """Issue 30 item 9: the δ llmdp picks is stated at launch with the N it came from."""
    from llmdp.run.launch import prepare
    from tests.train.test_loop import make_recipe

    cfg = make_recipe(tmp_path)
    cfg = type(cfg)(**{**cfg.__dict__, "privacy": type(cfg.privacy)(**{**cfg.privacy.__dict__, "delta": None})})
    lines = []
    spec = prepare(cfg, log=lines.append)
    n = spec.plan.dataset_size
    assert n >= 100
    assert any(f"privacy.delta not set: δ = {spec.plan.delta:g}" in x and f"N = {n} sequence units" in x
               for x in lines), lines


# ------------------------------------------------------------------------- issue 51


def tokenizerless_model(workdir, family: str = "qwen2"):
    """A tiny model folder saved with save_pretrained, with no tokenizer files (weights and
    config only, as a user may copy a checkpoint)."""
    from tests.helpers import tiny_model

    folder = workdir / f"{family}-no-tokenizer"
    tiny_model(family, vocab_size=300).save_pretrained(folder)
    assert not any("token" in n or "vocab" in n for n in os.listdir(folder)), os.listdir(folder)
    return folder


def pretrained_recipe(workdir, name_or_path, **model) -> str:
    recipe = write_recipe(workdir, {"path": "notes.jsonl"})
    raw = json.loads(open(recipe).read())
    raw["model"] = {"init": "pretrained", "name_or_path": str(name_or_path), **model}
    open(recipe, "w").write(json.dumps(raw))
    return recipe


@pytest.mark.parametrize("overrides", [["data.eval=null"], ["data.eval={fraction: 0.2}"]])
def test_a_model_folder_without_tokenizer_is_refused_before_the_ledger(workdir, capsys, overrides):
    """Issue 51 item 1: transformers builds an empty tokenizer (vocabulary 1) for a model
    folder without tokenizer files; the run would train on end-of-text tokens and spend ε.
    Refused, naming model.name_or_path, the folder and the fix (with the default split too,
    not as an empty evaluation part)."""
    folder = tokenizerless_model(workdir)
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    err = train_fails(workdir, capsys, pretrained_recipe(workdir, folder), *overrides)
    assert f"model.name_or_path: {folder} holds no tokenizer files" in err, err
    assert "set model.tokenizer" in err and "evaluation part" not in err, err


def test_an_empty_tokenizer_is_refused(workdir, capsys):
    """The same empty tokenizer (vocabulary of one special token), saved as a folder and
    named by model.tokenizer: refused by its vocabulary."""
    from transformers import AutoTokenizer

    folder = tokenizerless_model(workdir)
    AutoTokenizer.from_pretrained(folder).save_pretrained(workdir / "empty-tok")
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    err = train_fails(workdir, capsys, pretrained_recipe(
        workdir, folder, tokenizer=str(workdir / "empty-tok")))
    assert f"model.tokenizer: the tokenizer of '{workdir / 'empty-tok'}' has a vocabulary of 1" in err, err


def test_a_tokenizer_that_reads_most_of_the_data_as_unknown_is_refused(workdir, capsys):
    """A word-level tokenizer that knows none of the corpus's words: every token is its
    unknown token, so the model would learn nothing; refused before the ledger."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, "alpha": 3, "beta": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="[EOS]").save_pretrained(workdir / "words")
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    recipe = write_recipe(workdir, {"path": "notes.jsonl"})
    err = train_fails(workdir, capsys, recipe, f"model.tokenizer={workdir / 'words'}")
    assert f"model.tokenizer: the tokenizer of '{workdir / 'words'}' encodes the data as mostly " \
           "its unknown token '[UNK]'" in err, err


def test_a_missing_model_folder_is_named_by_name_or_path(workdir, capsys):
    """Issue 51 item 7: model.tokenizer defaults to model.name_or_path; a missing model
    folder was reported as `model.tokenizer: ... does not exist`."""
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    missing = workdir / "no-such-model"
    err = train_fails(workdir, capsys, pretrained_recipe(workdir, missing))
    assert f"model.name_or_path: {missing} does not exist" in err, err
    assert "model.tokenizer" not in err, err


def _make_ledger(home) -> str:
    """A dataset ledger with one record in ``home`` (LLMDP_HOME)."""
    from llmdp.privacy.ledger.database import LedgerDB

    location = os.path.join(home, "ledger.sqlite")
    db = LedgerDB(location)
    try:
        db.append("other-data", {"kind": "note", "run_id": None, "note": "an earlier release"})
    finally:
        db.close()
    return location


def test_a_read_only_llmdp_home_is_a_permission_problem_not_damage(workdir, capsys, monkeypatch):
    """Issue 51 item 7: a ledger the user may not write (a read-only LLMDP_HOME) was
    diagnosed as "not an SQLite file, or damaged; restore it from a backup". It is named as
    a permission problem, with the fix, and nothing is recorded. chmod does not restrict
    root: there SQLite is made to open the file read-only, as it does a file it may not
    write."""
    import sqlite3

    home = os.environ["LLMDP_HOME"]
    location = _make_ledger(home)
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    recipe = write_recipe(workdir, {"path": "notes.jsonl"})
    if os.geteuid() != 0:
        for p in os.listdir(home):
            os.chmod(os.path.join(home, p), 0o444 if os.path.isfile(os.path.join(home, p)) else 0o555)
        os.chmod(home, 0o555)
    else:
        real = sqlite3.connect

        def read_only(path, *a, **k):
            if k.get("uri") or os.path.abspath(str(path)) != location:
                return real(path, *a, **k)
            return real(f"file:{path}?mode=ro", *a, uri=True, **k)

        monkeypatch.setattr(sqlite3, "connect", read_only)
    try:
        err = train_fails(workdir, capsys, recipe)
    finally:
        _chmod_back(home)
    assert f"LLMDP_HOME: the ledger database {location} cannot be written" in err, err
    assert "a permission problem, not damage" in err and "restore" not in err, err


def _chmod_back(home) -> None:
    os.chmod(home, 0o700)
    for p in os.listdir(home):
        os.chmod(os.path.join(home, p), 0o600 if os.path.isfile(os.path.join(home, p)) else 0o700)


def test_an_output_dir_that_is_a_file_is_named(workdir, capsys):
    """Issue 51 item 7: output.dir naming a file was a FileExistsError traceback."""
    (workdir / "out").write_text("a file")
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes.jsonl"}),
                      f"output.dir={workdir / 'out'}")
    assert f"output.dir: {workdir / 'out'} is a file, not a folder" in err, err
    assert "e.g. output.dir=runs" in err and (workdir / "out").read_text() == "a file", err


def test_an_unwritable_output_dir_is_named(workdir, capsys, monkeypatch):
    """Issue 51 item 7: an output.dir on a read-only file system (or without write
    permission) was an `OSError: [Errno 30]` traceback. chmod does not restrict root: there
    the OS's refusal is injected where the launch first writes (its lock file)."""
    import errno

    out = workdir / "ro"
    out.mkdir()
    write_lines(workdir / "notes.jsonl", GOOD * 20)
    if os.geteuid() != 0:
        os.chmod(out, 0o555)
    else:
        from llmdp._fs import RunLock

        def refuse(self, run_dir):
            raise OSError(errno.EROFS, "Read-only file system", str(out))

        monkeypatch.setattr(RunLock, "__init__", refuse)
    try:
        err = train_fails(workdir, capsys, write_recipe(workdir, {"path": "notes.jsonl"}),
                          f"output.dir={out}")
    finally:
        os.chmod(out, 0o755)
    assert f"output.dir: {out}" in err and "e.g. output.dir=runs" in err, err
    assert "not writable" in err or "cannot be written (Read-only file system)" in err, err
    assert os.listdir(out) == []
