"""Scaling strategies as objects (``scaling.strategy``): where the model lives, where the
clipped sum accumulates, how it is reduced and noised, and how the training state is saved
and loaded (DESIGN §1; invariants `one-sensitivity-boundary` and `noise-once`). The worker loop (``llmdp.train.loop``) holds one
:class:`Strategy` and never branches on the strategy's name.

:class:`Replicated` (``replicated``)
    Every worker holds the whole model. The clipping engine adds each micro-step's clipped
    sum into ``p.grad``; once per logical step one all-reduce sums them over workers, every
    replica adds the *same* N(0, σ²C²I) (same noise key), and divides by q·N
    (``privatize.privatize_``). Trainable parameters narrower than float32 (bf16 full
    fine-tuning) get float32 sinks instead of ``p.grad``, as ``fsdp`` does: summed,
    all-reduced and noised in float32, then cast.

:class:`Fsdp` (``fsdp``)
    FSDP2 (``torch.distributed.fsdp.fully_shard``) on a 1-D mesh over all workers: each
    decoder layer is one FSDP unit, the root holds the rest (embeddings, final norm, head).
    Parameters, their gradients and the optimizer state are sharded on dim 0 (the last
    shard may be shorter, or empty). Per-unit norms are computed by each worker on its own
    micro-batches, as in ``replicated`` (a unit's rows never span two workers). The
    clipped sum is accumulated *locally* over the micro-steps in full-size buffers (one
    plain tensor per trainable parameter, float32, or float64 for float64 parameters):
    nothing is reduced per micro-step. Once per logical step one reduce-scatter gives
    every rank the cross-worker sum of its own shard; every rank adds to its shard its
    slice of the one global N(0, σ²C²I), seeked in the secure stream of the step's noise key
    (``llmdp.privacy.noise.gaussian``), so each coordinate gets exactly one draw, the very one the
    replicated strategy adds to it; then ÷ q·N, and the optimizer steps on the sharded
    parameters (``privatize.privatize_sharded_``).

    Limitation (for now): the full-size local buffers cost one unsharded float32 copy of
    the trainable parameters per worker, plus a transient padded copy of the same size at
    the reduce-scatter, so fsdp shards parameters and optimizer state but not the
    gradient accumulator. Sharded accumulators would need a reduce-scatter per
    micro-step. With LoRA the buffers are adapter-sized.

Checkpoints and the final model (``llmdp.record.checkpoints``, ``llmdp.train.save``):

- ``replicated``: rank 0 writes the full state (``state.pt``) and saves the final model
  with its own ``save_pretrained``.
- ``fsdp``: nothing is gathered for a checkpoint: every rank writes its own shards of
  the trainable parameters and of the optimizer state with ``torch.distributed.checkpoint``
  (DCP) into its own folder, rank 0 adds ``state.json`` (step, run id, ledger position,
  scheduler), and every rank reports its folder (Ray Train merges them into one). DCP
  reshards on load: a checkpoint written on W workers resumes on any other number. The
  final model is gathered once, streaming: tensor by tensor (every rank in each
  ``full_tensor()``), rank 0 writing safetensors shards of bounded size and their index,
  so that it never holds more than one shard. A PEFT model's adapter is small: its final
  save still gathers the state dict to rank 0 (as does transformers 4.x).

Mixed precision (``scaling.mixed_precision: bf16``): ``fsdp`` uses FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` (float32 master weights,
bf16 compute); ``replicated`` runs the forward under ``torch.autocast(bf16)``. Clipped
sums, the reduction and the noise stay in float32 (float64 for float64 parameters).

The collectives and the FSDP2 mechanics the strategies use live in ``llmdp.train.parallel``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from llmdp.base import losses
from llmdp.config.choices import MIXED_PRECISION, STRATEGIES
from llmdp.record import checkpoints
from llmdp.train import parallel, privatize
from llmdp.train import save as hf_save


class Strategy:
    """What differs between scaling strategies. Methods marked [sync point] are
    collectives: every rank calls them, at the same point of the loop."""

    name: ClassVar[str]

    def __init__(self, mixed_precision: str = "none", device: torch.device | str = "cpu"):
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"scaling.mixed_precision: {mixed_precision!r} is not one of {list(MIXED_PRECISION)}")
        self.mixed_precision = mixed_precision
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mixed_precision={self.mixed_precision!r}, device={str(self.device)!r})"

    # ---- set-up

    def check(self, privacy: Any) -> None:
        """Refuse privacy settings this strategy cannot honour (``privacy``: PrivacyConfig)."""

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and start every worker from rank 0's trainable weights
        (e.g. LoRA's random init) [sync point], then place it for the strategy. Build the
        optimizer and the clipping engine *after* this call, on the returned model's
        parameters."""
        model = model.to(self.device)
        parallel.broadcast_params([p for p in model.parameters() if p.requires_grad])
        return self._place(model)

    def _place(self, model: nn.Module) -> nn.Module:
        return model

    def grad_sinks(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Where the clipping engine accumulates the clipped sum: None for ``p.grad``, or one
        zeroed full-size float32+ buffer per trainable parameter, by name (the engine's
        ``grad_buffers``)."""
        return parallel.full_size_sinks(model)

    def loss_fn(self, base: Callable | None = None) -> Callable:
        """The per-row loss function under this strategy's mixed precision (``base``:
        ``llmdp.base.losses.row_losses``, looked up at this call)."""
        return losses.row_losses if base is None else base

    # ---- one step

    def privatize(
        self,
        params: Sequence[torch.Tensor],
        sinks: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None,
        noise_key: bytes,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        names: Sequence[str] | None = None,
        correlated=None,
    ) -> None:
        """Sum the clipped sums over workers, + N(0, σ²C²I) once, ÷ q·N; the result is left in
        ``p.grad``. ``sinks`` as :meth:`grad_sinks` made them (aligned with ``params``, or
        by ``names``). ``correlated``: a correlated mechanism's `llmdp.train.correlated.StepNoise`
        (its row of the correlated noise instead of the independent draw). [sync point, once per step]"""
        raise NotImplementedError

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``."""

    # ---- state

    @property
    def map_location(self) -> torch.device:
        """Where a full checkpoint's tensors are loaded before :meth:`load_training_state`."""
        return self.device

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                       names: Sequence[str]) -> tuple[dict, dict] | None:
        """(trainable parameters by name, optimizer state) as full CPU tensors, on rank 0;
        None on the other ranks. [sync point]"""
        raise NotImplementedError

    def load_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                            params: Mapping[str, torch.Tensor], optimizer_state: dict) -> None:
        """Load what :meth:`training_state` returned (read by every rank). [sync point]"""
        raise NotImplementedError

    def noise_layout(self, params: Sequence[torch.Tensor]):
        """(local shapes, offsets, totals) of the tensors this rank noises at each step, in
        their global noise vectors (None, None: whole vectors). Here the whole parameters."""
        return [p.shape for p in params], None, None

    def checkpoint_writers(self, world: int) -> int:
        """How many ranks write a part of a checkpoint (``save_checkpoint`` is True on them,
        each seals its part: `checkpoints.seal`): the full format's rank 0 alone."""
        return 1

    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        names: Sequence[str], folder: str, meta: dict, noise=None) -> bool:
        """Write this rank's part of a training checkpoint into ``folder`` (a fresh local
        folder of this rank): the trainable parameters ``names``, the optimizer state,
        ``meta`` (step, run id, ledger position, scheduler: ``llmdp.record.checkpoints``; rank 0's
        is written) and ``noise``'s state (a correlated mechanism's stream,
        `mf.stream.CorrelatedNoise`, bound to the tensors of ``names``; None: none). Returns
        whether this rank reports ``folder`` to Ray Train, which merges the folders reported
        at one step into one checkpoint. Here the full format: the state gathered to rank 0,
        which writes ``state.pt`` (the stream is the same on every replica). [sync point]"""
        state = self.training_state(model, optimizer, names)
        if state is None:
            return False
        extra = {}
        if noise is not None:
            sd = noise.state_dict()
            extra["noise"] = {**sd, "buffers": [b.detach().cpu().clone() for b in sd["buffers"]]}
        checkpoints.write_full(folder, *state, {**meta, "strategy": self.name, **extra})
        return True

    def load_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        names: Sequence[str], folder: str, noise=None) -> dict:
        """Load the checkpoint in ``folder`` into ``model`` and ``optimizer`` (and, when both
        have one, its correlated-noise state into ``noise``) and return its meta, whose
        ``"noise"`` (the state's header: t, digest, …) says whether a state was loaded; a
        checkpoint of another strategy is refused. [sync point]"""
        meta = checkpoints.read_meta(folder)
        checkpoints.check_strategy(meta, self.name, folder)
        if meta["format"] != "full":
            raise ValueError(f"the checkpoint in {folder} is in the {meta['format']!r} format, "
                             f"which scaling.strategy {self.name!r} does not write")
        state = checkpoints.read_full(folder, self.map_location)
        self.load_training_state(model, optimizer, state["params"], state["optimizer"])
        if noise is not None and state.get("noise") is not None:
            noise.load_state_dict(state["noise"])
        else:
            meta.pop("noise", None)
        return meta

    def save_model(self, model: nn.Module, folder: str) -> None:
        """Write the final model in Hugging Face format (weights, config) into ``folder``;
        rank 0 writes. Here rank 0 saves its own whole module. [sync point]"""
        if parallel.world()[0] == 0:
            os.makedirs(folder, exist_ok=True)
            model.save_pretrained(folder, safe_serialization=True)


def _aligned(sinks, names):
    if isinstance(sinks, Mapping):
        if names is None:
            raise ValueError("buffers given by name: pass names aligned with params")
        return [sinks[n] for n in names]
    return sinks


class Replicated(Strategy):
    name = "replicated"

    def grad_sinks(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        # float32+ trainable parameters: the engine sums into p.grad. Narrower ones (bf16 /
        # fp16 full fine-tuning): float32 sinks, so that the clipped sums, their all-reduce
        # and the noise are float32 (DESIGN, invariant `precision-never-widens`), cast to the parameter dtype at the end.
        if all(p.dtype.itemsize >= 4 for p in model.parameters() if p.requires_grad):
            return None
        return parallel.full_size_sinks(model)

    def loss_fn(self, base: Callable | None = None) -> Callable:
        """bf16: the forward runs under ``torch.autocast`` (the clipping engine's backward,
        outside it, keeps norms and clipped sums in float32)."""
        base = losses.row_losses if base is None else base
        if self.mixed_precision != "bf16":
            return base
        device_type = self.device.type

        def autocast_loss(model, batch):
            with torch.autocast(device_type, dtype=torch.bfloat16):
                return base(model, batch)

        return autocast_loss

    def privatize(self, params, sinks, noise_key, noise_multiplier, max_grad_norm,
                  expected_batch_size, names=None, correlated=None) -> None:
        privatize.privatize_(params, noise_key, noise_multiplier, max_grad_norm, expected_batch_size,
                            sinks=_aligned(sinks, names), correlated=correlated)

    def training_state(self, model, optimizer, names):
        if parallel.world()[0] != 0:
            return None
        by_name = dict(model.named_parameters())
        return {n: by_name[n].detach().cpu() for n in names}, optimizer.state_dict()

    def load_training_state(self, model, optimizer, params, optimizer_state) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(params[n])
        optimizer.load_state_dict(optimizer_state)


class Fsdp(Strategy):
    name = "fsdp"

    def checkpoint_writers(self, world: int) -> int:
        """The sharded format: every rank writes (and seals) its own shards."""
        return world

    def check(self, privacy: Any) -> None:
        if privacy.debug_check:
            raise ValueError("privacy.debug_check compares p.grad with the reference engine on the full "
                             "model; it is not supported with scaling.strategy: 'fsdp' (use 'replicated')")

    def _place(self, model: nn.Module) -> nn.Module:
        return parallel.fully_shard_model(model, self.mixed_precision, self.device)

    def privatize(self, params, sinks, noise_key, noise_multiplier, max_grad_norm,
                  expected_batch_size, names=None, correlated=None) -> None:
        sinks = _aligned(sinks, names)
        if sinks is None or len(sinks) != len(params):
            raise ValueError("scaling.strategy 'fsdp' needs one full-size buffer per parameter")
        privatize.privatize_sharded_(params, sinks, noise_key, noise_multiplier, max_grad_norm,
                                    expected_batch_size, correlated=correlated)

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)  # the next reduction checks for stray gradients

    @property
    def map_location(self) -> torch.device:
        return torch.device("cpu")  # full tensors, sharded into place by every rank

    def training_state(self, model, optimizer, names):
        params, optim = parallel.gather_training_state(model, optimizer, names)
        return None if params is None else (params, optim)

    def load_training_state(self, model, optimizer, params, optimizer_state) -> None:
        parallel.load_training_state(model, optimizer, params, optimizer_state)

    def noise_layout(self, params):
        """This rank's shards: their rows of the global noise vectors."""
        return privatize.noise_slices(params)

    @staticmethod
    def _noise_entries(model, names, noise) -> dict:
        """The stream's state as DCP entries: buffer j of parameter ``name``'s state (this
        rank's rows, [rows, …]) as a DTensor placed like the parameter, keyed ``name#j``."""
        by_name = dict(model.named_parameters())
        state = noise.state_tensors()
        if len(state) != len(names):
            raise ValueError(f"the correlated stream holds {len(state)} tensors, the checkpoint "
                             f"{len(names)} trainable parameters")
        return {"noise": {f"{n}#{j}": parallel.placed_like(s[j], by_name[n])
                          for n, s in zip(names, state) for j in range(s.shape[0])}}

    def save_checkpoint(self, model, optimizer, names, folder, meta, noise=None) -> bool:
        """The sharded format: every rank writes its own shards (DCP), the correlated
        stream's state among them (sharded like the parameters), nothing is gathered;
        rank 0 adds ``state.json`` (with the stream's header). Every rank reports its
        folder. [sync point]"""
        extra, header = None, {}
        if noise is not None:
            extra = self._noise_entries(model, names, noise)
            sd = noise.state_dict()
            header = {"noise": {k: v for k, v in sd.items() if k not in ("buffers", "shapes")}}
        parallel.save_sharded_state(model, optimizer, names, folder, extra=extra)
        if parallel.world()[0] == 0:
            checkpoints.write_meta(folder, {**meta, "strategy": self.name, **header})
        return True

    def load_checkpoint(self, model, optimizer, names, folder, noise=None) -> dict:
        """A sharded checkpoint written on any number of workers (DCP reshards, the
        correlated stream's state too), or a full one (written by fsdp before the sharded
        format). [sync point]"""
        meta = checkpoints.read_meta(folder)
        checkpoints.check_strategy(meta, self.name, folder)
        if meta["format"] != checkpoints.SHARDED:
            return super().load_checkpoint(model, optimizer, names, folder, noise=noise)
        header = meta.get("noise") if noise is not None else None
        if header is not None and header.get("digest") != noise.digest:
            noise.load_state_dict({**header, "buffers": noise.state_tensors()})  # refused, named
        extra = self._noise_entries(model, names, noise) if header is not None else None
        parallel.load_sharded_state(model, optimizer, names, folder, extra=extra)
        if header is not None:
            noise.load_state_dict({**header, "buffers": noise.state_tensors()})  # loaded in place
        else:
            meta.pop("noise", None)
        return meta

    def save_model(self, model: nn.Module, folder: str) -> None:
        """Gathered once, streaming (``llmdp.train.save``): tensor by tensor, rank 0 writing
        shards of bounded size. A PEFT model (its adapter is small) and a model whose saved
        weights are not its own tensors renamed: the full state dict gathered to rank 0,
        saved by the model's ``save_pretrained``. [sync point]"""
        rank = parallel.world()[0]
        plan = None if hasattr(model, "peft_config") else hf_save.save_plan(model)
        if plan is not None:
            hf_save.save_streaming(model, folder, plan, rank=rank)
            return
        full = parallel.gather_model_state(model)
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
            model.save_pretrained(folder, safe_serialization=True, state_dict=full)


_BY_NAME: dict[str, type[Strategy]] = {cls.name: cls for cls in (Replicated, Fsdp)}


def strategy_for(name: str, mixed_precision: str = "none",
                 device: torch.device | str = "cpu") -> Strategy:
    """The :class:`Strategy` named by ``scaling.strategy``."""
    if name not in STRATEGIES or name not in _BY_NAME:
        raise ValueError(f"scaling.strategy: {name!r} is not one of {list(STRATEGIES)}")
    return _BY_NAME[name](mixed_precision, device)
