"""Canary scores (issue 19, item 2): how much the trained model remembers each canary.

Both scores compare the final model θ_T with the model the run started from, θ_0 (the
same weights every worker started from: the recipe's model, LoRA initialised under
``train.seed``). θ_T's trainable parameters are read by name from the run's last
checkpoint (either format, ``llmdp.record.checkpoints``), so full fine-tuning, LoRA, replicated
and fsdp are read alike. Higher means "more likely included".

    black-box  loss(θ_0) − loss(θ_T) of the canary (its normalized loss, the unit loss the
               run trained on, ``losses.row_losses``): what an attacker who can query the
               model's likelihoods sees
    white-box  ⟨−g_i, θ_T − θ_0⟩ / ‖g_i‖, g_i the canary's gradient at θ_0: the canary's
               (clipped: only its direction counts) gradient probed against the sum of the
               run's updates. An attacker who sees the weights (white-box) gets a cleaner
               signal than the loss: the update carries each sampled unit's clipped
               gradient plus the noise, and no forward pass is in between

Scores are computed on the driver, one canary at a time for gradients (no per-canary
buffer the size of the model is kept).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmdp.base.losses import row_losses

__all__ = ["black_box_scores", "initial_model", "final_model", "unit_losses", "white_box_scores"]


def initial_model(cfg, cache_dir: str) -> nn.Module:
    """θ_0: the recipe's model as ``worker.setup`` builds it (seeded LoRA init included),
    in float32 on the CPU (scores are float32 whatever the run's dtype)."""
    from llmdp.train.models import load_model

    torch.manual_seed(int(cfg.train.seed))
    model, _ = load_model(cfg.model, cache_dir=cache_dir)
    return model.float().eval()


def final_model(cfg, cache_dir: str, checkpoint_dir: str) -> nn.Module:
    """θ_T: θ_0 with the trainable parameters of ``checkpoint_dir`` (by name)."""
    from llmdp.record import checkpoints

    model = initial_model(cfg, cache_dir)
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, value in checkpoints.trainable_params(checkpoint_dir):
            if name not in params:
                raise KeyError(f"checkpoint {checkpoint_dir} holds {name!r}, which the model lacks")
            params[name].copy_(torch.as_tensor(value).to(params[name].dtype))
            seen.add(name)
    missing = [n for n, p in params.items() if p.requires_grad and n not in seen]
    if missing:
        raise KeyError(f"checkpoint {checkpoint_dir} lacks trainable parameters {missing[:3]}")
    return model


def unit_losses(model: nn.Module, store, batch_units: int = 32) -> np.ndarray:
    """Every unit's normalized loss (float64), in store order: the held-out evaluation's
    per-unit statistics (``evaluation.metrics.unit_stats``) over consecutive batches."""
    from llmdp.evaluation.metrics import unit_stats

    batches = [np.arange(lo, min(lo + batch_units, store.num_units))
               for lo in range(0, store.num_units, batch_units)]
    return unit_stats(model, store, batches, torch.device("cpu"))["loss"]


def black_box_scores(initial: nn.Module, final: nn.Module, store) -> np.ndarray:
    """loss under θ_0 − loss under θ_T, per canary (higher: remembered)."""
    return unit_losses(initial, store) - unit_losses(final, store)


def white_box_scores(initial: nn.Module, final: nn.Module, store) -> np.ndarray:
    """⟨−g_i/‖g_i‖, θ_T − θ_0⟩ per canary, g_i its loss gradient at θ_0 over the trainable
    parameters (float64 accumulation)."""
    names = [n for n, p in initial.named_parameters() if p.requires_grad]
    params = [p for n, p in initial.named_parameters() if p.requires_grad]
    after = dict(final.named_parameters())
    delta = [(after[n].detach() - p.detach()).double() for n, p in zip(names, params)]
    initial.eval()
    out = np.zeros(store.num_units, dtype=np.float64)
    for u in range(store.num_units):
        batch = store.rows([u], width="auto")
        loss = row_losses(initial, batch).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        dot, sq = 0.0, 0.0
        for g, d in zip(grads, delta):
            if g is None:
                continue
            g = g.double()
            dot += float((g * d).sum())
            sq += float((g * g).sum())
        out[u] = -dot / sq ** 0.5 if sq > 0 else 0.0
    return out
