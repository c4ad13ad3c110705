"""The streaming noise's cost: one step of correlated noise against DP-SGD's draw, in one
process, as ratios.

    python benchmarks/mf_stream.py [--dims 354624 4000000] [--steps 50] [--reps 20]

For each d (the demo's trainable parameters by default, and a larger vector), the median
time of one step of: DP-SGD's in-place draw (`noise.add_noise_`, ChaCha20 + Box-Muller
into the sum), banded MF (b = 4, cyclic Poisson's strategy for --steps steps) and BLT (the
fixed-cycle strategy, its buffers as optimized), each adding its row of (scale·C)⁻¹Z to a
float32 sum of d coordinates, at a step t ≥ b (every buffer live); and the state each
keeps (n_buf · d float32). The correlated step *includes* the DP-SGD draw of z_t, so its
ratio minus 1 is the overhead. Memory-bound on a GPU: the extra bytes per coordinate and
step are those of `llmdp.privacy.mf.stream`'s docstring (banded 4·(3(b−1) + 6) − 8, BLT
4·(6n + 4) + 8 − 8 for float32), i.e. time ≈ extra bytes · d / memory bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from llmdp.privacy.mf.optimize import strategy_for
from llmdp.privacy.mf.stream import CorrelatedNoise
from llmdp.privacy.noise import gaussian as dp_noise


def _medians_s(fns: list, reps: int) -> list[float]:
    """Median time of each of ``fns``, interleaved rep by rep (load hits all alike), after
    one warm-up call each."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[354_624, 4_000_000])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "llmdp-mf-bench"))
    a = ap.parse_args()
    if a.reps + 9 > a.steps:
        ap.error(f"--reps {a.reps} needs --steps >= {a.reps + 9} (the stream's horizon)")
    facts = {
        "banded-mf b=4": strategy_for("banded-mf", a.steps, bands=4, cache_dir=a.cache),
        "blt": strategy_for("blt", a.steps, min_sep=a.steps, max_participations=1, cache_dir=a.cache),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; T={a.steps}, float32")
    print(f"{'d':>10} {'mechanism':<16} {'n_buf':>5} {'step ms':>9} {'vs dp-sgd':>9} {'state MB':>9}")
    for d in a.dims:
        x = torch.zeros(d)
        key = bytes(32)
        streams = {name: CorrelatedNoise(fact, [x.shape]) for name, fact in facts.items()}
        for s in streams.values():  # past the first rows: every buffer live
            for _ in range(8):
                s.add_([x], key, 1.0)
        fns = [lambda x=x, key=key: dp_noise.add_noise_([x], key, 1.0)]
        fns += [lambda s=s, x=x, key=key: s.add_([x], key, 1.0) for s in streams.values()]
        base, *rest = _medians_s(fns, a.reps)
        print(f"{d:>10} {'dp-sgd':<16} {0:>5} {1e3 * base:>9.2f} {1.0:>9.2f} {0:>9.1f}")
        for (name, s), t in zip(streams.items(), rest):
            print(f"{d:>10} {name:<16} {s.n_buf:>5} {1e3 * t:>9.2f} {t / base:>9.2f} "
                  f"{s.nbytes / 1e6:>9.1f}")

if __name__ == "__main__":
    main()
