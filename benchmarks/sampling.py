"""Sampling and batch assembly at dataset scale: a 1,000,000-unit store.

Builds (once, cached) a synthetic unit store of 1M document-like units of 1-3 rows of 128
tokens (random tokens; no tokenizer involved), then times, per logical step,

1. the Poisson (or truncated-Poisson) draw over all N units from a fresh secure key,
2. ``assign_micro_batches``: the whole worker/micro-batch assignment (every worker runs it),
3. reading the rows of every micro-batch of *every* worker from the memory-mapped store
   (a real worker reads only its own share: this is W times the work of one worker).

    python benchmarks/sampling.py                      # N=1e6, B=10,000, W=8, P=64
    python benchmarks/sampling.py --units 200000 --batch 2000 --repeats 3

Prints one JSON line per repetition and a summary (median seconds per stage).

``--draw-only`` times the draw alone, with no store: the O(B) ``PoissonSampler`` at
N = 10**9 units, B = 10**6 (q = 10**-3), and, for comparison, the O(N)
``ReferencePoissonSampler`` and the O(B) sampler at a smaller N (10**7) and the same q:
median seconds per draw, peak traced memory of one draw (tracemalloc, a separate run),
and their ratios, including the reference's time extrapolated linearly to the large N.

    python benchmarks/sampling.py --draw-only
    python benchmarks/sampling.py --draw-only --draw-units 1000000 --reference-units 100000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmdp.data.batching import assign_micro_batches  # noqa: E402
from llmdp.data.store import open_store, write_store  # noqa: E402
from llmdp.data.units import UnitArrays, UnitSpec  # noqa: E402
from llmdp.privacy.rng import keys  # noqa: E402
from llmdp.privacy.sampling import poisson as sampling
from llmdp.privacy.sampling import reference as reference_sampler


def synthetic_store(directory: str, num_units: int, L: int = 128, seed: int = 0):
    """A store of ``num_units`` units of 1-3 rows (probabilities .6/.3/.1), the last row of
    each unit 16..L tokens, the others full; random token ids below 32,000."""
    if os.path.isfile(os.path.join(directory, "meta.json")):
        s = open_store(directory)
        if s.num_units == num_units:
            return s
    rng = np.random.default_rng(seed)
    rows = rng.choice([1, 2, 3], size=num_units, p=[0.6, 0.3, 0.1]).astype(np.int32)
    R = int(rows.sum())
    row_len = np.full(R, L, dtype=np.int64)
    last = np.cumsum(rows) - 1
    row_len[last] = rng.integers(16, L + 1, num_units)
    offsets = np.concatenate([[0], np.cumsum(row_len)])
    tokens = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
    target = np.ones(tokens.size, dtype=np.uint8)
    units = UnitArrays(tokens, target, offsets, np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64),
                       rows, None, {"synthetic": True})
    spec = UnitSpec("document", L, max_rows_per_unit=3)
    write_store(directory, units, {"fingerprint": f"synthetic-{num_units}", "sequence_length": L,
                                   "pad_id": 0, "eos_id": 1, "spec": spec.to_dict()})
    return open_store(directory)


def _time_draws(sampler, repeats: int) -> dict:
    """Median seconds of `repeats` draws (after one warm-up), the sampled units of the
    last, and the peak traced memory (bytes) of one more draw under tracemalloc."""
    sampler.sample(keys.secure_key())  # warm-up: imports, OpenSSL, page faults
    secs = []
    for _ in range(repeats):
        key = keys.secure_key()
        t0 = time.perf_counter()
        sample = sampler.sample(key)
        secs.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        sampler.sample(keys.secure_key())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"median_s": statistics.median(secs), "min_s": min(secs), "sampled_units": int(sample.size),
            "peak_bytes": peak, "peak_bytes_per_sampled_unit": peak / max(int(sample.size), 1)}


def draw_benchmark(args) -> int:
    """The draw alone: O(B) sampler at (draw_units, draw_batch), then the O(N) reference
    and the O(B) sampler at reference_units with the same q. One JSON line each, and one
    line of ratios."""
    n_big, n_ref = args.draw_units, args.reference_units
    q = args.draw_batch / n_big
    rows = {}
    for name, cls, n in (("poisson_large_n", sampling.PoissonSampler, n_big),
                         ("poisson_small_n", sampling.PoissonSampler, n_ref),
                         ("reference_small_n", reference_sampler.ReferencePoissonSampler, n_ref)):
        rec = {"sampler": cls.__name__, "N": n, "q": q, "B": n * q, **_time_draws(cls(n, q), args.repeats)}
        rows[name] = rec
        print(json.dumps({"run": name, **{k: round(v, 6) if isinstance(v, float) else v
                                          for k, v in rec.items()}}))
    big, small, ref = rows["poisson_large_n"], rows["poisson_small_n"], rows["reference_small_n"]
    ratios = {
        # same N, same q: how much faster the O(B) draw is than one coin per unit
        "reference_over_poisson_s_at_small_n": ref["median_s"] / small["median_s"],
        # the reference scales with N: its time extrapolated to the large N, over the O(B) draw
        "reference_extrapolated_over_poisson_s_at_large_n":
            ref["median_s"] * (n_big / n_ref) / big["median_s"],
        # O(B): the large-N draw costs about B_large / B_small times the small-N one
        "poisson_s_large_over_small_n": big["median_s"] / small["median_s"],
        "B_large_over_small_n": n_big / n_ref,
        "reference_over_poisson_peak_bytes_at_small_n": ref["peak_bytes"] / small["peak_bytes"],
    }
    print(json.dumps({"summary": "draw only: median seconds per draw, peak traced bytes",
                      "poisson_s": round(big["median_s"], 4), "poisson_peak_MiB": round(big["peak_bytes"] / 2**20, 2),
                      "N": n_big, "B": args.draw_batch, "repeats": args.repeats,
                      **{k: round(v, 3) for k, v in ratios.items()}}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=1_000_000)
    ap.add_argument("--batch", type=float, default=10_000, help="expected batch size q*N")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--physical", type=int, default=64, help="rows per micro-batch")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sampler", choices=("poisson", "truncated-poisson"), default="poisson")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="truncated-poisson cap (default: B + 4 sqrt(B))")
    ap.add_argument("--dir", default=os.path.join(".cache", "llmdp", "bench", "store-1m"))
    ap.add_argument("--draw-only", action="store_true",
                    help="time the sampler's draw alone (no store): see the module docstring")
    ap.add_argument("--draw-units", type=int, default=10**9, help="--draw-only: N of the O(B) draw")
    ap.add_argument("--draw-batch", type=float, default=10**6, help="--draw-only: expected batch q*N")
    ap.add_argument("--reference-units", type=int, default=10**7,
                    help="--draw-only: N of the O(N) reference draw (same q)")
    args = ap.parse_args(argv)
    if args.draw_only:
        return draw_benchmark(args)

    t0 = time.perf_counter()
    store = synthetic_store(os.path.join(args.dir + f"-{args.units}"), args.units)
    build_s = time.perf_counter() - t0
    q = args.batch / store.num_units
    if args.sampler == "truncated-poisson":
        cap = args.max_batch_size or int(args.batch + 4 * args.batch ** 0.5)
        sampler = sampling.TruncatedPoissonSampler(store.num_units, q, cap)
    else:
        sampler = sampling.PoissonSampler(store.num_units, q)
    print(json.dumps({"store": store.path, "units": store.num_units, "rows": store.num_rows,
                      "open_or_build_s": round(build_s, 2)}))
    totals = []
    for rep in range(args.repeats + 1):  # the first repetition warms the page cache
        t = [time.perf_counter()]
        sample = sampler.sample(keys.secure_key())
        t.append(time.perf_counter())
        plan = assign_micro_batches(sample, store.unit_row_count, store.unit_max_row_length,
                                    world_size=args.workers, physical_batch_size=args.physical)
        t.append(time.perf_counter())
        rows = tokens = 0
        for worker in plan:
            for mb in worker:
                b = store.rows(mb, width="auto")
                rows += b["input_ids"].shape[0]
                tokens += int(b["attention_mask"].sum())
        t.append(time.perf_counter())
        rec = {"rep": rep, "sampled_units": int(sample.size), "rows": rows, "tokens": tokens,
               "micro_steps_per_worker": len(plan[0]),
               "sample_s": t[1] - t[0], "assign_s": t[2] - t[1], "read_all_workers_s": t[3] - t[2],
               "total_s": t[3] - t[0], "warmup": rep == 0}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}))
        if rep:
            totals.append(rec)
    med = {k: statistics.median(r[k] for r in totals)
           for k in ("sample_s", "assign_s", "read_all_workers_s", "total_s")}
    print(json.dumps({"summary": "median over repetitions", "sampler": args.sampler,
                      "N": store.num_units, "B": args.batch, "W": args.workers, "P": args.physical,
                      **{k: round(v, 4) for k, v in med.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
