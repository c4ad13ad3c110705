"""The one-run ε lower bound (llmdp/audit/estimate.py) against a direct implementation written
here (binomial terms from exact `math.comb`, summed in plain Python floats; exact Fractions
at a rational p), closed forms, monotonicity, and seeded calibration simulations."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest

from llmdp.audit.estimate import (
    AuditBound,
    auc,
    audit_bound,
    default_settings,
    epsilon_lower_bound,
    guesses,
    p_value,
    tpr_at_fpr,
)


# ------------------------------------------------------------------ the direct implementation
@functools.cache
def _log_comb(r: int) -> tuple[float, ...]:
    return tuple(math.log(math.comb(r, k)) for k in range(r + 1))


def _pmf(r: int, eps: float) -> list[float]:
    """Bin(r, e^ε/(1+e^ε)) probabilities, term by term from exact binomial coefficients."""
    log_q = -math.log1p(math.exp(-eps))  # log(e^ε/(1+e^ε))
    log_1mq = -math.log1p(math.exp(eps))  # log(1/(1+e^ε))
    lc = _log_comb(r)
    return [math.exp(lc[k] + k * log_q + (r - k) * log_1mq) for k in range(r + 1)]


def direct_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[X >= v] + 2 m δ max_{1<=i<=v} P[v-i <= X < v] / i (Steinke, Nasr, Jagielski 2023,
    Theorem 3.3), by explicit summation."""
    if v == 0:
        return 1.0
    pmf = _pmf(r, eps)
    tail = sum(pmf[v:])
    best, acc = 0.0, 0.0
    for i in range(1, v + 1):
        acc += pmf[v - i]
        best = max(best, acc / i)
    return min(1.0, tail + 2 * m * delta * best)


def direct_bound(m: int, r: int, v: int, delta: float, beta: float) -> float:
    """The largest ε in [0, 60] with direct_p_value < β, by a fixed 45-step bisection."""
    if r == 0 or direct_p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 60.0
    assert direct_p_value(m, r, v, hi, delta) >= beta
    for _ in range(45):
        mid = (lo + hi) / 2
        if direct_p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def closed_form_all_correct(r: int, beta: float) -> float:
    """δ = 0, v = r: the p-value is p^r, so the bound solves p^r = β: ε = log(b/(1-b)),
    b = β^(1/r) (0 when that is negative: then even ε = 0 is not rejected)."""
    b = beta ** (1.0 / r)
    return max(0.0, math.log(b / (1 - b)))


def _rr_q(eps: float) -> float:
    return math.exp(eps) / (1 + math.exp(eps))


# ------------------------------------------------------------------ p_value and the bound
@pytest.mark.parametrize("r,v,delta", [(10, 7, Fraction(1, 1000)), (12, 12, Fraction(0)),
                                       (9, 3, Fraction(1, 50)), (15, 11, Fraction(1, 10**5))])
def test_p_value_equals_the_exact_fraction_at_a_rational_p(r, v, delta):
    # ε = log 3 gives p = 3/4 exactly: the whole bound is a rational number
    m = 40
    q = Fraction(3, 4)
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    tail = sum(pmf[v:], Fraction(0))
    windows = [sum(pmf[v - i: v], Fraction(0)) / i for i in range(1, v + 1)]
    exact = min(Fraction(1), tail + 2 * m * delta * max(windows))
    got = p_value(m, r, v, math.log(3), float(delta))
    assert got == pytest.approx(float(exact), rel=1e-10, abs=1e-15)
    assert direct_p_value(m, r, v, math.log(3), float(delta)) == pytest.approx(float(exact),
                                                                               rel=1e-10)


CASES = [  # (m, r, v, delta, beta)
    (100, 0, 0, 0.0, 0.05),  # all abstain
    (100, 0, 0, 1e-5, 0.05),
    (1000, 100, 100, 0.0, 0.05),  # all correct
    (1000, 100, 100, 1e-5, 0.05),
    (1000, 100, 100, 1e-5, 0.01),
    (1000, 100, 50, 0.0, 0.05),  # half correct: no evidence
    (1000, 100, 50, 1e-5, 0.05),
    (1000, 100, 80, 0.0, 0.05),
    (1000, 100, 80, 1e-5, 0.05),
    (1000, 100, 80, 1e-3, 0.05),
    (50, 50, 45, 1e-3, 0.1),
    (1000, 5, 5, 0.0, 0.05),
    (1000, 4, 4, 0.0, 0.05),
    (10**6, 1000, 800, 1e-6, 0.05),  # large m
    (10**6, 1000, 990, 1e-7, 0.05),
    (10**5, 1500, 1000, 1e-5, 0.1),
]


@pytest.mark.parametrize("m,r,v,delta,beta", CASES)
def test_bound_equals_the_direct_implementation(m, r, v, delta, beta):
    got = epsilon_lower_bound(m, r, v, delta, beta)
    want = direct_bound(m, r, v, delta, beta)
    assert got == pytest.approx(want, abs=1e-5)
    if got > 0:  # the value returned is itself rejected, a hair above it is not
        assert direct_p_value(m, r, v, got, delta) < beta
        assert direct_p_value(m, r, v, got + 1e-5, delta) >= beta


def test_special_cases():
    assert epsilon_lower_bound(100, 0, 0, 0.0) == 0.0
    assert epsilon_lower_bound(100, 0, 0, 1e-5) == 0.0
    assert epsilon_lower_bound(1000, 100, 50, 0.0) == 0.0
    assert epsilon_lower_bound(1000, 100, 100, 0.0) > 3
    assert p_value(100, 0, 0, 5.0, 0.0) == 1.0
    # δ > 0 never raises the bound
    for v in (60, 80, 95, 100):
        b0 = epsilon_lower_bound(1000, 100, v, 0.0)
        for delta in (1e-6, 1e-4, 1e-3):
            assert epsilon_lower_bound(1000, 100, v, delta) <= b0
    assert epsilon_lower_bound(1000, 100, 100, 1e-3) < epsilon_lower_bound(1000, 100, 100, 0.0)
    # 2 m δ >= 1 with few guesses: nothing can be rejected
    assert epsilon_lower_bound(10**6, 10, 10, 1e-6) == 0.0


@pytest.mark.parametrize("r,beta", [(5, 0.05), (20, 0.05), (100, 0.05), (100, 0.01),
                                    (1000, 0.1), (3, 0.2), (4, 0.05)])
def test_all_correct_matches_the_closed_form(r, beta):
    assert epsilon_lower_bound(10 * r, r, r, 0.0, beta) == pytest.approx(
        closed_form_all_correct(r, beta), abs=2e-6)


def test_monotone_in_v_and_in_beta():
    for delta in (0.0, 1e-4):
        prev = -1.0
        for v in range(0, 61):
            b = epsilon_lower_bound(500, 60, v, delta, 0.05)
            assert b >= prev, (v, delta)
            prev = b
        assert prev > 0
    for v in (40, 52, 60):
        prev = -1.0
        for beta in (0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9):
            b = epsilon_lower_bound(500, 60, v, 1e-5, beta)
            assert b >= prev, (v, beta)
            prev = b


# ------------------------------------------------------------------ calibration
def _bounds_for(counts: np.ndarray, r: int, delta: float, beta: float) -> np.ndarray:
    """The estimator is a function of (m, r, v): evaluate it once per distinct v."""
    cache = {int(v): epsilon_lower_bound(r, r, int(v), delta, beta) for v in np.unique(counts)}
    return np.array([cache[int(v)] for v in counts])


def test_calibration_on_randomized_response():
    """ε-DP randomized response on every guess (each correct with probability e^ε/(1+e^ε)):
    the bound may exceed the true ε in at most a β fraction of runs. 4000 seeded runs: the
    tolerance is 3 binomial standard deviations, 3·sqrt(β(1−β)/4000) ≈ 0.010."""
    beta, r, n = 0.05, 200, 4000
    tol = 3 * math.sqrt(beta * (1 - beta) / n)
    rng = np.random.default_rng(20230514)
    for eps in (1.0, 4.0):
        counts = rng.binomial(r, _rr_q(eps), size=n)
        bounds = _bounds_for(counts, r, 0.0, beta)
        assert np.mean(bounds > eps) <= beta + tol, eps
        if eps == 4.0:  # not vacuous: a strong mechanism-level leak is found
            assert np.mean(bounds > 0) >= 0.99
            assert np.median(bounds) > 2.5
    # exactly: the smallest v whose bound exceeds ε = 1 has P[V >= v] <= β under ε = 1,
    # and the one below it is not far above β's cut (the test is not needlessly loose)
    q = _rr_q(1.0)
    v_star = next(v for v in range(r + 1) if epsilon_lower_bound(r, r, v, 0.0, beta) > 1.0)
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    assert sum(pmf[v_star:]) <= beta
    assert sum(pmf[v_star - 1:]) > beta * (1 - 1e-4)


# ------------------------------------------------------------------ guesses and audit_bound
def test_guesses_with_ties():
    scores = [3.0, 1.0, 3.0, 2.0, 1.0]
    assert guesses(scores, 1, 1).tolist() == [1, 0, 0, 0, -1]
    assert guesses(scores, 2, 2).tolist() == [1, -1, 1, 0, -1]
    assert guesses(scores, 0, 3).tolist() == [0, -1, 0, -1, -1]
    assert guesses(scores, 5, 0).tolist() == [1] * 5
    assert guesses([0.0, 0.0, 0.0], 1, 1).tolist() == [1, 0, -1]
    with pytest.raises(ValueError, match=r"k_pos \+ k_neg <= m"):
        guesses(scores, 3, 3)
    with pytest.raises(ValueError, match="k_neg must be an integer >= 0, got k_neg=-1"):
        guesses(scores, 1, -1)


def test_default_settings():
    assert default_settings(1000) == [(2, 0), (2, 2), (5, 0), (5, 5), (10, 0), (10, 10), (20, 0), (20, 20), (50, 0), (50, 50),
                                      (100, 0), (100, 100), (250, 0), (250, 250), (500, 0),
                                      (500, 500)]
    s = default_settings(10)
    assert s == [(1, 0), (1, 1), (2, 0), (2, 2), (5, 0), (5, 5)]
    assert all(a + b <= 3 for a, b in default_settings(3))


def test_audit_bound_is_the_best_setting_at_the_union_level():
    rng = np.random.default_rng(7)
    m, delta, beta = 400, 1e-5, 0.05
    truth = rng.random(m) < 0.5
    scores = truth * 0.8 + rng.normal(size=m)
    res = audit_bound(scores, truth, delta, beta)
    assert isinstance(res, AuditBound)
    settings = default_settings(m)
    assert res.tried == len(settings) and res.beta_per_try == pytest.approx(beta / len(settings))
    assert res.confidence == pytest.approx(1 - beta) and res.m == m
    # by hand: the guesses of every setting, the direct bound at β / tries, the maximum
    sign = np.where(truth, 1, -1)
    order = sorted(range(m), key=lambda i: (-scores[i], i))
    best = (0.0, None)
    for k_pos, k_neg in settings:
        correct = sum(sign[i] == 1 for i in order[:k_pos])
        correct += sum(sign[i] == -1 for i in order[m - k_neg:]) if k_neg else 0
        b = direct_bound(m, k_pos + k_neg, int(correct), delta, beta / len(settings))
        if b > best[0] + 1e-9:
            best = (b, (k_pos, k_neg, k_pos + k_neg, int(correct)))
    assert best[1] is not None, "the seeded scores should leak enough for a positive bound"
    assert res.epsilon_lower_bound == pytest.approx(best[0], abs=1e-5)
    assert (res.k_pos, res.k_neg, res.r, res.v) == best[1]
    # the same with ±1 and 0/1 truth vectors
    assert audit_bound(scores, sign, delta, beta) == res
    assert audit_bound(scores, truth.astype(int), delta, beta) == res
    # one explicit setting: no union penalty
    one = audit_bound(scores, truth, delta, beta, ks=[best[1][:2]])
    assert one.tried == 1 and one.epsilon_lower_bound > res.epsilon_lower_bound


def test_audit_bound_perfect_separation_grows_with_m():
    rng = np.random.default_rng(11)
    prev = 0.0
    for m in (100, 1000, 10000):
        truth = rng.random(m) < 0.5
        scores = truth + rng.uniform(0.0, 0.5, size=m)  # every included above every excluded
        res = audit_bound(scores, truth, 1e-5)
        assert res.v == res.r > 0
        assert res.epsilon_lower_bound > prev
        prev = res.epsilon_lower_bound
        # δ = 0: all r guesses right, so the closed form at the per-try level
        pure = audit_bound(scores, truth, 0.0)
        assert pure.v == pure.r == m // 2
        assert pure.epsilon_lower_bound == pytest.approx(
            closed_form_all_correct(pure.r, 0.05 / pure.tried), abs=2e-6)
        assert pure.epsilon_lower_bound >= res.epsilon_lower_bound
    assert prev > 4.5  # m = 10000, δ = 1e-5: the 2mδ term caps it near 4.9


def test_audit_bound_on_scores_independent_of_inclusion():
    """No leak: the bound is positive in at most ~β of seeded trials (300 trials; tolerance
    3·sqrt(β(1−β)/300) ≈ 0.038; with the union bound the rate is far below β anyway)."""
    rng = np.random.default_rng(3)
    beta, trials = 0.05, 300
    positive = 0
    for _ in range(trials):
        truth = rng.random(500) < 0.5
        positive += audit_bound(rng.normal(size=500), truth, 1e-5, beta).epsilon_lower_bound > 0
    assert positive / trials <= beta + 3 * math.sqrt(beta * (1 - beta) / trials)


# ------------------------------------------------------------------ ROC numbers
def test_tpr_at_fpr_and_auc_by_hand():
    scores = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    inc = [True, True, False, True, False, False]
    # thresholds: t=0.8 is the smallest with no false positive (0.7 is excluded): TPR 2/3;
    # t=0.6 lets in one of three excluded (FPR 1/3): TPR 1
    assert tpr_at_fpr(scores, inc, 0.0) == pytest.approx(2 / 3)
    assert tpr_at_fpr(scores, inc, 0.2) == pytest.approx(2 / 3)
    assert tpr_at_fpr(scores, inc, 1 / 3) == pytest.approx(1.0)
    assert tpr_at_fpr(scores, inc, 1.0) == pytest.approx(1.0)
    # 8 of the 9 (included, excluded) pairs are ordered right: 0.6 < 0.7
    assert auc(scores, inc) == pytest.approx(8 / 9)
    # ties move together: no threshold separates the two 1.0s
    assert tpr_at_fpr([1.0, 1.0, 0.0], [1, 0, 0], 0.0) == 0.0
    assert tpr_at_fpr([1.0, 1.0, 0.0], [1, 0, 0], 0.5) == 1.0
    assert auc([1.0, 1.0, 0.0], [1, 0, 0]) == pytest.approx(0.75)
    assert auc([0.0, 1.0], [-1, 1]) == 1.0
    # the rule is score >= t: at FPR 1 the lowest score (here included) is in
    assert tpr_at_fpr([0.9, 0.1], [0, 1], 1.0) == 1.0
    assert tpr_at_fpr([0.9, 0.1], [0, 1], 0.99) == 0.0


# ------------------------------------------------------------------ input validation
@pytest.mark.parametrize("call,message", [
    (lambda: audit_bound([0.1, 0.2, 0.3], [True, False], 1e-5),
     r"included must be a 1-d array as long as scores \(3\), got shape \(2,\)"),
    (lambda: audit_bound([0.1, float("nan"), 0.3], [1, 0, 1], 1e-5),
     r"scores must be finite, got scores\[1\]=nan"),
    (lambda: audit_bound([0.1, float("inf")], [1, 0], 1e-5), r"scores must be finite"),
    (lambda: audit_bound([0.1, 0.2], [1, 0], 1e-5, beta=1.0),
     r"beta must be in \(0, 1\), got beta=1.0"),
    (lambda: audit_bound([0.1, 0.2], [1, 0], 1e-5, beta=0),
     r"beta must be in \(0, 1\), got beta=0"),
    (lambda: audit_bound([0.1, 0.2], [1, 0], 1.0), r"delta must be in \[0, 1\), got delta=1.0"),
    (lambda: audit_bound([0.1, 0.2], [1, 0], -1e-6), r"delta must be in \[0, 1\), got delta=-1e-06"),
    (lambda: audit_bound([0.1, 0.2], [2, 0], 1e-5), r"included must be bool, or all values"),
    (lambda: audit_bound([], [], 1e-5), r"scores must be a non-empty 1-d array"),
    (lambda: audit_bound([0.1, 0.2], [1, 0], 1e-5, ks=[(2, 1)]), r"k_pos \+ k_neg <= m=2"),
    (lambda: epsilon_lower_bound(10, 5, 6, 0.0), r"need 0 <= v <= r <= m, got m=10, r=5, v=6"),
    (lambda: epsilon_lower_bound(10, 11, 6, 0.0), r"need 0 <= v <= r <= m"),
    (lambda: epsilon_lower_bound(10, 5, 2.5, 0.0), r"v must be an integer >= 0, got v=2.5"),
    (lambda: p_value(10, 5, 3, -0.1, 0.0), r"epsilon must be a finite number >= 0"),
    (lambda: p_value(10, 5, 3, 1.0, "x"), r"delta must be in \[0, 1\], got delta='x'"),
    (lambda: tpr_at_fpr([0.1, 0.2], [1, 1], 0.1), r"both included and excluded"),
    (lambda: tpr_at_fpr([0.1, 0.2], [1, 0], 1.5), r"fpr must be in \[0, 1\], got fpr=1.5"),
])
def test_input_validation(call, message):
    with pytest.raises(ValueError, match=message):
        call()
