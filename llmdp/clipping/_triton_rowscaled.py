"""Triton kernels on tensor cores: the clipped sum of one layer, Σ_r c_r · X_rᵀY_r, and
the per-unit squared norms ‖Σ_{r in u} X_rᵀ Y_r‖² without writing any per-unit gradient.

X [R, T, a] and Y [R, T, b] are a layer's output gradient and input (bf16/fp16), c [R] the
rows' clipping factors (float32). Each program owns one [BLOCK_A, BLOCK_B] tile of the
[a, b] result and walks its rows' positions one chunk of at most ``CHUNK_T`` positions at a
time. A chunk is one K block: one ``tl.dot`` on bf16/fp16 operands (tensor cores, exact
products, float32 accumulation) into a fresh float32 tile, the chunk's partial sum: the
tensor cores' truncating chain is one chunk long, not T. That partial sum goes straight
into the tile's float32 accumulator — times c_r, in float32, for the clipped sum — so the
kernels hold two [BLOCK_A, BLOCK_B] float32 tiles (the chunk's, the accumulator), and the K
loop has no branch: every iteration is one load of X and Y, one dot, one add. The factor
multiplies float32 partial sums, never an operand rounded back to bf16 (which would make
the added gradient differ from the one whose norm was clipped, DESIGN, invariant `precision-never-widens`). One pass over
X and Y, one write of the result: the cost of the non-private weight-gradient GEMM. The
rounding bounds of this structure are ``error_count`` and ``norm_error_count``.

Offsets are int32 (row indices included) unless an operand spans 2³¹ elements or more, then
int64 (``WIDE``, a compile-time switch). Compiled for sm_90 with the launcher's
specialization, every kernel at the benchmark model's layer shapes fits in registers with
no spill (``benchmarks/ptxas.py``, ``tests/clipping/test_kernel_spills.py``).

With ``TRITON_INTERPRET=1`` set before the import, the kernel runs on CPU tensors through
Triton's interpreter (the tests check it there against a float64 reference). The
interpreter's bf16 ``tl.dot`` is wrong (Triton 3.x), so there the tiles are widened to
float32 first and multiplied in IEEE float32: the same exact products and float32 sums.
"""

from __future__ import annotations

import torch

from llmdp._triton import available, interpreting, tl, triton  # noqa: F401 - re-used names

#: Positions per tensor-core accumulation chain, one ``tl.dot`` (then float32 adds): the
#: rounding bound of both kernels grows with it, not with T (``error_count``,
#: ``norm_error_count``). A power of two, at least 16 (the dot's smallest K). Read at each
#: call (``_chunk_t``) by the kernels' launches and by their error counts alike, so a process
#: that sets it (``benchmarks/clipping.py --chunk``) moves both together.
CHUNK_T = 128

#: Which loop structure each kernel uses by default (``flat=`` overrides it per call): the
#: nested loops (rows, then each row's chunks) or one flat pipelined loop over (row, chunk).
#: Both form the same sums in the same order: the results are the same bit for bit. Chosen
#: from ``benchmarks/kernels.py`` on an H200 (BENCHMARKS.md, "The GPU path", second
#: session, with the earlier three-accumulator kernels): the flat clipped sum ran at 305-358
#: TFLOP/s against the nested one's 248-274 at every layer shape of the 1.6 B model, T =
#: 1,024 and 256; the flat norm kernel won at T = 1,024 (``_norm_launch``).
FLAT_ROW_SCALED = True

#: Offsets from 2³¹ elements on need int64 (``_wide``); below, int32 (fewer registers).
INT32_SPAN = 2**31

if triton is not None:

    @triton.jit
    def _tile(A, B, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
        """This program's [BLOCK_A, BLOCK_B] tile of the [A, B] result: offsets and masks."""
        offs_a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
        offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        return offs_a, offs_b, offs_a < A, offs_b < B

    @triton.jit
    def _chunk(X, Y, r, t0, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa, syr, syt, syb,
               BLOCK_T: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr):
        """X_rᵀ Y_r over row r's positions [t0, t0 + BLOCK_T) (zeros past T) on the tile: one
        chunk, one dot into a fresh float32 tile (exact products, float32 accumulation)."""
        if WIDE:
            r = r.to(tl.int64)
        else:  # the norm kernel's row indices are loaded as int64: int32 arithmetic
            r = r.to(tl.int32)
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        x = tl.load(X + r * sxr + offs_t[:, None] * sxt + offs_a[None, :] * sxa,
                    mask=mask_t[:, None] & mask_a[None, :], other=0.0)
        y = tl.load(Y + r * syr + offs_t[:, None] * syt + offs_b[None, :] * syb,
                    mask=mask_t[:, None] & mask_b[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: the same exact products in fp32
            part = tl.dot(tl.trans(x.to(tl.float32)), y.to(tl.float32), input_precision="ieee")
        else:
            # The identity, opaque to the compiler: Triton folds ``acc + dot(a, b, 0)`` into
            # ``dot(a, b, acc)``, which would make the tensor-core chain the whole unit's
            # length instead of one chunk's (``test_kernel_spills`` checks every dot starts
            # from zero).
            part = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tl.dot(tl.trans(x), y)],
                                             dtype=tl.float32, is_pure=True, pack=1)
        return part

    @triton.jit
    def _store_sq(OUT, h, u, TILES_B):
        """OUT[u, tile] = the float64 sum of squares of the float32 tile h."""
        h64 = h.to(tl.float64)
        sq = tl.sum(tl.sum(h64 * h64, axis=1), axis=0)
        tl.store(OUT + u * (tl.num_programs(0) * TILES_B) + tl.program_id(0) * TILES_B
                 + tl.program_id(1), sq)

    @triton.jit
    def _store_tile(OUT, acc, A, B, offs_a, offs_b, mask_a, mask_b, WIDE: tl.constexpr,
                    ACC: tl.constexpr, SINK):
        """OUT[group, tile] = acc (float32), this program's row group's partial result; with
        ``ACC``, the first group's is SINK[tile] + acc (one float32 add: the clipped sum
        added to the caller's float32 sink in the kernel, as ``sink.add_`` would add it)."""
        g = tl.program_id(2)
        mask = mask_a[:, None] & mask_b[None, :]
        if ACC:
            if g == 0:
                acc += tl.load(SINK + offs_a[:, None] * B + offs_b[None, :], mask=mask, other=0.0)
        if WIDE:
            g = g.to(tl.int64)
        tl.store(OUT + g * A * B + offs_a[:, None] * B + offs_b[None, :], acc, mask=mask)

    @triton.jit
    def unit_sq_norms_kernel(
        X, Y, ROWS, PTR, OUT, T, A, B, TILES_B,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr, WIDE: tl.constexpr,
    ):
        """OUT[u, tile] = Σ over the tile of h², h = Σ_{r in u} Σ_chunks X_rᵀ Y_r in float32
        (one dot per chunk of BLOCK_T positions, each added to h), squares summed in
        float64. Nested loops: the unit's rows, then each row's chunks."""
        u = tl.program_id(2)
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        h = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        for j in range(tl.load(PTR + u).to(tl.int32), tl.load(PTR + u + 1).to(tl.int32)):
            r = tl.load(ROWS + j)
            for t0 in range(0, T, BLOCK_T):
                h += _chunk(X, Y, r, t0, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa,
                            syr, syt, syb, BLOCK_T, UPCAST, WIDE)
        _store_sq(OUT, h, u, TILES_B)

    @triton.jit
    def row_scaled_tn_kernel(
        X, Y, F, OUT, SINK, R, T, A, B, ROWS_PER,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr, WIDE: tl.constexpr, ACC: tl.constexpr,
    ):
        """OUT[group] = Σ_{r in group} Σ_chunks c_r · X_rᵀ Y_r (float32): each chunk's dot
        times c_r, added to the tile. Nested loops: the group's rows, then their chunks.
        A group of rows per ``program_id(2)`` (few output tiles: the rows are split too)."""
        r0 = tl.program_id(2) * ROWS_PER
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        for r in range(r0, tl.minimum(R, r0 + ROWS_PER)):
            f = tl.load(F + r)
            for t0 in range(0, T, BLOCK_T):
                acc += f * _chunk(X, Y, r, t0, T, offs_a, offs_b, mask_a, mask_b, sxr, sxt, sxa,
                                  syr, syt, syb, BLOCK_T, UPCAST, WIDE)
        _store_tile(OUT, acc, A, B, offs_a, offs_b, mask_a, mask_b, WIDE, ACC, SINK)

    # The same sums with one flat loop over (row, chunk): the loads of the next chunks are
    # software-pipelined across row boundaries (the nested loops restart the pipeline at
    # every row). The same adds in the same order: the results and bounds are those above.

    @triton.jit
    def unit_sq_norms_flat_kernel(
        X, Y, ROWS, PTR, OUT, T, A, B, TILES_B,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr, WIDE: tl.constexpr,
    ):
        u = tl.program_id(2)
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        h = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        start = tl.load(PTR + u).to(tl.int32)  # int32 loop indices (ptr is int64)
        nt = tl.cdiv(T, BLOCK_T)
        for k in range(0, (tl.load(PTR + u + 1).to(tl.int32) - start) * nt):
            h += _chunk(X, Y, tl.load(ROWS + start + k // nt), (k % nt) * BLOCK_T, T, offs_a,
                        offs_b, mask_a, mask_b, sxr, sxt, sxa, syr, syt, syb, BLOCK_T, UPCAST, WIDE)
        _store_sq(OUT, h, u, TILES_B)

    @triton.jit
    def row_scaled_tn_flat_kernel(
        X, Y, F, OUT, SINK, R, T, A, B, ROWS_PER,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr, WIDE: tl.constexpr, ACC: tl.constexpr,
    ):
        r0 = tl.program_id(2) * ROWS_PER
        offs_a, offs_b, mask_a, mask_b = _tile(A, B, BLOCK_A, BLOCK_B)
        acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        nt = tl.cdiv(T, BLOCK_T)
        for k in range(0, (tl.minimum(R, r0 + ROWS_PER) - r0) * nt):
            r = r0 + k // nt
            acc += tl.load(F + r) * _chunk(X, Y, r, (k % nt) * BLOCK_T, T, offs_a, offs_b, mask_a,
                                           mask_b, sxr, sxt, sxa, syr, syt, syb, BLOCK_T, UPCAST,
                                           WIDE)
        _store_tile(OUT, acc, A, B, offs_a, offs_b, mask_a, mask_b, WIDE, ACC, SINK)


def _chunk_t(chunk: int | None) -> int:
    """The chunk asked for, or ``CHUNK_T`` as it is now."""
    return CHUNK_T if chunk is None else chunk


def _quarter(k: int) -> int:
    """k float32 roundings (u = 2⁻²⁴) as a count at u = 2⁻²²: 1/(1 − k·2⁻²⁴) ≤
    1/(1 − ⌈k/4⌉·2⁻²²), so γ_k(2⁻²⁴) ≤ γ_⌈k/4⌉(2⁻²²)."""
    return -(-k // 4)


def error_count(R: int, T: int, chunk: int | None = None) -> int:
    """n such that every product's relative error in the clipped sum is within γ_n(2⁻²²)
    (``lowp.row_scaled_bound``). Product x_rt·y_rt is exact; it enters its chunk's
    tensor-core chain (one dot of at most min(T, chunk) products: at most min(T, chunk) + 1
    roundings of a truncating float32 accumulation, u = 2⁻²², ``lowp``); then float32
    roundings (u = 2⁻²⁴): one for c_r times the chunk's sum; at most R·m − 1 in the tile's
    accumulator, to which a row group's chunks (at most R rows of m = ⌈T/chunk⌉ chunks, in
    any order) are added one by one; at most R − 1 summing the row groups' partial results
    (``row_scaled_tn``'s split). So R·m + R − 1 float32 roundings, counted as
    ⌈(R·m + R)/4⌉ at 2⁻²² (``_quarter``); a chain of γ_a then γ_b is within γ_{a+b}
    (Higham, Lemma 3.3)."""
    chunk = _chunk_t(chunk)
    m = -(-T // chunk)
    return min(T, chunk) + 1 + _quarter(R * m + R)


def norm_error_count(T: int, max_rows: int, chunk: int | None = None) -> int:
    """n such that every entry of a unit's h in ``unit_sq_norms`` is within
    γ_n(2⁻²²)·Σ_{r in u, t} |x_rt||y_rt| of its exact value: min(T, chunk) + 1 in a chunk's
    chain (as ``error_count``), then at most K·m − 1 float32 adds of the unit's K rows' m
    chunks each into h, counted as ⌈(K·m + 1)/4⌉ at 2⁻²²."""
    chunk = _chunk_t(chunk)
    m = max_rows * -(-T // chunk)
    return min(T, chunk) + 1 + _quarter(m + 1)


def _depth(T: int, chunk: int | None) -> int:
    """The K block: one chunk, or the whole row when it is shorter (a power of two ≥ 16)."""
    chunk = _chunk_t(chunk)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk {chunk} is not a power of two of at least 16 (one tl.dot)")
    return min(chunk, max(16, triton.next_power_of_2(T)))


def _blocks(a: int, b: int, T: int, chunk: int | None = None):
    """((BLOCK_A, BLOCK_B, BLOCK_T), warps, stages): H100/H200-sized 128×128 tiles (two
    float32 tiles of them in registers: 128 of a thread's registers at 8 warps), one chunk
    per K block; two stages of 128-deep bf16 blocks are 128 KiB of shared memory (the
    norm kernels'; the clipped sum's, ``_sum_blocks``, three)."""
    depth = _depth(T, chunk)
    if interpreting():
        return (16, 16, depth), 4, 1
    return (128 if a >= 128 else 64, 128 if b >= 128 else 64, depth), 8, 2 if depth >= 128 else 3


#: Shared memory one block may use on sm_90 (227 KiB): ``launches``' device.
SM90_SHARED = 232_448


def _sum_blocks(a: int, b: int, T: int, chunk: int | None = None, shared: int = SM90_SHARED,
                item: int = 2):
    """The clipped sum's config: ``_blocks``' tiles in three stages where the device's shared
    memory per block (``shared`` bytes; operands of ``item`` bytes) holds three stages of
    both operands' blocks (192 KiB with 128-deep bf16 blocks: an H100 or H200, not an A100's
    163 KiB), else ``_blocks``' stages. On an H200 (BENCHMARKS.md, "The clipped sum in three
    stages on an H200") the flat clipped sum ran at 360-440 TFLOP/s in three stages against
    220-268 in two at the 1.6 B model's layers (T = 1,024), and the DP step went from 0.379
    to 0.330 s (T1024x8) and from 0.381 to 0.351 s (T256x32); at the benchmark shapes it
    compiles for sm_90 without a spill (``tests/clipping/test_kernel_spills.py``)."""
    blocks, warps, stages = _blocks(a, b, T, chunk)
    if interpreting() or 3 * (blocks[0] + blocks[1]) * blocks[2] * item > shared:
        return blocks, warps, stages
    return blocks, warps, 3


_SHARED: dict = {}  # device index -> its shared memory per block


def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use on ``device`` (Triton's driver's figure, the
    one its launches are checked against; 0 where it cannot be read: two stages). Off CUDA
    (``benchmarks/launches.py``'s emulation of an H100/H200 on the CPU): ``SM90_SHARED``."""
    if device.type != "cuda":
        return SM90_SHARED
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SHARED:
        try:
            _SHARED[idx] = int(triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"])
        except Exception:  # noqa: BLE001 - another backend, an older Triton
            _SHARED[idx] = 0
    return _SHARED[idx]


def _norm_launch(a: int, b: int, T: int, chunk: int | None = None):
    """(config, flat) of the norm kernel: ``_blocks``, in the flat loop at T ≥ 1,024 (on an
    H200 the flat loop with 128-deep K blocks in two stages ran at 269-316 TFLOP/s against
    the nested loop's 239-305), nested below (at T = 256 the nested loop beat the flat one,
    201-231 against 163-178, with 64-deep blocks; 128-deep ones were not measured there)."""
    return _blocks(a, b, T, chunk), (not interpreting() and T >= 1024)


def _check_config(config, T: int, chunk: int | None):
    """A config's K block must be the chunk's (``_depth``): the bounds count on it."""
    if config is not None and config[0][2] != _depth(T, chunk):
        raise ValueError(f"the K block {config[0][2]} is not one chunk ({_depth(T, chunk)} "
                         f"positions at T = {T}, chunk {_chunk_t(chunk)}): the bounds count one dot a chunk")
    return config


def _wide(*ts: torch.Tensor) -> bool:
    """int64 offsets: some tensor's furthest element, or a masked lane past it (a tile
    reaches at most 256 past the end of each dimension but the first, the rows), is 2³¹
    elements or more from its start."""
    return any(sum((n - 1 + (256 if i else 0)) * abs(s) for i, (n, s) in enumerate(zip(t.shape, t.stride())))
               >= INT32_SPAN for t in ts)


def _launch(kernel, grid, args, kwargs) -> None:
    """Every launch of this module's kernels (``benchmarks/launches.py`` counts them here)."""
    kernel[grid](*args, **kwargs)


def _programs(device: torch.device) -> int:
    """Programs that fill the device: two per SM."""
    return 8 if interpreting() else 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _norm_call(X, Y, rows, ptr, num_units: int, chunk: int | None, config, flat):
    """(kernel, grid, args, kwargs, out) of ``unit_sq_norms``' launch."""
    T, a = X.shape[1], X.shape[2]
    b = Y.shape[2]
    default, default_flat = _norm_launch(a, b, T, chunk)
    blocks, warps, stages = _check_config(config, T, chunk) or default
    flat = default_flat if flat is None else flat
    ta, tb = triton.cdiv(a, blocks[0]), triton.cdiv(b, blocks[1])
    out = torch.empty((num_units, ta * tb), dtype=torch.float64, device=X.device)
    kernel = unit_sq_norms_flat_kernel if flat else unit_sq_norms_kernel
    args = (X, Y, rows, ptr, out, T, a, b, tb,
            X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2))
    kwargs = dict(BLOCK_A=blocks[0], BLOCK_B=blocks[1], BLOCK_T=blocks[2],
                  UPCAST=interpreting(), WIDE=_wide(X, Y), num_warps=warps, num_stages=stages)
    return kernel, (ta, tb, num_units), args, kwargs, out


def unit_sq_norms(X: torch.Tensor, Y: torch.Tensor, rows: torch.Tensor, ptr: torch.Tensor,
                  num_units: int, chunk: int | None = None, config=None, flat=None) -> torch.Tensor:
    """[U] float64: Σ over tiles of the float64 sum of squares of each tile of the float32
    h_u = Σ_{r in u} X_rᵀ Y_r (X [R, T, a], Y [R, T, b], same half dtype; the rows of unit
    u are ``rows[ptr[u]:ptr[u+1]]``). Nothing of size a×b per unit is written.
    ``config``: ((BLOCK_A, BLOCK_B, BLOCK_T), warps, stages) instead of ``_norm_launch``'s
    (``benchmarks/kernels.py`` sweeps them; BLOCK_T must be the chunk's, ``_depth``);
    ``flat``: the loop structure (default: the measured faster one, ``_norm_launch``)."""
    kernel, grid, args, kwargs, out = _norm_call(X, Y, rows, ptr, num_units, chunk, config, flat)
    if num_units:
        _launch(kernel, grid, args, kwargs)
    return out.sum(1)


def _row_scaled_call(X, Y, f, chunk: int | None, config, flat, programs: int, sink=None):
    """(kernel, grid, args, kwargs, out) of ``row_scaled_tn``'s launch, ``programs`` the
    number of programs that fill the device; ``sink``: added to in the kernel (``out`` is
    the sink itself when the rows are not split)."""
    R, T, a = X.shape
    b = Y.shape[2]
    blocks, warps, stages = _check_config(config, T, chunk) or _sum_blocks(
        a, b, T, chunk, _shared_memory(X.device), X.element_size())
    tiles = triton.cdiv(a, blocks[0]) * triton.cdiv(b, blocks[1])
    # Too few output tiles to fill the device (a small layer): split the rows into groups,
    # each with its own float32 partial result, summed afterwards (split-K over rows).
    split = max(1, min(R, programs // tiles))
    rows_per = triton.cdiv(R, split)
    split = triton.cdiv(R, rows_per)
    if sink is not None and split == 1:
        out = sink.view(1, a, b)  # each element read, added to, written by its one program
    else:
        out = torch.empty((split, a, b), dtype=torch.float32, device=X.device)
    grid = (triton.cdiv(a, blocks[0]), triton.cdiv(b, blocks[1]), split)
    kernel = row_scaled_tn_flat_kernel if (FLAT_ROW_SCALED if flat is None else flat) else row_scaled_tn_kernel
    args = (X, Y, f, out, out if sink is None else sink, R, T, a, b, rows_per,
            X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2))
    kwargs = dict(BLOCK_A=blocks[0], BLOCK_B=blocks[1], BLOCK_T=blocks[2],
                  UPCAST=interpreting(), WIDE=_wide(X, Y, out), ACC=sink is not None,
                  num_warps=warps, num_stages=stages)
    return kernel, grid, args, kwargs, out


def row_scaled_tn(X: torch.Tensor, Y: torch.Tensor, f: torch.Tensor, chunk: int | None = None,
                  config=None, flat=None, sink: torch.Tensor | None = None) -> torch.Tensor | None:
    """Σ_r f_r X_rᵀ Y_r as a float32 [a, b] tensor (X [R, T, a], Y [R, T, b], same half
    dtype; f [R]). ``config`` and ``flat`` as ``unit_sq_norms``'s (default: ``_blocks``,
    ``FLAT_ROW_SCALED``). ``sink`` (float32, contiguous [a, b]): the sum is added to it
    instead (returns None): in the kernel when the rows are not split (one float32 add per
    element, as ``sink.add_(result)``), else the groups' partial results, the first one
    holding the sink's value, summed into it (as many roundings as the sum and its add)."""
    f = _f32(f, X.device)
    kernel, grid, args, kwargs, out = _row_scaled_call(X, Y, f, chunk, config, flat,
                                                       _programs(X.device), sink)
    _launch(kernel, grid, args, kwargs)
    if sink is not None:
        if out.data_ptr() != sink.data_ptr():
            torch.sum(out, 0, out=sink)
        return None
    return out[0] if out.shape[0] == 1 else out.sum(0)


_F32: list = [None, -1, None, None]  # the last factors, their version, device, float32 copy


def _f32(f: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``f`` as contiguous float32 on ``device``, cast once for the step's calls (which all
    pass the same row factors); ``_version`` tells an in-place write to f."""
    if _F32[0] is not f or _F32[1] != f._version or _F32[2] != device:
        _F32[:] = [f, f._version, device, f.to(device=device, dtype=torch.float32).contiguous()]
    return _F32[3]


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
        kernel, _, args, kwargs, _ = _norm_call(X, Y, rows, ptr, R, None, None, flat)
        out.append(("norms" + (" (default)" if flat == default_flat else ""), kernel, args, kwargs))
    sink = torch.empty((a, b), dtype=torch.float32, device="meta")
    for flat in (FLAT_ROW_SCALED, not FLAT_ROW_SCALED):
        for into in (None, sink):  # the sum returned, or added to the sink in the kernel
            kernel, _, args, kwargs, _ = _row_scaled_call(X, Y, f, None, None, flat, 2 * sms, into)
            out.append(("clipped sum" + (" into the sink" if into is not None else "")
                        + (" (default)" if flat == FLAT_ROW_SCALED else ""), kernel, args, kwargs))
    return out
