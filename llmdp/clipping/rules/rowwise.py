"""Normalization layers: LayerNorm, GroupNorm and every *RMSNorm class."""

from __future__ import annotations

import torch
from torch import nn

from llmdp.clipping.norms import (
    LayerRule,
    register_rule,
)


class RowwiseRule(LayerRule):
    """Normalization layers (LayerNorm, the RMSNorm variants, GroupNorm): their parameters
    are d-vectors, so per-unit gradients are small and always instantiated, by a vectorized
    vector-Jacobian product of the module re-run on each row alone (exact for any such
    module, whatever its formula: Llama's w·x̂, Gemma's (1+w)·x̂, LayerNorm's w·x̂+b).

    A module whose output *is* ``w * z`` (Llama's RMSNorm and the many families that copy
    it: the output's autograd node is the product of the trainable weight, itself, and a
    tensor z of the output's shape) skips the re-run: ``direct_operand`` takes z from that
    node's saved operands at the forward (``Record.direct``), and row r's gradient is
    Σ_t G[r,t]·z[r,t], which is what the node's own backward computes for the row (the same
    product, summed over the row's positions, cast to w's dtype): two operations instead of
    the norm's forward and backward again (issue 50: ~10 launches per norm call). Not under
    saved-tensor hooks (activation checkpointing): reading a saved operand there recomputes."""

    @staticmethod
    def direct_operand(module, args, output) -> torch.Tensor | None:
        """z, detached, when ``output`` is exactly ``w * z`` for the module's one trainable
        parameter w (a vector over the output's last dimension), a z of the output's shape,
        and z's own autograd history, walked back to the call's inputs, never reaches w
        (so the node's gradient for w is the call's whole gradient for w); else None (the
        generic re-run)."""
        node = getattr(output, "grad_fn", None)
        if node is None or node.name() != "MulBackward0" or _saved_tensor_hooks_active():
            return None
        trainable = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if len(trainable) != 1:
            return None
        w = trainable[0]
        try:
            a, b = node._saved_self, node._saved_other
        except (AttributeError, RuntimeError):  # freed, or a torch without the accessors
            return None
        z = b if a is w else a if b is w else None
        if z is None or w.dim() != 1 or output.dim() < 2 or w.shape[0] != output.shape[-1] \
                or z.shape != output.shape or _reaches(z, w, args):
            return None
        return z.detach()

    def per_unit(self, rec, units):
        module = rec.module
        if rec.direct:
            (n, w), = ((n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad)
            G = rec.G
            z = rec.A.reshape(G.shape)
            per_row = (G * z).reshape(G.shape[0], -1, G.shape[-1]).sum(1)
            return {n: units.rows_to_units(per_row.to(w.dtype))}
        from torch.func import functional_call, vjp, vmap

        params = {n: p.detach() for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not params:
            return {}
        frozen = {n: p.detach() for n, p in module.named_parameters(recurse=False) if not p.requires_grad}

        def one(a, g):
            def f(p):
                return functional_call(module, {**p, **frozen}, (a.unsqueeze(0),))

            _, pullback = vjp(f, params)
            return pullback(g.unsqueeze(0))[0]

        per_row = vmap(one)(rec.A, rec.G)
        return {n: units.rows_to_units(per_row[n]) for n in params}


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading): reading
    the node's saved operands would unpack them through the hooks, which for a checkpoint
    recomputes the region in the forward and keeps the result until the backward (measured:
    a higher peak checkpointed than not). The generic rule reads nothing saved."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


WALK_NODES = 64  # a norm's own graph is ~8 nodes; a longer one is left to the generic rule


def _reaches(z: torch.Tensor, w: torch.Tensor, args) -> bool:
    """Whether z's autograd history reaches w before the call's inputs (True, too, when the
    walk passes ``WALK_NODES`` nodes: not proven otherwise)."""
    stops = {id(a.grad_fn) for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    todo, seen = [z.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        if len(seen) > WALK_NODES:
            return True
        if getattr(node, "variable", None) is w:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def _is_rms_norm(module: nn.Module) -> bool:  # HF's LlamaRMSNorm, Qwen2RMSNorm, GemmaRMSNorm, ...
    return type(module).__name__.endswith("RMSNorm")


register_rule(nn.LayerNorm, nn.GroupNorm, match=_is_rms_norm)(RowwiseRule())
