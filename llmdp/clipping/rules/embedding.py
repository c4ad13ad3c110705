"""nn.Embedding and Gemma's scaled word embedding."""

from __future__ import annotations

import torch
from torch import nn

from llmdp.clipping.norms import (
    LayerRule,
    Record,
    acc_dtype,
    register_rule,
)


class EmbeddingRule(LayerRule):
    """nn.Embedding (and Gemma's scaled word embedding): y_t = E[id_t] (· scale)."""

    has_clipped_ghost = True

    def _ids_and_G(self, rec: Record):
        """Token ids [R, T] and the rows' gradients w.r.t. the gathered table rows, widened
        to float32 (float64) *before* the scale is applied: the norms, the cross terms and
        the clipped sum all read these same values (an embedding's G is [R, T, d], small)."""
        module = rec.module
        G = rec.G
        R = G.shape[0]
        ids = rec.A.reshape(rec.A.shape[0], -1)
        if ids.shape[0] != R:  # shared indices, e.g. learned position ids of shape [1, T]
            ids = ids.expand(R, -1)
        G3 = G.reshape(R, ids.shape[1], -1)
        G3 = G3.to(acc_dtype(G3))
        scale = getattr(module, "embed_scale", None)
        if scale is not None:  # Gemma: y = E[ids] * scale
            G3 = G3 * scale.to(G3.dtype)
        if module.padding_idx is not None:  # nn.Embedding never updates the padding row
            G3 = G3.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0)
        return ids, G3

    def choose_ghost(self, module, A, G, policy, num_units):
        if policy != "auto":
            return policy == "ghost"
        R, T = G.shape[0], G.reshape(G.shape[0], -1, G.shape[-1]).shape[1]
        V, d = module.weight.shape
        # Kept anyway: the output gradient [R, T, d] (the input is token ids).
        return num_units * V * d > R * T * d

    def sq_norms_ghost(self, rec, units):
        if not rec.module.weight.requires_grad:
            return {}
        ids, G3 = self._ids_and_G(rec)
        # Σ_{t,s} [id_t = id_s] ⟨G_t, G_s⟩: equal-token mask instead of a one-hot [T, V].
        same = (ids[:, :, None] == ids[:, None, :]).to(G3.dtype)
        diag = (same * torch.bmm(G3, G3.transpose(1, 2))).sum((1, 2))
        out = units.rows_to_units(diag)
        if not units.identity and units.pair_a is not None and units.pair_a.numel():
            a, b = units.pair_a, units.pair_b
            same_ab = (ids[a][:, :, None] == ids[b][:, None, :]).to(G3.dtype)
            cross = (same_ab * torch.bmm(G3[a], G3[b].transpose(1, 2))).sum((1, 2))
            out = out + units.pairs_to_units(cross)
        return {"weight": out}

    def per_unit(self, rec, units):
        module = rec.module
        if not module.weight.requires_grad:
            return {}
        ids, G3 = self._ids_and_G(rec)
        keep = units.keep
        uid = units.unit_of_row[keep].unsqueeze(1).expand(-1, ids.shape[1])
        out = G3.new_zeros((units.num_units, *module.weight.shape))
        out.index_put_((uid.reshape(-1), ids[keep].reshape(-1)), G3[keep].reshape(-1, G3.shape[-1]),
                       accumulate=True)
        return {"weight": out}

    def clipped_ghost(self, rec, row_factors):
        ids, G3 = self._ids_and_G(rec)
        Gc = G3 * row_factors.to(G3.dtype)[:, None, None]
        out = Gc.new_zeros(rec.module.weight.shape)
        out.index_add_(0, ids.reshape(-1), Gc.reshape(-1, Gc.shape[-1]))
        return {"weight": out}


def _is_scaled_embedding(module: nn.Module) -> bool:  # Gemma: y = E[ids] * embed_scale
    return isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")


register_rule(nn.Embedding, match=_is_scaled_embedding)(EmbeddingRule())
