"""Concurrency of the dataset ledger database (issue 13)."""

from __future__ import annotations

import time

from llmdp.privacy.ledgerdb import LedgerDB


def test_sqlite_first_open_waits_for_a_concurrent_writer(tmp_path):
    """Switching a new SQLite file to WAL needs an exclusive lock, and SQLite answers
    "database is locked" at once (no busy wait) while another connection writes: the
    opening process must wait, not fail with "not an SQLite file, or damaged". (Several
    runs starting together on a fresh ledger hit this: seen in the stress tests.)"""
    import sqlite3
    import threading

    path = tmp_path / "ledgers.sqlite"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE t (x)")
    other.execute("BEGIN IMMEDIATE")  # another process writing (the file not yet in WAL mode)
    other.execute("INSERT INTO t VALUES (1)")
    release = threading.Timer(0.5, lambda: other.execute("COMMIT"))
    release.start()
    db = LedgerDB(str(path))
    try:
        t0 = time.monotonic()
        db.append("ds", {"kind": "note", "text": "first"})
        assert time.monotonic() - t0 >= 0.4  # it waited for the writer
        assert [r["kind"] for r in db.records("ds")] == ["note"]
        mode = db._connect().execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"
    finally:
        release.join()
        db.close()
        other.close()
