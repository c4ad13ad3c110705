import hashlib
import json
import shutil
import socket

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmdp.data import files
from llmdp.data.files import record_location, resolve_format
from llmdp.data.sources import (
    fingerprint_file,
    load_records,
    load_texts,
    source_fingerprint,
)

ROWS = [
    {"text": "first document", "user_id": "u1"},
    {"text": "second document", "user_id": "u2"},
    {"text": "third one", "user_id": "u1"},
]


def _texts(ds, field="text"):
    return list(ds[field])


def test_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ds = load_texts(p)
    assert _texts(ds) == [r["text"] for r in ROWS]
    assert set(ds.column_names) == {"text", "user_id"}


def test_json_array_and_explicit_format(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(ROWS))
    assert _texts(load_texts(p)) == [r["text"] for r in ROWS]
    q = tmp_path / "d.data"  # unknown extension: format must be given
    q.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert _texts(load_texts(q, format="jsonl")) == [r["text"] for r in ROWS]
    with pytest.raises(ValueError, match="data.format"):
        load_texts(q)


def test_parquet_with_other_text_field(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": [r["text"] for r in ROWS], "n": [1, 2, 3]}), p)
    ds = load_texts(p, text_field="body")
    assert _texts(ds, "body") == [r["text"] for r in ROWS]


def test_text_lines(tmp_path):
    p = tmp_path / "d.txt"
    p.write_text("line one\nline two\n\nline three\n")
    assert _texts(load_texts(p, text_split="line")) == ["line one", "line two", "line three"]
    assert resolve_format(p) == "text"


def test_a_text_file_is_one_record_by_default(tmp_path):
    """Issue 12 item 9: a folder of notes is one record per note, not per line."""
    d = tmp_path / "notes"
    d.mkdir()
    notes = ["Patient seen.\nBP normal.\n\nPlan: rest.\n", "Second note,\ntwo lines\n", "one\n"]
    for i, n in enumerate(notes):
        (d / f"{i:02d}.txt").write_text(n)
    assert _texts(load_texts(d)) == [n.strip("\n") for n in notes]
    assert _texts(load_texts(d, text_split="paragraph")) == [
        "Patient seen.\nBP normal.", "Plan: rest.", "Second note,\ntwo lines", "one"]
    assert len(load_texts(d, text_split="line")) == 6
    loc = record_location(path=d, text_split="paragraph")
    assert loc(1) == f"{d / '00.txt'}:4" and loc(2) == f"{d / '01.txt'}:1"


def test_jsonl_record_locations_skip_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert len(load_texts(p)) == 2
    loc = record_location(path=p)
    assert loc(0) == f"{p}:1" and loc(1) == f"{p}:3"
    assert record_location(dataset="org/x")(4) == "record 4 of data.dataset='org/x' (split 'train')"


def test_mixed_json_types_name_the_field_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a", "n": 1}\n\n{"text": "b", "n": [2]}\n')
    with pytest.raises(ValueError, match=rf"{p}:3: field 'n' holds a JSON array, but a number at {p}:1"):
        load_texts(p)


def test_directory_of_files(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "b.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    (d / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (d / "README.md").write_text("not data")
    assert sorted(_texts(load_texts(d))) == ["first document", "second document"]
    fp = fingerprint_file(d)
    (d / "a.jsonl").write_text(json.dumps(ROWS[2]) + "\n")
    assert fingerprint_file(d) != fp


def test_missing_file_names_data_path(tmp_path):
    with pytest.raises(ValueError, match=r"data\.path=.*nope\.jsonl"):
        load_texts(tmp_path / "nope.jsonl")


def test_missing_field_names_text_field_and_columns(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(ValueError) as exc:
        load_texts(p, text_field="body")
    msg = str(exc.value)
    assert "data.text_field='body'" in msg
    assert "'text'" in msg and "'user_id'" in msg


def test_bad_format_name(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ValueError, match="data.format='xml'"):
        load_texts(p, format="xml")


def test_fingerprint_file(tmp_path):
    p = tmp_path / "f.bin"
    data = bytes(range(256)) * 5000  # > one read chunk
    p.write_bytes(data)
    assert fingerprint_file(p) == hashlib.sha256(data).hexdigest()
    p.write_bytes(data + b"x")
    assert fingerprint_file(p) == hashlib.sha256(data + b"x").hexdigest()


# ----------------------------------------------------------------------------- load_records

CHATS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"messages": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_records_local_formats(tmp_path):
    texts = [r["text"] for r in ROWS]
    p = _jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_records(path=p, columns=["text", "user_id"])["text"] == texts
    pq.write_table(pa.table({"body": texts}), tmp_path / "d.parquet")
    assert load_records(path=tmp_path / "d.parquet", columns=["body"])["body"] == texts
    (tmp_path / "d.csv").write_text("text,user_id\n" + "".join(f"{r['text']},{r['user_id']}\n" for r in ROWS))
    ds = load_records(path=tmp_path / "d.csv", format="csv")
    assert ds["text"] == texts and ds["user_id"] == [r["user_id"] for r in ROWS]
    (tmp_path / "d.txt").write_text("\n".join(texts) + "\n")
    assert load_records(path=tmp_path / "d.txt", text_split="line")["text"] == texts
    assert load_records(path=tmp_path / "d.txt")["text"] == ["\n".join(texts)]
    d = tmp_path / "dir"
    d.mkdir()
    _jsonl(d / "b.jsonl", ROWS[1:])
    _jsonl(d / "a.jsonl", ROWS[:1])
    assert load_records(path=d)["text"] == texts  # sorted file order


def test_load_records_chat_jsonl_keeps_message_lists(tmp_path):
    ds = load_records(path=_jsonl(tmp_path / "c.jsonl", CHATS), columns={"data.messages_field": "messages"})
    assert ds["messages"] == [r["messages"] for r in CHATS]


def test_load_records_saved_dataset(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    got = load_records(path=tmp_path / "saved", columns=["text"])
    assert got["text"] == [r["text"] for r in ROWS]
    with pytest.raises(ValueError, match=r"data\.split='test' does not apply"):
        load_records(path=tmp_path / "saved", split="test")
    with pytest.raises(ValueError, match=r"data\.format='jsonl' does not apply.*save_to_disk"):
        load_records(path=tmp_path / "saved", format="jsonl")
    with pytest.raises(ValueError, match=r"save_to_disk"):  # not a directory of data files
        files.data_files(tmp_path / "saved")


def _save_dict(path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS[:2]),
        "validation": datasets.Dataset.from_list(ROWS[2:]),
    })
    dd.save_to_disk(str(path))
    return path


def test_load_records_saved_dataset_dict_split(tmp_path):
    p = _save_dict(tmp_path / "dd")
    assert load_records(path=p)["text"] == [r["text"] for r in ROWS[:2]]
    assert load_records(path=p, split="validation")["text"] == [ROWS[2]["text"]]
    with pytest.raises(ValueError) as exc:
        load_records(path=p, split="test")
    msg = str(exc.value)
    assert "data.split='test'" in msg and "['train', 'validation']" in msg


def test_load_records_missing_columns_listed(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError) as exc:
        load_records(path=p, columns={"data.prompt_field": "prompt", "data.response_field": "text"})
    msg = str(exc.value)
    assert "data.prompt_field='prompt'" in msg and "response_field" not in msg
    assert "available columns: ['text', 'user_id']" in msg
    with pytest.raises(ValueError, match=r"column 'messages' is not in data\.path=.*\['text', 'user_id'\]"):
        load_records(path=p, columns=["text", "messages"])
    _save_dict(tmp_path / "dd")
    with pytest.raises(ValueError, match=r"split 'validation'.*available columns"):
        load_records(path=tmp_path / "dd", split="validation", columns=["messages"])


def test_load_records_source_errors(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", ROWS)
    for kw in ({}, {"path": p, "dataset": "org/name"}):
        with pytest.raises(ValueError, match=r"exactly one of data\.path .* and data\.dataset"):
            load_records(**kw)
        with pytest.raises(ValueError, match=r"exactly one of data\.path"):
            source_fingerprint(**kw)
    with pytest.raises(ValueError, match=r"data\.split='validation' does not apply"):
        load_records(path=p, split="validation")
    with pytest.raises(ValueError, match=r"data\.config_name='x'"):
        load_records(path=p, config_name="x")
    with pytest.raises(ValueError, match=r"data\.format='json' does not apply to data\.dataset"):
        load_records(dataset="org/name", format="json")


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or resolve a name fails the test."""
    def refuse(*a, **kw):
        raise AssertionError("the test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_hub_dataset_offline_error(tmp_path, monkeypatch, no_network):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets and huggingface_hub read these at import time.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")  # nothing cached
    name = "llmdp-tests/not-a-cached-dataset"
    for fn in (load_records, source_fingerprint):
        with pytest.raises(ValueError) as exc:
            fn(dataset=name)
        msg = str(exc.value)
        assert f"data.dataset='{name}' could not be reached offline" in msg
        assert "save_to_disk" in msg and "data.path" in msg


def test_hub_dataset_connection_error(monkeypatch):
    def unreachable(*a, **kw):
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ValueError, match=r"data\.dataset='org/name' could not be reached offline"):
        load_records(dataset="org/name")


def test_hub_dataset_loaded_and_fingerprinted(monkeypatch):
    tables = {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    calls = []

    def fake_load_dataset(name, config_name=None, *, split=None):
        calls.append((name, config_name, split))
        if split not in tables:
            raise ValueError(f'Unknown split "{split}". Should be one of {list(tables)}.')
        return tables[split]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_records(dataset="org/name", config_name="en", split="test", columns=["text"])
    assert ds["text"] == [ROWS[2]["text"]]
    assert calls == [("org/name", "en", "test")]
    with pytest.raises(ValueError, match=r"data\.dataset='org/name'.*data\.split='dev'.*Unknown split"):
        load_records(dataset="org/name", split="dev")
    with pytest.raises(ValueError, match=r"data\.text_field='body' is not a column of data\.dataset"):
        load_records(dataset="org/name", columns={"data.text_field": "body"})
    fp = source_fingerprint(dataset="org/name", split="train")
    assert fp == source_fingerprint(dataset="org/name", split="train")
    assert fp != source_fingerprint(dataset="org/name", split="test")
    assert fp != source_fingerprint(dataset="org/name", split="train", config_name="en")


# ----------------------------------------------------------------------------- fingerprints


def test_source_fingerprint_files(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", ROWS)
    fp = source_fingerprint(path=p)
    assert fp == source_fingerprint(path=p) == fingerprint_file(p)
    _jsonl(p, ROWS[:2])
    assert source_fingerprint(path=p) != fp
    with pytest.raises(ValueError, match=r"data\.format='xml'"):
        source_fingerprint(path=p, format="xml")


def test_source_fingerprint_saved(tmp_path):
    p = _save_dict(tmp_path / "dd")
    train = source_fingerprint(path=p)
    assert train == source_fingerprint(path=p, split="train")
    assert train != source_fingerprint(path=p, split="validation")
    with pytest.raises(ValueError, match=r"data\.split='test'.*\['train', 'validation'\]"):
        source_fingerprint(path=p, split="test")
    # Same content under the other split name: the split still changes it.
    q = tmp_path / "swapped"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(q))
    assert source_fingerprint(path=q, split="validation") != train

    s = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(s))
    fp = source_fingerprint(path=s)
    assert fp == source_fingerprint(path=s)
    datasets.Dataset.from_list(ROWS[:2]).save_to_disk(str(tmp_path / "tmp"))
    shutil.rmtree(s)
    shutil.copytree(tmp_path / "tmp", s)
    assert source_fingerprint(path=s) != fp


def test_broken_json_array_names_its_line(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[\n {"text": "a"},\n {"text": "b"\n]\n')
    with pytest.raises(ValueError, match=rf"{p}:4: not valid JSON"):
        load_texts(p)
    p.write_text("")
    with pytest.raises(ValueError, match="no records"):
        load_texts(p)
