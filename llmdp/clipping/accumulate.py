"""The clipped sum: each recorded call's part of it, and where it is added.

`contribution` forms Σ_u c_u·g_u for one call's parameters once the clipping factors are
known: contracted from the call's input A and output gradient G where the layer's rule can
(the factors applied to float32 partial sums, ``lowp``), else from its per-unit gradients
upcast to float32. Rows whose factor is 0 (padding, units with a non-finite gradient) are
zeroed first where they hold a non-finite value, so that they add exactly nothing.

DESIGN, invariant `precision-never-widens`: the clipped sum is accumulated in float32 or wider. It is added to ``p.grad``
only when the parameter is float32 or wider (`add_to_grad`); half-precision trainable
parameters, and parameters sharded by FSDP2 (DTensors, whose ``.grad`` the engine never
asks autograd for), need ``grad_buffers`` (`check_buffers`, `add_to_buffers`): one plain,
full-size floating tensor per trainable parameter name (``llmdp.train.strategy.Strategy.grad_sinks``),
which the caller reduces once per logical step."""

from __future__ import annotations

import torch

from llmdp.clipping.norms import Record, Units, exact_slices

__all__ = ["contribution", "check_buffers", "add_to_buffers", "add_to_grad"]


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def check_buffers(named, grad_buffers, engine: str, sharded: bool):
    """``grad_buffers`` checked against the trainable parameters ``named`` ((name,
    parameter) pairs): a dict, or None when there are none (refused for sharded ones)."""
    if grad_buffers is None:
        if sharded:
            raise ValueError(
                "the trainable parameters are sharded (FSDP2 DTensors): pass grad_buffers="
                "{name: full-size tensor} so the clipped sum has somewhere to accumulate "
                "(llmdp.train.strategy.Strategy.grad_sinks)"
            )
        return None
    if sharded and engine != "ghost":
        raise ValueError(
            f"clipping engine {engine!r} cannot run on sharded (FSDP) parameters; "
            "use engine='ghost' (privacy.clipping) or scaling.strategy='replicated'"
        )
    names = [n for n, _ in named]
    missing = [n for n in names if n not in grad_buffers]
    extra = [n for n in grad_buffers if n not in set(names)]
    if missing or extra:
        raise ValueError(f"grad_buffers must have one tensor per trainable parameter: "
                         f"missing {missing[:5]}, unknown {extra[:5]}")
    for n, p in named:
        b = grad_buffers[n]
        if _is_dtensor(b) or tuple(b.shape) != tuple(p.shape) or not b.is_floating_point():
            raise ValueError(
                f"grad_buffers[{n!r}] must be a plain floating tensor of the parameter's "
                f"full shape {tuple(p.shape)}, got {type(b).__name__} {tuple(b.shape)}"
            )
    return dict(grad_buffers)


def add_to_buffers(buffers, name_of: dict[int, str], contributions) -> None:
    """Add (stable parameter id, clipped-sum part) pairs into the caller's buffers."""
    with torch.no_grad():
        for pid, g in contributions:
            buf = buffers[name_of[pid]]
            buf.add_(g.to(buf.dtype))


def add_to_grad(name_of: dict[int, str], contributions) -> None:
    """Add (parameter, clipped-sum part) pairs to ``p.grad``: float32 or wider only."""
    for p, g in contributions:
        if p.dtype.itemsize < 4 or not p.dtype.is_floating_point:
            # A bf16/fp16 .grad would round the clipped sum (each unit's share of it
            # could exceed C): DESIGN, invariant `precision-never-widens`. Sum into float32 buffers instead.
            raise TypeError(
                f"parameter '{name_of.get(id(p), '?')}' is {p.dtype}: the clipped sum "
                "must be accumulated in float32 or wider; pass grad_buffers="
                "llmdp.train.strategy.Strategy.grad_sinks(model) (float32 sinks)"
            )
        g = g.to(p.dtype)
        if p.grad is None:
            # the engine's parts are fresh tensors of its own contractions: the first one
            # becomes .grad as it is (as autograd's own does), a view of anything is copied
            p.grad = g if g._base is None and g.is_contiguous() else g.clone()
        else:
            p.grad.add_(g)


def contribution(rec: Record, units: Units, factors: torch.Tensor, row_factors: torch.Tensor,
                 zero_rows: torch.Tensor | None, ghost: bool,
                 sinks: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Σ_u c_u·g_u for this call's parameters, in float32 or wider, from A and G (or
    the kept per-unit gradients); rows with a zero factor contribute exactly zero.
    ``factors``: c_u per unit; ``row_factors``: c_{u(r)} per row; ``zero_rows``: the
    rows whose factor is 0 (None: none); ``ghost``: contract A and G where the rule
    can (the call's norm was a ghost norm, or pass 2 brought G again); ``sinks``: the
    call's parameters' sinks, by name, which a rule that ``adds_to_sinks`` may add its
    part to itself (then left out of what is returned)."""
    rule, mask = rec.rule, zero_rows
    exact = rec.exact.tolist() if rec.exact is not None else []
    if exact:
        # Units recomputed exactly (norms module docstring, 4): their part comes from their
        # float64 gradient below, not from the contraction (their factor is 0 there).
        unit_factors = factors
        factors = factors.clone()
        factors[torch.tensor(exact, device=factors.device)] = 0
        row_factors = units.row_factors(factors)
    out = _contract(rec, units, factors, row_factors, mask, ghost, None if exact else sinks)
    for u in exact:
        c = float(unit_factors[u])
        if c == 0:
            continue
        rows = units.rows_of(u)
        for n, part in out.items():
            if rec.exact_shared and n in rec.exact_shared:
                continue  # summed over the parameter's uses and added by the engine
            for j0, j1, g in exact_slices(rule, rec, n, rows):
                part[j0:j1] += (g * c).to(part.dtype)
    return out


def _contract(rec: Record, units: Units, factors: torch.Tensor, row_factors: torch.Tensor,
              mask: torch.Tensor | None, ghost: bool, sinks=None) -> dict[str, torch.Tensor]:
    rule = rec.rule
    if rule.has_clipped_ghost and ghost:
        # A and G stay as the model produced them (bf16 too): the rule contracts them
        # with exact products and float32 sums, the factors applied in float32 (lowp).
        G, A = rec.G, rec.A
        if mask is not None and not isinstance(G, tuple):  # a whole call's rule masks its own
            # A zero factor times a finite value adds exactly 0, so only non-finite
            # values in the zero-factor rows need zeroing (0·NaN = NaN). G is the
            # largest tensor of the step (the LM head's [R, T, V]): it is copied only
            # when one of those rows of it is not finite. The engine reads that for all
            # calls at once (``dirty_flags``); checked here otherwise (two host syncs).
            dirty_g, dirty_a = rec.dirty if rec.dirty is not None else _dirty(G, A, mask)
            if dirty_g:
                G = G.masked_fill(_row_mask(mask, G), 0)
            if dirty_a:
                A = A.masked_fill(_row_mask(mask, A), 0)
        rec.G, rec.A = G, A
        if sinks and getattr(rule, "adds_to_sinks", False):
            return rule.clipped_ghost(rec, row_factors, sinks)
        return rule.clipped_ghost(rec, row_factors)
    per_unit = rec.per_unit if rec.per_unit is not None else rule.per_unit(rec, units)
    out = {}
    for n, g in per_unit.items():
        up = _compute_dtype(g.dtype)
        g = g if up is None else g.to(up)
        f = _factors_as(factors, g.dtype)
        # mask is None: no row has a zero factor, so no unit has (no sync to find out);
        # else the zero-factor units' gradients are zeroed (0·NaN would be NaN): one pass
        # over g, which the product reads anyway, instead of host syncs to find out
        if mask is not None:
            g = torch.where(_row_mask(f == 0, g), 0, g)
        # Σ_u c_u·h_u: one dot product of U terms per entry, in any order (its bound is
        # the rule's rel, γ_{U+2}): one matrix-vector product
        o = out[n] = g.new_empty(g.shape[1:])
        torch.mv(g.reshape(g.shape[0], -1).t(), f, out=o.view(-1))
    return out


_CAST: list = [None, {}]  # the last step's factors and their casts (one per dtype)


def _factors_as(factors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``factors`` in ``dtype``, cast once per step for all the calls that read it."""
    if _CAST[0] is not factors:
        _CAST[0], _CAST[1] = factors, {}
    f = _CAST[1].get(dtype)
    if f is None:
        f = _CAST[1][dtype] = factors.to(dtype)
    return f


def _dirty(G: torch.Tensor, A: torch.Tensor, mask: torch.Tensor) -> tuple[bool, bool]:
    """Whether a zero-factor row of G, and of A (when A has G's rows), is not finite."""
    g, a = dirty_flags(G, A, mask.nonzero().view(-1))
    return bool(g), bool(a)


def dirty_flags(G: torch.Tensor, A: torch.Tensor | None, rows: torch.Tensor,
                fp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Device flags: a non-finite value in G's (A's) rows ``rows`` (the zero-factor rows).
    With G dropped (two-pass, between its passes), from pass 1's fingerprint ``fp`` of G
    instead: a row with a NaN or an infinity has a non-finite Σ G², which the fingerprint
    maps to a negative sentinel (``norms.fingerprint``); a finite row whose Σ G² overflows
    is flagged too, and zeroing a zero-factor row changes nothing, so that costs nothing."""
    if G is not None:
        g = ~torch.isfinite(G.index_select(0, rows)).all()
    else:
        g = (fp.index_select(0, rows)[:, 0] < 0).any()
    R = G.shape[0] if G is not None else fp.shape[0]
    if A is not None and A.is_floating_point() and A.shape[0] == R:
        a = ~torch.isfinite(A.index_select(0, rows)).all()
    else:
        a = torch.zeros((), dtype=torch.bool, device=rows.device)
    return g, a


def _compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """Half-precision activations/gradients are upcast to float32 before the clipped sum is
    contracted (clipped sums are formed and accumulated in float32 at least)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else None


def _row_mask(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A [R] boolean mask shaped to broadcast over ``t`` [R, ...]."""
    return mask.view(-1, *([1] * (t.dim() - 1)))
