"""Book-keeping or two-pass: what each keeps, and how ``mode="auto"`` chooses.

Book-keeping keeps every hooked call's output gradient G (or, for a Linear whose per-unit
gradients may be instantiated, those in float32) until the norms are known, and forms the
clipped sum from what it kept: one backward pass. Two-pass drops G as soon as its norm is
taken and runs the same backward again; each call's G must then be pass 1's bit for bit,
which `norms.fingerprint` checks. ``auto`` picks book-keeping when an upper bound on what it
keeps (`_kept_bytes`) is under half the free memory (`_available_memory`), the same
decision on every rank when the parameters are sharded (the engine's module docstring).
"""

from __future__ import annotations

import os

import torch

from llmdp.clipping.accumulate import _is_dtensor
from llmdp.clipping.norms import Record, _ghost_cheaper
from llmdp.clipping.rules import LinearRule

MODES = ("auto", "book-keeping", "two-pass")


def resolve_mode(mode: str, records: list[Record], num_units: int, params, sharded: bool) -> str:
    """``mode``, or for ``"auto"`` the one that fits: book-keeping if what it keeps for
    ``records`` fits comfortably in the free memory of the parameters' device."""
    if mode != "auto":
        return mode
    # What book-keeping keeps beyond a non-private step, at most: every hooked layer's
    # G, or its float32 per-unit gradients where the layer may be instantiated.
    kept = sum(_kept_bytes(rec, num_units) for rec in records)
    free = _available_memory(params[0].device)
    fits = kept < 0.5 * free
    if sharded:
        # Two-pass runs a second backward, with FSDP2 all-gathers in it: every rank must
        # take the same decision (book-keeping only if it fits on all). [sync point]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            p = next(p for p in params if _is_dtensor(p))
            flag = torch.tensor([0.0 if fits else 1.0], device=p.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=p.device_mesh.get_group())
            fits = bool(flag.item() == 0.0)
    return "book-keeping" if fits else "two-pass"


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _kept_bytes(rec: Record, num_units: int) -> int:
    """An upper bound on what book-keeping keeps for one call until the clipped sum: its
    output gradient G, or, for a Linear whose per-unit gradients may be instantiated
    (U·p·d <= R·T·(p+d), norms._ghost_cheaper), those in float32."""
    if not isinstance(rec.rule, LinearRule) or not rec.A.is_floating_point():
        return rec.out_bytes
    d = rec.A.shape[-1]
    rows = rec.A.shape[0]
    T = rec.A.numel() // max(1, rows * d)
    p = rec.module.weight.shape[1 if rec.rule.transposed else 0]
    if _ghost_cheaper(num_units, rows, T, p, d):  # memory alone forces the ghost norm
        return rec.out_bytes
    return max(rec.out_bytes, 4 * num_units * p * d)
