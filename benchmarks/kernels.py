"""The clipping engine's two Triton kernels against cuBLAS's weight-gradient GEMM, per layer
shape of the 1.6 B benchmark model, with a sweep of tile configurations (issue 36).

    python benchmarks/kernels.py                 # CUDA: T1024x8 and T256x32, the sweep at T1024x8
    python benchmarks/kernels.py --quick         # the default config only

On the first H100 run (BENCHMARKS.md, "The GPU path on an H100") the two kernels ran at
about 320 TFLOP/s where cuBLAS's weight gradient runs at about 600: the DP step's largest
gap to the non-private one. For each (T, R, p, d) this prints the TFLOP/s of
``torch.mm(Gᵀ, A)`` (bf16 out, what a non-private backward does), of ``row_scaled_tn`` and
``unit_sq_norms`` with the default tiles in both loop structures (nested, flat), and the best
tile config of the flat kernels, checking each config's result against the default's (the
same sums, to float32 rounding) before timing it. Timing: ``triton.testing.do_bench`` (CUDA
events, median). Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (128256, 2048)]  # (p = out, d = in)
# The K block is one chunk (``_triton_rowscaled._depth``: 128 positions at these T), so the
# sweep varies the tiles, warps and stages.
CONFIGS = [((ba, bb, 128), w, s) for (ba, bb), w, s in itertools.product(
    [(128, 128), (128, 256), (256, 128)], [4, 8], [2, 3])] + [
    ((64, 128, 128), 4, 3), ((128, 64, 128), 4, 3), ((64, 256, 128), 8, 2)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    print("TFLOP/s; nested = one K loop per chunk, flat = one pipelined loop; same = the flat "
          "kernel's result equals the nested one's bit for bit")
    print(f"{'T x R':>9} {'p x d':>13} {'cuBLAS':>7} | {'rs nest':>7} {'flat':>5} {'best':>5} | "
          f"{'nrm nest':>8} {'flat':>5} {'best':>5} | same  best configs (flat)")
    for T, R in ((1024, 8), (256, 32)):
        for p, d in SHAPES:
            bench_shape(T, R, p, d, args.quick or T != 1024)
            torch.cuda.empty_cache()
    return 0


def bench_shape(T: int, R: int, p: int, d: int, quick: bool) -> None:
    from triton.testing import do_bench

    from llmdp.clipping import _triton_rowscaled as k

    g = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(R, T, p, device="cuda", generator=g).bfloat16()
    Y = torch.randn(R, T, d, device="cuda", generator=g).bfloat16()
    f = torch.rand(R, device="cuda", generator=g)
    rows, ptr = torch.arange(R, device="cuda"), torch.arange(R + 1, device="cuda")
    flops = 2.0 * R * T * p * d

    def tflops(fn) -> float:
        return flops / (do_bench(fn, return_mode="median") * 1e-3) / 1e12

    Xf, Yf = X.reshape(-1, p), Y.reshape(-1, d)
    cublas = tflops(lambda: torch.mm(Xf.t(), Yf))
    ref_rs = k.row_scaled_tn(X, Y, f, flat=False)
    ref_n = k.unit_sq_norms(X, Y, rows, ptr, R, flat=False)
    same = (torch.equal(k.row_scaled_tn(X, Y, f, flat=True), ref_rs)
            and torch.equal(k.unit_sq_norms(X, Y, rows, ptr, R, flat=True), ref_n))
    rs = [tflops(lambda fl=fl: k.row_scaled_tn(X, Y, f, flat=fl)) for fl in (False, True)]
    nr = [tflops(lambda fl=fl: k.unit_sq_norms(X, Y, rows, ptr, R, flat=fl)) for fl in (False, True)]
    best_rs, best_n = (max(rs), None), (max(nr), None)
    for cfg in ([] if quick else CONFIGS):
        try:
            torch.testing.assert_close(k.row_scaled_tn(X, Y, f, config=cfg, flat=True), ref_rs,
                                       rtol=1e-4, atol=1e-3)
            t = tflops(lambda c=cfg: k.row_scaled_tn(X, Y, f, config=c, flat=True))
            best_rs = max(best_rs, (t, cfg), key=lambda x: x[0])
            torch.testing.assert_close(k.unit_sq_norms(X, Y, rows, ptr, R, config=cfg, flat=True),
                                       ref_n, rtol=1e-4, atol=0)
            t = tflops(lambda c=cfg: k.unit_sq_norms(X, Y, rows, ptr, R, config=c, flat=True))
            best_n = max(best_n, (t, cfg), key=lambda x: x[0])
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory)
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
    print(f"{T:>5}x{R:<3} {p:>6}x{d:<6} {cublas:7.0f} | {rs[0]:7.0f} {rs[1]:5.0f} {best_rs[0]:5.0f} | "
          f"{nr[0]:8.0f} {nr[1]:5.0f} {best_n[0]:5.0f} | {str(same):5} rs {best_rs[1]}  norms {best_n[1]}",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
