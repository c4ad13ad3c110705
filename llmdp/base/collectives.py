"""The small collectives every stage shares: whether a multi-worker process group is up, and
a few numbers summed over workers (one tiny all-reduce). Training's collectives and the
privatization built on them are `llmdp.train.parallel`; evaluation needs only these."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def dist_on() -> bool:
    """Whether this process is one of several workers of an initialized process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_small(values: Sequence, dtype: torch.dtype, cast, device: torch.device) -> list:
    """``values`` summed over workers in ``dtype`` (one all-reduce), each passed to ``cast``."""
    if not dist_on():
        return [cast(v) for v in values]
    t = torch.tensor(list(values), dtype=dtype, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [cast(v) for v in t.tolist()]


def sum_floats_over_workers(values: Sequence[float], device: torch.device) -> list[float]:
    """Sum a few float64 values over workers (one tiny all-reduce). [sync point]"""
    return sum_small(values, torch.float64, float, device)
