"""What the worker loop (``llmdp.train.loop``) needs from Ray Train: its rank, its world,
the checkpoint to resume, and reporting a checkpoint. :class:`RayContext` adapts Ray
Train v2; :class:`LocalContext` does the same in one process without Ray (tests, debug,
the in-process GPU benchmarks), merging the folders the ranks report at one step as Ray
Train does."""

from __future__ import annotations

import os
import shutil
import tempfile

from llmdp.train import parallel

__all__ = ["LocalContext", "RayContext"]


class LocalContext:
    """What the loop needs from Ray Train, for a single process without Ray (tests, debug)."""

    def __init__(self, checkpoint_dir: str | None = None):
        self.checkpoint_dir = checkpoint_dir
        self.reports: list[dict] = []

    def get_world_rank(self) -> int:
        return parallel.world()[0]

    def get_world_size(self) -> int:
        return parallel.world()[1]

    def get_checkpoint_dir(self) -> str | None:
        return self.checkpoint_dir

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        """Like Ray Train: the folders the ranks report at one step become one checkpoint
        folder, which replaces the previous one. [sync point when there are several ranks]"""
        self.reports.append(dict(metrics))
        if not self.checkpoint_dir:
            return
        target = os.path.normpath(self.checkpoint_dir)
        staging = target + ".incoming"
        rank = parallel.world()[0]
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        parallel.barrier()
        if checkpoint_dir:
            shutil.copytree(checkpoint_dir, staging, dirs_exist_ok=True)
        parallel.barrier()
        if rank == 0:
            if os.listdir(staging):
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
            else:
                os.rmdir(staging)
        parallel.barrier()


class RayContext:
    """Adapter from Ray Train v2's API to the few calls the loop makes."""

    def __init__(self):
        import ray.train  # lazy: the loop runs without Ray (tests, LocalContext)

        self._train = ray.train
        self._ctx = ray.train.get_context()
        self._ckpt = ray.train.get_checkpoint()
        self._ckpt_dir = None

    def get_world_rank(self) -> int:
        return self._ctx.get_world_rank()

    def get_world_size(self) -> int:
        return self._ctx.get_world_size()

    def get_checkpoint_dir(self) -> str | None:
        if self._ckpt is None:
            return None
        if self._ckpt_dir is None:
            # Stored on a filesystem this worker sees: read it where it is (an fsdp
            # checkpoint holds every rank's shards; W copies of it would cost W times its
            # size on disk). Elsewhere, a fresh folder per worker: with Ray's default (shared
            # per node) folder, a second worker on the node can find it already created and
            # read a state.pt that the first is still copying.
            local = type(self._ckpt.filesystem).__name__ == "LocalFileSystem" and os.path.isdir(self._ckpt.path)
            self._ckpt_dir = self._ckpt.path if local else self._ckpt.to_directory(
                tempfile.mkdtemp(prefix=f"llmdp-ckpt-rank{self.get_world_rank()}-"))
        return self._ckpt_dir

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        from ray.train import Checkpoint  # lazy: Ray is imported only under Ray

        ckpt = Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        self._train.report(metrics, checkpoint=ckpt)
