"""The clipping engine's contractions, and the rounding error each one can make.

Every contraction of the engine takes a layer's input A and output gradient G *as the
model produced them* (bf16, fp16, float32 or float64; under autocast, what the matmul
read) and has a stated error bound, which the engine adds to the norms it clips with
(``norms.py``, DESIGN, invariant `precision-never-widens`):

* **the Gram side** (Gram matrices of the ghost norm, the cross terms, the norms of
  instantiated gradients): the operands are widened to float64 — exact for every
  floating input dtype, and a product of two widened float32 (or narrower) values is exact
  in float64 (24 + 24 significant bits ≤ 53) — and contracted in float64 (``bmm``,
  ``gram``; ``row_norms``, upper bounds only, reduces narrower inputs with a float32 result
  and scales it up by its bound instead). A dot product of n such terms, summed in any
  order, is within γ_n(2⁻⁵³)·Σ|terms| of its exact value (Higham, *Accuracy and
  Stability of Numerical Algorithms*, §3.1; γ_n(u) = n·u/(1 − n·u)). On CUDA these are
  float64 GEMMs (the FP64 tensor cores of A100/H100-class GPUs, at about their float32
  SIMT rate, ~1/15 of bf16; the layer choice counts them at the device's float64 rate,
  ``norms.device_spec``). float32 Gram matrices with an a-priori bound are not used: their
  worst-case error at a hidden size of 4,096 is ≈ 2.4·10⁻⁴ of |A||A|ᵀ per entry, more than
  1 % of the norm on any real sequence (``norms`` module docstring, 4); ``gram.py`` uses
  them with an a-posteriori bound instead, formed by ``gram_fast`` in chunks of the
  contraction (``gram_fast_bound``: γ grows with the chunk, not with the width).
* **the clipped sum** Σ_r c_r G_rᵀA_r (``row_scaled_tn``):
  - bf16/fp16 on CUDA: the operands go to the tensor cores as they are, with float32
    accumulation, in a Triton kernel (``_triton_rowscaled``) that multiplies each chunk's
    float32 partial sum (one ``tl.dot`` over at most ``CHUNK_T`` = 128 positions of a row)
    by the row's factor (never a half-precision operand). Its error is
    bounded with the tensor cores' measured arithmetic (exact products, each block of
    products aligned to its largest term and truncated: Fasi, Higham, Mikaitis, Pranesh,
    "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021; Khattak & Mikaitis 2025),
    taken as γ_n with u = 2⁻²² (four times float32's unit roundoff),
    n = min(T, 128) + 1 + ⌈(R·⌈T/128⌉ + R)/4⌉ (``_triton_rowscaled.error_count``);
  - anything else (CPU, float32 models, mixed dtypes, no Triton): widened to float32
    (exact), float32 GEMMs over groups of rows of about ``ROW_GROUP_POSITIONS`` positions,
    each into its own result, added to a float32 total: γ_{g+2+m}(2⁻²⁴) for m groups of
    g positions (one float64 GEMM for float64 inputs: γ_{RT+2}(2⁻⁵³)), plus one relative
    rounding of the result.
  ``row_scaled_bound`` says which bound applies to the path ``row_scaled_tn`` will take.
* **instantiated per-row gradients** (``per_row_tn``, then reused for the clipped sum):
  float32 accumulation (tensor cores for bf16/fp16 on CUDA), bounded by γ_{T+1}(u) per
  entry (``fast_bound``), u = 2⁻²⁴ or 2⁻²² (2⁻⁵³ for float64 operands); the engine adds
  that bound and recomputes a unit in float64 where it is a real part of the norm.

Large operands are widened a slice at a time (``CHUNK_ELEMENTS``), so e.g. the LM head's
[R, T, V] output gradient is never copied whole to float64. Float32 contractions run in
IEEE float32 (``exact_fp32``: TF32 and oneDNN's reduced modes off), whatever the user set.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import torch

HALF = (torch.bfloat16, torch.float16)
CHUNK_ELEMENTS = 1 << 25  # the most elements widened to float64 at once (256 MiB)

U64 = 2.0**-53  # unit roundoff of float64 (round to nearest)
U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)
UTC = 2.0**-22  # tensor-core float32 accumulation (truncating block FMA): 4·U32, see above

_OUT_DTYPE_OK: dict[int, bool] = {}  # CUDA device index -> bmm(out_dtype=float32) works
_TRITON_OK: dict[int, bool] = {}  # CUDA device index -> the Triton kernel built and ran
_ROWNORMS_OK: dict[int, bool] = {}  # the same for the row-norm kernel (_triton_rownorms)


def gamma(n: int | float, u: float) -> float:
    """γ_n(u) = n·u/(1 − n·u), rounded up (inf when n·u ≥ 1/2: no useful bound). The
    relative error of n successive roundings, or of a sum of n + 1 terms in any order,
    is at most γ_n."""
    nu = float(n) * u
    if not nu < 0.5:
        return math.inf
    return nu / (1.0 - nu) * (1.0 + 2.0**-50)  # three float64 roundings, upward


def result_dtype(*ts: torch.Tensor) -> torch.dtype:
    """The dtype the engine's results have: float64 if an operand is, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


acc_dtype = result_dtype  # the name older callers use


@contextmanager
def exact_fp32(device: torch.device):
    """IEEE float32 for the engine's float32 contractions, restored afterwards: TF32 off on
    CUDA; on CPU, oneDNN's reduced-precision float32 modes (bf16/TF32 inside a float32
    matmul, which ``torch.set_float32_matmul_precision`` can switch on) off."""
    if device.type != "cuda":
        m = getattr(torch.backends.mkldnn, "matmul", None)
        if m is None or not hasattr(m, "fp32_precision"):
            yield
            return
        prev = m.fp32_precision
        m.fp32_precision = "ieee"
        try:
            yield
        finally:
            m.fp32_precision = prev
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


def on_cpu(x: torch.Tensor) -> bool:
    """Whether the engine takes its CPU-only choices for x (``gram.use_lowp``'s width rule,
    ``norms._sq_chunked32``): x is on the CPU. ``benchmarks/launches.py``'s CUDA emulation
    answers False, so that it counts the GPU's paths."""
    return x.device.type == "cpu"


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
    """x [B, m, k] @ y [B, k, n] -> [B, m, n] in float64: exact products, float64 sums
    (each entry within γ_k(2⁻⁵³)·Σ|x||y|, γ_{k+1} for float64 operands). The k dimension
    is widened a slice at a time."""
    return _widened_bmm(x, y, torch.float64)


def _widened_bmm(x: torch.Tensor, y: torch.Tensor, dt: torch.dtype, step: int | None = None) -> torch.Tensor:
    """x @ y in ``dt``, the operands widened to ``dt`` a slice of k at a time (never a
    whole widened copy of a large operand), each slice's product added to the first's.
    ``step``: slices of exactly that length (``gram_fast``, whose bound counts them)."""
    B, m, k = x.shape
    n = y.shape[2]
    widen = (x.dtype != dt) or (y.dtype != dt)
    if step is None:
        step = k if not widen else max(1, CHUNK_ELEMENTS // max(1, B * max(m, n)))
    if step >= k:
        return torch.bmm(x.to(dt), y.to(dt))
    out = None
    for k0 in range(0, k, step):
        part = torch.bmm(x[:, :, k0:k0 + step].to(dt), y[:, k0:k0 + step].to(dt))
        out = part if out is None else out.add_(part)
    return out


def gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [R, T, a], y [R, S, a] -> x yᵀ [R, T, S] in float64 (x xᵀ: x widened once)."""
    if y is x and x.dtype != torch.float64 and x.numel() <= CHUNK_ELEMENTS:
        w = x.to(torch.float64)
        return torch.bmm(w, w.transpose(1, 2))
    return bmm(x, y.transpose(1, 2))


def bmm_fast(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [B, m, k] @ y [B, k, n] -> [B, m, n] in float32 (float64 for float64 operands):
    bf16/fp16 on CUDA on tensor cores with float32 accumulation, else widened to float32
    (exact) and contracted with TF32 (and oneDNN's reduced float32 modes) off. Each entry
    is within ``fast_bound``'s γ_n(u)·Σ|x||y| of its exact value. On tensor cores the
    contraction runs in chunks of the kernels' ``CHUNK_T`` (a fresh truncating chain each,
    added in float32), so the bound grows with the chunk, not with k."""
    if tensor_cores(x, y):
        from llmdp.clipping._triton_rowscaled import CHUNK_T

        k = x.shape[2]
        out = None
        for k0 in range(0, k, CHUNK_T):
            part = torch.bmm(x[:, :, k0:k0 + CHUNK_T], y[:, k0:k0 + CHUNK_T], out_dtype=torch.float32)
            out = part if out is None else out.add_(part)
        return out
    with exact_fp32(x.device):
        return _widened_bmm(x, y, result_dtype(x, y))


GRAM_CHUNK = 256  # contraction length of one float32 GEMM of ``gram_fast`` off tensor cores


def gram_fast(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [B, m, k] @ y [B, k, n] for a Gram matrix in float32: ``bmm_fast`` on tensor cores
    (chunks of ``CHUNK_T``); elsewhere float32 operands (narrower ones widened to float32
    a chunk at a time, exact) contracted ``GRAM_CHUNK`` at a time, each chunk an IEEE
    float32 GEMM whose result is added to a float32 total. The bound (``gram_fast_bound``)
    then grows with the chunk and the number of chunks, not with k: a Gram over the LM
    head's 32,000-wide output gradient is bounded by γ_381(2⁻²⁴), not γ_32001. Float64
    operands: ``bmm_fast`` (one float64 contraction)."""
    if tensor_cores(x, y) or result_dtype(x, y) == torch.float64:
        return bmm_fast(x, y)
    with exact_fp32(x.device):
        return _widened_bmm(x, y, torch.float32, step=GRAM_CHUNK)


def gram_fast_bound(x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[float, int]:
    """(u, n) for ``gram_fast`` over a contraction of length k: each entry within
    γ_n(u)·Σ|x||y| of its exact value. Off tensor cores, in float32: a product and its
    chunk's chain of at most c = ``GRAM_CHUNK`` terms (in any order: c roundings, γ_c),
    then one rounding per later chunk's add to the total, m − 1 of them (m = ⌈k/c⌉
    chunks): n = c + m ≥ min(k, c) + m − 1 + 1; never more than ``fast_bound``'s k + 1
    (c + m − 1 ≤ c·m)."""
    if tensor_cores(x, y) or result_dtype(x, y) == torch.float64:
        return fast_bound(x, y, k)
    c = min(k, GRAM_CHUNK)
    return U32, min(k + 1, c + -(-k // GRAM_CHUNK))


def fast_bound(x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[float, int]:
    """(u, n) for ``bmm_fast`` over a contraction of length k: tensor cores (u = 2⁻²²): the
    chunked chain of one row of the norm kernel (``unit_norm_count(k, 1)``); IEEE float32
    or float64: n = k + 1 (the products' rounding, the sum's chain)."""
    if tensor_cores(x, y):
        return UTC, unit_norm_count(k, 1)
    return (U64 if result_dtype(x, y) == torch.float64 else U32), k + 1


def per_row_tn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [R, T, a], y [R, T, b] -> x_rᵀ y_r for every row, [R, a, b] in float32 (float64
    for float64 operands): an instantiated layer's per-row gradients, whose error
    (``fast_bound`` over T) the engine bounds and adds (``rules/linear.py``)."""
    return bmm_fast(x.transpose(1, 2), y)


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """An upper bound on ‖x[..., :]‖ over the last dimension, in float64 (the engine uses
    these norms as upper bounds, N_u, only).

    float64 input: the float64 norm, within γ_{k+2}(2⁻⁵³) of the exact one (k squares,
    their sum, the root), relatively. Anything narrower (float32, bf16, fp16): one
    reduction with a float32 result, no float64 copy (issue 50, item 4: the LM head's
    [R, T, V] output gradient, peft's float32 adapters). Whatever the reduction's
    accumulator (float32 on CUDA, wider on the CPU) and order, each square rounds by at most
    a relative 2⁻²⁴, the sum of k nonnegative terms by γ_{k−1}, the root and the result's
    cast by one rounding each, and a square or partial sum in float32's subnormal range (or
    flushed to 0, where the arithmetic flushes) by at most an absolute 2⁻¹²⁶, 2k of them:
    the computed ñ satisfies ‖x‖² ≤ ñ²·(1 + γ_{k+3}(2⁻²⁴))² + k·2⁻¹²⁴, so

        ‖x‖ ≤ ñ·(1 + γ_{k+3}(2⁻²⁴)) + √k·2⁻⁶²;

    and also ‖x‖ ≤ √k·m, m = max|x_i| (read on the bits: exact, whatever the flush mode):

        ‖x‖ ≤ ñ·(1 + γ_{k+3}(2⁻²⁴)) + √k·min(m, 2⁻⁶²),

    which is what is returned, rounded up (the float64 product and sum: the two extra
    roundings in γ_{k+3} are far more than their 2⁻⁵³): never below the exact norm, at most
    ~2·γ above it, and exactly 0 for a row of zeros, which the fallback needs to tell a
    gradient that is exactly 0 (a LoRA B initialized to 0) from a bound that is all
    rounding (``norms.worth_recomputing``). On CUDA one Triton kernel forms it
    (``_triton_rownorms``: one launch instead of seven). A norm past float32's range
    (‖x‖ ≥ 2¹²⁸) is inf: the unit's bound is then not finite and it adds nothing
    (``norms.factors``): utility, never privacy."""
    k = x.shape[-1]
    if x.dtype == torch.float64 or x.dtype not in _ABS_BITS:
        return torch.linalg.vector_norm(x.to(torch.float64), dim=-1)
    scale = _row_scale(k)
    from llmdp.clipping import _triton_rownorms

    if _triton_rownorms.serves(x) and _ROWNORMS_OK.get(_index(x), True):
        try:
            return _triton_rownorms.row_norm_bounds(x, scale)
        except Exception as e:  # noqa: BLE001 - a kernel that does not build or run here
            _kernel_failed(_ROWNORMS_OK, "row-norm", x, e, "torch operations (the same bound)")
    return _row_norms_torch(x, scale)


def _row_scale(k: int) -> float:
    """``row_norms``' factor 1 + γ_{k+3}(2⁻²⁴), with the float64 mul and add, rounded up."""
    return (1.0 + gamma(k + 3, U32)) * (1.0 + 2.0 * U64)


def row_norms2(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``row_norms(x)``, ``row_norms(y)``): in one launch of the row-norm kernel where it
    serves both (one narrow dtype, one device; a Linear's A and G under autocast), the same
    program per row as two launches, so the same values."""
    from llmdp.clipping import _triton_rownorms

    if (x.dtype == y.dtype and x.dtype in _ABS_BITS and x.device == y.device
            and _triton_rownorms.serves(x) and _triton_rownorms.serves(y)
            and _ROWNORMS_OK.get(_index(x), True)):
        try:
            return _triton_rownorms.row_norm_bounds2(x, y, _row_scale(x.shape[-1]), _row_scale(y.shape[-1]))
        except Exception as e:  # noqa: BLE001 - as row_norms
            _kernel_failed(_ROWNORMS_OK, "row-norm", x, e, "torch operations (the same bound)")
    return row_norms(x), row_norms(y)


#: On the CPU, the book-keeping engine takes the row norms of its calls' small inputs and
#: output gradients in the step's one bound computation (`LazyRowNorms`); False: per call.
DEFER_CPU_NORMS = True


class LazyRowNorms:
    """``row_norms(x)`` not yet taken (issue 50). On the CPU a small operation costs ~10 µs
    of host time, and ``row_norms`` is ten of them (the float32 reduction, its float64
    scale and term, the zero rows read on their bits): for LoRA's adapters, whose inputs
    are a few kB, that is most of what a call costs. Deferred, the row norms of the
    step's calls are taken in its one bound computation (``stacked.Stack.of``), those of
    one shape, dtype and device stacked and reduced at once (``form_all``): the same
    program per row — a reduction along the last dimension, elementwise float64 operations,
    the zero rows' bits — so a row's bound does not depend on the rows stacked with it
    (tests/clipping/test_deferred_norms.py compares the bits). Only for an ``x`` that the
    engine keeps until then anyway (book-keeping keeps A and G for the clipped sum). An x
    up to ``MAX_BYTES`` is stacked (a small copy, then one reduction); a larger one is not
    copied: each is reduced into its slice of one float32 buffer and the rest of
    ``row_norms`` (the float64 scale and term, the zero rows' bits) runs once on the buffer
    (``_row_norms_torch_many``): the ~170 µs of fixed cost of ``row_norms``' small
    operations is paid once per shape, not once per call (LoRA's adapters' output
    gradients: a few hundred kB each, forty a step at the benchmark shape). Where the
    one-buffer path does not serve (a float64 x, a device; ``many_serves``) a large x is
    not deferred."""

    __slots__ = ("x", "_n")
    MAX_BYTES = 1 << 16

    def __init__(self, x: torch.Tensor):
        self.x, self._n = x, None

    def get(self) -> torch.Tensor:
        if self._n is None:
            self._n, self.x = row_norms(self.x), None
        return self._n

    @staticmethod
    def form_all(items: list) -> None:
        """Take every not-yet-taken one of ``items`` (others ignored): those of one shape,
        dtype and device in one ``row_norms`` of their stack."""
        todo = list({id(it): it for it in items if isinstance(it, LazyRowNorms) and it._n is None}.values())
        for idx in group_by(todo, lambda it: (tuple(it.x.shape), it.x.dtype, it.x.device)):
            if len(idx) == 1:
                todo[idx[0]].get()
                continue
            xs = [todo[i].x for i in idx]
            if xs[0].numel() * xs[0].element_size() <= LazyRowNorms.MAX_BYTES:
                n = row_norms(torch.stack(xs))
            else:  # no copy of large ones (``many_serves``: deferred only where it serves)
                n = _row_norms_torch_many(xs, _row_scale(xs[0].shape[-1]))
            for j, i in enumerate(idx):
                todo[i]._n, todo[i].x = n[j], None


def group_by(items: list, key) -> list[list[int]]:
    """The indices of ``items`` grouped by ``key(item)``, groups and members in first-seen
    order: the calls of one shape that a deferred bound forms at once (`LazyRowNorms`,
    `gram.PendingGram`, `norms.PendingRoot`, `norms.PendingMag`)."""
    groups: dict = {}
    for i, it in enumerate(items):
        groups.setdefault(key(it), []).append(i)
    return list(groups.values())


def resolved(n):
    """A row-norm tensor, taken now if it was deferred (`LazyRowNorms`)."""
    return n.get() if isinstance(n, LazyRowNorms) else n


def cpu_deferral(x: torch.Tensor, defer: bool) -> bool:
    """Whether bounds of ``x`` may be left to the step's bound computation on the CPU: the
    engine keeps x until then (``defer``: ``Units.defer``), x on the CPU, ``DEFER_CPU_NORMS``."""
    return bool(defer) and DEFER_CPU_NORMS and on_cpu(x)


def deferrable(x: torch.Tensor, defer: bool) -> bool:
    """Whether ``x``'s row norms may be deferred (`LazyRowNorms`): ``cpu_deferral``, and x
    small or formed without a copy there (``many_serves``)."""
    return cpu_deferral(x, defer) and (x.numel() * x.element_size() <= LazyRowNorms.MAX_BYTES
                                       or many_serves(x))


#: Large row norms deferred on the CPU and formed without a copy (`_row_norms_torch_many`);
#: False: a large x's row norms are taken per call (tests compare the two).
DEFER_LARGE_CPU_NORMS = True


def many_serves(x: torch.Tensor) -> bool:
    """``_row_norms_torch_many`` forms ``row_norms(x)``'s bits: a narrow float x on the
    CPU, where ``row_norms`` takes ``_row_norms_torch``'s CPU path (no Triton kernel)."""
    from llmdp.clipping import _triton_rownorms

    return (DEFER_LARGE_CPU_NORMS and x.dtype in _ABS_BITS and x.device.type == "cpu"
            and CPU_ZERO_ROWS_ONLY and x.dim() >= 1 and x.shape[-1] > 0
            and not _triton_rownorms.serves(x))


def row_norms_maybe_lazy(x: torch.Tensor, defer: bool):
    """``row_norms(x)``, or a `LazyRowNorms` of it where ``deferrable``."""
    return LazyRowNorms(x) if deferrable(x, defer) else row_norms(x)


def _row_norms_torch(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``row_norms``' bound by torch operations (no Triton).

    m is read on the bits and turned into its float64 value by integer operations
    (``magnitude_of_bits``): no float32 arithmetic touches it, so a subnormal m is not
    flushed to 0 where the arithmetic flushes (``torch.set_flush_denormal``). Off CUDA,
    min(m, 2⁻⁶²) is taken as 2⁻⁶² (never smaller: still an upper bound) for the rows whose
    float32 norm is not 0 — such a row is not all zeros — and m is read only for the rows
    whose norm is 0 (all zeros, or all subnormal where the arithmetic flushes them): one
    pass over x instead of three (finding those rows costs no device sync on the CPU;
    ``CPU_ZERO_ROWS_ONLY``). Those rows are usual, not rare — a causal LM's last position
    has no label, so every layer's output gradient is 0 there — so their common case, all
    of them exactly 0 (every m read 0), takes five small operations: their result is 0."""
    k = x.shape[-1]
    n32 = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    if x.device.type != "cpu" or not CPU_ZERO_ROWS_ONLY:
        tiny = magnitude_of_bits(_abs_bits(x).amax(-1)).clamp_(max=ROW_NORM_TINY)
        return (n32.to(torch.float64) * scale).add_(tiny, alpha=math.sqrt(k) * (1.0 + 4.0 * U64))
    return _cpu_bounds(n32, k, scale, lambda zero: x[zero])


def _row_norms_torch_many(xs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """``_row_norms_torch(x, scale)`` for each x of ``xs`` (one shape and dtype, the CPU:
    ``many_serves``), stacked [len(xs), *x.shape[:-1]], bit for bit, without a copy of any
    x: each x's float32 reduction is the same operation on the same tensor (written into its
    slice of one buffer), and the rest (``_cpu_bounds``) runs once on the buffer, its zero
    rows gathered from each x in the buffer's row-major order."""
    n32 = torch.empty((len(xs), *xs[0].shape[:-1]), dtype=torch.float32)
    for i, x in enumerate(xs):
        torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32, out=n32[i])
    return _cpu_bounds(n32, xs[0].shape[-1], scale,
                       lambda zero: torch.cat([x[z] for x, z in zip(xs, zero)]))


def _cpu_bounds(n32: torch.Tensor, k: int, scale: float, zero_rows) -> torch.Tensor:
    """``_row_norms_torch``'s CPU bound from the rows' float32 norms ``n32`` (rows of k
    entries); ``zero_rows(zero)`` gives the rows whose norm is 0, in ``zero``'s row-major
    order (the order ``out[zero]`` assigns). Elementwise float64 operations and the zero
    rows' bits: a row's bound does not depend on the rows formed with it. Where some zero
    row is not all zeros, an all-zero row's value is magnitude 0 (+0.0) times the factor,
    +0.0, as ``masked_fill_`` writes it."""
    tiny_f = math.sqrt(k) * (1.0 + 4.0 * U64)
    # ROW_NORM_TINY·tiny_f is a float64 product: rounded up (the other rows' term is
    # ≥ the same product computed tensor-wise below, which rounds the same way)
    out = (n32.to(torch.float64) * scale).add_(ROW_NORM_TINY * tiny_f * (1.0 + 2.0 * U64))
    zero = n32 == 0
    if bool(zero.any()):
        m_bits = _abs_bits(zero_rows(zero)).amax(-1)
        if bool(m_bits.any()):  # a row of subnormals (flushed or underflowed): m read
            out[zero] = magnitude_of_bits(m_bits).clamp_(max=ROW_NORM_TINY).mul_(tiny_f)
        else:  # every such row is all zeros: exactly 0
            out.masked_fill_(zero, 0.0)
    return out


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as the int32 bits of a float32 (the sign cleared): bf16's shifted into place,
    fp16's via float32 (fp16 values are normal float32 ones: the conversion is exact)."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).to(torch.int32) & 0x7FFF) << 16
    if x.dtype == torch.float16:
        x = x.float()
    return x.view(torch.int32) & 0x7FFFFFFF


def magnitude_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """The float64 value of nonnegative float32 bit patterns, by integer operations only
    (exact: subnormal float32 values are normal float64 ones), so a flush-to-zero mode of
    float32 arithmetic cannot turn a subnormal into 0."""
    b = bits.to(torch.int64)
    e = b >> 23
    mant = (b & 0x7FFFFF) + torch.where(e > 0, 1 << 23, 0)
    p2 = ((torch.clamp(e, min=1) - 150 + 1023) << 52).view(torch.float64)  # 2^(max(e,1) − 150)
    return mant.to(torch.float64) * p2


#: ``_row_norms_torch`` on the CPU reads the bits of the rows whose float32 norm is 0 only
#: (a data-dependent read: free on the CPU, a host sync on a device, which never takes it).
#: The sync-counting tests switch it off to count the device path.
CPU_ZERO_ROWS_ONLY = True

#: The cap of ``row_norms``' subnormal term (its docstring).
ROW_NORM_TINY = 2.0**-62
_ABS_BITS = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes read on their bits


def _triton_path(x: torch.Tensor, y: torch.Tensor) -> bool:
    if not (tensor_cores(x, y) and _TRITON_OK.get(_index(x), True)):
        return False
    from llmdp.clipping import _triton_rowscaled

    return _triton_rowscaled.available()


def tile_norms(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The per-unit norm kernel serves these operands (CUDA half precision, Triton built)."""
    return _triton_path(x, y)


def unit_sq_norms(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, ptr: torch.Tensor,
                  num_units: int) -> torch.Tensor | None:
    """‖h̃_u‖² [U] float64 for h̃_u the float32 tensor-core value of Σ_{r in u} x_rᵀ y_r
    (``_triton_rowscaled.unit_sq_norms``): each entry of h̃_u within γ_n(2⁻²²)·Σ|x||y| of
    its exact value, n = ``unit_norm_count``; the float64 sum of squares within
    γ_{a·b+4}(2⁻⁵³) of ‖h̃_u‖², relatively (squares of float32 values are exact in float64;
    a tile's padding adds exact zeros, so at most a·b − 1 additions can round). Only where
    ``tile_norms``. None if the kernel fails (it does not build or run here): the caller
    takes another path, and neither Triton kernel of ``_triton_rowscaled`` is used again on
    this device (``_TRITON_OK``, as a failed clipped sum)."""
    from llmdp.clipping import _triton_rowscaled

    try:
        return _triton_rowscaled.unit_sq_norms(x, y, rows, ptr, num_units)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build or run here
        _kernel_failed(_TRITON_OK, "per-unit norm", x, e, "the float64 Gram matrices (exact products, slower)")
        return None


def unit_norm_count(T: int, max_rows: int) -> int:
    """n of ``unit_sq_norms``' entry bound (``_triton_rowscaled.norm_error_count``)."""
    from llmdp.clipping import _triton_rowscaled

    return _triton_rowscaled.norm_error_count(T, max_rows)


def row_scaled_bound(x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """(u, n): the absolute error of ``row_scaled_tn(x, y, f)`` is at most
    γ_n(u)·Σ_r |f_r|·|x_r|ᵀ|y_r| entrywise, on the path it will take (the result's final
    rounding to float32, and the factor's, are relative roundings the caller counts).
    If the Triton kernel fails and the float64 path serves instead, its error is smaller."""
    R, T = x.shape[0], x.shape[1]
    if _triton_path(x, y):
        from llmdp.clipping import _triton_rowscaled

        return UTC, _triton_rowscaled.error_count(R, T)
    if result_dtype(x, y) == torch.float64:
        return U64, R * T + 2
    # float32 over one group of rows (the scaled operand's rounding, the products, the
    # chain: at most R rows), then one float32 rounding per later group's add to the total
    rows = min(_rows_per_group(T), R)
    return U32, rows * T + 2 + -(-R // rows)


def _triton_failed(x: torch.Tensor, e: Exception) -> None:
    """The float64 path has a smaller error than the bound the norms were given for the
    kernel's: warn once, keep training on it, for this process."""
    _kernel_failed(_TRITON_OK, "clipped-sum", x, e, "the float64 fallback (exact products, slower)")


def _kernel_failed(flags: dict, kernel: str, x: torch.Tensor, e: Exception, instead: str) -> None:
    """A Triton kernel that failed on x's device is not used there again in this process
    (``flags``); the path taken instead computes the same quantity within a bound no larger
    than the kernel's (never a weaker bound). Warned once per device and kernel."""
    flags[_index(x)] = False
    warnings.warn(f"llmdp: the Triton {kernel} kernel failed on {x.device} "
                  f"({type(e).__name__}: {e}); using {instead}", RuntimeWarning, stacklevel=3)


# Positions per float32 GEMM of the CPU clipped sum (each group's result added to the
# float32 total). Measured on one core (BENCHMARKS, issue 50): the d512 LM head's sum over
# T256 x 8 takes 626 ms in groups of 256 positions, 510 ms in one of 2,048, as the
# non-private weight gradient's one GEMM (505 ms); the bound grows to γ_2051(2⁻²⁴)·Σ|f||x||y|,
# still a small share of the norm (the step's largest share is printed by
# benchmarks/step_ratio.py), and a larger share costs utility, never privacy.
ROW_GROUP_POSITIONS = 2048


def _rows_per_group(T: int) -> int:
    return max(1, ROW_GROUP_POSITIONS // max(1, T))


def row_scaled_tn(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor,
                  sink: torch.Tensor | None = None) -> torch.Tensor | None:
    """Σ_r f_r · x_rᵀ y_r for x [R, T, a], y [R, T, b], f [R]: [a, b] in float32 (float64
    for float64 operands), within ``row_scaled_bound`` of its exact value.

    The factor multiplies float32 partial sums (Triton, CUDA half precision) or a float64
    copy of the smaller operand (elsewhere); never a half-precision operand. ``sink`` (an
    [a, b] tensor): the result is added to it (one rounding in the sink's dtype, in the
    Triton kernel itself for a float32 sink) and None is returned."""
    if sink is not None:
        if (_triton_path(x, y) and sink.dtype == torch.float32 and sink.is_contiguous()
                and sink.device == x.device):
            from llmdp.clipping import _triton_rowscaled

            try:
                return _triton_rowscaled.row_scaled_tn(x, y, f, sink=sink)
            except Exception as e:  # noqa: BLE001 - as below
                _triton_failed(x, e)
        sink.add_(row_scaled_tn(x, y, f).to(sink.dtype))
        return None
    if _triton_path(x, y):
        from llmdp.clipping import _triton_rowscaled

        try:
            return _triton_rowscaled.row_scaled_tn(x, y, f)
        except Exception as e:  # noqa: BLE001 - a kernel that does not build here
            _triton_failed(x, e)
    dt = result_dtype(x, y)
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
    if dt == torch.float64:
        with exact_fp32(x.device):
            parts = [(s2.t() @ sl if x_small else sl.t() @ s2)
                     for sl in (big2[:, j:j + step].to(dt) for j in range(0, n, step))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1 if x_small else 0)
    # float32 GEMMs over groups of rows (≈ ROW_GROUP_POSITIONS positions each), each into
    # its own output and then added to the float32 total: the float32 chain of any product
    # is one group long, plus one rounding per later group's add (``row_scaled_bound``).
    # (Not ``addmm_`` into the total: a GEMM may put the total into its chain, and every
    # earlier group's terms would then take a whole group's roundings again.)
    g = _rows_per_group(T) * T
    parts = []
    with exact_fp32(x.device):
        for j in range(0, n, step):
            sl = big2[:, j:j + step].to(dt)
            acc = part = None
            for p0 in range(0, R * T, g):
                a_, b_ = (s2[p0:p0 + g], sl[p0:p0 + g]) if x_small else (sl[p0:p0 + g], s2[p0:p0 + g])
                if acc is None:
                    acc = a_.t() @ b_
                    continue
                part = torch.mm(a_.t(), b_, out=part) if part is not None else a_.t() @ b_
                acc.add_(part)
            parts.append(acc)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1 if x_small else 0)
