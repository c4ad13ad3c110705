"""The DP-SGD loop that runs on every worker, readable top to bottom.

Per logical step, on every worker in lockstep (DESIGN §1):

    keys      rank 0 draws fresh OS entropy for the sample and the noise; broadcast   [sync]
    sample    every worker expands the same key into the same Poisson sample
    share     this worker's balanced share, cut into the same number of micro-steps
    clip      forward -> per-unit normalized loss -> per-unit clipped gradient sum
    ledger    rank 0 makes the step's DP event durable (write-ahead)
    reduce    one all-reduce of the clipped sums                                      [sync]
              (scaling.strategy fsdp: one reduce-scatter; each rank gets its shard's sum)
    noise     + N(0, σ²C²I), the same vector on every replica, exactly once
              (fsdp: each shard adds its slice of it, from its own stream)
    average   ÷ q·N (the expected batch size, never the realized one)
    update    optimizer + schedule

Nothing here imports Ray: :func:`train_loop_per_worker` takes a ``context`` that the Ray
trainer (or a test) provides, so the step is runnable and testable on its own.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from llmdp import parallel
from llmdp.clipping import GhostClipper
from llmdp.data.batching import assign_micro_batches
from llmdp.losses import row_losses
from llmdp.parallel import (
    _dist_on,
    broadcast_bytes,
    broadcast_params,
)
from llmdp.privacy import chacha, sampling

# --------------------------------------------------------------------------- one step


@dataclass
class StepKeys:
    """Per-step randomness: the keys of the sample and of the noise, both derived from one
    32-byte step key through ChaCha20 (``chacha.derive_key``, domain-separated labels)."""

    sample: bytes
    noise: bytes

    @classmethod
    def from_step_key(cls, step_key: bytes) -> StepKeys:
        return cls(chacha.derive_key(step_key, b"sample"), chacha.derive_key(step_key, b"noise"))

    @classmethod
    def draw(cls, step: int, rng_mode: str, seed: int | None, device: torch.device) -> StepKeys:
        """Fresh OS entropy on rank 0, broadcast to all; or derived from the seed (seeded mode)."""
        if rng_mode == "seeded":
            # Every rank derives the same keys: reproducible, and no guarantee against anyone
            # who knows the seed (the report says so).
            return cls.from_step_key(sampling.seeded_key(int(seed), step, "step"))
        rank0 = not _dist_on() or dist.get_rank() == 0
        raw = sampling.secure_key() if rank0 else None
        return cls.from_step_key(broadcast_bytes(raw, 32, device))


@dataclass
class StepStats:
    """What a worker did in one step. Counts and losses are computed on private data:
    never published without DP (the report marks them internal)."""

    units: int = 0
    rows: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    clipped: int = 0
    micro_steps: int = 0
    nonfinite: int = 0  # units whose gradient was NaN/inf (factor 0: they added nothing)


def accumulate_clipped_sum(
    model: nn.Module,
    clipper: GhostClipper,
    store,
    micro_batches: Sequence[np.ndarray],
    device: torch.device,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] = row_losses,
    debug_check: bool = False,
    width: int | str | None = "auto",
) -> StepStats:
    """Σ_u clip(g_u) over this worker's units, left in ``p.grad`` (zeroed first), or in the
    clipper's ``grad_buffers`` when it has them (``scaling.strategy: fsdp``).

    ``micro_batches`` is this worker's list from ``assign_micro_batches``: one entry per
    micro-step, the same count on every worker; an empty entry runs on one masked padding
    row (contributing exactly zero). ``width`` as in ``UnitStore.rows``.
    """
    if clipper.grad_buffers is not None:
        # fsdp: full-size local buffers, summed over the micro-steps; reduced once per step.
        for b in clipper.grad_buffers.values():
            b.zero_()
    else:
        for p in clipper.params:
            p.grad = torch.zeros_like(p)
    stats = StepStats(micro_steps=len(micro_batches))
    for m, units in enumerate(micro_batches):
        batch = store.rows(units, width=width)
        if batch["input_ids"].shape[0] == 0:
            batch = store.pad_batch(store.rows(units, width=8 if width == "auto" else width), 1,
                                    pad_id=store.pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        losses = loss_fn(model, batch)
        if debug_check and m == 0:
            norms = check_against_reference(clipper, losses, batch["row_units"])
        else:
            norms = clipper.backward(losses, batch["row_units"])
        real = batch["row_units"] >= 0
        stats.units += len(units)
        stats.rows += int(real.sum())
        stats.tokens += int(batch["attention_mask"][real].sum())
        stats.loss_sum += float(losses.detach()[real].sum())
        finite = torch.isfinite(norms)
        stats.clipped += int((norms[finite] > clipper.max_grad_norm).sum())
        stats.nonfinite += int((~finite).sum())
    return stats


class ClippingCheckError(RuntimeError):
    """The clipping engine disagrees with the exact reference (``--debug``)."""


def check_against_reference(clipper: GhostClipper, losses: torch.Tensor, row_units) -> torch.Tensor:
    """Run the engine and the slow exact reference on the same forward pass and compare
    per-unit norms and clipped sums; stop the run on a mismatch (DESIGN §3.6)."""
    from llmdp.clipping.reference import clipped_sum, per_unit_gradients_autograd

    per_unit = per_unit_gradients_autograd(losses, clipper.params, row_units, retain_graph=True)
    ref_sums, ref_norms = clipped_sum(per_unit, clipper.max_grad_norm)
    del per_unit
    sinks = clipper.grad_buffers
    now = (lambda: [p.grad for p in clipper.params]) if sinks is None else \
        (lambda: [sinks[n] for n in clipper.param_names])
    before = [g.detach().clone() for g in now()]
    norms = clipper.backward(losses, row_units)
    rtol = 1e-6 if losses.dtype == torch.float64 else 2e-3
    worst = float((norms.double() - ref_norms.double()).abs().max() / ref_norms.double().abs().max().clamp(min=1e-30))
    if worst > rtol:
        raise ClippingCheckError(f"per-unit norms differ from the reference by {worst:.3g} (relative) > {rtol:g}")
    names = {id(p): n for n, p in clipper.model.named_parameters()}
    for p, g, b, r in zip(clipper.params, now(), before, ref_sums):
        got = (g - b).double()
        scale = r.double().abs().max().clamp(min=1e-30)
        err = float((got - r.double()).abs().max() / scale)
        if err > rtol:
            raise ClippingCheckError(
                f"clipped sum of '{names[id(p)]}' differs from the reference by {err:.3g} "
                f"(relative) > {rtol:g}"
            )
    return norms


def fixed_micro_steps(plan, max_rows_per_unit: int, world_size: int, physical_batch_size: int) -> int:
    """Micro-steps every worker runs at least, every step.

    With truncated Poisson the batch is padded up to B_max units of compute: enough
    micro-steps for ``max_batch_size`` units of ``max_rows_per_unit`` rows (the public
    bounds), so memory and step count do not depend on the realized sample. Plain
    Poisson: 0 (the count follows the sample).
    """
    if plan.sampler != "truncated-poisson":
        return 0
    per_bin = max(1, physical_batch_size // max(1, int(max_rows_per_unit)))
    per_worker = -(-int(plan.max_batch_size) // world_size)
    return -(-per_worker // per_bin)


# --------------------------------------------------------------------------- optimizer


def build_optimizer(params, optim_cfg) -> torch.optim.Optimizer:
    if optim_cfg["name"] == "adamw":
        return torch.optim.AdamW(
            params,
            lr=optim_cfg["lr"],
            betas=tuple(optim_cfg["betas"]),
            eps=optim_cfg["eps"],
            weight_decay=optim_cfg["weight_decay"],
        )
    if optim_cfg["name"] == "sgd":
        return torch.optim.SGD(
            params,
            lr=optim_cfg["lr"],
            momentum=optim_cfg["momentum"],
            weight_decay=optim_cfg["weight_decay"],
        )
    raise ValueError(f"optim.name: {optim_cfg['name']!r} is not one of ['adamw', 'sgd']")


def lr_lambda(optim_cfg, total_steps: int) -> Callable[[int], float]:
    """Linear warmup, then constant / cosine / linear decay to ``min_lr_ratio``."""
    from llmdp.config import warmup_steps_for

    warmup = warmup_steps_for(optim_cfg, total_steps)  # warmup_steps, or warmup_ratio * T
    floor = float(optim_cfg["min_lr_ratio"])
    kind = optim_cfg["schedule"]

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return f


# --------------------------------------------------------------------------- the loop


class LocalContext:
    """What the loop needs from Ray Train, for a single process without Ray (tests, debug)."""

    def __init__(self, checkpoint_dir: str | None = None):
        self.checkpoint_dir = checkpoint_dir
        self.reports: list[dict] = []

    def get_world_rank(self) -> int:
        return dist.get_rank() if _dist_on() else 0

    def get_world_size(self) -> int:
        return dist.get_world_size() if _dist_on() else 1

    def get_checkpoint_dir(self) -> str | None:
        return self.checkpoint_dir

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir and self.checkpoint_dir:
            import shutil

            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
            shutil.copytree(checkpoint_dir, self.checkpoint_dir)


def _metrics_line(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _save_state(directory: str, params_named, optimizer, scheduler, step: int, extra: dict,
                full: tuple[dict, dict] | None = None):
    """``full``: (params, optimizer state) already gathered to full tensors (fsdp)."""
    params, optim = full if full is not None else (
        {n: p.detach().cpu() for n, p in params_named}, optimizer.state_dict())
    torch.save(
        {
            "params": params,
            "optimizer": optim,
            "scheduler": scheduler.state_dict(),
            "step": step,
            **extra,
        },
        os.path.join(directory, "state.pt"),
    )


def train_loop_per_worker(config: dict[str, Any], context=None) -> dict:
    """The whole job on one worker. ``config`` is plain data built by the driver:
    ``recipe`` (the resolved recipe dict), ``plan`` (DPPlan.to_dict()), ``store_dir``,
    ``run_dir``, ``cache_dir``, ``run_id``, ``ledger_meta``. Paths are absolute."""
    from llmdp.config import recipe_from_dict
    from llmdp.data.store import open_store
    from llmdp.models import load_model
    from llmdp.privacy.plan import DPPlan

    if context is None:
        context = _ray_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    recipe, plan = config["recipe"], DPPlan.from_dict(config["plan"])
    train_cfg, optim_cfg, priv_cfg = recipe["train"], recipe["optim"], recipe["privacy"]
    torch.set_num_threads(max(1, int(recipe["scaling"]["cpus_per_worker"])))
    device = _device(recipe)

    # ---- model, optimizer, data (identical on every replica)
    torch.manual_seed(int(train_cfg["seed"]))
    model, _ = load_model(recipe_from_dict(recipe).model, cache_dir=config["cache_dir"])
    model = model.to(device)
    model.train()
    strategy = recipe["scaling"].get("strategy", "replicated")
    mixed_precision = recipe["scaling"].get("mixed_precision", "none")
    parallel.check_strategy(strategy, mixed_precision)
    if strategy == "fsdp" and priv_cfg.get("debug_check"):
        raise ValueError("privacy.debug_check compares p.grad with the reference engine on the full "
                         "model; it is not supported with scaling.strategy: 'fsdp' (use 'replicated')")
    # Every worker starts from rank 0's full weights (e.g. LoRA's random init), then fsdp
    # shards them (parameters become DTensors; optimizer and engine are built on those).
    broadcast_params([p for p in model.parameters() if p.requires_grad])  # [sync point]
    model = parallel.prepare_model(model, strategy, mixed_precision, device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # fsdp: the clipped sum accumulates in full-size local buffers (None: in p.grad).
    grad_sinks = parallel.make_grad_sinks(model, strategy)
    clipper = GhostClipper(
        model, plan.max_grad_norm, engine=priv_cfg["clipping"], mode=priv_cfg.get("clipping_mode", "auto"),
        grad_buffers=grad_sinks,
    )
    loss_fn = parallel.loss_fn_for(strategy, mixed_precision, device)  # replicated bf16: autocast
    optimizer = build_optimizer(params, optim_cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, plan.steps))
    store = open_store(config["store_dir"])
    sampler = plan.make_sampler(store.num_units)  # the sampler the plan was accounted for
    physical = int(train_cfg["physical_batch_size"])
    min_micro = fixed_micro_steps(plan, store.spec.max_rows_per_unit, world, physical)
    bucket = bool(train_cfg.get("length_bucketing", True))

    # ---- resume
    start = 0
    nonfinite_steps = 0  # steps that had a unit with a NaN/inf gradient (train.max_nonfinite_steps)
    max_nonfinite = int(train_cfg.get("max_nonfinite_steps", 10))
    ckpt_dir = context.get_checkpoint_dir()
    if ckpt_dir and os.path.exists(os.path.join(ckpt_dir, "state.pt")):
        state = torch.load(os.path.join(ckpt_dir, "state.pt"),
                           map_location="cpu" if strategy == "fsdp" else device)
        if state.get("strategy", "replicated") != strategy:
            raise ValueError(
                f"the checkpoint in {ckpt_dir} was written with scaling.strategy: "
                f"{state.get('strategy', 'replicated')!r}; resume it with the same strategy, not {strategy!r}"
            )
        if strategy == "fsdp":
            # Full (gathered) tensors, read by every rank, sharded into place. [sync point]
            parallel.load_training_state(model, optimizer, state["params"], state["optimizer"])
        else:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(state["params"][n])
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start = int(state["step"])
        nonfinite_steps = int(state.get("nonfinite_steps", 0))

    run_dir = config["run_dir"]
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    ledger = None
    spec = config.get("ledger", {})
    budgeted = bool(spec.get("admit", spec.get("budget_epsilon") is not None))
    if rank == 0:
        # The single writer of the dataset's and the run's ledgers (a Ray actor on the
        # driver, or in-process without Ray). One attempt per (re)start of the worker
        # group: re-executed steps are counted again, as they must be.
        ledger = ledger_client(config)
        ledger.start_attempt()
        _metrics_line(metrics_path, {"event": "start", "step": start, "time": time.time(), "world_size": world})

    checkpoint_every = int(train_cfg["checkpoint_every"])
    def checkpoint(done: int) -> None:
        # ray.train.report is a barrier: every worker reaches it at the same steps.
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = None
            # fsdp: gather full parameters and optimizer state to rank 0 (a collective). [sync point]
            full = parallel.gather_training_state(model, optimizer, [n for n, _ in named]) \
                if strategy == "fsdp" else None
            if rank == 0:
                _save_state(tmp, named, optimizer, scheduler, done,
                            {"run_id": config["run_id"], "ledger": ledger.position(), "strategy": strategy,
                             "nonfinite_steps": nonfinite_steps},
                            full=full)
                ckpt = tmp
            context.report({"step": done}, ckpt)

    stopped = None
    for step in range(start, plan.steps):
        t0 = time.perf_counter()
        if budgeted:
            # Budget / target: rank 0 asks the ledger service; every worker learns the answer. [sync point]
            ok, why = ledger.admit(step) if ledger is not None else (True, "")
            if broadcast_bytes(b"\x01" if ok else b"\x00", 1, device) == b"\x00":
                stopped = {"step": step, "reason": why}
                break
        keys = StepKeys.draw(step, priv_cfg["rng"], priv_cfg.get("seed"), device)
        sample, truncated = sampler.sample_with_info(keys.sample)  # secret: never logged
        # Every worker computes the same assignment from the same sample; it reads only its own rows.
        mine = assign_micro_batches(
            sample, store.unit_row_count, store.unit_max_row_length, world_size=world,
            physical_batch_size=physical, bucket=bucket, min_micro_steps=min_micro,
        )[rank]
        micro = len(mine)
        stats = accumulate_clipped_sum(
            model, clipper, store, mine, device, loss_fn=loss_fn,
            debug_check=bool(priv_cfg.get("debug_check")) and step == start,
            width="auto" if bucket else None,
        )
        if ledger is not None:
            # Write-ahead: the step's event is durable before any replica applies the update.
            # The other ranks cannot pass the all-reduce below before rank 0 reaches it.
            ledger.ensure(step)
        # replicated: all-reduce of p.grad; fsdp: reduce-scatter of the local buffers, each
        # shard noised from its own stream. [sync point] Either way: sum, noise once, ÷ q·N.
        parallel.privatize(params, None if grad_sinks is None else [grad_sinks[n] for n, _ in named],
                           keys.noise, plan.noise_multiplier, plan.max_grad_norm,
                           plan.expected_batch_size, strategy)
        _maybe_inject_fault(step, rank)
        totals = _sum_over_workers([stats.units, stats.rows, stats.tokens, stats.nonfinite], device)  # [sync point]
        nonfinite_steps += totals[3] > 0  # every worker counts the same steps
        optimizer.step()
        if strategy == "fsdp":
            optimizer.zero_grad(set_to_none=True)  # the next reduction checks for stray gradients
        scheduler.step()
        del sample, mine
        dt = time.perf_counter() - t0

        if rank == 0:
            record = {
                "step": step + 1,
                "lr": scheduler.get_last_lr()[0],
                "step_time_s": dt,
                # computed on private data without DP: internal (see the report)
                "train_loss": stats.loss_sum / stats.units if stats.units else None,
                "worker0_units": stats.units,
                "worker0_tokens": stats.tokens,
                "worker0_tokens_per_s": stats.tokens / dt if dt > 0 else None,
                "worker0_units_per_s": stats.units / dt if dt > 0 else None,
                "units": totals[0],
                "rows": totals[1],
                "tokens": totals[2],
                "tokens_per_s": totals[2] / dt if dt > 0 else None,
                "units_per_s": totals[0] / dt if dt > 0 else None,
                "tokens_per_s_per_worker": totals[2] / dt / world if dt > 0 else None,
                "units_per_s_per_worker": totals[0] / dt / world if dt > 0 else None,
                "worker0_clipped_fraction": stats.clipped / stats.units if stats.units else None,
                "micro_steps": micro,
                "sample_truncated": bool(truncated),
                "nonfinite_units": totals[3],  # internal: units whose gradient was NaN/inf
            }
            _metrics_line(metrics_path, record)

        done = step + 1 == plan.steps
        if (step + 1) % checkpoint_every == 0 or done:
            checkpoint(step + 1)
        if nonfinite_steps > max_nonfinite and not done:
            # Those units added nothing (factor 0), so every update stays DP; but a run whose
            # gradients keep overflowing is not training. Stop cleanly, with the numbers.
            stopped = {"step": step + 1, "reason": (
                f"{nonfinite_steps} steps had privacy units whose gradient was not finite "
                f"(NaN/inf; they contributed nothing), more than train.max_nonfinite_steps="
                f"{max_nonfinite}. Lower optim.lr, train in float32 (model.dtype), or raise "
                "train.max_nonfinite_steps.")}
            break

    if stopped is not None:
        # Stopped by the budget before step `stopped["step"]`: save what was trained (every
        # update so far is in the ledger), unless that state was just checkpointed.
        if stopped["step"] % checkpoint_every != 0 and stopped["step"] > start:
            checkpoint(stopped["step"])
        full = parallel.full_model_state(model, strategy)  # fsdp: gathered to rank 0 [sync point]
        if rank == 0:
            _save_final_model(model, config, state_dict=full)
            _metrics_line(metrics_path, {"event": "stopped", "step": stopped["step"],
                                         "reason": stopped["reason"], "time": time.time()})
        return {"steps": stopped["step"], "stopped": stopped["reason"]}
    full = parallel.full_model_state(model, strategy)  # fsdp: gathered to rank 0 [sync point]
    if rank == 0:
        _save_final_model(model, config, state_dict=full)
        _metrics_line(metrics_path, {"event": "end", "step": plan.steps, "time": time.time()})
    return {"steps": plan.steps}


def _sum_over_workers(values: list[int], device: torch.device) -> list[int]:
    """Sum small integer counters over workers (one tiny all-reduce). [sync point]"""
    if not _dist_on():
        return [int(v) for v in values]
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [int(v) for v in t.tolist()]


def _maybe_inject_fault(step: int, rank: int) -> None:
    """Test hook: ``LLMDP_FAULT=step=K,rank=R,marker=PATH`` makes worker R raise once at
    0-based step K (after the ledger write, before the update), as a lost node would."""
    spec = os.environ.get("LLMDP_FAULT")
    if not spec:
        return
    f = dict(item.split("=", 1) for item in spec.split(","))
    if int(f["step"]) == step and int(f.get("rank", 0)) == rank and not os.path.exists(f["marker"]):
        with open(f["marker"], "w") as fh:
            fh.write(f"failed at step {step} on rank {rank}\n")
        raise RuntimeError(f"injected fault at step {step} on rank {rank} (LLMDP_FAULT)")


class _ActorLedger:
    """The ledger service's methods, called on its Ray actor (blocking: write-ahead)."""

    def __init__(self, name: str):
        import ray

        self._ray, self._actor = ray, ray.get_actor(name)

    def __getattr__(self, method):
        remote = getattr(self._actor, method)
        return lambda *a, **k: self._ray.get(remote.remote(*a, **k))


def ledger_client(config: dict):
    """The run's ledger service: the named Ray actor if the driver made one, else in-process."""
    from llmdp.privacy.service import LedgerService

    spec = config["ledger"]
    if spec.get("actor"):
        return _ActorLedger(spec["actor"])
    return LedgerService(**spec["service"])


def _device(recipe) -> torch.device:
    if recipe["scaling"]["use_gpu"] and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local)
    return torch.device("cpu")


def _save_final_model(model: nn.Module, config: dict, state_dict: dict | None = None) -> None:
    """``state_dict``: the full (gathered) state of a sharded model (fsdp), saved through
    the model's own ``save_pretrained``."""
    out = os.path.join(config["run_dir"], "model")
    os.makedirs(out, exist_ok=True)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(out, safe_serialization=True, **extra)
    tok_dir = config.get("tokenizer_dir")
    if tok_dir:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)


class _RayContext:
    """Adapter from Ray Train v2's API to the few calls the loop makes."""

    def __init__(self):
        import ray.train

        self._train = ray.train
        self._ctx = ray.train.get_context()
        self._ckpt = ray.train.get_checkpoint()
        self._ckpt_dir = None

    def get_world_rank(self) -> int:
        return self._ctx.get_world_rank()

    def get_world_size(self) -> int:
        return self._ctx.get_world_size()

    def get_checkpoint_dir(self) -> str | None:
        if self._ckpt is None:
            return None
        if self._ckpt_dir is None:
            # A fresh folder per worker: with Ray's default (shared per node) folder, a second
            # worker on the node can find it already created and read a state.pt that the
            # first is still copying (seen as a torch.load unpickling error on resume).
            self._ckpt_dir = self._ckpt.to_directory(
                tempfile.mkdtemp(prefix=f"llmdp-ckpt-rank{self.get_world_rank()}-"))
        return self._ckpt_dir

    def report(self, metrics: dict, checkpoint_dir: str | None) -> None:
        from ray.train import Checkpoint

        ckpt = Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        self._train.report(metrics, checkpoint=ckpt)


def _ray_context():
    return _RayContext()
