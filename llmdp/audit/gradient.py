"""Gradient canaries and every-iterate scores (issue 35, items 1 and 2).

A gradient canary is a privacy unit like any other: a row in the training store, included by
its keyed coin, sampled by the run's Poisson sampler, and clipped, summed and noised by the
real engine and strategy. Only its loss differs. Its row's language-model loss is replaced
by a linear probe of one trainable ``nn.Linear`` (the *target*, weight W [p, d]):

    loss_c = s · ⟨L(a_c), g_c⟩,   a_c ∈ R^d, g_c ∈ R^p unit vectors, s = SCALE·C,

a second call of the target module on a [R, 1, d] input that is a_c on the canary's row and
zero elsewhere. So the canary's per-unit gradient is s·g_c a_cᵀ on W (and s·g_c on a
trainable bias) and exactly zero on every other parameter: the direction

    u_c = (g_c a_cᵀ, g_c) / ‖(g_c a_cᵀ, g_c)‖  (without the bias part when W has none),

of norm s·‖(…)‖ ≥ 100·C, so clipping scales it to exactly C·u_c (never more: the engine's
norm is never below the true one). Any s ≥ 1 would do for a correct mechanism; a large one
makes a missing clip (the ``clip-off`` plant) a 100-fold signal the audit cannot miss. The engine sees the probe as one more call of the module, so
its norm, the cross terms with the module's other call and the clipped sum are formed by
the same code as every unit's (there is no side door for the replay suite to miss); the
language-model part of the canary's row is computed and then not used (``torch.where``: no
gradient reaches it).

Why a random rank-one direction in one layer: a canary direction should be one that the data
gradients barely share. For random unit a_c and g_c, a data gradient G of that layer projects
on g_c a_cᵀ as g_cᵀ G a_c, of order ‖G‖_F/√(p·d) (G is fixed before the key is drawn), and the
m canaries' directions are nearly orthogonal to each other for the same reason. A Dirac
canary (one coordinate) is the same idea with a basis vector; a random direction needs no
knowledge of which coordinates the data leave alone.

Every iterate: after each step's noise, rank 0 projects the noisy update (the strategy's
Σ clipped + noise, ÷ B) on every canary's direction, in units of C,

    x_{c,t} = B · ⟨ĝ_t, u_c⟩ / C,

which is b_{c,t} + σ·z_{c,t} + (the data's projection) with b_{c,t} = 1 when the canary was
sampled at step t, z ~ N(0, 1). The update is taken before the optimizer (AdamW's
preconditioning rescales coordinates per parameter, so the parameter change is not a sum of
the noisy gradients; the pre-optimizer noisy gradient is exactly the released quantity, and
its projection is the statistic the Gaussian analysis speaks of). The score is the
log-likelihood ratio of "included" against "excluded" on the canary's
own trajectory, Σ_t log(1 − q + q·exp((x_{c,t} − 1/2)/σ²)) (``fdp.lr_scores``; module
docstring of ``fdp``: at the small q of real runs it finds far more than the plain sum
Σ_t x_{c,t}/σ, which is the optimal statistic only for a canary present at every step).
The data's projection is not in that model. Its coherent part (the batch's mean gradient,
far above the noise in the first steps) would add a slowly drifting spread to every
canary's statistic and swamp the rare steps that sample it (on the demo: ε ≥ 0.35 instead of
2.55): ``clean`` removes the update's singular components above the noise's edge before
projecting. What remains of the data adds spread to included and excluded alike and can
only lower the bound, never make it invalid (the one-run bound holds for any score computed
from the released updates without the coins). Records are appended to
``audit/iterates.bin`` (secret, in the 0700 audit folder, never exported), one per executed
step; a step executed twice (a resume from an earlier checkpoint) keeps its last record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["GradientCanaries", "ITERATES", "SPEC", "load", "probe_loss", "read_iterates",
           "record_iterate", "scores", "target_module", "write_spec"]

SCALE = 100.0  # the probe's gradient norm, in units of C (module docstring)
SPEC = "gradient.json"  # in the run's audit/ folder: what the workers need (no secret)
ITERATES = "iterates.bin"  # the per-step projections (secret)


def _rng(key: bytes, label: bytes, i: int) -> np.random.Generator:
    digest = hmac.new(key, b"llmdp-audit/gradient/" + label + b"/" + int(i).to_bytes(8, "little"),
                      hashlib.sha256).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


@dataclass
class GradientCanaries:
    """The directions of m canaries on the target module, and which store units they are.

    ``first_unit``: the store index of the first included canary (the canary shard comes
    after the private units); ``included_ids``: the canary numbers of that shard's units, in
    order; ``a`` [m, d], ``g`` [m, p] float64 unit vectors; ``bias``: the target has a
    trainable bias (then u_c has a bias part and its norm factor is 1/√2)."""

    target: str
    first_unit: int
    included_ids: np.ndarray
    a: np.ndarray
    g: np.ndarray
    bias: bool

    @property
    def m(self) -> int:
        return self.a.shape[0]

    @property
    def norm(self) -> float:
        """‖(g_c a_cᵀ, g_c)‖ for unit a_c, g_c: the same for every canary."""
        return float(np.sqrt(2.0)) if self.bias else 1.0

    @classmethod
    def make(cls, key: bytes, m: int, target: str, p: int, d: int, bias: bool,
             first_unit: int, included_ids) -> GradientCanaries:
        a = np.stack([_unit(_rng(key, b"a", i).standard_normal(d)) for i in range(m)])
        g = np.stack([_unit(_rng(key, b"g", i).standard_normal(p)) for i in range(m)])
        return cls(target, int(first_unit), np.asarray(included_ids, dtype=np.int64), a, g, bool(bias))


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def target_module(model: nn.Module, name: str | None = None) -> tuple[str, nn.Linear]:
    """The probe's module: ``name`` if given, else the last trainable ``nn.Linear`` in the
    model's order whose weight is trainable (the output side of the network, where one
    layer's directions are least shared with the input's)."""
    found = [(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.weight.requires_grad]
    if name is not None:
        for n, m in found:
            if n == name:
                return n, m
        raise ValueError(f"no trainable nn.Linear named {name!r}; trainable ones: "
                         f"{[n for n, _ in found][:8]}")
    if not found:
        raise ValueError("the model has no trainable nn.Linear for gradient canaries")
    return found[-1]


def write_spec(folder: str, canaries_m: int, target: str | None, first_unit: int, included_ids) -> None:
    """audit/gradient.json: what every worker needs besides the key (which stays in
    audit/key): the target, the canary count, where the canary shard starts, which
    canaries it holds."""
    with open(os.path.join(folder, SPEC), "w", encoding="utf-8") as f:
        json.dump({"m": int(canaries_m), "target": target, "first_unit": int(first_unit),
                   "included_ids": [int(i) for i in included_ids]}, f)


def load(folder: str, model: nn.Module, key: bytes) -> GradientCanaries:
    with open(os.path.join(folder, SPEC), encoding="utf-8") as f:
        spec = json.load(f)
    name, mod = target_module(model, spec["target"])
    bias = mod.bias is not None and mod.bias.requires_grad
    return GradientCanaries.make(key, spec["m"], name, mod.out_features, mod.in_features, bias,
                                 spec["first_unit"], spec["included_ids"])


def probe_loss(base, module: nn.Linear, canaries: GradientCanaries, max_grad_norm: float):
    """A ``loss_fn(model, batch)`` (``train.step``): ``base``'s row losses, with every canary
    row's entry replaced by its probe s·⟨module(a_c), g_c⟩ (module docstring). The batch
    must carry ``unit_index`` (the store index of each row's unit, -1 on padding)."""
    scale = SCALE * float(max_grad_norm)

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        losses = base(model, batch)
        idx = batch["unit_index"]
        k = idx - canaries.first_unit
        is_canary = (k >= 0) & (k < canaries.included_ids.size)
        rows = torch.nonzero(is_canary).flatten()
        if rows.numel() == 0:
            return losses
        ids = torch.as_tensor(canaries.included_ids, device=idx.device)[k[rows]].cpu().numpy()
        w = module.weight
        x = torch.zeros(idx.shape[0], 1, module.in_features, dtype=w.dtype, device=w.device)
        x[rows, 0] = torch.as_tensor(canaries.a[ids], dtype=w.dtype, device=w.device)
        dt = torch.promote_types(w.dtype, torch.float32)  # float32 or wider
        gdir = torch.zeros(idx.shape[0], module.out_features, dtype=dt, device=w.device)
        gdir[rows] = torch.as_tensor(canaries.g[ids], dtype=dt, device=w.device)
        probe = (module(x)[:, 0, :].to(dt) * gdir).sum(-1) * scale
        return torch.where(is_canary, probe.to(losses.dtype), losses)

    return loss_fn


#: Singular components of a step's update above this multiple of the noise's edge are the
#: data's (``clean``), at most MAX_REMOVED of them (and a quarter of the smaller side).
EDGE_MARGIN = 1.05
MAX_REMOVED = 4


def clean(update: np.ndarray, noise_std: float) -> np.ndarray:
    """The update of the target [p, d'] less its singular components above the noise's edge
    EDGE_MARGIN·s·(√p + √d') (s the noise std per entry; the largest singular value of a
    p × d' matrix of N(0, s²) entries is s·(√p + √d') to within O(s·p^(-1/6)), Marchenko–
    Pastur and Tracy–Widom). Those are the data's coherent gradient (the batch's mean
    direction, large in the first steps): its projection on a canary direction adds a spread
    to every canary's statistic and drifts slowly, so it would swamp the rare steps that
    sample a canary. A canary's own contribution (rank one, singular value 1 in these units,
    far below the edge) stays, less its share of the removed directions (≈ r/p + r/d' for r
    removed). The data's coherent part is of low rank, so at most MAX_REMOVED components (and
    a quarter of min(p, d')) go: a broken mechanism whose canaries stand out by themselves
    (unclipped: hundreds of components far above the edge) stays visible. A function of
    the released update alone: the scores stay valid."""
    u, sv, vt = np.linalg.svd(update, full_matrices=False)
    edge = EDGE_MARGIN * float(noise_std) * (np.sqrt(update.shape[0]) + np.sqrt(update.shape[1]))
    cap = min(MAX_REMOVED, max(1, min(update.shape) // 4))
    r = min(int(np.count_nonzero(sv > edge)), cap)
    return update - (u[:, :r] * sv[:r]) @ vt[:r] if r else update


def projections(canaries: GradientCanaries, weight_grad: torch.Tensor,
                bias_grad: torch.Tensor | None, expected_batch_size: float,
                max_grad_norm: float, noise_multiplier: float | None = None) -> np.ndarray:
    """x_{c,t} = B·⟨ĝ_t, u_c⟩/C for every canary (float64), from the noisy update's
    gradient of the target (``p.grad`` after the strategy's privatize: Σ + noise, ÷ B),
    first ``clean``-ed of the data's coherent part when the noise multiplier is given."""
    scale = float(expected_batch_size) / float(max_grad_norm)  # ĝ·B/C: noise std σ per entry
    W = weight_grad.detach().to(torch.float64).cpu().numpy() * scale
    if canaries.bias and bias_grad is not None:
        W = np.concatenate([W, bias_grad.detach().to(torch.float64).cpu().numpy()[:, None] * scale], 1)
        A = np.concatenate([canaries.a, np.ones((canaries.m, 1))], 1)
    else:
        A = canaries.a
    if noise_multiplier:
        W = clean(W, noise_multiplier)
    proj = np.einsum("cd,cd->c", canaries.g @ W, A)  # g_cᵀ W a_c: one BLAS product
    return proj / canaries.norm


def record_iterate(folder: str, step: int, values: np.ndarray) -> None:
    """Append step ``step``'s projections to audit/iterates.bin: int64 step, then m float64."""
    rec = np.concatenate([np.asarray([step], dtype=np.int64).view(np.float64),
                          np.asarray(values, dtype=np.float64)])
    path = os.path.join(folder, ITERATES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as f:
        f.write(rec.tobytes())
        f.flush()
        os.fsync(f.fileno())


def read_iterates(folder: str, m: int, steps: int) -> np.ndarray:
    """[steps, m]: the last record of each step 0..steps-1 (a re-executed step's later one);
    a step without a record is an error (the scores would silently miss it)."""
    raw = np.fromfile(os.path.join(folder, ITERATES), dtype=np.float64)
    if raw.size % (m + 1):
        raise ValueError(f"{ITERATES}: {raw.size} values is not a whole number of records of {m + 1}")
    recs = raw.reshape(-1, m + 1)
    out = np.full((steps, m), np.nan)
    for row in recs:
        t = int(row[:1].view(np.int64)[0])
        if 0 <= t < steps:
            out[t] = row[1:]
    missing = np.flatnonzero(np.isnan(out).all(1))
    if missing.size:
        raise ValueError(f"{ITERATES}: no record of steps {missing[:5].tolist()}")
    return out


def scores(iterates: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """score_c: the log-likelihood ratio of canary c's projections [T, m] (module
    docstring, ``fdp.lr_scores``), for the run's Poisson rate q and noise multiplier σ."""
    from llmdp.audit.fdp import lr_scores

    return lr_scores(np.asarray(iterates).T, float(q), float(sigma))
