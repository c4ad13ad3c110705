"""The accountant module must give exactly what dp-accounting gives when called directly."""

import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from llmdp.privacy import accountant as acc
from llmdp.privacy.events import dpsgd_step_event

ADD_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


def _direct(kind, q, sigma, steps):
    """dp-accounting, called without going through llmdp."""
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    if kind == "pld":
        a = PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-4)
    else:
        a = RdpAccountant(orders=acc.RDP_ORDERS, neighboring_relation=ADD_REMOVE)
    return a.compose(event)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
@pytest.mark.parametrize("q, sigma, steps, delta", [(0.01, 1.0, 300, 1e-5), (0.2, 2.5, 40, 1e-6)])
def test_epsilon_matches_dp_accounting(kind, q, sigma, steps, delta):
    expected = _direct(kind, q, sigma, steps).get_epsilon(delta)
    got = acc.epsilon_for(q, sigma, steps, delta, kind)
    assert got == pytest.approx(expected, rel=1e-9)
    got2 = acc.epsilon([(dpsgd_step_event(q, sigma), steps)], delta, kind)
    assert got2 == pytest.approx(expected, rel=1e-9)


def test_entries_compose_like_one_long_run():
    # Splitting T steps into ledger blocks must not change epsilon.
    e = dpsgd_step_event(0.05, 1.2)
    whole = acc.epsilon([(e, 100)], 1e-5, "rdp")
    split = acc.epsilon([(e, 30), (e, 50), (e, 20)], 1e-5, "rdp")
    assert split == pytest.approx(whole, rel=1e-9)
    # ... and a different event does change it.
    other = acc.epsilon([(e, 80), (dpsgd_step_event(0.05, 0.6), 20)], 1e-5, "rdp")
    assert other > whole * 1.01


def test_rdp_grid_is_no_looser_than_default_grid():
    # Our order grid contains the regions where DP-SGD's optimum lies: never worse than
    # dp-accounting's default grid by more than a hair.
    ours = acc.epsilon_for(0.01, 1.0, 1000, 1e-5, "rdp")
    default = (
        RdpAccountant(neighboring_relation=ADD_REMOVE)
        .compose(dpa.SelfComposedDpEvent(dpsgd_step_event(0.01, 1.0), 1000))
        .get_epsilon(1e-5)
    )
    assert ours <= default * (1 + 1e-3)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_delta_for_epsilon_is_inverse(kind):
    entries = [(dpsgd_step_event(0.02, 1.1), 200)]
    eps = acc.epsilon(entries, 1e-5, kind)
    d = acc.delta_for_epsilon(entries, eps, kind)
    # delta(eps(delta)) <= delta, and not much smaller (the curves are inverse).
    assert 1e-5 * 0.5 <= d <= 1e-5 * 1.0001
    assert acc.delta_for_epsilon(entries, eps * 1.2, kind) < d


def test_more_steps_more_epsilon():
    e = [acc.epsilon_for(0.01, 1.0, t, 1e-5, "rdp") for t in (10, 100, 1000)]
    assert e[0] < e[1] < e[2]


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_empty_is_zero(kind):
    assert acc.epsilon([], 1e-5, kind) == 0.0
    assert acc.epsilon([(dpsgd_step_event(0.1, 1.0), 0)], 1e-5, kind) == 0.0
    assert acc.delta_for_epsilon([], 1.0, kind) == 0.0


def test_accepts_ledger_like_object():
    class FakeLedger:
        def entries(self):
            return [(dpsgd_step_event(0.1, 1.0), 10)]

    assert acc.epsilon(FakeLedger(), 1e-5, "rdp") == acc.epsilon_for(0.1, 1.0, 10, 1e-5, "rdp")


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0, math.nan])
def test_bad_delta(delta):
    with pytest.raises(
        ValueError, match=r"delta must be in the open interval \(0, 1\), got delta="
    ):
        acc.epsilon([], delta)


def test_bad_accountant():
    with pytest.raises(
        ValueError, match=r"accountant must be one of \('pld', 'rdp'\), got accountant='gdp'"
    ):
        acc.epsilon([], 1e-5, "gdp")
    with pytest.raises(ValueError, match="accountant="):
        acc.epsilon_for(0.1, 1.0, 10, 1e-5, "PLD")


def test_bad_epsilon_and_entries():
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got epsilon=-1"):
        acc.delta_for_epsilon([], -1)
    with pytest.raises(ValueError, match=r"entries\[0\] count"):
        acc.epsilon([(dpsgd_step_event(0.1, 1.0), -3)], 1e-5)
    with pytest.raises(ValueError, match=r"entries\[0\] event"):
        acc.epsilon([("not an event", 3)], 1e-5)
    with pytest.raises(ValueError, match="steps must be an integer >= 0, got steps=1.5"):
        acc.epsilon_for(0.1, 1.0, 1.5, 1e-5)
