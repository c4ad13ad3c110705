"""Issue 50 item 7: the experts rule takes all experts of a MoE call at once (pairs sorted
by expert and unit; the norms of every (unit, expert) group in a few padded chunks; the
clipped sum per expert over tiles of pairs). Here one experts block of each MoE family, in
float64, with a routing chosen to reach every layout case: a unit of several rows, a
padding row, a unit routed to no token of some expert, an expert with no pair at all,
groups of very different sizes (several chunks, padded rows), and small tiles (several
tiles per expert, float32-style flushes). Per-unit norms and the clipped sum are checked
against each unit's gradient by autograd, alone; and a neighbour test: what is added for
a batch and for the batch less one unit differ by at most C."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import clip_factors
from llmdp.clipping.rules import experts as ex
from tests.clipping.test_families import family_model

MOE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")
T = 6  # tokens per row
ROW_UNITS = [0, 0, 1, -1, 2, 3]  # unit 0: two rows; row 3: padding


class Block(nn.Module):
    """One experts block called as transformers calls it, with a fixed routing; each row's
    loss is ⟨its outputs, fixed random weights⟩ (so each unit's gradient differs)."""

    def __init__(self, experts, idx, w, target):
        super().__init__()
        self.experts = experts
        self.register_buffer("idx", idx)
        self.register_buffer("w", w)
        self.register_buffer("target", target)

    def forward(self, x):
        R, t, d = x.shape
        out = self.experts(x.reshape(R * t, d), self.idx, self.w).reshape(R, t, d)
        return (out * self.target).sum((1, 2))


def _routing(E: int, seed: int):
    """[R·T, 2] distinct experts per token: expert E − 1 gets no pair; unit 1 (row 2) none
    of expert 0; unit 0's first row all on expert 0 (a large group); the rest random."""
    g = torch.Generator().manual_seed(seed)
    R = len(ROW_UNITS)
    idx = torch.empty(R * T, 2, dtype=torch.long)
    for n in range(R * T):
        row = n // T
        pool = list(range(E - 1))
        if row == 2:
            pool.remove(0)
        if row == 0:
            first = 0
        else:
            first = pool[int(torch.randint(len(pool), (1,), generator=g))]
        rest = [e for e in pool if e != first]
        idx[n] = torch.tensor([first, rest[int(torch.randint(len(rest), (1,), generator=g))]])
    w = torch.rand(R * T, 2, generator=g, dtype=torch.float64)
    return idx, w


def block(family: str, seed: int = 0) -> tuple[Block, torch.Tensor]:
    model = family_model(family)
    experts = model.model.layers[0].mlp.experts
    for p in model.parameters():
        p.requires_grad_(False)
    for p in experts.parameters():
        p.requires_grad_(True)
    E = experts.down_proj.shape[0]
    assert E >= 4
    d = experts.down_proj.shape[1] if not experts.is_transposed else experts.down_proj.shape[2]
    idx, w = _routing(E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    R = len(ROW_UNITS)
    x = torch.randn(R, T, d, generator=g, dtype=torch.float64)
    x[4] *= 30  # unit 2: a large gradient (clipped)
    target = torch.randn(R, T, d, generator=g, dtype=torch.float64)
    return Block(experts, idx, w, target), x


def per_unit_reference(m: Block, x: torch.Tensor, C: float):
    params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    losses = m(x)
    ru = torch.tensor(ROW_UNITS)
    per = []
    for u in range(int(ru.max()) + 1):
        gs = torch.autograd.grad(losses[ru == u].sum(), [p for _, p in params], retain_graph=True,
                                 allow_unused=True)
        per.append([torch.zeros_like(p) if g is None else g for g, (_, p) in zip(gs, params)])
    norms = torch.stack([torch.cat([g.reshape(-1) for g in gs]).norm() for gs in per])
    f = clip_factors(norms, C)
    return norms, {n: sum(f[u] * per[u][i] for u in range(len(per))) for i, (n, _) in enumerate(params)}


def engine_step(m: Block, x: torch.Tensor, C: float, row_units=ROW_UNITS, **kw):
    m.zero_grad(set_to_none=True)
    clipper = GhostClipper(m, C, **kw)
    norms = clipper.backward(m(x), torch.tensor(row_units))
    clipper.remove_hooks()
    return norms, {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


FINE = {"PAD_MIN": 0, "PAD_RATIO": 0.7, "TILE": 2, "FLUSH": 2}


@pytest.fixture(params=["default", "fine"])
def layout(request, monkeypatch):
    """default: the bench's chunking and tiles (one chunk, one tile per expert here);
    fine: chunks of groups within 0.7 of each other's size, tiles of 2 pairs flushed every
    2 (several padded chunks, several tiles and flushes per expert)."""
    if request.param == "fine":
        for k, v in FINE.items():
            monkeypatch.setattr(ex, k, v)
    return request.param


@pytest.fixture(params=["own", "recompute"])
def forward(request, monkeypatch):
    """own: the rule's own forward keeps the activation and the inner gradient (the CPU's
    default); recompute: transformers' kernel runs, the rule recomputes them (CUDA's)."""
    monkeypatch.setattr(ex, "OWN_FORWARD", request.param == "own")
    return request.param


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("policy", ["ghost", "instantiate"])
def test_batched_experts_against_per_unit_references(family, policy, layout, forward):
    m, x = block(family)
    ref_norms, _ = per_unit_reference(m, x, 1.0)
    C = float(ref_norms.median())  # some units clipped, some not
    ref_norms, ref_sum = per_unit_reference(m, x, C)
    assert ref_norms.min() > 0 and (ref_norms > C).any() and (ref_norms < C).any()
    for mode in ("book-keeping", "two-pass"):
        norms, got = engine_step(m, x, C, mode=mode, layer_policy=policy)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0,
                                   msg=lambda s, mode=mode: f"{family} {policy} {layout} {forward} {mode}: {s}")
        assert set(got) == set(ref_sum)
        for n, g in got.items():
            scale = float(ref_sum[n].abs().max())
            assert scale > 0
            torch.testing.assert_close(g, ref_sum[n], rtol=1e-9, atol=1e-13 * scale,
                                       msg=lambda s, n=n, mode=mode: f"{family} {policy} {layout} {mode} {n}: {s}")
        # the empty expert's slice is exactly zero; the others are not
        E = m.experts.down_proj.shape[0]
        assert not got["experts.down_proj"][E - 1].any()
        assert got["experts.down_proj"][: E - 1].abs().amax(dim=(1, 2)).min() > 0


def test_the_layout_cases_are_reached(monkeypatch):
    """The routing above reaches what the tests claim: a unit with no pair on some expert,
    an expert with none, groups of several sizes in several chunks with padded rows, and
    experts of several tiles."""
    for k, v in FINE.items():
        monkeypatch.setattr(ex, k, v)
    seen = {}
    build = ex.ExpertsRule._build

    def spy(self, rec, units):
        p = build(self, rec, units)
        seen["pairs"] = p
        return p
    monkeypatch.setattr(ex.ExpertsRule, "_build", spy)
    m, x = block("qwen3_moe")
    engine_step(m, x, 1.0)
    p = seen["pairs"]
    E = m.experts.down_proj.shape[0]
    assert p.n_e[E - 1] == 0 and (0, 1) not in p.group_of and (1, 1) in p.group_of
    chunks = p.chunks(1)
    assert len(chunks) > 2 and any(len(g) > 1 and min(p.g_size[i] for i in g) < M for g, M in chunks)
    assert max(p.n_e) > 2 * FINE["TILE"] * FINE["FLUSH"]  # several flushes of several tiles


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_neighbouring_batches_differ_by_at_most_C(family, mode, layout, forward):
    """What is added for the batch and for the batch less one unit (its row made padding,
    everything else the same) differ by that unit's clipped gradient: at most C."""
    m, x = block(family)
    C = 0.5 * float(per_unit_reference(m, x, 1.0)[0].min())  # every unit clipped
    for gone in (0, 2):
        _, full = engine_step(m, x, C, mode=mode)
        less = [(-1 if u == gone else u) for u in ROW_UNITS]
        _, part = engine_step(m, x, C, row_units=less, mode=mode)
        diff = torch.cat([(full[n] - part[n]).reshape(-1) for n in full]).norm()
        assert C * (1 - 1e-6) < diff <= C * (1 + 1e-12), (gone, float(diff), C)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_per_expert_tensor_core_sums_against_per_unit_references(family, layout, monkeypatch):
    """The clipped sum's tensor-core branch (CUDA bf16/fp16: per expert, its groups padded,
    one ``row_scaled_tn`` each), taken on the CPU in float64: each expert's groups are
    found on the host (no host sync per expert), a group of a zero-factor unit reads the
    zero row. Checked against the per-unit references, and with a unit whose gradient is
    not finite (factor 0: it adds nothing, and its NaN does not reach the sum)."""
    monkeypatch.setattr(ex.ExpertsRule, "_tensor_cores", lambda self, x, y: True)
    m, x = block(family)
    ref_norms, _ = per_unit_reference(m, x, 1.0)
    C = float(ref_norms.median())
    ref_norms, ref_sum = per_unit_reference(m, x, C)
    for mode in ("book-keeping", "two-pass"):
        norms, got = engine_step(m, x, C, mode=mode)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
        for n, g in got.items():
            # this branch keeps each expert's sum in float32 (bf16 operands' tensor-core
            # sums are float32): float32's relative precision, not float64's; a wrong
            # group or factor is off by O(1)
            scale = float(ref_sum[n].abs().max())
            torch.testing.assert_close(g, ref_sum[n], rtol=1e-6, atol=1e-6 * scale, msg=lambda s, n=n: f"{n}: {s}")
    bad = x.clone()
    bad[5, 2, 0] = float("nan")  # row 5: unit 3's only row
    for mode in ("book-keeping", "two-pass"):
        _, got = engine_step(m, bad, C, mode=mode)
        _, want = engine_step(m, x, C, row_units=[u if u != 3 else -1 for u in ROW_UNITS], mode=mode)
        for n in want:
            assert torch.isfinite(got[n]).all(), n
            torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-15 * float(want[n].abs().max()))


def test_the_cpu_weight_sum_is_the_documented_one_bit_for_bit(monkeypatch):
    """The CPU's float32 clipped sum per expert (``ExpertsRule._weight_sum``): tiles of TILE
    pairs (the smaller operand scaled), their float32 sum flushed to float64 every FLUSH
    tiles, cast to float32 once; written out here in that order and compared bit for bit, on
    experts with no pair, one tile, at most FLUSH tiles (summed in the result's own slice)
    and several flushes, with zero factors (their pairs add exactly 0, a NaN among them
    reaches nothing)."""
    from types import SimpleNamespace

    monkeypatch.setattr(ex, "TILE", 4)
    monkeypatch.setattr(ex, "FLUSH", 2)
    g = torch.Generator().manual_seed(5)
    n_e = [0, 3, 8, 17, 40, 0]
    P, a, b = sum(n_e), 6, 9
    x, y = torch.randn(P + 1, a, generator=g), torch.randn(P + 1, b, generator=g) * 1e3
    x[-1], y[-1] = 0, 0
    f = torch.rand(P, generator=g, dtype=torch.float64).to(torch.float32)
    f[::7] = 0
    x[0:P:7] = float("nan")  # the zero-factor pairs: must not reach the sum
    live = f != 0
    ptr = [0]
    for n in n_e:
        ptr.append(ptr[-1] + n)
    pairs = SimpleNamespace(n_e=n_e, e_ptr=ptr)
    got = ex.ExpertsRule()._weight_sum(pairs, x, y, f, live, None)
    xz, yz = torch.where(live[:, None], x[:-1], 0), torch.where(live[:, None], y[:-1], 0)
    fz = torch.where(live, f, 0)[:, None]
    want = []
    for lo, hi in zip(ptr[:-1], ptr[1:]):
        acc32 = acc64 = None
        for i, p0 in enumerate(range(lo, hi, 4)):
            p1 = min(hi, p0 + 4)
            part = (xz[p0:p1] * fz[p0:p1]).t() @ yz[p0:p1]  # a = 6 <= b = 9: x scaled
            acc32 = part if acc32 is None else acc32 + part
            if (i + 1) % 2 == 0 or p1 == hi:
                acc64 = acc32.double() if acc64 is None else acc64 + acc32.double()
                acc32 = None
        want.append(torch.zeros(a, b) if acc64 is None else acc64.float())
    want = torch.stack(want)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert not got[0].any() and not got[-1].any() and got[1:-1].abs().amax(dim=(1, 2)).min() > 0


def test_the_chunks_row_norms_are_the_pairs_taken_once_and_bound_every_row(monkeypatch):
    """The norms' chunks take their row norms from the pairs' (one ``row_norms`` per pair
    tensor, gathered; the padding rows are the zero row): in float32, every chunk row's
    norm is ≥ its exact norm, 0 exactly for the padding rows, and ``row_norms`` runs
    twice per virtual Linear, never on a chunk."""
    from llmdp.clipping import lowp
    from llmdp.clipping import norms as nb

    for k, v in FINE.items():
        monkeypatch.setattr(ex, k, v)
    given, taken = [], []
    know, rn = nb.Units.know_norms, lowp.row_norms

    def spy_know(self, x, n):
        given.append((x, n))
        return know(self, x, n)

    def spy_rn(x):
        taken.append(tuple(x.shape))
        return rn(x)

    monkeypatch.setattr(nb.Units, "know_norms", spy_know)
    monkeypatch.setattr(lowp, "row_norms", spy_rn)
    m, x = block("qwen3_moe")
    m.float()
    engine_step(m, x.float(), 1.0)
    assert len(taken) == 4 and all(len(s) == 2 for s in taken), taken  # [P + 1, ·] x 2 x 2
    assert len(given) > 4  # several chunks, A and G each
    padding = 0
    for xs, n in given:
        exact = xs.double().norm(dim=-1)
        assert n.dtype == torch.float64 and n.shape == exact.shape
        assert (n >= exact).all()
        zero = ~xs.bool().any(-1)
        padding += int(zero.sum())
        assert (n[zero] == 0).all() and (n[~zero] > 0).all()
    assert padding > 0


@pytest.mark.parametrize("family", MOE)
def test_the_own_forward_is_the_blocks_and_a_plain_backward_gets_every_gradient(family, monkeypatch):
    """While a clipper records, the block runs the rule's forward: its output is the
    block's own (float64, to rounding), a plain backward through it (no clipper backward)
    gets the block's parameter and input gradients, the clipper's backward takes the
    captured path (no recompute), and removing the hooks restores the block's forward."""
    m, x = block(family)
    x = x.clone().requires_grad_(True)
    want = m(x)
    want_grads = torch.autograd.grad(want.sum(), [x, *m.experts.parameters()])
    clipper = GhostClipper(m, 1.0)
    assert "forward" in m.experts.__dict__
    got = m(x)
    assert ex._OWN[m.experts].pending() is not None  # the own forward ran
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad(got.sum(), [x, *m.experts.parameters()])
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    used = []
    captured = ex.ExpertsRule._captured

    def spy(self, *a, **k):
        used.append(1)
        return captured(self, *a, **k)
    monkeypatch.setattr(ex.ExpertsRule, "_captured", spy)
    clipper.backward(m(x), torch.tensor(ROW_UNITS))
    assert used == [1]
    clipper.remove_hooks()
    assert "forward" not in m.experts.__dict__ and m.experts not in ex._OWN


def test_a_copy_of_a_block_with_the_own_forward_runs_its_own_parameters():
    """A deep copy of a block whose forward the rule installed runs the copy's parameters
    through its class's forward, not the original's; a clipper attached to the copy
    installs its own."""
    import copy

    m, x = block("qwen3_moe")

    class Engine:  # the rule's install as an engine calls it, without the engine's hooks
        _recording, _anchor = True, None

    engine = Engine()
    handle = ex.ExpertsRule().install(m.experts, engine)
    assert "forward" in m.experts.__dict__
    twin = copy.deepcopy(m)
    with torch.no_grad():
        for p in twin.experts.parameters():
            p.mul_(2)
    want = type(twin.experts).forward  # the class's forward on the copy
    got = twin(x)
    assert twin.experts not in ex._OWN
    R, t, d = x.shape
    ref = (want(twin.experts, x.reshape(R * t, d), twin.idx, twin.w).reshape(R, t, d) * twin.target).sum((1, 2))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.allclose(got, m(x))
    clipper = GhostClipper(twin, 1.0)
    assert twin.experts in ex._OWN and ex._OWN[twin.experts] is not ex._OWN[m.experts]
    norms = clipper.backward(twin(x), torch.tensor(ROW_UNITS))
    assert torch.isfinite(norms).all()
    handle.remove()
    assert "forward" not in m.experts.__dict__ and m.experts not in ex._OWN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_neighbours_in_float32_and_bf16_differ_by_at_most_C(dtype, mode, forward):
    """The neighbour test with float32 and bf16 experts (float32 sums): for each unit,
    what is added for the batch and for the batch less that unit differ by at most C,
    measured in float64 from what was added (every unit clipped), with the rule's own
    forward (which then runs the block in that dtype) and with the recompute."""
    m, x = block("qwen3_moe")
    C = 0.5 * float(per_unit_reference(m, x, 1.0)[0].min())
    m.to(dtype)
    x = x.to(dtype)
    names = [n for n, p in m.named_parameters() if p.requires_grad]

    def added(ru):
        sinks = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in m.named_parameters() if p.requires_grad}
        clipper = GhostClipper(m, C, mode=mode, grad_buffers=sinks)
        norms = clipper.backward(m(x), torch.tensor(ru))
        clipper.remove_hooks()
        return torch.cat([sinks[n].double().reshape(-1) for n in names]), norms

    full, norms = added(ROW_UNITS)
    assert (norms > 1.5 * C).all()
    worst = 0.0
    for gone in range(max(ROW_UNITS) + 1):
        part, _ = added([(-1 if u == gone else u) for u in ROW_UNITS])
        worst = max(worst, float((full - part).norm()) / C)
    assert 1 - 1e-3 < worst <= 1 + 1e-6, worst
