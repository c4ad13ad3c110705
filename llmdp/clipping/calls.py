"""Whole calls of modules the generic rule clips (``rules/functional.py``): what the engine
keeps of such a call, and the tap that hands it the output gradients of every differentiable
output at once.

A module without a specific rule (a router returning logits, scores and indices; fused
3-D experts called with the routing; an attention block with trainable sinks; a norm or a
position embedding of its own kind) is re-run per unit by its rule, so the engine keeps the
call as it was made: every positional and keyword argument (tensors detached), the
differentiable outputs (detached: the probe compares them), and how the rows of the call's
first tensor input map to the rows of the batch:

* ``per_row = 1``: its leading dimension is the batch's rows (R);
* ``per_row = k``: it is R·k positions, the row-major flattening of a contiguous [R, k, ...]
  tensor (``x.view(-1, d)`` of the hidden states, as MoE blocks do before routing), so
  position i belongs to row i // k. Checked on the tensor's storage (its base has R rows,
  the same elements, contiguous, at the same address), never guessed from shapes alone: a
  position attributed to the wrong unit would let one unit's data into another's clipped
  gradient.

Anything else (an input that is not such a view, an output container other than a tensor,
tuple or list) is refused when the call is recorded, naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmdp.clipping.audit import UnsupportedModuleError

__all__ = ["Call", "TapMany", "folded", "record_call", "rerun", "rerunning", "tensors_in"]

_RERUN = [0]  # > 0 while a rule re-runs a module with plain autograd: the hooks stand aside


class rerun:
    """Context of a rule's re-run of a module (``rules/functional.SubtreeRule``)."""

    def __enter__(self):
        _RERUN[0] += 1

    def __exit__(self, *exc):
        _RERUN[0] -= 1


def rerunning() -> bool:
    return _RERUN[0] > 0


@dataclass
class Call:
    """One recorded call (see the module docstring)."""

    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]  # the differentiable outputs, detached, in order
    diff: list[int]  # their places in the call's output (0 for a tensor output)
    per_row: int  # positions of the first tensor input per batch row
    units: Any = None  # the batch's `Units`, set by the engine when the output gradient arrives
    derived: Any = None  # a rule's fingerprint of what it derived from G (two-pass: pass 2 checks it)
    # A rule's own forward that hands the output gradients on later in the same backward
    # (``hold``/``fire``: rules/experts.py, which waits for the gradient inside the call)
    late: Any = None


class TapMany(torch.autograd.Function):
    """Identity on a call's differentiable outputs; its backward hands all their gradients
    (zeros for an output the loss does not use) to the clipper at once."""

    @staticmethod
    def forward(ctx, anchor, clipper, rec, *xs):
        ctx.clipper, ctx.rec = clipper, rec
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        late = ctx.rec.call.late if ctx.rec.call is not None else None
        if late is not None:  # handed to the clipper when the call's inner gradient arrives
            late.hold(ctx.clipper, ctx.rec, tuple(gs))
        else:
            ctx.clipper._on_output_grad(ctx.rec, tuple(gs))
        return (None, None, None, *gs)


def _detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(v) for v in x) if type(x) in (tuple, list) else x
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def tensors_in(*xs: Any) -> list[torch.Tensor]:
    """Every tensor in ``xs`` (nested tuples, lists and dicts), in order."""
    out: list[torch.Tensor] = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            out += tensors_in(*x)
        elif isinstance(x, dict):
            out += tensors_in(*x.values())
    return out


def folded(x: torch.Tensor, rows: int | None) -> int:
    """k > 1 when ``x`` is the row-major flattening of a [rows, k, ...] tensor, else 1:
    proven on its storage (a view of a contiguous [rows, k, ...] base), or by its autograd
    graph (`_flattened_by_graph`)."""
    if rows is None or x.dim() == 0 or x.shape[0] <= rows or x.shape[0] % rows:
        return 1
    k = x.shape[0] // rows
    base = x._base
    if (base is not None and base.dim() >= 1 and base.shape[0] == rows and base.numel() == x.numel()
            and base.is_contiguous() and x.is_contiguous() and base.data_ptr() == x.data_ptr()):
        return k
    return k if rows != k and _flattened_by_graph(x, rows, k) else 1


# Autograd nodes that keep positions apart (position i of the output is computed from
# position i of each input): elementwise ops, a layer norm over the last dimensions, the
# engine's taps, a matmul with the positions on the left (addmm's mat1: input 1 only).
_POSITIONWISE = frozenset({
    "GeluBackward0", "SiluBackward0", "ReluBackward0", "TanhBackward0", "SigmoidBackward0",
    "NativeDropoutBackward0", "CloneBackward0", "ToCopyBackward0", "NativeLayerNormBackward0",
    "AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "_TapBackward",
    "TapManyBackward"})
_FLATTEN = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0",
                      "ReshapeBackward0"})
_GRAPH_NODES = 64  # the walk gives up (no fold) beyond this many nodes


def _is_weight(node) -> bool:
    """``node`` is a parameter, possibly transposed, cast or viewed (no data on the way)."""
    for _ in range(8):
        if node is None:
            return False
        if hasattr(node, "variable"):
            return True
        if node.name() not in ("TBackward0", "ToCopyBackward0", "PermuteBackward0", "ViewBackward0"):
            return False
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
    return False


def _flattened_by_graph(x: torch.Tensor, rows: int, k: int) -> bool:
    """Every path back from ``x`` through position-wise nodes ends at a flattening (view or
    reshape) of a tensor of logical shape [rows, k, ...] (so position i is row i // k), or
    at a leaf (a parameter, broadcast over positions). ``rows != k`` is required by the
    caller: a [k, rows, ...] (time-major) tensor then cannot have that shape. Any other node
    on the way (an index, a matmul with the positions on the right, a transpose) fails."""
    todo, seen, found = [x.grad_fn], set(), False
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if len(seen) > _GRAPH_NODES:
            return False
        name = node.name()
        if hasattr(node, "variable"):  # a leaf
            continue
        if name in _FLATTEN:
            sizes = tuple(getattr(node, "_saved_self_sym_sizes", ()) or ())
            if len(sizes) < 2 or sizes[0] != rows or sizes[1] != k or x.numel() % (rows * k):
                return False
            found = True
            continue
        nxt = [n for n, _ in node.next_functions]
        # x @ W (+ b): the positions on the left, a parameter (possibly transposed or cast)
        # on the right; W @ x would mix positions, so the right operand must be a weight.
        # A frozen weight has no node (None): a constant on the right is position-wise too.
        if name == "AddmmBackward0" and (nxt[2] is None or _is_weight(nxt[2])):  # bias, mat1, mat2
            todo.extend((nxt[0], nxt[1]))
            continue
        if name == "MmBackward0" and (nxt[1] is None or _is_weight(nxt[1])):  # mat1, mat2
            todo.append(nxt[0])
            continue
        if name not in _POSITIONWISE:
            return False
        todo.extend(nxt)
    return found


def _per_row(x: torch.Tensor, rows: int | None, name: str) -> int:
    """How many leading positions of ``x`` one batch row has (module docstring)."""
    if rows is None or x.dim() == 0:
        raise UnsupportedModuleError(
            f"module {name}: its input has no batch dimension the engine can read (shape "
            f"{tuple(x.shape)}), so its per-unit gradients are not defined; freeze it or "
            f"register a rule with llmdp.clipping.register_rule")
    n = x.shape[0]
    if n == rows:
        return 1
    if folded(x, rows) > 1:
        return n // rows
    raise UnsupportedModuleError(
        f"module {name}: its input's leading dimension ({n}) is neither the batch's rows "
        f"({rows}) nor a row-major flattening of them, so the engine cannot tell which unit "
        f"each position belongs to; freeze it or register a rule with "
        f"llmdp.clipping.register_rule")


def record_call(module, name: str, args: tuple, kwargs: dict, output, rows: int | None):
    """(the differentiable outputs, how to rebuild ``output`` with their tapped views, the
    `Call`), or None when no output is differentiable."""
    if isinstance(output, torch.Tensor):
        outs, rebuild = [output], (lambda new: new[0])
    elif type(output) in (tuple, list):
        kind = type(output)
        outs, rebuild = list(output), (lambda new: kind(new))
    else:
        raise UnsupportedModuleError(
            f"module {name} ({type(module).__name__}) returns {type(output).__name__}; the "
            f"generic clipping rule handles a tensor, a tuple or a list of outputs; freeze it or "
            f"register a rule with llmdp.clipping.register_rule")
    diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not diff:
        return None
    inputs = [t for t in tensors_in(args, kwargs) if t.dim() >= 1]
    if not inputs:
        raise UnsupportedModuleError(f"module {name} ({type(module).__name__}) was called "
                                     f"without a tensor input; its per-unit gradients are not defined")
    # The first input that is the batch's rows, or a checked flattening of them (the hidden
    # states, wherever the call passes them); the error names the first input otherwise.
    per_row = None
    for t in inputs:
        try:
            per_row = _per_row(t, rows, f"{name} ({type(module).__name__})")
            break
        except UnsupportedModuleError:
            continue
    if per_row is None:
        _per_row(inputs[0], rows, f"{name} ({type(module).__name__})")
    call = Call(_detach(args), _detach(kwargs), [outs[i].detach() for i in diff], diff, per_row)

    def rebuilt(tapped):
        new = list(outs)
        for i, t in zip(diff, tapped):
            new[i] = t
        return rebuild(new)

    return [outs[i] for i in diff], rebuilt, call
