"""Cyclic samplers (`llmdp.privacy.sampling.cyclic`): content-hash groups, cyclic Poisson, fixed cycle.

Statistical tests state their tolerance in standard deviations (sd) of the statistic;
keys come from `seeded_key` and contents from seeded generators, so every test is
deterministic, and the tolerances are what a correct implementation passes with
overwhelming probability.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

import llmdp.data.store as store_mod
from llmdp.data.holdout import split_hash
from llmdp.data.store import open_store, write_store, write_unit_files
from llmdp.data.units import EncodedCorpus, UnitSpec, _unit_content, build_units, selection_hash
from llmdp.privacy.rng.keys import seeded_key
from llmdp.privacy.sampling.cyclic import (
    DEFAULT_GROUP_KEY,
    CyclicPoissonSampler,
    FixedCycleSampler,
    group_of,
    store_groups,
    unit_groups,
)
from llmdp.privacy.sampling.poisson import PoissonSampler

EOS = 1


def _contents(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8).tobytes() + b"%d" % i
            for i in range(n)]


def _random_groups(n, cycle, seed=0):
    return np.random.default_rng(seed).integers(0, cycle, n)


# ----------------------------------------------------------------------------- groups


def test_group_is_floor_of_keyed_hash_times_cycle():
    """The exact definition, recomputed independently (Fraction-free integer floor)."""
    k = hashlib.sha256(b"llmdp.cyclic_groups:" + DEFAULT_GROUP_KEY.encode()).digest()
    contents = _contents(300, seed=1)
    for cycle in (1, 2, 3, 7, 1000, 2**62):
        x = [int.from_bytes(hashlib.blake2b(c, key=k, digest_size=8).digest(), "big")
             for c in contents]
        want = [v * cycle // 2**64 for v in x]
        got = unit_groups(contents, cycle)
        assert got.dtype == np.int64 and got.tolist() == want
        assert got.min() >= 0 and got.max() < cycle
        assert [group_of(c, cycle) for c in contents[:20]] == want[:20]
    assert unit_groups(contents, 1).tolist() == [0] * len(contents)
    assert unit_groups([], 4).shape == (0,)


def test_groups_depend_on_each_units_own_content_only():
    contents = _contents(500, seed=2)
    cycle = 6
    full = unit_groups(contents, cycle)
    rng = np.random.default_rng(3)
    keep = np.sort(rng.choice(len(contents), 300, replace=False))  # remove 200 units
    assert unit_groups([contents[i] for i in keep], cycle).tolist() == full[keep].tolist()
    added = _contents(50, seed=99)  # add 50 units, in the middle
    mixed = contents[:250] + added + contents[250:]
    g = unit_groups(mixed, cycle)
    assert g[:250].tolist() == full[:250].tolist() and g[300:].tolist() == full[250:].tolist()
    perm = rng.permutation(len(contents))  # reordering moves nobody
    assert unit_groups([contents[i] for i in perm], cycle).tolist() == full[perm].tolist()
    # The key changes the assignment: agreement ~ 1/cycle (Binomial(500, 1/6): mean 83,
    # sd 8.3; asserted < 83 + 5 sd), not all 500.
    other = unit_groups(contents, cycle, key="another.key")
    assert (other == full).sum() < 500 / cycle + 5 * math.sqrt(500 * (1 / cycle) * (1 - 1 / cycle))


def test_groups_are_domain_separated_from_split_and_selection_hashes():
    """Same key string as the held-out split, and the selection hash: the group agrees
    with floor(hash * cycle) of those only by chance (~1/cycle), within 5 sd."""
    contents = _contents(2000, seed=4)
    cycle = 4
    g = unit_groups(contents, cycle, key="llmdp.eval_split.v1")
    split = np.array([int(split_hash(c, "llmdp.eval_split.v1") * cycle) for c in contents])
    sel = np.array([int(selection_hash(c) * cycle) for c in contents])
    p, n = 1 / cycle, len(contents)
    for other in (split, sel):
        assert abs((g == other).sum() - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_group_distribution_is_uniform():
    n, cycle = 20_000, 10
    counts = np.bincount(unit_groups(_contents(n, seed=5), cycle), minlength=cycle)
    p = 1 / cycle
    # Each count ~ Binomial(n, 1/cycle): within 5 sd each ...
    assert np.all(np.abs(counts - n * p) < 5 * math.sqrt(n * p * (1 - p))), counts
    # ... and jointly: Pearson chi-square (df = cycle - 1) within 5 sd sqrt(2 df) of df.
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert abs(chi2 - (cycle - 1)) < 5 * math.sqrt(2 * (cycle - 1)), chi2


# ----------------------------------------------------------------------------- store groups


def _corpus(num_records=90, num_users=11, max_len=50, seed=0):
    rng = np.random.default_rng(seed)
    recs, users = [], []
    for _ in range(num_records):
        k = int(rng.integers(0, max_len))
        recs.append((np.append(rng.integers(2, 60, k), EOS).astype(np.int32), rng.random(k + 1) < 0.8))
        users.append(f"user-{int(rng.integers(num_users))}")
    return EncodedCorpus.from_records(recs, users)


def _meta(name, spec):
    return {"fingerprint": name, "sequence_length": spec.sequence_length, "pad_id": 0,
            "eos_id": EOS, "spec": spec.to_dict()}


def _spans_batches(store):
    r0 = store.unit_row_start
    r1 = r0 + store.unit_row_count - 1
    b = store._batch_start
    return (np.searchsorted(b, r0, side="right") != np.searchsorted(b, r1, side="right")).any()


def _contents_via_rows(store):
    """Each unit's content rebuilt through the public `rows()` API: row lengths (int64),
    tokens (int32), target flags (uint8) — an independent path from `store_groups`."""
    out = []
    for u in range(store.num_units):
        b = store.rows([u])
        lens = b["attention_mask"].sum(1).numpy().astype(np.int64)
        ids = np.concatenate([b["input_ids"][r, :n].numpy() for r, n in enumerate(lens)])
        tgt = np.concatenate([(b["labels"][r, :n] != -100).numpy() for r, n in enumerate(lens)])
        out.append(lens.tobytes() + ids.astype(np.int32).tobytes() + tgt.astype(np.uint8).tobytes())
    return out


@pytest.mark.parametrize("kind", ["sequence", "document", "user"])
def test_store_groups_equal_unit_groups_of_unit_content(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(store_mod, "_BATCH_TOKENS", 64)  # 4 rows per batch: units span batches
    spec = UnitSpec(kind, 16, max_rows_per_unit=1 if kind == "sequence" else 3,
                    user_field="u" if kind == "user" else None, document_masking=kind == "user")
    units = build_units(_corpus(), spec)
    write_store(tmp_path / kind, units, _meta(kind, spec))
    store = open_store(tmp_path / kind)
    assert len(store._batches) > 3 and (kind == "sequence" or _spans_batches(store))
    contents = [_unit_content(units, u) for u in range(units.num_units)]
    assert contents == _contents_via_rows(store)  # the store holds the same content
    for cycle in (1, 3, 8, 2**62):  # 2**62 compares 62 bits of each unit's hash
        assert store_groups(store, cycle).tolist() == unit_groups(contents, cycle).tolist()
    assert store_groups(store, 5, key="k2").tolist() == unit_groups(contents, 5, key="k2").tolist()


def test_store_groups_on_a_sharded_store(tmp_path, monkeypatch):
    """Two shards (rows numbered across them), the second using only part of its units."""
    monkeypatch.setattr(store_mod, "_BATCH_TOKENS", 48)
    spec = UnitSpec("document", 16, max_rows_per_unit=3)
    a = build_units(_corpus(seed=1), spec)
    b = build_units(_corpus(seed=2), spec)
    used_b = b.num_units - 5
    d = tmp_path / "sharded"
    d.mkdir()
    write_unit_files(str(d), a, 16, rows="rows-0.arrow", units_file="units-0.arrow")
    write_unit_files(str(d), b, 16, rows="rows-1.arrow", units_file="units-1.arrow")
    meta = {**_meta("sharded", spec), "format_version": store_mod.FORMAT_VERSION,
            "num_units": a.num_units + used_b, "num_rows": a.num_rows + b.num_rows,
            "shards": [{"rows": "rows-0.arrow", "units": "units-0.arrow", "num_units": a.num_units},
                       {"rows": "rows-1.arrow", "units": "units-1.arrow", "num_units": used_b}]}
    (d / "meta.json").write_text(json.dumps(meta))
    store = open_store(d)
    contents = [_unit_content(a, u) for u in range(a.num_units)] + \
        [_unit_content(b, u) for u in range(used_b)]
    assert _spans_batches(store)
    assert store_groups(store, 2**62).tolist() == unit_groups(contents, 2**62).tolist()


def test_store_groups_on_a_built_store(tmp_path):
    """A store built from text by the tokenizer (`tests.helpers.tiny_store`), content
    read back through `rows()`."""
    from tests.helpers import tiny_store

    store = tiny_store(tmp_path, num_documents=30, sequence_length=24)
    contents = _contents_via_rows(store)
    assert store_groups(store, 2**62).tolist() == unit_groups(contents, 2**62).tolist()


# ----------------------------------------------------------------------------- cyclic Poisson


def test_cyclic_poisson_samples_only_the_group_of_the_step():
    n, cycle, q = 300, 5, 0.4
    groups = _random_groups(n, cycle, seed=6)
    s = CyclicPoissonSampler(groups, cycle, q)
    assert (s.num_units, s.cycle, s.inclusion_probability) == (n, cycle, q)
    assert s.expected_batch_size == pytest.approx(q * n / cycle)
    for t in range(40):
        idx, truncated = s.sample_with_info(seeded_key(7, t, "sample"), t)
        assert truncated is False and idx.dtype == np.int64
        assert np.all(np.diff(idx) > 0)
        assert idx.size > 0 and np.all(groups[idx] == t % cycle)
        assert s.members(t % cycle).tolist() == np.flatnonzero(groups == t % cycle).tolist()


def test_cyclic_poisson_reuses_poisson_coins_on_the_members():
    groups = _random_groups(400, 3, seed=8)
    s = CyclicPoissonSampler(groups, 3, 0.2)
    for t in range(12):
        key = seeded_key(9, t, "sample")
        members = np.flatnonzero(groups == t % 3)
        assert s.sample(key, t).tolist() == members[PoissonSampler(members.size, 0.2).sample(key)].tolist()


@pytest.mark.parametrize("q", [0.05, 0.3, 1.0])
def test_cycle_one_is_poisson_sampling(q):
    n = 257
    s, p = CyclicPoissonSampler(np.zeros(n, dtype=np.int32), 1, q), PoissonSampler(n, q)
    assert s.expected_batch_size == pytest.approx(q * n)
    for t in range(30):
        key = seeded_key(10, t, "sample")
        assert s.sample(key, t).tolist() == p.sample(key).tolist()


def test_cyclic_poisson_inclusion_frequency():
    """Each unit's count over D steps of its group ~ Binomial(D, q): within 5 sd for
    every unit, and jointly (sum of z^2 ~ chi-square(N)) within 5 sd sqrt(2N) of N."""
    n, cycle, q, draws = 120, 4, 0.3, 1500
    groups = _random_groups(n, cycle, seed=11)
    s = CyclicPoissonSampler(groups, cycle, q)
    counts = np.zeros(n)
    for t in range(cycle * draws):
        idx = s.sample(seeded_key(12, t, "sample"), t)
        assert np.all(groups[idx] == t % cycle)
        counts[idx] += 1
    mean, sd = draws * q, math.sqrt(draws * q * (1 - q))
    assert np.all(np.abs(counts - mean) < 5 * sd), (counts.min(), counts.max())
    z2 = float((((counts - mean) / sd) ** 2).sum())
    assert abs(z2 - n) < 5 * math.sqrt(2 * n), z2


def test_cyclic_poisson_is_deterministic_per_key_and_step():
    groups = _random_groups(500, 4, seed=13)
    s = CyclicPoissonSampler(groups, 4, 0.5)
    k1, k2 = seeded_key(14, 0, "sample"), seeded_key(14, 1, "sample")
    a = s.sample(k1, 2)
    assert a.tolist() == s.sample(k1, 2).tolist()
    assert a.tolist() == CyclicPoissonSampler(groups, 4, 0.5).sample(k1, 2).tolist()
    assert a.tolist() == s.sample(k1, 6).tolist()  # same group, same key: fresh keys per step!
    assert a.tolist() != s.sample(k2, 2).tolist()  # P(equal) = tiny (~ 2**-125 groups of 125)
    assert a.tolist() != s.sample(k1, 3).tolist()  # another group


def test_empty_group_and_full_probability():
    groups = np.array([0, 0, 2, 2, 2])  # group 1 is empty
    s = CyclicPoissonSampler(groups, 3, 1.0)
    key = seeded_key(15, 0, "sample")
    assert s.sample(key, 0).tolist() == [0, 1]
    assert s.sample(key, 1).tolist() == []
    assert s.sample(key, 5).tolist() == [2, 3, 4]


# ----------------------------------------------------------------------------- fixed cycle


def test_fixed_cycle_takes_each_group_in_turn():
    n, cycle = 200, 7
    groups = _random_groups(n, cycle, seed=16)
    s = FixedCycleSampler(groups, cycle)
    assert (s.num_units, s.cycle, s.inclusion_probability) == (n, cycle, 1.0)
    assert s.expected_batch_size == pytest.approx(n / cycle)
    for start in (0, 3, 50):
        seen = np.zeros(n, dtype=np.int64)
        for t in range(start, start + cycle):
            idx, truncated = s.sample_with_info(seeded_key(17, t, "sample"), t)
            assert truncated is False
            assert idx.tolist() == np.flatnonzero(groups == t % cycle).tolist()
            seen[idx] += 1
        assert np.all(seen == 1)  # every unit exactly once per cycle
    assert s.sample(None, 9).tolist() == s.sample(b"ignored", 9).tolist()
    s.sample(None, 2)[:] = -1  # a copy: the sampler's members are untouched
    assert s.sample(None, 2).tolist() == np.flatnonzero(groups == 2).tolist()


# ----------------------------------------------------------------------------- checks


@pytest.mark.parametrize("cls", [CyclicPoissonSampler, FixedCycleSampler])
def test_input_checks(cls):
    extra = (0.5,) if cls is CyclicPoissonSampler else ()
    good = np.array([0, 1, 2, 1])
    for bad_cycle in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="cycle must be an integer >= 1"):
            cls(good, bad_cycle, *extra)
    with pytest.raises(ValueError, match=r"groups must lie in \[0, cycle=2\)"):
        cls(good, 2, *extra)
    with pytest.raises(ValueError, match="groups must lie"):
        cls(np.array([0, -1]), 2, *extra)
    with pytest.raises(ValueError, match="groups must be integers"):
        cls(np.array([0.0, 1.0]), 2, *extra)
    with pytest.raises(ValueError, match="1-D array"):
        cls(np.zeros((2, 2), dtype=int), 2, *extra)
    with pytest.raises(ValueError, match="1-D array"):
        cls(np.array([], dtype=int), 2, *extra)
    s = cls(good, 3, *extra)
    for bad_step in (-1, 1.0, True):
        with pytest.raises(ValueError, match="step must be an integer >= 0"):
            s.sample(seeded_key(0, 0, "sample"), bad_step)
    with pytest.raises(ValueError, match="group must be"):
        s.members(3)


def test_probability_and_key_checks():
    for q in (0, 1.5, -0.1, float("nan"), None):
        with pytest.raises(ValueError, match="sampling_probability must be in"):
            CyclicPoissonSampler(np.array([0, 1]), 2, q)
    s = CyclicPoissonSampler(np.array([0, 1]), 2, 0.5)
    with pytest.raises(ValueError, match="a sampling key is 32 bytes"):
        s.sample(b"short", 0)
    with pytest.raises(ValueError, match="cycle must be"):
        unit_groups([b"x"], 0)
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        unit_groups([b"x"], 2, key=b"bytes")
