"""A Linear's ghost norm from low-precision Gram matrices, with an a-posteriori bound
(issue 50, item 6).

The ghost norm of a Linear is ⟨A Aᵀ, G Gᵀ⟩ over a unit's row pairs (``norms`` module
docstring). Today's Gram side is float64 (``lowp.gram``): exact products and a bound
γ_{d+p+h}(2⁻⁵³)·N_u², at the FP64 rate. Here the two Gram matrices are formed with float32
accumulation instead — ``lowp.bmm_fast``: bf16/fp16 operands on tensor cores in chains of
``CHUNK_T`` positions on CUDA, widened float32 operands in IEEE float32 elsewhere — and the
bound is computed from the entries themselves, not assumed from the norms alone.

The bound (per unit u; t, s range over the positions of the unit's rows, every row pair
(r, r') of the unit included: the cross pairs' Gram matrices are formed the same way)
----------------------------------------------------------------------------------------
Let a_ts = A_t·A_s and b_ts = G_t·G_s (exact), ã_ts and b̃_ts the computed float32
entries, n_t ≥ ‖A_t‖ and m_t ≥ ‖G_t‖ (``lowp.row_norms``: upper bounds, exactly 0 for a
row of zeros). ``lowp.gram_fast_bound`` gives (u, k) with, for a contraction of length d,

    |ã_ts − a_ts| ≤ γ_k(u)·Σ_i |A_ti|·|A_si| + η ≤ γ_a·n_t·n_s + η_a      (Cauchy–Schwarz)

γ_a = γ_k(u) (any order of the chain: Higham §3.1; the tensor cores' model of ``lowp``),
and η_a = 4(d + 1)·2⁻¹²⁶ an absolute term for underflow: a product or partial sum below
float32's normal range loses at most 2⁻¹²⁶ (flushed to zero) or 2⁻¹⁵⁰ (gradual), at most
2d such events, each amplified by at most 1 + γ < 2 (subnormal bf16/fp16 operands themselves
are taken as ``lowp``'s tensor-core model takes them: exact products). A row of zeros gives exact zeros: the
error of (t, s) is 0 when n_t = 0 or n_s = 0. With τ_a = √(η_a/γ_a) and
n̂_t = n_t + τ_a where n_t > 0 (0 elsewhere), rounded up, both cases read

    e^a_ts := |ã_ts − a_ts| ≤ γ_a·n̂_t·n̂_s,     likewise  e^b_ts ≤ γ_g·m̂_t·m̂_s.

Then, exactly (ã b̃ − a b = (ã − a)·b̃ + ã·(b̃ − b) − (ã − a)·(b̃ − b)),

    |Σ ã b̃ − Σ a b| ≤ Σ e^a |b̃| + Σ |ã| e^b + Σ e^a e^b
                    ≤ γ_a·Σ n̂_t n̂_s |b̃_ts| + γ_g·Σ |ã_ts| m̂_t m̂_s + γ_a γ_g·N̂_u²,

N̂_u = Σ_t n̂_t m̂_t (the last sum factorizes: Σ_ts n̂_t n̂_s m̂_t m̂_s = N̂_u²). The value
returned is V = Σ ã b̃ summed in float64: each ã·b̃ is exact in float64 (two float32
values), the two-step sum over s then t, over the unit's rows and row pairs, is within
γ_h(2⁻⁵³)·Σ|ã b̃|, h = ``Units.pair_count``, and |ã_ts| ≤ n_t n_s + e^a_ts ≤
(1 + γ_a)·n̂_t n̂_s, so Σ|ã b̃| ≤ (1 + γ_a)(1 + γ_g)·N̂_u². Altogether

    |V − ‖g_u‖²| ≤ E_u = γ_a·E_a + γ_g·E_g + (γ_a γ_g + γ_h·(1 + γ_a)(1 + γ_g))·N̂_u²,

E_a = Σ n̂_t n̂_s |b̃_ts|, E_g = Σ |ã_ts| m̂_t m̂_s. E_a and E_g are sums of nonnegative
terms formed in float64 (|b̃|·n̂_s, the sum over s, times n̂_t, the sum over t, the unit's
rows and pairs: at most h + K + 2 roundings, K the most rows a unit has), so each is
rounded up by ``norms.up`` with that count; N̂_u likewise; the γ's are rounded up
(``lowp.gamma``) and the final combination (four products, three sums) is rounded up once
more. E_u is computed, not assumed: when the Gram entries are small against the norm
products (|b̃_ts| ≪ m_t m_s off the diagonal, the usual case in high dimension), it is far
below the a-priori γ·N_u²; when they are not — a massive activation channel makes
|ã_ts| ≈ n_t n_s while G cancels — E_u is a real part of ‖g_u‖², ρ_u exceeds the fallback
threshold and the engine recomputes the unit exactly (``norms`` module docstring, 4): the
bound costs time there, never privacy.

Not covered by the model: a float32 overflow (an entry past 2¹²⁸, i.e. row norms near
2⁶⁴). It makes the value non-finite, and a unit with a non-finite norm adds nothing
(``norms.factors``): utility, never privacy.

When (``use_lowp``): the policy is ``"auto"`` unless a test or benchmark forces it
(``forced``). Auto takes this path for T ≤ ``T_MAX`` on CUDA with bf16/fp16 operands on
tensor cores where the cost model (``lowp_gram_cheaper``) says it is cheaper than the
float64 Grams and than the tile kernel, and on the CPU for float32 (or narrower) operands
of every Linear with p + d ≥ ``CPU_MIN_WIDTH`` (measured: there it is the cheaper).
Its Grams are ``lowp.gram_fast``'s chunked float32 GEMMs (``CHUNK_T`` positions on tensor
cores, ``GRAM_CHUNK`` elsewhere): each chunk's partial result is added to the float32
output in memory, so the model counts those adds' bytes (and the float64 bound
arithmetic) at the device's bandwidth, a fixed cost per chunk (``CHUNK_FIXED_S``, measured
on an H200), as well as the tensor-core FLOPs; the entry bound γ then grows with the chunk
and the number of chunks, not with the contraction's length (``lowp.gram_fast_bound``).
On the H200 these chunked GEMMs were slower than the tile kernel at every layer of the
1.6 B benchmark model (BENCHMARKS, issue 52), and the model no longer takes them there or on
an H100; where float64 is slow (an L40S) it can. A Gram kernel of our own (one launch, the
chunks' sums in registers) is what would make this path pay on such GPUs.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from llmdp.clipping import lowp
from llmdp.clipping.lowp import U64, gamma

F64 = torch.float64
POLICIES = ("auto", "lowp", "float64")
T_MAX = 512  # auto takes the low-precision Grams only up to this many positions per row
_policy = "auto"


@contextmanager
def forced(policy: str):
    """Force the Gram path of Linear ghost norms: ``"lowp"`` (wherever the operands are not
    float64; on the CPU too: tests, benchmarks), ``"float64"`` (today's float64 Grams or
    the tile kernel, never this path), ``"auto"`` (the cost model)."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"gram policy {policy!r} is not one of {list(POLICIES)}")
    prev, _policy = _policy, policy
    try:
        yield
    finally:
        _policy = prev


def eligible(A3: torch.Tensor, G3: torch.Tensor) -> bool:
    """Floating operands, neither float64 (float64 operands gain nothing here)."""
    return all(t.is_floating_point() and t.dtype != F64 for t in (A3, G3))


# Bytes per Gram entry of this path beyond its GEMMs: the float64 bound arithmetic (the
# float32 entries read and widened, products and their sums for V, E_a and E_g): ~20
# float64 reads/writes of each of the two [R, T, T] matrices.
BOUND_BYTES = 160


# On the CPU the float32 Grams (``lowp.gram_fast``: IEEE float32 GEMMs of ``GRAM_CHUNK``
# positions) run at 2-3x the float64 ones' rate and need no float64 copy of A and G; the
# bound's float64 arithmetic (~20 ns per Gram entry on one core) is what they cost beyond
# their GEMMs. Measured on one core (BENCHMARKS, issue 50): float64 faster only for the
# narrowest layers; from p + d = 256 on the float32 Grams win (1.7x at 512, 2.3x at 8,448,
# 3.1x for a 32,000-wide LM head).
CPU_MIN_WIDTH = 256


# Measured on an H200 (BENCHMARKS, issue 52; ``benchmarks/kernels.py``): each chunk of
# ``lowp.bmm_fast`` (a ``bmm(out_dtype=float32)`` of CHUNK_T positions and the ``add_`` of its
# result) took 24-39 µs whatever its FLOPs, at 2-8 M Gram entries: two launches and their
# tails, and 16 bytes per entry (the bmm's float32 write; the add's two reads and its write).
# At every layer shape of the 1.6 B benchmark model the Gram path was the slower one there
# (0.77-39.7 ms against the tile kernel's 0.26-20.0 ms); a model of 8 bytes and no fixed
# cost sent the 128k LM head at T256 x 32 to it (1,018 chunks: 39.7 ms, not 20.0).
CHUNK_FIXED_S = 20e-6  # per chunk, on CUDA
CHUNK_BYTES = 16.0  # per Gram entry and chunk


def lowp_gram_cheaper(rows: int, T: int, p: int, d: int, spec, tile_time: float | None) -> bool:
    """This path's time against the float64 Grams' (2·R·T²·(p+d) float64 FLOPs) and, where
    the tile kernel serves, its time ``tile_time``: 2·R·T²·(p+d) FLOPs at ``spec.flops``,
    plus, per chunk of ``CHUNK_T`` positions, ``CHUNK_FIXED_S`` and ``CHUNK_BYTES`` per Gram
    entry (the chunked GEMMs' float32 results and adds), plus the bound's float64
    arithmetic (``BOUND_BYTES`` per entry), the bytes at ``spec.bandwidth``."""
    from llmdp.clipping._triton_rowscaled import CHUNK_T

    chunks = math.ceil(p / CHUNK_T) + math.ceil(d / CHUNK_T)
    t = 2.0 * rows * T * T * (p + d) / spec.flops + chunks * CHUNK_FIXED_S
    t += rows * T * T * (CHUNK_BYTES * chunks + 2 * BOUND_BYTES) / spec.bandwidth
    best = 2.0 * rows * T * T * (p + d) / spec.fp64
    if tile_time is not None:
        best = min(best, tile_time)
    return t < best


def use_lowp(A3: torch.Tensor, G3: torch.Tensor, spec, tile_time: float | None) -> bool:
    """Whether a Linear's ghost norm takes this path (module docstring, "When")."""
    if _policy == "float64" or not eligible(A3, G3):
        return False
    if _policy == "lowp":
        return True
    if G3.shape[1] > T_MAX:
        return False
    if lowp.on_cpu(G3):
        return G3.shape[-1] + A3.shape[-1] >= CPU_MIN_WIDTH
    if not (lowp.tensor_cores(A3, A3) and lowp.tensor_cores(G3, G3)):
        return False
    return lowp_gram_cheaper(G3.shape[0], G3.shape[1], G3.shape[-1], A3.shape[-1], spec, tile_time)


def gram32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x [R, T, a], y [R, S, a] -> x yᵀ [R, T, S] in float32 (``lowp.gram_fast``)."""
    return lowp.gram_fast(x, y.transpose(1, 2))


def self_gram32(x: torch.Tensor) -> torch.Tensor:
    """gram32(x, x): ``Units.cached``'s maker."""
    return gram32(x, x)


def entry_gamma(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(γ, η) of ``gram32(x, y)``'s entries: |ã_ts − a_ts| ≤ γ·‖x_t‖·‖y_s‖ + η
    (module docstring)."""
    a = x.shape[-1]
    u, k = lowp.gram_fast_bound(x, y.transpose(1, 2), a)
    return gamma(k, u), 4.0 * (a + 1) * 2.0**-126


def padded_norms(n: torch.Tensor, g: float, eta: float) -> torch.Tensor:
    """n̂ = n + √(η/γ) where n > 0, 0 where n = 0, never below n + √(η/γ) (module docstring)."""
    return _padded(n, _tau(g, eta))


def _tau(g: float, eta: float) -> float:
    return math.sqrt(eta / g) * (1.0 + 4.0 * U64)  # the quotient and the root, rounded up


def _padded(n: torch.Tensor, tau) -> torch.Tensor:
    """``padded_norms`` with τ given (a float, or a vector broadcasting along n's rows)."""
    inf = torch.full_like(n, math.inf)
    return torch.where(n > 0, torch.nextafter(n + tau, inf), torch.zeros_like(n))


def _weighted(abs_gram: torch.Tensor, wl: torch.Tensor, wr: torch.Tensor) -> torch.Tensor:
    """Σ_{t,s} wl_t·|M_ts|·wr_s per row, in float64 ([R, T, S], [R, T], [R, S] -> [R])."""
    inner = torch.bmm(abs_gram, wr.unsqueeze(2)).squeeze(2)  # Σ_s |M_ts| wr_s
    return (inner * wl).sum(1)


def _pair_parts(ga: torch.Tensor, gg: torch.Tensor, na_l, na_r, mg_l, mg_r):
    """(V, E_a, E_g) per row from float32 Grams ga, gg [R, T, S] and the padded norms of
    their left and right rows."""
    ga64, gg64 = ga.to(F64), gg.to(F64)
    value = (ga64 * gg64).sum(2).sum(1)
    e_a = _weighted(gg64.abs_(), na_l, na_r)
    e_g = _weighted(ga64.abs_(), mg_l, mg_r)
    return value, e_a, e_g


def sq_norm(A3: torch.Tensor, G3: torch.Tensor, units, gram_a: torch.Tensor | None = None,
            norms_a=None, norms_g=None):
    """Per unit (V, E): V = Σ ã b̃ over the unit's row pairs in float64, E ≥ |V − ‖g_u‖²|
    (module docstring), both [U] float64. ``gram_a``: gram32(A3, A3) if known (shared
    between the layers that read A, ``Units.shared``); ``norms_a``, ``norms_g``:
    lowp.row_norms(A3), lowp.row_norms(G3) (or their `lowp.LazyRowNorms`) if known.

    Units of one row each, on the CPU under book-keeping (``Units.defer``), Grams up to
    ``PendingGram.MAX_BYTES``: (p, p) for one `PendingGram` p, formed in the step's bound
    computation with the other calls of its shape (``PendingGram.form_all``)."""
    g_a, eta_a = entry_gamma(A3, A3)
    g_g, eta_g = entry_gamma(G3, G3)
    n = norms_a if norms_a is not None else lowp.row_norms(A3)
    m = norms_g if norms_g is not None else lowp.row_norms(G3)
    ga = gram_a if gram_a is not None else gram32(A3, A3)
    gg = gram32(G3, G3)
    if not units.has_pairs:
        p = PendingGram(ga, gg, n, m, g_a, eta_a, g_g, eta_g, units)
        if lowp.cpu_deferral(G3, units.defer) and p.nbytes <= PendingGram.MAX_BYTES:
            return p, p
        return p.form()
    na = padded_norms(lowp.resolved(n), g_a, eta_a)
    mg = padded_norms(lowp.resolved(m), g_g, eta_g)
    value, e_a, e_g = (units.rows_to_units(x) for x in _pair_parts(ga, gg, na, na, mg, mg))
    a, b = units.pair_a, units.pair_b
    pv, pa, pg = _pair_parts(gram32(A3[a], A3[b]), gram32(G3[a], G3[b]), na[a], na[b], mg[a], mg[b])
    value = value + units.pairs_to_units(pv)
    e_a = e_a + units.pairs_to_units(pa)
    e_g = e_g + units.pairs_to_units(pg)
    return _bound(value, e_a, e_g, units.rows_to_units((na * mg).sum(1)), units, A3.shape[1], g_a, g_g)


def _bound(value, e_a, e_g, nm, units, T: int, g_a, g_g):
    """(V, E) from V, E_a, E_g and Σ n̂_t m̂_t (``nm``) per unit, for Grams over T positions.
    ``g_a``, ``g_g``: floats, or [calls, 1] vectors for [calls, U] stacks (``_finish``: the
    same float64 operations per entry)."""
    h = units.pair_count(T, T)
    k = h + units.max_rows + 2  # E_a, E_g: two products per term, the sums of V's
    up1 = 1.0 + gamma(k + 1, U64)
    n_hat = nm * (1.0 + gamma(T + units.max_rows + 3, U64))
    second = g_a * g_g + gamma(h, U64) * (1.0 + g_a) * (1.0 + g_g)
    second *= 1.0 + gamma(6, U64)  # its own roundings (at most five a term), upward
    err = g_a * (e_a * up1) + g_g * (e_g * up1) + second * (n_hat * n_hat)
    return value, err * (1.0 + gamma(12, U64))


class PendingGram:
    """``sq_norm``'s (V, E) for units of one row each, not yet formed (issue 50): the call's
    two float32 Grams and its row norms (possibly `lowp.LazyRowNorms`) kept until the step's
    bound computation (``stacked.Stack.of``), where ``form_all`` takes the calls of one
    shape and one set of units at once: their Grams and norms stacked [calls, R, T, S], the
    same float64 operations on them, each call's constants (γ, η, its second-order term) a
    vector along the first axis — the same IEEE operations on the same operands per entry,
    so the same bits as ``form()`` on its own (tests/clipping/test_deferred_norms.py). On
    the CPU, ~35 small operations per call become ~35 per step. Kept only up to
    ``MAX_BYTES`` of Grams per call (the engine keeps A and G anyway; a Gram over T ≤ 128
    positions of 8 rows is 0.5 MB)."""

    __slots__ = ("ga", "gg", "na", "ng", "g_a", "eta_a", "g_g", "eta_g", "units")
    MAX_BYTES = 1 << 20

    def __init__(self, ga, gg, na, ng, g_a, eta_a, g_g, eta_g, units):
        self.ga, self.gg, self.na, self.ng = ga, gg, na, ng
        self.g_a, self.eta_a, self.g_g, self.eta_g, self.units = g_a, eta_a, g_g, eta_g, units

    @property
    def nbytes(self) -> int:
        return self.ga.numel() * self.ga.element_size() + self.gg.numel() * self.gg.element_size()

    def form(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _finish([self])[0]

    @staticmethod
    def form_all(items: list[PendingGram]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each one's ``form()``: those of one Gram shape, dtype, device and set of units in
        one pass; their deferred row norms first, all at once."""
        lowp.LazyRowNorms.form_all([n for p in items for n in (p.na, p.ng)])
        out: list = [None] * len(items)
        for idx in lowp.group_by(items, lambda p: (tuple(p.ga.shape), tuple(p.gg.shape), p.ga.dtype,
                                                   p.gg.dtype, p.ga.device, id(p.units))):
            for i, r in zip(idx, _finish([items[i] for i in idx])):
                out[i] = r
        return out


def _finish(items: list[PendingGram]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(V, E) of each of ``items`` (one shape, one set of units of one row each): one call
    as ``sq_norm`` forms it, or many on stacks, the calls' rows as one batch of C·R rows for
    ``_pair_parts`` and each call's constants (τ, γ) a vector along the calls."""
    first, C = items[0], len(items)
    units, dev = first.units, first.ga.device
    R, T, S = first.ga.shape

    def stacked(ts: list[torch.Tensor]) -> torch.Tensor:
        return ts[0].unsqueeze(0) if C == 1 else torch.stack(ts)

    def per_call(vals: list[float], dims: int):
        if C == 1:
            return vals[0]
        return torch.tensor(vals, dtype=F64, device=dev).view(C, *([1] * dims))

    na = _padded(stacked([lowp.resolved(p.na) for p in items]), per_call([_tau(p.g_a, p.eta_a) for p in items], 2))
    mg = _padded(stacked([lowp.resolved(p.ng) for p in items]), per_call([_tau(p.g_g, p.eta_g) for p in items], 2))
    na2, mg2 = na.view(C * R, T), mg.view(C * R, T)
    parts = _pair_parts(stacked([p.ga for p in items]).view(C * R, T, S),
                        stacked([p.gg for p in items]).view(C * R, T, S), na2, na2, mg2, mg2)

    def to_units(x: torch.Tensor) -> torch.Tensor:  # [C·R] -> [C, U]
        return units.rows_to_units(x.view(C, R).t()).t()

    value, e_a, e_g = (to_units(x) for x in parts)
    value, err = _bound(value, e_a, e_g, to_units((na2 * mg2).sum(1)), units, T,
                        per_call([p.g_a for p in items], 1), per_call([p.g_g for p in items], 1))
    return [(value[j], err[j]) for j in range(C)]
