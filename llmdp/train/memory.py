"""Memory per worker, estimated before a run (``llmdp train RECIPE --dry-run``, issue 51).

The estimate is the peak of one worker's step, in bytes, as the sum of what is alive at
the start of the backward of the largest micro-batch (``train.physical_batch_size`` rows of
``data.sequence_length`` tokens, the most length bucketing pads to):

- **weights**: every parameter and buffer in its dtype;
- **gradients**: the clipped sums' accumulators, one per trainable parameter, in float32 or
  wider (``Strategy.grad_sinks``: a bf16 parameter's clipped sum is summed in float32);
- **optimizer**: AdamW's and DP-AdamBC's two moments, SGD's momentum (none without), in
  the parameter's dtype as ``torch.optim`` keeps them (DP-AdamBC: float32 at least);
- **activations**: the tensors autograd saves for the backward of the model's forward and
  the per-unit loss, *traced* on the meta device (shapes only: nothing is computed or
  allocated) with the recipe's own loss function, with the inputs the clipping engine
  keeps of every call with trainable parameters (its A, until the clipped sum) and, under
  gradient checkpointing, the inputs each checkpointed layer keeps, each storage once;
  checkpointed, the largest layer's share of a trace without checkpointing is added for
  its recomputation in the backward;
- **clipping**: what the engine keeps beyond autograd, the output gradient of every call
  of a trainable Linear in book-keeping (and auto) mode, until the clipped sum is formed
  after the backward; two-pass keeps none;
- **workspace**: the largest saved tensor again, for its gradient in the backward, and a
  float64 copy of the largest trainable Linear output (its gradient's row norms).

Under ``scaling.strategy: fsdp`` weights, gradients and optimizer state are divided by the
number of workers (FSDP2 shards them); activations are per worker either way. Experts
routed by value cannot run on the meta device in float32; they are traced in bf16 with
the grouped-GEMM kernel (data-independent shapes) and each bf16 tensor counted at the
model's width. A model that cannot be traced either way gets the activations of a standard decoder layer instead (Korthikanti et al. 2022:
``R·T·(34·d + 5·heads·T)`` bytes per layer in 16-bit, scaled to the compute dtype), and the
estimate says so. It is an estimate of tensor memory: the framework's own allocations (CUDA
context, allocator caches, the data loader) come on top.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

__all__ = ["MemoryEstimate", "estimate_memory"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per worker by component (module docstring); ``traced``: the activations were
    traced on the meta device (False: the standard-layer formula)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    clipping: int
    workspace: int
    traced: bool
    rows: int
    sequence_length: int
    checkpointed: bool = False

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.clipping + self.workspace)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}

    def line(self) -> str:
        parts = ", ".join(f"{k} {_gib(getattr(self, k))}" for k in
                          ("weights", "gradients", "optimizer", "activations", "clipping", "workspace"))
        how = "traced" if self.traced else "standard-layer formula"
        ckpt = ("; with model.gradient_checkpointing the clipping engine still keeps every "
                "trainable layer's input" if self.checkpointed else
                "; model.gradient_checkpointing lowers the activations")
        return (f"memory per worker: about {_gib(self.total)} at {self.rows} rows x "
                f"{self.sequence_length} tokens per micro-batch ({parts}; activations {how}; "
                f"tensor memory only, an estimate; activations scale with "
                f"train.physical_batch_size{ckpt})")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _optimizer_slots(optim) -> int:
    if optim.name in ("adamw", "dp-adambc"):
        return 2
    return 1 if optim.name == "sgd" and optim.momentum > 0 else 0


def estimate_memory(model: nn.Module, cfg, *, world: int | None = None) -> MemoryEstimate:
    """The estimate for ``model`` (as ``load_model`` built it for ``cfg``, LoRA and
    checkpointing applied) trained by recipe ``cfg``. ``model`` is moved to the meta
    device (its weights are released): call it last."""
    world = int(world or cfg.scaling.num_workers)
    shard = world if cfg.scaling.strategy == "fsdp" else 1
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    grads = sum(p.numel() * max(4, p.element_size()) for p in trainable)
    optimizer = _optimizer_slots(cfg.optim) * sum(p.numel() * p.element_size() for p in trainable)

    R, T = int(cfg.train.physical_batch_size), int(cfg.data.sequence_length)
    compute = torch.bfloat16 if cfg.scaling.mixed_precision == "bf16" else None
    model.to("meta")
    if compute is not None:
        model.to(compute)  # autocast's matmuls: 16-bit activations (an approximation)
    new = hasattr(model, "is_activation_checkpointing")  # transformers' newer names
    checkpointed = bool(getattr(model, "is_activation_checkpointing" if new else
                                "is_gradient_checkpointing", False))
    trace = _trace_any(model, R, T, compute)
    if trace is not None:
        saved, largest, kept_g, layer = trace
        if checkpointed:  # the recomputed layer: its share of a trace without checkpointing
            getattr(model, "activation_checkpointing_disable" if new else
                    "gradient_checkpointing_disable")()
            again = _trace_any(model, R, T, compute)
            saved += again[3] if again is not None else 0
    else:
        saved, largest, kept_g = _formula(model, R, T), 0, 0
    clipping = 0 if cfg.privacy.clipping_mode == "two-pass" else kept_g  # a baseline too (C = inf)
    return MemoryEstimate(weights=math.ceil(weights / shard), gradients=math.ceil(grads / shard),
                          optimizer=math.ceil(optimizer / shard), activations=int(saved),
                          clipping=int(clipping), workspace=int(largest), traced=trace is not None,
                          rows=R, sequence_length=T, checkpointed=checkpointed)


def _trace_any(model: nn.Module, R: int, T: int, compute) -> tuple[int, int, int, int] | None:
    """:func:`_trace` in the model's dtype, else (experts routed by value) in bf16 with each
    bf16 tensor counted at the model's width; None if neither runs on the meta device."""
    try:
        return _trace(model, R, T)
    except Exception:  # noqa: BLE001 - a forward that needs values: experts routed eagerly
        if compute is not None:
            return None
    # The grouped-GEMM experts kernel routes with data-independent shapes but needs 16-bit
    # operands.
    width = _dtype_bytes(model)
    model.to(torch.bfloat16)
    try:
        return _trace(model, R, T, widen=width / 2)
    except Exception:  # noqa: BLE001
        return None


def _trace(model: nn.Module, R: int, T: int, widen: float = 1.0) -> tuple[int, int, int, int]:
    """On the meta device: (bytes held for the backward: the tensors autograd saves, the
    inputs the clipping engine keeps of every call with trainable parameters, and the
    inputs a checkpointed layer keeps, each storage once; the largest of them plus a
    float64 copy of the largest trainable Linear output; bytes of the trainable Linear
    calls' output gradients; the largest decoder layer's share of the first). ``widen``:
    the factor for bf16 tensors (a trace in bf16 of a wider model)."""
    from llmdp.base.losses import row_losses

    storages: dict[int, int] = {}
    owner: dict[int, int] = {}
    current = [-1]

    def hold(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            n = int(s.nbytes() * (widen if t.dtype == torch.bfloat16 else 1))
            storages[s._cdata] = max(storages.get(s._cdata, 0), n)
            owner.setdefault(s._cdata, current[0])
        return t

    kept = [0, 0]

    def on_call(module, args, out):
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            return
        if args:
            hold(args[0])  # the engine's A (a norm's input for its re-run)
        if (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D") and isinstance(out, torch.Tensor):
            kept[0] += int(out.numel() * out.element_size() * (widen if out.dtype == torch.bfloat16 else 1))
            kept[1] = max(kept[1], out.numel() * 8)  # its row norms read a float64 copy of G

    def enter(i):
        def pre(module, args, kwargs):
            current[0] = i
            hold(args[0] if args else kwargs.get("hidden_states"))  # a checkpoint keeps it
        return pre

    hooks = [m.register_forward_hook(on_call) for m in model.modules()
             if any(True for _ in m.parameters(recurse=False))]
    for i, layer in enumerate(_decoder_layers(model)):
        hooks.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda *_: current.__setitem__(0, -1)))
    dev = torch.device("meta")
    batch = {"input_ids": torch.zeros(R, T, dtype=torch.long, device=dev),
             "attention_mask": torch.ones(R, T, dtype=torch.long, device=dev),
             "labels": torch.zeros(R, T, dtype=torch.long, device=dev),
             "num_target_tokens": torch.full((R,), T, dtype=torch.long, device=dev)}
    was = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(hold, lambda t: t):
            row_losses(model, batch)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    per_layer: dict[int, int] = {}
    for k, n in storages.items():
        if owner[k] >= 0:
            per_layer[owner[k]] = per_layer.get(owner[k], 0) + n
    return (sum(storages.values()), max(storages.values(), default=0) + kept[1], kept[0],
            max(per_layer.values(), default=0))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the longest ModuleList of the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _config(model):
    cfg = getattr(model, "config", None)
    base = getattr(model, "get_base_model", None)
    return cfg if cfg is not None or base is None else base().config


def _hidden(model) -> int:
    c = _config(model)
    return int(getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0))


def _layers(model) -> int:
    c = _config(model)
    return int(getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0))


def _dtype_bytes(model) -> int:
    return next(iter(model.parameters())).element_size()


def _formula(model, R: int, T: int) -> int:
    """Activations of a standard decoder (module docstring) and the logits' float32 loss."""
    c = _config(model)
    d, L = _hidden(model), _layers(model)
    heads = int(getattr(c, "num_attention_heads", None) or getattr(c, "n_head", 1))
    V = int(getattr(c, "vocab_size", 0))
    per_layer = R * T * (34 * d + 5 * heads * T) * _dtype_bytes(model) / 2
    return int(L * per_layer + 2 * R * T * V * 4)
