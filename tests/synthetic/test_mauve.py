"""The MAUVE-style score: ~1 for one distribution, ~0 for disjoint ones, symmetric, and
deterministic under a seed."""

from __future__ import annotations

import numpy as np
import pytest

from llmdp.synthetic.mauve import divergence_frontier, kmeans, mauve


def _blobs(rng, centers, n, spread=0.05):
    c = np.asarray(centers, dtype=np.float64)
    return c[rng.integers(len(c), size=n)] + spread * rng.standard_normal((n, c.shape[1]))


def test_identical_sets_score_one():
    x = _blobs(np.random.default_rng(0), np.eye(8), 200)
    assert mauve(x, x.copy())["mauve"] == pytest.approx(1.0, abs=1e-9)


def test_two_samples_of_one_distribution_score_near_one():
    rng = np.random.default_rng(1)
    centers = np.eye(8) * 3
    assert mauve(_blobs(rng, centers, 400), _blobs(rng, centers, 400))["mauve"] > 0.9


def test_disjoint_clusters_score_near_zero():
    rng = np.random.default_rng(2)
    p = _blobs(rng, np.eye(8)[:4] * 3, 300)
    q = _blobs(rng, np.eye(8)[4:] * 3, 300)
    # no cluster holds both sets: the frontier is ((1-λ)^5, λ^5), whose area is 5 B(6, 5)
    assert mauve(p, q)["mauve"] == pytest.approx(5 * 120 * 24 / 3628800, abs=2e-3)


def test_partial_overlap_lies_in_between_and_falls_as_the_sets_part():
    rng = np.random.default_rng(3)
    e = np.eye(8) * 3
    p = _blobs(rng, e[:4], 400)
    half = mauve(p, _blobs(rng, e[2:6], 400))["mauve"]
    most = mauve(p, _blobs(rng, e[1:5], 400))["mauve"]
    assert 0.05 < half < most < 0.95


def test_symmetric_in_its_two_sets():
    rng = np.random.default_rng(4)
    p = _blobs(rng, np.eye(6)[:4] * 2, 250, spread=0.4)
    q = _blobs(rng, np.eye(6)[2:] * 2, 180, spread=0.4)
    assert mauve(p, q)["mauve"] == pytest.approx(mauve(q, p)["mauve"], abs=1e-12)
    # and in the order of the rows within a set
    assert mauve(p[::-1], q)["mauve"] == pytest.approx(mauve(p, q)["mauve"], abs=1e-12)


def test_deterministic_under_a_seed():
    rng = np.random.default_rng(5)
    p = _blobs(rng, rng.standard_normal((12, 6)), 300, spread=0.5)
    q = _blobs(rng, rng.standard_normal((12, 6)), 300, spread=0.5)
    assert mauve(p, q, seed=7) == mauve(p, q, seed=7)
    labels = kmeans(p, 10, seed=3)
    assert np.array_equal(labels, kmeans(p, 10, seed=3))


def test_the_frontier_runs_from_0_1_to_1_0():
    f = divergence_frontier(np.array([0.5, 0.5]), np.array([0.5, 0.5]))
    assert tuple(f[0]) == (0.0, 1.0) and tuple(f[-1]) == (1.0, 0.0)
    assert np.all(np.diff(f[:, 0]) >= 0)


def test_bad_shapes_are_one_message():
    with pytest.raises(ValueError, match="same d"):
        mauve(np.zeros((3, 2)), np.zeros((3, 4)))
