"""One Triton kernel on CUDA: ``lowp.row_norms``' upper bound on each row's norm, in one
launch (issue 50: the same bound by torch operations is about seven launches per call, for
every layer's output gradient, in the backward, where nothing hides their host time).

Each program owns one row of x [rows, k] (bf16, fp16 or float32, unit stride along k). It
reads the row once, in blocks of ``BLOCK``: the squares, widened to float32, added into a
float32 vector (the lanes' partial sums, then ``tl.sum``: some order; the bound holds for
any), and the largest |x_i|, taken on the bits (the sign bit cleared and compared as
integers: exact, and blind to flush-to-zero, which would read a subnormal as 0), turned
into its float64 value by integer operations (no float32 arithmetic touches it, as
``lowp.magnitude_of_bits``). Then, in float64, ñ·scale + √k·min(m, TINY)·(1 + 4·2⁻⁵³),
with ñ the correctly rounded float32 root. The float64 constants come from a float64
tensor (``_params``): a Python float passed to a Triton kernel is an fp32 argument, and
scale = 1 + γ rounded to fp32 could fall below 1 + γ (by up to 2⁻²⁴: a weaker bound).

TINY = 2⁻⁶² (``lowp.row_norms``' cap) covers flush-to-zero, which Triton may compile float32
arithmetic with (its libdevice calls are the ``ftz`` ones): a square or a partial sum below
2⁻¹²⁶ may become 0, an absolute error of at most 2⁻¹²⁶ each, at most 2k of them, so
‖x‖² ≤ ñ²(1 + γ)² + 2k·2⁻¹²⁶ ≤ ñ²(1 + γ)² + (√k·2⁻⁶²)²; and ‖x‖ ≤ √k·m always, so the
smaller of the two additive terms gives an upper bound either way, and a row of zeros is
exactly 0 (m = 0). The float64 operations are IEEE (no flush in float64).
"""

from __future__ import annotations

import math

import torch

from llmdp._triton import available, interpreting, tl, triton  # noqa: F401 - re-used names

#: Positions of a row read at once by one program.
BLOCK = 1024
#: The subnormal term's cap (``lowp.row_norms``): 2⁻⁶² covers flush-to-zero.
TINY = 2.0**-62
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _row_bound(base, K, P, OUT, BLOCK: tl.constexpr, BF16: tl.constexpr):
        """One row's bound (module docstring): its squares and largest magnitude read once."""
        scale, root_k, tiny = tl.load(P), tl.load(P + 1), tl.load(P + 2)  # float64
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        mbits = tl.zeros([BLOCK], dtype=tl.int32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            raw = tl.load(base + offs, mask=offs < K, other=0.0)
            x = raw.to(tl.float32)
            acc += x * x
            if BF16:  # |x| from the input's own bits (a bf16 subnormal is a float32 one)
                bits = (raw.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) << 16
            else:  # float32's bits; fp16's values are normal float32 ones
                bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            mbits = tl.maximum(mbits, bits)
        s = tl.sum(acc, axis=0)
        mb = tl.max(mbits, axis=0)
        e = mb >> 23
        mant = (mb & 0x7FFFFF) + tl.where(e > 0, 1 << 23, 0)
        p2 = ((tl.maximum(e, 1) - 150 + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
        m = mant.to(tl.float64) * p2  # max |x_i| in float64, exactly
        n = tl.sqrt_rn(s)
        out = n.to(tl.float64) * scale + tl.minimum(m, tiny) * root_k
        tl.store(OUT, out)

    @triton.jit
    def row_norm_bounds_kernel(X, OUT, K, stride, P,
                               BLOCK: tl.constexpr, WIDE: tl.constexpr, BF16: tl.constexpr):
        row = tl.program_id(0)
        if WIDE:
            row = row.to(tl.int64)
        _row_bound(X + row * stride, K, P, OUT + row, BLOCK, BF16)

    @triton.jit(do_not_specialize=["KX", "KY", "sx", "sy", "ROWS_X"])
    def row_norm_bounds2_kernel(X, Y, OUT, KX, KY, sx, sy, ROWS_X, P,
                                BLOCK: tl.constexpr, WIDE: tl.constexpr, BF16: tl.constexpr):
        """The rows of two tensors of one dtype in one launch (``row_norm_bounds2``): the
        programs before ``ROWS_X`` take x's rows, the others y's, each with its own
        parameters (P: x's three, then y's)."""
        row = tl.program_id(0)
        if WIDE:
            row = row.to(tl.int64)
        if row < ROWS_X:
            _row_bound(X + row * sx, KX, P, OUT + row, BLOCK, BF16)
        else:
            _row_bound(Y + (row - ROWS_X) * sy, KY, P + 3, OUT + row, BLOCK, BF16)


def serves(x: torch.Tensor) -> bool:
    """The kernel takes these rows: CUDA (or the interpreter), a narrow float dtype, unit
    stride along the last dimension, Triton built."""
    return (x.dtype in _DTYPES and x.dim() >= 1 and x.shape[-1] > 0 and x.stride(-1) == 1
            and (x.is_cuda or interpreting()) and available())


def row_norm_bounds(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The bound for every row of x (``x.shape[:-1]``, float64), ``scale`` = 1 + γ as
    ``lowp.row_norms`` computes it (with its float64 rounding)."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    out = torch.empty(rows, dtype=torch.float64, device=x.device)
    if rows:
        wide = rows * max(x2.stride(0), k) >= 2**31
        p = _params(scale, math.sqrt(k) * (1.0 + 4.0 * 2.0**-53), x.device)
        row_norm_bounds_kernel[(rows,)](x2, out, k, x2.stride(0), p,
                                        BLOCK=min(BLOCK, triton.next_power_of_2(k)), WIDE=wide,
                                        BF16=x.dtype == torch.bfloat16)
    return out.reshape(lead)


def row_norm_bounds2(x: torch.Tensor, y: torch.Tensor, scale_x: float,
                     scale_y: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_norm_bounds`` of x and of y (one dtype, both served) in one launch: the same
    program per row, so the same bits as two launches."""
    kx, ky = x.shape[-1], y.shape[-1]
    x2, y2 = x.reshape(-1, kx), y.reshape(-1, ky)
    rx, ry = x2.shape[0], y2.shape[0]
    out = torch.empty(rx + ry, dtype=torch.float64, device=x.device)
    if rx + ry:
        wide = max(rx * max(x2.stride(0), kx), ry * max(y2.stride(0), ky), rx + ry) >= 2**31
        p = _params2(scale_x, math.sqrt(kx) * (1.0 + 4.0 * 2.0**-53),
                     scale_y, math.sqrt(ky) * (1.0 + 4.0 * 2.0**-53), x.device)
        row_norm_bounds2_kernel[(rx + ry,)](
            x2, y2, out, kx, ky, x2.stride(0), y2.stride(0), rx, p,
            BLOCK=min(BLOCK, triton.next_power_of_2(max(kx, ky))), WIDE=wide,
            BF16=x.dtype == torch.bfloat16)
    return out[:rx].reshape(x.shape[:-1]), out[rx:].reshape(y.shape[:-1])


_PARAMS: dict = {}


def _params2(scale_x: float, root_x: float, scale_y: float, root_y: float,
             device: torch.device) -> torch.Tensor:
    """x's [scale, √k, TINY] then y's, as ``_params`` (kept)."""
    key = (scale_x, root_x, scale_y, root_y, str(device))
    t = _PARAMS.get(key)
    if t is None:
        if len(_PARAMS) > 256:
            _PARAMS.clear()
        t = _PARAMS[key] = torch.tensor([scale_x, root_x, TINY, scale_y, root_y, TINY],
                                        dtype=torch.float64, device=device)
    return t


def _params(scale: float, root_k: float, device: torch.device) -> torch.Tensor:
    """[scale, root_k, TINY] as a float64 tensor on ``device``, kept (the same few shapes
    every step: no host-to-device copy per call)."""
    key = (scale, root_k, str(device))
    t = _PARAMS.get(key)
    if t is None:
        if len(_PARAMS) > 256:
            _PARAMS.clear()
        t = _PARAMS[key] = torch.tensor([scale, root_k, TINY], dtype=torch.float64, device=device)
    return t
