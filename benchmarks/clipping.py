r"""Time, throughput, MFU and peak memory of one DP step, per clipping method, on one model, in one run.

    python benchmarks/clipping.py                      # ~20M-parameter Llama, T=256, CPU
    python benchmarks/clipping.py --lora               # the same, LoRA r=16 on every projection
    python benchmarks/clipping.py --device cuda --hidden 2048 --layers 16 --heads 32 \
        --intermediate 8192 --vocab 128256 --seq 1024 --batch 8 --dtype bfloat16   # ~1B, GPU
    python benchmarks/clipping.py ... --profile DIR    # also one step per method under torch.profiler
    python benchmarks/clipping.py --family qwen3_moe   # a mixture of experts (also mixtral, olmoe,
                                                       # qwen2_moe, gpt_oss): 8 experts, top-2
    bash benchmarks/gpu.sh                             # every GPU measurement in one call (issue 52)

Every method runs in its own subprocess (a clean peak-memory high-water mark): a forward
pass and the backward that leaves what that method produces (the plain gradient for
``non-private``; the sum of per-unit clipped gradients at C = ``--max-grad-norm``, σ = 0,
for the others) in ``p.grad``, in llmdp's float32 sums (bf16/fp16 parameters), or, for
Opake, in the float32 gradient tree its clipping function returns. Every unit here is one
row, so per-unit and per-example clipping coincide. Each process gets glibc's allocator settings that llmdp's
Ray workers get (``llmdp.base.localray.ALLOCATOR_ENV``; ``--system-allocator``: glibc's
defaults), every method alike. Time is the median over ``--steps``
steps after one warm-up step; peak memory is the process's peak RSS on CPU
(``torch.cuda.max_memory_allocated`` on CUDA). Ratios are against ``non-private``.
``grad norm`` is the norm of what the last step produced: equal (to rounding) across the
private rows, which is a check that they compute the same clipped sum.

Methods:
  non-private          the plain backward of the summed per-unit losses
  llmdp-*              llmdp's GhostClipper (auto / book-keeping / two-pass / reference)
  opacus-hooks         Opacus GradSampleModule: per-sample gradients, then clip and sum
  opacus-ghost         Opacus fast gradient clipping (ghost norms, two backwards)
  opake-whole-batch    Opake (``opake.api.engine.clipping.clipped_grad``: torch.func
                       ``vmap(grad)`` of a per-example loss, clipped and summed) over the
                       whole batch in one vmap, after ``opake.patches.apply_model_patches(
                       model, kernels=True)``; the per-example loss is the model's own
                       (mean over the example's target tokens) through Opake's fused
                       linear-cross-entropy forward (``loss_only=True``: no logits)
  opake-microbatch     the same, vmapped in chunks of ``--opake-microbatch`` examples
Robustness for a short GPU lease (``benchmarks/gpu.sh``): each row is printed and the JSON
rewritten as soon as its method ends, so a run stopped early keeps its finished rows;
``--method-timeout`` ends a method that runs too long (the row says so) and the run goes
on; an llmdp row that fails is run again with fewer of the engine's newest kernels
(``VARIANTS``: the default; ``no-gram-rownorm`` without the low-precision Gram path and
the Triton row-norm kernel; ``no-triton`` with no Triton kernel at all), and the row says
which variant it is and why the others failed (``--no-fallback``: one try).
``--gram POLICY`` forces the Gram path of the Linear ghost norms (``clipping/gram.py``:
``lowp`` wherever eligible, ``float64`` never); an llmdp row counts the Linear calls that
took it (``gram``: taken / asked).
``--profile DIR``: one more step per method under torch.profiler; its table goes to
``DIR/profile-<method>.txt`` and the row gets ``profile``: device kernels, the CUDA runtime
calls that launch or wait (``cudaLaunchKernel``, ``cuLaunchKernelEx``,
``cudaStreamSynchronize``, ...), top-level aten operators, the step's wall time, the
device's busy time (the sum of the kernels' times: the step's one stream) and the
difference (the host-bound gap), and the top items by device time.

Opacus and Opake rows need the ``bench`` extra (``pip install -e .[bench]``); a row whose
library is missing, or that cannot run a configuration, prints why and the run goes on.
Opake's Triton kernels (RoPE, RMSNorm, SwiGLU, cross-entropy, LoRA, clip-and-sum) need CUDA
and Triton; elsewhere Opake uses its PyTorch paths (its chunked linear-cross-entropy
included), which the row notes.

``--lora``: peft LoRA adapters (rank ``--lora-rank``, llmdp's ``apply_lora`` with alpha 16,
no dropout) on every Linear of the decoder layers (q, k, v, o, gate, up, down projections);
only the adapters are trainable, for every method.

Throughput and model FLOPs utilization. tokens/s = batch·seq / median step time. Model
FLOPs per step (the useful work, the same for every method: the clipping's own extra work
is not counted, so a private row's MFU is the non-private row's divided by its time ratio):

    full fine-tuning:  F = 6·P·N + 12·L·d·T·N
    LoRA:              F = 4·P·N + 6·P_lora·N + 12·L·d·T·N

N = batch·seq tokens; P = the non-embedding parameters plus the LM head (the untied input
embedding is a lookup, not a matmul; under LoRA, P counts the frozen base weights);
P_lora = the adapter parameters; L layers, d hidden size, T sequence length. A weight
costs 2 FLOPs per token forward, 2 for the input gradient and 2 for the weight gradient; a
frozen weight needs no weight gradient, hence 4·P under LoRA (the adapters pay the full 6;
this counts the input gradient of layer 0's q/k/v projections, which autograd skips: under
1% of F at the default sizes).
The attention term (QKᵀ and attention·V, forward and backward, not halved for the causal
mask, as in PaLM's appendix B) is the same whatever is trained. MFU = F / time / peak,
where peak is the device's dense bf16/fp16 tensor-core peak (float32: its non-tensor-core
peak) from ``PEAK_TFLOPS`` by ``torch.cuda.get_device_name``, or ``--peak-tflops``; on CPU,
or on a GPU not in the table, MFU is n/a unless ``--peak-tflops`` is given. The
non-private row's MFU is the non-private MFU.
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
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = [
    "non-private",
    "llmdp-auto",
    "llmdp-book-keeping",
    "llmdp-two-pass",
    "llmdp-reference",
    "opacus-hooks",
    "opacus-ghost",
    "opake-whole-batch",
    "opake-microbatch",
]

# Every Linear of a Llama decoder layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Dense (no sparsity) peaks in TFLOP/s: (substring of torch.cuda.get_device_name, bf16/fp16
# tensor core, float32 without tensor cores). The first match wins; NVL variants are not
# listed (pass --peak-tflops).
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0, 67.0),
    ("A100", 312.0, 19.5),
]

INSTALL_HINT = "pip install llmdp[bench]"


def device_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The table's peak for this GPU and dtype, or None (not listed, or not a GPU dtype)."""
    if "NVL" in device_name:
        return None
    for key, half, single in PEAK_TFLOPS:
        if key in device_name:
            if dtype in ("bfloat16", "float16"):
                return half
            if dtype == "float32":
                return single
            return None
    return None


def model_flops(*, base_params: int, lora_params: int, layers: int, hidden: int, seq: int,
                tokens: int, lora: bool) -> int:
    """Model FLOPs of one forward+backward step (the formula in the module docstring)."""
    attention = 12 * layers * hidden * seq * tokens
    if lora:
        return 4 * base_params * tokens + 6 * lora_params * tokens + attention
    return 6 * base_params * tokens + attention


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")


def moe_config(args):
    """A mixture-of-experts config at the bench size: every layer sparse, ``--experts``
    experts of width ``--intermediate`` (Qwen2-MoE: plus a shared expert of that width),
    top-``--top-k`` routing, transformers' default experts kernel."""
    from transformers import AutoConfig

    kw = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
              moe_intermediate_size=args.intermediate, shared_expert_intermediate_size=args.intermediate,
              num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.heads, max_position_embeddings=max(args.seq, 512),
              tie_word_embeddings=False, num_experts=args.experts, num_local_experts=args.experts,
              num_experts_per_tok=args.top_k, decoder_sparse_step=1, mlp_only_layers=[])
    if args.family == "gpt_oss":
        kw.update(head_dim=args.hidden // args.heads, sliding_window=128,
                  layer_types=["sliding_attention", "full_attention"] * (args.layers // 2) + ["full_attention"] * (args.layers % 2))
    return AutoConfig.for_model(args.family, **kw)


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.family != "llama":
        from transformers import AutoModelForCausalLM

        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(
                moe_config(args), attn_implementation="sdpa" if args.device == "cuda" else "eager"
            ).to(getattr(torch, args.dtype))
        return _finish(model, args)
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq, 512), tie_word_embeddings=False,
        attn_implementation="sdpa" if args.device == "cuda" else "eager",
    )
    # Built on its device (a 1.6 B model's float32 init on the CPU takes longer than its steps).
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    return _finish(model, args)


def _finish(model, args):
    import torch

    if args.lora:
        from llmdp.config.schema import LoraConfig
        from llmdp.train.models import apply_lora

        model = apply_lora(model, LoraConfig(r=args.lora_rank, target_modules=LORA_TARGETS))
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


_STATS: dict = {}  # the llmdp row's clipper, for its norm statistics

# llmdp's fallbacks when a row fails, newest kernels first (module docstring).
VARIANTS = ("default", "no-gram-rownorm", "no-triton")


def apply_variant(variant: str, device: str) -> None:
    """Switch off the engine's kernels that ``variant`` leaves out (for this process)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {list(VARIANTS)}")
    if variant in os.environ.get("LLMDP_BENCH_FAIL_VARIANTS", "").split(","):  # the fallback's test
        raise RuntimeError(f"variant {variant} failed (LLMDP_BENCH_FAIL_VARIANTS)")
    if variant == "default":
        return
    import torch

    from llmdp.clipping import _triton_rownorms, gram, lowp

    gram._policy = "float64"
    _triton_rownorms.serves = lambda x: False
    if variant == "no-triton" and device == "cuda":
        lowp._TRITON_OK[torch.cuda.current_device()] = False


def count_gram_choices() -> dict:
    """Count the Linear calls that ask ``gram.use_lowp`` and those it sends to the Gram path."""
    from llmdp.clipping import gram

    counts = {"asked": 0, "taken": 0}
    use = gram.use_lowp

    def counted(*a, **k):
        taken = use(*a, **k)
        counts["asked"] += 1
        counts["taken"] += bool(taken)
        return taken
    gram.use_lowp = counted
    return counts


class Unsupported(Exception):
    """This method cannot run this configuration (the row says why)."""


def step_fn(method, model, batch, args):
    """(step, reset, result, note): ``step`` is the timed work; ``reset`` clears what a step
    leaves (untimed); ``result`` returns the tensors the last step produced."""
    import torch

    from llmdp.base.losses import row_losses

    C = args.max_grad_norm
    params = [p for p in model.parameters() if p.requires_grad]

    def clear_grads():
        for p in params:
            p.grad = None

    def grads():
        return [p.grad for p in params if p.grad is not None]

    if method == "non-private":
        def step():
            row_losses(model, batch).sum().backward()
        return step, clear_grads, grads, ""

    if method.startswith("llmdp-"):
        from llmdp.clipping import GhostClipper
        from llmdp.train.strategy import Replicated

        kind = method[len("llmdp-"):]
        sinks = Replicated().grad_sinks(model)  # float32 sums for bf16 parameters
        clipper = (GhostClipper(model, C, engine="reference", grad_buffers=sinks) if kind == "reference"
                   else GhostClipper(model, C, mode=kind, grad_buffers=sinks))

        def step():
            clipper.backward(row_losses(model, batch), batch["row_units"])
        _STATS["clipper"] = clipper

        if sinks is None:
            return step, clear_grads, grads, ""

        def reset():
            clear_grads()
            for s in sinks.values():
                s.zero_()
        return step, reset, lambda: list(sinks.values()), ""

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
        return step, clear_grads, grads, ""

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
        return step, clear_grads, grads, ""

    if method in ("opake-whole-batch", "opake-microbatch"):
        return opake_step_fn(method, model, batch, args)

    raise ValueError(method)


def opake_step_fn(method, model, batch, args):
    """Opake's per-example DP step, as its DPTrainer builds it (``_apply_opake_model_patches``,
    ``make_functional(partition_trainable=True)``, ``compute_per_example_loss`` with
    ``loss_only``, ``clipped_grad``), with σ = 0 and no optimizer."""
    import torch
    from opake.api.engine.clipping import clipped_grad
    from opake.api.engine.device import fused_kernels_available
    from opake.api.engine.functional import make_functional
    from opake.patches import apply_model_patches

    # compat: vmap-safety wrappers (batchify, attention, masking); performance: no KV cache
    # and the conditional fused linear-CE forward; kernels: the Triton kernels, which Opake
    # itself leaves off when CUDA or Triton is missing.
    apply_model_patches(model, kernels=True)
    fmodel, trainable, frozen = make_functional(model, disable_autograd_tracking=True,
                                                partition_trainable=True)
    if not trainable:
        raise Unsupported("no trainable parameters")

    def loss_fn(tr, input_ids, attention_mask, labels):
        out = fmodel({**frozen, **tr}, input_ids=input_ids, attention_mask=attention_mask,
                     labels=labels, use_cache=False, loss_only=True)
        return out["loss"]

    if method == "opake-microbatch":
        microbatch = args.opake_microbatch
        if microbatch < 1:
            raise Unsupported(f"--opake-microbatch must be >= 1, got {microbatch}")
    else:
        microbatch = None
    # Float32 sums for narrower parameters, like llmdp's grad sinks.
    wide = all(p.dtype.itemsize >= 4 for p in trainable.values())
    grad_fn, state0 = clipped_grad(
        loss_fn, argnums=0, batch_argnums=(1, 2, 3), clipping_norm=args.max_grad_norm,
        microbatch_size=microbatch, dtype=None if wide else torch.float32,
    )
    state = {"clip": state0, "grads": None}
    args_ = (batch["input_ids"], batch["attention_mask"], batch["labels"])

    with torch.no_grad():  # did the loss-only (fused linear-CE) forward run?
        probe = fmodel({**frozen, **trainable}, input_ids=args_[0][0], attention_mask=args_[1][0],
                       labels=args_[2][0], use_cache=False, loss_only=True)
    notes = []
    if probe.get("logits") is not None:
        notes.append("fused linear-CE not used (logits materialized)")
    elif not args_[0].is_cuda:
        notes.append("chunked linear-CE (PyTorch)")
    if not fused_kernels_available():
        notes.append("Triton kernels need CUDA+Triton: off")
    if microbatch is not None:
        notes.append(f"microbatch {microbatch}")

    def step():
        g, state["clip"] = grad_fn(trainable, *args_, state=state["clip"])
        state["grads"] = g.pytree

    def reset():
        state["grads"] = None
        for p in model.parameters():
            p.grad = None

    return step, reset, lambda: list(state["grads"].values()), "; ".join(notes)


def missing(method) -> str | None:
    """Why this method's library cannot be imported, or None."""
    lib = {"opacus": "opacus", "opake": "opake"}.get(method.split("-")[0])
    if lib is None:
        return None
    try:
        if lib == "opake":
            import opake.api.engine.clipping  # noqa: F401
            import opake.patches  # noqa: F401
        else:
            import opacus  # noqa: F401
    except ImportError:
        return f"{lib} not installed ({INSTALL_HINT})"
    return None


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args) -> dict:
    method = args.child
    why = missing(method)
    if why:
        return {"method": method, "error": why}

    import torch

    from llmdp.clipping import gram

    torch.set_num_threads(args.threads)
    if args.gram != "auto":
        gram._policy = args.gram
    apply_variant(args.variant, args.device)  # after --gram: a fallback variant's float64 Grams win
    if args.chunk is not None:  # the kernels' chunk and their bounds' counts together
        from llmdp.clipping import _triton_rowscaled

        _triton_rowscaled.CHUNK_T = args.chunk
    grams = count_gram_choices() if method.startswith("llmdp-") else None
    model, batch = build(args)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        step, reset, result, note = step_fn(method, model, batch, args)
    except ImportError as e:
        return {"method": method, "error": f"not installed: {e.name} ({INSTALL_HINT})"}
    except Unsupported as e:
        return {"method": method, "error": str(e)}
    except Exception as e:  # a library that cannot wrap this model: say why, not where
        traceback.print_exc()
        return {"method": method, "error": f"cannot set up: {type(e).__name__}: {first_line(e)}"}
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    base = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    times = []
    try:
        for i in range(args.steps + 1):
            reset()
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i:  # the first step warms caches and allocators
                times.append(time.perf_counter() - t0)
    except Exception as e:
        traceback.print_exc()
        return {"method": method, "error": f"step failed: {type(e).__name__}: {first_line(e)}"}
    profiled = profile_step(step, reset, sync, method, args) if args.profile else None
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    grad_norm = sum(float(t.double().pow(2).sum()) for t in result()) ** 0.5
    clipper = _STATS.get("clipper")
    if clipper is not None and getattr(clipper, "last_norm_stats", None) is not None:
        st = clipper.last_norm_stats
        note = "; ".join(x for x in (note, f"mode {clipper.last_mode}, exact fallbacks {st.fallbacks}, "
                                           f"bound <= {100 * st.bound_max:.2f}% of a norm") if x)

    n_params = sum(p.numel() for p in params)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    # A mixture of experts computes with top_k of its experts per token: only those count.
    idle = sum(p.numel() for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")
               for p in m.parameters(recurse=False)) * (1 - args.top_k / args.experts)
    total_active = total - int(idle)
    tokens = args.batch * args.seq
    flops = model_flops(
        base_params=(total_active - n_params if args.lora else total_active) - embedding,
        lora_params=n_params if args.lora else 0,
        layers=args.layers, hidden=args.hidden, seq=args.seq, tokens=tokens, lora=args.lora,
    )
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    if args.peak_tflops:
        peak_tflops, peak_source = args.peak_tflops, "--peak-tflops"
    else:
        peak_tflops = device_peak_tflops(device_name, args.dtype) if cuda else None
        peak_source = f"table ({device_name}, {args.dtype})" if peak_tflops else None
    t = statistics.median(times)
    return {
        "method": method, "time_s": t, "peak_mb": peak, "base_mb": base,
        "params": n_params, "total_params": total, "tokens": tokens,
        "tokens_per_s": tokens / t, "flops": flops,
        "mfu": flops / t / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_tflops": peak_tflops, "peak_source": peak_source, "device_name": device_name,
        "grad_norm": grad_norm, "note": note,
        "kernel": getattr(model.config, "_experts_implementation", None),
        "variant": args.variant, "gram_policy": args.gram, "chunk": args.chunk,
        **({"gram": {**grams, "per_step": args.steps + 1 + bool(args.profile)}} if grams else {}),
        **({"bound_max": clipper.last_norm_stats.bound_max, "fallbacks": clipper.last_norm_stats.fallbacks,
            "mode": clipper.last_mode}
           if clipper is not None and getattr(clipper, "last_norm_stats", None) is not None else {}),
        **({"profile": profiled} if profiled else {}),
    }


# CUDA runtime/driver calls that launch work or make the host wait for the device.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cuStreamSynchronize", "cuCtxSynchronize")


def profile_step(step, reset, sync, method, args) -> dict:
    """One more step under torch.profiler; its operators by self device time (CPU time on
    CPU) go to ``<--profile>/profile-<method>.txt`` (after the timed steps: not in them).
    Returns ``profile_counts`` of it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    reset()
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"profile-{method}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))
    return profile_counts(prof.events(), wall, explicit_syncs=1 if cuda else 0)


def profile_counts(events, wall_s: float, explicit_syncs: int = 0, top: int = 15) -> dict:
    """What one profiled step issued: ``kernels`` (device events: kernels, copies, fills),
    the runtime calls that launch (``launch_calls``) and wait (``sync_calls``, less the
    benchmark's own ``explicit_syncs`` at the step's end), top-level ``aten_ops`` (an
    operator called by another counts once, in its caller), ``device_busy_ms`` (the sum of
    the device events' times: one stream, so no overlap), ``wall_ms`` and their difference
    ``host_gap_ms``, and the ``top`` items by device (else CPU) self time."""
    from collections import Counter

    kernels, busy, calls, aten = 0, 0.0, Counter(), 0
    by_name: dict = {}
    for e in events:
        dev = str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))
        if dev:
            kernels += 1
            t = e.time_range.elapsed_us()  # a device event's own interval (microseconds)
            busy += t
            item = by_name.setdefault(e.name, [0.0, 0])
            item[0] += t
            item[1] += 1
            continue
        if e.name.startswith("cu") and not e.name.startswith("cudnn"):
            calls[e.name] += 1
        parent = e.cpu_parent
        if e.name.startswith("aten::") and not (parent is not None and parent.name.startswith("aten::")):
            aten += 1
    if not kernels:  # CPU: the top items by CPU self time
        for e in events:
            if e.name.startswith("aten::"):
                item = by_name.setdefault(e.name, [0.0, 0])
                item[0] += e.self_cpu_time_total
                item[1] += 1
    launches = sum(n for k, n in calls.items() if k in LAUNCH_CALLS)
    syncs = sum(n for k, n in calls.items() if k in SYNC_CALLS) - explicit_syncs
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels": kernels, "launch_calls": launches, "sync_calls": max(0, syncs),
            "runtime_calls": dict(calls.most_common(12)), "aten_ops": aten,
            "wall_ms": 1e3 * wall_s, "device_busy_ms": busy / 1e3,
            "host_gap_ms": 1e3 * wall_s - busy / 1e3 if kernels else None,
            "top": [{"name": k[:90], "ms": v[0] / 1e3, "count": v[1]} for k, v in tops]}


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama", choices=("llama", *MOE_FAMILIES))
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
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
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters only (see above)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--opake-microbatch", type=int, default=2,
                    help="examples per vmap chunk of opake-microbatch")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="device peak for MFU, TFLOP/s (default: the table for known GPUs)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--profile", help="folder: profile one more step per method (torch.profiler)")
    ap.add_argument("--gram", default="auto", choices=("auto", "lowp", "float64"),
                    help="the Gram path of Linear ghost norms (clipping/gram.py)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="positions per tensor-core chain of the Triton kernels and their bounds "
                         "(default: clipping/_triton_rowscaled.CHUNK_T)")
    ap.add_argument("--method-timeout", type=float, default=None,
                    help="seconds one method may run (its row says it timed out; the run goes on)")
    ap.add_argument("--no-fallback", action="store_true",
                    help="an llmdp row that fails is not run again with fewer kernels")
    ap.add_argument("--system-allocator", action="store_true",
                    help="run the methods with glibc's default allocator settings, not those "
                         "llmdp's workers get (llmdp.base.localray.ALLOCATOR_ENV)")
    ap.add_argument("--variant", default="default", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.chunk is not None and (args.chunk < 16 or args.chunk & (args.chunk - 1)):
        ap.error(f"--chunk {args.chunk}: the chunk is one tl.dot's K, a power of two of at least 16 (e.g. 64)")
    if args.child:
        print(json.dumps(child(args)))
        return 0

    rows = []
    for m in args.methods.split(","):
        row = run_method(m, args, VARIANTS[0])
        failed = []
        if m.startswith("llmdp-") and not args.no_fallback:
            for tried, variant in zip(VARIANTS, VARIANTS[1:]):
                if "error" not in row or row.get("final"):
                    break
                failed.append(f"{tried}: {row['error']}")
                row = run_method(m, args, variant)
        if failed:
            row["failed_variants"] = failed
            if "error" not in row:
                row["note"] = "; ".join(x for x in (row.get("note"), f"variant {row['variant']}") if x)
        row.pop("final", None)
        rows.append(row)
        print(f"  done: {m}", file=sys.stderr, flush=True)
        _progress(row)
        if args.json:  # rewritten after every method: a run stopped early keeps its rows
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows, "complete": False}, f, indent=2)

    ok = [r for r in rows if "error" not in r]
    ref = next((r for r in ok if r["method"] == "non-private"), None)
    params = ok[0]["params"] if ok else 0
    total = ok[0]["total_params"] if ok else 0
    kind = ("Llama-family" if args.family == "llama" else
            f"{args.family}, {args.experts} experts, top-{args.top_k}, {ok[0].get('kernel', '?')} kernel")
    print(f"model: {kind}, {params / 1e6:.3g}M trainable parameters of {total / 1e6:.3g}M"
          f"{f' (LoRA r={args.lora_rank})' if args.lora else ''}; hidden={args.hidden}, "
          f"layers={args.layers}, vocab={args.vocab}; batch={args.batch} units x T={args.seq}; "
          f"{args.device}, {args.dtype}, {args.threads} threads; median of {args.steps} steps")
    if ok:
        src = ok[0]["peak_source"]
        print(f"model FLOPs/step {ok[0]['flops'] / 1e9:.1f} G ({'4' if args.lora else '6'}·P·N"
              f"{' + 6·P_lora·N' if args.lora else ''} + 12·L·d·T·N); MFU against "
              + (f"{ok[0]['peak_tflops']:g} TFLOP/s, {src}" if src
                 else "n/a (no known peak: pass --peak-tflops)"))
    ghost = next((r for r in ok if r["method"] == "opacus-ghost"), None)
    print(f"{'method':<20}{'time/step s':>12}{'x non-priv':>11}{'tokens/s':>10}{'MFU %':>8}"
          f"{'peak MB':>9}{'x non-priv':>11}{'Opacus ghost / this':>21}{'grad norm':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<20}  {r['error']}")
            continue
        t_ratio = r["time_s"] / ref["time_s"] if ref else float("nan")
        m_ratio = r["peak_mb"] / ref["peak_mb"] if ref else float("nan")
        speed = ghost["time_s"] / r["time_s"] if ghost else float("nan")
        mfu = f"{100 * r['mfu']:.2f}" if r["mfu"] is not None else "n/a"
        print(f"{r['method']:<20}{r['time_s']:>12.3f}{t_ratio:>11.2f}{r['tokens_per_s']:>10.0f}{mfu:>8}"
              f"{r['peak_mb']:>9.0f}{m_ratio:>11.2f}{speed:>21.2f}{r['grad_norm']:>11.4g}"
              + (f"  ({r['note']})" if r["note"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "complete": True}, f, indent=2)
    return 0


def method_env(system_allocator: bool = False) -> dict[str, str]:
    """The environment of a method's process: this one's, with glibc's allocator set as
    llmdp's workers get it (``localray.run_env``: each key this environment does not set)
    unless ``system_allocator``. Every method (the peers' too) runs under the same settings."""
    from llmdp.base.localray import allocator_env

    return {**os.environ, **({} if system_allocator else allocator_env())}


def run_method(m: str, args, variant: str) -> dict:
    """One method in its own process (``--method-timeout`` caps it): its row, ``variant``
    recorded; ``final`` set where another variant cannot help (a library missing, a
    configuration the method cannot run)."""
    cleaned = [sys.executable, os.path.abspath(__file__), "--child", m, "--variant", variant,
               "--gram", args.gram]
    for key in ("family", "experts", "top_k", "hidden", "intermediate", "layers", "heads", "vocab", "seq", "batch", "steps",
                "threads", "device", "dtype", "max_grad_norm", "lora_rank", "opake_microbatch",
                "peak_tflops", "profile", "chunk"):
        if getattr(args, key) is not None:
            cleaned += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    if args.lora:
        cleaned.append("--lora")
    try:
        proc = subprocess.run(cleaned, capture_output=True, text=True, timeout=args.method_timeout,
                              env=method_env(args.system_allocator))
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"")
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
        tail = (err.strip().splitlines() or [""])[-1][:120]
        return {"method": m, "error": f"timed out after {args.method_timeout:g} s" + (f" ({tail})" if tail else "")}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"method": m, "error": tail[:160]}
    row = json.loads(lines[-1])
    if "error" in row and (row["error"].startswith(("not installed", "cannot set up"))
                           or " not installed " in row["error"]):
        row["final"] = True
    return row


def _progress(r: dict) -> None:
    """One line per finished method (the table follows at the end)."""
    if "error" in r:
        print(f"  {r['method']}: {r['error']}", flush=True)
        return
    prof = r.get("profile") or {}
    extra = (f", profiled: {prof['kernels']} kernels, {prof['sync_calls']} syncs, "
             f"busy {prof['device_busy_ms']:.0f} of {prof['wall_ms']:.0f} ms" if prof.get("kernels") else "")
    print(f"  {r['method']}: {r['time_s']:.4f} s/step, peak {r['peak_mb']:.0f} MB, "
          f"grad norm {r['grad_norm']:.4g}{extra}" + (f" ({r['note']})" if r.get("note") else ""), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
