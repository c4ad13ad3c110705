"""Slow, exact per-unit gradients: the yardstick every clipping path is checked against.

Two independent routes are offered:

* :func:`per_unit_gradients_autograd` differentiates the per-unit losses of an already
  computed forward pass, one vector-Jacobian product per unit, batched with
  ``is_grads_batched`` (autograd's vmap over the backward pass).
* :func:`per_unit_gradients_func` re-runs the model row by row under ``torch.func``
  (``functional_call`` + ``vmap(grad)``), never looking at the batch's autograd graph.

Both return, for every trainable parameter, a tensor of shape ``[U, *param.shape]``: the
gradient of unit ``u``'s loss, which is the sum of the gradients of its rows (DESIGN, invariant `unit-is-a-unit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def unit_ids(row_units: torch.Tensor | None, num_rows: int, device=None) -> tuple[torch.Tensor, int]:
    """Normalize ``row_units`` (``None`` means row r is unit r) and return it with the unit count.

    Units are numbered 0..U-1 within the batch; -1 marks a padding row. Every id in
    0..U-1 need not appear, but ids must be >= -1.
    """
    if row_units is None:
        return torch.arange(num_rows, device=device), num_rows
    row_units = torch.as_tensor(row_units, device=device).long()
    if row_units.ndim != 1 or row_units.numel() != num_rows:
        raise ValueError(
            f"row_units must have one entry per batch row: got shape {tuple(row_units.shape)} "
            f"for {num_rows} rows"
        )
    lo, hi = torch.stack([row_units.min(), row_units.max()]).tolist() if row_units.numel() else (-1, -1)
    if lo < -1:  # min and max read together: one host sync
        raise ValueError("row_units entries must be a unit id >= 0, or -1 for a padding row")
    num_units = hi + 1
    return row_units, max(num_units, 0)


def unit_losses_from_rows(row_losses: torch.Tensor, row_units: torch.Tensor, num_units: int):
    """Sum the rows' loss entries into their units; padding rows (-1) are dropped."""
    keep = row_units >= 0
    out = row_losses.new_zeros(num_units)
    return out.index_add(0, row_units[keep], row_losses[keep])


def per_unit_gradients_autograd(
    row_losses: torch.Tensor,
    params: Sequence[torch.Tensor],
    row_units: torch.Tensor | None = None,
    retain_graph: bool = False,
) -> list[torch.Tensor]:
    """Per-unit gradients from per-row losses that still carry their autograd graph.

    A unit whose gradient is NaN/inf can make the *other* units' gradients here non-finite
    too (the batched VJP backpropagates a 0 through its rows: 0·inf = NaN); those units then
    also get clip factor 0 in :func:`clipped_sum` (nothing non-finite is ever added, but the
    step loses them). The hook-based engine keeps rows apart and loses only the bad unit."""
    row_units, num_units = unit_ids(row_units, row_losses.shape[0], row_losses.device)
    if num_units == 0:
        return [p.new_zeros((0, *p.shape)) for p in params]
    losses = unit_losses_from_rows(row_losses, row_units, num_units)
    eye = torch.eye(num_units, dtype=losses.dtype, device=losses.device)
    grads = torch.autograd.grad(
        losses,
        list(params),
        grad_outputs=eye,
        is_grads_batched=True,
        retain_graph=retain_graph,
        allow_unused=True,
    )
    return [
        g if g is not None else p.new_zeros((num_units, *p.shape)) for g, p in zip(grads, params)
    ]


def per_unit_gradients_func(
    model: nn.Module,
    row_loss_fn: Callable[[Callable[..., object], dict[str, torch.Tensor]], torch.Tensor],
    batch: dict[str, torch.Tensor],
    row_units: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-unit gradients by ``torch.func``: each row is run alone, then rows are summed per unit.

    ``row_loss_fn(call, one_row_batch)`` must return the scalar loss entry of that row (its
    share of the unit's normalized loss), where ``call(**model_kwargs)`` runs the model with
    the parameters being differentiated. Returns ``{param_name: [U, *shape]}`` for every
    trainable parameter.
    """
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def one_row(p, row):
        row = {k: v.unsqueeze(0) for k, v in row.items()}

        def call(**kwargs):
            state = {**p, **frozen, **buffers}
            return functional_call(model, state, args=(), kwargs=kwargs, strict=False)

        return row_loss_fn(call, row)

    num_rows = next(iter(batch.values())).shape[0]
    row_units, num_units = unit_ids(row_units, num_rows)
    per_row = vmap(grad(one_row), in_dims=(None, 0), randomness="different")(params, batch)
    keep = row_units >= 0
    out = {}
    for n, g in per_row.items():
        acc = g.new_zeros((num_units, *g.shape[1:]))
        out[n] = acc.index_add(0, row_units[keep], g[keep])
    return out


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """min(1, C/‖g_u‖), exactly 1 for a zero gradient (nothing to scale), and exactly 0
    for a non-finite norm (NaN or inf): such a unit contributes nothing. The caller must
    also zero that unit's gradient before summing (0·NaN is NaN)."""
    finite = torch.isfinite(norms)
    safe = torch.where(finite & (norms > 0), norms, torch.ones_like(norms))
    f = torch.where(norms > max_grad_norm, max_grad_norm / safe, torch.ones_like(norms))
    return torch.where(finite, f, torch.zeros_like(f))


def clipped_sum(
    per_unit: Sequence[torch.Tensor], max_grad_norm: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Flat clipping over all parameters: returns (Σ_u c_u·g_u, per-unit norms), with the
    norms taken in float64 and the factors from the norm used for clipping (never below
    ‖g_u‖ nor below what is added for u: ``norms`` module docstring; the per-unit
    gradients are the vectors measured and scaled). Sums in float32, or float64 for
    float64 gradients."""
    from llmdp.clipping import norms as nb
    from llmdp.clipping.lowp import U64, gamma

    if not per_unit or per_unit[0].shape[0] == 0:
        return [g.new_zeros(g.shape[1:]) for g in per_unit], torch.zeros(0)
    acc_dtype = torch.float64 if per_unit[0].dtype == torch.float64 else torch.float32
    U = per_unit[0].shape[0]
    u_out = nb.roundoff(acc_dtype)
    value = err = dsq = None
    for g in per_unit:
        zero = torch.zeros(U, dtype=torch.float64, device=g.device)
        sq = nb.sq_of_instantiated(g, zero, 0.0, gamma(U + 2, u_out))
        d = nb.deviation(sq, u_out)
        value = sq.value if value is None else value + sq.value
        err = sq.err if err is None else err + sq.err
        dsq = d * d if dsq is None else dsq + d * d
    k = len(per_unit) + 2
    nu = nb.used_norm(value, nb.up(err, k) + gamma(k, U64) * nb.up(value.abs(), k), nb.up(dsq, 2 * k))
    factors = nb.factors(nu, value, max_grad_norm).to(acc_dtype)
    # Sums in float32 or wider; a unit with factor 0 (non-finite) is zeroed, not multiplied.
    zero = factors == 0
    sums = [torch.einsum("u,u...->...", factors,
                         torch.where(zero.view(-1, *([1] * (g.dim() - 1))), 0, g.to(acc_dtype)))
            for g in per_unit]
    return sums, nb.round_up_to(nu, acc_dtype)
