"""Cross terms ⟨g_i, g_j⟩ between two uses of one parameter in a micro-batch (tied input
embedding and LM head, a module called twice): every use is in the unit's norm (DESIGN, invariant `precision-never-widens`).
Each is computed in float64 with a bound on its error (``norms.py``, module docstring 1):
|computed − ⟨g_i, g_j⟩| ≤ γ_n·N_i·N_j, N the uses' magnitudes."""

from __future__ import annotations

import torch

from llmdp.clipping import lowp
from llmdp.clipping.lowp import U64, gamma
from llmdp.clipping.norms import (
    F64,
    Record,
    Units,
    _as_3d,
    _pair_sum_two,
    _pair_sums,
    _row_sums,
    linear_mag,
    rows_mag,
    up,
)
from llmdp.clipping.rules.embedding import EmbeddingRule
from llmdp.clipping.rules.linear import LinearRule


def cross_inner(ri: Record, rj: Record, pname_i: str, pname_j: str, units: Units) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unit (⟨h_i, h_j⟩, its error bound) for one parameter used by two calls (tied
    embeddings, a module called twice), without forming a p×d gradient when both are
    ghost-capable: h is g itself there, else the calls' instantiated gradients (the
    engine adds the difference between those and the vectors the calls' own norms
    measured)."""
    ti, tj = type(ri.rule), type(rj.rule)
    if ti is EmbeddingRule and tj is LinearRule and not rj.rule.transposed:
        return _cross_embedding_linear(ri, rj, units)
    if tj is EmbeddingRule and ti is LinearRule and not ri.rule.transposed:
        return _cross_embedding_linear(rj, ri, units)
    if ti is LinearRule and tj is LinearRule and ri.rule.transposed == rj.rule.transposed and pname_i == pname_j == "weight":
        return _pair_sum_two(_as_3d(ri.A), _as_3d(ri.G), _as_3d(rj.A), _as_3d(rj.G), units)
    if ti is LinearRule and tj is LinearRule and pname_i == pname_j == "bias":
        Gi, Gj = _as_3d(ri.G), _as_3d(rj.G)
        bi = units.rows_to_units(_row_sums(Gi))
        bj = units.rows_to_units(_row_sums(Gj))
        n = Gi.shape[1] + Gj.shape[1] + 2 * units.max_rows + Gi.shape[-1] + 4
        return (bi * bj).sum(-1), up(rows_mag(Gi, units) * rows_mag(Gj, units), 1) * gamma(n, U64)
    # Anything else: instantiate both (small parameters only reach here), dot in float64.
    gi = ri.rule.instantiate(ri, units)[pname_i][0]
    gj = rj.rule.instantiate(rj, units)[pname_j][0]
    gi, gj = gi.reshape(gi.shape[0], -1).to(F64), gj.reshape(gj.shape[0], -1).to(F64)
    k = gi.shape[1]
    norm_i, norm_j = gi.norm(dim=1), gj.norm(dim=1)
    return (gi * gj).sum(1), up(norm_i * norm_j, 2 * k + 8) * gamma(k + 2, U64)


def _cross_embedding_linear(re: Record, rl: Record, units: Units) -> tuple[torch.Tensor, torch.Tensor]:
    """⟨embedding grad, linear grad⟩ of a tied [V, d] matrix, per unit:
    Σ_t Σ_s G_lin[s, id_t] ⟨G_emb,t, A_lin,s⟩ — a T×T computation, no V×d tensor. Each
    M[s, t] = ⟨A_lin,s, G_emb,t⟩ is within γ_{d+1}·‖A_s‖‖G_t‖, P[s, t] = G_lin[s, id_t] is
    exact and |P[s, t]| ≤ ‖G_lin,s‖: err ≤ γ_n·N_lin·N_emb."""
    ids, Ge = re.rule._ids_and_G(re, F64)
    Al, Gl = _as_3d(rl.A), _as_3d(rl.G)  # as the model produced them (Gl is [R, T, V])

    def one(e_ids, ge, al, gl):  # rows of the embedding call, rows of the linear call
        # P[s, t] = G_lin[s, id_t] (gathered, then widened: [R, T, T]); M[s, t] = ⟨A_lin,s, G_emb,t⟩
        P = torch.gather(gl, 2, e_ids[:, None, :].expand(-1, gl.shape[1], -1)).to(F64)
        return _pair_sums(P, lowp.bmm(al, ge.transpose(1, 2)))

    out = units.rows_to_units(one(ids, Ge, Al, Gl))
    if units.has_pairs:
        a, b = units.pair_a, units.pair_b
        out = out + units.pairs_to_units(one(ids[a], Ge[a], Al[b], Gl[b]))
    n = Al.shape[-1] + 2 + units.pair_count(Al.shape[1], Ge.shape[1])
    return out, up(rows_mag(Ge, units) * linear_mag(Al, Gl, units), 1) * gamma(n, U64)
