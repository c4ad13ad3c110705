"""The ledgers (issue 13): hash-chained records, the run's ledger.jsonl written ahead of
every step through the ledger service, the dataset ledgers' database, and every kind of
damage: a torn, garbage, deleted or edited line or record is detected with a message that
names it and the way out; nothing proceeds silently; a repair needs --acknowledge-loss and
leaves a record that excuses exactly the damage it saw.

Owns invariant `write-ahead-ledger` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.records import (
    GENESIS,
    Ledger,
    LedgerError,
    canonical,
    check_record,
    record_hash,
)
from llmdp.privacy.ledger.service import LedgerService, cross_check

EV = dpsgd_step_event(0.01, 1.0)
EVJ = event_to_json(EV)
META = {"unit": {"kind": "sequence", "sequence_length": 24}, "config_hash": "abc123"}
DS = "ds-1"
REPAIR_CMD = "llmdp privacy ledger repair"


def service(tmp_path, name="run", total=10, block=2, **kw) -> LedgerService:
    return LedgerService(
        location=str(tmp_path / "ledger.sqlite"), dataset_id=DS,
        run_ledger=str(tmp_path / name / "ledger.jsonl"), run_id=name, meta=META,
        block_size=block, total_steps=total, event_json=EVJ, delta=1e-5, accountant="rdp", **kw)


def run_all(tmp_path, name="run", total=10, block=2) -> LedgerService:
    """A run that reserved all its steps: ``total / block`` release records."""
    svc = service(tmp_path, name, total, block)
    svc.start_attempt()
    for step in range(total):
        svc.ensure(step)
    svc.db.close()
    return svc


def db_path(tmp_path) -> str:
    return str(tmp_path / "ledger.sqlite")


def sql(tmp_path, query: str, params=()) -> list:
    con = sqlite3.connect(db_path(tmp_path))
    try:
        rows = con.execute(query, params).fetchall()
        con.commit()
        return rows
    finally:
        con.close()


def row(tmp_path, seq: int) -> tuple[str, str]:
    return tuple(sql(tmp_path, "SELECT body, hash FROM llmdp_records WHERE ledger = ? AND seq = ?",
                     (DS, seq))[0])


def db_state(tmp_path) -> tuple[list, list]:
    return (sql(tmp_path, "SELECT seq, body, hash FROM llmdp_records ORDER BY ledger, seq"),
            sql(tmp_path, "SELECT ledger, seq, hash FROM llmdp_heads ORDER BY ledger"))


def released(records) -> dict[int, int]:
    """seq -> count of the release records among verified ``records``."""
    return {r["seq"]: r["count"] for r in records if r["kind"] == "release"}


# ------------------------------------------------------------------ records

def test_canonical_json_and_record_hash():
    rec = {"seq": 1, "kind": "note", "text": "é", "nested": {"b": 2, "a": [1, 2.5]}}
    text = canonical(rec)
    assert text == '{"kind":"note","nested":{"a":[1,2.5],"b":2},"seq":1,"text":"\\u00e9"}'
    assert canonical(dict(reversed(list(rec.items())))) == text  # key order does not matter
    h = record_hash(rec)
    assert h == hashlib.sha256(text.encode("ascii")).hexdigest()
    assert record_hash({**rec, "hash": "anything"}) == h  # taken without the "hash" key
    assert record_hash({**rec, "text": "e"}) != h
    with pytest.raises(LedgerError, match="not JSON-serializable"):
        canonical({"x": float("nan")})
    with pytest.raises(LedgerError, match="not JSON-serializable"):
        canonical({"x": object()})


def test_check_record():
    good = {"kind": "release", "event": EVJ, "count": 3, "seq": 1, "prev": GENESIS, "ledger": DS}
    assert check_record(good) is None
    assert "unknown kind" in check_record({**good, "kind": "rlease"})
    assert "seq" in check_record({**good, "seq": 0})
    assert "prev" in check_record({**good, "prev": "abc"})
    assert "ledger" in check_record({k: v for k, v in good.items() if k != "ledger"})
    assert "count" in check_record({**good, "count": "3"})
    assert "count" in check_record({**good, "count": True})
    assert "count" in check_record({**good, "count": -1})
    assert check_record([1]) == "not a JSON object"


# ------------------------------------------------------------------ write-ahead blocks

def test_blocks_written_ahead_to_the_database_and_ledger_jsonl(tmp_path):
    svc = service(tmp_path, total=10, block=4)
    svc.start_attempt()
    wrote = [svc.ensure(step) for step in range(10)]
    # One record per block, the last one cut at the planned total.
    assert [s for s, w in enumerate(wrote) if w] == [0, 4, 8]
    db = LedgerDB(db_path(tmp_path))
    records = db.records(DS)
    assert [(r["first_step"], r["count"]) for r in records] == [(0, 4), (4, 4), (8, 2)]
    assert [r["seq"] for r in records] == [1, 2, 3]
    assert records[0]["prev"] == GENESIS and records[0]["run_prev"] is None
    for a, b in zip(records, records[1:]):
        assert b["prev"] == a["hash"] and b["run_prev"] == a["hash"]
    assert all(r["run_id"] == "run" and r["meta"] == META and r["event"] == EVJ for r in records)
    assert all(r["hash"] == record_hash(r) for r in records)
    # ledger.jsonl holds the same records, byte for byte the canonical JSON with the hash.
    run_file = tmp_path / "run" / "ledger.jsonl"
    assert Ledger(run_file).records() == records
    assert run_file.read_text().splitlines() == [canonical(r) for r in records]
    assert not Ledger(run_file).legacy
    assert Ledger(run_file).entries() == [(EV, 10)]
    assert cross_check(Ledger(run_file).records(), records, "run", str(run_file)) == []
    pos = svc.position()
    assert (pos["reserved_until"], pos["run_steps_recorded"], pos["run_records"]) == (10, 10, 3)
    assert pos["run_last_hash"] == records[-1]["hash"] and pos["dataset_id"] == DS
    with pytest.raises(LedgerError, match="beyond the planned total_steps=10"):
        svc.ensure(10)
    # A restart (resumed at step 6) counts the re-executed steps again.
    svc.start_attempt()
    assert svc.ensure(6) and not svc.ensure(7)
    records = db.records(DS)
    assert [(r["first_step"], r["count"]) for r in records][-1] == (6, 4)
    assert sum(released(records).values()) == 14
    assert len({r["attempt"] for r in records}) == 2
    assert Ledger(run_file).records() == records
    db.close()


def test_a_missing_ledger_is_empty(tmp_path):
    from llmdp.privacy.accounting.accountant import epsilon

    lg = Ledger(tmp_path / "nope.jsonl")
    assert lg.records() == [] and lg.entries() == [] and lg.total_count() == 0 and lg.runs() == []
    assert epsilon(lg, 1e-5) == 0.0
    assert LedgerDB(db_path(tmp_path)).records("nope") == []


def test_a_restart_never_under_counts(tmp_path):
    total, block = 50, 8
    applied = 0
    svc = service(tmp_path, total=total, block=block)
    svc.start_attempt()  # attempt 1 applies steps 0..20, then crashes
    for step in range(21):
        svc.ensure(step)
        applied += 1
    svc.start_attempt()  # attempt 2 resumes from the checkpoint at step 13, to the end
    for step in range(13, total):
        svc.ensure(step)
        applied += 1
    lg = Ledger(tmp_path / "run" / "ledger.jsonl")
    assert applied <= lg.total_count("run") <= applied + 2 * block  # one partial block each
    assert lg.total_count() == sum(released(LedgerDB(db_path(tmp_path)).records(DS)).values())
    attempts = [r["attempt"] for r in lg.records()]
    assert attempts[0] != attempts[-1] and len(set(attempts)) == 2


def test_a_record_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    svc = LedgerService(location=db_path(tmp_path), dataset_id=DS,
                        run_ledger=str(tmp_path / "run" / "ledger.jsonl"), run_id="run",
                        meta={"x": object()}, block_size=2, total_steps=4, event_json=EVJ,
                        delta=1e-5, accountant="rdp")
    svc.start_attempt()
    with pytest.raises(LedgerError, match="not JSON-serializable"):
        svc.ensure(0)
    assert LedgerDB(db_path(tmp_path)).records(DS) == []
    assert not (tmp_path / "run" / "ledger.jsonl").exists()


def test_the_line_is_fsynced_before_ensure_returns(tmp_path, monkeypatch):
    run_file = tmp_path / "run" / "ledger.jsonl"
    seen = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        seen.append(run_file.read_bytes() if run_file.exists() else b"")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    svc = service(tmp_path, total=8, block=4)
    svc.start_attempt()
    for step in range(8):
        before = len(seen)
        if svc.ensure(step):
            assert len(seen) > before
            synced = [json.loads(x) for x in seen[-1].splitlines() if x]
            assert synced[-1]["first_step"] == step
        else:
            assert len(seen) == before  # a reserved step: no I/O


def test_a_line_that_cannot_be_written_leaves_no_record(tmp_path, monkeypatch):
    """The run's line is written inside the database transaction: if writing it fails,
    the record is not committed either."""
    import llmdp.privacy.ledger.records as ledger_mod

    svc = service(tmp_path)
    svc.start_attempt()
    svc.ensure(0)

    def failing(path, record):
        raise OSError("disk full")

    monkeypatch.setattr(ledger_mod, "append_line", failing)
    with pytest.raises(OSError, match="disk full"):
        svc.ensure(2)
    monkeypatch.undo()
    assert len(LedgerDB(db_path(tmp_path)).records(DS)) == 1
    svc.ensure(2)  # the service goes on where it stood
    records = LedgerDB(db_path(tmp_path)).records(DS)
    assert [r["first_step"] for r in records] == [0, 2]
    assert Ledger(tmp_path / "run" / "ledger.jsonl").records() == records


def test_a_crash_after_ensure_is_counted_in_both_ledgers(tmp_path):
    code = textwrap.dedent(f"""
        import os
        from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
        from llmdp.privacy.ledger.service import LedgerService
        svc = LedgerService(location={db_path(tmp_path)!r}, dataset_id={DS!r},
                            run_ledger={str(tmp_path / "child" / "ledger.jsonl")!r}, run_id="child",
                            meta={{}}, block_size=3, total_steps=10,
                            event_json=event_to_json(dpsgd_step_event(0.01, 1.0)), delta=1e-5,
                            accountant="rdp")
        svc.start_attempt()
        assert svc.ensure(0)
        os._exit(1)  # a crash: the update of step 0 is never applied
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 1
    records = LedgerDB(db_path(tmp_path)).records(DS)
    assert released(records) == {1: 3}
    assert Ledger(tmp_path / "child" / "ledger.jsonl").records() == records


def test_two_processes_append_to_one_ledger(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from llmdp.privacy.ledger.database import LedgerDB
        db = LedgerDB({db_path(tmp_path)!r})
        for i in range(25):
            db.append({DS!r}, {{"kind": "note", "run_id": sys.argv[1], "i": i}})
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, who], env=env) for who in "ab"]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    records = LedgerDB(db_path(tmp_path)).records(DS)  # the chain verifies
    assert [r["seq"] for r in records] == list(range(1, 51))
    for who in "ab":
        mine = [r for r in records if r["run_id"] == who]
        assert [r["i"] for r in mine] == list(range(25))
        assert [r["run_prev"] for r in mine[1:]] == [r["hash"] for r in mine[:-1]]


# ------------------------------------------------------------------ the run's ledger.jsonl

def _lines(path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write_lines(path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(x + b"\n" for x in lines))


def _torn(path):
    data = path.read_bytes()
    path.write_bytes(data[:-7])


def _garbage_middle(path):
    lines = _lines(path)
    lines[2] = b"\x00\x17 not a record {"
    _write_lines(path, lines)


def _json_not_a_record(path):
    lines = _lines(path)
    lines[2] = b'{"kind": "release", "count": 2}'
    _write_lines(path, lines)


def _empty_middle(path):
    lines = _lines(path)
    lines[2] = b""
    _write_lines(path, lines)


def _deleted_middle(path):
    lines = _lines(path)
    del lines[2]
    _write_lines(path, lines)


def _deleted_first(path):
    _write_lines(path, _lines(path)[1:])


def _edited_count(path):
    lines = _lines(path)
    assert b'"count":2' in lines[1]
    lines[1] = lines[1].replace(b'"count":2', b'"count":1')
    _write_lines(path, lines)


def _edited_rehashed(path):
    lines = _lines(path)
    rec = json.loads(lines[1])
    rec["count"] = 1
    rec["hash"] = record_hash(rec)
    lines[1] = canonical(rec).encode()
    _write_lines(path, lines)


def _reordered(path):
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    _write_lines(path, lines)


RUN_DAMAGE = {
    # name: (damage, what the message says)
    "torn last line": (_torn, r"the last line \(line 5: \d+ bytes, no newline\) is torn"),
    "garbage line": (_garbage_middle, r"line 3 is not a ledger record \(garbage"),
    "JSON that is no record": (_json_not_a_record, r"line 3 is not a valid record"),
    "empty line": (_empty_middle, r"line 3 is empty"),
    "deleted middle line": (_deleted_middle, r"line 3 \(dataset record 4\): it does not link to the "
                                             r"line before it: a line was deleted"),
    "deleted first line": (_deleted_first, r"line 1 \(dataset record 2\): the first line links to "
                                           r"an earlier record: the first line\(s\) were deleted"),
    "edited count": (_edited_count, r"line 2 \(dataset record 2\) was edited"),
    "edited, hash recomputed": (_edited_rehashed, r"line 3 \(dataset record 3\): it does not link"),
    "reordered lines": (_reordered, r"line 2 \(dataset record 3\): it does not link"),
}


@pytest.mark.parametrize("name", list(RUN_DAMAGE))
def test_run_ledger_damage_is_detected(tmp_path, name):
    damage, said = RUN_DAMAGE[name]
    svc = run_all(tmp_path)  # 5 lines, 2 steps each
    path = tmp_path / "run" / "ledger.jsonl"
    assert len(_lines(path)) == 5
    damage(path)
    with pytest.raises(LedgerError) as e:
        Ledger(path).records()
    msg = str(e.value)
    assert msg.startswith(str(path) + ":")  # the file
    assert re.search(said, msg), msg  # the line and what is wrong with it
    assert f"`{REPAIR_CMD} {tmp_path / 'run'}`" in msg  # the way out
    assert "Nothing that reads this ledger proceeds" in msg
    # Nothing reads past it: the entries, the service's checkpoint position.
    with pytest.raises(LedgerError):
        Ledger(path).entries()
    with pytest.raises(LedgerError):
        svc.position()


def test_lines_of_another_run_are_detected(tmp_path):
    run_all(tmp_path, "a")
    run_all(tmp_path, "b")
    a, b = tmp_path / "a" / "ledger.jsonl", tmp_path / "b" / "ledger.jsonl"
    _write_lines(a, _lines(a) + _lines(b)[:1])
    with pytest.raises(LedgerError, match=r"line 6 belongs to run 'b', not 'a'.*" + REPAIR_CMD):
        Ledger(a).records()


def test_a_deleted_last_line_is_caught_against_the_database(tmp_path):
    run_all(tmp_path)
    path = tmp_path / "run" / "ledger.jsonl"
    _write_lines(path, _lines(path)[:-1])
    run_records = Ledger(path).records()  # a valid chain on its own ...
    assert len(run_records) == 4
    db_records = LedgerDB(db_path(tmp_path)).records(DS)
    problems = cross_check(run_records, db_records, "run", str(path), "the dataset ledger 'ds-1'")
    assert len(problems) == 1  # ... but the dataset ledger holds the fifth record
    assert problems[0].startswith(f"{path} lacks 1 of this run's record(s) that the dataset "
                                  f"ledger 'ds-1' holds (records 5; 2 step(s))")
    assert f"{REPAIR_CMD} {tmp_path / 'run'}" in problems[0]


def test_a_line_whose_transaction_did_not_commit_is_caught(tmp_path, monkeypatch):
    """A crash after the run's line was written but before the database committed: the
    line is in no dataset ledger."""
    import llmdp.privacy.ledger.records as ledger_mod

    svc = service(tmp_path)
    svc.start_attempt()
    svc.ensure(0)
    real = ledger_mod.append_line

    def write_then_crash(path, record):
        real(path, record)
        raise KeyboardInterrupt  # killed before the commit

    monkeypatch.setattr(ledger_mod, "append_line", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        svc.ensure(2)
    path = tmp_path / "run" / "ledger.jsonl"
    run_records = Ledger(path).records()
    assert len(run_records) == 2
    db_records = LedgerDB(db_path(tmp_path)).records(DS)
    assert len(db_records) == 1
    problems = cross_check(run_records, db_records, "run", str(path))
    assert len(problems) == 1 and problems[0].startswith(f"{path}: line 2 (record 2) is not in "
                                                         "the dataset ledger")


# ------------------------------------------------------------------ the dataset ledger (database)

def _edited_body(tmp_path):
    body, _ = row(tmp_path, 3)
    sql(tmp_path, "UPDATE llmdp_records SET body = ? WHERE ledger = ? AND seq = 3",
        (body.replace('"count":2', '"count":1'), DS))


def _rehashed_body(tmp_path):
    body, _ = row(tmp_path, 3)
    body = body.replace('"count":2', '"count":1')
    sql(tmp_path, "UPDATE llmdp_records SET body = ?, hash = ? WHERE ledger = ? AND seq = 3",
        (body, hashlib.sha256(body.encode()).hexdigest(), DS))


def _rehashed_last(tmp_path):
    body, _ = row(tmp_path, 5)
    body = body.replace('"count":2', '"count":1')
    sql(tmp_path, "UPDATE llmdp_records SET body = ?, hash = ? WHERE ledger = ? AND seq = 5",
        (body, hashlib.sha256(body.encode()).hexdigest(), DS))


def _garbage_body(tmp_path):
    sql(tmp_path, "UPDATE llmdp_records SET body = ? WHERE ledger = ? AND seq = 3",
        ("\x00garbage{", DS))


def _deleted_row(seq):
    def damage(tmp_path):
        sql(tmp_path, "DELETE FROM llmdp_records WHERE ledger = ? AND seq = ?", (DS, seq))
    return damage


def _inserted_row(tmp_path):
    """A well-formed release at the end, linked to the last record: only the head shows it."""
    body, h = row(tmp_path, 5)
    rec = {**json.loads(body), "seq": 6, "prev": h, "count": 100, "run_id": "forged"}
    body = canonical(rec)
    sql(tmp_path, "INSERT INTO llmdp_records (ledger, seq, body, hash) VALUES (?, 6, ?, ?)",
        (DS, body, hashlib.sha256(body.encode()).hexdigest()))


DB_DAMAGE = {
    # name: (damage, what the message says, records a repair excuses, steps counted after it)
    "edited body": (_edited_body, r"record 3: its content no longer matches its hash \(edited\)",
                    {3}, 8),
    "edited body, hash recomputed": (_rehashed_body, r"record 4 does not link to record 3", {3}, 8),
    "last body edited, hash recomputed": (
        _rehashed_last, r"record 5, the last, is not the record the ledger's head names", {5}, 8),
    "garbage body": (_garbage_body, r"record 3 is not JSON \(garbage", {3}, 8),
    "deleted middle row": (_deleted_row(3), r"record 3 is missing \(deleted\)", {3}, 8),
    "deleted first row": (_deleted_row(1), r"record 1 is missing \(deleted\)", {1}, 8),
    "deleted last row": (_deleted_row(5), r"record 5 is missing \(deleted\)", {5}, 8),
    "inserted row": (_inserted_row, r"the ledger's head \(record 5, hash [0-9a-f]{12}\) is not its "
                                    r"last record 6: a record was edited or inserted", {6}, 10),
}


def _damaged_db(tmp_path, name):
    run_all(tmp_path)  # records 1..5: releases of 2 steps
    before = LedgerDB(db_path(tmp_path)).records(DS)
    DB_DAMAGE[name][0](tmp_path)
    return before


def _assert_names_damage(msg: str, said: str, tmp_path) -> None:
    assert msg.startswith(f"the dataset ledger {DS!r} in {db_path(tmp_path)} is damaged: "), msg
    assert re.search(said, msg), msg
    assert (f"`{REPAIR_CMD} --ledger {db_path(tmp_path)} --dataset {DS} --acknowledge-loss`"
            in msg), msg
    assert "restore the database from a backup" in msg


@pytest.mark.parametrize("name", list(DB_DAMAGE))
def test_dataset_ledger_damage_is_detected(tmp_path, name):
    _damaged_db(tmp_path, name)
    said = DB_DAMAGE[name][1]
    state = db_state(tmp_path)
    with pytest.raises(LedgerError) as e:
        LedgerDB(db_path(tmp_path)).read(DS)
    _assert_names_damage(str(e.value), said, tmp_path)
    # Nothing proceeds: no new reservation (database or run file), no hold, no import.
    other = service(tmp_path, "other", budget_epsilon=100.0)
    other.start_attempt()
    with pytest.raises(LedgerError, match="is damaged"):
        other.ensure(0)
    with pytest.raises(LedgerError, match="is damaged"):
        other.hold(10)
    with pytest.raises(LedgerError, match="is damaged"):
        LedgerDB(db_path(tmp_path)).append(DS, {"kind": "note"})
    assert db_state(tmp_path) == state
    assert not (tmp_path / "other" / "ledger.jsonl").exists()
    # Other ledgers in the same database are not concerned.
    LedgerDB(db_path(tmp_path)).append("another", {"kind": "note"})
    assert len(LedgerDB(db_path(tmp_path)).records("another")) == 1


@pytest.mark.parametrize("name", list(DB_DAMAGE))
def test_repair_needs_the_flag_and_leaves_a_record(tmp_path, name):
    before = _damaged_db(tmp_path, name)
    _, said, excused_seqs, steps_after = DB_DAMAGE[name]
    state = db_state(tmp_path)
    db = LedgerDB(db_path(tmp_path))
    # Refused without the flag: the same message, nothing written.
    with pytest.raises(LedgerError) as e:
        db.repair(DS, acknowledge_loss=False)
    _assert_names_damage(str(e.value), said, tmp_path)
    assert db_state(tmp_path) == state
    # With it: a repair record, listing the damage.
    damage, error = db.damage(DS)
    assert error is not None and damage
    rec = db.repair(DS, acknowledge_loss=True, reason="disk error, no backup")
    assert rec["kind"] == "repair" and rec["acknowledged_loss"] is True
    assert rec["reason"] == "disk error, no backup" and "@" in rec["by"]
    assert rec["seq"] == max(5, *excused_seqs) + 1
    assert rec["excused"][:len(damage)] == damage
    assert {d["seq"] for d in rec["excused"] if "fingerprint" in d} == excused_seqs
    assert rec["records_lost"] == len(excused_seqs)
    # The ledger verifies; the damaged records' releases are no longer counted.
    st = LedgerDB(db_path(tmp_path)).read(DS)
    assert st.excused == len(excused_seqs)
    assert st.records[-1] == rec and st.head_seq == rec["seq"]
    counted = released(st.records)
    assert not set(counted) & excused_seqs
    assert sum(counted.values()) == steps_after
    assert {s: c for s, c in counted.items()} == {
        r["seq"]: r["count"] for r in before if r["seq"] not in excused_seqs}
    assert db.damage(DS) == ([], None)
    assert db.repair(DS, acknowledge_loss=True) is None  # nothing left to repair
    # Later appends work, and link to the repair.
    later = run_all(tmp_path, "later", total=4, block=2)
    st = LedgerDB(db_path(tmp_path)).read(DS)
    assert [r["run_id"] for r in st.records[-2:]] == ["later", "later"]
    assert st.records[-2]["prev"] == rec["hash"]
    assert Ledger(later.run_ledger).records() == st.records[-2:]
    # A new damage after the repair is detected again: a repair excuses what it saw only.
    body, _ = row(tmp_path, 2)
    sql(tmp_path, "UPDATE llmdp_records SET body = ? WHERE ledger = ? AND seq = 2",
        (body.replace('"count":2', '"count":3'), DS))
    with pytest.raises(LedgerError, match=r"is damaged: record 2: its content no longer matches"):
        LedgerDB(db_path(tmp_path)).read(DS)


def test_an_excused_record_damaged_again_is_detected(tmp_path):
    _damaged_db(tmp_path, "edited body")
    LedgerDB(db_path(tmp_path)).repair(DS, acknowledge_loss=True)
    body, _ = row(tmp_path, 3)
    sql(tmp_path, "UPDATE llmdp_records SET body = ? WHERE ledger = ? AND seq = 3",
        (body.replace('"count":1', '"count":0'), DS))
    with pytest.raises(LedgerError, match=r"record 3: its content no longer matches its hash"):
        LedgerDB(db_path(tmp_path)).read(DS)
    # A second repair excuses the new damage; both repairs stay in the ledger.
    rec = LedgerDB(db_path(tmp_path)).repair(DS, acknowledge_loss=True)
    assert [d["seq"] for d in rec["excused"] if "fingerprint" in d] == [3]
    st = LedgerDB(db_path(tmp_path)).read(DS)
    assert [r["kind"] for r in st.records].count("repair") == 2


def test_a_row_put_back_after_a_repair_is_detected(tmp_path):
    """The repair excused record 3 as missing; whatever is put there later (even the
    original) is not what it excused."""
    before = _damaged_db(tmp_path, "deleted middle row")
    LedgerDB(db_path(tmp_path)).repair(DS, acknowledge_loss=True)
    third = next(r for r in before if r["seq"] == 3)
    body = canonical({k: v for k, v in third.items() if k != "hash"})
    sql(tmp_path, "INSERT INTO llmdp_records (ledger, seq, body, hash) VALUES (?, 3, ?, ?)",
        (DS, body, third["hash"]))
    with pytest.raises(LedgerError, match="record 3 is not the damaged record a repair excused"):
        LedgerDB(db_path(tmp_path)).read(DS)
    rec = LedgerDB(db_path(tmp_path)).repair(DS, acknowledge_loss=True)
    assert [d["seq"] for d in rec["excused"] if "fingerprint" in d] == [3]
    st = LedgerDB(db_path(tmp_path)).read(DS)
    assert 3 not in released(st.records) and st.excused == 1


def test_a_forged_row_put_back_after_a_repair_is_detected(tmp_path):
    _damaged_db(tmp_path, "deleted middle row")
    LedgerDB(db_path(tmp_path)).repair(DS, acknowledge_loss=True)
    body, h2 = row(tmp_path, 2)
    forged = {**json.loads(body), "seq": 3, "prev": h2, "kind": "hold_end", "run_id": "someone"}
    body = canonical(forged)
    sql(tmp_path, "INSERT INTO llmdp_records (ledger, seq, body, hash) VALUES (?, 3, ?, ?)",
        (DS, body, hashlib.sha256(body.encode()).hexdigest()))
    with pytest.raises(LedgerError, match="record 3 is not the damaged record a repair excused"):
        LedgerDB(db_path(tmp_path)).read(DS)


def test_a_deleted_head_is_detected(tmp_path):
    run_all(tmp_path)
    sql(tmp_path, "DELETE FROM llmdp_heads WHERE ledger = ?", (DS,))
    with pytest.raises(LedgerError, match="the ledger has records but no head"):
        LedgerDB(db_path(tmp_path)).read(DS)


# ------------------------------------------------------------------ legacy JSONL ledgers

def _legacy_line(count, first_step, run_id="old-run", kind="release") -> bytes:
    return json.dumps({"kind": kind, "event": EVJ, "count": count, "first_step": first_step,
                       "run_id": run_id, "attempt": "0", "time": "2025-01-02T03:04:05.000+00:00",
                       "meta": META}, separators=(",", ":")).encode()


def _legacy_file(tmp_path, lines) -> str:
    path = tmp_path / "legacy.jsonl"
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    return str(path)


def test_a_legacy_ledger_is_imported_once(tmp_path):
    path = _legacy_file(tmp_path, [_legacy_line(4, 0), _legacy_line(4, 4),
                                   b'{"kind":"note","text":"hello"}', _legacy_line(2, 8)])
    lg = Ledger(path)
    assert len(lg.records()) == 4 and lg.legacy
    db = LedgerDB(db_path(tmp_path))
    assert db.import_jsonl(DS, path) == 3
    records = db.records(DS)
    imp = records[0]
    assert imp["kind"] == "import" and imp["path"] == os.path.realpath(path)
    assert imp["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert (imp["lines"], imp["releases"]) == (4, 3)
    rel = records[1:]
    assert [(r["first_step"], r["count"]) for r in rel] == [(0, 4), (4, 4), (8, 2)]
    assert all(r["kind"] == "release" and r["run_id"] == "old-run" and r["event"] == EVJ
               and r["imported_from"] == os.path.realpath(path) and r["meta"] == META
               and r["original_time"].startswith("2025-01-02") for r in rel)
    # Imported once: a second import (another run on the same data) is a no-op.
    assert LedgerDB(db_path(tmp_path)).import_jsonl(DS, path) == 0
    assert LedgerDB(db_path(tmp_path)).records(DS) == records
    # A legacy file that changed since is not imported again, with a warning.
    with open(path, "ab") as f:
        f.write(_legacy_line(2, 10) + b"\n")
    said = []
    assert LedgerDB(db_path(tmp_path)).import_jsonl(DS, path, log=said.append) == 0
    assert len(said) == 1 and "changed since it was imported" in said[0]
    assert LedgerDB(db_path(tmp_path)).records(DS) == records


@pytest.mark.parametrize("damage, said", [
    ("torn", r"the last line \(line 3: \d+ bytes, no newline\) is torn"),
    ("garbage", r"line 2 is not a ledger record"),
    ("release without a count", r"line 2 is a release without a valid event and an integer count"),
])
def test_a_damaged_legacy_ledger_is_refused_with_its_line(tmp_path, damage, said):
    lines = [_legacy_line(4, 0), _legacy_line(4, 4), _legacy_line(2, 8)]
    if damage == "torn":
        path = _legacy_file(tmp_path, lines)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 9)
    elif damage == "garbage":
        lines[1] = b"#$%garbage"
        path = _legacy_file(tmp_path, lines)
    else:
        lines[1] = lines[1].replace(b'"count":4', b'"count":"4"')
        path = _legacy_file(tmp_path, lines)
    with pytest.raises(LedgerError) as e:
        LedgerDB(db_path(tmp_path)).import_jsonl(DS, path)
    msg = str(e.value)
    assert msg.startswith(path + ":") and re.search(said, msg), msg
    assert REPAIR_CMD not in msg  # no run directory to repair: the file is fixed by hand
    assert LedgerDB(db_path(tmp_path)).records(DS) == []


def test_a_legacy_torn_fragment_terminated_by_the_old_writer_is_imported(tmp_path):
    """An earlier llmdp, after a crash in the middle of a write, terminated the fragment and
    appended a "repair" line naming its length: the file it wrote imports."""
    fragment = _legacy_line(4, 4)[:23]
    path = _legacy_file(tmp_path, [
        _legacy_line(4, 0), fragment,
        json.dumps({"kind": "repair", "torn_bytes": len(fragment), "time": "x"}).encode(),
        _legacy_line(4, 4)])
    assert LedgerDB(db_path(tmp_path)).import_jsonl(DS, path) == 2
    assert sum(released(LedgerDB(db_path(tmp_path)).records(DS)).values()) == 8
    # A fragment the repair line does not name (another length) is garbage.
    path = _legacy_file(tmp_path, [
        _legacy_line(4, 0), fragment,
        json.dumps({"kind": "repair", "torn_bytes": len(fragment) + 1}).encode()])
    with pytest.raises(LedgerError, match="line 2 is not a ledger record"):
        LedgerDB(db_path(tmp_path)).import_jsonl("other", path)


def test_a_runs_ledger_jsonl_is_not_imported(tmp_path):
    run_all(tmp_path)
    with pytest.raises(LedgerError, match="is a run's ledger.jsonl"):
        LedgerDB(db_path(tmp_path)).import_jsonl("other", str(tmp_path / "run" / "ledger.jsonl"))
