"""Collectives and FSDP2 mechanics the scaling strategies are built from (``llmdp.train.strategy``
says what each strategy does with them; the privatization step itself, sum -> noise once -> ÷
q·N, is ``llmdp.train.privatize``; DESIGN §1).

- replicated collectives: rank 0's bytes and parameters to every rank, one flat
  all-reduce, small counters summed over workers;
- FSDP2: shard a model's decoder layers (:func:`fully_shard_model`), the dim-0 shard
  layout (:func:`shard_rows`), the reduce-scatter (:func:`reduce_scatter_`), the sharded training state written and read by every
  rank with ``torch.distributed.checkpoint`` (:func:`save_sharded_state`,
  :func:`load_sharded_state`: nothing gathered, any world size on load), and the full state
  gathered to / loaded from rank 0 (:func:`gather_training_state`, :func:`load_training_state`:
  fsdp checkpoints from before the sharded format; :func:`gather_model_state`: a PEFT
  model's final save);
- :func:`full_size_sinks`: the float32+ buffers the clipping engine accumulates into.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from llmdp.base.collectives import dist_on, sum_small

# --------------------------------------------------------------------------- replicated collectives


def broadcast_bytes(data: bytes | None, nbytes: int, device: torch.device) -> bytes:
    """Rank 0's bytes on every rank. [sync point]"""
    if not dist_on():
        assert data is not None
        return data
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist())


def all_reduce_(grads: Sequence[torch.Tensor]) -> None:
    """Sum tensors over workers with one flat all-reduce (in their own dtype, float32 or
    wider: checked by :func:`privatize_`). [sync point, once per step]"""
    if not dist_on():
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def broadcast_params(params: Sequence[torch.Tensor]) -> None:
    """Start every replica from rank 0's parameters (e.g. LoRA's random init). [sync point]"""
    if not dist_on():
        return
    for p in params:
        dist.broadcast(p.data, src=0)


def sum_over_workers(values: Sequence[int], device: torch.device) -> list[int]:
    """Sum small integer counters over workers (one tiny all-reduce). [sync point]"""
    return sum_small(values, torch.int64, int, device)


def barrier() -> None:
    """Wait for every worker (nothing without a process group). [sync point]"""
    if dist_on():
        dist.barrier()


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --------------------------------------------------------------------------- model setup


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the classes a HF model lists in
    ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``, ``GPT2Block``), found anywhere inside
    ``model`` (also under a PEFT wrapper)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    # Outermost only: never shard a block that sits inside another sharded block.
    inner = {id(c) for m in layers for c in m.modules() if c is not m}
    return [m for m in layers if id(m) not in inner]


def fully_shard_model(model: nn.Module, mixed_precision: str = "none",
                      device: torch.device | str | None = None) -> nn.Module:
    """Shard ``model`` with FSDP2 (the ``fsdp`` strategy); the same module object is returned.

    Needs an initialized process group (one rank is fine) and every rank must start from
    the same full weights (broadcast them first). Build the optimizer and the clipping
    engine *after* this call, on the sharded parameters.

    ``reshard_after_forward=True`` (FSDP2's default, the memory-saving choice) is valid for
    the clipping engine: it reads parameter values only inside the backward pass of their
    FSDP unit (the norm-layer rule re-runs the module there), when FSDP2 has all-gathered
    them again; after the backward it reads only shapes and flags, which the sharded
    DTensor reports with the global shape. Module inputs and output gradients (A, G), which
    it keeps, are activations, not parameters, and are not affected by resharding.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device is not None:
        model = model.to(device)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("scaling.strategy: 'fsdp' needs an initialized torch.distributed process group")
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    # The clipping engine's taps return a view of each hooked layer's output; when that is
    # the root's output (the LM head's logits), FSDP2 warns that an in-place op on it would
    # skip its pre-backward hook. The loss (llmdp.base.losses) never modifies logits in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"scaling.strategy: 'fsdp' found no decoder layer to shard in {type(model).__name__} "
            "(no _no_split_modules classes); use scaling.strategy: 'replicated'"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Clipped sums and noise: float32, or float64 for float64 parameters."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def full_size_sinks(model: nn.Module) -> dict[str, torch.Tensor]:
    """One zeroed full-size local buffer per trainable parameter, by name (the clipping
    engine's ``grad_buffers``), float32 (float64 for float64 parameters)."""
    return {
        n: torch.zeros(tuple(p.shape), dtype=sum_dtype(p.dtype), device=p.device)
        for n, p in model.named_parameters() if p.requires_grad
    }


# --------------------------------------------------------------------------- shard layout


def shard_rows(p: torch.Tensor, rank: int | None = None) -> tuple[int, int, int]:
    """(first row, rows, rows per shard) of ``rank``'s dim-0 shard of DTensor ``p``.

    FSDP2 shards dim 0 like ``torch.chunk``: ⌈d0/W⌉ rows per rank, the last shards shorter
    or empty. Checked against this rank's ``p.to_local()`` so a layout change fails loudly.
    """
    from torch.distributed.tensor import Shard

    placements = tuple(p.placements)
    if len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(f"expected an FSDP2 parameter sharded on dim 0, got placements {placements}")
    world = p.device_mesh.size()
    me = p.device_mesh.get_local_rank()
    d0 = p.shape[0]
    chunk = -(-d0 // world)
    _, n = rows_of(d0, chunk, me)
    local = tuple(p.to_local().shape)
    if local != (n, *p.shape[1:]):
        raise RuntimeError(
            f"unexpected FSDP2 shard layout: rank {me} holds {local} of {tuple(p.shape)}, "
            f"expected {(n, *p.shape[1:])}"
        )
    return (*rows_of(d0, chunk, me if rank is None else rank), chunk)


def rows_of(d0: int, chunk: int, r: int) -> tuple[int, int]:
    lo = min(r * chunk, d0)
    return lo, min(d0, lo + chunk) - lo


def placed_like(local: torch.Tensor, p: torch.Tensor):
    """``local`` (this rank's rows of a tensor shaped like FSDP2 parameter ``p``) as a
    DTensor placed like ``p``, sharing ``local``'s memory: DCP saves it, and loads into it
    in place (resharded when the checkpoint was written on another number of workers)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def reduce_scatter_(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


# --------------------------------------------------------------------------- state


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def gather_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, trainable: Sequence[str]
) -> tuple[dict | None, dict | None]:
    """``fsdp``: the full (gathered) trainable parameters and optimizer state, on rank 0
    (CPU); None on the other ranks. A collective: every rank calls it. [sync point]"""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = _full_options(cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if world()[0] != 0:
        return None, None
    params = {n: msd[n] for n in trainable}
    return params, osd


def load_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, params: Mapping[str, torch.Tensor],
    optimizer_state: dict | None,
) -> None:
    """``fsdp``: load full trainable parameters and a full optimizer state (as written by
    :func:`gather_training_state`, read by every rank) into the sharded model and
    optimizer. A collective. [sync point]"""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(params))
    if missing:
        raise ValueError(f"checkpoint lacks trainable parameters {missing[:5]}")
    set_model_state_dict(model, dict(params), options=_full_options(strict=False))
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_full_options())


def gather_model_state(model: nn.Module) -> dict | None:
    """``fsdp``, for the final export: the full model state dict gathered to rank 0's CPU
    (None on the other ranks). A collective: every rank calls it. [sync point]"""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model, options=_full_options(cpu_offload=True))
    return sd if world()[0] == 0 else None


def _sharded_templates(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: Sequence[str]):
    """This rank's shards of the trainable parameters and of the optimizer state (DTensors,
    no copy, nothing gathered), as DCP saves them and loads into them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    missing = sorted(set(trainable) - set(msd))
    if missing:
        raise ValueError(f"the model's state dict lacks trainable parameters {missing[:5]}")
    # By trainable name, as the full format: a tied weight (the LM head) once, under its
    # first name, as named_parameters() lists it.
    return {"model": {n: msd[n] for n in trainable}, "optim": osd}


def save_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: Sequence[str],
                       folder: str, extra: dict | None = None) -> None:
    """``fsdp``: every rank writes its own shards of the trainable parameters and of the
    optimizer state into ``folder`` with ``torch.distributed.checkpoint`` (rank 0 also
    the ``.metadata`` index); nothing is gathered. ``folder`` may differ between ranks
    (each rank's local folder; Ray Train merges them). ``extra``: more entries of the
    same checkpoint (e.g. ``{"noise": {key: DTensor}}``, :func:`placed_like`). A
    collective. [sync point]"""
    import torch.distributed.checkpoint as dcp

    dcp.save({**_sharded_templates(model, optimizer, trainable), **(extra or {})},
             storage_writer=dcp.FileSystemWriter(folder))


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: Sequence[str],
                       folder: str, extra: dict | None = None) -> None:
    """``fsdp``: load a :func:`save_sharded_state` checkpoint (written on any number of
    ranks: DCP reads the pieces of this rank's shards) into the sharded model and
    optimizer, and ``extra``'s entries into its tensors, in place. A collective. [sync point]"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    # The optimizer's template: get_state_dict initializes an empty optimizer state with a
    # zero-lr step on zero gradients (and clears them), so that there is a shard to load into.
    state = _sharded_templates(model, optimizer, trainable)
    dcp.load({**state, **(extra or {})}, storage_reader=dcp.FileSystemReader(folder))
    # strict=False: the frozen parameters are not in the checkpoint (the model was built with them).
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
