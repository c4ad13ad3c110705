import dataclasses
import json
import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from llmdp.privacy import plan as P
from llmdp.privacy.accounting import calibrate as C
from llmdp.privacy.accounting import truncation as T
from llmdp.privacy.accounting.accountant import RDP_ORDERS
from llmdp.privacy.plan import DPPlan, PlanError, calibrate_noise, default_delta, make_plan

ADD_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


def _direct_epsilon(q, sigma, steps, delta, kind="pld"):
    """Recompute epsilon with dp-accounting directly, bypassing llmdp's accountant."""
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    if kind == "pld":
        a = PLDAccountant(ADD_REMOVE)  # dp-accounting's own defaults
    else:
        a = RdpAccountant(orders=RDP_ORDERS, neighboring_relation=ADD_REMOVE)
    return a.compose(event).get_epsilon(delta)


def test_calibrate_acceptance():
    # N=50000, B=512, T=1953 (~20 epochs), eps=8, delta=1e-5: the brief's acceptance test.
    p = make_plan(
        dataset_size=50000,
        expected_batch_size=512,
        max_grad_norm=1.0,
        steps=1953,
        target_epsilon=8.0,
        delta=1e-5,
    )
    eps = _direct_epsilon(512 / 50000, p.noise_multiplier, 1953, 1e-5)
    assert 7.9 <= eps <= 8.0
    assert p.target_epsilon == 8.0 and p.steps == 1953
    assert p.sampling_probability == 512 / 50000


@pytest.mark.parametrize(
    "target, delta, q, steps, kind",
    [
        (1.0, 1e-5, 0.01, 100, "pld"),
        (3.0, 1e-6, 0.1, 50, "pld"),
        (0.3, 1e-5, 1.0, 3, "pld"),  # full batch: no amplification
        (2.0, 1e-5, 0.02, 500, "rdp"),
    ],
)
def test_calibration_is_tight_and_never_above_target(target, delta, q, steps, kind):
    sigma = calibrate_noise(target, delta, q, steps, accountant=kind)
    eps = _direct_epsilon(q, sigma, steps, delta, kind)
    assert eps <= target
    assert eps >= 0.99 * target


@pytest.mark.parametrize("target, delta, q, steps", [
    (3.0, 1e-4, 0.0087, 6),  # a small sigma: a reporting-grid PLD costs seconds here
    (0.5, 1e-6, 0.001, 3000),  # the grids differ by ~1% of epsilon: the shift is iterated
])
def test_pld_calibration_is_the_smallest_sigma_to_its_tolerance(monkeypatch, target, delta, q,
                                                               steps):
    """The PLD search locates the root on the search grid, then solves on the reporting grid:
    sigma meets the target and sigma less twice the tolerance does not (dp-accounting called
    directly), with the reporting grid evaluated a few times only (each a whole
    composition; 8-13 before the search grid located the root)."""
    from llmdp.privacy.accounting import accountant as A

    grids = []
    real = A.epsilon

    def counted(entries, delta, accountant="pld", interval=None):
        grids.append((str(accountant), interval))
        return real(entries, delta, accountant, interval)

    monkeypatch.setattr(A, "epsilon", counted)
    A._EPSILONS.clear()
    sigma = calibrate_noise(target, delta, q, steps)
    assert _direct_epsilon(q, sigma, steps, delta) <= target
    assert _direct_epsilon(q, sigma * (1 - 2 * C.SIGMA_RTOL), steps, delta) > target
    assert ("pld", None) in grids and ("rdp", None) not in grids
    assert grids.count(("pld", None)) <= 6, grids  # max_noise_multiplier's included


def test_calibrate_never_above_target_even_if_brent_lands_above(monkeypatch):
    # Force the root finder to return a sigma slightly too small: the final check must
    # nudge it up until epsilon <= target.
    real = C.solve

    def sloppy(eps, target, lo, hi, **kw):
        return real(eps, target, lo, hi, **kw) * (1 - 2e-4)

    monkeypatch.setattr(C, "solve", sloppy)
    calls = []
    monkeypatch.setattr(C, "solve", lambda *a, **k: calls.append(1) or sloppy(*a, **k))
    sigma = calibrate_noise(2.0, 1e-5, 0.01, 300, accountant="rdp")
    assert calls
    assert _direct_epsilon(0.01, sigma, 300, 1e-5, "rdp") <= 2.0


def test_epsilon_grows_with_steps_and_plan_epsilon_default():
    p = make_plan(
        dataset_size=10000,
        expected_batch_size=100,
        max_grad_norm=1.0,
        steps=400,
        noise_multiplier=1.0,
        accountant="rdp",
    )
    e = [p.epsilon(steps=t) for t in (50, 200, 400)]
    assert e[0] < e[1] < e[2]
    assert p.epsilon() == e[2]
    assert p.epsilon(accountant="pld") < p.epsilon()  # PLD is the tighter bound here


def test_plan_properties_and_roundtrip():
    p = make_plan(
        dataset_size=6000, expected_batch_size=60, max_grad_norm=0.5, epochs=2, noise_multiplier=1.2
    )
    assert p.delta == 1e-5  # default_delta(6000)
    assert p.sampling_probability == 0.01
    assert p.steps == 200
    assert p.noise_std == pytest.approx(1.2 * 0.5 / 60)
    assert p.step_event() == dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.2))
    assert DPPlan.from_dict(p.to_dict()) == p
    with pytest.raises(PlanError, match="unknown DPPlan field"):
        DPPlan.from_dict({**p.to_dict(), "sigmaa": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.steps = 5


def test_unreachable_target_names_the_knobs():
    with pytest.raises(PlanError) as ei:
        make_plan(
            dataset_size=100,
            expected_batch_size=100,
            max_grad_norm=1.0,
            steps=1000,
            target_epsilon=0.01,
            delta=1e-3,
            max_noise_multiplier=5.0,
        )
    msg = str(ei.value)
    assert "unreachable" in msg
    assert "max_noise_multiplier=5" in msg
    assert "epsilon=" in msg
    for knob in (
        "fewer steps/epochs",
        "smaller expected batch size",
        "larger dataset",
        "larger target_epsilon",
        "larger delta",
    ):
        assert knob in msg


BASE = dict(
    dataset_size=1000, expected_batch_size=10, max_grad_norm=1.0, steps=10, noise_multiplier=1.0
)


@pytest.mark.parametrize(
    "override, fragments",
    [
        (dict(epochs=1.0), ["exactly one of steps= or epochs=", "both"]),
        (dict(steps=None), ["exactly one of steps= or epochs=", "neither"]),
        (dict(target_epsilon=1.0), ["exactly one of target_epsilon=", "noise_multiplier=", "both"]),
        (dict(noise_multiplier=None), ["exactly one of target_epsilon=", "neither"]),
        (dict(dataset_size=0), ["dataset_size", "dataset_size=0"]),
        (dict(expected_batch_size=0), ["expected_batch_size", "expected_batch_size=0"]),
        (dict(expected_batch_size=1001), ["expected_batch_size=1001", "<= dataset_size = 1000"]),
        (
            dict(delta=1e-3),
            ["delta must be below 1/N = 0.001", "delta=0.001", "default_delta(1000) = 1e-05"],
        ),
        (dict(delta=0.5), ["below 1/N", "delta=0.5"]),
        (dict(delta=0.0), ["delta must be > 0", "delta=0.0"]),
        (dict(max_grad_norm=0.0), ["max_grad_norm", "max_grad_norm=0.0", "> 0"]),
        (dict(max_grad_norm=-1.0), ["max_grad_norm=-1.0"]),
        (dict(noise_multiplier=0.0), ["noise_multiplier", "noise_multiplier=0.0", "> 0"]),
        (
            dict(noise_multiplier=None, target_epsilon=-2.0),
            ["target_epsilon", "target_epsilon=-2.0", "> 0"],
        ),
        (dict(steps=0), ["steps must be an integer >= 1", "steps=0"]),
        (dict(accountant="moments"), ["accountant must be one of", "accountant='moments'"]),
        (dict(steps=None, epochs=-1.0), ["epochs", "epochs=-1.0"]),
    ],
)
def test_plan_errors_name_field_and_value(override, fragments):
    kwargs = {**BASE, **override}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    with pytest.raises(PlanError) as ei:
        make_plan(**kwargs)
    for f in fragments:
        assert f in str(ei.value), (f, str(ei.value))


def test_plan_error_is_value_error():
    assert issubclass(PlanError, ValueError)


def test_dpplan_validates_on_construction():
    with pytest.raises(PlanError, match="sampler"):
        DPPlan(
            dataset_size=10,
            expected_batch_size=1,
            steps=1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-3,
            sampler="shuffle",
        )
    with pytest.raises(PlanError, match="below 1/N"):
        DPPlan(
            dataset_size=10,
            expected_batch_size=1,
            steps=1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=0.2,
        )


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, 1e-2),
        (6000, 1e-5),
        (10000, 1e-6),
        (50000, 1e-6),
        (99999, 1e-6),
        (100000, 1e-7),
        (123456789, 1e-10),
    ],
)
def test_default_delta(n, expected):
    d = default_delta(n)
    assert d == expected
    assert d < 1 / (10 * n)
    assert d * 10 >= 1 / (10 * n) * (1 - 1e-12)  # the largest power of ten that qualifies
    assert math.log10(d) == round(math.log10(d))


@pytest.mark.parametrize(
    "epochs, q, expected",
    [
        (1, 0.01, 100),
        (3, 0.01, 300),
        (1, 0.3, 4),
        (2.5, 0.1, 25),
        (0.5, 512 / 50000, 49),
        (20, 512 / 50000, 1954),
    ],
)
def test_steps_for_epochs(epochs, q, expected):
    assert P.steps_for_epochs(epochs, q) == expected
    assert P.steps_for_epochs(epochs, q) >= epochs / q * (1 - 1e-9)


# ---- truncated Poisson sampling

TRUNC = dict(dataset_size=2000, expected_batch_size=40, steps=20, delta=1e-5, max_grad_norm=1.0)


def _direct_truncated_epsilon(n, q, cap, sigma, steps, delta, interval=1e-4):
    # n units sampled: dp-accounting's dataset_size is the add-neighbour's, n + 1
    event = dpa.TruncatedSubsampledGaussianDpEvent(n + 1, q, cap, sigma)
    a = PLDAccountant(ADD_REMOVE, value_discretization_interval=interval)
    return a.compose(dpa.SelfComposedDpEvent(event, steps)).get_epsilon(delta)


def _direct_cost(p: DPPlan, cap: int, interval=1e-4) -> float:
    """eps_truncated / eps_poisson - 1 at the plan's sigma, T, delta, by dp-accounting."""
    q, s, t, d = p.sampling_probability, p.noise_multiplier, p.steps, p.delta
    pois = (
        PLDAccountant(ADD_REMOVE, value_discretization_interval=interval)
        .compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), t))
        .get_epsilon(d)
    )
    return _direct_truncated_epsilon(p.dataset_size, q, cap, s, t, d, interval) / pois - 1


def _check_auto_cap(p: DPPlan, budget=0.01):
    cap = p.max_batch_size
    # The plan's cost is dp-accounting's, on the reporting grid, and below the budget ...
    assert p.truncation_cost == pytest.approx(_direct_cost(p, cap), rel=1e-9, abs=1e-12)
    assert p.truncation_cost < budget
    # ... and the cap is the smallest below budget on the planner's search grid.
    assert _direct_cost(p, cap, C._SEARCH_INTERVAL) < budget
    assert _direct_cost(p, cap - 1, C._SEARCH_INTERVAL) >= budget
    assert p.truncation_probability == stats.binom.sf(cap, p.dataset_size, p.sampling_probability)


def test_truncated_plan_fixed_sigma_picks_the_smallest_cap():
    p = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson")
    assert p.sampler == "truncated-poisson" and p.noise_multiplier == 4.0
    assert p.expected_batch_size < p.max_batch_size < p.dataset_size
    _check_auto_cap(p)
    q = p.sampling_probability
    assert p.step_event() == dpa.TruncatedSubsampledGaussianDpEvent(2001, q, p.max_batch_size, 4.0)
    expected = _direct_truncated_epsilon(2000, q, p.max_batch_size, 4.0, 20, 1e-5)
    assert p.epsilon() == pytest.approx(expected, rel=1e-12)
    assert p.epsilon_estimate() >= p.epsilon()
    sampler = p.make_sampler(2000)
    assert (sampler.num_units, sampler.sampling_probability, sampler.max_batch_size) == (
        2000, q, p.max_batch_size,
    )
    with pytest.raises(PlanError, match="dataset_size=2000"):
        p.make_sampler(1999)
    with pytest.raises(ValueError, match="privacy.accountant='rdp'"):
        p.epsilon(accountant="rdp")
    # A larger budget allows a smaller cap.
    loose = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson", truncation_budget=0.2)
    assert loose.max_batch_size < p.max_batch_size
    _check_auto_cap(loose, budget=0.2)


def test_truncated_plan_target_mode():
    target = 0.15
    p = make_plan(**TRUNC, target_epsilon=target, sampler="truncated-poisson")
    _check_auto_cap(p)
    q = p.sampling_probability
    eps = _direct_truncated_epsilon(2000, q, p.max_batch_size, p.noise_multiplier, 20, 1e-5)
    assert p.epsilon() == pytest.approx(eps, rel=1e-12)
    assert 0.999 * target <= eps <= target
    # sigma was calibrated under the truncated event: under Poisson it would give less.
    assert _direct_epsilon(q, p.noise_multiplier, 20, 1e-5) < eps / (1 + 0.5 * p.truncation_cost)


def test_truncated_plan_with_a_given_cap_carries_its_cost():
    p = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson", max_batch_size=44)
    assert p.max_batch_size == 44
    assert p.truncation_cost == pytest.approx(_direct_cost(p, 44), rel=1e-9)
    assert p.truncation_cost > 0.5  # far above the 1% budget, allowed, and reported
    t = make_plan(**TRUNC, target_epsilon=0.15, sampler="truncated-poisson", max_batch_size=44)
    eps = _direct_truncated_epsilon(2000, 0.02, 44, t.noise_multiplier, 20, 1e-5)
    assert 0.999 * 0.15 <= eps <= 0.15
    assert t.noise_multiplier == calibrate_noise(
        0.15, 1e-5, 0.02, 20, dataset_size=2000, max_batch_size=44
    )
    # A cap of N: no truncation can happen, the cost is exactly 0.
    full = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson", max_batch_size=2000)
    assert full.truncation_cost == 0.0 and full.truncation_probability == 0.0
    assert full.epsilon() == pytest.approx(_direct_epsilon(0.02, 4.0, 20, 1e-5), rel=1e-12)


def test_reporting_grid_has_the_last_word_on_the_cost(monkeypatch):
    # If the reporting grid puts the searched cap at or above the budget (a knife edge the
    # search grid missed), the plan takes the next cap rather than report cost >= budget.
    base = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson")
    real = T.truncation_cost

    def edgy(*a, value_discretization_interval=None, **k):
        cost = real(*a, value_discretization_interval=value_discretization_interval, **k)
        if value_discretization_interval is None and a[5] == base.max_batch_size:
            return 0.0101
        return cost

    monkeypatch.setattr(T, "truncation_cost", edgy)
    p = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson")
    assert p.max_batch_size == base.max_batch_size + 1 and p.truncation_cost < 0.01


def test_truncated_plan_roundtrip_and_old_dicts():
    p = make_plan(**TRUNC, noise_multiplier=4.0, sampler="truncated-poisson", max_batch_size=44)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["max_batch_size"] == 44 and d["sampler"] == "truncated-poisson"
    assert DPPlan.from_dict(d) == p
    # A plan.json written before these fields existed still loads (Poisson).
    old = {k: v for k, v in make_plan(**TRUNC, noise_multiplier=4.0).to_dict().items()
           if k not in ("max_batch_size", "truncation_cost", "truncation_probability")}
    q = DPPlan.from_dict(old)
    assert q.sampler == "poisson" and q.max_batch_size is None and q.truncation_cost is None
    assert q.step_event() == dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(4.0))
    # truncation_probability is derived: filled in if missing, refused if inconsistent.
    d2 = {**d, "truncation_probability": None}
    assert DPPlan.from_dict(d2).truncation_probability == p.truncation_probability
    with pytest.raises(PlanError, match="truncation_probability=0.5 does not match"):
        DPPlan.from_dict({**d, "truncation_probability": 0.5})


@pytest.mark.parametrize(
    "override, fragments",
    [
        (dict(sampler="shuffle"), ["privacy.sampler", "sampler='shuffle'", "'truncated-poisson'"]),
        (
            dict(max_batch_size=10),
            ["privacy.max_batch_size=10", "sampler is 'poisson'", "sampler: truncated-poisson"],
        ),
        (
            dict(sampler="truncated-poisson", accountant="rdp"),
            ["privacy.accountant='rdp'", "truncated-poisson", "accountant: pld"],
        ),
        (
            dict(sampler="truncated-poisson", max_batch_size=0),
            ["privacy.max_batch_size", "[1, dataset_size = 1000]", "max_batch_size=0", "unset"],
        ),
        (dict(sampler="truncated-poisson", max_batch_size=1001), ["max_batch_size=1001"]),
        (dict(sampler="truncated-poisson", max_batch_size=12.5), ["max_batch_size=12.5"]),
        (
            dict(sampler="truncated-poisson", truncation_budget=0.0),
            ["privacy.truncation_budget", "truncation_budget=0.0", "> 0"],
        ),
    ],
)
def test_truncated_plan_errors_name_field_and_value(override, fragments):
    with pytest.raises(PlanError) as ei:
        make_plan(**{**BASE, **override})
    for f in fragments:
        assert f in str(ei.value), (f, str(ei.value))


def test_dpplan_truncated_fields_are_validated():
    kw = dict(dataset_size=1000, expected_batch_size=10, steps=1, noise_multiplier=1.0,
              max_grad_norm=1.0, delta=1e-5)
    with pytest.raises(PlanError, match="privacy.max_batch_size is required"):
        DPPlan(**kw, sampler="truncated-poisson")
    with pytest.raises(PlanError, match="truncation_cost=0.1 is only meaningful"):
        DPPlan(**kw, truncation_cost=0.1)
    with pytest.raises(PlanError, match=r"truncation_cost=nan"):
        DPPlan(**kw, sampler="truncated-poisson", max_batch_size=20, truncation_cost=math.nan)
    with pytest.raises(PlanError, match="privacy.accountant='rdp'"):
        DPPlan(**kw, sampler="truncated-poisson", max_batch_size=20, accountant="rdp")
    p = DPPlan(**kw, sampler="truncated-poisson", max_batch_size=20)
    assert p.truncation_probability == stats.binom.sf(20, 1000, 0.01)
    assert p.truncation_cost is None


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-6, float("nan"), "1e-6"])
def test_calibrate_noise_refuses_a_bad_delta_with_the_shared_message(delta):
    """calibrate_noise checks delta with the one shared check (_validate._check_delta)."""
    from llmdp.privacy.plan import PlanError, calibrate_noise

    with pytest.raises(PlanError, match=r"delta must be in the open interval \(0, 1\), got delta="):
        calibrate_noise(1.0, delta, 0.01, 10)
