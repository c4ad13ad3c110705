"""Streaming correlated noise for DP-FTRL by matrix factorization: step t adds row t of
(scale·C)⁻¹Z to the noised sums, from O(state) memory, with z_t the DP-SGD step's noise.

A `Factorization` (``mf``) fixes the strategy C, a lower-triangular Toeplitz matrix. The
mechanism releases scale·C·G + Z and the optimizer sees G + (scale·C)⁻¹Z, so step t adds

    w_t = Σ_{j ≤ t} r_{t−j} z_j,        r = `Factorization.inverse_coefficients`,

where z_t is *exactly* the vector DP-SGD would add at step t: `noise.add_gaussian_` with
the step's key, tensor i's index i, the same std, offset and total (drawn into a zeroed
buffer of the state's dtype), so a shard draws exactly its slice and z_t stays i.i.d.
N(0, std²) per coordinate. `CorrelatedNoise` never forms the T×T matrix nor keeps Z:

* ``"banded"`` (a_k = scale·c_k, b bands): forward substitution, the last b−1 w's kept in
  a ring buffer, O((b−1)·d) state:   w_t = (z_t − Σ_{k=1}^{min(t, b−1)} a_k w_{t−k}) / a_0.
* ``"blt"`` (C⁻¹ has r_0 = 1, r_k = Σ_i ω̂_i θ̂_i^(k−1)): one buffer per θ̂_i, O(n·d) state:
      s_{i,0} = 0,  s_{i,t+1} = θ̂_i s_{i,t} + z_t,   w_t = (z_t + Σ_i ω̂_i s_{i,t}) / scale
  (unrolled, Σ_i ω̂_i s_{i,t} = Σ_{j<t} Σ_i ω̂_i θ̂_i^(t−1−j) z_j = Σ_{j<t} r_{t−j}·scale·z_j).

Everything is elementwise, so the noise of a coordinate depends only on its own z's: the
concatenation of shards' noise is the unsharded noise bit for bit, and a state restored
from `state_dict` continues bit for bit (same device; CPU: same torch thread count, as
`noise.add_gaussian_`). `dense_noise` is the float64 reference (tests).

Cost per coordinate and step (s = the state's itemsize, g = the tensor's; DP-SGD's in-place
draw moves 2g bytes): banded s·(4 + 3(b−1) + 2[a_0 ≠ 1] + 2[b > 1]) + 2g bytes (b = 1,
a_0 = 1, s = g: 2g, the DP-SGD draw itself); BLT s·(6n + 4) + 4g (t ≥ 1). Memory: the state,
n_buf·d·s, plus one temporary of the largest local tensor's numel·s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from llmdp.privacy import noise as dp_noise
from llmdp.privacy import rng
from llmdp.privacy.mf.factorization import Factorization, toeplitz_matrix

__all__ = ["CorrelatedNoise", "dense_noise", "STATE_DTYPES"]

#: The dtypes the streaming state (and z_t) may be kept in.
STATE_DTYPES = (torch.float32, torch.float64)


def _check_target(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in STATE_DTYPES:
        # as noise.add_gaussian_: noise added in bf16/fp16 would be rounded to a coarse grid
        raise TypeError(
            f"{what} is {t.dtype}: correlated noise is drawn and added in float32 or wider "
            "(float32 or float64); keep the clipped sums in float32 "
            "(llmdp.train.strategy.Strategy.grad_sinks)"
        )


class CorrelatedNoise:
    """The streaming state of (scale·C)⁻¹Z for a list of local tensors, and the step t.

    ``shapes[i]``: the shape of local tensor i, the slice ``offsets[i] … offsets[i] +
    numel − 1`` of global noise vector i of length ``totals[i]`` (as `noise.add_noise_`;
    default the whole vector). ``dtype``: the state's (and z_t's) dtype, float32 or
    float64. The state of tensor i is one tensor of shape [n_buf, *shape_i]: banded, the
    ring of the last b−1 w's (slot (t−k) mod (b−1) holds w_{t−k}); BLT, s_1 … s_n. Under
    FSDP it is sharded like the tensor (dim 1 of the state = dim 0 of the tensor).

    `add_` runs step t = 0, 1, …, ``fact.steps − 1`` (the horizon: step ``fact.steps`` is
    refused); `reset` starts a new segment (zero state, t = 0).
    """

    def __init__(self, fact: Factorization, shapes: Sequence[torch.Size], *,
                 offsets: Sequence[int] | None = None, totals: Sequence[int] | None = None,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        if not isinstance(fact, Factorization):
            raise TypeError(f"fact must be a Factorization, got {type(fact).__name__}")
        if dtype not in STATE_DTYPES:
            raise TypeError(f"the correlated-noise state is float32 or float64, got dtype={dtype}")
        self.fact = fact
        self.digest = fact.digest()
        self.dtype = dtype
        self.shapes = [torch.Size(s) for s in shapes]
        n = len(self.shapes)
        numels = [math.prod(s) for s in self.shapes]
        self.offsets = [0] * n if offsets is None else [int(o) for o in offsets]
        self.totals = ([o + m for o, m in zip(self.offsets, numels)] if totals is None
                       else [int(t) for t in totals])
        if len(self.offsets) != n or len(self.totals) != n:
            raise ValueError(f"{n} shapes but {len(self.offsets)} offsets and "
                             f"{len(self.totals)} totals")
        for i, (o, m, tot) in enumerate(zip(self.offsets, numels, self.totals)):
            if o < 0 or tot < o + m:
                raise ValueError(f"tensor {i}: offset {o} + numel {m} must lie in a noise vector "
                                 f"of length total={tot}")
        if fact.kind == "banded":
            a = [fact.scale * c for c in fact.coefficients]  # the scaled coefficients of scale·C
            self._a0, self._a = a[0], a[1:]  # a_0 > 0; a_1 … a_{b−1}
            self.n_buf = len(self._a)
        else:
            self._theta_hat, self._omega_hat = fact.theta_hat, fact.omega_hat
            self.n_buf = len(self._theta_hat)
        self.device = torch.empty(0, device=device).device
        self._state = [torch.zeros((self.n_buf, *s), dtype=dtype, device=self.device)
                       for s in self.shapes]
        self.t = 0

    # ---- what it is
    @property
    def steps(self) -> int:
        """The horizon T: steps 0 … T−1 may be run."""
        return self.fact.steps

    @property
    def nbytes(self) -> int:
        """Bytes of state held: n_buf · Σ_i numel_i · itemsize (n_buf = b−1 or the buffers)."""
        return sum(s.numel() * s.element_size() for s in self._state)

    def reset(self) -> None:
        """A new segment: the state is zero and the next step is t = 0."""
        for s in self._state:
            s.zero_()
        self.t = 0

    # ---- one step
    def add_(self, tensors: Sequence[torch.Tensor], key: bytes, std: float) -> None:
        """Step t: tensors[i] += w_t (tensor i's slice), then t += 1. In place.

        z_t of tensor i = `noise.add_gaussian_` (key, index i, std, offsets[i], totals[i])
        into a zeroed buffer of the state's dtype: bit for bit the DP-SGD step's draw when
        the state's dtype is the tensor's. Banded: w_t = (z_t − Σ_{k=1}^{min(t,b−1)} a_k
        w_{t−k}) / a_0 (summed in that order, in the state's dtype), stored in ring slot
        t mod (b−1), then tensor += w_t (one rounding to the tensor's dtype). BLT:
        tensor += (Σ_i ω̂_i s_{i,t}) / scale (summed in the state's dtype), then z_t is
        drawn, s_{i,t+1} = θ̂_i s_{i,t} + z_t, tensor += z_t / scale (two roundings to the
        tensor's dtype in all, whatever n). A single buffer of one tensor's size is live at
        a time. b = 1 with a_0 = scale·c_0 = 1 and the state's dtype the tensor's draws
        straight into the tensor: bit for bit `noise.add_noise_`.
        """
        tensors = list(tensors)
        if self.t >= self.steps:
            raise RuntimeError(
                f"correlated noise step t={self.t} is past the horizon: the factorization "
                f"(digest {self.digest[:12]}) was built for steps 0..{self.steps - 1} "
                f"(steps={self.steps}); start a new segment (reset) or use a longer one")
        std = dp_noise._check_std(std)
        key = rng.check_key(key)  # before anything is touched
        if len(tensors) != len(self.shapes):
            raise ValueError(f"{len(tensors)} tensors, but the state was built for "
                             f"{len(self.shapes)}")
        for i, x in enumerate(tensors):
            _check_target(x, f"tensor {i}")
            if x.shape != self.shapes[i]:
                raise ValueError(f"tensor {i} has shape {tuple(x.shape)}, the state "
                                 f"{tuple(self.shapes[i])}")
            if x.device != self.device:
                raise ValueError(f"tensor {i} is on {x.device}, the state on {self.device}")
        with torch.no_grad():
            for i, x in enumerate(tensors):
                if self.fact.kind == "banded":
                    self._banded_(i, x, key, std)
                else:
                    self._blt_(i, x, key, std)
        self.t += 1

    def _draw(self, i: int, key: bytes, std: float) -> torch.Tensor:
        """z_t of tensor i: a new zeroed buffer of the state's dtype + its DP-SGD draw."""
        z = torch.zeros(self.shapes[i], dtype=self.dtype, device=self.device)
        return dp_noise.add_gaussian_(z, key, i, std, offset=self.offsets[i], total=self.totals[i])

    def _banded_(self, i: int, x: torch.Tensor, key: bytes, std: float) -> None:
        t, m = self.t, self.n_buf
        if m == 0 and self._a0 == 1.0 and x.dtype == self.dtype:
            # w_t = z_t: the DP-SGD draw itself, added straight in (no buffer). Same
            # values as the general path: 0 + z is exact, then one rounding into x.
            dp_noise.add_gaussian_(x, key, i, std, offset=self.offsets[i], total=self.totals[i])
            return
        w = self._draw(i, key, std)
        ring = self._state[i]
        for k in range(1, min(t, m) + 1):  # w_{t−k} = 0 for k > t
            w.add_(ring[(t - k) % m], alpha=-self._a[k - 1])
        if self._a0 != 1.0:
            w.div_(self._a0)
        if m:
            ring[t % m].copy_(w)  # overwrites w_{t−(b−1)}, used above for the last time
        x.add_(w)

    def _blt_(self, i: int, x: torch.Tensor, key: bytes, std: float) -> None:
        s, inv = self._state[i], 1.0 / self.fact.scale
        if self.t > 0 and self.n_buf:  # s_{i,0} = 0: nothing correlated at t = 0
            acc = torch.mul(s[0], self._omega_hat[0])
            for j in range(1, self.n_buf):
                acc.add_(s[j], alpha=self._omega_hat[j])
            self._add_scaled(x, acc, inv)
            del acc  # one buffer at a time: freed before z_t is drawn
        z = self._draw(i, key, std)
        for j in range(self.n_buf):  # s_j ← θ̂_j s_j + z_t, one pass
            torch.add(z, s[j], alpha=self._theta_hat[j], out=s[j])
        self._add_scaled(x, z, inv)

    @staticmethod
    def _add_scaled(x: torch.Tensor, v: torch.Tensor, alpha: float) -> None:
        """x += alpha·v (x += v when alpha is 1: then exactly DP-SGD's addition)."""
        if alpha == 1.0:
            x.add_(v)
        else:
            x.add_(v, alpha=alpha)

    # ---- checkpoints
    def state_tensors(self) -> list[torch.Tensor]:
        """The live state, one tensor [n_buf, *shape_i] per local tensor i (not copies): for
        a sharded checkpoint, each rank's are the shards of the global [n_buf, *shape]
        state (split along dim 1 as the tensor along dim 0). Loading in place into them
        (e.g. torch.distributed.checkpoint) then `load_state_dict` restores the stream."""
        return list(self._state)

    def state_dict(self) -> dict:
        """{"t", "digest", "kind", "dtype", "totals", "shapes", "buffers"}: the step, the
        factorization's digest, the state's dtype, the global lengths, the local shapes and
        `state_tensors()` (live tensors, as nn.Module.state_dict: clone to keep a copy)."""
        return {"t": self.t, "digest": self.digest, "kind": self.fact.kind,
                "dtype": str(self.dtype).removeprefix("torch."), "totals": list(self.totals),
                "shapes": [list(s) for s in self.shapes], "buffers": self.state_tensors()}

    def load_state_dict(self, d: dict) -> None:
        """Restore a `state_dict`; the next `add_` continues the stream bit for bit. Refused,
        naming what differs, if the factorization's digest, the state's dtype, the number of
        tensors, their global lengths or the buffers' shapes differ, or t is out of range."""
        missing = {"t", "digest", "dtype", "totals", "buffers"} - set(d)
        if missing:
            raise ValueError(f"not a CorrelatedNoise state: missing {sorted(missing)}")
        if d["digest"] != self.digest:
            raise ValueError(f"the state is of factorization {d['digest'][:12]}…, this stream's is "
                             f"{self.digest[:12]}… ({self.fact.kind}, steps={self.steps}): "
                             "another strategy's state would not continue its noise")
        dtype = str(self.dtype).removeprefix("torch.")
        if d["dtype"] != dtype:
            raise ValueError(f"the state was kept in {d['dtype']}, this stream keeps {dtype}")
        bufs = list(d["buffers"])
        if len(bufs) != len(self._state):
            raise ValueError(f"the state has {len(bufs)} tensors, this stream {len(self._state)}")
        if [int(x) for x in d["totals"]] != self.totals:
            raise ValueError(f"the state's noise vectors have lengths (totals) {list(d['totals'])}, "
                             f"this stream's {self.totals}")
        for i, (b, s) in enumerate(zip(bufs, self._state)):
            if not isinstance(b, torch.Tensor) or b.shape != s.shape:
                got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
                raise ValueError(f"state tensor {i} has shape {got}, this stream's is "
                                 f"{tuple(s.shape)} ([n_buf, *shape of tensor {i}])")
            if b.dtype != s.dtype:
                raise ValueError(f"state tensor {i} is {b.dtype}, this stream's {s.dtype}")
        t = d["t"]
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t <= self.steps:
            raise ValueError(f"the state's step t={t!r} is not in 0..{self.steps}")
        for b, s in zip(bufs, self._state):
            if b is not s:
                s.copy_(b)
        self.t = int(t)


def dense_noise(fact: Factorization, z: torch.Tensor) -> torch.Tensor:
    """The reference: (scale·C)⁻¹Z in float64 from the dense T×T Toeplitz matrix of
    ``fact.inverse_coefficients(T)``; ``z`` [T, …] (row t: step t's z, any trailing
    shape), the result [T, …] float64 on the CPU. For tests (O(T²·d))."""
    T = z.shape[0]
    R = toeplitz_matrix(fact.inverse_coefficients(T))
    zz = z.detach().to("cpu", torch.float64).reshape(T, -1).numpy()
    return torch.from_numpy(R @ zz).reshape(z.shape)
