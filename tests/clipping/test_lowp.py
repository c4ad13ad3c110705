"""The engine's contractions (``llmdp.clipping.lowp``, issue 15 items 1 and 4): exact
products with float32 sums, the clipping factor applied in float32 and never to a
half-precision operand, bounded float32 copies on the fallback path; the Triton clipped-sum
kernel in Triton's interpreter; and, on a GPU, the tensor-core paths."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from llmdp.clipping import lowp
from tests.helpers import run_interpreted

HALVES = [torch.bfloat16, torch.float16]


def _data(dtype, R=3, T=37, a=20, b=45, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, T, a, generator=g).to(dtype).to(device)
    y = torch.randn(R, T, b, generator=g).to(dtype).to(device)
    f = torch.rand(R, generator=g).to(device)
    return x, y, f


def _fp32_sum_bound(x, y):
    """A bound on float32 summation error of Σ x·y products: ~K·2⁻²⁴·Σ|x||y| (K terms)."""
    return (x.shape[0] * x.shape[1]) * 2.0**-24 * torch.einsum("rta,rtb->ab", x.double().abs(), y.double().abs())


@pytest.mark.parametrize("dtype", [*HALVES, torch.float32, torch.float64])
def test_row_scaled_tn_applies_the_factor_exactly(dtype):
    """Σ_r f_r x_rᵀ y_r equals its float64 value up to float32 summation, for half
    precision operands too: the old way (scale the smaller bf16 operand, round it back to
    bf16) is off by ~2⁻⁹ relative per element, which this test rejects."""
    x, y, f = _data(dtype)
    ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
    out = lowp.row_scaled_tn(x, y, f)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert ((out.double() - ref).abs() <= _fp32_sum_bound(x, y) + 1e-300).all()
    # The bound the engine adds for this path, and the result's one relative rounding.
    u, n = lowp.row_scaled_bound(x, y)
    mag = torch.einsum("r,rta,rtb->ab", f.double(), x.double().abs(), y.double().abs())
    last = 0.0 if dtype == torch.float64 else lowp.U32
    claimed = lowp.gamma(n, u) * mag * (1 + last) + last * ref.abs()
    ref_err = lowp.gamma(x.shape[0] * x.shape[1] + 3, lowp.U64) * mag  # ref's own float64 sum
    assert ((out.double() - ref).abs() <= claimed + ref_err + 1e-300).all()
    if dtype in HALVES:  # the rejected construction really is distinguishable here
        xs = (x.float() * f[:, None, None]).to(dtype)
        bad = torch.einsum("rta,rtb->ab", xs.double(), y.double())
        assert ((bad - ref).abs() > _fp32_sum_bound(x, y)).any()


def _fsum_last(products: torch.Tensor) -> torch.Tensor:
    """Σ over the last axis of exact float64 products, correctly rounded (math.fsum): the
    exact value of a contraction of float32-or-narrower operands, to float64's last bit."""
    flat = products.reshape(-1, products.shape[-1]).tolist()
    return torch.tensor([math.fsum(v) for v in flat], dtype=torch.float64).reshape(products.shape[:-1])


@pytest.mark.parametrize("dtype", [*HALVES, torch.float32])
def test_gram_and_per_row_products_are_within_their_stated_bounds(dtype):
    """Gram matrices are float64: within γ_k(2⁻⁵³)·Σ|x||y| of the exact value; per-row
    gradients float32, within γ_{T+1}(2⁻²⁴)·Σ|x||y| — the bounds the engine adds
    (``norms`` module docstring)."""
    x, y, _ = _data(dtype, R=2, T=9, b=20)
    g = lowp.gram(x, y)
    ref = _fsum_last(x.double()[:, :, None, :] * y.double()[:, None, :, :])
    bound = lowp.gamma(x.shape[2], lowp.U64) * torch.einsum("rta,rsa->rts", x.double().abs(), y.double().abs())
    assert g.dtype == torch.float64 and ((g - ref).abs() <= bound).all()
    # per-row gradients (instantiation): float32 sums, within the bound the engine adds
    p = lowp.per_row_tn(x, y)
    ref = _fsum_last((x.double()[:, :, :, None] * y.double()[:, :, None, :]).permute(0, 2, 3, 1))
    u, n = lowp.fast_bound(x, y, x.shape[1])
    assert (u, n) == (lowp.U32, x.shape[1] + 1)
    bound = lowp.gamma(n, u) * torch.einsum("rta,rtb->rab", x.double().abs(), y.double().abs())
    assert p.dtype == torch.float32 and ((p.double() - ref).abs() <= bound).all()
    n = lowp.row_norms(x)
    refn = torch.tensor([[math.sqrt(math.fsum(v * v for v in row)) for row in r] for r in x.double().tolist()],
                        dtype=torch.float64)
    k = x.shape[2]
    if x.dtype == torch.float64:
        assert ((n - refn).abs() <= lowp.gamma(k + 2, lowp.U64) * refn).all()
    else:  # an upper bound from a float32 reduction (issue 50, item 4), never below
        assert (n >= refn).all()
        assert (n <= refn * (1 + 3 * lowp.gamma(k + 3, lowp.U32)) + math.sqrt(k) * 2.0**-61).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_norms_are_upper_bounds_without_a_float64_copy(dtype, monkeypatch):
    """Narrow inputs are reduced with a float32 result, never widened to float64 (the copy
    issue 50 item 4 removes), and the result is never below the exact norm: at ordinary
    magnitudes, where every square is in float32's subnormal range (their absolute rounding,
    the √k·2⁻⁷⁵ term), and where most of the norm is one entry."""
    g = torch.Generator().manual_seed(3)
    tiny = 1e-25 if dtype == torch.float32 else 1e-21  # squares far below float32's normals
    cases = [torch.randn(4, 7, 300, generator=g), torch.randn(4, 7, 300, generator=g) * tiny,
             torch.cat([torch.full((2, 3, 1), 3e4), torch.randn(2, 3, 999, generator=g) * 1e-3], -1)]
    widened = []
    real_to = torch.Tensor.to

    def spy(t, *a, **kw):
        out = real_to(t, *a, **kw)
        if out.dtype == torch.float64 and t.dim() == 3:
            widened.append(tuple(t.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    for x in cases:
        x = x.to(dtype)
        if not bool(x.abs().max() > 0) or not bool(torch.isfinite(x).all()):
            continue
        n = lowp.row_norms(x)
        exact = torch.tensor([[math.sqrt(math.fsum(v * v for v in row)) for row in r]
                              for r in x.double().tolist()], dtype=torch.float64)
        assert (n >= exact).all(), (dtype, float((exact - n).max()))
        k = x.shape[-1]
        assert (n <= exact * (1 + 3 * lowp.gamma(k + 3, lowp.U32)) + math.sqrt(k) * 2.0**-61).all()
    # a row of zeros is exactly 0 (a gradient that is exactly 0 is no bound to recompute)
    z = torch.zeros(2, 3, 50, dtype=dtype)
    z[1, 2, 7] = 1
    n = lowp.row_norms(z)
    assert n[0].tolist() == [0.0] * 3 and n[1, :2].tolist() == [0.0] * 2 and float(n[1, 2]) >= 1
    assert widened == []


def test_row_norms_bound_rows_of_subnormals_where_the_arithmetic_flushes_them():
    """Where the CPU flushes subnormals (``torch.set_flush_denormal``), a row of subnormal
    float32 values has a float32 norm of 0; its largest magnitude is read on the bits, so
    the bound stays above the exact norm; rows of zeros stay exactly 0 beside it, and
    ordinary rows take the subnormal term's cap."""
    x = torch.zeros(3, 4, 64)
    x[0, 1] = 2.0**-140  # subnormal in float32
    x[0, 1, 5] = -(2.0**-135)
    x[2] = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    exact = torch.tensor([[math.sqrt(math.fsum(v * v for v in row)) for row in r]
                          for r in x.double().tolist()], dtype=torch.float64)
    flushing = torch.set_flush_denormal(True)
    try:
        n = lowp.row_norms(x)
    finally:
        torch.set_flush_denormal(False)
    assert exact[0, 1] > 0 and (n >= exact).all(), (n[0, 1], exact[0, 1])
    assert n[1].tolist() == [0.0] * 4 and n[0, 0] == 0 and n[0, 2] == 0
    if flushing:  # this machine flushes: the float32 norm of that row really was 0
        assert float(n[0, 1]) <= math.sqrt(64) * 2.0**-135 * 1.01
    n = lowp.row_norms(x)
    assert (n >= exact).all()


def test_no_kernel_takes_a_python_float(monkeypatch):
    """A Python float passed to a Triton kernel is an fp32 argument: a bound's float64
    constant (row_norms' scale = 1 + γ) would be rounded, possibly below itself. Every
    launch of the engine's kernels passes tensors, ints and compile-time flags only."""
    from llmdp.clipping import _triton_rownorms as rn
    from llmdp.clipping import _triton_rowscaled as rs

    if rn.triton is None:
        pytest.skip("Triton is not installed")
    seen = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.name, args, kwargs))

    monkeypatch.setattr(rn, "row_norm_bounds_kernel", Spy("row norms"))
    rn.row_norm_bounds(torch.randn(3, 40), 1.0 + lowp.gamma(43, lowp.U32))
    monkeypatch.setattr(rs, "interpreting", lambda: True)  # the CPU-sized launch configuration
    monkeypatch.setattr(rs, "_launch", lambda kernel, grid, args, kwargs: seen.append((kernel, args, kwargs)))
    x, y = torch.randn(4, 20, 8).bfloat16(), torch.randn(4, 20, 6).bfloat16()
    rs.row_scaled_tn(x, y, torch.rand(4, dtype=torch.float64))
    rs.row_scaled_tn(x, y, torch.rand(4, dtype=torch.float64), sink=torch.zeros(8, 6))
    rs.unit_sq_norms(x, y, torch.arange(4), torch.arange(5), 4)
    assert len(seen) == 4
    for name, args, kwargs in seen:
        floats = [a for a in (*args, *kwargs.values()) if isinstance(a, float)]
        assert floats == [], (name, floats)


def test_fallback_widens_large_operands_a_slice_at_a_time(monkeypatch):
    """With a small CHUNK_ELEMENTS the fallback slices the widened operand (the LM head's
    [R, T, V] gradient is never copied whole to float64) and gives the same values."""
    x, y, f = _data(torch.bfloat16, a=8, b=300)
    whole_rs, whole_g = lowp.row_scaled_tn(x, y, f), lowp.gram(y, y)
    whole_rs_t = lowp.row_scaled_tn(y, x, f)
    widened = []
    real_to = torch.Tensor.to

    def spy(t, *a, **k):
        out = real_to(t, *a, **k)
        if out.dtype == torch.float64 and t.dtype == torch.bfloat16:
            widened.append(out.numel())
        return out

    monkeypatch.setattr(lowp, "CHUNK_ELEMENTS", 3 * 37 * 64)
    monkeypatch.setattr(torch.Tensor, "to", spy)
    rs, g, rs_t = lowp.row_scaled_tn(x, y, f), lowp.gram(y, y), lowp.row_scaled_tn(y, x, f)
    monkeypatch.undo()
    assert max(widened) <= 3 * 37 * 64 < y.numel()
    torch.testing.assert_close(rs, whole_rs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rs_t, whole_rs_t, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, whole_g, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("api", ["legacy", "new"])
def test_exact_fp32_switches_tf32_off_and_restores_the_users_setting(monkeypatch, api):
    """The flag is process-wide: the engine turns TF32 off around its own float32 calls
    only and gives back exactly what the user set, through whichever API they used (torch
    refuses to read the legacy flag after the new one was set)."""
    m = torch.backends.cuda.matmul
    if api == "new" and not hasattr(m, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    name, user = ("fp32_precision", "tf32") if api == "new" else ("allow_tf32", True)
    prev = getattr(m, name)
    setattr(m, name, user)
    try:
        with lowp.exact_fp32(torch.device("cuda")):
            inside = m.fp32_precision if hasattr(m, "fp32_precision") else m.allow_tf32
        assert inside in ("ieee", False)
        assert getattr(m, name) == user
    finally:
        setattr(m, name, prev)


def test_a_triton_kernel_that_fails_warns_once_and_the_exact_fallback_serves(monkeypatch):
    from llmdp.clipping import _triton_rowscaled

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(lowp, "tensor_cores", lambda x, y: True)
    monkeypatch.setattr(lowp, "_TRITON_OK", {})
    monkeypatch.setattr(_triton_rowscaled, "available", lambda: True)
    monkeypatch.setattr(_triton_rowscaled, "row_scaled_tn", broken)
    x, y, f = _data(torch.bfloat16)
    ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
    with pytest.warns(RuntimeWarning, match="Triton clipped-sum kernel failed"):
        out = lowp.row_scaled_tn(x, y, f)
    assert ((out.double() - ref).abs() <= _fp32_sum_bound(x, y)).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowp.row_scaled_tn(x, y, f)  # no second warning, no second try
    assert len(calls) == 1


def test_cpu_never_claims_tensor_cores():
    x, y, _ = _data(torch.bfloat16)
    assert not lowp.tensor_cores(x, y)


# --------------------------------------------------------------------------- Triton, interpreted

_INTERPRETED = textwrap.dedent(
    """
    import os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from llmdp.clipping import _triton_rowscaled as k
    from llmdp.clipping import lowp
    assert k.available()
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for dt in (torch.bfloat16, torch.float16):
        # tile remainders, T = 1 (2-D inputs), one row, rows split into groups, zero factors
        for R, T, a, b in [(3, 37, 20, 45), (5, 1, 7, 9), (1, 16, 16, 16), (9, 5, 3, 33)]:
            x = torch.randn(R, T, a, generator=g).to(dt)
            y = torch.randn(R, T, b, generator=g).to(dt)
            f = torch.rand(R, generator=g)
            f[0] = 0.0
            out = k.row_scaled_tn(x, y, f)
            assert out.shape == (a, b) and out.dtype == torch.float32
            ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
            bound = R * T * 2.0**-24 * torch.einsum("rta,rtb->ab", x.double().abs(), y.double().abs())
            assert ((out.double() - ref).abs() <= bound + 1e-30).all(), (dt, R, T, a, b)
            # the bound the engine adds to the norms for this path (lowp.row_scaled_bound)
            claimed = lowp.gamma(k.error_count(R, T), lowp.UTC) * torch.einsum(
                "r,rta,rtb->ab", f.double(), x.double().abs(), y.double().abs())
            assert ((out.double() - ref).abs() <= claimed + 1e-30).all(), (dt, R, T, a, b)
            worst = max(worst, float((out.double() - ref).abs().max()))
    # non-contiguous operands (a transposed view) are read through their strides
    x = torch.randn(4, 24, 6, generator=g).bfloat16().transpose(1, 2).contiguous().transpose(1, 2)
    y = torch.randn(4, 24, 10, generator=g).bfloat16()
    f = torch.rand(4, generator=g)
    ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
    assert (k.row_scaled_tn(x, y, f).double() - ref).abs().max() < 1e-5
    print("ok", worst)
    """
)


def test_triton_clipped_sum_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    r = run_interpreted(_INTERPRETED)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALVES)
def test_cuda_half_contractions_run_on_tensor_cores_and_are_exact(dtype):
    x, y, f = _data(dtype, R=4, T=256, a=192, b=320, device="cuda")
    assert lowp.tensor_cores(x, y)
    from llmdp.clipping import _triton_rowscaled

    assert _triton_rowscaled.available()
    ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
    out = lowp.row_scaled_tn(x, y, f)
    assert ((out.double() - ref).abs() <= _fp32_sum_bound(x, y)).all()
    u, n = lowp.row_scaled_bound(x, y)  # the bound the norms are given for this path
    assert u == lowp.UTC
    claimed = lowp.gamma(n, u) * torch.einsum("r,rta,rtb->ab", f.double(), x.double().abs(), y.double().abs())
    assert ((out.double() - ref).abs() <= claimed).all()
    g = lowp.gram(x, x)
    refg = torch.einsum("rta,rsa->rts", x.double(), x.double())
    boundg = x.shape[2] * 2.0**-24 * torch.einsum("rta,rsa->rts", x.double().abs(), x.double().abs())
    assert ((g.double() - refg).abs() <= boundg).all()


@pytest.mark.gpu
def test_cuda_float32_contractions_ignore_the_users_tf32_and_restore_it():
    x, y, f = _data(torch.float32, R=4, T=256, a=192, b=320, device="cuda")
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out = lowp.row_scaled_tn(x, y, f)
        g = lowp.gram(x, x)
        assert torch.backends.cuda.matmul.allow_tf32 is True  # the user's setting is kept
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
    assert ((out.double() - ref).abs() <= _fp32_sum_bound(x, y)).all()  # TF32 would be ~1e-3 off
    refg = torch.einsum("rta,rsa->rts", x.double(), x.double())
    torch.testing.assert_close(g.double(), refg, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALVES)
def test_cuda_per_row_products_and_row_norms_are_within_their_bounds_at_long_T(dtype):
    """Issue 36: on tensor cores the per-row products run in chunks of CHUNK_T positions
    (their bound grows with the chunk, not T: at T = 1024 a T-long chain's bound made the
    engine recompute LoRA layers in float64); half-precision row norms are float32
    reductions scaled up: never below the exact norm."""
    x, y, _ = _data(dtype, R=3, T=1024, a=24, b=40, device="cuda")
    u, n = lowp.fast_bound(x.transpose(1, 2), y, x.shape[1])
    assert u == lowp.UTC and n < 140
    p = lowp.per_row_tn(x, y)
    ref = torch.einsum("rta,rtb->rab", x.double(), y.double())
    bound = lowp.gamma(n, u) * torch.einsum("rta,rtb->rab", x.double().abs(), y.double().abs())
    assert p.dtype == torch.float32 and ((p.double() - ref).abs() <= bound).all()
    big = torch.randn(2, 5, 70_000, device="cuda").to(dtype)
    exact = big.double().norm(dim=-1)
    got = lowp.row_norms(big)
    assert (got >= exact).all() and (got <= exact * (1 + 3 * lowp.gamma(70_003, lowp.U32))).all()


def test_the_kernels_chunk_and_their_error_counts_move_together(monkeypatch):
    """``_triton_rowscaled.CHUNK_T`` is read at each call, by the launches and by every count
    of their bounds (``benchmarks/clipping.py --chunk``): set to 64, the clipped sum's and the
    norms' counts, the per-row products' (``fast_bound``) and the launches' K block are all
    those of a 64-position chunk, not a mix with the 128 the defaults were written with."""
    from llmdp.clipping import _triton_rowscaled as k

    at128 = (k.error_count(8, 1024), k.norm_error_count(1024, 3), lowp.unit_norm_count(1024, 1))
    monkeypatch.setattr(k, "CHUNK_T", 64)
    at64 = (k.error_count(8, 1024), k.norm_error_count(1024, 3), lowp.unit_norm_count(1024, 1))
    assert at64 == (k.error_count(8, 1024, 64), k.norm_error_count(1024, 3, 64), k.norm_error_count(1024, 1, 64))
    assert at128 == (k.error_count(8, 1024, 128), k.norm_error_count(1024, 3, 128),
                     k.norm_error_count(1024, 1, 128))
    assert all(a < b for a, b in zip(at64, at128))  # a shorter tensor-core chain: a smaller bound
    if k.triton is not None and not k.interpreting():
        for _, _, _, kwargs in k.launches(8, 1024, 256, 128):
            assert kwargs["BLOCK_T"] == 64 and kwargs["num_stages"] == 3


def test_the_clipped_sum_runs_three_stages_only_where_the_shared_memory_holds_them():
    """Three stages of 128-deep bf16 blocks (192 KiB) on an H100/H200 (227 KiB a block), two
    on an A100 (163 KiB), on a device whose figure cannot be read (0) or for 4-byte operands;
    64-deep blocks three stages everywhere, as before; the norm kernel keeps two."""
    from llmdp.clipping import _triton_rowscaled as k

    if k.triton is None or k.interpreting():
        pytest.skip("the launch configs need Triton, not its interpreter")
    stages = lambda T, shared, item=2: k._sum_blocks(2048, 2048, T, None, shared, item)[2]  # noqa: E731
    assert stages(1024, 232_448) == 3 and stages(1024, 166_912) == 2 and stages(1024, 0) == 2
    assert stages(1024, 232_448, item=4) == 2
    assert stages(64, 166_912) == stages(64, 0) == 3 == k._blocks(2048, 2048, 64)[2]
    got = {label: kw["num_stages"] for label, _, _, kw in k.launches(8, 1024, 2048, 2048)}
    assert got["clipped sum (default)"] == got["clipped sum into the sink (default)"] == 3
    assert got["norms (default)"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [7, lowp.GRAM_CHUNK, lowp.GRAM_CHUNK + 1, 3000])
def test_gram_fast_is_within_its_chunked_bound(dtype, k):
    """``gram_fast`` off tensor cores: float32 GEMMs of ``GRAM_CHUNK`` terms added in float32,
    each entry within γ_n(2⁻²⁴)·Σ|x||y| of the exact contraction (math.fsum of the exact
    float64 products), n = c + m: the chunk's chain and one rounding per later chunk; for a
    long contraction far below the unchunked k + 1 (what makes the LM head's float32 Grams
    usable: their a-posteriori bound is a γ-multiple of the entries' magnitudes)."""
    g = torch.Generator().manual_seed(k)
    # entries over ~2⁴⁰ of dynamic range, of both signs: long float32 chains do round
    x = (torch.randn(2, 5, k, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 5, k), generator=g))).to(dtype)
    y = (torch.randn(2, k, 6, generator=g) * torch.exp2(torch.randint(-20, 20, (2, k, 6), generator=g))).to(dtype)
    out = lowp.gram_fast(x, y)
    assert out.dtype == torch.float32
    ref = _fsum_last(x.double()[:, :, None, :] * y.double().transpose(1, 2)[:, None, :, :])
    u, n = lowp.gram_fast_bound(x, y, k)
    m = -(-k // lowp.GRAM_CHUNK)
    assert u == lowp.U32 and n == min(k + 1, min(k, lowp.GRAM_CHUNK) + m)
    mag = torch.einsum("rta,ras->rts", x.double().abs(), y.double().abs())
    assert ((out.double() - ref).abs() <= lowp.gamma(n, u) * mag).all()
    if k > 2 * lowp.GRAM_CHUNK:
        assert n < (k + 1) / 8  # the point of chunking
        # the result is the chunks' float32 sum, in that order (not one long chain)
        parts = [torch.bmm(x[:, :, i:i + lowp.GRAM_CHUNK].float(), y[:, i:i + lowp.GRAM_CHUNK].float())
                 for i in range(0, k, lowp.GRAM_CHUNK)]
        total = parts[0]
        for q in parts[1:]:
            total = total + q
        assert torch.equal(out, total)


@pytest.mark.parametrize("T", [100, 300])
def test_row_scaled_tn_over_several_row_groups_is_within_its_bound(T, monkeypatch):
    """The CPU float32 clipped sum over several groups of rows (each group's GEMM into its
    own result, added to a float32 total): every entry within γ_n(2⁻²⁴)·Σ_r f_r|x_r|ᵀ|y_r|
    (``row_scaled_bound``: the group's chain and one rounding per later group) plus the
    result's own rounding, against exact sums (math.fsum), with entries over ~2⁴⁰ of range."""
    g = torch.Generator().manual_seed(T)
    R, a, b = 7, 5, 6
    x = torch.randn(R, T, a, generator=g) * torch.exp2(torch.randint(-20, 20, (R, T, a), generator=g))
    y = torch.randn(R, T, b, generator=g) * torch.exp2(torch.randint(-20, 20, (R, T, b), generator=g))
    f = torch.rand(R, generator=g)
    monkeypatch.setattr(lowp, "ROW_GROUP_POSITIONS", 256)  # groups of 2 rows, or of 1
    rows = lowp._rows_per_group(T)
    assert -(-R // rows) >= 4  # several groups
    out = lowp.row_scaled_tn(x, y, f)
    assert out.dtype == torch.float32
    # exact: the factor times each exact product, summed correctly rounded
    prods = f.double()[:, None, None, None] * x.double()[:, :, :, None] * y.double()[:, :, None, :]
    ref = _fsum_last(prods.permute(2, 3, 0, 1).reshape(a, b, R * T))
    u, n = lowp.row_scaled_bound(x, y)
    assert (u, n) == (lowp.U32, rows * T + 2 + -(-R // rows))
    mag = torch.einsum("r,rta,rtb->ab", f.double(), x.double().abs(), y.double().abs())
    claimed = lowp.gamma(n, u) * mag * (1 + lowp.U32) + lowp.U32 * ref.abs()
    assert ((out.double() - ref).abs() <= claimed).all()


def test_the_row_norm_kernel_that_fails_warns_once_and_torch_operations_serve(monkeypatch):
    """A row-norm kernel that does not build or run (an old GPU, a Triton without its
    ptxas) costs a warning, not the run: the same bound by torch operations, and the kernel
    is not tried again on that device (one and two tensors alike)."""
    from llmdp.clipping import _triton_rownorms

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("ptxas not found")

    monkeypatch.setattr(_triton_rownorms, "serves", lambda x: True)
    monkeypatch.setattr(_triton_rownorms, "row_norm_bounds", broken)
    monkeypatch.setattr(_triton_rownorms, "row_norm_bounds2", broken)
    monkeypatch.setattr(lowp, "_ROWNORMS_OK", {})
    x, y, _ = _data(torch.float32)
    with pytest.warns(RuntimeWarning, match="Triton row-norm kernel failed"):
        nx = lowp.row_norms(x)
    assert torch.equal(nx, lowp._row_norms_torch(x, lowp._row_scale(x.shape[-1])))
    assert (nx >= torch.linalg.vector_norm(x.double(), dim=-1)).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n2 = lowp.row_norms2(x, y)
    assert len(calls) == 1
    assert torch.equal(n2[0], nx) and torch.equal(n2[1], lowp._row_norms_torch(y, lowp._row_scale(y.shape[-1])))


def test_a_norm_kernel_that_fails_leaves_the_norms_to_the_float64_grams(monkeypatch):
    """The per-unit norm kernel failing inside a backward: that call's norms come from the
    float64 Gram matrices (bit for bit what the engine computes without the kernel), the
    clipped sum is the same, one warning, and the kernels are not tried again there."""
    from torch import nn

    from llmdp.clipping import GhostClipper, _triton_rowscaled, gram
    from llmdp.clipping.rules import linear

    torch.manual_seed(0)
    lin = nn.Linear(24, 40, bias=False)
    A = torch.randn(6, 9, 24)
    units = torch.tensor([0, 1, 1, 2, 3, 3])

    def run():
        sinks = {"weight": torch.zeros(40, 24)}
        clipper = GhostClipper(lin, 0.5, layer_policy="ghost", grad_buffers=sinks)
        loss = lin(A).square().sum((1, 2))
        with gram.forced("float64"):
            norms = clipper.backward(loss, units)
        clipper.remove_hooks()
        return norms, sinks["weight"]

    ref_norms, ref_sum = run()
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(lowp, "tile_norms", lambda x, y: True)
    monkeypatch.setattr(linear, "tile_norm_cheaper", lambda *a: True)
    monkeypatch.setattr(_triton_rowscaled, "unit_sq_norms", broken)
    monkeypatch.setattr(lowp, "_TRITON_OK", {})
    with pytest.warns(RuntimeWarning, match="Triton per-unit norm kernel failed"):
        norms, total = run()
    assert len(calls) == 1 and lowp._TRITON_OK == {-1: False}
    assert torch.equal(norms, ref_norms) and torch.equal(total, ref_sum)
