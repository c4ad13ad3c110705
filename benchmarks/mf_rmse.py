"""Correlated noise's own figure of merit at equal (ε, δ): the root-mean-square noise in
the prefix sums (the model iterates of SGD) per unit clipping bound, σ·RMSE(C), for DP-SGD,
banded MF and BLT, each with σ calibrated to the same ε on its own analysis.

    python benchmarks/mf_rmse.py                      # the demo's shape (N, B, T below)
    python benchmarks/mf_rmse.py --steps 2000 --epsilon 1 3 8 16
    python benchmarks/mf_rmse.py --momentum 0.9 --schedule cosine --warmup-ratio 0.2
                                                      # SGD with momentum, the demo's schedule

Prints one row per (ε, mechanism): σ, the strategy's RMSE per unit σ, their product (lower
is better) and its ratio to DP-SGD's, and the optimizer's wall time. No training: this is the
noise the optimizer sees, not the model's loss. With --momentum / --schedule the workload is
SGD's with that momentum and learning-rate schedule (A[t, j] = Σ_{i=j..t} η_i β^(i−j), the one
the plan optimizes the strategies for when `optim.name: sgd`); the default is prefix sums.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

from llmdp.config.schema import OptimConfig, lr_lambda
from llmdp.privacy.mechanism import BandedMf, Blt
from llmdp.privacy.mf.workload import rmse, rmse_identity
from llmdp.privacy.plan import make_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset-size", type=int, default=14251)  # the demo's sequence units
    ap.add_argument("--batch-size", type=float, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--epsilon", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    ap.add_argument("--bands", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD's momentum β")
    ap.add_argument("--schedule", default="constant", choices=("constant", "cosine", "linear"))
    ap.add_argument("--warmup-ratio", type=float, default=0.0)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "llmdp-mf-bench"))
    a = ap.parse_args()
    n, b, t = a.dataset_size, a.batch_size, a.steps
    f = lr_lambda(OptimConfig(name="sgd", momentum=a.momentum, schedule=a.schedule,
                              warmup_ratio=a.warmup_ratio), t)
    lrs = [float(f(i)) for i in range(t)]
    work = dict(momentum=a.momentum, learning_rates=lrs)
    print(f"N={n} B={b:g} T={t} delta={a.delta:g}; workload: SGD, momentum {a.momentum:g}, "
          f"{a.schedule} learning rate, warmup {a.warmup_ratio:g}·T")
    print(f"{'eps':>5} {'mechanism':<28} {'sigma':>8} {'rmse/sigma':>10} {'noise':>8} {'vs dp-sgd':>9} {'opt s':>6}")
    base = dict(dataset_size=n, expected_batch_size=b, max_grad_norm=1.0, steps=t,
                delta=a.delta)
    mf = dict(strategy_cache=a.cache, **work)
    for eps in a.epsilon:
        sgd = make_plan(target_epsilon=eps, **base)
        ident = rmse_identity(t, **work)
        ref = sgd.noise_multiplier * ident
        rows = [("dp-sgd (poisson)", sgd.noise_multiplier, ident, 0.0)]
        configs = [(f"banded-mf b={k} (cyclic-poisson)",
                    dict(mechanism=BandedMf(bands=k, **mf), sampler="cyclic-poisson"))
                   for k in a.bands if k * b <= n]
        configs += [(f"banded-mf b={k} (fixed-cycle)",
                     dict(mechanism=BandedMf(bands=k, **mf), sampler="fixed-cycle")) for k in a.bands]
        configs += [("blt (fixed-cycle)", dict(mechanism=Blt(**mf), sampler="fixed-cycle"))]
        for name, kw in configs:
            t0 = time.perf_counter()
            p = make_plan(target_epsilon=eps, **base, **kw)
            fact = p.factorization()
            fixed = p.sampler == "fixed-cycle"
            r = rmse(fact, **work, min_sep=p.cycle if fixed else None,
                     max_participations=p.ledger_steps if fixed else None)
            rows.append((name, p.noise_multiplier, r, fact.meta.get("seconds",
                                                                    time.perf_counter() - t0)))
        for name, sigma, r, sec in rows:
            print(f"{eps:>5g} {name:<28} {sigma:>8.4f} {r:>10.4f} {sigma * r:>8.4f} "
                  f"{sigma * r / ref:>9.3f} {sec:>6.2f}")
        assert math.isfinite(ref)


if __name__ == "__main__":
    main()
