"""The δ that the noise generator's truncated tails add, folded into the published δ.

The generator (`gaussian.py`: Box-Muller on a ChaCha20 stream) cannot draw a pair of radius
above τ = NOISE_TAIL: its radius uniform u1 is never below 2**-106 (106 random bits), so
each pair is an exact 2-D Gaussian *conditioned on* ‖pair‖ ≤ τ = sqrt(-2 ln 2**-106) ≈
12.12, a truncation that removes TAIL_MASS = 2**-106 of each pair's mass. What that costs
one release of k noise coordinates at noise multiplier σ (relative to its L2 sensitivity)
is bounded by `truncation_delta_per_step(k, σ)` = η, whose docstring states the argument:
the truncated mechanism is (ε, δ_Gauss(ε)/Z + η)-DP with Z >= 1 - k·2**-106 the mass the
truncation keeps. Over a run's noised releases r (its T steps, each of k = the trainable
parameter count, and its DP evaluations) the bad events add and the kept masses multiply:

    δ_total <= δ_accountant / Z_run + η_run,   η_run = Σ_r count_r·η_r,
    Z_run = Π_r Z_r**count_r >= 1 - Σ_r count_r·k_r·2**-106   (Weierstrass),

where δ_accountant is what dp-accounting computes for exact Gaussians. So a run that
publishes (ε, δ) runs its accountant at

    δ_accountant = (δ - η_run)·(1 - Σ_r count_r·k_r·2**-106)

and the tail's share of the published δ is δ - δ_accountant (`NoiseTail.delta`). The
planner calibrates σ at that δ_accountant (it depends on σ through η) and refuses a plan
whose tail is more than MAX_TAIL_FRACTION of δ (`check_noise_tail`). With 106 bits the
tails of 10**5 steps of 10**10 coordinates add at most 2e-12 at σ >= 0.3 and 1e-17 at
σ >= 0.5 (`tests/privacy/noise/test_noise_tail.py`); the shipped recipes' are ~1e-14 of their δ.
With the earlier 53-bit radius uniform (τ ≈ 8.57, 2**-53 per pair) full fine-tuning of a
1B model at δ = 1e-7 (recipes/llama-3.2-1b-full.yaml) spent 42% of δ on them by the bound
below (3.7 δ by the looser one of then) and was refused. No torch here: the planner and
`llmdp privacy epsilon` import this without paying for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MAX_TAIL_FRACTION",
    "NOISE_TAIL",
    "RADIUS_BITS",
    "TAIL_MASS",
    "NoiseTail",
    "noise_tail",
    "truncation_delta_per_step",
]

#: Random bits of the radius uniform u1 (`noise._pairs`): u1 = k1·2**-53 + (k2 + 1)·2**-106
#: with k1, k2 two independent 53-bit integers, so u1 >= 2**-106.
RADIUS_BITS = 106

#: The mass the truncation removes from each Box-Muller pair: P(R > τ) = exp(-τ²/2) = the
#: smallest u1 = 2**-106 (exact in float64).
TAIL_MASS = 2.0**-RADIUS_BITS

#: The largest |z|/std the generator can return: u1 >= 2**-106, so r = sqrt(-2 ln u1) <=
#: sqrt(212 ln 2), reached at k1 = k2 = 0 with θ = 0 (s2 = 0: cos = 1).
NOISE_TAIL = math.sqrt(-2.0 * math.log(TAIL_MASS))  # ~12.1222

# The largest share of the published δ the tails may take. Above it the truncation, not the
# Gaussian, is what the guarantee rests on: δ_accountant is cut by more than 10% (ε moves by
# a few percent: ε grows roughly like sqrt(log(1/δ))) and the statement "(ε, δ) of a
# Gaussian mechanism" would be mostly about the generator. Below it the split is a
# bookkeeping detail the report still shows. A plan above it is refused (`check_noise_tail`)
# with its numbers and the fixes (fewer noise coordinates via LoRA, fewer steps, more noise,
# a larger δ). With the 106-bit radius only a noise multiplier far below any usable one
# (σ ≲ 0.2 at a billion coordinates) gets there.
MAX_TAIL_FRACTION = 0.1

# Evaluating the bound in floating point (exp, expm1, a few products: relative error
# ~1e-15) is covered by this factor, so the returned number is an upper bound as computed.
_ROUNDING_MARGIN = 1.0 + 1e-9
_ROUND_DOWN = 1.0 - 2.0**-50  # exact in float64


def truncation_delta_per_step(num_coordinates: int, noise_multiplier: float) -> float:
    """An upper bound on the δ that the generator's truncated tail adds to one step.

    Model. Each Box-Muller pair (z_2j, z_2j+1) = R(cos Θ, sin Θ) with R = sqrt(-2 ln U1) and
    U1 >= m = TAIL_MASS = 2**-106: an exact 2-D Gaussian *conditioned on* ‖pair‖ <= τ =
    NOISE_TAIL (the grid of U1 and Θ and the float arithmetic are not modelled; see
    gaussian_like). The removed mass per pair is P(R > τ) = exp(-τ²/2) = m. A vector of d
    coordinates uses k <= d pairs (a last, unpaired coordinate is its pair's cos half: the
    pair with a zero-sensitivity sin half released and then dropped, post-processing);
    Z = (1 - m)**k is the kept mass.

    Neighbouring sums differ by v with ‖v‖ <= C; let a_j be ‖v on pair j‖/(σC), so
    Σ a_j² <= s² with s = 1/σ (and each a_j <= s). On outputs both neighbours can produce,
    the density ratio is the untruncated Gaussian's (both divide by the same Z), so the
    truncated mechanism is (ε, δ_Gauss(ε)/Z + η)-DP, where η bounds the probability of an
    output the neighbour cannot produce: some pair with τ - a_j < ‖z_j‖ <= τ. By the
    Rayleigh tail P(‖z_j‖ > r) = exp(-r²/2), η <= Σ_j h(a_j)/Z with

        h(a) = exp(-(τ-a)²/2) - exp(-τ²/2) = m·expm1(a(τ - a/2)).

    Bound on Σ_j h(a_j). Two facts about h (h(0) = 0):
    (i) h is convex on [0, τ-1] (h'' = ((τ-a)² - 1)·exp(-(τ-a)²/2)), so below any
        b <= τ-1 it lies under its chord: h(a) <= a·h(b)/b for 0 <= a <= b; and h(a)/a is
        nondecreasing there.
    (ii) h(a)/a² is nondecreasing where a(τ-a) >= 2: its derivative has the sign of
        a·h'(a) - 2h(a), and a·h'(a) = a(τ-a)·exp(-(τ-a)²/2) >= 2·exp(-(τ-a)²/2) > 2h(a).
        a(τ-a) is concave, >= 2 on [a_lo, τ - a_lo] with a_lo = (τ - sqrt(τ² - 8))/2 ≈ 0.166.
    Require s <= τ - a_lo (σ >= ~0.084; below it the bound is vacuous: 1.0) and let
    b = min(a_lo, s). For any a0 in (0, b], split the pairs:
      small, a_j <= a0:       h(a_j) <= a_j·h(a0)/a0                      (i);
      middle, a0 < a_j <= b:  h(a_j) <= a_j·h(b)/b <= a_j²·h(b)/(b·a0)     (i), a_j > a0;
      large, a_j > b:         h(a_j) <= a_j²·h(s)/s²                      (ii), a_j <= s.
    With x² = the small pairs' Σ a_j² (<= s²), Cauchy-Schwarz gives Σ_small a_j <= sqrt(k)·x
    and the others' Σ a_j² <= s² - x², so with A = sqrt(k)·h(a0)/a0 and
    c = max(h(b)/(b·a0), h(s)/s²):

        Σ_j h(a_j) <= max over x in [0, s] of A·x + c·(s² - x²)
                    = A·s                  if A >= 2cs,
                      A²/(4c) + c·s²       otherwise,

    and η <= the minimum of that over a0 (a grid of a0 in (0, b]; every a0 gives a bound)
    divided by Z. It is within a small factor of the two extreme allocations, which it
    bounds: everything on one pair, h(s) (its 'large' term is exactly that), and spread
    evenly, k·h(s/sqrt(k)) ≈ sqrt(k)·s·τ·m. (An earlier form, h'(a0)·sqrt(k)·s + h(s)·s/a0,
    used the tangent slope h'(a0) >= h(a0)/a0 for the small pairs and a chord for all the
    others; this one is never larger over a0 <= b and is the exact worst case h(s) when
    the sensitivity sits on one pair.)

    The single-coordinate figure Φ̄(τ - 1/σ) is the 1-D, one-coordinate case; it is not an
    upper bound for a d-dimensional vector of pairs, hence this one. Over T steps the bad
    events add up (each step's privacy loss equals the Gaussian's outside its bad event):
    δ_total <= δ_accountant/Z**T + T·η (`NoiseTail`). Floating-point rounding of the draws
    (float64, then float32) is not covered (see gaussian_like).
    """
    k = int(num_coordinates)
    if k <= 0:
        return 0.0
    return _truncation_delta(k, float(noise_multiplier), NOISE_TAIL, TAIL_MASS)


def _truncation_delta(k: int, sigma: float, tau: float, mass: float) -> float:
    """`truncation_delta_per_step` for a generator whose pairs are truncated at radius
    ``tau`` (removed mass ``mass`` = exp(-tau²/2) per pair)."""
    s = 1.0 / sigma
    a_lo = (tau - math.sqrt(tau * tau - 8.0)) / 2.0  # the smaller root of a(τ - a) = 2
    if s > tau - a_lo or k * mass >= 0.5:
        return 1.0
    z = 1.0 - k * mass  # <= (1 - mass)**k

    def h(a):
        return mass * math.expm1(a * (tau - a / 2.0))

    b = min(a_lo, s)
    hs_s2 = h(s) / (s * s)
    hb_b = h(b) / b
    root_k = math.sqrt(k)
    best = math.inf
    for i in range(401):
        a0 = b * 10.0 ** (-8.0 + 8.0 * i / 400)
        big_a = root_k * h(a0) / a0
        c = max(hb_b / a0, hs_s2)
        val = big_a * s if big_a >= 2.0 * c * s else big_a * big_a / (4.0 * c) + c * s * s
        best = min(best, val)
    return min(1.0, best / z * _ROUNDING_MARGIN)


@dataclass(frozen=True)
class NoiseTail:
    """What the truncated tails of a run's noised releases add: ``eta`` = Σ count·η (the
    bad events: T·η for T identical steps) and ``lost_mass`` = Σ count·k·2**-106 (>= 1 - the
    kept mass Z_run). ``parts``: (what, count, coordinates, noise multiplier, count·η) per
    kind of release, for the report."""

    eta: float
    lost_mass: float
    parts: tuple = ()

    def accountant_delta(self, delta: float) -> float:
        """The δ the accountant runs at so that the published δ is ``delta``:
        (δ - η_run)·(1 - lost_mass), rounded down; <= 0 when the tails alone spend δ
        (nothing left). Rounded down: the four float64 roundings (the difference, 1 - lost,
        the product and the factor) are each within 2**-53 relative, so the factor
        1 - 2**-50 = 1 - 8·2**-53 keeps the result below the exact value; it matters when the tails are below δ's last bit (a 106-bit generator's
        usually are), where the plain expression would round back to δ itself."""
        if self.eta >= delta or self.lost_mass >= 1.0:
            return 0.0
        return (float(delta) - self.eta) * (1.0 - self.lost_mass) * _ROUND_DOWN

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
        lost += count * coords * TAIL_MASS
        parts.append((what, count, coords, float(sigma), e))
    return NoiseTail(eta=min(1.0, eta), lost_mass=min(1.0, lost), parts=tuple(parts))
