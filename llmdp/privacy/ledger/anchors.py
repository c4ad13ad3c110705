"""What the dataset ledgers are checked against outside their database: the head log and
the runs' ``ledger.jsonl`` files (DESIGN, invariant `ledger-not-bypassed`).

The database holds each ledger's records *and* its head (``llmdp_heads``), so whoever can
write the database can delete the last k records and move the head back, or delete a whole
ledger's rows and head, without recomputing a hash: the chain that is left still verifies.
Two copies outside the database make that visible:

- **The head log** (`HeadLog`), ``$LLMDP_HOME/heads/<16 hex of the database>.jsonl`` (one
  per database, `head_log_path`): after every transaction that appended records commits,
  one line ``{"db", "ledger", "seq", "hash", "time"}`` is appended (``seq``: the ledger's
  record count then; ``hash``: its last record's), with ``flock`` and ``fsync``. It is
  written *after* the commit, so a process that dies in between leaves the log one
  transaction behind the database, never ahead of it: every line names a record the
  database committed.
- **The runs' ledger.jsonl files** (`RunFiles`), named by the ``run_ledger`` field of the
  records a run's ledger service writes, each with ``txn``: the seq of the first record its
  transaction appended (the ledger's head + 1 when the transaction began, under its lock).
  A line is written inside its transaction, before the commit, so a crash can leave lines
  whose transaction never committed: the file's last lines. A line whose seq is below a
  *later* line's ``txn`` was committed: that later transaction began with the ledger's head
  past it, and the file's run chain, whose links (``run_prev``) each transaction takes from
  the database, ties that later line back to this one. Only such lines are claims; the
  others prove nothing.

Each such line is a *claim* (ledger, seq, hash). `claim_problems` checks the claims against
the verified ledger: a claim holds when the ledger's record ``seq`` has that hash (the hash
fixes records 1..seq, each holding its predecessor's hash, so one matching claim certifies
the whole prefix), or record ``seq`` is damage a repair excused, or a repair lists the claim
as lost (``repair --acknowledge-loss``: its ``lost`` field). A claim beyond the ledger's
last record: the last records were deleted and the head moved back (or the database was
restored from an older backup); a claim whose record differs: the ledger was rewritten;
claims on a ledger the database lacks: its records and head were deleted.

What this cannot see: tampering by someone who also rewrites the head log *and* the run
ledgers that name the lost records (whoever can write every copy can rewrite history);
records written by processes with another ``$LLMDP_HOME`` (another machine sharing a
PostgreSQL ledger) whose run directories are out of reach; ledgers last written before this
check existed, until their next append.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from llmdp.privacy.ledger.location import describe_location, is_url, llmdp_home
from llmdp.privacy.ledger.records import Ledger, LedgerError, append_line, make_dirs, now

__all__ = ["Claim", "HeadLog", "RunFiles", "head_log_path", "claim_problems", "named_run_ledgers"]


def _db_key(location: str) -> str:
    """The database as head-log lines name it: a SQLite file's absolute path, a URL
    without its password."""
    return describe_location(location) if is_url(location) else os.path.abspath(location)


def head_log_path(location: str, home: str | None = None) -> str:
    """The head log of the database at ``location``, in ``$LLMDP_HOME/heads`` (``home``)."""
    key = _db_key(location)
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return os.path.join(home or llmdp_home(), "heads", f"{digest}.jsonl")


@dataclass(frozen=True)
class Claim:
    """A record that a copy outside the database says was committed."""

    ledger: str
    seq: int
    hash: str
    where: str  # "the head log <path> (line n, <time>)" or "<run ledger> line n"


class HeadLog:
    """The head log of one database: `append` after each commit, `claims` (read
    incrementally: only the bytes appended since the last read are parsed; claims seen once
    are kept, so a log shrunk or rewritten since still counts what it said)."""

    def __init__(self, location: str, path: str | None = None):
        self.db = _db_key(location)
        self.path = path or head_log_path(location)
        self._offset = 0
        self._lines = 0
        self._ino = None
        self._claims: dict[str, dict[tuple[int, str], Claim]] = {}
        self._ready = False

    def ensure_writable(self) -> None:
        """Create the log (and its folder) before the first write transaction, so that a
        log that cannot be written stops a run before a commit, not after."""
        if self._ready:
            return
        try:
            make_dirs(os.path.dirname(self.path))
            with open(self.path, "ab"):
                pass
        except OSError as e:
            raise LedgerError(f"the ledgers' head log {self.path} cannot be written ({e}): every "
                              f"ledger append is anchored there; set LLMDP_HOME to a writable "
                              f"folder") from None
        self._ready = True

    def append(self, ledger: str, seq: int, head_hash: str) -> None:
        """One line: ``ledger`` has ``seq`` records, the last with hash ``head_hash``."""
        try:
            append_line(self.path, {"db": self.db, "ledger": ledger, "seq": int(seq),
                                    "hash": head_hash, "time": now()})
        except OSError as e:
            raise LedgerError(f"the ledger {ledger!r} committed record {seq}, but the head log "
                              f"{self.path} could not be written ({e}); the record counts. Make "
                              f"LLMDP_HOME writable before the next run") from None

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._ino or st.st_size < self._offset:
                    self._offset, self._lines, self._ino = 0, 0, st.st_ino  # replaced or shrunk
                f.seek(self._offset)
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):  # no log yet (or no LLMDP_HOME: said when opening the database)
            return
        end = data.rfind(b"\n") + 1  # a line being appended (no newline yet) is read next time
        for raw in data[:end].split(b"\n")[:-1]:
            self._lines += 1
            try:
                line = json.loads(raw)
                ledger, seq, h = line["ledger"], int(line["seq"]), line["hash"]
            except (ValueError, KeyError, TypeError):
                continue  # a torn write (a crash) or garbage: no claim
            if line.get("db") != self.db or not isinstance(ledger, str) or not isinstance(h, str):
                continue
            where = f"the head log {self.path} (line {self._lines}, {line.get('time')})"
            self._claims.setdefault(ledger, {}).setdefault((seq, h), Claim(ledger, seq, h, where))
        self._offset += end

    def claims(self, ledger: str) -> list[Claim]:
        self._read()
        return list(self._claims.get(ledger, {}).values())

    def ledgers(self) -> set[str]:
        """The ledgers the log names (a ledger deleted from the database is still here)."""
        self._read()
        return set(self._claims)


def named_run_ledgers(records) -> dict[str, set[str]]:
    """{run ledger path: the run ids whose records name it} (a run directory reused by a
    later run names one path for two runs)."""
    out: dict[str, set[str]] = {}
    for r in records:
        path = r.get("run_ledger")
        if isinstance(path, str) and r.get("run_id") is not None:
            out.setdefault(path, set()).add(r["run_id"])
    return out


class RunFiles:
    """The claims of runs' ledger.jsonl files (each file re-read only when it changed).

    A file that is gone (a run directory deleted or moved, another machine's disk), that
    does not verify on its own (its run's problem: `llmdp privacy ledger verify RUN_DIR`),
    that is legacy, or that now holds another run's records proves nothing here."""

    def __init__(self):
        self._cache: dict[str, tuple[tuple, list[dict]]] = {}

    def _records(self, path: str) -> list[dict]:
        try:
            st = os.stat(path)
        except OSError:
            return []
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            ledger = Ledger(path)
            recs = ledger.records()
            recs = [] if ledger.legacy else recs
        except (LedgerError, OSError):
            recs = []
        self._cache[path] = (key, recs)
        return recs

    def claims(self, ledger: str, named: dict[str, set[str]]) -> list[Claim]:
        out: list[Claim] = []
        for path, run_ids in named.items():
            recs = self._records(path)
            if not recs or recs[0].get("run_id") not in run_ids or any(
                    r.get("ledger") != ledger for r in recs):
                continue
            later = 0  # the largest txn of the lines after this one
            for i in range(len(recs), 0, -1):
                r = recs[i - 1]
                if later > int(r["seq"]):  # a later transaction began after it committed
                    out.append(Claim(ledger, int(r["seq"]), r["hash"], f"{path} line {i}"))
                txn = r.get("txn")
                later = max(later, int(txn)) if isinstance(txn, int) else later
        return out


def _excused_seqs(records) -> set[int]:
    """Records a repair excused as damaged (their rows are not what was committed)."""
    return {int(d["seq"]) for r in records if r.get("kind") == "repair"
            for d in (r.get("excused") or []) if d.get("link") is None}


def _lost(records) -> set[tuple[int, str]]:
    """Claims a repair acknowledged as lost."""
    return {(int(d["seq"]), d["hash"]) for r in records if r.get("kind") == "repair"
            for d in (r.get("lost") or []) if isinstance(d, dict) and "seq" in d and "hash" in d}


def unmet_claims(claims, records, head_seq: int) -> list[Claim]:
    """The claims the verified ledger (``records``, its head at ``head_seq``) does not meet."""
    by_seq = {int(r["seq"]): r["hash"] for r in records if "seq" in r}
    excused, lost = _excused_seqs(records), _lost(records)
    return sorted((c for c in claims
                   if (c.seq, c.hash) not in lost and c.seq not in excused
                   and by_seq.get(c.seq) != c.hash),
                  key=lambda c: (c.seq, c.where))


def claim_problems(claims, records, head_seq: int) -> list[str]:
    """What the unmet claims say happened to the ledger (empty: every claim is met)."""
    unmet = unmet_claims(claims, records, head_seq)
    if not unmet:
        return []
    beyond = [c for c in unmet if c.seq > head_seq]
    differ = [c for c in unmet if c.seq <= head_seq]
    out = []
    if beyond:
        top = max(beyond, key=lambda c: c.seq)
        if head_seq == 0:
            out.append(f"{top.where} says record {top.seq} (hash {top.hash[:12]}) was "
                       f"committed, but the database has none of this ledger's records: its "
                       f"records and its head were deleted")
        else:
            out.append(f"{top.where} says record {top.seq} (hash {top.hash[:12]}) was committed, "
                       f"but the ledger ends at record {head_seq}: its last "
                       f"{top.seq - head_seq} record(s) were deleted and its head moved back "
                       f"(or the database was restored from an older backup)")
    if differ:
        low = differ[0]
        out.append(f"its record {low.seq} is not the record {low.where} says was committed "
                   f"(hash {low.hash[:12]}): the ledger was rewritten from record {low.seq} on"
                   + (f" ({len(differ)} such record(s))" if len(differ) > 1 else ""))
    return out
