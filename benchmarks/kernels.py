"""The clipping engine's kernels against cuBLAS's weight-gradient GEMM, per layer shape of the
1.6 B benchmark model (issues 36 and 52).

    python benchmarks/kernels.py                      # CUDA: the 8 layer shapes (T1024x8, T256x32)
    python benchmarks/kernels.py --json out.json      # also the rows as JSON
    python benchmarks/kernels.py --sweep              # + a sweep of tile configs at T1024x8
    TRITON_INTERPRET=1 python benchmarks/kernels.py --dry-run   # tiny shapes on the CPU (a rehearsal)

For each (T, R, p, d), X = G [R, T, p] (output gradients) and Y = A [R, T, d] (inputs) in
bf16, it times (median, CUDA events: ``triton.testing.do_bench``):
- ``cublas``: ``torch.mm(Xᵀ, Y)``, bf16 out: what a non-private backward does for the weight;
- ``clipped_sum``: ``_triton_rowscaled.row_scaled_tn`` (Σ_r f_r X_rᵀ Y_r in float32), default tiles;
- ``norms``: ``_triton_rowscaled.unit_sq_norms`` (per-unit ‖X_rᵀ Y_r‖², nothing a×b written);
- ``gram``: the Gram path's two Gram matrices (``lowp.gram_fast`` of X with X and of Y with Y:
  bf16 on tensor cores in chains of ``CHUNK_T`` positions, float32 sums), 2·R·T²·(p + d) FLOPs;
- ``row_norms``: ``lowp.row_norms2(X, Y)``, the rows' norm bounds (GB/s of X and Y read).
The GEMM-like rows give TFLOP/s (2·R·T·p·d FLOPs, the Gram's own count for ``gram``) and every
row its milliseconds, so ``ms / cublas ms`` is what the DP step pays per layer beyond the
non-private weight gradient. A kernel that fails prints why and the others go on.
``--sweep`` (T1024x8 only): the flat kernels' tile configurations, at chunks of 128 and of 64
positions (``CONFIGS``), each checked against the default's result before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (128256, 2048)]  # (p = out, d = in)
GRIDS = [(1024, 8), (256, 32)]  # (T, R)
DRY_SHAPES = [(64, 32), (160, 48)]
DRY_GRIDS = [(128, 2), (64, 3)]
# The K block is one chunk (``_triton_rowscaled._depth``: 128 positions at these T), so the
# sweep varies the tiles, warps and stages; first chunks of 64 positions (64-deep K blocks: the
# clipped sum's pipeline before issue 50's item 5, and a smaller bound at T = 1,024), then 128.
CONFIGS = [(64, (tiles, w, s)) for tiles, w, s in (((128, 128, 64), 8, 3), ((128, 128, 64), 8, 4),
                                                  ((128, 128, 64), 4, 3), ((128, 256, 64), 8, 3),
                                                  ((256, 128, 64), 8, 3))] + [
    (128, ((ba, bb, 128), w, s)) for (ba, bb), w, s in itertools.product(
        [(128, 128), (128, 256), (256, 128)], [4, 8], [2, 3])] + [
    (128, ((64, 128, 128), 4, 3)), (128, ((128, 64, 128), 4, 3)), (128, ((64, 256, 128), 8, 2))]
KINDS = ("cublas", "clipped_sum", "norms", "gram", "row_norms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also sweep the tile configs at T1024x8 (the first grid)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--json", help="also write the rows to this file (rewritten after each shape)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("needs CUDA (or --dry-run with TRITON_INTERPRET=1)")
        return 1
    device = "cpu" if args.dry_run else "cuda"
    print("per layer: TFLOP/s (ms); cublas = the non-private weight gradient; gram = both Gram "
          "matrices of the Gram path; row_norms in GB/s")
    rows = []
    grids = DRY_GRIDS if args.dry_run else GRIDS
    for (T, R), (p, d) in itertools.product(grids, DRY_SHAPES if args.dry_run else SHAPES):
        row = bench_shape(T, R, p, d, device, sweep=args.sweep and (T, R) == grids[0])
        rows.append(row)
        print(_line(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": _device_name(device), "rows": rows}, f, indent=2)
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"


def _timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")

    def cpu_ms(fn):
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    return cpu_ms


def bench_shape(T: int, R: int, p: int, d: int, device: str, sweep: bool = False) -> dict:
    from llmdp.clipping import _triton_rowscaled as k
    from llmdp.clipping import lowp

    g = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(R, T, p, device=device, generator=g).bfloat16()
    Y = torch.randn(R, T, d, device=device, generator=g).bfloat16()
    f = torch.rand(R, device=device, generator=g)
    rows, ptr = torch.arange(R, device=device), torch.arange(R + 1, device=device)
    ms = _timer(device)
    gemm = 2.0 * R * T * p * d
    work = {
        "cublas": (lambda: torch.mm(X.reshape(-1, p).t(), Y.reshape(-1, d)), gemm),
        "clipped_sum": (lambda: k.row_scaled_tn(X, Y, f), gemm),
        "norms": (lambda: k.unit_sq_norms(X, Y, rows, ptr, R), gemm),
        "gram": (lambda: (lowp.gram_fast(X, X.transpose(1, 2)), lowp.gram_fast(Y, Y.transpose(1, 2))),
                 2.0 * R * T * T * (p + d)),
        "row_norms": (lambda: lowp.row_norms2(X, Y), None),
    }
    out = {"T": T, "R": R, "p": p, "d": d}
    for name, (fn, flops) in work.items():
        try:
            t = ms(fn)
        except Exception as e:  # noqa: BLE001 - a kernel that does not build or run here
            out[name] = {"error": f"{type(e).__name__}: {str(e).strip()[:160]}"}
            continue
        out[name] = {"ms": t}
        if flops is not None:
            out[name]["tflops"] = flops / (t * 1e-3) / 1e12
        else:
            out[name]["gb_s"] = 2.0 * R * T * (p + d) / (t * 1e-3) / 1e9
    if sweep:
        out["sweep"] = _sweep(X, Y, f, rows, ptr, R, ms, gemm)
    return out


def _sweep(X, Y, f, rows, ptr, R, ms, flops) -> dict:
    """Every tile config of the flat kernels, each checked against the default's result
    first: {"configs": [{"config", "clipped_sum", "norms"} (TFLOP/s, or the error)], "best"}."""
    from llmdp.clipping import _triton_rowscaled as k

    ref_rs = k.row_scaled_tn(X, Y, f, flat=True)
    ref_n = k.unit_sq_norms(X, Y, rows, ptr, R, flat=True)
    runs = []
    for chunk, cfg in CONFIGS:
        row = {"config": cfg, "chunk": chunk}
        for name, fn, ref, tol in (
                ("clipped_sum", lambda c, n: k.row_scaled_tn(X, Y, f, chunk=n, config=c, flat=True), ref_rs, 1e-3),
                ("norms", lambda c, n: k.unit_sq_norms(X, Y, rows, ptr, R, chunk=n, config=c, flat=True), ref_n, 0)):
            try:
                torch.testing.assert_close(fn(cfg, chunk), ref, rtol=1e-4, atol=tol)
                row[name] = flops / (ms(lambda c=cfg, n=chunk, fn=fn: fn(c, n)) * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory)
                row[name] = f"{type(e).__name__}: {str(e)[:80]}"
        runs.append(row)
    best = {name: max((r for r in runs if isinstance(r[name], float)), key=lambda r: r[name], default=None)
            for name in ("clipped_sum", "norms")}
    return {"configs": runs, "best": {n: (r["config"], r["chunk"], r[n]) if r else None for n, r in best.items()}}


def _line(r: dict) -> str:
    parts = []
    for name in KINDS:
        v = r[name]
        if "error" in v:
            parts.append(f"{name} FAILED ({v['error'][:60]})")
        elif "tflops" in v:
            parts.append(f"{name} {v['tflops']:.0f} ({v['ms']:.3f})")
        else:
            parts.append(f"{name} {v['gb_s']:.0f} GB/s ({v['ms']:.3f})")
    sweep = f"  sweep best {r['sweep']['best']}" if "sweep" in r else ""
    return f"T{r['T']}x{r['R']} {r['p']}x{r['d']}: " + ", ".join(parts) + sweep


if __name__ == "__main__":
    raise SystemExit(main())
