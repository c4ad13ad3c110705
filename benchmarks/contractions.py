"""The clipping engine's contractions against the non-private weight-gradient GEMM.

For each layer shape of a model (default: the 1.6 B Llama of issue 15: hidden 2048,
intermediate 8192, vocabulary 128,256) and a batch of R rows of T positions, times in one run:

* ``weight-grad``   Gᵀ·A in the model's dtype (what a non-private backward computes);
* ``clipped-sum``   Σ_r c_r G_rᵀA_r as the engine forms it (``lowp.row_scaled_tn``: the
                    Triton kernel for bf16/fp16 on CUDA, elsewhere widened float32 GEMMs
                    over groups of rows summed in float64);
* ``widened-fp32``  the previous engine's way: widen both operands to float32, scale the
                    smaller one, one float32 GEMM (SIMT on CUDA);
* ``gram``          the ghost norm's two Gram matrices (``lowp.gram``, float64) for comparison;

and prints each as a ratio to ``weight-grad``. Run on a GPU:

    python benchmarks/contractions.py --device cuda --dtype bfloat16

On CPU (``--device cpu``) only the fallback exists; use small shapes (``--small``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmdp.clipping import lowp  # noqa: E402


def _time(fn, device, reps):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (hidden 256, T 128)")
    a = ap.parse_args(argv)
    if a.small:
        a.rows, a.seq, a.hidden, a.intermediate, a.vocab = 4, 128, 256, 688, 4096
    device, dt = torch.device(a.device), getattr(torch, a.dtype)
    R, T, h = a.rows, a.seq, a.hidden
    shapes = {"attn q/o": (h, h), "mlp up/gate": (a.intermediate, h), "mlp down": (h, a.intermediate),
              "lm head": (a.vocab, h)}
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"dtype {a.dtype}, R={R} T={T}; times in ms, ratio to the weight-grad GEMM")
    print(f"{'layer':<12} {'weight-grad':>12} {'clipped-sum':>18} {'widened-fp32':>18} {'gram':>18}")
    for name, (p, d) in shapes.items():
        print(_row(name, p, d, R, T, device, dt, a.reps))


def _row(name, p, d, R, T, device, dt, reps):
    G = torch.randn(R, T, p, device=device).to(dt)
    A = torch.randn(R, T, d, device=device).to(dt)
    f = torch.rand(R, device=device)
    G2, A2 = G.reshape(R * T, p), A.reshape(R * T, d)

    def wgrad():
        return G2.t() @ A2

    def clipped():
        return lowp.row_scaled_tn(G, A, f)

    def widened():
        with lowp.exact_fp32(device):
            Af = (A.float() * f[:, None, None]).reshape(R * T, d)
            return G.float().reshape(R * T, p).t() @ Af

    def gram():
        return lowp.gram(G, G), lowp.gram(A, A)

    base = _time(wgrad, device, reps)
    row = [f"{name:<12} {base * 1e3:>12.2f}"]
    for fn in (clipped, widened, gram):
        try:
            t = _time(fn, device, reps)
            row.append(f"{t * 1e3:>10.2f} ({t / base:4.2f}x)")
        except torch.OutOfMemoryError:
            row.append(f"{'out of memory':>18}")
            torch.cuda.empty_cache()
    return " ".join(row)

if __name__ == "__main__":
    main()
