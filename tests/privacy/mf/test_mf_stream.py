"""Streaming correlated noise (`llmdp.privacy.mf.stream`): the stream against the dense
(scale·C)⁻¹Z of the very same DP-SGD draws, its covariance, shards, resume and refusals.

Bit for bit: b = 1 with scale·c_0 = 1 and the DP-SGD noise; shards against the whole;
a resumed stream against an uninterrupted one. Within stated bounds: everything else
against the float64 dense reference. Statistical tolerances are in standard errors (SE).
"""

import io
import math

import numpy as np
import pytest
import torch

from llmdp.privacy.mf.factorization import Factorization, toeplitz_inverse, toeplitz_matrix
from llmdp.privacy.mf.stream import CorrelatedNoise, dense_noise
from llmdp.privacy.noise.gaussian import add_noise_, gaussian_like
from llmdp.privacy.rng.keys import seeded_key

T = 12
STD = 0.8
SHAPES = [(3,), (2, 2)]  # d = 7 in two tensors
U32 = 2.0**-24  # float32 unit roundoff (half an ulp of 1)
_P = np.polynomial.polynomial


def _key(t: int, seed: int = 7) -> bytes:
    return seeded_key(seed, t, "mf-stream-test")


def _blt_inverse(theta, omega):
    """(θ̂, ω̂) of C⁻¹ for the BLT C(x) = 1 + Σ ω_i x/(1 − θ_i x) = P(x)/Q(x), Q = Π(1 − θ_i x):
    C⁻¹ = Q/P = 1 + Σ_k ω̂_k x/(1 − θ̂_k x), θ̂_k = 1/(roots of P), ω̂_k by residues."""
    q = np.array([1.0])
    for th in theta:
        q = _P.polymul(q, [1.0, -th])
    s = np.zeros(1)  # P − Q = x Σ_i ω_i Π_{j≠i} (1 − θ_j x)
    for i, om in enumerate(omega):
        term = np.array([0.0, om])
        for j, th in enumerate(theta):
            if j != i:
                term = _P.polymul(term, [1.0, -th])
        s = _P.polyadd(s, term)
    roots = _P.polyroots(_P.polyadd(q, s))
    assert np.all(np.abs(roots.imag) < 1e-12), roots
    th_hat = 1.0 / roots.real
    om_hat = [tk * -_P.polyval(1.0 / tk, s)
              / np.prod([1.0 - tj / tk for j, tj in enumerate(th_hat) if j != k])
              for k, tk in enumerate(th_hat)]
    return tuple(float(x) for x in th_hat), tuple(float(x) for x in om_hat)


def _blt(theta, omega, scale, steps=T):
    th_hat, om_hat = _blt_inverse(theta, omega)
    return Factorization("blt", steps, scale, theta=theta, omega=omega, theta_hat=th_hat,
                         omega_hat=om_hat)


def _facts(steps=T):
    sqrt_coeffs = tuple(math.comb(2 * k, k) / 4**k for k in range(steps))  # (1 − x)^(−1/2)
    return {
        "banded-b1": Factorization("banded", steps, 1.0, coefficients=(1.0,)),  # DP-SGD
        "banded-b1-scaled": Factorization("banded", steps, 2.0, coefficients=(1.0,)),
        "banded-b3": Factorization("banded", steps, 1.7, coefficients=(1.2, 0.5, 0.3)),
        "banded-bT": Factorization("banded", steps, 1.3, coefficients=sqrt_coeffs),
        "blt-1": _blt((0.9,), (0.3,), 1.5, steps),
        "blt-3": _blt((0.95, 0.7, 0.3), (0.25, 0.15, 0.1), 0.8, steps),
    }


FACTS = _facts()


def _run(fact, shapes, dtype, steps, *, tensor_dtype=None, std=STD, seed=7):
    """The streamed noise (added to zeros) and the DP-SGD draws z_t, each [steps, d]."""
    tensor_dtype = tensor_dtype or dtype
    cn = CorrelatedNoise(fact, shapes, dtype=dtype)
    W, Z = [], []
    for t in range(steps):
        xs = [torch.zeros(s, dtype=tensor_dtype) for s in shapes]
        cn.add_(xs, _key(t, seed), std)
        W.append(torch.cat([x.reshape(-1) for x in xs]))
        Z.append(torch.cat([gaussian_like(s, _key(t, seed), i, std, dtype=dtype).reshape(-1)
                            for i, s in enumerate(shapes)]))
    return torch.stack(W), torch.stack(Z)


def test_blt_fixtures_are_inverse_pairs():
    # The fixtures' (θ̂, ω̂) really describe C⁻¹ (else the dense test would test nothing
    # about C), and the BLT recursion's coefficients are the dense ones.
    for name, f in FACTS.items():
        r = f.inverse_coefficients(T)
        assert np.allclose(r, toeplitz_inverse(f.c_coefficients(T)), rtol=0, atol=1e-13), name
    assert FACTS["blt-1"].theta_hat[0] == pytest.approx(0.6) and \
        FACTS["blt-1"].omega_hat[0] == pytest.approx(-0.3)


@pytest.mark.parametrize("name", sorted(FACTS))
def test_stream_equals_dense_float64(name):
    # float64 state and tensors: |stream − dense| ≤ 1e-12 · (|R|·|Z|) elementwise (the
    # sum of the magnitudes of the terms r_{t−j} z_j: a relative bound without the
    # cancellation problem); measured ≤ 2 float64 ulps of it.
    f = FACTS[name]
    W, Z = _run(f, SHAPES, torch.float64, T)
    D = dense_noise(f, Z)
    mag = torch.from_numpy(np.abs(toeplitz_matrix(f.inverse_coefficients(T))) @ Z.abs().numpy())
    assert torch.all((W - D).abs() <= 1e-12 * mag), name
    assert not torch.equal(W, Z) or name == "banded-b1"  # the noise is correlated


@pytest.mark.parametrize("name", sorted(FACTS))
def test_stream_equals_dense_float32(name):
    # float32 state and tensors against the float64 dense C⁻¹Z of the same (float32) z's:
    # |error| ≤ 4 u32 · T · max_k|r_k| · max|Z| (u32 = 2⁻²⁴: a few float32 roundings per
    # term of a T-term sum); measured ≤ 0.2 u32 · T·max|r|·max|Z|. A wrong coefficient or
    # a missed term is off by O(std), ~10⁴ times the bound.
    f = FACTS[name]
    W, Z = _run(f, SHAPES, torch.float32, T)
    D = dense_noise(f, Z)
    r = f.inverse_coefficients(T)
    tol = 4 * U32 * T * np.abs(r).max() * Z.abs().max().item()
    assert (W.double() - D).abs().max().item() <= tol, name
    # float64 state, float32 tensors: the stream in float64, rounded into float32 (banded
    # once, BLT twice): |error| ≤ 2 ulp32 = 4 u32 of |R|·|Z|.
    W64, Z64 = _run(f, SHAPES, torch.float64, T, tensor_dtype=torch.float32)
    D64 = dense_noise(f, Z64)
    mag = torch.from_numpy(np.abs(toeplitz_matrix(r)) @ Z64.abs().numpy())
    assert torch.all((W64.double() - D64).abs() <= 4 * U32 * mag), name


def test_b1_unit_scale_is_dp_sgd_bit_for_bit():
    # b = 1, scale·c_0 = 1: C = I, the DP-SGD noise itself, bit for bit, also added to
    # non-zero sums (float32 and float64 tensors in a float32/float64 state).
    f = FACTS["banded-b1"]
    for dtype in (torch.float32, torch.float64):
        cn = CorrelatedNoise(f, SHAPES, dtype=dtype)
        for t in range(T):
            sums = [torch.linspace(-3, 5, math.prod(s), dtype=dtype).reshape(s) * (t + 1)
                    for s in SHAPES]
            ref = [x.clone() for x in sums]
            cn.add_(sums, _key(t), STD)
            add_noise_(ref, _key(t), STD)
            for a, b in zip(sums, ref):
                assert torch.equal(a, b)
        assert cn.nbytes == 0  # no state
    # b = 1 with scale 2: w_t = z_t / 2 exactly (division by a power of two)
    W, Z = _run(FACTS["banded-b1-scaled"], SHAPES, torch.float32, 4)
    assert torch.equal(W, Z / 2)


@pytest.mark.parametrize("name", ["banded-b3", "blt-3"])
def test_empirical_covariance(name):
    # d = 20000 coordinates are independent draws of the T-vector w = R z (R = (scale·C)⁻¹);
    # Cov(w) = std²·R·Rᵀ. The sample covariance Ŝ_ts = mean(w_t w_s) (the mean is known to be
    # 0) has SE_ts = sqrt((S_tt S_ss + S_ts²)/d); every entry must lie within 5 SE.
    steps, d, std = 6, 20000, 2.0
    f = _facts(steps)[name]
    W, Z = _run(f, [(12000,), (80, 100)], torch.float64, steps, std=std, seed=11)
    R = toeplitz_matrix(f.inverse_coefficients(steps))
    S = std**2 * R @ R.T
    se = np.sqrt((np.outer(np.diag(S), np.diag(S)) + S**2) / d)

    def z_scores(samples):
        x = samples.numpy()
        return np.abs(x @ x.T / d - S) / se

    assert z_scores(W).max() < 5.0
    # Not vacuous: the same test rejects the uncorrelated DP-SGD draws of the same steps
    # (S differs from std²·I by far more than 5 SE somewhere) ...
    assert z_scores(Z).max() > 50.0
    # ... and the correlation is there: some off-diagonal entry is > 20 SE from 0.
    off = ~np.eye(steps, dtype=bool)
    assert (np.abs(S) / se)[off].max() > 20.0


SHARD_SHAPES = [(5, 7), (11,)]
SPLITS = {  # per tensor: row ranges of each shard (the (11,) vector split mid-pair too)
    2: [[(0, 3), (3, 5)], [(0, 6), (6, 11)]],
    3: [[(0, 2), (2, 4), (4, 5)], [(0, 3), (3, 7), (7, 11)]],
}


@pytest.mark.parametrize("name", ["banded-b1", "banded-b3", "banded-bT", "blt-3"])
@pytest.mark.parametrize("parts", [2, 3])
def test_shards_concatenate_to_the_whole_bit_for_bit(name, parts):
    f, steps = FACTS[name], 8
    totals = [math.prod(s) for s in SHARD_SHAPES]
    row = [math.prod(s[1:]) for s in SHARD_SHAPES]
    whole = CorrelatedNoise(f, SHARD_SHAPES)
    shards = []
    for p in range(parts):
        rows = [SPLITS[parts][i][p] for i in range(len(SHARD_SHAPES))]
        shapes = [(hi - lo, *s[1:]) for (lo, hi), s in zip(rows, SHARD_SHAPES)]
        offsets = [lo * r for (lo, _), r in zip(rows, row)]
        shards.append((rows, CorrelatedNoise(f, shapes, offsets=offsets, totals=totals)))
    for t in range(steps):
        sums = [torch.randn(s, generator=torch.Generator().manual_seed(t)) for s in SHARD_SHAPES]
        local = [[sums[i][lo:hi].clone() for i, (lo, hi) in enumerate(rows)]
                 for rows, _ in shards]
        for (_, cn), xs in zip(shards, local):
            cn.add_(xs, _key(t), STD)
        whole.add_(sums, _key(t), STD)
        for i in range(len(SHARD_SHAPES)):
            assert torch.equal(torch.cat([xs[i] for xs in local]), sums[i])
    # The state is sharded like the tensors: dim 1 of [n_buf, *shape].
    for i in range(len(SHARD_SHAPES)):
        parts_i = [cn.state_tensors()[i] for _, cn in shards]
        assert torch.equal(torch.cat(parts_i, dim=1), whole.state_tensors()[i])


@pytest.mark.parametrize("name", ["banded-b3", "banded-bT", "blt-1", "blt-3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resume_is_bit_for_bit(name, dtype):
    f = FACTS[name]
    straight = CorrelatedNoise(f, SHAPES, dtype=dtype)
    first = CorrelatedNoise(f, SHAPES, dtype=dtype)
    outs_a, outs_b = [], []
    for t in range(10):
        xs = [torch.zeros(s) for s in SHAPES]
        straight.add_(xs, _key(t), STD)
        outs_a.append(xs)
    for t in range(5):
        first.add_([torch.zeros(s) for s in SHAPES], _key(t), STD)
    blob = io.BytesIO()
    torch.save(first.state_dict(), blob)
    blob.seek(0)
    resumed = CorrelatedNoise(f, SHAPES, dtype=dtype)
    resumed.load_state_dict(torch.load(blob))
    assert resumed.t == 5
    for t in range(5, 10):
        xs = [torch.zeros(s) for s in SHAPES]
        resumed.add_(xs, _key(t), STD)
        outs_b.append(xs)
    for a, b in zip(outs_a[5:], outs_b):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # reset: a new segment repeats the stream from t = 0
    resumed.reset()
    xs = [torch.zeros(s) for s in SHAPES]
    resumed.add_(xs, _key(0), STD)
    assert resumed.t == 1 and all(torch.equal(x, y) for x, y in zip(xs, outs_a[0]))


def test_foreign_state_is_refused():
    f = FACTS["banded-b3"]
    cn = CorrelatedNoise(f, SHAPES)
    cn.add_([torch.zeros(s) for s in SHAPES], _key(0), STD)
    sd = cn.state_dict()
    with pytest.raises(ValueError, match="factorization"):
        CorrelatedNoise(FACTS["banded-bT"], SHAPES).load_state_dict(sd)
    other_scale = Factorization("banded", T, 1.8, coefficients=(1.2, 0.5, 0.3))
    with pytest.raises(ValueError, match="factorization"):
        CorrelatedNoise(other_scale, SHAPES).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"state tensor 1 has shape \(2, 4\)"):
        CorrelatedNoise(f, SHAPES).load_state_dict(
            {**sd, "buffers": [sd["buffers"][0], torch.zeros(2, 4)]})
    with pytest.raises(ValueError, match="shape"):
        CorrelatedNoise(f, [(3,), (4,)], totals=[3, 4]).load_state_dict({**sd, "totals": [3, 4]})
    with pytest.raises(ValueError, match="totals"):
        CorrelatedNoise(f, SHAPES, offsets=[0, 0], totals=[3, 8]).load_state_dict(sd)
    with pytest.raises(ValueError, match="float32"):
        CorrelatedNoise(f, SHAPES, dtype=torch.float64).load_state_dict(sd)
    with pytest.raises(ValueError, match="2 tensors"):
        CorrelatedNoise(f, SHAPES[:1]).load_state_dict(sd)
    with pytest.raises(ValueError, match="step t=13"):
        CorrelatedNoise(f, SHAPES).load_state_dict({**sd, "t": 13})


def test_horizon_is_refused():
    f = Factorization("blt", 3, 1.0, theta=(0.9,), omega=(0.3,), theta_hat=(0.6,),
                      omega_hat=(-0.3,))
    cn = CorrelatedNoise(f, SHAPES)
    for t in range(3):
        cn.add_([torch.zeros(s) for s in SHAPES], _key(t), STD)
    with pytest.raises(RuntimeError, match=r"t=3 is past the horizon.*steps=3"):
        cn.add_([torch.zeros(s) for s in SHAPES], _key(3), STD)
    assert cn.t == 3


def test_bad_dtypes_shapes_and_std_are_refused():
    f = FACTS["blt-3"]
    for dtype in (torch.bfloat16, torch.float16, torch.int64):
        cn = CorrelatedNoise(f, SHAPES)
        with pytest.raises(TypeError, match="float32 or wider"):
            cn.add_([torch.zeros(SHAPES[0]), torch.zeros(SHAPES[1], dtype=dtype)], _key(0), STD)
        assert cn.t == 0 and all(not s.any() for s in cn.state_tensors())  # nothing happened
        with pytest.raises(TypeError, match="float32 or float64"):
            CorrelatedNoise(f, SHAPES, dtype=dtype)
    cn = CorrelatedNoise(f, SHAPES)
    with pytest.raises(ValueError, match=r"tensor 1 has shape \(4,\)"):
        cn.add_([torch.zeros(3), torch.zeros(4)], _key(0), STD)
    with pytest.raises(ValueError, match="1 tensors"):
        cn.add_([torch.zeros(3)], _key(0), STD)
    with pytest.raises(ValueError, match="std"):
        cn.add_([torch.zeros(s) for s in SHAPES], _key(0), 0.0)
    with pytest.raises(ValueError, match="total"):
        CorrelatedNoise(f, SHAPES, offsets=[1, 0], totals=[3, 4])
