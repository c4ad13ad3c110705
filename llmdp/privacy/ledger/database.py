"""The dataset ledgers' database: SQLite (WAL mode, the embedded default) or PostgreSQL.

One database holds the ledgers of many datasets, one hash chain per dataset id
(`llmdp.privacy.ledger.records`). Where it is: `llmdp.privacy.ledger.location.resolve_location`
(``privacy.ledger``: a SQLite path or a ``postgresql://`` URL; default
``$LLMDP_HOME/ledger.sqlite``).

Writes happen in `LedgerDB.transaction`: an exclusive lock on the ledger (SQLite: ``BEGIN
IMMEDIATE``; PostgreSQL: ``SELECT ... FOR UPDATE`` of the ledger's head row) during which
the caller reads the verified records, decides (e.g. checks the budget) and appends. "Check
the budget and reserve the next block" is therefore one transaction, whatever the number
of concurrent runs.

Tamper evidence: every read verifies the chain (`llmdp.privacy.ledger.verify.verify_rows`:
every record's hash, every link of the chain and the head, the last record's seq and hash,
kept in a table of its own, so a deleted last record is seen too). A damaged ledger raises
`LedgerError`; `LedgerDB.repair` with ``acknowledge_loss`` is the only way past it, and
appends a ``repair`` record naming each damaged record (by a fingerprint of what was found),
so that exactly that damage is excused from then on, and nothing else.

Anchors outside the database (`llmdp.privacy.ledger.anchors`): every committed transaction that
appended records is followed by a line in the database's head log (``$LLMDP_HOME/heads``),
and the records a run's ledger service writes name the run's ``ledger.jsonl``. Every full
read and every transaction checks the ledger against both, so deleting the last records
and moving the head back, or deleting a whole ledger, is detected as damage too (a repair
lists what it acknowledges as ``lost``).
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import socket
import sqlite3
import time

from llmdp.privacy.ledger.anchors import (
    HeadLog,
    RunFiles,
    claim_problems,
    named_run_ledgers,
    unmet_claims,
)
from llmdp.privacy.ledger.location import (
    default_location,
    describe_location,
    is_url,
    register,
)
from llmdp.privacy.ledger.records import (
    GENESIS,
    RECORD_VERSION,
    Ledger,
    LedgerDamaged,
    LedgerError,
    canonical,
    check_record,
    make_dirs,
    now,
)
from llmdp.privacy.ledger.verify import (
    DAMAGE_HINT,
    VerifiedLedger,
    _damage_list,
    _excused,
    _last_good,
    _self_valid,
    verify_rows,
)

__all__ = ["LedgerDB"]

SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS llmdp_records (ledger TEXT NOT NULL, seq BIGINT NOT NULL, "
    "body TEXT NOT NULL, hash TEXT NOT NULL, PRIMARY KEY (ledger, seq))",
    "CREATE TABLE IF NOT EXISTS llmdp_heads (ledger TEXT PRIMARY KEY, seq BIGINT NOT NULL, "
    "hash TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS llmdp_schema (version INTEGER NOT NULL)",
)


def _set_wal(conn, wait_s: float = 300.0) -> None:
    """Switch an SQLite connection's file to WAL mode (a no-op once it is). Switching a new
    file needs an exclusive lock, and SQLite answers "database is locked" at once (no busy
    wait) while another connection holds a lock on it, e.g. another run opening the same
    new file: wait for it (as long as the connection's busy timeout) instead of failing."""
    deadline = time.monotonic() + wait_s
    pause = 0.01
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            busy = "locked" in str(e) or "busy" in str(e)
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(0.5, pause * 2)


class _Tx:
    """One open transaction on one ledger: verified records and `append`."""

    def __init__(self, db: LedgerDB, cur, ledger: str, state: VerifiedLedger):
        self.db, self.cur, self.ledger, self.state = db, cur, ledger, state
        self.appended = 0
        self.first_seq = state.head_seq + 1

    @property
    def records(self) -> list[dict]:
        return self.state.records

    def append(self, record: dict) -> dict:
        """Add ``record`` at the end of the ledger (seq, prev, run_prev, time, hash set here);
        durable when the transaction commits. Returns the record with its hash."""
        st = self.state
        rec = {k: v for k, v in record.items() if k != "hash"}
        rec.update(v=RECORD_VERSION, ledger=self.ledger, seq=st.head_seq + 1, prev=st.head_hash)
        rec.setdefault("time", now())
        rec.setdefault("run_id", None)
        if rec["run_id"] in self.db.run_ledgers:  # the run's ledger.jsonl: an anchor (anchors.py)
            rec.setdefault("run_ledger", self.db.run_ledgers[rec["run_id"]])
            rec.setdefault("txn", self.first_seq)  # the transaction's first record
        if "run_prev" not in rec:
            last = st.last_of_run(rec["run_id"]) if rec["run_id"] is not None else None
            rec["run_prev"] = None if last is None else last["hash"]
        why = check_record(rec)
        if why:
            raise LedgerError(f"refusing to write an invalid ledger record: {why}")
        body = canonical(rec)
        h = hashlib.sha256(body.encode("ascii")).hexdigest()
        self.db._exec(self.cur, "INSERT INTO llmdp_records (ledger, seq, body, hash) VALUES (?, ?, ?, ?)",
                      (self.ledger, rec["seq"], body, h))
        self.db._exec(self.cur, "UPDATE llmdp_heads SET seq = ?, hash = ? WHERE ledger = ?",
                      (rec["seq"], h, self.ledger))
        rec["hash"] = h
        st.records.append(rec)
        st.head_seq, st.head_hash = rec["seq"], h
        self.appended += 1
        return rec


class LedgerDB:
    """A connection to the ledgers' database at ``location`` (a SQLite path or a
    ``postgresql://`` URL). ``read_only``: never create anything (readers: reports, export,
    verify); a missing SQLite file then raises `LedgerError`. ``head_log``: the database's
    head log (default `anchors.head_log_path`, in this process's ``$LLMDP_HOME``).
    ``run_ledgers``: {run id: its ledger.jsonl}, named in the records this connection
    appends for that run (the ledger service registers its run)."""

    def __init__(self, location: str, read_only: bool = False, head_log: str | None = None):
        self.location = location
        self.where = describe_location(location)
        self.pg = is_url(location)
        self.read_only = read_only
        self._conn = None
        self._cache: dict[str, VerifiedLedger] = {}
        self.heads = HeadLog(location, head_log)
        self.runs = RunFiles()
        self.run_ledgers: dict[str, str] = {}

    # ------------------------------------------------------------------ connection
    def _connect(self):
        if self._conn is not None:
            return self._conn
        if self.pg:
            try:
                import psycopg
            except ImportError:
                raise LedgerError(
                    f"privacy.ledger: {self.where} is a PostgreSQL URL, but the driver psycopg is "
                    f"not installed; `pip install 'llmdp[postgresql]'` (or psycopg[binary])") from None
            try:
                self._conn = psycopg.connect(self.location, autocommit=True, connect_timeout=30)
            except Exception as e:  # noqa: BLE001 - psycopg.OperationalError and friends
                raise LedgerError(f"cannot connect to the ledger database {self.where}: "
                                  f"{str(e).strip()}") from None
        else:
            if self.read_only and not os.path.exists(self.location):
                logged = sorted(self.heads.ledgers())
                if logged:
                    raise LedgerDamaged(
                        f"the ledger database {self.location} does not exist, but its head log "
                        f"{self.heads.path} names {len(logged)} ledger(s) written there "
                        f"({', '.join(repr(i) for i in logged[:3])}{', ...' if len(logged) > 3 else ''}): "
                        f"the database was deleted or moved. Restore it from a backup (or point "
                        f"privacy.ledger / --ledger at where it is now)")
                raise LedgerError(f"the ledger database {self.location} does not exist (was "
                                  f"LLMDP_HOME or privacy.ledger different when the run was made?)")
            if not self.read_only:
                folder = os.path.dirname(self.location) or "."
                try:
                    make_dirs(folder)
                except OSError as e:
                    raise LedgerError(_unusable_folder(folder, e)) from None
                if not os.path.isdir(folder):
                    raise LedgerError(_unusable_folder(folder, NotADirectoryError("not a folder")))
                denied = _not_writable(self.location)
                if denied:  # said as what it is, before SQLite reads it as damage
                    raise LedgerError(_permission_message(self.location, denied))
            try:
                self._conn = sqlite3.connect(self.location, timeout=300, isolation_level=None,
                                             check_same_thread=False)
                if not self.read_only:
                    _set_wal(self._conn)
                # Durable at every commit (WAL + FULL fsyncs the log at each commit).
                self._conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.DatabaseError as e:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None
                if _is_permission(e):
                    raise LedgerError(_permission_message(self.location, str(e))) from None
                raise LedgerError(f"the ledger database {self.location} cannot be opened: {e} "
                                  f"(not an SQLite file, or damaged; restore it from a backup)") from None
        if not self.read_only:
            self._ensure_schema()
            register(self.location)  # every database written to is searched by later runs
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def __getstate__(self):  # picklable (Ray actors): reconnect on the other side
        return {"location": self.location, "read_only": self.read_only,
                "head_log": self.heads.path, "run_ledgers": dict(self.run_ledgers)}

    def __setstate__(self, state):
        self.__init__(state["location"], state["read_only"], state.get("head_log"))
        self.run_ledgers.update(state.get("run_ledgers") or {})

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.pg else sql

    def _exec(self, cur, sql: str, params=()):
        try:
            cur.execute(self._sql(sql), params)
        except Exception as e:  # noqa: BLE001 - sqlite3/psycopg errors
            if isinstance(e, LedgerError):
                raise
            if not self.pg and _is_permission(e):
                raise LedgerError(_permission_message(self.location, str(e))) from None
            raise LedgerError(f"the ledger database {self.where}: {type(e).__name__}: {e}") from e
        return cur

    def _ensure_schema(self) -> None:
        conn = self._conn
        cur = conn.cursor()
        if self.pg:
            with conn.transaction():
                cur.execute("SELECT pg_advisory_xact_lock(7417011)")  # one creator at a time
                for s in _SCHEMA:
                    cur.execute(s)
                cur.execute("SELECT version FROM llmdp_schema")
                if cur.fetchone() is None:
                    cur.execute("INSERT INTO llmdp_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            return
        self._retry(lambda: self._sqlite_schema(cur))

    def _sqlite_schema(self, cur) -> None:
        cur.execute("BEGIN IMMEDIATE")
        try:
            for s in _SCHEMA:
                cur.execute(s)
            if cur.execute("SELECT version FROM llmdp_schema").fetchone() is None:
                cur.execute("INSERT INTO llmdp_schema (version) VALUES (?)", (SCHEMA_VERSION,))
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    def _retry(self, fn, tries: int = 50):
        for i in range(tries):
            try:
                return fn()
            except sqlite3.OperationalError as e:
                if _is_permission(e):
                    raise LedgerError(_permission_message(self.location, str(e))) from None
                if "locked" not in str(e) and "busy" not in str(e):
                    raise LedgerError(f"the ledger database: {e}") from e
                time.sleep(min(2.0, 0.05 * (i + 1)))
        return fn()

    # ------------------------------------------------------------------ reading
    def ledgers(self) -> list[str]:
        """Every ledger of the database, and every ledger its head log names (one deleted
        from the database is listed, and reads as damaged)."""
        logged = self.heads.ledgers()
        conn = self._connect()
        cur = conn.cursor()
        try:
            self._exec(cur, "SELECT ledger FROM llmdp_heads ORDER BY ledger")
        except LedgerError:
            if self.read_only:
                return sorted(logged)
            raise
        return sorted({r[0] for r in cur.fetchall()} | logged)

    def _rows(self, cur, ledger: str, after: int = 0):
        self._exec(cur, "SELECT seq, body, hash FROM llmdp_records WHERE ledger = ? AND seq > ? "
                        "ORDER BY seq", (ledger, after))
        rows = cur.fetchall()
        self._exec(cur, "SELECT seq, hash FROM llmdp_heads WHERE ledger = ?", (ledger,))
        return rows, cur.fetchone()

    def _hint_arg(self, ledger: str) -> str:
        loc = "" if self.location == default_location() else f"--ledger {self.where} "
        return f"{loc}--dataset {ledger} "

    def _verified(self, cur, ledger: str, full: bool) -> VerifiedLedger:
        """The verified ledger: fully checked (``full``), or the cached state extended by the
        records appended since (their links from the cached head checked)."""
        cached = self._cache.get(ledger)
        if full or cached is None:
            try:
                rows, head = self._rows(cur, ledger)
            except LedgerError:
                if self.read_only:
                    return VerifiedLedger(ledger=ledger)  # no tables yet: no ledger
                raise
            st = verify_rows(ledger, rows, head, self.where, self._hint_arg(ledger))
        else:
            rows, head = self._rows(cur, ledger, after=cached.head_seq)
            if not rows and (head is None or (int(head[0]), head[1]) == (cached.head_seq, cached.head_hash)):
                return cached
            st = VerifiedLedger(ledger=ledger, records=list(cached.records), head_seq=cached.head_seq,
                                head_hash=cached.head_hash, excused=cached.excused)
            expected = cached.head_hash
            for row in rows:
                seq = int(row[0])
                rec = _self_valid(ledger, seq, row)
                if rec is None or seq != st.head_seq + 1 or rec["prev"] != expected:
                    return self._verified(cur, ledger, full=True)  # full check: names the damage
                st.records.append(rec)
                st.head_seq, st.head_hash, expected = seq, rec["hash"], rec["hash"]
            if head is None or (int(head[0]), head[1]) != (st.head_seq, st.head_hash):
                return self._verified(cur, ledger, full=True)
        self._cache[ledger] = st
        return st

    @contextlib.contextmanager
    def _snapshot(self, conn):
        """One view of the database for several reads (a ledger's records, then its head).
        Without it each statement sees the database as it is then, and a record another
        process appends between the two makes an intact ledger look damaged. (Inside a
        write transaction, which locks the ledger, nothing changes in between.)"""
        if self.pg:
            import psycopg

            idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            with conn.transaction():
                if idle:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                yield
            return
        if conn.in_transaction:
            yield
            return
        conn.execute("BEGIN")  # deferred: a WAL read transaction, never waits for writers
        try:
            yield
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("COMMIT")

    def read(self, ledger: str) -> VerifiedLedger:
        """Every record of ``ledger``, fully verified (an unknown ledger is empty) and
        checked against its anchors (`_check_anchors`)."""
        conn = self._connect()
        cur = conn.cursor()
        runs = []
        for attempt in (0, 1):
            claims = self.heads.claims(ledger)  # before the snapshot: each line was committed
            with self._snapshot(conn):
                st = self._verified(cur, ledger, full=True)
            if attempt == 0:
                # Read after the snapshot, a run's file may show a record committed since:
                # the second look (a new snapshot) has every record the files showed.
                runs = self.runs.claims(ledger, named_run_ledgers(st.records))
            problems = claim_problems(claims + runs, st.records, st.head_seq)
            if not problems:
                return st
        self._cache.pop(ledger, None)
        raise self._anchor_damage(ledger, problems)

    def _anchor_damage(self, ledger: str, problems: list[str]) -> LedgerDamaged:
        return LedgerDamaged(f"the dataset ledger {ledger!r} in {self.where} is damaged: "
                             f"{'; '.join(problems)}. "
                             + DAMAGE_HINT.format(ledger_arg=self._hint_arg(ledger)))

    def _check_anchors(self, ledger: str, st: VerifiedLedger) -> None:
        """Inside a transaction (the ledger locked: no record can commit meanwhile): every
        claim of the head log and of the run ledgers the records name holds
        (`anchors.claim_problems`), else `LedgerDamaged`."""
        claims = self.heads.claims(ledger) + self.runs.claims(ledger, named_run_ledgers(st.records))
        problems = claim_problems(claims, st.records, st.head_seq)
        if problems:
            self._cache.pop(ledger, None)
            raise self._anchor_damage(ledger, problems)

    def records(self, ledger: str) -> list[dict]:
        return self.read(ledger).records

    # ------------------------------------------------------------------ writing
    @contextlib.contextmanager
    def transaction(self, ledger: str, full: bool = False):
        """Lock ``ledger`` exclusively, yield a `_Tx` (verified records + append), commit
        on exit (roll back on an exception). ``full``: verify the whole chain (else only
        the records appended since this connection last saw the ledger)."""
        if self.read_only:
            raise LedgerError(f"{self.where}: opened read-only")
        self.heads.ensure_writable()
        conn = self._connect()
        cur = conn.cursor()
        if self.pg:
            try:
                with conn.transaction():
                    cur.execute("INSERT INTO llmdp_heads (ledger, seq, hash) VALUES (%s, 0, %s) "
                                "ON CONFLICT (ledger) DO NOTHING", (ledger, GENESIS))
                    cur.execute("SELECT seq FROM llmdp_heads WHERE ledger = %s FOR UPDATE", (ledger,))
                    tx = self._begin(cur, ledger, full)
                    yield tx
            except BaseException:
                self._cache.pop(ledger, None)
                raise
            self._cache[ledger] = tx.state
            self._anchor(tx)
            return
        self._retry(lambda: cur.execute("BEGIN IMMEDIATE"))
        try:
            try:
                cur.execute("INSERT OR IGNORE INTO llmdp_heads (ledger, seq, hash) VALUES (?, 0, ?)",
                            (ledger, GENESIS))
            except sqlite3.OperationalError as e:
                if _is_permission(e):
                    raise LedgerError(_permission_message(self.location, str(e))) from None
                raise
            tx = self._begin(cur, ledger, full)
            yield tx
        except BaseException:
            cur.execute("ROLLBACK")
            self._cache.pop(ledger, None)
            raise
        try:
            cur.execute("COMMIT")
        except sqlite3.Error as e:
            self._cache.pop(ledger, None)
            raise LedgerError(f"the ledger database {self.where}: the transaction did not "
                              f"commit: {e}") from e
        self._cache[ledger] = tx.state
        self._anchor(tx)

    def _anchor(self, tx: _Tx) -> None:
        """After the commit: the ledger's new head in the head log (a crash before this line
        leaves the log behind the database, which the checks accept)."""
        if tx.appended:
            self.heads.append(tx.ledger, tx.state.head_seq, tx.state.head_hash)

    def _begin(self, cur, ledger: str, full: bool) -> _Tx:
        try:
            st = self._verified(cur, ledger, full)
            self._check_anchors(ledger, st)
        except LedgerError:
            self._cache.pop(ledger, None)
            raise
        # Work on a copy: a rollback must not leave appended records in the cache.
        st = VerifiedLedger(ledger=ledger, records=list(st.records), head_seq=st.head_seq,
                            head_hash=st.head_hash, excused=st.excused)
        return _Tx(self, cur, ledger, st)

    def append(self, ledger: str, record: dict) -> dict:
        """One record in its own transaction."""
        with self.transaction(ledger) as tx:
            return tx.append(record)

    # ------------------------------------------------------------------ repair, import
    def damage(self, ledger: str) -> tuple[list[dict], str | None]:
        """(what a repair of ``ledger`` would excuse, the verification error or None). The
        error includes claims of the anchors the ledger does not meet (`read`); what a repair
        acknowledges as lost for them is decided under its lock (`repair`)."""
        try:
            self.read(ledger)
            return [], None
        except LedgerDamaged as e:
            error = str(e)
        conn = self._connect()
        cur = conn.cursor()
        with self._snapshot(conn):
            rows, head = self._rows(cur, ledger)
        return _damage_list(ledger, rows, head), error

    def _lost_claims(self, ledger: str, rows, excuses: list[dict]) -> tuple[list[dict], int]:
        """The anchors' claims (`llmdp.privacy.ledger.anchors`) that the ledger's rows, once the
        damage ``excuses`` lists is excused, do not meet: what a repair acknowledges as lost,
        and how many records that loses (a claim beyond the last row loses every record up
        to it)."""
        old = _excused(ledger, rows)
        bad = {int(d["seq"]) for d in excuses + old if d.get("link") is None}
        valid = [rec for r in rows if int(r[0]) not in bad
                 and (rec := _self_valid(ledger, int(r[0]), r)) is not None]
        claims = self.heads.claims(ledger) + self.runs.claims(ledger, named_run_ledgers(valid))
        unmet = unmet_claims(claims, valid + [{"kind": "repair", "excused": excuses}], 0)
        top = max([int(r[0]) for r in rows], default=0)
        seqs = {c.seq for c in unmet} - bad
        seqs |= set(range(top + 1, max(seqs, default=0) + 1))
        return [{"seq": c.seq, "hash": c.hash, "seen_in": c.where} for c in unmet], len(seqs)

    def repair(self, ledger: str, *, acknowledge_loss: bool, reason: str = "") -> dict | None:
        """Append a ``repair`` record excusing the damage found now (None if none). Refused
        without ``acknowledge_loss``: the damaged records' releases stop being counted."""
        excuses, error = self.damage(ledger)
        if error is None:
            return None
        if not acknowledge_loss:
            raise LedgerError(error)
        self.heads.ensure_writable()
        conn = self._connect()
        cur = conn.cursor()

        def do():
            rows, head = self._rows(cur, ledger)
            excuses2 = [d for d in _damage_list(ledger, rows, head) if d not in _excused(ledger, rows)]
            seq = max([int(head[0]) if head else 0, *[int(r[0]) for r in rows]], default=0) + 1
            good = _last_good(ledger, rows, excuses2)
            lost = [d for d in excuses2 if d.get("link") is None]
            claims, claimed_lost = self._lost_claims(ledger, rows, excuses2)
            rec = {"kind": "repair", "excused": excuses2 + [{"seq": seq, "link": good[1]}],
                   **({"lost": claims} if claims else {}),
                   "records_lost": len(lost) + claimed_lost, "acknowledged_loss": True,
                   "by": f"{getpass.getuser()}@{socket.gethostname()}", "reason": reason,
                   "run_id": None, "run_prev": None,
                   "v": RECORD_VERSION, "ledger": ledger, "seq": seq, "prev": good[1], "time": now()}
            body = canonical(rec)
            h = hashlib.sha256(body.encode("ascii")).hexdigest()
            self._exec(cur, "INSERT INTO llmdp_records (ledger, seq, body, hash) VALUES (?, ?, ?, ?)",
                       (ledger, seq, body, h))
            if head is None:
                self._exec(cur, "INSERT INTO llmdp_heads (ledger, seq, hash) VALUES (?, ?, ?)",
                           (ledger, seq, h))
            else:
                self._exec(cur, "UPDATE llmdp_heads SET seq = ?, hash = ? WHERE ledger = ?",
                           (seq, h, ledger))
            rec["hash"] = h
            return rec

        self._cache.pop(ledger, None)
        if self.pg:
            with conn.transaction():
                cur.execute("SELECT seq FROM llmdp_heads WHERE ledger = %s FOR UPDATE", (ledger,))
                rec = do()
        else:
            self._retry(lambda: cur.execute("BEGIN IMMEDIATE"))
            try:
                rec = do()
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
        self.heads.append(ledger, rec["seq"], rec["hash"])
        self.read(ledger)  # the repaired ledger verifies
        return rec

    def import_jsonl(self, ledger: str, path: str, *, log=print) -> int:
        """Import a legacy JSONL ledger's records into ``ledger``, once per file (an
        ``import`` record names its real path and SHA-256). Returns the releases imported
        (0 if it was imported before)."""
        real = os.path.realpath(path)
        with open(real, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        legacy = Ledger(real)
        records = legacy.records()  # a torn or garbage line stops here, with its line
        if records and not legacy.legacy:
            raise LedgerError(f"{path} is a run's ledger.jsonl (hash-chained records), not a "
                              f"legacy dataset ledger: its records are in the dataset ledger already")
        with self.transaction(ledger) as tx:
            before = [r for r in tx.records if r["kind"] == "import" and r.get("path") == real]
            if before:
                if before[-1].get("sha256") != sha:
                    log(f"warning: the JSONL ledger {real} changed since it was imported into "
                        f"the dataset ledger {ledger!r} on {before[-1].get('time')}; it is not "
                        f"imported again (an earlier llmdp wrote to it since?). Check it by hand.")
                return 0
            releases = [r for r in records if r.get("kind") == "release" and r.get("count")]
            tx.append({"kind": "import", "path": real, "sha256": sha, "lines": len(records),
                       "releases": len(releases)})
            for r in releases:
                tx.append({"kind": "release", "event": r["event"], "count": int(r["count"]),
                           "first_step": r.get("first_step"), "run_id": r.get("run_id"),
                           "attempt": r.get("attempt"), "meta": r.get("meta") or {},
                           **({"extra": r["extra"]} if r.get("extra") is not None else {}),
                           "imported_from": real, "original_time": r.get("time")})
        return len(releases)




def _is_permission(e: Exception) -> bool:
    """An SQLite error that means "not allowed to write or open", not damage."""
    text = str(e).lower()
    return any(w in text for w in ("readonly", "read-only", "unable to open", "permission",
                                   "access permission"))


def _not_writable(location: str) -> str | None:
    """What of an SQLite ledger (the file, its folder, its -wal/-shm files) this process may
    not write, or None (an absent file: its folder is what must be writable)."""
    folder = os.path.dirname(location) or "."
    for path in (location, location + "-wal", location + "-shm"):
        if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            return f"{path} is not writable"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable"
    return None


def _permission_message(location: str | None, why: str) -> str:
    """A ledger that cannot be written for want of permission (read-only LLMDP_HOME or
    file): named as such, with the fix; it is not damaged and nothing was recorded."""
    from llmdp.privacy.ledger.location import default_location

    location = location or default_location()
    which = "LLMDP_HOME" if location == default_location() else "privacy.ledger"
    folder = os.path.dirname(location) or "."
    return (f"{which}: the ledger database {location} cannot be written ({why}): a permission "
            f"problem, not damage; nothing was recorded. Give yourself write access (chmod u+w "
            f"{folder} {location}) or set {which} to a folder you can write")


def _unusable_folder(folder: str, e: OSError) -> str:
    from llmdp.privacy.ledger.location import default_location

    which = ("LLMDP_HOME" if os.path.join(folder, "ledger.sqlite") == default_location()
             else "privacy.ledger")
    why = e.strerror or str(e)
    return (f"{which}: the ledgers' folder {folder} cannot be created or used ({why}); set "
            f"{which} to a folder you can write (it is created if missing), e.g. "
            f"LLMDP_HOME=~/.local/share/llmdp")
