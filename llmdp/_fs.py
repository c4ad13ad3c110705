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
