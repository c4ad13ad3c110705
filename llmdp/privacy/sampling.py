"""Poisson and truncated Poisson sampling of privacy units from a cryptographically
secure stream.

DESIGN §3.3: the sampler must be exactly what the accountant assumes.

* `PoissonSampler` is the sampling of `PoissonSampledDpEvent(q, ...)`: at every step,
  every privacy unit is included independently with probability q.
* `TruncatedPoissonSampler` is the sampling of
  `TruncatedSubsampledGaussianDpEvent(N + 1, q, B_max, ...)` for a sampler over N units
  (dp-accounting's size is that of the dataset holding the added unit): the same Poisson
  draw, and when it holds more than B_max units, a uniformly random subset of exactly
  B_max of them.

Both draws are unpredictable to an adversary and exact:

* randomness comes from SHAKE-256 (an extendable-output function, FIPS 202) keyed by a
  32-byte key; with a key from `secure_key()` (OS entropy) the stream is
  computationally indistinguishable from uniform for anyone who does not know the key.
  The guarantees below are stated for an ideal uniform stream.
* coins are exact, not rounded to a 2**-53 grid: a unit whose 53-bit uniform ties the
  threshold floor(q * 2**53) is decided with further bits (`_resolve_ties`), so the
  inclusion probability is q itself, which the truncated event needs (its bound is not
  known to be monotone in q). Subsets are drawn by Fisher-Yates with rejection-sampled
  integers, so they are exactly uniform.
* workers agree on a draw without communicating indices: rank 0 draws a fresh key per
  step and broadcasts it; every worker expands the same key to the same sample.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator

import numpy as np

__all__ = [
    "KEY_BYTES",
    "secure_key",
    "seeded_key",
    "uniform_stream",
    "PoissonSampler",
    "TruncatedPoissonSampler",
    "make_sampler",
]

KEY_BYTES = 32
_MIN_KEY_BYTES = 16  # 128 bits: shorter keys are guessable, which would void the guarantee
_CHUNK = 1 << 20  # uniforms per SHAKE call: bounds memory at 8 MiB per chunk for huge N
_STREAM_DOMAIN = b"llmdp.uniform_stream.v1"
_TWO_53 = float(2**53)


def secure_key() -> bytes:
    """32 bytes of fresh OS entropy (`os.urandom`): the key of one step's randomness."""
    return os.urandom(KEY_BYTES)


def seeded_key(seed: int, step: int, purpose: str) -> bytes:
    """SHA-256 of the canonical encoding of (seed, step, purpose).

    For tests and reproducible runs ONLY: anyone who knows `seed` can recompute every
    sample and every noise vector, so such a run carries no DP guarantee against
    anyone who knows the seed (DESIGN §3.7); its report must say so.
    """
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {name}={value!r}")
    if not isinstance(purpose, str):
        raise ValueError(f"purpose must be a string, got purpose={purpose!r}")
    # JSON of a list of (int, int, str) is an unambiguous, injective encoding.
    blob = json.dumps(["llmdp.seeded_key.v1", int(seed), int(step), purpose], separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).digest()


def _check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise ValueError(f"key must be bytes (e.g. secure_key()), got {type(key).__name__}")
    if len(key) < _MIN_KEY_BYTES:
        raise ValueError(f"key must have at least {_MIN_KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def _stream_prefix(key: bytes, purpose: bytes) -> bytes:
    """The SHAKE-256 input prefix of the stream (key, purpose): lengths are prefixed so
    that no two (key, purpose) pairs share an input."""
    key = _check_key(key)
    purpose = bytes(purpose)
    return (
        _STREAM_DOMAIN
        + len(key).to_bytes(4, "big")
        + key
        + len(purpose).to_bytes(4, "big")
        + purpose
    )


def _raw_chunks(key: bytes, purpose: bytes, n: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (offset, w) with w[i] uniform 64-bit words (uint64), n in total.

    Chunk j is the SHAKE-256 output for (domain, key, purpose, j). SHAKE output is
    prefix-consistent, so the first m values do not depend on n >= m.
    """
    prefix = _stream_prefix(key, purpose)
    for j, offset in enumerate(range(0, n, _CHUNK)):
        m = min(_CHUNK, n - offset)
        h = hashlib.shake_256(prefix + j.to_bytes(8, "big"))
        yield offset, np.frombuffer(h.digest(8 * m), dtype="<u8").astype(np.uint64, copy=False)


def _uint53_chunks(key: bytes, purpose: bytes, n: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (offset, k) with k[i] uniform integers in [0, 2**53), n in total: the top
    53 bits of the words of `_raw_chunks`."""
    for offset, words in _raw_chunks(key, purpose, n):
        yield offset, words >> np.uint64(11)  # keep the top 53 of 64 random bits


def uniform_stream(key: bytes, n: int, purpose: bytes = b"") -> np.ndarray:
    """`n` float64 uniforms in [0, 1) from SHAKE-256 keyed by (key, purpose).

    Each value is k * 2**-53 with k uniform on {0, ..., 2**53 - 1}: the grid of
    doubles with 53 random bits, so the granularity is 2**-53 (every event
    {u < t} has probability within 2**-53 of t). Deterministic given (key, purpose).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got n={n!r}")
    out = np.empty(int(n), dtype=np.float64)
    for offset, k in _uint53_chunks(key, purpose, int(n)):
        out[offset : offset + len(k)] = k * (1.0 / _TWO_53)  # exact: k < 2**53
    return out


def _uint64_words(key: bytes, purpose: bytes, n: int) -> np.ndarray:
    """`n` uniform 64-bit words (uint64) of the SHAKE-256 stream keyed by (key, purpose).

    Same construction and domain separation as `_uint53_chunks` (no shift); the first
    m words do not depend on n >= m. Used for the (small) draws of `_uniform_subset`.
    """
    words = [k for _, k in _raw_chunks(key, purpose, n)]
    return np.concatenate(words) if words else np.empty(0, dtype=np.uint64)


def _check_num_units(num_units) -> int:
    if isinstance(num_units, bool) or not isinstance(num_units, (int, np.integer)) or num_units < 1:
        raise ValueError(f"num_units must be an integer >= 1, got num_units={num_units!r}")
    return int(num_units)


def _check_q(sampling_probability) -> float:
    if isinstance(sampling_probability, bool):
        q = math.nan
    else:
        try:
            q = float(sampling_probability)
        except (TypeError, ValueError):
            q = math.nan
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
        )
    return q


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


class PoissonSampler:
    """Poisson subsampling of `num_units` privacy units at rate q.

    Formal guarantee: for a key drawn by `secure_key()` (and SHAKE-256 modelled as an
    ideal random stream), `sample(key)` includes every unit independently with
    probability exactly q. This is the sampling `PoissonSampledDpEvent(q, ...)` assumes.
    Fresh keys give independent draws across steps. Unit i's coin is u_i < q with
    u_i = (k_i + v_i) * 2**-53, k_i from `uniform_stream(key, N, PURPOSE)` and v_i's bits
    read, only when k_i == floor(q * 2**53) (probability 2**-53), from a per-unit stream
    under `TIE_PURPOSE` (see `_tie_rule`; for q < 2**-53 every unit ties, which is exact
    but costs one hash per unit).

    The batch size |S| ~ Binomial(N, q) is unbounded: memory must be provisioned for
    the largest batch that can occur; `TruncatedPoissonSampler` caps it.

    Same key -> same sample, on every machine: this is how workers agree on the draw
    (rank 0 draws a fresh key per step and broadcasts it). The sample, like the key,
    is secret (DESIGN §3.7): never log either.
    """

    PURPOSE = b"llmdp.poisson_sampler.v1"
    TIE_PURPOSE = b"llmdp.poisson_sampler.tie.v1"
    #: The cap on the batch size: None, Poisson batches are not capped.
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
        key = _check_key(key)
        parts, ties = [], []
        for offset, k in _uint53_chunks(key, self.PURPOSE, self.num_units):
            parts.append(np.flatnonzero(k < self._threshold) + offset)
            if self._tie_bits:
                ties.append(np.flatnonzero(k == self._threshold) + offset)
        indices = np.concatenate(parts).astype(np.int64, copy=False)
        if ties:
            won = _resolve_ties(key, self.TIE_PURPOSE, np.concatenate(ties), self._tie_bits, self._tie_r)
            if len(won):
                indices = np.sort(np.concatenate([indices, won]))
        return indices

    def sample_with_info(self, key: bytes) -> tuple[np.ndarray, bool]:
        """(`sample(key)`, False): the common interface with `TruncatedPoissonSampler`."""
        return self.sample(key), False


def _resolve_ties(key: bytes, purpose: bytes, tied: np.ndarray, m: int, r: int) -> np.ndarray:
    """The tied units (k_i == K) whose next m uniform bits V_i satisfy V_i < r.

    V_i is the top m bits of the SHAKE-256 stream keyed by (key, purpose || i), one
    stream per unit so that the decision of unit i does not depend on which other
    units tied. Exactly uniform on {0, ..., 2**m - 1}.
    """
    nbytes = -(-m // 8)
    won = []
    for i in np.asarray(tied, dtype=np.int64).tolist():
        stream = _stream_prefix(key, purpose + int(i).to_bytes(8, "big"))
        v = int.from_bytes(hashlib.shake_256(stream).digest(nbytes), "big") >> (8 * nbytes - m)
        if v < r:
            won.append(i)
    return np.asarray(won, dtype=np.int64)


def _uniform_subset(key: bytes, purpose: bytes, n: int, size: int) -> np.ndarray:
    """Sorted positions of a uniformly random `size`-subset of {0, ..., n-1}.

    Exactly uniform over all C(n, size) subsets (for an ideal stream): a partial
    Fisher-Yates shuffle of min(size, n - size) positions (choosing the complement when
    it is smaller, which is equally uniform), each swap index drawn exactly uniformly on
    {0, ..., m-1} from 64-bit words w by rejection (accept w >= 2**64 mod m, then
    w mod m: the accepted range has a multiple of m values). No 2**-53 rounding and no
    ties are involved.
    """
    if not (0 <= size <= n):
        raise ValueError(f"size must be in [0, n={n}], got size={size}")
    k = min(size, n - size)
    perm = np.arange(n, dtype=np.int64)
    need = k + 8  # a rejection has probability < m / 2**64: spares are plenty
    words = _uint64_words(key, purpose, need).tolist()
    pos = 0
    for i in range(k):
        m = n - i
        low = (1 << 64) % m
        while True:
            if pos == len(words):  # never in practice; the stream is prefix-consistent
                need *= 2
                words = _uint64_words(key, purpose, need).tolist()
            w = words[pos]
            pos += 1
            if w >= low:
                break
        j = i + w % m
        perm[i], perm[j] = perm[j], perm[i]
    chosen = perm[:k] if k == size else perm[k:]
    return np.sort(chosen)


class TruncatedPoissonSampler:
    """Poisson subsampling at rate q, capped at `max_batch_size` = B_max units.

    Formal guarantee: for a key drawn by `secure_key()` (and SHAKE-256 modelled as an
    ideal random stream), `sample(key)` is distributed as follows. S is the Poisson
    draw of `PoissonSampler(num_units, q).sample(key)` (every unit independently with
    probability exactly q; the *same* S for the same key). If |S| <= B_max the sample is
    S; otherwise it is a subset of S of size exactly B_max, uniformly random over all
    C(|S|, B_max) subsets (exactly, not up to a 2**-53 grid: `_uniform_subset`), drawn
    from the same key under `TRUNCATE_PURPOSE`, independently of which units S holds.
    This is the sampling `TruncatedSubsampledGaussianDpEvent(num_units, q, B_max, sigma)`
    assumes, so `num_units` must be the dataset size N of that event (the plan's).
    Fresh keys give independent draws across steps.

    The batch has at most B_max units: the caller provisions, and pads its compute to,
    B_max units per step ("pad below it"); units beyond B_max are never processed.

    Same key -> same sample, on every machine. The sample and the key are secret
    (DESIGN §3.7): never log them. Whether a step was truncated is computed on private
    data: it may only appear among the metrics the report marks internal.
    """

    TRUNCATE_PURPOSE = b"llmdp.truncated_poisson_sampler.subset.v1"

    def __init__(self, num_units: int, sampling_probability: float, max_batch_size: int):
        self._poisson = PoissonSampler(num_units, sampling_probability)
        if (
            isinstance(max_batch_size, bool)
            or not isinstance(max_batch_size, (int, np.integer))
            or max_batch_size < 1
        ):
            raise ValueError(
                f"max_batch_size must be an integer >= 1 (the cap B_max on units per step), "
                f"got max_batch_size={max_batch_size!r}"
            )
        self.num_units = self._poisson.num_units
        self.sampling_probability = self._poisson.sampling_probability
        self.max_batch_size = int(max_batch_size)

    @property
    def inclusion_probability(self) -> float:
        """q: the per-unit probability of the Poisson draw, before the cap."""
        return self._poisson.inclusion_probability

    def sample(self, key: bytes) -> np.ndarray:
        """Sorted int64 indices of this step's sample: at most `max_batch_size` of them."""
        return self.sample_with_info(key)[0]

    def sample_with_info(self, key: bytes) -> tuple[np.ndarray, bool]:
        """(indices, truncated): `truncated` says whether the Poisson draw exceeded B_max.

        `truncated` is computed on private data (it reveals |S| > B_max): it is as
        secret as the sample, and is neither logged nor reported unless privatized.
        """
        drawn = self._poisson.sample(key)
        if len(drawn) <= self.max_batch_size:
            return drawn, False
        keep = _uniform_subset(key, self.TRUNCATE_PURPOSE, len(drawn), self.max_batch_size)
        return drawn[keep], True


def make_sampler(
    num_units: int, sampling_probability: float, max_batch_size: int | None = None
) -> PoissonSampler | TruncatedPoissonSampler:
    """`PoissonSampler` if `max_batch_size` is None, else `TruncatedPoissonSampler`."""
    if max_batch_size is None:
        return PoissonSampler(num_units, sampling_probability)
    return TruncatedPoissonSampler(num_units, sampling_probability, max_batch_size)
