"""Triton kernel: the clipped sum of one layer, Σ_r c_r · X_rᵀ Y_r, on tensor cores.

X [R, T, a] and Y [R, T, b] are a layer's output gradient and input (bf16/fp16), c [R] the
rows' clipping factors (float32). Each program owns one [BLOCK_A, BLOCK_B] tile of the
[a, b] result. For each row r it accumulates X_rᵀ Y_r over the row's T positions in a
float32 register tile (``tl.dot`` on bf16/fp16 operands: tensor cores, exact products,
float32 accumulation), then adds ``c_r ·`` that partial sum, in float32, to the tile's
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

if triton is not None:

    @triton.jit
    def row_scaled_tn_kernel(
        X, Y, F, OUT, R, T, A, B, ROWS_PER,
        sxr, sxt, sxa, syr, syt, syb,
        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        pid_a = tl.program_id(0)
        pid_b = tl.program_id(1)
        pid_s = tl.program_id(2)  # a group of rows (few output tiles: split the rows too)
        offs_a = pid_a * BLOCK_A + tl.arange(0, BLOCK_A)
        offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        mask_a = offs_a < A
        mask_b = offs_b < B
        acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
        r_end = tl.minimum(R, (pid_s + 1) * ROWS_PER)
        for r in range(pid_s * ROWS_PER, r_end):
            f = tl.load(F + r)
            part = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
            for t0 in range(0, T, BLOCK_T):
                offs_t = t0 + tl.arange(0, BLOCK_T)
                mask_t = offs_t < T
                x = tl.load(X + r * sxr + offs_t[:, None] * sxt + offs_a[None, :] * sxa,
                            mask=mask_t[:, None] & mask_a[None, :], other=0.0)
                y = tl.load(Y + r * syr + offs_t[:, None] * syt + offs_b[None, :] * syb,
                            mask=mask_t[:, None] & mask_b[None, :], other=0.0)
                if UPCAST:  # the interpreter's bf16 dot is wrong: the same exact products in fp32
                    part = tl.dot(tl.trans(x.to(tl.float32)), y.to(tl.float32), part,
                                  input_precision="ieee")
                else:
                    part = tl.dot(tl.trans(x), y, part)
            acc += f * part
        tl.store(OUT + pid_s * A * B + offs_a[:, None] * B + offs_b[None, :], acc,
                 mask=mask_a[:, None] & mask_b[None, :])


def error_count(R: int, T: int) -> int:
    """Roundings any product goes through in the kernel (the clipped sum's bound,
    ``lowp.row_scaled_bound``): at most T in its row's float32 dot chain (``part``), one
    for c_r·part, at most R in the tile's accumulator, at most R in the sum of the row
    groups. With the tensor cores' truncating accumulation this is γ_n(2⁻²²), ``lowp``."""
    return T + 2 * R + 2


def row_scaled_tn(X: torch.Tensor, Y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Σ_r f_r X_rᵀ Y_r as a float32 [a, b] tensor (X [R, T, a], Y [R, T, b], same half
    dtype; f [R])."""
    R, T, a = X.shape
    b = Y.shape[2]
    f = f.to(device=X.device, dtype=torch.float32).contiguous()
    if interpreting():
        blocks, warps, stages, programs = (16, 16, 16), 4, 1, 8
    else:  # H100/A100-sized tiles: 128×128 float32 accumulators, 64-deep bf16 K steps
        blocks = (128 if a >= 128 else 64, 128 if b >= 128 else 64, 64 if T >= 64 else 32)
        warps, stages = 8, 3
        programs = 2 * torch.cuda.get_device_properties(X.device).multi_processor_count
    tiles = triton.cdiv(a, blocks[0]) * triton.cdiv(b, blocks[1])
    # Too few output tiles to fill the device (a small layer): split the rows into groups,
    # each with its own float32 partial result, summed afterwards (split-K over rows).
    split = max(1, min(R, programs // tiles))
    rows_per = triton.cdiv(R, split)
    split = triton.cdiv(R, rows_per)
    out = torch.empty((split, a, b), dtype=torch.float32, device=X.device)
    grid = (triton.cdiv(a, blocks[0]), triton.cdiv(b, blocks[1]), split)
    row_scaled_tn_kernel[grid](
        X, Y, f, out, R, T, a, b, rows_per,
        X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2),
        BLOCK_A=blocks[0], BLOCK_B=blocks[1], BLOCK_T=blocks[2], UPCAST=interpreting(),
        num_warps=warps, num_stages=stages,
    )
    return out[0] if split == 1 else out.sum(0)
