"""Statistical tests state their tolerance in standard deviations (sd) of the statistic.

Keys come from `seeded_key`, so every test is deterministic (not flaky), while the
tolerances are what a correct sampler passes with overwhelming probability.

`PoissonSampler` (geometric skips, O(qN)) and `ReferencePoissonSampler` (one coin per
unit, O(N)) draw different samples from the same key; they are compared in distribution.

Owns invariant `sampling-as-accounted` (docs/DESIGN.md §3): its tests are here."""

import itertools
import math
import random
import time
import tracemalloc
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from llmdp.privacy.rng import chacha
from llmdp.privacy.rng.keys import secure_key, seeded_key
from llmdp.privacy.sampling import _dyadic as D
from llmdp.privacy.sampling import poisson as S
from llmdp.privacy.sampling import reference as R
from llmdp.privacy.sampling.poisson import (
    PoissonSampler,
    TruncatedPoissonSampler,
    make_sampler,
    uniform_stream,
)
from llmdp.privacy.sampling.reference import ReferencePoissonSampler

SAMPLERS = [PoissonSampler, ReferencePoissonSampler]


def _chi2_within(observed, expected, sds=5.0):
    """Pearson chi-square of observed vs expected counts, asserted within `sds` standard
    deviations of its mean (df, sd sqrt(2 df)). Returns (chi2, df)."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    assert abs(observed.sum() - expected.sum()) < 1e-6 * expected.sum()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    assert abs(chi2 - df) < sds * math.sqrt(2 * df), (chi2, df)
    return chi2, df


def _pooled(observed_by_value, pmf_by_value, draws, min_expected=5.0):
    """Bins of consecutive support values, pooled from each tail inwards until every
    bin expects >= min_expected draws. Returns (observed, expected) arrays."""
    values = sorted(pmf_by_value)
    bins, cur_obs, cur_exp = [], 0.0, 0.0
    for v in values:  # lower tail upwards
        cur_obs += observed_by_value.get(v, 0)
        cur_exp += draws * pmf_by_value[v]
        if cur_exp >= min_expected:
            bins.append([cur_obs, cur_exp])
            cur_obs, cur_exp = 0.0, 0.0
    if bins:  # the remainder (upper tail) joins the last bin
        bins[-1][0] += cur_obs
        bins[-1][1] += cur_exp
    obs, exp = np.array(bins).T
    return obs, exp


def _binom_pmf(n, q):
    """The exact Binomial(n, q) pmf (math.comb, float64), {k: P(k)}."""
    return {k: math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(n + 1)}


def _assert_valid(idx, n):
    assert idx.dtype == np.int64
    assert np.all(np.diff(idx) > 0)  # sorted, never repeats a unit
    if len(idx):
        assert idx[0] >= 0 and idx[-1] < n


def _all_open(f, margin):
    """A `_fast_thresholds` that decides nothing: every coin takes the exact path."""
    n = np.shape(f)
    return np.zeros(n, dtype=np.uint64), np.full(n, np.iinfo(np.uint64).max, dtype=np.uint64)


# ---- both samplers against Binomial(N, q): N = 200 units, 4000 steps each

N_UNITS, DRAWS = 200, 4000


@pytest.fixture(scope="module", params=[(c, q) for c in SAMPLERS for q in (0.03, 0.3, 0.7)],
                ids=lambda p: f"{p[0].__name__}-q{p[1]}")
def indicators(request):
    """(q, DRAWS x N_UNITS inclusion indicators of independent steps)."""
    cls, q = request.param
    sampler = cls(N_UNITS, q)
    x = np.zeros((DRAWS, N_UNITS), dtype=np.float64)
    for d in range(DRAWS):
        idx = sampler.sample(seeded_key(1234, d, "sample"))
        _assert_valid(idx, N_UNITS)
        x[d, idx] = 1.0
    return q, x


def test_per_unit_inclusion_frequency(indicators):
    q, x = indicators
    counts = x.sum(axis=0)
    mean, sd = DRAWS * q, math.sqrt(DRAWS * q * (1 - q))
    # Each unit's count is Binomial(DRAWS, q): within 5 sd for every unit.
    assert np.all(np.abs(counts - mean) < 5 * sd), (counts.min(), counts.max())
    # Jointly: sum of z^2 over the N (independent) units is ~chi-square(N): mean N,
    # sd sqrt(2N). Catches schemes whose counts are too even (e.g. round robin: 0) or
    # too spread (units sharing coins), which the per-unit bound lets through.
    z2 = float((((counts - mean) / sd) ** 2).sum())
    assert abs(z2 - N_UNITS) < 5 * math.sqrt(2 * N_UNITS), z2
    # No drift along the index (a skip walk that favoured early or late units): the
    # first and second halves' totals differ by < 5 sd of the difference.
    half = N_UNITS // 2
    diff = counts[:half].sum() - counts[half:].sum()
    assert abs(diff) < 5 * math.sqrt(N_UNITS * DRAWS * q * (1 - q))


def test_sample_size_distribution_is_binomial(indicators):
    q, x = indicators
    sizes = x.sum(axis=1).astype(int)
    # Pearson chi-square against the exact pmf, bins pooled to >= 5 expected: within 5 sd.
    _chi2_within(*_pooled(Counter(sizes.tolist()), _binom_pmf(N_UNITS, q), DRAWS))


def test_sample_size_mean_and_variance_are_binomial(indicators):
    q, x = indicators
    sizes = x.sum(axis=1)
    # Poisson sampling: |sample| ~ Binomial(N, q). Mean within 5 sd of its estimator.
    var = N_UNITS * q * (1 - q)
    assert abs(sizes.mean() - N_UNITS * q) < 5 * math.sqrt(var / DRAWS)
    # The size must *vary* like a binomial: a fixed-size (shuffled) batch has variance 0
    # and must fail here. sd of the sample variance ~ var * sqrt(2 / (DRAWS - 1)) (the
    # binomial's excess kurtosis is small here: < 0.2 of that).
    assert abs(sizes.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (DRAWS - 1))


def test_units_and_steps_are_independent(indicators):
    q, x = indicators
    x = x - x.mean(axis=0)
    # Covariance of units at lag 1 and 2 (a skip walk couples neighbours if it is wrong),
    # averaged over the pairs. Each estimator has sd ~ q(1-q)/sqrt(DRAWS); the average of
    # P of them ~ that / sqrt(P).
    for lag in (1, 2):
        sd = q * (1 - q) / math.sqrt(DRAWS) / math.sqrt(N_UNITS - lag)
        assert abs((x[:, :-lag] * x[:, lag:]).mean()) < 5 * sd, lag
    # Same for consecutive steps of the same unit (fresh key per step).
    sd_steps = q * (1 - q) / math.sqrt(DRAWS - 1) / math.sqrt(N_UNITS)
    assert abs((x[:-1, :] * x[1:, :]).mean()) < 5 * sd_steps


# ---- the O(B) sampler's pieces


@pytest.mark.parametrize("q", [0.03, 0.3, 0.7, 0.5, 2.0**-10, float(np.nextafter(2.0**-10, 1.0)), 1e-3])
def test_skips_are_geometric(q):
    # The gaps G between included units: P(G = g) = (1-q)**g q, the law that makes the
    # walk N independent Bernoulli(q) coins. Pearson chi-square over 100,000 gaps, bins
    # pooled to >= 5 expected, within 5 sd; the mean (1-q)/q within 5 sd of its estimator.
    # q = 2**-10 (m q = 1) and the float just above it (t drops, m q ~ 1/2) are the edges.
    n = 100_000
    s = PoissonSampler(2**40, q)
    key = seeded_key(3, 0, "skips")
    g = s._skips(key, S._Stream(key, S._TAG_POISSON), n)
    assert g.dtype == np.int64 and g.min() >= 0
    top = int(math.ceil(40 / q))  # P(G > top) = (1-q)**top < e**-40
    pmf = {v: (1 - q) ** v * q for v in range(top)}
    pmf[top] = 1 - sum(pmf.values())
    counts = Counter(np.minimum(g, top).tolist())
    _chi2_within(*_pooled(counts, pmf, n))
    assert abs(g.mean() - (1 - q) / q) < 5 * math.sqrt((1 - q) / q**2 / n)


def _random_qs(rng, count, max_t):
    """Floats q with t = floor(log2(1/q)) <= max_t: uniform, dyadic, above 1/2, near 2**-j."""
    qs = [0.5, 0.75, 1 - 2.0**-53, 2.0**-max_t, float(np.nextafter(2.0**-max_t, 1.0)), 1 / 3]
    while len(qs) < count:
        kind = rng.randrange(3)
        if kind == 0:
            q = rng.random()
        elif kind == 1:
            q = 2.0 ** -rng.uniform(0, max_t)
        else:
            q = rng.randrange(1, 2**20) / 2**20
        if 2.0**-max_t <= q < 1.0:
            qs.append(q)
    return qs


def test_float_bounds_bracket_the_exact_power():
    # f(r) ~ (1-q)**r from the P_i: |f / p - 1| <= margin / 2 with p the exact Fraction,
    # and the integer thresholds (A, D) satisfy A / 2**64 <= p <= (D + 1) / 2**64 (so
    # W < A proves U < p and W > D proves U >= p). P_i is the float nearest (1-q)**(2**i).
    rng = random.Random(11)
    for q in _random_qs(rng, 60, 12):
        s = PoissonSampler(1000, q)
        base = 1 - Fraction(q)
        for i in range(s._t + 1):
            assert s._powers[i] == float(base ** (2**i))  # float(Fraction) rounds correctly
        rs = sorted({0, s._m - 1, *(rng.randrange(s._m) for _ in range(8))})
        r_arr = np.array(rs, dtype=np.uint64)
        f = s._factor(r_arr)
        a, d = s._thresholds(r_arr)
        for r, fr, ar, dr in zip(rs, f.tolist(), a.tolist(), d.tolist()):
            p = base**r
            assert abs(Fraction(fr) / p - 1) <= Fraction(s._margin) / 2, (q, r)
            assert Fraction(ar, 2**64) <= p <= Fraction(dr + 1, 2**64), (q, r)
            assert dr - ar < 2**64 * 4 * s._margin  # the open window is narrow
        # rho = (1-q)**m, the continue probability of Q
        rho = base ** s._m
        assert Fraction(int(s._rho_a), 2**64) <= rho <= Fraction(int(s._rho_d) + 1, 2**64)


@pytest.mark.parametrize("q", [1e-12, 3e-7, 2.0**-40, 2.0**-70, 5e-324])
def test_float_bounds_bracket_the_power_for_large_t(q):
    # t > 16 (several chunk tables): exact Fractions are too big, so the reference is the
    # rigorous integer bracket of `_power_bounds` at 4000 bits (checked below against
    # Fractions), which is far tighter than the float bounds being tested.
    rng = random.Random(5)
    s = PoissonSampler(2**62, q)
    assert s._t == min(63, math.floor(-math.log2(q)))
    rs = [0, 1, s._m - 1, *(rng.randrange(s._m) for _ in range(30))]
    r_arr = np.array(rs, dtype=np.uint64)
    f = s._factor(r_arr)
    a, d = s._thresholds(r_arr)
    prec = 4000
    for r, fr, ar, dr in zip(rs, f.tolist(), a.tolist(), d.tolist()):
        lo, hi = D._power_bounds(s._c, s._b, r, prec)
        assert Fraction(fr) * (1 - Fraction(s._margin) / 2) <= Fraction(lo, 2**prec)
        assert Fraction(hi, 2**prec) <= Fraction(fr) * (1 + Fraction(s._margin) / 2)
        assert ar * 2 ** (prec - 64) <= lo and hi <= (dr + 1) * 2 ** (prec - 64)
    lo, hi = D._power_bounds(s._c, s._b, s._m, prec)
    assert int(s._rho_a) * 2 ** (prec - 64) <= lo and hi <= (int(s._rho_d) + 1) * 2 ** (prec - 64)


def test_integer_power_bounds_bracket_the_fraction():
    rng = random.Random(2)
    for _ in range(200):
        q = rng.choice([rng.random(), 2.0 ** -rng.uniform(0, 60), rng.randrange(1, 1024) / 1024])
        c, b = D._one_minus(q)
        assert Fraction(c, 2**b) == 1 - Fraction(q)
        s = rng.randrange(0, 600)
        prec = rng.choice([8, 64, 200, 1000])
        lo, hi = D._power_bounds(c, b, s, prec)
        p = Fraction(c, 2**b) ** s
        assert Fraction(lo, 2**prec) <= p <= Fraction(hi, 2**prec), (q, s, prec)


def test_exact_coin_matches_the_fraction_comparison():
    # U = word w, then the words of (key, exct ‖ position); the coin is U < p exactly.
    # Words picked at floor(p 2**64) and next to it straddle p, so several words are read.
    rng = random.Random(8)
    key = seeded_key(4, 4, "coin")
    checked = 0
    for trial in range(300):
        q = rng.choice([rng.random(), 2.0 ** -rng.uniform(0, 30), 0.5, 0.25])
        c, b = D._one_minus(q)
        s = rng.randrange(0, 300)
        p = Fraction(c, 2**b) ** s
        w0 = min(int(p * 2**64), 2**64 - 1)
        w = rng.choice([w0, w0 - 1 if w0 else 0, w0 + 1 if w0 < 2**64 - 1 else w0, rng.randrange(2**64)])
        got = S._exact_coin(c, b, s, w, key, trial)
        # the reference: read U's bits until its interval is on one side of p
        v, k = w, 1
        while Fraction(v, 2 ** (64 * k)) < p < Fraction(v + 1, 2 ** (64 * k)):
            v = (v << 64) | int(S._words(key, S._TAG_EXACT, trial, k - 1, 1)[0])
            k += 1
        assert got == (Fraction(v + 1, 2 ** (64 * k)) <= p), (q, s, w)
        checked += k > 1
    assert checked > 50  # the multi-word path was exercised


@pytest.mark.parametrize("q", [0.03, 0.3, 0.7, 1e-3, 1e-12])
def test_exact_path_draws_the_same_sample(monkeypatch, q):
    # Every coin is "U < p" for a fixed real U (word w, then its own exct stream), so the
    # fast comparison and the exact path must decide every coin alike: forcing every coin
    # through the exact path reproduces the sample bit for bit.
    n = 2000 if q >= 1e-3 else 10**13
    keys = [seeded_key(21, d, "exact") for d in range(20)]
    fast = [PoissonSampler(n, q).sample(k) for k in keys]
    calls = []
    real = S._exact_coin

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(S, "_fast_thresholds", _all_open)
    monkeypatch.setattr(S, "_exact_coin", counting)
    slow_sampler = PoissonSampler(n, q)
    for k, expected in zip(keys, fast):
        assert np.array_equal(slow_sampler.sample(k), expected)
    assert len(calls) > 20 * 16  # every coin of every gap went through the exact path


def test_exact_path_distribution(monkeypatch):
    # The exact path on its own, in distribution (N = 100, q = 0.3, 1500 steps): the
    # sample size's mean and variance within 5 sd, each unit's count within 5 sd.
    monkeypatch.setattr(S, "_fast_thresholds", _all_open)
    n, q, draws = 100, 0.3, 1500
    sampler = PoissonSampler(n, q)
    x = np.zeros((draws, n))
    for d in range(draws):
        idx = sampler.sample(seeded_key(22, d, "exact-dist"))
        _assert_valid(idx, n)
        x[d, idx] = 1
    sizes = x.sum(axis=1)
    var = n * q * (1 - q)
    assert abs(sizes.mean() - n * q) < 5 * math.sqrt(var / draws)
    assert abs(sizes.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (draws - 1))
    counts = x.sum(axis=0)
    assert np.all(np.abs(counts - draws * q) < 5 * math.sqrt(draws * q * (1 - q)))
    _chi2_within(*_pooled(Counter(sizes.astype(int).tolist()), _binom_pmf(n, q), draws))


def test_cost_does_not_grow_with_n(monkeypatch):
    # Keystream words read per draw at the same expected batch B = 1000, for N = 10**6
    # and N = 10**9 (counted, not timed): within a factor 1.5 of each other, and a few
    # words per sampled unit: < 5.7 per gap for any q (module docstring), times the
    # batch's headroom of 6 sqrt(B) + 16 gaps (1.2 at B = 1000); about 6.1 is measured.
    used = []
    real = S._words

    def counting(key, tag, index, first, n):
        used.append(n)
        return real(key, tag, index, first, n)

    monkeypatch.setattr(S, "_words", counting)
    per_n = {}
    for n in (10**6, 10**9):
        sampler = PoissonSampler(n, 1000 / n)
        used.clear()
        sizes = sum(len(sampler.sample(seeded_key(6, d, "cost"))) for d in range(20))
        per_n[n] = sum(used)
        assert per_n[n] < 7 * sizes, (n, per_n[n], sizes)
    ratio = per_n[10**9] / per_n[10**6]
    assert 1 / 1.5 < ratio < 1.5, per_n


def test_no_array_of_size_n():
    # N = 10**12 units at q = 10**-9 (B = 1000): an O(N) array would be 8 TB.
    sampler = PoissonSampler(10**12, 1e-9)
    t0 = time.perf_counter()
    sizes = []
    for d in range(20):
        idx = sampler.sample(seeded_key(7, d, "huge"))
        _assert_valid(idx, 10**12)
        sizes.append(len(idx))
    assert time.perf_counter() - t0 < 20  # generous; about 10 ms in practice
    # 20 draws of Binomial(10**12, 1e-9): mean 1000, sd sqrt(1000 / 20); within 5 sd.
    assert abs(np.mean(sizes) - 1000) < 5 * math.sqrt(1000 / 20)
    # Peak traced memory of one draw at N = 10**9, B = 10**4: O(B) (a few hundred bytes
    # per sampled unit at most), nowhere near the 8 GB of an O(N) array.
    sampler = PoissonSampler(10**9, 1e-5)
    tracemalloc.start()
    try:
        idx = sampler.sample(seeded_key(7, 0, "mem"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1000 * max(len(idx), 1000), peak


def test_tiny_q_and_single_unit():
    # q = 1e-12 with N = 10**12: |S| ~ Binomial, mean 1, sd 1; 200 draws: mean within 5 sd.
    sampler = PoissonSampler(10**12, 1e-12)
    sizes = [len(sampler.sample(seeded_key(8, d, "tiny"))) for d in range(200)]
    assert abs(np.mean(sizes) - 1) < 5 * math.sqrt(1 / 200)
    # q below 2**-63 (t capped at 63) and the smallest subnormal: valid, almost surely empty.
    for q in (2.0**-70, 5e-324):
        s = PoissonSampler(2**62, q)
        for d in range(5):
            idx = s.sample(seeded_key(8, d, "tinier"))
            _assert_valid(idx, 2**62)
            assert len(idx) <= 1
    # N = 1: the single unit is in with probability q (2000 steps, within 5 sd).
    for q in (0.5, 0.1, 0.9):
        hits = sum(len(PoissonSampler(1, q).sample(seeded_key(9, d, "one"))) for d in range(2000))
        assert abs(hits - 2000 * q) < 5 * math.sqrt(2000 * q * (1 - q)), (q, hits)


@pytest.mark.parametrize("cls", SAMPLERS)
def test_same_key_same_sample_different_key_different_sample(cls):
    sampler = cls(1000, 0.5)
    k1, k2 = secure_key(), secure_key()
    a, b = sampler.sample(k1), cls(1000, 0.5).sample(k1)  # "another worker"
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sampler.sample(k2))  # equal with probability 2**-1000
    _assert_valid(a, 1000)
    for n, q in ((1, 0.5), (7, 0.3), (5000, 0.01), (300, 0.999)):
        s = cls(n, q)
        idx = s.sample(k1)
        _assert_valid(idx, n)
        assert np.array_equal(idx, s.sample(k1))


@pytest.mark.parametrize("cls", SAMPLERS)
def test_q_one_gives_everyone(cls):
    for n in (1, 50, 1000):
        assert np.array_equal(cls(n, 1.0).sample(secure_key()), np.arange(n))


def test_samplers_are_different_draws_of_one_law():
    # Same key, different streams (pois vs refp): the draws differ (equal w.p. ~2**-1000).
    key = seeded_key(0, 0, "diff")
    assert not np.array_equal(PoissonSampler(1000, 0.5).sample(key), ReferencePoissonSampler(1000, 0.5).sample(key))


def test_stream_tags_are_distinct():
    tags = {PoissonSampler.TAG, PoissonSampler.EXACT_TAG, ReferencePoissonSampler.TAG,
            ReferencePoissonSampler.TIE_TAG, TruncatedPoissonSampler.SUBSET_TAG, S._TAG_UNIFORM}
    assert len(tags) == 6 and all(len(t) == 4 for t in tags)
    for t in tags:
        chacha.stream_nonce(t, 0)  # a valid tag (not the key-derivation tag)


# ---- the O(N) reference


def test_reference_is_threshold_of_the_uniform_stream_across_chunks():
    # More units than one keystream chunk, so chunk boundaries are exercised.
    n = S._CHUNK + 12345
    sampler = ReferencePoissonSampler(n, 0.003)
    key = seeded_key(7, 0, "chunks")
    u = uniform_stream(key, n, ReferencePoissonSampler.TAG)
    # u < K / 2**53 (no unit of this key ties the threshold K: probability ~n * 2**-53)
    k_thr = R._tie_rule(0.003)[0]
    assert not np.any(u * 2.0**53 == k_thr)
    expected = np.flatnonzero(u * 2.0**53 < k_thr)
    assert np.array_equal(sampler.sample(key), expected)
    assert len(expected) > 0


def test_inclusion_probability_is_exactly_q():
    for q in (1e-7, 0.01, 1 / 3, 0.999999, 1.0, 0.5, 2.0**-60):
        assert PoissonSampler(10, q).inclusion_probability == q
        assert ReferencePoissonSampler(10, q).inclusion_probability == q
        # The tie rule splits q exactly: q = (K + r / 2**m) / 2**53.
        k, m, r = R._tie_rule(q)
        assert 0 <= r < 2**m
        assert Fraction(q) == (k + Fraction(r, 2**m)) / 2**53


@pytest.mark.parametrize("q", [1 / 3, 0.01, 0.3, 0.5, 2.0**-60])
def test_ties_are_resolved_with_the_exact_remainder(monkeypatch, q):
    # Force every unit's 53-bit uniform onto the threshold K (probability 2**-53 each in
    # reality): each is then included with probability exactly frac(q * 2**53) = r / 2**m.
    n = 4000
    k_thr, m, r = R._tie_rule(q)
    monkeypatch.setattr(R, "_reference_uint53", lambda key, first, count: np.full(count, k_thr, dtype=np.uint64))
    sampler = ReferencePoissonSampler(n, q)
    key = seeded_key(5, 0, "ties")
    got = sampler.sample(key)
    p = r / 2**m if m else 0.0  # dyadic q (0.5): u = K / 2**53 = q is not < q
    if p == 0.0:
        assert len(got) == 0
    else:
        assert abs(len(got) - n * p) < 5 * math.sqrt(n * p * (1 - p)), (len(got), n * p)
    assert np.array_equal(got, sampler.sample(key))  # deterministic given the key
    _assert_valid(got, n)
    # A unit's tie is decided by its own stream (ties ‖ i): the same whoever else tied.
    if len(got):
        i = int(got[0])
        assert np.array_equal(R._resolve_ties(key, np.array([i]), m, r), [i])


def test_uniform_stream_properties():
    key = seeded_key(1, 2, "uniform")
    n = 200_000
    u = uniform_stream(key, n)
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    k = u * 2.0**53
    assert np.array_equal(k, np.floor(k))  # 53-bit grid
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    # KS distance to U(0,1); 1.95/sqrt(n) is the 0.1% critical value.
    s = np.sort(u)
    i = np.arange(1, n + 1)
    d = max(np.max(i / n - s), np.max(s - (i - 1) / n))
    assert d < 1.95 / math.sqrt(n)
    # Prefix-consistent across lengths and chunk boundaries; the tag separates streams;
    # the values are the ChaCha20 words' top 53 bits.
    long = uniform_stream(key, S._CHUNK + 10)
    assert np.array_equal(long[:n], u)
    assert not np.array_equal(uniform_stream(key, 100, b"othr"), u[:100])
    w = chacha.words64(key, chacha.stream_nonce(b"unif", 0), 0, 10)
    assert np.array_equal(u[:10], (w >> np.uint64(11)) * 2.0**-53)


def test_keys():
    assert len(secure_key()) == 32 and secure_key() != secure_key()
    k = seeded_key(42, 3, "noise")
    assert len(k) == 32 and k == seeded_key(42, 3, "noise")
    assert (
        len(
            {k, seeded_key(43, 3, "noise"), seeded_key(42, 4, "noise"), seeded_key(42, 3, "sample")}
        )
        == 4
    )
    # Sampling keys are 32 bytes (a step's sample key); one message names length and fix.
    for cls in SAMPLERS:
        for bad in (b"short", bytes(16), bytes(33)):
            with pytest.raises(ValueError, match=rf"32 bytes .*got a {len(bad)}-byte key.*derive_key"):
                cls(10, 0.5).sample(bad)
        with pytest.raises(ValueError, match="32 bytes"):
            cls(10, 0.5).sample("a string")
    with pytest.raises(ValueError, match="32 bytes"):
        uniform_stream(bytes(16), 3)
    # The worker's sample key: derived from the step key.
    step = secure_key()
    assert len(PoissonSampler(100, 0.1).sample(chacha.derive_key(step, b"sample"))) <= 100
    with pytest.raises(ValueError, match="seed"):
        seeded_key("42", 0, "x")


def test_validation():
    for cls in SAMPLERS:
        with pytest.raises(ValueError, match="sampling_probability"):
            cls(10, 0.0)
        with pytest.raises(ValueError, match="num_units"):
            cls(0, 0.1)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        PoissonSampler(2**62 + 1, 0.1)


# ---- truncated Poisson


def test_truncated_sampler_interface_and_validation():
    t = TruncatedPoissonSampler(100, 0.1, 7)
    assert (t.num_units, t.sampling_probability, t.max_batch_size) == (100, 0.1, 7)
    assert t.inclusion_probability == 0.1
    assert PoissonSampler(100, 0.1).max_batch_size is None
    assert ReferencePoissonSampler(100, 0.1).max_batch_size is None
    assert isinstance(make_sampler(100, 0.1), PoissonSampler)
    m = make_sampler(100, 0.1, 7)
    assert isinstance(m, TruncatedPoissonSampler) and m.max_batch_size == 7
    assert isinstance(m._poisson, PoissonSampler)
    key = seeded_key(0, 0, "x")
    idx, truncated = PoissonSampler(100, 0.1).sample_with_info(key)
    assert truncated is False and np.array_equal(idx, PoissonSampler(100, 0.1).sample(key))
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match=f"max_batch_size={bad!r}"):
            TruncatedPoissonSampler(100, 0.1, bad)
    with pytest.raises(ValueError, match="sampling_probability"):
        TruncatedPoissonSampler(100, 0.0, 5)
    with pytest.raises(ValueError, match="num_units"):
        TruncatedPoissonSampler(0, 0.1, 5)
    with pytest.raises(ValueError, match="key"):
        t.sample(b"short")


def test_truncated_is_the_poisson_draw_capped():
    n, q, cap = 300, 0.2, 60  # mean 60: about half the draws are truncated
    poisson, trunc = PoissonSampler(n, q), TruncatedPoissonSampler(n, q, cap)
    seen_truncated = seen_not = 0
    for d in range(200):
        key = seeded_key(9, d, "trunc")
        drawn = poisson.sample(key)
        got, truncated = trunc.sample_with_info(key)
        assert np.array_equal(got, trunc.sample(key))  # same key -> same sample
        assert np.array_equal(got, TruncatedPoissonSampler(n, q, cap).sample(key))
        _assert_valid(got, n)
        assert truncated == (len(drawn) > cap)
        if truncated:
            seen_truncated += 1
            assert len(got) == cap and np.all(np.isin(got, drawn))  # a subset of the draw
            # ... chosen from the key's own subset stream (separate from the skips)
            keep = S._uniform_subset(key, TruncatedPoissonSampler.SUBSET_TAG, len(drawn), cap)
            assert np.array_equal(got, drawn[keep])
        else:
            seen_not += 1
            assert np.array_equal(got, drawn)
    assert seen_truncated > 20 and seen_not > 20


DRAWS_T, N_T, Q_T, CAP_T = 4000, 200, 0.1, 18  # mean 20 > cap: truncated ~72% of steps


@pytest.fixture(scope="module")
def truncated_draws():
    """(poisson draw, truncated sample) for DRAWS_T keys."""
    poisson, trunc = PoissonSampler(N_T, Q_T), TruncatedPoissonSampler(N_T, Q_T, CAP_T)
    out = []
    for d in range(DRAWS_T):
        key = seeded_key(77, d, "truncated")
        out.append((poisson.sample(key), trunc.sample(key)))
    return out


def test_truncated_batch_size_is_min_of_binomial_and_cap(truncated_draws):
    sizes = Counter(len(got) for _, got in truncated_draws)
    assert max(sizes) == CAP_T
    # Exact pmf of min(Binomial(N, q), B_max): the binomial below the cap, all the upper
    # tail P(Bin >= B_max) at the cap.
    binom = _binom_pmf(N_T, Q_T)
    pmf = {k: binom[k] for k in range(CAP_T)}
    pmf[CAP_T] = sum(binom[k] for k in range(CAP_T, N_T + 1))
    assert math.isclose(sum(pmf.values()), 1.0, rel_tol=1e-12)
    _chi2_within(*_pooled(sizes, pmf, DRAWS_T))
    p = pmf[CAP_T]
    assert abs(sizes[CAP_T] - DRAWS_T * p) < 5 * math.sqrt(DRAWS_T * p * (1 - p))


def test_truncation_keeps_each_drawn_unit_with_probability_cap_over_size(truncated_draws):
    kept = np.zeros(N_T)
    expected = np.zeros(N_T)
    var = np.zeros(N_T)
    for drawn, got in truncated_draws:
        if len(drawn) <= CAP_T:
            continue
        p = CAP_T / len(drawn)
        kept[got] += 1
        expected[drawn] += p
        var[drawn] += p * (1 - p)
    assert np.all(var > 0)
    z = (kept - expected) / np.sqrt(var)
    # Per unit within 5 sd; jointly sum z^2 ~ chi-square(N) within 5 of its sd.
    assert np.all(np.abs(z) < 5), np.abs(z).max()
    assert abs(float((z**2).sum()) - N_T) < 5 * math.sqrt(2 * N_T)


def test_truncation_has_no_position_bias(truncated_draws):
    # Rank r in the sorted draw is kept with probability B_max / |S| too: a scheme that
    # keeps the lowest indices (or a contiguous block) fails here. Cells (|S|, r) with
    # enough draws; and adjacent ranks are kept jointly with probability
    # B(B-1) / (|S|(|S|-1)), which a "random rotation + first B" scheme fails.
    by_size = {}
    for drawn, got in truncated_draws:
        n = len(drawn)
        if n > CAP_T:
            flags = np.isin(drawn, got).astype(float)
            by_size.setdefault(n, []).append(flags)
    z2, cells = 0.0, 0
    pair_obs = pair_exp = pair_var = 0.0
    for n, rows in by_size.items():
        rows = np.array(rows)
        if len(rows) < 50:
            continue
        p = CAP_T / n
        k = len(rows)
        z = (rows.sum(axis=0) - k * p) / math.sqrt(k * p * (1 - p))
        z2 += float((z**2).sum())
        cells += n
        pp = CAP_T * (CAP_T - 1) / (n * (n - 1))
        pairs = (rows[:, :-1] * rows[:, 1:]).sum(axis=1)  # adjacent kept pairs per draw
        pair_obs += float(pairs.sum())
        pair_exp += k * (n - 1) * pp
        pair_var += k * float(pairs.var(ddof=1))  # rows are independent draws
    assert cells > 100
    # Ranks within one row are (weakly) dependent; the chi-square bound is still ~5 sd.
    assert abs(z2 - cells) < 5 * math.sqrt(2 * cells), (z2, cells)
    assert abs(pair_obs - pair_exp) < 5 * math.sqrt(pair_var)


def test_truncation_subset_is_uniform_over_all_subsets():
    # Tiny case, exhaustively: for each drawn set S with |S| > B_max, every one of the
    # C(|S|, B_max) subsets is equally likely. Pooled chi-square over all (S, subset) cells.
    n, q, cap, draws = 6, 0.9, 3, 6000
    sampler = TruncatedPoissonSampler(n, q, cap)
    poisson = PoissonSampler(n, q)
    counts = {}
    for d in range(draws):
        key = seeded_key(31, d, "subsets")
        drawn = tuple(poisson.sample(key).tolist())
        if len(drawn) > cap:
            got = tuple(sampler.sample(key).tolist())
            counts.setdefault(drawn, Counter())[got] += 1
    chi2, df = 0.0, 0
    for drawn, c in counts.items():
        subsets = list(itertools.combinations(drawn, cap))
        total = sum(c.values())
        exp = total / len(subsets)
        if exp < 5:
            continue
        assert set(c) <= set(subsets)
        chi2 += sum((c.get(sub, 0) - exp) ** 2 / exp for sub in subsets)
        df += len(subsets) - 1
    assert df > 100
    assert abs(chi2 - df) < 5 * math.sqrt(2 * df), (chi2, df)


def test_uniform_subset_of_sizes_is_uniform():
    # _uniform_subset(n, size) directly, n = 7, size 1..6 (kept sets of both sizes below
    # and above n/2): pooled chi-square over all C(7, size) subsets within 5 sd.
    chi2, df = 0.0, 0
    for size in range(1, 7):
        subsets = list(itertools.combinations(range(7), size))
        draws = 10 * len(subsets)
        c = Counter(tuple(S._uniform_subset(seeded_key(32, d, f"sz{size}"), b"subs", 7, size).tolist())
                    for d in range(draws))
        assert set(c) <= set(subsets)
        chi2 += sum((c.get(sub, 0) - 10) ** 2 / 10 for sub in subsets)
        df += len(subsets) - 1
    assert abs(chi2 - df) < 5 * math.sqrt(2 * df), (chi2, df)


def test_uniform_subset_rejection_and_edges(monkeypatch):
    key = seeded_key(1, 1, "e")
    assert np.array_equal(S._uniform_subset(key, b"subs", 5, 0), [])
    assert np.array_equal(S._uniform_subset(key, b"subs", 5, 5), np.arange(5))
    big = S._uniform_subset(key, b"subs", 10**6, 5 * 10**5)  # vectorized: no loop over n
    assert big.dtype == np.int64 and len(big) == 5 * 10**5 and np.all(np.diff(big) > 0)
    with pytest.raises(ValueError, match="size"):
        S._uniform_subset(key, b"subs", 3, 4)
    # The 1st and 2nd smallest words tie (both 0): the draw is rejected and the next n
    # words of the stream decide: [5, 1, 9] keeps position 1.
    calls = []

    def fake(key, tag, index, first, n):
        calls.append(first)
        return np.array([0, 7, 0] if len(calls) == 1 else [5, 1, 9], dtype=np.uint64)

    monkeypatch.setattr(S, "_words", fake)
    assert np.array_equal(S._uniform_subset(key, b"subs", 3, 1), [1])
    assert calls == [0, 3]
