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

from dataclasses import dataclass

import torch

from llmdp.clipping import norms as nb
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
        value = torch.stack([s.value for s in sqs])
        err = torch.stack([s.err for s in sqs])
        dev = torch.stack([s.dev for s in sqs])
        rel = torch.stack([s.rel for s in sqs])
        g = torch.tensor([gamma(1, su) for su in sink_us], dtype=F64).to(value.device)[:, None]
        rel = rel + g + rel * g  # norms.deviation, with the sink's γ per pair
        norm = torch.sqrt(torch.clamp(value + err, min=0))
        return Stack(value, err, nb.up(dev + rel * (norm + dev), 6))


def call_flags(stack: Stack, groups: list[list[int]],
               threshold: float = nb.FALLBACK) -> tuple[torch.Tensor, torch.Tensor]:
    """For calls whose pairs are ``groups`` (indices into ``stack``): (bad, neg), [calls, U]
    bool. ``bad``: the units whose bound is more than ``threshold`` of the call's own norm
    (``norms.worth_recomputing``); ``neg``: a finite value + bound below 0 (a bug). The
    call's norm is ``norms.used_norm`` of its parameters' sums, with k = parameters + 2
    roundings, as the engine formed it for one call (``GhostClipper._fallback_mask``)."""
    dev = stack.value.device
    width = max(len(g) for g in groups)
    pad = stack.value.shape[0]  # a zero row: adding it changes no sum
    idx = torch.tensor([g + [pad] * (width - len(g)) for g in groups], dtype=torch.long).to(dev)

    def gathered(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(1, x.shape[1])])[idx]  # [calls, width, U]

    value = _running_sum(gathered(stack.value), 1)
    err = _running_sum(gathered(stack.err), 1)
    d = gathered(stack.d)
    dsq = _running_sum(d * d, 1)
    ks = [len(g) + 2 for g in groups]
    up_k = torch.tensor([1.0 + gamma(k + 1, U64) for k in ks], dtype=F64).to(dev)[:, None]
    g_k = torch.tensor([gamma(k, U64) for k in ks], dtype=F64).to(dev)[:, None]
    err = err * up_k + g_k * (value.abs() * up_k)
    nu = nb.used_norm(value, err, dsq * up_k, check=False)
    return nb.worth_recomputing(value, err, dsq, nu, threshold), nb.negative(value, err)


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
