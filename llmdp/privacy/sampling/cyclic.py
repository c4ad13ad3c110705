"""Cyclic samplers for banded MF / BLT noise: each unit is sampled only every `cycle` steps.

A banded matrix-factorization mechanism (noise correlated across steps by a b-banded
strategy matrix C) is private when every unit's participations are at least b steps
apart. These samplers give that structure:

* `unit_groups` / `store_groups` put every privacy unit in one of `cycle` groups, by a
  keyed hash of the unit's own content (its row lengths, tokens and target flags, exactly
  the bytes of `llmdp.data.units._unit_content`). The key is public and fixed, and the
  hash is domain-separated from the held-out split (`llmdp.data.holdout.split_hash`) and
  from the unit selection (`llmdp.data.units.selection_hash`). A unit's group depends on
  that unit alone: adding or removing a unit never moves another, so add/remove-one
  stays the neighbouring relation (a partition by index or by rank would let one added
  unit move others: replace-one at best). This is JAX Privacy's INDEPENDENT partition,
  with the assignment a public function of the content rather than secret randomness, so
  no amplification is claimed from the assignment itself.
* `CyclicPoissonSampler`: at step t, Poisson sampling (rate q_g) of group t mod cycle
  only, with the exact coins of `llmdp.privacy.sampling.poisson.PoissonSampler`.
* `FixedCycleSampler`: at step t, every unit of group t mod cycle (no randomness).

Group sizes are computed on private data (how many units hash into each group): like the
batch itself, they are never logged; updates are divided by the public constant
`expected_batch_size`, never by a realized size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from llmdp.privacy.rng import _check_sample_key
from llmdp.privacy.sampling.poisson import PoissonSampler, _check_q

__all__ = [
    "DEFAULT_GROUP_KEY",
    "unit_groups",
    "store_groups",
    "group_of",
    "CyclicPoissonSampler",
    "FixedCycleSampler",
]

#: The public key of the group hash (``data.cyclic.group_key`` when configurable).
DEFAULT_GROUP_KEY = "llmdp.cyclic_groups.v1"
# Domain prefix of the hash key: differs from holdout's b"llmdp.eval_split:" and from the
# selection key b"llmdp.unit_fraction.v1" (and blake2b keys of other lengths never collide).
_DOMAIN = b"llmdp.cyclic_groups:"


# --------------------------------------------------------------------------- validation


def _check_cycle(cycle) -> int:
    if isinstance(cycle, bool) or not isinstance(cycle, (int, np.integer)) or cycle < 1:
        raise ValueError(
            f"cycle must be an integer >= 1 (the number of groups, i.e. the minimum number of "
            f"steps between two participations of a unit), got cycle={cycle!r}"
        )
    return int(cycle)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got step={step!r}")
    return int(step)


def _check_groups(groups, cycle: int) -> np.ndarray:
    g = np.asarray(groups)
    if g.ndim != 1 or g.size < 1:
        raise ValueError(
            f"groups must be a 1-D array with one group per unit (at least one unit), "
            f"got shape {g.shape}"
        )
    if g.dtype == bool or not np.issubdtype(g.dtype, np.integer):
        raise ValueError(
            f"groups must be integers in [0, cycle) (e.g. from unit_groups / store_groups), "
            f"got dtype {g.dtype}"
        )
    g = g.astype(np.int64)
    lo, hi = int(g.min()), int(g.max())
    if lo < 0 or hi >= cycle:
        raise ValueError(
            f"groups must lie in [0, cycle={cycle}), got values in [{lo}, {hi}]: "
            f"were they computed with another cycle?"
        )
    return g


def _check_key_name(key) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string (public, fixed), got key={key!r}")
    return key


# --------------------------------------------------------------------------- groups


def _hash_key(key: str) -> bytes:
    return hashlib.sha256(_DOMAIN + _check_key_name(key).encode("utf-8")).digest()


def _group(h, cycle: int) -> int:
    """floor(x * cycle) for x = (64-bit digest of h) / 2**64, exactly (integer arithmetic)."""
    return (int.from_bytes(h.digest(), "big") * cycle) >> 64


def group_of(content: bytes, cycle: int, key: str = DEFAULT_GROUP_KEY) -> int:
    """The group in [0, cycle) of one unit of content `content` (see `unit_groups`)."""
    cycle = _check_cycle(cycle)
    return _group(hashlib.blake2b(content, key=_hash_key(key), digest_size=8), cycle)


def unit_groups(contents: Iterable[bytes], cycle: int,
                key: str = DEFAULT_GROUP_KEY) -> np.ndarray:
    """The group of each unit (int64, in [0, cycle)), from each unit's own content.

    Unit u's group is floor(x_u * cycle), x_u = blake2b-64(content_u; key =
    sha256(``llmdp.cyclic_groups:`` ‖ key)) / 2**64 (computed exactly in integers). With
    the hash modelled as a random function, groups are i.i.d. uniform on [0, cycle)
    (exactly uniform up to 2**-64), independent of the held-out split and the unit
    selection, and each depends on its own unit's content only. `contents`: bytes per
    unit, as `llmdp.data.units._unit_content` gives them.
    """
    cycle = _check_cycle(cycle)
    k = _hash_key(key)
    return np.fromiter((_group(hashlib.blake2b(c, key=k, digest_size=8), cycle) for c in contents),
                       dtype=np.int64)


def store_groups(store, cycle: int, key: str = DEFAULT_GROUP_KEY) -> np.ndarray:
    """`unit_groups` of every unit of a `llmdp.data.store.UnitStore`, read from its
    memory-mapped arrays: the same group as `unit_groups` on `_unit_content` of the
    UnitArrays the store was written from.

    Unit u's content is its rows' lengths (int64), then its tokens (int32), then its
    target flags (uint8), as raw bytes; the hash is fed these pieces in order
    (streaming: the same digest as of their concatenation) straight from the store's
    buffers, with no copy. A unit whose rows span two record batches is fed batch by
    batch. Cost: one pass over the tokens and one keyed hash per unit, O(N + tokens): about
    2.6 µs per 128-token unit (2.6 s per million units, rows files in the page cache; more
    for longer units, about 1 ns per byte hashed), plus reading the rows files once.
    """
    cycle = _check_cycle(cycle)
    k = _hash_key(key)
    n = int(store.num_units)
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    bstart = np.asarray(store._batch_start, dtype=np.int64)  # global first row of each batch
    batches = []  # per batch: (row lengths int64, tokens, targets) as byte memoryviews, offsets
    for cols in store._batches:
        offs = np.asarray(cols["input_ids"][0], dtype=np.int64)
        lens = np.diff(offs).astype(np.int64)
        batches.append((memoryview(lens).cast("B"),
                        memoryview(np.ascontiguousarray(cols["input_ids"][1], np.int32)).cast("B"),
                        memoryview(np.ascontiguousarray(cols["target"][1], np.uint8)).cast("B"),
                        offs))
    r0 = np.asarray(store.unit_row_start, dtype=np.int64)
    r1 = r0 + np.asarray(store.unit_row_count, dtype=np.int64)
    b0 = np.searchsorted(bstart, r0, side="right") - 1  # the batch of each unit's first row
    nb = bstart.size - 1
    single = (b0 < nb) & (r1 <= bstart[np.minimum(b0 + 1, nb)])  # rows within one batch
    blake2b, group = hashlib.blake2b, _group
    ones = np.flatnonzero(single)
    ones = ones[np.argsort(b0[ones], kind="stable")]  # by batch (one pass, not one per batch)
    cuts = np.flatnonzero(np.diff(b0[ones])) + 1
    for us in np.split(ones, cuts) if ones.size else ():
        b = int(b0[us[0]])
        lv, tv, gv, offs = batches[b]
        l0, l1 = r0[us] - bstart[b], r1[us] - bstart[b]
        a, e = offs[l0], offs[l1]
        for u, x0, x1, y0, y1 in zip(us.tolist(), (8 * l0).tolist(), (8 * l1).tolist(),
                                     a.tolist(), e.tolist()):
            h = blake2b(lv[x0:x1], key=k, digest_size=8)
            h.update(tv[4 * y0:4 * y1])
            h.update(gv[y0:y1])
            out[u] = group(h, cycle)
    for u in np.flatnonzero(~single).tolist():  # rows across record batches (rare)
        pieces, r, end_u = [], int(r0[u]), int(r1[u])
        while r < end_u:
            b = int(np.searchsorted(bstart, r, side="right") - 1)
            end = min(end_u, int(bstart[b + 1]))
            offs = batches[b][3]
            l0, l1 = r - int(bstart[b]), end - int(bstart[b])
            pieces.append((batches[b], l0, l1, int(offs[l0]), int(offs[l1])))
            r = end
        h = blake2b(key=k, digest_size=8)
        for (lv, _, _, _), l0, l1, _, _ in pieces:  # all row lengths, then tokens, then flags
            h.update(lv[8 * l0:8 * l1])
        for (_, tv, _, _), _, _, y0, y1 in pieces:
            h.update(tv[4 * y0:4 * y1])
        for (_, _, gv, _), _, _, y0, y1 in pieces:
            h.update(gv[y0:y1])
        out[u] = group(h, cycle)
    return out


# --------------------------------------------------------------------------- samplers


class _GroupedSampler:
    """Common part: the units of each group, in increasing order."""

    def __init__(self, groups, cycle):
        self.cycle = _check_cycle(cycle)
        self.groups = _check_groups(groups, self.cycle)
        self.num_units = int(self.groups.size)
        order = np.argsort(self.groups, kind="stable")  # within a group: increasing index
        bounds = np.searchsorted(self.groups[order], np.arange(self.cycle + 1))
        self._members = [order[bounds[g]:bounds[g + 1]] for g in range(self.cycle)]

    def group_at(self, step: int) -> int:
        """The group whose units may be sampled at `step`: step mod cycle."""
        return _check_step(step) % self.cycle

    def members(self, group: int) -> np.ndarray:
        """The sorted int64 indices of the units of `group` (private: never log them)."""
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) \
                or not 0 <= group < self.cycle:
            raise ValueError(f"group must be an integer in [0, cycle={self.cycle}), got {group!r}")
        return self._members[int(group)]


class CyclicPoissonSampler(_GroupedSampler):
    """Cyclic Poisson sampling: at step t, Poisson sampling at rate q_g of group t mod cycle.

    Formal guarantee: every unit is in exactly one group g, fixed by its own content
    (`unit_groups`; adding or removing a unit never changes another's group). For a key
    drawn by `secure_key()` (and ChaCha20 modelled as an ideal random stream),
    `sample(key, t)` includes each unit of group g = t mod cycle independently with
    probability exactly q_g = `group_probability` (the exact coins of `PoissonSampler`
    on the group's member list), and no unit of any other group. Fresh keys give
    independent draws across steps. So a unit participates only at steps t ≡ g (mod
    cycle), at most k = ceil(T / cycle) times in T steps, pairwise at least `cycle` steps
    apart, each time Poisson-subsampled with probability q_g: the setting of the amplified
    banded-MF analysis (Choquette-Choo et al. 2023, "Amplified banded matrix
    factorization: a unified approach to private training", cyclic Poisson sampling;
    JAX Privacy's `CyclicPoissonSampling` with an independent partition and its
    amplified BandMF event). With a b-banded strategy C, b <= cycle, the mechanism's
    privacy is that of the composition of ceil(T / cycle) Poisson-subsampled Gaussian
    mechanisms with probability q_g and noise multiplier sigma / (max column norm of C),
    under add/remove-one. With cycle = 1 this is `PoissonSampler(num_units, q_g)`: the
    same key gives the same sample.

    The batch size is Binomial(|group|, q_g), unbounded (no truncation). The update is
    divided by `expected_batch_size` = q_g N / cycle, a constant of the plan; the group
    sizes, the sample and the key are private (DESIGN, invariant `secrets-stay-secret`): never log them.
    """

    def __init__(self, groups: np.ndarray, cycle: int, group_probability: float):
        super().__init__(groups, cycle)
        self.group_probability = _check_q(group_probability)
        self._samplers: dict[int, PoissonSampler] = {}  # built on first use, per group

    @property
    def inclusion_probability(self) -> float:
        """q_g: the exact probability that a unit is included at a step of its group."""
        return self.group_probability

    @property
    def expected_batch_size(self) -> float:
        """q_g N / cycle: the constant the noisy sum is divided by (not the realized size)."""
        return self.group_probability * self.num_units / self.cycle

    def _sampler(self, g: int) -> PoissonSampler | None:
        if g not in self._samplers:
            m = self._members[g].size
            self._samplers[g] = PoissonSampler(m, self.group_probability) if m else None
        return self._samplers[g]

    def sample(self, key: bytes, step: int) -> np.ndarray:
        """Sorted int64 indices of the units included at `step` (all of group step mod cycle)."""
        key = _check_sample_key(key)
        g = self.group_at(step)
        sampler = self._sampler(g)
        if sampler is None:  # an empty group: nobody to sample
            return np.empty(0, dtype=np.int64)
        return self._members[g][sampler.sample(key)]  # members increasing: stays sorted

    def sample_with_info(self, key: bytes, step: int) -> tuple[np.ndarray, bool]:
        """(`sample(key, step)`, False): never truncated."""
        return self.sample(key, step), False


class FixedCycleSampler(_GroupedSampler):
    """Fixed cyclic participation: at step t, every unit of group t mod cycle.

    Formal guarantee: every unit is in exactly one group g, fixed by its own content
    (`unit_groups`; adding or removing a unit never changes another's group), and
    `sample(key, t)` is exactly the units of group t mod cycle, whatever the key. So a
    unit participates exactly at the steps t ≡ g (mod cycle): at most k = ceil(T / cycle)
    participations in T steps, pairwise at least `cycle` apart. This is the
    fixed-participation (min-separation) setting of DP matrix factorization (Choquette-Choo
    et al. 2023, multi-epoch MF): accounted without amplification, as one Gaussian
    mechanism with noise multiplier sigma / sens(C), sens(C) the sensitivity of C over
    all participation patterns with at most k participations at least `cycle` apart.
    The group is a public function of the content, so there is no balls-in-bins
    amplification either. `expected_batch_size` = N / cycle, the constant the update is
    divided by; a group's realized size is private.
    """

    @property
    def inclusion_probability(self) -> float:
        """1: a unit is included at every step of its group."""
        return 1.0

    @property
    def expected_batch_size(self) -> float:
        """N / cycle: the constant the noisy sum is divided by (not the realized size)."""
        return self.num_units / self.cycle

    def sample(self, key, step: int) -> np.ndarray:
        """Sorted int64 indices of the units of group step mod cycle (a copy); `key` is
        accepted for the common interface and ignored."""
        return self._members[self.group_at(step)].copy()

    def sample_with_info(self, key, step: int) -> tuple[np.ndarray, bool]:
        """(`sample(key, step)`, False)."""
        return self.sample(key, step), False
