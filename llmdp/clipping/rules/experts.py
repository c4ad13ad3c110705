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

All experts of a call at once (issue 50). The rule recomputes, from the call's own
tensors, the up projection (one matmul per expert, on its pairs), the activation and the
gradient at the up projection's output (one VJP for all pairs), and keeps the pairs sorted
by (expert, unit), unpadded ([P, ·], P ≤ N·K, and one zero row that padding points to).
A *group* is one unit's pairs on one expert.

* Norms. A chunk of groups, of any experts, is one Linear call of B rows (one per group,
  each its own unit) of M positions (the group's pairs): each group's norm is the Linear
  rule's (`rules/linear.py`: ghost or instantiated, by that rule's cost model per chunk;
  its arithmetic and bounds, at T = M), but for the clipped sum's bound, which is this
  rule's (below). The groups go largest first, each chunk zero-padded to its largest (a
  zero position adds exactly nothing; the bounds count the padded length M). A group joins a chunk when it has at least
  ``PAD_RATIO`` of its rows, or the chunk has at most ``PAD_MIN`` rows, and while the
  chunk's padded operands hold at most ``lowp.CHUNK_ELEMENTS`` values (a single larger
  group is a chunk of its own): so a few chunks per call, each padded to at most
  1/``PAD_RATIO`` of its pairs (but the last ones, of at most ``PAD_MIN`` positions). A unit's norm adds its groups' (disjoint slices of
  the parameter: values and errors add; the deviations add, by Minkowski; the relative
  roundings take their maximum; the float64 sums over at most E groups are counted).
* Clipped sum. Σ_s c_{u(s)}·G_sᵀA_s per expert, over its pairs as they lie (contiguous,
  no padding, no copy but the scaled operand): tiles of ``TILE`` pairs, each one float32
  GEMM like ``lowp.row_scaled_tn``'s groups (the smaller operand scaled by the pairs'
  factors in float32: one rounding; the products; a chain of at most TILE terms), the
  tiles' results added in float32 ``FLUSH`` at a time (at most FLUSH − 1 more roundings of
  any product), those sums in float64 (below one more float32 rounding), cast to float32
  once (a relative rounding, counted with the factor's cast in ``rel``; an expert of at
  most FLUSH tiles has one float32 sum, that value already: summed in its slice of the
  result). So every product is within γ_{TILE+FLUSH+3}(2⁻²⁴) of its exact value; float64
  operands: one float64 sum
  of at most n products of scaled operands, γ_{n+2}(2⁻⁵³), n the largest expert's pairs
  rounded up to tiles. The norms' ``dev`` counts that bound, at the unit's share of each
  expert's sum (its groups' N, as the Linear rule's; the Linear rule's ``clip``
  argument). Bf16/fp16 on CUDA with the Triton kernel: per expert, its groups as rows
  (padded to its largest), ``lowp.row_scaled_tn`` (factors on float32 partial sums),
  bounded by ``lowp.row_scaled_bound`` at the most rows of an expert and the largest
  group (the count grows with both). Biases: Σ_s c·G_s in float64 (a product and at
  most n − 1 additions: γ_{n+2}(2⁻⁵³), n the largest expert's pairs). A pair whose factor
  is 0 (a unit clipped to nothing, non-finite, or recomputed exactly) is zeroed first: it
  adds exactly 0, and a non-finite value cannot reach the sum.

Own forward (the CPU). While a clipper records on the CPU (no autocast, the parameters in
the input's dtype), the block runs this rule's forward instead of transformers' kernel
(``_Own``: installed by the engine, removed with its hooks): the same Σ w·down(act(up(x)))
with the module's own ``_apply_gate`` / ``act_fn``, its pairs sorted by (expert, token), one
GEMM per expert into its rows (``_ExpertsLinear``, whose backward forms no weight gradient
in the engine's backward, which asks for none, and every asked gradient otherwise); its
first call is checked against the module's own forward (``PROBE_REL``). It keeps x's rows
and the activation, and an identity on the up projection's output (``_Inner``) takes that
gradient in the backward: the call's taps hold its output gradients until then
(``calls.Call.late``), so the norms find all four pair tensors without recomputing any (the
recompute's two GEMMs per expert and its VJP are gone). The pairs are re-sorted by unit
only where the forward's (expert, token) order is not already (expert, unit); book-keeping
then drops the forward's references (its pairs are copies with the zero row). Two-pass
checks pass 2's captured tensors bit for bit as it checks the recompute's. CUDA keeps the
recompute (transformers' grouped kernel) until the GPU issue measures this path.

Memory: the four pair tensors ([P, d], [P, 2I], [P, I], [P, d]: as much as the experts'
own forward keeps), kept in book-keeping until the clipped sum (two-pass recomputes them
in the second pass and checks that they are the first pass's bit for bit, as the engine
checks G); for the norms one chunk's padded copy at a time (≤ ``lowp.CHUNK_ELEMENTS``
values, or one group) with its Gram matrices (B·M² float64) or, instantiated, its B
per-group gradients (the Linear rule's cost model allows them only when no larger than
the chunk's operands); for the clipped sum one tile's scaled operand and one expert's
[a, b] sums (float32 and float64) besides the result (and, when some factor is 0, a
zeroed copy of the two pair tensors).

Matched: a module with the attributes ``use_experts_implementation`` gives it, no post-
expert norm, no expert parallelism, and a kernel among the three above. The recomputed
output is compared with the call's on the module's first call (``PROBE_REL``): a forward
whose mathematics differ from the above is refused, naming the module. The router (a
Linear map plus top-k) is the generic rule's (`functional.py`). Padding rows' pairs are
dropped; a pair's unit is its token's row's (``calls.Call.per_row``).
"""

from __future__ import annotations

import types
import weakref
from collections import Counter
from types import SimpleNamespace

import torch

from llmdp.clipping import lowp
from llmdp.clipping.audit import UnsupportedModuleError
from llmdp.clipping.calls import rerunning, tensors_in
from llmdp.clipping.lowp import U32, U64, gamma
from llmdp.clipping.norms import F64, LayerRule, Record, Sq, Units, fingerprint, register_rule, up
from llmdp.clipping.rules.linear import LinearRule

__all__ = ["ExpertsRule", "is_experts"]

KERNELS = ("eager", "grouped_mm", "batched_mm")
# The first call's recomputed output within this of the call's, relative to its largest
# entry: a check of the formula, not of rounding (bf16 autocast moves it by ~1e-2; a
# different formula by O(1)). Exactness is tested in float64 (tests/clipping/test_families.py).
PROBE_REL = 0.05
PAD_RATIO = 0.75  # a group joins a norm chunk with at least this part of its padded rows
PAD_MIN = 16  # or when the chunk is this short (small groups together)
TILE = 256  # pairs of one expert in one float32 GEMM of the clipped sum
FLUSH = 16  # tiles added in float32 before their sum goes to the float64 one
# On the CPU, while a clipper records, the block runs this rule's forward (``_Own``): the
# same Σ w·down(act(up(x))), in an order the rule knows, keeping what the norms need
# instead of recomputing it in the backward. False: transformers' kernel, and the recompute.
OWN_FORWARD = True


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


def _max_rel(sq: Sq) -> float:
    """The largest rel of ``sq``: its constant (no host sync) when the rule deferred it."""
    r = sq._rel
    if not isinstance(r, torch.Tensor):
        return float(r)
    return float(r.max()) if r.numel() else 0.0


class _Pairs:
    """One call's pairs sorted by (expert, unit): the two virtual Linears' A and G [P + 1, ·]
    (the last row zero: padding points there), each pair's unit and expert, and the groups
    (a unit's pairs on one expert)."""

    __slots__ = ("a_up", "g_up", "a_dn", "g_dn", "unit", "expert", "n_e", "e_ptr", "g_e", "g_u",
                 "g_ptr", "g_size", "group_of", "dev_ptr", "dev_size", "dev_unit")

    def __init__(self, a_up, g_up, a_dn, g_dn, unit, expert, n_e, cnt, U):
        self.a_up, self.g_up, self.a_dn, self.g_dn = a_up, g_up, a_dn, g_dn
        self.unit, self.expert, self.n_e = unit, expert, n_e
        self.e_ptr = [0]
        for n in n_e:
            self.e_ptr.append(self.e_ptr[-1] + n)
        self.g_e, self.g_u, self.g_size, self.g_ptr, self.group_of = [], [], [], [0], {}
        for key, c in enumerate(cnt):
            if c:
                self.group_of[(key // U, key % U)] = len(self.g_size)
                self.g_e.append(key // U)
                self.g_u.append(key % U)
                self.g_size.append(c)
                self.g_ptr.append(self.g_ptr[-1] + c)
        dev = unit.device
        self.dev_ptr = torch.tensor(self.g_ptr[:-1], dtype=torch.long, device=dev)
        self.dev_size = torch.tensor(self.g_size, dtype=torch.long, device=dev)
        self.dev_unit = torch.tensor(self.g_u, dtype=torch.long, device=dev)

    def chunks(self, width: int) -> list[tuple[list[int], int]]:
        """The groups in chunks for the norms (module docstring): (group ids, padded rows)."""
        out, cur, M = [], [], 0
        for g in sorted(range(len(self.g_size)), key=lambda i: -self.g_size[i]):
            s = self.g_size[g]
            if cur and (s >= PAD_RATIO * M or M <= PAD_MIN) and (len(cur) + 1) * M * width <= lowp.CHUNK_ELEMENTS:
                cur.append(g)
                continue
            if cur:
                out.append((cur, M))
            cur, M = [g], s
        if cur:
            out.append((cur, M))
        return out

    def rows(self, groups: torch.Tensor, M: int, live: torch.Tensor | None = None) -> torch.Tensor:
        """[B, M]: the pair rows of the given groups, each group padded to M with the zero
        row (a group where ``live`` is False: all the zero row)."""
        dev = groups.device
        j = torch.arange(M, device=dev)
        valid = j < self.dev_size[groups][:, None]
        if live is not None:
            valid = valid & live[:, None]
        return torch.where(valid, self.dev_ptr[groups][:, None] + j, self.a_up.shape[0] - 1)

    def padded(self, x: torch.Tensor, groups: torch.Tensor, M: int,
               live: torch.Tensor | None = None) -> torch.Tensor:
        """x's rows of the given groups as [B, M, ·], each group zero-padded to M rows (a
        group where ``live`` is False: all zero rows)."""
        return x[self.rows(groups, M, live)]


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

    def _operands(self, pairs: _Pairs):
        return (pairs.a_up, pairs.g_up), (pairs.a_dn, pairs.g_dn)

    def choose_ghost(self, module, A, G, policy, num_units):
        self._policy = policy  # read by _sq, right after, in the same backward step
        return True  # norms below (ghost or instantiated per chunk), the sum by contraction

    # ------------------------------------------------------------------ own forward
    def install(self, module, engine):
        """Run ``module``'s forward as `_own_forward` does while ``engine`` records (the
        engine calls this once per module; the returned handle's ``remove`` undoes it)."""
        own = _OWN.get(module)
        if own is None:
            prev = module.__dict__.get("forward")
            if getattr(prev, "__func__", None) is _own_forward:  # copied from an installed one
                prev = None
            own = _OWN[module] = _Own(self, prev)
            # bound to the module: a copy of it (copy.deepcopy) is bound to the copy, which
            # has no `_Own` and runs its class's forward
            module.__dict__["forward"] = types.MethodType(_own_forward, module)
        own.engines.add(engine)
        return _Uninstall(module, own, engine)

    def on_record(self, module, rec: Record) -> None:
        """The engine recorded a call: if this rule's forward ran it, the call's output
        gradients wait for the inner gradient (``calls.Call.late``)."""
        own = _OWN.get(module)
        late = own.pending() if own is not None and own.pending is not None else None
        out = rec.call.outputs[0] if rec.call.outputs else None
        if late is not None and out is not None and out.data_ptr() == late.out_ptr and out.dim() == 2:
            rec.call.late = late

    def _forward(self, module, X, idx, w, engines):
        """(Σ w·down(act(up(x))) per token, its `_Late`), or None for a routing this forward
        does not take (an expert index out of range: transformers' own kernel runs)."""
        N, K = idx.shape
        E = module.down_proj.shape[0]
        dev = X.device
        upn, upb, dnn, dnb = self._names(module)
        if any(getattr(module, n).dtype != X.dtype for n in (upn, upb, dnn, dnb) if n):
            return None
        e = idx.reshape(-1).long()
        if bool(((e < 0) | (e >= E)).any()):
            return None
        tok = torch.arange(N, device=dev).repeat_interleave(K)
        order = torch.argsort(e * N + tok)  # by expert, then token (the keys are distinct)
        t, es = tok[order], e[order]
        n_e = torch.bincount(es, minlength=E).tolist()  # one sync
        ptr = [0]
        for n in n_e:
            ptr.append(ptr[-1] + n)
        W1, W2 = getattr(module, upn), getattr(module, dnn)
        B1 = getattr(module, upb) if upb else None
        B2 = getattr(module, dnb) if dnb else None
        flip = not module.is_transposed
        wt = w.reshape(-1)[order]
        late = _Late(t, es, wt.detach(), n_e)
        a = X[t]
        refs = tuple(weakref.ref(e) for e in engines)
        y1 = _Inner.apply(late, _experts_mm(a, W1, B1, ptr, flip, refs), *(e._anchor for e in engines))
        h = module._apply_gate(y1) if module.has_gate else module.act_fn(y1)
        o = _experts_mm(h, W2, B2, ptr, flip, refs)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=dev)
        # as transformers' kernels: each pair's output times its weight, a token's K summed
        out = (o * wt.unsqueeze(-1))[inv].view(N, K, o.shape[-1]).sum(dim=1).to(X.dtype)
        late.a, late.h, late.out_ptr = a.detach(), h.detach(), out.data_ptr()
        return out, late

    def _pairs(self, rec: Record, units: Units) -> _Pairs:
        cache = rec.cache
        if cache is not None and cache[0] is rec.G:
            return cache[1]
        pairs = self._build(rec, units)
        rec.cache = (rec.G, pairs)
        return pairs

    def _build(self, rec: Record, units: Units) -> _Pairs:
        module, call = rec.module, rec.call
        name = type(module).__name__
        if call.late is not None and call.late.g1 is not None:
            return self._captured(rec, units, call.late, name)
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
        dev = X.device
        tok = torch.arange(N, device=dev).repeat_interleave(K)
        e = idx.reshape(-1).long()
        u, key, cnt, n_e = _groups(units, call.per_row, tok, e, E)
        U = units.num_units
        sel = torch.argsort(key, stable=True)[:sum(n_e)]
        t, wt = tok[sel], w.reshape(-1)[sel]
        upn, upb, dnn, dnb = self._names(module)
        W1, W2 = getattr(module, upn).detach(), getattr(module, dnn).detach()
        B1 = getattr(module, upb).detach() if upb else None
        B2 = getattr(module, dnb).detach() if dnb else None
        tr = module.is_transposed
        ptr = [0]
        for n in n_e:
            ptr.append(ptr[-1] + n)

        P = ptr[-1]

        def gathered(x, scale=None):
            """x's rows of the pairs, [P + 1, ·], the last row zero (padding points there);
            times each pair's weight where ``scale`` is given."""
            out = x.new_empty((P + 1, x.shape[1]))
            torch.index_select(x.detach(), 0, t, out=out[:P])
            if scale is not None:
                out[:P].mul_(scale[:, None].to(out.dtype))
            out[P].zero_()
            return out

        def per_expert(v, W, B, flip):
            """v's rows of each expert times its matrix (W[e] used as x @ W[e], or its
            transpose when ``flip``), plus its bias: [P + 1, ·], the last row zero."""
            out = v.new_empty((P + 1, W.shape[1] if flip else W.shape[2]), dtype=torch.result_type(v, W))
            _mm_into(v.detach(), W, B, ptr, flip, out[:P])
            out[P].zero_()
            return out

        a = gathered(X)
        y1 = per_expert(a, W1, B1, not tr).requires_grad_(True)
        with torch.enable_grad():
            h = module._apply_gate(y1) if module.has_gate else module.act_fn(y1)
        g2 = gathered(Gout, wt)
        dh = per_expert(g2, W2, None, tr)  # its zero row makes g1's zero
        g1, = torch.autograd.grad(h, y1, dh.to(h.dtype))
        h = h.detach()
        h[-1] = 0  # act(0) need not be 0
        if module not in self._probed:
            o = per_expert(h, W2, B2, not tr)[:-1]
            out = torch.zeros_like(Gout, dtype=F64).index_add_(0, t, (o * wt[:, None].to(o.dtype)).to(F64))
            k = call.per_row
            real = ((units.unit_of_row.repeat_interleave(k) if k > 1 else units.unit_of_row) >= 0)[:, None]
            self._probe(module, out * real, rec.call.outputs[0] * real, name)
        pairs = _Pairs(a, g1.detach(), h, g2, u[sel], e[sel], n_e, cnt, U)
        _same_as_before(rec.call, pairs, name)
        return pairs

    def _captured(self, rec: Record, units: Units, late, name: str) -> _Pairs:
        """The pairs from what this rule's forward kept (``_forward``) and the gradient at
        the up projection's output (``_Inner``): sorted by (expert, unit) from the
        forward's (expert, token) order — usually already so: no copy but the zero row —
        the padding rows' pairs dropped."""
        call, module = rec.call, rec.module
        Gout = rec.G[0] if isinstance(rec.G, tuple) else rec.G
        u, key, cnt, n_e = _groups(units, call.per_row, late.t, late.e, module.down_proj.shape[0])
        U = units.num_units
        P = sum(n_e)
        ordered = P == key.numel() and bool((key[1:] >= key[:-1]).all())
        sel = None if ordered else torch.argsort(key, stable=True)[:P]

        def rows(x):  # the pairs' rows, and the zero row
            x = x if sel is None else x[sel]
            return torch.cat([x, x.new_zeros((1, x.shape[1]))])

        g_dn = Gout[late.t] * late.w[:, None].to(Gout.dtype)  # as the recompute's g2
        pairs = _Pairs(rows(late.a), rows(late.g1), rows(late.h), rows(g_dn),
                       u if sel is None else u[sel], late.e if sel is None else late.e[sel], n_e, cnt, U)
        _same_as_before(call, pairs, name)
        return pairs

    def _probe(self, module, got, want, name):
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        diff = float((got - want.to(F64)).abs().max()) if want.numel() else 0.0
        if not diff <= PROBE_REL * scale + 1e-30:
            raise UnsupportedModuleError(
                f"module {name}: its output is not Σ_k w·down_e(act(up_e(x))) as transformers' "
                f"experts compute it (recomputed {diff:.3g} away, at scale {scale:.3g}), so the "
                f"experts rule cannot clip it; freeze it or register a rule")
        self._probed.add(module)

    # ------------------------------------------------------------------ bounds of the sum
    def _tensor_cores(self, x, y) -> bool:
        return lowp.tile_norms(x, y)

    def _sum_bound(self, pairs: _Pairs, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        """(u, n): every product of ``_weight_sum`` within γ_n(u) of its exact value."""
        if self._tensor_cores(x, y):
            rows = max(Counter(pairs.g_e).values(), default=1)
            M = max(pairs.g_size or [1])  # the count grows with the rows and their length
            return lowp.row_scaled_bound(x.new_empty((rows, M, 0)), y.new_empty((rows, M, 0)))
        if lowp.result_dtype(x, y) == F64:
            return U64, -(-max(pairs.n_e + [1]) // TILE) * TILE + 2
        return U32, TILE + FLUSH + 3

    # ------------------------------------------------------------------ norms
    def sq_norms_ghost(self, rec, units):
        pairs = self._pairs(rec, units)
        module = rec.module
        U = units.num_units
        dev = units.unit_of_row.device
        lin = _LINEARS[module.is_transposed]
        acc: dict[str, dict] = {}
        for (stub, names), (A, G) in zip(self._linears(module), self._operands(pairs)):
            if not (stub.weight.requires_grad or (stub.bias is not None and stub.bias.requires_grad)):
                continue
            clip = self._sum_bound(pairs, *lin._clipped_operands(A, G))
            bias_clip = max(pairs.n_e + [1]) + 2
            chunks = pairs.chunks(A.shape[-1] + G.shape[-1])
            # every chunk's groups from one host-to-device copy (slices of it: views)
            order = torch.tensor([g for groups, _ in chunks for g in groups], dtype=torch.long, device=dev)
            # each pair's row norms once, gathered per chunk (a chunk's padding rows are the
            # zero row, of norm exactly 0): not one reduction per chunk over its padding too
            norms_A, norms_G = lowp.row_norms(A), lowp.row_norms(G)
            o0 = 0
            for groups, M in chunks:
                gi, o0 = order[o0:o0 + len(groups)], o0 + len(groups)
                idx = pairs.rows(gi, M)
                A3, G3 = A[idx], G[idx]
                B = len(groups)
                sub = Units(torch.arange(B, device=dev), B, True)  # each group its own unit
                sub.know_norms(A3, norms_A[idx])
                sub.know_norms(G3, norms_G[idx])
                r = Record(stub, lin, A3)
                r.G = G3
                if lin.choose_ghost(stub, A3, G3, self._policy, B):
                    got = lin.sq_norms_ghost(r, sub, clip=clip, bias_clip=bias_clip)
                else:
                    got = {n: sq for n, (_, sq) in lin.instantiate(r, sub, clip=clip, bias_clip=bias_clip).items()}
                to_unit = pairs.dev_unit[gi]
                for which, sq in got.items():
                    a = acc.setdefault(names[which], {k: torch.zeros(U, dtype=F64, device=dev)
                                                      for k in ("value", "err", "dev", "mag")} | {"rel": 0.0})
                    for kk in ("value", "err", "dev", "mag"):
                        a[kk].index_add_(0, to_unit, getattr(sq, kk).to(F64))
                    a["rel"] = max(a["rel"], _max_rel(sq))
        out = {}
        n = len(pairs.n_e) + 2  # the float64 sums over a unit's groups (at most one per expert)
        for pname in self.params(module):
            a = acc.get(pname)
            if a is None:  # no pair reached this parameter: every unit's gradient is 0
                z = torch.zeros(U, dtype=F64, device=dev)
                out[pname] = Sq(z, z.clone(), z.clone(), z.clone(), z.clone())
                continue
            value = a["value"]
            err = up(a["err"], n) + gamma(n, U64) * up(value.abs(), n)
            out[pname] = Sq(value, err, up(a["dev"], n), torch.full_like(value, a["rel"]), up(a["mag"], n))
        return out

    # ------------------------------------------------------------------ clipped sum
    def clipped_ghost(self, rec, row_factors):
        units = rec.call.units
        pairs = self._pairs(rec, units)
        module = rec.module
        unit_f = torch.zeros(units.num_units, dtype=row_factors.dtype, device=row_factors.device)
        keep = units.unit_of_row >= 0
        unit_f[units.unit_of_row[keep]] = row_factors[keep]
        f = unit_f[pairs.unit]  # each pair's factor
        live = f != 0  # a zero factor adds exactly 0: the pair is zeroed (NaN cannot reach the sum)
        lin = _LINEARS[module.is_transposed]
        want = set(self.params(module))
        out: dict[str, torch.Tensor] = {}
        for (_, names), (A, G) in zip(self._linears(module), self._operands(pairs)):
            if names["weight"] in want:
                x, y = lin._clipped_operands(A, G)
                out[names["weight"]] = self._weight_sum(pairs, x, y, f, live, unit_f)
            if names["bias"] in want:
                s = torch.where(live[:, None], G[:-1].to(F64) * f.to(F64)[:, None], 0)
                b = torch.zeros((len(pairs.n_e), G.shape[-1]), dtype=F64, device=G.device)
                out[names["bias"]] = b.index_add_(0, pairs.expert, s)
        for pname in want:
            if pname not in out:
                p = getattr(module, pname)
                out[pname] = torch.zeros(p.shape, dtype=F64 if p.dtype == F64 else torch.float32,
                                         device=p.device)
        return out

    def _weight_sum(self, pairs, x, y, f, live, unit_f) -> torch.Tensor:
        """[E, a, b]: Σ over expert e's pairs of f_s·x_sᵀy_s, for every expert (module
        docstring; within ``_sum_bound``)."""
        E, a, b = len(pairs.n_e), x.shape[-1], y.shape[-1]
        dt = lowp.result_dtype(x, y)
        if self._tensor_cores(x, y):
            out = torch.zeros((E, a, b), dtype=torch.float32, device=x.device)
            # An expert's groups are consecutive (sorted by expert, then unit); their sizes
            # are known on the host: no host sync per expert. A group whose unit's factor
            # is 0 reads the zero row (0·NaN would be NaN) and adds exactly 0.
            start = 0
            for ex in range(E):
                stop = start
                while stop < len(pairs.g_e) and pairs.g_e[stop] == ex:
                    stop += 1
                if stop == start:
                    continue
                groups = torch.arange(start, stop, device=x.device)
                M = max(pairs.g_size[start:stop])
                start = stop
                fg = unit_f[pairs.dev_unit[groups]]
                live_g = fg != 0
                out[ex] = lowp.row_scaled_tn(pairs.padded(x, groups, M, live_g),
                                             pairs.padded(y, groups, M, live_g), fg)
            return out
        x, y = x[:-1], y[:-1]
        if not bool(live.all()):  # zero-factor pairs zeroed once (0·NaN would be NaN)
            x, y = torch.where(live[:, None], x, 0), torch.where(live[:, None], y, 0)
        f = torch.where(live, f, 0).to(dt)[:, None]
        # [E, a, b] in dt, each expert's slice written once (an expert without pairs zeroed):
        # no fill of the whole result first
        out = torch.empty((E, a, b), dtype=dt, device=x.device)
        scale_x = a <= b  # scale the smaller operand (a copy of it)
        with lowp.exact_fp32(x.device):
            for ex in range(E):
                lo, hi = pairs.e_ptr[ex], pairs.e_ptr[ex + 1]
                if hi == lo:
                    out[ex].zero_()
                    continue
                # an expert of at most FLUSH tiles has one float32 partial sum: its float64
                # sum is that value exactly, and its cast back too, so the tiles are added
                # in the expert's slice of the result itself (the same roundings)
                one = hi - lo <= TILE * FLUSH
                acc32 = acc64 = part = None
                for i, p0 in enumerate(range(lo, hi, TILE)):
                    p1 = min(hi, p0 + TILE)
                    xs, ys = x[p0:p1].to(dt), y[p0:p1].to(dt)
                    if scale_x:
                        xs = xs * f[p0:p1]
                    else:
                        ys = ys * f[p0:p1]
                    if acc32 is None:
                        acc32 = torch.mm(xs.t(), ys, out=out[ex]) if one else xs.t() @ ys
                    else:
                        part = torch.mm(xs.t(), ys, out=part) if part is not None else xs.t() @ ys
                        acc32.add_(part)
                    if not one and ((i + 1) % FLUSH == 0 or p1 == hi):
                        acc64 = acc32.to(F64) if acc64 is None else acc64.add_(acc32.to(F64))
                        acc32 = None
                if acc64 is not None:
                    out[ex] = acc64  # the one cast to dt
        return out

    def exact(self, rec, name, rows, start, stop):
        units = rec.call.units
        pairs = self._pairs(rec, units)
        u = int(units.unit_of_row[rows[0]])
        p = getattr(rec.module, name)
        out = torch.zeros((stop - start, *p.shape[1:]), dtype=F64, device=p.device)
        (_, n_up), (_, n_dn) = self._linears(rec.module)
        tr = rec.module.is_transposed
        for names, (A, G) in zip((n_up, n_dn), self._operands(pairs)):
            for which, pname in names.items():
                if pname != name:
                    continue
                for ex in range(start, stop):
                    g = pairs.group_of.get((ex, u))
                    if g is None:
                        continue
                    Ar, Gr = A[pairs.g_ptr[g]:pairs.g_ptr[g + 1]], G[pairs.g_ptr[g]:pairs.g_ptr[g + 1]]
                    if which == "bias":
                        out[ex - start] = Gr.to(F64).sum(0)
                    elif tr:  # weight [in, out]
                        out[ex - start] = lowp.bmm(Ar.t().unsqueeze(0), Gr.unsqueeze(0))[0]
                    else:
                        out[ex - start] = lowp.bmm(Gr.t().unsqueeze(0), Ar.unsqueeze(0))[0]
        return out


def _groups(units: Units, per_row: int, tok: torch.Tensor, e: torch.Tensor, E: int):
    """(u, key, cnt, n_e) of pairs (token ``tok``, expert ``e``): each pair's unit, its sort
    key (expert, then unit; E·U for a pair dropped: a padding row's, or an expert out of
    range), the groups' sizes by key and the pairs kept per expert, on the host (one sync)."""
    uop = units.unit_of_row.repeat_interleave(per_row) if per_row > 1 else units.unit_of_row
    u, U = uop[tok], units.num_units
    key = torch.where((u >= 0) & (e >= 0) & (e < E), e * U + u, E * U)
    cnt = torch.bincount(key, minlength=E * U + 1)[: E * U].tolist()
    return u, key, cnt, [sum(cnt[ex * U:(ex + 1) * U]) for ex in range(E)]


def _mm_into(v, W, B, ptr, flip, out):
    """out's rows of each expert e (consecutive, ``ptr``) = v's times W[e] (its transpose
    when ``flip``) plus B[e]: one GEMM per expert, written in place; returns out."""
    for ex in range(len(ptr) - 1):
        lo, hi = ptr[ex], ptr[ex + 1]
        if hi > lo:
            torch.mm(v[lo:hi], W[ex].t() if flip else W[ex], out=out[lo:hi])
            if B is not None:
                out[lo:hi].add_(B[ex])
    return out


def _experts_mm(v, W, B, ptr, flip, engines=()):
    """[P, ·]: each expert's rows of v (consecutive, ``ptr``) times its matrix (W[e], or its
    transpose when ``flip``), plus its bias (`_ExpertsLinear`; ``engines``: weak references
    to the clippers that recorded the call)."""
    return _ExpertsLinear.apply(v, W, B, tuple(ptr), flip, engines)


def _dp_backward(engines) -> bool:
    """Whether one of ``engines`` (weak references) is running its backward: it asks for
    its anchor's gradient only (``GhostClipper.backward``), never a parameter's."""
    return any(e is not None and not e._recording for e in (r() for r in engines))


class _ExpertsLinear(torch.autograd.Function):
    """y[p] = v[p] @ W[e(p)] (+ B[e(p)]) for rows sorted by expert: one GEMM per expert
    into its rows of y (no concatenation); the backward forms only the gradients asked for
    (the engine's DP backward asks for v's only; a non-private backward also for W and B,
    one GEMM per expert into its slice: no full-size gradient per expert)."""

    @staticmethod
    def forward(ctx, v, W, B, ptr, flip, engines):
        ctx.save_for_backward(v, W)
        ctx.ptr, ctx.flip, ctx.has_b, ctx.engines = ptr, flip, B is not None, engines
        return _mm_into(v, W, B, ptr, flip, v.new_empty((v.shape[0], W.shape[1] if flip else W.shape[2])))

    @staticmethod
    def backward(ctx, g):
        v, W = ctx.saved_tensors
        ptr, flip = ctx.ptr, ctx.flip
        need_v, need_w, need_b = ctx.needs_input_grad[:3]
        if _dp_backward(ctx.engines):  # the engine's backward: no weight-gradient GEMMs
            need_w = need_b = False
        gv = torch.zeros_like(v) if need_v else None
        gw = torch.zeros_like(W) if need_w else None
        gb = g.new_zeros((W.shape[0], g.shape[1])) if need_b and ctx.has_b else None
        for ex in range(len(ptr) - 1):
            lo, hi = ptr[ex], ptr[ex + 1]
            if hi == lo:
                continue
            ge, ve = g[lo:hi], v[lo:hi]
            if gv is not None:
                torch.mm(ge, W[ex] if flip else W[ex].t(), out=gv[lo:hi])
            if gw is not None:
                torch.mm(ge.t(), ve, out=gw[ex]) if flip else torch.mm(ve.t(), ge, out=gw[ex])
            if gb is not None:
                gb[ex] = ge.sum(0)
        return gv, gw, gb, None, None, None


class _Late:
    """One call of the rule's own forward: its pairs in the forward's order (expert, then
    token: ``t`` the tokens, ``e`` the experts, ``w`` the weights, ``n_e`` per expert),
    what it kept (``a``: the up projection's input rows, ``h``: the activation), and
    ``g1``, the gradient at the up projection's output, once the backward reaches it. The
    call's taps ``hold`` its output gradients until then; ``fire`` hands them to their
    clippers, which then find ``g1`` here (``ExpertsRule._captured``)."""

    __slots__ = ("t", "e", "w", "n_e", "a", "h", "g1", "held", "out_ptr", "__weakref__")

    def __init__(self, t, e, w, n_e):
        self.t, self.e, self.w, self.n_e = t, e, w, n_e
        self.a = self.h = self.g1 = None
        self.held: list = []
        self.out_ptr = None

    def hold(self, clipper, rec, gs) -> None:
        self.held.append((clipper, rec, gs))

    def fire(self, g1: torch.Tensor) -> None:
        self.g1 = g1.detach()
        held, self.held = self.held, []
        for clipper, rec, gs in held:
            clipper._on_output_grad(rec, gs)
        if held and all(c._keep_G and r.cache is not None for c, r, _ in held):
            # book-keeping keeps the pairs (copies, with the zero row) until the clipped
            # sum: these are not needed again (two-pass rebuilds them in its second pass,
            # from tensors its retained graph keeps anyway)
            self.a = self.h = self.g1 = None


class _Inner(torch.autograd.Function):
    """Identity on the up projection's output; its backward hands that gradient to the
    call's `_Late`. The recording engines' anchors are inputs, so it runs in each of their
    backward passes (as the engine's taps do)."""

    @staticmethod
    def forward(ctx, late, y, *anchors):
        ctx.late, ctx.n = late, len(anchors)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        ctx.late.fire(g)
        return (None, g, *([None] * ctx.n))


class _Own:
    """An experts module's own-forward state (``ExpertsRule.install``): the rule, the
    module's previous instance ``forward`` if any, the engines that installed it, and the
    last call's `_Late` (a weak reference)."""

    def __init__(self, rule, prev):
        self.rule, self.prev = rule, prev
        self.engines: weakref.WeakSet = weakref.WeakSet()
        self.pending = None

    def original(self, module, *args, **kwargs):
        return self.prev(*args, **kwargs) if self.prev is not None else type(module).forward(module, *args, **kwargs)


# module -> its `_Own` (weak keys: a module's state goes with it; a copy has none)
_OWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _own_forward(module, *args, **kwargs):
    """The forward installed on an experts module: the rule's (``ExpertsRule._forward``)
    while an engine records on the CPU, the module's own otherwise. The first call is
    checked against the module's own forward (``PROBE_REL``): a block whose mathematics
    differ is refused, naming it."""
    own = _OWN.get(module)
    if own is None:  # a copy of an installed module
        return type(module).forward(module, *args, **kwargs)
    engines = [e for e in own.engines if e._recording and e._anchor is not None]
    ts = tensors_in(args, kwargs)
    if not (engines and OWN_FORWARD and torch.is_grad_enabled() and not rerunning()
            and not torch._C._are_functorch_transforms_active() and len(ts) == 3
            and ts[0].dim() == 2 and ts[1].dim() == 2 and ts[1].shape == ts[2].shape
            and not ts[1].is_floating_point() and lowp.on_cpu(ts[0])):
        return own.original(module, *args, **kwargs)
    got = None if _autocast(ts[0]) else own.rule._forward(module, *ts, engines)
    if got is None:
        return own.original(module, *args, **kwargs)
    out, late = got
    if module not in own.rule._probed:
        with torch.no_grad():
            want = own.original(module, *args, **kwargs)
        own.rule._probe(module, out.detach().to(F64), want, type(module).__name__)
    own.pending = weakref.ref(late)
    return out


def _autocast(x: torch.Tensor) -> bool:
    """Whether autocast is on for x's device (transformers' kernel then runs)."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch < 2.4
        return torch.is_autocast_enabled() if x.is_cuda else torch.is_autocast_cpu_enabled()


class _Uninstall:
    """``remove``: the engine's handle on its module's `_Own` (the module's forward is
    restored when no engine uses it any more)."""

    def __init__(self, module, own, engine):
        self.module, self.own, self.engine = weakref.ref(module), own, weakref.ref(engine)

    def remove(self) -> None:
        engine, module = self.engine(), self.module()
        if engine is not None:
            self.own.engines.discard(engine)
        if module is not None and not self.own.engines and _OWN.get(module) is self.own:
            del _OWN[module]
            if self.own.prev is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = self.own.prev


def _same_as_before(call, pairs: _Pairs, name: str) -> None:
    """Two-pass recomputes the parts in pass 2 (G is fingerprinted by the engine): what
    this rule derived from G (the up projection's output gradient, the activation) must be
    pass 1's bit for bit, or what is added would not be what was measured."""
    fp = fingerprint((pairs.g_up[:-1], pairs.a_dn[:-1]))
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
