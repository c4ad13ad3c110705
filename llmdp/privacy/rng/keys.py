"""The keys of a step's randomness: fresh OS entropy, or (tests only) a seeded hash.

A step's randomness (its sample and its noise) is a deterministic function of one secret
32-byte key: `secure_key()` draws it from the OS, so nobody can recompute the draw;
`seeded_key(seed, step, purpose, run=, attempt=)` derives it from a seed, for tests and
reproducible runs, which then carry no guarantee against anyone who knows the seed (DESIGN,
invariant `secrets-stay-secret`). The run and the attempt are in the key: two runs with one seed (two trials of a
sweep) and two attempts of one run (a step re-run after a resume, whose sum may be rounded
differently) draw independent noise, which no one can cancel by differencing them. The
sampler (`llmdp.privacy.sampling.poisson`) and the noise (`llmdp.privacy.noise.gaussian`) expand such keys
with ChaCha20 (`llmdp.privacy.rng.chacha`).

`_check_key` (bytes, at least 16 of them) also checks the private tokenizer's keys;
`_check_sample_key` checks a sampler's 32-byte key.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

__all__ = ["KEY_BYTES", "secure_key", "seeded_key"]

KEY_BYTES = 32
_MIN_KEY_BYTES = 16  # 128 bits: shorter keys are guessable, which would void the guarantee


def secure_key() -> bytes:
    """32 bytes of fresh OS entropy (`os.urandom`): the key of one step's randomness."""
    return os.urandom(KEY_BYTES)


def seeded_key(seed: int, step: int, purpose: str, run: str = "", attempt: str = "") -> bytes:
    """SHA-256 of the canonical encoding of (seed, run, attempt, step, purpose).

    For tests and reproducible runs ONLY: anyone who knows `seed` can recompute every
    sample and every noise vector, so such a run carries no DP guarantee against
    anyone who knows the seed (DESIGN, invariant `secrets-stay-secret`); its report must say so. ``run`` and
    ``attempt``: the release's identity (a training run's id and its ledger attempt,
    `llmdp.train.loop.seeded_scope`); every release passes its own, so that no two releases
    share noise. Left empty only by tests of the primitives (samplers, noise).
    """
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {name}={value!r}")
    for name, value in (("purpose", purpose), ("run", run), ("attempt", attempt)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {name}={value!r}")
    # JSON of a list of ints and strings is an unambiguous, injective encoding.
    blob = json.dumps(["llmdp.seeded_key.v2", int(seed), run, attempt, int(step), purpose],
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).digest()


def _check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise ValueError(f"key must be bytes (e.g. secure_key()), got {type(key).__name__}")
    if len(key) < _MIN_KEY_BYTES:
        raise ValueError(f"key must have at least {_MIN_KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def _check_sample_key(key) -> bytes:
    """The 32-byte sample key, or one ValueError that names the length and the fix."""
    if not isinstance(key, (bytes, bytearray)):
        raise ValueError(
            f"a sampling key is {KEY_BYTES} bytes, got {type(key).__name__}: pass the step's "
            "sample key, chacha.derive_key(step_key, b'sample') (or secure_key() / seeded_key())"
        )
    if len(key) != KEY_BYTES:
        raise ValueError(
            f"a sampling key is {KEY_BYTES} bytes (a ChaCha20 key), got a {len(key)}-byte key: "
            "pass the step's sample key, chacha.derive_key(step_key, b'sample') "
            "(or secure_key() / seeded_key()), not a shorter or longer one"
        )
    return bytes(key)
