"""The one-run lower bound on ε from canary guesses (Steinke, Nasr and Jagielski, "Privacy
Auditing with One (1) Training Run", NeurIPS 2023, arXiv:2305.08846), and the empirical ROC
numbers reported next to it. Pure functions of numbers and arrays: no torch, no files.

The set-up. m canaries; each is included in training independently with probability 1/2
(S_i = +1 included, −1 excluded). After training the auditor scores every canary and,
from the scores alone, guesses T ∈ {−1, 0, +1}^m: +1 on the k₊ highest scores, −1 on the k₋
lowest, 0 (abstain) on the rest. r = k₊ + k₋ is the number of guesses made and v the
number of correct ones (T_i = S_i).

The bound (the paper's Theorem 3.3, with δ > 0, and its Algorithm 2 in the appendix): if
the training algorithm is (ε, δ)-DP then for every v

    P[V ≥ v] ≤ P[X ≥ v] + 2·m·δ · max_{i ∈ {1..v}} (1/i)·P[v − i ≤ X < v],
    X ~ Binomial(r, p),  p = e^ε / (1 + e^ε),

(for δ = 0 the second term vanishes: then V is stochastically dominated by X, ε-DP
randomized response on each guess). `p_value` is this right-hand side, clipped to [0, 1].

The lower bound at confidence 1 − β (`epsilon_lower_bound`) is the largest ε whose p-value
is still < β, found by bisection on ε (to 1e-6). Why that is honest even where the p-value
were not monotone in ε: an (ε, δ)-DP algorithm is also (ε', δ)-DP for every ε' ≥ ε, so
g(ε, v) = inf_{ε' ≥ ε} p_value(ε', v) is a valid bound too, and it is monotone in ε. The
returned ε̂ always satisfies p_value(ε̂) < β (or is 0.0), so ε̂ > ε_true implies
g(ε_true, V) < β, which happens with probability ≤ β. (Bisection may stop at a smaller
crossing than the largest one if the p-value dipped again; that only makes ε̂ smaller.)
With r = 0 nothing can be rejected and the bound is 0.0; so it is when even ε = 0 is not
rejected.

`audit_bound` tries a small grid of (k₊, k₋) fixed by m alone (not by the scores) and
keeps the best ε. To stay honest across the tries it applies a union (Bonferroni) bound:
each try is tested at level β / tries, so the probability that *any* try overstates ε is
≤ β and the reported confidence 1 − β holds for the maximum.

`tpr_at_fpr` and `auc` are empirical ROC numbers of the rule "included iff score ≥ t": no
interpolation, no confidence statement; they describe the attack, not the guarantee.

The f-DP / Gaussian-DP tightening of the same one-run framework (Mahloujifar et al.,
"Auditing f-Differential Privacy in One Run") is `llmdp.audit.fdp`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special, stats

from llmdp.config.validate import _is_int, _is_number

__all__ = [
    "DEFAULT_FRACTIONS",
    "AuditBound",
    "auc",
    "guess_counts",
    "audit_bound",
    "default_settings",
    "epsilon_lower_bound",
    "guesses",
    "p_value",
    "tpr_at_fpr",
]

# k₊ as fractions of m in the default grid of `audit_bound` (each rounded, at least 1). The
# smallest ones are for audits of tens of thousands of gradient canaries, whose most
# confident few hundred guesses carry the bound (a subsampled mechanism stands out sharply
# in the rare steps that sample a canary: ``llmdp.audit.curve``).
DEFAULT_FRACTIONS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)

# Bisection stops once the bracket is this narrow (absolute, in ε).
_TOL = 1e-6
# The bracket's upper end never needs to pass this: for ε > ~37, p rounds to 1.0 in float64
# and P[X ≥ v] = 1 for every v ≤ r.
_EPS_CAP = 1024.0


# ------------------------------------------------------------------------------ validation
def _check_counts(m: Any, r: Any, v: Any) -> tuple[int, int, int]:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {name}={value!r}")
    if not v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m!r}, r={r!r}, v={v!r}")
    return int(m), int(r), int(v)


def _check_unit(name: str, value: Any, *, closed_high: bool, open_low: bool = False) -> float:
    ok = _is_number(value) and math.isfinite(value)
    if ok:
        lo_ok = (value > 0) if open_low else (value >= 0)
        hi_ok = (value <= 1) if closed_high else (value < 1)
        ok = lo_ok and hi_ok
    if not ok:
        interval = ("(0" if open_low else "[0") + (", 1]" if closed_high else ", 1)")
        raise ValueError(f"{name} must be in {interval}, got {name}={value!r}")
    return float(value)


def _check_epsilon(epsilon: Any) -> float:
    if not _is_number(epsilon) or not (0 <= epsilon < math.inf):
        raise ValueError(f"epsilon must be a finite number >= 0, got epsilon={epsilon!r}")
    return float(epsilon)


def _check_scores(scores: Any) -> np.ndarray:
    arr = np.asarray(scores)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"scores must be a non-empty 1-d array, got shape {arr.shape}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"scores must be real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(
            f"scores must be finite, got scores[{int(bad[0])}]={float(arr[bad[0]])!r} "
            f"({bad.size} non-finite)")
    return arr


def _check_included(included: Any, m: int) -> np.ndarray:
    """`included` as ±1 (int8): bool (True = included), or numbers all in {0, 1} or all in
    {−1, +1}. Its length must be m, the number of scores."""
    arr = np.asarray(included)
    if arr.ndim != 1 or arr.shape[0] != m:
        raise ValueError(
            f"included must be a 1-d array as long as scores ({m}), got shape {arr.shape}")
    if arr.dtype == bool:
        return np.where(arr, 1, -1).astype(np.int8)
    if not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"included must be bool or ±1 (or 0/1), got dtype {arr.dtype}")
    values = set(np.unique(arr).tolist())
    if values <= {0, 1}:
        return np.where(arr == 1, 1, -1).astype(np.int8)
    if values <= {-1, 1}:
        return arr.astype(np.int8)
    raise ValueError(
        f"included must be bool, or all values in {{0, 1}} or in {{-1, +1}}, "
        f"got values {sorted(values)[:5]}")


def _check_beta(beta: Any) -> float:
    return _check_unit("beta", beta, closed_high=False, open_low=True)


# ------------------------------------------------------------------------------ the bound
def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The paper's bound on P[V ≥ v] for an (ε, δ)-DP algorithm (Theorem 3.3, Algorithm 2):

        P[X ≥ v] + 2·m·δ · max_{1 ≤ i ≤ v} (1/i)·P[v − i ≤ X < v],  X ~ Bin(r, e^ε/(1+e^ε)),

    clipped to [0, 1]. m canaries, r guesses made, v of them correct; 0 ≤ v ≤ r ≤ m,
    ε ≥ 0, 0 ≤ δ ≤ 1. Small p-values are evidence against (ε, δ)-DP."""
    m, r, v = _check_counts(m, r, v)
    epsilon = _check_epsilon(epsilon)
    delta = _check_unit("delta", delta, closed_high=True)
    if v == 0:
        return 1.0  # P[V >= 0] = 1
    q = float(special.expit(epsilon))  # accuracy of ε-DP randomized response
    value = float(stats.binom.sf(v - 1, r, q))  # P[X >= v]
    if delta > 0.0:
        # window[i-1] = P[v-i <= X < v] = pmf(v-1) + ... + pmf(v-i), i = 1..v
        window = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
        value += 2.0 * m * delta * float(np.max(window / np.arange(1, v + 1)))
    return min(max(value, 0.0), 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest ε (to 1e-6, from below) that `p_value` rejects at level β: with
    probability ≥ 1 − β over the canaries' inclusion, an (ε_true, δ)-DP algorithm has
    ε_true ≥ this. 0.0 when no ε ≥ 0 is rejected (always so for r = 0). The value returned
    is the lower end of the final bisection bracket, so its own p-value is < β."""
    m, r, v = _check_counts(m, r, v)
    delta = _check_unit("delta", delta, closed_high=False)
    beta = _check_beta(beta)
    if r == 0 or p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:  # grow the bracket: p -> 1 as ε -> ∞
        lo, hi = hi, 2.0 * hi
        if hi > _EPS_CAP:  # cannot happen for v <= r (see _EPS_CAP); a guard, not a path
            raise RuntimeError(f"no upper end for the ε bracket (m={m}, r={r}, v={v})")
    while hi - lo > _TOL:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------------ guesses
def guesses(scores: Any, k_pos: int, k_neg: int) -> np.ndarray:
    """The guess vector T ∈ {−1, 0, +1}^m (int8) from the scores alone: +1 on the k_pos
    highest, −1 on the k_neg lowest, 0 elsewhere. Ties are broken by index: the canaries
    are ranked by score, highest first, equal scores in increasing index; the first k_pos
    of that ranking get +1 and the last k_neg get −1 (so among equal scores a smaller index
    counts as higher)."""
    arr = _check_scores(scores)
    m = arr.shape[0]
    for name, k in (("k_pos", k_pos), ("k_neg", k_neg)):
        if not _is_int(k) or k < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {name}={k!r}")
    if k_pos + k_neg > m:
        raise ValueError(f"need k_pos + k_neg <= m, got k_pos={k_pos}, k_neg={k_neg}, m={m}")
    # lexsort: the last key is the primary one; -score descending, then index ascending
    order = np.lexsort((np.arange(m), -arr))
    out = np.zeros(m, dtype=np.int8)
    out[order[:k_pos]] = 1
    if k_neg:
        out[order[m - k_neg:]] = -1
    return out


def default_settings(m: int) -> list[tuple[int, int]]:
    """The default (k₊, k₋) grid for m canaries: k₊ = max(1, round(f·m)) for f in
    `DEFAULT_FRACTIONS`, k₋ ∈ {0, k₊}; duplicates dropped, only k₊ + k₋ ≤ m, in that order.
    It depends on m alone, never on the scores (else the union bound would not hold)."""
    if not _is_int(m) or m < 1:
        raise ValueError(f"m must be an integer >= 1, got m={m!r}")
    out: list[tuple[int, int]] = []
    for f in DEFAULT_FRACTIONS:
        k = max(1, int(round(f * m)))
        for setting in ((k, 0), (k, k)):
            if sum(setting) <= m and setting not in out:
                out.append(setting)
    return out


@dataclass(frozen=True)
class AuditBound:
    """The best one-run bound over the tried (k₊, k₋) settings.

    epsilon_lower_bound: with probability ≥ `confidence` the audited run's ε is at least
        this (for its δ); 0.0 = no evidence against any ε ≥ 0.
    confidence: 1 − β, for the maximum over all tries (union bound).
    m, r, v: canaries, guesses made and correct guesses of the best setting.
    k_pos, k_neg: the best setting (the first in grid order on a tie).
    tried: how many (k₊, k₋) settings were tried.
    beta_per_try: β / tried, the level each setting was tested at.
    """

    epsilon_lower_bound: float
    confidence: float
    m: int
    r: int
    v: int
    k_pos: int
    k_neg: int
    tried: int
    beta_per_try: float


def audit_bound(scores: Any, included: Any, delta: float, beta: float = 0.05,
                ks: Iterable[tuple[int, int]] | None = None) -> AuditBound:
    """The one-run lower bound on ε from canary `scores` (higher = more likely included)
    and the truth `included` (bool, or ±1, or 0/1), for the run's δ (0 ≤ δ < 1) at
    confidence 1 − β (0 < β < 1).

    `ks`: the (k₊, k₋) settings to try; default `default_settings(m)`. They must be fixed
    before looking at the scores. Each is tested at level β / len(settings) (union bound)
    and the largest ε is returned with its setting."""
    delta = _check_unit("delta", delta, closed_high=False)
    m, level, counts = guess_counts(scores, included, beta, ks)
    beta = _check_beta(beta)
    best: AuditBound | None = None
    for k_pos, k_neg, v in counts:
        r = k_pos + k_neg
        eps = epsilon_lower_bound(m, r, v, delta, level)
        if best is None or eps > best.epsilon_lower_bound:
            best = AuditBound(eps, 1.0 - beta, m, r, v, k_pos, k_neg, len(counts), level)
    assert best is not None
    return best


def guess_counts(scores: Any, included: Any, beta: float,
                 ks: Iterable[tuple[int, int]] | None = None) -> tuple[int, float, list[tuple[int, int, int]]]:
    """What every one-run estimator starts from: (m, the level β / tries of each setting,
    [(k₊, k₋, correct guesses)] for the settings `ks`, default `default_settings(m)`)."""
    arr = _check_scores(scores)
    m = arr.shape[0]
    truth = _check_included(included, m)
    beta = _check_beta(beta)
    settings = default_settings(m) if ks is None else _check_settings(ks, m)
    # abstentions (0) never equal ±1
    counts = [(kp, kn, int(np.count_nonzero(guesses(arr, kp, kn) == truth))) for kp, kn in settings]
    return m, beta / len(settings), counts


def _check_settings(ks: Iterable[tuple[int, int]], m: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for item in ks:
        if (not isinstance(item, Sequence) or len(item) != 2
                or not all(_is_int(k) and k >= 0 for k in item)):
            raise ValueError(f"ks must hold pairs (k_pos, k_neg) of integers >= 0, got {item!r}")
        setting = (int(item[0]), int(item[1]))
        if sum(setting) < 1 or sum(setting) > m:
            raise ValueError(f"ks: need 1 <= k_pos + k_neg <= m={m}, got {setting}")
        if setting not in out:
            out.append(setting)
    if not out:
        raise ValueError("ks must hold at least one (k_pos, k_neg) setting")
    return out


# ------------------------------------------------------------------------------ ROC numbers
def _split(scores: Any, included: Any) -> tuple[np.ndarray, np.ndarray]:
    arr = _check_scores(scores)
    truth = _check_included(included, arr.shape[0])
    pos, neg = arr[truth == 1], arr[truth == -1]
    if pos.size == 0 or neg.size == 0:
        raise ValueError(
            f"included must hold both included and excluded canaries, got "
            f"{pos.size} included and {neg.size} excluded")
    return pos, neg


def tpr_at_fpr(scores: Any, included: Any, fpr: float) -> float:
    """The true-positive rate of the rule "included iff score ≥ t" at the most permissive
    threshold t (the smallest among +∞ and the scores) whose false-positive rate is still
    ≤ `fpr`: the best TPR at that FPR among the empirical ROC points. No interpolation
    between points: tied scores are all in or all out."""
    fpr = _check_unit("fpr", fpr, closed_high=True)
    pos, neg = _split(scores, included)
    thresholds = np.concatenate(([np.inf], np.unique(np.concatenate((pos, neg)))[::-1]))
    neg_sorted, pos_sorted = np.sort(neg), np.sort(pos)
    # count of scores >= t, for every t (descending t: counts non-decreasing)
    fp = neg.size - np.searchsorted(neg_sorted, thresholds, side="left")
    tp = pos.size - np.searchsorted(pos_sorted, thresholds, side="left")
    ok = np.flatnonzero(fp <= fpr * neg.size + 1e-12 * neg.size)
    return float(tp[ok[-1]] / pos.size)  # t = +inf (fp = 0) is always ok


def auc(scores: Any, included: Any) -> float:
    """The area under the empirical ROC curve: P[score of an included canary > score of an
    excluded one] + ½·P[equal] (the Mann–Whitney statistic over all pairs)."""
    pos, neg = _split(scores, included)
    ranks = stats.rankdata(np.concatenate((pos, neg)))  # average ranks for ties
    u = float(ranks[: pos.size].sum()) - pos.size * (pos.size + 1) / 2.0
    return u / (pos.size * neg.size)
