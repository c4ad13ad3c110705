"""The output file, written so that a crash loses nothing written and a rerun resumes.

Records are appended in index order, each block of lines flushed and fsync'd before the
sidecar ``FILE.progress.json`` (written atomically) counts them. Resuming (`Output.open`):
the sidecar must hold the same settings (anything else is refused: the file would mix two
corpora); the file is cut after its last complete line (a line torn by the crash is
dropped and sampled again) and sampling continues at the first missing index. A record is
a function of (seed, index) only (`llmdp.synthetic.sampling`), so lines written after the
sidecar's last count (a crash between the two writes) are the lines a rerun would write:
they are kept.
"""

from __future__ import annotations

import json
import os

from llmdp._fs import atomic_write, fsync_dir
from llmdp.synthetic.source import GenerateError

SIDECAR = ".progress.json"
VERSION = 1


def sidecar_path(out: str) -> str:
    return out + SIDECAR


class Output:
    def __init__(self, path: str, settings: dict):
        self.path = os.path.abspath(os.fspath(path))
        self.settings = json.loads(json.dumps(settings))
        self.done = 0
        self._f = None

    @property
    def sidecar(self) -> str:
        return sidecar_path(self.path)

    def _write_sidecar(self, complete: bool = False) -> None:
        state = {"llmdp_generate": VERSION, "settings": self.settings, "done": self.done,
                 "complete": complete}
        atomic_write(self.sidecar, lambda f: json.dump(state, f, indent=2, sort_keys=True), text=True)

    def open(self) -> int:
        """Create the file, or check and recover a partial one; returns the first missing index."""
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(self.sidecar):
            try:
                with open(self.sidecar, encoding="utf-8") as f:
                    state = json.load(f)
            except ValueError as e:
                raise GenerateError(f"{self.sidecar}: not valid JSON ({e}); delete it and "
                                    f"{self.path} to generate again from the start") from None
            old = state.get("settings") or {}
            if old != self.settings:
                diff = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
                shown = "; ".join(f"{k}: {_short(old.get(k))} -> {_short(self.settings.get(k))}" for k in diff)
                raise GenerateError(
                    f"--out {self.path}: it was written by `llmdp generate` with other arguments "
                    f"({shown}; recorded in {os.path.basename(self.sidecar)}). A rerun resumes "
                    f"only with the same arguments; choose another --out, or delete {self.path} "
                    f"and {self.sidecar} to start again")
            if not os.path.exists(self.path):
                raise GenerateError(f"{self.sidecar}: its output {self.path} is gone; delete "
                                    f"{self.sidecar} to generate again from the start")
            self.done = self._recover(int(self.settings.get("num_records", 0)))
        elif os.path.exists(self.path):
            raise GenerateError(
                f"--out {self.path}: the file exists and is not a partial `llmdp generate` output "
                f"(no {os.path.basename(self.sidecar)} beside it); choose another --out or delete it")
        else:
            with open(self.path, "wb") as f:
                os.fsync(f.fileno())
            fsync_dir(folder)
            self.done = 0
        self._write_sidecar()
        return self.done

    def _recover(self, limit: int) -> int:
        """Cut the file after its last complete JSON line; how many lines it keeps."""
        with open(self.path, "rb") as f:
            data = f.read()
        keep, n, start = 0, 0, 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            try:
                json.loads(data[start:end].decode("utf-8"))
            except ValueError:
                break
            n, keep, start = n + 1, end + 1, end + 1
        if n > limit:
            raise GenerateError(f"--out {self.path}: it holds {n} records, more than --num-records "
                                f"{limit} of its sidecar; delete it and {self.sidecar} and generate again")
        if keep != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
        return n

    def append(self, lines: list[str]) -> None:
        """Append one block of records (JSON lines, in index order), durably, then count them."""
        if not lines:
            return
        if self._f is None:
            self._f = open(self.path, "ab")
        self._f.write("".join(line + "\n" for line in lines).encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done += len(lines)
        self._write_sidecar()

    def close(self, complete: bool = False) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if complete:
            self._write_sidecar(complete=True)


def _short(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."
