"""The generic exact rule: any module with trainable parameters of its own and no specific
rule (issue 33: MoE routers and fused 3-D experts, attention sinks, a norm or a position
embedding of a family's own kind, new families).

Each unit's gradient of the module's own parameters is the vector-Jacobian product of the
module's own forward (``torch.func.functional_call``), re-run on that unit's rows alone
(positions, for a call on the flattened tokens: ``calls.py``), with the output gradients
at those rows as cotangents. Every tensor argument whose leading dimension is the call's
positions (or the batch's rows) is cut to the unit's; anything else (weights, a [1, T]
position table, scalars) is passed as it was. The unit's gradient therefore depends on its
own rows only, by construction; it is the exact gradient of the unit's loss when the
module treats rows independently, which the re-run checks for free: the outputs it
computes for the unit must be the outputs the batched call gave at those rows (to a few
ulps of the output's dtype). A module whose outputs differ (it mixes rows: a capacity-
limited router, a batch statistic) is refused, naming it.

The per-unit gradients are instantiated ([U, *shape] per parameter, in the parameter's
dtype): the engine takes their norms in float64 and forms the clipped sum from the same
tensors (``LayerRule.instantiate``), so what is added for a unit is the vector whose norm
was clipped. Cost: one re-run of the module's forward and backward over the batch, in U
pieces — or one piece per unit size: the units with the same number of rows re-run at once
under ``torch.func.vmap`` (``_batched``), each its own re-run, probed at its own scale; a
module vmap cannot run (a custom autograd Function, random numbers) keeps the U pieces;
memory: U copies of the module's parameters (small for routers, norms and sinks;
for experts, U × the experts' size, which a ghost rule for experts would avoid).
"""

from __future__ import annotations

import warnings

import torch

from llmdp.clipping.audit import UnsupportedModuleError
from llmdp.clipping.norms import LayerRule

__all__ = ["FunctionalRule", "PROBE_ULPS", "SubtreeRule"]

PROBE_ULPS = 16  # re-run outputs within 16 ulps (of the output dtype, at its scale) of the batch's
BATCHED = True  # units of one size re-run together under vmap (``FunctionalRule._batched``)


def _batched_ok(rule) -> bool:
    """vmap is torch.func's: the rule's own ``_vjp`` is (the subtree rule's is not)."""
    return BATCHED and type(rule)._vjp is FunctionalRule._vjp


def _cut(x, rows_n: int, pos_n: int, rows: torch.Tensor, pos: torch.Tensor):
    """``x`` (nested) with every tensor of rank >= 2 whose leading dimension is the call's
    positions (or the batch's rows) cut to the unit's."""
    if isinstance(x, torch.Tensor):
        if x.dim() >= 2 and x.shape[0] == pos_n:
            return x.index_select(0, pos)
        if x.dim() >= 2 and x.shape[0] == rows_n:
            return x.index_select(0, rows)
        return x
    if type(x) in (tuple, list):
        return type(x)(_cut(v, rows_n, pos_n, rows, pos) for v in x)
    if isinstance(x, dict):
        return {k: _cut(v, rows_n, pos_n, rows, pos) for k, v in x.items()}
    return x


def _cut_stack(x, by_len, out: bool = False):
    """(x cut for a stack of units, True), or (x, False) where it is passed as it is: the
    first (length, index [n, L]) of ``by_len`` whose length is x's leading dimension gives
    x[index], [n, L, ...] (``_cut``'s tensors of rank >= 2; any rank >= 1 for an output)."""
    if isinstance(x, torch.Tensor) and x.dim() >= (1 if out else 2):
        for n, index in by_len:
            if x.shape[0] == n:
                return x[index], True
    return x, False


def _cut_output(t: torch.Tensor, rows_n: int, pos_n: int, rows, pos, name: str,
                flat=None) -> torch.Tensor:
    """The unit's part of an output (or of its gradient): by the call's positions, by the
    batch's rows, or, for ``flat = (n, index)``, by the row-major flattening of a [rows, T,
    ...] input (``n`` = rows·T positions, ``index`` the unit's)."""
    if t.dim() >= 1 and t.shape[0] == pos_n:
        return t.index_select(0, pos)
    if t.dim() >= 1 and t.shape[0] == rows_n:
        return t.index_select(0, rows)
    if flat is not None and t.dim() >= 1 and t.shape[0] == flat[0]:
        return t.index_select(0, flat[1])
    raise UnsupportedModuleError(
        f"module {name}: an output of shape {tuple(t.shape)} has no batch dimension (rows "
        f"{rows_n}, positions {pos_n}), so its gradient cannot be split per unit; freeze the "
        f"module or register a rule with llmdp.clipping.register_rule")


class FunctionalRule(LayerRule):
    """Per-unit gradients of a module's own parameters by re-running it on each unit's rows
    (module docstring)."""

    wants_call = True  # the engine keeps the whole call and taps every differentiable output

    def per_unit(self, rec, units):
        module, call = rec.module, rec.call
        name = type(module).__name__
        params = {n: module.get_parameter(n).detach() for n in self.params(module)}
        frozen = {n: p.detach() for n, p in module.named_parameters(recurse=False) if not p.requires_grad}
        U = units.num_units
        out = {n: torch.zeros((U, *p.shape), dtype=p.dtype, device=p.device) for n, p in params.items()}
        if not params or U == 0:
            return out
        unit_of_row = units.unit_of_row
        R, k = unit_of_row.numel(), call.per_row
        unit_of_pos = unit_of_row.repeat_interleave(k) if k > 1 else unit_of_row
        G = rec.G if isinstance(rec.G, tuple) else (rec.G,)
        todo = range(U)
        if _batched_ok(self):
            todo = self._batched(module, params, frozen, call, G, units, out, name)
        for u in todo:
            rows = (unit_of_row == u).nonzero().flatten()
            if rows.numel() == 0:
                continue
            pos = (unit_of_pos == u).nonzero().flatten()
            args = _cut(call.args, R, R * k, rows, pos)
            kwargs = _cut(call.kwargs, R, R * k, rows, pos)
            flat = _flat_positions(call.args, R, k, rows)
            cot = tuple(_cut_output(g, R, R * k, rows, pos, name, flat) for g in G)
            want = tuple(_cut_output(o, R, R * k, rows, pos, name, flat) for o in call.outputs)

            try:
                got, grads = self._vjp(module, params, frozen, args, kwargs, call.diff, cot, want, name)
            except UnsupportedModuleError:
                raise
            except Exception as e:  # the module cannot run on one unit's rows
                raise UnsupportedModuleError(
                    f"module {name}: re-running it on one unit's rows failed ({type(e).__name__}: "
                    f"{str(e)[:200]}), so its per-unit gradients cannot be formed; freeze it or "
                    f"register a rule with llmdp.clipping.register_rule") from None
            for n in params:
                out[n][u] = grads[n]
        return out

    def _batched(self, module, params, frozen, call, G, units, out, name) -> list[int]:
        """The units of one size (rows, and so positions) re-run at once: ``torch.func.vmap``
        of the same per-unit VJP over a [n, ...] stack of their cut tensors, each unit's
        slice its own re-run (vmap keeps them apart by construction). Fills ``out`` for those
        units and returns the units left to the loop (all of them where the module cannot
        run under vmap: a custom autograd Function, random numbers, a data-dependent
        shape)."""
        from torch.func import functional_call, vjp, vmap
        from torch.utils._pytree import tree_flatten, tree_unflatten

        unit_of_row = units.unit_of_row
        R, k, U = unit_of_row.numel(), call.per_row, units.num_units
        real = unit_of_row >= 0
        counts = torch.bincount(unit_of_row[real], minlength=U).tolist()  # one sync
        order = torch.argsort(torch.where(real, unit_of_row, U), stable=True)  # rows by unit
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        by_size: dict[int, list[int]] = {}
        for u, c in enumerate(counts):
            if c:
                by_size.setdefault(c, []).append(u)
        diff = call.diff
        first = next((a for a in call.args if isinstance(a, torch.Tensor)), None)  # as _flat_positions
        T = first.shape[1] if first is not None and first.dim() >= 3 and first.shape[0] == R else None
        left: list[int] = []
        for c, us in by_size.items():
            if len(us) < 2:
                left += us
                continue
            n = len(us)
            dev = unit_of_row.device
            idx = torch.tensor([starts[u] for u in us], device=dev)[:, None] + torch.arange(c, device=dev)
            rows = order[idx]  # [n, c], each unit's rows ascending (a stable sort)
            pos = (rows[..., None] * k + torch.arange(k, device=dev)).reshape(n, c * k)
            flat = (rows[..., None] * T + torch.arange(T, device=dev)).reshape(n, c * T) \
                if k == 1 and T is not None and T > 1 else None

            leaves, spec = tree_flatten((call.args, call.kwargs))
            by_len = [(R * k, pos), (R, rows)]  # as _cut: positions first, then rows
            cuts = [_cut_stack(x, by_len) for x in leaves]
            if flat is not None:
                by_len.append((R * T, flat))  # as _cut_output: outputs also by flat positions
            outs = [_cut_stack(t, by_len, out=True) for t in (*G, *call.outputs)]
            if not all(b for _, b in outs):
                left += us  # the loop names the output that has no batch dimension
                continue
            batched = [x for x, b in cuts if b]

            def one(bl, cot, lv=cuts, sp=spec):
                it = iter(bl)
                args, kwargs = tree_unflatten([next(it) if b else x for x, b in lv], sp)

                def f(p):
                    o = functional_call(module, {**p, **frozen}, args, kwargs)
                    o = o if type(o) in (tuple, list) else (o,)
                    return tuple(o[i] for i in diff)

                got, pullback = vjp(f, params)
                return got, pullback(cot)[0]

            cot = tuple(x for x, _ in outs[:len(G)])
            want = tuple(x for x, _ in outs[len(G):])
            try:
                with warnings.catch_warnings():  # an op without a batching rule is looped by
                    warnings.filterwarnings("ignore", message="There is a performance drop")  # vmap
                    got, grads = vmap(one)(batched, cot)
            except UnsupportedModuleError:
                raise
            except Exception:  # not vmappable: the same re-runs one unit at a time
                left += us
                continue
            _probe_stack(got, want, name)
            ui = torch.tensor(us, device=dev)
            for pn in params:
                out[pn][ui] = grads[pn].to(out[pn].dtype)
        return sorted(left)

    def _vjp(self, module, params, frozen, args, kwargs, diff, cot, want, name):
        """(the unit's outputs, its gradients by parameter name): torch.func on the
        module's own forward, the probe between the two."""
        from torch.func import functional_call, vjp

        def f(p):
            o = functional_call(module, {**p, **frozen}, args, kwargs)
            o = o if type(o) in (tuple, list) else (o,)
            return tuple(o[i] for i in diff)

        try:
            got, pullback = vjp(f, params)
        except RuntimeError as e:
            if "setup_context" not in str(e):
                raise
            # A custom autograd.Function that torch.func cannot transform (PhiMoE's
            # sparsemixer): the same re-run with plain autograd.
            return _autograd_vjp(module, list(params), args, kwargs, diff, cot, want, name)
        _probe(got, want, name)
        return got, pullback(cot)[0]


def _autograd_vjp(module, names, args, kwargs, diff, cot, want, name):
    """The unit's re-run with plain autograd on the real module, inside the engine's
    backward (reentrant), the engine's hooks off for the re-run (``calls.rerun``)."""
    from llmdp.clipping.calls import rerun

    ps = [module.get_parameter(n) for n in names]
    with rerun(), torch.enable_grad():
        o = module(*args, **kwargs)
        o = o if type(o) in (tuple, list) else (o,)
        got = tuple(o[i] for i in diff)
        _probe(got, want, name)
        grads = torch.autograd.grad(got, ps, cot, allow_unused=True)
    return got, {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, ps, grads)}


def _flat_positions(args, R: int, k: int, rows: torch.Tensor):
    """A call on the batch's rows whose first tensor argument is [R, T, ...] (T > 1) may
    return outputs over its R·T flattened positions: a router that does ``x.view(-1, d)``
    itself (DeepSeek-V3's and GLM-4-MoE's top-k routers). Such an output is cut as the
    row-major flattening, the only one ``view`` makes; the probe then checks that what the
    unit's rows give alone is the batch's output at exactly those positions. (n, the
    unit's positions), or None."""
    if k != 1:
        return None
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() < 3 or first.shape[0] != R or first.shape[1] < 2:
        return None
    T = first.shape[1]
    index = (rows.unsqueeze(1) * T + torch.arange(T, device=rows.device)).reshape(-1)
    return R * T, index


def _probe(got, want, name: str) -> None:
    """The unit's outputs re-run alone must be the batch's at its rows (module docstring):
    `_probe_stack` of a stack of one."""
    _probe_stack(tuple(a.unsqueeze(0) for a in got), tuple(b.unsqueeze(0) for b in want), name)


def _probe_stack(got, want, name: str) -> None:
    """``_probe`` for each unit of a stack ([n, ...] outputs): each unit's outputs against
    the batch's at its rows, to ``PROBE_ULPS`` at that unit's own scale."""
    for a, b in zip(got, want):
        if a.shape != b.shape:
            raise UnsupportedModuleError(
                f"module {name}: on one unit's rows it returns shape {tuple(a.shape[1:])}, not "
                f"{tuple(b.shape[1:])} as in the batch, so its rows are not independent; freeze it "
                f"or register a rule")
        if not a.is_floating_point():
            if not torch.equal(a, b):
                raise _mixes(name)
            continue
        if not b.numel():
            continue
        a2, b2 = a.detach().reshape(a.shape[0], -1), b.detach().reshape(b.shape[0], -1)
        scale = b2.abs().amax(1).to(torch.float64)
        diff = torch.nan_to_num((a2 - b2).abs(), nan=float("inf")).amax(1).to(torch.float64)
        bad = (diff > PROBE_ULPS * torch.finfo(b.dtype).eps * scale) & torch.isfinite(b2).all(1)
        if bool(bad.any()):
            raise _mixes(name)


def _mixes(name: str) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        f"module {name}: its outputs for one unit's rows differ when they are computed without "
        f"the rest of the batch, so it mixes rows (a batch statistic, a capacity-limited "
        f"router) and a unit's gradient is not its own; DP-SGD cannot clip it. Freeze it, "
        f"or use a variant that treats rows independently")


class SubtreeRule(FunctionalRule):
    """The generic rule for a module whose trainable parameters live in descendants that
    are never called themselves: peft's ``ParamWrapper`` (LoRA on 3-D expert weights,
    ``target_parameters``), whose ``lora_A``/``lora_B`` Linears only hold the factors of a
    weight delta that a parametrization adds to the wrapped module's parameter during the
    wrapper's call. The wrapper's call is re-run per unit with all of its subtree's
    trainable parameters (nested wrappers included: the outermost claims them all), so each
    unit's gradient of the adapters is exact, as for any module of the generic rule. Cost:
    the experts' forward and backward once more, in U pieces; memory: U copies of the
    adapters (small: r·E·(in + out) per wrapped parameter)."""

    claims_subtree = True

    def params(self, module) -> list[str]:
        return [n for n, p in module.named_parameters() if p.requires_grad]

    def _vjp(self, module, params, frozen, args, kwargs, diff, cot, want, name):
        """Plain autograd on the real module (a parametrization swaps tensors in place,
        which torch.func refuses): `_autograd_vjp`."""
        return _autograd_vjp(module, list(params), args, kwargs, diff, cot, want, name)


def is_param_wrapper(module) -> bool:
    return type(module).__name__ == "ParamWrapper" and hasattr(module, "parameter_name") \
        and hasattr(module, "lora_A")
