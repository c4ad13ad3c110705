"""The noise generator's truncated tails are part of the published δ (issue 29, item 8).

The published δ = δ_accountant / Z + Σ count·η (`llmdp.privacy.noise_tail`): σ is calibrated
so that dp-accounting, called directly at δ_accountant = (δ - T·η)·(1 - T·k·2**-53), gives
the target ε; a plan whose tails take more than a tenth of δ is refused."""

import math

import dp_accounting
import pytest

from llmdp.privacy.noise_tail import (
    MAX_TAIL_FRACTION,
    NOISE_TAIL,
    noise_tail,
    truncation_delta_per_step,
)
from llmdp.privacy.plan import NoiseTailError, PlanError, make_plan

N, B, T, DELTA, K = 10_000, 50, 300, 1e-6, 10**8  # σ ≈ 0.65: the tails are ~6% of δ


def _direct_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def _accountant_delta(delta: float, steps: int, k: int, sigma: float) -> float:
    """δ_accountant written out from the statement δ <= δ_acc/Z + T·η, Z >= 1 - T·k·2**-53."""
    return (delta - steps * truncation_delta_per_step(k, sigma)) * (1 - steps * k / 2.0**53)


def test_the_issues_magnitude_example():
    """7 B parameters, σ = 0.5, 10,000 steps: T·η ≈ 4.6e-5 (the issue's figure), larger
    than any δ one would publish."""
    eta = truncation_delta_per_step(7 * 10**9, 0.5)
    assert 10_000 * eta == pytest.approx(4.6e-5, rel=0.01)
    tail = noise_tail([("training steps", 10_000, 7 * 10**9, 0.5)])
    assert tail.eta == pytest.approx(10_000 * eta, rel=1e-12)
    assert tail.lost_mass == pytest.approx(10_000 * 7e9 / 2**53, rel=1e-12)
    assert tail.accountant_delta(1e-5) == 0.0 and tail.delta(1e-5) == 1e-5  # nothing left


def test_calibration_at_delta_gives_the_target_at_delta_less_the_tails():
    """make_plan at δ: dp-accounting called directly at δ - T·η (and the kept mass) gives the
    target ε (to the calibration's 1e-4), and at δ itself clearly less: σ was calibrated at
    what the tails leave (before the fix, at δ: above the target at δ - T·η)."""
    target = 3.0
    plan = make_plan(dataset_size=N, expected_batch_size=B, max_grad_norm=1.0, steps=T,
                     delta=DELTA, target_epsilon=target, noise_coordinates=K)
    q, sigma = B / N, plan.noise_multiplier
    d_acc = _accountant_delta(DELTA, T, K, sigma)
    share = DELTA - d_acc
    assert 0.01 * DELTA < share < MAX_TAIL_FRACTION * DELTA  # the tails matter here, and fit
    assert plan.delta == DELTA and plan.accountant_delta == pytest.approx(d_acc, rel=1e-12)
    assert plan.noise_tail_delta == pytest.approx(share, rel=1e-9)
    eps = _direct_epsilon(q, sigma, T, d_acc)
    assert eps <= target * (1 + 1e-9) and eps == pytest.approx(target, rel=1e-4)
    assert plan.epsilon() == pytest.approx(eps, rel=1e-9)
    assert _direct_epsilon(q, sigma, T, DELTA) < target * (1 - 1e-3)  # the tails cost ε
    # Without noise_coordinates (a plan of an earlier llmdp): nothing folded, as before.
    old = make_plan(dataset_size=N, expected_batch_size=B, max_grad_norm=1.0, steps=T,
                    delta=DELTA, target_epsilon=target)
    assert old.accountant_delta == DELTA and old.noise_tail_delta is None
    assert old.noise_multiplier < sigma
    assert _direct_epsilon(q, old.noise_multiplier, T, d_acc) > target * (1 + 1e-3)


def test_fixed_sigma_is_accounted_at_delta_less_the_tails():
    plan = make_plan(dataset_size=N, expected_batch_size=B, max_grad_norm=1.0, steps=T,
                     delta=DELTA, noise_multiplier=0.65, noise_coordinates=K)
    d_acc = _accountant_delta(DELTA, T, K, 0.65)
    assert plan.epsilon() == pytest.approx(_direct_epsilon(B / N, 0.65, T, d_acc), rel=1e-9)
    # the plan round-trips through plan.json with its noise coordinates
    from llmdp.privacy.plan import DPPlan

    assert DPPlan.from_dict(plan.to_dict()) == plan
    old = {k: v for k, v in plan.to_dict().items() if k not in ("noise_coordinates", "eval_noise")}
    assert DPPlan.from_dict(old).accountant_delta == DELTA  # a plan.json of an earlier llmdp


def test_dp_evaluations_add_their_tails():
    """A plan with DP evaluations (eval_noise: releases, coordinates, noise multiplier) is
    accounted at δ less the tails of both kinds of release."""
    import dataclasses

    plan = make_plan(dataset_size=N, expected_batch_size=B, max_grad_norm=1.0, steps=T,
                     delta=DELTA, noise_multiplier=0.8, noise_coordinates=10**6)
    with_evals = dataclasses.replace(plan, eval_noise=(4, 3, 0.5))
    eta = T * truncation_delta_per_step(10**6, 0.8) + 4 * truncation_delta_per_step(3, 0.5)
    lost = (T * 10**6 + 4 * 3) / 2.0**53
    assert with_evals.accountant_delta == pytest.approx((DELTA - eta) * (1 - lost), rel=1e-12)
    assert with_evals.accountant_delta < plan.accountant_delta
    assert with_evals.noise_tail(steps=10, eval_releases=1).eta == pytest.approx(
        10 * truncation_delta_per_step(10**6, 0.8) + truncation_delta_per_step(3, 0.5), rel=1e-12)


@pytest.mark.parametrize("mode", ["sigma", "target"])
def test_a_tail_above_a_tenth_of_delta_is_refused_with_its_numbers_and_the_fix(mode):
    kw = dict(dataset_size=50_000, expected_batch_size=512, max_grad_norm=1.0, steps=10_000,
              delta=1e-5, noise_coordinates=7 * 10**9)
    with pytest.raises(NoiseTailError) as e:
        if mode == "sigma":
            make_plan(noise_multiplier=0.5, **kw)
        else:  # σ calibrated near 0.5: its tails are far above δ/10
            make_plan(target_epsilon=40.0, **{**kw, "steps": 1000})
    msg = str(e.value)
    assert isinstance(e.value, PlanError) and msg.startswith("privacy.delta: the noise generator's")
    assert f"|z| <= {NOISE_TAIL:.4g} std" in msg and "at most 10% is allowed" in msg
    assert "7,000,000,000 noise coordinates" in msg
    if mode == "sigma":
        assert "10000 x η = 4.61e-09 each" in msg and "4.61e-05 in all" in msg
    for fix in ("LoRA", "fewer steps", "privacy.noise_multiplier", "a larger privacy.delta"):
        assert fix in msg
    # The same numbers with LoRA-sized adapters (10 M parameters) and σ = 1: accepted.
    ok = make_plan(noise_multiplier=1.0, **{**kw, "noise_coordinates": 10**7})
    assert ok.noise_tail_delta < MAX_TAIL_FRACTION * ok.delta


def test_cli_states_the_split_and_refuses_in_flags(capsys):
    import json

    from llmdp.cli import main

    args = ["privacy", "epsilon", "--dataset-size", str(N), "--batch-size", str(B), "--steps",
            str(T), "--noise-multiplier", "0.65", "--delta", str(DELTA), "--json"]
    assert main(args + ["--parameters", str(K)]) == 0
    out = json.loads(capsys.readouterr().out)
    d_acc = _accountant_delta(DELTA, T, K, 0.65)
    assert out["delta"] == DELTA and out["delta_accountant"] == pytest.approx(d_acc, rel=1e-12)
    assert out["delta_noise_tail"] == pytest.approx(DELTA - d_acc, rel=1e-9)
    assert out["epsilon"] == pytest.approx(_direct_epsilon(B / N, 0.65, T, d_acc), rel=1e-9)
    assert main(args) == 0  # without --parameters: not included, and said so (null)
    out = json.loads(capsys.readouterr().out)
    assert out["delta_accountant"] == DELTA and out["delta_noise_tail"] is None
    code = main(["privacy", "epsilon", "--dataset-size", "50000", "--batch-size", "512",
                 "--steps", "10000", "--noise-multiplier", "0.5", "--delta", "1e-5",
                 "--parameters", str(7 * 10**9)])
    err = capsys.readouterr().err
    assert code != 0 and "--parameters 7000000000: the noise generator's truncated tails" in err
    assert "fewer --steps/--epochs" in err and "--noise-multiplier" in err and "Traceback" not in err


def test_the_tail_shrinks_as_sigma_grows():
    """What makes the calibration's curve non-increasing in σ: η falls with σ."""
    etas = [truncation_delta_per_step(10**8, s) for s in (0.5, 0.6, 0.8, 1.0, 2.0)]
    assert all(a > b for a, b in zip(etas, etas[1:]))
    assert math.isfinite(etas[-1]) and etas[-1] > 0
