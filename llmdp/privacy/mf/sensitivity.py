"""L2 sensitivity of a Toeplitz strategy C under multiple participations: what the privacy
analysis of a correlated-noise mechanism (`mf.Factorization`) charges for releasing C·G + Z.

Setting ((k, b)-min-sep participation, Choquette-Choo et al. 2023, "Amplified banded matrix
factorization: a unified approach to private training", NeurIPS 2023): one unit
(example or user) contributes to at most k of the first n steps, any two of them at least
b = ``min_sep`` steps apart, each contribution a gradient of norm <= 1. With X = CᵀC and a
pattern P = {p_1 < ... < p_k}, the change of C·G is Σ_l C[:, p_l]·g_l, so

    sens² = max_P max_{‖g_l‖<=1} Σ_{l,m} X[p_l, p_m]·<g_l, g_m>  <=  max_P Σ_{i,j∈P} |X_ij|   (1)

(their Eq. 5: the "absolute value trick"); equality holds when X >= 0 on the pattern (all
g_l equal). Three cases are exact here:

* k = 1 (or Poisson sampling): the maximum column norm; a Toeplitz C's first column is its
  longest, so sens = ‖c_0..c_{n-1}‖₂ whatever the signs.
* C has at most b non-zero diagonals (banded with bands <= min_sep): two columns of a
  pattern never overlap, X is diagonal on P, and the column norms are non-increasing in j,
  so P = {0, b, 2b, ...} (the l-th element of any pattern is >= (l-1)·b) is the maximizer.
* c >= 0 and non-increasing: X_ij = Σ_{m=0}^{n-1-max(i,j)} c_m c_{m+|i-j|} is non-negative
  and non-increasing both in |i-j| and in max(i,j); the pattern q_l = (l-1)·b has
  |q_l - q_m| <= |p_l - p_m| and max(q_l, q_m) <= max(p_l, p_m) for every pattern p, so it
  dominates entrywise, and more participations only add non-negative terms: sens² =
  ‖Σ_{l<k} C[:, l·b]‖². (Kalinin & Lampert 2024, "Banded square root matrix factorization
  for differentially private model training", arXiv:2405.13763, Thm. 2; McMahan, Pillutla
  et al. 2025, "Correlated noise mechanisms for differentially private learning"; the same
  closed form is jax_privacy's ``toeplitz.minsep_sensitivity_squared``.)

Otherwise the result is an upper bound, the smaller of two valid ones: (a) the
non-increasing majorant m_j = max_{i>=j} |c_i|, for which the exact formula holds and whose
Gram matrix dominates |X| entrywise; (b) Algorithm 4 of Choquette-Choo et al. 2023 (what
jax_privacy's ``sensitivity.get_min_sep_sensitivity_upper_bound`` implements): for each row i
of |X| the best pattern's sum v_i (a dynamic program, their Algorithm 3), then the best
pattern over v -- a maximum over an enlarged set (rows and columns may pick different
patterns), so an upper bound on (1). (b) costs O(n²k) and is skipped for large n·k.

`brute_force_sensitivity` enumerates every pattern (tests, small n).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from llmdp.privacy.mf.factorization import Factorization

__all__ = [
    "aligned_sum",
    "brute_force_sensitivity",
    "column_norms",
    "effective_participations",
    "gram_matrix",
    "max_pattern_sum",
    "minsep_sensitivity",
    "minsep_upper_bound",
    "prefix_sensitivity",
]

# Algorithm 4's dynamic program costs O(n²·k): only run it below this many cell updates.
_DP_BUDGET = 2e7


def _coefficients(fact_or_coeffs, n: int) -> np.ndarray:
    """The first n Toeplitz coefficients (scale included for a `Factorization`), zero-padded."""
    if isinstance(fact_or_coeffs, Factorization):
        return fact_or_coeffs.c_coefficients(n)
    c = np.asarray(fact_or_coeffs, dtype=np.float64).ravel()
    out = np.zeros(n)
    m = min(n, c.size)
    out[:m] = c[:m]
    return out


def _check(n: int, min_sep: int) -> tuple[int, int]:
    n, min_sep = int(n), int(min_sep)
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    if min_sep < 1:
        raise ValueError(f"min_sep must be >= 1, got min_sep={min_sep}")
    return n, min_sep


def effective_participations(n: int, min_sep: int, max_participations: int | None) -> int:
    """min(k, ceil(n / min_sep)): the most participations a (k, b)-min-sep pattern can have
    in n steps (k = None: no limit but the separation)."""
    n, min_sep = _check(n, min_sep)
    most = -(-n // min_sep)
    if max_participations is None:
        return most
    k = int(max_participations)
    if k < 1:
        raise ValueError(f"max_participations must be >= 1, got {max_participations!r}")
    return min(k, most)


def column_norms(c, n: int) -> np.ndarray:
    """The n column norms of the n×n lower-triangular Toeplitz C with coefficients ``c``:
    column j holds c_0..c_{n-1-j}, so its squared norm is the prefix sum of c² up to n-1-j."""
    c = _coefficients(c, int(n))
    return np.sqrt(np.cumsum(c * c)[::-1])


def aligned_sum(c: torch.Tensor, min_sep: int, k: int) -> torch.Tensor:
    """v = Σ_{l<k} C[:, l·min_sep] for the Toeplitz C of coefficients ``c`` (length n): the
    change of C·G for the pattern {0, b, ..., (k-1)·b} and aligned unit gradients. O(n);
    differentiable (torch). s_t = c_t + s_{t-b} accumulates every shift, and v = s - s
    shifted by k·b drops those beyond the k-th."""
    n = c.shape[0]
    b = int(min_sep)
    rows = -(-n // b)
    padded = torch.cat([c, c.new_zeros(rows * b - n)])
    s = torch.cumsum(padded.reshape(rows, b), dim=0).reshape(-1)[:n]
    shift = k * b
    if shift >= n:
        return s
    return torch.cat([s[:shift], s[shift:] - s[: n - shift]])


def _aligned_sq(c: np.ndarray, min_sep: int, k: int) -> float:
    v = aligned_sum(torch.from_numpy(np.ascontiguousarray(c, dtype=np.float64)), min_sep, k)
    return float(torch.dot(v, v))


def gram_matrix(c, n: int) -> np.ndarray:
    """X = CᵀC for the n×n Toeplitz C, in O(n²) from the coefficients: for i <= j, d = j-i,
    X_ij = Σ_{m=0}^{n-1-j} c_m c_{m+d} (a prefix sum of the lag-d products)."""
    c = _coefficients(c, int(n))
    n = c.size
    X = np.zeros((n, n))
    for d in range(n):
        pref = np.cumsum(c[: n - d] * c[d:])  # pref[L-1] = Σ_{m<L} c_m c_{m+d}
        i = np.arange(n - d)
        X[i, i + d] = pref[n - 1 - (i + d)]
    return np.triu(X) + np.triu(X, 1).T


def max_pattern_sum(x: np.ndarray, min_sep: int, k: int) -> np.ndarray:
    """max over patterns P (<= k indices, pairwise >= min_sep apart) of Σ_{j∈P} x_j, for each
    row of ``x`` (a vector or a matrix of rows; the empty pattern counts, value 0).
    Dynamic program (Choquette-Choo et al. 2023, Algorithm 3): F_κ(i) = the best with at most
    κ picks in x[i:] = max(F_κ(i+1), x_i + F_{κ-1}(i+b)); O(len·k) per row."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    rows, n = x.shape
    b = int(min_sep)
    f = np.zeros((rows, n + b))
    for _ in range(int(k)):
        take = x + f[:, b:]
        g = np.maximum.accumulate(take[:, ::-1], axis=1)[:, ::-1]  # best at or after i
        f = np.concatenate([np.maximum(g, 0.0), np.zeros((rows, b))], axis=1)
    return f[:, 0]


def minsep_upper_bound(c, n: int, min_sep: int, max_participations: int | None = None) -> float:
    """A valid upper bound on the (k, b)-min-sep sensitivity of any lower-triangular Toeplitz
    C (any signs): the smaller of the non-increasing-majorant bound and, when affordable,
    Choquette-Choo et al. 2023 Algorithm 4 on |CᵀC| (see the module docstring)."""
    n, min_sep = _check(n, min_sep)
    c = _coefficients(c, n)
    k = effective_participations(n, min_sep, max_participations)
    majorant = np.maximum.accumulate(np.abs(c)[::-1])[::-1]
    best = _aligned_sq(majorant, min_sep, k)
    if n * n * k <= _DP_BUDGET:
        v = max_pattern_sum(np.abs(gram_matrix(c, n)), min_sep, k)
        best = min(best, float(max_pattern_sum(v, min_sep, k)[0]))
    return math.sqrt(best)


def minsep_sensitivity(fact_or_coeffs, n: int, min_sep: int,
                       max_participations: int | None = None) -> tuple[float, bool]:
    """(sensitivity, exact) of C·G, C the n×n Toeplitz strategy (a `Factorization`, scale
    included, or its coefficients), when a unit participates at most ``max_participations``
    times (None: as often as the separation allows), ``min_sep`` steps apart or more, in the
    first n steps, with gradients of norm <= 1. ``exact`` is True when the value is the
    sensitivity itself (k = 1; bands <= min_sep; c >= 0 non-increasing: the pattern
    {0, b, 2b, ...} is the maximizer, module docstring) and False when it is an upper bound."""
    n, min_sep = _check(n, min_sep)
    c = _coefficients(fact_or_coeffs, n)
    k = effective_participations(n, min_sep, max_participations)
    if k == 1:
        return float(np.linalg.norm(c)), True
    nz = np.flatnonzero(c)
    bands = int(nz[-1]) + 1 if nz.size else 1
    if bands <= min_sep:
        col_sq = np.cumsum(c * c)[::-1]  # column j's squared norm
        return math.sqrt(float(col_sq[np.arange(k) * min_sep].sum())), True
    if np.all(c >= 0) and np.all(np.diff(c) <= 0):
        return math.sqrt(_aligned_sq(c, min_sep, k)), True
    return minsep_upper_bound(c, n, min_sep, k), False


def prefix_sensitivity(fact: Factorization, t: int, min_sep: int | None) -> tuple[float, bool]:
    """(sensitivity, exact) of the first t steps (the t×t leading block of scale·C) with as
    many participations as t steps allow, ceil(t / min_sep) -- what the ledger charges after
    t steps. ``min_sep`` None (Poisson sampling, one participation per release): the largest
    column norm, ‖c_0..c_{t-1}‖."""
    t = int(t)
    if min_sep is None:
        return minsep_sensitivity(fact, t, 1, 1)
    return minsep_sensitivity(fact, t, min_sep, -(-t // int(min_sep)))


def _patterns(n: int, min_sep: int, k: int):
    for size in range(1, k + 1):
        for p in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in zip(p, p[1:])):
                yield p


def brute_force_sensitivity(c, n: int, min_sep: int,
                            max_participations: int | None = None) -> tuple[float, float]:
    """By enumeration of every (k, b)-min-sep pattern in n steps (tests; small n only):
    (max_P sqrt(Σ_{i,j∈P} |X_ij|), max_P max_{s∈{±1}^P} sqrt(sᵀ X_P s)). The first is the
    bound (1) (= the vector sensitivity when X >= 0), the second the scalar-valued
    sensitivity, a lower bound on the vector-valued one; they agree when X >= 0."""
    n, min_sep = _check(n, min_sep)
    c = _coefficients(c, n)
    k = effective_participations(n, min_sep, max_participations)
    C = np.zeros((n, n))
    i, j = np.indices((n, n))
    C[i >= j] = c[(i - j)[i >= j]]
    X = C.T @ C
    best_abs = best_signed = 0.0
    for p in _patterns(n, min_sep, k):
        sub = X[np.ix_(p, p)]
        best_abs = max(best_abs, float(np.abs(sub).sum()))
        for tail in itertools.product((1.0, -1.0), repeat=len(p) - 1):
            s = np.array((1.0,) + tail)
            best_signed = max(best_signed, float(s @ sub @ s))
    return math.sqrt(best_abs), math.sqrt(best_signed)
