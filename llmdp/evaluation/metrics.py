"""Held-out metrics: per-unit normalized loss and token accuracy of the model on the
evaluation units, each worker a share, computed in the run's compute precision and
accumulated in float64.

Every worker runs the same number of forward micro-steps (``assign_micro_batches`` on all
the evaluation units: the same assignment on every worker; an empty micro-step runs a
padding row), so a sharded model (fsdp) gathers its parameters in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from llmdp.base.collectives import sum_floats_over_workers
from llmdp.base.losses import row_eval_stats
from llmdp.data.batching import assign_micro_batches

__all__ = ["unit_stats", "my_share", "evaluate", "summary"]


@torch.no_grad()
def unit_stats(model: nn.Module, store, micro_batches, device: torch.device,
               fn: Callable = row_eval_stats) -> dict[str, np.ndarray]:
    """This worker's units (in ``micro_batches`` order): per-unit loss and accuracy, and
    the token-level NLL sum and target count over them (float64)."""
    losses, accs, nll, tokens = [], [], 0.0, 0.0
    was_training = model.training
    model.eval()
    try:
        for units in micro_batches:
            batch = store.rows(units, width="auto")
            if batch["input_ids"].shape[0] == 0:
                batch = store.pad_batch(store.rows(units, width=8), 1, pad_id=store.pad_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            rows = fn(model, batch).to(torch.float64)
            real = batch["row_units"] >= 0
            if len(units):
                per_unit = torch.zeros(len(units), 2, dtype=torch.float64, device=rows.device)
                per_unit.index_add_(0, batch["row_units"][real], rows[real, :2])
                losses.append(per_unit[:, 0].cpu().numpy())
                accs.append(per_unit[:, 1].cpu().numpy())
            nll += float(rows[real, 2].sum())
            tokens += float(rows[real, 3].sum())
    finally:
        model.train(was_training)
    return {"loss": _cat(losses), "accuracy": _cat(accs), "nll": nll, "tokens": tokens}


def _cat(parts: list) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def my_share(store, rank: int, world: int, physical_batch_size: int) -> list:
    """This worker's micro-batches of the evaluation units (the same count on every worker)."""
    every = np.arange(store.num_units, dtype=np.int64)
    return assign_micro_batches(every, store.unit_row_count, store.unit_max_row_length,
                                world_size=world, physical_batch_size=physical_batch_size,
                                bucket=True)[rank]


def evaluate(model, store, device, rank: int, world: int, physical_batch_size: int,
             fn: Callable = row_eval_stats) -> tuple[dict, dict[str, np.ndarray]]:
    """(metrics over all workers, this worker's per-unit values). [sync point]"""
    mine = unit_stats(model, store, my_share(store, rank, world, physical_batch_size), device, fn)
    loss_sum, acc_sum, n, nll, tokens = sum_floats_over_workers(
        [float(mine["loss"].sum()), float(mine["accuracy"].sum()), float(mine["loss"].size),
         mine["nll"], mine["tokens"]], device)
    return summary(loss_sum, acc_sum, n, nll, tokens), mine


def summary(loss_sum: float, acc_sum: float, n: float, nll: float, tokens: float) -> dict:
    """Mean normalized loss and token accuracy over units; perplexity exp(NLL / tokens)."""
    return {
        "loss": loss_sum / n if n else None,
        "accuracy": acc_sum / n if n else None,
        "perplexity": math.exp(min(nll / tokens, 700.0)) if tokens else None,
        "units": int(n),
        "tokens": int(tokens),
    }
