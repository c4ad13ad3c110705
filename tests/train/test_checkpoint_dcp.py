"""Sharded fsdp checkpoints (torch.distributed.checkpoint) and the streamed final model.

One pair of spawned gloo processes runs every scenario once and leaves its results in
files; rank 0 also runs the world-size-1 parts, in process groups of its own, before and
after the pair's. The tests below read the files.

- the round trip: what every rank wrote (no gather) loads, into a differently initialized
  model, as exactly the saved parameters and optimizer state (and so does fsdp's full
  ``state.pt`` of before);
- resuming on another world size: 4 seeded steps (one key scope for all: `_proc`) with a
  checkpoint at step 2, on 2 workers and on 1; each resumed from the other's step-2
  checkpoint; all four final models agree
  (the noise is keyed per coordinate, the sample per step: only float summation order
  differs, float64);
- the streamed final model (tensor by tensor, bounded shards + index) equals exactly what
  ``save_pretrained`` writes for the same weights unsharded (and the gathered save's values),
  and loads with ``from_pretrained``;
- ``llmdp export``'s verification reads the sharded checkpoint, and fails on a tampered shard.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from llmdp.clipping import GhostClipper
from llmdp.record import checkpoints
from llmdp.train import parallel
from llmdp.train import save as hf_save
from llmdp.train.loop import LocalContext
from llmdp.train.strategy import Fsdp, Replicated
from tests.helpers import start_processes, tiny_llama, tiny_store
from tests.train.test_parallel import S1, full, model64, one_step, step_

WORLD = 2
STEPS, KEEP = 4, 2  # the runs' steps; the checkpoint every resumed run starts from


def _recipe(tmp, name, *, rng="seeded", steps=STEPS, every=KEEP, **privacy):
    from llmdp.config.schema import recipe_from_dict
    from tests.helpers import tiny_tokenizer_dir, write_notes

    data = os.path.join(tmp, "notes.jsonl")
    if not os.path.exists(data):
        write_notes(data, 30)
    return recipe_from_dict({
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(), "dtype": "float64",
                  "tiny": {"hidden_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": data, "sequence_length": 24},
        # Seeded: both world sizes draw the same samples and noise (not a DP release to
        # publish: the export test uses its own secure run).
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4, "rng": rng,
                    **({"seed": 7} if rng == "seeded" else {}), **privacy},
        "optim": {"name": "adamw", "lr": 2e-2, "schedule": "cosine", "warmup_steps": 1},
        "train": {"expected_batch_size": 8, "steps": steps, "physical_batch_size": 2,
                  "checkpoint_every": every},
        "scaling": {"num_workers": WORLD, "strategy": "fsdp"},
        "output": {"dir": os.path.join(tmp, "runs"), "name": name},
    })


def _ckpt(spec) -> str:
    """Where Ray Train would put the run's checkpoint (RunDir and export find it there)."""
    return os.path.join(spec.run_dir, "checkpoints", "checkpoint_000000")


class KeepingContext(LocalContext):
    """A LocalContext that also keeps a copy of the checkpoint reported at step ``keep_at``."""

    def __init__(self, checkpoint_dir, keep_at, keep_dir):
        super().__init__(checkpoint_dir)
        self.keep_at, self.keep_dir = keep_at, keep_dir

    def report(self, metrics, checkpoint_dir):
        super().report(metrics, checkpoint_dir)  # [sync point] the ranks' folders merged
        if metrics["step"] == self.keep_at and parallel.world()[0] == 0:
            shutil.copytree(self.checkpoint_dir, self.keep_dir)
        parallel.barrier()


def _train(spec, ckpt, keep_dir=None, start_from=None):
    from llmdp.train.loop import train_loop_per_worker

    if start_from is not None and parallel.world()[0] == 0:
        shutil.copytree(start_from, ckpt)  # the other world size's step-KEEP checkpoint
    parallel.barrier()
    ctx = KeepingContext(ckpt, KEEP, keep_dir) if keep_dir else LocalContext(ckpt)
    return train_loop_per_worker(spec, ctx)


def _ctrl_c_before(spec, step: int) -> None:
    """The driver's first Ctrl-C (its stop request) lands before step ``step`` (rank 0's
    hook, in this spawned process), or, with ``step`` None, the hook is the real one again."""
    from llmdp.record.rundir import STOP_REQUEST
    from llmdp.train import loop, testhooks

    stop = os.path.join(spec.run_dir, STOP_REQUEST)
    if step is None:
        # rank 0 alone removes it, as the one driver does when it ends (both ranks of the
        # pair call this: an exists-then-remove in each raced, and the slower one's remove
        # found the file gone)
        if parallel.world()[0] == 0 and os.path.exists(stop):
            os.remove(stop)
        loop.maybe_wait_for_ctrl_c = testhooks.maybe_wait_for_ctrl_c
        return

    def request(run, at):
        if at == str(step) and run.rank == 0:
            with open(stop, "w") as f:
                f.write("ctrl-c\n")

    loop.maybe_wait_for_ctrl_c = request


def _group(rank, world, port, fn):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


def _ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while they are chosen)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc(rank, ports, runs, store_dir, out):
    from llmdp.train import loop

    torch.set_num_threads(1)
    # Every run and attempt here keys its seeded draws alike, so that the world sizes and the
    # resumed runs compare with one another: a real seeded run keys them by its run id and
    # attempt (`loop.seeded_scope`, issue 49 item 6), and its resumed attempts draw anew.
    loop.seeded_scope = lambda run: setattr(run, "key_scope", ("same", "1"))
    res = {}
    if rank == 0:  # world size 1 first: the uninterrupted run, keeping its step-2 checkpoint
        _group(0, 1, ports[0], lambda: _train(runs["w1"], _ckpt(runs["w1"]), keep_dir=os.path.join(out, "w1_at2")))

    def pair():
        res["round_trip"] = _round_trip(rank, store_dir, out)
        res["streamed"] = _final_models(rank, out)
        _train(runs["w2"], _ckpt(runs["w2"]), keep_dir=os.path.join(out, "w2_at2"))
        _train(runs["w2_from_w1"], _ckpt(runs["w2_from_w1"]), start_from=os.path.join(out, "w1_at2"))
        _train(runs["export"], _ckpt(runs["export"]))
        # banded MF: uninterrupted, and stopped by Ctrl-C mid-round (before step 3)
        _train(runs["mf_w2"], _ckpt(runs["mf_w2"]))
        _ctrl_c_before(runs["mf_split"], 3)
        res["mf_stopped"] = _train(runs["mf_split"], _ckpt(runs["mf_split"]))
        _ctrl_c_before(runs["mf_split"], None)

    _group(rank, WORLD, ports[1], pair)
    if rank == 0:  # world size 1 again: resume the pair's step-2 checkpoint
        _group(0, 1, ports[2], lambda: _train(runs["w1_from_w2"], _ckpt(runs["w1_from_w2"]),
                                              start_from=os.path.join(out, "w2_at2")))
        # ... and the stopped banded run: its stream's shards resharded onto one worker
        _group(0, 1, ports[3], lambda: _train(runs["mf_split"], _ckpt(runs["mf_split"])))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def _shards_and_state(clipper, opt):
    """This rank's local shards of the parameters and optimizer state, cloned."""
    out = {}
    for n, p in zip(clipper.param_names, clipper.params):
        out[n] = p.detach().to_local().clone()
        for k, v in opt.state[p].items():
            out[f"{n}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def _round_trip(rank, store_dir, out):
    """Save (every rank its own folder, as under Ray), merge the folders, load into a
    differently initialized model and optimizer."""
    from llmdp.data.store import open_store

    store = open_store(store_dir)
    model, clipper, opt, _ = one_step(store, S1, "fsdp", world=WORLD, rank=rank, sigma=0.5,
                                      optimizer="adamw")
    opt.zero_grad(set_to_none=True)
    names = clipper.param_names
    mine = os.path.join(out, "rt", f"rank{rank}")
    os.makedirs(mine)
    meta = {"step": 1, "scheduler": {}, "run_id": "rt", "ledger": None, "nonfinite_steps": 0}
    assert Fsdp().save_checkpoint(model, opt, names, mine, meta)
    merged = os.path.join(out, "rt", "merged")
    parallel.barrier()
    if rank == 0:
        for r in range(WORLD):
            shutil.copytree(os.path.join(out, "rt", f"rank{r}"), merged, dirs_exist_ok=True)
    parallel.barrier()
    saved = _shards_and_state(clipper, opt)
    gathered, gathered_optim = parallel.gather_training_state(model, opt, names)  # the reference

    other = Fsdp("none", "cpu").prepare_model(model64(seed=1))
    oc = GhostClipper(other, 0.05, grad_buffers=Fsdp().grad_sinks(other))
    oopt = torch.optim.AdamW(oc.params, lr=1e-2, weight_decay=0.1)
    differs_before = any(not torch.equal(a.to_local(), b.to_local()) for a, b in zip(clipper.params, oc.params))
    got_meta = Fsdp().load_checkpoint(other, oopt, oc.param_names, merged)
    loaded = _shards_and_state(oc, oopt)
    regathered, regathered_optim = parallel.gather_training_state(other, oopt, names)
    # fsdp's full format from before (rank 0's state.pt of gathered tensors) still loads.
    legacy = os.path.join(out, "rt", "legacy")
    if rank == 0:
        os.makedirs(legacy)
        checkpoints.write_full(legacy, gathered, gathered_optim, {**meta, "strategy": "fsdp"})
    parallel.barrier()
    third = Fsdp("none", "cpu").prepare_model(model64(seed=2))
    tc = GhostClipper(third, 0.05, grad_buffers=Fsdp().grad_sinks(third))
    topt = torch.optim.AdamW(tc.params, lr=1e-2, weight_decay=0.1)
    legacy_meta = Fsdp().load_checkpoint(third, topt, tc.param_names, legacy)
    legacy_loaded = _shards_and_state(tc, topt)
    # One more identical step on both: identical parameters.
    for m, c, o in ((model, clipper, opt), (other, oc, oopt)):
        step_(m, c, o, store, S1, "fsdp", WORLD, rank, 0.5, b"2" * 32, 9.0)
    next_equal = all(torch.equal(full(a), full(b)) for a, b in zip(clipper.params, oc.params))
    return {"saved": saved, "loaded": loaded, "differs_before": differs_before, "meta": got_meta,
            "files": sorted(os.listdir(mine)), "gathered": (gathered, gathered_optim),
            "regathered": (regathered, regathered_optim), "next_equal": next_equal,
            "legacy_loaded": legacy_loaded, "legacy_format": legacy_meta["format"]}


def _final_models(rank, out):
    """The streamed save (bounded shards) and the gathered save_pretrained of the same
    sharded models: an untied float64 Llama and a tied-embedding one."""
    plans = {}
    for name, build in (("untied", lambda: tiny_llama(vocab_size=301, dtype=torch.float64, seed=3)),
                        ("tied", lambda: tiny_llama(vocab_size=301, tie_word_embeddings=True, seed=4))):
        if rank == 0:  # the reference: the same weights, unsharded, saved by save_pretrained
            build().save_pretrained(os.path.join(out, "plain", name))
        model = Fsdp("none", "cpu").prepare_model(build())
        plan = hf_save.save_plan(model)
        plans[name] = plan
        hf_save.save_streaming(model, os.path.join(out, "streamed", name), plan, rank=rank,
                               max_shard_bytes=20_000)
        full_sd = parallel.gather_model_state(model)
        if rank == 0:
            model.save_pretrained(os.path.join(out, "gathered", name), state_dict=full_sd)
        # Through the strategy (default bound: one file), as the worker saves.
        Fsdp().save_model(model, os.path.join(out, "strategy", name))
        parallel.barrier()
    return plans


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from llmdp.run.launch import prepare

    tmp = str(tmp_path_factory.mktemp("dcp"))
    specs = {name: prepare(_recipe(tmp, name), log=lambda *a: None)
             for name in ("w1", "w2", "w2_from_w1", "w1_from_w2")}
    specs["export"] = prepare(_recipe(tmp, "export", rng="secure", steps=2), log=lambda *a: None)
    store = tiny_store(os.path.join(tmp, "store"), num_documents=40, sequence_length=24)
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    for name in ("mf_w2", "mf_split"):
        specs[name] = prepare(_recipe(tmp, name, mechanism="banded-mf", sampler="cyclic-poisson",
                                      bands=2), log=lambda *a: None)
    old = os.umask(0o002)  # a permissive umask: the workers' checkpoints stay owner-only
    try:
        start_processes(_proc, (_ports(4), specs, store.path, out), WORLD)
    finally:
        os.umask(old)
    res = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)]
    return {"specs": specs, "out": out, "res": res}


# --------------------------------------------------------------------------- round trip


def test_sharded_round_trip_restores_params_and_optimizer_state(runs):
    for r in range(WORLD):
        rt = runs["res"][r]["round_trip"]
        assert rt["differs_before"] and rt["next_equal"], r
        # Each rank wrote only its own shards; rank 0 also the index and state.json.
        want = ({".metadata", "__0_0.distcp", checkpoints.META} if r == 0 else {f"__{r}_0.distcp"})
        assert set(rt["files"]) == want, (r, rt["files"])
        assert set(rt["saved"]) == set(rt["loaded"]) and any("/exp_avg_sq" in k for k in rt["saved"])
        for k, v in rt["saved"].items():
            assert torch.equal(rt["loaded"][k], v), (r, k)
        assert rt["meta"]["step"] == 1 and rt["meta"]["strategy"] == "fsdp"
        assert rt["legacy_format"] == "full" and set(rt["legacy_loaded"]) == set(rt["saved"])
        assert all(torch.equal(rt["legacy_loaded"][k], v) for k, v in rt["saved"].items()), r
    # The same, as full tensors: the gathered state before saving and after loading.
    params, optim = runs["res"][0]["round_trip"]["gathered"]
    params2, optim2 = runs["res"][0]["round_trip"]["regathered"]
    assert set(params) == set(params2) and params
    assert all(torch.equal(params[n], params2[n]) for n in params)
    assert set(optim["state"]) == set(optim2["state"]) == set(params)
    for n, st in optim["state"].items():
        assert set(st) == set(optim2["state"][n]) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(st[k], optim2["state"][n][k]) for k in st), n


def test_the_sharded_checkpoint_reads_without_a_process_group(runs):
    """One tensor at a time, assembled from both ranks' files: the gathered reference."""
    params, _ = runs["res"][0]["round_trip"]["gathered"]
    folder = os.path.join(runs["out"], "rt", "merged")
    got = dict(checkpoints.trainable_params(folder))
    assert set(got) == set(params)
    for n, t in params.items():
        assert got[n].dtype == t.dtype == torch.float64 and torch.equal(got[n], t), n


def test_a_strategy_change_is_refused_with_the_checkpoint_named(runs):
    folder = os.path.join(runs["out"], "rt", "merged")
    model = Replicated().prepare_model(model64())
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="written with scaling.strategy: 'fsdp'; resume it with the same "
                                         "strategy, not 'replicated'"):
        Replicated().load_checkpoint(model, opt, [], folder)


# --------------------------------------------------------------------------- world sizes


def _final(spec) -> dict[str, torch.Tensor]:
    meta = checkpoints.read_meta(_ckpt(spec))
    assert meta["step"] == STEPS and meta["format"] == checkpoints.SHARDED
    return dict(checkpoints.trainable_params(_ckpt(spec)))


def _starts(spec) -> list[tuple[int, int]]:
    with open(os.path.join(spec.run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    return [(x["step"], x["world_size"]) for x in lines if x.get("event") == "start"]


def _rel_err(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)


def test_resume_on_another_world_size_gives_the_uninterrupted_model(runs):
    s = runs["specs"]
    assert _starts(s["w2"]) == [(0, 2)] and _starts(s["w1"]) == [(0, 1)]
    assert _starts(s["w1_from_w2"]) == [(KEEP, 1)] and _starts(s["w2_from_w1"]) == [(KEEP, 2)]
    w2, w1 = _final(s["w2"]), _final(s["w1"])
    w1_from_w2, w2_from_w1 = _final(s["w1_from_w2"]), _final(s["w2_from_w1"])
    # Not vacuous: training moved the parameters well beyond the tolerance.
    at2 = dict(checkpoints.trainable_params(os.path.join(runs["out"], "w2_at2")))
    assert _rel_err(at2, w2) > 1e-3
    assert _rel_err(w1, w2) < 1e-9  # world size changes float summation order only (float64)
    assert _rel_err(w1_from_w2, w2) < 1e-9
    assert _rel_err(w2_from_w1, w1) < 1e-9
    # The saved final model is the final checkpoint.
    from safetensors.torch import load_file

    saved = load_file(os.path.join(s["w1_from_w2"].run_dir, "model", "model.safetensors"))
    assert all(torch.equal(saved[n], t) for n, t in w1_from_w2.items())


def test_banded_mf_resumed_after_ctrl_c_on_another_world_size_continues_its_noise(runs):
    """The stream's state is in the sharded checkpoint, placed like the parameters: a run
    stopped gracefully mid-round on 2 workers and resumed on 1 continues the same
    mechanism (DCP reshards the state) and ends with the uninterrupted 2-worker model."""
    s = runs["specs"]
    assert runs["res"][0]["mf_stopped"] == {"steps": 3, "interrupted": True}
    with open(os.path.join(s["mf_split"].run_dir, "metrics.jsonl")) as f:
        seg = [json.loads(x) for x in f if '"noise_segment"' in x]
    assert [(x["step"], x["continued"], x["row"]) for x in seg] == [(3, True, 3)]
    assert _starts(s["mf_split"]) == [(0, 2), (3, 1)]
    split, whole = _final(s["mf_split"]), _final(s["mf_w2"])
    # a new segment (or a state lost in the reshard) moves every coordinate by its noise
    assert _rel_err(split, whole) < 1e-9
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(_ckpt(s["mf_split"])).read_metadata()
    noise = {k: v.size for k, v in md.state_dict_metadata.items() if k.startswith("noise.")}
    params = dict(checkpoints.trainable_params(_ckpt(s["mf_split"])))
    # bands 2: one buffer per parameter, of the parameter's global shape
    assert {k.removeprefix("noise.") for k in noise} == {f"{n}#0" for n in params}
    assert all(tuple(noise[f"noise.{n}#0"]) == tuple(p.shape) for n, p in params.items())


def test_run_dir_reads_the_sharded_checkpoint_step(runs):
    from llmdp.record.rundir import RunDir

    rd = RunDir(runs["specs"]["w2"].run_dir)
    assert rd.latest_checkpoint() == _ckpt(runs["specs"]["w2"])
    assert rd.checkpoint_step() == STEPS


# --------------------------------------------------------------------------- the final model


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_streamed_final_model_equals_the_gathered_one_and_loads(runs, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    streamed = os.path.join(runs["out"], "streamed", name)
    plain = os.path.join(runs["out"], "plain", name)
    assert runs["res"][0]["streamed"][name] == runs["res"][1]["streamed"][name]  # one plan
    ref = load_file(os.path.join(plain, "model.safetensors"))
    index = json.load(open(os.path.join(streamed, hf_save.INDEX)))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not os.path.exists(os.path.join(streamed, hf_save.WEIGHTS))
    got = {}
    for f in files:
        part = load_file(os.path.join(streamed, f))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 20_000 or len(part) == 1
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert set(got) == set(ref) == set(index["weight_map"])
    assert ("lm_head.weight" in ref) == (name == "untied")  # a tied head is saved once, as HF does
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    # The gathered save (the path it replaces) holds the same values; it writes a tied head
    # twice (its full state dict does not share storage), which the unsharded save does not.
    gathered = os.path.join(runs["out"], "gathered", name)
    old = load_file(os.path.join(gathered, "model.safetensors"))
    assert set(old) - set(ref) == ({"lm_head.weight"} if name == "tied" else set())
    assert all(torch.equal(old[k], t) for k, t in ref.items())
    for cfg in ("config.json", "generation_config.json"):
        want = json.load(open(os.path.join(plain, cfg)))
        assert json.load(open(os.path.join(streamed, cfg))) == want
        assert json.load(open(os.path.join(gathered, cfg))) == want
    loaded = AutoModelForCausalLM.from_pretrained(streamed)
    sd = loaded.state_dict()
    for k, t in ref.items():
        assert torch.equal(sd[k], t), k
    if name == "tied":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # The strategy's save (one file under the default bound) is the same model.
    one = load_file(os.path.join(runs["out"], "strategy", name, "model.safetensors"))
    assert set(one) == set(ref) and all(torch.equal(one[k], t) for k, t in ref.items())


def test_shard_groups_are_bounded_and_in_order():
    assert hf_save.shard_groups([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert hf_save.shard_groups([3], 1) == [[0]]
    assert hf_save.shard_names(1) == ["model.safetensors"]
    assert hf_save.shard_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


# --------------------------------------------------------------------------- export


def test_export_verifies_a_sharded_checkpoint_and_catches_a_tampered_shard(runs):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from llmdp._fs import too_open
    from llmdp.hub.export import verify_run
    from llmdp.report.build import write_report

    spec = runs["specs"]["export"]
    write_report(spec.run_dir)
    problems, report = verify_run(spec.run_dir)
    assert problems == [] and report["status"] == "complete"
    # the sharded checkpoint (every rank's shards, the index) is owner-only (issue 37)
    assert too_open(_ckpt(spec)) == [] and any(f.endswith(".distcp") for f in os.listdir(_ckpt(spec)))
    # Flip bytes in the middle of rank 1's piece of the embedding (an 8-byte float64 each).
    folder = _ckpt(spec)
    md = FileSystemReader(folder).read_metadata()
    key = "model.model.embed_tokens.weight"
    chunk = md.state_dict_metadata[key].chunks[1]
    info = md.storage_data[MetadataIndex(key, chunk.offsets)]
    assert info.relative_path == "__1_0.distcp"
    path = os.path.join(folder, info.relative_path)
    original = open(path, "rb").read()
    at = info.offset + info.length // 2
    tampered = bytearray(original)
    tampered[at:at + 8] = bytes(b ^ 0x5A for b in tampered[at:at + 8])
    try:
        with open(path, "wb") as f:
            f.write(tampered)
        problems, _ = verify_run(spec.run_dir)
    finally:
        with open(path, "wb") as f:
            f.write(original)
    assert len(problems) == 1, problems
    assert ("'model.embed_tokens.weight' differs from the last checkpoint's" in problems[0]
            or "the last checkpoint cannot be read" in problems[0]), problems
    assert verify_run(spec.run_dir)[0] == []
