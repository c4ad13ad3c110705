"""Rigorous arithmetic on the dyadic probabilities of `sampling`'s exact coins.

Every coin of `PoissonSampler` is "U < p" with p = (1-q)**s a dyadic rational (q is a
binary float, so 1 - q = c / 2**b exactly). This module holds the integer and float64
arithmetic that decides such a coin without ever rounding p the wrong way: integer lower
and upper bounds of p at any precision (`_power_bounds`), the float64 nearest to
(1-q)**(2**i) computed with Python integers (`_nearest_powers`), the rigorous relative
error bound of a product of those (`_margin`), and the 64-bit thresholds that decide a
coin from one keystream word when it is far enough from p (`_fast_thresholds`). Reading
the further bits of U when it is not (`poisson._exact_coin`) is the sampler's part; the
sampling module docstring states why the whole is exact.
"""

from __future__ import annotations

import functools

import numpy as np

_TWO_64 = float(2**64)
_U53 = 2.0**-53  # the unit roundoff of float64 (round to nearest)


def _one_minus(q: float) -> tuple[int, int]:
    """(c, b) with 1 - q = c / 2**b exactly (q is a binary float: q = a / 2**b)."""
    a, den = q.as_integer_ratio()
    return den - a, den.bit_length() - 1


def _ceil_shift(x: int, k: int) -> int:
    """ceil(x / 2**k) for x >= 0."""
    return -((-x) >> k)


@functools.lru_cache(maxsize=4096)
def _power_bounds(c: int, b: int, s: int, prec: int) -> tuple[int, int]:
    """(lo, hi) with lo / 2**prec <= (c / 2**b)**s <= hi / 2**prec, rigorously.

    Binary powering on fixed-point integers (value X / 2**prec), rounding every product
    down for `lo` and up for `hi`: all quantities are >= 0, so products of lower bounds are
    lower bounds. The width shrinks as `prec` grows (about s 2**-prec relative).
    """
    if prec >= b:
        base_lo = base_hi = c << (prec - b)
    else:
        base_lo, base_hi = c >> (b - prec), _ceil_shift(c, b - prec)
    lo = hi = 1 << prec
    while s:
        if s & 1:
            lo = (lo * base_lo) >> prec
            hi = _ceil_shift(hi * base_hi, prec)
        s >>= 1
        if s:
            base_lo = (base_lo * base_lo) >> prec
            base_hi = _ceil_shift(base_hi * base_hi, prec)
    return lo, hi


def _nearest_powers(c: int, b: int, t: int) -> list[float]:
    """[P_0, ..., P_t]: P_i is the float64 nearest to (c / 2**b)**(2**i) (ties to even).

    Integer bounds lo <= x <= hi by repeated squaring with directed rounding; when lo and
    hi round to the same float, so does x (rounding is monotone). Python's int / int is
    correctly rounded. If they differ the precision doubles: the bounds close in on x, and
    an x that is a float64 midpoint has few enough bits to be computed exactly.
    """
    prec = 2 * (b + t) + 128
    while prec <= 1 << 22:
        one = 1 << prec
        lo = hi = c << (prec - b)  # exact: prec > b
        out = []
        for i in range(t + 1):
            if i:
                lo, hi = (lo * lo) >> prec, _ceil_shift(hi * hi, prec)
            f_lo, f_hi = lo / one, hi / one
            if f_lo != f_hi:
                break
            out.append(f_lo)
        else:
            return out
        prec *= 2
    raise RuntimeError(f"could not round (1-q)**(2**i) to float64 for 1-q = {c}/2**{b}")  # pragma: no cover


def _margin(t: int) -> float:
    """4 (t + 2) 2**-53: twice a rigorous bound on the relative error of f.

    f is a product of at most t + 1 of the P_i (each within relative 2**-53 of its exact
    value) with at most t correctly rounded multiplications (relative error <= 2**-53
    each; no underflow: every partial product is >= min(1/4, 1 - q) >= 2**-53), so
    |f / p - 1| <= (1 + 2**-53)**(2t + 1) - 1 < (2t + 2) 2**-53 <= margin / 2. The other
    half covers the roundings of f (1 ± margin) in `_fast_thresholds`."""
    return 4 * (t + 2) * _U53


def _fast_thresholds(f: np.ndarray, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """(A, D), uint64 arrays: for the coin "U < p" with |f / p - 1| <= margin / 2 (see
    `_margin`) and U's first 64 bits W, W < A proves U < p and W > D proves U >= p.

    fl(f (1 - margin)) <= p (1 + margin/2)(1 - margin)(1 + 2**-53) <= p since margin >=
    8 2**-53, and likewise fl(f (1 + margin)) >= p. So
    A = floor(f (1 - margin) 2**64) <= p 2**64, so W < A gives U < (W + 1) / 2**64 <= p.
    D = ceil(f (1 + margin) 2**64) - 1, so W > D gives U >= W / 2**64 >= p; when that
    ceiling is 2**64 or more, D = 2**64 - 1 and W > D never holds. f <= 1, so
    f (1 - margin) < 1 and the casts are exact (floats >= 2**53 are integers).
    """
    lo = f * (1.0 - margin)
    hi = f * (1.0 + margin)
    a = (lo * _TWO_64).astype(np.uint64)  # truncation = floor (lo >= 0)
    c = np.ceil(hi * _TWO_64)
    d = np.where(c >= _TWO_64, 0.0, c).astype(np.uint64) - np.uint64(1)  # 0 - 1 wraps to 2**64 - 1
    return a, d
