"""nn.Linear and HF GPT-2's Conv1D (the same rule, transposed weight)."""

from __future__ import annotations

from torch import nn

from llmdp.clipping import gram, lowp
from llmdp.clipping.lowp import U32, U64, gamma
from llmdp.clipping.norms import (
    F64,
    LayerRule,
    PendingMag,
    _as_3d,
    _bias_sq,
    _ghost_cheaper,
    _pair_sum_two,
    _row_sums,
    device_spec,
    linear_mag_parts,
    register_rule,
    roundoff,
    rows_mag,
    sq_bound,
    sq_of_instantiated,
    tile_norm_cheaper,
    tile_norm_time,
    up_factor,
)


class LinearRule(LayerRule):
    """nn.Linear (weight [out, in]) and, with ``transposed``, HF GPT-2 Conv1D ([in, out])."""

    has_clipped_ghost = True
    has_exact = True
    adds_to_sinks = True  # clipped_ghost may add the weight's sum to the caller's sink itself

    def __init__(self, transposed: bool = False):
        self.transposed = transposed

    def choose_ghost(self, module, A, G, policy, num_units):
        if policy != "auto":
            return policy == "ghost"
        G3 = _as_3d(G)
        spec = device_spec(G.device, G.dtype)
        tile = lowp.tile_norms(*self._clipped_operands(_as_3d(A), G3))
        return _ghost_cheaper(num_units, G3.shape[0], G3.shape[1], G.shape[-1], A.shape[-1], spec, tile)

    # Every contraction goes through ``lowp`` on A and G as the model produced them: the
    # norms in float64 (exact products), the clipped sum on tensor cores (bf16/fp16 on
    # CUDA) or in float64; each with its bound (norms.py, DESIGN, invariant `precision-never-widens`).

    def _clipped_operands(self, A3, G3):
        return (A3, G3) if self.transposed else (G3, A3)

    # ``clip`` / ``bias_clip``: the bound of a clipped sum formed otherwise than by this
    # rule's ``clipped_ghost`` on rec's A and G (the experts rule's, ``rules/experts.py``):
    # (u, n) of the weight's contraction (default ``lowp.row_scaled_bound``) and n (float64)
    # of the bias's; the norms' own arithmetic and bounds are unchanged.

    def sq_norms_ghost(self, rec, units, clip=None, bias_clip=None):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        res_u = roundoff(lowp.result_dtype(A3, G3))
        out = {}
        if module.weight.requires_grad:
            # N_u, its rounding up, and the bounds that are constants times it or the
            # value are deferred to the step's one bound computation (`Sq`, stacked.py)
            # (on the CPU under book-keeping both may be deferred to the step's bound
            # computation: `lowp.LazyRowNorms`, `norms.PendingMag`, `gram.PendingGram`)
            na, ng = units.norms_pair(A3, G3, lazy=True)  # for N_u, and the Gram path's bound
            mag, mag_f = linear_mag_parts(A3, G3, units, defer="cpu", norms_g=ng)
            x, y = self._clipped_operands(A3, G3)
            u, n = clip or lowp.row_scaled_bound(x, y)
            R, T = G3.shape[0], G3.shape[1]
            spec = device_spec(G3.device, G3.dtype)
            tile = lowp.tile_norms(x, y)
            tile_time = tile_norm_time(R, T, G3.shape[-1], A3.shape[-1], spec) if tile else None
            if gram.use_lowp(A3, G3, spec, tile_time):
                # float32 Grams with the a-posteriori bound (gram.py); A's shared like
                # the float64 one between the layers that read it
                value, err = gram.sq_norm(A3, G3, units, units.cached(A3, "gram32", gram.self_gram32),
                                          na, ng)
                out["weight"] = sq_bound(value, err, (gamma(n, u), up_factor(1)), gamma(2, res_u), mag, mag_f)
            elif tile and tile_norm_cheaper(R, T, G3.shape[-1], A3.shape[-1], spec) and (
                    value := lowp.unit_sq_norms(x, y, *units.csr(), units.num_units)) is not None:
                # The norm of h̃_u, the tensor-core value of the unit's gradient (never
                # written), within γ_k·N_u of g_u; then the clipped sum's own error. (A
                # kernel that fails returns None: the float64 Grams below instead.)
                err = gamma(x.shape[2] * y.shape[2] + 4, U64)  # × value
                k = lowp.unit_norm_count(T, units.max_rows)
                dev = (gamma(k, lowp.UTC) + gamma(n, u), up_factor(2))  # × N_u
                out["weight"] = sq_bound(value, err, dev, gamma(2, res_u), mag, mag_f)
            else:
                mag = (mag.form() if isinstance(mag, PendingMag) else mag) * mag_f
                value, err = _pair_sum_two(A3, G3, A3, G3, units, gram_a=units.self_gram(A3),
                                           mags=(mag, mag))
                # the clipped sum's own error; then the factor's and the result's roundings
                out["weight"] = sq_bound(value, err, (gamma(n, u), up_factor(1)), gamma(2, res_u), mag)
        if module.bias is not None and module.bias.requires_grad:
            value, err, mag = _bias_sq(G3, units)  # the bias gradient of each row
            n = _bias_clip_count(G3, bias_clip)
            out["bias"] = sq_bound(value, err, (gamma(n, U64), up_factor(1)), gamma(1, res_u), mag)
        return out

    def instantiate(self, rec, units, clip=None, bias_clip=None):
        """Per-unit gradients from per-row float32 contractions (tensor cores for bf16/fp16
        on CUDA; float64 for float64 operands), each entry within γ_{T+K+1}(u)·|G|ᵀ|A| of
        its exact value (``lowp.fast_bound``; K: the unit's rows), so ‖h − g‖ ≤ γ·N: the
        bound the norm carries. The stored vector is what the clipped sum scales."""
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        store = lowp.result_dtype(A3, G3)
        rel = gamma(units.num_units + 2, roundoff(store))
        out = {}
        # Two-pass forms the clipped sum from A and G again (``clipped_ghost``), not from h:
        # that contraction's error is in dev too (it is the delivery's; book-keeping scales
        # h, whose relative roundings are ``rel``), with one more relative rounding.
        rel = max(rel, gamma(2, roundoff(store)))
        if module.weight.requires_grad:
            x, y = (A3, G3) if self.transposed else (G3, A3)
            u, n = lowp.fast_bound(x, y, G3.shape[1])
            h = units.rows_to_units(lowp.per_row_tn(x, y))
            mag, mag_f = linear_mag_parts(A3, G3, units, defer=True)
            uc, nc = clip or lowp.row_scaled_bound(*self._clipped_operands(A3, G3))
            dev = (gamma(n + units.max_rows + 1, u) + gamma(nc, uc), up_factor(2))  # × N_u
            out["weight"] = (h, sq_of_instantiated(h, dev, 0.0, rel, mag, mag_f, defer=units.defer))
        if module.bias is not None and module.bias.requires_grad:
            h = units.rows_to_units(_row_sums(G3)).to(store)
            mag = rows_mag(G3, units)
            # h's sums (its rows', its units'), then the clipped sum's (or the caller's)
            n = (2 * G3.shape[1] + 2 * G3.shape[0] + 4 if bias_clip is None
                 else G3.shape[1] + units.max_rows + 1 + bias_clip)
            dev = (gamma(n, U64), up_factor(1))  # × N_u
            out["bias"] = (h, sq_of_instantiated(h, dev, 0.0 if store == F64 else U32, rel, mag,
                                                 defer=units.defer))
        return out

    def per_unit(self, rec, units):
        return {n: h for n, (h, _) in self.instantiate(rec, units).items()}

    def clipped_ghost(self, rec, row_factors, sinks=None):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            # Σ_r c_r G_rᵀA_r, the factor applied in float32 partial sums or float64 (never
            # to a bf16 operand); added to the sink where the caller gave one (in the
            # Triton kernel: no separate add), else returned.
            sink = (sinks or {}).get("weight")  # the weight's shape: [out, in] or Conv1D's [in, out]
            part = lowp.row_scaled_tn(*self._clipped_operands(A3, G3), row_factors, sink=sink)
            if part is not None:
                out["weight"] = part
        if module.bias is not None and module.bias.requires_grad:
            s = _row_sums(G3)
            out["bias"] = (s * row_factors.to(s.dtype)[:, None]).sum(0)
        return out

    def exact(self, rec, name, rows, start, stop):
        A3, G3 = _as_3d(rec.A)[rows], _as_3d(rec.G)[rows]
        if name == "bias":
            return G3[..., start:stop].to(F64).sum((0, 1))
        Af, Gf = A3.reshape(-1, A3.shape[-1]), G3.reshape(-1, G3.shape[-1])
        if self.transposed:  # Conv1D: weight [in, out], rows of it follow the input
            return lowp.bmm(Af[:, start:stop].t().unsqueeze(0), Gf.unsqueeze(0))[0]
        return lowp.bmm(Gf[:, start:stop].t().unsqueeze(0), Af.unsqueeze(0))[0]


def _bias_clip_count(G3, bias_clip: int | None) -> int:
    """n of the bias's clipped sum (float64 row sums, × factor, the sum over rows), or the
    caller's count for a sum it forms itself."""
    return bias_clip if bias_clip is not None else G3.shape[1] + 2 * G3.shape[0] + 2


def _is_conv1d(module: nn.Module) -> bool:  # HF GPT-2's Conv1D: y = x @ W + b, W [in, out]
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


register_rule(nn.Linear)(LinearRule())
register_rule(match=_is_conv1d)(LinearRule(transposed=True))
