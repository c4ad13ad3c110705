r"""Issue 29 item 1, measured: a unit whose ghost norm is a small difference of huge terms.

One ``nn.Linear(d, p)`` and one unit of T positions: inputs a + 0.01·randn with
a[0] = big (a "massive activation" channel shared by every position), output gradients
G_t = (−1)^t·v (they cancel across positions, so the big channel cancels in
g = Σ_t G_t A_tᵀ), C = 1e-6 (the unit is clipped). For each case it prints what the real
``GhostClipper`` added, measured in float64 from the float32 sinks (contribution / C,
which must be ≤ 1), the norm it reported against the true norm (computed from A and G in
float64), the fallbacks to exact instantiation and the largest bound share
(``GhostClipper.last_norm_stats``), and the time of the backward.

    python benchmarks/massive_activation.py            # the issue's cases, small and large
    python benchmarks/massive_activation.py --quick    # T ≤ 256, the 64x64 layer only
    python benchmarks/massive_activation.py --gram lowp  # the float32 Grams forced (gram.py)
    python benchmarks/massive_activation.py --device cuda --json out.json   # on a GPU, rows as JSON

On CUDA the wide cases run in bf16 too (the tensor-core Grams, the tile kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdp.clipping import GhostClipper, gram  # noqa: E402

C = 1e-6


def case(T: int, big: float, d: int, p: int, policy: str, mode: str, dtype: torch.dtype,
         seed: int = 0, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    lin = nn.Linear(d, p, bias=False).to(device=device, dtype=dtype)
    a = torch.randn(d, generator=g)
    a[0] = big
    A = (a + 0.01 * torch.randn(T, d, generator=g)).to(device=device, dtype=dtype)
    sign = torch.tensor([(-1.0) ** t for t in range(T)])[:, None]
    G = (sign * torch.randn(p, generator=g)).to(device=device, dtype=dtype)
    sinks = {"weight": torch.zeros(p, d, device=device)}
    clipper = GhostClipper(lin, C, mode=mode, layer_policy=policy, grad_buffers=sinks)
    loss = (lin(A[None]) * G[None]).sum((1, 2))
    t0 = time.perf_counter()
    norms = clipper.backward(loss, torch.tensor([0], device=device))
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    true = float((G.double().T @ A.double()).norm())
    stats = getattr(clipper, "last_norm_stats", None)
    return {"ratio": float(sinks["weight"].double().norm()) / C, "norm": float(norms[0]),
            "true": true, "fallbacks": getattr(stats, "fallbacks", None),
            "bound": getattr(stats, "bound_max", None), "mode": clipper.last_mode, "s": dt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gram", choices=gram.POLICIES, default="auto",
                    help="the Gram path of Linear ghost norms (gram.forced)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    with gram.forced(args.gram):
        return _main(args)


def _main(args) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    small = [(64, 10.0), (64, 100.0), (64, 1000.0), (256, 100.0)]
    if not args.quick:
        small += [(1024, 100.0), (2048, 100.0), (64, 1e4)]
    for T, big in small:
        for policy, mode in [("ghost", "book-keeping"), ("instantiate", "book-keeping"), ("auto", "auto")]:
            for dtype in (torch.float32, torch.bfloat16):
                rows.append((f"64x64 T={T} big={big:g} {policy}/{mode} {str(dtype)[6:]}",
                             case(T, big, 64, 64, policy, mode, dtype, device=args.device)))
    if not args.quick:
        wide = (torch.float32, torch.bfloat16) if args.device == "cuda" else (torch.float32,)
        for n in (1024, 4096):
            for big in (100.0, 1000.0):
                for dtype in wide:
                    rows.append((f"{n}x{n} T=512 big={big:g} auto/auto {str(dtype)[6:]}",
                                 case(512, big, n, n, "auto", "auto", dtype, device=args.device)))
    print(f"{'case':44s} {'added/C':>12s} {'norm/true':>12s} {'fallbacks':>9s} {'bound':>9s} "
          f"{'mode':>12s} {'s':>7s}")
    for name, r in rows:
        fb = "-" if r["fallbacks"] is None else str(r["fallbacks"])
        bd = "-" if r["bound"] is None else f"{r['bound']:.1e}"
        print(f"{name:44s} {r['ratio']:12.7g} {r['norm'] / r['true']:12.9f} {fb:>9s} {bd:>9s} "
              f"{r['mode']:>12s} {r['s']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "gram": args.gram,
                       "rows": [{"case": name, **r} for name, r in rows]}, f, indent=2)
    worst = max(r["ratio"] for _, r in rows)
    print(f"largest added/C: {worst:.7g} ({'within C' if worst <= 1 + 1e-6 else 'ABOVE C'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
