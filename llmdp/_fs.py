"""Folders built next to their destination and moved into place in one rename, so that a
crash or a concurrent builder never leaves a half-written model, tokenizer or export."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def building_dir(out_dir: str, prefix: str) -> Iterator[str]:
    """A fresh temporary sibling of `out_dir` (mode 0755, readable by other processes) to
    build in; it is removed if the block raises. Move it into place with `replace_dir` or
    `install_dir` inside the block."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
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
