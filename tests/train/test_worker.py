"""The DP-SGD step on a worker: what the mechanism promises, checked in float64.

Owns invariant `noise-once` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from llmdp.clipping import GhostClipper
from llmdp.data.batching import assign_micro_batches
from llmdp.privacy.rng import keys
from llmdp.train.privatize import privatize_
from llmdp.train.step import accumulate_clipped_sum
from llmdp.train.strategy import Replicated
from tests.helpers import TINY_VOCAB, start_processes, tiny_llama, tiny_store

P = 4  # physical batch size


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_store(tmp_path_factory.mktemp("store"), num_documents=40, sequence_length=24)


def model64():
    return tiny_llama(vocab_size=TINY_VOCAB, dtype=torch.float64)


def private_grad(model, store, sample, *, C, sigma, B, key=b"\0" * 32, world=1, rank=0, physical=P,
                 bucket=True):
    """The averaged noisy gradient of one logical step, as this worker sees it."""
    clipper = GhostClipper(model, C)
    mine = assign_micro_batches(np.asarray(sample, dtype=np.int64), store.unit_row_count,
                                store.unit_max_row_length, world_size=world,
                                physical_batch_size=physical, bucket=bucket)[rank]
    stats = accumulate_clipped_sum(model, clipper, store, mine, torch.device("cpu"),
                                   width="auto" if bucket else None)
    privatize_(clipper.params, key, sigma, C, B)
    return [p.grad.detach().clone() for p in clipper.params], stats


def flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


def test_one_huge_unit_moves_the_update_by_at_most_C_over_qN(store):
    C, B, lr = 1e-3, 7.5, 1.0
    base = list(range(0, 10))
    outlier = 17
    # The outlier's own gradient is far above C: the bound below is not vacuous.
    m = model64()
    g_alone, _ = private_grad(m, store, [outlier], C=1e9, sigma=0.0, B=1.0)
    assert flat(g_alone).norm() > 100 * C

    def updated_params(sample):
        model = model64()
        grads, _ = private_grad(model, store, sample, C=C, sigma=0.0, B=B)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        opt.step()
        return flat([p.detach() for p in model.parameters() if p.requires_grad])

    moved = (updated_params(base + [outlier]) - updated_params(base)).norm().item()
    assert moved <= lr * C / B * (1 + 1e-9)
    assert moved >= 0.5 * lr * C / B  # it is clipped to C, not dropped


def test_padding_rows_and_micro_batch_split_change_nothing(store):
    # The last unit of the store is a partial row: padding tokens inside a real unit.
    assert int(store.rows([store.num_units - 1])["attention_mask"].sum()) < store.sequence_length
    sample = [0, 3, 5, 8, 11, store.num_units - 1]
    ref, _ = private_grad(model64(), store, sample, C=0.05, sigma=0.0, B=6.0, physical=64)
    one_by_one, stats = private_grad(model64(), store, sample, C=0.05, sigma=0.0, B=6.0, physical=1)
    assert stats.micro_steps == len(sample)
    torch.testing.assert_close(flat(one_by_one), flat(ref), rtol=1e-10, atol=1e-15)

    class PaddedStore:
        """Every micro-batch padded with masked rows of arbitrary tokens."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def rows(self, idx, width=None):
            batch = self.inner.rows(idx, width=width)
            padded = self.inner.pad_batch(batch, batch["input_ids"].shape[0] + 3)
            padded["input_ids"][-3:] = torch.randint(0, TINY_VOCAB, (3, batch["input_ids"].shape[1]))
            return padded

        def pad_batch(self, batch, n, pad_id=0):
            return self.inner.pad_batch(batch, n, pad_id)

    padded, _ = private_grad(model64(), PaddedStore(store), sample, C=0.05, sigma=0.0, B=6.0, physical=2)
    torch.testing.assert_close(flat(padded), flat(ref), rtol=1e-10, atol=1e-15)


def test_multi_row_units_same_update_for_any_micro_batching(tmp_path):
    """Document units of several rows: bucketing, micro-batch size and worker split change
    nothing (a unit's rows always stay together and are clipped once)."""
    from llmdp.data.store import build_store
    from llmdp.data.units import UnitSpec
    from tests.helpers import tiny_tokenizer, write_notes

    data = write_notes(tmp_path / "n.jsonl", num_documents=30, seed=2)
    docs = build_store(tmp_path / "u", data_path=data, tokenizer=tiny_tokenizer(),
                       spec=UnitSpec("document", 16, max_rows_per_unit=3))
    assert docs.unit_row_count.max() == 3
    sample = np.arange(0, docs.num_units, 2)
    ref, _ = private_grad(model64(), docs, sample, C=0.05, sigma=0.0, B=8.0, physical=64, bucket=False)
    for physical, bucket in ((3, True), (4, False), (7, True)):
        got, stats = private_grad(model64(), docs, sample, C=0.05, sigma=0.0, B=8.0,
                                  physical=physical, bucket=bucket)
        assert stats.units == sample.size
        torch.testing.assert_close(flat(got), flat(ref), rtol=1e-10, atol=1e-15)
    with pytest.raises(ValueError, match="physical_batch_size=2"):
        private_grad(model64(), docs, sample, C=0.05, sigma=0.0, B=8.0, physical=2)


def test_empty_sample_is_a_noise_only_step_with_std_sigma_C_over_qN(store):
    sigma, C, B = 1.3, 0.7, 20.0
    grads, stats = private_grad(model64(), store, [], C=C, sigma=sigma, B=B, key=keys.secure_key())
    assert stats.micro_steps == 0 and stats.units == 0
    x = flat(grads)
    n = x.numel()
    expected = sigma * C / B
    # Sample std of n iid normals has sd ~ expected / sqrt(2n); the mean has sd expected / sqrt(n).
    assert abs(x.std().item() - expected) < 5 * expected / math.sqrt(2 * n), (x.std().item(), expected)
    assert abs(x.mean().item()) < 5 * expected / math.sqrt(n)
    # Without noise the same step is exactly zero: the std above is the noise, nothing else.
    zero, _ = private_grad(model64(), store, [], C=C, sigma=0.0, B=B)
    assert torch.count_nonzero(flat(zero)) == 0


def test_noise_is_added_once_and_identically_for_the_same_key(store):
    key = keys.secure_key()
    a, _ = private_grad(model64(), store, [1, 2], C=0.1, sigma=0.8, B=4.0, key=key)
    b, _ = private_grad(model64(), store, [1, 2], C=0.1, sigma=0.8, B=4.0, key=key)
    c, _ = private_grad(model64(), store, [1, 2], C=0.1, sigma=0.0, B=4.0, key=key)
    torch.testing.assert_close(flat(a), flat(b), rtol=0, atol=0)
    noise = flat(a) - flat(c)
    n = noise.numel()
    expected = 0.8 * 0.1 / 4.0
    assert abs(noise.std().item() - expected) < 5 * expected / math.sqrt(2 * n)


def _two_worker_proc(rank, world, port, store_dir, sample, out_dir, sigma, key):
    import torch.distributed as dist

    from llmdp.data.store import open_store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        grads, _ = private_grad(model64(), open_store(store_dir), sample, C=0.05, sigma=sigma, B=9.0,
                                key=key, world=world, rank=rank)
        torch.save(flat(grads), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_two_workers_give_the_update_of_one(store, tmp_path, sigma):
    sample = [0, 2, 4, 5, 9, 12, 13]  # odd size: uneven shares, padding micro-steps
    key = b"k" * 32
    single, _ = private_grad(model64(), store, sample, C=0.05, sigma=sigma, B=9.0, key=key)
    start_processes(_two_worker_proc, (2, _free_port(), store.path, sample, str(tmp_path), sigma, key), 2)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)  # replicas agree bit for bit
    torch.testing.assert_close(r0, flat(single), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_learning_rate_schedule(schedule):
    from llmdp.config.schema import OptimConfig
    from llmdp.train.loop import lr_lambda

    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1, schedule=schedule)
    f = lr_lambda(cfg, total_steps=24)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    end = {"constant": 1.0, "cosine": 0.1, "linear": 0.1}[schedule]
    assert f(24) == pytest.approx(end)
    mid = f(14)  # halfway through the decay
    assert mid == pytest.approx({"constant": 1.0, "cosine": 0.55, "linear": 0.55}[schedule])
    assert all(f(s) >= f(s + 1) - 1e-12 for s in range(4, 24))


def test_debug_check_accepts_the_engine_and_catches_a_wrong_one(store, monkeypatch):
    from llmdp.base.losses import row_losses
    from llmdp.clipping.rules import LinearRule
    from llmdp.train.step import ClippingCheckError, check_against_reference

    batch = store.rows([0, 1, 2])
    model = model64()
    clipper = GhostClipper(model, 0.05, mode="book-keeping", layer_policy="ghost")
    for p in clipper.params:
        p.grad = torch.zeros_like(p)
    check_against_reference(clipper, row_losses(model, batch), batch["row_units"])

    real = LinearRule.clipped_ghost

    def wrong(self, rec, row_factors):  # a bug: clipping factors applied twice
        return real(self, rec, row_factors * row_factors)

    monkeypatch.setattr(LinearRule, "clipped_ghost", wrong)
    with pytest.raises(ClippingCheckError, match="clipped sum of '.*' differs"):
        check_against_reference(clipper, row_losses(model, batch), batch["row_units"])


# --------------------------------------------------------------------------- issue 12


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    s = tiny_store(tmp_path_factory.mktemp("big"), num_documents=15, sequence_length=8)
    assert s.num_units > 1024
    return s


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_sensitivity_of_the_clipped_sum_at_B_1024(big_store, dtype, device):
    """Issue 12 item 2: ‖f(D) − f(D∖u)‖ ≤ C(1+1e-6), f = this worker's clipped sum before
    noise through the real engine, sinks and micro-step accumulation, measured in float64;
    bf16 trainable parameters (full fine-tuning, replicated) included (was 2.75·C)."""

    C, B, physical = 1e-3, 1024, 256

    def f(sample):
        model = tiny_llama(vocab_size=TINY_VOCAB, dtype=dtype).to(device)
        sinks = Replicated().grad_sinks(model)
        clipper = GhostClipper(model, C, grad_buffers=sinks)
        mine = assign_micro_batches(np.asarray(sample, dtype=np.int64), big_store.unit_row_count,
                                    big_store.unit_max_row_length, world_size=1,
                                    physical_batch_size=physical)[0]
        accumulate_clipped_sum(model, clipper, big_store, mine, torch.device(device))
        sums = [p.grad for p in clipper.params] if sinks is None else [sinks[n] for n in clipper.param_names]
        dtypes.update(s.dtype for s in sums)
        return torch.cat([s.double().reshape(-1) for s in sums])

    dtypes = set()
    D = list(range(B))
    u = 700
    full = f(D)
    assert float(full.norm()) > 10 * C  # many clipped units add up: not a vacuous bound
    sens = float((full - f([i for i in D if i != u])).norm())
    assert sens <= C * (1 + 1e-6), sens / C
    assert sens >= C * (1 - 1e-3)  # the unit is clipped: its contribution is C
    assert dtypes == {torch.float32}  # the sums are float32 whatever the parameter dtype


def test_privatize_reduces_and_noises_float32_sinks_and_casts_at_the_end():
    """bf16 parameters: the clipped sums, the noise and the ÷ q·N stay in float32; the
    result is cast to bf16 only once, into p.grad."""
    from llmdp.privacy.noise.gaussian import gaussian_like

    model = tiny_llama(vocab_size=TINY_VOCAB, dtype=torch.bfloat16)
    sinks = Replicated().grad_sinks(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    for n in names:
        sinks[n].copy_(torch.randn(sinks[n].shape, generator=g) * 1e-3)
    want = [(sinks[n].clone() + gaussian_like(sinks[n].shape, b"k" * 32, i, 0.5 * 2.0)) / 7.0
            for i, n in enumerate(names)]
    Replicated().privatize(params, sinks, b"k" * 32, 0.5, 2.0, 7.0, names=names)
    for p, w in zip(params, want):
        assert p.grad.dtype == torch.bfloat16
        assert torch.equal(p.grad, w.to(torch.bfloat16))
    # A bf16 clipped sum is refused, not reduced and noised in bf16.
    for p in params:
        p.grad = torch.zeros_like(p)
    with pytest.raises(TypeError, match="float32 or wider"):
        privatize_(params, b"k" * 32, 0.5, 2.0, 7.0)


def _nan_first_row(monkeypatch):
    """Every micro-batch's first real row gets a NaN loss (hence a NaN gradient)."""
    import llmdp.base.losses

    real = llmdp.base.losses.row_losses

    def nan_first_row(model, batch):
        losses = real(model, batch)
        first = (batch["row_units"] >= 0).long().argmax()
        bad = torch.zeros_like(losses, dtype=torch.bool)
        bad[first] = bool(batch["row_units"][first] >= 0)
        return torch.where(bad, losses * float("nan"), losses)

    monkeypatch.setattr(llmdp.base.losses, "row_losses", nan_first_row)


def test_nonfinite_units_never_stop_the_run_nor_change_what_is_published(tmp_path, monkeypatch):
    """Issue 29 item 3. A unit with a NaN gradient gets factor 0 and is counted internally;
    the count is a statistic of private data without DP, so it may warn (internal) but must
    not change the run's length, status or published report. Neighbour comparison: the
    same recipe with and without non-finite units publishes the same shape."""
    import json

    from llmdp.record.publish import publishable_report
    from llmdp.report.build import write_report
    from llmdp.train.loop import LocalContext, train_loop_per_worker
    from tests.train.test_loop import make_recipe, prepared_config

    published = {}
    for name in ("clean", "nan"):
        with monkeypatch.context() as m:
            if name == "nan":
                _nan_first_row(m)
            # Each side its own ledgers: the same corpus in two folders is one dataset, and
            # a second ledger for it would be refused (issue 29 item 5), as would another
            # database listed in the same registry of ledger databases (issue 49 item 3).
            m.setenv("LLMDP_HOME", str(tmp_path / name / "home"))
            m.setenv("XDG_DATA_HOME", str(tmp_path / name / "home"))
            cfg = make_recipe(tmp_path / name, steps=8, max_nonfinite_steps=2)
            prep = prepared_config(cfg)
            out = train_loop_per_worker(prep, LocalContext())
        assert out == {"steps": 8}  # never stopped early
        lines = [json.loads(x) for x in open(os.path.join(prep.run_dir, "metrics.jsonl"))]
        steps = [x for x in lines if "nonfinite_units" in x]
        warned = [x for x in lines if x.get("event") == "warning"]
        if name == "nan":
            # every step with a sampled unit had one NaN unit (an empty sample has none)
            assert all(x["nonfinite_units"] >= 1 for x in steps if x["units"] > 0)
            had = sum(x["units"] > 0 for x in steps)
            assert len(warned) == (1 if had > 2 else 0)
            assert all(x["internal"] and "max_nonfinite_steps=2" in x["message"] for x in warned)
        else:
            assert all(x["nonfinite_units"] == 0 for x in steps) and not warned
        r = write_report(prep.run_dir)
        assert r["status"] == "complete" and r["steps_completed"] == 8 and r["stopped"] is None
        pub = publishable_report(r)
        assert "finite" not in json.dumps(pub)
        published[name] = pub
        from safetensors.torch import load_file

        saved = load_file(os.path.join(prep.run_dir, "model", "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in saved.values())  # nothing non-finite leaked
    shape = ("status", "stopped", "steps_completed", "steps", "stop_cause")
    assert {k: published["clean"].get(k) for k in shape} == {k: published["nan"].get(k) for k in shape}


@pytest.mark.parametrize("value,why", [(-1, "out of range"), ("ten", "wrong type"), (2.5, "wrong type")])
def test_max_nonfinite_steps_is_validated(value, why):
    from llmdp.config.schema import ConfigError, recipe_from_dict

    raw = {"model": {"init": "tiny", "tokenizer": "/tmp"}, "data": {"path": "x.jsonl"},
           "privacy": {"noise_multiplier": 1.0},
           "train": {"steps": 5, "max_nonfinite_steps": value}}
    with pytest.raises(ConfigError, match=rf"train.max_nonfinite_steps: .*{why}"):
        recipe_from_dict(raw)
    raw["train"]["max_nonfinite_steps"] = 0
    assert recipe_from_dict(raw).train.max_nonfinite_steps == 0


def test_report_states_the_noise_tail_and_its_delta(tmp_path):
    """Issue 12 item 8c: the report (JSON and Markdown) carries the generator's tail and
    the δ it adds, computed from the run's trainable parameter count and σ."""
    from llmdp.privacy.noise.gaussian import NOISE_TAIL, truncation_delta_per_step
    from llmdp.report.build import write_report
    from llmdp.report.render import render_markdown
    from llmdp.train.loop import LocalContext, train_loop_per_worker
    from tests.train.test_loop import make_recipe, prepared_config

    prep = prepared_config(make_recipe(tmp_path, steps=2))
    train_loop_per_worker(prep, LocalContext())
    r = write_report(prep.run_dir)
    g = r["noise_generator"]
    assert g["tail_truncation_std"] == NOISE_TAIL
    assert g["trainable_parameters"] > 0
    assert g["truncation_delta_per_step"] == truncation_delta_per_step(g["trainable_parameters"],
                                                                       r["noise_multiplier"])
    assert g["truncation_delta_run"] == pytest.approx(g["truncation_delta_per_step"] * r["steps"])
    md = render_markdown(r)
    assert f"|z| ≤ {NOISE_TAIL:.4f}·σC" in md and "rounded to float32" in md
    # Issue 14: the generator and the accountant's continuous-Gaussian assumption are stated.
    assert "ChaCha20 (RFC 8439)" in g["method"] and "ChaCha20 (RFC 8439)" in md
    assert "continuous Gaussian" in g["accountant_assumes"] and "exact continuous Gaussian" in md


def test_report_delta_is_the_accountants_plus_the_noise_tails(tmp_path, monkeypatch):
    """Issue 29 item 8: the headline δ is δ_accountant + the noise generator's tails over the
    ledger's releases, ε is dp-accounting at δ_accountant = (δ - T·η)·(1 - T·k·m), and the
    report shows the split. The tails of the 53-bit generator model (m = 2**-53: σ = 0.3
    makes them ~5% of δ, visible in ε; the 106-bit generator's need σ ≈ 0.14 to show, where
    PLD costs seconds per ε): the wiring is the same for any cap. A plan.json of an earlier
    llmdp (no noise_coordinates) is still read, as before, and says so."""
    from tests.helpers import use_noise_cap

    mass, _ = use_noise_cap(monkeypatch, 53)
    import json

    import dp_accounting

    from llmdp.config.schema import recipe_from_dict
    from llmdp.config.yamlio import to_dict
    from llmdp.privacy.noise.gaussian import truncation_delta_per_step
    from llmdp.report.build import build_report, write_report
    from llmdp.report.render import render_markdown
    from llmdp.train.loop import LocalContext, train_loop_per_worker
    from tests.train.test_loop import make_recipe, prepared_config

    raw = to_dict(make_recipe(tmp_path, steps=2))
    raw["privacy"]["noise_multiplier"] = 0.3
    prep = prepared_config(recipe_from_dict(raw))
    train_loop_per_worker(prep, LocalContext())
    r = write_report(prep.run_dir)
    k, sigma, steps = r["noise_generator"]["trainable_parameters"], r["noise_multiplier"], r["steps"]
    assert k == prep.plan.noise_coordinates and steps == 2
    want = (1e-4 - steps * truncation_delta_per_step(k, sigma)) * (1 - steps * k * mass)
    assert r["delta"] == 1e-4 and r["delta_accountant"] == pytest.approx(want, rel=1e-12)
    assert r["delta_accountant"] + r["delta_noise_tail"] == pytest.approx(r["delta"], rel=1e-14)
    assert 0.01 < r["delta_noise_tail"] / r["delta"] < 0.1

    # dp-accounting's own PLD of the run's releases, built once: its ε at each δ below
    ref = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    ref.compose(dp_accounting.PoissonSampledDpEvent(
        r["sampling_probability"], dp_accounting.GaussianDpEvent(sigma)), steps)
    direct = ref.get_epsilon

    assert r["epsilon"] == pytest.approx(direct(want), rel=1e-6)
    assert direct(1e-4) < r["epsilon"] * (1 - 1e-4)  # at δ itself ε would be understated
    assert r["epsilon_curve"][-1][1] == r["epsilon"]  # the curve: the same δ_accountant
    g = r["noise_generator"]
    assert g["included_in_delta"] and g["delta_noise_tail"] == r["delta_noise_tail"]
    md = render_markdown(r)
    assert "δ includes the noise generator's truncated tails" in md and "included in δ above" in md
    assert "(accountant) +" in md

    # A plan.json written before the field existed: read, δ is the accountant's, as before.
    path = os.path.join(prep.run_dir, "plan.json")
    info = json.load(open(path))
    info["plan"].pop("noise_coordinates")
    info["plan"].pop("eval_noise")
    from llmdp.privacy.plan import DPPlan

    # ... whose planned ε was of that plan (no tails), as plan.json's reader re-derives it
    info["epsilon_planned"] = info["epsilon_planned_training_only"] = \
        DPPlan.from_dict(info["plan"]).epsilon()
    json.dump(info, open(path, "w"))
    old = build_report(prep.run_dir)
    assert old["delta"] == old["delta_accountant"] == 1e-4 and old["delta_noise_tail"] is None
    assert old["epsilon"] == pytest.approx(direct(1e-4), rel=1e-6)
    assert not old["noise_generator"]["included_in_delta"]
    assert "earlier llmdp" in old["noise_generator"]["note"]
    md = render_markdown(old)
    assert "not included in δ above (a plan of an earlier llmdp)" in md
    assert "the noise generator's truncated tails are not included" in md


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                            "</{{ m['role'] }}>\n{% endfor %}"])
def test_a_chat_report_names_its_template_and_that_only_replies_are_trained(tmp_path, template):
    """Issue 51 item 10: the report of a run on chat records says which chat template
    rendered them (the tokenizer's own, with its hash, or the plain format) and that only
    the assistant replies are training targets; the publishable report and the card too."""
    import dataclasses
    import hashlib
    import json

    from llmdp.config.schema import recipe_from_dict, to_dict
    from llmdp.record.publish import publishable_report
    from llmdp.report.build import write_report
    from llmdp.report.render import render_markdown
    from tests.helpers import simulate_steps, tiny_tokenizer
    from tests.train.test_loop import make_recipe, prepared_config

    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(60):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Summarize note {i} about the patient's cough."},
                {"role": "assistant", "content": f"Note {i}: cough for {i % 9 + 1} days."}]}) + "\n")
    raw = to_dict(make_recipe(tmp_path))
    raw["data"].update({"path": str(chats), "messages_field": "messages"})
    if template is not None:  # a tokenizer that carries its own chat template
        tok = tiny_tokenizer(tmp_path)
        tok.chat_template = template
        tok.save_pretrained(tmp_path / "tok-chat")
        raw["model"]["tokenizer"] = str(tmp_path / "tok-chat")
    cfg = recipe_from_dict(raw)
    prep = prepared_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2)))
    simulate_steps(prep)
    r = write_report(prep.run_dir)
    fmt = r["record_format"]
    assert fmt.startswith("chat records (data.messages_field='messages') rendered with ")
    assert "only the assistant replies" in fmt and "never trained on" in fmt
    if template is None:
        assert "no chat template: the plain format plain-v1" in fmt
    else:
        sha = hashlib.sha256(json.dumps(template).encode()).hexdigest()[:12]
        assert f"the tokenizer's own chat template (sha256 {sha}…)" in fmt
    assert f"| Record format | {fmt} |" in render_markdown(r)
    assert publishable_report(r)["record_format"] == fmt
