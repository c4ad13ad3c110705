"""The unit store built on Ray Data from a corpus larger than a memory cap.

Writes a synthetic JSON-lines corpus of ``--corpus-mb`` MiB (records recombined from the
project's faker clinical notes, with user ids: no download), then, for each worker count
of ``--workers``, builds the unit store on Ray Data (``llmdp.data.sharded``) with
``data.preprocess_memory_mb = --cap-mb`` and measures

- the driver's peak RSS during the build (Linux VmHWM, reset before the build) and its
  increase over the driver's RSS before it (the driver holds no corpus);
- every task's peak RSS (reset at the start of each task) and its increase over the task
  process's RSS at that start (the data a task holds; the rest is Ray, pyarrow and the
  tokenizer loaded once per worker process);
- records/s, from the planning of chunks to the renamed store (Ray start-up excluded).

    python benchmarks/preprocess.py                                 # 2 GiB, cap 500 MiB, 1 and 2 workers
    python benchmarks/preprocess.py --corpus-mb 64 --cap-mb 4 --workers 2 --unit user

Prints one JSON line per build and a summary table. Exit status 1 if a measured peak
exceeds the cap (``--check``: absolute peaks; ``--check-data``: increases over baselines).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20


def write_corpus(path: str, megabytes: float, seed: int = 0, users: int = 5000) -> dict:
    """A JSON-lines corpus of about ``megabytes`` MiB: records of 1-12 sentences drawn from
    400 generated notes, each with a user id among ``users``. Streams to disk."""
    from llmdp.data.synthetic import generate_clinical_notes

    rng = random.Random(seed)
    notes = generate_clinical_notes(400, seed)
    sentences = [s.strip() + "." for n in notes for s in n["text"].split(".") if s.strip()]
    target, written, records = int(megabytes * MiB), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            lines = []
            for _ in range(1000):
                text = " ".join(rng.choices(sentences, k=rng.randint(1, 12)))
                lines.append(json.dumps({"user_id": f"u{rng.randrange(users)}", "text": text}))
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block.encode())
            records += len(lines)
    return {"bytes": written, "records": records}


def build_once(corpus: str, cache: str, *, cap_mb: float, workers: int, unit: str,
               sequence_length: int = 128, vocab_size: int | None = None) -> dict:
    """One build on Ray Data (Ray started for it, outside the timed part); measurements."""
    import ray

    from llmdp.data.sharded import _reset_peak, _status, build_sharded
    from llmdp.data.sources import source_fingerprint
    from llmdp.data.units import UnitSpec
    from tests.helpers import tiny_tokenizer

    tok = tiny_tokenizer() if vocab_size is None else tiny_tokenizer(vocab_size=vocab_size)
    spec = UnitSpec(kind=unit, sequence_length=sequence_length,
                    max_rows_per_unit=1 if unit == "sequence" else 4,
                    user_field="user_id" if unit == "user" else None)
    sha = source_fingerprint(path=corpus)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=workers, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False)
    try:
        base = _reset_peak()
        stats: dict = {}
        t0 = time.perf_counter()
        path = build_sharded(cache, tokenizer=tok, spec=spec, data_path=corpus,
                                    source_sha256=sha, memory_mb=cap_mb, workers=workers,
                                    stats=stats, log_fn=lambda m: None)
        dt = time.perf_counter() - t0
        peak = max(_status("VmHWM"), base)
    finally:
        if started:
            ray.shutdown()
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    counts = meta["counts"]
    shutil.rmtree(path, ignore_errors=True)
    return {"unit": unit, "workers": workers, "vocab": len(tok), "cap_mb": cap_mb, "seconds": dt,
            "records": counts["num_records"], "records_per_s": counts["num_records"] / dt,
            "units": meta["num_units"], "chunks": stats["chunks"], "tasks": stats["tasks"],
            "chunk_mb": stats["chunk_bytes"] / MiB,
            "driver_peak_mb": peak / MiB, "driver_over_base_mb": (peak - base) / MiB,
            "task_peak_mb": stats["task_peak_rss"] / MiB,
            "task_over_base_mb": stats["task_peak_over_base"] / MiB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-mb", type=float, default=2048)
    ap.add_argument("--cap-mb", type=float, default=500)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--unit", default="document", choices=("sequence", "document", "user"))
    ap.add_argument("--vocab", type=int, default=8192,
                    help="vocabulary of the BPE tokenizer trained for the run (the tests' tiny "
                         "one has 300: about one token per 1.3 characters, the memory worst case)")
    ap.add_argument("--dir", default=None, help="where the corpus and the store go (default: a temp dir)")
    ap.add_argument("--check", action="store_true", help="fail if an absolute peak RSS exceeds the cap")
    ap.add_argument("--check-data", action="store_true",
                    help="fail if a peak RSS increase over its process baseline exceeds the cap")
    args = ap.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="llmdp-preprocess-")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, f"corpus-{args.corpus_mb:g}MB.jsonl")
    if not os.path.exists(corpus):
        info = write_corpus(corpus, args.corpus_mb)
        print(json.dumps({"corpus": os.path.basename(corpus), **info}), flush=True)
    rows, ok = [], True
    for w in args.workers:
        r = build_once(corpus, os.path.join(work, "units"), cap_mb=args.cap_mb, workers=w,
                       unit=args.unit, vocab_size=args.vocab)
        print(json.dumps(r), flush=True)
        rows.append(r)
        if args.check:
            ok &= r["driver_peak_mb"] <= args.cap_mb and r["task_peak_mb"] <= args.cap_mb
        if args.check_data:
            ok &= r["driver_over_base_mb"] <= args.cap_mb and r["task_over_base_mb"] <= args.cap_mb
    size = os.path.getsize(corpus) / MiB
    print(f"\ncorpus {size:.0f} MiB ({size / args.cap_mb:.1f}x the cap of {args.cap_mb:g} MiB), "
          f"unit {args.unit}")
    print("workers  records/s  seconds  chunks  driver peak (over base)  task peak (over base)  MiB")
    for r in rows:
        print(f"{r['workers']:>7}  {r['records_per_s']:>9.0f}  {r['seconds']:>7.1f}  {r['chunks']:>6}  "
              f"{r['driver_peak_mb']:>11.0f} ({r['driver_over_base_mb']:>6.1f})  "
              f"{r['task_peak_mb']:>13.0f} ({r['task_over_base_mb']:>6.1f})")
    if len(rows) > 1:
        print(f"speed-up {rows[-1]['workers']} vs {rows[0]['workers']} workers: "
              f"{rows[-1]['records_per_s'] / rows[0]['records_per_s']:.2f}x")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
