"""The f-DP one-run lower bound (Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential
Privacy in One Run", ICML 2025, arXiv:2410.22235), for the Gaussian trade-off curves, and the
ceiling an audit of a given mechanism can reach. Pure functions of numbers and arrays.

The set-up is `estimate`'s: m canaries, each included independently with probability 1/2;
from the scores alone the auditor guesses "included" on the k₊ highest, "excluded" on the
k₋ lowest and abstains on the rest; k = k₊ + k₋ guesses are made, c of them correct.

The hypothesis audited: the training algorithm is μ-GDP with respect to each canary, i.e.
f-DP (Dong, Roth and Su 2022) for the Gaussian trade-off curve

    G_μ(α) = Φ(Φ⁻¹(1 − α) − μ):  no test of "included" against "excluded" has type I error
    α and type II error below G_μ(α).

Its blow-up function f̄(x) = 1 − G_μ(x) = Φ(Φ⁻¹(x) + μ) (the largest power at level x) has
the inverse f̄⁻¹(x) = Φ(Φ⁻¹(x) − μ).

The test (the paper's Algorithm 3, "audit with abstention", from its Theorem on guessing
games with a cap on the guesses; alphabet size 2). For a level τ, suppose the hypothesis
held and P[C ≥ c] ≥ τ. Then the expected fractions of the m canaries guessed right and
guessed wrong are bounded below by the recursion

    r_c = τ·c/m,   h_c = τ·(k − c)/m,
    for i = c − 1, …, 0:
        h_i = max(h_{i+1}, f̄⁻¹(r_{i+1}))
        r_i = r_{i+1} + i/(k − i) · (h_i − h_{i+1}),

and since only k guesses are made, r_0 + h_0 ≤ k/m. So r_0 + h_0 > k/m contradicts
"P[C ≥ c] ≥ τ": the observed c has probability < τ under the hypothesis, which is rejected
at level τ. (Once h_i = h_{i+1}, r_i = r_{i+1} and nothing changes further: the loop stops
there, with the same result.)

`mu_lower_bound` is the largest μ the test rejects. Rejection is monotone in μ (a larger μ
makes f̄⁻¹ pointwise smaller, so every h_i and r_i smaller), so it is found by bisection:
the value returned is the lower end of the last bracket, itself rejected. With probability
≥ 1 − τ over the coins, a μ_true-GDP algorithm has μ_true ≥ the returned μ.

`gdp_epsilon` turns μ into ε at the run's δ (the μ-GDP curve's (ε, δ) dual, Dong, Roth and
Su, Corollary 2.13): δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2). Read it as "the run is not
μ̂-GDP; a μ̂-GDP mechanism would be (ε̂, δ)-DP": a statement about the Gaussian curve closest
to DP-SGD's, not a rejection of (ε̂, δ)-DP itself (for that, `estimate.audit_bound`).

`audit_gdp` tries the same (k₊, k₋) grid as `estimate.audit_bound` (fixed by m alone) and
applies the same union bound: each setting at level β / tries.

`ceiling` answers "how close could an audit of this mechanism come": the same estimator on
ideal scores drawn from the mechanism itself. A gradient canary whose per-step contribution
is its clipped gradient, of norm exactly C, along a direction no other unit shares, has per
step the noisy update's projection on that direction, in units of C,

    x_t = b_t + σ·z_t,   b_t ~ Bernoulli(q) if included (0 if excluded), z_t ~ N(0, 1),

(the projections of independent N(0, σ²C²I) noise on a unit vector are independent). Its
score is the log-likelihood ratio of "included" against "excluded" on its own trajectory,

    Σ_t log(1 − q + q·exp((x_t − 1/2)/σ²))      (`lr_scores`),

the Neyman-Pearson statistic for the canary's iterates (the plain sum Σ_t x_t/σ is that
statistic only when the canary is in every step; at the small q of real runs the likelihood
ratio finds far more: `tests/audit/test_fdp.py` measures both). The ceiling is the median
bound over `draws` such simulations of m canaries with fair coins, from a fixed seed
(reproducible; it is a figure of the mechanism, not of the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, special

from llmdp.audit.estimate import _check_beta, _check_counts, _check_unit, guess_counts

__all__ = ["GdpBound", "audit_gdp", "ceiling", "gdp_delta", "gdp_epsilon", "ideal_iterates",
           "ideal_scores", "lr_scores", "mu_lower_bound", "rejects", "rejects_curve"]

# Bisection on μ stops once the bracket is this narrow.
_TOL = 1e-6
# No audit with float64 scores rejects μ-GDP beyond this: Φ⁻¹ of the smallest r is > -40.
_MU_CAP = 80.0


def _inv_blow_up(x: float, mu: float) -> float:
    """f̄⁻¹(x) = Φ(Φ⁻¹(x) − μ) for the μ-GDP curve (0 at x = 0, 1 at x = 1)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    return float(special.ndtr(special.ndtri(x) - mu))


def rejects(mu: float, m: int, k: int, c: int, tau: float) -> bool:
    """True iff c correct guesses out of k (m canaries) reject μ-GDP at level τ: the
    recursion of the paper's Algorithm 3 (module docstring) ends with r_0 + h_0 > k/m."""
    return rejects_curve(lambda x: _inv_blow_up(x, mu), m, k, c, tau)


def rejects_curve(inv_blow_up, m: int, k: int, c: int, tau: float) -> bool:
    """`rejects` for any symmetric trade-off curve f, given by its blow-up's inverse
    f̄⁻¹ (a non-decreasing map of [0, 1] onto [0, 1]; ``llmdp.audit.curve`` passes the
    mechanism's own)."""
    m, k, c = _check_counts(m, k, c)
    if k == 0 or c == 0:
        return False  # P[C >= 0] = 1: nothing is rejected
    r = tau * c / m
    h = tau * (k - c) / m
    for i in range(c - 1, -1, -1):
        h_new = max(h, inv_blow_up(r))
        if h_new == h:
            break  # r and h are fixed from here on
        r, h = r + i / (k - i) * (h_new - h), h_new
    return r + h > k / m


def mu_lower_bound(m: int, k: int, c: int, beta: float = 0.05) -> float:
    """The largest μ (to 1e-6, from below) that `rejects` at level β; 0.0 when μ = 0 (no
    information at all) is not rejected."""
    m, k, c = _check_counts(m, k, c)
    beta = _check_beta(beta)
    if not rejects(0.0, m, k, c, beta):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejects(hi, m, k, c, beta):
        lo, hi = hi, 2.0 * hi
        if hi > _MU_CAP:
            raise RuntimeError(f"no upper end for the μ bracket (m={m}, k={k}, c={c})")
    while hi - lo > _TOL:
        mid = 0.5 * (lo + hi)
        if rejects(mid, m, k, c, beta):
            lo = mid
        else:
            hi = mid
    return lo


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the μ-GDP curve: Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (the second term in
    log space: e^ε overflows long before the product does)."""
    if mu <= 0.0:
        return 0.0
    a = special.log_ndtr(-epsilon / mu + mu / 2.0)
    b = epsilon + special.log_ndtr(-epsilon / mu - mu / 2.0)
    return float(math.exp(a) * -math.expm1(b - a)) if b < a else 0.0


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ δ on the μ-GDP curve (0.0 for μ = 0 or when
    δ(0) ≤ δ already)."""
    delta = _check_unit("delta", delta, closed_high=False, open_low=True)
    if mu <= 0.0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-9))


@dataclass(frozen=True)
class GdpBound:
    """The best f-DP (Gaussian) one-run bound over the tried (k₊, k₋) settings.

    mu_lower_bound: with probability ≥ `confidence` the run is not μ-GDP for any μ below this.
    epsilon: the ε at `delta` of the μ̂-GDP curve (`gdp_epsilon`).
    confidence, m, k (guesses), c (correct), k_pos, k_neg, tried, beta_per_try: as
    `estimate.AuditBound`'s."""

    mu_lower_bound: float
    epsilon: float
    delta: float
    confidence: float
    m: int
    k: int
    c: int
    k_pos: int
    k_neg: int
    tried: int
    beta_per_try: float


def audit_gdp(scores: Any, included: Any, delta: float, beta: float = 0.05,
              ks=None) -> GdpBound:
    """The f-DP one-run bound from canary `scores` (higher = more likely included) and the
    truth `included`, at confidence 1 − β over the settings `ks` (default: m's grid), each
    tested at β / len(ks)."""
    delta = _check_unit("delta", delta, closed_high=False, open_low=True)
    m, level, counts = guess_counts(scores, included, beta, ks)
    best: GdpBound | None = None
    for k_pos, k_neg, c in counts:
        mu = mu_lower_bound(m, k_pos + k_neg, c, level)
        if best is None or mu > best.mu_lower_bound:
            best = GdpBound(mu, gdp_epsilon(mu, delta), delta, 1.0 - beta, m, k_pos + k_neg, c,
                            k_pos, k_neg, len(counts), level)
    assert best is not None
    return best


def ideal_iterates(q: float, sigma: float, steps: int, m: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(x [m, T], included [m]) of m ideal gradient canaries with fair coins (module
    docstring): x_t = b_t + σ z_t, b_t ~ Bernoulli(q) for an included canary, 0 otherwise."""
    if not (0.0 < q <= 1.0) or sigma <= 0.0 or steps < 1 or m < 1:
        raise ValueError(f"need 0 < q <= 1, sigma > 0, steps >= 1, m >= 1; got q={q}, "
                         f"sigma={sigma}, steps={steps}, m={m}")
    included = rng.random(m) < 0.5
    hits = (rng.random((m, steps)) < q) & included[:, None]
    return hits + sigma * rng.standard_normal((m, steps)), included


def lr_scores(x: np.ndarray, q: float, sigma: float) -> np.ndarray:
    """Σ_t log(1 − q + q·exp((x_t − 1/2)/σ²)) per row of x [m, T] (float64; log-sum-exp form:
    no overflow for large x)."""
    x = np.asarray(x, dtype=np.float64)
    z = (x - 0.5) / sigma**2
    return np.logaddexp(np.log1p(-q) if q < 1 else -np.inf, np.log(q) + z).sum(axis=-1)


def ideal_scores(q: float, sigma: float, steps: int, m: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(scores, included): `lr_scores` of `ideal_iterates`."""
    x, included = ideal_iterates(q, sigma, steps, m, rng)
    return lr_scores(x, q, sigma), included


def ceiling(q: float, sigma: float, steps: int, m: int, delta: float, beta: float = 0.05,
            draws: int = 5, seed: int = 0) -> GdpBound:
    """The median (by μ) of `audit_gdp` over `draws` ideal simulations of the mechanism
    (Poisson rate q, noise multiplier σ, T steps) with m canaries: what the f-DP audit can
    reach on this mechanism with perfect scores."""
    rng = np.random.default_rng(seed)
    bounds = sorted((audit_gdp(*ideal_scores(q, sigma, steps, m, rng), delta, beta)
                     for _ in range(draws)), key=lambda b: b.mu_lower_bound)
    return bounds[len(bounds) // 2]
