"""The correlated-noise strategies' objective: the workload, the differentiable Toeplitz
solve, the optimizer driver and the RMSE figure of merit (`banded`, `blt` and
`optimize` build on it).


The objective (Choquette-Choo et al. 2023, "Amplified banded matrix factorization: a
unified approach to private training", NeurIPS 2023; McMahan, Pillutla et al. 2025,
"Correlated noise mechanisms for differentially private learning"): the model after
step t is row t of A·G; with the release C·G + Z (Z ~ N(0, σ²·sens²·I)), its noise is
A·C⁻¹·Z, so the expected total squared error is σ²·sens(C)²·‖A·C⁻¹‖_F², invariant to the
scale of C. Workload A (``Workload``): SGD with momentum β and learning rates η_t,
θ_t = θ_0 - Σ_{i<=t} η_i·m_i, m_i = β·m_{i-1} + g_i, i.e. A[t, j] = Σ_{i=j..t} η_i·β^(i-j),
A = S·diag(η)·M (S the prefix-sum matrix, M Toeplitz with coefficients β^d); β = 0 and
η = 1 is the prefix-sum workload. For a Toeplitz C⁻¹ with coefficients r:

* constant η (Toeplitz A): A·C⁻¹ is Toeplitz with coefficients h = η·cumsum(M·r), so
  ‖A·C⁻¹‖_F² = Σ_m (n-m)·h_m² and the largest row error is Σ_m h_m² (the last row). O(n)
  (plus O(n) for the momentum filter M·r).
* a learning-rate schedule: with q = M·r, Q = Toeplitz(q), ‖S·D·Q‖_F² = tr(K·QQᵀ) for
  K = D·SᵀS·D (K_ab = η_a·η_b·(n - max(a, b))), and QQᵀ is the diagonal-wise cumulative sum
  of q·qᵀ, so ‖A·C⁻¹‖_F² = qᵀ·W·q with W_ab = Σ_{s>=0} K_{a+s, b+s}: one O(n²) matrix built
  once per workload, one O(n²) mat-vec per evaluation.

`rmse` reports sqrt(sens²·‖A·C⁻¹‖_F² / n) (noise per unit σ in the average step, for
DP-SGD too: `rmse_identity`); `rmse_dense` computes it from dense matrices (tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math

import numpy as np
import scipy.linalg
import scipy.signal
import torch

from llmdp.privacy.mf.factorization import Factorization, toeplitz_matrix
from llmdp.privacy.mf.sensitivity import effective_participations, minsep_sensitivity

__all__ = [
    "ERRORS",
    "Workload",
    "lbfgs",
    "rmse",
    "rmse_dense",
    "rmse_identity",
    "single_threaded",
    "toeplitz_solve",
]

ERRORS = ("mean", "max")
_SCHEDULE_MAX_N = 8192  # the schedule workload's W is n×n float64


# ---- the Toeplitz solve, differentiable
class _LowerToeplitzSolve(torch.autograd.Function):
    """y = T(a)⁻¹·x for the lower-triangular Toeplitz T(a) (a_0 != 0), by recursion
    (scipy.signal.lfilter: O(n·len(a))). Adjoint: x̄ = T⁻ᵀ·ȳ = J·T⁻¹·J·ȳ (J reverses:
    J·Tᵀ·J = T) and ā_j = -Σ_t x̄_t·y_{t-j} (from dy = -T⁻¹·dT·y)."""

    @staticmethod
    def forward(ctx, a, x):
        a_np = a.detach().numpy()
        y = torch.from_numpy(scipy.signal.lfilter([1.0], a_np, x.detach().numpy()))
        ctx.save_for_backward(a, y)
        return y

    @staticmethod
    def backward(ctx, g):
        a, y = ctx.saved_tensors
        a_np, y_np = a.numpy(), y.numpy()
        lam = scipy.signal.lfilter([1.0], a_np, g.numpy()[::-1])[::-1].copy()
        grad_a = None
        if ctx.needs_input_grad[0]:
            n, b = y_np.size, a_np.size
            m = min(n, b)  # lags >= n do not reach y
            if m <= 64:
                ga = np.array([np.dot(lam[j:], y_np[: n - j]) for j in range(m)])
            elif n * m <= 5e7:
                ga = np.convolve(lam, y_np[::-1])[n - 1 : n - 1 + m]
            else:
                ga = scipy.signal.fftconvolve(lam, y_np[::-1])[n - 1 : n - 1 + m]
            grad_a = torch.from_numpy(-np.concatenate([ga, np.zeros(b - m)]))
        grad_x = torch.from_numpy(lam) if ctx.needs_input_grad[1] else None
        return grad_a, grad_x


def toeplitz_solve(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """T(a)⁻¹·x (float64 torch, differentiable in both): with x = e_0, the coefficients of
    the inverse of the Toeplitz matrix of ``a``."""
    return _LowerToeplitzSolve.apply(a, x)


# ---- the workload
@dataclasses.dataclass(frozen=True)
class Workload:
    """A = S·diag(η)·M (module docstring): ``n`` steps, momentum β in [0, 1), learning rates
    η (None: all 1; a constant schedule is Toeplitz, a varying one costs O(n²))."""

    n: int
    momentum: float = 0.0
    learning_rates: tuple | None = None

    @classmethod
    def build(cls, n: int, workload: str = "prefix", momentum: float = 0.0,
              learning_rates=None) -> Workload:
        if workload != "prefix":
            raise ValueError(f"workload must be 'prefix' (SGD: prefix sums of the gradients, "
                             f"with momentum and learning_rates), got {workload!r}")
        n = int(n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got n={n}")
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if learning_rates is not None:
            learning_rates = tuple(float(v) for v in learning_rates)
            if len(learning_rates) != n:
                raise ValueError(f"learning_rates needs one value per step ({n}), got "
                                 f"{len(learning_rates)}")
            if not all(math.isfinite(v) and v > 0 for v in learning_rates):
                raise ValueError("learning_rates must be finite and > 0")
            if n > _SCHEDULE_MAX_N and len(set(learning_rates)) > 1:
                raise ValueError(f"a varying learning-rate schedule is supported up to "
                                 f"n={_SCHEDULE_MAX_N} steps (an n×n objective), got n={n}")
        return cls(n, momentum, learning_rates)

    @property
    def toeplitz(self) -> bool:
        return self.learning_rates is None or len(set(self.learning_rates)) == 1

    @property
    def eta(self) -> np.ndarray:
        return np.ones(self.n) if self.learning_rates is None else np.array(self.learning_rates)

    def key(self) -> dict:
        """Its identity as JSON values (the cache key; the learning rates by their digest)."""
        lr = None
        if self.learning_rates is not None:
            lr = hashlib.sha256(json.dumps(list(self.learning_rates)).encode()).hexdigest()
        return {"workload": "prefix", "momentum": self.momentum, "learning_rates": lr}

    def matrix(self) -> np.ndarray:
        """Dense A (tests, small n)."""
        n = self.n
        M = toeplitz_matrix(self.momentum ** np.arange(n, dtype=np.float64))
        return np.tril(np.ones((n, n))) @ (self.eta[:, None] * M)

    @functools.cached_property
    def _gram(self) -> torch.Tensor:
        """W with ‖S·D·Q‖_F² = qᵀ·W·q (module docstring): W_ab = K_ab + W_{a+1, b+1}, built
        in one n×n array (upper triangle by rows from the last, then mirrored)."""
        n, eta = self.n, self.eta
        W = np.zeros((n, n))
        for a in range(n - 1, -1, -1):
            W[a, a:] = eta[a] * eta[a:] * (n - np.arange(a, n))  # K_ab, b >= a
            if a + 1 < n:
                W[a, a:n - 1] += W[a + 1, a + 1:]  # + W[a+1, b+1], b = a..n-2
        for a in range(n - 1):
            W[a + 1:, a] = W[a, a + 1:]
        return torch.from_numpy(W)

    def error(self, r: torch.Tensor, kind: str = "mean") -> torch.Tensor:
        """‖A·C⁻¹‖_F² ("mean": the total squared error, σ = sens = 1) or the largest row's
        squared norm ("max"), for C⁻¹ with Toeplitz coefficients ``r`` (torch float64, length
        n, differentiable)."""
        if kind not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {kind!r}")
        q = r
        if self.momentum:
            q = toeplitz_solve(r.new_tensor([1.0, -self.momentum]), r)  # q = M·r
        if self.toeplitz:
            h = torch.cumsum(q, 0) * float(self.eta[0])
            if kind == "max":
                return torch.dot(h, h)
            weights = torch.arange(self.n, 0, -1, dtype=torch.float64)
            return torch.dot(weights, h * h)
        if kind == "max":
            raise NotImplementedError("the max error of a varying learning-rate schedule is "
                                      "not implemented; use error='mean'")
        return torch.dot(q, self._gram @ q)

    def error_np(self, r: np.ndarray, kind: str = "mean") -> float:
        with torch.no_grad():
            return float(self.error(torch.from_numpy(np.asarray(r, dtype=np.float64)), kind))


# ---- the optimizer driver
@contextlib.contextmanager
def single_threaded():
    """torch on one intra-op thread for the duration (restored after): the objectives are
    small vector ops, and idle OpenMP threads spinning beside the BLAS threads of the numpy
    / scipy calls made them several times slower on a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lbfgs(objective, x0: np.ndarray, *, maxiter: int = 1000, gtol: float = 1e-9,
          ftol: float = 1e-12) -> tuple[np.ndarray, float, int]:
    """Minimize ``objective`` (torch float64 vector -> scalar tensor) from x0 by L-BFGS
    (torch.optim.LBFGS, strong-Wolfe line search, gradients by autograd, float64; pure
    torch, so no BLAS thread pool contends with torch's on small machines): (x, value,
    iterations). It stops when the largest |gradient| < ``gtol``, a step changes the value
    or the point by < ``ftol``, or after ``maxiter`` iterations. A non-finite value is
    reported as a huge one so the line search backs off."""
    x = torch.tensor(np.asarray(x0, dtype=np.float64), requires_grad=True)
    if x.numel() == 0:
        with torch.no_grad():
            return x.detach().numpy().copy(), float(objective(x)), 0
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=int(maxiter), max_eval=int(maxiter) * 2,
                            tolerance_grad=gtol, tolerance_change=ftol, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = objective(x)
        if not torch.isfinite(value):
            value = x.sum() * 0.0 + 1e100
        value.backward()
        if not torch.all(torch.isfinite(x.grad)):
            x.grad.zero_()
        return value

    opt.step(closure)
    iterations = int(opt.state[x].get("n_iter", 0))
    with torch.no_grad():
        value = float(objective(x))
    return x.detach().numpy().copy(), value, iterations


# ---- figures of merit
def _sensitivity(fact_or_coeffs, n: int, min_sep, max_participations) -> float:
    if min_sep is None:
        if max_participations not in (None, 1):
            raise ValueError("max_participations needs min_sep (None: Poisson sampling, "
                             "one participation per release)")
        return minsep_sensitivity(fact_or_coeffs, n, 1, 1)[0]
    return minsep_sensitivity(fact_or_coeffs, n, min_sep, max_participations)[0]


def rmse(fact: Factorization, *, workload: str = "prefix", momentum: float = 0.0,
         learning_rates=None, min_sep: int | None = None,
         max_participations: int | None = None, n: int | None = None) -> float:
    """sqrt(sens² · ‖A·C⁻¹‖_F² / n): the root-mean-square noise of the model iterates per
    unit noise multiplier σ (scale-invariant). sens: the largest column norm (``min_sep``
    None, Poisson sampling) or the (k, b)-min-sep sensitivity (an upper bound where it is
    not exact, `sensitivity`)."""
    n = fact.steps if n is None else int(n)
    W = Workload.build(n, workload, momentum, learning_rates)
    err = W.error_np(fact.inverse_coefficients(n))
    sens = _sensitivity(fact, n, min_sep, max_participations)
    return math.sqrt(sens * sens * err / n)


def rmse_identity(n: int, *, workload: str = "prefix", momentum: float = 0.0,
                  learning_rates=None, min_sep: int | None = None,
                  max_participations: int | None = None) -> float:
    """`rmse` of DP-SGD (C = I) in the same setting, for comparison."""
    ident = Factorization(kind="banded", steps=int(n), coefficients=(1.0,))
    return rmse(ident, workload=workload, momentum=momentum, learning_rates=learning_rates,
                min_sep=min_sep, max_participations=max_participations)


def rmse_dense(fact: Factorization, *, workload: str = "prefix", momentum: float = 0.0,
               learning_rates=None, min_sep: int | None = None,
               max_participations: int | None = None, n: int | None = None) -> float:
    """`rmse` from dense matrices (tests, small n): A built entry by entry, A·C⁻¹ by a
    triangular solve, the sensitivity from CᵀC on the pattern {0, b, 2b, ...} (the maximizer
    when CᵀC >= 0 has the monotone structure, `sensitivity`) or the largest column norm."""
    n = fact.steps if n is None else int(n)
    W = Workload.build(n, workload, momentum, learning_rates)
    eta = W.eta
    A = np.zeros((n, n))
    for t in range(n):
        for j in range(t + 1):
            A[t, j] = sum(eta[i] * W.momentum ** (i - j) for i in range(j, t + 1))
    C = toeplitz_matrix(fact.c_coefficients(n))
    B = scipy.linalg.solve_triangular(C.T, A.T, lower=False).T  # B·C = A
    if min_sep is None:
        sens_sq = float(np.max(np.sum(C * C, axis=0)))
    else:
        k = effective_participations(n, min_sep, max_participations)
        P = np.arange(k) * int(min_sep)
        sens_sq = float((C.T @ C)[np.ix_(P, P)].sum())
    return math.sqrt(sens_sq * float(np.sum(B * B)) / n)
