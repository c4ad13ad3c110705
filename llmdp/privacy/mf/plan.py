"""The correlated mechanisms' part of a DP plan: which sampler each analysis covers, the
strategy C, and the event the ledger records per *round*.

A correlated mechanism (banded MF, BLT; `llmdp.privacy.mf.factorization`) runs with a cyclic sampler
(`llmdp.privacy.sampling.cyclic`): units in ``cycle`` fixed groups, step t draws from group
t mod cycle only. Its ledger unit is a **round**: the ``cycle`` consecutive steps
[r·cycle, (r+1)·cycle) in which every group has its turn once, so a run of T steps has
K = ⌈T/cycle⌉ rounds, and the ε of any prefix of the run is at most that of the rounds
it has begun (a round is recorded before its first step: write-ahead).

* ``cyclic-poisson`` + ``banded-mf`` (b ≤ cycle), the amplified analysis (Choquette-Choo et
  al. 2023, "Amplified banded matrix factorization", Thm. 4; JAX Privacy's amplified
  banded-MF event): a unit's participations are ≥ cycle ≥ b steps apart, so each touches
  rows of C·G that no other participation of it touches (C is b-banded), and the release
  is an adaptive composition, per round, of one Poisson-subsampled Gaussian mechanism
  with the group's probability q_g and noise multiplier σ / (C's largest column norm). C is
  scaled so that norm is 1: the round's event is PoissonSampled(q_g, Gaussian(σ)), the
  same for every round.
* ``fixed-cycle`` (banded-mf or blt), without amplification: a unit participates at most
  k = K times, at steps ≥ cycle apart, so the whole run is one Gaussian mechanism with
  noise multiplier σ / sens(C) (min-separation sensitivity, `sensitivity`); C is
  scaled so that sens = 1. The ledger records it as K identical rounds of
  Gaussian(σ·f), f = min_{r ≤ K} √r / sens_r, sens_r the sensitivity of the first r rounds
  (r participations in the first min(r·cycle, T) steps): Gaussians compose exactly
  (1/σ² adds), so r rounds are Gaussian(σ·f/√r), at most as private as the prefix
  (σ·f/√r ≤ σ/sens_r), and all K are exactly Gaussian(σ) when the minimum is at r = K
  (``round_factor_exact``: sensitivity growing at least linearly in the rounds, as for the
  non-negative decreasing strategies llmdp optimizes; otherwise the ledger over-counts,
  stated in the report).

Every other combination is refused by name: plain or truncated Poisson with a correlated
mechanism (the analyses need a unit's participations ≥ b apart), BLT with cyclic Poisson
(amplification for BLT needs a balls-in-bins analysis with a verified bound, not built),
banded-mf with more bands than the cycle under cyclic Poisson, and cyclic samplers with
DP-SGD.
"""

from __future__ import annotations

import math

from llmdp.config.choices import Mechanism, Sampler, mechanism_problem
from llmdp.privacy.accounting import PlanError

__all__ = ["MechanismError", "mf_commitment", "check_mechanism", "resolve_cycle", "rounds", "round_factor",
           "build_strategy", "participation_text"]

class MechanismError(PlanError):
    """A mechanism / sampler combination no analysis here covers; ``field`` is the recipe
    key (under ``privacy``) to change."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_mechanism(mechanism: str, sampler: str, *, bands=None, cycle=None, dp: bool = True) -> None:
    """Refuse, naming the field, every (mechanism, sampler, bands, cycle) no analysis covers
    (the rules: `llmdp.config.choices.mechanism_problem`, which recipe checks read too)."""
    problem = mechanism_problem(mechanism, sampler, bands=bands, cycle=cycle, dp=dp)
    if problem is not None:
        raise MechanismError(*problem)


def resolve_cycle(sampler: str, *, bands, cycle, dataset_size: int, expected_batch_size: float) -> int:
    """The number of groups: ``cycle`` if given; else cyclic-poisson's ``bands``, or
    fixed-cycle's round(N / B) (every step then takes ~B units)."""
    if cycle is not None:
        c = int(cycle)
    elif sampler == Sampler.CYCLIC_POISSON:
        c = int(bands)
    else:
        c = max(1, round(int(dataset_size) / float(expected_batch_size)))
    if c > dataset_size:
        raise MechanismError(f"{c} groups is more than the {dataset_size} units: every group needs "
                             "units; lower cycle", "cycle")
    if sampler == Sampler.CYCLIC_POISSON and float(expected_batch_size) * c > dataset_size:
        raise MechanismError(
            f"{c} groups at train.expected_batch_size {expected_batch_size:g} need a group "
            f"probability q_g = B·cycle/N = {float(expected_batch_size) * c / dataset_size:.4g} > 1 "
            f"(N = {dataset_size}); lower the batch size or the cycle (bands)", "cycle")
    return c


def rounds(steps: int, cycle: int) -> int:
    """K = ⌈T / cycle⌉: the rounds a run of T steps begins."""
    return -(-int(steps) // int(cycle))


def build_strategy(mechanism: str, sampler: str, *, steps: int, cycle: int, bands=None,
                   buffers: int = 8, momentum: float = 0.0, learning_rates=None, cache_dir=None):
    """The optimized strategy (`llmdp.privacy.mf.factorization.Factorization`), scaled so that the
    sensitivity its sampler's analysis uses is 1 (cached by its inputs, `optimize`)."""
    from llmdp.privacy.mf.optimize import strategy_for

    fixed = sampler == Sampler.FIXED_CYCLE
    k = rounds(steps, cycle)
    return strategy_for(mechanism, int(steps), bands=bands,
                        min_sep=int(cycle) if fixed else None,
                        max_participations=k if fixed else None, max_buffers=int(buffers),
                        momentum=float(momentum), learning_rates=learning_rates,
                        cache_dir=cache_dir)


def prefix_sensitivities(fact, steps: int, cycle: int) -> list[tuple[float, bool]]:
    """(sens_r, exact) for r = 1..K: the min-separation sensitivity of the first r rounds."""
    from llmdp.privacy.mf.sensitivity import minsep_sensitivity

    out = []
    for r in range(1, rounds(steps, cycle) + 1):
        v, exact = minsep_sensitivity(fact, min(r * cycle, steps), cycle, r)
        out.append((float(v), bool(exact)))
    return out


def scaled_sensitivity(fact, sampler: str, *, steps: int, cycle: int) -> float:
    """The sensitivity the sampler's analysis uses, of the strategy as recorded (scale
    included): C's largest column norm (cyclic Poisson) or its min-separation sensitivity
    over all K rounds (fixed cycle). `build_strategy` scales it to 1, so it is linear in
    ``scale``: a plan read back is checked against it (`llmdp.record.rundir.check_read_back`)."""
    if sampler == Sampler.CYCLIC_POISSON:
        from llmdp.privacy.mf.sensitivity import column_norms

        return float(max(column_norms(fact.c_coefficients(steps), steps)))
    from llmdp.privacy.mf.sensitivity import minsep_sensitivity

    return float(minsep_sensitivity(fact, steps, cycle, rounds(steps, cycle))[0])


def round_factor(fact, sampler: str, *, steps: int, cycle: int) -> tuple[float, bool]:
    """(f, exact): the ledger's round event is Gaussian(σ·f) (fixed-cycle), or the
    Poisson-subsampled Gaussian at σ·f with f = 1 (cyclic-poisson: C's largest column norm,
    checked to be 1). ``exact``: K rounds compose to exactly the one-release analysis."""
    if sampler == Sampler.CYCLIC_POISSON:
        from llmdp.privacy.mf.sensitivity import column_norms

        top = float(max(column_norms(fact.c_coefficients(steps), steps)))
        if not top <= 1.0 + 1e-12:
            raise PlanError(f"the banded strategy's largest column norm is {top!r}, not 1: it was "
                            "not scaled for the amplified analysis")
        return min(1.0, 1.0 / top), True
    sens = prefix_sensitivities(fact, steps, cycle)
    k = len(sens)
    f = min(math.sqrt(r) / s for r, (s, _) in enumerate(sens, 1) if s > 0)
    full = sens[-1][0]
    if not full <= 1.0 + 1e-9:
        raise PlanError(f"the strategy's min-separation sensitivity is {full!r}, not 1: it was not "
                        "scaled for the fixed-participation analysis")
    exact = all(e for _, e in sens) and f >= math.sqrt(k) / full * (1 - 1e-12)
    return min(f, math.sqrt(k) / full), exact


def participation_text(mechanism: str, sampler: str, cycle: int, steps: int, q_group=None) -> str:
    """The participation assumption in plain words (report, card, console)."""
    k = rounds(steps, cycle)
    name = {Mechanism.BANDED_MF: "banded matrix factorization", Mechanism.BLT: "buffered linear Toeplitz (BLT)"}
    mech = name.get(mechanism, mechanism)
    if sampler == Sampler.CYCLIC_POISSON:
        return (f"correlated noise ({mech}); the units are split into {cycle} fixed groups by a "
                f"keyed hash of their content, step t draws each unit of group t mod {cycle} with "
                f"probability {q_group:.4g} (cyclic Poisson), so a unit takes part in at most {k} "
                f"steps, at least {cycle} apart; accounted as {k} Poisson-subsampled Gaussian "
                f"mechanisms (amplified banded MF)")
    return (f"correlated noise ({mech}); the units are split into {cycle} fixed groups by a keyed "
            f"hash of their content, step t takes every unit of group t mod {cycle} (fixed cycle, "
            f"no sampling), so a unit takes part in at most {k} steps, at least {cycle} apart; "
            f"accounted as one Gaussian mechanism at the strategy's min-separation sensitivity "
            f"(no amplification)")


def mf_commitment(plan) -> dict:
    """What a correlated run's ledger records commit to (every one carries it in ``meta``):
    the strategy's digest and shape, the horizon, the rounds, σ, the sampler, the round
    event's factor. Public configuration only (no data)."""
    fact = plan.factorization()
    return {"strategy_sha256": fact.digest(), "kind": fact.kind, "bands": fact.bands,
            "buffers": fact.buffers, "cycle": plan.cycle, "steps": plan.steps,
            "rounds": plan.ledger_steps, "max_participations": plan.ledger_steps,
            "noise_multiplier": plan.noise_multiplier, "sampler": plan.sampler,
            "group_probability": plan.event_probability if plan.sampler == Sampler.CYCLIC_POISSON else None,
            "round_factor": plan.round_factor, "round_factor_exact": plan.round_factor_exact,
            "ledger_unit": "round"}
