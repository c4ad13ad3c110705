"""Cross terms ⟨g_i, g_j⟩ between two uses of one parameter in a micro-batch (tied input
embedding and LM head, a module called twice): every use is in the unit's norm (DESIGN §3.8)."""

from __future__ import annotations

import torch

from llmdp.clipping import lowp
from llmdp.clipping.norms import Record, Units, _as_3d, _pair_sum_two, _row_sums, acc_dtype
from llmdp.clipping.rules.embedding import EmbeddingRule
from llmdp.clipping.rules.linear import LinearRule


def cross_inner(ri: Record, rj: Record, pname_i: str, pname_j: str, units: Units) -> torch.Tensor:
    """Per unit ⟨g_i, g_j⟩ for one parameter used by two calls (tied embeddings, a module
    called twice), without forming a p×d gradient when both are ghost-capable."""
    ti, tj = type(ri.rule), type(rj.rule)
    if ti is EmbeddingRule and tj is LinearRule and not rj.rule.transposed:
        return _cross_embedding_linear(ri, rj, units)
    if tj is EmbeddingRule and ti is LinearRule and not ri.rule.transposed:
        return _cross_embedding_linear(rj, ri, units)
    if ti is LinearRule and tj is LinearRule and ri.rule.transposed == rj.rule.transposed and pname_i == pname_j == "weight":
        return _pair_sum_two(_as_3d(ri.A), _as_3d(ri.G), _as_3d(rj.A), _as_3d(rj.G), units)
    if ti is LinearRule and tj is LinearRule and pname_i == pname_j == "bias":
        bi = units.rows_to_units(_row_sums(_as_3d(ri.G)))
        bj = units.rows_to_units(_row_sums(_as_3d(rj.G)))
        return (bi * bj.to(bi.dtype)).sum(-1)
    # Anything else: instantiate both (small parameters only reach here).
    gi = ri.rule.per_unit(ri, units)[pname_i]
    gj = rj.rule.per_unit(rj, units)[pname_j]
    return (gi.reshape(gi.shape[0], -1).to(acc_dtype(gi)) * gj.reshape(gj.shape[0], -1).to(acc_dtype(gj))).sum(1)


def _cross_embedding_linear(re: Record, rl: Record, units: Units) -> torch.Tensor:
    """⟨embedding grad, linear grad⟩ of a tied [V, d] matrix, per unit:
    Σ_t Σ_s G_lin[s, id_t] ⟨G_emb,t, A_lin,s⟩ — a T×T computation, no V×d tensor."""
    ids, Ge = re.rule._ids_and_G(re)  # float32 (float64)
    Al, Gl = _as_3d(rl.A), _as_3d(rl.G)  # as the model produced them (Gl is [R, T, V])

    def one(e_ids, ge, al, gl):  # rows of the embedding call, rows of the linear call
        # P[s, t] = G_lin[s, id_t] (gathered, then widened: [R, T, T]); M[s, t] = ⟨A_lin,s, G_emb,t⟩
        P = torch.gather(gl, 2, e_ids[:, None, :].expand(-1, gl.shape[1], -1)).to(ge.dtype)
        M = lowp.bmm(al, ge.transpose(1, 2))
        return (P * M.to(ge.dtype)).sum((1, 2))

    diag = one(ids, Ge, Al, Gl)
    out = units.rows_to_units(diag)
    if not units.identity and units.pair_a is not None and units.pair_a.numel():
        a, b = units.pair_a, units.pair_b
        out = out + units.pairs_to_units(one(ids[a], Ge[a], Al[b], Gl[b]))
    return out
