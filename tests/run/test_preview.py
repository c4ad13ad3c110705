"""`llmdp data preview RECIPE`: the first units of a recipe with their loss masks, on the
console only (issue 51)."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from llmdp.cli import main
from tests.helpers import TINY_MODEL_YAML, tiny_tokenizer_dir, write_notes

TAIL = """privacy: {{target_epsilon: 4.0, max_grad_norm: 0.5}}
optim: {{name: sgd, lr: 0.5, schedule: constant}}
train: {{expected_batch_size: 4, steps: 2, physical_batch_size: 4}}
output: {{dir: runs, name: preview}}
"""


def _recipe(tmp_path, data: str, tok: str | None = None) -> str:
    text = TINY_MODEL_YAML.format(tok=tok or tiny_tokenizer_dir()) + f"data: {data}\n" + \
        TAIL.format()
    (tmp_path / "r.yaml").write_text(text)
    return str(tmp_path / "r.yaml")


def _units(out: str) -> list[str]:
    """The rendered text of each unit (its rows joined), from the plain (no color) output."""
    blocks = re.split(r"^--- unit \d+: .*$", out, flags=re.M)[1:]
    return [b.strip("\n") for b in blocks]


def _masked(text: str) -> list[str]:
    return re.findall(r"\[\[(.*?)\]\]", text, flags=re.S)


def test_plain_text_sequence_units_are_the_first_rows_with_only_their_first_token_masked(
        tmp_path, monkeypatch, capsys):
    """Sequence units of plain text: every token is trained except a row's first (nothing
    predicts it); the rows shown are the first rows the full build makes, and nothing is
    written (no run directory, no file next to the recipe)."""
    from transformers import AutoTokenizer

    from llmdp.data.formats import RecordEncoder
    from llmdp.data.sources import load_records
    from llmdp.data.units import EncodedCorpus, UnitSpec, build_units

    monkeypatch.chdir(tmp_path)
    write_notes(tmp_path / "notes.jsonl", 30)
    recipe = _recipe(tmp_path, "{path: notes.jsonl, sequence_length: 32}")
    before = sorted(os.listdir(tmp_path))
    assert main(["data", "preview", recipe, "-n", "2", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "PRIVATE" in out and "on this console only" in out
    units = _units(out)
    assert len(units) == 2
    # The full build's first two rows, decoded: what the preview shows, brackets removed.
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    enc = RecordEncoder(tok, text_field="text")
    ds = load_records(path=str(tmp_path / "notes.jsonl"), columns=["text"])
    full = build_units(EncodedCorpus.from_records(enc.encode_batch(ds[:])), UnitSpec("sequence", 32))
    for u, shown in enumerate(units):
        s, e = full.row_offsets[u], full.row_offsets[u + 1]
        first = tok.decode([int(full.tokens[s])], skip_special_tokens=False)
        assert _masked(shown) == [first]
        assert shown.replace("[[", "").replace("]]", "") == tok.decode(
            full.tokens[s:e].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert f"32 tokens, {int(full.unit_target_tokens()[u])} trained" in out
    assert sorted(os.listdir(tmp_path)) == before


def test_a_chat_recipe_masks_the_prompt_and_trains_the_replies(tmp_path, monkeypatch, capsys):
    """A chat recipe trains on the assistant's replies only: the preview shows the user's
    turn and the template's markers masked, the reply trained; ``--raw`` adds the ids
    (masked ones in parentheses), as many as the row has tokens."""
    from tests.data._chat_helpers import chat_tokenizer

    monkeypatch.chdir(tmp_path)
    tok = chat_tokenizer()
    tok.save_pretrained(tmp_path / "chat-tok")
    chats = [{"messages": [{"role": "user", "content": f"question number {i} please"},
                           {"role": "assistant", "content": f"the answer is {i}"}]} for i in range(5)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    recipe = _recipe(tmp_path, "{path: chats.jsonl, messages_field: messages, unit: document, max_rows_per_unit: 1, "
                               "sequence_length: 48}", tok=str(tmp_path / "chat-tok"))
    assert main(["data", "preview", recipe, "--raw", "--color", "never"]) == 0
    out = capsys.readouterr().out
    units = _units(out)
    assert len(units) == 3
    for i, shown in enumerate(units):
        text, raw = shown.split("\nids (masked in parentheses): ")
        masked = "".join(_masked(text))
        trained = re.sub(r"\[\[.*?\]\]", "", text, flags=re.S)
        assert f"question number {i} please" in masked and "<|im_start|>" in masked
        assert f"the answer is {i}" in trained and "question" not in trained
        ids = raw.split()
        assert len(ids) == len(tok(text.replace("[[", "").replace("]]", ""),
                                   add_special_tokens=False)["input_ids"])
        assert any(x.startswith("(") for x in ids) and any(not x.startswith("(") for x in ids)


def test_user_units_hold_every_record_of_the_first_users(tmp_path, monkeypatch, capsys):
    """User units: a user's records, wherever they are in the file, form one unit (of at
    most max_rows_per_unit rows); the preview builds them from those users' records only."""
    monkeypatch.chdir(tmp_path)
    recs = [{"user_id": u, "text": f"note {k} of user {u}."}
            for k, u in enumerate(["ann", "bob", "cid", "ann", "bob", "ann"])]
    (tmp_path / "u.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    recipe = _recipe(tmp_path, "{path: u.jsonl, unit: user, user_field: user_id, "
                               "max_rows_per_unit: 4, sequence_length: 16}")
    assert main(["data", "preview", recipe, "-n", "2", "--color", "never"]) == 0
    units = _units(capsys.readouterr().out)
    assert len(units) == 2
    by_user = {u: [r["text"] for r in recs if r["user_id"] == u] for u in ("ann", "bob")}
    for shown in units:
        plain = shown.replace("[[", "").replace("]]", "")
        who = [u for u in by_user if f"user {u}" in plain]
        assert len(who) == 1 and all(t in plain for t in by_user[who[0]])
        assert "cid" not in plain


def test_colors_mark_trained_green_and_masked_dim_and_a_bad_count_is_one_message(
        tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    from llmdp.run.preview import render_row

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    ids = np.asarray(tok("hello world again")["input_ids"], dtype=np.int32)
    target = np.ones(ids.size, np.uint8)
    target[-1] = 0
    colored = render_row(tok, ids, target, color=True)
    assert colored.startswith("\x1b[2m") and "\x1b[32m" in colored and colored.endswith("\x1b[0m")
    assert render_row(tok, ids, target, color=False).startswith("[[")
    monkeypatch.chdir(tmp_path)
    write_notes(tmp_path / "notes.jsonl", 5)
    recipe = _recipe(tmp_path, "{path: notes.jsonl, sequence_length: 32}")
    assert main(["data", "preview", recipe, "-n", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--units 0" in err and "at least 1" in err
