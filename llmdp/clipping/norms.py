"""Registry of per-unit gradient rules, by module type.

For every supported module, a *rule* knows, from the module's input A (kept by a forward
hook) and the gradient G of the loss at its output (seen during the backward pass):

* ``sq_norms``   each unit's squared gradient norm for the module's own parameters,
  either by the **ghost** identity ‖Σ_t G_t A_tᵀ‖² = ⟨A Aᵀ, G Gᵀ⟩ over the unit's tokens
  (O(T²(p+d)) per unit, never forming the p×d gradient) or by **instantiating** the
  unit's gradient (O(p·d) per unit, then reused for the clipped sum);
* ``clipped``    Σ_u c_u · g_u, from the same A and G (book-keeping: no second backward).

Only modules whose output at one row depends on that row alone have rules; anything else
is refused by the engine (DESIGN §3.6): no silent fallback.

Units: ``unit_of_row[r]`` is row r's unit (−1: padding row). A unit's gradient is the sum
over its rows, so its ghost norm sums ⟨A_r A_r'ᵀ, G_r G_r'ᵀ⟩ over all pairs of its rows.
"""

from __future__ import annotations

from collections import OrderedDict
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


class LinearRule(LayerRule):
    """nn.Linear (weight [out, in]) and, with ``transposed``, HF GPT-2 Conv1D ([in, out])."""

    has_clipped_ghost = True

    def __init__(self, transposed: bool = False):
        self.transposed = transposed

    def choose_ghost(self, module, A, G, policy, num_units):
        if policy != "auto":
            return policy == "ghost"
        G3 = _as_3d(G)
        spec = device_spec(G.device, G.dtype)
        return _ghost_cheaper(num_units, G3.shape[0], G3.shape[1], G.shape[-1], A.shape[-1], spec)

    # Every contraction goes through ``lowp`` on A and G as the model produced them: exact
    # products, float32 (float64) sums, on tensor cores for bf16/fp16 on CUDA. The norms
    # and the clipped sum are so formed from the same values (DESIGN §3.8).

    def sq_norms_ghost(self, rec, units):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            out["weight"] = _gram_pair_sum(A3, G3, units)
        if module.bias is not None and module.bias.requires_grad:
            out["bias"] = _bias_sq(_row_sums(G3), units)  # the bias gradient of each row
        return out

    def per_unit(self, rec, units):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            per_row = lowp.per_row_tn(A3, G3) if self.transposed else lowp.per_row_tn(G3, A3)
            out["weight"] = units.rows_to_units(per_row)
        if module.bias is not None and module.bias.requires_grad:
            out["bias"] = units.rows_to_units(_row_sums(G3))
        return out

    def clipped_ghost(self, rec, row_factors):
        module = rec.module
        A3, G3 = _as_3d(rec.A), _as_3d(rec.G)
        out = {}
        if module.weight.requires_grad:
            # Σ_r c_r G_rᵀA_r, the factor applied in float32 (never to a bf16 operand).
            out["weight"] = (lowp.row_scaled_tn(A3, G3, row_factors) if self.transposed
                             else lowp.row_scaled_tn(G3, A3, row_factors))
        if module.bias is not None and module.bias.requires_grad:
            s = _row_sums(G3)
            out["bias"] = (s * row_factors.to(s.dtype)[:, None]).sum(0)
        return out


def _row_sums(G3: torch.Tensor) -> torch.Tensor:
    """Σ_t G[r, t] per row in float32 (float64): the bias gradient of each row."""
    return G3.sum(1, dtype=acc_dtype(G3))


def _bias_sq(per_row: torch.Tensor, units: Units) -> torch.Tensor:
    per_unit = units.rows_to_units(per_row)
    return (per_unit * per_unit).sum(-1)


class EmbeddingRule(LayerRule):
    """nn.Embedding (and Gemma's scaled word embedding): y_t = E[id_t] (· scale)."""

    has_clipped_ghost = True

    def _ids_and_G(self, rec: Record):
        """Token ids [R, T] and the rows' gradients w.r.t. the gathered table rows, widened
        to float32 (float64) *before* the scale is applied: the norms, the cross terms and
        the clipped sum all read these same values (an embedding's G is [R, T, d], small)."""
        module = rec.module
        G = rec.G
        R = G.shape[0]
        ids = rec.A.reshape(rec.A.shape[0], -1)
        if ids.shape[0] != R:  # shared indices, e.g. learned position ids of shape [1, T]
            ids = ids.expand(R, -1)
        G3 = G.reshape(R, ids.shape[1], -1)
        G3 = G3.to(acc_dtype(G3))
        scale = getattr(module, "embed_scale", None)
        if scale is not None:  # Gemma: y = E[ids] * scale
            G3 = G3 * scale.to(G3.dtype)
        if module.padding_idx is not None:  # nn.Embedding never updates the padding row
            G3 = G3.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0)
        return ids, G3

    def choose_ghost(self, module, A, G, policy, num_units):
        if policy != "auto":
            return policy == "ghost"
        R, T = G.shape[0], G.reshape(G.shape[0], -1, G.shape[-1]).shape[1]
        V, d = module.weight.shape
        # Kept anyway: the output gradient [R, T, d] (the input is token ids).
        return num_units * V * d > R * T * d

    def sq_norms_ghost(self, rec, units):
        if not rec.module.weight.requires_grad:
            return {}
        ids, G3 = self._ids_and_G(rec)
        # Σ_{t,s} [id_t = id_s] ⟨G_t, G_s⟩: equal-token mask instead of a one-hot [T, V].
        same = (ids[:, :, None] == ids[:, None, :]).to(G3.dtype)
        diag = (same * torch.bmm(G3, G3.transpose(1, 2))).sum((1, 2))
        out = units.rows_to_units(diag)
        if not units.identity and units.pair_a is not None and units.pair_a.numel():
            a, b = units.pair_a, units.pair_b
            same_ab = (ids[a][:, :, None] == ids[b][:, None, :]).to(G3.dtype)
            cross = (same_ab * torch.bmm(G3[a], G3[b].transpose(1, 2))).sum((1, 2))
            out = out + units.pairs_to_units(cross)
        return {"weight": out}

    def per_unit(self, rec, units):
        module = rec.module
        if not module.weight.requires_grad:
            return {}
        ids, G3 = self._ids_and_G(rec)
        keep = units.keep
        uid = units.unit_of_row[keep].unsqueeze(1).expand(-1, ids.shape[1])
        out = G3.new_zeros((units.num_units, *module.weight.shape))
        out.index_put_((uid.reshape(-1), ids[keep].reshape(-1)), G3[keep].reshape(-1, G3.shape[-1]),
                       accumulate=True)
        return {"weight": out}

    def clipped_ghost(self, rec, row_factors):
        ids, G3 = self._ids_and_G(rec)
        Gc = G3 * row_factors.to(G3.dtype)[:, None, None]
        out = Gc.new_zeros(rec.module.weight.shape)
        out.index_add_(0, ids.reshape(-1), Gc.reshape(-1, Gc.shape[-1]))
        return {"weight": out}


class RowwiseRule(LayerRule):
    """Normalization layers (LayerNorm, the RMSNorm variants, GroupNorm): their parameters
    are d-vectors, so per-unit gradients are small and always instantiated, by a vectorized
    vector-Jacobian product of the module re-run on each row alone (exact for any such
    module, whatever its formula: Llama's w·x̂, Gemma's (1+w)·x̂, LayerNorm's w·x̂+b)."""

    def per_unit(self, rec, units):
        from torch.func import functional_call, vjp, vmap

        module = rec.module
        params = {n: p.detach() for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not params:
            return {}
        frozen = {n: p.detach() for n, p in module.named_parameters(recurse=False) if not p.requires_grad}

        def one(a, g):
            def f(p):
                return functional_call(module, {**p, **frozen}, (a.unsqueeze(0),))

            _, pullback = vjp(f, params)
            return pullback(g.unsqueeze(0))[0]

        per_row = vmap(one)(rec.A, rec.G)
        return {n: units.rows_to_units(per_row[n]) for n in params}


_LINEAR, _CONV1D, _EMBEDDING, _ROWWISE = LinearRule(), LinearRule(transposed=True), EmbeddingRule(), RowwiseRule()


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for ``module``'s own parameters, or None if it is not supported.

    Matching is by exact type (a subclass may change the forward, as Gemma's scaled
    embedding does), plus the HF classes whose forward is known.
    """
    t = type(module)
    if t is nn.Linear:
        return _LINEAR
    if t is nn.Embedding or (isinstance(module, nn.Embedding) and t.__name__.endswith("ScaledWordEmbedding")):
        return _EMBEDDING
    if t.__name__ == "Conv1D" and hasattr(module, "nf"):
        return _CONV1D
    if t in (nn.LayerNorm, nn.GroupNorm) or t.__name__.endswith("RMSNorm"):
        return _ROWWISE
    return None


# --------------------------------------------------------------------------- shared parameters


def cross_inner(ri: Record, rj: Record, pname_i: str, pname_j: str, units: Units) -> torch.Tensor:
    """Per unit ⟨g_i, g_j⟩ for one parameter used by two calls (tied embeddings, a module
    called twice), without forming a p×d gradient when both are ghost-capable."""
    ti, tj = type(ri.rule), type(rj.rule)
    if ti is EmbeddingRule and tj is LinearRule and not rj.rule.transposed:
        return _cross_embedding_linear(ri, rj, units)
    if tj is EmbeddingRule and ti is LinearRule and not ri.rule.transposed:
        return _cross_embedding_linear(rj, ri, units)
    if ti is LinearRule and tj is LinearRule and ri.rule.transposed == rj.rule.transposed and pname_i == pname_j == "weight":
        return _pair_sum_two(_as_3d(ri.A), _as_3d(ri.G), _as_3d(rj.A), _as_3d(rj.G), units)
    if ti is LinearRule and tj is LinearRule and pname_i == pname_j == "bias":
        bi = units.rows_to_units(_row_sums(_as_3d(ri.G)))
        bj = units.rows_to_units(_row_sums(_as_3d(rj.G)))
        return (bi * bj.to(bi.dtype)).sum(-1)
    # Anything else: instantiate both (small parameters only reach here).
    gi = ri.rule.per_unit(ri, units)[pname_i]
    gj = rj.rule.per_unit(rj, units)[pname_j]
    return (gi.reshape(gi.shape[0], -1).to(acc_dtype(gi)) * gj.reshape(gj.shape[0], -1).to(acc_dtype(gj))).sum(1)


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


def _cross_embedding_linear(re: Record, rl: Record, units: Units) -> torch.Tensor:
    """⟨embedding grad, linear grad⟩ of a tied [V, d] matrix, per unit:
    Σ_t Σ_s G_lin[s, id_t] ⟨G_emb,t, A_lin,s⟩ — a T×T computation, no V×d tensor."""
    ids, Ge = re.rule._ids_and_G(re)  # float32 (float64)
    Al, Gl = _as_3d(rl.A), _as_3d(rl.G)  # as the model produced them (Gl is [R, T, V])

    def one(e_ids, ge, al, gl):  # rows of the embedding call, rows of the linear call
        # P[s, t] = G_lin[s, id_t] (gathered, then widened: [R, T, T]); M[s, t] = ⟨A_lin,s, G_emb,t⟩
        P = torch.gather(gl, 2, e_ids[:, None, :].expand(-1, gl.shape[1], -1)).to(ge.dtype)
        M = lowp.bmm(al, ge.transpose(1, 2))
        return (P * M.to(ge.dtype)).sum((1, 2))

    diag = one(ids, Ge, Al, Gl)
    out = units.rows_to_units(diag)
    if not units.identity and units.pair_a is not None and units.pair_a.numel():
        a, b = units.pair_a, units.pair_b
        out = out + units.pairs_to_units(one(ids[a], Ge[a], Al[b], Gl[b]))
    return out
