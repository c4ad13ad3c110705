"""Folders built next to their destination and moved into place in one rename, so that a
crash or a concurrent builder never leaves a half-written model, tokenizer or export."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def building_dir(out_dir: str, prefix: str) -> Iterator[str]:
    """A fresh temporary sibling of `out_dir` (the umask's folder mode: 0755 under 022,
    0700 inside `private_files`) to build in; it is removed if the block raises. Move it
    into place with `replace_dir` or `install_dir` inside the block."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        os.chmod(tmp, folder_mode())  # mkdtemp makes it 0700
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(tmp: str, out_dir: str) -> None:
    """`tmp` becomes `out_dir`; whatever was there is removed."""
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def install_dir(tmp: str, out_dir: str, is_current: Callable[[], bool]) -> bool:
    """`tmp` becomes `out_dir` unless a concurrent builder already put a current build there
    (`is_current()`, e.g. its marker's hash): then `tmp` is dropped. A stale build is
    replaced. True if ours was installed."""
    if os.path.isdir(out_dir):
        if is_current():
            shutil.rmtree(tmp)
            return False
        shutil.rmtree(out_dir)
    try:
        os.rename(tmp, out_dir)
    except OSError:  # a concurrent builder renamed first
        if not is_current():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return True


def fsync_dir(folder) -> None:
    """fsync a folder: the names created, renamed or removed in it are on the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write: Callable, text: bool = False) -> None:
    """``write(f)`` into ``path`` as a whole or not at all: a temporary file of its own in the
    same folder (concurrent writers never share one), flushed and fsynced, renamed over
    ``path``, the folder fsynced (the rename is durable). The temporary file is removed if
    anything fails (a full disk leaves no truncated file). ``text``: ``f`` is a UTF-8 text
    file (else binary)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with (os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb")) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(folder)


def sha256_file(path, block: int = 1 << 22) -> str:
    """The hex sha256 of a file's bytes, read a block at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


class RunDirInUse(RuntimeError):
    """A second launch into a run directory that a live launch holds."""


class RunLock:
    """One launch per run directory: an exclusive ``flock`` on ``<dir>/.<name>.lock`` (a
    sibling of the run directory, so that it is taken before anything is written), held
    until `release` or the process's end (the OS drops it when the holder dies). The file
    names its holder (pid, host, time) for the refusal message; a dataset ledger's hold
    names the file, so that a hold whose run died can be told from a live one."""

    def __init__(self, run_dir: str):
        import fcntl
        import json
        import socket
        import time

        run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(os.path.dirname(run_dir), f".{os.path.basename(run_dir)}.lock")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = False
                break
            # A holder may have removed the file (`release(remove=True)`) between our open and
            # our flock: then we hold a lock on a name nobody sees; take the new file instead.
            try:
                held = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
            except FileNotFoundError:
                held = False
            if held:
                break
            os.close(self._fd)
        if not held:
            try:
                holder = json.loads(os.pread(self._fd, 4096, 0).decode() or "{}")
            except ValueError:
                holder = {}
            os.close(self._fd)
            self._fd = None
            raise RunDirInUse(
                f"output.name: {os.path.basename(run_dir)!r} ({run_dir}) is in use by another "
                f"launch (PID {holder.get('pid', '?')} on host {holder.get('host', '?')}, since "
                f"{holder.get('since', '?')}); two launches would interleave checkpoints and "
                f"ledger records. Wait for it to finish (or stop it), or give this run its own "
                f"output.name") from None
        self.info = {"pid": os.getpid(), "host": socket.gethostname(),
                     "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "path": self.path}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(self.info).encode(), 0)
        os.fsync(self._fd)

    def release(self, remove: bool = False) -> None:
        """Drop the lock; ``remove``: also delete the file (a launch refused before it wrote
        anything leaves nothing behind). Removed while still held, so that no other launch
        can hold a lock on the old file then (it re-checks the name after its flock)."""
        if self._fd is not None:
            if remove:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def cache_root() -> str:
    """llmdp's cache folder (tokenized unit stores, legacy JSONL ledgers): ``$LLMDP_CACHE``,
    else ``.cache/llmdp`` under the working directory."""
    return os.path.abspath(os.environ.get("LLMDP_CACHE", ".cache/llmdp"))


# ---- private data at rest (issue 37) -------------------------------------------------------
# Everything llmdp derives from private data (unit stores, run folders, checkpoints, the
# dataset ledger, internal metrics) is created owner-only, whatever the process umask: the
# launch sets this umask for its own lifetime and every worker sets it on start. What is
# meant for publication (an export) is given ordinary permissions explicitly (`publish_tree`).
PRIVATE_UMASK = 0o077  # files 0600, folders 0700
GROUP_UMASK = 0o027  # output.group_readable: files 0640, folders 0750; never world-readable
_user_umask: list[int] = []  # the umask found on entering the outermost `private_files`


def folder_mode() -> int:
    """The mode a new folder gets under the current umask (0755 under 022; 0700 inside
    `private_files`): for folders made by ``mkdtemp`` (always 0700) and then shared."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def private_umask(group_readable: bool = False) -> int:
    return GROUP_UMASK if group_readable else PRIVATE_UMASK


@contextlib.contextmanager
def private_files(group_readable: bool = False) -> Iterator[None]:
    """Within the block, new files and folders are owner-only (group-readable with
    ``group_readable``); the process umask is restored after it."""
    old = os.umask(private_umask(group_readable))
    _user_umask.append(old)
    try:
        yield
    finally:
        _user_umask.pop()
        os.umask(old)


def user_umask() -> int:
    """The umask the user runs llmdp with (outside `private_files`)."""
    if _user_umask:
        return _user_umask[0]
    cur = os.umask(0)
    os.umask(cur)
    return cur


def publish_tree(path: str) -> None:
    """Ordinary permissions for a folder meant for publication (an export): 0777/0666 less
    the user's umask (0755/0644 under the usual 022), whatever it was created with."""
    mask = user_umask()
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o777 & ~mask)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


def too_open(path: str, group_readable: bool = False) -> list[str]:
    """The entries under ``path`` (itself included; not following links) readable, writable
    or searchable by others (or by the group, unless ``group_readable``)."""
    allowed = 0o750 if group_readable else 0o700
    out: list[str] = []
    if not os.path.exists(path):
        return out
    walk = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
    for root, _, files in walk:
        for p in ([root] if os.path.isdir(path) else []) + [os.path.join(root, f) for f in files]:
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                continue
            if not os.path.islink(p) and mode & 0o777 & ~allowed:
                out.append(p)
    return out


def fix_command(paths: list[str], group_readable: bool = False) -> str:
    return f"chmod -R {'g-w,o-rwx' if group_readable else 'go-rwx'} " + " ".join(
        sorted({os.path.abspath(p) for p in paths}))


# ---- a full or failing disk (issue 51) ------------------------------------------------------
# Errors of the disk itself, not of llmdp or of the data: each ends a run with one message that
# names the path, the error and the fix (`StorageError`), never a chained traceback.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
# What every launch needs besides its checkpoints and its model: metrics lines, ledger lines,
# the report and its figure. Small; a check that leaves this much free keeps them writable.
SMALL_FILES_BYTES = 32 * 2**20


class StorageError(RuntimeError):
    """The disk refused a write (full, over quota, read-only, failing) or has no room for the
    next one: one message naming the path, the error and what to do."""


def free_bytes(path: str) -> int:
    """Free bytes (for this user) on the filesystem holding ``path`` (or its nearest existing
    parent: the folder may not exist yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _fix(err: int | None) -> str:
    if err == errno.EROFS:
        return "the filesystem is read-only: remount it writable"
    if err == errno.EIO:
        return "the disk reported an I/O error: check it (e.g. dmesg, fsck)"
    if err == errno.EDQUOT:
        return "the disk quota is exhausted: free space or raise the quota"
    return "free space on that disk"


RESUME_AFTER_FIX = ("then re-run the same command: it resumes from the last intact checkpoint "
                    "and the ledger keeps what ran (or start the run over elsewhere with "
                    "output.dir on a disk with room)")


def check_free(needs: dict[str, int], what: str) -> None:
    """``StorageError`` unless each path's filesystem has room for the bytes asked of it
    (paths on one filesystem add up) and `SMALL_FILES_BYTES` more. ``what``: what the room
    is for, for the message."""
    by_dev: dict[int, tuple[str, int]] = {}
    for path, need in needs.items():
        probe = os.path.abspath(path)
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        dev = os.stat(probe).st_dev
        first, total = by_dev.get(dev, (path, 0))
        by_dev[dev] = (first, total + int(need))
    for path, need in by_dev.values():
        free = free_bytes(path)
        if free < need + SMALL_FILES_BYTES:
            raise StorageError(
                f"not enough free space for {what} in {path}: {_size(free)} free, about "
                f"{_size(need + SMALL_FILES_BYTES)} needed. Free space on that disk; "
                f"{RESUME_AFTER_FIX}")


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The disk's OSError (`STORAGE_ERRNOS`) behind ``exc``: ``exc`` itself, what it was
    raised from or while handling (torch wraps a failed write in a RuntimeError), or a Ray
    Train worker's error (``worker_failures``)."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and (
        e.errno in STORAGE_ERRNOS or "No space left on device" in str(e))), None)


def storage_error(exc: BaseException, what: str, path: str | None = None) -> StorageError | None:
    """One `StorageError` for a failed write behind ``exc`` (None if the disk is not the
    cause): ``what`` was being written, to ``path`` (else the error's own file name)."""
    if isinstance(exc, StorageError):
        return exc
    found = next((e for e in _chain(exc) if isinstance(e, StorageError)), None)
    if found is not None:  # raised by a worker: Ray may wrap it; its message is the first arg
        return StorageError(str(found.args[0])) if found.args else found
    e = os_error_in(exc)
    if e is None:
        return None
    where = e.filename or path or "?"
    why = e.strerror or str(e)
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    return StorageError(f"{what} failed: {where}: {why}{f' ({name})' if name else ''}. "
                        f"{_fix(e.errno).capitalize()}; {RESUME_AFTER_FIX}")


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        todo += list((getattr(e, "worker_failures", None) or {}).values())


@contextlib.contextmanager
def disk_errors(what: str, path: str | None = None) -> Iterator[None]:
    """Within the block, a write the disk refuses (`os_error_in`) becomes one `StorageError`
    naming ``what``, the path, the error and the fix; anything else passes unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unless the disk is the cause
        err = storage_error(e, what, path)
        if err is None:
            raise
        raise err from None
