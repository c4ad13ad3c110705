"""Per-unit gradient rules: their interface, the registry by module type, shared helpers.

For every supported module, a *rule* knows, from the module's input A (kept by a forward
hook) and the gradient G of the loss at its output (seen during the backward pass):

* ``sq_norms``   each unit's squared gradient norm for the module's own parameters,
  either by the **ghost** identity ‖Σ_t G_t A_tᵀ‖² = ⟨A Aᵀ, G Gᵀ⟩ over the unit's tokens
  (O(T²(p+d)) per unit, never forming the p×d gradient) or by **instantiating** the
  unit's gradient (O(p·d) per unit, then reused for the clipped sum);
* ``clipped``    Σ_u c_u · g_u, from the same A and G (book-keeping: no second backward).

Only modules whose output at one row depends on that row alone have rules; anything else
is refused by the engine (DESIGN §3.6): no silent fallback. The built-in rules live in
``rules/`` (one file per family: linear, embedding, normalization layers) and register
themselves with :func:`register_rule`; cross terms between two uses of one parameter are in
``cross.py``.

Units: ``unit_of_row[r]`` is row r's unit (−1: padding row). A unit's gradient is the sum
over its rows, so its ghost norm sums ⟨A_r A_r'ᵀ, G_r G_r'ᵀ⟩ over all pairs of its rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from llmdp.clipping import lowp

ACC = torch.float32  # norms and Gram matrices are accumulated in at least float32
GRAM_MEMORY = 2  # input Gram matrices remembered at once (Units.self_gram)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else ACC


# --------------------------------------------------------------------------- units


@dataclass
class Units:
    """The row -> unit map of one micro-batch, with the pairs of rows that share a unit."""

    unit_of_row: torch.Tensor  # [R] int64, -1 = padding
    num_units: int
    identity: bool  # row r is unit r for every r (no padding): the common fast path
    pair_a: torch.Tensor | None = None  # rows r, r' (r != r') of the same unit
    pair_b: torch.Tensor | None = None
    # The last few input Gram matrices A Aᵀ, by the input's storage: layers that read the
    # same input (Llama's q/k/v, gate/up) share one; their output gradients arrive one
    # after another in the backward, so a short memory suffices.
    _grams: OrderedDict = field(default_factory=OrderedDict, repr=False)
    gram_calls: int = 0  # Gram matrices computed (not taken from the memory), for tests

    def self_gram(self, x: torch.Tensor) -> torch.Tensor:
        """x xᵀ per row ([R, T, a] -> [R, T, T], float32+), shared between the layers that
        read the same tensor in this backward."""
        key = (x.data_ptr(), x.device, x.dtype, tuple(x.shape), tuple(x.stride()))
        hit = self._grams.get(key)
        if hit is not None:
            self._grams.move_to_end(key)
            return hit[1]
        g = lowp.gram(x, x)
        self.gram_calls += 1
        self._grams[key] = (x, g)  # x is kept alive with its Gram: its storage is not reused
        while len(self._grams) > GRAM_MEMORY:
            self._grams.popitem(last=False)
        return g

    @staticmethod
    def make(unit_of_row: torch.Tensor, num_units: int) -> Units:
        R = unit_of_row.shape[0]
        identity = num_units == R and bool(
            torch.equal(unit_of_row, torch.arange(R, device=unit_of_row.device))
        )
        u = Units(unit_of_row, num_units, identity)
        if not identity:
            same = (unit_of_row[:, None] == unit_of_row[None, :]) & (unit_of_row[:, None] >= 0)
            same.fill_diagonal_(False)
            a, b = same.nonzero(as_tuple=True)
            u.pair_a, u.pair_b = a, b
        return u

    @property
    def keep(self) -> torch.Tensor:
        return self.unit_of_row >= 0

    def rows_to_units(self, per_row: torch.Tensor) -> torch.Tensor:
        """Sum a per-row quantity [R, ...] into units [U, ...]; padding rows dropped."""
        if self.identity:
            return per_row
        out = per_row.new_zeros((self.num_units, *per_row.shape[1:]))
        return out.index_add(0, self.unit_of_row[self.keep], per_row[self.keep])

    def pairs_to_units(self, per_pair: torch.Tensor) -> torch.Tensor:
        """Sum a quantity of same-unit row pairs [P] into units [U]."""
        out = per_pair.new_zeros(self.num_units)
        if per_pair.numel():
            out.index_add_(0, self.unit_of_row[self.pair_a], per_pair)
        return out

    def row_factors(self, unit_factors: torch.Tensor) -> torch.Tensor:
        """c_{u(r)} for every row, 0 for padding rows."""
        if self.identity:
            return unit_factors
        f = unit_factors.new_zeros(self.unit_of_row.shape[0])
        f[self.keep] = unit_factors[self.unit_of_row[self.keep]]
        return f


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[R, in] -> [R, 1, in]; [R, T, ..., in] -> [R, T', in]."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _gram_pair_sum(X: torch.Tensor, Y: torch.Tensor, units: Units) -> torch.Tensor:
    """Per unit Σ_{r,r' in u} ⟨X_r X_r'ᵀ, Y_r Y_r'ᵀ⟩ for X [R,T,a] (a layer's input, its
    Gram matrix shared with the other layers reading it), Y [R,T,b] (float32+)."""
    return _pair_sum_two(X, Y, X, Y, units, gram_a=units.self_gram(X))


@dataclass(frozen=True)
class DeviceSpec:
    """What the layer choice needs to know of a device: dense matmul throughput for the
    contraction dtype (FLOP/s) and memory bandwidth (bytes/s)."""

    flops: float
    bandwidth: float


# Dense bf16/fp16 tensor-core FLOP/s (no sparsity) and HBM bandwidth, from the vendors'
# data sheets; matched as a substring of torch.cuda.get_device_name().
_CUDA_SPECS = {
    "H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "H800": (989e12, 3.35e12),
    "GH200": (989e12, 4.0e12), "B200": (2250e12, 8.0e12), "A100": (312e12, 2.0e12),
    "A800": (312e12, 2.0e12), "L40S": (362e12, 0.864e12), "L40": (181e12, 0.864e12),
    "L4": (121e12, 0.3e12), "A10": (125e12, 0.6e12), "A6000": (155e12, 0.77e12),
    "4090": (165e12, 1.0e12), "V100": (125e12, 0.9e12), "T4": (65e12, 0.32e12),
}
_CUDA_DEFAULT = (300e12, 2.0e12)
# float32 operands on CUDA run at about 1/15 of the tensor-core rate (SIMT; TF32 is off
# for the engine's float32 contractions, lowp.py).
_CUDA_FP32_SLOWDOWN = 15.0
# CPU: a few cores' float32 matmul rate against one socket's bandwidth.
_CPU_SPEC = DeviceSpec(flops=2e11, bandwidth=2e10)


def device_spec(device: torch.device, dtype: torch.dtype) -> DeviceSpec:
    if device.type != "cuda":
        return _CPU_SPEC
    name = torch.cuda.get_device_name(device)
    flops, bw = next((v for k, v in _CUDA_SPECS.items() if k in name), _CUDA_DEFAULT)
    if dtype not in (torch.bfloat16, torch.float16):
        flops /= _CUDA_FP32_SLOWDOWN
    return DeviceSpec(flops, bw)


def _ghost_cheaper(num_units: int, rows: int, T: int, p: int, d: int,
                   spec: DeviceSpec | None = None) -> bool:
    """Ghost norm or instantiation, for one [p x d] layer and one batch (R rows of T
    positions, U units), from memory first, then time on this device.

    Memory: instantiation keeps U per-unit gradients (U·p·d floats) until the clipped sum
    (book-keeping); allowed only when that is no larger than what book-keeping keeps for
    the layer anyway, its input and output (R·T·(p+d)). Otherwise the ghost norm, whose
    memory is T² per row, never p×d.

    Time, both paths also paying the clipped sum:
      instantiation  2·R·T·p·d FLOPs (per-row gradients, written in float32), then the
                     per-unit norms and the weighted sum read them: ≈ 8·(R+U)·p·d bytes;
      ghost norm     2·R·T²·(p+d) FLOPs (two Gram matrices) + the clipped sum's
                     2·R·T·p·d FLOPs (a tensor-core GEMM, as in a non-private backward).
    The cheaper on ``spec`` wins (a GPU's FLOP/byte ratio is ~100-300, so long rows of
    mid-sized layers go to the ghost norm there and to instantiation on a CPU)."""
    if num_units * p * d > rows * T * (p + d):
        return True
    if spec is None:
        return False
    t_inst = 2.0 * rows * T * p * d / spec.flops + 8.0 * (rows + num_units) * p * d / spec.bandwidth
    t_ghost = (2.0 * rows * T * T * (p + d) + 2.0 * rows * T * p * d) / spec.flops
    return t_ghost < t_inst


# --------------------------------------------------------------------------- records


class Record:
    """One call of one hooked module in one micro-batch: its input, and later its output
    gradient or its per-unit gradients."""

    __slots__ = ("module", "rule", "A", "G", "per_unit", "ghost", "sqn", "out_bytes", "fp")

    def __init__(self, module: nn.Module, rule: LayerRule, A: torch.Tensor, out_bytes: int = 0):
        self.module, self.rule, self.A = module, rule, A
        self.G: torch.Tensor | None = None
        self.per_unit: dict[str, torch.Tensor] | None = None
        self.ghost: bool = False
        self.sqn: dict[str, torch.Tensor] | None = None  # per-unit squared norms, per parameter
        self.out_bytes = out_bytes  # size of the module output, hence of G
        self.fp: torch.Tensor | None = None  # two-pass: pass 1's fingerprint of G, per row


class LayerRule:
    """Interface of a rule. ``params`` are the module's own trainable parameter names.
    ``has_clipped_ghost``: the rule forms Σ_r c_{u(r)}·(row r's gradient) from A and G
    directly (one contraction, no per-unit tensor)."""

    has_clipped_ghost = False

    def params(self, module) -> list[str]:
        return [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]

    def choose_ghost(self, module, A, G, policy: str, num_units: int) -> bool:
        return False

    def sq_norms_ghost(self, rec: Record, units: Units) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def per_unit(self, rec: Record, units: Units) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def clipped_ghost(self, rec: Record, row_factors: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError


# --------------------------------------------------------------------------- registry

_BY_TYPE: dict[type, LayerRule] = {}
_BY_MATCH: list[tuple[Callable[[nn.Module], bool], LayerRule]] = []


def register_rule(*module_types: type, match: Callable[[nn.Module], bool] | None = None):
    """Register a rule (a ``LayerRule`` subclass, instantiated with no arguments, or an
    instance) for modules of exactly ``module_types`` — by exact type: a subclass may change
    the forward, as Gemma's scaled embedding does — and/or for the modules ``match``
    accepts (third-party classes known by name). Usable as a class decorator::

        @register_rule(MyLinear)
        class MyLinearRule(LayerRule): ...

    A later registration for the same type replaces the earlier one."""
    def add(rule):
        inst = rule() if isinstance(rule, type) else rule
        if not isinstance(inst, LayerRule):
            raise TypeError(f"register_rule: {rule!r} is not a LayerRule")
        for t in module_types:
            _BY_TYPE[t] = inst
        if match is not None:
            _BY_MATCH.append((match, inst))
        return rule
    return add


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for ``module``'s own parameters, or None if it is not supported: first by
    exact type, then the registered matchers, most recent first."""
    rule = _BY_TYPE.get(type(module))
    if rule is not None:
        return rule
    for match, r in reversed(_BY_MATCH):
        if match(module):
            return r
    return None


# --------------------------------------------------------------------------- helpers shared by rules


def _row_sums(G3: torch.Tensor) -> torch.Tensor:
    """Σ_t G[r, t] per row in float32 (float64): the bias gradient of each row."""
    return G3.sum(1, dtype=acc_dtype(G3))


def _bias_sq(per_row: torch.Tensor, units: Units) -> torch.Tensor:
    per_unit = units.rows_to_units(per_row)
    return (per_unit * per_unit).sum(-1)


def _pair_sum_two(Ai, Gi, Aj, Gj, units: Units, gram_a: torch.Tensor | None = None) -> torch.Tensor:
    """Per unit Σ_{r,r' in u} ⟨A_i,r A_j,r'ᵀ, G_i,r G_j,r'ᵀ⟩ (Gram matrices by ``lowp``:
    exact products, float32 sums, no float32 copy of A or G on tensor cores)."""
    ga = gram_a if gram_a is not None else lowp.gram(Ai, Aj)
    gg = lowp.gram(Gi, Gj)
    dt = lowp.acc_dtype(ga, gg)
    diag = (ga.to(dt) * gg.to(dt)).sum((1, 2))
    out = units.rows_to_units(diag)
    if not units.identity and units.pair_a is not None and units.pair_a.numel():
        a, b = units.pair_a, units.pair_b
        cross = (lowp.gram(Ai[a], Aj[b]).to(dt) * lowp.gram(Gi[a], Gj[b]).to(dt)).sum((1, 2))
        out = out + units.pairs_to_units(cross)
    return out
