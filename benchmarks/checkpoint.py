"""Rank 0's peak memory while an fsdp checkpoint is saved: full gather vs sharded (issue 18).

For each world size W of ``--worlds`` it spawns W gloo processes (CPU), builds a Llama from a
config (random weights, float32, nothing downloaded), shards it with FSDP2
(``llmdp.train.parallel.fully_shard_model``), takes one AdamW step (the optimizer state: two
more tensors per parameter), and saves a checkpoint of the trainable parameters and the
optimizer state both ways, measuring rank 0:

* ``full``: what fsdp did before: ``parallel.gather_training_state`` (every tensor gathered
  into rank 0's CPU memory) and rank 0's ``torch.save``;
* ``dcp``: ``Fsdp.save_checkpoint``: every rank writes its own shards with
  ``torch.distributed.checkpoint``, nothing gathered (rank 0 adds the index and state.json).

Peak = the increase of rank 0's peak RSS over its RSS just before the save: Linux's
``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs`` right before and read right after
(where that file is not writable, a thread sampling ``VmRSS`` every millisecond). Each
path runs once unmeasured (imports, first calls), then ``--repeats`` times; the largest
increase is reported. The table gives each
peak as a fraction of the whole checkpoint (parameters + optimizer state) and relative to
the same path on one worker.

    python benchmarks/checkpoint.py                       # W = 1, 2, 4; a ~140 M-parameter Llama
    python benchmarks/checkpoint.py --worlds 1,2,4,8 --layers 12
    python benchmarks/checkpoint.py --json out.json

Prints one JSON line per (world size, path), then the table (Markdown).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _Sampler(threading.Thread):
    """Peak VmRSS, sampled every millisecond (where VmHWM cannot be reset)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = _status_kb("VmRSS")
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _status_kb("VmRSS"))

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, _status_kb("VmRSS"))


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that the RSS before a save counts
    live memory only (the unsharded model freed after sharding would otherwise be reused
    without showing as an increase)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_increase(fn) -> tuple[int, float, str]:
    """(bytes of peak RSS over the RSS before ``fn()``, seconds, how it was measured)."""
    gc.collect()
    _trim()
    before = _status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        sampler = None
    except OSError:
        sampler = _Sampler()
        sampler.start()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM") if sampler is None else sampler.stop()
    return (peak - before) * 1024, dt, "VmHWM" if sampler is None else "sampled VmRSS"


def build_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _save(path, model, opt, names, folder, meta) -> None:
    """One checkpoint save (every rank calls it). [sync point]"""
    from llmdp.train.strategy import Fsdp

    if path == "dcp":
        Fsdp().save_checkpoint(model, opt, names, folder, meta)
        return
    state = Fsdp().training_state(model, opt, names)  # gathered to rank 0
    if state is not None:
        torch.save({"params": state[0], "optimizer": state[1], **meta}, os.path.join(folder, "state.pt"))


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    import torch.distributed as dist

    from llmdp.train import parallel
    from llmdp.train.strategy import Fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = Fsdp("none", "cpu").prepare_model(build_model(args))
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        for p in params:  # one step: the optimizer state exists (exp_avg, exp_avg_sq, step)
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        n_params = sum(p.numel() for p in params)
        meta = {"step": 1, "scheduler": {}, "run_id": "bench", "ledger": None, "nonfinite_steps": 0}
        rows = []
        for rep in range(-1, args.repeats):  # rep -1: a warm-up of each path (imports, first calls)
            for path in ("dcp", "full"):
                folder = tempfile.mkdtemp(prefix=f"llmdp-bench-ckpt-{rank}-", dir=args.dir)

                save = functools.partial(_save, path, model, opt, names, folder, meta)
                parallel.barrier()
                grew, secs, how = peak_increase(save)
                parallel.barrier()
                written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
                shutil.rmtree(folder, ignore_errors=True)
                if rep < 0:
                    continue
                rows.append({"world": world, "path": path, "rep": rep, "rank0_peak_increase_bytes": grew,
                             "seconds": secs, "rank0_bytes_written": written, "measured_by": how,
                             "params": n_params, "state_bytes": 3 * 4 * n_params})
        if rank == 0:
            with open(os.path.join(out, f"world{world}.json"), "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="llmdp-bench-out-", dir=args.dir)
    try:
        mp.start_processes(_worker, args=(world, _port(), args, out), nprocs=world, join=True,
                           start_method="spawn")
        with open(os.path.join(out, f"world{world}.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def table(results: list[dict]) -> str:
    best = {}
    for r in results:  # the largest increase over the repeats
        key = (r["world"], r["path"])
        if key not in best or r["rank0_peak_increase_bytes"] > best[key]["rank0_peak_increase_bytes"]:
            best[key] = r
    worlds = sorted({w for w, _ in best})
    state = next(iter(best.values()))["state_bytes"]
    lines = [f"checkpoint (parameters + AdamW state): {state / 2**20:.0f} MiB",
             "",
             "| workers | path | rank 0 peak increase (MiB) | ÷ checkpoint | × 1 worker | rank 0 wrote (MiB) | save (s) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for w in worlds:
        for path in ("full", "dcp"):
            r = best[(w, path)]
            one = best[(worlds[0], path)]["rank0_peak_increase_bytes"]
            grew = r["rank0_peak_increase_bytes"]
            lines.append(f"| {w} | {path} | {grew / 2**20:.1f} | {grew / state:.3f} | {_ratio(grew, one)} | "
                         f"{r['rank0_bytes_written'] / 2**20:.0f} | {r['seconds']:.2f} |")
    lines.append("")
    lines.append("| workers | dcp ÷ full (rank 0 peak increase) |")
    lines.append("| ---: | ---: |")
    for w in worlds:
        full = best[(w, "full")]["rank0_peak_increase_bytes"]
        lines.append(f"| {w} | {_ratio(best[(w, 'dcp')]['rank0_peak_increase_bytes'], full, 3)} |")
    return "\n".join(lines)


def _ratio(a: float, b: float, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}" if b > 0 else "—"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--json", default=None, help="also write every row to this file")
    args = ap.parse_args(argv)
    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        rows = run_world(world, args)
        for r in rows:
            print(json.dumps(r), flush=True)
        results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
