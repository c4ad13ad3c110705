"""nn.Linear and HF GPT-2's Conv1D (the same rule, transposed weight)."""

from __future__ import annotations

from torch import nn

from llmdp.clipping import lowp
from llmdp.clipping.norms import (
    LayerRule,
    _as_3d,
    _bias_sq,
    _ghost_cheaper,
    _gram_pair_sum,
    _row_sums,
    device_spec,
    register_rule,
)


class LinearRule(LayerRule):
    """nn.Linear (weight [out, in]) and, with ``transposed``, HF GPT-2 Conv1D ([in, out])."""

    has_clipped_ghost = True

    def __init__(self, transposed: bool = False):
        self.transposed = transposed

    def choose_ghost(self, module, A, G, policy, num_units):
        if policy != "auto":
            return policy == "ghost"
        G3 = _as_3d(G)
        spec = device_spec(G.device, G.dtype)
        return _ghost_cheaper(num_units, G3.shape[0], G3.shape[1], G.shape[-1], A.shape[-1], spec)

    # Every contraction goes through ``lowp`` on A and G as the model produced them: exact
    # products, float32 (float64) sums, on tensor cores for bf16/fp16 on CUDA. The norms
    # and the clipped sum are so formed from the same values (DESIGN §3.8).

    def sq_norms_ghost(self, rec, units):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            out["weight"] = _gram_pair_sum(A3, G3, units)
        if module.bias is not None and module.bias.requires_grad:
            out["bias"] = _bias_sq(_row_sums(G3), units)  # the bias gradient of each row
        return out

    def per_unit(self, rec, units):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            per_row = lowp.per_row_tn(A3, G3) if self.transposed else lowp.per_row_tn(G3, A3)
            out["weight"] = units.rows_to_units(per_row)
        if module.bias is not None and module.bias.requires_grad:
            out["bias"] = units.rows_to_units(_row_sums(G3))
        return out

    def clipped_ghost(self, rec, row_factors):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            # Σ_r c_r G_rᵀA_r, the factor applied in float32 (never to a bf16 operand).
            out["weight"] = (lowp.row_scaled_tn(A3, G3, row_factors) if self.transposed
                             else lowp.row_scaled_tn(G3, A3, row_factors))
        if module.bias is not None and module.bias.requires_grad:
            s = _row_sums(G3)
            out["bias"] = (s * row_factors.to(s.dtype)[:, None]).sum(0)
        return out


def _is_conv1d(module: nn.Module) -> bool:  # HF GPT-2's Conv1D: y = x @ W + b, W [in, out]
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


register_rule(nn.Linear)(LinearRule())
register_rule(match=_is_conv1d)(LinearRule(transposed=True))
