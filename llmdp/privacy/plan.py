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
from typing import TYPE_CHECKING

from llmdp.config.choices import Accountant, Choice, Mechanism, Relation, Sampler
from llmdp.config.validate import _check_delta, _check_positive, _check_steps, _is_int, _is_number
from llmdp.privacy import accounting as _acc
from llmdp.privacy import sampling as _sampling
from llmdp.privacy.accounting import (
    DEFAULT_TRUNCATION_BUDGET,
    EpsilonCurve,
    PlanError,
    calibrate_curve,
    calibrate_truncated,
    dpsgd_step_event,
    plan_truncated,
    truncation_cost,
    truncation_probability,
)
from llmdp.privacy.mechanism import DpSgd, MechanismConfig, check_config
from llmdp.privacy.noise import MAX_TAIL_FRACTION, NOISE_TAIL, NoiseTail, noise_tail

if TYPE_CHECKING:  # a plan's events are built at the call (`events`): a worker builds none
    import dp_accounting

__all__ = [
    "PlanError",
    "DPPlan",
    "default_delta",
    "steps_for_epochs",
    "calibrate_noise",
    "make_plan",
    "check_noise_tail",
    "NoiseTailError",
    "truncation_cost",
    "truncation_probability",
    "DEFAULT_TRUNCATION_BUDGET",
]

TRUNCATED = Sampler.TRUNCATED_POISSON
_DP_SGD = DpSgd()  # make_plan's default mechanism (nothing beyond the shared inputs)


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


def _check_accountant_field(accountant) -> Accountant:
    if Accountant.get(accountant) is None:
        raise PlanError(
            f"privacy.accountant must be one of {Accountant.choices()}, got accountant={accountant!r}"
        )
    return Accountant(accountant)


def _check_sampler_fields(sampler, accountant, dataset_size, max_batch_size) -> int | None:
    """Validate (sampler, accountant, max_batch_size); returns B_max as an int or None."""
    if Sampler.get(sampler) is None:
        raise PlanError(
            f"privacy.sampler must be one of {Sampler.choices()}, got sampler={sampler!r}: only "
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
    if accountant != Accountant.PLD:
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


@dataclass(frozen=True)
class DPPlan:
    """Everything the accountant needs, frozen for the whole run.

    Noise is added once per logical step to the *sum* of clipped unit gradients with
    std sigma*C, and the noisy sum is divided by the expected batch size B = q*N
    (DESIGN, invariant `noise-once`), hence `noise_std` = sigma*C/B on the averaged gradient.

    `sampler="truncated-poisson"` caps every step at `max_batch_size` = B_max units
    (required, 1 <= B_max <= N; the PLD accountant only) and is accounted with
    `TruncatedSubsampledGaussianDpEvent(N + 1, q, B_max, sigma)` (the add-neighbour's
    size: `events.dpsgd_step_event`). Its plan also carries
    `truncation_cost` (eps_truncated / eps_poisson - 1 at this sigma, T and delta: what
    the cap costs in epsilon; None if not computed) and `truncation_probability`
    (P(Binomial(N, q) > B_max): how often a step drops units; derived, filled in if
    None). For "poisson" the three are None.

    The noise generator's truncated tails (`llmdp.privacy.noise.tail`) are folded into
    `delta`, the published δ, when `noise_coordinates` (the trainable parameter count: the
    noise coordinates of one step) is known: the accountant then runs at
    `accountant_delta` = δ - the tails' share of the run's noised releases (its `steps`
    steps and, with `eval_noise` = (releases, coordinates, noise multiplier), its DP
    evaluations), so that the published (ε, δ) includes it. `noise_coordinates` None (a
    plan.json of an earlier llmdp, `llmdp privacy epsilon` without --parameters): not
    folded, `accountant_delta` == `delta`, as before (the report says so).

    `dp=False`: a NON-PRIVATE baseline (`llmdp.record.baseline`): the same sampling and steps, σ = 0,
    no target or truncation cost, `clip_bound` inf (`max_grad_norm` keeps the recipe's C, not
    applied), `epsilon()` inf, no DP event. `to_dict` writes ``dp`` only when False.
    """

    dataset_size: int
    expected_batch_size: float
    steps: int
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    accountant: Accountant = Accountant.PLD
    sampler: Sampler = Sampler.POISSON
    relation: Relation = Relation.ADD_OR_REMOVE_ONE
    target_epsilon: float | None = None
    max_batch_size: int | None = None
    truncation_cost: float | None = None
    truncation_probability: float | None = None
    dp: bool = True
    noise_coordinates: int | None = None
    eval_noise: tuple | None = None  # (releases, coordinates, noise multiplier) of DP evals
    # The noised releases of a starting checkpoint trained on the same data, composed into
    # this run's guarantee (`llmdp.record.provenance`): ((what, count, coordinates, noise
    # multiplier), ...); their tails are folded into δ with this run's.
    prior_noise: tuple | None = None
    # A correlated mechanism (`llmdp.privacy.mf.plan`): "banded-mf" / "blt" with a cyclic
    # sampler of `cycle` groups, its strategy (`mf.Factorization.to_dict()`), and the factor
    # f of the ledger's round event (σ·f; `round_factor_exact`: K rounds compose to exactly
    # the one-release analysis). The ledger counts rounds of `cycle` steps (`ledger_steps`).
    mechanism: Mechanism = Mechanism.DP_SGD
    cycle: int | None = None
    strategy: dict | None = dataclasses.field(default=None, hash=False)
    round_factor: float | None = None
    round_factor_exact: bool | None = None

    def __post_init__(self):
        # Validate here too, so a plan read back from a file (from_dict) is as checked
        # as one built by make_plan.
        _check_sampling(self.dataset_size, self.expected_batch_size)
        _check_steps(self.steps, error=PlanError)
        if not isinstance(self.dp, bool):
            raise PlanError(f"dp must be true or false, got dp={self.dp!r}")
        if self.dp:
            _check_positive("noise_multiplier", self.noise_multiplier, "sigma", error=PlanError)
        elif self.noise_multiplier != 0 or self.target_epsilon is not None or self.truncation_cost is not None:
            raise PlanError(
                f"noise_multiplier={self.noise_multiplier!r}, target_epsilon={self.target_epsilon!r}, "
                f"truncation_cost={self.truncation_cost!r} in a non-private plan (dp=False): a "
                "NON-PRIVATE baseline has no noise (0) and no ε (None)")
        _check_positive("max_grad_norm", self.max_grad_norm, "the clipping bound C",
                        error=PlanError)
        _check_delta(self.delta, self.dataset_size, default=default_delta(self.dataset_size),
                     error=PlanError)
        _check_accountant_field(self.accountant)
        _check_sampler_fields(self.sampler, self.accountant, self.dataset_size, self.max_batch_size)
        self._check_mechanism_fields()
        if Relation.get(self.relation) is None:
            raise PlanError(f"relation must be one of {Relation.choices()}, got relation={self.relation!r}")
        # checked: each choice as its member (equal to, and written as, the string it was)
        for name, kind in (("accountant", Accountant), ("sampler", Sampler),
                           ("relation", Relation), ("mechanism", Mechanism)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.target_epsilon is not None:
            _check_positive("target_epsilon", self.target_epsilon, "the privacy budget",
                            error=PlanError)
        self._check_noise_fields()
        self._check_prior_noise()
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

    def _check_mechanism_fields(self) -> None:
        from llmdp.privacy.mf import check_mechanism

        check_mechanism(self.mechanism, self.sampler, cycle=self.cycle, dp=self.dp,
                        bands=None if self.strategy is None else len(self.strategy.get("coefficients") or ()) or None)
        if not self.correlated:
            if any(v is not None for v in (self.strategy, self.round_factor, self.round_factor_exact)):
                raise PlanError("strategy / round_factor belong to a correlated mechanism's plan "
                                f"(mechanism is {self.mechanism!r})")
            return
        if not _is_int(self.cycle) or not (1 <= self.cycle <= self.dataset_size):
            raise PlanError(f"cycle must be an integer in [1, dataset_size] with mechanism "
                            f"{self.mechanism!r}, got cycle={self.cycle!r}")
        object.__setattr__(self, "cycle", int(self.cycle))
        if self.sampler == Sampler.CYCLIC_POISSON and self.event_probability > 1:
            raise PlanError(f"the group probability q_g = B·cycle/N = {self.event_probability:.4g} "
                            "is above 1: lower train.expected_batch_size or the cycle")
        if not self.dp:
            return
        if not isinstance(self.strategy, dict):
            raise PlanError(f"a {self.mechanism} plan needs its strategy (privacy.mf), got "
                            f"strategy={self.strategy!r}")
        fact = self.factorization()
        want = {Mechanism.BANDED_MF: "banded", Mechanism.BLT: "blt"}[self.mechanism]
        if fact.kind != want or fact.steps != self.steps:
            raise PlanError(f"the strategy is a {fact.kind} factorization for {fact.steps} steps; "
                            f"mechanism {self.mechanism!r} over {self.steps} steps needs a {want} one")
        f = self.round_factor
        if not (_is_number(f) and 0 < f < math.inf) or not isinstance(self.round_factor_exact, bool):
            raise PlanError(f"round_factor must be a finite number > 0 and round_factor_exact a "
                            f"boolean, got {f!r}, {self.round_factor_exact!r}")

    @property
    def correlated(self) -> bool:
        """Whether the noise is correlated across steps (banded MF, BLT)."""
        return self.mechanism != Mechanism.DP_SGD

    def factorization(self):
        """The strategy C (`llmdp.privacy.mf.factorization.Factorization`), None for DP-SGD / a baseline."""
        if self.strategy is None:
            return None
        from llmdp.privacy.mf import Factorization

        return Factorization.from_dict(self.strategy)

    @property
    def ledger_steps(self) -> int:
        """The run's releases in ledger units: T steps (DP-SGD), K = ⌈T/cycle⌉ rounds
        (a correlated mechanism: `llmdp.privacy.mf.plan`)."""
        return self.ledger_begun(self.steps)

    def ledger_index(self, step: int) -> int:
        """The ledger unit of training step ``step`` (its round for a correlated mechanism)."""
        return int(step) // self.cycle if self.correlated else int(step)

    def ledger_begun(self, steps: int) -> int:
        """The ledger units that ``steps`` steps have begun (⌈steps/cycle⌉ rounds)."""
        return -(-int(steps) // self.cycle) if self.correlated else int(steps)

    @property
    def event_probability(self) -> float:
        """The sampling probability of the ledger's event: q (DP-SGD), the group probability
        q_g = B·cycle/N (cyclic Poisson), 1 (fixed cycle: no amplification)."""
        if not self.correlated:
            return self.sampling_probability
        if self.sampler == Sampler.FIXED_CYCLE:
            return 1.0
        return float(self.expected_batch_size) * self.cycle / int(self.dataset_size)

    @property
    def event_multiplier(self) -> float:
        """The noise multiplier of the ledger's event: σ (DP-SGD), σ·f (a round)."""
        if not self.correlated or not self.dp:
            return self.noise_multiplier
        return self.noise_multiplier * self.round_factor

    def _check_noise_fields(self) -> None:
        k = self.noise_coordinates
        if k is not None and (not _is_int(k) or k < 1):
            raise PlanError(f"noise_coordinates must be an integer >= 1 (the trainable parameter "
                            f"count) or null, got noise_coordinates={k!r}")
        ev = self.eval_noise
        if ev is None:
            return
        ok = (isinstance(ev, (list, tuple)) and len(ev) == 3 and _is_int(ev[0]) and ev[0] >= 1
              and _is_int(ev[1]) and ev[1] >= 1 and _is_number(ev[2]) and 0 < ev[2] < math.inf)
        if not ok:
            raise PlanError(f"eval_noise must be [releases >= 1, coordinates >= 1, noise "
                            f"multiplier > 0] (the DP evaluations' noise) or null, got {ev!r}")
        object.__setattr__(self, "eval_noise", (int(ev[0]), int(ev[1]), float(ev[2])))

    def _check_prior_noise(self) -> None:
        pn = self.prior_noise
        if pn is None:
            return
        ok = isinstance(pn, (list, tuple)) and all(
            isinstance(x, (list, tuple)) and len(x) == 4 and isinstance(x[0], str) and _is_int(x[1])
            and x[1] >= 0 and _is_int(x[2]) and x[2] >= 1 and _is_number(x[3]) and 0 < x[3] < math.inf
            for x in pn)
        if not ok:
            raise PlanError(f"prior_noise must be a list of [what, count >= 0, coordinates >= 1, "
                            f"noise multiplier > 0] (a starting checkpoint's noised releases) or "
                            f"null, got {pn!r}")
        object.__setattr__(self, "prior_noise", tuple((str(w), int(c), int(k), float(z)) for w, c, k, z in pn))

    def noise_tail(self, steps: int | None = None, eval_releases: int | None = None) -> NoiseTail | None:
        """The truncated tails' `NoiseTail` of `steps` ledger units (default: all T steps;
        a correlated mechanism's round draws at most `cycle` steps' noise) and
        `eval_releases` DP evaluations (default: all planned); None when not folded in
        (`noise_coordinates` unknown, or a non-private plan)."""
        if not self.dp or self.noise_coordinates is None:
            return None
        draws = self.steps if steps is None else steps * (self.cycle if self.correlated else 1)
        return _run_tail(draws, self.noise_coordinates,
                         self.noise_multiplier, self.eval_noise, eval_releases, self.prior_noise)

    @property
    def noise_tail_delta(self) -> float | None:
        """The tails' share of `delta` over the planned releases (None: not folded in)."""
        tail = self.noise_tail()
        return None if tail is None else tail.delta(self.delta)

    @property
    def accountant_delta(self) -> float:
        """The δ every ε of this plan is computed at: `delta` minus the tails' share (0.0 when
        the tails alone spend δ: every ε is then inf); `delta` itself when not folded in."""
        tail = self.noise_tail()
        return self.delta if tail is None else tail.accountant_delta(self.delta)

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
    def clip_bound(self) -> float:
        """The bound the clipping engine applies: C, or inf for a non-private plan (every
        factor is then exactly 1: the engine sums the unclipped unit gradients)."""
        return self.max_grad_norm if self.dp else math.inf

    @property
    def truncated(self) -> bool:
        """Whether the plan uses truncated Poisson sampling (a cap `max_batch_size`)."""
        return self.sampler == TRUNCATED

    def _event_kwargs(self) -> dict:
        if not self.truncated:
            return {}
        return {"dataset_size": int(self.dataset_size), "max_batch_size": self.max_batch_size}

    def step_event(self) -> dp_accounting.DpEvent:
        """The event of one ledger unit: a step (Poisson, or truncated Poisson:
        `max_batch_size`), or a correlated mechanism's round (`llmdp.privacy.mf.plan`)."""
        if not self.dp:
            raise PlanError(_NO_EVENT)
        return dpsgd_step_event(
            self.event_probability, self.event_multiplier, **self._event_kwargs()
        )

    def make_sampler(self, num_units: int | None = None, groups=None):
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
        if self.sampler in (Sampler.CYCLIC_POISSON, Sampler.FIXED_CYCLE):
            from llmdp.privacy.sampling import CyclicPoissonSampler, FixedCycleSampler

            if groups is None or len(groups) != self.dataset_size:
                raise PlanError(f"a {self.sampler} sampler needs every unit's group (store_groups), "
                                f"got {None if groups is None else len(groups)} for "
                                f"{self.dataset_size} units")
            if self.sampler == Sampler.FIXED_CYCLE:
                return FixedCycleSampler(groups, self.cycle)
            return CyclicPoissonSampler(groups, self.cycle, self.event_probability)
        return _sampling.make_sampler(
            int(self.dataset_size), self.sampling_probability, self.max_batch_size
        )

    def epsilon(self, steps: int | None = None, accountant: str | None = None) -> float:
        """Epsilon after `steps` ledger units (default: all, `ledger_steps`) at
        `accountant_delta` (the published δ less the planned releases' noise tails): the ε of
        the published (ε, `delta`); inf for a non-private plan (no guarantee) or a δ the
        tails spend."""
        if not self.dp or self.accountant_delta <= 0:
            return math.inf
        steps = self.ledger_steps if steps is None else steps
        return _acc.epsilon_for(
            self.event_probability,
            self.event_multiplier,
            steps,
            self.accountant_delta,
            accountant or self.accountant,
            **self._event_kwargs(),
        )

    def epsilon_estimate(self, steps: int | None = None) -> float:
        """A fast, conservative PLD epsilon after `steps` steps, for display only
        (`accountant.epsilon_estimate` of this plan's event, at `accountant_delta`); inf for a
        non-private plan."""
        if not self.dp or self.accountant_delta <= 0:
            return math.inf
        steps = self.ledger_steps if steps is None else steps
        return _acc.epsilon_estimate(
            self.event_probability,
            self.event_multiplier,
            steps,
            self.accountant_delta,
            **self._event_kwargs(),
        )

    def to_dict(self) -> dict:
        # a choice as its plain string: the record is byte for byte what it always was
        d = {k: v.value if isinstance(v, Choice) else v for k, v in dataclasses.asdict(self).items()}
        if d["dp"]:
            del d["dp"]  # a DP plan's record is as before the field existed (from_dict: True)
        if d["eval_noise"] is not None:
            d["eval_noise"] = list(d["eval_noise"])
        if d["prior_noise"] is None:
            del d["prior_noise"]  # as before the field existed
        else:
            d["prior_noise"] = [list(x) for x in d["prior_noise"]]
        for k in ("mechanism", "cycle", "strategy", "round_factor", "round_factor_exact"):
            if not self.correlated:
                del d[k]  # a DP-SGD plan's record is as before correlated noise existed
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DPPlan:
        """Inverse of `to_dict`; a dict written before a field existed gets its default."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanError(f"unknown DPPlan field(s) {unknown}; known fields are {sorted(names)}")
        return cls(**d)


_PRIOR = "starting checkpoint: "


def _run_tail(steps: int, coordinates: int, sigma: float, eval_noise=None,
              eval_releases: int | None = None, prior_noise=None) -> NoiseTail:
    """The `NoiseTail` of `steps` steps of `coordinates` noise coordinates at `sigma`, the
    DP evaluations `eval_noise` = (releases, coordinates, noise multiplier) (their first
    `eval_releases`, default all), and a starting checkpoint's releases `prior_noise`."""
    parts = [("training steps", steps, coordinates, sigma)]
    # labelled once, also when the starting run composed a starting checkpoint of its own
    parts += [(w if w.startswith(_PRIOR) else _PRIOR + w, c, k, z) for w, c, k, z in prior_noise or ()]
    if eval_noise is not None:
        n, k, z = eval_noise
        parts.append(("DP evaluations", n if eval_releases is None else eval_releases, k, z))
    return noise_tail(parts)


def _delta_at(delta: float, steps: int, coordinates: int | None, eval_noise=None):
    """sigma -> the accountant's δ (`delta` less the tails at sigma), or None when the
    tails are not folded in (`coordinates` unknown)."""
    if coordinates is None:
        return None

    def at(sigma: float) -> float:
        return _run_tail(steps, coordinates, sigma, eval_noise).accountant_delta(delta)

    return at


def check_noise_tail(plan: DPPlan) -> DPPlan:
    """`plan`, or `PlanError` when the noise generator's truncated tails take more than
    MAX_TAIL_FRACTION of its δ: then the truncation, not the Gaussian, carries the
    guarantee (`noise.tail.MAX_TAIL_FRACTION` says why 10%). The message names the numbers
    of each kind of release and the fixes."""
    tail = plan.noise_tail()
    if tail is not None:
        _check_tail(plan.delta, tail, plan.eval_noise is not None)
    return plan


class NoiseTailError(PlanError):
    """A plan whose noise tails take more than MAX_TAIL_FRACTION of δ. ``share`` (the δ the
    tails need), ``delta`` and ``detail`` (the numbers per kind of release) let a caller
    restate the fix in its own terms (`llmdp privacy calibrate`: flags)."""

    def __init__(self, message: str, *, share: float, delta: float, detail: str):
        super().__init__(message)
        self.share, self.delta, self.detail = share, delta, detail


def _check_tail(delta: float, tail: NoiseTail, evals: bool = False) -> None:
    share = tail.delta(delta)
    if share <= MAX_TAIL_FRACTION * delta:
        return
    # What the tails need (above δ itself when they spend it all: accountant_delta is 0).
    share = tail.eta + max(0.0, delta - tail.eta) * min(1.0, tail.lost_mass)
    parts = "; ".join(
        f"{what}: {count} x η = {eta / count:.3g} each ({coords:,} noise coordinates at noise "
        f"multiplier {sigma:.4g}), {eta:.3g} in all"
        for what, count, coords, sigma, eta in tail.parts)
    lost = (f", and the kept-mass factor 1 - {tail.lost_mass:.3g} on δ_accountant"
            if tail.lost_mass >= 1e-6 else "")
    evals = ("; for the DP evaluations, a larger eval.noise_multiplier (or a smaller "
             "eval.epsilon)" if evals else "")
    head = tail_message(share, delta, parts + lost)
    raise NoiseTailError(
        f"privacy.delta: {head}. Fix: fewer trainable parameters (LoRA: "
        f"model.lora), fewer steps (train.steps / train.epochs), more noise (a larger "
        f"privacy.noise_multiplier, or a smaller privacy.target_epsilon){evals}, or a larger "
        f"privacy.delta (still below 1/N)", share=share, delta=delta, detail=parts + lost)


def tail_message(share: float, delta: float, detail: str) -> str:
    """The numbers of a `NoiseTailError`, without the fix."""
    return (f"the noise generator's truncated tails (|z| <= {NOISE_TAIL:.4g} std) add δ = "
            f"{share:.3g} to δ = {delta:.3g}, {100 * share / delta:.3g}% of it (at most "
            f"{100 * MAX_TAIL_FRACTION:g}% is allowed: above that the truncation, not the "
            f"Gaussian, carries the guarantee): {detail}")


_NO_EVENT = (
    "this is the plan of a NON-PRIVATE baseline (privacy.dp: false): it makes no DP release, "
    "so it has no DP event to account, compose or record in a ledger")


def _check_calibration_args(target_epsilon, delta, sampling_probability, steps, accountant,
                            max_noise_multiplier):
    target = _check_positive("target_epsilon", target_epsilon, "the privacy budget",
                             error=PlanError)
    delta = _check_delta(delta, error=PlanError)
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
    accountant: Accountant = Accountant.PLD,
    max_noise_multiplier: float = 100.0,
    *,
    dataset_size: int | None = None,
    max_batch_size: int | None = None,
    noise_coordinates: int | None = None,
) -> float:
    """The smallest noise multiplier sigma whose epsilon (at `delta`, after `steps`
    steps at sampling rate q) is at most `target_epsilon`.

    With `noise_coordinates` (the trainable parameter count), `delta` is the published δ
    and epsilon is computed at δ less the noise generator's truncated tails over the
    `steps` steps at each sigma tried (`DPPlan.accountant_delta`): the published (ε, δ)
    includes them. (The refusal of a tail above a tenth of δ is `make_plan`'s.)

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
    if noise_coordinates is not None and (not _is_int(noise_coordinates) or noise_coordinates < 1):
        raise PlanError("noise_coordinates must be an integer >= 1 (the trainable parameter "
                        f"count), got noise_coordinates={noise_coordinates!r}")
    delta_at = _delta_at(delta, steps, noise_coordinates)
    if max_batch_size is not None:
        if not _is_int(dataset_size) or dataset_size < 1:
            raise PlanError(
                "dataset_size must be an integer >= 1 (the number of privacy units N of the "
                f"truncated event) with max_batch_size, got dataset_size={dataset_size!r}"
            )
        b = _check_sampler_fields(TRUNCATED, accountant, dataset_size, max_batch_size)
        return calibrate_truncated(q, steps, delta, int(dataset_size), b, target, max_sigma,
                                   delta_at=delta_at)
    return calibrate_curve(EpsilonCurve(q, steps, delta, accountant, delta_at=delta_at), target,
                           max_sigma)


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
    accountant: Accountant = Accountant.PLD,
    max_noise_multiplier: float = 100.0,
    sampler: Sampler = Sampler.POISSON,
    max_batch_size: int | None = None,
    truncation_budget: float = DEFAULT_TRUNCATION_BUDGET,
    dp: bool = True,
    noise_coordinates: int | None = None,
    mechanism: MechanismConfig = _DP_SGD,
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

    `noise_coordinates` (the trainable parameter count; None: unknown, not folded in): the
    noise generator's truncated tails over the T steps are folded into `delta`, the
    published δ: sigma is calibrated at δ less the tails at each sigma tried
    (`DPPlan.accountant_delta`), and a plan whose tails take more than a tenth of δ is
    refused (`check_noise_tail`). A run's DP evaluations add theirs (`DPPlan.eval_noise`,
    `prior.calibrate_with_prior`).

    `dp=False`: a NON-PRIVATE baseline's plan (no target, no σ; truncated Poisson needs its cap).

    `mechanism`: the mechanism's own inputs, one config per `Mechanism`
    (`llmdp.privacy.mechanism`): `DpSgd()` (the default), or `BandedMf` / `Blt`
    (`llmdp.privacy.mf.plan`): a correlated mechanism with a cyclic sampler of `cycle`
    groups; its strategy is optimized here for T steps (`bands`, `buffers`; the workload of
    SGD with `momentum` and the per-step `learning_rates` multipliers; cached under
    `strategy_cache`), and σ is calibrated on the ledger's rounds.
    """
    mechanism = check_config(mechanism)
    if (steps is None) == (epochs is None):
        got = "both" if steps is not None else "neither"
        raise PlanError(
            f"pass exactly one of steps= or epochs=, got {got} (steps={steps!r}, epochs={epochs!r})"
        )
    if not dp and (target_epsilon is not None or noise_multiplier is not None):
        raise PlanError(
            "a non-private plan (dp=False) takes neither target_epsilon= nor noise_multiplier= "
            f"(got target_epsilon={target_epsilon!r}, noise_multiplier={noise_multiplier!r}): a "
            "NON-PRIVATE baseline adds no noise")
    if dp and (target_epsilon is None) == (noise_multiplier is None):
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
    cyc = None
    if mechanism.mechanism.correlated:  # the cyclic sampler's groups; a fixed cycle's batch is N / cycle
        cyc, expected_batch_size = mechanism.resolve(sampler, dp=dp, dataset_size=dataset_size,
                                                     expected_batch_size=expected_batch_size)
        q = expected_batch_size / int(dataset_size)
    mf = {} if cyc is None else {"mechanism": mechanism.mechanism, "cycle": cyc}
    if sampler == TRUNCATED and cap is None and not dp:
        raise PlanError(
            f"privacy.max_batch_size is required with privacy.sampler={TRUNCATED!r} and "
            "privacy.dp: false: the cap is otherwise chosen by its ε cost, which a NON-PRIVATE "
            "baseline does not have; set it to the DP run's cap (its report's max_batch_size)")
    if sampler == TRUNCATED and cap is None:
        if not _is_number(truncation_budget) or not (0 < truncation_budget < math.inf):
            raise PlanError(
                "privacy.truncation_budget (the largest relative epsilon cost of the automatic "
                "max_batch_size, e.g. 0.01 for 1%) must be a finite number > 0, got "
                f"truncation_budget={truncation_budget!r}"
            )
    steps = _check_steps(steps, error=PlanError) if steps is not None else steps_for_epochs(epochs, q)
    if noise_coordinates is not None and (not _is_int(noise_coordinates) or noise_coordinates < 1):
        raise PlanError("noise_coordinates must be an integer >= 1 (the trainable parameter "
                        f"count), got noise_coordinates={noise_coordinates!r}")
    if not dp:  # the same sampling and steps, no noise: nothing to calibrate
        return DPPlan(dataset_size=int(dataset_size), expected_batch_size=float(expected_batch_size),
                      steps=steps, noise_multiplier=0.0, max_grad_norm=float(max_grad_norm),
                      delta=delta, accountant=accountant, sampler=sampler, max_batch_size=cap,
                      dp=False, **mf)
    sigma = max_sigma = None
    if noise_multiplier is not None:
        sigma = _check_positive("noise_multiplier", noise_multiplier, "sigma", error=PlanError)
        if noise_coordinates is not None:  # before any accounting at what is left of δ
            _check_tail(delta, _run_tail(steps, int(noise_coordinates), sigma))
    else:
        target_epsilon = _check_positive("target_epsilon", target_epsilon, "the privacy budget",
                                         error=PlanError)
        max_sigma = _check_positive(
            "max_noise_multiplier", max_noise_multiplier, "largest sigma tried"
        , error=PlanError)
    if mf:
        common = dict(dataset_size=int(dataset_size), expected_batch_size=float(expected_batch_size),
                      steps=steps, max_grad_norm=float(max_grad_norm), delta=delta,
                      accountant=accountant, sampler=sampler,
                      noise_coordinates=None if noise_coordinates is None else int(noise_coordinates),
                      target_epsilon=None if target_epsilon is None else float(target_epsilon), **mf)
        return _correlated_plan(common, sigma, max_sigma, mechanism)
    cost = None
    if sampler == TRUNCATED:
        sigma, cap, cost = plan_truncated(
            q=q,
            n=int(dataset_size),
            steps=steps,
            delta=delta,
            sigma=sigma,
            target=target_epsilon,
            cap=cap,
            budget=float(truncation_budget),
            max_sigma=max_sigma,
            delta_at=_delta_at(delta, steps, noise_coordinates),
        )
    elif sigma is None:
        sigma = calibrate_noise(
            target_epsilon,
            delta,
            q,
            steps,
            accountant=accountant,
            max_noise_multiplier=max_sigma,
            noise_coordinates=noise_coordinates,
        )
    return check_noise_tail(DPPlan(
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
        noise_coordinates=None if noise_coordinates is None else int(noise_coordinates),
    ))



def _correlated_plan(common: dict, sigma, max_sigma, config) -> DPPlan:
    """A correlated mechanism's `DPPlan` (`llmdp.privacy.mf.plan`): its strategy (built by
    its config, `llmdp.privacy.mechanism`), the round event's factor f, and σ (given, or
    calibrated on the ledger's rounds: the round's multiplier σ·f is what the accountant sees)."""
    from llmdp.privacy import mf as _mf

    steps, cyc, sampler = common["steps"], common["cycle"], common["sampler"]
    fact = config.strategy(sampler, steps=steps, cycle=cyc)
    f, exact = _mf.round_factor(fact, sampler, steps=steps, cycle=cyc)
    # what the plan records: the strategy and how it was made, not whether a cache served it
    # (a re-launch's plan must equal the first launch's)
    fact = dataclasses.replace(fact, meta={k: v for k, v in fact.meta.items() if k != "cached"})
    mf = dict(strategy=fact.to_dict(), round_factor=float(f), round_factor_exact=bool(exact))
    if sigma is None:
        probe = DPPlan(noise_multiplier=1.0, **mf, **common)
        k, delta = common["noise_coordinates"], common["delta"]

        def delta_at(s: float) -> float:  # the tails of all T steps' draws at σ = s / f
            return _run_tail(steps, k, s / f).accountant_delta(delta)

        curve = EpsilonCurve(probe.event_probability, probe.ledger_steps, delta,
                             common["accountant"], delta_at=None if k is None else delta_at)
        s = calibrate_curve(curve, common["target_epsilon"], float(max_sigma) * f)
        sigma = s / f
        while sigma * f < s:  # the round's multiplier never below the calibrated one
            sigma = math.nextafter(sigma, math.inf)
    return check_noise_tail(DPPlan(noise_multiplier=float(sigma), **mf, **common))
