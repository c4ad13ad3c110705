"""The clipping engine on CUDA (issue 15 item 5). GPU only: CI has no GPU, these skip there
(conftest); on a GPU machine: ``pytest -o addopts="" --import-mode=importlib -m gpu
tests/clipping/test_engine_cuda.py``.

* float64 on CUDA against torch.func per-unit gradients (as the CPU tests, same 1e-6
  tolerances): Llama, GPT-2 (tied), Gemma (tied), Qwen2; multi-row units and padding;
  LoRA; activation checkpointing; every clipping configuration;
* bf16 autocast on CUDA (tensor-core contractions, the Triton clipped sum) against the
  float32 reference engine under the same autocast: norms within 2e-2 relative (bf16
  activations and gradients in both, rounded at different places), the clipped sum within
  5e-2 of its norm;
* the bound itself under bf16 is in test_engine.py (its ``cuda`` parameters).
"""

from __future__ import annotations

import pytest
import torch

from llmdp.base.losses import row_losses
from llmdp.clipping import GhostClipper
from llmdp.clipping.reference import clipped_sum, per_unit_gradients_autograd
from tests.clipping.test_engine import (
    CONFIGS,
    IDS,
    _compare,
    _lora,
    make_batch,
    reference,
    tiny_llama,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _to(batch):
    return {k: v.to(DEV) for k, v in batch.items()}


def _check(model, batch, C, clip):
    ref_norms, ref_sum = reference(model, batch, C)
    _compare(model, batch, C, ref_norms, ref_sum, **clip)


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("family,kw", [("llama", {}), ("gpt2", {"tie_word_embeddings": True}),
                                       ("gemma", {"tie_word_embeddings": True}), ("qwen2", {})])
@pytest.mark.parametrize("row_units", [[0, 1, 2, 3], [0, 0, 1, -1, 2]], ids=["rows", "multi-row"])
def test_float64_on_cuda_matches_torch_func(family, kw, clip, row_units):
    model = tiny_llama(family, **kw).to(DEV)
    _check(model, _to(make_batch(row_units)), 0.05, clip)


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_on_cuda_matches_torch_func(family, clip):
    model = _lora(tiny_llama(family), dropout=0.0).to(DEV)
    _check(model, _to(make_batch([0, 0, 1, 2, -1])), 0.02, clip)


@pytest.mark.parametrize("clip", CONFIGS[1:], ids=IDS[1:])
def test_activation_checkpointing_on_cuda(clip):
    model = tiny_llama("llama", tie_word_embeddings=True).to(DEV)
    batch = _to(make_batch([0, 1, 1, -1, 2]))
    ref_norms, ref_sum = reference(model, batch, 0.05)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    clipper = GhostClipper(model, 0.05, **clip)
    norms = clipper.backward(row_losses(model, batch), batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_sum[n], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("family,kw", [("llama", {}), ("gemma", {"tie_word_embeddings": True})])
def test_bf16_autocast_on_cuda_against_the_float32_reference(family, kw, mode):
    from tests.helpers import tiny_model

    model = tiny_model(family, vocab_size=97, dtype=torch.float32, hidden_size=64, num_heads=4,
                       intermediate_size=128, **kw).to(DEV)
    batch = _to(make_batch([0, 1, 1, 2, 3, -1]))
    C = 1e-2
    clipper = GhostClipper(model, C, mode=mode)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        losses = row_losses(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    per_unit = per_unit_gradients_autograd(losses, params, batch["row_units"], retain_graph=True)
    ref, ref_norms = clipped_sum(per_unit, C)
    norms = clipper.backward(losses, batch["row_units"])
    torch.testing.assert_close(norms, ref_norms, rtol=2e-2, atol=0)
    for p, r in zip(params, ref):
        assert p.grad.dtype == torch.float32
        assert float((p.grad - r).norm()) <= 5e-2 * C * len(ref_norms) ** 0.5
