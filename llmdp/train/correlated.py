"""A correlated mechanism's noise on one worker: the stream of its tensors (all of them, or
its FSDP shards), its checkpointed state, and its segments.

Step t of a segment adds row t of (scale·C)⁻¹Z to the reduced clipped sum, where z_t is
the step's ordinary DP-SGD draw (`llmdp.privacy.mf.stream.CorrelatedNoise`). A *segment*
is one run of the mechanism from a zero state. The stream's state is part of every
checkpoint (``llmdp.train.strategy``: in ``state.pt``, or under fsdp as DTensors placed
like the parameters, so that DCP reshards it with them), and a resumed attempt either
continues the segment, bit for bit, or starts a new one:

* **continued** when the checkpoint was written by a graceful stop (the first Ctrl-C:
  ``stop_gracefully``, after the ledger service closed that attempt, so it released no
  row after the checkpoint's step) *and* the run's ledger holds no release after the
  checkpoint's ledger position (every attempt's first step records a release before it
  runs, so no attempt ran a step from this state since): no row of the mechanism after
  the checkpoint was ever released, and the resumed run is the one uninterrupted
  mechanism. A stop in the middle of a round leaves that round recorded by the stopped
  attempt and recorded again by the resumed one (one extra round per such resume: an
  over-count, never an under-count).
* **new** otherwise (a crash, a lost node, a budget stop, an older checkpoint format):
  the steps after the checkpoint may already have been released by the attempt that
  failed (their rows of C·G + Z were published with noise the restored state would
  share), so the resumed attempt starts a fresh, independent mechanism at its first
  step (zero state, C restarted at row 0), and the ledger counts the rounds it begins
  again, as it counts DP-SGD's re-executed steps (`llmdp.privacy.mf.plan`: each segment
  is accounted as its own release; their composition is what the ledger composes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmdp.privacy.mf import CorrelatedNoise, Factorization

__all__ = ["StepNoise"]


class StepNoise:
    """This worker's stream: bound by `bind` (the loop does, before resuming, so that a
    checkpoint's state loads into it) or else on the first `add_` (their shapes, and under
    FSDP their slices of the global noise vectors)."""

    def __init__(self, fact: Factorization):
        self.fact = fact
        self.stream: CorrelatedNoise | None = None

    def bind(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device,
             offsets: Sequence[int] | None = None,
             totals: Sequence[int] | None = None) -> CorrelatedNoise:
        """The stream of tensors of these local shapes (slices ``offsets``/``totals`` of
        the global noise vectors, as `noise.add_noise_`), its state zero."""
        self.stream = CorrelatedNoise(self.fact, shapes, offsets=offsets, totals=totals,
                                      dtype=dtype, device=device)
        return self.stream

    def new_segment(self) -> None:
        """A fresh mechanism from the next step on (zero state, C from its row 0)."""
        if self.stream is not None:
            self.stream.reset()

    def add_(self, tensors: Sequence[torch.Tensor], key: bytes, std: float,
             offsets: Sequence[int] | None = None, totals: Sequence[int] | None = None) -> None:
        """tensors[i] += this step's row of the correlated noise (std: σ·C of z_t)."""
        if self.stream is None:
            dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
            self.bind([t.shape for t in tensors], dtype, tensors[0].device, offsets, totals)
        elif offsets is not None and [int(o) for o in offsets] != self.stream.offsets:
            raise ValueError(f"the correlated stream was bound to noise offsets {self.stream.offsets}, "
                             f"this step's tensors lie at {list(offsets)}")
        self.stream.add_(tensors, key, std)


def bound_stream(fact: Factorization, strategy, params: Sequence[torch.Tensor], device) -> StepNoise:
    """A `StepNoise` bound to the tensors ``strategy`` noises at each step (all of
    ``params``, or this rank's shards), in the dtype of their clipped sums (float64 when a
    parameter is float64, else float32), so that a checkpoint's state can load into it."""
    noise = StepNoise(fact)
    shapes, offsets, totals = strategy.noise_layout(params)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    noise.bind(shapes, dtype, device, offsets, totals)
    return noise


def may_continue(meta: dict | None, ledger) -> bool:
    """Whether a resumed attempt may continue the restored segment (module docstring): the
    checkpoint holds the stream's state, was written by a graceful stop, and the run's
    ledger (``ledger``: the ledger service, rank 0's) holds no release after the
    checkpoint's ledger position. Anything it cannot prove gives False (a new segment)."""
    meta = meta or {}
    if meta.get("noise") is None or meta.get("graceful") is not True or ledger is None:
        return False
    return not ledger.released_after(meta.get("ledger"))
