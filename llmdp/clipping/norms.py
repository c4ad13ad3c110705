"""Per-unit gradient rules: their interface, the registry by module type, shared helpers,
and the rounding-error bounds that make the norm used for clipping never too small.

For every supported module, a *rule* knows, from the module's input A (kept by a forward
hook) and the gradient G of the loss at its output (seen during the backward pass):

* ``sq_norms_ghost``  each unit's squared gradient norm for the module's own parameters
  by the **ghost** identity ‖Σ_t G_t A_tᵀ‖² = ⟨A Aᵀ, G Gᵀ⟩ over the unit's tokens
  (O(T²(p+d)) per unit, never forming the p×d gradient), with its error bounds (`Sq`);
* ``instantiate``     or each unit's gradient itself (O(p·d) per unit, then reused for the
  clipped sum), with the bounds of its norm;
* ``clipped_ghost``   Σ_u c_u · g_u, from the same A and G (book-keeping: no second backward);
* ``exact``           one unit's gradient in float64, a slice at a time (the fallback below).

Only modules whose output at one row depends on that row alone have rules; anything else
is refused by the engine (DESIGN, invariant `no-silent-fallbacks`): no silent fallback. The built-in rules live in
``rules/`` (one file per family: linear, embedding, normalization layers) and register
themselves with :func:`register_rule`; cross terms between two uses of one parameter are in
``cross.py``.

Units: ``unit_of_row[r]`` is row r's unit (−1: padding row). A unit's gradient is the sum
over its rows, so its ghost norm sums ⟨A_r A_r'ᵀ, G_r G_r'ᵀ⟩ over all pairs of its rows.

The norm used for clipping is never below the true norm (DESIGN, invariant `precision-never-widens`)
------------------------------------------------------------------------
The exact per-unit gradient g_u is the one A and G define (as the model produced them);
what the engine adds for unit u is a_u, formed in floating point. Clipping needs a number
ν_u with ‖g_u‖ ≤ ν_u and ‖a_u‖ ≤ c_u·ν_u for c_u = min(1, C/ν_u): then ‖a_u‖ ≤ C, not only
in tests. The float32 ghost norm had neither: ⟨AAᵀ, GGᵀ⟩ is a sum of T² terms, and when
the unit's inputs share a large component (a "massive activation" channel) while its
output gradients cancel across positions, the terms are huge and the result their small
difference, lost to rounding — down to a negative number, which was clamped to 0 (factor
1: a contribution of 85,524·C was measured). Now:

1. *Everything on the norm side is float64 with a bound.* Operands are widened to float64
   (exact), products of float32-or-narrower values are exact in float64, and a dot
   product or sum of n terms, in any order, is within γ_n·Σ|terms| of the exact value,
   γ_n = n·u/(1 − n·u), u = 2⁻⁵³ (``lowp.gamma``). For the ghost norm of a Linear,
   ã_ts = fl(A_t·A_s), b̃_ts = fl(G_t·G_s) satisfy |ã − a| ≤ γ_{d+1}·|A_t|·|A_s|,
   |b̃ − b| ≤ γ_{p+1}·|G_t|·|G_s|; the T×T products and their two-step sum (over s, then
   over t: height T + S, not T·S), then over a unit's row pairs, add γ_h, so

       |Ŝ_u − ‖g_u‖²| ≤ γ_{d+p+h+4} · Σ_{t,s} (|A_t|·|A_s|)(|G_t|·|G_s|) ≤ γ_{d+p+h+4} · N_u²,

   N_u = Σ_t ‖A_t‖·‖G_t‖ over the unit's positions (Cauchy–Schwarz; N_u ≥ ‖|G|ᵀ|A|‖, the
   norm of the entrywise magnitudes, and is computed with a relative bound and rounded
   up). The bias (‖Σ_t G_t‖²), the embedding (⟨[id_t = id_s], G Gᵀ⟩, N = Σ_t ‖G_t‖), the
   cross terms between two uses of one parameter (|err| ≤ γ·N_i·N_j), and the norms of
   instantiated per-unit gradients (their float64 sum of squares) all follow the same
   pattern. Each call and parameter returns `Sq` = (value, err, dev, rel) per unit.
2. *The clipped sum's own error is bounded too.* The sum is formed by a different
   contraction (``lowp.row_scaled_tn``: float32 over groups of ~256 positions summed in
   float64, or bf16 tensor cores with float32 accumulation on CUDA), whose error for unit
   u is, entrywise, at most γ_n(u_path)·c_u·|G_u|ᵀ|A_u|, so at most γ_n·c_u·N_u in norm:
   that is ``dev``. An instantiated layer's per-unit gradient h (float32 per-row
   contractions, ``lowp.per_row_tn``; what its clipped sum scales) is within γ_{T+K+1}·N_u
   of g_u: that too is in ``dev``, and its norm is measured on h itself. After it
   come relative roundings (the factor's cast, the result's cast to float32, a sum over
   units for instantiated layers, the add into the float32 sink): each multiplies each
   entry of the unit's part by (1 + θ), |θ| ≤ γ_k: that is ``rel`` (the sink's is added
   by the engine). For parameter P with uses i (a tied embedding and LM head, a module
   called twice): δ_P = Σ_i dev_i + rel_i·(‖h_i‖ + dev_i), where h_i is the vector whose
   norm ``value`` measures (g_i itself for a ghost norm; the stored gradient when
   instantiated, with dev_i ≥ ‖h_i − g_i‖).
3. *The norm used.* With S_u = Σ_P value, E_u = Σ_P err (+ the float64 summation's own
   γ·Σ|value|), and δ_P as above,

       ν_u = √(S_u + E_u)↑ + √(Σ_P δ_P²)↑        (↑: rounded toward +∞)

   By Minkowski, ‖a_u‖/c_u ≤ √(Σ_P (‖h_P‖ + δ_P)²) ≤ ‖h_u‖ + ‖δ‖ ≤ ν_u, and ‖g_u‖ ≤ ν_u
   likewise. S_u + E_u ≥ ‖h_u‖² ≥ 0 by construction: a negative value is a bug, and is
   raised as one, never clamped. The factor is c_u = C/ν_u rounded toward 0 (``factors``)
   when ν_u > C, else 1; so ‖a_u‖ ≤ C.
4. *Fallback to exact instantiation.* When the bound is a real part of the norm —
   ρ_u = 1 − √S_u/ν_u > ``FALLBACK`` = 1 % (a setting: ``GhostClipper(fallback=...)``,
   any value in [0, 1]; see below) — the call (or, for a shared parameter, every
   call using it) is recomputed for that unit as its exact float64 gradient, a slice at
   a time (``LayerRule.exact``), and the clipped sum takes that unit's part from it
   (c_u·g̃_u, cast to float32, added), not from the contraction; the bound is then
   γ_{RT}(2⁻⁵³)·N_u plus four relative float32 roundings of ‖g̃_u‖. Why 1 %: below it, the
   bound costs a clipped unit at most 1 % of its contribution (a 1 % shorter step in its
   direction, far inside the noise and any learning-rate tuning); above it, the float64
   gradient (2·T·p·d FLOPs per unit at the float64 rate) is the cheaper loss. The Gram
   matrices are float64, or float32 with an a-posteriori bound (``gram.py``), because
   there the cancellation lives: a float32 Gram's a-priori bound, γ_d(2⁻²⁴)·N² ≈
   2.4·10⁻⁴·N² at d = 4,096, is more than 1 % of ‖g‖² as soon as N²/‖g‖² > 40, i.e. on any
   sequence. The float32 contractions' bounds grow like
   n·2⁻²⁴·N_u/‖g_u‖ (n ≈ 256 positions on CPU, T + 2R on CUDA's tensor cores at 2⁻²²),
   N/‖g‖ ≈ 1.5·√T on random-like data: ρ ≈ 4·10⁻⁴ at T = 256; a fallback needs
   N/‖g‖ ≳ 700 (CPU) — a massive activation that cancels — or, on CUDA, T ≳ 1,000. The
   engine counts fallbacks (``GhostClipper.last_norm_stats``). The threshold is a
   setting (``GhostClipper(fallback=...)``, default ``FALLBACK``): the norm used, ν_u, is
   never below the true norm whatever it is — a larger threshold only lets a unit be
   clipped by a ν_u up to that share above its norm (over-clipping: a shorter step,
   utility), a smaller one recomputes more units exactly (time); neither changes what
   any unit can add (≤ C), so neither changes the privacy guarantee. 0 recomputes every
   unit with any bound (but a gradient that is exactly 0), 1 never recomputes. A Linear's
   ghost norm from float32 Gram matrices (``gram.py``) carries an a-posteriori bound that
   is often larger than the float64 Grams' — it is the threshold that sends the units
   where it is material to the exact path.

What is not covered: the float32 sums over *other* units. Removing unit u changes how
the other units' parts round in the shared float32 sink (by at most float32's relative
precision of their sum); that is the same for every float32 DP-SGD implementation and is
far below the noise, but it is not part of the bound above.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from llmdp.clipping import lowp
from llmdp.clipping.lowp import U32, U64, gamma

GRAM_MEMORY = 2  # input Gram matrices remembered at once (Units.self_gram)
# ρ_u above which a unit's call is recomputed exactly, by default (module docstring, 4;
# ``GhostClipper(fallback=...)``): a utility/time trade-off, never a privacy one.
FALLBACK = 1e-2


def check_fallback(fallback) -> float:
    """A fallback threshold: a number in [0, 1] (ρ_u is in [0, 1])."""
    try:
        f = float(fallback)
    except (TypeError, ValueError):
        raise ValueError(f"fallback must be a number in [0, 1], got {fallback!r}") from None
    if isinstance(fallback, bool) or not 0.0 <= f <= 1.0:
        raise ValueError(f"fallback must be a number in [0, 1], got {fallback!r}")
    return f
F64 = torch.float64


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of the engine's results for operands like ``t``: float64 for float64,
    float32 otherwise (norms are float64 whatever the operands)."""
    return lowp.result_dtype(t)


def roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of a result stored in ``dtype`` (float32 for anything narrower)."""
    return U64 if dtype == torch.float64 else U32


def fingerprint(G) -> torch.Tensor:
    """Per row (Σ G², Σ G) in float32: pass 2 must see pass 1's G bit for bit (any
    rounding difference changes these). Non-finite values map to sentinels so that a
    NaN row compares equal to itself. A call with several outputs (the generic rule's):
    their fingerprints, flattened and concatenated."""
    if isinstance(G, tuple):
        return torch.cat([fingerprint(g).reshape(-1) for g in G])
    g = G.detach().reshape(G.shape[0], -1)
    dt = acc_dtype(g)
    fp = torch.stack([torch.linalg.vector_norm(g, dim=1, dtype=dt), g.sum(1, dtype=dt)], 1)
    return torch.nan_to_num(fp, nan=-1.0, posinf=-2.0, neginf=-3.0)


# --------------------------------------------------------------------------- bounds


class Sq:
    """One call's squared gradient norm for one parameter, per unit, with its bounds (all
    [U] float64; module docstring, 1–2):

    * ``value``: the computed ‖h_u‖², h_u the vector measured (g_u itself for a ghost
      norm; the stored per-unit gradient when instantiated);
    * ``err``:   |value − ‖h_u‖²| ≤ err;
    * ``dev``:   ‖h_u − g_u‖ plus the clipped sum's absolute error for the unit (both in
      units of c_u), before the relative roundings;
    * ``rel``:   γ of the relative roundings of the unit's part after that, but for the
      sink's own add (the engine's);
    * ``mag``:   N_u, an upper bound on ‖|G_u|ᵀ|A_u|‖ (cross terms and the fallback use it).

    Deferred arithmetic (issue 50: one bound computation per step). Most bounds are a
    constant times a tensor the rule has anyway; formed call by call, each is a GPU launch.
    A rule may give them as constants instead, and ``stacked.Stack.of`` forms them for all
    calls at once on [pairs, U] stacks — the same IEEE operations on the same operands, so
    the same bits (tests/clipping/test_stacked.py):

    * ``err`` a float c:            err = value·c;
    * ``mag`` with ``mag_f`` f:     mag = mag·f (``up``'s factor, ``up_factor``); ``mag``
      None: ‖h‖ rounded up from value and err (``sq_of_instantiated``'s);
    * ``dev`` a tuple (f₀, f₁, …):  dev = ((mag·f₀)·f₁)…; ``dev`` 0.0: dev = 0;
    * ``rel`` a float:              rel = that constant for every unit;
    * ``value`` None with ``root`` r: value = r² (an instantiated gradient's float64 norm,
      ``sq_of_instantiated``: one launch fewer per call); r a `PendingRoot`: that norm not
      yet taken either (the calls of one shape in one reduction);
    * ``mag`` a `PendingMag`: N_u's per-row dot not yet taken (``linear_mag_parts``);
    * ``value`` and ``err`` one `gram.PendingGram`: a Gram-path ghost norm and its bound
      not yet formed (on the CPU: the calls of one shape in one pass).

    Reading a field (``sq.err``…) forms it (once) for code that needs one call's tensors.
    """

    __slots__ = ("_value", "_root", "_err", "_dev", "_rel", "_mag", "_mag_f")

    def __init__(self, value: torch.Tensor | None, err, dev, rel, mag, mag_f: float | None = None,
                 root: torch.Tensor | None = None):
        self._value, self._root = value, root
        self._err, self._dev, self._rel, self._mag, self._mag_f = err, dev, rel, mag, mag_f

    @property
    def value(self) -> torch.Tensor:
        if self._value is None:  # deferred: value = root², formed here or stacked (Stack.of)
            if isinstance(self._root, PendingRoot):
                self._root = self._root.form()
            self._value = self._root.square()
        elif self.pending_gram is not None:  # (V, E) both
            self._value, self._err = self._value.form()
        return self._value

    @property
    def pending_gram(self):
        """The `gram.PendingGram` this `Sq`'s value and err wait for, or None."""
        v = self._value
        return v if v is not None and not isinstance(v, torch.Tensor) else None

    @property
    def err(self) -> torch.Tensor:
        if not isinstance(self._err, torch.Tensor):
            if self.pending_gram is not None:  # (V, E) both
                self._value, self._err = self._value.form()
                return self._err
            self._err = self.value * self._err
        return self._err

    @property
    def mag(self) -> torch.Tensor:
        if self._mag is None:  # sq_of_instantiated: ‖h‖ from its squared norm, rounded up
            self._mag = up(torch.sqrt(self.value + self.err), 2)
            return self._mag
        if isinstance(self._mag, PendingMag):
            self._mag = self._mag.form()
        if self._mag_f is not None:
            self._mag, self._mag_f = self._mag * self._mag_f, None
        return self._mag

    @property
    def dev(self) -> torch.Tensor:
        if isinstance(self._dev, tuple):
            d = self.mag
            for f in self._dev:
                d = d * f
            self._dev = d
        elif not isinstance(self._dev, torch.Tensor):
            self._dev = torch.zeros_like(self.value)
        return self._dev

    @property
    def rel(self) -> torch.Tensor:
        if not isinstance(self._rel, torch.Tensor):
            self._rel = torch.full_like(self.value, float(self._rel))
        return self._rel


    def at(self, units: torch.Tensor, **new: torch.Tensor) -> Sq:
        """A copy with the given fields replaced at ``units``."""
        out = {}
        for k in ("value", "err", "dev", "rel", "mag"):
            t = getattr(self, k)
            if k in new:
                t = t.clone()
                t[units] = new[k].to(t.dtype)
            out[k] = t
        return Sq(**out)


def up_factor(n: int) -> float:
    """``up``'s factor: up(x, n) is x·up_factor(n)."""
    return 1.0 + gamma(n + 1, U64)


def up(x: torch.Tensor, n: int) -> torch.Tensor:
    """x·(1 + γ_n), rounded up: an upper bound on a nonnegative quantity computed with n
    float64 roundings (the multiplication's own counted)."""
    return x * up_factor(n)


def sq_bound(value: torch.Tensor, err, dev, rel, mag, mag_f: float | None = None) -> Sq:
    """A rule's `Sq`; each bound a tensor or a deferred constant (`Sq`)."""
    return Sq(value, err, dev, rel, mag, mag_f)


def sq_of_instantiated(h: torch.Tensor, inst_dev, stored_u: float, rel: float,
                       mag: torch.Tensor | None = None, mag_f: float | None = None,
                       defer: bool = False) -> Sq:
    """The bounds of a per-unit gradient ``h`` [U, ...] that the clipped sum scales as it is:
    value = ‖h‖² in float64 (γ_{k+4}); dev = ‖h − g‖ ≤ ``inst_dev`` (the error of the
    computation that formed it: a tensor, factors of ``mag`` or 0.0, as `Sq` defers them)
    + ``stored_u``·‖g̃‖ (the rounding of storing a wider result in h's dtype, ≤
    stored_u/(1 − stored_u)·‖h‖). ``mag`` None: ‖h‖ rounded up. ``defer``: the engine keeps
    h until the bound computation anyway (book-keeping: ``Units.defer``), so a small h's norm
    may wait for it (`PendingRoot`); two-pass drops h once its norm is taken, which a
    deferred norm would keep alive through the backward."""
    U = h.shape[0]
    h2 = h.reshape(U, -1)
    k = h2.shape[1]
    if (lowp.on_cpu(h2) and h2.dtype == torch.float32 and k > 2 * lowp.GRAM_CHUNK
            and h2.numel() >= CHUNKED_MIN_ELEMENTS and isinstance(mag, (torch.Tensor, PendingMag))):
        # (taken where the rule gives N_u, as before; err does not read it, so a deferred
        # N_u stays deferred; the reference and generic rules keep the float64 norm)
        value, err = _sq_chunked32(h2)
        sq = Sq(value, err, inst_dev, rel, mag, mag_f)
    else:
        # float64 accumulation (the input cast to float64: its squares, the sum, the root,
        # the square back: k + 4 roundings at most); the square deferred (`Sq`), and the
        # norm too, for a small h the engine keeps anyway (`PendingRoot`)
        root = (PendingRoot(h2) if DEFER_ROOT and defer and PendingRoot.defers(h2)
                else torch.linalg.vector_norm(h2, dim=1, dtype=F64))
        sq = Sq(None, gamma(k + 4, U64), inst_dev, rel, mag, mag_f, root=root)
    if stored_u:
        norm_up = up(torch.sqrt(sq.value + sq.err), 2)
        sq._dev = up(sq.dev + (stored_u / (1.0 - stored_u)) * norm_up, 3)
    return sq


# ``_sq_chunked32`` from this many entries on (U·k): below it the float64 norm's one
# operation (its float64 copy small) is cheaper than the chunked sum's nine and its pass
# over the bits. Measured on one core under the workers' allocator settings (float64 norm
# vs chunked, µs): [8, 11,008] 42 vs 109, [8, 65,536] 265 vs 431, [8, 176,128] 819 vs 974,
# [8, 262,144] 2,607 vs 2,125, [8, 524,288] 26,363 vs 3,906 (the float64 copy past the
# allocator's 32 MiB threshold is faulted in every time).
CHUNKED_MIN_ELEMENTS = 1 << 21


def _sq_chunked32(h2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖h_u‖², its bound) per row of a float32 [U, k] on the CPU without a float64 copy of
    h (the copy costs more than the sum there: 8·U·k bytes written and read again): the
    float32 norms of chunks of c = ``lowp.GRAM_CHUNK`` entries, squared and summed in
    float64.

    A chunk's float32 norm (its squares, their sum in any order, the root; at least float32
    accumulation) is ñ = √(s·(1 + θ_c))·(1 + δ) for its exact sum of squares s, |θ_c| ≤
    γ_c(2⁻²⁴), |δ| ≤ 2⁻²⁴, so ñ² is within γ_{c+2}; its square in float64 and the float64
    sum of the m + 1 chunks (nonnegative) add less than one more float32 rounding (m <
    2²⁸): the computed value is within γ_{c+3}(2⁻²⁴) of ‖h‖², relatively, and taking the
    bound relative to the computed value (exact ≤ computed/(1 − γ)) is one more: err =
    γ_{c+5}(2⁻²⁴)·value, with a rounding to spare. Squares and partial sums below
    float32's normal range lose at most 2⁻¹²⁶ each (flushed to zero) — at most 2k of them,
    each amplified by the later roundings by less than 2: 4k·2⁻¹²⁶ on ‖h‖² — added to err
    as an absolute term wherever the row of h has a nonzero entry, read on its bits (the
    sign cleared: ``lowp._abs_bits``, exact whatever the flush mode, which would read a subnormal as 0 in
    a float comparison). A row that is exactly 0 has only exact zeros to square and sum,
    so its value 0 and err 0 are exact, and a gradient that is exactly 0 keeps err = 0
    (``worth_recomputing`` tells it by that). N_u is not read, so a deferred one stays
    deferred (``PendingMag``). No host read; one pass over h's bits beyond the norms.
    A norm past float32's range is inf: the unit's bound is then not finite and it adds
    nothing (``factors``)."""
    U, k = h2.shape
    c = lowp.GRAM_CHUNK
    m = k // c
    parts = torch.linalg.vector_norm(h2[:, :m * c].reshape(U, m, c), dim=-1)  # [U, m] float32
    value = parts.to(F64).square().sum(-1)
    if m * c < k:
        value = value + torch.linalg.vector_norm(h2[:, m * c:], dim=-1).to(F64).square()
    # a nonzero magnitude in the row (the bits' largest: a bool reduction is several times slower)
    nonzero = lowp._abs_bits(h2).amax(-1) > 0
    err = value * gamma(c + 5, U32) + nonzero.to(F64) * (4.0 * k * 2.0**-126)
    return value, err


def deviation(s: Sq, sink_u: float) -> torch.Tensor:
    """dev + rel'·(‖h‖ + dev), rel' = the call's relative roundings and the sink's add:
    this call's share of δ_P (module docstring, 2), rounded up."""
    g_sink = gamma(1, sink_u)
    rel = s.rel + g_sink + s.rel * g_sink
    norm = torch.sqrt(torch.clamp(s.value + s.err, min=0))
    return up(s.dev + rel * (norm + s.dev), 6)


def check_nonnegative(value: torch.Tensor, err: torch.Tensor, what: str = "") -> None:
    """Raise if a finite value + err is negative (one device sync)."""
    if bool(negative(value, err).any()):
        s = value + err
        worst = float(s[torch.isfinite(s)].min())
        raise RuntimeError(
            f"clipping engine bug: a squared norm plus its rounding bound is negative "
            f"({worst:.3g}{', ' + what if what else ''}); the bound must make it >= 0. "
            "Please report this with the model and batch shapes."
        )


def negative(value: torch.Tensor, err: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """Where a finite value + err is negative (a bug, ``used_norm``), as a device tensor
    (``total``: value + err, if the caller has it)."""
    s = value + err if total is None else total
    return (s < 0) & torch.isfinite(s)


def worth_recomputing(value: torch.Tensor, err: torch.Tensor, dev: torch.Tensor,
                      nu: torch.Tensor, threshold: float = FALLBACK) -> torch.Tensor:
    """The units whose bound is more than ``threshold`` of ν (module docstring, 4), finite, and
    not a gradient that is exactly 0: value, its bound and its deviation all 0 mean that
    g_u = 0 (ν is then the smallest positive float, all rounding, and ρ = 1; recomputing
    would find 0 again: a LoRA B initialized to 0 makes every A's gradient 0). The fallback
    only tightens ν; skipping it never lowers ν below the true norm."""
    material = torch.stack(torch.broadcast_tensors(value, err, dev)).ne(0).any(0)  # any not 0
    return (rho(value, nu) > threshold) & torch.isfinite(value) & torch.isfinite(nu) & material


def rho(value: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
    """The part of ν that is bound, 1 − √value/ν, in [0, 1] (0 where ν = 0)."""
    root = torch.sqrt(torch.clamp(value, min=0))
    pos = nu > 0
    r = torch.where(pos, 1 - root / torch.where(pos, nu, 1.0), 0.0)
    return torch.clamp(torch.nan_to_num(r, nan=0.0), 0, 1)


def used_norm(value: torch.Tensor, err: torch.Tensor, delta_sq: torch.Tensor, what: str = "",
              check: bool = True, total: torch.Tensor | None = None) -> torch.Tensor:
    """ν = √(value + err)↑ + √(Σ δ²)↑ (module docstring, 3), for [U] float64 inputs whose
    own float64 sums are already in ``err`` (and rounded up in ``delta_sq``). A negative
    value + err breaks the bound's construction: a bug, raised, never clamped (``check``
    False: the caller checks ``negative(value, err)`` itself, several calls at once, with
    one device sync instead of one per call; ``total``: value + err, if the caller has it)."""
    s = value + err if total is None else total
    if check:
        check_nonnegative(value, err, what)
    inf = _inf(s)
    root = torch.nextafter(torch.sqrt(s), inf)
    dev = torch.nextafter(torch.sqrt(delta_sq), inf)
    return torch.nextafter(root + dev, inf)


_INF: dict = {}


def _inf(x: torch.Tensor) -> torch.Tensor:
    """+inf as a 0-dim tensor of x's dtype on x's device, kept (made once by a fill on the
    device, not a copy from the host; no launch per use)."""
    key = (x.dtype, x.device)
    t = _INF.get(key)
    if t is None:
        t = _INF[key] = x.new_full((), math.inf)
    return t


def factors(nu: torch.Tensor, value: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """c_u = min(1, C/ν_u), the quotient rounded toward 0 (so c_u·ν_u ≤ C exactly); 0 for a
    unit whose computed norm is not finite (NaN/inf gradient), or whose bound is not
    (its contribution cannot be bounded: it adds nothing)."""
    finite = torch.isfinite(value) & torch.isfinite(nu)
    safe = torch.where(finite & (nu > 0), nu, torch.ones_like(nu))
    # a true division (a Python number over a tensor is a reciprocal and a product: two
    # roundings), then one step toward 0: q ≤ C/ν exactly
    q = torch.nextafter(torch.div(torch.full_like(safe, max_grad_norm), safe), torch.zeros_like(safe))
    f = torch.where(nu > max_grad_norm, q, torch.ones_like(nu))
    return torch.where(finite, f, torch.zeros_like(f))


def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float64) in ``dtype``, never below it."""
    if dtype == F64:
        return x
    y = x.to(dtype)
    below = y.to(F64) < x
    return torch.where(below, torch.nextafter(y, torch.full_like(y, math.inf)), y)


# --------------------------------------------------------------------------- units


@dataclass
class Units:
    """The row -> unit map of one micro-batch, with the pairs of rows that share a unit."""

    unit_of_row: torch.Tensor  # [R] int64, -1 = padding
    num_units: int
    identity: bool  # row r is unit r for every r (no padding): the common fast path
    pair_a: torch.Tensor | None = None  # rows r, r' (r != r') of the same unit
    pair_b: torch.Tensor | None = None
    max_rows: int = 1  # the most rows one unit has (bounds count its row pairs)
    # The last few input Gram matrices A Aᵀ (float64) and row norms ‖A_t‖, by the input's
    # storage: layers that read the same input (Llama's q/k/v, gate/up) share them; their
    # output gradients arrive one after another in the backward, so a short memory suffices.
    _grams: OrderedDict = field(default_factory=OrderedDict, repr=False)
    gram_calls: int = 0  # Gram matrices computed (not taken from the memory), for tests
    _csr: tuple | None = field(default=None, repr=False)  # (rows, ptr), ``csr``
    _slot: torch.Tensor | None = field(default=None, repr=False)  # ``slot``
    # The engine keeps every call's A and G until the step's bound computation (book-keeping):
    # on the CPU the rules may leave small row norms and Gram bounds to it (`lowp.LazyRowNorms`,
    # `gram.PendingGram`), formed there for many calls at once.
    defer: bool = False

    def _entry(self, x: torch.Tensor) -> dict:
        key = (x.data_ptr(), x.device, x.dtype, tuple(x.shape), tuple(x.stride()))
        hit = self._grams.get(key)
        if hit is not None:
            self._grams.move_to_end(key)
            return hit
        hit = {"x": x}  # x is kept alive with its Gram: its storage is not reused
        self._grams[key] = hit
        while len(self._grams) > GRAM_MEMORY:
            self._grams.popitem(last=False)
        return hit

    def self_gram(self, x: torch.Tensor) -> torch.Tensor:
        """x xᵀ per row ([R, T, a] -> [R, T, T], float64), shared between the layers that
        read the same tensor in this backward."""
        e = self._entry(x)
        if "gram" not in e:
            e["gram"] = lowp.gram(x, x)
            self.gram_calls += 1
        return e["gram"]

    def cached(self, x: torch.Tensor, key: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``make(x)``, shared like ``self_gram`` under ``key`` (``gram.py``'s float32 Gram)."""
        e = self._entry(x)
        if key not in e:
            e[key] = make(x)
            self.gram_calls += 1
        return e[key]

    def self_norms(self, x: torch.Tensor, lazy: bool = False):
        """‖x[r, t]‖ ([R, T, a] -> [R, T], float64), shared like ``self_gram``. ``lazy``: a
        `lowp.LazyRowNorms` where ``defer`` allows it (the caller resolves it)."""
        e = self._entry(x)
        if "norms" not in e:
            e["norms"] = lowp.row_norms_maybe_lazy(x, self.defer)
        return e["norms"] if lazy else self._resolved(e)

    def know_norms(self, x: torch.Tensor, norms: torch.Tensor) -> None:
        """Give x's row norms, taken otherwise (``lowp.row_norms`` of the rows x was
        gathered from: the experts rule's padded chunks, whose padding rows are a zero row
        of norm 0): ``self_norms`` and ``norms_pair`` return them for x. A row's bound does
        not depend on the rows reduced with it (``lowp.row_norms``: one reduction per row)."""
        self._entry(x)["norms"] = norms

    def _known_norms(self, x: torch.Tensor):
        # the same memory seen the same way (the entry keeps its tensor alive: not reused)
        e = self._grams.get((x.data_ptr(), x.device, x.dtype, tuple(x.shape), tuple(x.stride())))
        return None if e is None else e.get("norms")

    @staticmethod
    def _resolved(e: dict) -> torch.Tensor:
        e["norms"] = lowp.resolved(e["norms"])
        return e["norms"]

    def norms_pair(self, x: torch.Tensor, g: torch.Tensor, lazy: bool = False) -> tuple:
        """(``self_norms(x)``, ``lowp.row_norms(g)``): both in one launch when x's are not
        known yet (``lowp.row_norms2``), x's then kept as ``self_norms`` keeps them.
        ``lazy``: either may be a `lowp.LazyRowNorms` (``self_norms``)."""
        known = self._known_norms(g)
        if known is not None:
            return self.self_norms(x, lazy=lazy), known if lazy else lowp.resolved(known)
        if lazy and lowp.cpu_deferral(g, self.defer):  # each deferred if small
            return self.self_norms(x, lazy=True), lowp.row_norms_maybe_lazy(g, True)
        e = self._entry(x)
        if "norms" in e:
            return self._resolved(e), lowp.row_norms(g)
        e["norms"], ng = lowp.row_norms2(x, g)
        return e["norms"], ng

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
            # rows per unit (padding rows counted in a spare slot): one host read
            counts = torch.zeros(num_units + 1, dtype=torch.long, device=unit_of_row.device)
            counts.index_add_(0, u.slot, torch.ones_like(unit_of_row))
            if num_units:
                u.max_rows = max(1, int(counts[:num_units].max()))
        return u

    def csr(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ptr): unit u's rows are ``rows[ptr[u]:ptr[u+1]]`` (padding rows in none);
        built on the device, no host sync; kept for the batch."""
        if self._csr is None:
            uor = self.unit_of_row
            dev = uor.device
            if self.identity:
                self._csr = (torch.arange(uor.shape[0], device=dev),
                             torch.arange(uor.shape[0] + 1, device=dev))
            else:
                key = torch.where(uor >= 0, uor, self.num_units)  # padding last, not counted
                counts = torch.bincount(key, minlength=self.num_units + 1)[: self.num_units]
                ptr = torch.zeros(self.num_units + 1, dtype=torch.long, device=dev)
                ptr[1:] = counts.cumsum(0)
                self._csr = (torch.argsort(key, stable=True), ptr)
        return self._csr

    @property
    def keep(self) -> torch.Tensor:
        return self.unit_of_row >= 0

    def rows_of(self, unit: int) -> torch.Tensor:
        """The batch rows of one unit."""
        return (self.unit_of_row == unit).nonzero(as_tuple=True)[0]

    @property
    def slot(self) -> torch.Tensor:
        """Each row's unit, padding rows mapped to a spare slot U (no boolean mask: a
        mask's index on CUDA reads its size back, a host sync per call)."""
        if self._slot is None:
            uor = self.unit_of_row
            self._slot = torch.where(uor >= 0, uor, self.num_units)
        return self._slot

    def rows_to_units(self, per_row: torch.Tensor) -> torch.Tensor:
        """Sum a per-row quantity [R, ...] into units [U, ...]; padding rows dropped (summed
        into the spare slot, which is cut off: nothing of theirs reaches a unit)."""
        if self.identity:
            return per_row
        out = per_row.new_zeros((self.num_units + 1, *per_row.shape[1:]))
        return out.index_add_(0, self.slot, per_row)[: self.num_units]

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
        return torch.cat([unit_factors, unit_factors.new_zeros(1)])[self.slot]

    @property
    def has_pairs(self) -> bool:
        return not self.identity and self.pair_a is not None and bool(self.pair_a.numel())

    def pair_count(self, T: int, S: int) -> int:
        """Roundings any term of a pair sum goes through (module docstring, 1): the T×S
        sum in two steps, the unit's row pairs, the diagonal's add, the product."""
        return T + S + self.max_rows * self.max_rows + 4


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[R, in] -> [R, 1, in]; [R, T, ..., in] -> [R, T', in]."""
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _pair_sums(ga: torch.Tensor, gg: torch.Tensor) -> torch.Tensor:
    """Σ_{t,s} ga[r,t,s]·gg[r,t,s] per row, summed over s and then t (height T + S)."""
    return (ga * gg).sum(2).sum(1)


def _pair_sum_two(Ai, Gi, Aj, Gj, units: Units, gram_a: torch.Tensor | None = None,
                  mags: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unit Σ_{r,r' in u} ⟨A_i,r A_j,r'ᵀ, G_i,r G_j,r'ᵀ⟩ in float64, and its bound
    γ_n·N_i·N_j (module docstring, 1): (value, err). ``mags``: (N_i, N_j) if known."""
    ga = gram_a if gram_a is not None else lowp.gram(Ai, Aj)
    gg = lowp.gram(Gi, Gj)
    out = units.rows_to_units(_pair_sums(ga, gg))
    if units.has_pairs:
        a, b = units.pair_a, units.pair_b
        out = out + units.pairs_to_units(_pair_sums(lowp.gram(Ai[a], Aj[b]), lowp.gram(Gi[a], Gj[b])))
    n = Ai.shape[-1] + Gi.shape[-1] + 2 + units.pair_count(Ai.shape[1], Aj.shape[1])
    if mags is not None:
        mi, mj = mags
    else:
        mi = linear_mag(Ai, Gi, units)
        mj = mi if (Aj is Ai and Gj is Gi) else linear_mag(Aj, Gj, units)
    return out, up(mi * mj, 1) * gamma(n, U64)


def linear_mag(A3: torch.Tensor, G3: torch.Tensor, units: Units | None = None) -> torch.Tensor:
    """N_u = Σ_{r in u, t} ‖A_rt‖·‖G_rt‖, rounded up ([U] float64): N_u ≥ ‖|G_u|ᵀ|A_u|‖."""
    raw, f = linear_mag_parts(A3, G3, units)
    return raw * f


def linear_mag_parts(A3: torch.Tensor, G3: torch.Tensor, units: Units | None = None,
                     defer: bool | str = False, norms_g=None
                     ) -> tuple[torch.Tensor | PendingMag, float]:
    """``linear_mag`` as (its sum, the factor that rounds it up): N_u = sum·factor. With
    ``defer`` True the sum is a `PendingMag`, its per-row dot taken in the step's one bound
    computation for all such calls at once: off the CPU (``DEFER_MAG``) with the row norms
    taken now; on the CPU where the engine keeps A and G until then (``Units.defer``) with
    the row norms deferred too (`lowp.LazyRowNorms`). ``defer="cpu"``: the CPU's deferral
    only. ``norms_g``: ``lowp.row_norms(G3)`` (or its `LazyRowNorms`) if the caller has it
    (the Gram path reads it too)."""
    lazy = bool(defer) and units is not None and lowp.cpu_deferral(A3, units.defer)
    if norms_g is not None:
        ng = norms_g
        na = (units.self_norms(A3, lazy=lazy) if units is not None and A3.dtype.is_floating_point
              else lowp.row_norms(A3))
    elif units is not None and A3.dtype.is_floating_point:
        na, ng = units.norms_pair(A3, G3, lazy=lazy)
    else:  # row_norms2 takes each on its own where one launch cannot serve both
        na, ng = lowp.row_norms2(A3, G3)
    n = A3.shape[-1] + G3.shape[-1] + A3.shape[1] + 8
    f = up_factor(n) if units is None else up_factor(n + units.max_rows)
    if lazy or (defer is True and DEFER_MAG and not lowp.on_cpu(A3)):
        return PendingMag(na, ng, units), f
    return PendingMag(na, ng, units).form(), f


# Off the CPU an instantiated Linear's N_u is formed in the bound computation, batched over
# the calls (one launch fewer per call); False forms it per call (tests compare the two).
DEFER_MAG = True


# Under book-keeping (which keeps h until then) a small instantiated gradient's float64 norm
# is taken in the bound computation, the calls of one shape in one reduction
# (``PendingRoot.form_all``), on every device; False takes it per call.
DEFER_ROOT = True


class PendingRoot:
    """‖h_u‖ in float64 of an instantiated per-unit gradient h2 [U, k], not yet taken. The
    calls of one shape and dtype are stacked and reduced at once (``form_all``): each unit's
    norm the same float64 reduction of the same k entries (its bound, γ_{k+4}(2⁻⁵³), holds
    for any order of the sum, so also where a device reduces a stack in another order).
    Only for h up to ``MAX_BYTES`` (LoRA's adapters: the stack is a small copy; a large
    per-unit gradient is reduced where it is, without one); on the CPU up to
    ``CPU_MAX_BYTES`` (``defers``). There one operation fewer per call saves ~10 µs of host
    time, but the float64 reduction of a stack of larger h is slower than each h's own: it
    reads the stack's float64 copy, past the caches (from 32 MiB past the allocator's mmap
    threshold, faulted in every step). Measured on one core under the workers' allocator
    settings, 40 h of one shape, stacked vs each its own, µs: [8, 1,024] 162 vs 262,
    [32, 256] 148 vs 239, [8, 4,096] 1,472 vs 608, [8, 11,008] 5,390 vs 2,076, [32, 4,096]
    26,298 vs 4,785. Either way each unit's norm is the same float64 reduction of the same
    k entries; the tests compare the bits (tests/clipping/test_norm_bounds.py)."""

    __slots__ = ("h2",)
    MAX_BYTES = 1 << 22
    CPU_MAX_BYTES = 1 << 15

    @staticmethod
    def defers(h2: torch.Tensor) -> bool:
        """Whether h2's norm may wait for ``form_all``: h2 small enough (class docstring)."""
        limit = PendingRoot.CPU_MAX_BYTES if lowp.on_cpu(h2) else PendingRoot.MAX_BYTES
        return h2.numel() * h2.element_size() <= limit

    def __init__(self, h2: torch.Tensor):
        self.h2 = h2

    def form(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.h2, dim=1, dtype=F64)

    @staticmethod
    def form_all(pending: list[PendingRoot]) -> list[torch.Tensor]:
        """Each one's ``form()``: those of one shape, dtype and device in one reduction."""
        out: list = [None] * len(pending)
        for idx in lowp.group_by(pending, lambda p: (tuple(p.h2.shape), p.h2.dtype, p.h2.device)):
            if len(idx) == 1:
                out[idx[0]] = pending[idx[0]].form()
                continue
            roots = torch.linalg.vector_norm(torch.stack([pending[i].h2 for i in idx]), dim=2, dtype=F64)
            for j, i in enumerate(idx):
                out[i] = roots[j]
        return out


class PendingMag:
    """N_u's sum before its per-row dot: Σ_t na_t·ng_t per row (T products, T − 1 additions
    in whatever order the kernel takes: ``linear_mag_parts``' n counts them all), then the
    rows summed into units. ``form_all`` forms many with one batched dot."""

    __slots__ = ("na", "ng", "units")

    def __init__(self, na: torch.Tensor, ng: torch.Tensor, units: Units | None):
        self.na, self.ng, self.units = na, ng, units

    def form(self) -> torch.Tensor:
        self.na, self.ng = lowp.resolved(self.na), lowp.resolved(self.ng)
        per_row = torch.bmm(self.na.unsqueeze(1), self.ng.unsqueeze(2)).view(self.na.shape[0])
        return per_row if self.units is None else self.units.rows_to_units(per_row)

    @staticmethod
    def form_all(pending: list[PendingMag]) -> list[torch.Tensor]:
        """Each one's ``form()``: those of one shape and one set of units as one batched
        dot (the same products and sums, each row's in the kernel's order); their deferred
        row norms first, all at once (`lowp.LazyRowNorms.form_all`)."""
        lowp.LazyRowNorms.form_all([n for p in pending for n in (p.na, p.ng)])
        for p in pending:
            p.na, p.ng = lowp.resolved(p.na), lowp.resolved(p.ng)
        out: list = [None] * len(pending)
        for idx in lowp.group_by(pending, lambda p: (tuple(p.na.shape), tuple(p.ng.shape), id(p.units))):
            if len(idx) == 1:
                out[idx[0]] = pending[idx[0]].form()
                continue
            first = pending[idx[0]]
            R, T = first.na.shape
            na = torch.stack([pending[i].na for i in idx]).view(len(idx) * R, 1, T)
            ng = torch.stack([pending[i].ng for i in idx]).view(len(idx) * R, T, 1)
            rows = torch.bmm(na, ng).view(len(idx), R).t()  # [R, calls]
            sums = rows if first.units is None else first.units.rows_to_units(rows)
            for j, i in enumerate(idx):
                out[i] = sums[:, j]
        return out


def rows_mag(G3: torch.Tensor, units: Units) -> torch.Tensor:
    """Σ_{r in u, t} ‖G_rt‖ rounded up: the magnitude of a bias or an embedding gradient."""
    per_row = lowp.row_norms(G3).sum(1)
    return up(units.rows_to_units(per_row), G3.shape[-1] + G3.shape[1] + units.max_rows + 4)


def _row_sums(G3: torch.Tensor) -> torch.Tensor:
    """Σ_t G[r, t] per row in float64: the bias gradient of each row."""
    return G3.sum(1, dtype=F64)


def _bias_sq(G3: torch.Tensor, units: Units) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖Σ_{r in u, t} G_rt‖² per unit in float64: (value, err, N). Each entry of the
    per-unit sum is within γ_{T+K}·m of its exact value (m the entries' magnitudes), its
    square within γ_{2(T+K)+1}·m², the sum over p within γ_p more: err ≤ γ·N²."""
    per_unit = units.rows_to_units(_row_sums(G3))
    value = (per_unit * per_unit).sum(-1)
    mag = rows_mag(G3, units)
    n = 2 * (G3.shape[1] + units.max_rows) + G3.shape[-1] + 4
    return value, up(mag * mag, 1) * gamma(n, U64), mag


# --------------------------------------------------------------------------- layer choice


@dataclass(frozen=True)
class DeviceSpec:
    """What the layer choice needs to know of a device: dense matmul throughput for the
    contraction dtype (FLOP/s), float64 throughput (the Gram matrices are float64,
    ``lowp``), and memory bandwidth (bytes/s)."""

    flops: float
    bandwidth: float
    fp64: float


# Dense bf16/fp16 tensor-core FLOP/s (no sparsity), HBM bandwidth, and dense float64 FLOP/s
# (FP64 tensor cores where the chip has them), from the vendors' data sheets; matched as a
# substring of torch.cuda.get_device_name().
_CUDA_SPECS = {
    "H200": (989e12, 4.8e12, 67e12), "H100": (989e12, 3.35e12, 67e12),
    "H800": (989e12, 3.35e12, 67e12), "GH200": (989e12, 4.0e12, 67e12),
    "B200": (2250e12, 8.0e12, 40e12), "A100": (312e12, 2.0e12, 19.5e12),
    "A800": (312e12, 2.0e12, 19.5e12), "L40S": (362e12, 0.864e12, 1.4e12),
    "L40": (181e12, 0.864e12, 1.4e12), "L4": (121e12, 0.3e12, 0.49e12),
    "A10": (125e12, 0.6e12, 0.98e12), "A6000": (155e12, 0.77e12, 1.2e12),
    "4090": (165e12, 1.0e12, 1.3e12), "V100": (125e12, 0.9e12, 7.8e12),
    "T4": (65e12, 0.32e12, 0.25e12),
}
_CUDA_DEFAULT = (300e12, 2.0e12, 1.0e12)
# float32 operands on CUDA run at about 1/15 of the tensor-core rate (SIMT; TF32 is off
# for the engine's float32 contractions, lowp.py).
_CUDA_FP32_SLOWDOWN = 15.0
# CPU: a few cores' float32 matmul rate (float64: half) against one socket's bandwidth.
_CPU_SPEC = DeviceSpec(flops=2e11, bandwidth=2e10, fp64=1e11)


def device_spec(device: torch.device, dtype: torch.dtype) -> DeviceSpec:
    if device.type != "cuda":
        return _CPU_SPEC
    name = torch.cuda.get_device_name(device)
    flops, bw, fp64 = next((v for k, v in _CUDA_SPECS.items() if k in name), _CUDA_DEFAULT)
    if dtype not in (torch.bfloat16, torch.float16):
        flops /= _CUDA_FP32_SLOWDOWN
    return DeviceSpec(flops, bw, fp64)


def tile_norm_time(rows: int, T: int, p: int, d: int, spec: DeviceSpec) -> float:
    """Seconds of the tensor-core norm kernel (``tile_norm_cheaper``) on ``spec``."""
    return 2.0 * rows * T * p * d / spec.flops


def tile_norm_cheaper(rows: int, T: int, p: int, d: int, spec: DeviceSpec) -> bool:
    """A Linear's per-unit norms from the tensor-core norm kernel (2·R·T·p·d half-precision
    FLOPs, nothing written: ``lowp.unit_sq_norms``) rather than its two float64 Gram
    matrices (2·R·T²·(p+d) float64 FLOPs): on an H100 the kernel wins unless T < ~(p+d)/10."""
    return 2.0 * rows * T * p * d / spec.flops < 2.0 * rows * T * T * (p + d) / spec.fp64


def _ghost_cheaper(num_units: int, rows: int, T: int, p: int, d: int,
                   spec: DeviceSpec | None = None, tile: bool = False) -> bool:
    """Ghost norm or instantiation, for one [p x d] layer and one batch (R rows of T
    positions, U units), from memory first, then time on this device.

    Memory: instantiation keeps U per-unit gradients (U·p·d floats) until the clipped sum
    (book-keeping); allowed only when that is no larger than what book-keeping keeps for
    the layer anyway, its input and output (R·T·(p+d)). Otherwise the ghost norm, whose
    memory is T² per row, never p×d.

    Time, both paths also paying the clipped sum:
      instantiation  2·R·T·p·d FLOPs (per-row gradients, written in float32), then the
                     per-unit norms and the weighted sum read them: ≈ 8·(R+U)·p·d bytes;
      ghost norm     2·R·T²·(p+d) float64 FLOPs (two Gram matrices, ``lowp``) + the
                     clipped sum's 2·R·T·p·d FLOPs (a tensor-core GEMM for bf16/fp16 on
                     CUDA, as in a non-private backward).
    With ``tile`` (CUDA half precision, ``lowp.tile_norms``) the ghost path's norms are
    the cheaper of those Gram matrices and the tensor-core norm kernel (2·R·T·p·d FLOPs at
    the half-precision rate, nothing written), which makes it the cheaper path there.
    The cheaper on ``spec`` wins (a GPU's FLOP/byte ratio is ~100-300, so long rows of
    mid-sized layers go to the ghost norm there and to instantiation on a CPU)."""
    if num_units * p * d > rows * T * (p + d):
        return True
    if spec is None:
        return False
    t_inst = 2.0 * rows * T * p * d / spec.flops + 8.0 * (rows + num_units) * p * d / spec.bandwidth
    t_norms = 2.0 * rows * T * T * (p + d) / spec.fp64
    if tile:
        t_norms = min(t_norms, 2.0 * rows * T * p * d / spec.flops)
    t_ghost = t_norms + 2.0 * rows * T * p * d / spec.flops
    return t_ghost < t_inst


# --------------------------------------------------------------------------- records


class Record:
    """One call of one hooked module in one micro-batch: its input, and later its output
    gradient or its per-unit gradients."""

    __slots__ = ("module", "rule", "A", "G", "per_unit", "ghost", "sqn", "out_bytes", "fp", "exact",
                 "exact_shared", "call", "fold", "cache", "dirty", "direct")

    def __init__(self, module: nn.Module, rule: LayerRule, A: torch.Tensor, out_bytes: int = 0):
        self.module, self.rule, self.A = module, rule, A
        self.G: torch.Tensor | None = None
        self.per_unit: dict[str, torch.Tensor] | None = None
        self.ghost: bool = False
        self.sqn: dict[str, Sq] | None = None  # per-unit squared norms and bounds, per parameter
        self.out_bytes = out_bytes  # size of the module output, hence of G
        self.fp: torch.Tensor | None = None  # two-pass: pass 1's fingerprint of G, per row
        # Units whose part of this call is recomputed exactly (module docstring, 4): their
        # norm and their part of the clipped sum come from LayerRule.exact.
        self.exact: torch.Tensor | None = None
        # Of those, the parameters whose exact part the engine adds itself, summed over the
        # parameter's uses (a shared parameter: its uses' parts may cancel).
        self.exact_shared: set[str] | None = None
        self.call = None  # the whole call, for a rule that re-runs the module (`calls.Call`)
        self.fold = 1  # k > 1: A and G are [R·k, ...] flattened tokens, kept as [R, k, ...]
        self.cache = None  # what a rule derived from G, for its clipped sum (dropped with G)
        # (G, A): whether a row whose factor is 0 holds a non-finite value, read by the
        # engine for all calls with one host sync (None: not read; the clipped sum checks)
        self.dirty: tuple[bool, bool] | None = None
        # A is not the module's input but the tensor its one parameter multiplied
        # elementwise, taken from autograd (rules/rowwise.py, ``direct_operand``)
        self.direct = False


class LayerRule:
    """Interface of a rule. ``params`` are the module's own trainable parameter names.
    ``has_clipped_ghost``: the rule forms Σ_r c_{u(r)}·(row r's gradient) from A and G
    directly (one contraction, no per-unit tensor). ``has_exact``: it can form one unit's
    gradient in float64 (``exact``), so the engine can fall back to it (module docstring, 4).

    A rule with a ghost norm returns, for each parameter, an `Sq` (the value and its
    rounding bounds); the default ``instantiate`` wraps ``per_unit`` (whose tensors are
    then the vectors measured and scaled: their norm is taken in float64)."""

    has_clipped_ghost = False
    has_exact = False
    # The engine keeps the whole call (`calls.Call` in ``Record.call``) and taps every
    # differentiable output; G is then the tuple of their gradients (rules/functional.py).
    wants_call = False
    # The rule clips the trainable parameters of the module's whole subtree (``params``
    # names them by path); the engine hooks none of its descendants (rules/functional.py).
    claims_subtree = False

    def params(self, module) -> list[str]:
        # ``named_parameters(recurse=False)``'s trainable names, read off the module's own
        # table: the engine asks several times per recorded call, and the generator behind
        # ``named_parameters`` costs tens of µs each time (issue 50)
        own = module._parameters
        names = [n for n, p in own.items() if p is not None and p.requires_grad]
        if len(names) > 1 and len({id(own[n]) for n in names}) < len(names):
            # one tensor registered under two names: its first name only, as there
            return [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        return names

    def choose_ghost(self, module, A, G, policy: str, num_units: int) -> bool:
        return False

    def sq_norms_ghost(self, rec: Record, units: Units) -> dict[str, Sq]:
        raise NotImplementedError

    def per_unit(self, rec: Record, units: Units) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def instantiate(self, rec: Record, units: Units) -> dict[str, tuple[torch.Tensor, Sq]]:
        """Per-unit gradients [U, ...] and the bounds of their norms. The sum over units
        in the clipped sum is one float32 (float64) contraction of U terms: γ_{U+2}."""
        out = {}
        for n, g in self.per_unit(rec, units).items():
            out[n] = (g, sq_of_instantiated(g, 0.0, 0.0, gamma(g.shape[0] + 2, roundoff(g.dtype)),
                                            defer=units.defer))
        return out

    def clipped_ghost(self, rec: Record, row_factors: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def exact(self, rec: Record, name: str, rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (of the parameter's first dimension) of the gradient of
        parameter ``name`` from batch rows ``rows`` alone, in float64: exact products,
        float64 sums, so within γ_{R·T+4}(2⁻⁵³)·N of the exact value in norm."""
        raise NotImplementedError


def exact_slices(rule: LayerRule, rec: Record, name: str, rows: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, float64 slice) of one unit's exact gradient, a bounded slice at a time."""
    p = rec.module.get_parameter(name)
    first = p.shape[0] if p.dim() else 1
    cols = max(1, p.numel() // max(1, first))
    step = max(1, lowp.CHUNK_ELEMENTS // cols)
    for j in range(0, first, step):
        stop = min(first, j + step)
        yield j, stop, rule.exact(rec, name, rows, j, stop)


def exact_count(rec: Record) -> int:
    """The roundings of ``exact`` for any call: its sums run over at most the batch's R·T
    positions (float64), plus the widening-free products and the unit's rows."""
    G = rec.G[0] if isinstance(rec.G, tuple) else rec.G
    positions = G.numel() // max(1, G.shape[-1]) if G is not None else 1
    return positions + 8


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
