"""The privacy ledger: an append-only, write-ahead, durable record of every DP release.

Format: JSON lines (`ledger.jsonl`), one object per line. Lines of kind "release" hold
`(event, count)` pairs, the only thing the accountant reads:

    {"kind": "release", "event": <event_to_json>, "count": k, "first_step": s,
     "run_id": ..., "attempt": ..., "time": <ISO 8601 UTC>, "meta": {...}}

Invariant (DESIGN §3.5): a step's event is durable on disk *before* its update is
applied, so a crash can make the ledger over-count, never under-count. To keep that
cheap, a writer reserves blocks of steps: one fsync'ed line per `block_size` steps,
never one line per step. After a crash the unused tail of the last block is counted
although it never ran (over-count, allowed); a resumed run uses a new writer that has
reserved nothing, so steps re-executed after the crash are counted again, which is
correct: the steps run before the crash were real releases.

Durability: every append is one `write` of a whole line under an exclusive `flock`
(so concurrent processes never interleave bytes), then `fsync`; the directory is
fsync'ed when the file (or a directory) is created. A crash mid-write can leave a torn
final line; readers ignore it, and the next append first terminates it with "\\n"
and a "repair" line naming its length, so the fragment stays an isolated, ignored
line while any other unparsable line is reported as corruption.
"""

from __future__ import annotations

import copy
import datetime as _dt
import fcntl
import json
import os
from pathlib import Path

import dp_accounting

from llmdp.privacy.events import event_from_json, event_to_json

__all__ = ["LEDGER_FILENAME", "LedgerError", "Ledger", "LedgerWriter", "append_record"]

LEDGER_FILENAME = "ledger.jsonl"
_REPAIR_KIND = "repair"
_RELEASE_KIND = "release"


class LedgerError(RuntimeError):
    """A ledger that cannot be read or written safely."""


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _encode(record: dict) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON, and a ledger other tools cannot read
    # is not a checkable record. json.dumps escapes newlines, so one record = one line.
    try:
        text = json.dumps(record, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    except (TypeError, ValueError) as e:
        raise LedgerError(f"ledger record is not JSON-serializable: {e}") from e
    return text.encode("ascii") + b"\n"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(directory: Path) -> None:
    """mkdir -p, fsync'ing the parent of every directory created, so a fresh run
    directory survives a power loss together with the ledger inside it."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        _fsync_dir(d.parent)


def _tail_fragment_length(fd: int, size: int) -> int:
    """Bytes after the last b"\\n" of the file (0 if it ends with a newline)."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        pos = chunk.rfind(b"\n")
        if pos >= 0:
            return size - (start + pos + 1)
        end = start
    return size


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _durable_append(path: Path, record: dict | None) -> None:
    """Append `record` (or only repair a torn tail if None) and fsync before returning."""
    payload = (
        b"" if record is None else _encode(record)
    )  # encode first: fail before touching the file
    _make_dirs(path.parent)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # Advisory lock held across read-tail + write + fsync: every llmdp writer takes
        # it, so no two processes interleave partial lines or both repair one tail.
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        torn = _tail_fragment_length(fd, size) if size else 0
        if torn:
            repair = {"kind": _REPAIR_KIND, "torn_bytes": torn, "time": _now()}
            payload = b"\n" + _encode(repair) + payload
        if payload:
            _write_all(fd, payload)
        # fsync, not just flush: the write-ahead promise is about the disk, not the page cache.
        os.fsync(fd)
    finally:
        os.close(fd)  # also releases the flock
    if created:
        # A new file's directory entry is only durable once the directory is synced.
        _fsync_dir(path.parent)


def append_record(path, record: dict) -> None:
    """Durably append one JSON record as one line: lock, write, fsync, then return."""
    if not isinstance(record, dict):
        raise LedgerError(f"a ledger record must be a dict, got {type(record).__name__}")
    _durable_append(Path(path), record)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def release_entries(numbered_records, where: str) -> list[tuple[dp_accounting.DpEvent, int]]:
    """`(event, count)` of the release records among ``numbered_records`` (pairs of a line
    number and a parsed record, e.g. ``enumerate(records, 1)``), consecutive identical events
    merged; an unreadable event stops with ``where`` and its line."""
    out: list[tuple[dp_accounting.DpEvent, int]] = []
    cache: dict[str, dp_accounting.DpEvent] = {}
    for lineno, rec in numbered_records:
        if rec.get("kind") != _RELEASE_KIND or not rec.get("count"):
            continue
        key = json.dumps(rec["event"], sort_keys=True)
        if key not in cache:
            try:
                cache[key] = event_from_json(rec["event"])
            except Exception as e:
                raise LedgerError(f"{where}: line {lineno} has an unreadable event: {e}") from e
        event = cache[key]
        if out and out[-1][0] == event:
            out[-1] = (event, out[-1][1] + int(rec["count"]))
        else:
            out.append((event, int(rec["count"])))
    return out


class Ledger:
    """Read side of a ledger file. A missing file is an empty ledger."""

    def __init__(self, path):
        self.path = Path(path)
        self._torn_lines = 0

    @property
    def torn_lines(self) -> int:
        """Torn fragments (crash mid-write) ignored in the file as it is now."""
        self._numbered_records()
        return self._torn_lines

    def _numbered_records(self) -> list[tuple[int, dict]]:
        # Re-read on every call: the file is small (one line per block of steps) and
        # may be growing while a run is live.
        self._torn_lines = 0
        try:
            with open(self.path, "rb") as f:
                # Shared lock: never read a line a writer is in the middle of appending.
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                data = f.read()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline

        def parse(raw: bytes):
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                return None
            return obj if isinstance(obj, dict) and isinstance(obj.get("kind"), str) else None

        out: list[tuple[int, dict]] = []
        parsed = [None if not raw.strip() else parse(raw) for raw in complete]
        for i, raw in enumerate(complete):
            lineno = i + 1
            if not raw.strip():
                continue
            rec = parsed[i]
            if rec is None:
                nxt = parsed[i + 1] if i + 1 < len(parsed) else None
                if (
                    nxt is not None
                    and nxt.get("kind") == _REPAIR_KIND
                    and nxt.get("torn_bytes") == len(raw)
                ):
                    self._torn_lines += 1  # a torn write, terminated by a later writer
                    continue
                raise LedgerError(
                    f"{self.path}: line {lineno} is not a valid ledger record "
                    f"(corrupt or edited file; first bytes: {raw[:80]!r})"
                )
            self._check(rec, lineno)
            out.append((lineno, rec))
        if tail.strip():
            rec = parse(tail)
            if rec is None:
                self._torn_lines += 1  # crash mid-write: the line was never acknowledged
            else:
                # Whole record, only the newline missing. Counting it can only over-count
                # (allowed), and a later writer's repair turns it into a complete line.
                self._check(rec, len(complete) + 1)
                out.append((len(complete) + 1, rec))
        return out

    def _check(self, rec: dict, lineno: int) -> None:
        if rec["kind"] != _RELEASE_KIND:
            return
        count = rec.get("count")
        if not isinstance(rec.get("event"), dict) or not _is_int(count) or count < 0:
            raise LedgerError(
                f"{self.path}: line {lineno} is a release without a valid event and an integer "
                f"count >= 0 (count={count!r})"
            )

    def records(self) -> list[dict]:
        """All parsed lines, in file order (torn fragments excluded, see `torn_lines`)."""
        return [rec for _, rec in self._numbered_records()]

    def entries(self) -> list[tuple[dp_accounting.DpEvent, int]]:
        """`(event, count)` of all releases, consecutive identical events merged."""
        return release_entries(self._numbered_records(), self.path)

    def delta_threshold(self) -> float:
        """Combined delta of the thresholds of thresholded releases (private tokenizers):
        1 - prod(1 - d_i) over the releases' ``extra["delta_threshold"]``; 0.0 if none.
        Account the ledger with `accountant.epsilon_with_threshold(entries(), delta, this)`."""
        from llmdp.privacy.accountant import threshold_delta

        return threshold_delta(r for r in self.records() if r["kind"] == _RELEASE_KIND)

    def total_count(self, run_id: str | None = None) -> int:
        """Sum of release counts (of one run if `run_id` is given)."""
        return sum(
            rec["count"]
            for rec in self.records()
            if rec["kind"] == _RELEASE_KIND and (run_id is None or rec.get("run_id") == run_id)
        )

    def runs(self) -> list[str]:
        """Run ids with releases, in order of first appearance."""
        seen: dict[str, None] = {}
        for rec in self.records():
            if rec["kind"] == _RELEASE_KIND and rec.get("run_id") is not None:
                seen.setdefault(rec["run_id"], None)
        return list(seen)


class LedgerWriter:
    """Write side for one process / attempt of one run.

    Call `ensure(step, event)` before applying the update of global step `step`
    (0-based). It returns only once that step is durably accounted for.
    """

    def __init__(
        self,
        path,
        *,
        run_id: str,
        attempt: str,
        meta: dict,
        block_size: int,
        total_steps: int,
    ):
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string, got run_id={run_id!r}")
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got block_size={block_size!r}")
        if not _is_int(total_steps) or total_steps < 0:
            raise ValueError(
                f"total_steps must be an integer >= 0, got total_steps={total_steps!r}"
            )
        if not isinstance(meta, dict):
            raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
        _encode({"meta": meta})  # not JSON-able -> fail now, before any training step
        self.path = Path(path)
        self.run_id = run_id
        self.attempt = str(attempt)
        self.meta = copy.deepcopy(meta)
        self.block_size = block_size
        self.total_steps = total_steps
        self._blocks: list[tuple[dp_accounting.DpEvent, int, int]] = []
        self._reserved_until = 0
        # Create the file (and directories) durably and terminate a torn tail left by
        # a crashed predecessor, so our first line starts on a fresh line.
        _durable_append(self.path, None)

    @property
    def reserved_until(self) -> int:
        """End (exclusive) of the last block this writer reserved; 0 before any."""
        return self._reserved_until

    def ensure(self, step: int, event: dp_accounting.DpEvent) -> bool:
        """Make sure global step `step` is durably recorded as `event`; True if a line
        was written (a new block `[step, step + min(block_size, total_steps - step))`)."""
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got step={step!r}")
        if step >= self.total_steps:
            # Refuse rather than silently spend budget the plan never accounted for.
            raise LedgerError(
                f"step {step} is beyond the planned total_steps={self.total_steps}: "
                "the privacy budget covers only the planned steps"
            )
        for ev, start, end in self._blocks:
            if start <= step < end and ev == event:
                return False
        count = min(self.block_size, self.total_steps - step)
        self.append(event, count, first_step=step)
        self._blocks.append((event, step, step + count))
        self._reserved_until = step + count
        return True

    def append(
        self,
        event: dp_accounting.DpEvent | None,
        count: int,
        *,
        first_step: int | None = None,
        kind: str = _RELEASE_KIND,
        extra: dict | None = None,
    ) -> dict:
        """Durably append one record of this run/attempt; returns the record written.

        `extra` (e.g. what a private tokenizer released) is stored under "extra".
        """
        if kind == _RELEASE_KIND:
            if not isinstance(event, dp_accounting.DpEvent):
                raise ValueError(
                    f"a release needs a dp_accounting.DpEvent, got {type(event).__name__}"
                )
            if not _is_int(count) or count < 1:
                raise ValueError(f"count must be an integer >= 1, got count={count!r}")
        if kind == _REPAIR_KIND:
            raise ValueError(f"kind={kind!r} is reserved for torn-tail repairs")
        record = {
            "kind": kind,
            "event": None if event is None else event_to_json(event),
            "count": count,
            "first_step": first_step,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "time": _now(),
            "meta": self.meta,
        }
        if extra is not None:
            record["extra"] = extra
        append_record(self.path, record)
        return record
