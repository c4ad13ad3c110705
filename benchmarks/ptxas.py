"""Registers and spills of the clipping engine's Triton kernels, compiled for sm_90 on any
machine (Triton's compiler and bundled ptxas, no GPU): every kernel of
``llmdp/clipping/_triton_rowscaled.py`` as the engine launches it for each layer shape of
the 1.6 B benchmark model (``benchmarks/kernels.py``'s SHAPES) at T x R = 1024 x 8 and
256 x 32, bf16, both loop structures.

    python benchmarks/ptxas.py            # the table
    python benchmarks/ptxas.py --quick    # the 2048 x 2048 layer only

A kernel that spills keeps part of its accumulators in local memory (``spill`` bytes per
thread): ``tests/clipping/test_kernel_spills.py`` fails on any.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernels import SHAPES  # noqa: E402

RUNS = ((1024, 8), (256, 32))


def rows(shapes=SHAPES, runs=RUNS, capability: int = 90):
    """[(T, R, p, d, label, config, report, unaligned report)] for every kernel launch of
    these shapes (``llmdp._triton.ptxas_usage``: as launched, and without divisibility
    hints, as for sizes that are not multiples of 16)."""
    from llmdp._triton import ptxas_usage
    from llmdp.clipping import _triton_rowscaled as k

    out = []
    for T, R in runs:
        for p, d in shapes:
            for label, kernel, args, kwargs in k.launches(R, T, p, d):
                cfg = (f"{kwargs['BLOCK_A']}x{kwargs['BLOCK_B']}x{kwargs['BLOCK_T']} "
                       f"w{kwargs['num_warps']} s{kwargs['num_stages']}")
                out.append((T, R, p, d, label, cfg, ptxas_usage(kernel, args, kwargs, capability),
                            ptxas_usage(kernel, args, kwargs, capability, aligned=False)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--capability", type=int, default=90)
    args = ap.parse_args(argv)
    shapes = SHAPES[:1] if args.quick else SHAPES
    print("| T × R | layer p × d | kernel | tiles, warps, stages | registers | spill stores / "
          "loads (B) | shared (KiB) | unaligned: registers | spills |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for T, R, p, d, label, cfg, rep, un in rows(shapes, capability=args.capability):
        print(f"| {T} × {R} | {p} × {d} | {rep['name']} {label} | {cfg} | {rep['registers']} | "
              f"{rep['spill_stores']} / {rep['spill_loads']} | {rep['shared'] / 1024:.0f} | "
              f"{un['registers']} | "
              f"{un['spill_stores']} / {un['spill_loads']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
