"""ChaCha20 (RFC 8439): the one keystream behind the noise and the sampling (DESIGN, invariant `secrets-stay-secret`).

Why ChaCha20. DP-SGD needs randomness an adversary cannot predict (a statistical PRNG such
as torch's Philox or Mersenne Twister can be reconstructed from its outputs). ChaCha20 is
a standard stream cipher whose block function is a PRF of (key, counter, nonce); it is
add-rotate-xor only (no tables, no data-dependent branches), so it runs at full speed
and in constant time on any device, and it is *seekable*: block ``c`` of the stream is
computed from (key, nonce, c) alone. That is what lets every worker, or every FSDP shard,
compute exactly its part of one global random vector without communicating it.

Layout (RFC 8439 §2.3): the state is 16 little-endian 32-bit words,
``constants(4) ‖ key(8) ‖ counter(1) ‖ nonce(3)``; 20 rounds; the block is the state plus
the input state, serialized little-endian. Block ``counter`` gives words
``16·counter … 16·counter + 15`` of the stream; the 32-bit counter must not wrap
(2**32 blocks = 256 GiB per (key, nonce)), which every entry point checks.

Implementations, bit-identical by construction and checked against each other and the RFC
vectors by the tests:

* CPU: OpenSSL's ChaCha20 (through ``cryptography``): SIMD, constant time;
* CUDA: a Triton kernel (``llmdp.privacy.rng._triton_chacha``), fused with the Gaussian
  transform for the noise;
* anywhere: :func:`chacha20_keystream_torch`, plain torch integer ops (int64 arithmetic
  masked to 32 bits). The reference and the fallback on a CUDA machine without Triton.

Keys. A step has one 32-byte step key (OS entropy on rank 0, broadcast). The keys of its
noise and its sample are derived from it by :func:`derive_key`: the first block of the
stream (step key, ``b"kdf:" + label``), i.e. one evaluation of the ChaCha20 PRF per label,
so the derived keys are independent and reveal nothing about each other or the step key.
Streams under a derived key use 12-byte nonces ``tag(4) ‖ index(8, little-endian)``
(:func:`stream_nonce`), tags distinct from ``b"kdf:"``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from llmdp.privacy.rng._rfc8439 import CONSTANTS  # "expand 32-byte k"

__all__ = [
    "KEY_BYTES",
    "NONCE_BYTES",
    "BLOCK_WORDS",
    "chacha20_keystream",
    "chacha20_keystream_torch",
    "derive_key",
    "stream_nonce",
    "keystream_into",
    "words64",
]

KEY_BYTES = 32
NONCE_BYTES = 12
BLOCK_WORDS = 16
BLOCK_BYTES = 64
MAX_BLOCKS = 1 << 32  # the RFC 8439 block counter is 32 bits: never wrap it
_KDF_TAG = b"kdf:"
_M32 = 0xFFFFFFFF
_ZEROS = bytes(1 << 20)  # OpenSSL encrypts zeros: its output is the keystream itself


# --------------------------------------------------------------------------- checks


def check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"a ChaCha20 key is {KEY_BYTES} bytes (e.g. secure_key()), got {got}")
    return bytes(key)


def _check_nonce(nonce) -> bytes:
    if not isinstance(nonce, (bytes, bytearray)) or len(nonce) != NONCE_BYTES:
        got = f"{len(nonce)} bytes" if isinstance(nonce, (bytes, bytearray)) else type(nonce).__name__
        raise ValueError(f"a ChaCha20 nonce is {NONCE_BYTES} bytes (RFC 8439), got {got}")
    return bytes(nonce)


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {name}={value!r}")
    return int(value)


def _check_span(counter: int, n_blocks: int) -> None:
    if counter + n_blocks > MAX_BLOCKS:
        raise ValueError(
            f"ChaCha20 stream overrun: blocks {counter}..{counter + n_blocks - 1} pass the 32-bit "
            f"block counter (at most {MAX_BLOCKS} blocks = 256 GiB per key and nonce); split the "
            "draw over several nonces"
        )


def stream_nonce(tag: bytes, index: int) -> bytes:
    """The 12-byte nonce ``tag ‖ index`` (4-byte tag, 8-byte little-endian index)."""
    if not isinstance(tag, (bytes, bytearray)) or len(tag) != 4 or bytes(tag) == _KDF_TAG:
        raise ValueError(f"a stream tag is 4 bytes other than {_KDF_TAG!r}, got {tag!r}")
    index = _check_int("index", index, 0, (1 << 64) - 1)
    return bytes(tag) + index.to_bytes(8, "little")


# --------------------------------------------------------------------------- CPU: OpenSSL


def _cipher(key: bytes, nonce: bytes, counter: int):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    # cryptography/OpenSSL take a 16-byte "nonce": the 32-bit counter (little-endian),
    # then the 96-bit RFC 8439 nonce.
    return Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), None).encryptor()


def keystream_into(key: bytes, nonce: bytes, counter: int, out) -> None:
    """Fill the writable buffer ``out`` (its length a multiple of 64 bytes) with the
    keystream from block ``counter`` on (OpenSSL, CPU). No allocation beyond ``out``."""
    mv = memoryview(out).cast("B")
    n = len(mv)
    if n % BLOCK_BYTES:
        raise ValueError(f"keystream_into needs whole 64-byte blocks, got {n} bytes")
    _check_span(counter, n // BLOCK_BYTES)
    enc = _cipher(key, nonce, counter)
    step = len(_ZEROS)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        enc.update_into(_ZEROS[: hi - lo], mv[lo:hi])


def _keystream_bytes(key: bytes, nonce: bytes, counter: int, n_blocks: int) -> bytearray:
    buf = bytearray(n_blocks * BLOCK_BYTES)
    if n_blocks:
        keystream_into(key, nonce, counter, buf)
    return buf


def words64(key: bytes, nonce: bytes, first: int, n: int) -> np.ndarray:
    """64-bit words ``first … first + n - 1`` of the stream (key, nonce) as uint64, word j
    being stream words 2j (low half) and 2j + 1 (high half): the little-endian reading of
    bytes 8j … 8j + 7. Seekable: the result does not depend on how the stream is cut."""
    key, nonce = check_key(key), _check_nonce(nonce)
    first = _check_int("first", first, 0, MAX_BLOCKS * 8)
    n = _check_int("n", n, 0, MAX_BLOCKS * 8)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    b0, skip = divmod(first, 8)
    n_blocks = -(-(skip + n) // 8)
    buf = _keystream_bytes(key, nonce, b0, n_blocks)
    return np.frombuffer(buf, dtype="<u8")[skip : skip + n].astype(np.uint64, copy=False)


def derive_key(key: bytes, label: bytes) -> bytes:
    """The 32-byte key for ``label`` (at most 8 bytes) under ``key``: the first 8 words of
    block 0 of the stream (key, ``b"kdf:" + label`` zero-padded to 12 bytes)."""
    key = check_key(key)
    if not isinstance(label, (bytes, bytearray)) or not 1 <= len(label) <= 8 or b"\0" in label:
        raise ValueError(f"a key label is 1 to 8 non-zero bytes, got {label!r}")
    nonce = _KDF_TAG + bytes(label).ljust(8, b"\0")
    return bytes(_keystream_bytes(key, nonce, 0, 1)[:KEY_BYTES])


# --------------------------------------------------------------------------- torch reference


def _state_words(key: bytes, nonce: bytes) -> tuple[int, ...]:
    return (*CONSTANTS, *struct.unpack("<8I", key), 0, *struct.unpack("<3I", nonce))


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) & _M32) | (x >> (32 - n))


def _quarter(s: list[torch.Tensor], a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & _M32
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _M32
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & _M32
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _M32
    s[b] = _rotl(s[b] ^ s[c], 7)


def _blocks_torch(words: tuple[int, ...], counter: int, n_blocks: int, device) -> torch.Tensor:
    """[n_blocks, 16] int64 keystream words (values in [0, 2**32)), plain torch ops."""
    ctr = torch.arange(counter, counter + n_blocks, dtype=torch.int64, device=device)
    init = [torch.full_like(ctr, w) for w in words]
    init[12] = ctr
    s = list(init)
    for _ in range(10):  # 20 rounds: column round, then diagonal round
        _quarter(s, 0, 4, 8, 12)
        _quarter(s, 1, 5, 9, 13)
        _quarter(s, 2, 6, 10, 14)
        _quarter(s, 3, 7, 11, 15)
        _quarter(s, 0, 5, 10, 15)
        _quarter(s, 1, 6, 11, 12)
        _quarter(s, 2, 7, 8, 13)
        _quarter(s, 3, 4, 9, 14)
    return torch.stack([(x + y) & _M32 for x, y in zip(s, init)], dim=1)


def chacha20_keystream_torch(
    key: bytes, nonce: bytes, counter: int, n_words: int, device="cpu", chunk_blocks: int = 1 << 18
) -> torch.Tensor:
    """:func:`chacha20_keystream` computed with plain torch integer ops on ``device``: the
    reference implementation, and the CUDA path where Triton is missing."""
    key, nonce = check_key(key), _check_nonce(nonce)
    counter = _check_int("counter", counter, 0, MAX_BLOCKS - 1)
    n_words = _check_int("n_words", n_words, 0, MAX_BLOCKS * BLOCK_WORDS)
    n_blocks = -(-n_words // BLOCK_WORDS)
    _check_span(counter, n_blocks)
    words = _state_words(key, nonce)
    out = torch.empty(n_blocks * BLOCK_WORDS, dtype=torch.int64, device=device)
    for b in range(0, n_blocks, chunk_blocks):
        m = min(chunk_blocks, n_blocks - b)
        out[b * 16 : (b + m) * 16] = _blocks_torch(words, counter + b, m, device).reshape(-1)
    return out[:n_words]


# --------------------------------------------------------------------------- public entry


def chacha20_keystream(key: bytes, nonce: bytes, counter: int, n_words: int, device="cpu") -> torch.Tensor:
    """The RFC 8439 ChaCha20 keystream as ``n_words`` 32-bit words, starting at block
    ``counter``: an int64 tensor on ``device`` holding the unsigned values (0 ≤ w < 2**32),
    word j being bytes 4j … 4j + 3 of the keystream read little-endian.

    The same (key, nonce, counter) gives bit-identical words on every device: OpenSSL on
    CPU, a Triton kernel on CUDA (plain torch ops where Triton is missing). ``counter`` +
    the blocks needed must stay within the 32-bit block counter.
    """
    key, nonce = check_key(key), _check_nonce(nonce)
    counter = _check_int("counter", counter, 0, MAX_BLOCKS - 1)
    n_words = _check_int("n_words", n_words, 0, MAX_BLOCKS * BLOCK_WORDS)
    device = torch.device(device)
    n_blocks = -(-n_words // BLOCK_WORDS)
    _check_span(counter, n_blocks)
    if device.type == "cpu":
        buf = _keystream_bytes(key, nonce, counter, n_blocks)
        w = np.frombuffer(buf, dtype="<u4")[:n_words].astype(np.int64)
        return torch.from_numpy(w)
    if device.type == "cuda":
        from llmdp.privacy.rng import (
            _triton_chacha,  # lazy: imports Triton, only ever asked on CUDA
        )

        if _triton_chacha.available():
            return _triton_chacha.keystream(key, nonce, counter, n_words, device)
    return chacha20_keystream_torch(key, nonce, counter, n_words, device)
