"""Optimizers that know the noise of the gradient they are given (issue 54).

Every optimizer here is post-processing of the privatized gradient: its step reads the
parameters, their ``.grad`` (the clipped sum + noise ÷ B that ``Strategy.privatize`` left
there) and its own state, and constants fixed before the run from the plan (σ, C, B: public
values, not data). It reads no per-unit quantity, no sink and no data, so the guarantee of
the released gradients carries over to every update it makes (DESIGN §3).

**DP-AdamBC** (Tang, Shpilevskiy and Lécuyer, AAAI 2024: "DP-AdamBC: Your DP-Adam Is
Actually DP-SGD (Unless You Apply Bias Correction)"). The privatized gradient is
g̃ = ḡ + z/B with z ~ N(0, σ²C²I): Adam's second moment v estimates E[g̃²] = ḡ² + Φ with
Φ = (σC/B)², a constant per coordinate that swamps the signal at DP batch sizes, so
m̂/√v̂ degenerates into DP-SGD with a rescaled learning rate. DP-AdamBC subtracts the known
Φ from the bias-corrected v̂ before the square root, floored at γ' for stability:

    m_t = β₁m_{t−1} + (1−β₁)g̃_t,   v_t = β₂v_{t−1} + (1−β₂)g̃_t²
    m̂_t = m_t/(1−β₁ᵗ),             v̂_t = v_t/(1−β₂ᵗ)
    θ_t = θ_{t−1}(1 − ηλ) − η·m̂_t / √max(v̂_t − Φ, γ')

(λ: decoupled weight decay, as AdamW). The moments are kept in float32 for 16-bit
parameters (Φ is ~1e-5 for σ = 1, C = 1, B = 256: a bf16 v̂ would lose it). Φ = 0 for a
NON-PRIVATE baseline (nothing to correct). Correlated mechanisms (banded-mf, blt) add noise
whose per-step variance is not Φ; they are refused with this optimizer (``config.checks``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["DPAdamBC", "noise_variance"]


def noise_variance(noise_multiplier: float, max_grad_norm: float, expected_batch_size: float) -> float:
    """Φ = (σC/B)²: the per-coordinate variance of the noise in the privatized gradient
    (``Strategy.privatize`` adds N(0, σ²C²I) to the clipped sum and divides by B)."""
    if not noise_multiplier:
        return 0.0
    return (float(noise_multiplier) * float(max_grad_norm) / float(expected_batch_size)) ** 2


class DPAdamBC(torch.optim.Optimizer):
    """DP-AdamBC (module docstring): Adam whose second moment has the DP noise's variance
    ``noise_var`` (Φ) removed, floored at ``floor`` (γ')."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 noise_var: float = 0.0, floor: float = 1e-8):
        if not (lr > 0 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1 and weight_decay >= 0
                and noise_var >= 0 and floor > 0 and math.isfinite(noise_var)):
            raise ValueError(f"DPAdamBC: invalid lr={lr}, betas={betas}, weight_decay={weight_decay}, "
                             f"noise_var={noise_var} or floor={floor}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      noise_var=float(noise_var), floor=float(floor)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, phi, floor = group["lr"], group["weight_decay"], group["noise_var"], group["floor"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                wide = p.dtype if p.dtype.itemsize >= 4 else torch.float32
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(p, dtype=wide)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=wide)
                state["step"] += 1
                t = int(state["step"])
                g = p.grad.to(wide)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = m / (1 - b1 ** t)
                denom = (v / (1 - b2 ** t)).sub_(phi).clamp_(min=floor).sqrt_()
                if wd:
                    p.mul_(1 - lr * wd)
                p.sub_((m_hat / denom).mul_(lr).to(p.dtype))
        return loss
