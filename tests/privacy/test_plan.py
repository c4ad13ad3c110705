import dataclasses
import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from llmdp.privacy import plan as P
from llmdp.privacy.accountant import RDP_ORDERS
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


def test_calibrate_never_above_target_even_if_brent_lands_above(monkeypatch):
    # Force the root finder to return a sigma slightly too small: the final check must
    # nudge it up until epsilon <= target.
    real = P._brent

    def sloppy(curve, target, lo, hi, rtol):
        return real(curve, target, lo, hi, rtol) * (1 - 2e-4)

    monkeypatch.setattr(P, "_brent", sloppy)
    calls = []
    monkeypatch.setattr(P, "_brent", lambda *a, **k: calls.append(1) or sloppy(*a, **k))
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
