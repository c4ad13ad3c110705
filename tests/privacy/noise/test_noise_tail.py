"""The noise generator's truncated tails are part of the published δ (issue 29, item 8).

The published δ = δ_accountant / Z + Σ count·η (`llmdp.privacy.noise.tail`): σ is calibrated
so that dp-accounting, called directly at δ_accountant = (δ - T·η)·(1 - T·k·m) (m = the
mass each pair's truncation removes), gives the target ε; a plan whose tails take more than
a tenth of δ is refused.

The generator's radius uniform has 106 bits (m = 2**-106, |z| <= 12.12 std): its tails are
negligible for any σ one would use, so the folding, calibration and refusal machinery is
tested (fixture ``cap53``) on the model of the earlier 53-bit generator (m = 2**-53,
|z| <= 8.57 std), whose tails show in ε at usual σ: the machinery is the same for any cap,
and PLD at the σ ≈ 0.19 where the 106-bit tails would show costs seconds per evaluation."""

import math

import dp_accounting
import pytest

from llmdp.privacy.noise import tail as nt
from llmdp.privacy.noise.tail import (
    MAX_TAIL_FRACTION,
    NOISE_TAIL,
    TAIL_MASS,
    noise_tail,
    truncation_delta_per_step,
)
from llmdp.privacy.plan import NoiseTailError, PlanError, make_plan
from tests.helpers import use_noise_cap

# With cap53: σ ≈ 0.65, the tails are a few % of δ
N, B, T, DELTA, K = 10_000, 50, 300, 3e-7, 10**9
CAP53 = (2.0**-53, math.sqrt(106 * math.log(2)))  # the 53-bit generator: m, τ ≈ 8.5717


@pytest.fixture
def cap53(monkeypatch):
    assert use_noise_cap(monkeypatch, 53) == CAP53
    return CAP53


def _direct_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def _accountant_delta(delta: float, steps: int, k: int, sigma: float) -> float:
    """δ_accountant written out from the statement δ <= δ_acc/Z + T·η, Z >= 1 - T·k·m."""
    return (delta - steps * truncation_delta_per_step(k, sigma)) * (1 - steps * k * nt.TAIL_MASS)


def test_the_issues_magnitude_example(monkeypatch):
    """7 B parameters, σ = 0.5, 10,000 steps. With a 53-bit radius uniform T·η ≈ 4.3e-6
    (the issue quoted 4.6e-5 from the looser bound of then), more than any δ one would
    publish; with the generator's 106 bits, ~6e-19."""
    eta = truncation_delta_per_step(7 * 10**9, 0.5)
    assert 10_000 * eta < 1e-18
    tail = noise_tail([("training steps", 10_000, 7 * 10**9, 0.5)])
    assert tail.eta == pytest.approx(10_000 * eta, rel=1e-12)
    assert tail.lost_mass == pytest.approx(10_000 * 7e9 / 2.0**106, rel=1e-12)
    assert tail.accountant_delta(1e-5) == pytest.approx(1e-5, rel=1e-12)
    use_noise_cap(monkeypatch, 53)
    eta53 = truncation_delta_per_step(7 * 10**9, 0.5)
    assert 10_000 * eta53 == pytest.approx(4.34e-6, rel=0.01)
    tail = noise_tail([("training steps", 10_000, 7 * 10**9, 0.5)])
    assert tail.eta == pytest.approx(10_000 * eta53, rel=1e-12)
    assert tail.lost_mass == pytest.approx(10_000 * 7e9 / 2**53, rel=1e-12)
    assert tail.accountant_delta(1e-6) == 0.0 and tail.delta(1e-6) == 1e-6  # nothing left


# The shipped full fine-tuning recipes at the example N their comments quote (issue 29,
# item 8: with a 53-bit radius uniform both were refused at launch). Their trainable
# parameter counts, from the architectures (no model is loaded):
# Llama 3.2 1B (vocabulary 128,256, width 2,048, 16 layers, MLP 8,192, 8 KV heads of 64,
# tied embeddings): embedding + 16 × (attention + MLP + 2 norms) + the final norm.
LLAMA_1B = 128_256 * 2_048 + 16 * (2 * 2_048 * 2_048 + 2 * 2_048 * 512 + 3 * 2_048 * 8_192
                                   + 2 * 2_048) + 2_048
# Qwen2.5 7B with LoRA r = 16 on q, k, v, o, gate, up, down (width 3,584, MLP 18,944, 28
# layers, 4 KV heads of 128): r·(in + out) per adapted Linear.
QWEN_7B_LORA = 28 * 16 * ((3_584 + 3_584) * 2 + (3_584 + 512) * 2 + (3_584 + 18_944) * 3)


def _recipe_plan(name: str, n: int, coordinates: int):
    """make_plan as `llmdp train` plans recipes/<name>.yaml at N = n units (plan_run's
    arguments, without the data or the model)."""
    from tests.config.test_recipes import load

    cfg = load(name)
    return make_plan(
        dataset_size=n, expected_batch_size=cfg.train.expected_batch_size,
        max_grad_norm=cfg.privacy.max_grad_norm, steps=cfg.train.steps, epochs=cfg.train.epochs,
        delta=cfg.privacy.delta, target_epsilon=cfg.privacy.target_epsilon,
        noise_multiplier=cfg.privacy.noise_multiplier, accountant=cfg.privacy.accountant,
        max_noise_multiplier=cfg.privacy.max_noise_multiplier, sampler=cfg.privacy.sampler,
        max_batch_size=cfg.privacy.max_batch_size, noise_coordinates=coordinates)


@pytest.mark.parametrize("name, n, coordinates, sigma", [
    ("llama-3.2-1b-full", 100_000, LLAMA_1B, 0.63),
    ("qwen2.5-7b-lora-fsdp", 200_000, QWEN_7B_LORA, 0.59),
])
def test_the_shipped_recipes_plan_with_negligible_tails(monkeypatch, name, n, coordinates, sigma):
    """The two recipes plan at their quoted σ and δ = 1e-7 with the tails ~1e-14 of δ (or
    less); the same plans with a 53-bit radius uniform are refused (the tails then take
    more than a tenth of δ), as they were before the generator drew 106 bits (the launch's
    check, `check_noise_tail`, on the plan at the recipe's σ)."""
    from llmdp.privacy.plan import check_noise_tail

    assert (LLAMA_1B, QWEN_7B_LORA) == (1_235_814_400, 40_370_176)  # "1.24 B", "40 M"
    plan = _recipe_plan(name, n, coordinates)
    assert plan.delta == 1e-7 and plan.noise_coordinates == coordinates
    assert round(plan.noise_multiplier, 2) == sigma  # the σ the recipe's comment quotes
    assert plan.epsilon() <= 8.0 * (1 + 1e-9)
    assert 0 < plan.noise_tail_delta < 1e-13 * plan.delta
    assert plan.accountant_delta == pytest.approx(plan.delta, rel=1e-13)
    assert check_noise_tail(plan) is plan
    use_noise_cap(monkeypatch, 53)
    with pytest.raises(NoiseTailError) as e:
        check_noise_tail(plan)
    assert e.value.share > MAX_TAIL_FRACTION * e.value.delta and e.value.delta == 1e-7


def test_a_plan_is_still_refused_where_the_106_bit_tails_matter():
    """The refusal is not dead code: at σ = 0.15 (s = 6.7 std of noise per unit of
    sensitivity: 12.12 - 6.7 leaves ~5.5 std of tail) 10,000 steps of 7 B coordinates
    take more than δ."""
    with pytest.raises(NoiseTailError) as e:
        make_plan(dataset_size=50_000, expected_batch_size=512, max_grad_norm=1.0, steps=10_000,
                  delta=1e-5, noise_multiplier=0.15, noise_coordinates=7 * 10**9)
    assert f"|z| <= {NOISE_TAIL:.4g} std" in str(e.value) and e.value.share > 1e-5


def test_the_106_bit_tails_are_negligible_for_any_usable_sigma():
    """What the module docstring states: over 10**5 steps of 10**10 coordinates the tails
    add at most 2e-12 at σ >= 0.3 and 1e-17 at σ >= 0.5 (the bound falls with σ)."""
    assert TAIL_MASS == 2.0**-106
    assert 10**5 * truncation_delta_per_step(10**10, 0.3) < 2e-12
    assert 10**5 * truncation_delta_per_step(10**10, 0.5) < 1e-17


def test_calibration_at_delta_gives_the_target_at_delta_less_the_tails(cap53):
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


def test_fixed_sigma_is_accounted_at_delta_less_the_tails(cap53):
    plan = make_plan(dataset_size=N, expected_batch_size=B, max_grad_norm=1.0, steps=T,
                     delta=DELTA, noise_multiplier=0.65, noise_coordinates=K)
    d_acc = _accountant_delta(DELTA, T, K, 0.65)
    assert plan.epsilon() == pytest.approx(_direct_epsilon(B / N, 0.65, T, d_acc), rel=1e-9)
    # the plan round-trips through plan.json with its noise coordinates
    from llmdp.privacy.plan import DPPlan

    assert DPPlan.from_dict(plan.to_dict()) == plan
    old = {k: v for k, v in plan.to_dict().items() if k not in ("noise_coordinates", "eval_noise")}
    assert DPPlan.from_dict(old).accountant_delta == DELTA  # a plan.json of an earlier llmdp


def test_dp_evaluations_add_their_tails(cap53):
    """A plan with DP evaluations (eval_noise: releases, coordinates, noise multiplier) is
    accounted at δ less the tails of both kinds of release."""
    import dataclasses

    plan = make_plan(dataset_size=N, expected_batch_size=B, max_grad_norm=1.0, steps=T,
                     delta=DELTA, noise_multiplier=0.8, noise_coordinates=10**6)
    with_evals = dataclasses.replace(plan, eval_noise=(4, 3, 0.5))
    eta = T * truncation_delta_per_step(10**6, 0.8) + 4 * truncation_delta_per_step(3, 0.5)
    lost = (T * 10**6 + 4 * 3) * 2.0**-53
    assert with_evals.accountant_delta == pytest.approx((DELTA - eta) * (1 - lost), rel=1e-12)
    assert with_evals.accountant_delta < plan.accountant_delta
    assert with_evals.noise_tail(steps=10, eval_releases=1).eta == pytest.approx(
        10 * truncation_delta_per_step(10**6, 0.8) + truncation_delta_per_step(3, 0.5), rel=1e-12)


@pytest.mark.parametrize("mode", ["sigma", "target"])
def test_a_tail_above_a_tenth_of_delta_is_refused_with_its_numbers_and_the_fix(mode, cap53):
    kw = dict(dataset_size=50_000, expected_batch_size=512, max_grad_norm=1.0, steps=10_000,
              delta=1e-5, noise_coordinates=7 * 10**9)
    with pytest.raises(NoiseTailError) as e:
        if mode == "sigma":
            make_plan(noise_multiplier=0.5, **kw)
        else:  # σ calibrated near 0.5: its tails are far above δ/10 (RDP: the calibration's
            # accountant does not matter here, and PLD's at ε = 40 takes most of a minute)
            make_plan(target_epsilon=40.0, accountant="rdp", **{**kw, "steps": 1000, "delta": 1e-6})
    msg = str(e.value)
    assert isinstance(e.value, PlanError) and msg.startswith("privacy.delta: the noise generator's")
    assert f"|z| <= {cap53[1]:.4g} std" in msg and "at most 10% is allowed" in msg
    assert "7,000,000,000 noise coordinates" in msg
    if mode == "sigma":
        assert "10000 x η = 4.34e-10 each" in msg and "4.34e-06 in all" in msg
    for fix in ("LoRA", "fewer steps", "privacy.noise_multiplier", "a larger privacy.delta"):
        assert fix in msg
    # The same numbers with LoRA-sized adapters (10 M parameters) and σ = 1: accepted.
    ok = make_plan(noise_multiplier=1.0, **{**kw, "noise_coordinates": 10**7})
    assert ok.noise_tail_delta < MAX_TAIL_FRACTION * ok.delta


def test_cli_states_the_split_and_refuses_in_flags(capsys, cap53):
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
