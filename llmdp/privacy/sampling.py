"""Poisson sampling of privacy units from a cryptographically secure stream.

DESIGN §3.3: the sampler must be exactly what the accountant assumes. For
`PoissonSampledDpEvent(q, ...)` that is: at every step, every privacy unit is included
independently with probability q, and the draw is unpredictable to an adversary. Both
are provided here:

* randomness comes from SHAKE-256 (an extendable-output function, FIPS 202) keyed by a
  32-byte key; with a key from `secure_key()` (OS entropy) the stream is
  computationally indistinguishable from uniform for anyone who does not know the key.
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
    "split_for_workers",
    "num_micro_batches",
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


def _uint53_chunks(key: bytes, purpose: bytes, n: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (offset, k) with k[i] uniform integers in [0, 2**53), n in total.

    Chunk j is the SHAKE-256 output for (domain, key, purpose, j), with lengths
    prefixed so that no two (key, purpose) pairs share an input. SHAKE output is
    prefix-consistent, so the first m values do not depend on n >= m.
    """
    key = _check_key(key)
    purpose = bytes(purpose)
    prefix = (
        _STREAM_DOMAIN
        + len(key).to_bytes(4, "big")
        + key
        + len(purpose).to_bytes(4, "big")
        + purpose
    )
    for j, offset in enumerate(range(0, n, _CHUNK)):
        m = min(_CHUNK, n - offset)
        h = hashlib.shake_256(prefix + j.to_bytes(8, "big"))
        words = np.frombuffer(h.digest(8 * m), dtype="<u8")
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


class PoissonSampler:
    """Poisson subsampling of `num_units` privacy units at rate q.

    Formal guarantee: for a key drawn by `secure_key()`, `sample(key)` includes every
    unit independently with probability p = floor(q * 2**53) / 2**53, where
    q - 2**-53 < p <= q. This is the sampling `PoissonSampledDpEvent(q, ...)` assumes
    (amplification by subsampling only improves as p decreases, so accounting with q
    is valid). Fresh keys give independent draws across steps. Unit i's coin is
    u_i = k_i * 2**-53 < p from `uniform_stream(key, N, PURPOSE)`.

    Same key -> same sample, on every machine: this is how workers agree on the draw
    (rank 0 draws a fresh key per step and broadcasts it). The sample, like the key,
    is secret (DESIGN §3.7): never log either.
    """

    PURPOSE = b"llmdp.poisson_sampler.v1"

    def __init__(self, num_units: int, sampling_probability: float):
        if (
            isinstance(num_units, bool)
            or not isinstance(num_units, (int, np.integer))
            or num_units < 1
        ):
            raise ValueError(f"num_units must be an integer >= 1, got num_units={num_units!r}")
        q = float(sampling_probability)
        if not (0.0 < q <= 1.0):
            raise ValueError(
                f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
            )
        self.num_units = int(num_units)
        self.sampling_probability = q
        # q * 2**53 is exact in binary floating point; the floor makes p <= q.
        self._threshold = np.uint64(math.floor(q * _TWO_53))

    @property
    def inclusion_probability(self) -> float:
        """The exact per-unit inclusion probability p (q - 2**-53 < p <= q)."""
        return int(self._threshold) / _TWO_53

    def sample(self, key: bytes) -> np.ndarray:
        """Sorted int64 indices of the units included in this step's sample."""
        parts = [
            np.flatnonzero(k < self._threshold) + offset
            for offset, k in _uint53_chunks(key, self.PURPOSE, self.num_units)
        ]
        return np.concatenate(parts).astype(np.int64, copy=False)


def split_for_workers(indices, world_size: int) -> list[np.ndarray]:
    """Deterministic balanced split: contiguous slices whose sizes differ by at most 1
    (the first `len % world_size` workers get one more)."""
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, (int, np.integer))
        or world_size < 1
    ):
        raise ValueError(f"world_size must be an integer >= 1, got world_size={world_size!r}")
    return np.array_split(np.asarray(indices, dtype=np.int64), int(world_size))


def num_micro_batches(sample_size: int, world_size: int, physical_batch_size: int) -> int:
    """Micro-batches every worker runs this step: ceil(ceil(S / W) / P), 0 if S == 0.

    All workers must run the same number (collectives inside forward/backward would
    otherwise deadlock), so workers with a smaller share pad with empty micro-batches;
    it depends only on the public-to-workers sample size, not on which units were drawn.
    """
    for name, value, low in (
        ("sample_size", sample_size, 0),
        ("world_size", world_size, 1),
        ("physical_batch_size", physical_batch_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {name}={value!r}")
    max_share = -(-int(sample_size) // int(world_size))
    return -(-max_share // int(physical_batch_size))
