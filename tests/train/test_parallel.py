"""Scaling strategies: fsdp ≡ replicated ≡ one worker, and fsdp's noise is one N(0, σ²C²I).

The two-worker checks run in one pair of spawned processes (gloo, CPU) per module: every
scenario runs there once and leaves its results in files; the tests below read them.
"""

from __future__ import annotations

import math
import os
import socket

import numpy as np
import pytest
import torch

from llmdp.clipping import GhostClipper
from llmdp.data.batching import assign_micro_batches
from llmdp.privacy.noise import gaussian as dp_noise
from llmdp.train import parallel
from llmdp.train.step import accumulate_clipped_sum
from llmdp.train.strategy import Fsdp, Replicated, strategy_for
from tests.helpers import TINY_VOCAB, start_processes, tiny_llama, tiny_store

WORLD = 2
# One more embedding row than the tokenizer needs: 301 rows shard unevenly (151 + 150).
VOCAB = TINY_VOCAB + 1
S1 = [0, 2, 4, 5, 9, 12, 13]  # uneven shares: rank 0 has one more micro-step of 2 units
S2 = [7]  # rank 1 runs a micro-step of padding only (no unit): backward must still run
C, B, LR = 0.05, 9.0, 0.5
KEY = b"k" * 32
NOISE = dict(sigma=1.3, C=0.7, B=20.0, key=b"n" * 32)


def model64(**kw):
    return tiny_llama(vocab_size=VOCAB, dtype=torch.float64, **kw)


def full(t):
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def one_step(store, sample, strategy, *, world=1, rank=0, C=C, sigma=0.0, B=B, key=KEY, model=None,
             mixed="none", mode="auto", optimizer="sgd"):
    """One logical DP-SGD step as train_loop_per_worker runs it; returns the model, its
    optimizer and the privatized gradients (gathered to full tensors, by name)."""
    model = model64() if model is None else model
    model = strategy_for(strategy, mixed, "cpu").prepare_model(model)
    sinks = strategy_for(strategy).grad_sinks(model)
    clipper = GhostClipper(model, C, mode=mode, grad_buffers=sinks)
    params = clipper.params
    opt = (torch.optim.SGD(params, lr=LR) if optimizer == "sgd"
           else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    step_(model, clipper, opt, store, sample, strategy, world, rank, sigma, key, B, mixed)
    grads = {n: full(p.grad) for n, p in zip(clipper.param_names, params)}
    return model, clipper, opt, grads


def step_(model, clipper, opt, store, sample, strategy, world, rank, sigma, key, B, mixed="none"):
    mine = assign_micro_batches(np.asarray(sample, dtype=np.int64), store.unit_row_count,
                                store.unit_max_row_length, world_size=world, physical_batch_size=2)[rank]
    accumulate_clipped_sum(model, clipper, store, mine, torch.device("cpu"),
                           loss_fn=strategy_for(strategy, mixed, "cpu").loss_fn())
    sinks = clipper.grad_buffers
    strategy_for(strategy).privatize(clipper.params, None if sinks is None else [sinks[n] for n in clipper.param_names],
                                     key, sigma, clipper.max_grad_norm, B)
    opt.step()


def params_of(model):
    return {n: full(p) for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------- two workers


def _scenarios(rank, world, port, store_dir, out_dir):
    import torch.distributed as dist

    from llmdp.data.store import open_store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = open_store(store_dir)
    res = {}
    kw = dict(world=world, rank=rank)
    try:
        # σ = 0: the averaged gradient and the updated parameters.
        for name, strategy, sample, extra in [
            ("fsdp", "fsdp", S1, {}),
            ("replicated", "replicated", S1, {}),
            ("fsdp_s2_two_pass", "fsdp", S2, {"mode": "two-pass"}),
            ("fsdp_s2", "fsdp", S2, {}),
        ]:
            model, _, _, grads = one_step(store, sample, strategy, **kw, **extra)
            res[name] = (grads, params_of(model))
        ckpt_model = model64()
        ckpt_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model, _, _, grads = one_step(store, S1, "fsdp", model=ckpt_model, **kw)
        res["fsdp_checkpointed"] = (grads, params_of(model))

        # Noise only (empty sample), and σ = 0 for the same empty step.
        n = NOISE
        _, clipper, _, grads = one_step(store, [], "fsdp", C=n["C"], sigma=n["sigma"], B=n["B"],
                                        key=n["key"], **kw)
        res["noise"] = grads
        res["noise_local"] = [p.grad.to_local().clone() for p in clipper.params]
        _, _, _, grads = one_step(store, [], "replicated", C=n["C"], sigma=n["sigma"], B=n["B"],
                                  key=n["key"], **kw)
        res["noise_replicated"] = grads
        _, _, _, grads = one_step(store, [], "fsdp", C=n["C"], sigma=0.0, B=n["B"], key=n["key"], **kw)
        res["no_noise"] = grads

        # bf16 mixed precision, float32 master weights, under both strategies.
        for strategy in ("fsdp", "replicated"):
            m32 = tiny_llama(vocab_size=VOCAB, dtype=torch.float32)
            model, _, _, grads = one_step(store, S1, strategy, model=m32, mixed="bf16", **kw)
            res[f"bf16_{strategy}"] = (grads, {n: p.dtype for n, p in model.named_parameters()})

        res["checkpoint"] = _checkpoint_round_trip(store, out_dir, **kw)
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _checkpoint_round_trip(store, out_dir, world, rank):
    """fsdp: gather → save (rank 0) → load into a differently initialized model; then one
    more identical step on both must give identical parameters."""
    import torch.distributed as dist

    out = {}
    model, clipper, opt, _ = one_step(store, S1, "fsdp", world=world, rank=rank, sigma=0.5,
                                      optimizer="adamw")
    # Without clearing gradients, the next reduction refuses to add to a stray gradient.
    try:
        Fsdp().privatize(clipper.params, [clipper.grad_buffers[n] for n in clipper.param_names],
                         KEY, 0.5, C, B)
    except RuntimeError as e:
        out["stray_grad_error"] = str(e)
    opt.zero_grad(set_to_none=True)
    names = clipper.param_names
    params, optim = parallel.gather_training_state(model, opt, names)
    path = os.path.join(out_dir, "state.pt")
    if rank == 0:
        out["saved_shapes"] = {n: tuple(t.shape) for n, t in params.items()}
        torch.save({"params": params, "optimizer": optim}, path)
    dist.barrier()
    state = torch.load(path)
    other = Fsdp("none", "cpu").prepare_model(model64(seed=1))
    other_clipper = GhostClipper(other, C, grad_buffers=Fsdp().grad_sinks(other))
    other_opt = torch.optim.AdamW(other_clipper.params, lr=1e-2, weight_decay=0.1)
    out["differs_before"] = any(not torch.equal(a.to_local(), b.to_local())
                                for a, b in zip(clipper.params, other_clipper.params))
    parallel.load_training_state(other, other_opt, state["params"], state["optimizer"])
    same = True
    for a, b in zip(clipper.params, other_clipper.params):
        same &= torch.equal(a.to_local(), b.to_local())
        sa, sb = opt.state[a], other_opt.state[b]
        same &= set(sa) == set(sb) and len(sa) > 0
        for k in sa:
            va, vb = sa[k], sb[k]
            va = va.to_local() if hasattr(va, "to_local") else va
            vb = vb.to_local() if hasattr(vb, "to_local") else vb
            same &= torch.equal(va, vb)
    out["restored"] = bool(same)
    for m, c, o in ((model, clipper, opt), (other, other_clipper, other_opt)):
        step_(m, c, o, store, S1, "fsdp", world, rank, 0.5, b"2" * 32, B)
    out["next_step_equal"] = all(torch.equal(full(a), full(b))
                                 for a, b in zip(clipper.params, other_clipper.params))
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_store(tmp_path_factory.mktemp("store"), num_documents=40, sequence_length=24)


@pytest.fixture(scope="module")
def two(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    start_processes(_scenarios, (WORLD, _free_port(), store.path, str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_worker(store):
    """One worker, replicated, σ = 0: (gradients, updated parameters) per sample."""
    out = {}
    for key, sample in (("S1", S1), ("S2", S2)):
        model, _, _, grads = one_step(store, sample, "replicated")
        out[key] = (grads, params_of(model))
    return out


def assert_rel_close(got: dict, ref: dict, rtol=1e-6):
    assert set(got) == set(ref)
    for n in ref:
        assert got[n].shape == ref[n].shape, n
        scale = ref[n].abs().max().clamp(min=1e-30)
        err = float((got[n] - ref[n]).abs().max() / scale)
        assert err <= rtol, (n, err)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,sample", [("fsdp", "S1"), ("replicated", "S1"), ("fsdp_checkpointed", "S1"),
                                         ("fsdp_s2", "S2"), ("fsdp_s2_two_pass", "S2")])
def test_two_workers_equal_one_worker_at_sigma_zero(one_worker, two, name, sample):
    ref_grads, ref_params = one_worker[sample]
    assert any(float(g.abs().max()) > 0 for g in ref_grads.values())  # not vacuous
    for r in range(WORLD):
        grads, params = two[r][name]
        assert_rel_close(grads, ref_grads)
        assert_rel_close(params, ref_params)
    # The embedding shards unevenly (151 + 150 rows) and still matches.
    assert two[0][name][0]["model.embed_tokens.weight"].shape[0] == VOCAB


def test_fsdp_equals_replicated_on_two_workers(two):
    assert_rel_close(two[0]["fsdp"][0], two[0]["replicated"][0])
    assert_rel_close(two[0]["fsdp"][1], two[0]["replicated"][1])


def _corr(x, y):
    x, y = x - x.mean(), y - y.mean()
    return float((x @ y) / (x.norm() * y.norm()))


def test_fsdp_noise_is_one_gaussian_with_std_sigma_C_over_qN(two):
    sigma, Cn, Bn, key = NOISE["sigma"], NOISE["C"], NOISE["B"], NOISE["key"]
    x = torch.cat([g.reshape(-1) for g in two[0]["noise"].values()])
    torch.testing.assert_close(x, torch.cat([g.reshape(-1) for g in two[1]["noise"].values()]),
                               rtol=0, atol=0)  # both ranks gather the same vector
    n = x.numel()
    expected = sigma * Cn / Bn
    # Sample std of n iid normals has sd ~ expected/sqrt(2n); the mean, expected/sqrt(n).
    assert abs(x.std().item() - expected) < 5 * expected / math.sqrt(2 * n), (x.std().item(), expected)
    assert abs(x.mean().item()) < 5 * expected / math.sqrt(n)
    # The same step without noise is exactly zero: the std above is the noise, nothing else.
    assert all(torch.count_nonzero(g) == 0 for g in two[0]["no_noise"].values())

    # fsdp adds exactly the replicated strategy's noise for the same key, bit for bit:
    # each shard generated only its slice of the one global vector (issue 14).
    for r in range(WORLD):
        rep = two[r]["noise_replicated"]
        assert set(rep) == set(two[r]["noise"])
        for name, g in two[r]["noise"].items():
            assert torch.equal(g, rep[name]), name
    # ...and each shard's local tensor is that slice, seeked in the stream of the step's
    # noise key (tensor i = vector i, from row lo·(row size)).
    grads = list(two[0]["noise"].values())
    for r in range(WORLD):
        for i, (local, full) in enumerate(zip(two[r]["noise_local"], grads)):
            d0, row = full.shape[0], math.prod(full.shape[1:])
            lo = min(r * -(-d0 // WORLD), d0)
            want = dp_noise.gaussian_like(local.shape, key, i, sigma * Cn, dtype=local.dtype,
                                          offset=lo * row, total=full.numel()) / Bn
            assert torch.equal(local, want), i
    # The shards are not copies of each other: equal-length prefixes are uncorrelated.
    a = torch.cat([t.reshape(-1) for t in two[0]["noise_local"]])
    b = torch.cat([t.reshape(-1) for t in two[1]["noise_local"]])
    m = min(a.numel(), b.numel())
    assert m > 5000
    assert abs(_corr(a[:m], b[:m])) < 5 / math.sqrt(m)


@pytest.mark.parametrize("strategy", ["fsdp", "replicated"])
def test_bf16_mixed_precision_runs_a_step(store, two, strategy):
    grads, dtypes = two[0][f"bf16_{strategy}"]
    m32 = tiny_llama(vocab_size=VOCAB, dtype=torch.float32)
    _, _, _, ref = one_step(store, S1, "replicated", model=m32)
    assert set(grads) == set(ref)
    for n, g in grads.items():
        assert g.shape == ref[n].shape and g.dtype == torch.float32, n
        assert torch.isfinite(g).all(), n
        assert dtypes[n] == torch.float32  # float32 master weights
    a = torch.cat([g.reshape(-1) for g in grads.values()])
    b = torch.cat([g.reshape(-1) for g in ref.values()])
    assert float(a @ b / (a.norm() * b.norm())) > 0.99  # bf16 compute, same update direction
    torch.testing.assert_close(a, torch.cat([g.reshape(-1) for g in two[1][f"bf16_{strategy}"][0].values()]),
                               rtol=0, atol=0)


def test_fsdp_checkpoint_round_trip_restores_params_and_optimizer(two):
    for r in range(WORLD):
        ck = two[r]["checkpoint"]
        assert ck["differs_before"] and ck["restored"] and ck["next_step_equal"], (r, ck)
        assert "already has a gradient" in ck["stray_grad_error"]
    model = model64()
    assert two[0]["checkpoint"]["saved_shapes"] == {
        n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("kw", [{"mode": "book-keeping"}, {"mode": "two-pass"}, {"engine": "reference"}])
def test_grad_buffers_receive_exactly_what_p_grad_would(store, kw):
    batch = store.rows([0, 1, 2, 3])
    from llmdp.base.losses import row_losses

    a = model64()
    GhostClipper(a, 0.05, **kw).backward(row_losses(a, batch), batch["row_units"])
    b = model64()
    sinks = Fsdp().grad_sinks(b)  # plain full-size buffers; no process group needed
    for _ in range(2):  # accumulates, like autograd
        GhostClipper(b, 0.05, grad_buffers=sinks, **kw).backward(row_losses(b, batch), batch["row_units"])
    assert all(p.grad is None for p in b.parameters())
    for n, p in a.named_parameters():
        torch.testing.assert_close(sinks[n], 2 * p.grad, rtol=1e-12, atol=1e-15)


def test_grad_buffers_are_checked():
    m = model64()
    sinks = Fsdp().grad_sinks(m)
    sinks.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing \\['lm_head.weight'\\]"):
        GhostClipper(m, 1.0, grad_buffers=sinks)
    sinks = Fsdp().grad_sinks(m)
    sinks["lm_head.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="full shape"):
        GhostClipper(m, 1.0, grad_buffers=sinks)
    assert Replicated().grad_sinks(m) is None
    with pytest.raises(ValueError, match="scaling.strategy: 'tp'"):
        strategy_for("tp")
    with pytest.raises(ValueError, match="scaling.mixed_precision: 'fp8'"):
        strategy_for("fsdp", "fp8")


def test_shard_rows_layout_is_torch_chunk():
    from llmdp.train.parallel import rows_of

    for d0 in (1, 2, 5, 7, 301):
        for world in (1, 2, 3, 4):
            chunk = -(-d0 // world)
            got = [rows_of(d0, chunk, r) for r in range(world)]
            ref = torch.arange(d0).chunk(world)
            ref = [(int(c[0]), c.numel()) for c in ref] + [(d0, 0)] * (world - len(ref))
            assert [(lo if n else d0, n) for lo, n in got] == ref
            assert sum(n for _, n in got) == d0


def test_decoder_layers_are_found():
    m = model64()
    layers = parallel.decoder_layers(m)
    assert [type(x).__name__ for x in layers] == ["LlamaDecoderLayer"] * 2


# --------------------------------------------------------------------------- the worker loop


def _loop_proc(rank, world, port, spec, ckpt_dir, out_dir):
    import torch.distributed as dist

    from llmdp.train.loop import LocalContext, train_loop_per_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        first = train_loop_per_worker(spec, LocalContext(checkpoint_dir=ckpt_dir))
        # A second launch resumes from the last checkpoint (every step done: it only loads
        # the full state into the shards and exports again).
        again = train_loop_per_worker(spec, LocalContext(checkpoint_dir=ckpt_dir))
    finally:
        dist.destroy_process_group()
    torch.save({"first": first, "again": again}, os.path.join(out_dir, f"loop{rank}.pt"))


def test_worker_loop_under_fsdp_checkpoints_resumes_and_exports(tmp_path):
    from safetensors.torch import load_file

    from llmdp.config.schema import recipe_from_dict
    from llmdp.run.launch import prepare
    from tests.helpers import tiny_tokenizer_dir, write_notes

    data = write_notes(tmp_path / "notes.jsonl", 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(), "gradient_checkpointing": True,
                  "tiny": {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 2, "physical_batch_size": 4, "checkpoint_every": 1},
        "scaling": {"num_workers": WORLD, "strategy": "fsdp", "mixed_precision": "bf16"},
        "output": {"dir": str(tmp_path / "runs"), "name": "fsdp"},
    }
    prep = prepare(recipe_from_dict(raw), log=lambda *a: None)
    ckpt = tmp_path / "ckpt"
    start_processes(_loop_proc, (WORLD, _free_port(), prep, str(ckpt), str(tmp_path)), WORLD)
    for r in range(WORLD):
        out = torch.load(tmp_path / f"loop{r}.pt")
        assert out["first"]["steps"] == out["again"]["steps"] == 2
    from torch.distributed.checkpoint import FileSystemReader

    from llmdp.record import checkpoints

    meta = checkpoints.read_meta(str(ckpt))  # sharded: every rank wrote its own shards
    assert meta["strategy"] == "fsdp" and meta["step"] == 2 and meta["format"] == checkpoints.SHARDED
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(ckpt))
    exported = load_file(os.path.join(prep.run_dir, "model", "model.safetensors"))
    params = dict(checkpoints.trainable_params(str(ckpt)))
    assert params
    for n, t in params.items():  # full tensors, the exported model is the checkpoint
        torch.testing.assert_close(exported[n], t, rtol=0, atol=0)
    # the optimizer state, by parameter name
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert all(f"optim.state.{n}.exp_avg" in keys for n in params)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_autocast_with_document_masking(attn):
    """Packed rows with document masking under bf16 autocast, and in a bf16 model: the
    additive mask works with eager and SDPA attention whatever the query dtype."""
    from llmdp.base.losses import row_losses
    from tests.helpers import tiny_llama

    replicated = Replicated("bf16", torch.device("cpu"))
    model = replicated.prepare_model(tiny_llama(attn_implementation=attn))
    loss_fn = replicated.loss_fn()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 16), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "row_units": torch.tensor([0, 1]), "num_target_tokens": torch.tensor([15, 15]),
             "segment_ids": torch.tensor([[0] * 6 + [1] * 10, [0] * 16])}
    losses = loss_fn(model, batch)
    assert losses.shape == (2,) and torch.isfinite(losses).all()
    plain = row_losses(model, batch)  # float32 without autocast: same mask semantics
    torch.testing.assert_close(losses.float(), plain.float(), rtol=0.05, atol=0.05)
    bf16 = tiny_llama(attn_implementation=attn).to(torch.bfloat16)
    pure = row_losses(bf16, batch)
    assert torch.isfinite(pure).all()
    torch.testing.assert_close(pure.float(), plain.float(), rtol=0.05, atol=0.05)
