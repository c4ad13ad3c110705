"""Buffered linear Toeplitz (BLT) strategies: the closed forms linking a BLT C and its inverse,
and the optimizer over the pair of decay vectors (θ for C, θ̂ for C⁻¹).

A BLT with d buffers (Dvijotham, McMahan, Pillutla, Steinke & Thakurta 2024, "Efficient and
near-optimal noise generation for streaming differential privacy", arXiv:2404.16706;
`mf.Factorization` kind "blt") is the lower-triangular Toeplitz C with c_0 = 1,
c_k = Σ_i ω_i·θ_i^(k-1), i.e. the generating function

    C(z) = 1 + Σ_i ω_i·z / (1 - θ_i·z) = Π_j (1 - θ̂_j·z) / Π_j (1 - θ_j·z),            (1)

a degree-(d, d) rational function; C⁻¹(z) = 1/C(z) swaps the roles, so C⁻¹ is a BLT with
decays θ̂ and (streaming) d buffers. Partial fractions of (1) at z = 1/θ_i give (their
Lemma 5.2; McMahan & Pillutla 2025, "An inversion theorem for buffered linear Toeplitz (BLT)
matrices and applications to streaming differential privacy", arXiv:2504.21413, Thm. 2;
jax_privacy ``buffered_toeplitz.blt_pair_from_theta_pair``)

    ω_i = θ_i·Π_j (1 - θ̂_j/θ_i) / Π_{j≠i} (1 - θ_j/θ_i) = Π_j (θ_i - θ̂_j) / Π_{j≠i} (θ_i - θ_j),
    ω̂_i = Π_j (θ̂_i - θ_j) / Π_{j≠i} (θ̂_i - θ̂_j).                                          (2)

Feasible set. jax_privacy's optimizer keeps θ, θ̂ in (0, 1), ω > 0, ω̂ < 0 by log-barriers
(their ``LossFn.compute_penalties``): then c is positive and non-increasing, so the min-sep
sensitivity has its exact closed form (`sensitivity`). That set is exactly the
interlacing 1 > θ_1 > θ̂_1 > θ_2 > θ̂_2 > ... > θ_d > θ̂_d > 0: with ω > 0, w ↦ Σ ω_i/(w - θ_i)
falls from +∞ to -∞ between consecutive θ's, so each interval holds one zero 1/θ̂ of (1)
(where the sum is -1), none lies above θ_1, and the last one lies below θ_d, in (0, θ_d) iff
Σ ω_i/θ_i < 1 (jax_privacy's "Pillutla score"); conversely interlacing makes the signs in (2)
ω > 0, ω̂ < 0, and c_1 = Σ ω_i = Σ θ_i - Σ θ̂_i < θ_1 < 1 = c_0. So the optimizer here
parameterizes the interlaced sequence directly by its 2d + 1 gaps g = softmax(u) (1 - θ_1,
θ_1 - θ̂_1, ..., θ̂_d - 0): every iterate is feasible, the differences in (2) are sums of
gaps (no cancellation, decays near 1 keep their precision), and a vanishing log-barrier
-μ·Σ log g_j (μ = 1e-12) keeps the decays distinct.

Loss (Dvijotham et al. 2024, "Opt-BLT"; McMahan, Pillutla et al. 2025, "Correlated noise
mechanisms for differentially private learning"): sens² · ‖A·C⁻¹‖_F² with the
(k, b)-min-sep sensitivity, from the first n coefficients of C and C⁻¹ (O(n·d)) and the
workload objective of `optimize` (O(n) for Toeplitz workloads), in float64, minimized
by L-BFGS on its log. Buffers are added one at a time from d = 1 (a grid start; d + 1 warm
starts by splitting one gap of the d-buffer optimum into a close (θ, θ̂) pair, or by a new
pair near 1, θ = 1 - 1e-9 and θ̂ = 1 - q/n, each start tried briefly, the best continued)
while the loss improves by >= 0.1%, as jax_privacy's ``buffered_toeplitz.optimize`` grows
num_buffers; typically 3-7 buffers. The pair near 1 matters: the optimum can put θ_1 at
1 (a constant tail in c), which no split of the leading gap reaches (n = 256, min_sep =
32, k = 8, max error: 1.1% worse without it).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from llmdp.config.choices import Mechanism
from llmdp.privacy.mf.factorization import Factorization
from llmdp.privacy.mf.sensitivity import aligned_sum, effective_participations, minsep_sensitivity
from llmdp.privacy.mf.workload import ERRORS, Workload, lbfgs, single_threaded

__all__ = ["blt_factorization", "blt_omegas", "optimize_blt"]

_BARRIER = 1e-12
_RTOL = 1e-3  # add a buffer while it improves the loss by at least this fraction
# a gap split in three, the middle one the new pair's gap: a visible pair, and one that
# nearly cancels in (1) (C almost unchanged: the d-buffer loss is a start for d + 1)
_SPLITS = ((0.45, 0.1, 0.45), (0.5, 1e-6, 0.5 - 1e-6))
# a new pair near 1: 1 - θ = 1e-9 and 1 - θ̂ = q/n (the optimum can sit at θ -> 1: a
# constant tail in c, e.g. n = 256, min_sep = 32, k = 8, max error)
_NEAR_ONE_GAP = 1e-9
_NEAR_ONE = (0.2, 1.0)


def blt_omegas(theta, theta_hat) -> tuple[np.ndarray, np.ndarray]:
    """(ω, ω̂) of Eq. (2) for distinct decays θ (C) and θ̂ (C⁻¹), float64."""
    th = np.asarray(theta, dtype=np.float64)
    hat = np.asarray(theta_hat, dtype=np.float64)
    if th.shape != hat.shape or th.ndim != 1:
        raise ValueError("theta and theta_hat must be vectors of equal length")

    def residues(a, b):
        num = np.prod(a[:, None] - b[None, :], axis=1)
        diff = a[:, None] - a[None, :]
        np.fill_diagonal(diff, 1.0)
        return num / np.prod(diff, axis=1)

    return residues(th, hat), residues(hat, th)


def blt_factorization(theta, theta_hat, n: int, *, scale: float = 1.0,
                      meta: dict | None = None) -> Factorization:
    """The "blt" `Factorization` of decays θ, θ̂ (ω, ω̂ by Eq. (2)), decays sorted
    descending."""
    th = np.sort(np.asarray(theta, dtype=np.float64))[::-1]
    hat = np.sort(np.asarray(theta_hat, dtype=np.float64))[::-1]
    om, om_hat = blt_omegas(th, hat)
    return Factorization(kind="blt", steps=int(n), scale=scale, theta=tuple(th),
                         omega=tuple(om), theta_hat=tuple(hat), omega_hat=tuple(om_hat),
                         meta=dict(meta or {}))


class _Interlaced:
    """logits u (2d + 1) -> the interlaced decays and Eq. (2), differentiable (torch)."""

    def __init__(self, d: int):
        self.d = d
        p = 2 * d
        idx = torch.arange(p)
        j = torch.arange(p + 1)
        fwd = (idx[:, None, None] < j) & (j <= idx[None, :, None])
        bwd = (idx[None, :, None] < j) & (j <= idx[:, None, None])
        self.mask = fwd.to(torch.float64) - bwd.to(torch.float64)  # D[p, q] = x_p - x_q
        self.eye = torch.eye(d, dtype=torch.float64)

    def decays(self, u: torch.Tensor):
        """(θ, θ̂, log θ, log θ̂, ω, ω̂, log g)."""
        logg = torch.log_softmax(u, 0)
        g = torch.exp(logg)
        x = torch.flip(torch.cumsum(torch.flip(g, [0]), 0), [0])[1:]  # x_p = Σ_{j>p} g_j
        one_minus = torch.cumsum(g, 0)[:-1]  # 1 - x_p = Σ_{j<=p} g_j
        near_one = one_minus < 0.5
        logx = torch.where(near_one, torch.log1p(-torch.clamp(one_minus, max=0.5)),
                           torch.log(torch.clamp(x, min=1e-300, max=0.5)))
        D = self.mask @ g
        t, h = slice(0, None, 2), slice(1, None, 2)
        om = torch.prod(D[t, h], 1) / torch.prod(D[t, t] + self.eye, 1)
        om_hat = torch.prod(D[h, t], 1) / torch.prod(D[h, h] + self.eye, 1)
        return x[t], x[h], logx[t], logx[h], om, om_hat, logg

    @staticmethod
    def coefficients(logdecay: torch.Tensor, om: torch.Tensor, n: int) -> torch.Tensor:
        """1, Σ ω θ^0, Σ ω θ^1, ...: n Toeplitz coefficients, O(n·d)."""
        m = torch.arange(max(n - 1, 0), dtype=torch.float64)
        # exponents clamped at -700: exp stays a normal float (denormals are slow on CPUs),
        # and terms below 1e-304 change nothing
        powers = torch.exp(torch.clamp(logdecay[:, None] * m[None, :], min=-700.0))
        return torch.cat([om.new_ones(1), om @ powers])[:n]


def _logits(gaps) -> np.ndarray:
    g = np.asarray(gaps, dtype=np.float64)
    return np.log(g / g.sum())


def _grid_start(objective, n: int) -> np.ndarray:
    """The best 1-buffer start on a grid of (1 - θ, θ̂/θ)."""
    best, best_u = math.inf, None
    for lead in np.geomspace(0.05 / n, 0.5, 15):
        theta = 1.0 - lead
        for frac in (0.05, 0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.96, 0.98, 0.99, 0.995):
            hat = theta * frac
            u = _logits([lead, theta - hat, hat])
            with torch.no_grad():
                v = float(objective(torch.from_numpy(u)))
            if math.isfinite(v) and v < best:
                best, best_u = v, u
    return best_u


def _grow(u: np.ndarray, n: int) -> list[np.ndarray]:
    """Starts for d + 1 buffers: each gap of the d-buffer optimum split into three (the
    middle one a close (θ, θ̂) pair, so C changes little or not at all); and a new pair
    near 1 (θ = 1 - 1e-9, θ̂ = 1 - q/n for each q of ``_NEAR_ONE``, below half the leading
    gap): a decay whose time constant exceeds n, which a split of the leading gap does
    not reach."""
    g = np.exp(u - u.max())
    g /= g.sum()
    starts = []
    for j in range(g.size):
        for split in _SPLITS:
            parts = [g[j] * s for s in split]
            starts.append(_logits(np.concatenate([g[:j], parts, g[j + 1:]])))
    for hat_gap in sorted({min(q / n, 0.5 * g[0]) for q in _NEAR_ONE}):
        if hat_gap > 2 * _NEAR_ONE_GAP:  # else θ_1 is already that close to 1
            parts = [_NEAR_ONE_GAP, hat_gap - _NEAR_ONE_GAP, g[0] - hat_gap]
            starts.append(_logits(np.concatenate([parts, g[1:]])))
    return starts


def _grow_buffers(objective_for, n: int, min_buffers: int, max_buffers: int, maxiter: int):
    """d = 1, 2, ...: optimize, keep the best d >= min_buffers, stop when a buffer more
    gains < 0.1%. Returns ((log loss, d, logits), {d: loss}, total L-BFGS iterations)."""
    iterations = 0
    losses: dict[int, float] = {}
    best = None
    u = _grid_start(objective_for(1), n)
    for d in range(1, max_buffers + 1):
        objective = objective_for(d)
        if d > 1:
            trials = []
            for s in _grow(u, n):
                x, v, it = lbfgs(objective, s, maxiter=30)
                iterations += it
                trials.append((v, x))
            u = min(trials, key=lambda t: t[0])[1]
        u, value, it = lbfgs(objective, u, maxiter=maxiter)
        iterations += it
        losses[d] = math.exp(value)
        if d < min_buffers:
            continue
        if best is not None and not value < best[0] + math.log1p(-_RTOL):
            break
        best = (value, d, u)
    return best, losses, iterations


def optimize_blt(n: int, *, max_buffers: int = 8, min_sep: int = 1,
                 max_participations: int | None = 1, workload: str = "prefix",
                 momentum: float = 0.0, learning_rates=None, error: str = "mean",
                 min_buffers: int = 1, maxiter: int = 1000) -> Factorization:
    """The BLT strategy minimizing sens² · ‖A·C⁻¹‖_F² (module docstring) over n steps for
    (k, b)-min-sep participation (k = ``max_participations``, None: as many as the separation
    allows; k = 1 is single participation / Poisson sampling: the largest column norm), with
    between ``min_buffers`` and ``max_buffers`` buffers (more only while the loss improves by
    >= 0.1%). ``error`` "max": the largest per-step error instead of the total. The result's
    ``scale`` is 1/sens; meta: loss, rmse, seconds, iterations, buffers, and the loss at
    each number of buffers tried."""
    n = int(n)
    if n < 2:
        raise ValueError(f"a BLT needs n >= 2 steps, got n={n}")
    if not 1 <= int(min_buffers) <= int(max_buffers) <= 15:
        raise ValueError(f"need 1 <= min_buffers <= max_buffers <= 15, got {min_buffers}, "
                         f"{max_buffers} (3-7 buffers are typical; many more are numerically "
                         "fragile)")
    if error not in ERRORS:
        raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
    W = Workload.build(n, workload, momentum, learning_rates)
    min_sep = int(min_sep)
    k = effective_participations(n, min_sep, max_participations)
    models = {}

    def objective_for(d: int):
        model = models.setdefault(d, _Interlaced(d))

        def objective(u: torch.Tensor) -> torch.Tensor:
            _, _, lt, lh, om, om_hat, logg = model.decays(u)
            c = model.coefficients(lt, om, n)
            r = model.coefficients(lh, om_hat, n)
            v = aligned_sum(c, min_sep, k)
            return (torch.log(torch.dot(v, v)) + torch.log(W.error(r, error))
                    - _BARRIER * logg.sum())

        return objective

    start = time.perf_counter()
    with single_threaded():
        best, losses, iterations = _grow_buffers(objective_for, n, int(min_buffers),
                                                 int(max_buffers), maxiter)
    seconds = time.perf_counter() - start

    _, d, u = best
    with torch.no_grad():
        th, hat, _, _, om, om_hat, _ = models[d].decays(torch.from_numpy(u))
    if not (float(th.max()) < 1.0 and float(hat.min()) > 0.0):
        raise RuntimeError(f"BLT optimization left the feasible set: theta={th.tolist()}, "
                           f"theta_hat={hat.tolist()}")
    fact = Factorization(kind="blt", steps=n, theta=tuple(th.tolist()), omega=tuple(om.tolist()),
                         theta_hat=tuple(hat.tolist()), omega_hat=tuple(om_hat.tolist()))
    sens, exact = minsep_sensitivity(fact, n, min_sep, k)
    err = W.error_np(fact.inverse_coefficients(n), error)
    mean_err = err if error == "mean" else W.error_np(fact.inverse_coefficients(n), "mean")
    meta = {
        **W.key(),
        "mechanism": Mechanism.BLT.value,
        "bands": None,
        "buffers": d,
        "participation": "min-sep",
        "min_sep": min_sep,
        "max_participations": None if max_participations is None else int(max_participations),
        "participations": k,
        "error": error,
        "loss": sens * sens * err,
        "rmse": math.sqrt(sens * sens * mean_err / n),
        "sensitivity_exact": bool(exact),
        "losses_by_buffers": {str(b): v for b, v in losses.items()},
        "seconds": seconds,
        "iterations": int(iterations),
    }
    return Factorization(kind="blt", steps=n, scale=1.0 / sens, theta=fact.theta,
                         omega=fact.omega, theta_hat=fact.theta_hat,
                         omega_hat=fact.omega_hat, meta=meta)
