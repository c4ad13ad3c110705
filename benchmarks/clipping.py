"""Time and peak memory of one DP step, per clipping method, on one model, in one run.

    python benchmarks/clipping.py                      # ~20M-parameter Llama, T=256, CPU
    python benchmarks/clipping.py --device cuda --hidden 2048 --layers 16 --heads 32 \
        --intermediate 8192 --vocab 128256 --seq 1024 --batch 8 --dtype bfloat16   # ~1B, GPU

Every method runs in its own subprocess (a clean peak-memory high-water mark): a forward
pass and the backward that leaves in ``p.grad`` what that method produces (the plain
gradient for ``non-private``; the sum of per-unit clipped gradients for the others).
Time is the median over ``--steps`` steps after one warm-up step; peak memory is the
process's peak RSS on CPU (``torch.cuda.max_memory_allocated`` on CUDA). Ratios are
against ``non-private``. Opacus rows need the ``bench`` extra (``pip install opacus``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

METHODS = [
    "non-private",
    "llmdp-auto",
    "llmdp-book-keeping",
    "llmdp-two-pass",
    "llmdp-reference",
    "opacus-hooks",
    "opacus-ghost",
]


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 512), tie_word_embeddings=False,
        attn_implementation="sdpa" if args.device == "cuda" else "eager",
    )
    model = LlamaForCausalLM(cfg).to(args.device, getattr(torch, args.dtype))
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "num_target_tokens": torch.full((args.batch,), args.seq - 1, device=args.device),
        "row_units": torch.arange(args.batch, device=args.device),
    }
    return model, batch


def step_fn(method, model, batch, C):
    import torch

    from llmdp.losses import row_losses

    params = [p for p in model.parameters() if p.requires_grad]

    if method == "non-private":
        def step():
            row_losses(model, batch).sum().backward()
        return step

    if method.startswith("llmdp-"):
        from llmdp.clipping import GhostClipper
        from llmdp.parallel import make_grad_sinks

        kind = method[len("llmdp-"):]
        sinks = make_grad_sinks(model, "replicated")  # float32 sums for bf16 parameters
        clipper = (GhostClipper(model, C, engine="reference", grad_buffers=sinks) if kind == "reference"
                   else GhostClipper(model, C, mode=kind, grad_buffers=sinks))

        def step():
            clipper.backward(row_losses(model, batch), batch["row_units"])
        return step

    if method == "opacus-hooks":
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)

        def step():
            row_losses(gsm, batch).sum().backward()
            # What Opacus' DPOptimizer does next: flat per-sample norms, clip, sum.
            norms = torch.stack([p.grad_sample.reshape(p.grad_sample.shape[0], -1).norm(dim=1)
                                 for p in params], 1).norm(dim=1)
            f = (C / (norms + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad = torch.einsum("i,i...->...", f.to(p.dtype), p.grad_sample)
                p.grad_sample = None
        return step

    if method == "opacus-ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="sum", strict=False, max_grad_norm=C,
            use_ghost_clipping=True,
        )

        def step():
            # Opacus' two-backward fast gradient clipping (DPTensorFastGradientClipping.backward).
            losses = row_losses(gsm, batch)
            losses.sum().backward(retain_graph=True)
            for p in params:
                p.grad = None
            coef = gsm.get_clipping_coef()
            gsm.disable_hooks()
            (coef.to(losses.dtype) * losses).sum().backward()
            gsm.enable_hooks()
        return step

    raise ValueError(method)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, batch = build(args)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        step = step_fn(args.child, model, batch, args.max_grad_norm)
    except ImportError as e:
        return {"method": args.child, "error": f"not installed: {e.name}"}
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    base = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    times = []
    for i in range(args.steps + 1):
        for p in params:
            p.grad = None
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i:  # the first step warms caches and allocators
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    n_params = sum(p.numel() for p in params)
    return {"method": args.child, "time_s": statistics.median(times), "peak_mb": peak,
            "base_mb": base, "params": n_params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="units (rows) per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    rows = []
    for m in args.methods.split(","):
        cleaned = [sys.executable, __file__, "--child", m]
        for key in ("hidden", "intermediate", "layers", "heads", "vocab", "seq", "batch", "steps",
                    "threads", "device", "dtype", "max_grad_norm"):
            cleaned += ["--" + key.replace("_", "-"), str(getattr(args, key))]
        proc = subprocess.run(cleaned, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"method": m, "error": tail[:160]})
        else:
            rows.append(json.loads(lines[-1]))
        print(f"  done: {m}", file=sys.stderr, flush=True)

    ref = next((r for r in rows if r["method"] == "non-private" and "error" not in r), None)
    params = next((r["params"] for r in rows if "params" in r), 0)
    print(f"model: Llama-family, {params / 1e6:.1f}M trainable parameters; hidden={args.hidden}, "
          f"layers={args.layers}, vocab={args.vocab}; batch={args.batch} units x T={args.seq}; "
          f"{args.device}, {args.dtype}, {args.threads} threads; median of {args.steps} steps")
    ghost = next((r for r in rows if r["method"] == "opacus-ghost" and "error" not in r), None)
    print(f"{'method':<20}{'time/step s':>12}{'x non-priv':>11}{'peak MB':>10}{'x non-priv':>11}{'Opacus ghost / this':>21}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<20}  error: {r['error']}")
            continue
        t_ratio = r["time_s"] / ref["time_s"] if ref else float("nan")
        m_ratio = r["peak_mb"] / ref["peak_mb"] if ref else float("nan")
        speed = ghost["time_s"] / r["time_s"] if ghost else float("nan")
        print(f"{r['method']:<20}{r['time_s']:>12.3f}{t_ratio:>11.2f}{r['peak_mb']:>10.0f}{m_ratio:>11.2f}{speed:>21.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
