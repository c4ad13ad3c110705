"""Normalization layers: LayerNorm, GroupNorm and every *RMSNorm class."""

from __future__ import annotations

from torch import nn

from llmdp.clipping.norms import (
    LayerRule,
    register_rule,
)


class RowwiseRule(LayerRule):
    """Normalization layers (LayerNorm, the RMSNorm variants, GroupNorm): their parameters
    are d-vectors, so per-unit gradients are small and always instantiated, by a vectorized
    vector-Jacobian product of the module re-run on each row alone (exact for any such
    module, whatever its formula: Llama's w·x̂, Gemma's (1+w)·x̂, LayerNorm's w·x̂+b)."""

    def per_unit(self, rec, units):
        from torch.func import functional_call, vjp, vmap

        module = rec.module
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


def _is_rms_norm(module: nn.Module) -> bool:  # HF's LlamaRMSNorm, Qwen2RMSNorm, GemmaRMSNorm, ...
    return type(module).__name__.endswith("RMSNorm")


register_rule(nn.LayerNorm, nn.GroupNorm, match=_is_rms_norm)(RowwiseRule())
