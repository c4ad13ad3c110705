"""Grey-box neighbour replay (issue 19, item 0; ``llmdp.train.replay``): the real DP step
on D and on D∖{u}, same randomness. Every case of the matrix passes with no plant; each
planted bug is caught by the check it breaks.

The matrix (pairwise over the axes, not their product; ``CASES``): model families tied
(llama with tied embeddings, gemma) and untied (llama, gpt2, qwen2), mixtures of experts
(qwen3_moe, gpt_oss, in bf16; LoRA on the experts' 3-D weights); full fine-tuning and
LoRA; float32 and bfloat16 parameters; bf16 mixed precision; book-keeping and two-pass
clipping; ghost and instantiate layer policies; activation checkpointing; sequence,
document and user units; Poisson and truncated Poisson; replicated and fsdp (2 gloo
processes, one spawned pair for all fsdp cases and a 2-worker replicated one).

Correlated noise (issue 34): banded MF with cyclic Poisson, over three steps of two
groups: ‖Δ‖ = C at the removed unit's group's steps, Δ = 0 exactly at the other's.

C = 1e-3: every unit's gradient is far above C, so every removed unit is clipped and
contributes exactly C (``expect_clipped``: ‖Δ‖ ≥ C(1 − 1e-3), the bound is not vacuous),
and the sum over D is many times C, so rounding on it would show.

Owns invariant `one-sensitivity-boundary` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from llmdp.data.batching import assign_micro_batches
from llmdp.data.store import open_store
from llmdp.train.replay import (
    ReplayResult,
    aligned,
    aligned_draw,
    replay,
    sampled_seed,
    with_seed,
)
from llmdp.train.step import StepKeys

C = 1e-3
SEQ = 24
PHYSICAL = 6  # rows per micro-step: 2 document units of 3 rows, or 6 sequences
# Character lengths of the records, cycled: short records are padding-heavy units, long
# ones fill data.max_rows_per_unit rows.
LENGTHS = (12, 400, 60, 900, 25, 150, 700, 40)


def _corpus(path: str, n: int) -> str:
    """``n`` records of varied length cut from the synthetic notes, with a user field
    (users of 1 to 3 records)."""
    from tests.helpers import write_notes

    if os.path.exists(path):
        return path
    src = path + ".notes.jsonl"
    write_notes(src, 40)
    with open(src) as f:
        notes = [json.loads(line)["text"] for line in f]
    with open(path, "w") as f:
        for i in range(n):
            text = (notes[i % 40] * 3)[: LENGTHS[i % len(LENGTHS)]]
            f.write(json.dumps({"text": text, "user_id": f"user{(i * 7) % (n // 2)}"}) + "\n")
    return path


# name: family, tied, lora, dtype, mixed, mode, policy, checkpointing, unit, sampler,
#       strategy, q ("1": every unit; "last": q < 1, the last unit removed), records (the
#       corpus size: at q < 1 one where some B ≈ N/2 keeps the other coins in place)
CASES = {
    "llama-seq-bk-ghost": dict(family="llama", unit="sequence", mode="book-keeping",
                               policy="ghost"),
    "llama-tied-lora-doc-trunc": dict(family="llama", tied=True, lora=True, unit="document",
                                      mode="two-pass", policy="instantiate",
                                      sampler="truncated-poisson"),
    "gpt2-bf16-user-ckpt": dict(family="gpt2", dtype="bfloat16", unit="user",
                                mode="book-keeping", policy="instantiate", checkpointing=True),
    "qwen2-mixed-doc-trunc": dict(family="qwen2", mixed="bf16", unit="document",
                                  mode="two-pass", policy="ghost",
                                  sampler="truncated-poisson"),
    "gemma-lora-bf16-seq-last": dict(family="gemma", tied=True, lora=True, dtype="bfloat16",
                                     unit="sequence", policy="ghost", checkpointing=True,
                                     q="last", records=7),
    "llama-doc-trunc-last": dict(family="llama", unit="document", mode="book-keeping",
                                 policy="instantiate", sampler="truncated-poisson", q="last",
                                 records=47),
    # Issue 33: mixtures of experts in bf16 (the experts rule; LoRA on the 3-D expert
    # weights through peft's ParamWrapper; gpt-oss's attention sinks by the generic rule).
    "qwen3moe-bf16-doc-bk-trunc": dict(family="qwen3_moe", dtype="bfloat16", unit="document",
                                       mode="book-keeping", policy="ghost",
                                       sampler="truncated-poisson"),
    "gptoss-bf16-lora-experts-seq": dict(family="gpt_oss", dtype="bfloat16", lora=True,
                                         lora_experts=True, unit="sequence", mode="two-pass"),
    "gptoss-bf16-user-trunc": dict(family="gpt_oss", dtype="bfloat16", unit="user",
                                   mode="book-keeping", policy="instantiate",
                                   sampler="truncated-poisson"),
    "pair-gpt2-replicated-seq": dict(family="gpt2", unit="sequence", mode="two-pass",
                                     workers=2),
    "fsdp-llama-doc-trunc": dict(family="llama", unit="document", mode="two-pass",
                                 sampler="truncated-poisson", strategy="fsdp"),
    "fsdp-qwen2-lora-mixed-seq": dict(family="qwen2", lora=True, mixed="bf16", unit="sequence",
                                      mode="book-keeping", strategy="fsdp"),
    "fsdp-gemma-user-ckpt-last": dict(family="gemma", tied=True, unit="user", checkpointing=True,
                                      policy="instantiate", strategy="fsdp", q="last",
                                      records=46),
}
SLOW = {"llama-tied-lora-doc-trunc", "llama-doc-trunc-last"}  # the longest (measured)
# Issue 29 item 1: the model replaced by _MassiveDifference (``with_model``); the recipe
# gives the data, the sampler and the mode. ``big``: the massive channel's value (1e8
# makes even the float64 Gram's bound exceed 1 % of the norm).
MASSIVE = {
    "massive-seq-bk": dict(family="llama", unit="sequence", mode="book-keeping", big=1e4),
    "massive-doc-two-pass-trunc": dict(family="llama", unit="document", mode="two-pass",
                                       sampler="truncated-poisson", big=1e8),
}


def _raw(tmp: str, name: str, case: dict, batch: int, max_batch: int | None) -> dict:
    unit = case.get("unit", "sequence")
    records = case.get("records", 8 if unit == "sequence" else 32)
    data = {"path": _corpus(os.path.join(tmp, f"corpus-{unit}-{records}.jsonl"), records),
            "sequence_length": SEQ, "unit": unit}
    if unit != "sequence":
        data["max_rows_per_unit"] = 3
    if unit == "user":
        data["user_field"] = "user_id"
    pair = case.get("strategy") == "fsdp" or case.get("workers") == 2
    from tests.helpers import tiny_tokenizer_dir

    return {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "dtype": case.get("dtype", "float32"),
                  "gradient_checkpointing": case.get("checkpointing", False),
                  **({"lora": {"r": 2, "alpha": 4.0, **(
                      {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
                      if case.get("lora_experts") else {})}} if case.get("lora") else {}),
                  "tiny": {"family": case.get("family", "llama"), "hidden_size": 16,
                           "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64,
                           "tie_word_embeddings": case.get("tied", False)}},
        "data": data,
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": C, "delta": 1e-4,
                    "rng": "seeded", "seed": 0, "clipping_mode": case.get("mode", "auto"),
                    "sampler": case.get("sampler", "poisson"),
                    **({"max_batch_size": max_batch} if max_batch else {})},
        "optim": {"name": "sgd", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": batch, "steps": 2, "physical_batch_size": PHYSICAL,
                  "checkpoint_every": 1},
        "scaling": {"num_workers": 2 if pair else 1, "strategy": case.get("strategy", "replicated"),
                    "mixed_precision": case.get("mixed", "none")},
        "output": {"dir": os.path.join(tmp, "runs"), "name": name},
    }


def _spec(tmp: str, name: str):
    """The case's RunSpec (``trainer.prepare``) at q = 1, or at q ≈ 1/2 with a seed whose
    first step samples the last unit."""
    from llmdp.config.schema import recipe_from_dict
    from llmdp.run.launch import prepare

    case = CASES[name] if name in CASES else MASSIVE[name]
    # A first plan learns N (the store is built once and cached for the second). N does not
    # depend on the sampler: the probe samples by Poisson, whose plan needs no search for
    # truncated Poisson's cap (seconds of dp-accounting for a plan that is thrown away).
    probe = prepare(recipe_from_dict(_raw(tmp, name + "-probe", {**case, "sampler": "poisson"}, 2, None)),
                    log=lambda *a: None)
    n = open_store(probe.paths.store_dir).num_units
    last = case.get("q") == "last"
    batch = _aligned_batch(n) if last else n
    trunc = case.get("sampler") == "truncated-poisson"
    max_batch = (min(n, batch + 4) if last else n) if trunc else None
    spec = prepare(recipe_from_dict(_raw(tmp, name, case, batch, max_batch)), log=lambda *a: None)
    if last:
        assert spec.plan.sampling_probability == batch / n < 1
        spec = with_seed(spec, sampled_seed(spec, n - 1))
    return spec


def _aligned_batch(n: int) -> int:
    """The expected batch size B nearest N/2 at which removing the last of N units moves
    no other unit's coin on the real sampler (``aligned_draw``; far from every B does)."""
    from llmdp.privacy.rng.keys import seeded_key

    for b in sorted(range(2, n - 1), key=lambda b: (abs(b - n / 2), b)):
        if all(aligned_draw(n, b / n, None, n - 1, seeded_key(0, s, "test")) for s in range(8)):
            return b
    raise AssertionError(f"no aligned expected batch size for N={n}")


def _units(spec) -> dict[str, int]:
    """The worst-case units to remove: one on a micro-step boundary (the first unit of
    micro-step 1), the longest (most rows), the most padding-heavy (fewest target tokens);
    at q < 1 only the last unit."""
    store = open_store(spec.paths.store_dir)
    n = store.num_units
    if spec.plan.sampling_probability < 1:
        return {"last": n - 1}
    world = spec.cfg.scaling.num_workers
    plan = assign_micro_batches(np.arange(n), store.unit_row_count, store.unit_max_row_length,
                                world_size=world, physical_batch_size=PHYSICAL)
    out = {"boundary": int(plan[0][1][0])}
    if spec.cfg.data.unit != "sequence":
        out["longest"] = int(np.argmax(store.unit_row_count))
        out["shortest"] = int(np.argmin(store.unit_target_tokens))
    return out


def _not_vacuous(res: ReplayResult, what: str) -> None:
    """What makes a passing verdict mean something: the sum over D is many times C (a
    rounding of it would show), every unit was clipped (the removed one contributes
    exactly C), the step's reduction, noise and ledger record were seen."""
    d, _ = res.steps[0]
    assert res.full_norms[0] > 5, f"{what}: {res}"
    assert not res.notes, f"{what}: {res}"  # every check was made
    assert d.metrics["worker0_clipped_fraction"] == 1.0, f"{what}: {d.metrics}"
    ops = {c[0] for c in d.collectives}
    assert {"parallel.sum_over_workers", "noise.add_noise_"} <= ops, ops
    assert [r["kind"] for r in d.ledger] == ["release"], d.ledger


def _check(spec, name: str) -> dict[str, ReplayResult]:
    policy = CASES[name].get("policy")
    return {k: replay(spec, u, layer_policy=policy, expect_clipped=True)
            for k, u in _units(spec).items()}


# --------------------------------------------------------------------------- replicated


# In one process; the others run in one spawned pair of gloo processes (below).
REPLICATED = [n for n in CASES if CASES[n].get("strategy") != "fsdp" and not CASES[n].get("workers")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in REPLICATED])
def test_replicated_case_passes(tmp_path, name):
    spec = _spec(str(tmp_path), name)
    results = _check(spec, name)
    for what, res in results.items():
        print(f"{name} / {what}: {res}")  # with -s: the measured ‖Δ‖/C
        assert res.ok, f"{name} / {what}: {res}"
        _not_vacuous(res, f"{name} / {what}")
    store = open_store(spec.paths.store_dir)
    if spec.cfg.data.unit != "sequence" and spec.plan.sampling_probability == 1:
        assert store.unit_row_count[results["longest"].unit] == 3  # data.max_rows_per_unit
    if spec.cfg.data.unit == "document" and spec.plan.sampling_probability == 1:
        short = store.rows([results["shortest"].unit])
        assert int(short["attention_mask"].sum()) < SEQ // 2  # mostly padding


def test_two_steps_from_the_same_parameters(tmp_path):
    """Step 2 compares the sums at D's parameters after its first (noised) update."""
    name = "qwen2-mixed-doc-trunc"
    spec = _spec(str(tmp_path), name)
    res = replay(spec, _units(spec)["boundary"], steps=2, layer_policy=CASES[name].get("policy"),
                 expect_clipped=True)
    assert res.ok and len(res.ratios) == 2, str(res)
    assert res.steps[0][0].ledger and res.steps[0][0].ledger == res.steps[0][1].ledger


def test_the_last_unit_leaves_every_other_coin_in_place_only_at_some_n_and_q(tmp_path):
    """q < 1: at the case's N and q, removing the last unit moves no other unit's coin on
    the real samplers, and the chosen seed samples it; removing the first unit is refused
    (indices shift). At q = B/N exactly the coins move (the skip walk's chunk size follows
    ⌊N·q⌋): the replay cannot use such a pair, and says so."""
    from llmdp.privacy.rng.keys import seeded_key
    from llmdp.train.replay import _ATTEMPT, ReplayError

    assert not any(aligned_draw(40, 0.5, None, 39, seeded_key(0, s, "test")) for s in range(8))
    spec = _spec(str(tmp_path), "llama-doc-trunc-last")
    n = int(spec.plan.dataset_size)
    assert spec.plan.sampling_probability < 1
    for seed in range(20):  # every draw D does not truncate (a truncated one subsamples anew)
        s = with_seed(spec, seed)
        key = StepKeys.draw(0, "seeded", seed, torch.device("cpu"), (s.run_id, _ATTEMPT)).sample
        if not s.plan.make_sampler().sample_with_info(key)[1]:
            assert aligned(s, n - 1), seed
    res = replay(spec, n - 1, layer_policy="instantiate", expect_clipped=True)
    assert res.ok, str(res)
    assert n - 1 in res.steps[0][0].sample
    assert 0 < len(res.steps[0][1].sample) == len(res.steps[0][0].sample) - 1
    if not aligned(spec, 0):
        with pytest.raises(ReplayError, match="not D's without unit 0"):
            replay(spec, 0)


# --------------------------------------------------------------------------- correlated noise (issue 34)


def _mf_spec(tmp: str, cycle: int = 2):
    """Banded MF (bands = cycle = 2) with cyclic Poisson at q_g = 1 (B = N / cycle): every
    unit of the step's group is sampled, so the neighbour's sample is D's without u."""
    from llmdp.config.schema import recipe_from_dict
    from llmdp.run.launch import prepare

    case = dict(family="llama", unit="document", mode="book-keeping", policy="ghost", records=16)
    probe = prepare(recipe_from_dict(_raw(tmp, "mf-probe", case, 2, None)), log=lambda *a: None)
    n = open_store(probe.paths.store_dir).num_units
    raw = _raw(tmp, "mf", case, 2, None)
    raw["privacy"] |= {"mechanism": "banded-mf", "sampler": "cyclic-poisson", "bands": cycle}
    raw["train"] |= {"expected_batch_size": n / cycle, "steps": 4}
    spec = prepare(recipe_from_dict(raw), log=lambda *a: None)
    assert spec.plan.correlated and spec.plan.event_probability == 1.0
    return spec


def test_banded_mf_sums_are_within_c_at_the_units_turns_and_equal_elsewhere(tmp_path):
    """The correlated mechanism takes the same clipped sums as DP-SGD: at each step of the
    removed unit's group ‖Δ‖ = C (clipped), at the other group's step Δ = 0 exactly; the
    stream's entry is where the sums are captured, and the ledger's round records agree."""
    from llmdp.train.replay import unit_groups_of

    spec = _mf_spec(str(tmp_path))
    groups = unit_groups_of(spec)
    assert sorted(set(groups.tolist())) == [0, 1]
    for g in (0, 1):
        u = int(np.flatnonzero(groups == g)[-1])
        res = replay(spec, u, steps=3, layer_policy="ghost", expect_clipped=True)
        print(f"group {g}: {res}")
        assert res.ok, str(res)
        turns = [t % 2 == g for t in range(3)]
        assert [r == 0 for r in res.ratios] == [not x for x in turns], res.ratios
        assert all(abs(r - 1) < 1e-3 for r, x in zip(res.ratios, turns) if x), res.ratios
        d, n = res.steps[0]
        assert {c[0] for c in d.collectives} >= {"correlated.add_", "parallel.sum_over_workers"}
        assert "noise.add_noise_" not in {c[0] for c in d.collectives}  # no second noise
        assert [r["kind"] for r in d.ledger] == ["release"] and d.ledger == n.ledger
        assert d.ledger[0]["meta"]["mechanism"] == "banded-mf"
        assert res.full_norms[0] > 2
        assert all(s.metrics["worker0_clipped_fraction"] == 1.0 for s, _ in res.steps)


def test_a_planted_clip_scale_fails_the_banded_mf_replay(tmp_path, monkeypatch):
    from llmdp.base import plants as plant
    from llmdp.train.replay import unit_groups_of

    spec = _mf_spec(str(tmp_path))
    u = int(np.flatnonzero(unit_groups_of(spec) == 0)[-1])
    monkeypatch.setenv(plant.ENV, "clip-scale")
    res = replay(spec, u, layer_policy="ghost", expect_clipped=True)
    assert not res.ok and any("sensitivity" in v for v in res.violations), str(res)


# --------------------------------------------------------------------------- massive activation


class _MassiveDifference(torch.nn.Module):
    """A tiny causal LM whose trainable layer's clipping norm is a small difference of huge
    terms (issue 29 item 1): its input has a channel that is ``big`` at every position (a
    frozen embedding whose column 0 is ``big``: a "massive activation"), and its output
    gradient sums to exactly zero over each row's positions (the next step outputs
    h_t − h_{t−1}), so the big channel cancels in g = Σ_t G_t A_tᵀ while ⟨AAᵀ, GGᵀ⟩ is a
    sum of ~big² terms. Rows stay independent."""

    def __init__(self, vocab: int, d: int = 16, big: float = 1e4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.mix = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.embed.weight[:, 0] = big
        self.embed.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, input_ids, attention_mask=None, **_):
        from types import SimpleNamespace

        h = self.mix(self.embed(input_ids))
        y = torch.cat([torch.zeros_like(h[:, :1]), h[:, 1:] - h[:, :-1]], 1)
        return SimpleNamespace(logits=self.head(y))


@pytest.mark.parametrize("policy", ["ghost", "instantiate"])
@pytest.mark.parametrize("name", list(MASSIVE))
def test_massive_activation_with_cancelling_gradients(tmp_path, name, policy):
    """The removed unit adds at most C(1 + 1e-6) — and, clipped, at least C(1 − 1e-3) —
    through the real step, with a layer whose float32 ghost norm cancelled to garbage
    (before the fix: ‖Δ‖/C far from 1 on these cases)."""
    from llmdp.train.replay import with_model

    spec = _spec(str(tmp_path), name)
    factory = with_model(spec, lambda vocab: _MassiveDifference(vocab, big=MASSIVE[name]["big"]))
    for what, unit in _units(spec).items():
        res = replay(factory, unit, spec=spec, layer_policy=policy, expect_clipped=True)
        print(f"{name} / {policy} / {what}: {res}")
        assert res.ok, f"{name} / {what}: {res}"
        _not_vacuous(res, f"{name} / {what}")
        # The float32 contractions' bounds are a real part of these norms: the exact float64
        # fallback served (and is counted, internally).
        assert res.steps[0][0].metrics["worker0_norm_fallbacks"] > 0, res.steps[0][0].metrics


# --------------------------------------------------------------------------- plants


def _odd_unit(spec) -> int:
    """A unit with an odd number of tokens: removing it flips the parity of the share."""
    store = open_store(spec.paths.store_dir)
    for u in range(store.num_units):
        if int(store.rows([u])["attention_mask"].sum()) % 2:
            return u
    raise AssertionError("no unit with an odd token count")


@pytest.mark.parametrize("plant_name,case", [("clip-scale", "llama-seq-bk-ghost"),
                                             ("bf16-sum", "llama-seq-bk-ghost"),
                                             ("extra-micro-step", "llama-tied-lora-doc-trunc")])
def test_a_planted_bug_fails_the_replay(tmp_path, monkeypatch, plant_name, case):
    from llmdp.base import plants as plant

    spec = _spec(str(tmp_path), case)
    unit = _odd_unit(spec) if plant_name == "extra-micro-step" else _units(spec)["boundary"]
    monkeypatch.setenv(plant.ENV, plant_name)
    res = replay(spec, unit, layer_policy=CASES[case].get("policy"), expect_clipped=True)
    print(f"{plant_name}: {res}")
    assert not res.ok
    if plant_name == "extra-micro-step":
        assert any(v.startswith("(b)") and "micro-steps" in v for v in res.violations), str(res)
        assert not any(v.startswith("(a)") for v in res.violations), str(res)
    else:
        assert any(v.startswith("(a)") for v in res.violations), str(res)
        if plant_name == "clip-scale":
            assert res.ratios[0] == pytest.approx(1.01, rel=1e-4)
            assert any("sensitivity" in v for v in res.violations), str(res)


# --------------------------------------------------------------------------- two workers


PAIR = [n for n in CASES if n not in REPLICATED]


def _summary(res: ReplayResult) -> dict:
    d, _ = res.steps[0]
    return {"ok": res.ok, "text": str(res), "ratios": res.ratios, "full_norms": res.full_norms,
            "violations": res.violations, "notes": res.notes, "ops": sorted({c[0] for c in d.collectives}),
            "clipped": d.metrics["worker0_clipped_fraction"], "ledger": d.ledger}


def _fsdp_proc(rank, port, jobs, out):
    """One of the 2 gloo processes: every job's replay, rank 0 writes the verdicts."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        verdicts = {}
        for key, spec, unit, policy in jobs:
            verdicts[key] = _summary(replay(spec, unit, layer_policy=policy, expect_clipped=True))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(out, "verdicts.json"), "w") as f:
            json.dump(verdicts, f)


def _spawn(jobs, out) -> dict:
    import torch.multiprocessing as mp

    from tests.helpers import start_processes
    from tests.train.test_checkpoint_dcp import _ports

    # The port is chosen free, then bound by gloo a moment later: on a loaded machine another
    # process can take it in between, and a gloo process dies by a signal (seen once: SIGABRT,
    # "terminate called without an active exception"). Such a death is retried once on a
    # fresh port; a replay's verdict (a wrong bound) is never retried: it is a result, read
    # by the test, and a process that dies twice fails it.
    for attempt in (1, 2):
        try:
            start_processes(_fsdp_proc, (_ports(1)[0], jobs, out), 2)
            break
        except mp.ProcessExitedException as e:
            if attempt == 2 or e.signal_name is None:
                raise
            print(f"gloo pair died ({e}); retried once on a fresh port")
    with open(os.path.join(out, "verdicts.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def pair_verdicts(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fsdp"))
    jobs = []
    for name in PAIR:
        spec = _spec(tmp, name)
        # One unit a case (each fsdp replay costs ~5 s on 2 cores): the micro-step boundary,
        # or at q < 1 the last unit; the longest and shortest are replayed replicated.
        k, u = next(iter(_units(spec).items()))
        jobs.append((f"{name}/{k}", spec, u, CASES[name].get("policy")))
    return _spawn(jobs, tmp)


@pytest.mark.slow
@pytest.mark.parametrize("name", PAIR)
def test_two_worker_case_passes(pair_verdicts, name):
    mine = {k: v for k, v in pair_verdicts.items() if k.startswith(name + "/")}
    assert mine
    for key, v in mine.items():
        print(f"{key}: {v['text']}")
        assert v["ok"], f"{key}: {v['text']}"
        # the sum over a Poisson half-batch of a few clipped units is a few C, by how their
        # directions add (3.9 and 7.3 C seen for fsdp-gemma-user-ckpt-last across full runs):
        # at least twice C, as the correlated-noise replay asks
        assert v["full_norms"][0] > 2 and v["clipped"] == 1.0, f"{key}: {v['text']}"
        assert not v["notes"], f"{key}: {v['text']}"  # every check was made
        # fsdp: the parameters' all-gathers and the sums' reduce-scatter were seen;
        # replicated: the sums' all-reduce
        seen = {"dist.all_gather_single", "privatize.privatize_sharded_",
                "dist.reduce_scatter_single"} if CASES[name].get("strategy") == "fsdp" else \
            {"privatize.privatize_", "parallel.all_reduce_", "dist.all_reduce"}
        assert seen <= set(v["ops"]), v["ops"]
        assert [r["kind"] for r in v["ledger"]] == ["release"], v["ledger"]


@pytest.mark.slow
def test_bf16_sum_fails_the_replay_under_fsdp(tmp_path, monkeypatch):
    from llmdp.base import plants as plant

    name = "fsdp-llama-doc-trunc"
    spec = _spec(str(tmp_path), name)
    monkeypatch.setenv(plant.ENV, "bf16-sum")  # the spawned processes inherit it
    verdicts = _spawn([("boundary", spec, _units(spec)["boundary"], CASES[name].get("policy"))],
                      str(tmp_path))
    for k, v in verdicts.items():
        print(f"bf16-sum under fsdp, {k}: {v['text']}")
        # The rounded sums differ by C plus a rounding error: above or below C, never C.
        assert not v["ok"]
        assert any(x.startswith("(a)") for x in v["violations"]), v["text"]


@pytest.mark.parametrize("name", ["llama-seq-bk-ghost", "gpt2-bf16-user-ckpt"])
def test_a_gradient_canary_is_clipped_to_c_in_the_replay(tmp_path, name):
    """Issue 35: the gradient canaries' path (their probe, a second call of the target
    module) through the real step: the last unit of D is a canary (the audit's layout: the
    canary shard after the private units); removing it moves the noise's input by exactly C
    (float64, the replay's tolerance), and nothing else differs."""
    from llmdp.audit import canaries as cn
    from llmdp.audit import gradient as gc

    spec = _spec(str(tmp_path), name)
    n = open_store(spec.paths.store_dir).num_units
    folder = os.path.join(spec.run_dir, "audit")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    cn.write_key(os.path.join(folder, "key"), bytes(range(32)))
    gc.write_spec(folder, 3, None, n - 1, [2])  # the last unit is canary 2 of 3
    res = replay(spec, n - 1, layer_policy=CASES[name].get("policy"), expect_clipped=True)
    print(res)
    assert res.ok, str(res)
    assert abs(res.ratios[0] - 1) < 1e-3, res.ratios
    assert os.path.getsize(os.path.join(folder, gc.ITERATES)) > 0  # its projections were taken
