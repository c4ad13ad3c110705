"""Gaussian noise: the one place it is drawn (DESIGN, invariant `noise-once`, invariant `secrets-stay-secret`).

Noise comes from ChaCha20 (RFC 8439, ``rng/chacha.py``), keyed by the step's noise key, not
from torch's generator: torch's Mersenne Twister / Philox are statistical PRNGs whose
state can be recovered from outputs, and the DP guarantee needs noise an adversary cannot
predict. The noise of a step is one global vector: tensor i of the trainable parameters
(in the model's order) is the stream (noise key, nonce ``b"gaus" ‖ i``), and its element e
is normal ``e % 4`` of ChaCha20 block ``e // 4`` (two Box-Muller pairs a block: 106 random
bits for each pair's radius, 53 for its angle). So

* every replica, holding the same broadcast key, adds the *identical* noise, once per
  logical step, without communicating it;
* the draw is seekable: an FSDP shard computes exactly its slice of the global vector
  (``offset``), bit for bit what the replicated strategy adds there;
* it is generated in place on the device that holds the sums, in chunks (CUDA: one fused
  Triton kernel, keystream and transform in registers; CPU: OpenSSL's ChaCha20 and
  vectorized torch math on cache-sized chunks), never in a parameter-sized buffer.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
from collections.abc import Sequence

import numpy as np
import torch

from llmdp.privacy import rng
from llmdp.privacy.noise.tail import NOISE_TAIL, RADIUS_BITS, truncation_delta_per_step
from llmdp.privacy.rng import chacha20_keystream

__all__ = [
    "chacha20_keystream",
    "gaussian_like",
    "add_gaussian_",
    "add_noise_",
    "NOISE_TAIL",
    "NOISE_METHOD",
    "truncation_delta_per_step",
    "keyed_normal",
]

NOISE_TAG = b"gaus"
_TWO_PI = 2.0 * math.pi
_INV_2_53 = 1.0 / float(2**53)
_INV_2_106 = _INV_2_53 * _INV_2_53  # 2**-106, exact
assert RADIUS_BITS == 106  # the radius uniform below: two 53-bit integers
_TWO_PI_2M53 = _TWO_PI * _INV_2_53
_MASK53 = (1 << 53) - 1
_KEYED_DOMAIN = b"llmdp.keyed_normal.v1"
PAIR_WORDS = 4  # 64-bit words of the stream per Box-Muller pair (the 4th is not used)
PAIRS_PER_BLOCK = 2  # a 64-byte ChaCha20 block: 8 words, 2 pairs, 4 normals
_CHUNK_PAIRS = 1 << 16  # CPU: 128 Ki normals per chunk (2 MiB of keystream, ~5 MiB of work space)
_CHUNK_PAIRS_TORCH = 1 << 20  # the torch-ops keystream elsewhere: larger launches
assert _CHUNK_PAIRS % PAIRS_PER_BLOCK == 0  # chunks start on ChaCha20 block boundaries

#: What the generator is, for the privacy report.
NOISE_METHOD = (
    "ChaCha20 (RFC 8439) keystream; Box-Muller in float64 on a 106-bit radius uniform and a "
    "53-bit angle per pair; rounded to float32 (float64 for float64 sums)"
)


def _check_std(std) -> float:
    if (
        isinstance(std, bool)
        or not isinstance(std, (int, float, np.floating))
        or not (0 < std < math.inf)
    ):
        # Zero noise would be a silent non-private fallback (DESIGN, invariant `no-silent-fallbacks`).
        raise ValueError(f"std must be a finite number > 0, got std={std!r}")
    return float(std)


def _check_index(index) -> int:
    if (
        isinstance(index, bool)
        or not isinstance(index, (int, np.integer))
        or not (0 <= index < 2**63)
    ):
        raise ValueError(f"index must be an integer in [0, 2**63), got index={index!r}")
    return int(index)


def _check_target(t: torch.Tensor, what: str) -> None:
    if not t.is_floating_point() or t.dtype.itemsize < 4:
        # Noise drawn or added in bf16/fp16 would be rounded to a coarse grid (and the
        # clipped sum it is added to already was): DESIGN, invariant `precision-never-widens`.
        raise TypeError(
            f"{what} is {t.dtype}: noise is drawn and added in float32 or wider; "
            "keep the clipped sums in float32 (llmdp.train.strategy.Strategy.grad_sinks)"
        )


def _nonce(index: int) -> bytes:
    return rng.stream_nonce(NOISE_TAG, index)


def _triton_available() -> bool:
    from llmdp._triton import available  # lazy: imports Triton, only ever asked on CUDA

    return available()


def _keystream_cpu(key: bytes, nonce: bytes, p0: int, n_pairs: int, buf: bytearray) -> bytearray:
    """The 32 bytes of each pair p0 … p0 + n_pairs - 1 (p0 % 2 == 0) into ``buf``'s prefix."""
    n_blocks = -(-n_pairs // PAIRS_PER_BLOCK)
    rng.keystream_into(key, nonce, p0 // PAIRS_PER_BLOCK, memoryview(buf)[: 64 * n_blocks])
    return buf


def _pairs(words: torch.Tensor, std: float, ws: dict) -> torch.Tensor:
    """[n, 2] in ``ws["dtype"]``: std·r·(cos θ, sin θ) of n pairs, computed in float64 on
    ``words``' device. ``words`` [n, 4] int64: the four little-endian 64-bit words of each
    pair (32 bytes of the stream; 2 pairs a block).

    k1, k2 = the low 53 bits of the first and of the second word, s2 = the third read as a
    signed integer, shifted right by 11 (its top 53 bits, in [-2**52, 2**52)); the fourth
    is not used. u1 = k1·2**-53 + (k2 + 1)·2**-106 in [2**-106, 1] (106 random bits: both
    terms exact, their sum rounded once to float64; exact when k1 = 0), θ = 2π·s2·2**-53 in
    [-π, π). ``ws`` holds reusable work buffers (planar, so the math runs vectorized): a
    draw allocates nothing per chunk."""
    n = words.shape[0]
    if ws.get("n") != n:
        dtype = ws["dtype"]
        ws.clear()
        kw = {"device": words.device}
        ws.update(n=n, dtype=dtype,
                  k=torch.empty(3, n, dtype=torch.int64, **kw),
                  f=torch.empty(3, n, dtype=torch.float64, **kw),
                  c=torch.empty(n, dtype=torch.float64, **kw),
                  z=torch.empty(n, 2, dtype=dtype, **kw))
    words = words.t()
    k, f, c, z = ws["k"], ws["f"], ws["c"], ws["z"]
    torch.bitwise_and(words[0], _MASK53, out=k[0])  # k1: the low 53 bits
    torch.bitwise_and(words[1], _MASK53, out=k[1])  # k2: the low 53 bits
    torch.bitwise_right_shift(words[2], 11, out=k[2])  # s2: arithmetic shift, the top 53 bits
    f.copy_(k)  # exact: |k| < 2**53
    r, k2, theta = f[0], f[1], f[2]
    k2.add_(1.0)  # exact: k2 + 1 <= 2**53
    # u1 = k1·2**-53 + (k2 + 1)·2**-106: the product is exact (a power of two, no underflow),
    # so fused or not the sum is rounded once, as in the Triton kernel and keyed_normal.
    r.mul_(_INV_2_53).add_(k2, alpha=_INV_2_106)
    r.log_().mul_(-2.0 * std * std).sqrt_()  # std·sqrt(-2 ln u1)
    theta.mul_(_TWO_PI_2M53)
    torch.cos(theta, out=c)
    z[:, 0].copy_(c.mul_(r))  # rounded to the target dtype
    torch.sin(theta, out=c)
    z[:, 1].copy_(c.mul_(r))
    return z


_POOL = None
_POOL_PID = None


def _pool():
    """One background thread: OpenSSL (which releases the GIL) makes the next chunk's
    keystream while torch transforms this one. A forked child gets its own (the parent's
    thread does not exist there)."""
    global _POOL, _POOL_PID
    if _POOL is None or _POOL_PID != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmdp-keystream")
        _POOL_PID = os.getpid()
    return _POOL


def _words_cpu(key: bytes, nonce: bytes, chunks: list[tuple[int, int]]):
    """The [m, 4] int64 words of each chunk (p0, m), from OpenSSL; the next chunk's
    keystream is made in the background while the caller transforms this one."""
    size = 64 * -(-max(m for _, m in chunks) // PAIRS_PER_BLOCK)
    bufs = [bytearray(size), bytearray(size) if len(chunks) > 1 else None]
    pending = None
    for i, (p0, m) in enumerate(chunks):
        buf = pending.result() if pending is not None else _keystream_cpu(key, nonce, p0, m, bufs[0])
        pending = None
        if i + 1 < len(chunks):
            q0, qm = chunks[i + 1]
            pending = _pool().submit(_keystream_cpu, key, nonce, q0, qm, bufs[(i + 1) % 2])
        if sys.byteorder == "little":
            words = torch.frombuffer(buf, dtype=torch.int64, count=PAIR_WORDS * m)
        else:  # the stream's 64-bit words are little-endian
            words = torch.from_numpy(
                np.frombuffer(buf, dtype="<u8", count=PAIR_WORDS * m).astype(np.int64))
        yield words.view(m, PAIR_WORDS)


def _words_torch(key: bytes, nonce: bytes, chunks: list[tuple[int, int]], device):
    """The same words from :func:`chacha.chacha20_keystream_torch` on ``device`` (a CUDA
    machine without Triton; any other device)."""
    for p0, m in chunks:
        w = rng.chacha20_keystream_torch(key, nonce, p0 // PAIRS_PER_BLOCK, 2 * PAIR_WORDS * m,
                                            device).view(m, PAIR_WORDS, 2)
        yield (w[:, :, 1] << 32) | w[:, :, 0]  # the little-endian 64-bit words, as int64


def _add_chunked(flat: torch.Tensor, key: bytes, nonce: bytes, offset: int, total: int,
                 std: float, chunk_pairs: int) -> None:
    """flat += elements [offset, offset + numel) of the noise vector of length ``total``.

    Chunks are the fixed pair ranges [c·P, min((c+1)·P, ⌈total/2⌉)): an element is always
    computed in the same chunk at the same position, whatever slice is asked for, so slices
    of one vector are bit-identical to the whole (CPU: same torch thread count)."""
    n = flat.numel()
    pairs_total = -(-total // 2)
    first_pair, last_pair = offset // 2, (offset + n - 1) // 2
    chunks = [(p0, min(p0 + chunk_pairs, pairs_total) - p0)
              for p0 in range(first_pair - first_pair % chunk_pairs, last_pair + 1, chunk_pairs)]
    if flat.device.type == "cpu":
        source = _words_cpu(key, nonce, chunks)
    else:
        source = _words_torch(key, nonce, chunks, flat.device)
    ws: dict = {"dtype": flat.dtype}
    for (p0, m), words in zip(chunks, source):
        z = _pairs(words, std, ws).view(-1)
        lo, hi = max(offset, 2 * p0), min(offset + n, 2 * (p0 + m))  # elements of both
        flat[lo - offset : hi - offset] += z[lo - 2 * p0 : hi - 2 * p0]


def add_gaussian_(t: torch.Tensor, key: bytes, index: int, std: float, offset: int = 0,
                  total: int | None = None) -> torch.Tensor:
    """``t += N(0, std²)``: elements ``offset … offset + t.numel() - 1`` (in ``t``'s
    row-major order) of noise vector ``index`` under ``key``, whose full length is
    ``total`` (default ``offset + t.numel()``). In place, on ``t``'s device, in float32
    or float64 (``t``'s dtype; narrower dtypes are refused); returns ``t``.

    Method (the same on every device): element e is normal ``e % 4`` of ChaCha20 block
    ``e // 4`` of the stream (key, ``b"gaus" ‖ index``); the 8 little-endian 64-bit words
    of a block make 2 Box-Muller pairs, pair j from words 4j … 4j + 3: k1 and k2 = the low
    53 bits of the first and of the second, s2 = the top 53 bits of the third as a signed
    integer (in [-2**52, 2**52)), the fourth unused; u1 = k1·2**-53 + (k2 + 1)·2**-106 in
    [2**-106, 1] (106 random bits, rounded once to float64; log(u1) is finite),
    θ = 2π·s2·2**-53 in [-π, π), r = std·sqrt(-2 ln u1), elements 2j, 2j + 1 = r·cos θ,
    r·sin θ, computed in float64 and rounded to ``t``'s dtype, then added (a second
    rounding).

    Floating-point limits, stated so the privacy report states them too:

    * it is floating-point Gaussian sampling, not a discrete Gaussian: the output lives on
      a non-uniform float grid (such artifacts have been exploited against floating-point
      Laplace samplers, Mironov 2012); the accountant assumes an exact continuous Gaussian;
    * the tails are truncated: |z| <= NOISE_TAIL·std, NOISE_TAIL = sqrt(-2 ln 2**-106) =
      sqrt(212 ln 2) ~ 12.122 (u1 >= 2**-106; reached at k1 = k2 = s2 = 0). The δ this
      adds per step is bounded by :func:`truncation_delta_per_step` (6e-23 for a billion
      coordinates at σ = 0.5), and the run's total is folded into the published δ
      (`llmdp.privacy.noise.tail`: the accountant runs at δ minus it). A 53-bit radius
      uniform capped |z| at 8.57 std, a tail that took 42% of δ = 1e-7 for 800 steps of a
      1.24 B-parameter model at σ = 0.63 (recipes/llama-3.2-1b-full.yaml): hence two words
      for the radius, at the cost of twice the keystream per pair (32 bytes, not 16);
    * each draw is computed in float64 and rounded to float32 (float64 for float64 sums),
      then rounded again when added to the sum. The rounding is not covered by the
      accountant (nor by the δ above). float64 log/cos/sin differ between devices by an
      ulp or so (SLEEF/glibc on CPU, libdevice on CUDA): the *keystream* is bit-identical
      everywhere, the noise bit-identical on one device.

    Seekable: any slice of the vector equals the same slice of the whole, bit for bit, on
    the same device (CPU: with the same torch thread count), which FSDP shards rely on.
    """
    std = _check_std(std)
    index = _check_index(index)
    _check_target(t, "the tensor")
    key = rng.check_key(key)
    n = t.numel()
    offset = _check_index(offset)
    total = offset + n if total is None else _check_index(total)
    if total < offset + n:
        raise ValueError(f"total={total} < offset + numel = {offset + n}")
    per_block = 2 * PAIRS_PER_BLOCK
    if -(-total // per_block) > rng.MAX_BLOCKS:
        raise ValueError(f"a noise vector of {total} elements passes the ChaCha20 block counter "
                         f"(at most {per_block * rng.MAX_BLOCKS} per tensor)")
    if n == 0:
        return t
    nonce = _nonce(index)
    with torch.no_grad():
        flat = t.view(-1) if t.is_contiguous() else None
        work = flat if flat is not None else t.contiguous().view(-1)
        if t.device.type == "cuda" and _triton_available():
            from llmdp.privacy.rng import gauss_add_  # lazy: imports Triton (CUDA only)

            gauss_add_(work, key, nonce, offset, std)
        else:
            chunk = _CHUNK_PAIRS if t.device.type == "cpu" else _CHUNK_PAIRS_TORCH
            _add_chunked(work, key, nonce, offset, total, std, chunk)
        if flat is None:
            t.copy_(work.view(t.shape))
    return t


def gaussian_like(
    shape,
    key: bytes,
    index: int,
    std: float,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    offset: int = 0,
    total: int | None = None,
) -> torch.Tensor:
    """A new tensor of i.i.d. N(0, std²) draws: elements ``offset …`` of noise vector
    ``index`` under ``key`` (:func:`add_gaussian_` added to zeros, so the two agree bit for
    bit). ``dtype`` float32 or float64."""
    out = torch.zeros(torch.Size(shape), dtype=dtype, device=device)
    _check_target(out, f"dtype {dtype}")
    return add_gaussian_(out, key, index, std, offset=offset, total=total)


def add_noise_(tensors: Sequence[torch.Tensor], key: bytes, std: float,
               offsets: Sequence[int] | None = None, totals: Sequence[int] | None = None) -> None:
    """Add N(0, std²) noise to each tensor in place: tensor i gets noise vector i
    (its elements ``offsets[i] …`` of a vector of length ``totals[i]``: an FSDP shard's
    slice; default the whole vector).

    Every worker holds the same key, so all replicas add the identical noise vector,
    once per logical step, after the cross-worker sum; and a shard adds exactly the
    slice the replicated strategy adds to the same coordinates.
    """
    std = _check_std(std)
    for i, t in enumerate(tensors):
        _check_target(t, f"tensor {i}")
    for i, t in enumerate(tensors):
        add_gaussian_(t, key, i, std, offset=0 if offsets is None else offsets[i],
                      total=None if totals is None else totals[i])


def _label_key(key: bytes, label: bytes) -> bytes:
    """The 32-byte ChaCha20 key of ``label`` under ``key``: SHA-256 of (domain, the
    4-byte big-endian length of ``key``, ``key``, ``label``). The length prefix makes the
    encoding injective, so distinct (key, label) pairs never share an input; labels may
    have any length, which `chacha.derive_key`'s 8-byte labels do not allow."""
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise ValueError(f"key must be non-empty bytes, got {type(key).__name__}")
    if not isinstance(label, (bytes, bytearray)):
        raise ValueError(f"label must be bytes, got {type(label).__name__}")
    return hashlib.sha256(
        _KEYED_DOMAIN + len(key).to_bytes(4, "big") + bytes(key) + bytes(label)
    ).digest()


def keyed_normal(key: bytes, label: bytes, std: float) -> float:
    """One N(0, std²) draw, a deterministic function of (key, label) alone: element 0 of
    noise vector 0 under the per-label key `_label_key(key, label)`, i.e. the first
    Box-Muller pair (words 0-3) of the ChaCha20 stream (that key, nonce ``b"gaus" ‖ 0``),
    cos branch,
    in float64, computed without torch. Draws for distinct labels are independent
    (distinct ChaCha20 keys); same sampler and tail as :func:`add_gaussian_`.

    Relation to ``gaussian_like((1,), _label_key(key, label), 0, std, torch.float64)[0]``:
    the same keystream words, the same integers k1, k2 and s2 and the same float64 formula
    (u1 the same float64 number: one correctly rounded sum of two exact terms on both
    sides), but *not* bit for bit the same draw. Here log, sqrt and cos are Python's `math` (the
    C library: sqrt correctly rounded, log and cos within 1 ulp); there they are torch's
    vectorized CPU kernels (SLEEF log and cos within 1 ulp; its float64 sqrt is not always
    correctly rounded either). The two agree to a few ulps (each of the three functions
    within 1 ulp of the exact value on both sides: at most ~13 ulps apart); measured, about
    1.2% of draws differ, by 1 or 2 ulps. Computing this draw through torch instead would make it
    ~6x slower (a private tokenizer draws one per distinct word) and tie it to torch's CPU
    dispatch; either number is a draw of the same Gaussian sampler.
    """
    std = _check_std(std)
    block = bytearray(rng.BLOCK_BYTES)
    rng.keystream_into(_label_key(key, label), _nonce(0), 0, block)
    w1, w2, w3 = struct.unpack_from("<QQq", block)
    # as `_pairs`: the low 53 bits of the first two words; the third's top 53 bits, signed
    k1, k2, s2 = w1 & _MASK53, w2 & _MASK53, w3 >> 11
    u1 = float(k1) * _INV_2_53 + float(k2 + 1) * _INV_2_106  # both terms exact: one rounding
    r = math.sqrt(math.log(u1) * (-2.0 * std * std))
    return math.cos(float(s2) * _TWO_PI_2M53) * r
