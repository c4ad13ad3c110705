"""`ReferencePoissonSampler`: Poisson sampling the obvious way, one coin per unit (O(N)).

The test reference for `llmdp.privacy.sampling.poisson.PoissonSampler` (the same distribution,
drawn differently: the tests compare the two in distribution); not used in training. It
reads the same keystream words as the samplers (`sampling._words`), from its own streams,
tagged ``refp`` (one word per unit) and ``ties`` (a unit's further bits, one stream per
unit), so that its inclusion probability is exactly q.
"""

from __future__ import annotations

import numpy as np

from llmdp.privacy.rng import _check_sample_key
from llmdp.privacy.sampling.poisson import (
    _CHUNK,
    _TAG_REFERENCE,
    _TAG_TIES,
    _check_num_units,
    _check_q,
    _words,
)

__all__ = ["ReferencePoissonSampler"]


def _tie_rule(q: float) -> tuple[int, int, int]:
    """(K, m, r) with q = (K + r / 2**m) / 2**53 exactly, 0 <= r < 2**m.

    A unit with 53-bit uniform k is in the sample iff u < q, u = (k + v) / 2**53 with v a
    further uniform in [0, 1): iff k < K, or k == K and v < r / 2**m, i.e. the next m
    bits of v, as an integer V, satisfy V < r (exact: r / 2**m is a dyadic rational).
    """
    a, den = q.as_integer_ratio()  # q = a / den exactly, den a power of two (q is a binary float)
    b = den.bit_length() - 1
    if b <= 53:
        return a << (53 - b), 0, 0
    m = b - 53
    return a >> m, m, a & ((1 << m) - 1)


def _reference_uint53(key: bytes, first: int, n: int) -> np.ndarray:
    """Units first … first + n - 1's 53-bit uniforms: the top 53 bits of the words of the
    stream (key, ``refp ‖ 0``)."""
    return _words(key, _TAG_REFERENCE, 0, first, n) >> np.uint64(11)


class ReferencePoissonSampler:
    """Poisson subsampling at rate q with one coin per unit: O(N) per step.

    The test reference for `PoissonSampler` (same distribution, different draws for the
    same key; the tests compare them in distribution). Not for training at scale.

    Unit i's coin is u_i < q with u_i = (k_i + v_i) * 2**-53, k_i the top 53 bits of word
    i of the stream (key, ``refp ‖ 0``) (`uniform_stream(key, N, b"refp")` * 2**53) and
    v_i's bits read, only when k_i == floor(q * 2**53) (probability 2**-53), from the
    unit's own stream (key, ``ties ‖ i``) (see `_tie_rule`), so a unit's decision depends
    on that unit's words only. The inclusion probability is exactly q.
    """

    TAG = _TAG_REFERENCE
    TIE_TAG = _TAG_TIES
    max_batch_size: int | None = None

    def __init__(self, num_units: int, sampling_probability: float):
        self.num_units = _check_num_units(num_units)
        self.sampling_probability = _check_q(sampling_probability)
        self._k, self._tie_bits, self._tie_r = _tie_rule(self.sampling_probability)
        # K <= 2**53, exact in uint64; k < 2**53 so q = 1 (K = 2**53) includes everyone.
        self._threshold = np.uint64(self._k)

    @property
    def inclusion_probability(self) -> float:
        """The exact per-unit inclusion probability: q itself (ties resolved exactly)."""
        return self.sampling_probability

    def sample(self, key: bytes) -> np.ndarray:
        """Sorted int64 indices of the units included in this step's sample."""
        key = _check_sample_key(key)
        parts, ties = [], []
        for offset in range(0, self.num_units, _CHUNK):
            k = _reference_uint53(key, offset, min(_CHUNK, self.num_units - offset))
            parts.append(np.flatnonzero(k < self._threshold) + offset)
            if self._tie_bits:
                ties.append(np.flatnonzero(k == self._threshold) + offset)
        indices = np.concatenate(parts).astype(np.int64, copy=False)
        if ties:
            won = _resolve_ties(key, np.concatenate(ties), self._tie_bits, self._tie_r)
            if len(won):
                indices = np.sort(np.concatenate([indices, won]))
        return indices

    def sample_with_info(self, key: bytes) -> tuple[np.ndarray, bool]:
        """(`sample(key)`, False): the common interface with `TruncatedPoissonSampler`."""
        return self.sample(key), False


def _resolve_ties(key: bytes, tied: np.ndarray, m: int, r: int) -> np.ndarray:
    """The tied units (k_i == K) whose next m uniform bits V_i satisfy V_i < r.

    V_i is the top m bits of the stream (key, ``ties ‖ i``), its words read most
    significant first: one stream per unit, so that the decision of unit i does not
    depend on which other units tied. Exactly uniform on {0, ..., 2**m - 1}.
    """
    n_words = -(-m // 64)
    won = []
    for i in np.asarray(tied, dtype=np.int64).tolist():
        v = 0
        for w in _words(key, _TAG_TIES, i, 0, n_words).tolist():
            v = (v << 64) | w
        if v >> (64 * n_words - m) < r:
            won.append(i)
    return np.asarray(won, dtype=np.int64)
