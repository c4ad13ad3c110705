"""Mixture-of-experts blocks as transformers 5.x implements them (issue 33): the experts'
weights are 3-D parameters [E, ...] (``gate_up_proj`` or ``up_proj``, ``down_proj``, and
their biases), the block is called as ``experts(hidden [N, d], top_k_index [N, K],
top_k_weights [N, K])`` and computes, for each (token n, choice j) pair s routed to expert
e = top_k_index[n, j],

    out[n] += w_s · down_e(act(up_e(x_n)))       (``_apply_gate`` or ``act_fn``)

whatever kernel runs it (``experts_implementation``: "eager" loop, "grouped_mm",
"batched_mm"). Every expert is a Linear applied to the pairs routed to it, so each unit's
gradient of expert e's slice is Σ over that unit's pairs routed to e of G_s A_sᵀ, with

    up:    A_s = x_n,             G_s = the gradient at up_e's output
    down:  A_s = act(up_e(x_n)),  G_s = w_s · G_out[n]

The rule recomputes, per expert and from the call's own tensors, the up projection, the
activation and the gradient at the up projection's output (one VJP of the activation), and
hands each expert's pairs, laid out per unit ([U_e, m, ·], zero-padded: a zero row adds
exactly nothing), to the Linear rule (`rules/linear.py`). The norms are that rule's, with
its bounds, per (unit, expert), and added over experts (they are disjoint slices of the
parameter: values and errors add; the deviations add, by Minkowski; the relative roundings
take their maximum); ghost or instantiated by the Linear rule's cost model, per expert;
the clipped sum is the Linear rule's contraction per expert with the same factors. Memory:
one expert's pairs at a time (at most a unit's tokens each), plus, in book-keeping, each
call's pairs until the clipped sum (two-pass recomputes them in the second pass, and
checks that they are the first pass's bit for bit, as the engine checks G).

Matched: a module with the attributes ``use_experts_implementation`` gives it, no post-
expert norm, no expert parallelism, and a kernel among the three above. The recomputed
output is compared with the call's on the module's first call (``PROBE_REL``): a forward
whose mathematics differ from the above is refused, naming the module. The router (a
Linear map plus top-k) is the generic rule's (`functional.py`). Padding rows' pairs are
dropped; a pair's unit is its token's row's (``calls.Call.per_row``).
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch

from llmdp.clipping.audit import UnsupportedModuleError
from llmdp.clipping.calls import tensors_in
from llmdp.clipping.lowp import U64, gamma
from llmdp.clipping.norms import F64, LayerRule, Record, Sq, Units, fingerprint, register_rule, up
from llmdp.clipping.rules.linear import LinearRule

__all__ = ["ExpertsRule", "is_experts"]

KERNELS = ("eager", "grouped_mm", "batched_mm")
# The first call's recomputed output within this of the call's, relative to its largest
# entry: a check of the formula, not of rounding (bf16 autocast moves it by ~1e-2; a
# different formula by O(1)). Exactness is tested in float64 (tests/clipping/test_families.py).
PROBE_REL = 0.05


def is_experts(module) -> bool:
    down = getattr(module, "down_proj", None)
    up_ = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", None)
    cfg = getattr(module, "config", None)
    return (isinstance(down, torch.nn.Parameter) and down.dim() == 3
            and isinstance(up_, torch.nn.Parameter) and up_.dim() == 3
            and hasattr(module, "is_transposed") and hasattr(module, "has_bias")
            and not getattr(module, "has_post_expert_norm", False)
            and not getattr(module, "_is_expert_parallel", False)
            and getattr(cfg, "_experts_implementation", None) in KERNELS)


class _Part:
    """One expert's pairs, per unit: the two virtual Linears' A and G ([U_e, m, ·])."""

    __slots__ = ("e", "units", "a_up", "g_up", "a_dn", "g_dn")

    def __init__(self, e, units, a_up, g_up, a_dn, g_dn):
        self.e, self.units = e, units
        self.a_up, self.g_up, self.a_dn, self.g_dn = a_up, g_up, a_dn, g_dn


class ExpertsRule(LayerRule):
    """Per-unit norms and clipped sums of transformers' 3-D experts (module docstring)."""

    wants_call = True
    has_clipped_ghost = True
    has_exact = True

    def __init__(self):
        self._policy = "auto"
        self._probed = weakref.WeakSet()  # modules whose first call passed the probe

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _names(module):
        upn = "gate_up_proj" if module.has_gate else "up_proj"
        return upn, (upn + "_bias") if module.has_bias else None, "down_proj", \
            "down_proj_bias" if module.has_bias else None

    def _linears(self, module):
        """The two virtual Linears: (stub module, parameter names) for up and down."""
        upn, upb, dnn, dnb = self._names(module)

        def stub(w, b):
            wp = getattr(module, w)
            bp = getattr(module, b) if b else None
            return SimpleNamespace(weight=SimpleNamespace(requires_grad=wp.requires_grad),
                                   bias=SimpleNamespace(requires_grad=bp.requires_grad) if bp is not None else None)
        return (stub(upn, upb), {"weight": upn, "bias": upb}), (stub(dnn, dnb), {"weight": dnn, "bias": dnb})

    def choose_ghost(self, module, A, G, policy, num_units):
        self._policy = policy  # read by _sq, right after, in the same backward step
        return True  # norms below (ghost or instantiated per expert), the sum by contraction

    def _parts(self, rec: Record, units: Units) -> list[_Part]:
        cache = rec.cache
        if cache is not None and cache[0] is rec.G:
            return cache[1]
        parts = self._build(rec, units)
        rec.cache = (rec.G, parts)
        return parts

    def _build(self, rec: Record, units: Units) -> list[_Part]:
        module, call = rec.module, rec.call
        name = type(module).__name__
        ts = tensors_in(call.args, call.kwargs)
        if len(ts) != 3 or ts[0].dim() != 2 or ts[1].shape != ts[2].shape or ts[1].dim() != 2 \
                or ts[1].is_floating_point():
            raise UnsupportedModuleError(
                f"module {name}: called with tensors of shapes {[tuple(t.shape) for t in ts]}, not "
                f"(hidden [N, d], top_k_index [N, K], top_k_weights [N, K]); freeze it or register a rule")
        X, idx, w = ts
        Gout = rec.G[0] if isinstance(rec.G, tuple) else rec.G
        N, K = idx.shape
        E = module.down_proj.shape[0]
        k = call.per_row
        uop = units.unit_of_row.repeat_interleave(k) if k > 1 else units.unit_of_row
        dev = X.device
        tok = torch.arange(N, device=dev).repeat_interleave(K)
        e = idx.reshape(-1).long()
        ws = w.reshape(-1)
        u = uop[tok]
        keep = (u >= 0) & (e >= 0) & (e < E)
        U = units.num_units
        key = torch.where(keep, e * U + u, E * U)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=E * U + 1)[: E * U].view(E, U)
        per_e = counts.sum(1).tolist()
        widest = counts.max(1).values.tolist()  # one sync for all experts
        upn, upb, dnn, dnb = self._names(module)
        W1, W2 = getattr(module, upn).detach(), getattr(module, dnn).detach()
        B1 = getattr(module, upb).detach() if upb else None
        B2 = getattr(module, dnb).detach() if dnb else None
        tr = module.is_transposed
        parts, start = [], 0
        probe = module not in self._probed
        out = torch.zeros_like(Gout, dtype=F64) if probe else None
        for ex, n in enumerate(per_e):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            t, wt = tok[sel], ws[sel]
            a = X[t]
            with torch.enable_grad():
                y1 = (a @ W1[ex] if tr else a @ W1[ex].t())
                if B1 is not None:
                    y1 = y1 + B1[ex]
                y1 = y1.detach().requires_grad_(True)
                h = module._apply_gate(y1) if module.has_gate else module.act_fn(y1)
                g2 = Gout[t] * wt[:, None].to(Gout.dtype)
                dh = g2 @ W2[ex].t() if tr else g2 @ W2[ex]
                g1, = torch.autograd.grad(h, y1, dh.to(h.dtype))
            h = h.detach()
            if probe:
                o = h @ W2[ex] if tr else h @ W2[ex].t()
                if B2 is not None:
                    o = o + B2[ex]
                out.index_add_(0, t, (o * wt[:, None].to(o.dtype)).to(F64))
            # per unit: the units of this expert's pairs, in order, and each pair's place
            cu = counts[ex]
            present = (cu > 0).nonzero(as_tuple=True)[0]
            m = widest[ex]
            ptr = torch.zeros(U + 1, dtype=torch.long, device=dev)
            ptr[1:] = cu.cumsum(0)
            uu = u[sel]
            slot = torch.arange(n, device=dev) - ptr[uu]
            local = torch.full((U,), -1, dtype=torch.long, device=dev)
            local[present] = torch.arange(present.numel(), device=dev)
            li = local[uu]
            laid = []
            for v in (a, g1.detach(), h, g2):  # [n, ·] -> [units present, m, ·], zero-padded
                z = v.new_zeros((present.numel(), m, v.shape[-1]))
                z[li, slot] = v
                laid.append(z)
            parts.append(_Part(ex, present, *laid))
        if probe:
            real = (uop >= 0)[:, None]
            self._probe(module, out * real, rec.call.outputs[0] * real, name)
        _same_as_before(rec.call, parts, name)
        return parts

    def _probe(self, module, got, want, name):
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        diff = float((got - want.to(F64)).abs().max()) if want.numel() else 0.0
        if not diff <= PROBE_REL * scale + 1e-30:
            raise UnsupportedModuleError(
                f"module {name}: its output is not Σ_k w·down_e(act(up_e(x))) as transformers' "
                f"experts compute it (recomputed {diff:.3g} away, at scale {scale:.3g}), so the "
                f"experts rule cannot clip it; freeze it or register a rule")
        self._probed.add(module)

    # ------------------------------------------------------------------ norms
    def sq_norms_ghost(self, rec, units):
        parts = self._parts(rec, units)
        U = units.num_units
        dev = units.unit_of_row.device
        acc: dict[str, dict] = {}
        count: dict[str, int] = {}
        for part in parts:
            for (stub, names), (A3, G3) in zip(self._linears(rec.module),
                                               ((part.a_up, part.g_up), (part.a_dn, part.g_dn))):
                if not (stub.weight.requires_grad or (stub.bias is not None and stub.bias.requires_grad)):
                    continue
                sub = Units.make(torch.arange(A3.shape[0], device=dev), A3.shape[0])
                r = Record(stub, _LINEARS[rec.module.is_transposed], A3)
                r.G = G3
                lin = r.rule
                if lin.choose_ghost(stub, A3, G3, self._policy, A3.shape[0]):
                    got = lin.sq_norms_ghost(r, sub)
                else:
                    got = {n: sq for n, (_, sq) in lin.instantiate(r, sub).items()}
                for which, sq in got.items():
                    pname = names[which]
                    a = acc.setdefault(pname, {k: torch.zeros(U, dtype=F64, device=dev)
                                               for k in ("value", "err", "dev", "mag")} | {"rel": 0.0})
                    for kk in ("value", "err", "dev", "mag"):
                        a[kk].index_add_(0, part.units, getattr(sq, kk).to(F64))
                    a["rel"] = max(a["rel"], float(sq.rel.max()) if sq.rel.numel() else 0.0)
                    count[pname] = count.get(pname, 0) + 1
        out = {}
        for pname in self.params(rec.module):
            a = acc.get(pname)
            if a is None:  # no pair reached this parameter: every unit's gradient is 0
                z = torch.zeros(U, dtype=F64, device=dev)
                out[pname] = Sq(z, z.clone(), z.clone(), z.clone(), z.clone())
                continue
            n = count[pname] + 2  # the float64 sums over experts
            value = a["value"]
            err = up(a["err"], n) + gamma(n, U64) * up(value.abs(), n)
            out[pname] = Sq(value, err, up(a["dev"], n), torch.full_like(value, a["rel"]), up(a["mag"], n))
        return out

    # ------------------------------------------------------------------ clipped sum
    def clipped_ghost(self, rec, row_factors):
        units = rec.call.units
        parts = self._parts(rec, units)
        module = rec.module
        unit_f = torch.zeros(units.num_units, dtype=row_factors.dtype, device=row_factors.device)
        keep = units.unit_of_row >= 0
        unit_f[units.unit_of_row[keep]] = row_factors[keep]
        want = set(self.params(module))
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            f = unit_f[part.units]
            for (stub, names), (A3, G3) in zip(self._linears(module),
                                               ((part.a_up, part.g_up), (part.a_dn, part.g_dn))):
                if not any(v in want for v in names.values() if v):
                    continue
                r = Record(stub, _LINEARS[module.is_transposed], A3)
                r.G = G3
                # A zero factor (a unit clipped to nothing, or non-finite) adds exactly 0:
                # its rows are left out, so a non-finite value there cannot reach the sum.
                nz = f != 0
                if not bool(nz.all()):
                    A3, G3, ff = A3[nz], G3[nz], f[nz]
                    r.A, r.G = A3, G3
                else:
                    ff = f
                if ff.numel() == 0:
                    continue
                for which, g in r.rule.clipped_ghost(r, ff).items():
                    pname = names[which]
                    if pname not in want:
                        continue
                    if pname not in out:
                        p = getattr(module, pname)
                        out[pname] = torch.zeros(p.shape, dtype=g.dtype, device=g.device)
                    out[pname][part.e] = g.reshape(out[pname].shape[1:])
        for pname in want:
            if pname not in out:
                p = getattr(module, pname)
                out[pname] = torch.zeros(p.shape, dtype=F64 if p.dtype == F64 else torch.float32,
                                         device=p.device)
        return out

    def exact(self, rec, name, rows, start, stop):
        units = rec.call.units
        parts = self._parts(rec, units)
        u = int(units.unit_of_row[rows[0]])
        p = getattr(rec.module, name)
        out = torch.zeros((stop - start, *p.shape[1:]), dtype=F64, device=p.device)
        (_, n_up), (_, n_dn) = self._linears(rec.module)
        for part in parts:
            if not start <= part.e < stop:
                continue
            hit = (part.units == u).nonzero(as_tuple=True)[0]
            if hit.numel() == 0:
                continue
            for names, (A3, G3) in ((n_up, (part.a_up, part.g_up)), (n_dn, (part.a_dn, part.g_dn))):
                for which, pname in names.items():
                    if pname != name:
                        continue
                    r = Record(None, _LINEARS[rec.module.is_transposed], A3)
                    r.G = G3
                    first = p.shape[1]
                    out[part.e - start] = r.rule.exact(r, which, hit, 0, first)
        return out


def _same_as_before(call, parts: list[_Part], name: str) -> None:
    """Two-pass recomputes the parts in pass 2 (G is fingerprinted by the engine): what
    this rule derived from G (the up projection's output gradient, the activation) must be
    pass 1's bit for bit, or what is added would not be what was measured."""
    fp = torch.cat([fingerprint((p.g_up, p.a_dn)) for p in parts]) if parts else None
    before = call.derived
    call.derived = fp
    if before is not None and (fp is None or not torch.equal(fp, before)):
        raise RuntimeError(
            f"clipping two-pass: recomputing the experts of {name} in the second pass gave "
            "other values than in the first (a non-deterministic kernel), so what would be "
            "added is not what was clipped. Use privacy.clipping_mode: book-keeping, or "
            "torch.use_deterministic_algorithms(True).")


_LINEARS = {False: LinearRule(), True: LinearRule(transposed=True)}

register_rule(match=is_experts)(ExpertsRule())
