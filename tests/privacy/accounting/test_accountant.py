"""The accountant module must give exactly what dp-accounting gives when called directly."""

import math

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from llmdp.privacy.accounting import accountant as acc
from llmdp.privacy.accounting.events import dpsgd_step_event

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


# ---- truncated Poisson (TruncatedSubsampledGaussianDpEvent): PLD only

TN, TQ, TCAP, TSIGMA, TSTEPS, TDELTA = 2000, 0.02, 50, 4.0, 20, 1e-5  # mean 40, sd 6.3


def _direct_truncated(cap, steps=TSTEPS, interval=1e-4):
    # dp-accounting's dataset_size is the add-neighbour's: N + 1 (events.dpsgd_step_event)
    event = dpa.TruncatedSubsampledGaussianDpEvent(TN + 1, TQ, cap, TSIGMA)
    a = PLDAccountant(ADD_REMOVE, value_discretization_interval=interval)
    return a.compose(dpa.SelfComposedDpEvent(event, steps))


def _truncated_event(cap=TCAP):
    return dpsgd_step_event(TQ, TSIGMA, dataset_size=TN, max_batch_size=cap)


def test_truncated_epsilon_matches_dp_accounting():
    direct = _direct_truncated(TCAP)
    expected = direct.get_epsilon(TDELTA)
    got = acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA, dataset_size=TN, max_batch_size=TCAP)
    assert got == pytest.approx(expected, rel=1e-12)
    assert acc.epsilon([(_truncated_event(), TSTEPS)], TDELTA) == pytest.approx(expected, rel=1e-12)
    d = acc.delta_for_epsilon([(_truncated_event(), TSTEPS)], expected)
    assert d == pytest.approx(direct.get_delta(expected), rel=1e-12)
    # Truncation costs epsilon: strictly above the Poisson epsilon at the same sigma.
    assert got > acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA) * 1.01


def test_truncated_estimate_is_dp_accounting_on_the_coarse_grid():
    est = acc.epsilon_estimate(TQ, TSIGMA, TSTEPS, TDELTA, dataset_size=TN, max_batch_size=TCAP)
    expected = _direct_truncated(TCAP, interval=acc.PLD_DISPLAY_DISCRETIZATION_INTERVAL)
    assert est == pytest.approx(expected.get_epsilon(TDELTA), rel=1e-12)
    fine = acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA, dataset_size=TN, max_batch_size=TCAP)
    assert fine <= est <= fine * 1.01  # conservative, and close
    assert acc.epsilon_estimate(TQ, TSIGMA, 0, TDELTA, dataset_size=TN, max_batch_size=TCAP) == 0.0


@pytest.mark.parametrize("cap", [TN, TN + 7])
def test_cap_that_cannot_truncate_gives_the_poisson_epsilon(cap):
    poisson = acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA)
    got = acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA, dataset_size=TN, max_batch_size=cap)
    assert got == pytest.approx(poisson, rel=1e-12)


def test_rdp_refuses_the_truncated_event_with_the_fix():
    event = _truncated_event()
    # Not an llmdp restriction hiding a capability: dp-accounting's RDP cannot do it.
    assert not RdpAccountant(neighboring_relation=ADD_REMOVE).supports(event)
    fragments = ["privacy.accountant='rdp'", "truncated", "PLD", "privacy.accountant: pld"]
    calls = [
        lambda: acc.epsilon_for(TQ, TSIGMA, 10, TDELTA, "rdp", dataset_size=TN, max_batch_size=TCAP),
        lambda: acc.epsilon([(event, 10)], TDELTA, "rdp"),
        lambda: acc.epsilon([(dpsgd_step_event(0.1, 1.0), 5), (event, 10)], TDELTA, "rdp"),
        lambda: acc.delta_for_epsilon([(dpa.SelfComposedDpEvent(event, 3), 2)], 1.0, "rdp"),
    ]
    for call in calls:
        with pytest.raises(ValueError) as ei:
            call()
        for f in fragments:
            assert f in str(ei.value), (f, str(ei.value))


def test_ledger_entries_with_truncated_events_compose():
    t, p = _truncated_event(), dpsgd_step_event(TQ, TSIGMA)
    whole = acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA, dataset_size=TN, max_batch_size=TCAP)
    split = acc.epsilon([(t, 12), (t, 0), (t, 8)], TDELTA)
    assert split == pytest.approx(whole, rel=1e-8)  # PLD self-composition vs composition

    class FakeLedger:
        def entries(self):
            return [(t, 10), (p, 20)]

    mixed = acc.epsilon(FakeLedger(), TDELTA)
    direct = (
        PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-4)
        .compose(dpa.SelfComposedDpEvent(t, 10))
        .compose(dpa.SelfComposedDpEvent(p, 20))
        .get_epsilon(TDELTA)
    )
    assert mixed == pytest.approx(direct, rel=1e-12)
    assert acc.epsilon_for(TQ, TSIGMA, TSTEPS, TDELTA) < mixed < whole


def test_truncated_event_uses_the_add_neighbours_size():
    """Issue 12 item 5: dp-accounting's TruncatedSubsampledGaussianDpEvent takes the size
    of the dataset that contains the differing unit. Sampling N units at q = B/N, the
    add-neighbour has N + 1 units; accounting with N understates epsilon."""
    n, q, cap, sigma, steps, delta = 10_000, 0.01, 110, 1.0, 1000, 1e-5
    event = dpsgd_step_event(q, sigma, dataset_size=n, max_batch_size=cap)
    assert event == dpa.TruncatedSubsampledGaussianDpEvent(n + 1, q, cap, sigma)

    def direct(size):
        a = PLDAccountant(ADD_REMOVE)
        ev = dpa.TruncatedSubsampledGaussianDpEvent(size, q, cap, sigma)
        return a.compose(dpa.SelfComposedDpEvent(ev, steps)).get_epsilon(delta)

    got = acc.epsilon_for(q, sigma, steps, delta, dataset_size=n, max_batch_size=cap)
    with_n_plus_1, with_n = direct(n + 1), direct(n)
    assert got == pytest.approx(with_n_plus_1, rel=1e-12)
    # The old accounting (dataset_size = N) is ~4e-4 relative below: 7.6820 vs 7.6851.
    assert with_n_plus_1 - with_n > 2e-4 * with_n


def _pmf_arrays(pld):
    """The kept PLD's state, copied (probabilities, offsets, infinity masses)."""
    out = []
    for pmf in (pld._pmf_remove, pld._pmf_add):
        out.append((pmf._probs.copy(), pmf._lower_loss, pmf._infinity_mass))
    return out


def _assert_same_numbers(mine, ref, entries) -> None:
    """``mine`` composed of ``entries`` answers ε(δ) and δ(ε) exactly as ``ref`` (==)."""
    for event, count in entries:
        mine.compose(event, count)
    for delta in (1e-5, 1e-3):
        assert mine.get_epsilon(delta) == ref.get_epsilon(delta)
    for eps in (0.5, 2.0):
        assert mine.get_delta(eps) == ref.get_delta(eps)


def test_the_kept_step_pld_gives_dp_accountings_numbers_bit_for_bit():
    """`make_accountant('pld')` keeps a DP-SGD step's PLD across compositions. Every number
    must equal a plain dp-accounting PLDAccountant's exactly (==, not approx), on the first
    use and on later ones (the kept object), for every event kind llmdp composes, mixed and
    nested; and using a kept PLD never changes it."""
    acc._step_pld.cache_clear()
    acc._gaussian_pld.cache_clear()
    poisson = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.5))
    truncated = dpa.TruncatedSubsampledGaussianDpEvent(
        dataset_size=500, sampling_probability=0.02, truncated_batch_size=14, noise_multiplier=2.0)
    cases = [
        [(poisson, 30)],
        [(poisson, 7), (poisson, 23)],  # the ledger's blocks
        [(dpa.SelfComposedDpEvent(poisson, 4), 5)],
        [(truncated, 12)],
        [(dpa.ComposedDpEvent([poisson, dpa.GaussianDpEvent(3.0), truncated]), 2),
         (dpa.LaplaceDpEvent(2.0), 1), (dpa.PoissonSampledDpEvent(0.0, dpa.GaussianDpEvent(1.0)), 3)],
        [(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(0.0)), 2)],  # no noise: inf
        [(dpa.GaussianDpEvent(2.0), 3), (dpa.GaussianDpEvent(2.0), 1), (poisson, 5)],  # DP evals
        [(dpa.GaussianDpEvent(0.0), 1)],
    ]
    for interval in (None, 1e-3):
        for entries in cases:
            ref = PLDAccountant(ADD_REMOVE, value_discretization_interval=interval or 1e-4)
            for event, count in entries:
                ref.compose(event, count)
            for _ in range(2):  # the second round from the kept PLDs
                _assert_same_numbers(acc.make_accountant("pld", value_discretization_interval=interval),
                                     ref, entries)
    assert acc._step_pld.cache_info().hits > 0 and acc._gaussian_pld.cache_info().hits > 0
    kept = acc._step_pld(poisson, 1e-4)
    before = _pmf_arrays(kept)
    a = acc.make_accountant("pld")
    a.compose(poisson, 50)
    a.get_epsilon(1e-6)
    for (p0, l0, i0), (p1, l1, i1) in zip(before, _pmf_arrays(kept)):
        assert (p0 == p1).all() and l0 == l1 and i0 == i1


def test_the_kept_epsilon_is_dp_accountings_for_the_very_same_question_only():
    """`epsilon` keeps each composition's ε per process: the kept value must be exactly a
    plain dp-accounting accountant's, and a question that differs in any part (an event's
    last bit, a count, the order of entries' counts, δ, the grid, the accountant) must never
    get another question's answer."""
    acc._EPSILONS.clear()
    poisson = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.5))
    nudged = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(math.nextafter(1.5, 2.0)))
    gauss = dpa.GaussianDpEvent(2.0)
    questions = [
        ([(poisson, 30)], 1e-5, "pld", None),
        ([(nudged, 30)], 1e-5, "pld", None),
        ([(poisson, 31)], 1e-5, "pld", None),
        ([(poisson, 30)], 1e-6, "pld", None),
        ([(poisson, 30)], 1e-5, "pld", 1e-3),
        ([(poisson, 30)], 1e-5, "rdp", None),
        ([(gauss, 2), (poisson, 30)], 1e-5, "pld", None),
        ([(gauss, 30), (poisson, 2)], 1e-5, "pld", None),
        ([(dpa.ComposedDpEvent([gauss, poisson]), 3)], 1e-5, "pld", None),
    ]

    def plain(entries, delta, accountant, interval):
        ref = (PLDAccountant(ADD_REMOVE, value_discretization_interval=interval or 1e-4)
               if accountant == "pld" else
               RdpAccountant(orders=acc.RDP_ORDERS, neighboring_relation=ADD_REMOVE))
        for event, count in entries:
            ref.compose(event, count)
        return ref.get_epsilon(delta)

    expected = [plain(*q) for q in questions]
    assert len(set(expected)) == len(expected)  # every question has its own answer
    for _ in range(2):  # asked afresh, then answered from what was kept
        for q, want in zip(questions, expected):
            entries, delta, accountant, interval = q
            assert acc.epsilon(entries, delta, accountant, interval) == want
    assert len(acc._EPSILONS) == len(questions)
    # A long composition (a ledger of many blocks) is answered, not kept: the memory kept
    # stays bounded however long a run's ledger grows.
    blocks = [(dpa.GaussianDpEvent(5.0 + i * 1e-3), 3) for i in range(150)]  # closed-form RDP
    assert len(repr(blocks)) > acc._KEY_CHARS_KEPT
    assert acc.epsilon(blocks, 1e-5, "rdp") == plain(blocks, 1e-5, "rdp", None)
    assert len(acc._EPSILONS) == len(questions)
    # epsilon_for (a plan's steps) is answered through the same kept values.
    q, sigma = 0.01, 1.5
    assert acc.epsilon_for(q, sigma, 30, 1e-5) == expected[0]


def test_the_kept_step_rdp_gives_dp_accountings_numbers_bit_for_bit():
    """`make_accountant('rdp')` keeps a DP-SGD step's RDP vector across compositions. Every
    number must equal a plain dp-accounting RdpAccountant's exactly (==), on the first use
    and on later ones, for the event kinds llmdp composes, mixed and nested; the kept vector
    is never changed by use (read-only)."""
    acc._step_rdp.cache_clear()
    poisson = dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.5))
    cases = [
        [(poisson, 30)],
        [(poisson, 7), (poisson, 23)],  # the ledger's blocks
        [(dpa.SelfComposedDpEvent(poisson, 4), 5)],
        [(dpa.ComposedDpEvent([poisson, dpa.GaussianDpEvent(3.0)]), 2), (dpa.LaplaceDpEvent(2.0), 1),
         (dpa.PoissonSampledDpEvent(0.0, dpa.GaussianDpEvent(1.0)), 3)],
        [(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(0.0)), 2)],  # no noise: inf
        [(dpa.PoissonSampledDpEvent(0.02, dpa.ComposedDpEvent(  # nested Gaussians: dp-accounting's path
            [dpa.GaussianDpEvent(2.0), dpa.GaussianDpEvent(3.0)])), 4)],
        [(dpa.GaussianDpEvent(2.0), 3), (poisson, 5)],
    ]
    for entries in cases:
        ref = RdpAccountant(orders=acc.RDP_ORDERS, neighboring_relation=ADD_REMOVE)
        for event, count in entries:
            ref.compose(event, count)
        for _ in range(2):  # the second round from the kept vectors
            _assert_same_numbers(acc.make_accountant("rdp"), ref, entries)
    assert acc._step_rdp.cache_info().hits > 0
    kept = acc._step_rdp(0.01, 1.5, acc.RDP_ORDERS)
    before = kept.copy()
    a = acc.make_accountant("rdp")
    a.compose(poisson, 50)
    a.get_epsilon(1e-6)
    assert (kept == before).all() and not kept.flags.writeable
