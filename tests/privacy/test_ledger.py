import json
import os
import subprocess
import sys
import textwrap

import pytest

from llmdp.privacy.accountant import epsilon
from llmdp.privacy.events import dpsgd_step_event
from llmdp.privacy.ledger import Ledger, LedgerError, LedgerWriter, append_record

EV = dpsgd_step_event(0.01, 1.0)
META = {
    "config_hash": "abc123",
    "unit": "sequence",
    "dataset_fingerprint": "f00d",
    "rng": "os.urandom",
}


def _writer(path, attempt="0", block_size=10, total_steps=35, run_id="run-a"):
    return LedgerWriter(
        path,
        run_id=run_id,
        attempt=attempt,
        meta=META,
        block_size=block_size,
        total_steps=total_steps,
    )


def _lines(path):
    return path.read_bytes().split(b"\n")


def test_round_trip_and_meta(tmp_path):
    path = tmp_path / "run" / "ledger.jsonl"  # parent directory does not exist yet
    w = _writer(path)
    assert path.exists()
    rec = w.append(EV, 4, first_step=0, extra={"note": "x"})
    records = Ledger(path).records()
    assert records == [rec]
    r = records[0]
    assert r["kind"] == "release" and r["count"] == 4 and r["first_step"] == 0
    assert r["run_id"] == "run-a" and r["attempt"] == "0" and r["meta"] == META
    assert r["extra"] == {"note": "x"}
    assert "T" in r["time"]  # ISO 8601
    assert Ledger(path).entries() == [(EV, 4)]
    assert Ledger(path).runs() == ["run-a"]


def test_missing_ledger_is_empty(tmp_path):
    lg = Ledger(tmp_path / "nope.jsonl")
    assert lg.records() == [] and lg.entries() == [] and lg.total_count() == 0
    assert epsilon(lg, 1e-5) == 0.0


def test_block_reservation_one_line_per_block(tmp_path):
    path = tmp_path / "ledger.jsonl"
    w = _writer(path, block_size=10, total_steps=35)
    wrote = [w.ensure(step, EV) for step in range(35)]
    # Lines at steps 0, 10, 20, 30 only; the last block is clipped to the plan.
    assert [s for s, x in enumerate(wrote) if x] == [0, 10, 20, 30]
    recs = Ledger(path).records()
    assert [(r["first_step"], r["count"]) for r in recs] == [(0, 10), (10, 10), (20, 10), (30, 5)]
    assert w.reserved_until == 35
    lg = Ledger(path)
    assert lg.total_count() == 35
    assert lg.entries() == [(EV, 35)]  # consecutive identical events merged
    with pytest.raises(LedgerError, match="beyond the planned total_steps=35"):
        w.ensure(35, EV)


def test_new_event_mid_block_starts_new_block(tmp_path):
    path = tmp_path / "ledger.jsonl"
    w = _writer(path, block_size=10, total_steps=100)
    other = dpsgd_step_event(0.02, 1.0)
    assert w.ensure(0, EV) and not w.ensure(1, EV)
    assert w.ensure(2, other)  # different mechanism: its own reservation
    assert not w.ensure(3, other)
    assert Ledger(path).entries() == [(EV, 10), (other, 10)]


def test_crash_and_resume_never_under_counts(tmp_path):
    path = tmp_path / "ledger.jsonl"
    total, block = 50, 8
    applied = 0
    # Attempt 1 applies steps 0..k-1 and then crashes (the object is simply abandoned).
    w1 = _writer(path, attempt="1", block_size=block, total_steps=total)
    k = 21
    for step in range(k):
        w1.ensure(step, EV)
        applied += 1
    del w1
    # Attempt 2 resumes from a checkpoint taken at step j < k and runs to the end:
    # steps j..k-1 are executed (released) a second time.
    j = 13
    w2 = _writer(path, attempt="2", block_size=block, total_steps=total)
    for step in range(j, total):
        w2.ensure(step, EV)
        applied += 1
    lg = Ledger(path)
    assert applied == k + (total - j)
    assert lg.total_count() >= applied
    # ... and over-counts by at most one partial block per attempt.
    assert lg.total_count() <= applied + 2 * block
    assert lg.total_count("run-a") == lg.total_count()
    attempts = [r["attempt"] for r in lg.records()]
    assert attempts[0] == "1" and attempts[-1] == "2"
    # The ledger's epsilon is at least that of the steps actually applied.
    assert epsilon(lg, 1e-5, "rdp") >= epsilon([(EV, applied)], 1e-5, "rdp")


def test_torn_last_line_ignored_then_repaired(tmp_path):
    path = tmp_path / "ledger.jsonl"
    w = _writer(path, block_size=5, total_steps=100)
    w.ensure(0, EV)
    good = path.read_bytes()
    torn = b'{"kind":"release","event":{"module_na'
    with open(path, "ab") as f:
        f.write(torn)  # crash in the middle of writing the next line
    lg = Ledger(path)
    assert lg.total_count() == 5 and lg.torn_lines == 1
    # A new writer (resume) terminates the fragment; appending works and the fragment
    # stays an isolated, ignored line, while the file stays readable.
    w2 = _writer(path, attempt="1", block_size=5, total_steps=100)
    assert path.read_bytes().startswith(good + torn + b"\n")
    w2.ensure(5, EV)
    lg = Ledger(path)
    assert lg.total_count() == 10
    assert lg.torn_lines == 1
    assert [r["kind"] for r in lg.records()] == ["release", "repair", "release"]
    # A plain append_record after another torn write also repairs first.
    with open(path, "ab") as f:
        f.write(b'{"kind":"rel')
    append_record(path, {"kind": "note", "text": "hello"})
    lg = Ledger(path)
    assert lg.torn_lines == 2 and lg.total_count() == 10
    assert lg.records()[-1] == {"kind": "note", "text": "hello"}


def test_complete_line_missing_only_newline_is_counted(tmp_path):
    # Over-counting is allowed, under-counting is not: a whole record is kept.
    path = tmp_path / "ledger.jsonl"
    w = _writer(path, block_size=5, total_steps=100)
    w.ensure(0, EV)
    data = path.read_bytes()
    path.write_bytes(data + data.rstrip(b"\n"))
    assert Ledger(path).total_count() == 10


def test_corrupt_middle_line_raises_with_line_number(tmp_path):
    path = tmp_path / "ledger.jsonl"
    w = _writer(path, block_size=5, total_steps=100)
    for s in (0, 5, 10):
        w.ensure(s, EV)
    lines = _lines(path)
    lines[1] = lines[1][:20] + b"#garbage" + lines[1][20:]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LedgerError, match="line 2"):
        Ledger(path).records()
    # A torn fragment is excused only if the repair line right after names its length.
    lines = _lines(path)
    lines[1] = b'{"kind":"release","ev'
    lines.insert(2, json.dumps({"kind": "repair", "torn_bytes": 999}).encode())
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LedgerError, match="line 2"):
        Ledger(path).records()


def test_release_without_count_is_corruption(tmp_path):
    path = tmp_path / "ledger.jsonl"
    append_record(path, {"kind": "release", "event": {"a": 1}, "count": "7"})
    with pytest.raises(LedgerError, match="line 1"):
        Ledger(path).total_count()


def test_fsync_happens_before_ensure_returns(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    calls = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        # Snapshot the file as of this fsync: the line must already be written.
        calls.append(path.read_bytes() if path.exists() else b"")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    w = _writer(path, block_size=4, total_steps=8)
    n_init = len(calls)
    assert n_init >= 2  # file fsync + directory fsync for the newly created file
    for step in range(8):
        before = len(calls)
        if w.ensure(step, EV):
            # At least one fsync after the write and before ensure returned, and that
            # fsync saw the reservation for this step on disk.
            assert len(calls) > before
            synced = [json.loads(x) for x in calls[-1].splitlines() if x]
            assert any(r.get("first_step") == step for r in synced)
        else:
            assert len(calls) == before  # no I/O for already reserved steps
    assert len(calls) - n_init == 2  # two blocks


def test_two_processes_do_not_interleave(tmp_path):
    path = tmp_path / "ledger.jsonl"
    code = textwrap.dedent(
        f"""
        import sys
        from llmdp.privacy.ledger import append_record
        for i in range(200):
            append_record({str(path)!r}, {{"kind": "note", "who": sys.argv[1], "i": i, "pad": "x" * 3000}})
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, name]) for name in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    recs = Ledger(path).records()
    assert len(recs) == 400
    for who in "ab":
        assert [r["i"] for r in recs if r["who"] == who] == list(range(200))


def test_crash_after_ensure_is_counted(tmp_path):
    # A child ensures step 0 (write-ahead), then dies before "applying" the update.
    path = tmp_path / "ledger.jsonl"
    code = textwrap.dedent(
        f"""
        import os
        from llmdp.privacy.events import dpsgd_step_event
        from llmdp.privacy.ledger import LedgerWriter
        w = LedgerWriter({str(path)!r}, run_id="child", attempt="0", meta={{}}, block_size=3,
                         total_steps=10)
        assert w.ensure(0, dpsgd_step_event(0.01, 1.0))
        os._exit(1)  # crash: no cleanup, no flush of Python buffers, update never applied
        """
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert r.returncode == 1
    lg = Ledger(path)
    assert lg.total_count("child") == 3 and lg.entries() == [(EV, 3)]


def test_writer_validation(tmp_path):
    p = tmp_path / "l.jsonl"
    with pytest.raises(ValueError, match="block_size"):
        LedgerWriter(p, run_id="r", attempt="0", meta={}, block_size=0, total_steps=5)
    with pytest.raises(ValueError, match="run_id"):
        LedgerWriter(p, run_id="", attempt="0", meta={}, block_size=1, total_steps=5)
    with pytest.raises(LedgerError, match="JSON"):
        LedgerWriter(p, run_id="r", attempt="0", meta={"x": object()}, block_size=1, total_steps=5)
    w = LedgerWriter(p, run_id="r", attempt="0", meta={}, block_size=1, total_steps=5)
    with pytest.raises(ValueError, match="repair"):
        w.append(None, 0, kind="repair")
    with pytest.raises(ValueError, match="count"):
        w.append(EV, 0)
    w.append(None, 0, kind="note")
    assert Ledger(p).total_count() == 0
