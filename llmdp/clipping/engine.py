"""Per-unit clipping behind the ``GhostClipper`` contract (DESIGN §4).

``GhostClipper(model, max_grad_norm).backward(row_losses, row_units)`` returns the per-unit
gradient norms before clipping and *adds* Σ_u min(1, C/‖g_u‖)·g_u to ``p.grad`` of every
trainable parameter, like autograd accumulation.

The ``reference`` engine below is exact but instantiates every unit's full gradient
(memory U × params): one vector-Jacobian product per unit, batched by autograd. The fast
hook-based ghost / book-keeping engine plugs in behind the same contract.
"""

from __future__ import annotations

import torch
from torch import nn

from llmdp.clipping.reference import clipped_sum, per_unit_gradients_autograd, unit_ids

ENGINES = ("reference",)


class UnsupportedModuleError(ValueError):
    """A trainable module the clipping engine cannot clip per unit (DESIGN §3.6)."""


# Modules whose output for one example depends on other examples of the batch: their
# per-example gradients are not defined, so DP-SGD with them is refused, not approximated.
_CROSS_EXAMPLE = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def check_model(model: nn.Module) -> None:
    """Refuse modules that mix examples of a batch (BatchNorm and friends), by path and type."""
    for name, module in model.named_modules():
        if isinstance(module, _CROSS_EXAMPLE) and (
            module.training or any(p.requires_grad for p in module.parameters(recurse=False))
        ):
            raise UnsupportedModuleError(
                f"module '{name}' ({type(module).__name__}) mixes examples of a batch, so a "
                "unit's gradient is not its own; DP-SGD cannot clip it. Replace it with "
                "GroupNorm/LayerNorm, or freeze it and put it in eval mode."
            )
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModuleError("the model has no trainable parameter")


class GhostClipper:
    """Per-unit clipped gradient sum, exact.

    Args:
        model: the module whose trainable parameters (``requires_grad``) are trained.
        max_grad_norm: C, the L2 bound on each unit's gradient over *all* trainable
            parameters (flat clipping, DESIGN §3.1).
        engine: ``"reference"`` (exact, batched per-unit vector-Jacobian products).
    """

    def __init__(self, model: nn.Module, max_grad_norm: float, engine: str = "reference"):
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if engine not in ENGINES:
            raise ValueError(f"clipping engine {engine!r} is not one of {list(ENGINES)}")
        check_model(model)
        self.model = model
        self.max_grad_norm = float(max_grad_norm)
        self.engine = engine
        self.params = [p for p in model.parameters() if p.requires_grad]

    def backward(
        self, unit_losses: torch.Tensor, row_units: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Add the clipped sum of per-unit gradients to ``p.grad``; return per-unit norms.

        ``unit_losses`` has one entry per batch row: a unit's loss is the sum of its rows'
        entries (the worker makes each entry the row's share of the unit's normalized loss).
        ``row_units[r]`` is the unit of row r (default: row r is unit r); -1 marks padding,
        whose rows contribute exactly nothing.
        """
        if unit_losses.ndim != 1:
            raise ValueError(
                f"unit_losses must be a 1-D tensor with one loss per row, got shape "
                f"{tuple(unit_losses.shape)}"
            )
        row_units, num_units = unit_ids(row_units, unit_losses.shape[0], unit_losses.device)
        if num_units == 0:
            return torch.zeros(0, dtype=torch.float32, device=unit_losses.device)
        per_unit = per_unit_gradients_autograd(unit_losses, self.params, row_units)
        sums, norms = clipped_sum(per_unit, self.max_grad_norm)
        for p, s in zip(self.params, sums):
            s = s.to(p.dtype)
            if p.grad is None:
                p.grad = s.clone()
            else:
                p.grad.add_(s)
        return norms
