"""The bound arithmetic of all calls of a backward as one computation (issue 50, item 2).

After the backward, every (call, parameter) pair has its `Sq` (value, err, dev, rel per unit;
``norms`` module docstring). The engine needs, from them, (a) each call's fallback flags
(which units' bound is more than ``norms.FALLBACK`` of the call's own norm, and whether a
value + bound is negative: a bug) and (b) the norm used for clipping, ν_u, over all
parameters. Formed call by call and parameter by parameter, that is ~60 small operations
per call, thousands per step, each a GPU launch whose host time nothing hides. Here the
same arithmetic runs on [pairs, U] stacks: tens of operations per backward.

The same numbers. Every elementwise step is the one ``norms.deviation``,
``norms.used_norm`` and ``norms.worth_recomputing`` take, with the per-pair (γ of the sink)
and per-call (γ_k of the call's k = parameters + 2 roundings) constants as vectors: IEEE
operations on the same operands give the same bits. The sums (a call's parameters; all
parameters of the model) are running sums along the stacked axis (``_running_sum``), the
order the engine summed them in before; on the CPU that is bit for bit the same result.
On CUDA the scan may add in another order: the bound does not depend on it (a float64 sum
of n terms in *any* order is within γ_n·Σ|terms| of the exact one, and the err of a sum
carries γ_K·Σ|value| with K ≥ the number of terms; ``norms`` module docstring, 1 and 3), so
ν stays an upper bound on the true norm either way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from llmdp.clipping import lowp
from llmdp.clipping import norms as nb
from llmdp.clipping.gram import PendingGram
from llmdp.clipping.lowp import U64, gamma
from llmdp.clipping.norms import F64, Sq


def _running_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ along ``dim``, added in order (x_0 + x_1 + …, as Python's ``sum`` adds a list)."""
    return x.cumsum(dim).select(dim, -1)


@dataclass
class Stack:
    """The `Sq` of N (call, parameter) pairs as [N, U] float64 tensors, and each pair's share
    of δ_P, ``d`` = ``norms.deviation`` (the call's relative roundings and the sink's add)."""

    value: torch.Tensor
    err: torch.Tensor
    d: torch.Tensor

    @staticmethod
    def of(sqs: list[Sq], sink_us: list[float]) -> Stack:
        """The stacks of ``sqs``, their deferred bounds (`Sq`) formed here for all pairs at
        once: each row the operations `Sq`'s fields would take, on the same operands."""
        _form_pending(sqs)
        value = _values(sqs)
        err = _rows(value, [s._err for s in sqs], lambda s: s.err, sqs)
        dev = _dev_rows(value, sqs)
        rels = [s._rel for s in sqs]
        gs = [gamma(1, su) for su in sink_us]
        if not any(isinstance(r, torch.Tensor) for r in rels):
            # constants only: the same float64 operations on the host, in the same order
            rel = const([float(r) + g + float(r) * g for r, g in zip(rels, gs)], value.device)[:, None]
        else:
            rel = _rows(None, rels, lambda s: s.rel, sqs)
            g = const(gs, value.device)[:, None]
            rel = rel + g + rel * g  # norms.deviation, with the sink's γ per pair
        norm = torch.sqrt(torch.clamp(value + err, min=0))
        return Stack(value, err, nb.up(dev + rel * (norm + dev), 6))


def _form_pending(sqs: list[Sq]) -> None:
    """The CPU's deferred row norms (`lowp.LazyRowNorms`: of the Gram-path norms and of the
    N_u not formed yet), all at once, then the Gram-path (V, E) (`gram.PendingGram`), those of
    one shape at once."""
    grams = [s for s in sqs if s.pending_gram is not None]
    lazy = [n for s in grams for n in (s._value.na, s._value.ng)]
    lazy += [n for s in sqs if isinstance(s._mag, nb.PendingMag) for n in (s._mag.na, s._mag.ng)]
    lowp.LazyRowNorms.form_all(lazy)
    if grams:
        for s, (v, e) in zip(grams, PendingGram.form_all([s._value for s in grams])):
            s._value, s._err = v, e


def _values(sqs: list[Sq]) -> torch.Tensor:
    """[N, U] values; the rows deferred as a root r (``Sq``) squared here for all at once,
    r·r as ``Sq.value`` would form it."""
    roots = [i for i, s in enumerate(sqs) if s._value is None]
    if not roots:
        return torch.stack([s.value for s in sqs])
    pending = [i for i in roots if isinstance(sqs[i]._root, nb.PendingRoot)]
    if pending:  # norms of instantiated calls not taken yet: one reduction per shape
        for i, r in zip(pending, nb.PendingRoot.form_all([sqs[i]._root for i in pending])):
            sqs[i]._root = r
    if len(roots) == len(sqs):
        return torch.stack([s._root for s in sqs]).square()
    out = torch.stack([s._root if s._value is None else s._value for s in sqs])
    idx = const(roots, out.device, torch.long)
    return out.index_copy_(0, idx, out.index_select(0, idx).square())


def _rows(base: torch.Tensor | None, forms: list, field, sqs: list[Sq]) -> torch.Tensor:
    """[N, U] (or [N, 1] when every row is one constant) of one `Sq` field: a deferred
    constant c is ``base``·c (``base`` None: c itself), a tensor is stacked as it is."""
    lazy = [i for i, f in enumerate(forms) if not isinstance(f, torch.Tensor)]
    if not lazy:
        return torch.stack(forms)
    dev = sqs[0].value.device
    c = const([0.0 if isinstance(f, torch.Tensor) else float(f) for f in forms], dev)[:, None]
    out = c if base is None else base * c
    if len(lazy) == len(forms):
        return out
    if base is None:
        out = out.expand(len(forms), sqs[0].value.shape[0]).clone()
    fixed = [i for i, f in enumerate(forms) if isinstance(f, torch.Tensor)]
    return out.index_copy_(0, const(fixed, dev, torch.long), torch.stack([field(sqs[i]) for i in fixed]))


def _dev_rows(value: torch.Tensor, sqs: list[Sq]) -> torch.Tensor:
    """[N, U] dev: rows deferred as factors of N_u are (N_u·f₀)·f₁… of the stacked N_u
    (each `Sq`'s ``mag``, itself deferred or not; a row with fewer factors takes exact
    ·1.0s), zero rows are 0, tensor rows stacked as they are."""
    dev = value.device
    forms = [s._dev for s in sqs]
    by_mag = [i for i, f in enumerate(forms) if isinstance(f, tuple)]
    tensors = [i for i, f in enumerate(forms) if isinstance(f, torch.Tensor)]
    zeros = [i for i, f in enumerate(forms) if not isinstance(f, (tuple, torch.Tensor))]
    if not by_mag:
        out = torch.zeros_like(value) if not tensors else None
    else:
        mags, mag_f = [], []
        for i, (s, f) in enumerate(zip(sqs, forms)):
            if not isinstance(f, tuple):
                mags.append(value[i])  # a placeholder row, replaced below
                mag_f.append(1.0)
            elif s._mag is not None and s._mag_f is not None:
                mags.append(s._mag)
                mag_f.append(s._mag_f)
            else:
                mags.append(s.mag)
                mag_f.append(None)
        pending = [i for i, m in enumerate(mags) if isinstance(m, nb.PendingMag)]
        if pending:  # N_u of instantiated calls: one batched dot for all (norms.PendingMag)
            for i, m in zip(pending, nb.PendingMag.form_all([mags[i] for i in pending])):
                mags[i] = m
        out = torch.stack(mags)
        if any(f is not None for f in mag_f):
            out = out * const([1.0 if f is None else f for f in mag_f], dev)[:, None]
        width = max(len(forms[i]) for i in by_mag)
        for j in range(width):
            fj = [f[j] if isinstance(f, tuple) and j < len(f) else 1.0 for f in forms]
            out = out * const(fj, dev)[:, None]
    if tensors:
        rows = torch.stack([sqs[i].dev for i in tensors])
        if out is None and not zeros:
            return rows
        if out is None:
            out = torch.zeros_like(value)
        out = out.index_copy_(0, const(tensors, dev, torch.long), rows)
    if zeros and by_mag:
        out = out.index_fill_(0, const(zeros, dev, torch.long), 0.0)
    return out


_CONSTS: OrderedDict = OrderedDict()
_CONSTS_KEPT = 256


def const(values: list, device: torch.device, dtype: torch.dtype = F64) -> torch.Tensor:
    """A constant vector on ``device``, kept: a step's bound constants are the same as the
    last step's, and a host-to-device copy (on CUDA, from pageable memory) waits for the
    device — a host sync per constant if made anew each step."""
    key = (tuple(values), str(device), dtype)
    t = _CONSTS.get(key)
    if t is None:
        t = torch.tensor(values, dtype=dtype).to(device)
        _CONSTS[key] = t
        if len(_CONSTS) > _CONSTS_KEPT:
            _CONSTS.popitem(last=False)
    else:
        _CONSTS.move_to_end(key)
    return t


def call_flags(stack: Stack, groups: list[list[int]],
               threshold: float = nb.FALLBACK) -> tuple[torch.Tensor, torch.Tensor]:
    """For calls whose pairs are ``groups`` (indices into ``stack``): (bad, neg), [calls, U]
    bool. ``bad``: the units whose bound is more than ``threshold`` of the call's own norm
    (``norms.worth_recomputing``); ``neg``: a finite value + bound below 0 (a bug). The
    call's norm is ``norms.used_norm`` of its parameters' sums, with k = parameters + 2
    roundings, as the engine formed it for one call (``GhostClipper._fallback_mask``)."""
    dev = stack.value.device
    width = max(len(g) for g in groups)
    if width == 1 and [g[0] for g in groups] == list(range(stack.value.shape[0])):
        # one parameter per call, in order (LoRA's adapters, Linears without a bias): the
        # sums over a call's parameters are the rows themselves
        value, err, d = stack.value, stack.err, stack.d
        dsq = d * d
    else:
        pad = stack.value.shape[0]  # a zero row: adding it changes no sum
        idx = const([i for g in groups for i in g + [pad] * (width - len(g))], dev, torch.long)
        idx = idx.view(len(groups), width)

        def gathered(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(1, x.shape[1])])[idx]  # [calls, width, U]

        value = _running_sum(gathered(stack.value), 1)
        err = _running_sum(gathered(stack.err), 1)
        d = gathered(stack.d)
        dsq = _running_sum(d * d, 1)
    ks = [len(g) + 2 for g in groups]
    up_k = const([1.0 + gamma(k + 1, U64) for k in ks], dev)[:, None]
    g_k = const([gamma(k, U64) for k in ks], dev)[:, None]
    err = err * up_k + g_k * (value.abs() * up_k)
    s = value + err
    nu = nb.used_norm(value, err, dsq * up_k, check=False, total=s)
    return nb.worth_recomputing(value, err, dsq, nu, threshold), nb.negative(value, err, s)


def total(value: torch.Tensor, err: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(ν, S, neg) over all parameters from their [P, U] (value, err, δ_P) (``norms`` module
    docstring, 3): S = Σ_P value, E = Σ_P err↑ + γ_K·Σ_P |value|↑, K = P + 2, and
    ν = √(S + E)↑ + √(Σ_P δ_P²)↑; ``neg`` [U] flags a finite S + E below 0 (a bug: the
    caller raises it)."""
    K = value.shape[0] + 2
    s = _running_sum(value, 0)
    e = nb.up(_running_sum(err, 0), K)
    e = e + gamma(K, U64) * nb.up(_running_sum(value.abs(), 0), K)
    dsq = nb.up(_running_sum(d * d, 0), 2 * K)
    return nb.used_norm(s, e, dsq, check=False), s, nb.negative(s, e)
