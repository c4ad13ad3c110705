"""DP-AdamBC (issue 54, ``llmdp.train.optimizers``): a float64 reference step on known noisy
gradients, post-processing of the privatized gradient only, Φ from the plan, and the
recipe checks."""

from __future__ import annotations

import math

import pytest
import torch

from llmdp.train.optimizers import DPAdamBC, noise_variance


def _reference(theta, grads, lr, b1, b2, wd, phi, floor):
    """The paper's update, written out in float64 with Python floats per coordinate."""
    theta = [float(x) for x in theta]
    m = [0.0] * len(theta)
    v = [0.0] * len(theta)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            m_hat, v_hat = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            theta[i] = theta[i] * (1 - lr * wd) - lr * m_hat / math.sqrt(max(v_hat - phi, floor))
    return theta


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_dp_adambc_is_the_papers_update_in_float64(wd):
    """Five steps on noisy gradients whose coordinates span the floor (v̂ − Φ below γ') and
    the signal regime: the optimizer equals the written-out update to float64 rounding."""
    gen = torch.Generator().manual_seed(0)
    phi, floor = (1.0 * 1.0 / 64) ** 2, 1e-6
    theta0 = torch.randn(7, generator=gen, dtype=torch.float64)
    signal = torch.tensor([0.0, 1e-4, 1e-3, 0.01, 0.05, 0.3, 1.0], dtype=torch.float64)
    grads = [signal + math.sqrt(phi) * torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(5)]
    p = torch.nn.Parameter(theta0.clone())
    opt = DPAdamBC([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, noise_var=phi, floor=floor)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _reference(theta0.tolist(), [g.tolist() for g in grads], 1e-2, 0.9, 0.99, wd, phi, floor)
    torch.testing.assert_close(p.detach(), torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=1e-15)
    # the correction matters: Φ = 0 (DP-Adam without it) moves the weak coordinates less
    q = torch.nn.Parameter(theta0.clone())
    plain = DPAdamBC([q], lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, noise_var=0.0, floor=floor)
    for g in grads:
        q.grad = g.clone()
        plain.step()
    assert not torch.allclose(p.detach(), q.detach())


def test_dp_adambc_keeps_float32_moments_for_bf16_parameters():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = DPAdamBC([p], lr=1e-3, noise_var=1e-5)
    p.grad = torch.full((4,), 1e-2, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg_sq"].dtype == torch.float32 and p.dtype == torch.bfloat16


def test_the_update_is_a_function_of_the_privatized_gradient_only():
    """Post-processing: the step reads the parameters, their .grad and its own state. Two
    optimizers given the same .grad update identically whatever else differs (the other
    tensors of the model, a sink the engine used), and a NaN planted anywhere but .grad
    reaches no parameter."""
    a = torch.nn.Linear(3, 2).double()
    b = torch.nn.Linear(3, 2).double()
    b.load_state_dict(a.state_dict())
    noise = torch.randn(2, 3, dtype=torch.float64)
    oa = DPAdamBC(a.parameters(), lr=1e-2, noise_var=1e-4)
    ob = DPAdamBC(b.parameters(), lr=1e-2, noise_var=1e-4)
    for m in (a, b):
        m.weight.grad, m.bias.grad = noise.clone(), torch.zeros(2, dtype=torch.float64)
    b.register_buffer("sink", torch.full((2, 3), float("nan"), dtype=torch.float64))
    oa.step()
    ob.step()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert torch.isfinite(b.weight).all()


def test_the_worker_builds_it_with_the_plans_noise_variance(tmp_path, monkeypatch):
    """The worker loop's optimizer is DP-AdamBC with Φ = (σC/B)² of the run's plan; a
    NON-PRIVATE baseline's Φ is 0. The run's ε is the plan's, as with any optimizer."""
    from llmdp.train import loop
    from tests.train.test_loop import make_recipe, prepared_config

    built = {}
    real = loop.build_optimizer

    def spy(params, optim, noise_var=0.0):
        built["noise_var"], built["name"] = noise_var, optim.name
        return real(params, optim, noise_var)

    monkeypatch.setattr(loop, "build_optimizer", spy)
    cfg = make_recipe(tmp_path, steps=2)
    from dataclasses import replace

    cfg = replace(cfg, optim=replace(cfg.optim, name="dp-adambc"))
    prep = prepared_config(cfg)
    loop.train_loop_per_worker(prep, loop.LocalContext())
    plan = prep.plan
    assert built["name"] == "dp-adambc"
    assert built["noise_var"] == noise_variance(plan.noise_multiplier, plan.max_grad_norm,
                                                plan.expected_batch_size) > 0
    assert built["noise_var"] == pytest.approx((plan.noise_multiplier * plan.max_grad_norm
                                                / plan.expected_batch_size) ** 2, rel=1e-15)
    assert noise_variance(0.0, 1.0, 8) == 0.0


def test_a_correlated_mechanism_with_dp_adambc_is_refused():
    from llmdp.config.schema import ConfigError, recipe_from_dict

    raw = {"model": {"init": "tiny", "tokenizer": "/tmp"}, "data": {"path": "x.jsonl"},
           "privacy": {"noise_multiplier": 1.0, "mechanism": "blt", "sampler": "fixed-cycle",
                       "cycle": 4},
           "optim": {"name": "dp-adambc"}, "train": {"steps": 8}}
    with pytest.raises(ConfigError, match=r"optim.name: dp-adambc .* privacy.mechanism: blt"):
        recipe_from_dict(raw)
    raw["privacy"] = {"noise_multiplier": 1.0}
    assert recipe_from_dict(raw).optim.name == "dp-adambc"
