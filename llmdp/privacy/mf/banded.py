"""Banded matrix factorization (BandMF): optimizing the coefficients of a b-banded
lower-triangular Toeplitz strategy C for a training workload.

Choquette-Choo et al. 2023, "Amplified banded matrix factorization: a unified approach to
private training" (NeurIPS 2023): a b-banded C with b <= min_sep keeps the columns of two
participations disjoint, so the (k, b)-min-sep sensitivity is sqrt(k)·(column norm) and,
with (cyclic) Poisson sampling of b-step blocks, the mechanism is amplified like DP-SGD
(their Thm. 4). McKenna 2024, "Scaling up the banded matrix factorization mechanism for
large scale differentially private ML", shows banded Toeplitz strategies are within <0.5%
of general banded ones for n >= 1000, b <= 32, and optimizes them directly; jax_privacy's
``toeplitz.optimize_banded_toeplitz`` is that optimizer. Here:

    minimize over c (c_0 = 1, c_j = 0 for j >= b):  sens(c)² · ‖A·C(c)⁻¹‖_F²

(scale-invariant, so c_0 = 1 loses nothing), in float64 by L-BFGS (torch) on the log of
the loss, gradients by autograd through an O(n·b) Toeplitz solve (`optimize`):

* Poisson sampling (``min_sep`` None): sens = the largest column norm = ‖c‖₂ (b <= n),
  i.e. the loss of the column-normalized c / ‖c‖ ("Poisson" rows of jax_privacy's tests).
  McKenna's column normalization also rescales the last b-1 (truncated) columns, which
  leaves the Toeplitz class; `Factorization` keeps C Toeplitz, so only ‖c‖ is divided out.
* (k, b)-min-sep participation, bands <= min_sep: sens² = Σ_{l<k} ‖C[:, l·b]‖² (exact for
  any signs, `sensitivity`).
* (k, b)-min-sep participation, bands > min_sep: c is restricted to non-negative,
  non-increasing sequences (c_j = Π_{i<=j} sigmoid(u_i)), where the pattern {0, b, 2b, ...}
  is the maximizer, so the optimized loss is the true one (not a bound).

Initialization: the truncated square-root factorization c_j = binom(2j, j)/4^j (Fichtenberger,
Henzinger & Upadhyay 2023; the optimal Toeplitz strategy for max error, Dvijotham et al.
2024), itself in the feasible set of all three cases. The result's ``scale`` is 1/sens, so
the sensitivity the analysis uses is 1. bands = 1 is C = I (DP-SGD).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from llmdp.config.choices import Mechanism
from llmdp.privacy.mf.factorization import Factorization, toeplitz_inverse
from llmdp.privacy.mf.sensitivity import (
    aligned_sum,
    effective_participations,
    minsep_sensitivity,
)
from llmdp.privacy.mf.workload import ERRORS, Workload, lbfgs, single_threaded, toeplitz_solve

__all__ = ["banded_loss", "optimize_banded", "sqrt_coefficients"]


def sqrt_coefficients(m: int) -> np.ndarray:
    """c_j = binom(2j, j) / 4^j, j < m: the Toeplitz square root of the prefix-sum matrix
    (C·C = S; generating function (1 - z)^(-1/2)), by c_j = c_{j-1}·(2j - 1)/(2j)."""
    j = np.arange(1, int(m))
    return np.concatenate([[1.0], np.cumprod((2 * j - 1) / (2 * j))])


def _setting(n: int, bands: int, min_sep, max_participations) -> tuple[int, str]:
    """(k, mode): mode "poisson" (largest column norm), "disjoint" (bands <= min_sep), or
    "monotone" (bands > min_sep: c restricted to non-negative non-increasing)."""
    if min_sep is None:
        if max_participations not in (None, 1):
            raise ValueError("max_participations needs min_sep (None: Poisson sampling, one "
                             "participation per release)")
        return 1, "poisson"
    k = effective_participations(n, int(min_sep), max_participations)
    if k == 1:
        return 1, "poisson"
    return k, ("disjoint" if bands <= int(min_sep) else "monotone")


def _sens_sq(c: torch.Tensor, n: int, k: int, mode: str, min_sep) -> torch.Tensor:
    if mode == "poisson":
        return torch.dot(c, c)
    if mode == "disjoint":
        b = c.shape[0]
        cum = torch.cumsum(c * c, 0)  # cum[m-1]: a column holding m of the coefficients
        held = [min(b, n - i * int(min_sep)) for i in range(k)]
        return cum[torch.tensor(held) - 1].sum()
    full = torch.cat([c, c.new_zeros(n - c.shape[0])])
    v = aligned_sum(full, int(min_sep), k)
    return torch.dot(v, v)


def banded_loss(c, n: int, *, workload: str = "prefix", momentum: float = 0.0,
                learning_rates=None, min_sep: int | None = None,
                max_participations: int | None = None, error: str = "mean") -> float:
    """sens² · ‖A·C⁻¹‖_F² (or · the largest row error, ``error`` "max") of the n×n Toeplitz C
    with coefficients ``c`` (numpy; sens from `sensitivity.minsep_sensitivity`, an upper
    bound where it is not exact)."""
    W = Workload.build(n, workload, momentum, learning_rates)
    c = np.asarray(c, dtype=np.float64)
    full = np.zeros(n)
    full[: min(n, c.size)] = c[:n]
    err = W.error_np(toeplitz_inverse(full), error)
    if min_sep is None:
        sens = minsep_sensitivity(full, n, 1, 1)[0]
    else:
        sens = minsep_sensitivity(full, n, min_sep, max_participations)[0]
    return sens * sens * err


def optimize_banded(n: int, bands: int, *, workload: str = "prefix", momentum: float = 0.0,
                    learning_rates=None, min_sep: int | None = None,
                    max_participations: int | None = None, error: str = "mean",
                    init=None, maxiter: int = 2000) -> Factorization:
    """The b-banded Toeplitz strategy minimizing sens² · ‖A·C⁻¹‖_F² (module docstring) for
    n steps: Poisson sampling (``min_sep`` None) or (k, b)-min-sep participation
    (``max_participations`` None: as many as the separation allows). ``error`` "max"
    minimizes the largest per-step error instead of the total (Toeplitz workloads).
    ``init``: starting coefficients (default: the truncated square root, normalized to
    c_0 = 1; non-negative non-increasing when bands > min_sep). Returns a "banded" `Factorization` with c_0 = 1 and ``scale`` = 1/sens."""
    n, bands = int(n), int(bands)
    if not 1 <= bands <= n:
        raise ValueError(f"bands must be in [1, n={n}], got bands={bands}")
    if error not in ERRORS:
        raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
    W = Workload.build(n, workload, momentum, learning_rates)
    k, mode = _setting(n, bands, min_sep, max_participations)
    e0 = torch.zeros(n, dtype=torch.float64)
    e0[0] = 1.0
    init = sqrt_coefficients(bands) if init is None else np.asarray(init, dtype=np.float64)
    if init.shape != (bands,) or not init[0] > 0:
        raise ValueError(f"init must be {bands} coefficients with c_0 > 0")
    init = init / init[0]

    if mode == "monotone":
        if np.any(init <= 0) or np.any(np.diff(init) > 0):
            raise ValueError("init must be positive and non-increasing when bands > min_sep")
        ratios = np.clip(init[1:] / init[:-1], 1e-12, 1 - 1e-12)
        x0 = np.log(ratios) - np.log1p(-ratios)  # logit

        def coeffs(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_ones(1), torch.cumprod(torch.sigmoid(x), 0)])
    else:
        x0 = init[1:].copy()

        def coeffs(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_ones(1), x])

    def objective(x: torch.Tensor) -> torch.Tensor:
        c = coeffs(x)
        r = toeplitz_solve(c, e0)
        return torch.log(_sens_sq(c, n, k, mode, min_sep)) + torch.log(W.error(r, error))

    start = time.perf_counter()
    with single_threaded():
        x, _, iterations = lbfgs(objective, x0, maxiter=maxiter)
    with torch.no_grad():
        c = coeffs(torch.from_numpy(x)).numpy().copy()
    seconds = time.perf_counter() - start

    full = np.zeros(n)
    full[:bands] = c
    if mode == "poisson":
        sens, exact = minsep_sensitivity(full, n, 1, 1)
    else:
        sens, exact = minsep_sensitivity(full, n, int(min_sep), k)
    err = W.error_np(toeplitz_inverse(full), error)
    mean_err = err if error == "mean" else W.error_np(toeplitz_inverse(full), "mean")
    meta = {
        **W.key(),
        "mechanism": Mechanism.BANDED_MF.value,
        "bands": bands,
        "participation": "poisson" if min_sep is None else "min-sep",
        "min_sep": None if min_sep is None else int(min_sep),
        "max_participations": None if max_participations is None else int(max_participations),
        "participations": k,
        "error": error,
        "loss": sens * sens * err,
        "rmse": math.sqrt(sens * sens * mean_err / n),
        "sensitivity_exact": bool(exact),
        "seconds": seconds,
        "iterations": int(iterations),
    }
    return Factorization(kind="banded", steps=n, scale=1.0 / sens,
                         coefficients=tuple(float(v) for v in c), meta=meta)
