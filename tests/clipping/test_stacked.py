"""The bound arithmetic of all calls as one computation (issue 50, item 2): the stacked
flags and norms are the per-call, per-parameter arithmetic of ``norms`` (``deviation``,
``used_norm``, ``worth_recomputing``), bit for bit on the CPU, on adversarial values (huge
and tiny magnitudes, zeros, a non-finite unit, float32 and float64 sinks)."""

from __future__ import annotations

import math

import torch

from llmdp.clipping import norms as nb
from llmdp.clipping import stacked
from llmdp.clipping.lowp import U32, U64, gamma

F64 = torch.float64


def _sq(U: int, g: torch.Generator) -> nb.Sq:
    scale = 10.0 ** torch.randint(-12, 12, (U,), generator=g).to(F64)
    value = torch.rand(U, generator=g, dtype=F64) * scale
    err = value * torch.rand(U, generator=g, dtype=F64) * 10.0 ** torch.randint(-16, 0, (U,), generator=g).to(F64)
    dev = torch.sqrt(value) * torch.rand(U, generator=g, dtype=F64) * 1e-3
    rel = torch.full((U,), gamma(3, U32), dtype=F64)
    value[0] = err[0] = dev[0] = 0.0  # a unit whose gradient is exactly 0
    return nb.Sq(value, err, dev, rel, torch.sqrt(value) * 10)


def _per_call(sqs, sinks):
    """GhostClipper's per-call arithmetic before issue 50 (``_fallback_mask``)."""
    value = err = dsq = None
    for sq, su in zip(sqs, sinks):
        d = nb.deviation(sq, su)
        value = sq.value if value is None else value + sq.value
        err = sq.err if err is None else err + sq.err
        dsq = d * d if dsq is None else dsq + d * d
    k = len(sqs) + 2
    err = nb.up(err, k) + gamma(k, U64) * nb.up(value.abs(), k)
    nu = nb.used_norm(value, err, nb.up(dsq, k), check=False)
    return nb.worth_recomputing(value, err, dsq, nu), nb.negative(value, err)


def _total(per_param):
    """GhostClipper._norms before issue 50, for parameters with one use each."""
    K = len(per_param) + 2
    value = sum(v for v, _, _ in per_param)
    err = nb.up(sum(e for _, e, _ in per_param), K)
    err = err + gamma(K, U64) * nb.up(sum(v.abs() for v, _, _ in per_param), K)
    dsq = nb.up(sum(d * d for _, _, d in per_param), 2 * K)
    return nb.used_norm(value, err, dsq, check=False), value


def test_stacked_flags_and_norms_are_the_per_call_arithmetic_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    U = 64
    calls = [[_sq(U, g) for _ in range(k)] for k in (1, 2, 3, 1, 5, 2)]
    calls[2][1] = nb.Sq(*(t.clone() for t in (calls[2][1].value, calls[2][1].err, calls[2][1].dev,
                                               calls[2][1].rel, calls[2][1].mag)))
    calls[2][1].value[5] = math.inf  # a non-finite unit
    calls[4][0].err[7] = calls[4][0].value[7] * 0.5  # a bound that is a real part of the norm
    sinks = [[U32 if (i + j) % 3 else U64 for j in range(len(c))] for i, c in enumerate(calls)]
    flat = [s for c in calls for s in c]
    flat_sinks = [s for c in sinks for s in c]
    stack = stacked.Stack.of(flat, flat_sinks)
    groups, i = [], 0
    for c in calls:
        groups.append(list(range(i, i + len(c))))
        i += len(c)
    bad, neg = stacked.call_flags(stack, groups)
    any_bad = False
    for j, (c, su) in enumerate(zip(calls, sinks)):
        b, n = _per_call(c, su)
        assert torch.equal(bad[j], b) and torch.equal(neg[j], n)
        any_bad |= bool(b.any())
    assert any_bad  # the case the flags exist for is exercised
    # deviation per pair, and the norm over all parameters
    for row, (sq, su) in enumerate(zip(flat, flat_sinks)):
        assert torch.equal(stack.d[row], nb.deviation(sq, su))
    nu, value, negs = stacked.total(stack.value, stack.err, stack.d)
    nu_ref, value_ref = _total([(s.value, s.err, nb.deviation(s, su)) for s, su in zip(flat, flat_sinks)])
    assert torch.equal(value, value_ref)
    assert torch.equal(torch.nan_to_num(nu, posinf=-1.0), torch.nan_to_num(nu_ref, posinf=-1.0))
    assert not bool(negs.any())


def test_a_negative_sum_is_flagged_where_it_is():
    g = torch.Generator().manual_seed(1)
    sqs = [_sq(8, g), _sq(8, g)]
    sqs[1].value[3] = -(sqs[0].value[3] + sqs[0].err[3] + sqs[1].err[3]) * 2 - 1
    stack = stacked.Stack.of(sqs, [U32, U32])
    _, neg = stacked.call_flags(stack, [[0, 1]])
    assert neg[0].tolist() == [i == 3 for i in range(8)]
    _, _, negs = stacked.total(stack.value, stack.err, stack.d)
    assert negs.tolist() == [i == 3 for i in range(8)]
