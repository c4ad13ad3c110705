"""What the clipping engine refuses, and how it finds it (DESIGN, invariant `no-silent-fallbacks`, invariant `precision-never-widens`).

Nothing is clipped silently wrong: each case below raises `UnsupportedModuleError` naming
the module or parameter and what to do instead.

* `check_model`: a module that mixes the examples of a batch (BatchNorm and friends): a
  unit's gradient is not its own, so DP-SGD cannot clip it. (A trainable module without a
  clipping rule is refused when the engine installs its hooks.) Also a module that draws
  fresh random numbers on every call in training mode (`random_modules`: Mixtral's and
  PhiMoE's router jitter, PhiMoE's sampled routing): the engine re-runs modules per unit
  and a re-run cannot reproduce the draw, and the jitter's in-place multiply would edit
  the engine's tapped activations. Checked when the clipper is built and on every
  forward (`check_random`), since ``model.train()`` may come later.
* `UseAudit`: a trainable parameter used where the hooks cannot see it (a functional
  ``F.linear(x, module.weight)`` outside the module, or the tensor read by another
  module). Each recorded call marks the autograd nodes between its output and its input,
  and the parameter tensors it used, as its own; a walk of the loss's autograd graph then
  finds any edge into a parameter, or into a call's nodes, from outside that call.
* `check_coverage`: a hooked module that took part in no recorded forward/backward of the
  batch (reentrant activation checkpointing hides modules from the hooks).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["UnsupportedModuleError", "check_model", "check_random", "random_modules", "UseAudit",
           "check_coverage"]


class UnsupportedModuleError(ValueError):
    """A trainable module the clipping engine cannot clip per unit (DESIGN, invariant `no-silent-fallbacks`)."""


# Modules whose output for one example depends on other examples of the batch: their
# per-example gradients are not defined, so DP-SGD with them is refused, not approximated.
_CROSS_EXAMPLE = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def check_model(model: nn.Module) -> None:
    """Refuse modules that mix examples of a batch (BatchNorm and friends), by path and type."""
    for name, module in model.named_modules():
        if isinstance(module, _CROSS_EXAMPLE) and (
            module.training or any(p.requires_grad for p in module.parameters(recurse=False))
        ):
            raise UnsupportedModuleError(
                f"module '{name}' ({type(module).__name__}) mixes examples of a batch, so a "
                "unit's gradient is not its own; DP-SGD cannot clip it. Replace it with "
                "GroupNorm/LayerNorm, or freeze it and put it in eval mode."
            )
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModuleError("the model has no trainable parameter")
    check_random(random_modules(model))


# Attributes of transformers' MoE blocks and routers that, when > 0, multiply the hidden
# states by fresh uniform noise on every call in training mode, and the config field.
_JITTER = (("jitter_noise", "router_jitter_noise"), ("input_jitter_noise", "input_jitter_noise"))
# Routers that sample their routing at random in training mode (PhiMoE's sparsemixer).
_SAMPLED_ROUTERS = ("PhimoeTopKRouter",)


def random_modules(model: nn.Module) -> list[tuple[str, nn.Module, str, str, bool]]:
    """(path, module, what it draws, the fix, only when trainable) of each module that can
    draw fresh random numbers on every call in training mode (`check_random` refuses them
    in training; a sampled router only while it is trained: frozen, its routing is an
    input of the experts the engine records)."""
    out = []
    for name, module in model.named_modules():
        for attr, field in _JITTER:
            value = getattr(module, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                out.append((name, module, f"multiplies its input by fresh random noise on every "
                            f"call in training mode ({field}={value:g})",
                            f"set {field}: 0 in the model's config (config.json)", False))
        if type(module).__name__ in _SAMPLED_ROUTERS:
            out.append((name, module, "samples its routing at random on every call in training "
                        "mode (sparsemixer)",
                        "freeze the routers (requires_grad=False, or LoRA adapters that leave "
                        "out the router: model.lora.target_modules without it)", True))
    return out


def check_random(found) -> None:
    """Refuse the first of ``found`` (`random_modules`) that is in training mode: the
    engine re-runs modules on each unit's rows (rules/functional.py, rules/experts.py) and
    a re-run cannot reproduce a random draw, so the unit's gradient could not be formed
    exactly (an in-place jitter would also edit the activations the engine taps)."""
    for name, module, what, fix, if_trained in found:
        if module.training and (not if_trained or any(
                p.requires_grad for p in module.parameters(recurse=False))):
            raise UnsupportedModuleError(
                f"module '{name}' ({type(module).__name__}) {what}: the clipping engine "
                f"re-runs modules on each unit's rows and a re-run cannot reproduce a random "
                f"draw, so per-unit gradients cannot be formed exactly. Fix: {fix}")


#: autograd node type -> whether its nodes are leaves (``AccumulateGrad``: a ``variable``
#: attribute): read once per type, not by a failing ``hasattr`` per node of every walk
_LEAF: dict[type, bool] = {}


def _is_leaf(node) -> bool:
    leaf = _LEAF.get(type(node))
    if leaf is None:
        leaf = _LEAF[type(node)] = hasattr(node, "variable")
    return leaf


class UseAudit:
    """The autograd nodes and parameter tensors of each recorded call of one micro-batch,
    to find uses of trainable parameters that the hooks did not record."""

    def __init__(self):
        # The autograd nodes of each recorded call (node -> record indices) and the
        # parameter tensors each call used: to find uses the hooks did not see.
        self.owned: dict[object, set[int]] = {}
        self.rec_params: list[set[int]] = []
        # (module, parameter name) -> the tensor the call used (FSDP2: the unsharded one).
        self.fwd_params: dict[tuple[nn.Module, str], torch.Tensor] = {}

    def clear(self) -> None:
        self.owned.clear()
        self.rec_params.clear()
        self.fwd_params.clear()

    def record(self, module: nn.Module, pnames, output, inp, index: int) -> None:
        """Recorded call ``index`` of ``module``: the parameter tensors it used (by name)
        and the autograd nodes between its ``output`` and its input ``inp``."""
        used = set()
        for pname in pnames:
            t = module.get_parameter(pname)
            self.fwd_params[(module, pname)] = t
            used.add(id(t))
        self.rec_params.append(used)
        self.own_subgraph(output, inp, index)

    def own_subgraph(self, output, inp, index: int) -> None:
        """Mark the autograd nodes between this call's output and its input as the call's
        own: an edge into them (or into its parameters) from anywhere else is a use of the
        parameters that the hooks did not record (checked in ``check``). ``output`` and
        ``inp`` may be lists (a call with several outputs, or several tensor inputs: the
        walk stops at every input)."""
        inputs = inp if isinstance(inp, list) else [inp]
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        outputs = output if isinstance(output, list) else [output]
        todo = [o.grad_fn for o in outputs if o.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in stop or _is_leaf(node):
                continue
            mine = self.owned.setdefault(node, set())
            if index in mine:
                continue
            mine.add(index)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def check(self, total: torch.Tensor, names: dict[int, str], tap) -> None:
        """Walk the loss's autograd graph; refuse a trainable parameter reached by an op
        that no recorded call owns (e.g. ``F.linear(x, module.weight)`` outside the
        module): its gradient would be trained without being in its unit's norm (two-pass)
        or silently dropped (book-keeping). DESIGN, invariant `precision-never-widens`. ``names``: tensor id -> parameter
        name; ``tap``: the autograd node class (or classes) of the engine's taps."""
        if total.grad_fn is None:
            return
        bad: set[str] = set()
        seen = {total.grad_fn}
        todo = [total.grad_fn]
        while todo:
            node = todo.pop()
            src = self.owned.get(node)
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if _is_leaf(nxt):  # a leaf: a parameter (or the anchor, an input)
                    v = id(nxt.variable)
                    if v in names and not (src and any(v in self.rec_params[i] for i in src)):
                        bad.add(names[v])
                    continue
                dst = self.owned.get(nxt)
                if dst is not None and not isinstance(node, tap) and not (src and src & dst):
                    bad.update(self.params_below(nxt, dst, names))
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        if bad:
            raise UnsupportedModuleError(
                f"trainable parameter(s) {sorted(bad)} are used in the forward pass outside a "
                "call of the module that owns them (e.g. a functional F.linear(x, module.weight), "
                "or the tensor read by another module): the clipping engine cannot see that use, "
                "so the unit's gradient would not be clipped as a whole. Call the owning module "
                "instead, freeze the parameter (requires_grad_(False)), or use "
                "privacy.clipping: reference."
            )

    def params_below(self, node, recs: set[int], names: dict[int, str]) -> set[str]:
        """Names of the parameters reached from ``node`` inside the calls ``recs`` own (e.g.
        the weight behind a cast that autocast's cache shares with an outside use)."""
        out, seen, todo = set(), {node}, [node]
        while todo:
            for nxt, _ in todo.pop().next_functions:
                if nxt is None or nxt in seen:
                    continue
                seen.add(nxt)
                if hasattr(nxt, "variable"):
                    if id(nxt.variable) in names:
                        out.add(names[id(nxt.variable)])
                elif self.owned.get(nxt, set()) & recs:
                    todo.append(nxt)
        return out or {names.get(v, "?") for i in recs for v in self.rec_params[i]}


def check_coverage(model: nn.Module, hooked, seen) -> None:
    """Every hooked module (``hooked``: a container of modules) must have been seen with its
    output gradient (``seen``: the records reached): a trainable parameter the engine did not
    see would be trained without being clipped, or not at all (DESIGN, invariant `no-silent-fallbacks`: no silent
    fallback)."""
    reached = {id(r.module) for r in seen}
    if all(id(m) in reached for m in hooked):  # the usual case: no walk of the model's names
        return
    missing = [n for n, m in model.named_modules() if m in hooked and id(m) not in reached]
    if missing:
        raise UnsupportedModuleError(
            f"trainable modules {missing[:5]}{' ...' if len(missing) > 5 else ''} took part "
            "in no recorded forward/backward of this batch. Reentrant activation "
            "checkpointing hides them from the engine: use "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
            "False}); a module the model never calls must be frozen (requires_grad_(False))."
        )
