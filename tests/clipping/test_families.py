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

from llmdp.base.losses import row_losses
from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import clip_factors
from tests.clipping.test_engine import make_batch
from tests.helpers import make_exact

V = 97
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe")
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
    if family in ("deepseek_v3", "glm4_moe"):
        # Grouped top-k routers of their own (a sigmoid score, a bias, top groups), which
        # flatten the hidden states themselves; a dense first layer, a shared expert.
        kw.update(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                  topk_group=1, head_dim=4)
    if family == "deepseek_v3":  # multi-head latent attention
        kw.update(q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=4, num_key_value_heads=4)
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


def assert_matches_reference(model, batch, modes=("book-keeping", "two-pass"), rtol=1e-9, atol=1e-12,
                             label="", ref=None):
    """The engine's per-unit norms (to ``rtol``) and clipped sum (each parameter to ``rtol``
    and ``atol`` times its largest entry) against ``per_unit_reference``, in every mode."""
    ref_norms, ref_sum = ref if ref is not None else per_unit_reference(model, batch, 0.05)
    for mode in modes:
        norms, got = _clipped(model, batch, mode=mode)
        torch.testing.assert_close(norms, ref_norms, rtol=rtol, atol=0)
        for n, g in got.items():
            scale = float(ref_sum[n].abs().max())
            torch.testing.assert_close(g, ref_sum[n], rtol=rtol, atol=atol * scale,
                                       msg=lambda m, n=n, mode=mode: f"{label} {mode} {n}: {m}")


def lora_model(family: str, tie: bool = False):
    """LoRA (r = 2, random B so every factor has a gradient) on every Linear of the decoder
    ("all-linear"); on MoE models also on the 3-D expert weights (peft's
    ``target_parameters``: a ``ParamWrapper``, nested for two parameters)."""
    from peft import LoraConfig, get_peft_model

    model = family_model(family, tie)
    kw = {}
    if family in MOE:
        kw["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                init_lora_weights=False, **kw)).to(torch.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_exact_with_lora(family):
    model = lora_model(family)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if family in MOE:
        assert any("experts.lora_A" in n for n in trainable)  # the 3-D experts' adapters
    batch = make_batch([0, 0, 1, -1, 2])
    assert_matches_reference(model, batch, label=family)


# Tied where the family's checkpoints tie (GPT-2, Gemma), untied elsewhere; and the other
# way round for a dense, a MoE and gpt-oss (a tied head is an embedding used twice).
CASES = [(f, f in ("gpt2", "gemma")) for f in FAMILIES] + [
    ("llama", True), ("qwen3_moe", True), ("gpt_oss", True), ("gpt2", False)]


@pytest.mark.parametrize("family,tie", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_every_family_is_exact(family, tie):
    model = family_model(family, tie=tie)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie
    batch = make_batch([0, 0, 1, -1, 2])
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    modes = ("book-keeping", "two-pass") if family in MOE else ("auto",)
    for mode in modes:
        norms, got = _clipped(model, batch, mode=mode)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
        scale = max(float(r.abs().max()) for r in ref_sum.values())
        for n, g in got.items():
            torch.testing.assert_close(g, ref_sum[n], rtol=1e-9, atol=1e-12 * scale,
                                       msg=lambda m, n=n, mode=mode: f"{family} {mode} {n}: {m}")


def _clipped(model, batch, C=0.05, **kw):
    model.zero_grad(set_to_none=True)
    norms = GhostClipper(model, C, **kw).backward(row_losses(model, batch), batch["row_units"])
    return norms, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("policy", ["ghost", "instantiate"])
def test_the_experts_rule_is_exact_with_either_layer_policy_and_its_exact_fallback(family, policy, monkeypatch):
    """The experts' 3-D parameters go through the experts rule (per expert, the Linear
    rule's ghost norm or instantiation) — exact either way, and through the float64
    fallback (every unit recomputed by ``exact``, FALLBACK = 0)."""
    from llmdp.clipping import norms as nb
    from llmdp.clipping.rules.experts import ExpertsRule

    model = family_model(family)
    clipper = GhostClipper(model, 0.05)
    assert sum(isinstance(r, ExpertsRule) for r in clipper._rules.values()) == 2  # one per layer
    clipper.remove_hooks()
    batch = make_batch([0, 0, 1, -1, 2])
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    for fallback in (False, True):
        if fallback:
            monkeypatch.setattr(nb, "FALLBACK", -1.0)
        # The fallback's bound counts four float32 roundings of the exact part's add
        # (norms module docstring, 4), whatever the model's dtype: ~2.4e-7 of the norm.
        rtol = 1e-6 if fallback else 1e-9
        for mode in ("book-keeping", "two-pass"):
            norms, got = _clipped(model, batch, mode=mode, layer_policy=policy)
            torch.testing.assert_close(norms, ref_norms, rtol=rtol, atol=0)
            for n, g in got.items():
                torch.testing.assert_close(g, ref_sum[n], rtol=rtol, atol=1e-15,
                                           msg=lambda m, n=n, mode=mode, fb=fallback: f"{mode} {fb} {n}: {m}")


def test_an_experts_block_whose_forward_differs_is_refused_naming_it():
    """The experts rule recomputes Σ w·down(act(up(x))): a block computing something else
    (here: its activation changed after the model was built) is refused on its first call."""
    from llmdp.clipping import UnsupportedModuleError

    model = family_model("qwen3_moe")
    batch = make_batch([0, 1, 2])
    clipper = GhostClipper(model, 0.05)
    experts = model.model.layers[0].mlp.experts
    experts.forward = lambda x, i, w: type(experts).forward(experts, x, i, w) * 1.5
    with pytest.raises(UnsupportedModuleError, match="Qwen3MoeExperts"):
        clipper.backward(row_losses(model, batch), batch["row_units"])


def test_grouped_mm_experts_in_float32_and_bf16_against_a_float64_loop():
    """transformers' grouped-matmul experts (its default kernel; no float64 on CPU) in
    float32 and bf16: the engine's per-unit norms and clipped sum against the float64
    reference of the same weights run with the eager per-expert loop. Tolerances: float32
    2e-4 (the returned norm carries its rounding bound, ~4.5e-5 here, as a dense model's
    does), bf16 5e-2 (bf16 activations); a mistake in the routing or the layout is O(1)."""
    from transformers import AutoModelForCausalLM

    from llmdp.train import parallel

    cfg = family_config("qwen3_moe")
    batch = make_batch([0, 0, 1, -1, 2])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                     experts_implementation="eager").to(torch.float64)
    ref_norms, ref_sum = per_unit_reference(ref_model, batch, 0.05)
    for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 5e-2)):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 experts_implementation="grouped_mm")
        model.load_state_dict({k: v.to(dtype) for k, v in ref_model.state_dict().items()})
        model.to(dtype)
        assert model.config._experts_implementation == "grouped_mm"
        sinks = parallel.full_size_sinks(model)
        clipper = GhostClipper(model, 0.05, grad_buffers=sinks)
        norms = clipper.backward(row_losses(model, batch), batch["row_units"])
        got = sinks if sinks is not None else {n: p.grad for n, p in model.named_parameters()}
        assert (norms.double() >= ref_norms * (1 - tol)).all()
        torch.testing.assert_close(norms.double(), ref_norms, rtol=tol, atol=0)
        for n, ref in ref_sum.items():
            scale = float(ref.abs().max())
            torch.testing.assert_close(got[n].double(), ref, rtol=tol, atol=tol * scale,
                                       msg=lambda m, n=n, dt=dtype: f"{dt} {n}: {m}")


def test_a_recipes_lora_target_parameters_reach_the_experts_and_a_wrong_name_is_named():
    """``model.lora.target_parameters`` (the recipe field) puts adapters on the 3-D expert
    weights through llmdp's apply_lora; the step is exact; a name that matches no
    parameter is refused with the field, the value and the model's 3-D parameters."""
    from llmdp.config.schema import LoraConfig
    from llmdp.train.models import apply_lora

    cfg = LoraConfig(r=2, target_modules=("q_proj",),
                     target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    model = apply_lora(family_model("qwen3_moe"), cfg).to(torch.float64)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum("experts" in n for n in names) == 8  # A and B, two parameters, two layers
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    batch = make_batch([0, 1, 1, 2])
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    norms, got = _clipped(model, batch)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
    for n, g in got.items():
        torch.testing.assert_close(g, ref_sum[n], rtol=1e-9, atol=1e-15)
    bad = LoraConfig(r=2, target_modules=("q_proj",), target_parameters=("mlp.experts.up",))
    with pytest.raises(ValueError, match=r"target_parameters=.*mlp.experts.up.*match no parameter.*mlp.experts.gate_up_proj"):
        apply_lora(family_model("qwen3_moe"), bad)


def test_the_load_balancing_aux_loss_is_never_part_of_a_units_loss():
    """MoE models can add a load-balancing loss (router_aux_loss_coef · a statistic of the
    routing over the whole batch) to the loss when called with labels. It couples units
    (one unit's routing moves every unit's loss), so it has no per-unit gradient: llmdp's
    per-row losses call the model without labels and take the loss from the logits, so
    the aux loss never enters, even with ``output_router_logits`` on; each unit's gradient
    stays its own (exact against each unit's loss run alone)."""
    model = family_model("mixtral")
    batch = make_batch([0, 0, 1, 2])
    sub = {k: v for k, v in batch.items() if k != "row_units"}
    plain = row_losses(model, sub).detach()
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 10.0
    with_aux = row_losses(model, sub).detach()
    torch.testing.assert_close(with_aux, plain, rtol=0, atol=0)
    labelled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"])
    assert float(labelled.aux_loss) > 0  # the model would add it, given labels
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    norms, got = _clipped(model, batch)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)


def test_two_pass_refuses_experts_recomputed_differently_in_the_second_pass(monkeypatch):
    """Two-pass recomputes the experts' derived tensors (the up projection's output
    gradient, the activation) in pass 2; if they are not pass 1's bit for bit (a
    non-deterministic kernel), what would be added is not what was measured: refused.
    (The recompute: transformers' kernel runs the forward, ``OWN_FORWARD`` off.)"""
    from llmdp.clipping.rules import experts as ex

    monkeypatch.setattr(ex, "OWN_FORWARD", False)
    model = family_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    calls = [0]

    def drifting_gate(y):  # the model's forward does not use it; the rule's recompute does
        calls[0] += 1
        gate, up_ = y.chunk(2, dim=-1)
        return experts.act_fn(gate) * up_ * (1 + 1e-12 * calls[0])

    experts._apply_gate = drifting_gate
    batch = make_batch([0, 1, 2])
    with pytest.raises(RuntimeError, match="recomputing the experts.*second pass"):
        _clipped(model, batch, mode="two-pass")
    experts._apply_gate = lambda y: experts.act_fn(y.chunk(2, dim=-1)[0]) * y.chunk(2, dim=-1)[1]
    norms, _ = _clipped(model, batch, mode="two-pass")  # deterministic: accepted
    assert torch.isfinite(norms).all()


def test_two_pass_refuses_a_captured_inner_gradient_that_differs_in_the_second_pass(monkeypatch):
    """The experts rule's own forward keeps the activation and takes the gradient at the
    up projection's output from the backward itself (``_Inner``): pass 2's must be pass
    1's bit for bit (a non-deterministic backward kernel would break it): refused."""
    from llmdp.clipping.rules import experts as ex

    model = family_model("qwen3_moe")
    batch = make_batch([0, 1, 2])
    seen = [0]
    fire = ex._Late.fire

    def drifting(self, g1):
        seen[0] += 1
        return fire(self, g1 * (1 + 1e-12 * seen[0]))

    monkeypatch.setattr(ex._Late, "fire", drifting)
    with pytest.raises(RuntimeError, match="recomputing the experts.*second pass"):
        _clipped(model, batch, mode="two-pass")
    monkeypatch.setattr(ex._Late, "fire", fire)
    norms, _ = _clipped(model, batch, mode="two-pass")  # deterministic: accepted
    assert torch.isfinite(norms).all()


def _phimoe(**kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "phimoe", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
        eos_token_id=1, vocab_size=V, tie_word_embeddings=False, num_local_experts=4,
        num_experts_per_tok=2, attention_dropout=0.0, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 experts_implementation="eager")
    return make_exact(model.to(torch.float64))


def test_phimoe_is_exact_with_its_deterministic_routing_and_its_sampled_routing_is_refused():
    """PhiMoE's router is a Linear returning (logits, weights, experts) through a custom
    autograd.Function (sparsemixer) that torch.func cannot transform: the generic rule
    re-runs it with plain autograd, exact against the reference where the routing is
    deterministic (eval mode). In training mode sparsemixer samples the routing at random
    on every call, which no re-run reproduces: refused, naming the router and the fix
    (freeze the routers), never a crash or a probe's "mixes rows"."""
    from llmdp.clipping import UnsupportedModuleError

    model = _phimoe().eval()
    batch = make_batch([0, 0, 1, -1, 2])
    assert_matches_reference(model, batch)
    model.train()
    with pytest.raises(UnsupportedModuleError,
                       match=r"model\.layers\.0\.mlp\.router.*PhimoeTopKRouter.*samples its routing "
                             r"at random.*Fix: freeze the routers"):
        GhostClipper(model, 0.05)
    for n, p in model.named_parameters():  # frozen routers: their random routing is an input
        p.requires_grad_("mlp.router" not in n)
    norms, _ = _clipped(model, batch)
    assert norms.shape == (3,) and torch.isfinite(norms).all()


@pytest.mark.parametrize("family,field", [("mixtral", "router_jitter_noise"),
                                          ("phimoe", "input_jitter_noise")])
def test_router_jitter_is_refused_naming_the_module_and_the_fix_never_a_crash(family, field):
    """A jitter multiplies the MoE block's input by fresh uniform noise on every call in
    training mode (in place, on the engine's tapped activations): refused when the clipper
    is built in training mode, and on the forward when ``model.train()`` comes after it;
    ``field: 0`` (or eval mode) is accepted."""
    from llmdp.clipping import UnsupportedModuleError

    model = family_model("mixtral") if family == "mixtral" else _phimoe()
    for m in model.modules():
        if hasattr(m, "jitter_noise" if family == "mixtral" else "input_jitter_noise"):
            setattr(m, "jitter_noise" if family == "mixtral" else "input_jitter_noise", 0.1)
    if family == "phimoe":
        for n, p in model.named_parameters():
            p.requires_grad_("mlp.router" not in n)
    batch = make_batch([0, 0, 1, 2])
    want = rf"module 'model\.layers\.0\.mlp.*\({field}=0\.1\).*Fix: set {field}: 0"
    model.train()
    with pytest.raises(UnsupportedModuleError, match=want):
        GhostClipper(model, 0.05)
    model.eval()
    clipper = GhostClipper(model, 0.05)
    model.train()
    with pytest.raises(UnsupportedModuleError, match=want):
        clipper.backward(row_losses(model, batch), batch["row_units"])
    clipper.remove_hooks()
    for m in model.modules():
        for a in ("jitter_noise", "input_jitter_noise"):
            if hasattr(m, a):
                setattr(m, a, 0.0)
    norms, _ = _clipped(model, batch)
    assert torch.isfinite(norms).all()


def test_gpt_oss_with_its_own_attention_sinks_and_sliding_window_is_exact():
    """``make_exact`` swaps in an attention function without sinks; here GPT-OSS runs its
    own eager attention (the sinks' extra softmax column, trained by the generic rule) with
    a sliding window shorter than the rows, padding inside a row and a padding row."""
    from transformers import AutoModelForCausalLM

    cfg = family_config("gpt_oss")
    cfg.sliding_window = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 experts_implementation="eager").to(torch.float64)
    batch = make_batch([0, 0, 1, -1, 2])
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    assert all(float(ref_sum[f"model.layers.{i}.self_attn.sinks"].abs().max()) > 0 for i in (0, 1))
    assert_matches_reference(model, batch, ref=(ref_norms, ref_sum))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "cohere"])
def test_the_generic_rule_reruns_the_units_of_one_size_together_exactly(family, monkeypatch):
    """The generic rule re-runs the units of one size at once (vmap of the same per-unit
    VJP): here units 0, 2 and 3 (one row each) together, unit 1 (two rows) alone, in every
    call the rule serves — and the result is the per-unit reference's, and the one-unit-at-
    a-time loop's."""
    from llmdp.clipping.rules import functional as fn

    model = family_model(family)
    batch = make_batch([0, 1, 1, -1, 2, 3])
    ref_norms, ref_sum = per_unit_reference(model, batch, 0.05)
    alone, left = [], []
    vjp, batched = fn.FunctionalRule._vjp, fn.FunctionalRule._batched

    def spy_vjp(self, *a, **k):
        alone.append(1)
        return vjp(self, *a, **k)

    def spy_batched(self, *a, **k):
        got = batched(self, *a, **k)
        left.append(got)
        return got

    monkeypatch.setattr(fn.FunctionalRule, "_vjp", spy_vjp)
    monkeypatch.setattr(fn.FunctionalRule, "_batched", spy_batched)
    norms, got = _clipped(model, batch, mode="book-keeping")
    assert left and all(x == [1] for x in left), left  # every call: only unit 1 left to the loop
    assert len(alone) == len(left)
    monkeypatch.setattr(fn, "BATCHED", False)
    loop_norms, loop = _clipped(model, batch, mode="book-keeping")
    assert len(alone) == len(left) * 5  # the loop: units 0-3 one at a time
    torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
    torch.testing.assert_close(norms, loop_norms, rtol=1e-12, atol=0)
    scale = max(float(r.abs().max()) for r in ref_sum.values())
    for n, g in got.items():
        torch.testing.assert_close(g, ref_sum[n], rtol=1e-9, atol=1e-12 * scale, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(g, loop[n], rtol=1e-12, atol=1e-15 * scale, msg=lambda m, n=n: f"{n}: {m}")
