"""Issue 50 item 6: a Linear's ghost norm from float32 Gram matrices with an a-posteriori
bound (``clipping/gram.py``), and the fallback threshold as a setting.

* the bound against error-free references: random data (units of several rows, padding),
  massive activations up to T = 2,048, float32 underflow, rows of zeros (exactly 0);
* the worst rounding the entry model admits, forced elementwise (every Gram entry moved by
  0.9 of its admitted error in the direction that moves Σ ã b̃ most, up and down): still
  covered, and the bound is nearly attained (so an undercounted term would fail);
* the engine with the path forced on CPU: massive activations add ≤ C (the fallback takes
  the units whose bound is material), random data needs no fallback, the neighbour test
  (removing any one unit changes what was added by at most C) on a bf16 Llama;
* the policy (auto never on the CPU), the cost model, the threshold's validation and what
  it changes (utility, never the ≤ C guarantee)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from llmdp.clipping import GhostClipper, gram, lowp, norms
from llmdp.clipping.lowp import U32, U64, gamma
from llmdp.clipping.norms import Units
from tests.clipping.test_norm_bounds import SLACK, C, _exact_sum, _massive, _true_norm


def _true_sq(A3: torch.Tensor, G3: torch.Tensor, unit_of_row: list[int], U: int) -> list[float]:
    """‖Σ_{r in u} G_rᵀA_r‖² per unit from float32-or-narrower A, G: exact products in
    float64, error-free sums (``_exact_sum``), squares summed by math.fsum (≤ 3·2⁻⁵³)."""
    out = []
    for u in range(U):
        rows = [r for r, x in enumerate(unit_of_row) if x == u]
        A = A3[rows].reshape(-1, A3.shape[-1]).double()
        G = G3[rows].reshape(-1, G3.shape[-1]).double()
        g = _exact_sum(G[:, :, None] * A[:, None, :])
        out.append(math.fsum((g.reshape(-1) ** 2).tolist()))
    return out


def _check(A3, G3, unit_of_row, **kw):
    """(V, E, true) per unit, after checking |V − true| ≤ E (the reference's own 3·2⁻⁵³)."""
    U = max(unit_of_row) + 1
    units = Units.make(torch.tensor(unit_of_row), U)
    value, err = gram.sq_norm(A3, G3, units, **kw)
    true = _true_sq(A3, G3, unit_of_row, U)
    for u in range(U):
        v, e, t = float(value[u]), float(err[u]), true[u]
        assert abs(v - t) <= e + 4 * U64 * t, (u, v, e, t)
    return value, err, true


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 64, 48), (37, 300, 17), (200, 64, 64), (9, 40, 1100)], ids=str)
@pytest.mark.parametrize("unit_of_row", [[0, 1, 2], [0, 0, 1, -1, 1]], ids=["identity", "pairs"])
def test_the_bound_holds_on_random_data(dtype, shape, unit_of_row):
    T, d, p = shape
    g = torch.Generator().manual_seed(T + d)
    R = len(unit_of_row)
    A3 = torch.randn(R, T, d, generator=g).to(dtype)
    G3 = (torch.randn(R, T, p, generator=g) * 1e-3).to(dtype)
    value, err, _ = _check(A3, G3, unit_of_row)
    assert (err > 0).all() and (value > 0).all()


def test_the_bound_is_far_below_the_a_priori_one_in_high_dimension():
    """Random-like rows in d = 512: the Gram entries off the diagonal are ~1/√d of the norm
    products, so E_u is a fraction of the a-priori γ_d(2⁻²⁴)·N_u², and a small share of ‖g‖²."""
    g = torch.Generator().manual_seed(0)
    T, d, p = 128, 512, 256
    A3 = torch.randn(2, T, d, generator=g)
    G3 = torch.randn(2, T, p, generator=g)
    value, err, true = _check(A3, G3, [0, 1])
    mag = norms.linear_mag(A3, G3)
    a_priori = (gamma(d + 1, U32) + gamma(p + 1, U32)) * mag * mag
    assert (err < 0.1 * a_priori).all(), err / a_priori
    assert (err < 2e-3 * value).all(), err / value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,big", [(64, 10.0), (256, 100.0), (2048, 100.0), (64, 1e4)])
def test_the_bound_covers_massive_activations(T, big, dtype):
    """One unit, a shared large channel, cancelling gradients: ‖g‖² is a small difference of
    huge terms; the bound covers the float32 Grams' loss (and is material: the engine's
    fallback takes such a unit, ``test_the_engine_adds_at_most_C_with_massive_activations``)."""
    A, G = _massive(T, 64, 64, big, dtype)
    value, err, true = _check(A[None], G[None], [0])
    assert float(err[0]) > norms.FALLBACK * true[0]  # material: it goes to the fallback


def _adversarial(monkeypatch, sign: float):
    """gram32 replaced by the exact Gram (float64) moved by 0.9 of the admitted error
    γ·Σ_i|x_ti||y_si| per entry, toward ``sign``·(the other Gram's sign), rounded to float32
    (within the remaining 0.1·γ·Σ|x||y| ≥ 2⁻²⁴·|entry| for d ≥ 10): the worst the entry
    model admits, applied elementwise, not left to a BLAS."""
    seen = {}

    def exact(x, y):
        return torch.bmm(x.double(), y.double().transpose(1, 2))

    def moved(x, y):
        a = exact(x, y)
        other = seen.get("other")
        direction = torch.sign(other) if other is not None and other.shape == a.shape else torch.ones_like(a)
        direction = torch.where(direction == 0, torch.ones_like(direction), direction)
        g, _ = gram.entry_gamma(x, y)
        mag = torch.bmm(x.double().abs(), y.double().abs().transpose(1, 2))
        return (a + sign * 0.9 * g * mag * direction).float()

    monkeypatch.setattr(gram, "gram32", lambda x, y: moved(x, y))
    monkeypatch.setattr(gram, "self_gram32", lambda x: moved(x, x))
    return seen, exact


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["up", "down"])
def test_the_worst_admitted_rounding_is_covered_and_nearly_attained(monkeypatch, sign):
    g = torch.Generator().manual_seed(3)
    T, d, p = 48, 32, 24
    A3 = torch.randn(1, T, d, generator=g)
    G3 = torch.randn(1, T, p, generator=g)
    seen, exact = _adversarial(monkeypatch, sign)
    # ã moves with sign(b), b̃ with sign(ã): every first-order term of the error adds up
    seen["other"] = exact(G3, G3)
    ga = gram.gram32(A3, A3)
    seen["other"] = ga.double()
    value, err, true = _check(A3, G3, [0], gram_a=ga)
    miss = abs(float(value[0]) - true[0])
    assert (float(value[0]) - true[0]) * sign > 0
    assert miss > 0.5 * float(err[0]), (miss, float(err[0]))


def test_underflow_and_rows_of_zeros():
    """Products below float32's range (rows of norm 1e-25: every product underflows) are
    covered by the absolute term; a unit whose G is zero has value and bound exactly 0 (a
    LoRA B at initialization: nothing to recompute)."""
    g = torch.Generator().manual_seed(5)
    A3 = torch.randn(2, 20, 40, generator=g) * 1e-25
    G3 = torch.randn(2, 20, 30, generator=g) * 1e-25
    value, err, true = _check(A3, G3, [0, 1])
    assert (err > 0).all()
    G3[1] = 0
    G3[0, 3] = 0  # one zero row inside a unit changes nothing of the others' bound
    value, err, _ = _check(torch.randn(2, 20, 40, generator=g), G3, [0, 1])
    assert float(value[1]) == 0.0 and float(err[1]) == 0.0 and float(err[0]) > 0


# --------------------------------------------------------------------------- the engine


def _spy(monkeypatch) -> list:
    calls = []
    real = gram.sq_norm

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(gram, "sq_norm", spy)
    return calls


ENGINE = [pytest.param(T, big, dt, mode, id=f"T{T}-big{big:g}-{name}-{mode}")
          for T, big in [(64, 100.0), (256, 100.0), (2048, 100.0), (64, 1e4)]
          for dt, name in [(torch.float32, "fp32"), (torch.bfloat16, "bf16")]
          for mode in (("book-keeping", "two-pass") if T <= 256 else ("book-keeping",))]


@pytest.mark.parametrize("T,big,dtype,mode", ENGINE)
def test_the_engine_adds_at_most_C_with_massive_activations(monkeypatch, T, big, dtype, mode):
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).to(dtype)
    A, G = _massive(T, 64, 64, big, dtype)
    sinks = {n: torch.zeros(q.shape) for n, q in lin.named_parameters()}
    with gram.forced("lowp"):
        clipper = GhostClipper(lin, C, mode=mode, layer_policy="ghost", grad_buffers=sinks)
        used = clipper.backward((lin(A[None]) * G[None]).sum((1, 2)), torch.tensor([0]))
    assert calls
    added = torch.cat([s.double().reshape(-1) for s in sinks.values()])
    true = _true_norm([(A, G)])
    ratio = float(added.norm()) / C
    assert 1 - norms.FALLBACK < ratio <= SLACK, ratio
    assert float(used[0]) >= true * (1 - 4 * U64)
    stats = clipper.last_norm_stats
    assert stats.fallbacks >= 1 and stats.bound_max < norms.FALLBACK


def test_random_data_needs_no_fallback(monkeypatch):
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(256, 128, bias=False)
    A = torch.randn(3, 128, 256, generator=g)
    G = torch.randn(3, 128, 128, generator=g)
    sinks = {"weight": torch.zeros(128, 256)}
    with gram.forced("lowp"):
        clipper = GhostClipper(lin, C, layer_policy="ghost", grad_buffers=sinks)
        used = clipper.backward((lin(A) * G).sum((1, 2)), torch.tensor([0, 1, 2]))
    assert calls and clipper.last_norm_stats.fallbacks == 0
    assert 0 < clipper.last_norm_stats.bound_max < norms.FALLBACK
    true = _true_sq(A, G, [0, 1, 2], 3)
    assert all(float(used[u]) >= math.sqrt(true[u]) for u in range(3))
    assert float(sinks["weight"].double().norm()) <= 3 * C * SLACK


@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_the_neighbour_test_on_a_bf16_llama(monkeypatch, mode):
    """Removing any one unit changes what was added by at most C (float64), on a bf16 Llama
    with every Linear's ghost norm from the float32 Grams; its norms agree with the float64
    Grams' within the fallback threshold."""
    from llmdp.base.losses import row_losses
    from tests.clipping.test_engine import V, make_batch
    from tests.helpers import tiny_model

    calls = _spy(monkeypatch)
    model = tiny_model("llama", vocab_size=V, dtype=torch.float32).to(torch.bfloat16)
    row_units = [0, 1, 1, 2, 3, 4]
    batch = make_batch(row_units)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    Cm = 1e-2

    def added(ru, policy):
        sinks = {n: torch.zeros(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        with gram.forced(policy):
            clipper = GhostClipper(model, Cm, mode=mode, layer_policy="ghost", grad_buffers=sinks)
            used = clipper.backward(row_losses(model, {**batch, "row_units": torch.tensor(ru)}),
                                    torch.tensor(ru))
        clipper.remove_hooks()
        return torch.cat([sinks[n].double().reshape(-1) for n in names]), used

    _, f64 = added(row_units, "float64")
    assert not calls
    full, used = added(row_units, "lowp")
    assert calls
    assert (used > 2 * Cm).all()
    assert (used >= f64 * (1 - 1e-6)).all() and (used <= f64 * (1 + norms.FALLBACK)).all(), (used, f64)
    worst = 0.0
    for u in range(5):
        without, _ = added([r if r != u else -1 for r in row_units], "lowp")
        worst = max(worst, float((full - without).norm()) / Cm)
    assert 1 - 1e-3 < worst <= 1 + 1e-6, worst


def test_layers_reading_one_input_share_its_float32_gram(monkeypatch):
    n = []
    real = gram.gram32
    monkeypatch.setattr(gram, "gram32", lambda x, y: (n.append(1), real(x, y))[1])

    class QK(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x):
            return self.q(x).square().sum((1, 2)) + self.k(x).sum((1, 2))

    m = QK()
    with gram.forced("lowp"):
        clipper = GhostClipper(m, 1.0, layer_policy="ghost")
        clipper.backward(m(torch.randn(3, 10, 16)), torch.tensor([0, 1, 2]))
    assert len(n) == 3  # A's once, each G's


# --------------------------------------------------------------------------- policy, cost, threshold


def test_the_policy():
    A = torch.randn(2, 8, 16)
    G = torch.randn(2, 8, 4)
    spec = norms.device_spec(torch.device("cpu"), torch.float32)
    assert not gram.use_lowp(A, G, spec, None)  # auto on the CPU: p + d below CPU_MIN_WIDTH
    wide = torch.randn(2, 8, gram.CPU_MIN_WIDTH - 4)
    assert gram.use_lowp(wide, G, spec, None)  # p + d = CPU_MIN_WIDTH: the float32 Grams
    assert gram.use_lowp(wide.bfloat16(), G.bfloat16(), spec, None)
    assert not gram.use_lowp(wide.double(), G.double(), spec, None)
    long_rows = torch.randn(1, gram.T_MAX + 1, gram.CPU_MIN_WIDTH)
    assert not gram.use_lowp(long_rows, long_rows, spec, None)  # T > T_MAX: float64
    with gram.forced("lowp"):
        assert gram.use_lowp(A, G, spec, None)
        assert gram.use_lowp(A.bfloat16(), G.bfloat16(), spec, None)
        assert not gram.use_lowp(A.double(), G.double(), spec, None)  # nothing to gain
    with gram.forced("float64"):
        assert not gram.use_lowp(A, G, spec, None)
    with pytest.raises(ValueError, match="gram policy"):
        with gram.forced("fp16"):
            pass


def test_the_cost_model():
    """The float32 Grams' FLOPs are ~15x cheaper than the float64 ones on an H100 (989 and 67
    TFLOP/s), but this implementation's cost per chunk of CHUNK_T positions (fixed, and
    bytes per Gram entry: the chunked GEMMs' float32 results and adds) and the bound's
    float64 arithmetic decide: on an H100 the tile kernel or the float64 Grams are cheaper
    (T = 64 or 512, a few rows or many); on a GPU with slow float64 (an L40S: 1.4 TFLOP/s)
    it wins for short rows of wide layers in a large batch, not for a few such rows (the
    chunks' fixed cost)."""
    h100 = norms.DeviceSpec(*norms._CUDA_SPECS["H100"])
    l40s = norms.DeviceSpec(*norms._CUDA_SPECS["L40S"])
    tile = norms.tile_norm_time
    for R, T, p, d in [(512, 64, 8192, 8192), (8, 64, 8192, 8192), (8, 512, 2048, 2048), (64, 256, 4096, 4096)]:
        assert not gram.lowp_gram_cheaper(R, T, p, d, h100, tile(R, T, p, d, h100))
        assert not gram.lowp_gram_cheaper(R, T, p, d, h100, None)
    assert gram.lowp_gram_cheaper(512, 64, 8192, 8192, l40s, tile(512, 64, 8192, 8192, l40s))
    assert not gram.lowp_gram_cheaper(8, 64, 8192, 8192, l40s, tile(8, 64, 8192, 8192, l40s))
    # the bytes and the chunks' fixed cost are what loses: free of them, the FLOP rates decide
    free = norms.DeviceSpec(h100.flops, math.inf, h100.fp64)
    fixed = gram.CHUNK_FIXED_S
    try:
        gram.CHUNK_FIXED_S = 0.0
        assert gram.lowp_gram_cheaper(8, 512, 2048, 2048, free, None)
    finally:
        gram.CHUNK_FIXED_S = fixed


# benchmarks/kernels.py on an H200 (BENCHMARKS, issue 52): (T, R, p, d) -> ms of the Gram
# path's two Grams and of the tile norm kernel, both measured at the 1.6 B model's layers.
H200_MEASURED = {
    (1024, 8, 2048, 2048): (1.17, 0.26), (1024, 8, 8192, 2048): (3.00, 0.90),
    (1024, 8, 2048, 8192): (2.93, 0.96), (1024, 8, 128256, 2048): (38.74, 16.14),
    (256, 32, 2048, 2048): (0.77, 0.32), (256, 32, 8192, 2048): (1.96, 1.17),
    (256, 32, 2048, 8192): (3.02, 1.23), (256, 32, 128256, 2048): (39.67, 20.04),
}


@pytest.mark.parametrize("shape", sorted(H200_MEASURED))
def test_the_cost_model_takes_the_faster_path_measured_on_an_h200(shape):
    """Where the H200 measured the tile kernel faster (every layer of the benchmark model),
    the model does not send the layer to the Gram path (it sent the LM head at T256 x 32
    there, 39.7 ms against 20.0, before the chunks' fixed cost was in it)."""
    T, R, p, d = shape
    gram_ms, tile_ms = H200_MEASURED[shape]
    h200 = norms.DeviceSpec(*norms._CUDA_SPECS["H200"])
    assert gram.lowp_gram_cheaper(R, T, p, d, h200, norms.tile_norm_time(R, T, p, d, h200)) == (gram_ms < tile_ms)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "x", True, None])
def test_the_fallback_threshold_is_validated(bad):
    with pytest.raises(ValueError, match="fallback"):
        GhostClipper(nn.Linear(2, 2), 1.0, fallback=bad)


@pytest.mark.parametrize("fallback", [0.0, 0.005, 1.0])
def test_the_fallback_threshold_changes_utility_never_the_bound(fallback):
    """With a threshold of 1 nothing is recomputed: the massive-activation unit is clipped by
    its (large) bound, adding less than C (over-clipping), never more; 0 recomputes every
    unit with a bound; in every case the norm used is never below the true one."""
    A, G = _massive(256, 64, 64, 100.0, torch.float32)
    lin = nn.Linear(64, 64, bias=False)
    sinks = {"weight": torch.zeros(64, 64)}
    with gram.forced("lowp"):
        clipper = GhostClipper(lin, C, layer_policy="ghost", grad_buffers=sinks, fallback=fallback)
        used = clipper.backward((lin(A[None]) * G[None]).sum((1, 2)), torch.tensor([0]))
    true = _true_norm([(A, G)])
    ratio = float(sinks["weight"].double().norm()) / C
    assert float(used[0]) >= true * (1 - 4 * U64) and ratio <= SLACK
    stats = clipper.last_norm_stats
    if fallback == 1.0:
        assert stats.fallbacks == 0 and ratio < 1 - 0.05 and stats.bound_max > 0.05
    else:
        assert stats.fallbacks == 1 and stats.bound_max < max(fallback, 1e-6)


def test_lowp_bound_inputs():
    """``entry_gamma`` is ``fast_bound``'s γ over the contraction; the padded norms are 0
    on zero rows and never below n + √(η/γ)."""
    x = torch.randn(1, 5, 33)
    g, eta = gram.entry_gamma(x, x)
    u, k = lowp.fast_bound(x, x.transpose(1, 2), 33)
    assert g == gamma(k, u) and eta == 4 * 34 * 2.0**-126
    n = torch.tensor([0.0, 1e-30, 1.0, 3e5], dtype=torch.float64)
    nh = gram.padded_norms(n, g, eta)
    tau = math.sqrt(eta / g)
    assert nh[0] == 0 and all(float(nh[i]) >= float(n[i]) + tau for i in range(1, 4))
