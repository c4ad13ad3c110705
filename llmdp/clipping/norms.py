"""Registry of per-unit gradient rules, by module type.

A rule turns what the forward hook kept (the module's input A) and the gradient of the
loss with respect to the module's output (G) into per-*row* gradient contributions for
each of the module's own trainable parameters; the engine then sums rows into units.

Rules exist only for modules whose output at one row depends on that row alone. Anything
else is refused by the engine (DESIGN §3.6): no silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# rule(module, A, G, unit_of_row, num_units) -> {param_local_name: tensor [U, *param.shape]}
Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, int], dict[str, torch.Tensor]]


def _to_units(per_row: torch.Tensor, unit_of_row: torch.Tensor, num_units: int) -> torch.Tensor:
    """Sum per-row gradients into units; padding rows (-1) are dropped."""
    if num_units == per_row.shape[0] and _is_identity(unit_of_row):
        return per_row  # row r is unit r: nothing to sum (the common case of sequence units)
    keep = unit_of_row >= 0
    out = per_row.new_zeros((num_units, *per_row.shape[1:]))
    return out.index_add(0, unit_of_row[keep], per_row[keep])


def _is_identity(unit_of_row: torch.Tensor) -> bool:
    n = unit_of_row.shape[0]
    return bool(torch.equal(unit_of_row, torch.arange(n, device=unit_of_row.device)))


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[R, in] -> [R, 1, in]; [R, T, ..., in] -> [R, T', in]."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def linear_rule(module: nn.Linear, A, G, unit_of_row, num_units):
    A3, G3 = _as_3d(A).to(G.dtype), _as_3d(G)
    out = {}
    if module.weight.requires_grad:
        # Row r's weight gradient is Σ_t G[r,t] A[r,t]ᵀ; rows are summed into their unit.
        out["weight"] = _to_units(torch.einsum("rto,rti->roi", G3, A3), unit_of_row, num_units)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = _to_units(G3.sum(1), unit_of_row, num_units)
    return out


def conv1d_rule(module, A, G, unit_of_row, num_units):
    """HF GPT-2 Conv1D: y = x W + b with W of shape [in, out]."""
    A3, G3 = _as_3d(A).to(G.dtype), _as_3d(G)
    out = {}
    if module.weight.requires_grad:
        out["weight"] = _to_units(torch.einsum("rti,rto->rio", A3, G3), unit_of_row, num_units)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = _to_units(G3.sum(1), unit_of_row, num_units)
    return out


def embedding_rule(module: nn.Embedding, A, G, unit_of_row, num_units):
    """Scatter each token's output gradient into its row of the unit's [V, d] gradient."""
    if not module.weight.requires_grad:
        return {}
    R = G.shape[0]
    ids = A.reshape(A.shape[0], -1)
    if ids.shape[0] != R:  # shared indices, e.g. learned position ids of shape [1, T]
        ids = ids.expand(R, -1)
    G3 = G.reshape(R, ids.shape[1], -1)
    scale = getattr(module, "embed_scale", None)
    if scale is not None:  # Gemma's scaled word embedding: y = E[ids] * scale
        G3 = G3 * scale.to(G3.dtype)
    if module.padding_idx is not None:
        # nn.Embedding never updates the padding row.
        G3 = G3.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0)
    keep = unit_of_row >= 0
    units = unit_of_row[keep].unsqueeze(1).expand(-1, ids.shape[1])
    out = G3.new_zeros((num_units, *module.weight.shape))
    out.index_put_((units.reshape(-1), ids[keep].reshape(-1)), G3[keep].reshape(-1, G3.shape[-1]), accumulate=True)
    return {"weight": out}


def rowwise_vjp_rule(module: nn.Module, A, G, unit_of_row, num_units):
    """Exact per-row gradients of any row-independent module (normalization layers), by a
    vectorized vector-Jacobian product of the module re-run on each row alone."""
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

    per_row = vmap(one)(A.detach(), G)
    return {n: _to_units(per_row[n], unit_of_row, num_units) for n in params}


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def find_rule(module: nn.Module) -> Rule | None:
    """The rule for ``module``'s own parameters, or None if it is not supported."""
    if type(module) is nn.Linear:
        return linear_rule
    if type(module) is nn.Embedding or (
        isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
    ):
        return embedding_rule
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return conv1d_rule
    if isinstance(module, nn.LayerNorm) or _is_rms_norm(module) or isinstance(module, nn.GroupNorm):
        return rowwise_vjp_rule
    return None
