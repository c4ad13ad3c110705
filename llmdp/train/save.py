"""The final model of an ``fsdp`` run in Hugging Face format, gathered once, streaming:
tensor by tensor (every rank takes part in each ``full_tensor()``), rank 0 writing
safetensors shards of bounded size, so that it never holds more than one shard of the
model (DESIGN §4, checkpoints).

The folder is what ``save_pretrained`` writes for the same weights: ``config.json``
(with ``dtype`` and ``architectures`` set as it sets them), ``generation_config.json``,
and ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards with
``model.safetensors.index.json`` (``{"metadata": {"total_parameters", "total_size"},
"weight_map": {key: file}}``). Which keys are written, and under which names, is decided as
``save_pretrained`` decides it (transformers' own ``remove_tied_weights_from_state_dict``
and ``revert_weight_conversion``), on shape-only stand-ins, identically on every rank.
"""

from __future__ import annotations

import json
import os
import re

import torch
from torch import nn

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Rank 0 holds at most one shard (and one tensor being gathered) of this size.
MAX_SHARD_BYTES = 5 * 10**9  # "5GB", the Hub's usual shard size


def save_plan(model: nn.Module) -> list[tuple[str, str]] | None:
    """``[(key in the saved file, key in model.state_dict())]`` in the order
    ``save_pretrained`` writes them, or None where the saved weights are not the model's
    own tensors renamed (transformers 4.x, which lacks the functions this follows; a
    conversion that computes new tensors): those are saved gathered."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4.x
        return None
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    # Shape-only stand-ins: the decision reads shapes, dtypes and which parameters are one
    # (tied), never values or this rank's shard layout, so every rank makes the same one.
    meta = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in state.items()}
    source = {id(t): k for k, t in meta.items()}
    planned = revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(meta), model))
    plan = []
    for key, t in planned.items():
        if id(t) not in source:
            return None
        plan.append((key, source[id(t)]))
    return plan


def shard_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors (by index) into shards of at most ``max_bytes`` (a larger
    tensor alone), in order."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not groups or (total + n > max_bytes and groups[-1]):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def shard_names(n: int) -> list[str]:
    if n == 1:
        return [WEIGHTS]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_configs(model: nn.Module, folder: str) -> None:
    """config.json and generation_config.json, as ``save_pretrained`` writes them."""
    cfg = model.config
    cfg.dtype = str(next(p.dtype for p in model.parameters() if p.is_floating_point())).split(".")[1]
    cfg.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 renames the class
    cfg.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)


def _clear_weights(folder: str) -> None:
    """Weight files of an earlier save (a re-launch that finishes again)."""
    pattern = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
    for name in os.listdir(folder):
        if pattern.fullmatch(name):
            os.remove(os.path.join(folder, name))


def save_streaming(model: nn.Module, folder: str, plan: list[tuple[str, str]], *, rank: int,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``model`` (FSDP2-sharded) into ``folder`` by ``plan`` (:func:`save_plan`):
    each tensor is all-gathered on its own and rank 0 keeps it until its shard is
    written. Every rank calls this with the same plan. [sync point, once per tensor]"""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    state = model.state_dict()  # this rank's shards (DTensors), no copy
    sizes = [state[src].numel() * state[src].element_size() for _, src in plan]
    groups = shard_groups(sizes, max_shard_bytes)
    names = shard_names(len(groups))
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        _clear_weights(folder)
        _write_configs(model, folder)
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        shard: dict[str, torch.Tensor] = {}
        for i in group:
            key, src = plan[i]
            t = state[src]
            # [sync point] every rank gathers the same tensor, in the same order.
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if rank == 0:
                shard[key] = full.detach().to("cpu").contiguous()
                weight_map[key] = name
            del full
        if rank == 0:
            save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        del shard  # rank 0 never holds more than this one shard
    if rank == 0 and len(names) > 1:
        with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
            total = {"total_parameters": model.num_parameters(), "total_size": sum(sizes)}
            json.dump({"metadata": total, "weight_map": weight_map}, f, indent=2, sort_keys=True)
            f.write("\n")
