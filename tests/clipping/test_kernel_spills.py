"""The clipping kernels fit in registers on sm_90 (issue 50, item 5): each kernel of
``llmdp/clipping/_triton_rowscaled.py`` is compiled as the engine launches it for every
layer shape of the benchmark model (``benchmarks/kernels.py``'s SHAPES: hidden 2,048,
intermediate 8,192, vocabulary 128,256) at T × R = 1,024 × 8 and 256 × 32, bf16, in both
loop structures (the clipped sum also as it adds itself to the float32 sink), with Triton's compiler and its bundled ptxas on the CPU
(``llmdp._triton.ptxas_usage``; no GPU). A register spill fails the test, and so does a
dot that continues an earlier tensor-core chain: the kernels' rounding bounds count one
fresh chain per chunk (``error_count``). Skipped only where this machine cannot compile for
sm_90 (no Triton, or no ptxas in it)."""

from __future__ import annotations

import pytest

from benchmarks.kernels import SHAPES
from llmdp import _triton

RUNS = ((1024, 8), (256, 32))
SM90_SHARED = 232_448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def _usage(kernel, args, kwargs, **kw):
    try:
        return _triton.ptxas_usage(kernel, args, kwargs, **kw)
    except _triton.CompilerUnavailable as e:
        pytest.skip(f"cannot compile for sm_90 here: {e}")


@pytest.mark.parametrize("T,R", RUNS)
def test_every_kernel_compiles_for_sm90_without_spills_at_the_benchmark_shapes(T, R):
    if _triton.triton is None:
        pytest.skip("cannot compile for sm_90 here: Triton does not import")
    from llmdp.clipping import _triton_rowscaled as k

    seen = []
    for p, d in SHAPES:
        for label, kernel, args, kwargs in k.launches(R, T, p, d):
            rep = _usage(kernel, args, kwargs)
            seen.append((p, d, label, rep))
            where = f"{rep['name']} ({label}) at T={T}, R={R}, {p}x{d}: {rep}"
            assert rep["spill_stores"] == rep["spill_loads"] == rep["stack"] == 0, where
            assert rep["shared"] <= SM90_SHARED, where
            assert rep["dots"] >= 1 and rep["dots_from_zero"] == rep["dots"], where
    # every kernel of the module, the defaults and the other loop structures
    names = {rep["name"] for *_, rep in seen}
    assert names == {"unit_sq_norms_kernel", "unit_sq_norms_flat_kernel", "row_scaled_tn_kernel",
                     "row_scaled_tn_flat_kernel"}
    # norms in both loops; the clipped sum in both loops, returned or added to the sink
    assert len(seen) == 6 * len(SHAPES)


def test_the_report_sees_spills_and_continued_chains():
    """The checks above can fail: a [128, 128] float32 tile held by one warp across a
    reduction (512 values a thread) spills, the [64, 64] one does not; and
    ``acc += tl.dot(a, b)`` is compiled as one chain through acc."""
    if _triton.triton is None:
        pytest.skip("cannot compile for sm_90 here: Triton does not import")
    import torch

    tl, triton = _triton.tl, _triton.triton

    @triton.jit
    def hold(X, OUT, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(X + offs[:, None] * N + offs[None, :])
        s = tl.sum(x, axis=0)
        tl.store(OUT + offs[:, None] * N + offs[None, :], x * s[None, :])

    @triton.jit
    def chained(A, B, OUT, K, N: tl.constexpr):
        offs = tl.arange(0, N)
        acc = tl.zeros((N, N), dtype=tl.float32)
        for k0 in range(0, K, N):
            a = tl.load(A + offs[:, None] * K + k0 + offs[None, :])
            b = tl.load(B + (k0 + offs[:, None]) * N + offs[None, :])
            acc += tl.dot(a, b)
        tl.store(OUT + offs[:, None] * N + offs[None, :], acc)

    for n, spills in ((128, True), (64, False)):
        tiles = (torch.empty((n, n), device="meta"), torch.empty((n, n), device="meta"))
        rep = _usage(hold, tiles, dict(N=n, num_warps=1, num_stages=1))
        assert (rep["spill_stores"] > 0) == spills and rep["dots"] == 0, rep
    n = 64
    args = (torch.empty((n, 4 * n), dtype=torch.bfloat16, device="meta"),
            torch.empty((4 * n, n), dtype=torch.bfloat16, device="meta"),
            torch.empty((n, n), dtype=torch.float32, device="meta"), 4 * n)
    rep = _usage(chained, args, dict(N=n, num_warps=4, num_stages=2))
    assert rep["spill_stores"] == 0 and rep["dots"] == 1 and rep["dots_from_zero"] == 0, rep


def test_ptxas_log_parsing():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert _triton.parse_ptxas(log, "k") == {"name": "k", "registers": 255, "stack": 8,
                                             "spill_stores": 12, "spill_loads": 16}


def test_int64_offsets_only_past_int32():
    """The kernels compute offsets in int32 (fewer registers) unless an operand spans 2³¹
    elements or more (the LM head's [R, T, V] gradient from R·T ≈ 2³¹ / V on: int64)."""
    import torch

    from llmdp.clipping import _triton_rowscaled as k

    def meta(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    assert not k._wide(meta(8, 1024, 128256), meta(8, 1024, 2048))
    assert k._wide(meta(17, 1024, 128256), meta(17, 1024, 2048))
    assert not k._wide(meta(4, 1024, 2048), meta(4, 1024, 2048).transpose(0, 2))
    assert k._wide(meta(2**31 // 4096, 4096)[None])


@pytest.mark.parametrize("T,R", RUNS)
def test_the_row_norm_kernel_compiles_for_sm90_without_spills(T, R):
    """``_triton_rownorms`` (one launch per row-norm bound) at the bench model's row widths
    (every layer's input and output, the LM head's vocabulary), bf16 and float32 (peft's
    adapters), as ``row_norm_bounds`` launches it."""
    if _triton.triton is None:
        pytest.skip("cannot compile for sm_90 here: Triton does not import")

    import torch

    from llmdp.clipping import _triton_rownorms as rn

    for k in sorted({w for shape in SHAPES for w in shape}):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty((R * T, k), dtype=dtype, device="meta")
            out = torch.empty(R * T, dtype=torch.float64, device="meta")
            params = torch.empty(3, dtype=torch.float64, device="meta")  # scale, √k, TINY
            rep = _usage(rn.row_norm_bounds_kernel, (x, out, k, k, params),
                         dict(BLOCK=min(rn.BLOCK, 1 << (k - 1).bit_length()), WIDE=False,
                              BF16=dtype == torch.bfloat16))
            where = f"row norms, k={k}, {dtype}: {rep}"
            assert rep["spill_stores"] == rep["spill_loads"] == rep["stack"] == 0, where
            assert rep["shared"] <= SM90_SHARED, where
    # a Linear's A and G in one launch (``lowp.row_norms2``): every layer's (p, d)
    for p, d in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty((R * T, p), dtype=dtype, device="meta")
            y = torch.empty((R * T, d), dtype=dtype, device="meta")
            out = torch.empty(2 * R * T, dtype=torch.float64, device="meta")
            params = torch.empty(6, dtype=torch.float64, device="meta")
            rep = _usage(rn.row_norm_bounds2_kernel, (x, y, out, p, d, p, d, R * T, params),
                         dict(BLOCK=min(rn.BLOCK, 1 << (max(p, d) - 1).bit_length()), WIDE=False,
                              BF16=dtype == torch.bfloat16))
            where = f"row norms of two tensors, {p}x{d}, {dtype}: {rep}"
            assert rep["spill_stores"] == rep["spill_loads"] == rep["stack"] == 0, where
            assert rep["shared"] <= SM90_SHARED, where
