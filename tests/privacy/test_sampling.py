"""Statistical tests state their tolerance in standard deviations (sd) of the statistic.

Keys come from `seeded_key`, so every test is deterministic (not flaky), while the
tolerances are what a correct sampler passes with overwhelming probability.
"""

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from llmdp.privacy import sampling as S
from llmdp.privacy.sampling import (
    PoissonSampler,
    TruncatedPoissonSampler,
    make_sampler,
    secure_key,
    seeded_key,
    uniform_stream,
)


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

N_UNITS, Q, DRAWS = 200, 0.1, 2000


@pytest.fixture(scope="module")
def indicator_matrix():
    """DRAWS x N_UNITS inclusion indicators of independent steps."""
    sampler = PoissonSampler(N_UNITS, Q)
    x = np.zeros((DRAWS, N_UNITS), dtype=np.float64)
    for d in range(DRAWS):
        x[d, sampler.sample(seeded_key(1234, d, "sample"))] = 1.0
    return x


def test_per_unit_inclusion_frequency(indicator_matrix):
    counts = indicator_matrix.sum(axis=0)
    mean, sd = DRAWS * Q, math.sqrt(DRAWS * Q * (1 - Q))
    # Each unit's count is Binomial(DRAWS, q): within 5 sd for every unit.
    assert np.all(np.abs(counts - mean) < 5 * sd), (counts.min(), counts.max())
    # Jointly: sum of z^2 over the N (independent) units is ~chi-square(N): mean N,
    # sd sqrt(2N). Catches schemes whose counts are too even (e.g. round robin: 0) or
    # too spread (units sharing coins), which the per-unit bound lets through.
    z2 = float((((counts - mean) / sd) ** 2).sum())
    assert abs(z2 - N_UNITS) < 5 * math.sqrt(2 * N_UNITS), z2


def test_sample_size_distribution_is_binomial(indicator_matrix):
    sizes = indicator_matrix.sum(axis=1).astype(int)
    support = range(N_UNITS + 1)
    pmf = {k: stats.binom.pmf(k, N_UNITS, Q) for k in support}
    _chi2_within(*_pooled(Counter(sizes.tolist()), pmf, DRAWS))


def test_sample_size_mean_and_variance_are_binomial(indicator_matrix):
    sizes = indicator_matrix.sum(axis=1)
    # Poisson sampling: |sample| ~ Binomial(N, q). Mean within 5 sd of its estimator.
    var = N_UNITS * Q * (1 - Q)
    assert abs(sizes.mean() - N_UNITS * Q) < 5 * math.sqrt(var / DRAWS)
    # The size must *vary* like a binomial: a fixed-size (shuffled) batch has variance 0
    # and must fail here. sd of the sample variance ~ var * sqrt(2 / (DRAWS - 1)).
    assert abs(sizes.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (DRAWS - 1))


def test_units_and_steps_are_independent(indicator_matrix):
    x = indicator_matrix - indicator_matrix.mean(axis=0)
    # Covariance of neighbouring units' indicators, averaged over the N-1 pairs. Each
    # estimator has sd ~ q(1-q)/sqrt(DRAWS); the average of N-1 of them ~ that / sqrt(N-1).
    sd = Q * (1 - Q) / math.sqrt(DRAWS) / math.sqrt(N_UNITS - 1)
    cov_units = (x[:, :-1] * x[:, 1:]).mean()
    assert abs(cov_units) < 5 * sd
    # Same for consecutive steps of the same unit (fresh key per step).
    sd_steps = Q * (1 - Q) / math.sqrt(DRAWS - 1) / math.sqrt(N_UNITS)
    cov_steps = (x[:-1, :] * x[1:, :]).mean()
    assert abs(cov_steps) < 5 * sd_steps


def test_same_key_same_sample_different_key_different_sample():
    sampler = PoissonSampler(1000, 0.5)
    k1, k2 = secure_key(), secure_key()
    a, b = sampler.sample(k1), PoissonSampler(1000, 0.5).sample(k1)  # "another worker"
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sampler.sample(k2))  # equal with probability 2**-1000
    assert a.dtype == np.int64 and np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 1000


def test_sample_is_threshold_of_the_uniform_stream_across_chunks():
    # More units than one SHAKE chunk, so chunk boundaries are exercised.
    n = S._CHUNK + 12345
    sampler = PoissonSampler(n, 0.003)
    key = seeded_key(7, 0, "chunks")
    u = uniform_stream(key, n, PoissonSampler.PURPOSE)
    # u < K / 2**53 (no unit of this key ties the threshold K: probability ~n * 2**-53)
    k_thr = S._tie_rule(0.003)[0]
    assert not np.any(u * 2.0**53 == k_thr)
    expected = np.flatnonzero(u * 2.0**53 < k_thr)
    assert np.array_equal(sampler.sample(key), expected)
    assert len(expected) > 0


def test_inclusion_probability_is_exactly_q():
    for q in (1e-7, 0.01, 1 / 3, 0.999999, 1.0, 0.5, 2.0**-60):
        assert PoissonSampler(10, q).inclusion_probability == q
        # The tie rule splits q exactly: q = (K + r / 2**m) / 2**53.
        k, m, r = S._tie_rule(q)
        assert 0 <= r < 2**m
        assert Fraction(q) == (k + Fraction(r, 2**m)) / 2**53
    assert np.array_equal(PoissonSampler(50, 1.0).sample(secure_key()), np.arange(50))


@pytest.mark.parametrize("q", [1 / 3, 0.01, 0.3, 0.5])
def test_ties_are_resolved_with_the_exact_remainder(monkeypatch, q):
    # Force every unit's 53-bit uniform onto the threshold K (probability 2**-53 each in
    # reality): each is then included with probability exactly frac(q * 2**53) = r / 2**m.
    n = 4000
    k_thr, m, r = S._tie_rule(q)

    def all_tied(key, purpose, count):
        yield 0, np.full(count, k_thr, dtype=np.uint64)

    monkeypatch.setattr(S, "_uint53_chunks", all_tied)
    sampler = PoissonSampler(n, q)
    key = seeded_key(5, 0, "ties")
    got = sampler.sample(key)
    p = r / 2**m if m else 0.0  # dyadic q (0.5): u = K / 2**53 = q is not < q
    if p == 0.0:
        assert len(got) == 0
    else:
        assert abs(len(got) - n * p) < 5 * math.sqrt(n * p * (1 - p)), (len(got), n * p)
    assert np.array_equal(got, sampler.sample(key))  # deterministic given the key
    assert got.dtype == np.int64 and np.all(np.diff(got) > 0)


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
    # Prefix-consistent across lengths and chunk boundaries; purpose separates streams.
    long = uniform_stream(key, S._CHUNK + 10)
    assert np.array_equal(long[:n], u)
    assert not np.array_equal(uniform_stream(key, 100, b"other"), u[:100])


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
    with pytest.raises(ValueError, match="key"):
        PoissonSampler(10, 0.5).sample(b"short")
    with pytest.raises(ValueError, match="seed"):
        seeded_key("42", 0, "x")


def test_sampling_probability_validation():
    with pytest.raises(ValueError, match="sampling_probability"):
        PoissonSampler(10, 0.0)


# ---- truncated Poisson


def test_truncated_sampler_interface_and_validation():
    t = TruncatedPoissonSampler(100, 0.1, 7)
    assert (t.num_units, t.sampling_probability, t.max_batch_size) == (100, 0.1, 7)
    assert t.inclusion_probability == 0.1
    assert PoissonSampler(100, 0.1).max_batch_size is None
    assert isinstance(make_sampler(100, 0.1), PoissonSampler)
    m = make_sampler(100, 0.1, 7)
    assert isinstance(m, TruncatedPoissonSampler) and m.max_batch_size == 7
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
        assert got.dtype == np.int64 and np.all(np.diff(got) > 0)
        assert truncated == (len(drawn) > cap)
        if truncated:
            seen_truncated += 1
            assert len(got) == cap and np.all(np.isin(got, drawn))  # a subset of the draw
            # ... chosen from the key's own subset stream (domain-separated from the coins)
            keep = S._uniform_subset(key, TruncatedPoissonSampler.TRUNCATE_PURPOSE, len(drawn), cap)
            assert np.array_equal(got, drawn[keep])
        else:
            seen_not += 1
            assert np.array_equal(got, drawn)
    assert seen_truncated > 20 and seen_not > 20
    purposes = {PoissonSampler.PURPOSE, PoissonSampler.TIE_PURPOSE, TruncatedPoissonSampler.TRUNCATE_PURPOSE}
    assert len(purposes) == 3


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
    # tail P(Bin >= B_max) = sf(B_max - 1) at the cap.
    pmf = {k: stats.binom.pmf(k, N_T, Q_T) for k in range(CAP_T)}
    pmf[CAP_T] = stats.binom.sf(CAP_T - 1, N_T, Q_T)
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


def test_uniform_subset_rejection_and_edges(monkeypatch):
    assert np.array_equal(S._uniform_subset(seeded_key(1, 1, "e"), b"p", 5, 0), [])
    assert np.array_equal(S._uniform_subset(seeded_key(1, 1, "e"), b"p", 5, 5), np.arange(5))
    # m = 3: 2**64 mod 3 = 1, so the word 0 is rejected (it would favour index 0) and the
    # next word, 7, picks 7 mod 3 = 1.
    monkeypatch.setattr(S, "_uint64_words", lambda key, purpose, n: np.array([0, 7] + [0] * (n - 2), dtype=np.uint64))
    assert np.array_equal(S._uniform_subset(seeded_key(1, 1, "e"), b"p", 3, 1), [1])
