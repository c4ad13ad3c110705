"""The DP plan: sampling rate q, steps T, noise multiplier sigma, clip bound C, delta.

A `DPPlan` is frozen: once training starts, the numbers the accountant was promised
cannot drift. `make_plan` validates user input with messages that name the field, the
value and the fix, and calibrates sigma to a target epsilon with dp-accounting.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting import mechanism_calibration

from llmdp.privacy import accountant as _acc
from llmdp.privacy.events import dpsgd_step_event

__all__ = [
    "PlanError",
    "DPPlan",
    "SAMPLERS",
    "RELATIONS",
    "default_delta",
    "steps_for_epochs",
    "calibrate_noise",
    "make_plan",
]

SAMPLERS = ("poisson",)
RELATIONS = ("add_or_remove_one",)

# Calibration tolerance on sigma, relative. Epsilon is smooth in sigma with
# |d log eps / d log sigma| of order 1-3 in the DP-SGD regime, so 1e-5 relative on sigma
# keeps the calibrated epsilon within ~1e-4 relative of the target.
_SIGMA_RTOL = 1e-5


class PlanError(ValueError):
    """An invalid or unreachable DP plan; the message names the field, value and fix."""


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def default_delta(dataset_size: int) -> float:
    """A round power of ten strictly below 1/(10 N): N=6000 -> 1e-5, N=50000 -> 1e-6.

    delta must be well below 1/N: a mechanism that publishes one random unit in the
    clear is (0, 1/N)-DP. One order of magnitude of margin is the usual convention.
    """
    if not _is_int(dataset_size) or dataset_size < 1:
        raise PlanError(f"dataset_size must be an integer >= 1, got dataset_size={dataset_size!r}")
    # 10N has d digits, so 10**(d-1) <= 10N < 10**d and 10**-d < 1/(10N) strictly;
    # integer arithmetic avoids log10 rounding at exact powers of ten.
    digits = len(str(10 * int(dataset_size)))
    return float(f"1e-{digits}")


def steps_for_epochs(epochs: float, sampling_probability: float) -> int:
    """ceil(epochs / q): the number of Poisson-sampled steps that visits each unit
    `epochs` times in expectation."""
    if not _is_number(epochs) or not (0 < epochs < math.inf):
        raise PlanError(f"epochs must be a finite number > 0, got epochs={epochs!r}")
    if not _is_number(sampling_probability) or not (0 < sampling_probability <= 1):
        raise PlanError(
            f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
        )
    x = float(epochs) / float(sampling_probability)
    # 3 / 0.01 == 300.00000000000006 in floating point: do not turn that into 301 steps.
    r = round(x)
    if abs(x - r) <= 1e-9 * max(1.0, x):
        return max(1, int(r))
    return max(1, math.ceil(x))


def _check_delta(delta, dataset_size: int) -> float:
    if not _is_number(delta) or not (delta > 0):
        raise PlanError(
            f"delta must be > 0 (and below 1/N), got delta={delta!r}; "
            f"use e.g. default_delta({dataset_size}) = {default_delta(dataset_size):g}"
        )
    if not (delta < 1.0 / dataset_size):
        raise PlanError(
            f"delta must be below 1/N = {1.0 / dataset_size:.6g} (N = dataset_size = {dataset_size}), "
            f"got delta={delta!r}: a delta that large allows publishing a whole privacy unit. "
            f"Use a smaller delta, e.g. default_delta({dataset_size}) = {default_delta(dataset_size):g}"
        )
    return float(delta)


def _check_positive(name: str, value, what: str) -> float:
    if not _is_number(value) or not (0 < value < math.inf):
        raise PlanError(f"{name} ({what}) must be a finite number > 0, got {name}={value!r}")
    return float(value)


def _check_steps(steps) -> int:
    if not _is_int(steps) or steps < 1:
        raise PlanError(f"steps must be an integer >= 1, got steps={steps!r}")
    return int(steps)


def _check_sampling(dataset_size, expected_batch_size) -> float:
    if not _is_int(dataset_size) or dataset_size < 1:
        raise PlanError(
            f"dataset_size must be an integer >= 1 (number of privacy units), got dataset_size={dataset_size!r}"
        )
    if not _is_number(expected_batch_size) or not (0 < expected_batch_size <= dataset_size):
        raise PlanError(
            f"expected_batch_size must satisfy 0 < expected_batch_size <= dataset_size = {dataset_size} "
            f"(the sampling probability q = expected_batch_size / dataset_size must be in (0, 1]), "
            f"got expected_batch_size={expected_batch_size!r}"
        )
    return float(expected_batch_size) / int(dataset_size)


@dataclass(frozen=True)
class DPPlan:
    """Everything the accountant needs, frozen for the whole run.

    Noise is added once per logical step to the *sum* of clipped unit gradients with
    std sigma*C, and the noisy sum is divided by the expected batch size B = q*N
    (DESIGN §3.2), hence `noise_std` = sigma*C/B on the averaged gradient.
    """

    dataset_size: int
    expected_batch_size: float
    steps: int
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    accountant: str = "pld"
    sampler: str = "poisson"
    relation: str = "add_or_remove_one"
    target_epsilon: float | None = None

    def __post_init__(self):
        # Validate here too, so a plan read back from a file (from_dict) is as checked
        # as one built by make_plan.
        _check_sampling(self.dataset_size, self.expected_batch_size)
        _check_steps(self.steps)
        _check_positive("noise_multiplier", self.noise_multiplier, "sigma")
        _check_positive("max_grad_norm", self.max_grad_norm, "the clipping bound C")
        _check_delta(self.delta, self.dataset_size)
        if self.accountant not in _acc.ACCOUNTANTS:
            raise PlanError(
                f"accountant must be one of {_acc.ACCOUNTANTS}, got accountant={self.accountant!r}"
            )
        if self.sampler not in SAMPLERS:
            raise PlanError(
                f"sampler must be one of {SAMPLERS}, got sampler={self.sampler!r}: only Poisson "
                "sampling is accounted as Poisson"
            )
        if self.relation not in RELATIONS:
            raise PlanError(f"relation must be one of {RELATIONS}, got relation={self.relation!r}")
        if self.target_epsilon is not None:
            _check_positive("target_epsilon", self.target_epsilon, "the privacy budget")

    @property
    def sampling_probability(self) -> float:
        """q = B / N."""
        return float(self.expected_batch_size) / int(self.dataset_size)

    @property
    def noise_std(self) -> float:
        """sigma*C/(q*N): per-coordinate noise std in the averaged gradient."""
        return (
            self.noise_multiplier
            * self.max_grad_norm
            / (self.sampling_probability * self.dataset_size)
        )

    def step_event(self) -> dp_accounting.DpEvent:
        return dpsgd_step_event(self.sampling_probability, self.noise_multiplier)

    def epsilon(self, steps: int | None = None, accountant: str | None = None) -> float:
        """Epsilon at `self.delta` after `steps` steps (default: all T planned steps)."""
        steps = self.steps if steps is None else steps
        return _acc.epsilon_for(
            self.sampling_probability,
            self.noise_multiplier,
            steps,
            self.delta,
            accountant or self.accountant,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DPPlan:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanError(f"unknown DPPlan field(s) {unknown}; known fields are {sorted(names)}")
        return cls(**d)


def _knobs_message() -> str:
    return (
        "To make it reachable: fewer steps/epochs, a smaller expected batch size "
        "(smaller sampling probability q), a larger dataset, a larger target_epsilon, "
        "or a larger delta (still below 1/N)."
    )


class _EpsilonCurve:
    """epsilon(sigma) for fixed (q, T, delta, accountant), memoized.

    A PLD evaluation costs ~1 s at T~2000 and `calibrate_dp_mechanism` re-evaluates the
    bracket endpoints and its final root; the memo makes those repeats free. The
    values are exactly those `accountant.epsilon_for` returns.
    """

    def __init__(self, q: float, steps: int, delta: float, accountant: str):
        self.q, self.steps, self.delta, self.accountant = q, steps, delta, accountant
        self._values: dict[float, float] = {}

    def event(self, sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(dpsgd_step_event(self.q, sigma), self.steps)

    def __call__(self, sigma: float) -> float:
        sigma = float(sigma)
        if sigma not in self._values:
            self._values[sigma] = _acc.epsilon_for(
                self.q, sigma, self.steps, self.delta, self.accountant
            )
        return self._values[sigma]

    def fresh_accountant(self) -> dp_accounting.PrivacyAccountant:
        return _MemoAccountant(self)


class _MemoAccountant(dp_accounting.PrivacyAccountant):
    """Adapter so `calibrate_dp_mechanism` evaluates through an `_EpsilonCurve`.

    It only accepts the events `_EpsilonCurve.event` builds, so the memo key (sigma)
    is unambiguous; anything else is an error, never a silently wrong epsilon.
    """

    def __init__(self, curve: _EpsilonCurve):
        super().__init__(_acc.NEIGHBORING_RELATION)
        self._curve = curve
        self._composed: list[tuple[dp_accounting.DpEvent, int]] = []

    def _maybe_compose(self, event, count, do_compose):
        return None  # composition happens lazily in get_epsilon

    def compose(self, event, count=1):
        self._composed.append((event, count))
        return super().compose(event, count)

    def get_epsilon(self, target_delta: float) -> float:
        sigma = None
        if len(self._composed) == 1 and self._composed[0][1] == 1:
            event = self._composed[0][0]
            sigma = getattr(
                getattr(getattr(event, "event", None), "event", None), "noise_multiplier", None
            )
        if target_delta != self._curve.delta or sigma is None or event != self._curve.event(sigma):
            raise RuntimeError(
                f"unexpected calibration query: {self._composed!r}, delta={target_delta!r}"
            )
        return self._curve(sigma)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int,
    accountant: str = "pld",
    max_noise_multiplier: float = 100.0,
) -> float:
    """The smallest noise multiplier sigma whose epsilon (at `delta`, after `steps`
    steps at sampling rate q) is at most `target_epsilon`.

    The result satisfies epsilon(sigma) <= target (checked, not assumed) and is within
    a relative 1e-5 of the exact solution, so epsilon(sigma) is within ~1e-4 of target.
    Raises `PlanError` if even `max_noise_multiplier` gives epsilon > target.
    """
    target = _check_positive("target_epsilon", target_epsilon, "the privacy budget")
    if not _is_number(delta) or not (0 < delta < 1):
        raise PlanError(f"delta must be in (0, 1), got delta={delta!r}")
    if not _is_number(sampling_probability) or not (0 < sampling_probability <= 1):
        raise PlanError(
            f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
        )
    steps = _check_steps(steps)
    max_sigma = _check_positive("max_noise_multiplier", max_noise_multiplier, "largest sigma tried")
    if accountant not in _acc.ACCOUNTANTS:
        raise PlanError(
            f"accountant must be one of {_acc.ACCOUNTANTS}, got accountant={accountant!r}"
        )
    q, delta = float(sampling_probability), float(delta)

    curve = _EpsilonCurve(q, steps, delta, accountant)
    eps_max = curve(max_sigma)
    if eps_max > target:
        raise PlanError(
            f"target_epsilon={target:g} is unreachable with these numbers: even the largest "
            f"noise multiplier tried, max_noise_multiplier={max_sigma:g}, gives epsilon={eps_max:.4g} "
            f"(sampling probability q={q:.6g}, steps={steps}, delta={delta:g}, accountant={accountant!r}). "
            + _knobs_message()
        )

    # Bracket the root before handing it to Brent. PLD cost and memory explode as
    # sigma -> 0 (sigma=0.1 at q=0.01, T=2000 asks for >20 GiB), so PLD must never probe
    # far below the answer: locate it first, loosely, with the cheap RDP accountant
    # (an upper bound of the same quantity, so usually a slightly larger sigma), then
    # walk from there in small geometric steps with PLD.
    if accountant == "pld":
        rdp = _EpsilonCurve(q, steps, delta, "rdp")
        if rdp(max_sigma) <= target:
            lo, hi = _bracket(rdp, target, 1.0, max_sigma, factor=2.0)
            guess = hi if lo is None else _brent(rdp, target, lo, hi, rtol=1e-2)
        else:  # RDP cannot reach the target but PLD can: start from the top.
            guess = max_sigma
        lo, hi = _bracket(curve, target, guess, max_sigma, factor=1.1)
    else:
        lo, hi = _bracket(curve, target, 1.0, max_sigma, factor=2.0)
    if lo is None:
        return hi  # epsilon <= target even at a vanishing sigma: nothing to calibrate.

    sigma = _brent(curve, target, lo, hi, rtol=_SIGMA_RTOL)
    # calibrate_dp_mechanism already guarantees a non-positive gap; check it anyway,
    # nudging sigma up if ever needed, so the promise "epsilon <= target" never rests
    # on a library's internals.
    step = _SIGMA_RTOL
    for _ in range(60):
        if curve(sigma) <= target:
            return sigma
        sigma *= 1.0 + step
        step *= 2.0  # geometric: a few evaluations even if the root was far off
    raise PlanError(f"calibration failed to reach target_epsilon={target:g} near sigma={sigma:g}")


def _bracket(eps, target: float, start: float, max_sigma: float, factor: float):
    """(lo, hi) with eps(lo) > target >= eps(hi) and eps(lo) finite, walking geometrically
    from `start`; (None, hi) if eps stays <= target down to a vanishing sigma.

    eps(max_sigma) <= target must hold (the caller checks it).
    """
    lo = lo_value = None
    hi = min(start, max_sigma)
    value = eps(hi)
    while value > target:  # start is infeasible: walk up
        lo, lo_value = hi, value
        hi = min(hi * factor, max_sigma)
        value = eps(hi)
    if lo is not None and math.isfinite(lo_value):
        return lo, hi
    floor = hi * 1e-6
    while True:  # hi is feasible: walk down until infeasible
        cand = hi / factor
        if cand < floor:
            return None, hi
        value = eps(cand)
        if value <= target:
            hi = cand
        elif math.isfinite(value):
            return cand, hi
        else:
            # Infinite epsilon makes Brent's interpolation meaningless: step more gently.
            factor = math.sqrt(factor)
            if factor < 1.0 + 1e-9:
                raise PlanError(
                    f"could not bracket the noise multiplier for target_epsilon={target:g}"
                )


def _brent(curve: _EpsilonCurve, target: float, lo: float, hi: float, rtol: float) -> float:
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            curve.fresh_accountant,
            curve.event,
            target,
            curve.delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(lo, hi),
            tol=rtol * lo,
        )
    )


def make_plan(
    *,
    dataset_size: int,
    expected_batch_size: float,
    max_grad_norm: float,
    steps: int | None = None,
    epochs: float | None = None,
    delta: float | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    accountant: str = "pld",
    max_noise_multiplier: float = 100.0,
) -> DPPlan:
    """Validate the inputs and build a `DPPlan`, calibrating sigma if a target is given.

    Exactly one of `steps`/`epochs` and exactly one of `target_epsilon`/`noise_multiplier`.
    `delta` defaults to `default_delta(dataset_size)`.
    """
    if (steps is None) == (epochs is None):
        got = "both" if steps is not None else "neither"
        raise PlanError(
            f"pass exactly one of steps= or epochs=, got {got} (steps={steps!r}, epochs={epochs!r})"
        )
    if (target_epsilon is None) == (noise_multiplier is None):
        got = "both" if target_epsilon is not None else "neither"
        raise PlanError(
            "pass exactly one of target_epsilon= (calibrate sigma) or noise_multiplier= (fixed sigma), "
            f"got {got} (target_epsilon={target_epsilon!r}, noise_multiplier={noise_multiplier!r})"
        )
    q = _check_sampling(dataset_size, expected_batch_size)
    _check_positive("max_grad_norm", max_grad_norm, "the clipping bound C")
    if delta is None:
        delta = default_delta(dataset_size)
    delta = _check_delta(delta, dataset_size)
    if accountant not in _acc.ACCOUNTANTS:
        raise PlanError(
            f"accountant must be one of {_acc.ACCOUNTANTS}, got accountant={accountant!r}"
        )
    steps = _check_steps(steps) if steps is not None else steps_for_epochs(epochs, q)
    if noise_multiplier is not None:
        sigma = _check_positive("noise_multiplier", noise_multiplier, "sigma")
    else:
        target_epsilon = _check_positive("target_epsilon", target_epsilon, "the privacy budget")
        sigma = calibrate_noise(
            target_epsilon,
            delta,
            q,
            steps,
            accountant=accountant,
            max_noise_multiplier=max_noise_multiplier,
        )
    return DPPlan(
        dataset_size=int(dataset_size),
        expected_batch_size=float(expected_batch_size),
        steps=steps,
        noise_multiplier=float(sigma),
        max_grad_norm=float(max_grad_norm),
        delta=delta,
        accountant=accountant,
        target_epsilon=None if target_epsilon is None else float(target_epsilon),
    )
