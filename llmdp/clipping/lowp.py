"""The clipping engine's contractions: exact products, float32 (float64) sums, tensor cores.

Every contraction of the engine (Gram matrices of the ghost norm, per-row gradients when a
layer is instantiated, the clipped sum Σ_r c_r G_rᵀA_r) takes the layer's input A and
output gradient G *as the model produced them* and returns float32 (float64 for float64
inputs):

* **bf16/fp16 on CUDA**: the operands go to the tensor cores as they are, with float32
  accumulation (``torch.bmm(..., out_dtype=torch.float32)``) — never a float32 copy of
  them, never a float32 SIMT GEMM. The clipped sum runs in a Triton kernel
  (``_triton_rowscaled``) that multiplies each row's float32 partial sum by its factor:
  the operands are never scaled and rounded back to bf16.
* **anything else** (CPU, float32 models, mixed dtypes, no Triton): the operands are
  widened to float32 — exact for bf16/fp16 — and contracted with TF32 *off* (switched off
  for the engine's own calls only and restored, whatever the user set for the model): a
  TF32 contraction would round float32 operands to 10 mantissa bits. Large operands are
  widened a slice at a time (``CHUNK_ELEMENTS``), so e.g. the LM head's [R, T, V] output
  gradient is never copied whole to float32.

So the norms and the clipped sum are formed from the same values (the model's A and G)
with exact products; they differ only by float32 summation order (relative ~1e-7), which
is the engine's stated precision (DESIGN §3.8).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

HALF = (torch.bfloat16, torch.float16)
CHUNK_ELEMENTS = 1 << 26  # the most elements widened to float32 at once on the fallback path

_OUT_DTYPE_OK: dict[int, bool] = {}  # CUDA device index -> bmm(out_dtype=float32) works
_TRITON_OK: dict[int, bool] = {}  # CUDA device index -> the Triton kernel built and ran


def acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


@contextmanager
def exact_fp32(device: torch.device):
    """TF32 off for the engine's float32 contractions on CUDA, restored afterwards."""
    if device.type != "cuda":
        yield
        return
    m = torch.backends.cuda.matmul
    # torch >= 2.9 has fp32_precision; reading the legacy allow_tf32 after a user set the
    # new one raises, while the new one reads and restores whatever the user set.
    name, off = ("fp32_precision", "ieee") if hasattr(m, "fp32_precision") else ("allow_tf32", False)
    prev = getattr(m, name)
    setattr(m, name, off)
    try:
        yield
    finally:
        setattr(m, name, prev)


def _index(x: torch.Tensor) -> int:
    """The device index of ``x`` (the current CUDA device for a bare ``cuda``, -1 off CUDA)."""
    if x.device.index is not None:
        return x.device.index
    return torch.cuda.current_device() if x.is_cuda else -1


def tensor_cores(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Both operands half precision of one dtype on a CUDA device whose torch has
    ``bmm(out_dtype=float32)``: contract them as they are."""
    if not (x.is_cuda and x.dtype in HALF and y.dtype == x.dtype):
        return False
    idx = _index(x)
    ok = _OUT_DTYPE_OK.get(idx)
    if ok is None:
        try:
            a = torch.ones((1, 2, 2), dtype=x.dtype, device=x.device)
            ok = torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _OUT_DTYPE_OK[idx] = ok
    return ok


def bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [B, m, k] @ y [B, k, n] -> [B, m, n] in float32 (float64), exact products.
    On the fallback path the k dimension is widened a slice at a time."""
    if tensor_cores(x, y):
        return torch.bmm(x, y, out_dtype=torch.float32)
    dt = acc_dtype(x, y)
    B, m, k = x.shape
    n = y.shape[2]
    widen = (x.dtype != dt) or (y.dtype != dt)
    step = k if not widen else max(1, CHUNK_ELEMENTS // max(1, B * max(m, n)))
    with exact_fp32(x.device):
        if step >= k:
            return torch.bmm(x.to(dt), y.to(dt))
        out = None
        for k0 in range(0, k, step):
            part = torch.bmm(x[:, :, k0:k0 + step].to(dt), y[:, k0:k0 + step].to(dt))
            out = part if out is None else out.add_(part)
        return out


def gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [R, T, a], y [R, S, a] -> x yᵀ [R, T, S] (float32/float64)."""
    return bmm(x, y.transpose(1, 2))


def per_row_tn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [R, T, a], y [R, T, b] -> x_rᵀ y_r for every row, [R, a, b] (float32/float64)."""
    return bmm(x.transpose(1, 2), y)


def row_scaled_tn(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Σ_r f_r · x_rᵀ y_r for x [R, T, a], y [R, T, b], f [R]: [a, b] in float32/float64.

    The factor multiplies float32 partial sums (Triton, CUDA half precision) or a float32
    copy of the smaller operand (fallback); never a half-precision operand."""
    if tensor_cores(x, y) and _TRITON_OK.get(_index(x), True):
        from llmdp.clipping import _triton_rowscaled

        if _triton_rowscaled.available():
            try:
                return _triton_rowscaled.row_scaled_tn(x, y, f)
            except Exception as e:  # noqa: BLE001 - a kernel that does not build here
                # Same values either way (the widened path below is exact too): warn once,
                # keep training, on the slower path, for this process.
                _TRITON_OK[_index(x)] = False
                warnings.warn(f"llmdp: the Triton clipped-sum kernel failed on {x.device} "
                              f"({type(e).__name__}: {e}); using the float32 fallback "
                              "(exact, slower)", RuntimeWarning, stacklevel=2)
    dt = acc_dtype(x, y)
    R, T, a = x.shape
    b = y.shape[2]
    f = f.to(device=x.device, dtype=dt)
    # Scale the smaller operand (a float32 copy of it); widen the larger by column slices.
    x_small = a <= b
    small, big = (x, y) if x_small else (y, x)
    s2 = (small.to(dt) * f[:, None, None]).reshape(R * T, small.shape[2])
    big2 = big.reshape(R * T, big.shape[2])
    n = big2.shape[1]
    step = n if big.dtype == dt else max(1, CHUNK_ELEMENTS // max(1, R * T))
    with exact_fp32(x.device):
        parts = []
        for j in range(0, n, step):
            sl = big2[:, j:j + step].to(dt)
            parts.append(s2.t() @ sl if x_small else sl.t() @ s2)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1 if x_small else 0)
