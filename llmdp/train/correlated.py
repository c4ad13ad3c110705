"""A correlated mechanism's noise on one worker: the stream of its tensors (all of them, or
its FSDP shards), bound on the first step, and its segments.

Step t of a segment adds row t of (scale·C)⁻¹Z to the reduced clipped sum, where z_t is
the step's ordinary DP-SGD draw (`llmdp.privacy.mf_stream.CorrelatedNoise`). A *segment*
is one run of the mechanism from a zero state: a run is one segment unless it resumes
after a failure, when the steps after its checkpoint may already have been released by
the attempt that failed (their rows of C·G + Z were published with noise the restored
state would share). A resumed attempt therefore starts a new segment at its first step
(zero state, C restarted at row 0: a fresh, independent mechanism over the rest of the
run), and the ledger counts the rounds it begins again, as it counts DP-SGD's
re-executed steps (`llmdp.privacy.mf_plan`: each segment is accounted as its own
release; their composition is what the ledger composes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmdp.privacy.mf import Factorization
from llmdp.privacy.mf_stream import CorrelatedNoise

__all__ = ["StepNoise"]


class StepNoise:
    """Bound to this worker's tensors on its first `add_` (their shapes, and under FSDP
    their slices of the global noise vectors)."""

    def __init__(self, fact: Factorization):
        self.fact = fact
        self.stream: CorrelatedNoise | None = None

    def new_segment(self) -> None:
        """A fresh mechanism from the next step on (zero state, C from its row 0)."""
        if self.stream is not None:
            self.stream.reset()

    def add_(self, tensors: Sequence[torch.Tensor], key: bytes, std: float,
             offsets: Sequence[int] | None = None, totals: Sequence[int] | None = None) -> None:
        """tensors[i] += this step's row of the correlated noise (std: σ·C of z_t)."""
        if self.stream is None:
            dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
            self.stream = CorrelatedNoise(self.fact, [t.shape for t in tensors], offsets=offsets,
                                          totals=totals, dtype=dtype, device=tensors[0].device)
        self.stream.add_(tensors, key, std)
