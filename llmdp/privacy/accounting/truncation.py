"""Truncated Poisson sampling: what the cap B_max costs, and how the planner picks it.

Truncated Poisson sampling caps every step at B_max units (bounded memory); it is
accounted with dp-accounting's `TruncatedSubsampledGaussianDpEvent` (PLD only).
`truncation_probability` is how often a step drops units, `truncation_cost` what the cap
costs in epsilon relative to Poisson sampling; `smallest_cap` finds the smallest cap
whose cost is below a budget and `plan_truncated` settles (sigma, B_max) for `make_plan`.
"""

from __future__ import annotations

import math

from llmdp.config.choices import Accountant
from llmdp.privacy.accounting.calibrate import (
    _SEARCH_INTERVAL,
    EpsilonCurve,
    PlanError,
    calibrate_curve,
    round_up,
)

__all__ = [
    "DEFAULT_TRUNCATION_BUDGET",
    "calibrate_truncated",
    "plan_truncated",
    "smallest_cap",
    "truncation_cost",
    "truncation_probability",
]

# make_plan picks the smallest cap B_max whose relative epsilon cost is below this.
DEFAULT_TRUNCATION_BUDGET = 0.01

# Rounds of "search B_max at sigma, calibrate sigma at B_max" before giving up (they
# settle in 1-2: B_max moves sigma by < 1%).
_MAX_ROUNDS = 6


def truncation_probability(dataset_size: int, sampling_probability: float, max_batch_size: int) -> float:
    """P(|S| > B_max) for S ~ Binomial(N, q): the per-step probability that truncated
    Poisson sampling drops units. `scipy.stats.binom.sf(B_max, N, q)`."""
    from scipy import stats  # here: a training worker loads this module, never scipy's

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
    from scipy import stats

    from llmdp.privacy.accounting import accountant as _acc

    # dp-accounting's own shortcut, for the event's dataset size N + 1 (`dpsgd_step_event`).
    if stats.binom.sf(int(max_batch_size) - 1, int(dataset_size), sampling_probability) == 0.0:
        return 0.0  # exactly the Poisson PLD (dp-accounting's own shortcut): no PLD needed
    if value_discretization_interval is None:

        def eps(b):
            return _acc.epsilon_for(
                sampling_probability, noise_multiplier, steps, delta, Accountant.PLD,
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


def _truncated_curve(q, steps, delta, n, b, interval=None, delta_at=None) -> EpsilonCurve:
    return EpsilonCurve(
        q, steps, delta, Accountant.PLD, dataset_size=n, max_batch_size=b, interval=interval,
        delta_at=delta_at,
    )


def _calibrate_truncated(q, steps, delta, n, b, target, max_sigma, start, delta_at=None) -> float:
    """sigma calibrated on the search grid under the truncated event at cap b, walking
    from `start` (the Poisson sigma, or a previous round's)."""
    curve = _truncated_curve(q, steps, delta, n, b, _SEARCH_INTERVAL, delta_at)
    return calibrate_curve(curve, target, max_sigma, start=start)


def calibrate_truncated(q, steps, delta, n, b, target, max_sigma, delta_at=None) -> float:
    """sigma calibrated under the truncated event at cap b (`plan.calibrate_noise`): on the
    search grid, first under Poisson then at the cap, then checked (nudged up if needed)
    on the reporting grid, so epsilon(sigma) <= target holds for the reported number.
    `delta_at(sigma)`: the accountant's δ at sigma (`EpsilonCurve`; None: `delta`)."""
    sigma = calibrate_curve(EpsilonCurve(q, steps, delta, Accountant.PLD, interval=_SEARCH_INTERVAL,
                                         delta_at=delta_at), target, max_sigma)
    sigma = _calibrate_truncated(q, steps, delta, n, b, target, max_sigma, sigma, delta_at)
    return round_up(_truncated_curve(q, steps, delta, n, b, delta_at=delta_at), target, sigma)


def smallest_cap(q, steps, delta, n, sigma, budget, start=None, step=None) -> int:
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


def plan_truncated(*, q, n, steps, delta, sigma, target, cap, budget, max_sigma, delta_at=None):
    """(sigma, B_max, truncation_cost) of a truncated-Poisson plan.

    `delta_at(sigma)` is the accountant's δ at sigma (the published `delta` less the noise
    tails, `plan.make_plan`; None: `delta`): every epsilon, cost and cap search runs at it.

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
    def dl(s):
        return delta if delta_at is None else delta_at(s)

    if target is not None:
        sigma = calibrate_curve(EpsilonCurve(q, steps, delta, Accountant.PLD, interval=_SEARCH_INTERVAL,
                                             delta_at=delta_at), target, max_sigma)
    b = cap if cap is not None else smallest_cap(q, steps, dl(sigma), n, sigma, budget)
    if target is not None:
        sigma_at: dict[int, float] = {}
        for _ in range(_MAX_ROUNDS):
            sigma = sigma_at[b] = _calibrate_truncated(q, steps, delta, n, b, target, max_sigma,
                                                       sigma, delta_at)
            if cap is not None:
                break
            nxt = smallest_cap(q, steps, dl(sigma), n, sigma, budget, start=b, step=1)
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
            sigma = round_up(_truncated_curve(q, steps, delta, n, b, delta_at=delta_at), target,
                             sigma)
        cost = truncation_cost(q, sigma, steps, dl(sigma), n, b) if dl(sigma) > 0 else math.inf
        # b == n is the largest cap allowed: the sampler never truncates on the N units,
        # but the add-neighbour (N + 1 units) can, so its cost is small but not 0; on a
        # tiny dataset it may exceed the budget. The plan carries (and the report states) it.
        if cap is not None or cost < budget or b >= n:
            return sigma, b, cost
        b += 1  # knife edge: the search grid said < budget, the reporting grid does not
        if target is not None:
            sigma = _calibrate_truncated(q, steps, delta, n, b, target, max_sigma, sigma, delta_at)
    raise PlanError(
        f"could not find privacy.max_batch_size with truncation cost < {budget:g} "
        f"(last tried {b}, cost {cost:.4g}); set privacy.max_batch_size explicitly"
    )
