"""The DP plan: sampling rate q, steps T, noise multiplier sigma, clip bound C, delta,
and the sampler (Poisson, or truncated Poisson with its cap B_max).

A `DPPlan` is frozen: once training starts, the numbers the accountant was promised
cannot drift. `make_plan` validates user input with messages that name the field, the
value and the fix, calibrates sigma to a target epsilon with dp-accounting and, for
truncated Poisson sampling, picks the cap B_max whose epsilon cost is below a budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import dp_accounting
from dp_accounting import mechanism_calibration
from scipy import stats

from llmdp._validate import _check_delta, _check_positive, _check_steps, _is_int, _is_number
from llmdp.choices import RELATIONS, SAMPLERS
from llmdp.privacy import accountant as _acc
from llmdp.privacy import sampling as _sampling
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
    "truncation_cost",
    "truncation_probability",
    "DEFAULT_TRUNCATION_BUDGET",
]

TRUNCATED = SAMPLERS[1]

# Calibration tolerance on sigma, relative. Epsilon is smooth in sigma with
# |d log eps / d log sigma| of order 1-3 in the DP-SGD regime, so 1e-5 relative on sigma
# keeps the calibrated epsilon within ~1e-4 relative of the target.
_SIGMA_RTOL = 1e-5

# make_plan picks the smallest cap B_max whose relative epsilon cost is below this.
DEFAULT_TRUNCATION_BUDGET = 0.01

# The PLD grid of the planner's searches (B_max, and sigma under the truncated event):
# ~10x faster than the reporting grid `_acc.PLD_VALUE_DISCRETIZATION_INTERVAL`, and
# pessimistic like it. Every number a plan carries is recomputed on the reporting grid.
_SEARCH_INTERVAL = _acc.PLD_DISPLAY_DISCRETIZATION_INTERVAL

# Rounds of "search B_max at sigma, calibrate sigma at B_max" before giving up (they
# settle in 1-2: B_max moves sigma by < 1%).
_MAX_ROUNDS = 6


class PlanError(ValueError):
    """An invalid or unreachable DP plan; the message names the field, value and fix."""


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


def _check_accountant_field(accountant) -> str:
    if accountant not in _acc.ACCOUNTANTS:
        raise PlanError(
            f"privacy.accountant must be one of {_acc.ACCOUNTANTS}, got accountant={accountant!r}"
        )
    return accountant


def _check_sampler_fields(sampler, accountant, dataset_size, max_batch_size) -> int | None:
    """Validate (sampler, accountant, max_batch_size); returns B_max as an int or None."""
    if sampler not in SAMPLERS:
        raise PlanError(
            f"privacy.sampler must be one of {SAMPLERS}, got sampler={sampler!r}: only "
            "Poisson and truncated Poisson sampling are accounted (shuffled fixed batches "
            "are never accounted as Poisson)"
        )
    if sampler != TRUNCATED:
        if max_batch_size is not None:
            raise PlanError(
                f"privacy.max_batch_size={max_batch_size!r} is only used with privacy.sampler="
                f"{TRUNCATED!r} (sampler is {sampler!r}); remove max_batch_size or set "
                f"sampler: {TRUNCATED}"
            )
        return None
    if accountant != "pld":
        raise PlanError(
            f"privacy.accountant={accountant!r} cannot account privacy.sampler={TRUNCATED!r}: "
            "dp-accounting supports the truncated event (TruncatedSubsampledGaussianDpEvent) "
            "only in its PLD accountant, under the add-or-remove-one relation. Fix: set "
            "accountant: pld, or sampler: poisson"
        )
    if max_batch_size is None:
        return None
    if not _is_int(max_batch_size) or not (1 <= max_batch_size <= dataset_size):
        raise PlanError(
            f"privacy.max_batch_size must be an integer in [1, dataset_size = {dataset_size}] "
            f"(the cap B_max on units per step), got max_batch_size={max_batch_size!r}; set "
            "it in that range, or leave it unset (null) to let the plan pick the smallest "
            "cap whose epsilon cost is below the truncation budget"
        )
    return int(max_batch_size)


def truncation_probability(dataset_size: int, sampling_probability: float, max_batch_size: int) -> float:
    """P(|S| > B_max) for S ~ Binomial(N, q): the per-step probability that truncated
    Poisson sampling drops units. `scipy.stats.binom.sf(B_max, N, q)`."""
    return float(stats.binom.sf(int(max_batch_size), int(dataset_size), float(sampling_probability)))


def truncation_cost(
    sampling_probability: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    dataset_size: int,
    max_batch_size: int,
    *,
    value_discretization_interval: float | None = None,
) -> float:
    """eps_truncated(sigma, B_max) / eps_poisson(sigma) - 1 after `steps` steps at `delta`.

    Both epsilons are PLD (the only accountant of the truncated event), on the reporting
    grid unless `value_discretization_interval` is given (the planner's searches use a
    coarser one). 0.0 where no truncation can happen (B_max >= N, or a tail probability
    that underflows: dp-accounting then uses the Poisson PLD itself).
    """
    # dp-accounting's own shortcut, for the event's dataset size N + 1 (`dpsgd_step_event`).
    if stats.binom.sf(int(max_batch_size) - 1, int(dataset_size), sampling_probability) == 0.0:
        return 0.0  # exactly the Poisson PLD (dp-accounting's own shortcut): no PLD needed
    if value_discretization_interval is None:

        def eps(b):
            return _acc.epsilon_for(
                sampling_probability, noise_multiplier, steps, delta, "pld",
                dataset_size=None if b is None else dataset_size, max_batch_size=b,
            )
    else:

        def eps(b):
            return _acc.epsilon_estimate(
                sampling_probability, noise_multiplier, steps, delta,
                dataset_size=None if b is None else dataset_size, max_batch_size=b,
                value_discretization_interval=value_discretization_interval,
            )

    truncated, poisson = eps(int(max_batch_size)), eps(None)
    if poisson == 0.0:
        return 0.0 if truncated == 0.0 else math.inf
    return truncated / poisson - 1.0


@dataclass(frozen=True)
class DPPlan:
    """Everything the accountant needs, frozen for the whole run.

    Noise is added once per logical step to the *sum* of clipped unit gradients with
    std sigma*C, and the noisy sum is divided by the expected batch size B = q*N
    (DESIGN §3.2), hence `noise_std` = sigma*C/B on the averaged gradient.

    `sampler="truncated-poisson"` caps every step at `max_batch_size` = B_max units
    (required, 1 <= B_max <= N; the PLD accountant only) and is accounted with
    `TruncatedSubsampledGaussianDpEvent(N + 1, q, B_max, sigma)` (the add-neighbour's
    size: `events.dpsgd_step_event`). Its plan also carries
    `truncation_cost` (eps_truncated / eps_poisson - 1 at this sigma, T and delta: what
    the cap costs in epsilon; None if not computed) and `truncation_probability`
    (P(Binomial(N, q) > B_max): how often a step drops units; derived, filled in if
    None). For "poisson" the three are None.
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
    max_batch_size: int | None = None
    truncation_cost: float | None = None
    truncation_probability: float | None = None

    def __post_init__(self):
        # Validate here too, so a plan read back from a file (from_dict) is as checked
        # as one built by make_plan.
        _check_sampling(self.dataset_size, self.expected_batch_size)
        _check_steps(self.steps, error=PlanError)
        _check_positive("noise_multiplier", self.noise_multiplier, "sigma", error=PlanError)
        _check_positive("max_grad_norm", self.max_grad_norm, "the clipping bound C",
                        error=PlanError)
        _check_delta(self.delta, self.dataset_size, default=default_delta(self.dataset_size),
                     error=PlanError)
        _check_accountant_field(self.accountant)
        _check_sampler_fields(self.sampler, self.accountant, self.dataset_size, self.max_batch_size)
        if self.relation not in RELATIONS:
            raise PlanError(f"relation must be one of {RELATIONS}, got relation={self.relation!r}")
        if self.target_epsilon is not None:
            _check_positive("target_epsilon", self.target_epsilon, "the privacy budget",
                            error=PlanError)
        if self.sampler != TRUNCATED:
            for name in ("truncation_cost", "truncation_probability"):
                if getattr(self, name) is not None:
                    raise PlanError(
                        f"{name}={getattr(self, name)!r} is only meaningful with "
                        f"sampler={TRUNCATED!r} (sampler is {self.sampler!r}); remove it"
                    )
            return
        if self.max_batch_size is None:
            raise PlanError(
                f"privacy.max_batch_size is required with sampler={TRUNCATED!r} in a DPPlan "
                "(make_plan picks it when left unset)"
            )
        object.__setattr__(self, "max_batch_size", int(self.max_batch_size))
        cost = self.truncation_cost
        if cost is not None and not (_is_number(cost) and -1.0 <= cost < math.inf):
            raise PlanError(
                f"truncation_cost must be a finite number >= -1 (eps_truncated / eps_poisson - 1), "
                f"got truncation_cost={cost!r}"
            )
        exact = truncation_probability(
            self.dataset_size, self.sampling_probability, self.max_batch_size
        )
        given = self.truncation_probability
        if given is None:
            object.__setattr__(self, "truncation_probability", exact)
        elif not (_is_number(given) and math.isclose(given, exact, rel_tol=1e-6, abs_tol=1e-300)):
            raise PlanError(
                f"truncation_probability={given!r} does not match P(Binomial(N, q) > "
                f"max_batch_size) = {exact!r} for N={self.dataset_size}, q="
                f"{self.sampling_probability!r}, max_batch_size={self.max_batch_size}; "
                "remove it (it is derived)"
            )

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

    @property
    def truncated(self) -> bool:
        """Whether the plan uses truncated Poisson sampling (a cap `max_batch_size`)."""
        return self.sampler == TRUNCATED

    def _event_kwargs(self) -> dict:
        if not self.truncated:
            return {}
        return {"dataset_size": int(self.dataset_size), "max_batch_size": self.max_batch_size}

    def step_event(self) -> dp_accounting.DpEvent:
        """The event of one step: Poisson, or truncated Poisson (`max_batch_size`)."""
        return dpsgd_step_event(
            self.sampling_probability, self.noise_multiplier, **self._event_kwargs()
        )

    def make_sampler(self, num_units: int | None = None):
        """The sampler that makes `step_event()` true: `PoissonSampler(N, q)` or
        `TruncatedPoissonSampler(N, q, max_batch_size)`, N = `dataset_size`.

        `num_units`, if given (e.g. the store's size), must equal `dataset_size`: the
        truncated event's guarantee is for N units exactly.
        """
        if num_units is not None and num_units != self.dataset_size:
            raise PlanError(
                f"the sampler must draw from the plan's dataset_size={self.dataset_size} "
                f"units, got num_units={num_units!r}: rebuild the plan for this dataset"
            )
        return _sampling.make_sampler(
            int(self.dataset_size), self.sampling_probability, self.max_batch_size
        )

    def epsilon(self, steps: int | None = None, accountant: str | None = None) -> float:
        """Epsilon at `self.delta` after `steps` steps (default: all T planned steps)."""
        steps = self.steps if steps is None else steps
        return _acc.epsilon_for(
            self.sampling_probability,
            self.noise_multiplier,
            steps,
            self.delta,
            accountant or self.accountant,
            **self._event_kwargs(),
        )

    def epsilon_estimate(self, steps: int | None = None) -> float:
        """A fast, conservative PLD epsilon after `steps` steps, for display only
        (`accountant.epsilon_estimate` of this plan's event)."""
        steps = self.steps if steps is None else steps
        return _acc.epsilon_estimate(
            self.sampling_probability,
            self.noise_multiplier,
            steps,
            self.delta,
            **self._event_kwargs(),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DPPlan:
        """Inverse of `to_dict`; a dict written before a field existed gets its default."""
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
    """epsilon(sigma) for fixed (q, T, delta, accountant[, N, B_max][, grid]), memoized.

    A PLD evaluation costs ~1 s at T~2000 (several seconds for the truncated event) and
    `calibrate_dp_mechanism` re-evaluates the bracket endpoints and its final root; the
    memo makes those repeats free. The values are exactly those
    `accountant.epsilon_for` returns (or `accountant.epsilon_estimate` on `interval`).
    """

    def __init__(
        self,
        q: float,
        steps: int,
        delta: float,
        accountant: str,
        *,
        dataset_size: int | None = None,
        max_batch_size: int | None = None,
        interval: float | None = None,
    ):
        self.q, self.steps, self.delta, self.accountant = q, steps, delta, accountant
        self.dataset_size, self.max_batch_size, self.interval = dataset_size, max_batch_size, interval
        self._values: dict[float, float] = {}

    def _kwargs(self) -> dict:
        if self.max_batch_size is None:
            return {}
        return {"dataset_size": self.dataset_size, "max_batch_size": self.max_batch_size}

    def event(self, sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(
            dpsgd_step_event(self.q, sigma, **self._kwargs()), self.steps
        )

    @staticmethod
    def sigma_of(event) -> float | None:
        """sigma of an event built by `event`, None for anything else."""
        inner = getattr(event, "event", None)
        if isinstance(inner, dp_accounting.TruncatedSubsampledGaussianDpEvent):
            return inner.noise_multiplier
        return getattr(getattr(inner, "event", None), "noise_multiplier", None)

    def __call__(self, sigma: float) -> float:
        sigma = float(sigma)
        if sigma not in self._values:
            if self.interval is None:
                value = _acc.epsilon_for(
                    self.q, sigma, self.steps, self.delta, self.accountant, **self._kwargs()
                )
            else:
                assert self.accountant == "pld", "a grid is a PLD setting"
                value = _acc.epsilon_estimate(
                    self.q, sigma, self.steps, self.delta,
                    value_discretization_interval=self.interval, **self._kwargs(),
                )
            self._values[sigma] = value
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
        sigma = event = None
        if len(self._composed) == 1 and self._composed[0][1] == 1:
            event = self._composed[0][0]
            sigma = self._curve.sigma_of(event)
        if target_delta != self._curve.delta or sigma is None or event != self._curve.event(sigma):
            raise RuntimeError(
                f"unexpected calibration query: {self._composed!r}, delta={target_delta!r}"
            )
        return self._curve(sigma)


def _check_calibration_args(target_epsilon, delta, sampling_probability, steps, accountant,
                            max_noise_multiplier):
    target = _check_positive("target_epsilon", target_epsilon, "the privacy budget",
                             error=PlanError)
    if not _is_number(delta) or not (0 < delta < 1):
        raise PlanError(f"delta must be in (0, 1), got delta={delta!r}")
    if not _is_number(sampling_probability) or not (0 < sampling_probability <= 1):
        raise PlanError(
            f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
        )
    steps = _check_steps(steps, error=PlanError)
    max_sigma = _check_positive("max_noise_multiplier", max_noise_multiplier,
                                "largest sigma tried", error=PlanError)
    _check_accountant_field(accountant)
    return target, float(delta), float(sampling_probability), steps, max_sigma


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int,
    accountant: str = "pld",
    max_noise_multiplier: float = 100.0,
    *,
    dataset_size: int | None = None,
    max_batch_size: int | None = None,
) -> float:
    """The smallest noise multiplier sigma whose epsilon (at `delta`, after `steps`
    steps at sampling rate q) is at most `target_epsilon`.

    The result satisfies epsilon(sigma) <= target (checked, not assumed) and is within
    a relative 1e-5 of the exact solution, so epsilon(sigma) is within ~1e-4 of target.
    Raises `PlanError` if even `max_noise_multiplier` gives epsilon > target.

    With `max_batch_size` (and `dataset_size`), sigma is calibrated for truncated
    Poisson sampling (the truncated event, PLD only): the search runs on the planner's
    coarser PLD grid and the result is checked, and nudged up if needed, on the
    reporting grid, so epsilon(sigma) <= target holds for the reported number.
    """
    target, delta, q, steps, max_sigma = _check_calibration_args(
        target_epsilon, delta, sampling_probability, steps, accountant, max_noise_multiplier
    )
    if max_batch_size is not None:
        if not _is_int(dataset_size) or dataset_size < 1:
            raise PlanError(
                "dataset_size must be an integer >= 1 (the number of privacy units N of the "
                f"truncated event) with max_batch_size, got dataset_size={dataset_size!r}"
            )
        b = _check_sampler_fields(TRUNCATED, accountant, dataset_size, max_batch_size)
        coarse = _EpsilonCurve(q, steps, delta, "pld", interval=_SEARCH_INTERVAL)
        sigma = _calibrate(coarse, target, max_sigma)
        sigma = _calibrate_truncated(q, steps, delta, int(dataset_size), b, target, max_sigma, sigma)
        return _fine_check(_truncated_curve(q, steps, delta, int(dataset_size), b), target, sigma)
    return _calibrate(_EpsilonCurve(q, steps, delta, accountant), target, max_sigma)


def _calibrate(curve: _EpsilonCurve, target: float, max_sigma: float,
               start: float | None = None) -> float:
    """The calibration of `calibrate_noise` on any curve; `start` is a close guess of
    the root (then the bracket walks from it in small, growing steps)."""
    eps_max = curve(max_sigma)
    if eps_max > target:
        cap = "" if curve.max_batch_size is None else f", max_batch_size={curve.max_batch_size}"
        knobs = _knobs_message()
        if curve.max_batch_size is not None:
            knobs += " With truncated Poisson sampling: a larger max_batch_size."
        raise PlanError(
            f"target_epsilon={target:g} is unreachable with these numbers: even the largest "
            f"noise multiplier tried, max_noise_multiplier={max_sigma:g}, gives epsilon={eps_max:.4g} "
            f"(sampling probability q={curve.q:.6g}, steps={curve.steps}, delta={curve.delta:g}, "
            f"accountant={curve.accountant!r}{cap}). " + knobs
        )

    # Bracket the root before handing it to Brent. PLD cost and memory explode as
    # sigma -> 0 (sigma=0.1 at q=0.01, T=2000 asks for >20 GiB), so PLD must never probe
    # far below the answer: locate it first, loosely, with the cheap RDP accountant
    # (an upper bound of the same quantity, so usually a slightly larger sigma), then
    # walk from there in small geometric steps with PLD.
    if start is not None:
        lo, hi = _bracket(curve, target, start, max_sigma, factor=1.01, accelerate=True)
    elif curve.accountant == "pld":
        rdp = _EpsilonCurve(curve.q, curve.steps, curve.delta, "rdp")
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
    return _fine_check(curve, target, sigma)


def _fine_check(curve: _EpsilonCurve, target: float, sigma: float) -> float:
    """sigma, nudged up geometrically until curve(sigma) <= target."""
    step = _SIGMA_RTOL
    for _ in range(60):
        if curve(sigma) <= target:
            return sigma
        sigma *= 1.0 + step
        step *= 2.0  # geometric: a few evaluations even if the root was far off
    raise PlanError(f"calibration failed to reach target_epsilon={target:g} near sigma={sigma:g}")


def _bracket(eps, target: float, start: float, max_sigma: float, factor: float,
             accelerate: bool = False):
    """(lo, hi) with eps(lo) > target >= eps(hi) and eps(lo) finite, walking geometrically
    from `start` (with `accelerate`, the factor squares after each step: small steps
    first for a close guess, few steps for a far one); (None, hi) if eps stays <= target
    down to a vanishing sigma.

    eps(max_sigma) <= target must hold (the caller checks it).
    """
    lo = lo_value = None
    hi = min(start, max_sigma)
    value = eps(hi)
    up = factor
    while value > target:  # start is infeasible: walk up
        lo, lo_value = hi, value
        hi = min(hi * up, max_sigma)
        value = eps(hi)
        if accelerate:
            up = up * up
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
            if accelerate:
                factor = factor * factor
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


# ---- truncated Poisson: the cap B_max and sigma under the truncated event


def _truncated_curve(q, steps, delta, n, b, interval=None) -> _EpsilonCurve:
    return _EpsilonCurve(
        q, steps, delta, "pld", dataset_size=n, max_batch_size=b, interval=interval
    )


def _calibrate_truncated(q, steps, delta, n, b, target, max_sigma, start) -> float:
    """sigma calibrated on the search grid under the truncated event at cap b, walking
    from `start` (the Poisson sigma, or a previous round's)."""
    curve = _truncated_curve(q, steps, delta, n, b, _SEARCH_INTERVAL)
    return _calibrate(curve, target, max_sigma, start=start)


def _smallest_cap(q, steps, delta, n, sigma, budget, start=None, step=None) -> int:
    """The smallest B_max in [1, n] with truncation_cost < budget on the search grid, at
    noise multiplier sigma (the cost falls with B_max; it is 0 at B_max = n).

    Walks from `start` (default: qN + 3 sd, where the cost is usually still large) in
    doubling steps to bracket the answer, then bisects on the integers.
    """
    def feasible(b: int) -> bool:
        if b >= n:
            return True
        return truncation_cost(
            q, sigma, steps, delta, n, b, value_discretization_interval=_SEARCH_INTERVAL
        ) < budget

    mean, sd = q * n, math.sqrt(n * q * (1.0 - q))
    if start is None:
        start = math.ceil(mean + 3.0 * sd)
    if step is None:
        step = max(1, math.ceil(sd / 2.0))
    start = min(max(1, int(start)), n)
    if feasible(start):
        lo, hi = 0, start  # feasible(0) is False by definition (a cap of 0 units)
        while True:
            cand = hi - step
            if cand < 1:
                break
            if feasible(cand):
                hi, step = cand, 2 * step
            else:
                lo = cand
                break
    else:
        lo, hi = start, n
        while True:
            cand = lo + step
            if cand >= n:
                break
            if feasible(cand):
                hi = cand
                break
            lo, step = cand, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _plan_truncated(*, q, n, steps, delta, sigma, target, cap, budget, max_sigma):
    """(sigma, B_max, truncation_cost) of a truncated-Poisson plan.

    Fixed sigma (target None): B_max = `cap`, or the smallest cap whose cost is below
    `budget` at sigma. Target mode: sigma is first calibrated under Poisson, then B_max
    is searched at sigma and sigma re-calibrated under the truncated event at B_max,
    until B_max is the smallest cap at its own sigma (a cycle B <-> B-1, possible in
    principle, resolves to the larger cap). All of that runs on the search grid; the
    final sigma is then checked (nudged up if needed) and the cost computed on the
    reporting grid. If the reporting grid puts an automatic cap's cost at or above the
    budget (a knife edge the search grid missed), the cap grows by one and the last
    steps repeat (up to the largest cap, N, which is kept with its stated cost
    even if that is above the budget: only possible for a tiny N).
    """
    if target is not None:
        sigma = _calibrate(_EpsilonCurve(q, steps, delta, "pld", interval=_SEARCH_INTERVAL),
                           target, max_sigma)
    b = cap if cap is not None else _smallest_cap(q, steps, delta, n, sigma, budget)
    if target is not None:
        sigma_at: dict[int, float] = {}
        for _ in range(_MAX_ROUNDS):
            sigma = sigma_at[b] = _calibrate_truncated(q, steps, delta, n, b, target, max_sigma, sigma)
            if cap is not None:
                break
            nxt = _smallest_cap(q, steps, delta, n, sigma, budget, start=b, step=1)
            if nxt == b:
                break
            if nxt in sigma_at:  # a cycle: the larger cap meets the budget at its sigma
                b = max(b, nxt)
                sigma = sigma_at[b]
                break
            b = nxt
        else:
            raise PlanError(
                f"could not settle privacy.max_batch_size for target_epsilon={target:g} "
                f"(last tried {b}); set privacy.max_batch_size explicitly"
            )
    for _ in range(_MAX_ROUNDS):
        if target is not None:
            sigma = _fine_check(_truncated_curve(q, steps, delta, n, b), target, sigma)
        cost = truncation_cost(q, sigma, steps, delta, n, b)
        # b == n is the largest cap allowed: the sampler never truncates on the N units,
        # but the add-neighbour (N + 1 units) can, so its cost is small but not 0; on a
        # tiny dataset it may exceed the budget. The plan carries (and the report states) it.
        if cap is not None or cost < budget or b >= n:
            return sigma, b, cost
        b += 1  # knife edge: the search grid said < budget, the reporting grid does not
        if target is not None:
            sigma = _calibrate_truncated(q, steps, delta, n, b, target, max_sigma, sigma)
    raise PlanError(
        f"could not find privacy.max_batch_size with truncation cost < {budget:g} "
        f"(last tried {b}, cost {cost:.4g}); set privacy.max_batch_size explicitly"
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
    sampler: str = "poisson",
    max_batch_size: int | None = None,
    truncation_budget: float = DEFAULT_TRUNCATION_BUDGET,
) -> DPPlan:
    """Validate the inputs and build a `DPPlan`, calibrating sigma if a target is given.

    Exactly one of `steps`/`epochs` and exactly one of `target_epsilon`/`noise_multiplier`.
    `delta` defaults to `default_delta(dataset_size)`.

    `sampler="truncated-poisson"` (PLD accountant only): with `max_batch_size=None` the
    cap B_max is the smallest whose truncation cost eps_truncated / eps_poisson - 1 is
    below `truncation_budget` (relative; 1% by default), found on the planner's search
    grid, with sigma calibrated under the truncated event at that cap in target mode
    (so the reported epsilon, truncated event, is <= target_epsilon). A given
    `max_batch_size` is used as is, whatever its cost; the plan carries the cost. The
    plan's cost, epsilon and sigma are on the reporting grid. Takes seconds to tens of
    seconds (PLD of the truncated event): ~20 s for N=15000, B=256, T=50 on 2 cores.
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
    _check_positive("max_grad_norm", max_grad_norm, "the clipping bound C", error=PlanError)
    if delta is None:
        delta = default_delta(dataset_size)
    delta = _check_delta(delta, dataset_size, default=default_delta(dataset_size), error=PlanError)
    _check_accountant_field(accountant)
    cap = _check_sampler_fields(sampler, accountant, dataset_size, max_batch_size)
    if sampler == TRUNCATED and cap is None:
        if not _is_number(truncation_budget) or not (0 < truncation_budget < math.inf):
            raise PlanError(
                "privacy.truncation_budget (the largest relative epsilon cost of the automatic "
                "max_batch_size, e.g. 0.01 for 1%) must be a finite number > 0, got "
                f"truncation_budget={truncation_budget!r}"
            )
    steps = _check_steps(steps, error=PlanError) if steps is not None else steps_for_epochs(epochs, q)
    sigma = max_sigma = None
    if noise_multiplier is not None:
        sigma = _check_positive("noise_multiplier", noise_multiplier, "sigma", error=PlanError)
    else:
        target_epsilon = _check_positive("target_epsilon", target_epsilon, "the privacy budget",
                                         error=PlanError)
        max_sigma = _check_positive(
            "max_noise_multiplier", max_noise_multiplier, "largest sigma tried"
        , error=PlanError)
    cost = None
    if sampler == TRUNCATED:
        sigma, cap, cost = _plan_truncated(
            q=q,
            n=int(dataset_size),
            steps=steps,
            delta=delta,
            sigma=sigma,
            target=target_epsilon,
            cap=cap,
            budget=float(truncation_budget),
            max_sigma=max_sigma,
        )
    elif sigma is None:
        sigma = calibrate_noise(
            target_epsilon,
            delta,
            q,
            steps,
            accountant=accountant,
            max_noise_multiplier=max_sigma,
        )
    return DPPlan(
        dataset_size=int(dataset_size),
        expected_batch_size=float(expected_batch_size),
        steps=steps,
        noise_multiplier=float(sigma),
        max_grad_norm=float(max_grad_norm),
        delta=delta,
        accountant=accountant,
        sampler=sampler,
        target_epsilon=None if target_epsilon is None else float(target_epsilon),
        max_batch_size=cap,
        truncation_cost=None if cost is None else float(cost),
    )


def release_entries(releases) -> tuple[list, float]:
    """(entries, delta_threshold) of earlier releases a run builds on (``plan.json``
    ``prior_releases``: dicts with ``event`` JSON, ``count`` and ``extra``)."""
    from llmdp.privacy.events import event_from_json

    releases = list(releases)
    return ([(event_from_json(r["event"]), int(r["count"])) for r in releases],
            _acc.threshold_delta(releases))


def composed_epsilon(plan: DPPlan, prior_releases=(), accountant: str | None = None,
                     steps: int | None = None,
                     value_discretization_interval: float | None = None) -> float:
    """Epsilon at `plan.delta` of earlier releases on the same units (`prior_releases`,
    e.g. a private tokenizer's, thresholds' delta included) composed with `steps`
    (default: all) steps of `plan` (`accountant.epsilon_with_threshold`)."""
    steps = plan.steps if steps is None else steps
    prior, d_thr = release_entries(prior_releases)
    if not prior and value_discretization_interval is None:
        return plan.epsilon(steps, accountant) if steps else 0.0
    entries = prior + ([(plan.step_event(), steps)] if steps else [])
    return _acc.epsilon_with_threshold(entries, plan.delta, d_thr, accountant or plan.accountant,
                                       value_discretization_interval)


def calibrate_with_prior(plan: DPPlan, prior_releases, rtol: float = 1e-3) -> DPPlan:
    """`plan` with sigma raised so that the composition of the earlier releases
    (`prior_releases`, thresholds' delta included) and all of the plan's steps is
    <= `plan.target_epsilon` at `plan.delta`: the guarantee of a model trained with a
    private tokenizer covers both. sigma is located with Brent's method on the coarse PLD
    grid, refined on the reporting grid to `rtol`, and always lands on the side that meets
    the target. A truncated plan keeps its cap; its cost is recomputed at the new sigma.
    """
    target = plan.target_epsilon
    prior_releases = list(prior_releases)
    if target is None or not prior_releases:
        return plan  # fixed sigma: the report states the composed epsilon, whatever it is
    prior_entries, d_thr = release_entries(prior_releases)
    if not (0.0 <= d_thr < plan.delta):
        raise PlanError(
            f"privacy.delta: {plan.delta:.3g} is not above the delta {d_thr:.3g} that the earlier "
            f"releases (private tokenizer thresholds) already spend; raise privacy.delta (below "
            f"1/N) or train the tokenizer with a smaller delta"
        )
    spent = _acc.epsilon_with_threshold(prior_entries, plan.delta, d_thr, plan.accountant)
    if spent >= target:
        raise PlanError(
            f"privacy.target_epsilon: {target:g} is already spent by the earlier releases on this "
            f"data (ε = {spent:.4f} at δ = {plan.delta:.3g}, e.g. the private tokenizer); raise "
            f"target_epsilon or train the tokenizer with a smaller epsilon"
        )

    from scipy.optimize import brentq

    coarse = _SEARCH_INTERVAL if plan.accountant == "pld" else None
    memo: dict[tuple, float] = {}

    def eps(sigma: float, interval=None) -> float:
        if (sigma, interval) not in memo:
            p = dataclasses.replace(plan, noise_multiplier=sigma, truncation_cost=None,
                                    truncation_probability=None)
            memo[sigma, interval] = composed_epsilon(p, prior_releases,
                                                     value_discretization_interval=interval)
        return memo[sigma, interval]

    def root(lo: float, hi: float, interval, xtol: float) -> float:
        # Brent's method on log(sigma): each evaluation is a whole PLD composition.
        return math.exp(brentq(lambda x: eps(math.exp(x), interval) - target,
                               math.log(lo), math.log(hi), xtol=xtol))

    if eps(plan.noise_multiplier) <= target:
        return plan
    # 1. On the planner's coarse grid (fast), bracket and locate the root.
    lo = hi = float(plan.noise_multiplier)
    while eps(hi, coarse) > target:
        lo, hi = hi, hi * 1.5
        if hi > 1e4:
            raise PlanError(f"no noise multiplier reaches target_epsilon={target:g} with the earlier "
                            f"releases composed; {_knobs_message()}")
    guess = root(lo, hi, coarse, 1e-3) if lo < hi else hi
    # 2. On the reporting grid, in a narrow bracket around it.
    lo, hi = guess / 1.02, guess * 1.02
    while eps(lo) <= target:
        lo /= 1.02
    while eps(hi) > target:
        hi *= 1.02
    r = root(lo, hi, None, rtol / 4)
    # 3. Never on the wrong side of the target.
    hi = r * (1 + rtol / 4)
    while eps(hi) > target:
        hi *= 1 + rtol / 4
    cost = None
    if plan.truncated:
        cost = truncation_cost(plan.sampling_probability, hi, plan.steps, plan.delta,
                               plan.dataset_size, plan.max_batch_size)
    return dataclasses.replace(plan, noise_multiplier=hi, truncation_cost=cost,
                               truncation_probability=None)
