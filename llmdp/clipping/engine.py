"""Per-unit clipping behind the ``GhostClipper`` contract (DESIGN §4).

``GhostClipper(model, max_grad_norm).backward(row_losses, row_units)`` returns the per-unit
gradient norms before clipping — the norms ν_u used for clipping, never below the true
‖g_u‖ (their rounding bounds added, ``norms`` module docstring) — and *adds*
Σ_u min(1, C/ν_u)·g_u to ``p.grad`` of every trainable parameter, like autograd
accumulation; what it adds for a unit has norm ≤ C.

How (``engine="ghost"``, the default):

1. forward hooks keep each trainable module's input A and wrap its output in a *tap*, an
   identity autograd node that also leads to one dummy leaf;
2. one backward pass, asked only for the dummy leaf's gradient, runs every tap with the
   gradient G at that module's output — autograd never forms the unclipped weight
   gradients (their matmuls are skipped: nothing asks for them);
3. as each G arrives, the layer's rule (``rules/``) computes each unit's squared norm,
   by the ghost identity or from the instantiated per-unit gradient, whichever is
   cheaper for this batch's shapes, in float64 with its rounding bounds; a unit whose
   bound is more than 1 % of its norm is recomputed as its exact float64 gradient
   (``norms`` module docstring, 4; counted in ``last_norm_stats``). Which units, and
   whether a value + bound is negative (a bug, raised), are device flags formed for all
   calls at once and read with one host sync after the backward (``stacked``; the norm
   used is formed the same way): book-keeping keeps its calls' A and G until then (its
   instantiated calls', which it would drop, until a window of about 1/``WINDOWS`` of the
   output gradients is full); two-pass, which drops G, brings it back for the flagged
   calls only, by one more backward (rare);
4. with the norms known, c_u = min(1, C/ν_u) (rounded toward 0), and the clipped sum is formed either
   from what was kept (``mode="book-keeping"``: Σ_r c_{u(r)} G_rᵀA_r per layer, one
   backward in all, but every G is kept until the norms are known) or by a second,
   identical backward (``mode="two-pass"``: G is dropped as soon as its norm is taken;
   pass 2 runs the same backward of the same unscaled loss, so each tap receives the
   same G again, checked bit for bit against a fingerprint kept from pass 1, and forms
   Σ_r c_{u(r)} G_rᵀA_r from it as it arrives). ``mode="auto"`` picks book-keeping when
   what it keeps fits comfortably in free memory.

Precision (DESIGN, invariant `precision-never-widens`). The norms and the clipped sum are contracted from the same A and G,
as the model produced them, with exact products: Gram matrices in float64, per-row
gradients and the clipped sum in float32 (on CUDA's tensor cores for bf16/fp16, with
float32 partial sums that the clipping factor multiplies, never a half-precision operand;
``lowp.py``), in both modes, whatever the parameter or autocast dtype. Every one of these
contractions has a stated error bound, and the norm used for clipping includes them all
(``norms`` module docstring): rounding can make it larger, never smaller. Under autocast a Linear's input is recorded in the autocast
dtype, the value its matmul used. Pass 2 never backpropagates c_u-scaled losses through
low-precision layers (that changes G by rounding, so the added gradient would not be the
one whose norm was clipped). It is added to ``p.grad`` only when that is float32 or
wider; half-precision trainable parameters need float32 ``grad_buffers``
(``llmdp.train.strategy.Strategy.grad_sinks``).

Every use is in the norm (DESIGN, invariant `precision-never-widens`). Each recorded call of a hooked module is one use
of its parameters; a parameter with several uses in a micro-batch (tied embeddings, a
module called twice) gets all cross terms ⟨g_i, g_j⟩. A use the hooks cannot see (a
functional ``F.linear(x, module.weight)`` outside the module) is found by walking the
autograd graph of the loss and refused with the parameter's name, never mis-clipped.

Non-finite gradients: a unit whose gradient norm is NaN or infinite gets factor 0 and
its rows are zeroed before any contraction (0·NaN would be NaN), so it contributes
exactly nothing; ``last_nonfinite`` counts such units in the last call (an internal
statistic: never logged per unit).

``engine="reference"`` is the exact, slow yardstick (per-unit vector-Jacobian products).

Sharded parameters (FSDP2, ``scaling.strategy: fsdp``): with ``grad_buffers`` (one plain,
full-size tensor per trainable parameter name) the clipped sum is *added to those
buffers* instead of ``p.grad``; the caller reduce-scatters them once per logical step.
The engine never asks autograd for a parameter gradient (both passes ask only for the
dummy leaf's), so FSDP2's own gradient reduce-scatter finds nothing to reduce. Parameters are identified by the objects
registered when the clipper was built (the sharded DTensors), not by what a module holds
at backward time (FSDP2 swaps in unsharded parameters around forward and backward).
Parameter *values* are read only inside the backward pass of their FSDP unit (the
norm-layer rule re-runs the module there), when FSDP2 has all-gathered them; after the
backward only shapes and flags are read, which the sharded DTensor reports globally.
So FSDP2's default ``reshard_after_forward=True`` is valid. Every rank must issue the same
collectives: with sharded parameters an all-padding micro-batch still runs its backward
pass(es) (on a zero loss), and ``mode="auto"`` takes one decision for all ranks.

Around the engine: what it refuses and how it finds it (`check_model`, uses the hooks
cannot see, modules never reached) is ``audit.py``; what book-keeping keeps, how ``auto``
chooses and the two-pass fingerprint, ``modes.py``; forming each call's part of the
clipped sum and adding it to ``p.grad`` or the buffers, ``accumulate.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from llmdp.base import plants as plant
from llmdp.clipping import norms as nb
from llmdp.clipping import stacked
from llmdp.clipping.accumulate import (
    _is_dtensor,
    add_to_buffers,
    add_to_grad,
    check_buffers,
    contribution,
    dirty_flags,
)
from llmdp.clipping.audit import (
    UnsupportedModuleError,
    UseAudit,
    check_coverage,
    check_model,
    check_random,
    random_modules,
)
from llmdp.clipping.calls import TapMany, folded, record_call, rerunning, tensors_in
from llmdp.clipping.cross import cross_inner
from llmdp.clipping.lowp import U64, gamma
from llmdp.clipping.modes import MODES, resolve_mode
from llmdp.clipping.norms import Record, Sq, Units, find_rule, fingerprint
from llmdp.clipping.reference import (
    clipped_sum,
    per_unit_gradients_autograd,
    unit_ids,
)
from llmdp.clipping.rules import LinearRule
from llmdp.clipping.rules.functional import FunctionalRule

GENERIC = FunctionalRule()

ENGINES = ("ghost", "reference")
#: Book-keeping reads its instantiated calls' fallback flags once per 1/WINDOWS of the
#: backward's output gradients (``GhostClipper._read_window``): host syncs per backward.
WINDOWS = 4
LAYER_POLICIES = ("auto", "ghost", "instantiate")


@dataclass(frozen=True)
class NormStats:
    """What the rounding bounds did in the last backward (``GhostClipper.last_norm_stats``;
    computed on private data: internal, never published). ``fallbacks``: (call, unit)
    pairs recomputed as the exact float64 gradient because the bound was more than
    the fallback threshold (``fallback``) of the unit's norm; ``bound_max``: the largest share of a used norm
    that is rounding bound, 1 − √S_u/ν_u, after the fallbacks (``norms`` module docstring)."""

    units: int = 0
    fallbacks: int = 0
    bound_max: float = 0.0


class _Tap(torch.autograd.Function):
    """Identity on the module output whose backward hands G to the clipper."""

    @staticmethod
    def forward(ctx, x, anchor, clipper, rec):
        ctx.clipper, ctx.rec = clipper, rec
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.clipper._on_output_grad(ctx.rec, g)
        return g, None, None, None


def _detached(G, fold: int = 1):
    """G, or the tuple of a call's output gradients (``calls.TapMany``), detached; a call
    on the flattened tokens folded back to [R, k, ...] (``Record.fold``)."""
    if isinstance(G, tuple):
        return tuple(g.detach() for g in G)
    G = G.detach()
    return G.reshape(-1, fold, *G.shape[1:]) if fold > 1 else G


def _autocast_input_dtype(module: nn.Module, rule, A: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast cast a Linear/Conv1D input to, if it did (else None)."""
    if not isinstance(rule, LinearRule) or not A.is_floating_point():
        return None
    dev = A.device.type
    try:
        if not torch.is_autocast_enabled(dev):
            return None
        dt = torch.get_autocast_dtype(dev)
    except (TypeError, AttributeError, RuntimeError):  # pragma: no cover - torch < 2.4 API
        return None
    # autocast casts float32 operands only (float64 ones are left as they are)
    return dt if dt in (torch.bfloat16, torch.float16) and A.dtype == torch.float32 else None


class GhostClipper:
    """Exact per-unit clipping of the gradient over all trainable parameters.

    Args:
        model: the module whose trainable parameters (``requires_grad``) are trained.
        max_grad_norm: C, the L2 bound on each unit's gradient over *all* trainable
            parameters (flat clipping, DESIGN, invariant `one-sensitivity-boundary`).
        engine: ``"ghost"`` (hooks, default) or ``"reference"`` (slow, for tests).
        mode: ``"auto"``, ``"book-keeping"`` or ``"two-pass"`` (see the module docstring).
        layer_policy: ``"auto"`` (per layer and batch, the cheaper of ghost norm and
            instantiation), or force ``"ghost"`` / ``"instantiate"`` where a rule has both.
        grad_buffers: ``{parameter name: tensor}`` for every trainable parameter (names
            as in ``model.named_parameters()``, full/global shapes, plain tensors): the
            clipped sum is added there instead of ``p.grad``. Required when the trainable
            parameters are sharded DTensors (FSDP2); optional otherwise.
        fallback: ρ_u, the share of a unit's used norm that is rounding bound, above which
            the unit's call is recomputed exactly (default ``norms.FALLBACK`` = 1 %; any
            number in [0, 1]). The norm used is never below the true norm whatever this
            is: over-clipping by the bound costs utility (a step up to this share shorter),
            never privacy; a smaller value costs time (``norms`` module docstring, 4).
    """

    def __init__(
        self,
        model: nn.Module,
        max_grad_norm: float,
        engine: str = "ghost",
        mode: str = "auto",
        layer_policy: str = "auto",
        grad_buffers: Mapping[str, torch.Tensor] | None = None,
        fallback: float = nb.FALLBACK,
    ):
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if engine not in ENGINES:
            raise ValueError(f"clipping engine {engine!r} is not one of {list(ENGINES)}")
        if mode not in MODES:
            raise ValueError(f"clipping mode {mode!r} is not one of {list(MODES)}")
        if layer_policy not in LAYER_POLICIES:
            raise ValueError(f"layer_policy {layer_policy!r} is not one of {list(LAYER_POLICIES)}")
        self.fallback = nb.check_fallback(fallback)
        check_model(model)
        self._random = random_modules(model)  # refused in training mode (audit.check_random)
        self.model = model
        self.max_grad_norm = float(max_grad_norm)
        self.engine, self.mode, self.layer_policy = engine, mode, layer_policy
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.param_names = [n for n, _ in named]
        self._name_of = {id(p): n for n, p in named}
        self._param_of = {id(p): p for _, p in named}
        self.sharded = any(_is_dtensor(p) for p in self.params)
        self.grad_buffers = check_buffers(named, grad_buffers, engine, self.sharded)
        # (module, parameter name) -> id of the parameter registered at construction (stable
        # under FSDP2, which swaps unsharded parameters in and out around forward/backward).
        self._pids: dict[tuple[nn.Module, str], int] = {}
        self.last_mode: str | None = None  # the mode the last backward used (auto resolves)
        self._records: list[Record] = []
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # autocast inputs
        self._recording = True
        self._phase = "idle"
        self._units: Units | None = None
        self._keep_G = False
        self._shared: set[int] = set()  # parameters with several uses in this micro-batch
        self._audit = UseAudit()  # each recorded call's own nodes: uses the hooks did not see
        self._factors = self._row_factors = self._zero_rows = None
        self.last_nonfinite = 0  # units with a non-finite gradient norm in the last backward
        self.last_norm_stats = NormStats()  # the rounding bounds' fallbacks (internal)
        self._fallbacks = 0
        self._deferred: list[Record] = []  # calls whose fallback flags are read after pass 1
        self._window: list[Record] = []  # book-keeping: instantiated calls not yet flagged
        self._window_bytes, self._window_budget = 0, 1
        self._mismatch: list = []  # two-pass: (call, G differs from pass 1's) device flags
        self._refetch: set = set()  # two-pass: the calls whose G is brought back
        self._total = None  # the loss of the backward in progress
        self._handles = []
        self._rules = {}
        self._names: dict = {}  # module -> its path in the model (for messages)
        self._anchor = None
        if engine == "ghost":
            self._install_hooks()

    def _pid(self, module: nn.Module, pname: str) -> int:
        pid = self._pids.get((module, pname))
        return pid if pid is not None else id(module.get_parameter(pname))

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        owners: dict[int, int] = {}
        claimed: list[str] = []  # subtrees whose parameters a rule of their root clips
        for name, module in self.model.named_modules():
            if any(name.startswith(c + ".") for c in claimed):
                continue
            # No specific rule: the generic exact one (re-runs the module per unit, refuses
            # a module that mixes rows when it first sees one do so: rules/functional.py).
            rule = find_rule(module) or GENERIC
            if rule.claims_subtree:  # peft's ParamWrapper: its adapters are never called
                claimed.append(name)
            own = rule.params(module)
            if not own:
                continue
            self._rules[module] = rule
            self._names[module] = name
            for pname in own:
                p = module.get_parameter(pname)
                owners[id(p)] = owners.get(id(p), 0) + 1
                self._pids[(module, pname)] = id(p)
            self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
            if hasattr(rule, "install"):  # a rule that runs the module's forward itself
                self._handles.append(rule.install(module, self))
        # Which parameters have several uses (tied input embedding and LM head, a module
        # called twice) is counted per micro-batch from the recorded calls (_multi_use).
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in owners]
        if missing:  # pragma: no cover - every parameter belongs to some module
            raise UnsupportedModuleError(f"trainable parameters outside any module: {missing}")
        # The number of rows of the batch, read from the model's input: a module whose output
        # is shared by all rows (learned position embeddings of shape [1, T, d]) is expanded
        # to one copy per row, so that the backward pass gives each row its own gradient.
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        device = self.params[0].device
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    def _on_model_input(self, module, args, kwargs) -> None:
        if self._random:  # a jitter switched on by model.train() after the clipper was built
            check_random(self._random)
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if x is None and args:
            x = args[0]
        self._rows = x.shape[0] if isinstance(x, torch.Tensor) else None

    def _on_forward(self, module, args, kwargs, output):
        if (
            not self._recording
            or torch._C._are_functorch_transforms_active()  # a rule re-running a module
            or rerunning()
            or not torch.is_grad_enabled()
        ):
            return None
        if self._rules[module].wants_call:
            return self._on_call(module, args, kwargs, output)
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        rows = getattr(self, "_rows", None)
        if isinstance(module, nn.Embedding) and rows is not None and output.dim() >= 2 and output.shape[0] == 1 and rows > 1:
            output = output.expand(rows, *output.shape[1:])
        A = args[0].detach()
        if rec_dtype := _autocast_input_dtype(module, self._rules[module], A):
            # Under autocast the module multiplied bf16(A), not A: record that (it is the
            # model's true gradient Gᵀ·bf16(A), half the memory, and tensor-core ready).
            # One cast per input tensor: layers reading the same input (q/k/v) share it,
            # and with it their input Gram matrix (Units.self_gram).
            src = args[0]
            hit = self._casts.get(id(src))
            if hit is None or hit[0] is not src or hit[1].dtype != rec_dtype:
                hit = (src, A.to(rec_dtype))
                self._casts[id(src)] = hit
            A = hit[1]
        # A Linear on the flattened tokens (OPT's fc1/fc2 take x.reshape(-1, d)): its rows
        # are the batch's rows' positions; the rule sees A and G folded back to [R, k, ...].
        fold = folded(args[0], rows)
        if fold > 1:
            A = A.reshape(rows, fold, *A.shape[1:])
        elif rows is not None and A.dim() and A.shape[0] not in (rows, 1):
            raise UnsupportedModuleError(
                f"module '{self._names[module]}' ({type(module).__name__}): its input's leading "
                f"dimension ({A.shape[0]}) is neither the batch's rows ({rows}) nor a flattening "
                f"of them that the engine can prove row-major (calls.folded), so it cannot tell "
                f"which unit each position belongs to; freeze it, or register a rule")
        rec = Record(module, self._rules[module], A, output.numel() * output.element_size())
        rec.fold = fold
        direct = getattr(rec.rule, "direct_operand", None)
        if direct is not None and (z := direct(module, args, output)) is not None:
            rec.A, rec.direct = z, True
        self._records.append(rec)
        # The parameter tensors this call used (FSDP2: the unsharded ones), and its nodes.
        self._audit.record(module, rec.rule.params(module), output, args[0], len(self._records) - 1)
        return _Tap.apply(output, self._anchor, self, rec)

    def _on_call(self, module, args, kwargs, output):
        """A call of a module whose rule re-runs it (``calls.py``): keep the whole call and
        tap every differentiable output at once."""
        got = record_call(module, self._names[module], args, kwargs, output, getattr(self, "_rows", None))
        if got is None:
            return None
        outs, rebuild, call = got
        rule = self._rules[module]
        first = tensors_in(args, kwargs)
        rec = Record(module, rule, first[0].detach(), sum(o.numel() * o.element_size() for o in outs))
        rec.call = call
        if hasattr(rule, "on_record"):
            rule.on_record(module, rec)
        self._records.append(rec)
        self._audit.record(module, rule.params(module), list(outs), first, len(self._records) - 1)
        return rebuild(TapMany.apply(self._anchor, self, rec, *outs))

    def _check_uses(self, total: torch.Tensor) -> None:
        """Refuse a trainable parameter used outside the calls the hooks recorded (audit.py)."""
        names = {i: n for i, n in self._name_of.items()}
        for (module, pname), t in self._audit.fwd_params.items():
            names[id(t)] = self._name_of.get(self._pid(module, pname), pname)
        self._audit.check(total, names, (_Tap._backward_cls, TapMany._backward_cls))

    def _on_output_grad(self, rec: Record, G: torch.Tensor) -> None:
        """Runs inside the backward pass, once per recorded call, as soon as G is known."""
        if self._phase in ("apply", "refetch"):
            if self._phase == "apply" or rec in self._refetch:
                self._apply_second_pass(rec, _detached(G, rec.fold))
            return
        if self._phase != "norms":
            return
        units = self._units
        G = _detached(G, rec.fold)
        rec.G = G
        if rec.call is not None:
            rec.call.units = units
        rule = rec.rule
        rec.ghost = rule.choose_ghost(rec.module, rec.A, G, self.layer_policy, units.num_units)
        shared = any(self._pid(rec.module, n) in self._shared for n in rule.params(rec.module))
        if rec.ghost:
            rec.sqn = _checked(rule, rule.sq_norms_ghost(rec, units))
        else:
            inst = rule.instantiate(rec, units)
            rec.per_unit = {n: h for n, (h, _) in inst.items()}
            rec.sqn = _checked(rule, {n: sq for n, (_, sq) in inst.items()})
        deferred = not shared and rule.has_exact and bool(rec.sqn)
        if deferred:
            # A call whose bound is a real part of its norm (ghost or instantiated: float32
            # per-row gradients have a bound too) is recomputed exactly for those units (a
            # shared parameter's calls: in _norms). Which units, and whether a value + bound
            # is negative (a bug), are device flags, formed for many calls at once and read
            # with one host sync (stacked.call_flags): after the backward for the calls that
            # keep A and G anyway (book-keeping's ghost calls) and for two-pass, which drops
            # G and brings it back for the flagged calls only, by one more backward (rare);
            # book-keeping's instantiated calls, which would drop A and G here, keep them
            # until their window of output gradients is full (_read_window).
            if self._keep_G and not rec.ghost:
                self._window.append(rec)
                self._window_bytes += rec.out_bytes
                if self._window_bytes >= self._window_budget:
                    self._read_window()
            else:
                self._deferred.append(rec)
        if not self._keep_G:
            # two-pass: pass 2 brings the same G again; keep A and G's fingerprint only
            # (G too, until the cross terms are taken, if the parameter has other uses).
            rec.fp = fingerprint(G)
            rec.per_unit = rec.cache = None
            if not shared:
                rec.G = None
            return
        if shared or deferred:
            return  # cross terms with the other uses, or the fallback flags, need A and G
        if not rec.ghost and rec.exact is None:
            # book-keeping, instantiated: the per-unit gradients are kept (A and G too when
            # a unit's part is to be recomputed exactly at the clipped sum)
            rec.G, rec.A = None, None

    def _read_window(self) -> None:
        """Book-keeping: the fallback flags of the instantiated calls kept since the last
        read, with one host sync; their exact fallbacks; then their A and G are dropped
        (kept only where a unit's part is recomputed exactly at the clipped sum). Windows
        hold about 1/WINDOWS of the backward's output gradients: at most WINDOWS reads
        per backward, and that much kept beyond what instantiation keeps."""
        recs, self._window, self._window_bytes = self._window, [], 0
        if recs:
            self._flag_calls(recs, self._units)
        for r in recs:
            if r.exact is None:
                r.G, r.A = None, None

    def _apply_second_pass(self, rec: Record, G: torch.Tensor) -> None:
        """Two-pass, pass 2: the same backward brings G again; form and add this call's
        part of the clipped sum from it, in float32, then drop it. (``refetch``: bring G
        back for a call whose units are recomputed exactly, ``_refetch_G``.)"""
        if rec.fp is None:  # not reached in pass 1 (so not part of the norms)
            return
        self._same_G(rec, G)
        rec.G = G
        if self._phase == "refetch":
            return
        parts = self._contribution(rec, self._units)
        rec.G = rec.A = rec.exact = rec.exact_shared = rec.cache = None
        self._add_parts([(rec, parts)])

    def _same_G(self, rec: Record, G) -> None:
        """Pass 1's G again, bit for bit: a shape that differs is refused at once; the
        fingerprints are compared on the device and the flags read once, after the pass
        (``_check_same_G``)."""
        fp = fingerprint(G)
        if fp.shape != rec.fp.shape:
            self._refuse_different_G(rec)
        self._mismatch.append((rec, (fp != rec.fp).any()))

    def _check_same_G(self) -> None:
        """Raise if a call of the last pass saw a G other than pass 1's (one host sync).
        Pass 2 adds each call's part as its G arrives, so a mismatch is raised after the
        pass, with parts added, as it was raised midway before (with the parts of the calls
        before it added): either way the backward raises and what it added is not a
        clipped sum (the step is not taken: the caller's sums are discarded)."""
        checks, self._mismatch = self._mismatch, []
        if not checks:
            return
        flags = torch.stack([f for _, f in checks]).tolist()
        for (rec, _), bad in zip(checks, flags):
            if bad:
                self._refuse_different_G(rec)

    @staticmethod
    def _refuse_different_G(rec: Record) -> None:
        raise RuntimeError(
            f"clipping two-pass: the second backward gave module {type(rec.module).__name__} "
            "a different output gradient than the first (a non-deterministic backward), so "
            "what would be added is not what was clipped. Use privacy.clipping_mode: "
            "book-keeping, or torch.use_deterministic_algorithms(True)."
        )

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ backward
    def backward(self, row_losses: torch.Tensor, row_units: torch.Tensor | None = None) -> torch.Tensor:
        """Add the clipped sum of per-unit gradients to ``p.grad``; return per-unit norms.

        ``row_losses`` has one entry per batch row: the row's share of its unit's normalized
        loss, so a unit's loss is the sum of its rows' entries.
        ``row_units[r]`` is the unit of row r (default: row r is unit r); -1 marks padding,
        whose rows contribute exactly nothing.
        """
        if row_losses.ndim != 1:
            raise ValueError(
                f"row_losses must be a 1-D tensor with one loss per row, got shape "
                f"{tuple(row_losses.shape)}"
            )
        row_units, num_units = unit_ids(row_units, row_losses.shape[0], row_losses.device)
        try:
            if num_units == 0:
                if self.sharded and self._records:
                    self._collective_backward_only(row_losses)
                return torch.zeros(0, dtype=torch.float32, device=row_losses.device)
            if self.engine == "reference":
                per_unit = per_unit_gradients_autograd(row_losses, self.params, row_units)
                sums, norms = clipped_sum(per_unit, self.max_grad_norm)
                self.last_nonfinite = int((~torch.isfinite(norms)).sum())
                self._add_to_grad(zip(self.params, sums))
                return norms
            return self._ghost_backward(row_losses, row_units, num_units)
        finally:
            self._records.clear()
            self._casts.clear()
            self._audit.clear()
            self._factors = self._row_factors = self._zero_rows = None
            self._phase = "idle"
            self._units = self._total = None
            self._deferred, self._window, self._mismatch = [], [], []

    def _collective_backward_only(self, row_losses: torch.Tensor) -> None:
        """A micro-batch of padding rows only, with sharded parameters: contributes nothing,
        but runs the same backward pass(es) as a rank with real units, so that FSDP2's
        backward all-gathers are issued on every rank in the same order. [sync points]"""
        mode = self._resolve_mode()
        total = (row_losses * 0).sum()
        self._recording = False
        try:
            torch.autograd.grad(total, self._anchor, retain_graph=mode == "two-pass", allow_unused=True)
            if mode == "two-pass":
                torch.autograd.grad(total, self._anchor, allow_unused=True)
        finally:
            self._recording = True

    def _multi_use(self, records: list[Record]) -> set[int]:
        """Parameters with more than one recorded use in this micro-batch (stable ids)."""
        count: dict[int, int] = {}
        for rec in records:
            for n in rec.rule.params(rec.module):
                pid = self._pid(rec.module, n)
                count[pid] = count.get(pid, 0) + 1
        return {pid for pid, c in count.items() if c > 1}

    def _resolve_mode(self, num_units: int = 1) -> str:
        return resolve_mode(self.mode, self._records, num_units, self.params, self.sharded)

    def _ghost_backward(self, row_losses, row_units, num_units) -> torch.Tensor:
        records = list(self._records)
        if not records:
            raise RuntimeError(
                "GhostClipper.backward: no forward pass was recorded; call the model with "
                "gradients enabled between two backward calls"
            )
        mode = self._resolve_mode(num_units)
        self.last_mode = mode
        units = Units.make(row_units, num_units)
        units.defer = mode == "book-keeping"  # A and G kept until the bound computation
        self._fallbacks = 0
        self._exact_totals = []
        # padding rows' losses left out (by value: a boolean index reads its size back)
        total = torch.where(row_units >= 0, row_losses, 0).sum()
        self._shared = self._multi_use(records)
        self._check_uses(total)
        self._units, self._keep_G, self._phase = units, mode == "book-keeping", "norms"
        self._total = total
        self._deferred, self._window, self._window_bytes = [], [], 0
        self._window_budget = max(1, sum(r.out_bytes for r in records) // WINDOWS)
        self._mismatch, self._refetch = [], set()
        self._recording = False  # activation-checkpoint recomputation must not record
        try:
            # Pass 1. Rows are independent, so the gradient of the summed loss at a module's
            # output row is that of the row's own unit loss: one backward serves every unit.
            torch.autograd.grad(total, self._anchor, retain_graph=mode == "two-pass", allow_unused=True)
        finally:
            self._recording = True
            self._phase = "idle"
        # book-keeping's last window of instantiated calls: flagged with the others, below
        window, self._window, self._window_bytes = self._window, [], 0
        self._deferred.extend(window)
        seen = [r for r in records if r.sqn is not None]
        check_coverage(self.model, self._rules, seen)
        nu, value, neg = self._norms(seen, units)
        for r in window:  # their flags are read: as _read_window
            if r.exact is None:
                r.G, r.A = None, None
        factors = nb.factors(nu, value, self.max_grad_norm)  # 0 for a non-finite norm
        norms = nb.round_up_to(nu, self._norm_dtype())  # never below the used norm
        factors = _planted_factors(factors, norms)  # test-only (llmdp.base.plants): unchanged
        self._row_factors = units.row_factors(factors)
        # Rows that add nothing (padding, units with a non-finite gradient) are zeroed
        # before any contraction: a 0 factor alone would leave 0·NaN = NaN in the sum.
        zero = self._row_factors == 0
        # A negative norm (a bug), the statistics, and whether any row adds nothing: one
        # host sync for all of them.
        finite = torch.isfinite(nu)
        bad_sum, nonfinite, bound_max, any_zero = torch.stack([
            neg.any().to(torch.float64),
            (~finite).sum().to(torch.float64),
            torch.where(finite, nb.rho(value, nu), torch.zeros_like(nu)).max(),
            zero.any().to(torch.float64)]).tolist()
        if bad_sum:
            raise RuntimeError(
                "clipping engine bug: a squared norm plus its rounding bound is negative (the "
                "sum over all parameters); the bound must make it >= 0. Please report this "
                "with the model and batch shapes.")
        self.last_nonfinite = int(nonfinite)
        self.last_norm_stats = NormStats(units=units.num_units, fallbacks=self._fallbacks,
                                         bound_max=bound_max)
        self._factors = factors
        self._add_exact_totals(factors, units)  # while every use's G is still here
        self._zero_rows = zero if any_zero else None
        self._read_dirty(seen)
        if mode == "two-pass":
            for rec in seen:
                rec.G, rec.per_unit = None, None  # cross terms are taken: pass 2 brings G again
            # Pass 2: the same backward of the same loss; each tap checks that G is pass 1's
            # G and adds Σ_r c_{u(r)} G_rᵀA_r (float32) to the sinks as G arrives.
            self._phase = "apply"
            self._recording = False
            try:
                torch.autograd.grad(total, self._anchor, allow_unused=True)
            finally:
                self._recording = True
                self._phase = "idle"
            self._check_same_G()
            return norms
        self._add_parts([(rec, self._contribution(rec, units)) for rec in seen])
        return norms

    def _read_dirty(self, recs: list[Record]) -> None:
        """Rows that add nothing (a zero factor) are zeroed in a call's A and G only where
        one of them holds a non-finite value; whether it does, for every call whose clipped
        sum contracts A and G, with one host sync (two with the rows' indices), not two per
        call. Two-pass reads G's from pass 1's fingerprint (pass 2 checks it is the same G)."""
        for r in recs:
            r.dirty = None
        if self._zero_rows is None:
            return
        todo = [r for r in recs if r.rule.has_clipped_ghost and r.A is not None
                and not isinstance(r.G if r.G is not None else r.fp, tuple)
                and (r.ghost or not self._keep_G)
                and (r.G is not None or (r.fp is not None and r.fp.dim() == 2))]
        if not todo:
            return
        rows = self._zero_rows.nonzero().view(-1)
        flags = torch.stack([torch.stack(dirty_flags(r.G, r.A, rows, r.fp)) for r in todo]).tolist()
        for r, (g, a) in zip(todo, flags):
            r.dirty = (g, a)

    def _contribution(self, rec: Record, units: Units) -> dict[str, torch.Tensor]:
        ghost = rec.ghost or self._phase == "apply"  # pass 2 brings G: contract it
        sinks = None
        if self.grad_buffers is not None and getattr(rec.rule, "adds_to_sinks", False):
            # a rule may add its part to the sink itself (the Triton clipped sum, in its
            # kernel: one launch fewer per call); the same one float32 add either way
            sinks = {n: self.grad_buffers[self._name_of[self._pid(rec.module, n)]]
                     for n in rec.rule.params(rec.module)}
        return contribution(rec, units, self._factors, self._row_factors, self._zero_rows, ghost, sinks)

    def _add_parts(self, parts: list[tuple[Record, dict[str, torch.Tensor]]]) -> None:
        if self.grad_buffers is not None:
            self._add_to_buffers((self._pid(rec.module, n), g) for rec, d in parts for n, g in d.items())
        else:
            self._add_to_grad((rec.module.get_parameter(n), g) for rec, d in parts for n, g in d.items())

    def _norm_dtype(self) -> torch.dtype:
        """The returned norms' dtype: float64 for a float64 model, float32 otherwise."""
        return torch.float64 if self.params and self.params[0].dtype == torch.float64 else torch.float32

    def _sink_u(self, pid: int) -> float:
        """Unit roundoff of the sink parameter ``pid``'s clipped sum is added to."""
        if self.grad_buffers is not None:
            b = self.grad_buffers.get(self._name_of.get(pid, ""))
            if b is not None:
                return nb.roundoff(b.dtype)
        p = self._param_of.get(pid)
        return nb.roundoff(p.dtype) if p is not None else nb.U32

    def _pairs(self, recs: list[Record]) -> tuple[list[tuple[Record, str]], list[list[int]]]:
        """The (call, parameter) pairs of ``recs`` in order, and each call's indices in it."""
        pairs: list[tuple[Record, str]] = []
        groups = []
        for r in recs:
            groups.append(list(range(len(pairs), len(pairs) + len(r.sqn))))
            pairs.extend((r, n) for n in r.sqn)
        return pairs, groups

    def _stack(self, pairs: list[tuple[Record, str]]) -> stacked.Stack:
        return stacked.Stack.of([r.sqn[n] for r, n in pairs],
                                [self._sink_u(self._pid(r.module, n)) for r, n in pairs])

    def _flag_calls(self, recs: list[Record], units: Units) -> None:
        """The fallback of calls with no shared parameter (``norms`` module docstring, 4),
        with one host sync for all of them (a second for each flagged call): a negative
        value + bound is raised as ``used_norm`` raises it, naming the module; the units
        whose bound is more than the fallback threshold of the call's own norm are recomputed exactly.
        Two-pass dropped those calls' G: it is brought back for the flagged ones only."""
        pairs, groups = self._pairs(recs)
        bad, neg = stacked.call_flags(self._stack(pairs), groups, self.fallback)
        flags = torch.cat([neg.any().reshape(1), bad.any(1)]).tolist()
        if flags[0]:
            self._raise_negative(recs, pairs, groups)
        self._fallback_hits([(r, b) for r, b, f in zip(recs, bad.unbind(0), flags[1:]) if f], units)

    def _fallback_hits(self, hit: list[tuple[Record, torch.Tensor]], units: Units) -> None:
        """The exact fallback of each flagged call, for its flagged units; two-pass (which
        dropped their G) brings G back first, for those calls only, and drops it after."""
        if hit and not self._keep_G:
            self._refetch_G([r for r, _ in hit])
        for r, b in hit:
            self._fallback_units(r, b, units)
            if not self._keep_G:
                r.G = None  # two-pass: pass 2 brings it again (not shared)

    def _raise_negative(self, recs, pairs, groups) -> None:
        """A call's value + bound is negative: a bug, raised with the call's module."""
        for r, g in zip(recs, groups):
            value = sum(r.sqn[pairs[i][1]].value for i in g)
            err = sum(r.sqn[pairs[i][1]].err for i in g)
            nb.check_nonnegative(value, err, type(r.module).__name__)
        raise RuntimeError("clipping engine bug: a squared norm plus its rounding bound is "
                           "negative; please report this with the model and batch shapes")

    def _refetch_G(self, recs: list[Record]) -> None:
        """Two-pass: G again for ``recs`` (calls with a unit to recompute exactly, whose G
        pass 1 dropped): the same backward of the same loss (its graph is retained for pass
        2 anyway), each of those taps checking that G is pass 1's and keeping it; the other
        taps do nothing. Only when some call needs it (rare)."""
        self._refetch = set(recs)
        self._phase, self._recording = "refetch", False
        try:
            torch.autograd.grad(self._total, self._anchor, retain_graph=True, allow_unused=True)
        finally:
            self._phase, self._recording = "idle", True
            self._refetch = set()
        self._check_same_G()

    def _fallback_units(self, rec: Record, bad: torch.Tensor, units: Units) -> None:
        for u in bad.nonzero(as_tuple=True)[0].tolist():
            for n in list(rec.sqn):
                v, e, d = self._exact_param([(rec, n)], u, units)
                idx = torch.tensor([u], device=bad.device)
                rec.sqn[n] = rec.sqn[n].at(idx, value=v, err=e, dev=d, rel=torch.zeros(1, dtype=torch.float64))
            _mark_exact(rec, u)
            self._fallbacks += 1

    def _exact_param(self, uses: list[tuple[Record, str]], u: int, units: Units,
                     together: bool = False) -> tuple[torch.Tensor, ...]:
        """(value, err, dev) of one parameter's gradient for unit ``u``, summed over its
        ``uses``, from each use's exact float64 gradient (``LayerRule.exact``), a slice at a
        time (norms module docstring, 4). dev covers the recomputation at the clipped sum
        (any float64 evaluation of use i is within ε_i = γ·N_i of g_i), the sum over uses,
        and four float32 roundings (c·g̃, its cast, its add to the call's part, to the sink)
        of what is added: the sum over uses once (``together``: a shared parameter, whose
        uses may cancel), or each use's part."""
        rows = units.rows_of(u)
        dev_ = rows.device
        total = torch.zeros((), dtype=torch.float64, device=dev_)
        per_use = [torch.zeros((), dtype=torch.float64, device=dev_) for _ in uses]
        rec0, n0 = uses[0]
        numel = getattr(rec0.module, n0).numel()
        slices = [nb.exact_slices(rec.rule, rec, n, rows) for rec, n in uses]
        for parts in zip(*slices):
            tot = None
            for i, (_, _, part) in enumerate(parts):
                per_use[i] += (part * part).sum()
                tot = part if tot is None else tot + part
            total += (tot * tot).sum()
        k = len(uses)
        value = total
        err = nb.up(total, 2) * gamma(numel + 2, U64)
        norms = [nb.up(torch.sqrt(s), numel + 4) for s in per_use]
        eps = [nb.up(rec.sqn[n].mag[u] * gamma(nb.exact_count(rec), U64), 1) for rec, n in uses]
        base = nb.up(sum(2 * e for e in eps) + gamma(k, U64) * sum(norms), 2 * k + 4)
        if together:
            dev = base + gamma(4, nb.U32) * (nb.up(torch.sqrt(value + err), 2) + base)
        else:
            dev = base + sum(gamma(4, nb.U32) * (m + 2 * e) for e, m in zip(eps, norms))
        dev = nb.up(dev, 2 * k + 4)
        return value.reshape(1), err.reshape(1), dev.reshape(1)

    def _add_exact_totals(self, factors: torch.Tensor, units: Units) -> None:
        """Add c_u·Σ_i g̃_i (float64, cast once) for every shared parameter recomputed
        exactly for unit u (``_fallback_shared``): the sum over its uses is formed before
        any float32 rounding, so uses that cancel (a tied embedding and head) cancel
        exactly; the calls' own parts leave u out (``Record.exact_shared``)."""
        for pid, uses, u in self._exact_totals:
            c = float(factors[u])
            if c == 0:
                continue
            rows = units.rows_of(u)
            name = self._name_of[pid]
            for parts in zip(*[nb.exact_slices(r.rule, r, n, rows) for r, n in uses]):
                j0, j1 = parts[0][0], parts[0][1]
                tot = sum(part for _, _, part in parts)
                self._add_slice(pid, name, uses[0][0], uses[0][1], j0, j1, tot * c)
        self._exact_totals = []

    def _add_slice(self, pid: int, name: str, rec: Record, pname: str, j0: int, j1: int,
                   g: torch.Tensor) -> None:
        with torch.no_grad():
            if self.grad_buffers is not None:
                buf = self.grad_buffers[name]
                buf[j0:j1].add_(g.to(buf.dtype))
                return
            p = rec.module.get_parameter(pname)
            if p.dtype.itemsize < 4:  # as add_to_grad: never a half-precision .grad
                add_to_grad(self._name_of, [(p, g)])  # raises, naming the fix
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad[j0:j1].add_(g.to(p.dtype))

    def _norms(self, records: list[Record], units: Units) -> tuple[torch.Tensor, ...]:
        """(ν, S, neg): the norm used for clipping and the computed squared norm, per unit,
        in float64 (norms module docstring, 3), and where S + E is negative (a bug: the
        caller raises it), after the exact fallbacks (4) of the deferred calls and of shared
        parameters; all of it on [pairs, U] stacks (``stacked``), with one host sync for
        every fallback flag (and one more per flagged call or parameter, rare)."""
        pairs, _ = self._pairs(records)
        U = units.num_units
        device = self.params[0].device if self.params else units.unit_of_row.device
        if not pairs:  # no trainable parameter was reached by this batch
            z = torch.zeros(U, dtype=torch.float64, device=device)
            return z, z, torch.zeros(U, dtype=torch.bool, device=device)
        uses: dict[int, list[tuple[Record, str]]] = {}
        index: dict[int, int] = {}  # a parameter with one use: its pair's row
        for i, (rec, n) in enumerate(pairs):
            pid = self._pid(rec.module, n)
            uses.setdefault(pid, []).append((rec, n))
            index.setdefault(pid, i)
        stack = self._stack(pairs)
        # The flags: the deferred calls' (bad units, negative) and the shared parameters'.
        deferred, self._deferred = [r for r in self._deferred if r.sqn], []
        shared = {pid: self._combine(us, units) for pid, us in uses.items() if len(us) > 1}
        flags, neg = [], []
        if deferred:
            first = {id(r): i for i, (r, _) in reversed(list(enumerate(pairs)))}
            groups = [list(range(first[id(r)], first[id(r)] + len(r.sqn))) for r in deferred]
            bad_calls, neg_calls = stacked.call_flags(stack, groups, self.fallback)
            flags.append(bad_calls.any(1))
            neg.append(neg_calls.any().reshape(1))
        if shared:
            sv, se, sd = (torch.stack(x) for x in zip(*shared.values()))
            nu = nb.used_norm(sv, se, sd * sd, check=False)
            bad_shared = nb.worth_recomputing(sv, se, sd, nu, self.fallback)
            flags.append(bad_shared.any(1))
            neg.append(nb.negative(sv, se).any().reshape(1))
        read_shared: list = []
        if flags:
            read = torch.cat(neg + flags).tolist()  # the one host sync
            if any(read[: len(neg)]):
                for pid, (v, e, _) in shared.items():
                    nb.check_nonnegative(v, e, self._name_of.get(pid, ""))
                self._raise_negative(deferred, *self._pairs(deferred))
            read = read[len(neg):]
            hit = [(r, b) for r, b, f in zip(deferred, bad_calls.unbind(0), read) if f] if deferred else []
            read_shared = read[len(deferred):]
            self._fallback_hits(hit, units)
            if hit:  # their norms changed: the stack again (rare)
                stack = self._stack(pairs)
        if not shared:  # every parameter has one use: the pairs' rows, in order
            return stacked.total(stack.value, stack.err, stack.d)
        # Each parameter's (value, err, δ_P) in the order of its first use: a single use's
        # pair row, or a shared parameter's combination (_combine), gathered in one index.
        if any(read_shared):  # rare: per parameter, as _fallback_shared replaces some
            per_param = {pid: (stack.value[i], stack.err[i], stack.d[i]) for pid, i in index.items()}
            per_param.update(shared)
            self._fallback_shared(uses, per_param, units,
                                  [p for p, f in zip(shared, read_shared) if f],
                                  dict(zip(shared, bad_shared.unbind(0))))
            value, err, d = (torch.stack(x) for x in zip(*per_param.values()))
            return stacked.total(value, err, d)
        n = len(pairs)
        slot = {pid: n + j for j, pid in enumerate(shared)}
        order = stacked.const([slot.get(pid, i) for pid, i in index.items()], stack.value.device, torch.long)
        value, err, d = (torch.cat([x, y])[order] for x, y in ((stack.value, sv), (stack.err, se), (stack.d, sd)))
        return stacked.total(value, err, d)

    def _combine(self, uses: list[tuple[Record, str]], units: Units) -> tuple[torch.Tensor, ...]:
        """(value, err, δ) of one parameter over its uses: Σ_i value_i + 2Σ_{i<j} ⟨h_i, h_j⟩,
        their bounds (the cross terms' own, and the difference between the vectors a cross
        term reads and those the uses' norms measured: ≤ dev_i·‖h_j‖ + (‖h_i‖ + dev_i)·dev_j),
        and δ_P = Σ_i dev_i + rel_i·(‖h_i‖ + dev_i)."""
        pid = self._pid(uses[0][0].module, uses[0][1])
        sink_u = self._sink_u(pid)
        sqs = [rec.sqn[n] for rec, n in uses]
        if len(uses) == 1:
            s = sqs[0]
            return s.value, s.err, nb.deviation(s, sink_u)
        value = sum(s.value for s in sqs)
        err = sum(s.err for s in sqs)
        absv = sum(s.value.abs() for s in sqs)
        norm = [torch.sqrt(torch.clamp(s.value + s.err, min=0)) for s in sqs]
        for i in range(len(uses)):
            for j in range(i + 1, len(uses)):
                (ri, ni), (rj, nj) = uses[i], uses[j]
                c, ce = cross_inner(ri, rj, ni, nj, units)
                mismatch = sqs[i].dev * norm[j] + (norm[i] + sqs[i].dev) * sqs[j].dev
                value = value + 2 * c
                err = err + 2 * (ce + mismatch)
                absv = absv + 2 * c.abs()
        k = len(uses) * len(uses) + 2
        err = nb.up(err, k) + gamma(k, U64) * nb.up(absv, k)
        delta = nb.up(sum(nb.deviation(s, sink_u) for s in sqs), len(uses) + 2)
        return value, err, delta

    def _fallback_shared(self, uses, per_param, units: Units, pids: list[int],
                         bad: dict[int, torch.Tensor]) -> None:
        """The shared parameters ``pids`` whose bound is more than the fallback threshold of their norm for
        the units ``bad[pid]``: every call using it — and, in turn, every parameter of those
        calls and their other uses — is recomputed exactly for that unit (norms module
        docstring, 4). Calls whose rule cannot (``has_exact`` False) keep their bound: it
        is valid, only larger."""
        for pid in pids:
            for u in bad[pid].nonzero(as_tuple=True)[0].tolist():
                recs, closure = self._closure(pid, uses)
                if any(not r.rule.has_exact or r.G is None for r in recs):
                    continue
                if any(u in _exact_units(r) for r in recs):
                    continue  # already recomputed, with another shared parameter
                for q in closure:
                    shared = len(uses[q]) > 1
                    v, e, d = self._exact_param(uses[q], u, units, together=shared)
                    d = nb.up(d + gamma(1, self._sink_u(q)) * (torch.sqrt(v + e) + d), 4)
                    pv, pe, pd = per_param[q]
                    per_param[q] = (_set(pv, u, v), _set(pe, u, e), _set(pd, u, d))
                    if shared:
                        self._exact_totals.append((q, uses[q], u))
                        for r, n in uses[q]:
                            r.exact_shared = (r.exact_shared or set()) | {n}
                for r in recs:
                    _mark_exact(r, u)
                    self._fallbacks += 1

    def _closure(self, pid: int, uses) -> tuple[list[Record], list[int]]:
        """The calls using ``pid``, and the parameters of those calls, closed under 'a call
        of a parameter of a call in the set'."""
        recs: list[Record] = []
        pids: list[int] = []
        todo = [pid]
        while todo:
            q = todo.pop()
            if q in pids:
                continue
            pids.append(q)
            for r, _ in uses[q]:
                if not any(r is x for x in recs):
                    recs.append(r)
                    todo.extend(self._pid(r.module, n) for n in r.sqn)
        return recs, pids

    def _add_to_buffers(self, contributions) -> None:
        add_to_buffers(self.grad_buffers, self._name_of, contributions)

    def _add_to_grad(self, contributions) -> None:
        if self.grad_buffers is not None:  # the reference engine, into the buffers
            self._add_to_buffers((id(p), g) for p, g in contributions)
            return
        add_to_grad(self._name_of, contributions)


def _checked(rule, sqn: dict) -> dict[str, Sq]:
    """A rule's norms must carry their rounding bounds (norms.Sq), never a bare tensor."""
    for n, v in sqn.items():
        if not isinstance(v, Sq):
            raise TypeError(
                f"clipping rule {type(rule).__name__} returned a {type(v).__name__} for the norm "
                f"of '{n}': a rule must return llmdp.clipping.norms.Sq (the value and its rounding "
                "bounds, norms.py) so that the norm used for clipping is never below the true one"
            )
    return sqn


def _exact_units(rec: Record) -> set[int]:
    return set() if rec.exact is None else set(rec.exact.tolist())


def _mark_exact(rec: Record, u: int) -> None:
    t = torch.tensor([u], dtype=torch.long)
    rec.exact = t if rec.exact is None else torch.cat([rec.exact, t])


def _set(t: torch.Tensor, u: int, v: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[u] = v.reshape(()).to(t.dtype)
    return t


def _planted_factors(factors: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """The factors, unchanged unless a test switched on a planted bug (``LLMDP_TEST_PLANT``,
    never a recipe): ``clip-scale`` makes every factor 1.01× too large, ``clip-off`` sets
    every finite unit's factor to 1."""
    if plant.on("clip-scale"):
        return factors * 1.01
    if plant.on("clip-off"):
        return torch.where(torch.isfinite(norms), torch.ones_like(factors), factors)
    return factors
