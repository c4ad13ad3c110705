"""Issue 33: the family matrix. Tiny configs of every family people fine-tune, mixture-of-
experts included, full fine-tuning in float64: the engine's per-unit norms and clipped sum
against an independent reference (each unit's loss run alone through the model, autograd),
with multi-row units and padding; nothing refused.

MoE models run their experts with transformers' "eager" loop here (its grouped-matmul
implementation refuses float64 on CPU); the generic rule re-runs whatever implementation
the model uses, so the rule is the same for both."""

from __future__ import annotations

import pytest
import torch

from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import clip_factors
from llmdp.train.losses import row_losses
from tests.clipping.test_engine import make_batch
from tests.helpers import make_exact

V = 97
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", *MOE, "gemma", "gemma2", "gemma3_text",
            "phi3", "gpt2", "gpt_neox", "olmo2", "granite", "cohere", "opt", "starcoder2",
            "smollm3")


def family_config(family: str, tie: bool = False):
    from transformers import AutoConfig

    if family == "gpt2":
        kw = dict(n_embd=16, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1)
    else:
        kw = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=2,
                  bos_token_id=0, eos_token_id=1)
    kw.update(vocab_size=V, tie_word_embeddings=tie)
    if family == "opt":
        kw.update(ffn_dim=32, word_embed_proj_dim=16)
    if family in MOE:
        kw.update(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  shared_expert_intermediate_size=8)
    if family == "gpt_oss":
        kw.update(head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family in ("gemma", "gemma2", "gemma3_text", "qwen3", "olmo2"):
        kw.update(head_dim=4)
    cfg = AutoConfig.for_model(family, **kw)
    for a in ("dropout", "attention_dropout", "activation_dropout", "layerdrop", "hidden_dropout",
              "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(cfg, a):
            setattr(cfg, a, 0.0)
    return cfg


def family_model(family: str, tie: bool = False):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(family, tie), attn_implementation="eager",
                                                 experts_implementation="eager")
    return make_exact(model.to(torch.float64))


def per_unit_reference(model, batch, C):
    """Each unit's loss computed from its rows alone (a forward of those rows only), its
    gradient by autograd; the clipped sum with the same factors."""
    ru = batch["row_units"]
    U = int(ru.max()) + 1
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per = []
    for u in range(U):
        rows = (ru == u).nonzero().flatten()
        sub = {k: v[rows] for k, v in batch.items() if k != "row_units"}
        grads = torch.autograd.grad(row_losses(model, sub).sum(), [p for _, p in named], allow_unused=True)
        per.append([torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)])
    norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per])
    f = clip_factors(norms, C)
    return norms, {n: sum(f[u] * per[u][i] for u in range(U)) for i, (n, _) in enumerate(named)}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_exact(family):
    model = family_model(family, tie=family in ("gpt2", "gemma"))
    batch = make_batch([0, 0, 1, -1, 2])
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    modes = ("book-keeping", "two-pass") if family in MOE else ("auto",)
    for mode in modes:
        model.zero_grad(set_to_none=True)
        norms = GhostClipper(model, 0.05, mode=mode).backward(row_losses(model, batch), batch["row_units"])
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
        scale = max(float(r.abs().max()) for r in ref_sum.values())
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-9, atol=1e-12 * scale,
                                           msg=lambda m, n=n: f"{family} {mode} {n}: {m}")
