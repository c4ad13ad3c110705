"""The norm rule's direct path (``rules/rowwise.py``): a norm whose output is ``w * z`` gets
its per-row gradient Σ_t G·z from the z autograd saved, instead of re-running the norm's
forward and backward per row. Against per-unit autograd in float64; the path is checked to
be taken where it applies and refused where it does not."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmdp.clipping import GhostClipper
from llmdp.clipping.norms import Units
from llmdp.clipping.rules.rowwise import RowwiseRule
from tests.clipping.test_engine import make_batch
from tests.clipping.test_families import assert_matches_reference, family_model


def _spy(monkeypatch) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    orig = RowwiseRule.per_unit

    def per_unit(self, rec, units):
        seen.append((type(rec.module).__name__, rec.direct))
        return orig(self, rec, units)

    monkeypatch.setattr(RowwiseRule, "per_unit", per_unit)
    return seen


# Llama's w·x̂ and Qwen3's (q_norm/k_norm on [R, T, heads, head_dim]) take the direct path;
# Gemma's x̂·(1 + w) and GPT-2's LayerNorm (w·x̂ + b) the generic re-run.
@pytest.mark.parametrize("family,direct", [("llama", True), ("qwen3", True), ("olmo2", True),
                                           ("gemma", False), ("gpt2", False)])
@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_norms_are_exact_on_the_path_they_take(family, direct, mode, monkeypatch):
    model = family_model(family)
    seen = _spy(monkeypatch)
    batch = make_batch([0, 0, 1, -1, 2])  # units of two rows and a padding row
    assert_matches_reference(model, batch, modes=(mode,), rtol=1e-10, atol=1e-13, label=family)
    assert seen and all(d == direct for _, d in seen), seen


class _SquareRMSNorm(torch.nn.Module):
    """Output w·(w·x): the last node is a product with w, but z = w·x depends on w too, so
    the node's gradient for w is only part of the call's (the walk must see it)."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, x):
        return self.weight * (self.weight * x)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6).double()
        self.norm = _SquareRMSNorm(6)
        self.head = torch.nn.Linear(6, 11).double()

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_a_product_whose_other_operand_depends_on_w_takes_the_generic_path(monkeypatch):
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (5, 7))
    row_units = torch.tensor([0, 1, 1, -1, 2])
    seen = _spy(monkeypatch)

    def rows(m, ids=ids):
        return (m(ids) ** 2).sum(dim=(1, 2)) / 10

    net = _Net()
    params = list(net.parameters())
    per = []
    for u in range(3):
        keep = (row_units == u).nonzero().flatten()
        per.append(torch.autograd.grad(rows(net, ids[keep]).sum(), params))
    ref_norms = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per])
    C = float(ref_norms.median())
    f = (C / ref_norms).clamp(max=1.0)
    norms = GhostClipper(net, C).backward(rows(net), row_units)
    assert seen == [("_SquareRMSNorm", False)]
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=0)
    for i, p in enumerate(params):
        torch.testing.assert_close(p.grad, sum(f[u] * per[u][i] for u in range(3)), rtol=1e-10, atol=1e-14)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from benchmarks.launches import _NO_LAUNCH

        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in _NO_LAUNCH:  # what launches a kernel on a GPU
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_direct_path_issues_two_operations_per_call(dtype):
    """Per norm call and units of one row: the product and the sum over positions (the
    generic re-run issues the norm's whole forward and backward again: issue 50)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from llmdp.clipping.norms import Record

    norm = LlamaRMSNorm(16).to(dtype)
    x = torch.randn(4, 5, 16, dtype=dtype, requires_grad=True)
    y = norm(x)
    z = RowwiseRule.direct_operand(norm, (x,), y)
    assert z is not None
    G = torch.randn_like(y)
    units = Units(torch.arange(4), 4, identity=True)
    counts = {}
    for direct in (True, False):
        rec = Record(norm, RowwiseRule(), z if direct else x.detach())
        rec.direct, rec.G = direct, G
        with _Count() as c:
            got = RowwiseRule().per_unit(rec, units)
        counts[direct] = len(c.ops)
        if direct:
            want = torch.stack([torch.autograd.grad(norm(x[r:r + 1]), norm.weight, G[r:r + 1])[0]
                                for r in range(4)])
            assert got["weight"].dtype == dtype
            torch.testing.assert_close(got["weight"].double(), want.double(), rtol=0, atol=0)
    assert counts[True] <= 2 < counts[False] - 6, counts



def test_under_activation_checkpointing_the_saved_operand_is_not_read(monkeypatch):
    """Reading the product's saved z inside a checkpointed region unpacks it through the
    checkpoint's hooks: a recomputation of the region in the forward, kept until the
    backward (a Llama's peak was higher checkpointed than not). There the norm takes the
    generic path, and stays exact; ``direct_operand`` refuses under any saved-tensor hooks."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16).double()
    x = torch.randn(4, 5, 16, dtype=torch.float64, requires_grad=True)
    assert RowwiseRule.direct_operand(norm, (x,), norm(x)) is not None
    unpacked = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(1) or t):
        assert RowwiseRule.direct_operand(norm, (x,), norm(x)) is None
    assert not unpacked

    model = family_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seen = _spy(monkeypatch)
    batch = make_batch([0, 0, 1, -1, 2])
    assert_matches_reference(model, batch, modes=("book-keeping",), rtol=1e-10, atol=1e-13, label="llama-ckpt")
    # the layers' two norms each (checkpointed) generic; the final norm, outside them, direct
    assert sorted(d for _, d in seen) == [False] * 4 + [True], seen
