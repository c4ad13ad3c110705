"""Issue 50: on the CPU, book-keeping leaves small row norms (``lowp.LazyRowNorms``) and the
Gram-path ghost norms with their bounds (``gram.PendingGram``) to the step's one bound
computation (``stacked.Stack.of``), where the calls of one shape are formed at once.

Formed together or one at a time, every number is the same bit for bit: the row norms
against ``lowp.row_norms`` (zero rows, subnormal rows, bf16, overflow), the Gram path's
(V, E) against ``gram.sq_norm`` formed per call (units of one row, padding), and the whole
engine (norms used, clipped sums) with the deferral on and off, on a Llama with its Linears
on the Gram path and on rank-4 "adapters" that are instantiated. Tests fail if nothing is
batched (a spy counts the calls formed together)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmdp.clipping import engine, gram, lowp, norms
from llmdp.clipping.norms import Units
from tests.clipping.test_norm_bounds import assert_same_bits, clipped_step

C = 1e-2


def _rows(seed: int, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """Random rows with every special case ``row_norms`` tells apart: rows of zeros, a row of
    one subnormal (its norm not 0 however the arithmetic flushes), a row near float32's
    largest values (its norm inf)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-8, 8, shape[:-1] + (1,), generator=g)
    x[..., -1, :] = 0  # a causal LM's last position
    x[0, 1] = 0
    x[0, 1, 0] = 1e-39  # subnormal in float32 and bf16
    x[-1, 2] = 3e38
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lazy_row_norms_are_row_norms_bit_for_bit(dtype):
    xs = [_rows(i, (3, 7, w), dtype) for i, w in enumerate([16, 16, 16, 5, 5, 300])]
    xs.append(torch.zeros(3, 7, 16, dtype=dtype))
    lazy = [lowp.LazyRowNorms(x) for x in xs]
    formed = lowp.LazyRowNorms(xs[0])
    formed.get()
    stacks = []
    real = torch.stack
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "stack", lambda ts, *a, **k: (stacks.append(len(ts)), real(ts, *a, **k))[1])
        lowp.LazyRowNorms.form_all(lazy + [formed, torch.ones(2)])  # others ignored
    assert sorted(stacks) == [2, 4]  # the five 16-wide ones, the two 5-wide; 300 alone
    for x, n in zip(xs, lazy):
        assert n.x is None  # released
        assert torch.equal(n.get(), lowp.row_norms(x))
    assert torch.isinf(lazy[0].get()[-1, 2]) and lazy[0].get()[0, 1] > 0
    assert (lazy[-1].get() == 0).all() and (lazy[0].get()[:, -1] == 0).all()


def test_row_norms_are_deferred_only_where_allowed(monkeypatch):
    small, big = torch.randn(2, 3, 4), torch.randn(64, 64, 64)
    assert isinstance(lowp.row_norms_maybe_lazy(small, True), lowp.LazyRowNorms)
    assert isinstance(lowp.row_norms_maybe_lazy(small, False), torch.Tensor)
    # over MAX_BYTES: deferred where it is formed without a copy (float32 on the CPU), not
    # in float64 (no one-buffer path) or with that path switched off
    assert isinstance(lowp.row_norms_maybe_lazy(big, True), lowp.LazyRowNorms)
    assert isinstance(lowp.row_norms_maybe_lazy(big.double(), True), torch.Tensor)
    monkeypatch.setattr(lowp, "DEFER_LARGE_CPU_NORMS", False)
    assert isinstance(lowp.row_norms_maybe_lazy(big, True), torch.Tensor)
    monkeypatch.undo()
    monkeypatch.setattr(lowp, "on_cpu", lambda x: False)  # a GPU: its own one-launch path
    assert isinstance(lowp.row_norms_maybe_lazy(small, True), torch.Tensor)
    monkeypatch.undo()
    monkeypatch.setattr(lowp, "DEFER_CPU_NORMS", False)
    assert isinstance(lowp.row_norms_maybe_lazy(small, True), torch.Tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_large_row_norms_are_formed_without_a_copy_bit_for_bit(dtype, monkeypatch):
    """Row norms over ``MAX_BYTES`` formed together (``_row_norms_torch_many``): no stack
    of the inputs, and every bit of ``row_norms`` of each — zero rows (0), a row of one
    subnormal (the bits read), overflow (inf) — also in a group whose zero rows are all
    zeros (the ``masked_fill_`` branch) and one with none."""
    w = lowp.LazyRowNorms.MAX_BYTES // (3 * 7 * 2) + 1  # every x over MAX_BYTES
    xs = [_rows(i, (3, 7, w), dtype) for i in range(3)]
    zeros_only = [x.clone() for x in xs]
    for x in zeros_only:
        x[0, 1] = 0  # no subnormal row: the zero rows are all zeros
    no_zero = [torch.randn(3, 7, w).to(dtype) + 1 for _ in range(2)]
    stacks = []
    real = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: (stacks.append(len(ts)), real(ts, *a, **k))[1])
    for group in (xs, zeros_only, no_zero):
        lazy = [lowp.row_norms_maybe_lazy(x, True) for x in group]
        assert all(isinstance(n, lowp.LazyRowNorms) for n in lazy)
        lowp.LazyRowNorms.form_all(lazy)
        for x, n in zip(group, lazy):
            assert n.x is None
            assert torch.equal(n.get().view(torch.int64), lowp.row_norms(x).view(torch.int64))
    assert stacks == []  # no copy of the inputs
    n = lowp.row_norms(xs[0])
    assert (n[:, -1] == 0).all()
    if dtype != torch.float16:  # fp16 holds neither 1e-39 nor 3e38 (0 and inf there)
        assert n[0, 1] > 0 and torch.isinf(n[-1, 2])


def _reference(A3, G3, units):
    """(V, E) of units of one row each, written out from ``gram``'s module docstring as the
    per-call code formed them before the deferral (an independent transcription)."""
    from llmdp.clipping.lowp import U64, gamma

    g_a, eta_a = gram.entry_gamma(A3, A3)
    g_g, eta_g = gram.entry_gamma(G3, G3)
    na = gram.padded_norms(lowp.row_norms(A3), g_a, eta_a)
    mg = gram.padded_norms(lowp.row_norms(G3), g_g, eta_g)
    ga, gg = gram.gram32(A3, A3).double(), gram.gram32(G3, G3).double()
    value = units.rows_to_units((ga * gg).sum(2).sum(1))
    e_a = units.rows_to_units((torch.bmm(gg.abs(), na.unsqueeze(2)).squeeze(2) * na).sum(1))
    e_g = units.rows_to_units((torch.bmm(ga.abs(), mg.unsqueeze(2)).squeeze(2) * mg).sum(1))
    T = A3.shape[1]
    h = units.pair_count(T, T)
    up1 = 1.0 + gamma(h + units.max_rows + 3, U64)
    n_hat = units.rows_to_units((na * mg).sum(1)) * (1.0 + gamma(T + units.max_rows + 3, U64))
    second = (g_a * g_g + gamma(h, U64) * (1.0 + g_a) * (1.0 + g_g)) * (1.0 + gamma(6, U64))
    err = g_a * (e_a * up1) + g_g * (e_g * up1) + second * (n_hat * n_hat)
    return value, err * (1.0 + gamma(12, U64))


@pytest.mark.parametrize("unit_of_row", [[0, 1, 2, 3], [0, -1, 1, 2]], ids=["identity", "padding"])
@pytest.mark.parametrize("lazy", [False, True], ids=["norms", "lazy-norms"])
def test_pending_grams_are_formed_as_one_call_is(unit_of_row, lazy):
    """Several calls (widths 16 to 300, one T), formed together: (V, E) are ``sq_norm``'s
    per-call ones bit for bit, those are the docstring's formula's (``_reference``), and E
    bounds the error (test_gram.py's error-free reference)."""
    from tests.clipping.test_gram import _true_sq

    U = max(unit_of_row) + 1
    R, T = len(unit_of_row), 9
    calls = [(_rows(10 + i, (R, T, d)), _rows(20 + i, (R, T, p)) * 1e-3)
             for i, (d, p) in enumerate([(16, 16), (16, 300), (40, 7), (300, 300)])]
    for A3, G3 in calls:  # no overflow here: the bound is checked below
        A3[-1, 2] = 0.5
        G3[-1, 2] = 0.5
    eager = Units.make(torch.tensor(unit_of_row), U)
    deferred = Units.make(torch.tensor(unit_of_row), U)
    deferred.defer = True
    want = [gram.sq_norm(A3, G3, eager) for A3, G3 in calls]
    for (v, e), (A3, G3) in zip(want, calls):
        rv, re = _reference(A3, G3, eager)
        assert torch.equal(v, rv) and torch.equal(e, re)
    pending = []
    for A3, G3 in calls:
        na = lowp.LazyRowNorms(A3) if lazy else lowp.row_norms(A3)
        ng = lowp.LazyRowNorms(G3) if lazy else lowp.row_norms(G3)
        p, same = gram.sq_norm(A3, G3, deferred, norms_a=na, norms_g=ng)
        assert isinstance(p, gram.PendingGram) and same is p
        pending.append(p)
    sizes = []
    real = gram._finish
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gram, "_finish", lambda items: (sizes.append(len(items)), real(items))[1])
        got = gram.PendingGram.form_all(pending)
    assert sizes == [len(calls)]
    for (v, e), (wv, we), (A3, G3) in zip(got, want, calls):
        assert torch.equal(v, wv) and torch.equal(e, we)
        true = _true_sq(A3, G3, unit_of_row, U)
        for u in range(U):
            assert abs(float(v[u]) - true[u]) <= float(e[u]) + 4 * lowp.U64 * true[u]


def test_grams_with_row_pairs_are_not_deferred():
    units = Units.make(torch.tensor([0, 0, 1]), 2)
    units.defer = True
    A3, G3 = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    value, err = gram.sq_norm(A3, G3, units, norms_a=lowp.LazyRowNorms(A3), norms_g=lowp.LazyRowNorms(G3))
    assert isinstance(value, torch.Tensor) and isinstance(err, torch.Tensor)


def _spies(monkeypatch) -> dict:
    seen = {"grams": [], "norms": []}
    real_g, real_n = gram.PendingGram.form_all, lowp.LazyRowNorms.form_all

    def grams(items):
        seen["grams"].append(len(items))
        return real_g(items)

    def rows(items):
        seen["norms"].append(sum(isinstance(i, lowp.LazyRowNorms) and i._n is None for i in items))
        return real_n(items)

    monkeypatch.setattr(gram.PendingGram, "form_all", staticmethod(grams))
    monkeypatch.setattr(lowp.LazyRowNorms, "form_all", staticmethod(rows))
    return seen


@pytest.mark.parametrize("row_units", [[0, 1, 2, 3, 4, 5], [0, 1, -1, 2, 3, 4], [0, 1, 1, 2, 3, 4]],
                         ids=["identity", "padding", "pairs"])
def test_the_engine_is_the_same_with_the_deferral_on_or_off(monkeypatch, row_units):
    """A Llama, every Linear on the float32 Gram path (forced at these widths), book-keeping on
    the CPU: the norms used and the clipped sums with the deferral on are those with it off,
    bit for bit; the Gram-path calls are formed together (units of one row each)."""
    from llmdp.base.losses import row_losses
    from tests.clipping.test_engine import V, make_batch
    from tests.helpers import tiny_model

    seen = _spies(monkeypatch)
    model = tiny_model("llama", vocab_size=V, hidden_size=32, intermediate_size=64)
    batch = {**make_batch(row_units), "row_units": torch.tensor(row_units)}

    def run(defer: bool):
        monkeypatch.setattr(lowp, "DEFER_CPU_NORMS", defer)
        with gram.forced("lowp"):
            return clipped_step(model, lambda: row_losses(model, batch), batch["row_units"], C,
                                mode="book-keeping", layer_policy="ghost")

    a = run(True)
    if 1 in row_units[2:3]:  # row pairs: the Gram path forms per call (its norms with it)
        assert not seen["grams"]
    else:
        assert seen["grams"] and max(seen["grams"]) >= 8  # the layers' Linears, together
        assert seen["norms"] and max(seen["norms"]) >= 2
    seen["grams"].clear()
    seen["norms"].clear()
    b = run(False)
    assert not seen["grams"] and not any(seen["norms"])
    assert_same_bits(a, b)


@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_instantiated_adapters_are_the_same_with_the_deferral_on_or_off(monkeypatch, mode):
    """Rank-4 Linears (LoRA's shapes) instantiated: their small inputs' and output gradients'
    row norms and N_u are left to the bound computation under book-keeping (several windows
    of it: ``engine.WINDOWS``), never under two-pass (which drops G); the same bits either way."""
    seen = _spies(monkeypatch)
    torch.manual_seed(3)

    class Adapters(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.ModuleList(nn.Linear(24, 4, bias=False) for _ in range(4))
            self.up = nn.ModuleList(nn.Linear(4, 24, bias=False) for _ in range(4))

        def forward(self, x):
            for d, u in zip(self.down, self.up):
                x = torch.tanh(x + u(d(x)))
            return x.square().mean((1, 2))

    model = Adapters()
    x = torch.randn(5, 6, 24)
    units = torch.tensor([0, 1, 2, -1, 3])

    def run(defer: bool):
        monkeypatch.setattr(lowp, "DEFER_CPU_NORMS", defer)
        return clipped_step(model, lambda: model(x), units, C, mode=mode, layer_policy="instantiate")

    a = run(True)
    if mode == "book-keeping":
        assert max(seen["norms"]) >= 2
    else:
        assert not any(seen["norms"])
    seen["norms"].clear()
    b = run(False)
    assert not any(seen["norms"])
    assert_same_bits(a, b)
    assert engine.WINDOWS >= 2


def test_a_deferred_norm_read_on_its_own_is_formed():
    """A `Sq` holding a `PendingGram` forms it when a field is read (``_combine`` reads the
    calls of a shared parameter one by one): value and err are the pending pair's."""
    units = Units.make(torch.tensor([0, 1]), 2)
    units.defer = True
    A3, G3 = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    p, _ = gram.sq_norm(A3, G3, units)
    want = p.form()
    sq = norms.Sq(p, p, 0.0, 0.0, torch.ones(2))
    assert torch.equal(sq.err, want[1]) and torch.equal(sq.value, want[0])
    sq2 = norms.Sq(p, p, 0.0, 0.0, torch.ones(2))
    assert torch.equal(sq2.value, want[0]) and torch.equal(sq2.err, want[1])
