"""Statistical tests state their tolerance in standard deviations (sd) of the statistic.

Keys come from `seeded_key`, so every test is deterministic (not flaky), while the
tolerances are what a correct sampler passes with overwhelming probability.
"""

import math

import numpy as np
import pytest

from llmdp.privacy import sampling as S
from llmdp.privacy.sampling import (
    PoissonSampler,
    num_micro_batches,
    secure_key,
    seeded_key,
    split_for_workers,
    uniform_stream,
)

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
    expected = np.flatnonzero(u < sampler.inclusion_probability)
    assert np.array_equal(sampler.sample(key), expected)
    assert len(expected) > 0


def test_inclusion_probability_never_exceeds_q():
    for q in (1e-7, 0.01, 1 / 3, 0.999999, 1.0):
        p = PoissonSampler(10, q).inclusion_probability
        assert q - 2**-53 < p <= q
    assert np.array_equal(PoissonSampler(50, 1.0).sample(secure_key()), np.arange(50))


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


@pytest.mark.parametrize("n, world", [(0, 3), (1, 4), (10, 3), (17, 8), (1000, 7), (5, 5)])
def test_split_for_workers_balanced(n, world):
    idx = np.sort(np.random.default_rng(0).choice(10_000, size=n, replace=False))
    parts = split_for_workers(idx, world)
    assert len(parts) == world
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    assert np.array_equal(np.concatenate(parts), idx)
    again = split_for_workers(idx, world)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@pytest.mark.parametrize(
    "n, world, pbs", [(0, 4, 8), (1, 4, 8), (32, 4, 8), (33, 4, 8), (100, 3, 7), (5, 8, 2)]
)
def test_num_micro_batches_covers_every_worker(n, world, pbs):
    m = num_micro_batches(n, world, pbs)
    shares = [len(p) for p in split_for_workers(np.arange(n), world)]
    if n == 0:
        assert m == 0
    else:
        # Enough micro-batches for the largest share, and no more than needed.
        assert m * pbs >= max(shares) > (m - 1) * pbs


def test_num_micro_batches_validation():
    with pytest.raises(ValueError, match="physical_batch_size"):
        num_micro_batches(10, 2, 0)
    with pytest.raises(ValueError, match="world_size"):
        split_for_workers(np.arange(3), 0)
    with pytest.raises(ValueError, match="sampling_probability"):
        PoissonSampler(10, 0.0)
