"""The privatization step (invariants `noise-once` and `precision-never-widens`): the workers'
clipped sums summed and nothing else (one all-reduce, or FSDP2's reduce-scatter), N(0, σ²C²I)
added once over the full trainable vector (or a correlated mechanism's row of (scale·C)⁻¹Z,
``llmdp.train.correlated``), the result divided by the expected batch size q·N, and only then
cast to the parameters' dtype. ``Strategy.privatize`` calls :func:`privatize_` (replicated)
or :func:`privatize_sharded_` (each shard noised with its slice of the one global draw,
:func:`noise_slices`); the collectives come from ``llmdp.train.parallel``, looked up through
the module (the replay, ``llmdp.train.replay``, records them there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from llmdp.base import plants as plant
from llmdp.privacy import noise as dp_noise
from llmdp.train import parallel


def privatize_(
    params: Sequence[torch.Tensor],
    noise_key: bytes,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    sinks: Sequence[torch.Tensor] | None = None,
    correlated=None,
) -> None:
    """All-reduce the clipped sums, add N(0, σ²C²I) once (or, for a correlated mechanism,
    ``correlated``'s row of (scale·C)⁻¹Z built from that draw: `llmdp.train.correlated`),
    divide by q·N. In place on ``p.grad``, or on ``sinks`` (float32 sums of low-precision
    parameters), then cast into ``p.grad``: the only rounding to the parameter dtype happens
    after the noise (DESIGN, invariant `precision-never-widens`)."""
    grads = [p.grad for p in params] if sinks is None else list(sinks)
    for i, g in enumerate(grads):
        if g is None or not g.is_floating_point() or g.dtype.itemsize < 4:
            raise TypeError(
                f"clipped sum {i} is {None if g is None else g.dtype}: clipped sums, their "
                "reduction and the noise must be float32 or wider (DESIGN, invariant `precision-never-widens`); accumulate "
                "low-precision parameters into Strategy.grad_sinks buffers (llmdp.train.strategy)"
            )
    _planted_sum(grads)  # test-only (llmdp.base.plants): nothing unless a test plants a bug
    parallel.all_reduce_(grads)  # [sync point] nothing but summation touches the clipped sum
    noise_multiplier = _planted_noise(noise_multiplier)
    if noise_multiplier > 0 and correlated is not None:
        correlated.add_(grads, noise_key, noise_multiplier * max_grad_norm)
    elif noise_multiplier > 0:
        dp_noise.add_noise_(grads, noise_key, noise_multiplier * max_grad_norm)
    for g in grads:
        g.div_(expected_batch_size)
    if sinks is not None:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)  # the update, cast at the end


def noise_slices(params: Sequence[torch.Tensor]) -> tuple[list[torch.Size], list[int], list[int]]:
    """(local shapes, offsets, totals) of this rank's shards of FSDP2 parameters in their
    global noise vectors: shard i is the slice ``offsets[i] … offsets[i] + numel − 1`` of
    vector i, of length ``totals[i] = params[i].numel()`` (`noise.add_noise_`)."""
    shapes, offsets, totals = [], [], []
    for p in params:
        lo, n, _ = parallel.shard_rows(p)
        rest = math.prod(p.shape[1:])
        shapes.append(torch.Size((n, *p.shape[1:])))
        offsets.append(lo * rest)
        totals.append(p.numel())
    return shapes, offsets, totals


def privatize_sharded_(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    noise_key: bytes,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    correlated=None,
) -> None:
    """FSDP2: reduce-scatter the local clipped sums, noise each shard with its slice of the noise,
    ÷ q·N, and set each sharded parameter's ``.grad``. [sync point, once per step]"""
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            raise TypeError(f"parameter {i} is not an FSDP2 DTensor (type {type(p).__name__})")
        if p.grad is not None:
            raise RuntimeError(
                f"parameter {i} {tuple(p.shape)} already has a gradient before the DP reduction: "
                "something other than the clipping engine produced it (it would be counted "
                "twice). Clear gradients after each optimizer step (zero_grad(set_to_none=True))."
            )
    if not params:
        return
    _planted_sum(buffers)  # test-only (llmdp.base.plants)
    noise_multiplier = _planted_noise(noise_multiplier)
    mesh = params[0].device_mesh
    group, world = mesh.get_group(), mesh.size()
    layouts = [parallel.shard_rows(p) for p in params]
    local: list[torch.Tensor | None] = [None] * len(params)
    # One reduce-scatter per dtype (normally one in all). Send layout: [world, per_rank],
    # rank r's segment holds, parameter after parameter, its ⌈d0/W⌉ rows (zero-padded).
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, b in enumerate(buffers):
        if tuple(b.shape) != tuple(params[i].shape):
            raise ValueError(f"buffer {i} has shape {tuple(b.shape)}, parameter {tuple(params[i].shape)}")
        by_dtype.setdefault(b.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        rest = {i: math.prod(params[i].shape[1:]) for i in idx}
        per_rank = sum(layouts[i][2] * rest[i] for i in idx)
        send = torch.zeros(world, per_rank, dtype=dtype, device=buffers[idx[0]].device)
        off = 0
        for i in idx:
            d0, chunk, r_ = params[i].shape[0], layouts[i][2], rest[i]
            flat = buffers[i].reshape(d0, r_)
            for r in range(world):
                lo, n = parallel.rows_of(d0, chunk, r)
                if n:
                    send[r, off : off + n * r_] = flat[lo : lo + n].reshape(-1)
            off += chunk * r_
        recv = torch.empty(per_rank, dtype=dtype, device=send.device)
        parallel.reduce_scatter_(recv, send.reshape(-1), group)  # [sync point] summation only
        del send
        off = 0
        for i in idx:
            _, n, chunk = layouts[i]
            local[i] = recv[off : off + n * rest[i]].view(n, *params[i].shape[1:])
            off += chunk * rest[i]
    if noise_multiplier > 0:
        # This shard's slice of the one global N(0, σ²C²I): tensor i's noise vector i from
        # the step's noise key, seeked to the shard's first row, so each coordinate gets
        # exactly the draw the replicated strategy adds to it.
        _, offsets, totals = noise_slices(params)
        if correlated is not None:  # this shard's slice of the correlated noise: its own state
            correlated.add_(local, noise_key, noise_multiplier * max_grad_norm, offsets=offsets,
                            totals=totals)
        else:
            dp_noise.add_noise_(local, noise_key, noise_multiplier * max_grad_norm,
                                offsets=offsets, totals=totals)
    for p, g in zip(params, local):
        g.div_(expected_batch_size)
        p.grad = DTensor.from_local(g.to(p.dtype), p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())


def _planted_sum(sums: Sequence[torch.Tensor]) -> None:
    """Test-only planted bug ``bf16-sum`` (``LLMDP_TEST_PLANT``, never a recipe): each clipped
    sum rounded to bfloat16 before the reduction. Nothing otherwise."""
    if plant.on("bf16-sum"):
        for g in sums:
            g.copy_(g.to(torch.bfloat16))


def _planted_noise(noise_multiplier: float) -> float:
    """Test-only planted bug ``noise-off``: σ = 0. The real σ otherwise."""
    return 0.0 if plant.on("noise-off") else noise_multiplier
