"""The chunked cross-entropy (issue 15, item 3, the loss half): the same values and
gradients as the unchunked loss, bit for bit, without a whole float32 copy of the logits
or of their log-softmax, and the clipping engine sees exactly the same head gradients."""

import pytest
import torch

import llmdp.base.losses as L
from llmdp.base.losses import row_losses, token_cross_entropy
from llmdp.clipping import GhostClipper
from tests.clipping.test_engine import make_batch, reference, tiny_llama


def _data(dtype, R=3, T=9, V=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, T, V, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (R, T), generator=g)
    labels[0, :3] = -100
    labels[2, -1] = -100
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [17, 40, 17 * 5, 17 * 26, 17 * 27 - 1])
def test_chunked_equals_unchunked_bit_for_bit(dtype, chunk):
    logits, labels = _data(dtype)
    whole = token_cross_entropy(logits, labels, chunk_elements=0)
    g_whole, = torch.autograd.grad(whole.sum(), logits)
    part = token_cross_entropy(logits, labels, chunk_elements=chunk)
    assert part.dtype == whole.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(part, whole)
    assert torch.equal(part[0, :3], torch.zeros(3, dtype=part.dtype))  # ignored labels add 0
    g_part, = torch.autograd.grad(part.sum(), logits, retain_graph=True)
    assert torch.equal(g_part, g_whole)
    again, = torch.autograd.grad(part.sum(), logits)  # a second backward (two-pass) recomputes
    assert torch.equal(again, g_whole)


def test_per_row_batched_gradients_work_through_the_chunks():
    """The reference engine differentiates each row's loss with is_grads_batched."""
    logits, labels = _data(torch.float64)
    rows = token_cross_entropy(logits, labels, chunk_elements=20).sum(1)
    eye = torch.eye(3, dtype=torch.float64)
    g, = torch.autograd.grad(rows, logits, grad_outputs=eye, is_grads_batched=True)
    for r in range(3):
        want, = torch.autograd.grad(token_cross_entropy(logits, labels, chunk_elements=0)[r].sum(), logits)
        assert torch.equal(g[r], want)


def test_no_whole_float32_copy_is_saved_for_the_backward():
    """bf16 logits [R·T, V]: unchunked, autograd keeps a float32 log-softmax of all of them;
    chunked, nothing float32 larger than one chunk is kept (checkpointing recomputes it)."""
    logits, labels = _data(torch.bfloat16, R=4, T=64, V=101)
    n = logits.numel()

    def largest_float32_saved(chunk):
        sizes = []

        def pack(t):
            if t.dtype == torch.float32:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = token_cross_entropy(logits, labels, chunk_elements=chunk)
        out.sum().backward()
        return max(sizes, default=0)

    assert largest_float32_saved(0) >= n  # the yardstick: a whole float32 copy is kept
    assert largest_float32_saved(101 * 16) <= 101 * 16


def test_inside_torch_func_the_loss_is_computed_unchunked():
    logits, labels = _data(torch.float64)
    want, = torch.autograd.grad(token_cross_entropy(logits, labels, chunk_elements=0).sum(), logits)
    got = torch.func.grad(lambda x: token_cross_entropy(x, labels, chunk_elements=20).sum())(logits.detach())
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_engine_with_the_chunked_loss_is_exact(monkeypatch, mode):
    """The head's output gradient is the same with and without chunking, so the engine's
    norms and clipped sum are bit-identical, and equal the torch.func reference."""
    row_units = [0, 1, 1, 2, -1, 3]
    batch = make_batch(row_units)
    C = 1e-2

    def run(chunk):
        monkeypatch.setattr(L, "CE_CHUNK_ELEMENTS", chunk)
        model = tiny_llama()
        clipper = GhostClipper(model, C, mode=mode)
        norms = clipper.backward(row_losses(model, batch), batch["row_units"])
        clipper.remove_hooks()
        return norms, {n: p.grad.clone() for n, p in model.named_parameters()}, model

    norms0, sums0, model = run(0)
    norms1, sums1, _ = run(97 * 5)  # a few positions per chunk: many chunks
    assert torch.equal(norms1, norms0)
    assert all(torch.equal(sums1[n], sums0[n]) for n in sums0)
    monkeypatch.setattr(L, "CE_CHUNK_ELEMENTS", 0)
    ref_norms, ref_sums = reference(model, batch, C)
    torch.testing.assert_close(norms1, ref_norms, rtol=1e-10, atol=0)
    for n, r in ref_sums.items():
        torch.testing.assert_close(sums1[n], r, rtol=1e-9, atol=1e-14)
