"""Batch assembly: micro-batches per worker, equal micro-step counts, bucketing."""

from __future__ import annotations

import numpy as np
import pytest

from llmdp.data.batching import assign_micro_batches, pack_units


def units(n=500, max_rows=4, L=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, max_rows + 1, n), rng.integers(2, L + 1, n)


def check(out, sample, rows, P, W):
    assert len(out) == W
    steps = {len(w) for w in out}
    assert len(steps) == 1, "every worker runs the same number of micro-steps"
    got = np.concatenate([mb for w in out for mb in w]) if sample.size else np.empty(0)
    assert sorted(got.tolist()) == sorted(sample.tolist()), "each sampled unit exactly once"
    for w in out:
        for mb in w:
            assert rows[mb].sum() <= P
    return steps.pop()


@pytest.mark.parametrize("W,P", [(1, 8), (2, 8), (3, 5), (4, 4), (7, 16)])
@pytest.mark.parametrize("bucket", [False, True])
def test_every_worker_gets_the_same_micro_step_count(W, P, bucket):
    rows, lens = units()
    rng = np.random.default_rng(W * 100 + P)
    for size in (0, 1, 2, W - 1, W + 1, 37, 200):
        sample = np.sort(rng.choice(rows.size, size=min(size, rows.size), replace=False))
        out = assign_micro_batches(sample, rows, lens, world_size=W, physical_batch_size=P,
                                   bucket=bucket)
        m = check(out, sample, rows, P, W)
        if size == 0:
            assert m == 0
        # next-fit wastes less than half of each bin: at most 2*ceil(rows/P) bins
        total_rows = int(rows[sample].sum())
        assert m <= -(-2 * -(-total_rows // P) // W) + 1


def test_empty_sample_and_min_micro_steps():
    rows, lens = units()
    out = assign_micro_batches([], rows, lens, world_size=3, physical_batch_size=4, min_micro_steps=5)
    assert [len(w) for w in out] == [5, 5, 5] and all(mb.size == 0 for w in out for mb in w)
    out = assign_micro_batches([1, 2], rows, lens, world_size=2, physical_batch_size=64, min_micro_steps=3)
    assert [len(w) for w in out] == [3, 3]


def test_single_row_units_fill_micro_batches_exactly():
    n = 103
    rows = np.ones(n, dtype=np.int64)
    out = assign_micro_batches(np.arange(n), rows, None, world_size=4, physical_batch_size=8,
                               bucket=False)
    sizes = [mb.size for w in out for mb in w]
    assert sorted(sizes, reverse=True)[:12] == [8] * 12 and sum(sizes) == n
    bins = -(-n // 8)
    assert len(out[0]) == -(-bins // 4)


def test_bucketing_cuts_padding():
    rows = np.ones(4000, dtype=np.int64)
    lens = np.random.default_rng(1).integers(8, 513, rows.size)
    sample = np.arange(0, rows.size, 3)

    def padded_tokens(out):
        return sum(mb.size * int(-(-lens[mb].max() // 8) * 8) for w in out for mb in w if mb.size)

    flat = assign_micro_batches(sample, rows, lens, world_size=2, physical_batch_size=16, bucket=False)
    buck = assign_micro_batches(sample, rows, lens, world_size=2, physical_batch_size=16, bucket=True)
    real = int(lens[sample].sum())
    assert padded_tokens(buck) < 1.1 * real < padded_tokens(flat)


def test_assignment_is_deterministic_and_unit_rows_fit():
    rows, lens = units(seed=4)
    sample = np.arange(0, 500, 2)
    a = assign_micro_batches(sample, rows, lens, world_size=3, physical_batch_size=6)
    b = assign_micro_batches(sample.copy(), rows.copy(), lens.copy(), world_size=3, physical_batch_size=6)
    assert all(np.array_equal(x, y) for wa, wb in zip(a, b) for x, y in zip(wa, wb))
    with pytest.raises(ValueError, match="more than train.physical_batch_size=3"):
        assign_micro_batches(sample, rows, lens, world_size=3, physical_batch_size=3)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        assign_micro_batches(sample, rows, lens, world_size=0, physical_batch_size=6)


def test_pack_units_next_fit():
    assert pack_units(np.array([2, 2, 3, 1, 4, 1]), 4).tolist() == [0, 0, 1, 1, 2, 3]
    assert pack_units(np.array([1] * 5), 2).tolist() == [0, 0, 1, 1, 2]
    assert pack_units(np.array([3] * 5), 7).tolist() == [0, 0, 1, 1, 2]
