"""The f-DP one-run bound on the mechanism's own trade-off curve (llmdp.audit.curve).

References, independent of the production code: the exact Neyman–Pearson curves of one
Poisson-subsampled Gaussian step (closed form, both directions), the likelihood-ratio test
of T steps simulated by Monte Carlo, the Gaussian curve G_μ of the paper's Algorithm 3
(``fdp.rejects``, itself checked against the transcribed algorithm in test_fdp.py), and
dp-accounting's PLD accountant called directly for ε.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

from llmdp.audit import curve, fdp
from llmdp.audit.estimate import default_settings, guesses


def exact_one_step(q: float, sigma: float, t: np.ndarray):
    """(α, power) of both directions' most powerful tests of one step, thresholds t:
    "included" on x > t (null N(0, σ²), alternative (1−q)N(0, σ²) + qN(1, σ²)) and
    "excluded" on x < t (null the mixture, alternative N(0, σ²))."""
    a_in = special.ndtr(-t / sigma)
    p_in = (1 - q) * a_in + q * special.ndtr((1 - t) / sigma)
    p_ex = special.ndtr(t / sigma)
    a_ex = (1 - q) * p_ex + q * special.ndtr((t - 1) / sigma)
    return (a_in, p_in), (a_ex, p_ex)


def blow_up(c: curve.Curve, alpha: np.ndarray) -> np.ndarray:
    return np.interp(alpha, c.alpha, c.power, right=1.0)


@pytest.mark.parametrize("q,sigma", [(0.05, 0.8), (1.0, 1.5), (0.3, 0.5)])
def test_one_step_curve_is_never_below_the_exact_one_and_close_to_it(q, sigma):
    """The curve tested is the concave envelope of both directions' power: never below the
    exact power of either (else a correct mechanism could be rejected too often), and within
    the PLD grid's pessimism of the larger one."""
    c = curve.trade_off(q, sigma, 1)
    t = np.linspace(-6 * sigma, 1 + 6 * sigma, 4001)
    worst = 0.0
    for a, p in exact_one_step(q, sigma, t):
        fb = blow_up(c, a)
        assert (fb >= p - 1e-12).all(), float((p - fb).max())
        worst = max(worst, float((fb - p).min()))
    # the larger of the two exact powers at each α, against the hull
    grid = np.linspace(0, 1, 2001)
    (a1, p1), (a2, p2) = exact_one_step(q, sigma, t)
    top = np.maximum(np.interp(grid, a1[::-1], p1[::-1]), np.interp(grid, a2, p2))
    gap = blow_up(c, grid) - top
    assert gap.min() >= -1e-3  # (the exact curves are sampled: interpolation error)
    # the envelope of the two bridges where they cross (a few hundredths at most); in the
    # tail that audits read (α ≤ 1e-3) it is the larger curve itself, to the grid's pessimism
    assert gap.max() <= 0.05, float(gap.max())
    tail = np.logspace(-12, -3, 200)
    top_tail = np.maximum(np.interp(tail, a1[::-1], p1[::-1]), np.interp(tail, a2, p2))
    assert (blow_up(c, tail) - top_tail <= 0.02 * top_tail + 1e-12).all()
    # a concave, increasing map onto [p0, 1]
    assert (np.diff(c.power) > 0).all() and (np.diff(c.alpha) > 0).all()
    slopes = np.diff(c.power) / np.diff(c.alpha)
    assert (np.diff(slopes) <= 1e-9 * slopes[:-1]).all()
    assert c.power[-1] == pytest.approx(1.0, abs=1e-9)


def test_the_composed_curve_bounds_the_likelihood_ratio_test_of_every_iterate():
    """T steps: the most powerful test of "included" is the likelihood ratio of the canary's
    T projections (``fdp.lr_scores``). Monte Carlo of that test under both hypotheses: its
    power at each level is never above the curve (beyond sampling error)."""
    q, sigma, steps, n = 0.1, 0.7, 8, 200_000
    rng = np.random.default_rng(3)
    null = fdp.lr_scores(sigma * rng.standard_normal((n, steps)), q, sigma)
    alt = fdp.lr_scores((rng.random((n, steps)) < q) + sigma * rng.standard_normal((n, steps)), q, sigma)
    c = curve.trade_off(q, sigma, steps)
    for level in (1e-3, 3e-3, 1e-2, 0.05, 0.2, 0.5):
        thr = np.quantile(null, 1 - level)
        a, p = float((null > thr).mean()), float((alt > thr).mean())
        se = math.sqrt(p * (1 - p) / n) + 1e-5
        assert p <= blow_up(c, np.array([a]))[0] + 4 * se, (level, a, p)
    # and it is not loose: at 1% the Monte Carlo power is within 0.05 of the curve
    thr = np.quantile(null, 0.99)
    assert blow_up(c, np.array([(null > thr).mean()]))[0] - (alt > thr).mean() < 0.05


def test_the_recursion_on_a_sampled_gaussian_curve_is_the_papers_on_g_mu():
    """`rejects_curve` with the μ-GDP blow-up tabulated as a Curve decides as `fdp.rejects`
    (the transcription of Algorithm 3) except within the tabulation's error."""
    mu = 1.3
    x = np.concatenate([[0.0], np.logspace(-14, 0, 40001)])
    pw = special.ndtr(special.ndtri(np.clip(x, 1e-300, 1)) + mu)
    pw[0] = 0.0
    c = curve.Curve(x, np.maximum.accumulate(pw))
    same = 0
    for m, k, cc in [(1000, 100, 95), (1000, 50, 50), (500, 40, 30), (2000, 400, 330), (100, 10, 10)]:
        for tau in (0.01, 0.05):
            assert fdp.rejects_curve(c.inverse, m, k, cc, tau) == fdp.rejects(mu, m, k, cc, tau)
            same += 1
    assert same == 10


def test_a_less_noisy_curve_is_less_private_everywhere():
    """f̄ grows as σ' falls: the rejected σ' are an interval [σ̂, ∞), which bisection finds."""
    grid = np.logspace(-8, 0, 500)
    curves = [blow_up(curve.trade_off(0.05, s, 20), grid) for s in (0.6, 0.9, 1.4)]
    assert (curves[0] >= curves[1] - 1e-9).all() and (curves[1] >= curves[2] - 1e-9).all()
    assert (curves[0] - curves[2]).max() > 0.1


def _claimed_rejections(q, sigma, steps, m, draws, beta, true_sigma, seed):
    rng = np.random.default_rng(seed)
    c = curve.trade_off(q, sigma, steps)
    settings = default_settings(m)
    level = beta / len(settings)
    hits = 0
    for _ in range(draws):
        s, inc = fdp.ideal_scores(q, true_sigma, steps, m, rng)
        truth = np.where(inc, 1, -1)
        hits += any(fdp.rejects_curve(c.inverse, m, kp + kn,
                                      int(np.count_nonzero(guesses(s, kp, kn) == truth)), level)
                    for kp, kn in settings)
    return hits


def test_a_correct_mechanism_is_rarely_rejected_and_a_weaker_one_is():
    """Validity over 300 seeded ideal audits of the claimed mechanism: its own curve is
    rejected at most β·300 + 3 standard deviations times (the theorem says ≤ β); a mechanism
    with 40% of the claimed noise is rejected in most audits (the test has power)."""
    beta = 0.05
    wrong = _claimed_rejections(0.2, 1.0, 10, 1000, 300, beta, 1.0, seed=11)
    assert wrong <= beta * 300 + 3 * math.sqrt(300 * beta * (1 - beta)), wrong
    # (one full-batch step: 1000 canaries see that curve's whole relevant range)
    weak = _claimed_rejections(1.0, 2.0, 1, 1000, 20, beta, 0.8, seed=12)
    assert weak >= 15, weak


def test_the_bound_and_its_epsilon():
    """σ̂ is rejected and σ̂·(1 − tolerance) is not (bisection); ε̂ is dp-accounting's ε of
    DP-SGD at (q, σ̂, T), called directly; ideal scores of the claimed mechanism give
    0 < ε̂ < ε and do not reject σ; a run that added too little noise is a violation."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    q, sigma, steps, m, delta = 0.2, 1.0, 10, 2000, 1e-5
    s, inc = fdp.ideal_scores(q, sigma, steps, m, np.random.default_rng(5))
    b = curve.audit_curve(s, inc, q, sigma, steps, delta, beta=0.05)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(b.noise_multiplier)), steps)
    assert b.epsilon == pytest.approx(acc.get_epsilon(delta), rel=1e-6)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert 0 < b.epsilon < acc.get_epsilon(delta) and not b.rejects_claimed
    assert b.noise_multiplier > sigma
    truth = np.where(inc, 1, -1)
    level = b.beta_per_try
    kc = [(kp + kn, int(np.count_nonzero(guesses(s, kp, kn) == truth))) for kp, kn in default_settings(m)]

    def rejected(sp):
        c = curve.trade_off(q, sp, steps)
        return any(fdp.rejects_curve(c.inverse, m, k, cc, level) for k, cc in kc)

    assert rejected(b.noise_multiplier) and not rejected(b.noise_multiplier / (1 + 2 * curve._REL_TOL))
    # a mechanism that ran at half the noise it claims (one full-batch step, where 1000
    # canaries are enough to see it): its claimed σ is rejected
    s2, inc2 = fdp.ideal_scores(1.0, 1.0, 1, 1000, np.random.default_rng(6))
    bad = curve.audit_curve(s2, inc2, 1.0, 2.0, 1, delta, beta=0.05)
    assert bad.rejects_claimed and bad.noise_multiplier < 2.0
    # no information (coins unrelated to the scores): nothing rejected, ε̂ = 0
    none = curve.audit_curve(np.zeros(m) + np.arange(m) * 1e-9, inc, q, sigma, steps, delta)
    assert none.noise_multiplier is None and none.epsilon == 0.0 and not none.rejects_claimed
