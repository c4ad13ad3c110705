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

__all__ = ["gaussian_like", "add_noise_", "NOISE_TAIL", "truncation_delta_per_step"]

_NOISE_DOMAIN = b"llmdp.gaussian.v1"
_TWO_PI = 2.0 * math.pi
_INV_2_53 = 1.0 / float(2**53)
assert _CHUNK % 2 == 0  # Box-Muller pairs must never straddle two chunks

# The largest |z|/std the generator can return: u1 >= 2**-53, so r = sqrt(-2 ln u1) <=
# sqrt(106 ln 2), reached at k1 = 0 with theta = 0 (k2 = 0: cos = 1).
NOISE_TAIL = math.sqrt(-2.0 * math.log(_INV_2_53))  # ~8.5717


def truncation_delta_per_step(num_coordinates: int, noise_multiplier: float) -> float:
    """An upper bound on the δ that the generator's truncated tail adds to one step.

    Model. Each Box-Muller pair (z_2j, z_2j+1) = R(cos Θ, sin Θ) with R = sqrt(-2 ln U1) and
    U1 >= 2**-53: an exact 2-D Gaussian *conditioned on* ‖pair‖ <= τ = NOISE_TAIL (the
    grid of U1 and Θ and the float arithmetic are not modelled; see gaussian_like). The
    removed mass per pair is P(R > τ) = exp(-τ²/2) = 2**-53 exactly. A vector of d
    coordinates uses k <= d pairs; Z = (1 - 2**-53)**k is the kept mass.

    Neighbouring sums differ by v with ‖v‖ <= C; let a_j be ‖v on pair j‖/(σC), so
    Σ a_j² <= s² with s = 1/σ. On outputs both neighbours can produce, the density ratio is
    the untruncated Gaussian's (both divide by the same Z), so the truncated mechanism is
    (ε, δ_Gauss(ε)/Z + η)-DP, where η bounds the probability of an output the neighbour
    cannot produce: some pair with τ - a_j < ‖z_j‖ <= τ. By the Rayleigh tail
    P(‖z_j‖ > r) = exp(-r²/2), η <= Σ_j h(a_j)/Z with h(a) = exp(-(τ-a)²/2) - exp(-τ²/2).

    Bound on Σ_j h(a_j). h(0) = 0 and h is convex on [0, s] when s <= τ - 1 (h'' =
    ((τ-a)² - 1)·exp(-(τ-a)²/2)). For any a0 in (0, s]: pairs with a_j <= a0 give
    h(a_j) <= a_j·h'(a0) (convexity), and Σ a_j <= sqrt(k)·s (Cauchy-Schwarz); pairs with
    a_j > a0 lie under the chord, h(a_j) <= a_j·h(s)/s, and Σ_{a_j > a0} a_j <= s²/a0. So

        η <= min over a0 of [h'(a0)·sqrt(k)·s + h(s)·s/a0] / Z.

    The single-coordinate figure Φ̄(τ - 1/σ) is the 1-D, one-coordinate case; it is not an
    upper bound for a d-dimensional vector of pairs, hence this one. Over T steps the
    bad events add up (each step's privacy loss equals the Gaussian's outside its bad
    event): δ_total <= δ_accountant/Z**T + T·η. For σ < 1/(τ - 1) ≈ 0.132 the bound is
    vacuous (returns 1.0). Floating-point rounding of the draws (float64, then float32) is
    not covered (see gaussian_like).
    """
    k = int(num_coordinates)
    if k <= 0:
        return 0.0
    tau, s = NOISE_TAIL, 1.0 / float(noise_multiplier)
    if s > tau - 1 or k * _INV_2_53 >= 0.5:
        return 1.0
    z = 1.0 - k * _INV_2_53  # <= (1 - 2**-53)**k

    def h(a):
        return math.exp(-((tau - a) ** 2) / 2) - math.exp(-(tau**2) / 2)

    def dh(a):
        return (tau - a) * math.exp(-((tau - a) ** 2) / 2)

    best = min(
        dh(a0) * math.sqrt(k) * s + h(s) * s / a0
        for a0 in (s * 10 ** (-6 + 6 * i / 400) for i in range(401))
    )
    return min(1.0, best / z)


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
    * the tails are truncated: |z| <= NOISE_TAIL * std, NOISE_TAIL = sqrt(-2 ln 2**-53) =
      sqrt(106 ln 2) ~ 8.5717 (u1 >= 2**-53; the bound is reached at k1 = k2 = 0). The δ
      this adds per step is bounded by :func:`truncation_delta_per_step` (derived there)
      and stated in the privacy report;
    * the draw is computed in float64 and rounded to float32 (``add_noise_`` always adds
      float32 noise to float32 sums, float64 to float64; never bf16/fp16), then rounded
      again when added to the sum. This rounding is not covered by the accountant (nor by
      the δ above).
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
