"""Run a recipe's worker loop in this process (no Ray), on the GPU the recipe asks for, and
print its step times and report: how ``recipes/gpu-1b-synthetic.yaml`` is checked on a GPU
machine without Ray (issue 36, item 4).

    python benchmarks/gpu_recipe.py recipes/gpu-1b-synthetic.yaml [--steps N] [--out DIR]

``llmdp train`` runs the same loop in a Ray Train worker; here ``prepare`` (plan, ledger,
unit store) and ``train_loop_per_worker`` run in-process with a ``LocalContext``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=None, help="override train.steps")
    ap.add_argument("--out", default=None, help="override output.dir")
    args = ap.parse_args(argv)

    from llmdp.config.schema import load_recipe, recipe_from_dict, to_dict
    from llmdp.report.build import write_report
    from llmdp.run.launch import prepare
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    raw = to_dict(load_recipe(args.recipe))
    if args.steps:
        raw["train"]["steps"] = args.steps
        raw["train"]["checkpoint_every"] = args.steps
        raw["train"]["eval_every"] = args.steps
    if args.out:
        raw["output"]["dir"] = args.out
    cfg = recipe_from_dict(raw)
    t0 = time.perf_counter()
    prep = prepare(cfg, log=lambda *a: print(*a, flush=True))
    t1 = time.perf_counter()
    train_loop_per_worker(prep, LocalContext())
    t2 = time.perf_counter()
    with open(os.path.join(prep.run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"step"' in line]
    r = write_report(prep.run_dir)
    keys = ("step", "train_loss", "step_time_s", "realized_batch_size", "clipped_fraction")
    for s in steps[-6:]:
        print({k: s.get(k) for k in keys if k in s})
    print(f"prepare {t1 - t0:.1f} s, loop {t2 - t1:.1f} s for {r['steps']} steps; "
          f"epsilon {r['epsilon']:.3f} at delta {r['delta']:.1e}; noise: {r['noise_generator']['method']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
