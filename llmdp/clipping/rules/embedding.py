"""nn.Embedding and Gemma's scaled word embedding."""

from __future__ import annotations

import torch
from torch import nn

from llmdp.clipping.lowp import U64, gamma
from llmdp.clipping.norms import (
    F64,
    LayerRule,
    Record,
    _pair_sums,
    acc_dtype,
    register_rule,
    roundoff,
    rows_mag,
    sq_bound,
    sq_of_instantiated,
    up,
)


class EmbeddingRule(LayerRule):
    """nn.Embedding (and Gemma's scaled word embedding): y_t = E[id_t] (· scale)."""

    has_clipped_ghost = True
    has_exact = True

    def _ids_and_G(self, rec: Record, dtype: torch.dtype | None = None, rows: torch.Tensor | None = None):
        """Token ids [R, T] and the rows' gradients w.r.t. the gathered table rows, widened
        to ``dtype`` (default float32, float64 for float64 G) *before* the scale is applied
        (an embedding's G is [R, T, d], small). The norms read them in float64 (the scale's
        product exact), the clipped sum in float32, whose rounding its bound counts."""
        module = rec.module
        G = rec.G
        R = G.shape[0]
        ids = rec.A.reshape(rec.A.shape[0], -1)
        if ids.shape[0] != R:  # shared indices, e.g. learned position ids of shape [1, T]
            ids = ids.expand(R, -1)
        G3 = G.reshape(R, ids.shape[1], -1)
        if rows is not None:
            ids, G3 = ids[rows], G3[rows]
        G3 = G3.to(dtype or acc_dtype(G3))
        scale = getattr(module, "embed_scale", None)
        if scale is not None:  # Gemma: y = E[ids] * scale
            G3 = G3 * torch.as_tensor(scale).to(device=G3.device, dtype=G3.dtype)
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
        ids, G3 = self._ids_and_G(rec, F64)
        # Σ_{t,s} [id_t = id_s] ⟨G_t, G_s⟩: equal-token mask instead of a one-hot [T, V].
        same = (ids[:, :, None] == ids[:, None, :]).to(F64)
        out = units.rows_to_units(_pair_sums(same, torch.bmm(G3, G3.transpose(1, 2))))
        if units.has_pairs:
            a, b = units.pair_a, units.pair_b
            same_ab = (ids[a][:, :, None] == ids[b][:, None, :]).to(F64)
            out = out + units.pairs_to_units(_pair_sums(same_ab, torch.bmm(G3[a], G3[b].transpose(1, 2))))
        T, d = G3.shape[1], G3.shape[2]
        mag = rows_mag(G3, units)  # Σ_t ‖G_t‖ ≥ the gradient's entrywise magnitudes, in norm
        err = up(mag * mag, 1) * gamma(d + 2 + units.pair_count(T, T), U64)
        # The clipped sum: G·scale and ·c_r in float32 (float64), then index_add, whose
        # longest chain is the most frequent token's count: within γ_{count+3}·c·N.
        count = int(torch.bincount(ids.reshape(-1)).max()) if ids.numel() else 0
        res_u = roundoff(acc_dtype(rec.G))
        dev = up(mag * gamma(count + 3, res_u), 1)
        return {"weight": sq_bound(value=out, err=err, dev=dev, rel=0.0, mag=mag)}

    def instantiate(self, rec, units):
        """Per-unit gradients accumulated in float32 (float64 for float64 G): each entry a
        chain of at most ``count`` adds of G·scale terms, within γ_{count+2}·N of g (the
        bound the norm carries; ``count`` the most frequent token's)."""
        module = rec.module
        if not module.weight.requires_grad:
            return {}
        ids, G3 = self._ids_and_G(rec)
        keep = units.keep
        # padding rows add exact zeros to unit 0 (not left out by a boolean index, which
        # reads its size back: a host sync); their tokens are in ``count`` below anyway
        uid = torch.where(keep, units.unit_of_row, 0).unsqueeze(1).expand(-1, ids.shape[1])
        vals = torch.where(keep[:, None, None], G3, 0) if not units.identity else G3
        h = G3.new_zeros((units.num_units, *module.weight.shape))
        h.index_put_((uid.reshape(-1), ids.reshape(-1)), vals.reshape(-1, G3.shape[-1]), accumulate=True)
        count = int(torch.bincount(ids.reshape(-1)).max()) if ids.numel() else 0
        mag = rows_mag(self._ids_and_G(rec, F64)[1], units)
        # h's own error, and (two-pass forms the sum from G again) clipped_ghost's
        inst_dev = up(mag * (gamma(count + 2, roundoff(h.dtype)) + gamma(count + 3, roundoff(h.dtype))), 2)
        rel = gamma(units.num_units + 2, roundoff(h.dtype))
        return {"weight": (h, sq_of_instantiated(h, inst_dev, 0.0, rel, mag, defer=units.defer))}

    def per_unit(self, rec, units):
        return {n: h for n, (h, _) in self.instantiate(rec, units).items()}

    def clipped_ghost(self, rec, row_factors):
        ids, G3 = self._ids_and_G(rec)
        Gc = G3 * row_factors.to(G3.dtype)[:, None, None]
        out = Gc.new_zeros(rec.module.weight.shape)
        out.index_add_(0, ids.reshape(-1), Gc.reshape(-1, Gc.shape[-1]))
        return {"weight": out}

    def exact(self, rec, name, rows, start, stop):
        ids, G3 = self._ids_and_G(rec, F64, rows=rows)
        m = (ids >= start) & (ids < stop)
        out = G3.new_zeros((stop - start, G3.shape[-1]))
        return out.index_add_(0, ids[m] - start, G3[m])


def _is_scaled_embedding(module: nn.Module) -> bool:  # Gemma: y = E[ids] * embed_scale
    return isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")


register_rule(nn.Embedding, match=_is_scaled_embedding)(EmbeddingRule())
