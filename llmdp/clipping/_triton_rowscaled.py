"""Triton kernels on tensor cores: the clipped sum of one layer, Σ_r c_r · X_rᵀ Y_r, and
the per-unit squared norms ‖Σ_{r in u} X_rᵀ Y_r‖² without writing any per-unit gradient.

X [R, T, a] and Y [R, T, b] are a layer's output gradient and input (bf16/fp16), c [R] the
rows' clipping factors (float32). Each program owns one [BLOCK_A, BLOCK_B] tile of the
[a, b] result. For each row r it accumulates X_rᵀ Y_r over the row's T positions in a
float32 register tile (``tl.dot`` on bf16/fp16 operands: tensor cores, exact products,
float32 accumulation; a fresh accumulator every ``CHUNK_T`` positions, the chunks summed
in float32: the tensor cores' truncating chain is one chunk long, not T — the bound is
``error_count``), then adds ``c_r ·`` that partial sum, in float32, to the tile's
float32 accumulator. So the factor multiplies the float32 partial sum once per row and
tile: the operands are never scaled and rounded back to bf16 (which would make the added
gradient differ from the one whose norm was clipped, DESIGN §3.8). One pass over X and Y,
one write of the result: the cost of the non-private weight-gradient GEMM.

With ``TRITON_INTERPRET=1`` set before the import, the kernel runs on CPU tensors through
Triton's interpreter (the tests check it there against a float64 reference). The
interpreter's bf16 ``tl.dot`` is wrong (Triton 3.x), so there the tiles are widened to
float32 first and multiplied in IEEE float32: the same exact products and float32 sums.
"""

from __future__ import annotations

import torch

from llmdp._triton import available, interpreting, tl, triton  # noqa: F401 - re-used names

#: Positions per tensor-core accumulation chain (then float32 adds): the rounding bound of
#: both kernels grows with it, not with T (``error_count``, ``norm_error_count``).
CHUNK_T = 128

#: Which loop structure each kernel uses by default (``flat=`` overrides it per call): the
#: nested loops (one K loop per chunk) or one flat pipelined loop. Both form the same sums
#: with the same roundings. Chosen from ``benchmarks/kernels.py`` on an H200 (BENCHMARKS.md,
#: "The GPU path", second session): the flat clipped sum runs at 305-358 TFLOP/s against
#: the nested one's 248-274 at every layer shape of the 1.6 B model, T = 1,024 and 256; the
#: flat norm kernel wins only with 128-deep K blocks (``_norm_launch``).
FLAT_ROW_SCALED = True

if triton is not None:

    @triton.jit
    def _tile(A, B, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
        """This program's [BLOCK_A, BLOCK_B] tile of the [A, B] result: offsets and masks."""
        offs_a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        return offs_a, offs_b, offs_a < A, offs_b < B

    @triton.jit
    def _load_pair(X, Y, r, t0, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa, syr, syt, syb,
                   BLOCK_T: tl.constexpr):
        """Row r's positions [t0, t0 + BLOCK_T) of X and Y on the tile (zeros past T)."""
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        x = tl.load(X + r * sxr + offs_t[:, None] * sxt + offs_a[None, :] * sxa,
                    mask=mask_t[:, None] & mask_a[None, :], other=0.0)
        y = tl.load(Y + r * syr + offs_t[:, None] * syt + offs_b[None, :] * syb,
                    mask=mask_t[:, None] & mask_b[None, :], other=0.0)
        return x, y

    @triton.jit
    def _mma(x, y, part, UPCAST: tl.constexpr):
        """part + xᵀ y on tensor cores (exact products, float32 accumulation)."""
        if UPCAST:  # the interpreter's bf16 dot is wrong: the same exact products in fp32
            out = tl.dot(tl.trans(x.to(tl.float32)), y.to(tl.float32), part, input_precision="ieee")
        else:
            out = tl.dot(tl.trans(x), y, part)
        return out

    @triton.jit
    def _row_product(X, Y, r, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa, syr, syt, syb,
                     BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
                     CHUNK: tl.constexpr, UPCAST: tl.constexpr):
        """X_rᵀ Y_r on one [BLOCK_A, BLOCK_B] tile, float32: a fresh tensor-core chain per
        CHUNK positions, the chunks added in float32."""
        row = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        for c0 in range(0, T, CHUNK):
            part = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
            for t0 in range(c0, tl.minimum(c0 + CHUNK, T), BLOCK_T):
                x, y = _load_pair(X, Y, r, t0, T, offs_a, offs_b, mask_a, mask_b,
                                  sxr, sxt, sxa, syr, syt, syb, BLOCK_T)
                part = _mma(x, y, part, UPCAST)
            row += part
        return row

    @triton.jit
    def _store_sq(OUT, h, u, TILES_B):
        """OUT[u, tile] = the float64 sum of squares of the float32 tile h."""
        h64 = h.to(tl.float64)
        sq = tl.sum(tl.sum(h64 * h64, axis=1), axis=0)
        tl.store(OUT + u * (tl.num_programs(0) * TILES_B) + tl.program_id(0) * TILES_B
                 + tl.program_id(1), sq)

    @triton.jit
    def unit_sq_norms_kernel(
        X, Y, ROWS, PTR, OUT, T, A, B, TILES_B,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        CHUNK: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """OUT[u, tile] = Σ over the tile of h², h = Σ_{r in u} X_rᵀ Y_r in float32 (a fresh
        chain per CHUNK positions of a row), its squares summed in float64."""
        u = tl.program_id(2)
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        h = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        start = tl.load(PTR + u)
        end = tl.load(PTR + u + 1)
        for j in range(start, end):
            r = tl.load(ROWS + j)
            h += _row_product(X, Y, r, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa,
                              syr, syt, syb, BLOCK_A, BLOCK_B, BLOCK_T, CHUNK, UPCAST)
        _store_sq(OUT, h, u, TILES_B)

    @triton.jit
    def row_scaled_tn_kernel(
        X, Y, F, OUT, R, T, A, B, ROWS_PER,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        CHUNK: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid_s = tl.program_id(2)  # a group of rows (few output tiles: split the rows too)
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        r_end = tl.minimum(R, (pid_s + 1) * ROWS_PER)
        for r in range(pid_s * ROWS_PER, r_end):
            f = tl.load(F + r)
            row = _row_product(X, Y, r, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa,
                               syr, syt, syb, BLOCK_A, BLOCK_B, BLOCK_T, CHUNK, UPCAST)
            acc += f * row
        tl.store(OUT + pid_s * A * B + offs_a[:, None] * B + offs_b[None, :], acc,
                 mask=mask_a[:, None] & mask_b[None, :])

    # The same sums with one flat loop over (row, K block): the loads of the next blocks are
    # software-pipelined across chunk and row boundaries (the nested loops above restart the
    # pipeline every CHUNK positions: two K blocks at CHUNK 128). The flushes happen at the
    # same places, in the same order, so the results and the bounds are those above.

    @triton.jit
    def _flat_step(X, Y, r, j, nt, T, offs_a, offs_b, mask_a, mask_b, part, row,
                   sxr, sxt, sxa, syr, syt, syb, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_T: tl.constexpr, CHUNK: tl.constexpr, UPCAST: tl.constexpr):
        """K block j of row r into the chain ``part``; at a chunk's end (or the row's) the
        chain is added to the row's sum ``row`` and restarted. Returns (part, row)."""
        x, y = _load_pair(X, Y, r, j * BLOCK_T, T, offs_a, offs_b, mask_a, mask_b,
                          sxr, sxt, sxa, syr, syt, syb, BLOCK_T)
        part = _mma(x, y, part, UPCAST)
        if ((j + 1) % (CHUNK // BLOCK_T) == 0) | (j == nt - 1):
            row += part
            part = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        return part, row

    @triton.jit
    def unit_sq_norms_flat_kernel(
        X, Y, ROWS, PTR, OUT, T, A, B, TILES_B,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        CHUNK: tl.constexpr, UPCAST: tl.constexpr,
    ):
        u = tl.program_id(2)
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        h = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        row = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        part = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        start = tl.load(PTR + u)
        nt = tl.cdiv(T, BLOCK_T)
        for k in range(0, (tl.load(PTR + u + 1) - start) * nt):
            j = k % nt
            part, row = _flat_step(X, Y, tl.load(ROWS + start + k // nt), j, nt, T, offs_a, offs_b,
                                   mask_a, mask_b, part, row, sxr, sxt, sxa, syr, syt, syb,
                                   BLOCK_A, BLOCK_B, BLOCK_T, CHUNK, UPCAST)
            if j == nt - 1:  # the row's end: into the unit's
                h += row
                row = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        _store_sq(OUT, h, u, TILES_B)

    @triton.jit
    def row_scaled_tn_flat_kernel(
        X, Y, F, OUT, R, T, A, B, ROWS_PER,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        CHUNK: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid_s = tl.program_id(2)
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        row = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        part = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        r0 = pid_s * ROWS_PER
        nt = tl.cdiv(T, BLOCK_T)
        for k in range(0, (tl.minimum(R, r0 + ROWS_PER) - r0) * nt):
            r = r0 + k // nt
            j = k % nt
            part, row = _flat_step(X, Y, r, j, nt, T, offs_a, offs_b, mask_a, mask_b, part, row,
                                   sxr, sxt, sxa, syr, syt, syb, BLOCK_A, BLOCK_B, BLOCK_T, CHUNK,
                                   UPCAST)
            if j == nt - 1:  # the row's end: its factor times its sum, into the tile's
                acc += tl.load(F + r) * row
                row = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        tl.store(OUT + pid_s * A * B + offs_a[:, None] * B + offs_b[None, :], acc,
                 mask=mask_a[:, None] & mask_b[None, :])


def error_count(R: int, T: int, chunk: int = CHUNK_T) -> int:
    """n such that every product's relative error in the clipped sum is within γ_n(2⁻²²)
    (``lowp.row_scaled_bound``): at most min(T, chunk) + 1 roundings in its chunk's
    tensor-core chain (truncating accumulation: u = 2⁻²², ``lowp``), then float32 ones
    (u = 2⁻²⁴): at most m = ⌈T/chunk⌉ adding the row's chunks, one for c_r·row, at most R
    in the tile's accumulator, at most R in the sum of the row groups. k float32 roundings
    are within γ_⌈k/4⌉(2⁻²²) (1/(1 − k·2⁻²⁴) ≤ 1/(1 − ⌈k/4⌉·2⁻²²)), and a chain of
    γ_a then γ_b within γ_{a+b} (Higham, Lemma 3.3)."""
    m = -(-T // chunk)
    return min(T, chunk) + 1 + -(-(m + 2 * R + 2) // 4)


def norm_error_count(T: int, max_rows: int, chunk: int = CHUNK_T) -> int:
    """n such that every entry of a unit's h in ``unit_sq_norms`` is within
    γ_n(2⁻²²)·Σ_{r in u, t} |x_rt||y_rt| of its exact value: min(T, chunk) + 1 in a chunk's
    chain, then at most K·⌈T/chunk⌉ float32 adds of the unit's K rows' chunks (as above)."""
    m = max_rows * -(-T // chunk)
    return min(T, chunk) + 1 + -(-(m + 1) // 4)


def _blocks(a: int, b: int, T: int):
    if interpreting():
        return (16, 16, 16), 4, 1
    # H100/A100-sized tiles: 128×128 float32 accumulators, 64-deep bf16 K steps
    return (128 if a >= 128 else 64, 128 if b >= 128 else 64, 64 if T >= 64 else 32), 8, 3


def _norm_launch(a: int, b: int, T: int):
    """(config, flat) of the norm kernel. Measured on an H200 (``benchmarks/kernels.py``):
    at T = 1,024 the flat loop with 128-deep K blocks in two stages runs at 269-316 TFLOP/s
    against the nested default's 239-305 (the flat loop with 64-deep blocks: 208-230); at
    T = 256 the nested default (201-231) beat the flat one (163-178) and the deeper blocks
    were not measured, so it stays. A K block of 128 is one whole chunk: the chain, and so
    ``norm_error_count``, are unchanged."""
    blocks, warps, stages = _blocks(a, b, T)
    if not interpreting() and T >= 1024 and blocks[:2] == (128, 128) and CHUNK_T % 128 == 0:
        return ((128, 128, 128), 8, 2), True
    return (blocks, warps, stages), False


def _check_chunk(chunk: int, block_t: int) -> int:
    """A chunk is whole K blocks (a block never spans two chunks: the bounds count on it)."""
    if chunk % block_t:
        raise ValueError(f"chunk {chunk} is not a multiple of the kernel's K block {block_t}")
    return chunk


def _norm_call(X, Y, rows, ptr, num_units: int, chunk: int, config, flat):
    """(kernel, grid, args, kwargs, out) of ``unit_sq_norms``' launch."""
    T, a = X.shape[1], X.shape[2]
    b = Y.shape[2]
    default, default_flat = _norm_launch(a, b, T)
    blocks, warps, stages = config or default
    flat = default_flat if flat is None else flat
    _check_chunk(chunk, blocks[2])
    ta, tb = triton.cdiv(a, blocks[0]), triton.cdiv(b, blocks[1])
    out = torch.empty((num_units, ta * tb), dtype=torch.float64, device=X.device)
    kernel = unit_sq_norms_flat_kernel if flat else unit_sq_norms_kernel
    args = (X, Y, rows, ptr, out, T, a, b, tb,
            X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2))
    kwargs = dict(BLOCK_A=blocks[0], BLOCK_B=blocks[1], BLOCK_T=blocks[2], CHUNK=chunk,
                  UPCAST=interpreting(), num_warps=warps, num_stages=stages)
    return kernel, (ta, tb, num_units), args, kwargs, out


def unit_sq_norms(X: torch.Tensor, Y: torch.Tensor, rows: torch.Tensor, ptr: torch.Tensor,
                  num_units: int, chunk: int = CHUNK_T, config=None, flat=None) -> torch.Tensor:
    """[U] float64: Σ over tiles of the float64 sum of squares of each tile of the float32
    h_u = Σ_{r in u} X_rᵀ Y_r (X [R, T, a], Y [R, T, b], same half dtype; the rows of unit
    u are ``rows[ptr[u]:ptr[u+1]]``). Nothing of size a×b per unit is written.
    ``config``: ((BLOCK_A, BLOCK_B, BLOCK_T), warps, stages) instead of ``_norm_launch``'s
    (``benchmarks/kernels.py`` sweeps them); ``flat``: the loop structure (default: the
    measured faster one, ``_norm_launch``)."""
    kernel, grid, args, kwargs, out = _norm_call(X, Y, rows, ptr, num_units, chunk, config, flat)
    if num_units:
        kernel[grid](*args, **kwargs)
    return out.sum(1)


def _row_scaled_call(X, Y, f, chunk: int, config, flat, programs: int):
    """(kernel, grid, args, kwargs, out) of ``row_scaled_tn``'s launch, ``programs`` the
    number of programs that fill the device."""
    R, T, a = X.shape
    b = Y.shape[2]
    blocks, warps, stages = config or _blocks(a, b, T)
    tiles = triton.cdiv(a, blocks[0]) * triton.cdiv(b, blocks[1])
    # Too few output tiles to fill the device (a small layer): split the rows into groups,
    # each with its own float32 partial result, summed afterwards (split-K over rows).
    split = max(1, min(R, programs // tiles))
    rows_per = triton.cdiv(R, split)
    split = triton.cdiv(R, rows_per)
    out = torch.empty((split, a, b), dtype=torch.float32, device=X.device)
    grid = (triton.cdiv(a, blocks[0]), triton.cdiv(b, blocks[1]), split)
    kernel = row_scaled_tn_flat_kernel if (FLAT_ROW_SCALED if flat is None else flat) else row_scaled_tn_kernel
    args = (X, Y, f, out, R, T, a, b, rows_per,
            X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2))
    kwargs = dict(BLOCK_A=blocks[0], BLOCK_B=blocks[1], BLOCK_T=blocks[2],
                  CHUNK=_check_chunk(chunk, blocks[2]), UPCAST=interpreting(), num_warps=warps,
                  num_stages=stages)
    return kernel, grid, args, kwargs, out


def row_scaled_tn(X: torch.Tensor, Y: torch.Tensor, f: torch.Tensor, chunk: int = CHUNK_T,
                  config=None, flat=None) -> torch.Tensor:
    """Σ_r f_r X_rᵀ Y_r as a float32 [a, b] tensor (X [R, T, a], Y [R, T, b], same half
    dtype; f [R]). ``config`` and ``flat`` as ``unit_sq_norms``'s (default: ``_blocks``,
    ``FLAT_ROW_SCALED``)."""
    f = f.to(device=X.device, dtype=torch.float32).contiguous()
    programs = 8 if interpreting() else 2 * torch.cuda.get_device_properties(X.device).multi_processor_count
    kernel, grid, args, kwargs, out = _row_scaled_call(X, Y, f, chunk, config, flat, programs)
    kernel[grid](*args, **kwargs)
    return out[0] if out.shape[0] == 1 else out.sum(0)


def launches(R: int, T: int, a: int, b: int, dtype=torch.bfloat16, sms: int = 132):
    """Every kernel of this module as the wrappers above launch it for one layer, X [R, T, a]
    and Y [R, T, b] contiguous, one row per unit, on a device of ``sms`` SMs (an H100 or
    H200: 132): [(label, kernel, args, kwargs)], tensors on the ``meta`` device (nothing is
    allocated). The default loop structure and the other one, each with the default tiles:
    what ``llmdp._triton.ptxas_usage`` compiles (``tests/clipping/test_kernel_spills.py``,
    ``benchmarks/ptxas.py``)."""
    if interpreting():
        raise RuntimeError("launches() describes CUDA launches: unset TRITON_INTERPRET")
    X = torch.empty((R, T, a), dtype=dtype, device="meta")
    Y = torch.empty((R, T, b), dtype=dtype, device="meta")
    f = torch.empty((R,), dtype=torch.float32, device="meta")
    rows = torch.empty((R,), dtype=torch.long, device="meta")
    ptr = torch.empty((R + 1,), dtype=torch.long, device="meta")
    out = []
    default_flat = _norm_launch(a, b, T)[1]
    for flat in (default_flat, not default_flat):
        cfg = None if flat == default_flat else _blocks(a, b, T)
        kernel, _, args, kwargs, _ = _norm_call(X, Y, rows, ptr, R, CHUNK_T, cfg, flat)
        out.append(("norms" + (" (default)" if cfg is None else ""), kernel, args, kwargs))
    for flat in (FLAT_ROW_SCALED, not FLAT_ROW_SCALED):
        kernel, _, args, kwargs, _ = _row_scaled_call(X, Y, f, CHUNK_T, None, flat, 2 * sms)
        out.append(("clipped sum" + (" (default)" if flat == FLAT_ROW_SCALED else ""), kernel,
                    args, kwargs))
    return out
