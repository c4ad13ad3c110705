"""The δ that the noise generator's truncated tails add, folded into the published δ.

The generator (`noise.py`: Box-Muller on a ChaCha20 stream) cannot draw a pair of radius
above τ = NOISE_TAIL: each pair is an exact 2-D Gaussian *conditioned on* ‖pair‖ ≤ τ. What
that costs one release of k noise coordinates at noise multiplier σ (relative to its L2
sensitivity) is bounded by `truncation_delta_per_step(k, σ)` = η, whose docstring states the
argument: the truncated mechanism is (ε, δ_Gauss(ε)/Z + η)-DP with Z >= 1 - k·2**-53 the mass
the truncation keeps. Over a run's noised releases r (its T steps, each of k = the trainable
parameter count, and its DP evaluations) the bad events add and the kept masses multiply:

    δ_total <= δ_accountant / Z_run + η_run,   η_run = Σ_r count_r·η_r,
    Z_run = Π_r Z_r**count_r >= 1 - Σ_r count_r·k_r·2**-53   (Weierstrass),

where δ_accountant is what dp-accounting computes for exact Gaussians. So a run that
publishes (ε, δ) runs its accountant at

    δ_accountant = (δ - η_run)·(1 - Σ_r count_r·k_r·2**-53)

and the tail's share of the published δ is δ - δ_accountant (`NoiseTail.delta`). The
planner calibrates σ at that δ_accountant (it depends on σ through η) and refuses a plan
whose tail is more than MAX_TAIL_FRACTION of δ (`check_noise_tail`). No torch here: the
planner and `llmdp privacy epsilon` import this without paying for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MAX_TAIL_FRACTION",
    "NOISE_TAIL",
    "NoiseTail",
    "noise_tail",
    "truncation_delta_per_step",
]

_INV_2_53 = 1.0 / float(2**53)

# The largest |z|/std the generator can return: u1 >= 2**-53, so r = sqrt(-2 ln u1) <=
# sqrt(106 ln 2), reached at k1 = 0 with theta = 0 (s2 = 0: cos = 1).
NOISE_TAIL = math.sqrt(-2.0 * math.log(_INV_2_53))  # ~8.5717

# The largest share of the published δ the tails may take. Above it the truncation, not the
# Gaussian, is what the guarantee rests on: δ_accountant is cut by more than 10% (ε moves by
# a few percent: ε grows roughly like sqrt(log(1/δ))) and the statement "(ε, δ) of a
# Gaussian mechanism" would be mostly about the generator. Below it the split is a
# bookkeeping detail the report still shows. A plan above it is refused (`check_noise_tail`)
# with its numbers and the fixes (fewer noise coordinates via LoRA, fewer steps, more noise,
# a larger δ).
MAX_TAIL_FRACTION = 0.1


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
    event): δ_total <= δ_accountant/Z**T + T·η (`NoiseTail`). For σ < 1/(τ - 1) ≈ 0.132
    the bound is vacuous (returns 1.0). Floating-point rounding of the draws (float64, then
    float32) is not covered (see gaussian_like).
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


@dataclass(frozen=True)
class NoiseTail:
    """What the truncated tails of a run's noised releases add: ``eta`` = Σ count·η (the
    bad events: T·η for T identical steps) and ``lost_mass`` = Σ count·k·2**-53 (>= 1 - the
    kept mass Z_run). ``parts``: (what, count, coordinates, noise multiplier, count·η) per
    kind of release, for the report."""

    eta: float
    lost_mass: float
    parts: tuple = ()

    def accountant_delta(self, delta: float) -> float:
        """The δ the accountant runs at so that the published δ is ``delta``:
        (δ - η_run)·(1 - lost_mass); <= 0 when the tails alone spend δ (nothing left)."""
        if self.eta >= delta or self.lost_mass >= 1.0:
            return 0.0
        return (float(delta) - self.eta) * (1.0 - self.lost_mass)

    def delta(self, delta: float) -> float:
        """The tails' share of the published ``delta``: δ - δ_accountant."""
        return float(delta) - self.accountant_delta(delta)


def noise_tail(releases: Iterable[tuple[str, int, int, float]]) -> NoiseTail:
    """The `NoiseTail` of noised releases ``(what, count, coordinates, noise_multiplier)``:
    ``count`` releases, each of ``coordinates`` Gaussian coordinates (each coordinate counted
    as a pair of its own: an upper bound on the pairs it uses) at ``noise_multiplier`` relative
    to the release's L2 sensitivity."""
    eta = lost = 0.0
    parts = []
    for what, count, coords, sigma in releases:
        count, coords = int(count), int(coords)
        if count <= 0 or coords <= 0:
            continue
        e = min(1.0, count * truncation_delta_per_step(coords, float(sigma)))
        eta += e
        lost += count * coords * _INV_2_53
        parts.append((what, count, coords, float(sigma), e))
    return NoiseTail(eta=min(1.0, eta), lost_mass=min(1.0, lost), parts=tuple(parts))
