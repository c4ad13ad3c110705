"""Composition with earlier releases on the same units (e.g. a private tokenizer's): the
epsilon a run's plan and those releases spend together, and sigma raised to meet the
target with them (on `calibrate.calibrate_sigma`)."""

from __future__ import annotations

import dataclasses
import math

from llmdp.config.choices import Accountant
from llmdp.privacy.accounting.calibrate import (
    _SEARCH_INTERVAL,
    Memo,
    PlanError,
    calibrate_sigma,
    knobs_message,
)
from llmdp.privacy.accounting.events import event_from_json
from llmdp.privacy.accounting.truncation import truncation_cost

__all__ = ["calibrate_with_prior", "composed_epsilon", "release_entries"]


def release_entries(releases) -> tuple[list, float]:
    """(entries, delta_threshold) of earlier releases a run builds on (``plan.json``
    ``prior_releases``: dicts with ``event`` JSON, ``count`` and ``extra``)."""
    from llmdp.privacy.accounting import accountant as _acc  # at the call, as in `calibrate`

    releases = list(releases)
    return ([(event_from_json(r["event"]), int(r["count"])) for r in releases],
            _acc.threshold_delta(releases))


def composed_epsilon(plan, prior_releases=(), accountant: str | None = None,
                     steps: int | None = None,
                     value_discretization_interval: float | None = None) -> float:
    """Epsilon at `plan.accountant_delta` (the published δ less the noise tails of the
    plan's releases) of earlier releases on the same units (`prior_releases`, e.g. a
    private tokenizer's, thresholds' delta included) composed with `steps` (default: all)
    steps of the `DPPlan` `plan` (`accountant.epsilon_with_threshold`); inf when the
    tails and thresholds leave nothing of δ."""
    steps = plan.ledger_steps if steps is None else steps
    prior, d_thr = release_entries(prior_releases)
    if not prior and value_discretization_interval is None:
        return plan.epsilon(steps, accountant) if steps else 0.0
    if plan.accountant_delta <= d_thr:
        return math.inf
    entries = prior + ([(plan.step_event(), steps)] if steps else [])
    from llmdp.privacy.accounting import accountant as _acc

    return _acc.epsilon_with_threshold(entries, plan.accountant_delta, d_thr,
                                       accountant or plan.accountant, value_discretization_interval)


def calibrate_with_prior(plan, prior_releases, rtol: float = 1e-3):
    """The `DPPlan` `plan` with sigma raised so that the composition of the earlier
    releases (`prior_releases`, thresholds' delta included) and all of the plan's steps is
    <= `plan.target_epsilon` at `plan.accountant_delta`: the guarantee of a model trained
    with a private tokenizer covers both. The noise tails (`DPPlan.noise_tail`: its steps
    and DP evaluations) shrink as sigma grows, so every sigma tried is accounted at its own
    `accountant_delta` (`dataclasses.replace` recomputes it). sigma is located with Brent's
    method on log sigma on the coarse PLD grid, refined on the reporting grid to `rtol`, and
    always lands on the side that meets the target (`calibrate_sigma`, twice). A truncated
    plan keeps its cap; its cost is recomputed at the new sigma.
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
    from llmdp.privacy.accounting import accountant as _acc

    spent = _acc.epsilon_with_threshold(prior_entries, plan.delta, d_thr, plan.accountant)
    # (at the whole δ: what the earlier releases alone spend, before any tail of this run)
    if spent >= target:
        raise PlanError(
            f"privacy.target_epsilon: {target:g} is already spent by the earlier releases on this "
            f"data (ε = {spent:.4f} at δ = {plan.delta:.3g}: a private tokenizer, a starting checkpoint "
            f"trained on this data); raise target_epsilon, or train the tokenizer or the "
            f"checkpoint with a smaller epsilon"
        )

    coarse = _SEARCH_INTERVAL if plan.accountant == Accountant.PLD else None

    def curve(interval) -> Memo:
        def eps(sigma: float) -> float:
            p = dataclasses.replace(plan, noise_multiplier=sigma, truncation_cost=None,
                                    truncation_probability=None)
            return composed_epsilon(p, prior_releases, value_discretization_interval=interval)

        return Memo(eps)

    fine = curve(None)
    if fine(plan.noise_multiplier) <= target:
        return plan
    # 1. On the planner's coarse grid (fast): walk up from the plan's sigma, locate loosely.
    guess = calibrate_sigma(
        curve(coarse), target, start=float(plan.noise_multiplier), factor=1.5, rtol=1e-3,
        max_sigma=1e4, walk_down=False, log=True, check=False,
        unreachable=lambda _: PlanError(
            f"no noise multiplier reaches target_epsilon={target:g} with the earlier "
            f"releases composed; {knobs_message()}"),
    )
    # 2. On the reporting grid, from the guess in small steps; never above the target.
    sigma = calibrate_sigma(fine, target, start=guess, factor=1.02, rtol=rtol / 4, log=True)
    cost = None
    if plan.truncated:
        new = dataclasses.replace(plan, noise_multiplier=sigma)
        cost = truncation_cost(plan.sampling_probability, sigma, plan.steps, new.accountant_delta,
                               plan.dataset_size, plan.max_batch_size)
    return dataclasses.replace(plan, noise_multiplier=sigma, truncation_cost=cost,
                               truncation_probability=None)
