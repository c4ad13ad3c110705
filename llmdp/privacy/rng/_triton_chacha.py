"""Triton kernels: the ChaCha20 keystream (RFC 8439) and the Gaussian noise drawn from it,
generated and added in place on the GPU (see ``chacha.py`` and ``noise/gaussian.py`` for the
contracts these kernels implement; the tests compare them bit for bit with OpenSSL and
with the torch reference).

Each program computes ``BLOCK`` ChaCha20 blocks, one per lane: the 16-word state lives in
registers, 20 rounds of add-rotate-xor on uint32 lanes, no memory traffic but the output.
The noise kernel turns each block (16 words: 8 little-endian 64-bit words) into 2
Box-Muller pairs (4 normals) exactly as ``gaussian._pairs`` does on CPU, pair j from 64-bit
words 4j … 4j + 3: k1, k2 = the low 53 bits of the first two, s2 = the third's top 53 bits,
signed (the fourth unused), u1 = k1·2**-53 + (k2 + 1)·2**-106, θ = 2π·s2·2**-53, in
float64, and adds ``std·r·(cos θ, sin θ)``, rounded to the target's dtype, to the elements
it owns.

With ``TRITON_INTERPRET=1`` set before the import, the same kernels run on CPU tensors
through Triton's interpreter (the tests use this to check the kernels without a GPU).
"""

from __future__ import annotations

import math
import struct

import torch

from llmdp._triton import available, interpreting, tl, triton  # noqa: F401 - re-used names
from llmdp.privacy.rng._rfc8439 import CONSTANTS

if triton is not None:

    @triton.jit
    def _rotl(x, n: tl.constexpr):
        return (x << n) | (x >> (32 - n))

    @triton.jit
    def _qr(a, b, c, d):
        a = a + b
        d = _rotl(d ^ a, 16)
        c = c + d
        b = _rotl(b ^ c, 12)
        a = a + b
        d = _rotl(d ^ a, 8)
        c = c + d
        b = _rotl(b ^ c, 7)
        return a, b, c, d

    @triton.jit
    def _block(kn_ptr, ctr):
        """16 uint32 lanes-vectors: the keystream words of blocks ``ctr`` (uint32 vector)."""
        k0 = tl.load(kn_ptr + 0).to(tl.uint32, bitcast=True)
        k1 = tl.load(kn_ptr + 1).to(tl.uint32, bitcast=True)
        k2 = tl.load(kn_ptr + 2).to(tl.uint32, bitcast=True)
        k3 = tl.load(kn_ptr + 3).to(tl.uint32, bitcast=True)
        k4 = tl.load(kn_ptr + 4).to(tl.uint32, bitcast=True)
        k5 = tl.load(kn_ptr + 5).to(tl.uint32, bitcast=True)
        k6 = tl.load(kn_ptr + 6).to(tl.uint32, bitcast=True)
        k7 = tl.load(kn_ptr + 7).to(tl.uint32, bitcast=True)
        n0 = tl.load(kn_ptr + 8).to(tl.uint32, bitcast=True)
        n1 = tl.load(kn_ptr + 9).to(tl.uint32, bitcast=True)
        n2 = tl.load(kn_ptr + 10).to(tl.uint32, bitcast=True)
        c0 = tl.load(kn_ptr + 11).to(tl.uint32, bitcast=True)
        c1 = tl.load(kn_ptr + 12).to(tl.uint32, bitcast=True)
        c2 = tl.load(kn_ptr + 13).to(tl.uint32, bitcast=True)
        c3 = tl.load(kn_ptr + 14).to(tl.uint32, bitcast=True)
        z = ctr * 0
        x0 = z + c0
        x1 = z + c1
        x2 = z + c2
        x3 = z + c3
        x4 = z + k0
        x5 = z + k1
        x6 = z + k2
        x7 = z + k3
        x8 = z + k4
        x9 = z + k5
        x10 = z + k6
        x11 = z + k7
        x12 = ctr
        x13 = z + n0
        x14 = z + n1
        x15 = z + n2
        for _ in tl.static_range(10):
            x0, x4, x8, x12 = _qr(x0, x4, x8, x12)
            x1, x5, x9, x13 = _qr(x1, x5, x9, x13)
            x2, x6, x10, x14 = _qr(x2, x6, x10, x14)
            x3, x7, x11, x15 = _qr(x3, x7, x11, x15)
            x0, x5, x10, x15 = _qr(x0, x5, x10, x15)
            x1, x6, x11, x12 = _qr(x1, x6, x11, x12)
            x2, x7, x8, x13 = _qr(x2, x7, x8, x13)
            x3, x4, x9, x14 = _qr(x3, x4, x9, x14)
        return (x0 + c0, x1 + c1, x2 + c2, x3 + c3, x4 + k0, x5 + k1, x6 + k2, x7 + k3,
                x8 + k4, x9 + k5, x10 + k6, x11 + k7, x12 + ctr, x13 + n0, x14 + n1, x15 + n2)

    @triton.jit
    def keystream_kernel(out_ptr, kn_ptr, counter, n_blocks, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        b = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = b < n_blocks
        ctr = (b + counter).to(tl.uint32)
        w = _block(kn_ptr, ctr)
        base = out_ptr + b * 16
        for i in tl.static_range(16):
            tl.store(base + i, w[i].to(tl.int32, bitcast=True), mask=mask)

    @triton.jit
    def _pair(lo0, hi0, lo1, hi1, lo2, hi2, scale, two_pi_2m53):
        k1 = ((hi0 & 0x1FFFFF).to(tl.uint64) << 32) | lo0.to(tl.uint64)  # low 53 bits
        k2 = ((hi1 & 0x1FFFFF).to(tl.uint64) << 32) | lo1.to(tl.uint64)  # low 53 bits
        w3 = ((hi2.to(tl.uint64) << 32) | lo2.to(tl.uint64)).to(tl.int64, bitcast=True)
        s2 = w3 >> 11  # signed: the top 53 bits, in [-2**52, 2**52)
        # u1 = k1·2**-53 + (k2 + 1)·2**-106: both products exact (powers of two, exact in
        # fp32 and fp64; no underflow), so fused into an FMA or not the sum is rounded once.
        u1 = k1.to(tl.float64) * 1.1102230246251565e-16 + (k2.to(tl.float64) + 1.0) * 1.2325951644078310e-32
        r = tl.sqrt(tl.log(u1) * scale)
        theta = s2.to(tl.float64) * two_pi_2m53
        return r * tl.cos(theta), r * tl.sin(theta)

    @triton.jit
    def _put(t_ptr, e, z, first, n, live):
        m = live & (e >= first) & (e < first + n)
        p = t_ptr + (e - first)
        old = tl.load(p, mask=m, other=0.0)
        tl.store(p, old + z.to(old.dtype), mask=m)

    @triton.jit
    def gauss_add_kernel(t_ptr, kn_ptr, c_ptr, first, n, block0, n_blocks, BLOCK: tl.constexpr):
        """t[e - first] += noise element e for e in [first, first + n): element e is normal
        e % 4 of block e // 4 (pairs of 8 32-bit words, cos then sin)."""
        pid = tl.program_id(0)
        b = block0 + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = b < block0 + n_blocks
        scale = tl.load(c_ptr)  # float64 scalars: -2·std², 2π·2**-53 (float args would be fp32)
        two_pi_2m53 = tl.load(c_ptr + 1)
        w = _block(kn_ptr, b.to(tl.uint32))
        e0 = b * 4
        for p in tl.static_range(2):
            za, zb = _pair(w[8 * p], w[8 * p + 1], w[8 * p + 2], w[8 * p + 3], w[8 * p + 4],
                           w[8 * p + 5], scale, two_pi_2m53)
            _put(t_ptr, e0 + 2 * p, za, first, n, live)
            _put(t_ptr, e0 + 2 * p + 1, zb, first, n, live)

    @triton.jit
    def pairs_kernel(w_ptr, out_ptr, c_ptr, n, BLOCK: tl.constexpr):
        """out[2i], out[2i + 1] = `_pair` of the 8 32-bit words w[8i … 8i + 7]: the fused
        kernel's transform on given words (tests: the fused kernel's words are ChaCha20's,
        which no test can choose)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        scale = tl.load(c_ptr)
        two_pi_2m53 = tl.load(c_ptr + 1)
        base = w_ptr + i * 8
        lo0 = tl.load(base, mask=m, other=0).to(tl.uint32, bitcast=True)
        hi0 = tl.load(base + 1, mask=m, other=0).to(tl.uint32, bitcast=True)
        lo1 = tl.load(base + 2, mask=m, other=0).to(tl.uint32, bitcast=True)
        hi1 = tl.load(base + 3, mask=m, other=0).to(tl.uint32, bitcast=True)
        lo2 = tl.load(base + 4, mask=m, other=0).to(tl.uint32, bitcast=True)
        hi2 = tl.load(base + 5, mask=m, other=0).to(tl.uint32, bitcast=True)
        za, zb = _pair(lo0, hi0, lo1, hi1, lo2, hi2, scale, two_pi_2m53)
        tl.store(out_ptr + 2 * i, za, mask=m)
        tl.store(out_ptr + 2 * i + 1, zb, mask=m)



def _key_nonce_tensor(key: bytes, nonce: bytes, device) -> torch.Tensor:
    words = (*struct.unpack("<8I", key), *struct.unpack("<3I", nonce), *CONSTANTS)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    return torch.tensor(signed, dtype=torch.int32, device=device)


_BLOCK = 256
_TWO_PI_2M53 = 2.0 * math.pi / float(2**53)


def keystream(key: bytes, nonce: bytes, counter: int, n_words: int, device) -> torch.Tensor:
    n_blocks = -(-n_words // 16)
    out = torch.empty(n_blocks * 16, dtype=torch.int32, device=device)
    if n_blocks:
        kn = _key_nonce_tensor(key, nonce, device)
        keystream_kernel[(triton.cdiv(n_blocks, _BLOCK),)](out, kn, counter, n_blocks, BLOCK=_BLOCK)
    return out[:n_words].to(torch.int64) & 0xFFFFFFFF


def pairs_from_words(words: torch.Tensor, std: float) -> torch.Tensor:
    """[n, 2] float64: the pairs the fused kernel makes of ``words`` ([n, 4] int64: each
    pair's four little-endian 64-bit words, as ``gaussian._pairs`` takes them), through the
    same `_pair` function. For the tests: they compare it with ``gaussian._pairs`` on words
    they choose (k1 = 0, where u1's low 53 bits decide the radius)."""
    n = words.shape[0]
    halves = torch.stack([words & 0xFFFFFFFF, (words >> 32) & 0xFFFFFFFF], -1).view(n, 8)
    w32 = torch.where(halves >= 2**31, halves - 2**32, halves).to(torch.int32)  # (lo, hi) each
    out = torch.empty(n, 2, dtype=torch.float64, device=words.device)
    consts = torch.tensor([-2.0 * float(std) * float(std), _TWO_PI_2M53], dtype=torch.float64,
                          device=words.device)
    if n:
        pairs_kernel[(triton.cdiv(n, _BLOCK),)](w32, out, consts, n, BLOCK=_BLOCK)
    return out


def gauss_add_(t: torch.Tensor, key: bytes, nonce: bytes, first: int, std: float) -> None:
    """``t.view(-1) += std·noise[first : first + t.numel()]`` of the stream (key, nonce)."""
    n = t.numel()
    if n == 0:
        return
    if not t.is_contiguous():
        raise ValueError("gauss_add_ needs a contiguous tensor")
    block0 = first // 4
    n_blocks = (first + n - 1) // 4 - block0 + 1
    kn = _key_nonce_tensor(key, nonce, t.device)
    consts = torch.tensor([-2.0 * float(std) * float(std), _TWO_PI_2M53], dtype=torch.float64, device=t.device)
    gauss_add_kernel[(triton.cdiv(n_blocks, _BLOCK),)](t, kn, consts, first, n, block0, n_blocks, BLOCK=_BLOCK)
