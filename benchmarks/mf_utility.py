"""Correlated noise against DP-SGD on the demo, at equal ε, steps, batch and compute.

    python benchmarks/mf_utility.py [--seeds 0,1,2] [--epsilons 1,3,8] [--out-dir runs/mf]
        [--mechanisms dp-sgd,banded-mf,blt] [--sgd LR [--momentum 0.9]]

From the public-pretrained start (`recipes/demo-finetune.yaml`, the model
`recipes/demo-pretrain.yaml` trains first if it is not complete), for each ε, mechanism and
seed, one run of `llmdp train` with the same data, T = 50 steps, B = 256, learning rate,
clipping norm and DP evaluation (its ε = 0.5 inside the target, as in the demo):

  dp-sgd      Poisson sampling, independent noise
  banded-mf   bands 4, cyclic Poisson over 4 groups (amplified; q_g = 4·B/N)
  blt         BLT (buffers grown up to 8), fixed cycle: every unit of the step's group, one
              participation in the demo's 50 steps (cycle round(N/B) = 56 > T)

With `--sgd LR` every run trains with SGD (momentum 0.9 unless --momentum says otherwise) at
that learning rate instead of AdamW at 3e-3 (pinned: the recipe's own optimizer is now SGD),
with the same cosine schedule: the workload
the strategies are optimized for (momentum and schedule included). Run names start with
`sgd{momentum}-lr{LR}-`.

Every run uses `privacy.rng=seeded privacy.seed=SEED`: the seed draws the batches and the
noise, the randomness DP adds (pinned, so the numbers can be regenerated; such a report says
its noise is seeded: measurements, not releases). Ledger records go to OUT_DIR/ledger.sqlite.
A run already complete in OUT_DIR is not run again (interrupt and restart at will).

Prints, per (ε, mechanism), the pooled final held-out loss (internal: computed without DP),
the DP evaluation's released loss (and its noise std), σ, the median step time (steps 2+;
the streaming noise is inside it) and the stream's state (n_buf · d float32 values), then
the same table in Markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from privacy_utility import PRETRAIN, REPO, llmdp, run_all  # noqa: E402

RECIPE = "recipes/demo-finetune.yaml"
MECHANISMS = {  # each pinned in full: the recipe's own mechanism is banded MF (issue 54)
    "dp-sgd": ["privacy.mechanism=dp-sgd", "privacy.sampler=poisson", "privacy.bands=null"],
    "banded-mf": ["privacy.mechanism=banded-mf", "privacy.sampler=cyclic-poisson", "privacy.bands=4"],
    "blt": ["privacy.mechanism=blt", "privacy.sampler=fixed-cycle", "privacy.bands=null"],
}
# Without --sgd: the AdamW these tables were measured with (the recipe now says SGD).
ADAMW = ("train.hyperparameters_from=null", "optim.name=adamw", "optim.lr=0.003", "optim.momentum=0")


def runs(seeds, epsilons, mechanisms=tuple(MECHANISMS), optim: tuple[str, ...] = (),
         prefix: str = "") -> list[tuple[str, float, int, str, list[str]]]:
    """(mechanism, ε, seed, run name, overrides), seeds outermost. ``optim``: overrides of the
    optimizer shared by every run (their name starts with ``prefix``)."""
    return [(mech, eps, seed, f"{prefix}{mech}-eps{eps:g}-seed{seed}",
             [*MECHANISMS[mech], *optim, f"privacy.target_epsilon={eps:g}", "privacy.rng=seeded",
              f"privacy.seed={seed}"])
            for seed in seeds for eps in epsilons for mech in mechanisms]


def measure(run_dir: str) -> dict:
    """One run's numbers: from its report, and its step times from metrics.jsonl."""
    from llmdp.report.compare import load_run

    row = load_run(run_dir)
    with open(os.path.join(run_dir, "privacy_report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        times = [r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r and r.get("step", 0) > 1]
    d = rep["noise_generator"]["trainable_parameters"]
    corr = rep.get("correlated_noise") or {}
    n_buf = (corr["bands"] - 1 if corr.get("mechanism") == "banded-mf" else
             corr.get("buffers", 0)) if corr else 0
    return {"loss": row["heldout"]["loss"], "dp_loss": (row["dp_eval"] or {}).get("loss"),
            "dp_loss_std": (row["dp_eval"] or {}).get("loss_std"), "epsilon": row["epsilon"],
            "sigma": rep["noise_multiplier"], "step_s": statistics.median(times),
            "state_mb": n_buf * d * 4 / 1e6, "n_buf": n_buf, "d": d}


def _pm(xs: list[float], spec: str = ".4f") -> str:
    m = statistics.fmean(xs)
    return f"{m:{spec}} ± {statistics.stdev(xs):{spec}}" if len(xs) > 1 else f"{m:{spec}}"


def table(results: dict) -> str:
    lines = ["| ε | mechanism | runs | held-out loss (internal), mean ± sd [min, max] | DP-evaluation "
             "loss, mean ± sd (noise std) | σ | step time, median s | stream state |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for (eps, mech), ms in sorted(results.items(), key=lambda kv: (kv[0][0], list(MECHANISMS).index(kv[0][1]))):
        loss = [m["loss"] for m in ms]
        dp = [m["dp_loss"] for m in ms if m["dp_loss"] is not None]
        std = ms[0]["dp_loss_std"]
        state = (f"{ms[0]['n_buf']} × d = {ms[0]['state_mb']:.1f} MB" if ms[0]["n_buf"] else "–")
        lines.append(f"| {eps:g} | {mech} | {len(ms)} | {_pm(loss)} [{min(loss):.4f}, {max(loss):.4f}] | "
                     f"{_pm(dp, '.3f') if dp else '–'}" + (f" ({std:.3f})" if std else "") + " | "
                     f"{ms[0]['sigma']:.4g} | {statistics.median(m['step_s'] for m in ms):.2f} | {state} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epsilons", default="1,3,8")
    ap.add_argument("--out-dir", default="runs/mf")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
    ap.add_argument("--sgd", type=float, metavar="LR", default=None,
                    help="SGD with momentum (--momentum) at this learning rate instead of the "
                         "recipe's AdamW: the workload the strategies are optimized for")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    epsilons = [float(e) for e in args.epsilons.split(",")]
    mechanisms = args.mechanisms.split(",")
    unknown = sorted(set(mechanisms) - set(MECHANISMS))
    if unknown:
        ap.error(f"--mechanisms: unknown {', '.join(unknown)}; choose from {', '.join(MECHANISMS)}")
    optim: tuple[str, ...] = ADAMW
    prefix = ""
    if args.sgd is not None:
        optim = ("train.hyperparameters_from=null", "optim.name=sgd", f"optim.lr={args.sgd:g}",
                 f"optim.momentum={args.momentum:g}")
        prefix = f"sgd{args.momentum:g}-lr{args.sgd:g}-"
    out_dir = os.path.abspath(os.path.join(REPO, args.out_dir))
    ledger = os.path.join(out_dir, "ledger.sqlite")
    pre = [*llmdp(), "train", PRETRAIN]
    todo = [(mech, eps, name, [*llmdp(), "train", RECIPE, *over, f"output.dir={out_dir}",
                               f"output.name={name}", f"privacy.ledger={ledger}"])
            for mech, eps, _seed, name, over in runs(seeds, epsilons, mechanisms, optim, prefix)]
    if run_all(pre, [(name, cmd) for _m, _e, name, cmd in todo], out_dir, args.dry_run):
        return 0
    results: dict = {}
    for mech, eps, name, _ in todo:
        results.setdefault((eps, mech), []).append(measure(os.path.join(out_dir, name)))
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
