"""Correlated noise by matrix factorization: the `Factorization` value (the strategy C) and
the Toeplitz arithmetic every other ``mf_*`` module shares.

Training as a workload (DP-fy building blocks, "Beyond DP-SGD: correlated noise"): the
model after step t is a linear function of the gradients, X = A·G (A the T×T prefix-sum
workload, or its momentum / learning-rate-schedule variant). Factor A = B·C, release
C·G + Z (Z i.i.d. Gaussian) and feed the optimizer Ĝ = C⁻¹(C·G + Z) = G + C⁻¹Z: step t's
noise is row t of C⁻¹Z, and the model sees A·G + B·Z, noise that partly cancels across
steps. The privacy cost is that of releasing C·G + Z, so it depends on C's column norms
(one participation per band, `sensitivity`), and the error is ‖B‖_F = ‖A·C⁻¹‖_F.

llmdp's strategies are lower-triangular **Toeplitz** matrices, so one coefficient sequence
c_0, c_1, ... describes C (C[i, j] = c_{i−j} for i ≥ j) and C⁻¹ is Toeplitz too:

* ``"banded"`` (banded MF): c_k = 0 for k ≥ b (``coefficients`` = c_0..c_{b−1}).
* ``"blt"`` (buffered linear Toeplitz): c_0 = 1, c_k = Σ_i ω_i θ_i^(k−1) for k ≥ 1, and
  C⁻¹ is BLT with (θ̂, ω̂), so C⁻¹Z streams with one buffer per θ̂_i.

A `Factorization` is frozen and exact: what was optimized is what is recorded (its
`digest` in the ledger), streamed (`stream`) and accounted (`sensitivity`).
``scale`` multiplies C (the optimizers choose it so that the sensitivity the analysis uses
is 1, which makes the plan's noise multiplier σ the mechanism's effective one); the noise
a step adds is then (scale·C)⁻¹Z = C⁻¹Z / scale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Factorization", "KINDS", "toeplitz_inverse", "toeplitz_matrix"]

KINDS = ("banded", "blt")


def _floats(name: str, values) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be finite numbers, got {values!r}")
    return out


@dataclass(frozen=True)
class Factorization:
    """The encoder C of a Toeplitz factorization, exactly (float64 values).

    ``kind`` "banded": ``coefficients`` = (c_0, ..., c_{b−1}), c_0 > 0; ``bands`` = b.
    ``kind`` "blt": ``theta``, ``omega`` (C's buffers), ``theta_hat``, ``omega_hat`` (C⁻¹'s),
    equal lengths (the number of buffers), each θ in [0, 1).
    ``steps``: the horizon T it was optimized for. ``scale``: C's multiplier (> 0).
    ``meta``: how it was obtained (workload, participation, loss, optimizer wall time; JSON
    values), not part of its identity.
    """

    kind: str
    steps: int
    scale: float = 1.0
    coefficients: tuple = ()
    theta: tuple = ()
    omega: tuple = ()
    theta_hat: tuple = ()
    omega_hat: tuple = ()
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Factorization kind must be one of {KINDS}, got kind={self.kind!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got steps={self.steps!r}")
        if not (isinstance(self.scale, (int, float)) and 0 < self.scale < math.inf):
            raise ValueError(f"scale must be a finite number > 0, got scale={self.scale!r}")
        for name in ("coefficients", "theta", "omega", "theta_hat", "omega_hat"):
            object.__setattr__(self, name, _floats(name, getattr(self, name)))
        object.__setattr__(self, "scale", float(self.scale))
        if self.kind == "banded":
            if not self.coefficients or self.coefficients[0] <= 0:
                raise ValueError("a banded factorization needs coefficients c_0..c_{b-1} with "
                                 f"c_0 > 0, got {self.coefficients!r}")
            if self.theta or self.omega or self.theta_hat or self.omega_hat:
                raise ValueError("a banded factorization has no BLT buffers (theta, omega, ...)")
        else:
            n = len(self.theta)
            if self.coefficients:
                raise ValueError("a BLT factorization is given by theta, omega, theta_hat, "
                                 "omega_hat, not coefficients")
            if not (len(self.omega) == len(self.theta_hat) == len(self.omega_hat) == n):
                raise ValueError("BLT theta, omega, theta_hat, omega_hat must have one entry "
                                 f"per buffer, got lengths {len(self.theta)}, {len(self.omega)}, "
                                 f"{len(self.theta_hat)}, {len(self.omega_hat)}")
            if not all(0 <= x < 1 for x in self.theta + self.theta_hat):
                raise ValueError(f"BLT decays must be in [0, 1), got theta={self.theta!r}, "
                                 f"theta_hat={self.theta_hat!r}")

    # ---- what it is
    @property
    def bands(self) -> int | None:
        """b for a banded strategy (C has b non-zero diagonals), None for BLT."""
        return len(self.coefficients) if self.kind == "banded" else None

    @property
    def buffers(self) -> int | None:
        """The number of BLT buffers (the streaming state's size in units of d), None if banded."""
        return len(self.theta) if self.kind == "blt" else None

    def c_coefficients(self, n: int | None = None) -> np.ndarray:
        """The first ``n`` (default `steps`) Toeplitz coefficients of scale·C, float64."""
        n = self.steps if n is None else int(n)
        if self.kind == "banded":
            c = np.zeros(n)
            m = min(n, len(self.coefficients))
            c[:m] = self.coefficients[:m]
        else:
            c = _blt_coefficients(self.theta, self.omega, n)
        return self.scale * c

    def inverse_coefficients(self, n: int | None = None) -> np.ndarray:
        """The first ``n`` Toeplitz coefficients of (scale·C)⁻¹, float64 (BLT: from θ̂, ω̂;
        banded: by forward substitution)."""
        n = self.steps if n is None else int(n)
        if self.kind == "blt":
            return _blt_coefficients(self.theta_hat, self.omega_hat, n) / self.scale
        return toeplitz_inverse(self.c_coefficients(n))

    # ---- identity
    def identity(self) -> dict:
        """The values that define it (no ``meta``): canonical, JSON-able."""
        d = dataclasses.asdict(self)
        d.pop("meta")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of `identity` (floats by their repr: exact)."""
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict:
        return {**self.identity(), "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict) -> Factorization:
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


def _blt_coefficients(theta, omega, n: int) -> np.ndarray:
    """1, Σ_i ω_i θ_i^0, Σ_i ω_i θ_i^1, ...: the first n coefficients of a BLT matrix."""
    c = np.zeros(n)
    if n:
        c[0] = 1.0
    k = np.arange(max(0, n - 1), dtype=np.float64)
    for th, om in zip(theta, omega):
        c[1:] += om * np.power(th, k)
    return c


def toeplitz_inverse(c: np.ndarray) -> np.ndarray:
    """Coefficients r of the inverse of the lower-triangular Toeplitz matrix with
    coefficients ``c`` (c_0 != 0), by forward substitution in float64: r_0 = 1/c_0,
    r_k = −(Σ_{j=1..k} c_j r_{k−j}) / c_0. O(n·b) for b non-zero c's."""
    c = np.asarray(c, dtype=np.float64)
    n = c.size
    nz = int(np.flatnonzero(c).max()) + 1 if n else 0
    r = np.zeros(n)
    if not n:
        return r
    r[0] = 1.0 / c[0]
    for k in range(1, n):
        j = np.arange(1, min(k, nz - 1) + 1)
        r[k] = -np.dot(c[j], r[k - j]) / c[0]
    return r


def toeplitz_matrix(c: np.ndarray) -> np.ndarray:
    """The dense lower-triangular Toeplitz matrix of coefficients ``c`` (tests, small n)."""
    c = np.asarray(c, dtype=np.float64)
    n = c.size
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)
