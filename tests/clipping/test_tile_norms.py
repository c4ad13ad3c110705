"""The tensor-core per-unit norm kernel and the chunked clipped-sum kernel (issue 36),
checked on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess: the variable
must be set before Triton is imported), and on CUDA by the ``gpu`` tests of
``test_engine.py`` (on a GPU every bf16 Linear's ghost norm takes this path).

* the kernels against float64 references, within the bounds the engine adds
  (``error_count``, ``norm_error_count``), with chunks shorter than T, units of several
  rows, tile remainders and T = 1; both loop structures and int64 offsets give the same
  bits; the worst accumulation order each bound admits, forced elementwise (not left to
  this machine's BLAS), stays within it, and bites: a count without the accumulator's
  chain of R·m chunk sums is exceeded;
* the engine with the kernel path forced on a bf16 model on CPU: removing any one unit
  changes what was added by at most C (the neighbour test, float64), and the norms used
  are never below those of the float64 Gram path by more than its own bound."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_interpreted

_KERNELS = textwrap.dedent(
    """
    import torch
    from llmdp.clipping import _triton_rowscaled as k
    from llmdp.clipping import lowp

    def chunks(x, y, chunk):
        # Each row's chunk sums X_rᵀ Y_r over [c0, c0 + chunk), their chains fully
        # sequential: every add a float32 rounding, in a fixed order (the products of
        # bf16/fp16 values are exact in float32); elementwise ops only, so no BLAS decides
        # the order. Yields (r, part) in the kernels' order: rows, then their chunks.
        R, T = x.shape[:2]
        for r in range(R):
            for c0 in range(0, T, chunk):
                part = torch.zeros(x.shape[2], y.shape[2])
                for t in range(c0, min(c0 + chunk, T)):
                    part = part + x[r, t].float()[:, None] * y[r, t].float()[None, :]
                yield r, part

    def sequential(x, y, f, chunk):
        # Σ_r f_r X_rᵀ Y_r in the kernel's structure: each chunk's sum times f_r, added to
        # one float32 accumulator.
        acc = torch.zeros(x.shape[2], y.shape[2])
        for r, part in chunks(x, y, chunk):
            acc = acc + f[r].float() * part
        return acc

    def sequential_h(x, y, chunk):
        # h of one unit (all of x's rows) in the norm kernel's structure: chunks added to h.
        h = torch.zeros(x.shape[2], y.shape[2])
        for _, part in chunks(x, y, chunk):
            h = h + part
        return h

    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        for R, T, a, b, chunk, units in [
            (3, 37, 20, 45, 16, [0, 1, 0]),      # 3 chunks, a unit of two rows
            (5, 1, 7, 9, 16, [0, 1, 2, 3, 4]),   # T = 1
            (4, 70, 33, 18, 32, [1, 0, 1, 1]),   # 3 rows in one unit
            (2, 50, 17, 17, 128, [0, 1]),        # one chunk
        ]:
            x = torch.randn(R, T, a, generator=g).to(dt)
            y = torch.randn(R, T, b, generator=g).to(dt)
            f = torch.rand(R, generator=g)
            f[0] = 0.0
            out = k.row_scaled_tn(x, y, f, chunk=chunk)
            # the flat pipelined loop forms the same sums in the same order: bit for bit
            assert torch.equal(k.row_scaled_tn(x, y, f, chunk=chunk, flat=True), out)
            ref = torch.einsum("r,rta,rtb->ab", f.double(), x.double(), y.double())
            claimed = lowp.gamma(k.error_count(R, T, chunk), lowp.UTC) * torch.einsum(
                "r,rta,rtb->ab", f.double(), x.double().abs(), y.double().abs())
            assert ((out.double() - ref).abs() <= claimed + 1e-30).all(), (dt, R, T)
            # added to a float32 sink instead (the engine's gradient buffer): in the kernel
            # when the rows are not split, bit for bit sink + out as ``sink.add_`` adds it;
            # else the partial results summed into it, within one more rounding per term
            sink = torch.randn(a, b, generator=g)
            into = sink.clone()
            assert k.row_scaled_tn(x, y, f, chunk=chunk, sink=into) is None
            absf = torch.einsum("r,rta,rtb->ab", f.double(), x.double().abs(), y.double().abs())
            if k._row_scaled_call(x, y, f.float(), chunk, None, None, k._programs(x.device))[4].shape[0] == 1:
                assert torch.equal(into, sink + out), (dt, R, T)
            else:
                err = (into.double() - sink.double() - ref).abs()
                assert (err <= claimed + lowp.gamma(R + 1, 2.0**-24) * (sink.double().abs() + absf)).all()
            assert not torch.equal(into, sink)
            # the bound holds for the worst order it admits too, not only for this machine's
            chained = sequential(x, y, f, chunk)
            assert ((chained.double() - ref).abs() <= claimed + 1e-30).all(), (dt, R, T)
            uor = torch.tensor(units)
            U = int(uor.max()) + 1
            ptr = torch.zeros(U + 1, dtype=torch.long)
            ptr[1:] = torch.bincount(uor, minlength=U).cumsum(0)
            sq = k.unit_sq_norms(x, y, torch.argsort(uor, stable=True), ptr, U, chunk=chunk)
            assert torch.equal(k.unit_sq_norms(x, y, torch.argsort(uor, stable=True), ptr, U,
                                               chunk=chunk, flat=True), sq)
            assert sq.dtype == torch.float64 and sq.shape == (U,)
            h = torch.zeros(U, a, b, dtype=torch.float64).index_add(
                0, uor, torch.einsum("rta,rtb->rab", x.double(), y.double()))
            mag = torch.zeros(U, a, b, dtype=torch.float64).index_add(
                0, uor, torch.einsum("rta,rtb->rab", x.double().abs(), y.double().abs()))
            gm = lowp.gamma(k.norm_error_count(T, int(torch.bincount(uor).max()), chunk), lowp.UTC)
            true = h.flatten(1).norm(dim=1)
            # ‖h̃‖ − ‖h‖ ≤ ‖h̃ − h‖ ≤ γ·‖|x|ᵀ|y|‖ (the float64 sum of squares adds ~1e-16)
            slack = gm * mag.flatten(1).norm(dim=1) * (1 + 1e-9) + 1e-12 * true
            assert ((sq.sqrt() - true).abs() <= slack).all(), (dt, R, T, sq.sqrt(), true)
            # int64 offsets (the kernels' WIDE switch, for operands of 2³¹ elements or more):
            # the same sums
            k.INT32_SPAN = 1
            assert torch.equal(k.row_scaled_tn(x, y, f, chunk=chunk), out)
            assert torch.equal(k.unit_sq_norms(x, y, torch.argsort(uor, stable=True), ptr, U,
                                               chunk=chunk), sq)
            k.INT32_SPAN = 2**31
    # Adversarial: 1 then many 2^-25 (each float32 add of one to the running 1 is lost), so
    # a sequential chain errs by ~15 roundings of the first chunk: a bound that counted fewer
    # fails here. How much a machine's float32 dot loses is not ours to assert (a BLAS may
    # keep several partial sums and lose nothing), so the rounding is forced: the worst
    # order the bound admits (one product at a time into the chunk's chain) is accumulated
    # here in float32, elementwise, and the kernel is held to the same bound separately.
    T = 64
    x = torch.full((1, T, 16), 2.0**-25)
    x[0, 0] = 1.0
    x, y = x.bfloat16(), torch.ones(1, T, 16).bfloat16()
    ref = torch.einsum("rta,rtb->ab", x.double(), y.double())
    mag = torch.einsum("rta,rtb->ab", x.double().abs(), y.double().abs())
    bound = lowp.gamma(k.error_count(1, T, 16), lowp.UTC) * mag
    chained = sequential(x, y, torch.ones(1), 16)
    assert ((chained.double() - ref).abs() > 1.5 * lowp.gamma(1, lowp.UTC) * mag).all()  # it bites
    assert ((chained.double() - ref).abs() <= bound).all()
    out = k.row_scaled_tn(x, y, torch.ones(1), chunk=16)
    assert torch.equal(k.row_scaled_tn(x, y, torch.ones(1), chunk=16, flat=True), out)
    assert ((out.double() - ref).abs() <= bound).all()
    sq = k.unit_sq_norms(x, y, torch.arange(1), torch.tensor([0, 1]), 1, chunk=16)
    gm = lowp.gamma(k.norm_error_count(T, 1, 16), lowp.UTC)
    assert abs(float(sq.sqrt()) - float(ref.norm())) <= gm * float(mag.norm())
    # Adversarial for the accumulator: all chunk sums go into one float32 tile, R·m of them.
    # Row 0 starts with 1, every other chunk holds one product just under half an ulp of 1
    # (each add of it to the running ~1 is lost): 4·128 − 1 lost adds, more than a count of
    # m + 2R + 2 float32 roundings (the three-accumulator kernels', whose chunks went into
    # a row sum first) admits; error_count's R·m + R covers them.
    R, T, chunk = 4, 16 * 128, 16
    m = T // chunk
    x = torch.zeros(R, T, 16)
    x[:, ::chunk] = 2.0**-24 * (1 - 2.0**-8)
    x[0, 0] = 1.0
    x, y = x.bfloat16(), torch.ones(R, T, 16).bfloat16()
    ones = torch.ones(R)
    ref = torch.einsum("rta,rtb->ab", x.double(), y.double())
    mag = torch.einsum("rta,rtb->ab", x.double().abs(), y.double().abs())
    three_acc = lowp.gamma(chunk + 1 + -(-(m + 2 * R + 2) // 4), lowp.UTC) * mag
    bound = lowp.gamma(k.error_count(R, T, chunk), lowp.UTC) * mag
    chained = sequential(x, y, ones, chunk)
    assert ((chained.double() - ref).abs() > three_acc).all()  # it bites
    assert ((chained.double() - ref).abs() <= bound).all()
    out = k.row_scaled_tn(x, y, ones, chunk=chunk)
    assert torch.equal(k.row_scaled_tn(x, y, ones, chunk=chunk, flat=True), out)
    assert ((out.double() - ref).abs() <= bound).all()
    gm = lowp.gamma(k.norm_error_count(T, R, chunk), lowp.UTC)
    h = sequential_h(x, y, chunk)  # the four rows as one unit
    assert ((h.double() - ref).abs() > three_acc).all()
    assert ((h.double() - ref).abs() <= gm * mag).all()
    sq = k.unit_sq_norms(x, y, torch.arange(R), torch.tensor([0, R]), 1, chunk=chunk)
    assert torch.equal(k.unit_sq_norms(x, y, torch.arange(R), torch.tensor([0, R]), 1, chunk=chunk,
                                       flat=True), sq)
    assert abs(float(sq.sqrt()) - float(ref.norm())) <= gm * float(mag.norm())
    for bad in (24, 8):
        try:
            k.unit_sq_norms(x, y, torch.arange(1), torch.tensor([0, 1]), 1, chunk=bad)
        except ValueError as e:
            assert "not a power of two" in str(e)
        else:
            raise AssertionError("a chunk that is not one tl.dot must be refused")
    try:  # a config whose K block is not the chunk
        k.row_scaled_tn(x, y, torch.ones(1), chunk=16, config=((16, 16, 32), 4, 1))
    except ValueError as e:
        assert "not one chunk" in str(e)
    else:
        raise AssertionError("a K block other than the chunk must be refused")
    # the bound is one chunk long, not T: at T = 1024 it is about 7x smaller
    assert k.error_count(8, 1024) < (1024 + 2 * 8 + 2) / 7
    print("ok")
    """
)

_ENGINE = textwrap.dedent(
    """
    import torch
    from llmdp.clipping import GhostClipper, lowp
    from llmdp.clipping.rules import linear
    from llmdp.base.losses import row_losses
    from tests.clipping.test_engine import V, make_batch
    from tests.helpers import tiny_model

    calls = []
    real = lowp.unit_sq_norms

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    def use_tiles(on):
        lowp.tile_norms = (lambda x, y: x.dtype == torch.bfloat16 == y.dtype) if on else (lambda x, y: False)
        linear.tile_norm_cheaper = lambda *a: on

    lowp.unit_sq_norms = spy
    # The rows' norm bounds by torch operations, not the Triton row-norm kernel: in the
    # interpreter that kernel (one program a row) took three quarters of this test's time;
    # it has its own test (`test_the_row_norm_kernel_is_an_upper_bound_in_the_interpreter`:
    # never below the exact norm, the torch path's bits for two tensors in one launch).
    from llmdp.clipping import _triton_rownorms
    _triton_rownorms.serves = lambda x: False
    model = tiny_model("llama", vocab_size=V, dtype=torch.float32).to(torch.bfloat16)
    row_units = [0, 1, 1, 2, 3, 4]
    batch = make_batch(row_units)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    C = 1e-2

    def added(ru, mode):
        sinks = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in model.named_parameters()
                 if p.requires_grad}
        clipper = GhostClipper(model, C, mode=mode, layer_policy="ghost", grad_buffers=sinks)
        norms = clipper.backward(row_losses(model, {**batch, "row_units": torch.tensor(ru)}),
                                 torch.tensor(ru))
        clipper.remove_hooks()
        return torch.cat([sinks[n].double().reshape(-1) for n in names]), norms

    for mode in ("book-keeping", "two-pass"):
        use_tiles(False)
        _, gram_norms = added(row_units, mode)
        use_tiles(True)
        calls.clear()
        full, norms = added(row_units, mode)
        assert calls, "the tile-norm kernel was not used"
        assert (norms > 2 * C).all()
        assert (norms >= gram_norms * (1 - 1e-2)).all() and (norms <= gram_norms * 1.02).all(), (norms, gram_norms)
        if mode == "two-pass":
            continue  # the same norms and contraction, formed in the second backward
        worst = 0.0
        # every unit is clipped (norms > 2C), so each removal moves the sum by C exactly:
        # a unit of one row and one of two (the interpreter runs each backward in Python)
        for u in (0, 1):
            without, _ = added([r if r != u else -1 for r in row_units], mode)
            worst = max(worst, float((full - without).norm()) / C)
        assert 1 - 1e-3 < worst <= 1 + 1e-6, (mode, worst)
    print("ok")
    """
)


def _interpreted(script: str) -> None:
    pytest.importorskip("triton")
    r = run_interpreted(script)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


_ROW_NORMS = textwrap.dedent(
    """
    import math, torch
    from llmdp.clipping import lowp, _triton_rownorms as rn
    assert rn.serves(torch.zeros(2, 3))  # lowp.row_norms takes the kernel here
    g = torch.Generator().manual_seed(0)

    def exact(x):
        rows = x.double().reshape(-1, x.shape[-1]).tolist()
        return torch.tensor([math.sqrt(math.fsum(v * v for v in r)) for r in rows],
                            dtype=torch.float64).reshape(x.shape[:-1])

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tiny = 1e-7 if dtype == torch.float16 else 1e-40  # subnormal squares (and values)
        for shape in [(3, 5, 7), (2, 2500), (4, 1, 1), (1, 3, 1030)]:
            for x in (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g) * tiny,
                      torch.zeros(*shape)):
                x = x.to(dtype)
                got, ex, k = lowp.row_norms(x), exact(x), shape[-1]
                assert got.dtype == torch.float64 and got.shape == x.shape[:-1]
                assert (got >= ex).all(), (dtype, shape, float((ex - got).max()))
                slack = ex * (1 + 3 * lowp.gamma(k + 3, lowp.U32)) + math.sqrt(k) * 2.0**-61
                assert (got <= slack).all(), (dtype, shape)
                assert ((got == 0) == (ex == 0)).all()  # zero rows exactly 0, no others
        x = torch.randn(2, 9, 33, generator=g).to(dtype)[:, ::2]  # strided rows
        assert (lowp.row_norms(x) >= exact(x)).all()
        # two tensors in one launch (a Linear's A and G): the one-tensor launches' bits
        launches = []
        real = rn.row_norm_bounds2_kernel.run
        rn.row_norm_bounds2_kernel.run = lambda *a, **k: (launches.append(1), real(*a, **k))[1]
        for xs, ys in [((3, 5, 7), (3, 5, 1030)), ((2, 4, 2500), (2, 4, 3)), ((4, 1, 1), (4, 1, 1))]:
            x = torch.randn(*xs, generator=g).to(dtype)
            y = torch.randn(*ys, generator=g).to(dtype)
            y[1] = 0  # zero rows stay exactly 0
            y[0, 0] *= tiny
            na, ng = lowp.row_norms2(x, y)
            assert torch.equal(na, lowp.row_norms(x)) and torch.equal(ng, lowp.row_norms(y))
            assert (ng[1] == 0).all() and (ng >= exact(y)).all()
        rn.row_norm_bounds2_kernel.run = real
        assert len(launches) == 3
    print("ok")
    """
)


def test_the_row_norm_kernel_is_an_upper_bound_in_the_interpreter():
    """``_triton_rownorms`` (``lowp.row_norms`` on CUDA, one launch): never below the exact
    norm, within its stated slack above it, zero rows exactly 0, on normal and subnormal
    values of float32, bf16 and fp16, rows shorter and longer than a block, strided; and
    two tensors' rows in one launch (``lowp.row_norms2``) give the one-tensor kernel's bits."""
    _interpreted(_ROW_NORMS)


def test_chunked_kernels_are_within_their_stated_bounds_in_the_interpreter():
    _interpreted(_KERNELS)


def test_engine_on_the_tile_norm_path_adds_at_most_C_per_unit_in_the_interpreter():
    _interpreted(_ENGINE)
