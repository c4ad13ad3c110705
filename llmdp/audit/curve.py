"""The one-run f-DP bound on the mechanism's own trade-off curve (issue 35, items 3 and 4).

``fdp`` tests the run against the Gaussian curves G_μ. DP-SGD's curve is not Gaussian: with
Poisson rate q a canary is absent from most steps and stands out sharply in the few it is
sampled in, so its curve is far more powerful than G_μ at small type I error and less at
large. An audit that sees a handful of very confident right guesses then rejects only a small
μ, and μ's ε is a small fraction of the run's. Mahloujifar, Melis and Chaudhuri's guessing
game holds for any trade-off function f (their Algorithm 3 needs only the inverse of f's
blow-up f̄(α) = 1 − f(α)), so this module asks the sharper question: is the run f-DP for the
curve of the mechanism it claims to be,

    f_σ' = the trade-off curve of T Poisson-subsampled Gaussian steps at (q, σ'),

for a noise multiplier σ' (q and T are the run's, from its report)? A larger σ' is a more
private curve (f̄⁻¹ pointwise larger), so the rejected σ' form an interval [σ̂, ∞), found by
bisection. The audit reports σ̂ (the run behaved as if its noise multiplier were below σ̂) and
ε̂ = the ε at the run's δ of DP-SGD at (q, σ̂, T), from the run's own accountant. With a
correct mechanism (the run is f_σ-DP at its own σ) σ ≥ σ̂ with probability ≥ 1 − β, so
ε̂ ≤ ε: ε̂ > ε is a violation at that confidence, and ``rejects_claimed`` says whether σ
itself was rejected.

The curve. dp-accounting's pessimistic privacy loss distribution of the T composed steps
(grid `CURVE_INTERVAL`) is, in each direction (remove / add), a discrete pair (P, Q):
losses l_i with P-probabilities p_i, Q-probabilities p_i·e^{−l_i}, and P-mass p_∞ where
Q is 0. Its hockey-stick divergences are never below the mechanism's (the "pessimistic"
guarantee: δ(ε) is an upper bound for every ε), which is the same as its trade-off curve
never being above the mechanism's (the duality of Dong, Roth and Su, Prop. 2.12). The
Neyman–Pearson tests of Q against P reject for the largest losses: with losses sorted down,
the vertices (α_j, power_j) = (Σ_{i≤j} p_i e^{−l_i}, p_∞ + Σ_{i≤j} p_i) trace the most
powerful test's power against its level, linear in between (randomized tests). The two
directions are the two kinds of guess (remove: "included" on a high score; add:
"excluded" on a low one); the game needs one symmetric f below both, so f̄ here is the upper
concave hull of both vertex sets with (0, 0) and (1, 1) (the concave envelope of the larger
power: a trade-off function below both curves). f̄⁻¹ of that piecewise-linear hull is exact.

Truncation of the Poisson sample and the noise generator's tails move the mechanism away
from this curve by the run's reported δ terms (``delta_noise_tail``; truncated sampling is
accounted on top of it): far below 1/m for any m an audit uses, so they are not modelled.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmdp.audit.estimate import _check_unit, guess_counts
from llmdp.audit.fdp import ideal_scores, rejects_curve

__all__ = ["CURVE_INTERVAL", "Curve", "CurveBound", "audit_curve", "ceiling", "trade_off"]

#: The privacy-loss grid of the tested curves (pessimistic: a coarser grid is a less private
#: curve, so a rejection stays valid; 1e-3 keeps one curve under a second at T ≈ 1000).
CURVE_INTERVAL = 1e-3
#: The noise multipliers searched (from the run's own), and the bisection's relative
#: precision on σ̂ (σ̂ is the rejected end: never above what the data reject).
SIGMA_RANGE = (0.05, 100.0)
_REL_TOL = 5e-3


@dataclass(frozen=True)
class Curve:
    """The blow-up f̄ of a symmetric trade-off curve as the vertices of a concave,
    piecewise-linear map of [0, 1] onto [power[0], 1]: α increasing from 0, power strictly
    increasing up to 1 (the flat end is dropped)."""

    alpha: np.ndarray
    power: np.ndarray

    def __post_init__(self):  # plain lists: `inverse` runs thousands of times per test
        object.__setattr__(self, "_a", self.alpha.tolist())
        object.__setattr__(self, "_p", self.power.tolist())

    def inverse(self, r: float) -> float:
        """f̄⁻¹(r): the smallest type I error with power ≥ r (0 for r ≤ power[0])."""
        a, p = self._a, self._p
        if r <= p[0]:
            return 0.0
        if r >= p[-1]:
            return a[-1]
        i = bisect.bisect_left(p, r)  # p[i-1] < r <= p[i]
        return a[i - 1] + (a[i] - a[i - 1]) * (r - p[i - 1]) / (p[i] - p[i - 1])


def _vertices(pmf) -> tuple[np.ndarray, np.ndarray]:
    """The Neyman–Pearson vertices of one direction's discrete pair (module docstring)."""
    dense = pmf.to_dense_pmf()
    probs = np.asarray(dense._probs, dtype=np.float64)
    losses = (dense._lower_loss + np.arange(probs.size)) * dense._discretization
    keep = probs > 0
    p, loss = probs[keep][::-1], losses[keep][::-1]  # the largest loss first
    alpha = np.concatenate([[0.0], np.cumsum(p * np.exp(-loss))])
    power = dense._infinity_mass + np.concatenate([[0.0], np.cumsum(p)])
    return alpha, power


def _upper_hull(alpha: np.ndarray, power: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The upper concave hull of the points, from (0, the highest power at α = 0) to the
    first point of highest power (Andrew's monotone chain, upper half). Orientation
    tests in float64 (relative rounding ~1e-16, far inside the PLD grid's pessimism) without an
    absolute tolerance: the curve's tail lives at α of 1e-30 and
    below, where a geometry library's tolerance (qhull's) would erase it."""
    order = np.lexsort((-power, alpha))  # α ascending; at equal α the highest power first
    hull: list[tuple[float, float]] = []
    for x, y in zip(alpha[order].tolist(), power[order].tolist()):
        if hull and x == hull[-1][0]:
            continue  # a lower power at the same α
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (y - y1) >= (y2 - y1) * (x - x1):
                hull.pop()  # (x2, y2) is on or below the chord from (x1, y1) to (x, y)
            else:
                break
        hull.append((x, y))
    a, b = np.asarray(hull).T
    top = int(np.argmax(b))  # the first of the highest power: the flat end is dropped
    return a[:top + 1], b[:top + 1]


def trade_off(q: float, sigma: float, steps: int, interval: float = CURVE_INTERVAL) -> Curve:
    """f̄ of T Poisson-subsampled Gaussian steps at (q, σ) (module docstring). Memoized: a
    bisection, and the ceiling's draws, visit the same σ' again and again."""
    if not (0.0 < q <= 1.0) or not sigma > 0.0 or int(steps) < 1:
        raise ValueError(f"need 0 < q <= 1, sigma > 0, steps >= 1; got q={q}, sigma={sigma}, "
                         f"steps={steps}")
    return _trade_off(float(q), float(sigma), int(steps), float(interval))


@functools.lru_cache(maxsize=64)  # each a few hundred kB
def _trade_off(q: float, sigma: float, steps: int, interval: float) -> Curve:
    from dp_accounting.pld import privacy_loss_distribution as pld

    dist = pld.from_gaussian_mechanism(float(sigma), sampling_prob=float(q),
                                       value_discretization_interval=float(interval),
                                       pessimistic_estimate=True)
    if int(steps) > 1:
        dist = dist.self_compose(int(steps))
    points = [_vertices(dist._pmf_remove), _vertices(dist._pmf_add)]
    alpha = np.concatenate([a for a, _ in points] + [np.array([0.0, 1.0])])
    power = np.minimum(np.concatenate([b for _, b in points] + [np.array([0.0, 1.0])]), 1.0)
    return Curve(*_upper_hull(alpha, power))


@dataclass(frozen=True)
class CurveBound:
    """The best bound over the tried (k₊, k₋) settings, each at level β / tried.

    noise_multiplier: σ̂; the run is not f_σ'-DP for any σ' ≥ σ̂ (None: no σ' in
        `SIGMA_RANGE` was rejected).
    epsilon: ε at `delta` of DP-SGD at (q, σ̂, T) (the accountant's PLD); 0.0 without a
        rejection.
    rejects_claimed: the run's own σ was rejected (a violation at `confidence`).
    k, c, k_pos, k_neg: guesses, correct ones and the setting that rejects σ̂ (the first in
    grid order)."""

    noise_multiplier: float | None
    epsilon: float
    rejects_claimed: bool
    delta: float
    confidence: float
    q: float
    steps: int
    m: int
    k: int
    c: int
    k_pos: int
    k_neg: int
    tried: int
    beta_per_try: float


def audit_curve(scores: Any, included: Any, q: float, sigma: float, steps: int, delta: float,
                beta: float = 0.05, ks=None, interval: float = CURVE_INTERVAL) -> CurveBound:
    """The bound from canary `scores` (higher = more likely included) and the truth
    `included`, for a run of `steps` steps at Poisson rate q that claims noise multiplier
    σ, at confidence 1 − β over the settings `ks` (default: m's grid)."""
    from llmdp.privacy.accounting import epsilon_for

    delta = _check_unit("delta", delta, closed_high=False, open_low=True)
    m, level, counts = guess_counts(scores, included, beta, ks)
    curves: dict[float, Curve] = {}

    def rejecting(s: float):
        """The first setting that rejects f_s, or None."""
        if s not in curves:
            curves[s] = trade_off(q, s, steps, interval)
        inv = curves[s].inverse
        return next(((kp, kn, c) for kp, kn, c in counts
                     if rejects_curve(inv, m, kp + kn, c, level)), None)

    def bound(s_hat, hit) -> CurveBound:
        eps = 0.0 if s_hat is None else float(epsilon_for(q, s_hat, int(steps), delta))
        kp, kn, c = hit if hit else (0, 0, 0)
        return CurveBound(s_hat, eps, rejecting(float(sigma)) is not None, delta, 1.0 - beta,
                          float(q), int(steps), m, kp + kn, c, kp, kn, len(counts), level)

    # From the claimed σ: up (doubling) to the first rejected σ', or down (halving) to the
    # first one not rejected when σ itself is; then bisection on the bracket.
    s_min, s_max = SIGMA_RANGE
    s0 = min(max(float(sigma), s_min), s_max)
    hit = rejecting(s0)
    if hit is None:
        lo, hi = s0, min(2.0 * s0, s_max)
        while (hit := rejecting(hi)) is None:
            if hi >= s_max:
                return bound(None, None)
            lo, hi = hi, min(2.0 * hi, s_max)
    else:
        hi, lo = s0, max(s0 / 2.0, s_min)
        while (found := rejecting(lo)) is not None:
            if lo <= s_min:
                return bound(lo, found)
            hi, hit, lo = lo, found, max(lo / 2.0, s_min)
    while hi / lo > 1.0 + _REL_TOL:  # invariant: hi rejected (by `hit`), lo not
        mid = math.sqrt(lo * hi)
        found = rejecting(mid)
        if found is None:
            lo = mid
        else:
            hi, hit = mid, found
    return bound(hi, hit)


def ceiling(q: float, sigma: float, steps: int, m: int, delta: float, beta: float = 0.05,
            draws: int = 5, seed: int = 0) -> CurveBound:
    """The median (by ε) of `audit_curve` over `draws` ideal simulations of the mechanism
    (``fdp.ideal_scores``: gradient canaries scored by the likelihood ratio of every
    iterate) with m canaries: what this estimator can reach on this mechanism."""
    rng = np.random.default_rng(seed)
    bounds = sorted((audit_curve(*ideal_scores(q, sigma, steps, m, rng), q, sigma, steps, delta,
                                 beta) for _ in range(draws)), key=lambda b: b.epsilon)
    return bounds[len(bounds) // 2]
