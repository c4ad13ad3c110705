"""Gradient canaries (issue 35, item 1): a canary unit's loss is a linear probe of one Linear,
so its per-unit gradient is a secret direction, and the real engine clips it to exactly C
along that direction. Checked in float64 against torch.func per-unit gradients and with a
neighbour comparison: the clipped sum with the canary minus the clipped sum without it is
C·u_c, of norm ≤ C, and nothing on any other parameter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from llmdp.audit import fdp
from llmdp.audit import gradient as gc
from llmdp.base.losses import row_losses
from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import per_unit_gradients_autograd
from tests.helpers import random_rows, tiny_llama

C = 0.7
KEY = b"k" * 32


def _setup(bias: bool = False):
    model = tiny_llama(dtype=torch.float64, exact=True)
    if bias:  # a target with a trainable bias: the direction has a bias part
        name = "model.layers.1.mlp.down_proj"
        mod = model.get_submodule(name)
        mod.bias = torch.nn.Parameter(torch.randn(mod.out_features, dtype=torch.float64) * 0.01)
    name, mod = gc.target_module(model, "model.layers.1.mlp.down_proj" if bias else None)
    has_bias = mod.bias is not None
    # 6 data units (store 0..5), then the canary shard from store index 6: canaries 3 and 8
    can = gc.GradientCanaries.make(KEY, 10, name, mod.out_features, mod.in_features, has_bias,
                                   first_unit=6, included_ids=[3, 8])
    batch = random_rows(8, 12)
    batch["unit_index"] = torch.arange(8)  # rows 6 and 7 are canaries 3 and 8
    return model, mod, can, batch


def _direction(can: gc.GradientCanaries, c: int, mod) -> dict[str, np.ndarray]:
    u = {"weight": np.outer(can.g[c], can.a[c]) / can.norm}
    if can.bias:
        u["bias"] = can.g[c] / can.norm
    return u


@pytest.mark.parametrize("bias", [False, True])
def test_a_canary_units_gradient_is_its_secret_direction(bias):
    model, mod, can, batch = _setup(bias)
    loss_fn = gc.probe_loss(row_losses, mod, can, C)
    losses = loss_fn(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    per_unit = per_unit_gradients_autograd(losses, params, batch["row_units"])
    target = {f"{can.target}.weight": "weight", f"{can.target}.bias": "bias"}
    for row, c in ((6, 3), (7, 8)):
        u = _direction(can, c, mod)
        for p, g in zip(params, per_unit):
            part = target.get(names[id(p)])
            got = g[row].numpy()
            if part is None:
                assert not got.any(), names[id(p)]  # nothing outside the target
            else:  # s·‖(…)‖ · u_c, s = SCALE·C
                np.testing.assert_allclose(got, gc.SCALE * C * can.norm * u[part], rtol=1e-12, atol=1e-15)
    # the data rows are untouched: their entries are the language-model losses
    torch.testing.assert_close(losses[:6], row_losses(model, {k: v[:6] for k, v in batch.items()}))


@pytest.mark.parametrize("bias", [False, True])
def test_the_engine_clips_a_canary_to_exactly_c_along_its_direction(bias):
    """Neighbour: the real clipped sum on D and on D minus canary 8 (its row removed),
    identical otherwise; the difference is C·u_8 (float64, 1e-12), norm ≤ C."""
    model, mod, can, batch = _setup(bias)
    loss_fn = gc.probe_loss(row_losses, mod, can, C)
    sums = []
    for keep in (8, 7):  # all rows; without the last (canary 8)
        model.zero_grad(set_to_none=True)
        sub = {k: v[:keep] for k, v in batch.items()}
        clipper = GhostClipper(model, C)
        for p in clipper.params:
            p.grad = torch.zeros_like(p)
        clipper.backward(loss_fn(model, sub), sub["row_units"])
        sums.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    u = _direction(can, 8, mod)
    total = 0.0
    for n in sums[0]:
        diff = (sums[0][n] - sums[1][n]).numpy()
        part = {f"{can.target}.weight": "weight", f"{can.target}.bias": "bias"}.get(n)
        if part is None:
            assert np.abs(diff).max() < 1e-13, n
        else:
            np.testing.assert_allclose(diff, C * u[part], rtol=1e-9, atol=1e-13)
            total += float((diff ** 2).sum())
    assert np.sqrt(total) <= C * (1 + 1e-12)
    assert np.sqrt(total) == pytest.approx(C, rel=1e-9)


def test_projections_and_scores_follow_the_update(tmp_path):
    """x_c = B·⟨ĝ, u_c⟩/C: an update that is exactly C·u_3/B reads 1 for canary 3 and
    ⟨u_c, u_3⟩ for the others; records append, a re-executed step keeps its last record."""
    model, mod, can, _ = _setup()
    B = 5.0
    g = torch.as_tensor(C * np.outer(can.g[3], can.a[3]) / B)
    x = gc.projections(can, g, None, B, C)
    assert x[3] == pytest.approx(1.0, rel=1e-12)
    others = [c for c in range(can.m) if c != 3]
    expect = [float(can.g[c] @ can.g[3]) * float(can.a[c] @ can.a[3]) for c in others]
    np.testing.assert_allclose(x[others], expect, rtol=1e-10, atol=1e-14)
    folder = str(tmp_path)
    gc.record_iterate(folder, 0, x)
    gc.record_iterate(folder, 1, 2 * x)
    gc.record_iterate(folder, 1, 3 * x)  # step 1 again (a resume): the last record counts
    assert oct(os.stat(os.path.join(folder, gc.ITERATES)).st_mode & 0o777) == "0o600"
    it = gc.read_iterates(folder, can.m, 2)
    np.testing.assert_array_equal(it, np.stack([x, 3 * x]))
    np.testing.assert_allclose(gc.scores(it, 0.5, 0.1), fdp.lr_scores(it.T, 0.1, 0.5))
    with pytest.raises(ValueError, match="no record of steps"):
        gc.read_iterates(folder, can.m, 3)


def test_cleaning_removes_the_datas_coherent_part_and_keeps_the_canaries():
    """A step's update of a [p, d] target = noise (σ per entry, in units of C/B) + the data's
    coherent gradient (rank 2, singular values far above the noise's edge) + one sampled
    canary. Raw, the data part moves every canary's projection by O(1) (it would swamp the
    canaries); cleaned, the projections are the canary's 1 plus noise of std σ, as the
    likelihood-ratio score assumes. Pure noise is left as it is (nothing above the edge)."""
    rng = np.random.default_rng(0)
    p, d, m, sigma, B, C = 512, 48, 4000, 0.6, 200.0, 0.5
    can = gc.GradientCanaries.make(KEY, m, "t", p, d, False, first_unit=0, included_ids=[])
    noise = sigma * rng.standard_normal((p, d))
    data = 120.0 * np.outer(rng.standard_normal(p), rng.standard_normal(d)) / np.sqrt(p * d) * 8 \
        + 60.0 * np.outer(rng.standard_normal(p), rng.standard_normal(d)) / np.sqrt(p * d) * 8
    canary = np.outer(can.g[7], can.a[7])
    for update, expect_std in ((noise, sigma), (noise + data + canary, sigma)):
        g = torch.as_tensor(update * C / B)
        raw = gc.projections(can, g, None, B, C)
        cleaned = gc.projections(can, g, None, B, C, noise_multiplier=sigma)
        others = np.delete(cleaned, 7)
        assert abs(others.std() - expect_std) < 0.05 * expect_std
        assert abs(others.mean()) < 4 * expect_std / np.sqrt(m)
    # the data part: raw projections spread far wider; the canary keeps ≥ 0.9 of its signal
    assert np.delete(raw, 7).std() > 2 * sigma
    signal = cleaned[7] - gc.projections(can, torch.as_tensor((noise + data) * C / B), None, B, C,
                                         noise_multiplier=sigma)[7]
    assert 0.9 < signal <= 1.0 + 1e-9
    # pure noise: nothing removed
    np.testing.assert_array_equal(gc.clean(noise, sigma), noise)
    assert np.linalg.matrix_rank(noise + data - gc.clean(noise + data, sigma)) == 2
