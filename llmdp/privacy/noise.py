"""Gaussian noise: the one place it is drawn (DESIGN §3.2, §3.7).

Noise comes from the same keyed SHAKE-256 stream as sampling (`sampling.py`), not from
torch's generator: torch's Mersenne Twister / Philox are statistical PRNGs whose state
can be recovered from outputs, and the DP guarantee needs noise an adversary cannot
predict. Keying by (key, index) also makes every worker, holding the same broadcast
key, produce the *identical* noise vector, so "noise once per logical step" holds
across data-parallel replicas without communicating the noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from llmdp.privacy.sampling import _CHUNK, _uint53_chunks

__all__ = ["gaussian_like", "add_noise_"]

_NOISE_DOMAIN = b"llmdp.gaussian.v1"
_TWO_PI = 2.0 * math.pi
_INV_2_53 = 1.0 / float(2**53)
assert _CHUNK % 2 == 0  # Box-Muller pairs must never straddle two chunks


def _check_std(std) -> float:
    if (
        isinstance(std, bool)
        or not isinstance(std, (int, float, np.floating))
        or not (0 < std < math.inf)
    ):
        # Zero noise would be a silent non-private fallback (DESIGN §3.6).
        raise ValueError(f"std must be a finite number > 0, got std={std!r}")
    return float(std)


def _check_index(index) -> int:
    if (
        isinstance(index, bool)
        or not isinstance(index, (int, np.integer))
        or not (0 <= index < 2**63)
    ):
        raise ValueError(f"index must be an integer in [0, 2**63), got index={index!r}")
    return int(index)


def gaussian_like(
    shape,
    key: bytes,
    index: int,
    std: float,
    dtype: torch.dtype = torch.float32,
    device="cpu",
) -> torch.Tensor:
    """A tensor of i.i.d. N(0, std**2) draws, deterministic given (key, index).

    Method: Box-Muller in float64 on 53-bit uniforms from SHAKE-256 keyed by
    (key, index): u1 = (k1 + 1) * 2**-53 in (0, 1] (so log(u1) is finite),
    u2 = k2 * 2**-53 in [0, 1), and both outputs r*cos(2 pi u2), r*sin(2 pi u2) of each
    pair are used. The result is cast to `dtype` at the end and moved to `device`.

    Known limitations, stated so the report can state them too:
    * this is floating-point Gaussian sampling, not a discrete Gaussian: the output
      lives on a non-uniform float grid, and such artifacts have been exploited
      against floating-point Laplace samplers (Mironov 2012); the accountant assumes
      an exact continuous Gaussian;
    * the tails are truncated at sqrt(2 * 53 * ln 2) ~ 8.57 std (u1 >= 2**-53);
    * casting to float32/bfloat16 rounds each draw, and adding it to a low-precision
      gradient rounds again.
    """
    std = _check_std(std)
    index = _check_index(index)
    shape = torch.Size(shape)
    n = shape.numel()
    out = torch.empty(n, dtype=dtype)
    purpose = _NOISE_DOMAIN + index.to_bytes(8, "big")
    for offset, k in _uint53_chunks(key, purpose, 2 * ((n + 1) // 2)):
        k1, k2 = k[0::2], k[1::2]
        u1 = (k1 + np.uint64(1)) * _INV_2_53
        theta = (k2 * _INV_2_53) * _TWO_PI
        r = np.sqrt(-2.0 * np.log(u1))
        r *= std
        z = np.empty(len(k), dtype=np.float64)
        z[0::2] = r * np.cos(theta)
        z[1::2] = r * np.sin(theta)
        take = min(len(z), n - offset)
        out[offset : offset + take] = torch.from_numpy(z[:take])
    return out.reshape(shape).to(device)


def add_noise_(tensors: Sequence[torch.Tensor], key: bytes, std: float) -> None:
    """Add independent N(0, std**2) noise to each tensor in place (tensor i uses index i).

    Every worker holds the same key, so all replicas add the identical noise vector,
    once per logical step, after the cross-worker sum.
    """
    std = _check_std(std)
    for i, t in enumerate(tensors):
        if not t.is_floating_point() or t.dtype.itemsize < 4:
            # Noise drawn or added in bf16/fp16 would be rounded to a coarse grid (and the
            # clipped sum it is added to already was): DESIGN §3.8.
            raise TypeError(
                f"tensor {i} is {t.dtype}: noise is drawn and added in float32 or wider; "
                "keep the clipped sums in float32 (llmdp.parallel.make_grad_sinks)"
            )
    with torch.no_grad():
        for i, t in enumerate(tensors):
            dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
            t.add_(gaussian_like(t.shape, key, i, std, dtype=dtype, device=t.device))
