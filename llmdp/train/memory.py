"""Memory per worker, estimated before a run (``llmdp train RECIPE --dry-run``, issue 51).

The estimate is the peak of one worker's step, in bytes, as the sum of what is alive at
the start of the backward of the largest micro-batch (``train.physical_batch_size`` rows of
``data.sequence_length`` tokens, the most length bucketing pads to):

- **weights**: every parameter and buffer in its dtype;
- **gradients**: the clipped sums' accumulators, one per trainable parameter, in float32 or
  wider (``Strategy.grad_sinks``: a bf16 parameter's clipped sum is summed in float32);
- **optimizer**: AdamW's two moments, SGD's momentum (none without), in the parameter's
  dtype as ``torch.optim`` keeps them;
- **activations**: the tensors autograd saves for the backward of the model's forward and
  the per-unit loss, *traced* on the meta device (shapes only: nothing is computed or
  allocated) with the recipe's own loss function. Gradient checkpointing lowers none of
  it under per-unit clipping: the engine keeps every trainable call's input (and its
  audit the call's output) from the forward until the clipped sum, so the activations are
  traced without checkpointing and the largest layer's share is added for its
  recomputation (measured on CPU, a two-layer d128 Llama at 16 × 128 tokens: a peak of
  111 MiB checkpointed against 65 MiB not);
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
        ckpt = ("; model.gradient_checkpointing saves nothing here: the clipping engine keeps "
                "each layer's inputs until the clipped sum, and the recomputed layer comes on "
                "top" if self.checkpointed else "")
        return (f"memory per worker: about {_gib(self.total)} at {self.rows} rows x "
                f"{self.sequence_length} tokens per micro-batch ({parts}; activations {how}; "
                f"tensor memory only, an estimate; activations scale with "
                f"train.physical_batch_size{ckpt})")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _optimizer_slots(optim) -> int:
    if optim.name == "adamw":
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
    new = hasattr(model, "is_activation_checkpointing")  # transformers' newer names
    checkpointed = bool(getattr(model, "is_activation_checkpointing" if new else
                                "is_gradient_checkpointing", False))
    if checkpointed:  # saves nothing under the engine (module docstring): traced without
        getattr(model, "activation_checkpointing_disable" if new else "gradient_checkpointing_disable")()
    if compute is not None:
        model.to(compute)  # autocast's matmuls: 16-bit activations (an approximation)
    try:
        trace = _trace(model, R, T)
    except Exception:  # noqa: BLE001 - a forward that needs values: experts routed eagerly
        trace = None
    if trace is None and compute is None:
        # The grouped-GEMM experts kernel routes with data-independent shapes but needs
        # 16-bit operands: trace in bf16 and count each bf16 tensor at the model's width.
        width = _dtype_bytes(model)
        model.to(torch.bfloat16)
        try:
            trace = _trace(model, R, T, widen=width / 2)
        except Exception:  # noqa: BLE001
            trace = None
    if trace is not None:
        saved, largest, kept_g, layer = trace
        saved += layer if checkpointed else 0
    else:
        saved, largest, kept_g = _formula(model, R, T), 0, 0
    clipping = 0 if cfg.privacy.clipping_mode == "two-pass" else kept_g  # a baseline too (C = inf)
    return MemoryEstimate(weights=math.ceil(weights / shard), gradients=math.ceil(grads / shard),
                          optimizer=math.ceil(optimizer / shard), activations=int(saved),
                          clipping=int(clipping), workspace=int(largest), traced=trace is not None,
                          rows=R, sequence_length=T, checkpointed=checkpointed)


def _trace(model: nn.Module, R: int, T: int, widen: float = 1.0) -> tuple[int, int, int, int]:
    """(bytes autograd saves for the step's backward, the largest saved tensor's bytes plus
    a float64 copy of the largest trainable Linear output, bytes of the trainable Linear
    calls' output gradients, the largest decoder layer's saved bytes), on the meta device;
    ``widen``: the factor for bf16 tensors (a trace in bf16 of a wider model)."""
    from llmdp.train.losses import row_losses

    storages: dict[int, int] = {}
    owner: dict[int, int] = {}
    current = [-1]

    def pack(t):
        s = t.untyped_storage()
        n = s.nbytes() * (widen if t.dtype == torch.bfloat16 else 1)
        storages[s._cdata] = max(storages.get(s._cdata, 0), int(n))
        owner.setdefault(s._cdata, current[0])
        return t

    kept = [0, 0]

    def on_output(module, args, out):
        if module.weight.requires_grad or (module.bias is not None and module.bias.requires_grad):
            n = out.numel() * (widen if out.dtype == torch.bfloat16 else 1)
            kept[0] += int(n * out.element_size())
            kept[1] = max(kept[1], out.numel() * 8)  # its row norms read a float64 copy of G

    def enter(i):
        return lambda *_: current.__setitem__(0, i)

    hooks = [m.register_forward_hook(on_output) for m in model.modules() if isinstance(m, nn.Linear)]
    for i, layer in enumerate(_decoder_layers(model)):
        hooks.append(layer.register_forward_pre_hook(enter(i)))
        hooks.append(layer.register_forward_hook(lambda *_: current.__setitem__(0, -1)))
    dev = torch.device("meta")
    batch = {"input_ids": torch.zeros(R, T, dtype=torch.long, device=dev),
             "attention_mask": torch.ones(R, T, dtype=torch.long, device=dev),
             "labels": torch.zeros(R, T, dtype=torch.long, device=dev),
             "num_target_tokens": torch.full((R,), T, dtype=torch.long, device=dev)}
    was = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
