"""Issue 29 item 5: one ledger per dataset whatever the spelling of its source.

Each pair of spellings from the issue opens ONE ledger through the real path a run takes
(`open_dataset_ledger`, a real SQLite database): Hub ids in any case, ``file://`` and the
plain path, ``s3://b//x`` and ``s3://b/x``, ``S3://`` and ``s3://``. A file and a folder
that reads it are two sources that overlap: the second is refused, naming the first
ledger and how to declare it, unless ``data.dataset_id`` is declared. Ledgers an earlier
llmdp started under another spelling are found and kept, never replaced by a fresh one.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from llmdp.config.validate import ConfigError
from llmdp.data.ids import canonical_id, normalize_uri
from llmdp.data.sources import source_fingerprint
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.dataset import open_dataset_ledger
from llmdp.privacy.ledger.service import open_dataset
from tests.helpers import write_notes


def data(path=None, dataset=None, config_name=None, dataset_id=None):
    return SimpleNamespace(path=None if path is None else str(path), dataset=dataset,
                           config_name=config_name, dataset_id=dataset_id)


def _open(tmp_path, d, sha="a" * 64, lines=None) -> dict:
    return open_dataset_ledger(d, str(tmp_path / "ledger.sqlite"), sha,
                               log=(lines.append if lines is not None else (lambda *a: None)))


def _release(tmp_path, ds: str) -> None:
    LedgerDB(str(tmp_path / "ledger.sqlite")).append(ds, {"kind": "note", "text": "a release"})


def _ledgers(tmp_path) -> list[str]:
    return LedgerDB(str(tmp_path / "ledger.sqlite"), read_only=True).ledgers()


def _notes(tmp_path):
    sub = tmp_path / "data" / "sub"
    sub.mkdir(parents=True)
    return write_notes(sub / "notes.jsonl", 20), sub


SPELLINGS = {
    "hub case": (lambda t: data(dataset="OrgName/Notes"), lambda t: data(dataset="orgname/notes")),
    "hub case, config": (lambda t: data(dataset="OrgName/Notes", config_name="en"),
                         lambda t: data(dataset="orgname/NOTES", config_name="EN")),
    "file:// vs path": (lambda t: data(path="file://" + str(t / "data" / "sub" / "notes.jsonl")),
                        lambda t: data(path=t / "data" / "sub" / "notes.jsonl")),
    "file://localhost vs relative path": (
        lambda t: data(path="file://localhost" + str(t / "data" / "sub" / "notes.jsonl")),
        lambda t: data(path=os.path.relpath(t / "data" / "sub" / "notes.jsonl"))),
    "s3 double slash": (lambda t: data(path="s3://bucket//corpus/x"),
                        lambda t: data(path="s3://bucket/corpus/x")),
    "S3 vs s3": (lambda t: data(path="S3://Bucket/corpus/x"), lambda t: data(path="s3://bucket/corpus/x")),
    "trailing slash and dots": (lambda t: data(path="s3://bucket/corpus/./y/../x/"),
                                lambda t: data(path="s3://bucket/corpus/x")),
}


@pytest.mark.parametrize("pair", list(SPELLINGS))
def test_each_spelling_pair_opens_one_ledger(tmp_path, monkeypatch, pair):
    _notes(tmp_path)
    monkeypatch.chdir(tmp_path)
    first, second = (f(tmp_path) for f in SPELLINGS[pair])
    a = _open(tmp_path, first)
    _release(tmp_path, a["dataset_id"])
    lines = []
    b = _open(tmp_path, second, lines=lines)
    assert b["dataset_id"] == a["dataset_id"]
    assert _ledgers(tmp_path) == [a["dataset_id"]]
    assert not any("warning" in x for x in lines), lines


def test_normalized_ids():
    assert canonical_id("hub:OrgName/Notes") == "hub:orgname/notes"
    assert normalize_uri("S3://Bucket//a/./b/../c/") == "s3://bucket/a/c"
    assert normalize_uri("s3://b/../../x") == "s3://b/x"
    assert normalize_uri("hdfs://user@Host:9000/x") == "hdfs://user@Host:9000/x"  # user kept
    assert canonical_id("uri:file:///tmp/../tmp/x.jsonl") == "path:" + os.path.realpath("/tmp/x.jsonl")
    assert canonical_id("path:/a/b") == "path:/a/b"
    assert canonical_id("Clinic-Notes") == "Clinic-Notes"  # a declared id is verbatim


@pytest.mark.parametrize("old,new", [
    ("hub:OrgName/Notes", data(dataset="orgname/notes")),
    ("uri:S3://bucket//corpus/x", data(path="s3://bucket/corpus/x")),
    ("uri:file://{notes}", data(path="{notes}")),
])
def test_a_ledger_started_under_an_earlier_spelling_is_kept(tmp_path, old, new):
    """An earlier llmdp stored the raw spelling: that ledger is this dataset's, under its
    stored id (no fresh ledger, no lost releases)."""
    notes, _ = _notes(tmp_path)
    old = old.format(notes=notes)
    new = data(path=new.path.format(notes=notes)) if new.path else new
    db = LedgerDB(str(tmp_path / "ledger.sqlite"))
    open_dataset(db, old, sha256="a" * 64, source=old, name="x", log=lambda *a: None)
    _release(tmp_path, old)
    lines = []
    got = _open(tmp_path, new, lines=lines)
    assert got["dataset_id"] == old
    assert any(f"was started as {old!r}" in x for x in lines), lines
    assert _ledgers(tmp_path) == [old]


def test_two_earlier_spellings_are_refused_naming_both(tmp_path):
    db = LedgerDB(str(tmp_path / "ledger.sqlite"))
    for old in ("hub:OrgName/Notes", "hub:orgname/NOTES"):
        open_dataset(db, old, sha256="a" * 64, source=old, name="x", log=lambda *a: None)
    with pytest.raises(ConfigError) as e:
        _open(tmp_path, data(dataset="OrgName/notes"))
    msg = str(e.value)
    assert "'hub:OrgName/Notes'" in msg and "'hub:orgname/NOTES'" in msg
    assert "Set data.dataset_id to one of them" in msg
    assert e.value.key == "data.dataset_id"
    assert sorted(_ledgers(tmp_path)) == ["hub:OrgName/Notes", "hub:orgname/NOTES"]


@pytest.mark.parametrize("order", ["folder first", "file first"])
def test_a_file_and_its_folder_are_refused_unless_declared(tmp_path, order):
    """``data/sub/notes.jsonl`` and the folder ``data/sub`` that holds only it: two
    spellings of one dataset (different content hashes: a folder's hash covers its file
    names). The second to come is refused, naming the first ledger and how to declare it;
    declared, it is charged to that ledger."""
    notes, sub = _notes(tmp_path)
    file_d, folder_d = data(path=notes), data(path=sub)
    first, second = (folder_d, file_d) if order == "folder first" else (file_d, folder_d)
    a = _open(tmp_path, first, sha=source_fingerprint(path=first.path))
    _release(tmp_path, a["dataset_id"])
    with pytest.raises(ConfigError) as e:
        _open(tmp_path, second, sha=source_fingerprint(path=second.path))
    msg = str(e.value)
    assert f"but its data looks like the data of the ledger(s) {a['dataset_id']!r}" in msg
    assert "overlapping sources: " in msg and os.path.realpath(notes) in msg
    assert f"set data.dataset_id: {a['dataset_id']} so that this run is charged" in msg
    assert e.value.key == "data.dataset_id"
    assert _ledgers(tmp_path) == [a["dataset_id"]]  # nothing started
    declared = data(path=second.path, dataset_id=a["dataset_id"])
    b = _open(tmp_path, declared, sha=source_fingerprint(path=second.path))
    assert b["dataset_id"] == a["dataset_id"] and _ledgers(tmp_path) == [a["dataset_id"]]


def test_a_folder_sharing_a_file_with_a_folder_ledger_is_refused(tmp_path):
    notes, sub = _notes(tmp_path)
    (sub / "more.jsonl").write_bytes(open(notes, "rb").read()[:200])
    a = _open(tmp_path, data(path=sub), sha="1" * 64)
    with pytest.raises(ConfigError, match="both read the file"):
        _open(tmp_path, data(path=tmp_path / "data"), sha="2" * 64)  # holds sub/ and its files
    # A sibling folder with other files is another dataset: no refusal.
    other = tmp_path / "other"
    other.mkdir()
    write_notes(other / "o.jsonl", 5, seed=3)
    b = _open(tmp_path, data(path=other), sha="3" * 64)
    assert b["dataset_id"] != a["dataset_id"]


def test_a_folder_uri_and_a_file_in_it_are_refused(tmp_path):
    _open(tmp_path, data(path="s3://bucket/corpus/"), sha="1" * 64)
    with pytest.raises(ConfigError, match=r"overlapping sources: corpus/x.jsonl is inside|"
                                          r"bucket/corpus/x.jsonl is inside"):
        _open(tmp_path, data(path="S3://bucket/corpus//x.jsonl"), sha="2" * 64)


def test_same_content_elsewhere_is_refused_unless_declared(tmp_path):
    notes, _ = _notes(tmp_path)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(open(notes, "rb").read())
    sha = source_fingerprint(path=notes)
    a = _open(tmp_path, data(path=notes), sha=sha)
    with pytest.raises(ConfigError, match="the same content hash"):
        _open(tmp_path, data(path=copy), sha=sha)
    lines = []
    b = _open(tmp_path, data(path=copy, dataset_id="copy-of-notes"), sha=sha, lines=lines)
    assert b["dataset_id"] == "copy-of-notes"
    assert any(x.startswith("warning: starting a new ledger") and a["dataset_id"] in x for x in lines)


def test_the_same_name_with_other_content_only_warns(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = write_notes(tmp_path / "a" / "notes.jsonl", 5, seed=1)
    two = write_notes(tmp_path / "b" / "notes.jsonl", 5, seed=2)
    _open(tmp_path, data(path=one), sha=source_fingerprint(path=one))
    lines = []
    _open(tmp_path, data(path=two), sha=source_fingerprint(path=two), lines=lines)
    assert any("the same source name 'notes.jsonl', other content" in x for x in lines), lines


def test_the_demo_in_two_clones_shares_one_ledger(tmp_path):
    """Data llmdp generates (`data.synthetic`) is named by its generator spec: the same demo
    notes in two checkouts (same bytes, two paths) are one dataset, not a look-alike that
    refuses the second clone's `make demo`. Another spec is another dataset."""
    from llmdp.config.schema import SyntheticDataConfig

    ids = []
    for clone, seed in (("a", 0), ("b", 0), ("c", 1)):
        path = tmp_path / clone / "clinical_notes.jsonl"
        path.parent.mkdir()
        write_notes(path, 20, seed=seed)
        d = SimpleNamespace(**vars(data(path=path)), synthetic=SyntheticDataConfig(num_documents=20, seed=seed))
        ids.append(_open(tmp_path, d, sha=source_fingerprint(path=str(path)))["dataset_id"])
    assert ids[0] == ids[1] == "synthetic:clinical_notes:n=20:seed=0"
    assert ids[2] == "synthetic:clinical_notes:n=20:seed=1"
    assert sorted(_ledgers(tmp_path)) == sorted(set(ids))
