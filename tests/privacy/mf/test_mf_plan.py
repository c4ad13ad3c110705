"""Correlated mechanisms in the plan: ε equals dp-accounting called directly on the analysis
each sampler is covered by, the ledger's rounds compose to it, and every combination no
analysis covers is refused by name."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from llmdp.privacy.accounting import accountant as acc
from llmdp.privacy.mechanism import mechanism_config
from llmdp.privacy.mf.factorization import toeplitz_matrix
from llmdp.privacy.mf.plan import MechanismError, check_mechanism
from llmdp.privacy.plan import DPPlan, PlanError, make_plan

N = 6000


def _direct(events, delta, accountant):
    """ε of the composition of ``events`` [(event, count)] by dp-accounting, llmdp's grids."""
    if accountant == "pld":
        a = PLDAccountant(acc.NEIGHBORING_RELATION,
                          value_discretization_interval=acc.PLD_VALUE_DISCRETIZATION_INTERVAL)
    else:
        a = RdpAccountant(list(acc.RDP_ORDERS), acc.NEIGHBORING_RELATION)
    for e, k in events:
        a.compose(e, k)
    return a.get_epsilon(delta)


def _plan(tmp_path, mechanism="dp-sgd", bands=None, cycle=None, **kw):
    config = mechanism_config(mechanism, bands=bands, cycle=cycle, strategy_cache=str(tmp_path))
    base = dict(dataset_size=N, expected_batch_size=60, max_grad_norm=1.0, delta=1e-5,
                mechanism=config)
    return make_plan(**{**base, **kw})


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("bands,steps,batch,sigma", [(4, 40, 60, 0.9), (8, 50, 30, 1.3),
                                                     (2, 37, 120, 0.7)])
def test_cyclic_poisson_banded_equals_the_amplified_event(tmp_path, accountant, bands, steps,
                                                          batch, sigma):
    """Choquette-Choo et al. 2023 (JAX Privacy's amplified banded-MF event): ⌈T/b⌉
    Poisson-subsampled Gaussians at the group's probability q_g = B·b/N and σ over the
    largest column norm (C is scaled so that it is 1: checked on the dense matrix)."""
    plan = _plan(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=bands,
                 steps=steps, expected_batch_size=batch, noise_multiplier=sigma,
                 accountant=accountant)
    c = toeplitz_matrix(plan.factorization().c_coefficients(steps))
    assert np.linalg.norm(c, axis=0).max() == pytest.approx(1.0, abs=1e-12)
    assert plan.cycle == bands and plan.ledger_steps == math.ceil(steps / bands)
    q_g = batch * bands / N
    event = dp_accounting.PoissonSampledDpEvent(q_g, dp_accounting.GaussianDpEvent(sigma))
    want = _direct([(event, math.ceil(steps / bands))], 1e-5, accountant)
    assert plan.epsilon() == pytest.approx(want, rel=1e-12)
    # every prefix of rounds: the ledger's ε after r rounds
    for r in (1, plan.ledger_steps // 2):
        assert plan.epsilon(r) == pytest.approx(_direct([(event, r)], 1e-5, accountant), rel=1e-12)


def test_one_band_is_dp_sgd(tmp_path):
    mf = _plan(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=1, steps=30,
               noise_multiplier=1.1)
    sgd = _plan(tmp_path, steps=30, noise_multiplier=1.1)
    assert mf.factorization().c_coefficients(5).tolist() == [1.0, 0, 0, 0, 0]
    assert mf.step_event() == sgd.step_event() and mf.ledger_steps == sgd.steps
    assert mf.epsilon() == sgd.epsilon()


def _brute_sensitivity(c: np.ndarray, sep: int, k: int) -> float:
    """max over every participation pattern (≤ k steps, pairwise ≥ sep apart) of
    ‖Σ_{i∈pattern} C[:, i]‖ (CᵀC ≥ 0: aligned unit gradients are the worst case)."""
    n = c.shape[0]
    g = c.T @ c
    assert (g >= -1e-15).all()
    best = 0.0
    for size in range(1, k + 1):
        for pat in itertools.combinations(range(n), size):
            if all(b - a >= sep for a, b in zip(pat, pat[1:])):
                best = max(best, float(g[np.ix_(pat, pat)].sum()))
    return math.sqrt(best)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("mechanism,bands", [("blt", None), ("banded-mf", 3)])
def test_fixed_cycle_is_one_gaussian_at_the_min_sep_sensitivity(tmp_path, accountant, mechanism,
                                                                bands):
    """Without amplification: one Gaussian mechanism with noise multiplier σ / sens(C),
    sens the largest ‖C x‖ over every pattern of k participations ≥ cycle apart (brute
    force here, on the dense matrix); the ledger's K rounds compose to it."""
    steps, cycle, sigma = 14, 4, 2.0
    plan = _plan(tmp_path, mechanism=mechanism, sampler="fixed-cycle", bands=bands, steps=steps,
                 cycle=cycle, noise_multiplier=sigma, accountant=accountant)
    k = math.ceil(steps / cycle)
    assert plan.ledger_steps == k and plan.expected_batch_size == pytest.approx(N / cycle)
    c = toeplitz_matrix(plan.factorization().c_coefficients(steps))
    sens = _brute_sensitivity(c, cycle, k)
    assert sens == pytest.approx(1.0, rel=1e-9)  # scaled for the analysis
    want = _direct([(dp_accounting.GaussianDpEvent(sigma / sens), 1)], 1e-5, accountant)
    got = plan.epsilon()
    if plan.round_factor_exact:
        # Gaussians compose exactly (RDP: to rounding; PLD: to its discretization)
        assert got == pytest.approx(want, rel=1e-9 if accountant == "rdp" else 2e-3)
    assert got >= want * (1 - 2e-3)  # never below the one-release analysis
    # every prefix of r rounds: at least the ε of the first r rounds' own sensitivity
    for r in range(1, k + 1):
        n = min(r * cycle, steps)
        s_r = _brute_sensitivity(c[:n, :n], cycle, r)
        floor = _direct([(dp_accounting.GaussianDpEvent(sigma / s_r), 1)], 1e-5, accountant)
        assert plan.epsilon(r) >= floor * (1 - 2e-3)


def test_calibration_meets_the_target(tmp_path):
    plan = _plan(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=4, steps=40,
                 target_epsilon=3.0)
    assert plan.epsilon() <= 3.0
    assert plan.epsilon() == pytest.approx(3.0, rel=1e-3)
    assert plan.noise_multiplier * plan.round_factor >= plan.noise_multiplier * (1 - 1e-15)
    again = DPPlan.from_dict(plan.to_dict())
    assert again == plan and again.epsilon() == plan.epsilon()


def test_noise_tails_count_every_step_not_every_round(tmp_path):
    plan = _plan(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=4, steps=40,
                 noise_multiplier=1.0, noise_coordinates=10**6)
    sgd = _plan(tmp_path, steps=40, noise_multiplier=1.0, noise_coordinates=10**6)
    assert plan.noise_tail_delta == sgd.noise_tail_delta > 0
    # a round of the ledger draws at most `cycle` steps' noise
    assert plan.noise_tail(steps=10).eta == pytest.approx(sgd.noise_tail(steps=40).eta)


@pytest.mark.parametrize("mechanism,sampler,bands,cycle,field", [
    ("banded-mf", "poisson", 4, None, "sampler"),
    ("banded-mf", "truncated-poisson", 4, None, "sampler"),
    ("blt", "poisson", None, None, "sampler"),
    ("blt", "cyclic-poisson", None, None, "sampler"),
    ("banded-mf", "cyclic-poisson", 8, 4, "bands"),
    ("banded-mf", "cyclic-poisson", None, None, "bands"),
    ("dp-sgd", "cyclic-poisson", None, None, "sampler"),
    ("dp-sgd", "poisson", 4, None, "bands"),
    ("blt", "fixed-cycle", 4, None, "bands"),
])
def test_combinations_no_analysis_covers_are_refused(mechanism, sampler, bands, cycle, field):
    with pytest.raises(MechanismError) as e:
        check_mechanism(mechanism, sampler, bands=bands, cycle=cycle)
    assert e.value.field == field


def test_a_recipe_with_plain_poisson_and_banded_mf_is_refused_naming_the_field():
    from llmdp.config.schema import ConfigError, recipe_from_dict

    with pytest.raises(ConfigError) as e:
        recipe_from_dict({"data": {"path": "x.jsonl"},
                          "privacy": {"target_epsilon": 3, "mechanism": "banded-mf", "bands": 4}})
    assert "privacy.sampler" in str(e.value) and "cyclic-poisson" in str(e.value)


def test_group_probability_above_one_is_refused(tmp_path):
    with pytest.raises(PlanError, match="q_g"):
        _plan(tmp_path, mechanism="banded-mf", sampler="cyclic-poisson", bands=4, steps=10,
              expected_batch_size=N / 2, noise_multiplier=1.0)
