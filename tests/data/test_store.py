import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmdp.data.store import UnitStore, build_store, open_store
from llmdp.data.units import UnitSpec
from tests.helpers import tiny_tokenizer, tiny_tokenizer_dir, write_notes

L = 32


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return write_notes(d / "notes.jsonl", num_documents=30, seed=3)


def _build(cache, data, tok, seq_len=L, **kw):
    return build_store(cache, data_path=data, data_format="auto", text_field="text",
                       tokenizer=tok, spec=UnitSpec(sequence_length=seq_len), **kw)


def _expected_stream(data, tok):
    with open(data) as f:
        texts = [json.loads(line)["text"] for line in f]
    stream = []
    for t in texts:
        stream += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return stream, len(texts)


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus, tok):
    return _build(tmp_path_factory.mktemp("units"), corpus, tok)


def test_packing_keeps_every_token_once_in_order(store, corpus, tok):
    stream, n_docs = _expected_stream(corpus, tok)
    n_full, rest = divmod(len(stream), L)
    assert store.num_units == n_full + (rest >= 2)
    b = store.rows(np.arange(store.num_units))
    real = b["input_ids"][b["attention_mask"].bool()].tolist()  # row-major order
    assert real == (stream if rest >= 2 else stream[: n_full * L])
    stats = store.stats()
    assert (stats["num_units"], stats["num_rows"], stats["num_tokens"], stats["num_records"],
            stats["sequence_length"]) == (store.num_units, store.num_units, len(real), n_docs, L)
    # EOS separates documents; no BOS was added.
    assert real.count(tok.eos_token_id) == n_docs
    assert tok.bos_token_id not in real


def test_rows_format_and_last_partial_row(store, tok):
    idx = [store.num_units - 1, 0, 5]
    b = store.rows(idx)
    assert set(b) == {"input_ids", "attention_mask", "labels", "row_units", "num_target_tokens"}
    for k in ("input_ids", "attention_mask", "labels"):
        assert b[k].shape == (3, L) and b[k].dtype == torch.int64
    assert b["row_units"].tolist() == [0, 1, 2]
    mask = b["attention_mask"].bool()
    assert torch.equal(b["labels"][mask], b["input_ids"][mask])
    assert (b["labels"][~mask] == -100).all()
    assert (b["input_ids"][~mask] == store.pad_id).all()
    assert torch.equal(b["num_target_tokens"], (b["labels"][:, 1:] != -100).sum(1))
    # Rows 0 and 5 are full; the last one is the padded remainder of the stream.
    assert b["num_target_tokens"][1:].tolist() == [L - 1, L - 1]
    n_last = int(mask[0].sum())
    assert 2 <= n_last < L, "this corpus should end in a partial row"
    assert mask[0, :n_last].all() and not mask[0, n_last:].any()  # padding at the end only
    assert b["num_target_tokens"][0] == n_last - 1
    assert store.pad_id == tok.pad_token_id


def test_rows_edge_cases(store):
    empty = store.rows([])
    assert empty["input_ids"].shape == (0, L) and empty["row_units"].shape == (0,)
    t = store.rows(torch.tensor([2, 2]))  # tensors and repeats are fine
    assert torch.equal(t["input_ids"][0], t["input_ids"][1])
    with pytest.raises(IndexError):
        store.rows([store.num_units])
    with pytest.raises(IndexError):
        store.rows([-1])


def test_pad_batch(store):
    b = store.rows([0, 1])
    p = UnitStore.pad_batch(b, 5)
    assert p["input_ids"].shape == (5, L)
    assert p["row_units"].tolist() == [0, 1, -1, -1, -1]
    assert (p["attention_mask"][2:] == 0).all() and (p["labels"][2:] == -100).all()
    assert p["num_target_tokens"][2:].tolist() == [1, 1, 1]
    for k in b:
        assert torch.equal(p[k][:2], b[k]) and p[k].dtype == b[k].dtype
    assert UnitStore.pad_batch(b, 2)["input_ids"].shape == (2, L)
    e = store.pad_batch(store.rows([]), 1, pad_id=store.pad_id)
    assert e["row_units"].tolist() == [-1] and (e["input_ids"] == store.pad_id).all()
    with pytest.raises(ValueError):
        UnitStore.pad_batch(b, 1)


def test_rebuilt_only_when_fingerprint_changes(tmp_path, tok):
    data = write_notes(tmp_path / "n.jsonl", num_documents=8, seed=1)
    cache = tmp_path / "cache"
    s1 = _build(cache, data, tok)
    meta = os.path.join(s1.path, "meta.json")
    mtime = os.stat(meta).st_mtime_ns
    s2 = _build(cache, data, tok)
    assert s2.path == s1.path and s2.fingerprint == s1.fingerprint
    assert os.stat(meta).st_mtime_ns == mtime  # reused, not rebuilt

    seen = {s1.fingerprint}
    s3 = _build(cache, data, tok, seq_len=16)
    s4 = _build(cache, data, tok, unit_fraction=0.5)
    assert 0 < s4.num_units < s1.num_units
    s5 = _build(cache, data, tiny_tokenizer(vocab_size=280))
    s7 = build_store(cache, data_path=data, tokenizer=tok,
                     spec=UnitSpec("document", L, max_rows_per_unit=2))
    s8 = build_store(cache, data_path=data, tokenizer=tok,
                     spec=UnitSpec("user", L, max_rows_per_unit=2, user_field="user_id"))
    s9 = build_store(cache, data_path=data, tokenizer=tok, prompt_field="author", response_field="text",
                     spec=UnitSpec(sequence_length=L))
    write_notes(data, num_documents=8, seed=2)  # the text file changes
    s6 = _build(cache, data, tok)
    for s in (s3, s4, s5, s6, s7, s8, s9):
        assert s.fingerprint not in seen
        seen.add(s.fingerprint)
        assert os.path.basename(s.path) == s.fingerprint
    assert os.stat(meta).st_mtime_ns == mtime  # old stores are left alone
    assert [p for p in os.listdir(cache) if p.startswith(".tmp")] == []


def test_open_store_elsewhere_and_in_another_process(tmp_path, store):
    moved = tmp_path / "moved"
    shutil.copytree(store.path, moved)
    other = open_store(str(moved))
    idx = np.arange(0, store.num_units, 3)
    for k, v in store.rows(idx).items():
        assert torch.equal(v, other.rows(idx)[k])
    clone = pickle.loads(pickle.dumps(store))  # ships the path, not the arrays
    assert clone.path == store.path and clone.num_units == store.num_units

    code = (
        "import sys, json; from llmdp.data.store import open_store; "
        "s = open_store(sys.argv[1]); b = s.rows([0, s.num_units - 1]); "
        "print(json.dumps([s.num_units, b['input_ids'].sum().item()]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(moved)], capture_output=True,
                         text=True, check=True, timeout=120)
    expect = [store.num_units, store.rows([0, store.num_units - 1])["input_ids"].sum().item()]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expect


def test_unit_spec():
    spec = UnitSpec(sequence_length=128)
    assert spec.describe() == "a sequence of 128 tokens (packed across document boundaries)"
    assert "masked at document boundaries" in UnitSpec(sequence_length=8, document_masking=True).describe()
    with pytest.raises(ValueError, match="data.unit='paragraph'"):
        UnitSpec(kind="paragraph")
    with pytest.raises(ValueError):
        UnitSpec(sequence_length=1)


def test_errors_name_the_fields(tmp_path, tok):
    with pytest.raises(ValueError, match=r"data\.path"):
        _build(tmp_path / "c", tmp_path / "missing.jsonl", tok)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": ""}) + "\n")  # an empty text: a malformed record
    with pytest.raises(ValueError, match=rf"{one}:1: data.text_field='text' is empty"):
        _build(tmp_path / "c", one, tok)
    with pytest.raises(ValueError, match=r"every record is malformed \(1 skipped"):
        build_store(tmp_path / "c", data_path=one, tokenizer=tok, spec=UnitSpec(sequence_length=L),
                    on_bad_record="skip")
    with pytest.raises(ValueError, match=r"data\.text_field='body'"):
        build_store(tmp_path / "c", data_path=one, data_format="auto", text_field="body",
                    tokenizer=tok, spec=UnitSpec(sequence_length=L))


def test_pad_falls_back_to_eos(tmp_path):
    from transformers import AutoTokenizer

    d = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("pad_token")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    smap = json.loads((d / "special_tokens_map.json").read_text())
    smap.pop("pad_token")
    (d / "special_tokens_map.json").write_text(json.dumps(smap))
    tok = AutoTokenizer.from_pretrained(d)
    if tok.pad_token_id is not None:
        pytest.skip("this transformers version restores the pad token from tokenizer.json")
    data = write_notes(tmp_path / "n.jsonl", num_documents=3, seed=0)
    s = _build(tmp_path / "c", data, tok)
    assert s.pad_id == tok.eos_token_id


def test_document_and_user_stores_from_the_notes(tmp_path, tok):
    """The demo corpus through build_store as document and as user units."""
    data = write_notes(tmp_path / "n.jsonl", num_documents=60, seed=5)
    with open(data) as f:
        recs = [json.loads(line) for line in f]
    doc = build_store(tmp_path / "c", data_path=data, tokenizer=tok,
                      spec=UnitSpec("document", L, max_rows_per_unit=2))
    lens = [len(tok(r["text"], add_special_tokens=False)["input_ids"]) + 1 for r in recs]
    assert doc.num_units == len(recs)  # one unit per note
    assert doc.stats()["records_truncated"] == sum(n > 2 * L for n in lens)
    assert doc.unit_row_count.tolist() == [min(2, -(-n // L) - (n % L == 1)) for n in lens]
    first = doc.rows([0], width=None)
    ids = tok(recs[0]["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert first["input_ids"][first["attention_mask"].bool()].tolist() == ids[: 2 * L]

    user = build_store(tmp_path / "c", data_path=data, tokenizer=tok,
                       spec=UnitSpec("user", L, max_rows_per_unit=3, user_field="user_id"))
    users = sorted({r["user_id"] for r in recs})
    assert user.num_units == len(users) and user.unit_row_count.max() <= 3
    assert user.stats()["num_users"] == len(users)
    b = user.rows(np.arange(user.num_units))
    assert b["row_units"].tolist() == np.repeat(np.arange(user.num_units), user.unit_row_count).tolist()
    with pytest.raises(ValueError, match="data.user_field='patient'"):
        build_store(tmp_path / "c", data_path=data, tokenizer=tok,
                    spec=UnitSpec("user", L, max_rows_per_unit=3, user_field="patient"))


def test_chat_records_train_on_responses_only(tmp_path):
    """Through the store, labels are -100 everywhere but the assistant replies."""
    from tests.data._chat_helpers import chat_tokenizer

    tok = chat_tokenizer()
    chats = [{"messages": [{"role": "system", "content": "You are a scribe."},
                           {"role": "user", "content": f"Summarize visit {i}."},
                           {"role": "assistant", "content": f"Patient {i} is stable."},
                           {"role": "user", "content": "Anything else?"},
                           {"role": "assistant", "content": "No."}]} for i in range(6)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    s = build_store(tmp_path / "c", data_path=data, tokenizer=tok, messages_field="messages",
                    spec=UnitSpec("document", 64, max_rows_per_unit=2))
    assert s.num_units == 6
    b = s.rows([2], width=None)
    labels = b["labels"][b["labels"] != -100].tolist()
    text = tok.decode(labels, skip_special_tokens=False)
    assert "Patient 2 is stable." in text and "No." in text
    for prompt in ("scribe", "Summarize", "Anything", "system", "user"):
        assert prompt not in text
    rows = b["labels"].shape[0]
    assert b["num_target_tokens"].tolist() == [int((b["labels"][:, 1:] != -100).sum())] * rows


def test_parallel_tokenization_builds_the_same_units(tmp_path, tok):
    """num_proc > 1 (a datasets.map pool) and one process give identical stores."""
    from llmdp.data.encode import encode_records
    from llmdp.data.formats import RecordEncoder
    from llmdp.data.sources import load_records

    data = write_notes(tmp_path / "n.jsonl", num_documents=50, seed=4)
    spec = UnitSpec("user", L, max_rows_per_unit=3, user_field="user_id")
    ds = load_records(path=data)
    enc = RecordEncoder(tok)
    one = encode_records(ds, enc, spec, num_proc=1, progress=False)
    two = encode_records(ds, enc, spec, num_proc=2, progress=False)
    for name in ("tokens", "target", "offsets"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    assert one.users.tolist() == two.users.tolist() == [r for r in ds["user_id"]]


@pytest.mark.parametrize("bad,why", [
    ({"body": "no text field"}, "is missing"),
    ({"text": 12345}, "holds a int"),
    ({"text": "   "}, "is empty"),
])
def test_bad_records_refused_or_skipped_and_counted(tmp_path, tok, bad, why):
    """Issue 12 item 9: a missing / numeric / empty text is refused with its file:line and
    field (data.on_bad_record=error), or left out and counted (skip): the units are then
    exactly those of the file without that record."""
    good = [{"text": f"note {i}: the patient was seen today"} for i in range(6)]
    with_bad = tmp_path / "with_bad.jsonl"
    with_bad.write_text("".join(json.dumps(r) + "\n" for r in good[:4] + [bad] + good[4:]))
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps(r) + "\n" for r in good))
    spec = UnitSpec("document", L, max_rows_per_unit=2)
    with pytest.raises(ValueError, match=rf"{with_bad}:5: data.text_field='text' {why}"):
        build_store(tmp_path / "c", data_path=with_bad, tokenizer=tok, spec=spec)
    skipped = build_store(tmp_path / "c", data_path=with_bad, tokenizer=tok, spec=spec,
                          on_bad_record="skip")
    ref = build_store(tmp_path / "c", data_path=clean, tokenizer=tok, spec=spec)
    assert skipped.stats()["records_skipped"] == 1 and ref.stats()["records_skipped"] == 0
    assert skipped.stats()["records_skipped_by_field"] == {"data.text_field='text'": 1}
    assert skipped.num_units == ref.num_units == 6
    a, b = skipped.rows(range(6)), ref.rows(range(6))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_chat_with_unknown_role_is_refused(tmp_path, tok):
    chats = [{"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(3)]
    chats[1]["messages"][1]["role"] = "assitant"
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in chats))
    with pytest.raises(ValueError, match=rf"{p}:2: data.messages_field='messages' message 1 has "
                                         r"role 'assitant', not one of"):
        build_store(tmp_path / "c", data_path=p, tokenizer=tok, messages_field="messages",
                    chat_template="none", spec=UnitSpec("document", L, max_rows_per_unit=1))
    s = build_store(tmp_path / "c", data_path=p, tokenizer=tok, messages_field="messages",
                    chat_template="none", spec=UnitSpec("document", L, max_rows_per_unit=1),
                    on_bad_record="skip")
    assert s.num_units == 2 and s.stats()["records_skipped"] == 1
