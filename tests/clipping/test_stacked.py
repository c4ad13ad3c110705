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


def _deferred_sqs(U: int, g: torch.Generator) -> list[nb.Sq]:
    """`Sq`s in every form a rule may give (norms.Sq): err a constant, N_u with its rounding
    factor or formed from the value (None), dev as 1-3 factors of N_u or 0, rel a constant,
    mixed with tensor forms; values and N_u with zeros, huge and tiny magnitudes and
    non-finite entries."""
    def t(scale_lo=-12, scale_hi=12):
        scale = 10.0 ** torch.randint(scale_lo, scale_hi, (U,), generator=g).to(F64)
        x = torch.rand(U, generator=g, dtype=F64) * scale
        x[0] = 0.0
        return x

    out = []
    for i in range(12):
        value, mag = t(), t()
        if i == 3:
            value[2], mag[3] = math.inf, math.nan
        if i == 7:
            mag[4] = math.inf
        err = gamma(40 + i, U64) if i % 3 else value * 1e-9
        dev = [(gamma(9 + i, U32), nb.up_factor(1)), (gamma(5, 2.0**-22) + gamma(i + 2, U32), nb.up_factor(2)),
               0.0, t() * 1e-4, (gamma(3, U64),), (gamma(2, U32), 1.5, nb.up_factor(3))][i % 6]
        rel = gamma(2 + i, U32) if i % 4 else torch.full((U,), gamma(3, U32), dtype=F64)
        m, f = [(mag, nb.up_factor(20 + i)), (mag, None), (None, None)][i % 3]
        if m is None and isinstance(dev, tuple):
            m = mag  # the rules pass N_u whenever dev is a multiple of it
        if i % 4 == 1:  # the value deferred as a root (an instantiated gradient's norm)
            root = torch.sqrt(value)
            if isinstance(err, torch.Tensor):
                err = root.square() * 1e-9
            out.append(nb.Sq(None, err, dev, rel, m, f, root=root))
            continue
        out.append(nb.Sq(value, err, dev, rel, m, f))
    return out


def _eager(sq: nb.Sq) -> nb.Sq:
    """The same bounds formed one call at a time, as the rules formed them before."""
    value = sq.value
    err = sq._err if isinstance(sq._err, torch.Tensor) else value * sq._err
    if sq._mag is None:
        mag = nb.up(torch.sqrt(value + err), 2)
    else:
        mag = sq._mag if sq._mag_f is None else sq._mag * sq._mag_f
    if isinstance(sq._dev, tuple):
        dev = mag
        for f in sq._dev:
            dev = dev * f
    elif isinstance(sq._dev, torch.Tensor):
        dev = sq._dev
    else:
        dev = torch.zeros_like(value)
    rel = sq._rel if isinstance(sq._rel, torch.Tensor) else torch.full_like(value, float(sq._rel))
    return nb.Sq(value, err, dev, rel, mag)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0)) \
        and torch.equal(a.isnan(), b.isnan())


def test_deferred_bounds_are_formed_bit_for_bit_as_one_call_at_a_time():
    g = torch.Generator().manual_seed(3)
    U = 32
    sqs = _deferred_sqs(U, g)
    sinks = [U32 if i % 2 else U64 for i in range(len(sqs))]
    eager = [_eager(s) for s in sqs]
    # the fields, read one call at a time
    for s, e in zip(_deferred_sqs(U, torch.Generator().manual_seed(3)), eager):
        for k in ("value", "err", "dev", "rel", "mag"):
            assert _same(getattr(s, k), getattr(e, k)), k
    # the stacks: every mix of forms, and each form alone (1, 5, 9: values as roots)
    for pick in (range(len(sqs)), [0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11], [2, 8], [5, 11], [1, 5, 9]):
        pick = list(pick)
        a = stacked.Stack.of([sqs[i] for i in pick], [sinks[i] for i in pick])
        b = stacked.Stack.of([eager[i] for i in pick], [sinks[i] for i in pick])
        for k in ("value", "err", "d"):
            x, y = getattr(a, k), getattr(b, k)
            assert _same(x, y.expand_as(x) if y.shape != x.shape else y), (pick, k)
    # a deferred stack carries no state into the next: the same numbers again
    a2 = stacked.Stack.of(sqs, sinks)
    assert _same(a2.d, stacked.Stack.of(eager, sinks).d)


def test_constants_are_made_once_and_not_shared_with_callers_writes():
    c1 = stacked.const([1.0, 2.0, 3.0], torch.device("cpu"))
    c2 = stacked.const([1.0, 2.0, 3.0], torch.device("cpu"))
    assert c1 is c2  # no new host-to-device copy for a step's repeated constants
    sq = nb.Sq(torch.ones(4, dtype=F64), 0.5, 0.0, 0.25, torch.ones(4, dtype=F64))
    s = stacked.Stack.of([sq, sq], [U32, U32])
    s.err.add_(1.0)  # a caller writing into a stack must not change the cached constants
    again = stacked.Stack.of([sq, sq], [U32, U32])
    assert torch.equal(again.err, torch.full((2, 4), 0.5, dtype=F64))


def test_pending_mags_are_formed_as_one_call_at_a_time():
    """N_u deferred (``norms.PendingMag``: row norms kept, their per-row dot taken for all
    calls at once in ``Stack.of``) is the per-call N_u bit for bit, for units of one row and
    of several rows with padding, shapes mixed (grouped by shape), and so is the stack's
    deviation."""
    g = torch.Generator().manual_seed(5)
    R, U = 6, 4
    one = nb.Units.make(torch.arange(R), R)
    several = nb.Units.make(torch.tensor([0, 0, 1, 2, 3, -1]), U)

    def norms_of(T):
        x = torch.rand(R, T, generator=g, dtype=F64) * 10.0 ** torch.randint(-8, 8, (R, T), generator=g).to(F64)
        x[1, :] = 0.0  # a row of zeros
        return x

    sqs, eager = [], []
    for i, (units, T) in enumerate([(one, 7), (several, 7), (one, 7), (one, 11), (several, 7), (one, 11)]):
        pm = nb.PendingMag(norms_of(T), norms_of(T), units)
        f = nb.up_factor(30 + i)
        dev = (gamma(9 + i, U32), nb.up_factor(2))
        value = torch.rand(units.num_units, generator=g, dtype=F64)
        sqs.append(nb.Sq(value, gamma(20, U64), dev, gamma(3, U32), pm, f))
        eager.append(nb.Sq(value, gamma(20, U64), dev, gamma(3, U32), pm.form(), f))
    for s, e in zip(sqs, eager):
        assert torch.equal(nb.PendingMag.form_all([s._mag])[0], e._mag)
    by_units = [[0, 2, 3, 5], [1, 4]]  # a stack holds calls of one set of units
    for pick in by_units:
        a = stacked.Stack.of([sqs[i] for i in pick], [U32] * len(pick))
        b = stacked.Stack.of([eager[i] for i in pick], [U32] * len(pick))
        assert torch.equal(a.d, b.d) and torch.equal(a.err, b.err)
    for s, e in zip(sqs, eager):  # read one call at a time
        assert torch.equal(s.mag, e.mag) and torch.equal(s.dev, e.dev)
