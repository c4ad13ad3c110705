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

ENGINES = ("instantiate", "reference")


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


class _Record:
    __slots__ = ("module", "inputs", "output")

    def __init__(self, module, inputs, output):
        self.module, self.inputs, self.output = module, inputs, output


class GhostClipper:
    """Per-unit clipped gradient sum, exact.

    Args:
        model: the module whose trainable parameters (``requires_grad``) are trained.
        max_grad_norm: C, the L2 bound on each unit's gradient over *all* trainable
            parameters (flat clipping, DESIGN §3.1).
        engine: ``"instantiate"`` (default): forward hooks keep each module's input, one
            backward pass gives the gradient at each module's output, and registered rules
            (``clipping/norms.py``) form every unit's gradient from the two; autograd never
            forms the unclipped parameter gradients. ``"reference"``: batched per-unit
            vector-Jacobian products (exact, slow, memory ~ units² · activations; tests).
    """

    def __init__(self, model: nn.Module, max_grad_norm: float, engine: str = "instantiate"):
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if engine not in ENGINES:
            raise ValueError(f"clipping engine {engine!r} is not one of {list(ENGINES)}")
        check_model(model)
        self.model = model
        self.max_grad_norm = float(max_grad_norm)
        self.engine = engine
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._records: list[_Record] = []
        self._recording = True  # off while the rules re-run modules on single rows
        self._handles = []
        self._rules = {}
        if engine == "instantiate":
            self._install_hooks()

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        from llmdp.clipping.norms import find_rule

        covered: set[int] = set()
        for name, module in self.model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            rule = find_rule(module)
            if rule is None:
                pnames = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
                raise UnsupportedModuleError(
                    f"module '{name}' ({type(module).__name__}) has trainable parameters "
                    f"{pnames} that the clipping engine cannot clip per unit. Freeze them "
                    f"(e.g. `for p in model.get_submodule('{name}').parameters(): "
                    "p.requires_grad_(False)`), train with LoRA, or register a rule in "
                    "llmdp/clipping/norms.py."
                )
            self._rules[module] = rule
            covered.update(id(p) for p in own)
            self._handles.append(module.register_forward_hook(self._on_forward))
        # The number of rows of the batch, read from the model's input: a module whose output
        # is shared by all rows (learned position embeddings of shape [1, T, d]) is expanded
        # to one copy per row, so that the backward pass gives each row its own gradient.
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in covered]
        if missing:  # pragma: no cover - every parameter belongs to some module
            raise UnsupportedModuleError(f"trainable parameters outside any module: {missing}")

    def _on_model_input(self, module, args, kwargs) -> None:
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if x is None and args:
            x = args[0]
        self._rows = x.shape[0] if isinstance(x, torch.Tensor) else None

    def _on_forward(self, module, args, output):
        if (
            not self._recording
            or not torch.is_grad_enabled()
            or not isinstance(output, torch.Tensor)
            or not output.requires_grad
        ):
            return None
        rows = getattr(self, "_rows", None)
        if (
            isinstance(module, nn.Embedding)
            and rows is not None
            and output.dim() >= 2
            and output.shape[0] == 1
            and rows > 1
        ):
            output = output.expand(rows, *output.shape[1:])
            self._records.append(_Record(module, args[0].detach(), output))
            return output
        self._records.append(_Record(module, args[0].detach(), output))
        return None

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget what forward passes recorded (e.g. after a forward that is not trained on)."""
        self._records.clear()

    # ------------------------------------------------------------------ backward
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
        try:
            if num_units == 0:
                return torch.zeros(0, dtype=torch.float32, device=unit_losses.device)
            if self.engine == "reference":
                per_unit = per_unit_gradients_autograd(unit_losses, self.params, row_units)
            else:
                per_unit = self._per_unit_from_hooks(unit_losses, row_units, num_units)
            sums, norms = clipped_sum(per_unit, self.max_grad_norm)
        finally:
            self._records.clear()
        for p, s in zip(self.params, sums):
            s = s.to(p.dtype)
            if p.grad is None:
                p.grad = s.clone()
            else:
                p.grad.add_(s)
        return norms

    def _per_unit_from_hooks(self, row_losses, row_units, num_units) -> list[torch.Tensor]:
        records = self._records
        if not records:
            raise RuntimeError(
                "GhostClipper.backward: no forward pass was recorded; call the model with "
                "gradients enabled between two backward calls"
            )
        # Rows are independent, so the gradient of the summed loss at a module's output row
        # is the gradient of that row's own unit loss: one backward pass serves every unit.
        total = row_losses[row_units >= 0].sum()
        grads_out = torch.autograd.grad(total, [r.output for r in records], allow_unused=True)
        per_param: dict[int, torch.Tensor] = {}
        self._recording = False
        try:
            computed = [
                (rec, self._rules[rec.module](rec.module, rec.inputs, G.detach(), row_units, num_units))
                for rec, G in zip(records, grads_out)
                if G is not None
            ]
        finally:
            self._recording = True
        for rec, grads in computed:
            for local, g in grads.items():
                p = getattr(rec.module, local)
                # A parameter shared by several modules (tied embeddings) or a module called
                # twice: its per-unit gradient is the sum of every use, cross terms included.
                key = id(p)
                per_param[key] = g if key not in per_param else per_param[key] + g
        return [
            per_param.get(id(p), p.new_zeros((num_units, *p.shape))) for p in self.params
        ]
