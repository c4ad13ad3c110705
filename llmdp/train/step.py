"""This worker's share of one logical DP-SGD step, up to the clipped sum (DESIGN §1):

    keys      :class:`StepKeys`: rank 0 draws fresh OS entropy (or the seed derives it);
              the sample's and the noise's keys follow by ChaCha20                   [sync]
    micro     :func:`fixed_micro_steps`: the public lower bound on micro-steps (truncated
              Poisson pads every step to B_max units of compute)
    clip      :func:`accumulate_clipped_sum`: forward -> per-unit normalized loss ->
              Σ_u clip(g_u) into ``p.grad`` or the strategy's sinks, micro-step by micro-step
    check     :func:`check_against_reference` (``privacy.debug_check``): the engine against
              the exact torch.func reference on the same forward pass

The reduction, the noise and the update are the strategy's (``llmdp.train.strategy``); the loop
that calls all of this is ``llmdp.train.loop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from llmdp.base import plants as plant
from llmdp.base.collectives import dist_on
from llmdp.base.losses import row_losses
from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import clipped_sum, per_unit_gradients_autograd
from llmdp.config.choices import Sampler
from llmdp.privacy import rng
from llmdp.train.parallel import broadcast_bytes


@dataclass
class StepKeys:
    """Per-step randomness: the keys of the sample and of the noise, both derived from one
    32-byte step key through ChaCha20 (``chacha.derive_key``, domain-separated labels)."""

    sample: bytes
    noise: bytes

    @classmethod
    def from_step_key(cls, step_key: bytes) -> StepKeys:
        return cls(rng.derive_key(step_key, b"sample"), rng.derive_key(step_key, b"noise"))

    @classmethod
    def draw(cls, step: int, rng_mode: str, seed: int | None, device: torch.device,
             scope: tuple[str, str] | None = None) -> StepKeys:
        """Fresh OS entropy on rank 0, broadcast to all; or derived from the seed (seeded mode)
        and ``scope``, the run's (run id, attempt) (`llmdp.train.loop.seeded_scope`)."""
        if rng_mode == "seeded":
            # Every rank derives the same keys: reproducible, and no guarantee against anyone
            # who knows the seed (the report says so). Keyed by the run and the attempt too:
            # two runs, or two attempts of one run, never share a step's noise.
            if scope is None:
                raise ValueError("a seeded draw needs the run's scope (run id, attempt): two "
                                 "runs or attempts with one seed would otherwise share noise")
            run, attempt = scope
            return cls.from_step_key(rng.seeded_key(int(seed), step, "step", run=run,
                                                     attempt=attempt))
        rank0 = not dist_on() or dist.get_rank() == 0
        raw = rng.secure_key() if rank0 else None
        return cls.from_step_key(broadcast_bytes(raw, 32, device))


@dataclass
class StepStats:
    """What a worker did in one step. Counts and losses are computed on private data:
    never published without DP (the report marks them internal)."""

    units: int = 0
    rows: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    clipped: int = 0
    micro_steps: int = 0
    nonfinite: int = 0  # units whose gradient was NaN/inf (factor 0: they added nothing)
    # the clipping engine's rounding bounds (GhostClipper.last_norm_stats): (call, unit)
    # pairs recomputed exactly, and the largest share of a used norm that was bound
    norm_fallbacks: int = 0
    norm_bound_max: float = 0.0


def accumulate_clipped_sum(
    model: nn.Module,
    clipper: GhostClipper,
    store,
    micro_batches: Sequence[np.ndarray],
    device: torch.device,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] = row_losses,
    debug_check: bool = False,
    width: int | str | None = "auto",
) -> StepStats:
    """Σ_u clip(g_u) over this worker's units, left in ``p.grad`` (zeroed first), or in the
    clipper's ``grad_buffers`` when it has them (``scaling.strategy: fsdp``).

    ``micro_batches`` is this worker's list from ``assign_micro_batches``: one entry per
    micro-step, the same count on every worker; an empty entry runs on one masked padding
    row (contributing exactly zero). ``width`` as in ``UnitStore.rows``.
    """
    if clipper.grad_buffers is not None:
        # fsdp: full-size local buffers, summed over the micro-steps; reduced once per step.
        for b in clipper.grad_buffers.values():
            b.zero_()
    else:
        for p in clipper.params:
            p.grad = torch.zeros_like(p)
    stats = StepStats(micro_steps=len(micro_batches))
    for m, units in enumerate(micro_batches):
        batch = store.rows(units, width=width)
        if batch["input_ids"].shape[0] == 0:
            batch = store.pad_batch(store.rows(units, width=8 if width == "auto" else width), 1,
                                    pad_id=store.pad_id)
        # each row's store index (-1 on padding): what a loss may key on (gradient canaries)
        ui = torch.as_tensor(np.asarray(units, dtype=np.int64))
        ru = batch["row_units"]
        batch["unit_index"] = (torch.where(ru >= 0, ui[ru.clamp(min=0)], -1) if ui.numel()
                               else torch.full_like(ru, -1))
        batch = {k: v.to(device) for k, v in batch.items()}
        losses = loss_fn(model, batch)
        if debug_check and m == 0:
            norms = check_against_reference(clipper, losses, batch["row_units"])
        else:
            norms = clipper.backward(losses, batch["row_units"])
        real = batch["row_units"] >= 0
        stats.units += len(units)
        stats.rows += int(real.sum())
        stats.tokens += int(batch["attention_mask"][real].sum())
        stats.loss_sum += float(losses.detach()[real].sum())
        finite = torch.isfinite(norms)
        stats.clipped += int((norms[finite] > clipper.max_grad_norm).sum())
        stats.nonfinite += int((~finite).sum())
        ns = clipper.last_norm_stats
        stats.norm_fallbacks += ns.fallbacks
        stats.norm_bound_max = max(stats.norm_bound_max, ns.bound_max)
    if plant.on("extra-micro-step") and stats.tokens % 2 == 1:
        # Test-only planted bug (``LLMDP_TEST_PLANT``, never a recipe): control flow that
        # depends on the data. One more micro-step, on one padding row.
        pad = store.pad_batch(store.rows(np.empty(0, np.int64), width=8), 1, pad_id=store.pad_id)
        pad = {k: v.to(device) for k, v in pad.items()}
        clipper.backward(loss_fn(model, pad), pad["row_units"])
        stats.micro_steps += 1
    return stats


class ClippingCheckError(RuntimeError):
    """The clipping engine disagrees with the exact reference (``--debug``)."""


def check_against_reference(clipper: GhostClipper, losses: torch.Tensor, row_units) -> torch.Tensor:
    """Run the engine and the slow exact reference on the same forward pass and compare
    per-unit norms and clipped sums; stop the run on a mismatch (DESIGN, invariant `no-silent-fallbacks`)."""
    per_unit = per_unit_gradients_autograd(losses, clipper.params, row_units, retain_graph=True)
    ref_sums, ref_norms = clipped_sum(per_unit, clipper.max_grad_norm)
    del per_unit
    sinks = clipper.grad_buffers
    now = (lambda: [p.grad for p in clipper.params]) if sinks is None else \
        (lambda: [sinks[n] for n in clipper.param_names])
    before = [g.detach().clone() for g in now()]
    norms = clipper.backward(losses, row_units)
    rtol = 1e-6 if losses.dtype == torch.float64 else 2e-3
    worst = float((norms.double() - ref_norms.double()).abs().max() / ref_norms.double().abs().max().clamp(min=1e-30))
    if worst > rtol:
        raise ClippingCheckError(f"per-unit norms differ from the reference by {worst:.3g} (relative) > {rtol:g}")
    names = {id(p): n for n, p in clipper.model.named_parameters()}
    for p, g, b, r in zip(clipper.params, now(), before, ref_sums):
        got = (g - b).double()
        scale = r.double().abs().max().clamp(min=1e-30)
        err = float((got - r.double()).abs().max() / scale)
        if err > rtol:
            raise ClippingCheckError(
                f"clipped sum of '{names[id(p)]}' differs from the reference by {err:.3g} "
                f"(relative) > {rtol:g}"
            )
    return norms


def fixed_micro_steps(plan, max_rows_per_unit: int, world_size: int, physical_batch_size: int) -> int:
    """Micro-steps every worker runs at least, every step.

    With truncated Poisson the batch is padded up to B_max units of compute: enough
    micro-steps for ``max_batch_size`` units of ``max_rows_per_unit`` rows (the public
    bounds), so memory and step count do not depend on the realized sample. Plain
    Poisson: 0 (the count follows the sample).
    """
    if plan.sampler != Sampler.TRUNCATED_POISSON:
        return 0
    per_bin = max(1, physical_batch_size // max(1, int(max_rows_per_unit)))
    per_worker = -(-int(plan.max_batch_size) // world_size)
    return -(-per_worker // per_bin)


