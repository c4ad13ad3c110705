"""The clipping engine against torch.func per-unit gradients, in float64."""

import pytest
import torch

from llmdp.clipping import GhostClipper, UnsupportedModuleError
from llmdp.clipping.reference import clip_factors, per_unit_gradients_func
from llmdp.losses import row_losses
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


@pytest.mark.parametrize("engine", ["instantiate", "reference"])
@pytest.mark.parametrize("row_units", [[0, 1, 2, 3], [0, 0, 1, 1, 1, -1], [2, 0, -1, 1, 0]])
@pytest.mark.parametrize("C", [1e-3, 1e3])
def test_engine_matches_torch_func(engine, row_units, C):
    model = tiny_llama()
    batch = make_batch(row_units)
    ref_norms, ref_sum = reference(model, batch, C)
    clipper = GhostClipper(model, C, engine=engine)
    norms = clipper.backward(row_losses(model, batch), batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("family,kw", [("gpt2", {"tie_word_embeddings": True}), ("gemma", {"tie_word_embeddings": True}),
                                       ("qwen2", {}), ("llama", {"tie_word_embeddings": True})])
def test_families_tied_embeddings_and_padding(family, kw):
    model = tiny_llama(family, **kw)
    if kw.get("tie_word_embeddings"):
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    batch = make_batch([0, 0, 1, -1, 2])
    C = 0.05
    ref_norms, ref_sum = reference(model, batch, C)
    norms = GhostClipper(model, C).backward(row_losses(model, batch), batch["row_units"])
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
