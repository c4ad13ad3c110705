"""The clipping engine against torch.func per-unit gradients, in float64.

Owns invariant `no-silent-fallbacks` (docs/DESIGN.md §3): its tests are here."""

import pytest
import torch

from llmdp.base.losses import row_losses
from llmdp.clipping import GhostClipper, UnsupportedModuleError
from llmdp.clipping.reference import clip_factors, per_unit_gradients_func
from tests.helpers import tiny_model

V, L = 97, 12


def tiny_llama(family="llama", **kw):
    return tiny_model(family, vocab_size=V, dtype=torch.float64, exact=True, **kw)


def make_batch(row_units):
    g = torch.Generator().manual_seed(1)
    R = len(row_units)
    ids = torch.randint(0, V, (R, L), generator=g)
    mask = torch.ones(R, L, dtype=torch.long)
    mask[1, -4:] = 0  # padding tokens inside a real row
    labels = ids.masked_fill(mask == 0, -100)
    ru = torch.tensor(row_units)
    labels[ru < 0] = -100
    per_row = (labels[:, 1:] != -100).sum(1)
    U = max(int(ru.max()) + 1, 1)
    per_unit = torch.zeros(U, dtype=torch.long).index_add(0, ru[ru >= 0], per_row[ru >= 0])
    ntt = torch.where(ru >= 0, per_unit[ru.clamp(min=0)], torch.ones_like(ru))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "num_target_tokens": ntt, "row_units": ru}


def reference(model, batch, C):
    model_inputs = {k: v for k, v in batch.items() if k != "row_units"}
    grads = per_unit_gradients_func(model, lambda call, row: row_losses(call, row)[0],
                                    model_inputs, batch["row_units"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in names], 1)
    norms = flat.norm(dim=1)
    f = clip_factors(norms, C)
    return norms, {n: torch.einsum("u,u...->...", f, grads[n]) for n in names}


CONFIGS = [
    {"engine": "reference"},
    {"engine": "ghost", "mode": "book-keeping", "layer_policy": "ghost"},
    {"engine": "ghost", "mode": "book-keeping", "layer_policy": "instantiate"},
    {"engine": "ghost", "mode": "two-pass", "layer_policy": "ghost"},
    {"engine": "ghost", "mode": "auto", "layer_policy": "auto"},
]
IDS = ["reference", "bk-ghost", "bk-instantiate", "two-pass", "auto"]


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
@pytest.mark.parametrize("row_units", [[0, 1, 2, 3], [0, 0, 1, 1, 1, -1], [2, 0, -1, 1, 0]])
@pytest.mark.parametrize("C", [1e-3, 1e3])
def test_engine_matches_torch_func(kw, row_units, C):
    model = tiny_llama()
    batch = make_batch(row_units)
    ref_norms, ref_sum = reference(model, batch, C)
    clipper = GhostClipper(model, C, **kw)
    norms = clipper.backward(row_losses(model, batch), batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("family,kw", [("gpt2", {"tie_word_embeddings": True}), ("gemma", {"tie_word_embeddings": True}),
                                       ("qwen2", {}), ("llama", {"tie_word_embeddings": True})])
def test_families_tied_embeddings_and_padding(family, kw, clip):
    model = tiny_llama(family, **kw)
    if kw.get("tie_word_embeddings"):
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    batch = make_batch([0, 0, 1, -1, 2])
    C = 0.05
    ref_norms, ref_sum = reference(model, batch, C)
    norms = GhostClipper(model, C, **clip).backward(row_losses(model, batch), batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)


def test_accumulates_like_autograd():
    model = tiny_llama()
    batch = make_batch([0, 1, 2])
    clipper = GhostClipper(model, 0.01)
    clipper.backward(row_losses(model, batch), batch["row_units"])
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    clipper.backward(row_losses(model, batch), batch["row_units"])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-12, atol=0)


def test_each_clipped_unit_has_norm_at_most_C():
    model = tiny_llama()
    batch = make_batch([0, 1, 2, 3])
    C = 1e-3
    for u in range(4):
        model.zero_grad(set_to_none=True)
        rows = {k: v[u : u + 1] for k, v in batch.items()}
        rows["row_units"] = torch.tensor([0])
        norms = GhostClipper(model, C).backward(row_losses(model, rows), rows["row_units"])
        total = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
        assert norms[0] > C  # really clipped, not vacuous
        assert total <= C * (1 + 1e-9)


def test_padding_rows_change_nothing():
    model = tiny_llama()
    batch = make_batch([0, 1, 2])
    padded = make_batch([0, 1, 2, -1, -1])
    for k in batch:
        padded[k][:3] = batch[k]
    padded["input_ids"][3:] = torch.randint(0, V, (2, L))  # arbitrary content in padding rows
    GhostClipper(model, 0.5).backward(row_losses(model, batch), batch["row_units"])
    a = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    GhostClipper(model, 0.5).backward(row_losses(model, padded), padded["row_units"])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, a[n], rtol=1e-12, atol=1e-15)


def test_empty_batch_adds_nothing():
    model = tiny_llama()
    batch = make_batch([-1, -1])
    norms = GhostClipper(model, 1.0).backward(row_losses(model, batch), batch["row_units"])
    assert norms.numel() == 0
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_batchnorm_is_refused_by_path_and_type():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(UnsupportedModuleError, match=r"'1' \(BatchNorm1d\) mixes examples"):
        GhostClipper(net, 1.0)


def _compare(model, batch, C, ref_norms, ref_sum, **clip):
    for p in model.parameters():
        p.grad = None
    clipper = GhostClipper(model, C, **clip)
    norms = clipper.backward(row_losses(model, batch), batch["row_units"])
    clipper.remove_hooks()
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_activation_checkpointing(family, clip):
    model = tiny_llama(family, tie_word_embeddings=True)
    batch = make_batch([0, 1, 1, -1, 2])
    ref_norms, ref_sum = reference(model, batch, 0.05)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _compare(model, batch, 0.05, ref_norms, ref_sum, **clip)


def _lora(model, dropout):
    from peft import LoraConfig, get_peft_model

    targets = ["c_attn", "c_fc"] if model.config.model_type == "gpt2" else ["q_proj", "v_proj", "down_proj"]
    torch.manual_seed(3)
    lora = get_peft_model(model, LoraConfig(r=3, lora_alpha=6, lora_dropout=dropout, target_modules=targets,
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():  # LoRA B starts at zero; make the adapters' gradients non-trivial
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return lora.double()


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_lora_matches_torch_func(family, clip):
    model = _lora(tiny_llama(family), dropout=0.0)
    batch = make_batch([0, 0, 1, 2, -1])
    ref_norms, ref_sum = reference(model, batch, 0.02)
    assert set(ref_sum) and all("lora_" in n for n in ref_sum)
    _compare(model, batch, 0.02, ref_norms, ref_sum, **clip)


@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_lora_with_dropout_matches_autograd_on_the_same_forward(mode):
    from llmdp.clipping.reference import clipped_sum, per_unit_gradients_autograd

    model = _lora(tiny_llama(), dropout=0.3)
    model.train()
    batch = make_batch([0, 1, 1, 2])
    clipper = GhostClipper(model, 0.02, mode=mode)
    losses = row_losses(model, batch)  # one forward: one dropout mask for both
    params = [p for p in model.parameters() if p.requires_grad]
    per_unit = per_unit_gradients_autograd(losses, params, batch["row_units"], retain_graph=True)
    ref, ref_norms = clipped_sum(per_unit, 0.02)
    norms = clipper.backward(losses, batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-12)


def test_bf16_autocast_norms_in_float32():
    model = tiny_model("llama", vocab_size=V, dtype=torch.float32)
    batch = make_batch([0, 1, 2, 3])
    ref_norms, _ = reference(model.double(), batch, 1.0)
    model = model.float()
    clipper = GhostClipper(model, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = row_losses(model, batch)
    norms = clipper.backward(losses, batch["row_units"])
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms.double(), ref_norms, rtol=3e-2, atol=0)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_a_module_without_a_rule_is_clipped_exactly_by_the_generic_rule():
    """Issue 33 item 2: a trainable module with no specific rule (here a Conv1d, whose rows
    are independent) gets exact per-unit gradients from the generic rule (re-run per unit),
    in book-keeping and two-pass, against autograd per unit in float64."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.mixer = torch.nn.Conv1d(4, 4, 3)

        def forward(self, input_ids):
            return self.mixer(self.embed(input_ids).transpose(1, 2))

    torch.manual_seed(0)
    ids = torch.randint(0, 10, (5, 7))
    row_units = torch.tensor([0, 1, 1, -1, 2])
    for mode in ("book-keeping", "two-pass"):
        net = Net().double()

        def rows(m, ids=ids):
            return (m(ids) ** 2).sum(dim=(1, 2)) / 10

        per = []
        params = [p for p in net.parameters()]
        for u in range(3):
            keep = (row_units == u).nonzero().flatten()
            per.append(torch.autograd.grad(rows(net, ids[keep]).sum(), params))
        norms_ref = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per])
        C = float(norms_ref.median())
        f = (C / norms_ref).clamp(max=1.0)
        norms = GhostClipper(net, C, mode=mode).backward(rows(net), row_units)
        torch.testing.assert_close(norms, norms_ref, rtol=1e-10, atol=0)
        for i, p in enumerate(params):
            ref = sum(f[u] * per[u][i] for u in range(3))
            torch.testing.assert_close(p.grad, ref, rtol=1e-10, atol=1e-14)


def test_a_module_that_mixes_rows_is_refused_by_the_generic_rule():
    """The generic rule's probe: a module whose outputs for one unit change when the rest of
    the batch is absent (a batch statistic) is refused, naming it; never clipped wrong."""
    class Center(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return (x - x.mean(0, keepdim=True)) * self.scale

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.center = Center()

        def forward(self, input_ids):
            return self.center(self.embed(input_ids))

    net = Net().double()
    ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UnsupportedModuleError) as e:
        GhostClipper(net, 1.0).backward((net(ids) ** 2).sum(dim=(1, 2)), torch.arange(4))
    assert "Center" in str(e.value) and "mixes rows" in str(e.value)


def test_the_generic_rules_stacked_reruns_are_probed_each_at_its_own_scale():
    """Units of one size re-run together (vmap) are probed one by one, each at its own
    output's scale (as the one-at-a-time loop probes them): a row mixing far below a large
    unit's scale but far above a small one's is refused."""
    class Leak(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))

        def forward(self, x):  # a batch mean leaks in at a relative 1e-16 of the large rows
            return x * self.scale + 1e-16 * x.mean(0, keepdim=True)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.leak = Leak()

        def forward(self, x):
            return self.leak(x)

    x = torch.ones(2, 3, 4, dtype=torch.float64)
    x[0] *= 1e6  # unit 0: outputs ~1e6, the leak ~5e-11 is within its 16 ulps (~3.6e-9)
    x[1] *= 1e-3  # unit 1: outputs ~1e-3, the leak is ~1e7 of its ulps
    net = Net()
    with pytest.raises(UnsupportedModuleError, match="Leak.*mixes rows"):
        GhostClipper(net, 1.0).backward((net(x) ** 2).sum(dim=(1, 2)), torch.arange(2))


UNITS = {"units-of-1": [0, 1, -1, 2], "units-of-3": [0, 0, 0, 1, -1, 1, 1]}


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("layout", list(UNITS))
@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("family,kw", [("llama", {}), ("gpt2", {"tie_word_embeddings": True}),
                                       ("gemma", {"tie_word_embeddings": True}), ("qwen2", {})])
def test_acceptance_matrix(family, kw, tuning, layout, ckpt):
    """Every family x full/LoRA x units of 1 and 3 rows (padding rows and tokens) x
    activation checkpointing: the default engine equals torch.func in float64."""
    model = tiny_llama(family, **kw)
    if tuning == "lora":
        model = _lora(model, dropout=0.0)
    batch = make_batch(UNITS[layout])
    ref_norms, ref_sum = reference(model, batch, 0.03)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    _compare(model, batch, 0.03, ref_norms, ref_sum)


def test_reentrant_checkpointing_is_refused_not_silently_unclipped():
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    batch = make_batch([0, 1])
    with pytest.raises((UnsupportedModuleError, RuntimeError), match="use_reentrant"):
        GhostClipper(model, 1.0).backward(row_losses(model, batch), batch["row_units"])


def test_a_trainable_module_outside_the_graph_is_refused():
    model = tiny_llama()
    model.unused = torch.nn.Linear(3, 3).double()  # trainable, never called by forward
    batch = make_batch([0, 1])
    with pytest.raises(UnsupportedModuleError, match="'unused'"):
        GhostClipper(model, 1.0).backward(row_losses(model, batch), batch["row_units"])


# --------------------------------------------------------------------------- issue 12


class _Reuse(torch.nn.Module):
    """Embedding -> a Linear called twice (or, ``functional``, its weight also used by
    F.linear outside the module) -> head. Rows are independent."""

    def __init__(self, functional=False, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(V, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, V, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.functional = functional
        self.to(dtype)

    def forward(self, input_ids, **_):
        h = self.embed(input_ids)
        h = torch.tanh(self.mix(h))
        if self.functional:
            h = torch.tanh(torch.nn.functional.linear(h, self.mix.weight))
        else:
            h = torch.tanh(self.mix(h))  # the same module, a second call
        return self.head(h)


def _reuse_row_losses(model, batch):
    logits = model(batch["input_ids"])
    lp = torch.log_softmax(logits[:, :-1].to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
    nll = -lp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return nll.mean(1)


def _reuse_reference(model, batch, C):
    grads = per_unit_gradients_func(model, lambda call, row: _reuse_row_losses(_Call(call), row)[0],
                                    {"input_ids": batch["input_ids"]}, batch["row_units"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flat = torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in names], 1)
    norms = flat.norm(dim=1)
    f = clip_factors(norms, C)
    return norms, {n: torch.einsum("u,u...->...", f, grads[n]) for n in names}


class _Call:
    def __init__(self, call):
        self.call = call

    def __call__(self, input_ids):
        return self.call(input_ids=input_ids)


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("row_units", [[0, 1, 2, 3], [0, 0, 1, -1, 1]])
def test_module_called_twice_has_its_cross_terms(clip, row_units):
    """A module called twice in one forward: its two uses' gradients add up, so the unit's
    norm needs the cross term (issue 12 item 3: it contributed sqrt(2)*C without it)."""
    model = _Reuse()
    batch = make_batch(row_units)
    C = 1e-3
    ref_norms, ref_sum = _reuse_reference(model, batch, C)
    assert (ref_norms > 10 * C).all()  # every unit is clipped: the bound below is not vacuous
    norms = GhostClipper(model, C, **clip).backward(_reuse_row_losses(model, batch), batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-9, atol=1e-15)
    # One unit alone adds at most C (the sensitivity), measured from what was added.
    model.zero_grad(set_to_none=True)
    one = {k: v[:1] for k, v in batch.items()}
    GhostClipper(model, C, **clip).backward(_reuse_row_losses(model, one), one["row_units"])
    added = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    assert added <= C * (1 + 1e-9)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp64", "bf16-autocast"])
@pytest.mark.parametrize("mode", ["book-keeping", "two-pass", "auto"])
def test_weight_reused_functionally_is_refused_with_its_name(mode, autocast):
    """F.linear(h, module.weight) outside the module: a use the hooks cannot record. It must
    be refused with the parameter's name, never mis-clipped (issue 12 item 3: 1.83*C)."""
    model = _Reuse(functional=True, dtype=torch.float32 if autocast else torch.float64)
    batch = make_batch([0, 1, 2])
    clipper = GhostClipper(model, 1e-3, mode=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = _reuse_row_losses(model, batch)
    with pytest.raises(UnsupportedModuleError, match=r"\['mix.weight'\].*outside a call of the module"):
        clipper.backward(losses, batch["row_units"])
    assert all(p.grad is None for p in model.parameters())  # refused before anything was added
    # The same model without the functional use is accepted (the check is not a blanket refusal).
    model.functional = False
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = _reuse_row_losses(model, batch)
    clipper.backward(losses, batch["row_units"])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("kw", CONFIGS[1:] + [{"engine": "ghost", "mode": "two-pass", "layer_policy": "instantiate"}],
                         ids=IDS[1:] + ["two-pass-instantiate"])
def test_a_padding_row_with_non_finite_activations_changes_nothing(kw, bad, monkeypatch):
    """A padding row's activations are NaN/inf (its embedding output is made so), so its
    rows of every layer's input A are, and of the output gradients G downstream of a
    nonlinearity (0·NaN = NaN): its factor is 0, and the rows of A and G that add nothing
    are zeroed where they are not finite, as read for all calls at once
    (``GhostClipper._read_dirty``; two-pass from pass 1's fingerprints of G), never by a
    per-call check (patched to fail here)."""
    from llmdp.clipping import accumulate

    def per_call(*a, **k):
        raise AssertionError("a per-call check of the zero-factor rows (two host syncs per call)")

    monkeypatch.setattr(accumulate, "_dirty", per_call)
    model = tiny_llama()
    row_units = [0, 1, 1, -1, 2]
    batch = make_batch(row_units)
    C = 1e-2
    clean = {**batch, "row_units": torch.tensor([0, 1, 1, -1, 2])}
    _, ref_sum = reference(model, clean, C)
    ru = batch["row_units"]
    clipper = GhostClipper(model, C, **kw)
    seen = []

    def poison(module, args, out):
        out = out.clone()
        out[3] = bad
        return out

    def spy(rec, *a):  # the rows the clipped sums zero really hold non-finite values
        seen.append(rec.dirty)
        return contract(rec, *a)

    contract = accumulate._contract
    monkeypatch.setattr(accumulate, "_contract", spy)
    hook = model.get_input_embeddings().register_forward_hook(poison)
    try:
        losses = row_losses(model, batch)
    finally:
        hook.remove()
    norms = clipper.backward(losses, ru)
    if not (kw["mode"] == "book-keeping" and kw["layer_policy"] == "instantiate"):  # else h is scaled
        assert any(d is not None and d[1] for d in seen) and any(d is not None and d[0] for d in seen), seen
    assert torch.isfinite(norms).all()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["two-pass", "book-keeping"])
def test_under_bf16_autocast_each_unit_adds_at_most_C(mode, device):
    """Issue 12 item 8a: under bf16 autocast each clipped unit's contribution, measured in
    float64 from what the engine actually added (the sum with the unit minus the sum with
    its row turned into padding, same shapes), is <= C."""
    model = tiny_model("llama", vocab_size=V, dtype=torch.float32).to(device)
    row_units = list(range(8))
    batch = {k: v.to(device) for k, v in make_batch(row_units).items()}
    C = 1e-2

    def added(ru):
        model.zero_grad(set_to_none=True)
        clipper = GhostClipper(model, C, mode=mode)
        with torch.autocast(device, dtype=torch.bfloat16):
            losses = row_losses(model, {**batch, "row_units": torch.tensor(ru, device=device)})
        norms = clipper.backward(losses, torch.tensor(ru, device=device))
        clipper.remove_hooks()
        return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()]), norms

    full, norms = added(row_units)
    assert (norms > 2 * C).all()  # every unit is clipped
    worst = 0.0
    for u in row_units:
        without, _ = added([r if r != u else -1 for r in row_units])
        worst = max(worst, float((full - without).norm()) / C)
    assert worst <= 1 + 1e-6, worst
    assert worst > 1 - 1e-3  # the units really reach C


def test_clip_factors_of_non_finite_norms_are_zero():
    C = 2.0
    f = clip_factors(torch.tensor([float("nan"), float("inf"), 0.0, 4.0, 1.0, C]), C)
    torch.testing.assert_close(f, torch.tensor([0.0, 0.0, 1.0, 0.5, 1.0, 1.0]), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_a_unit_with_a_non_finite_gradient_contributes_nothing(kw, bad):
    """Issue 12 item 8b: unit 1's loss is NaN/inf, so its gradient is. Factor 0, rows zeroed
    (0*NaN would be NaN): the sum equals the reference over the finite units, it is counted."""
    model = tiny_llama()
    row_units = [0, 1, 1, 2, -1, 3]
    batch = make_batch(row_units)
    C = 1e-2
    finite_only = {**batch, "row_units": torch.tensor([u if u != 1 else -1 for u in row_units])}
    _, ref_sum = reference(model, finite_only, C)
    ru = batch["row_units"]
    clipper = GhostClipper(model, C, **kw)
    losses = row_losses(model, batch)
    scale = torch.where(ru == 1, torch.tensor(bad, dtype=losses.dtype), torch.ones_like(losses))
    norms = clipper.backward(losses * scale, ru)
    assert not torch.isfinite(norms[1])
    if kw["engine"] == "reference":
        # Its batched VJP backpropagates 0·NaN into the other units too (documented): they
        # are dropped as well, and nothing non-finite is added.
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert clipper.last_nonfinite >= 1
        return
    assert torch.isfinite(norms[[0, 2, 3]]).all()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)
    assert clipper.last_nonfinite == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["two-pass", "book-keeping"])
@pytest.mark.parametrize("family,kw", [("llama", {}),
                                       # hidden 24: Gemma's scale √24 is not exact in bf16
                                       ("gemma", {"tie_word_embeddings": True, "hidden_size": 24})])
def test_bf16_model_each_unit_adds_at_most_C(family, kw, mode, device):
    """Issue 15 item 4: a bf16 model (bf16 A and G, float32 sinks): each clipped unit's
    contribution, measured in float64 from what was added, is <= C, ghost norms and
    instantiation alike. Gemma scales its embedding output: the norms and the sum must
    apply that scale to the same widened values (it was applied in bf16 for the norm)."""
    model = tiny_model(family, vocab_size=V, dtype=torch.float32, **kw).to(device=device, dtype=torch.bfloat16)
    row_units = [0, 1, 1, 2, 3, 4]
    batch = {k: v.to(device) for k, v in make_batch(row_units).items()}
    C = 1e-2
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def added(ru, policy):
        sinks = {n: torch.zeros(p.shape, dtype=torch.float32, device=device)
                 for n, p in model.named_parameters() if p.requires_grad}
        clipper = GhostClipper(model, C, mode=mode, layer_policy=policy, grad_buffers=sinks)
        losses = row_losses(model, {**batch, "row_units": torch.tensor(ru, device=device)})
        norms = clipper.backward(losses, torch.tensor(ru, device=device))
        clipper.remove_hooks()
        return torch.cat([sinks[n].double().reshape(-1) for n in names]), norms

    for policy in ("ghost", "instantiate"):
        full, norms = added(row_units, policy)
        assert (norms > 2 * C).all()  # every unit is clipped
        worst = 0.0
        for u in range(5):
            without, _ = added([r if r != u else -1 for r in row_units], policy)
            worst = max(worst, float((full - without).norm()) / C)
        assert worst <= 1 + 1e-6, (policy, worst)
        assert worst > 1 - 1e-3


def test_auto_mode_counts_instantiated_per_unit_gradients_as_kept(monkeypatch):
    """Book-keeping keeps, per Linear that may be instantiated, its float32 per-unit
    gradients (U·p·d·4 bytes), not just its output gradient: auto must count them when it
    decides whether book-keeping fits (with 8 units here they outweigh the G's)."""
    from llmdp.clipping import modes

    model = tiny_llama()
    batch = make_batch(list(range(8)))
    seen = {}

    def fake_free(device):
        return seen["free"]

    monkeypatch.setattr(modes, "_available_memory", fake_free)
    clipper = GhostClipper(model, 1.0, mode="auto")
    losses = row_losses(model, batch)
    g_only = sum(r.out_bytes for r in clipper._records)
    kept = sum(modes._kept_bytes(r, 8) for r in clipper._records)
    assert kept > g_only
    # Free memory between 2·(G's only) and 2·kept: only the full count picks two-pass.
    seen["free"] = (2 * g_only + 2 * kept) // 2
    clipper.backward(losses, batch["row_units"])
    assert clipper.last_mode == "two-pass"
    seen["free"] = 4 * kept
    clipper.backward(row_losses(model, batch), batch["row_units"])
    assert clipper.last_mode == "book-keeping"


@pytest.mark.parametrize("autocast", [False, True], ids=["fp64", "bf16-autocast"])
def test_layers_reading_one_input_share_its_gram_matrix(monkeypatch, autocast):
    """q/k/v read one input, gate/up another: with the ghost norm the engine computes each
    input's Gram matrix once (3 + 2 -> 2 per decoder layer), with unchanged norms."""
    from llmdp.clipping import norms as nm

    made = []
    real = nm.Units.make

    def spy(*a, **k):
        u = real(*a, **k)
        made.append(u)
        return u

    model = tiny_llama() if not autocast else tiny_model("llama", vocab_size=V, dtype=torch.float32)
    batch = make_batch([0, 1, 1, 2])

    def run(memory):
        monkeypatch.setattr(nm, "GRAM_MEMORY", memory)
        monkeypatch.setattr(nm.Units, "make", staticmethod(spy))
        model.zero_grad(set_to_none=True)
        clipper = GhostClipper(model, 0.05, mode="book-keeping", layer_policy="ghost")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = row_losses(model, batch)
        norms = clipper.backward(losses, batch["row_units"])
        clipper.remove_hooks()
        return norms, made[-1].gram_calls, {n: p.grad.clone() for n, p in model.named_parameters()}

    shared, calls, grads = run(2)
    alone, calls0, grads0 = run(0)
    layers = model.config.num_hidden_layers
    linears_per_layer = 7
    assert calls0 == layers * linears_per_layer + 1  # + the untied LM head
    assert calls == layers * 4 + 1  # q/k/v share one, gate/up one; o and down their own
    torch.testing.assert_close(shared, alone, rtol=0, atol=0)
    for n in grads:
        torch.testing.assert_close(grads[n], grads0[n], rtol=0, atol=0)


def test_a_registered_rule_serves_a_new_module_type(monkeypatch):
    """register_rule (as Opacus' register_grad_sampler): a module type the engine does not
    know is clipped by the generic rule (re-run per unit); once a rule is registered for it,
    the engine uses that rule instead; both exactly (here: a Linear subclass, so by exact
    type it had no rule)."""
    from llmdp.clipping import norms
    from llmdp.clipping.rules import LinearRule
    from llmdp.clipping.rules.functional import FunctionalRule

    monkeypatch.setattr(norms, "_BY_TYPE", dict(norms._BY_TYPE))

    class MyLinear(torch.nn.Linear):
        pass

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(MyLinear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()

    def check(expected_rule):
        model = net()
        x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        clipper = GhostClipper(model, 0.1)
        assert type(clipper._rules[model[0]]) is expected_rule
        norms_ = clipper.backward(model(x).pow(2).sum(1))
        ref = net()
        from llmdp.clipping.reference import clipped_sum, per_unit_gradients_autograd

        params = list(ref.parameters())
        ref_sum, ref_norms = clipped_sum(per_unit_gradients_autograd(ref(x).pow(2).sum(1), params,
                                                                     torch.arange(4)), 0.1)
        torch.testing.assert_close(norms_, ref_norms, rtol=1e-10, atol=0)
        for p, r in zip(model.parameters(), ref_sum):
            torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-14)

    check(FunctionalRule)
    from llmdp.clipping import register_rule

    register_rule(MyLinear)(LinearRule())
    check(LinearRule)
    with pytest.raises(TypeError, match="not a LayerRule"):
        register_rule(MyLinear)(object())


def test_a_rules_parameters_are_named_parameters_trainable_names():
    """``LayerRule.params`` reads the module's own table (issue 50: no generator per call):
    the same names as ``named_parameters(recurse=False)``, a frozen one left out, a tensor
    registered under two names named once, a child's parameters not named."""
    from llmdp.clipping.norms import LayerRule

    def expected(m):
        return [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]

    lin = torch.nn.Linear(3, 2)
    lin.child = torch.nn.Linear(2, 2)
    assert LayerRule().params(lin) == expected(lin) == ["weight", "bias"]
    lin.bias.requires_grad_(False)
    assert LayerRule().params(lin) == expected(lin) == ["weight"]
    lin.register_parameter("alias", lin.weight)
    lin.register_parameter("empty", None)
    assert LayerRule().params(lin) == expected(lin) == ["weight"]
