"""Ledger records: hash-chained, tamper-evident records of DP releases, and the run's
``ledger.jsonl`` (the human-readable copy of one run's records).

The dataset ledger (every release on one dataset: runs, attempts, private tokenizers) is a
database (`llmdp.privacy.ledger.database`: SQLite in WAL mode by default, PostgreSQL on clusters).
Every record there carries

- ``ledger`` (the dataset id), ``seq`` (1, 2, ... per ledger) and ``prev``: the hash of
  record ``seq - 1`` (`GENESIS` for the first): a hash chain per ledger, so an edited,
  deleted, inserted or garbage record breaks a link and is *detected*;
- ``run_id`` and ``run_prev``: the hash of the same run's previous record (None for its
  first): a chain per run inside the ledger's chain.

A record's hash is the SHA-256 of its canonical JSON (`canonical`: sorted keys, no spaces,
ASCII). A run's ``ledger.jsonl`` holds that run's records exactly as they are in the
dataset ledger, one per line, each with its ``"hash"``; it is written inside the same
database transaction that writes the record (`llmdp.privacy.ledger.service`). Reading it
(`Ledger`) checks every line's hash and the run chain: a torn, garbage, edited or deleted
line stops the reader with a `LedgerError` naming the file, the line and the choices. A
deleted *last* line leaves a valid chain; the dataset ledger (which holds the record) and
the run's checkpoints (which hold the position) catch it (`llmdp.hub.export.verify_run`).
A file rewritten from the dataset ledger (`llmdp privacy ledger repair RUN_DIR`) after a
repair of the dataset ledger lacks the records that repair excused; its own repair line
names each link that skips one (``run_links_excused``: the line before and the missing
hash), and only those links are accepted.

Release records hold ``(event, count)``, the only thing the accountant reads:

    {"kind": "release", "event": <event_to_json>, "count": k, "first_step": s,
     "attempt": ..., "meta": {...}, ...}

Invariant (DESIGN, invariant `write-ahead-ledger`): a step's event is durable *before* its update is applied, so a
crash can make the ledger over-count, never under-count; a writer reserves blocks of steps
(one record per block).

A graceful stop (the first Ctrl-C) ends an attempt inside a block: the steps of that block
that never ran are recorded as *void* by the writer that reserved them, in the transaction
that also takes them out of its reservation, so that no process can run them any more:

    {"kind": "void", "release": <hash of the block's release>, "first_step": s, "steps": k,
     "event": <the release's event>, "meta": <its meta>, "attempt": ..., "reason": ...}

Every count of released steps is *net* of voids (`net_records`): a void takes off the steps of
its release's range ``[first_step, first_step + count)`` that it names, counted once however
many voids name them, and only from a release of the same run among the records read (a void
whose release is not there takes nothing off: reading a subset can over-count, never
under-count). Only a crash (or a second Ctrl-C, which stops at once) leaves reserved steps
charged that never ran.

Ledgers written by llmdp before hash chains (lines without ``"hash"``) are read as
*legacy* files (`Ledger.legacy`): imported once into a dataset ledger
(`llmdp.privacy.ledger.database.LedgerDB.import_jsonl`), never written again.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from llmdp._fs import fsync_dir
from llmdp.config.choices import Mechanism
from llmdp.config.validate import _is_int
from llmdp.privacy import accounting as _acc

if TYPE_CHECKING:
    import dp_accounting

# The accounting (dp-accounting, and the scipy it loads: ~1 CPU-s) is reached through the
# package, at the call: a training worker loads this module (through the run's spec) and
# never reads an event.

__all__ = ["LEDGER_FILENAME", "GENESIS", "LedgerError", "LedgerDamaged", "Ledger", "canonical", "record_hash",
           "append_line", "release_entries", "check_record", "now", "is_step_release",
           "step_count", "EVAL_MECHANISM", "VOID_KIND", "net_records"]

LEDGER_FILENAME = "ledger.jsonl"
GENESIS = "0" * 64
RECORD_VERSION = 2
_RELEASE_KIND = "release"
# What a record may be (anything else is not a record llmdp wrote).
KINDS = ("dataset", "data_version", "release", "hold", "hold_end", "import", "repair", "note",
         "budget", "void")
VOID_KIND = "void"
# A run's releases are its training steps (``meta.mechanism`` a `Mechanism`: "dp-sgd", or
# absent: every run before DP evaluations; "banded-mf" / "blt": a correlated mechanism, whose
# count is of rounds, `llmdp.privacy.mf.plan`) and its DP evaluations ("dp-eval", count 1 each).
EVAL_MECHANISM = "dp-eval"


def is_step_release(rec: dict) -> bool:
    """Whether ``rec`` is a release of training steps or rounds (not a DP evaluation, not a
    tokenizer)."""
    return (rec.get("kind") == _RELEASE_KIND
            and Mechanism.get((rec.get("meta") or {}).get("mechanism", Mechanism.DP_SGD)) is not None)


def _voided_steps(release: dict, voids: list[dict]) -> int:
    """Steps of ``release``'s range that ``voids`` (records naming it) say never ran: the
    union of their ranges inside the release's, so that no step is taken off twice."""
    first, count = release.get("first_step"), int(release.get("count") or 0)
    if not _is_int(first) or count <= 0:
        return 0
    gone: set[int] = set()
    for v in voids:
        a, k = v.get("first_step"), v.get("steps")
        if _is_int(a) and _is_int(k) and k > 0 and v.get("run_id") == release.get("run_id"):
            gone.update(range(max(first, a), min(first + count, a + k)))
    return len(gone)


def net_records(records) -> list[dict]:
    """``records`` with every release's count net of the voids that name it (a copy of that
    release with ``count`` lowered and ``voided``: the steps taken off), void records left
    out. Idempotent: what it returns holds no void any more. Every count of released steps
    and every composition reads records through it (module docstring)."""
    records = list(records)
    voids: dict[str, list[dict]] = {}
    for r in records:
        if r.get("kind") == VOID_KIND and isinstance(r.get("release"), str):
            voids.setdefault(r["release"], []).append(r)
    if not voids:
        return [r for r in records if r.get("kind") != VOID_KIND]
    out = []
    for r in records:
        if r.get("kind") == VOID_KIND:
            continue
        if r.get("kind") == _RELEASE_KIND and r.get("hash") in voids:
            k = _voided_steps(r, voids[r["hash"]])
            if k:
                r = {**r, "count": int(r["count"]) - k, "voided": k}
        out.append(r)
    return out


def step_count(records) -> int:
    """Training steps released by ``records``, net of voids (DP evaluations are not steps)."""
    return sum(int(r.get("count") or 0) for r in net_records(records) if is_step_release(r))


class LedgerError(RuntimeError):
    """A ledger that cannot be read or written safely. The message names the ledger, the
    record and what the user can do; nothing that reads the ledger proceeds past it."""


class LedgerDamaged(LedgerError):
    """A dataset ledger whose records do not verify (as opposed to one that cannot be
    reached)."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def canonical(record: dict) -> str:
    """The one text of a record that its hash is taken over."""
    try:
        return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False)
    except (TypeError, ValueError) as e:
        raise LedgerError(f"ledger record is not JSON-serializable: {e}") from e


def record_hash(record: dict) -> str:
    """SHA-256 (hex) of ``record``'s canonical JSON, without any ``"hash"`` key."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical(body).encode("ascii")).hexdigest()


def check_record(rec) -> str | None:
    """Why ``rec`` is not a well-formed record (None if it is)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("kind") not in KINDS:
        return f"unknown kind {rec.get('kind')!r}"
    if not _is_int(rec.get("seq")) or rec["seq"] < 1:
        return f"seq {rec.get('seq')!r} is not an integer >= 1"
    if not isinstance(rec.get("prev"), str) or len(rec["prev"]) != 64:
        return "no 64-hex 'prev' hash"
    if not isinstance(rec.get("ledger"), str):
        return "no 'ledger' (dataset id)"
    if rec["kind"] == _RELEASE_KIND:
        count = rec.get("count")
        if not isinstance(rec.get("event"), dict) or not _is_int(count) or count < 0:
            return f"a release without a valid event and an integer count >= 0 (count={count!r})"
    if rec["kind"] == VOID_KIND:  # reserved steps that never ran (module docstring)
        a, k = rec.get("first_step"), rec.get("steps")
        if (not isinstance(rec.get("release"), str) or len(rec["release"]) != 64 or not _is_int(a)
                or a < 0 or not _is_int(k) or k < 1 or not isinstance(rec.get("event"), dict)):
            return (f"a void without its release's hash, an integer first_step >= 0, integer "
                    f"steps >= 1 and an event (first_step={a!r}, steps={k!r})")
    if rec["kind"] == "budget":  # the dataset's budget (llmdp.privacy.ledger.budget.DatasetBudget)
        eps, delta = rec.get("epsilon"), rec.get("delta")
        if not (isinstance(eps, (int, float)) and 0 < eps < float("inf")
                and isinstance(delta, (int, float)) and 0 < delta < 1
                and isinstance(rec.get("accountant"), str) and isinstance(rec.get("unit"), dict)):
            return (f"a budget without a finite epsilon > 0, a delta in (0, 1), an accountant "
                    f"and a unit (epsilon={eps!r}, delta={delta!r})")
    return None


def make_dirs(directory) -> None:
    """mkdir -p, fsync'ing the parent of every directory created, so a fresh run
    directory survives a power loss together with the ledger inside it."""
    missing = []
    d = Path(directory)
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def append_line(path, record: dict) -> None:
    """Durably append one record (with its ``"hash"``) as one line: exclusive ``flock``
    (no two processes interleave bytes), one ``write``, ``fsync`` before returning; the
    directory is fsync'ed when the file is created."""
    path = Path(path)
    payload = (canonical(record) + "\n").encode("ascii")  # encode first: fail before writing
    make_dirs(path.parent)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)  # less the umask
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _write_all(fd, payload)
        os.fsync(fd)  # the write-ahead promise is about the disk, not the page cache
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def release_entries(numbered_records, where: str) -> list[tuple[dp_accounting.DpEvent, int]]:
    """`(event, count)` of the release records among ``numbered_records`` (pairs of a number
    and a parsed record, e.g. ``enumerate(records, 1)``), identical events merged into one
    entry (composition is commutative: the order of releases does not change ε), counts net
    of voids (`net_records`); an unreadable event stops with ``where`` and its number."""
    numbered_records = list(numbered_records)
    netted = net_records(rec for _, rec in numbered_records)
    numbers = [n for n, rec in numbered_records if rec.get("kind") != VOID_KIND]
    counts: dict[str, int] = {}
    events: dict[str, dp_accounting.DpEvent] = {}
    for n, rec in zip(numbers, netted):
        if rec.get("kind") != _RELEASE_KIND or not rec.get("count"):
            continue
        key = json.dumps(rec["event"], sort_keys=True)
        if key not in events:
            try:
                events[key] = _acc.event_from_json(rec["event"])
            except Exception as e:
                raise LedgerError(f"{where}: record {n} has an unreadable event: {e}") from e
        counts[key] = counts.get(key, 0) + int(rec["count"])
    return [(events[k], c) for k, c in counts.items()]


RUN_REPAIR_HINT = (
    "The dataset ledger holds this run's records: `llmdp privacy ledger repair {run_dir}` "
    "rewrites ledger.jsonl from it (the damaged file is kept beside it). Nothing that reads "
    "this ledger proceeds until then.")


LEGACY_HINT = (
    "It is a JSONL ledger of an earlier llmdp (no hash-chained records): correct or remove that "
    "line by hand (a torn last line is a write that never completed: its steps never ran), "
    "then import the file again (`llmdp privacy ledger import`). Nothing that reads this "
    "ledger proceeds until then.")


def _old_torn_fragment(raw: bytes, following) -> bool:
    """Whether ``raw`` is a torn fragment that an earlier llmdp's writer terminated: the next
    line is its "repair" record naming the fragment's length (``following``: the next
    (number, bytes, parsed) line, if any)."""
    if not following:
        return False
    nxt = following[0][2]
    return (isinstance(nxt, dict) and nxt.get("kind") == "repair"
            and nxt.get("torn_bytes") == len(raw) and "hash" not in nxt)


class Ledger:
    """Read side of a run's ``ledger.jsonl`` (or a legacy JSONL ledger). A missing file is
    an empty ledger. Every read checks the whole file (it is small: one line per block of
    steps) and raises `LedgerError` on a torn, garbage, edited or unlinked line."""

    def __init__(self, path):
        self.path = Path(path)
        self.legacy = False  # True: written before hash chains (no "hash" on any line)

    def _hint(self) -> str:
        if self.legacy:
            return LEGACY_HINT
        return RUN_REPAIR_HINT.format(run_dir=self.path.parent)

    def _lines(self) -> tuple[list[bytes], bytes]:
        try:
            with open(self.path, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # never read a line being appended
                data = f.read()
        except FileNotFoundError:
            return [], b""
        lines = data.split(b"\n")
        return lines[:-1], lines[-1]

    def _numbered_records(self) -> list[tuple[int, dict]]:
        complete, tail = self._lines()
        lines: list[tuple[int, bytes, object]] = []
        for i, raw in enumerate(complete, 1):
            try:
                rec = json.loads(raw.decode("utf-8")) if raw.strip() else None
            except (UnicodeDecodeError, json.JSONDecodeError):
                rec = None
            lines.append((i, raw, rec))
        objects = [rec for _, _, rec in lines if isinstance(rec, dict)]
        # Written before hash chains: no line has a hash (the messages then say so).
        self.legacy = bool(objects) and all("hash" not in r for r in objects)
        parsed: list[tuple[int, dict]] = []
        for k, (i, raw, rec) in enumerate(lines):
            if rec is None and self.legacy and _old_torn_fragment(raw, lines[k + 1:k + 2]):
                continue  # an earlier llmdp's torn write, terminated by its writer's "repair" line
            if not raw.strip():
                raise LedgerError(f"{self.path}: line {i} is empty (an edited file). {self._hint()}")
            if rec is None:
                raise LedgerError(
                    f"{self.path}: line {i} is not a ledger record (garbage or an edited line; "
                    f"first bytes: {raw[:60]!r}). {self._hint()}")
            if not isinstance(rec, dict):
                raise LedgerError(f"{self.path}: line {i} is not a JSON object. {self._hint()}")
            parsed.append((i, rec))
        if tail:
            raise LedgerError(
                f"{self.path}: the last line (line {len(complete) + 1}: {len(tail)} bytes, no "
                f"newline) is torn: a write that did not complete (a crash while it was written) "
                f"or a truncated file. {self._hint()}")
        if self.legacy:
            return self._legacy(parsed)
        prev_hash = None
        run_id = None
        # Links to records of this run that a repair of the dataset ledger excused (named by
        # the repair that rewrote this file; `llmdp privacy ledger repair RUN_DIR`).
        gaps = {(g.get("after"), g.get("link")) for _, r in parsed if r.get("kind") == "repair"
                for g in (r.get("run_links_excused") or []) if isinstance(g, dict)}
        for i, rec in parsed:
            why = check_record({k: v for k, v in rec.items() if k != "hash"})
            if "hash" not in rec or why:
                raise LedgerError(f"{self.path}: line {i} is not a valid record "
                                  f"({why or 'no hash'}). {self._hint()}")
            if record_hash(rec) != rec["hash"]:
                raise LedgerError(
                    f"{self.path}: line {i} (dataset record {rec.get('seq')}) was edited: its "
                    f"content no longer matches its hash. {self._hint()}")
            if run_id is None:
                run_id = rec.get("run_id")
            if rec.get("run_id") != run_id:
                raise LedgerError(
                    f"{self.path}: line {i} belongs to run {rec.get('run_id')!r}, not "
                    f"{run_id!r} (lines from another run's ledger). {self._hint()}")
            if rec.get("run_prev") != prev_hash and (prev_hash, rec.get("run_prev")) not in gaps:
                what = ("the first line links to an earlier record: the first line(s) were deleted"
                        if prev_hash is None else
                        "it does not link to the line before it: a line was deleted or reordered")
                raise LedgerError(f"{self.path}: line {i} (dataset record {rec.get('seq')}): "
                                  f"{what}. {self._hint()}")
            prev_hash = rec["hash"]
        return parsed

    def _legacy(self, parsed: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
        out = []
        for i, rec in parsed:
            if not isinstance(rec.get("kind"), str):
                raise LedgerError(f"{self.path}: line {i} is not a ledger record (no kind)")
            if rec["kind"] == _RELEASE_KIND:
                count = rec.get("count")
                if not isinstance(rec.get("event"), dict) or not _is_int(count) or count < 0:
                    raise LedgerError(
                        f"{self.path}: line {i} is a release without a valid event and an "
                        f"integer count >= 0 (count={count!r})")
            out.append((i, rec))
        return out

    def records(self) -> list[dict]:
        """Every record, in file order (verified)."""
        return [rec for _, rec in self._numbered_records()]

    def entries(self) -> list[tuple[dp_accounting.DpEvent, int]]:
        """`(event, count)` of all releases (identical events merged)."""
        return release_entries(self._numbered_records(), str(self.path))

    def delta_threshold(self) -> float:
        """Combined delta of the thresholds of thresholded releases (private tokenizers)."""
        return _acc.threshold_delta(r for r in self.records() if r["kind"] == _RELEASE_KIND)

    def total_count(self, run_id: str | None = None) -> int:
        """Sum of release counts, net of voids (of one run if `run_id` is given)."""
        return sum(
            rec["count"]
            for rec in net_records(self.records())
            if rec["kind"] == _RELEASE_KIND and (run_id is None or rec.get("run_id") == run_id)
        )

    def runs(self) -> list[str]:
        """Run ids with releases, in order of first appearance."""
        seen: dict[str, None] = {}
        for rec in self.records():
            if rec["kind"] == _RELEASE_KIND and rec.get("run_id") is not None:
                seen.setdefault(rec["run_id"], None)
        return list(seen)
