"""The strategy interface (issue 16 item 2): Replicated and Fsdp implement every method of
Strategy; the worker loop holds one and never branches on the strategy's name. The two
strategies' numerics (same step, same noise, sharded state round trip over two processes)
are tested in tests/train/test_parallel.py."""

from __future__ import annotations

import ast
import inspect
import io
from pathlib import Path

import pytest
import torch

import llmdp.train.loop
from llmdp.base.losses import row_losses
from llmdp.config.choices import STRATEGIES
from llmdp.config.schema import PrivacyConfig
from llmdp.train.strategy import Fsdp, Replicated, Strategy, strategy_for
from tests.helpers import TINY_VOCAB, tiny_llama

INTERFACE = ("check", "prepare_model", "grad_sinks", "loss_fn", "privatize", "after_update",
             "map_location", "training_state", "load_training_state", "save_checkpoint",
             "load_checkpoint", "save_model")


def test_every_configured_strategy_has_its_class():
    assert {strategy_for(n).name for n in STRATEGIES} == set(STRATEGIES)
    assert isinstance(strategy_for("replicated", "bf16", "cpu"), Replicated)
    assert isinstance(strategy_for("fsdp"), Fsdp)
    with pytest.raises(ValueError, match=r"scaling.strategy: 'tp' is not one of \['replicated', 'fsdp'\]"):
        strategy_for("tp")
    with pytest.raises(ValueError, match="scaling.mixed_precision: 'fp8'"):
        Replicated("fp8")


@pytest.mark.parametrize("cls", [Replicated, Fsdp])
def test_strategies_implement_the_whole_interface(cls):
    for name in INTERFACE:
        assert hasattr(Strategy, name), name
    # The methods the base leaves abstract are the ones each strategy must define itself.
    abstract = [n for n in INTERFACE if callable(getattr(Strategy, n, None))
                and "NotImplementedError" in inspect.getsource(getattr(Strategy, n))]
    assert set(abstract) == {"privatize", "training_state", "load_training_state"}
    for name in abstract:
        assert getattr(cls, name) is not getattr(Strategy, name), f"{cls.__name__}.{name}"


def test_the_worker_loop_never_branches_on_the_strategy_name():
    tree = ast.parse(Path(llmdp.train.loop.__file__).read_text(encoding="utf-8"))
    names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in STRATEGIES]
    assert names == [], names


def test_replicated_sinks_follow_the_parameter_dtype():
    assert Replicated().grad_sinks(tiny_llama(vocab_size=TINY_VOCAB)) is None  # float32: p.grad
    sinks = Replicated().grad_sinks(tiny_llama(vocab_size=TINY_VOCAB, dtype=torch.bfloat16))
    assert sinks and {t.dtype for t in sinks.values()} == {torch.float32}
    sinks = Fsdp().grad_sinks(tiny_llama(vocab_size=TINY_VOCAB, dtype=torch.float64))
    assert sinks and {t.dtype for t in sinks.values()} == {torch.float64}
    assert all(float(t.abs().sum()) == 0 for t in sinks.values())


def test_replicated_bf16_loss_runs_under_autocast():
    model = tiny_llama(vocab_size=TINY_VOCAB)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids = torch.randint(3, TINY_VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "row_units": torch.tensor([0, 1]), "num_target_tokens": torch.tensor([7, 7])}
    assert Replicated().loss_fn() is row_losses and Fsdp("bf16").loss_fn() is row_losses
    a = Replicated("none").loss_fn()(model, batch)
    b = Replicated("bf16").loss_fn()(model, batch)
    assert seen == [torch.float32, torch.bfloat16]
    torch.testing.assert_close(a, b.float(), rtol=5e-2, atol=5e-2)


def test_replicated_training_state_round_trip():
    """What a checkpoint holds loads into a differently initialized replica: parameters and
    optimizer state equal, and one more identical update gives identical parameters."""
    def build(seed):
        torch.manual_seed(seed)
        m = Replicated().prepare_model(tiny_llama(vocab_size=TINY_VOCAB, seed=seed))
        params = [p for p in m.parameters() if p.requires_grad]
        return m, params, torch.optim.AdamW(params, lr=1e-2)

    def update(params, opt):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.01 * (i + 1))
        opt.step()

    a, pa, oa = build(0)
    update(pa, oa)
    names = [n for n, p in a.named_parameters() if p.requires_grad]
    params, optim = Replicated().training_state(a, oa, names)
    assert set(params) == set(names) and all(t.device.type == "cpu" for t in params.values())
    buf = io.BytesIO()  # through torch.save, as the checkpoint is written
    torch.save({"params": params, "optimizer": optim}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    b, pb, ob = build(1)
    assert any(not torch.equal(x, y) for x, y in zip(pa, pb))
    Replicated().load_training_state(b, ob, saved["params"], saved["optimizer"])
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    update(pa, oa)
    update(pb, ob)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))


def test_fsdp_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="privacy.debug_check .* not supported with scaling.strategy: 'fsdp'"):
        Fsdp().check(PrivacyConfig(debug_check=True))
    Fsdp().check(PrivacyConfig())
    Replicated().check(PrivacyConfig(debug_check=True))
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        Fsdp().prepare_model(tiny_llama(vocab_size=TINY_VOCAB))
    assert Fsdp(device="cpu").map_location == torch.device("cpu")
    assert Replicated(device="cpu").map_location == torch.device("cpu")


def test_fsdp_clears_gradients_after_the_update():
    """The next sharded reduction refuses a stray gradient: after_update must clear them."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(3)
    Replicated().after_update(opt)
    assert p.grad is not None
    Fsdp().after_update(opt)
    assert p.grad is None
