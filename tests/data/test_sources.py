import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmdp.data.sources import fingerprint_file, load_texts, resolve_format

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
    p.write_text("line one\nline two\nline three\n")
    assert _texts(load_texts(p)) == ["line one", "line two", "line three"]
    assert resolve_format(p) == "text"


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
