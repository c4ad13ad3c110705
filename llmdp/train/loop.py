"""The DP-SGD loop that runs on every worker, readable top to bottom:
:func:`train_loop_per_worker` = :func:`setup` (model, strategy, engine, optimizer, data) ->
:func:`resume` (the checkpoint Ray Train restored) -> :func:`open_ledger` (rank 0) ->
:func:`choose_segment` (a correlated mechanism's noise) -> for
each remaining step: :func:`admitted` (budget) -> :func:`dp_step` -> :func:`checkpoint`
-> :func:`finish` (the final model).

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

The clipped sum is ``llmdp.train.step``'s; the reduction and the noise are the strategy's
(``llmdp.train.strategy``). Nothing here imports Ray: :func:`train_loop_per_worker` takes a ``context`` that the Ray
trainer (or a test) provides, so the step is runnable and testable on its own.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmdp._fs import StorageError, check_free, disk_errors, private_files
from llmdp.base.localray import WORKER_ENV
from llmdp.base.losses import row_eval_stats
from llmdp.clipping import GhostClipper
from llmdp.config.schema import OptimConfig, lr_lambda
from llmdp.data.batching import assign_micro_batches
from llmdp.data.store import open_store
from llmdp.evaluation import loop as evaluation
from llmdp.privacy.sampling import store_groups
from llmdp.record import checkpoints
from llmdp.record.baseline import NON_PRIVATE
from llmdp.record.provenance import write_provenance
from llmdp.record.rundir import STOP_REQUEST
from llmdp.record.spec import RunPaths, RunSpec
from llmdp.train import parallel
from llmdp.train.contexts import LocalContext, RayContext  # noqa: F401 (LocalContext: re-exported)
from llmdp.train.correlated import StepNoise, bound_stream, may_continue
from llmdp.train.explog import NO_LOG, open_log
from llmdp.train.models import load_model
from llmdp.train.optimizers import DPAdamBC, noise_variance
from llmdp.train.parallel import broadcast_bytes
from llmdp.train.step import StepKeys, accumulate_clipped_sum, fixed_micro_steps
from llmdp.train.strategy import Replicated, Strategy, strategy_for
from llmdp.train.testhooks import maybe_inject_fault, maybe_wait_for_ctrl_c

# --------------------------------------------------------------------------- optimizer


def build_optimizer(params, optim: OptimConfig, noise_var: float = 0.0) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``params``; ``noise_var``: Φ = (σC/B)², the per-coordinate
    variance of the privatized gradient's noise (from the plan: public), which DP-AdamBC
    removes from its second moment (``llmdp.train.optimizers``)."""
    if optim.name == "dp-adambc":
        return DPAdamBC(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                        noise_var=noise_var, floor=optim.adambc_floor)
    if optim.name == "adamw":
        return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                 weight_decay=optim.weight_decay)
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum,
                               weight_decay=optim.weight_decay)
    raise ValueError(f"optim.name: {optim.name!r} is not one of ['adamw', 'sgd', 'dp-adambc']")


# --------------------------------------------------------------------------- the loop


def _label(spec: RunSpec) -> dict:
    """What marks a NON-PRIVATE baseline's metrics records (nothing for a DP run)."""
    return {} if spec.dp else {"privacy": NON_PRIVATE}


def _metrics_line(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class Training:
    """One worker's run: what :func:`setup` built, and where the loop stands."""

    spec: RunSpec
    context: Any
    rank: int
    world: int
    device: torch.device
    strategy: Strategy
    model: nn.Module
    names: list[str]  # trainable parameters, aligned with clipper.params
    clipper: GhostClipper
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    scheduler: Any
    store: Any
    sampler: Any
    min_micro_steps: int
    start: int = 0  # the first step this launch runs
    nonfinite_steps: int = 0  # steps that had a unit with a NaN/inf gradient (internal)
    nonfinite_warned: bool = False
    ledger: Any = None  # rank 0: the ledger service (the single writer)
    attempt: str | None = None  # rank 0: the ledger service's id of this attempt
    key_scope: tuple[str, str] | None = None  # seeded runs: (run id, attempt), every rank
    eval_store: Any = None  # the held-out units (None: no evaluation)
    eval_fn: Callable | None = None  # per-row evaluation statistics, in the run's precision
    tokenizer: Any = None
    # a correlated mechanism's noise stream on this worker (llmdp.train.correlated), else None
    noise: StepNoise | None = None
    restored: dict | None = None  # the meta of the checkpoint this launch resumed (None: none)
    # an audit with gradient canaries (llmdp.audit.gradient): (folder, canaries, module)
    canaries: tuple | None = None
    explog: Any = NO_LOG  # rank 0: logging.backend's experiment log (llmdp.train.explog)

    @property
    def sinks(self) -> list[torch.Tensor] | None:
        b = self.clipper.grad_buffers
        return None if b is None else [b[n] for n in self.names]


def setup(spec: RunSpec, context) -> Training:
    """Model, strategy, engine, optimizer, data: identical on every replica."""
    cfg, plan = spec.cfg, spec.plan
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    device = _device(cfg.scaling.use_gpu)
    strategy = strategy_for(cfg.scaling.strategy, cfg.scaling.mixed_precision, device)
    strategy.check(cfg.privacy)
    torch.manual_seed(int(cfg.train.seed))
    model, tokenizer = load_model(cfg.model, cache_dir=spec.paths.model_cache)
    model.train()
    # Every worker starts from rank 0's full weights (e.g. LoRA's random init), then fsdp
    # shards them (parameters become DTensors; optimizer and engine are built on those).
    model = strategy.prepare_model(model)  # [sync point]
    # clip_bound: C, or inf for a NON-PRIVATE baseline (every factor 1: nothing is clipped)
    clipper = GhostClipper(model, plan.clip_bound, engine=cfg.privacy.clipping,
                           mode=cfg.privacy.clipping_mode, grad_buffers=strategy.grad_sinks(model))
    optimizer = build_optimizer(clipper.params, cfg.optim, noise_variance(
        plan.noise_multiplier, plan.max_grad_norm, plan.expected_batch_size) if spec.dp else 0.0)
    store = open_store(spec.paths.store_dir)
    run = Training(
        spec=spec, context=context, rank=rank, world=world, device=device, strategy=strategy,
        model=model, names=list(clipper.param_names), clipper=clipper,
        loss_fn=strategy.loss_fn(),  # replicated bf16: autocast
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, plan.steps)),
        store=store,
        # the sampler the plan was accounted for (cyclic: each unit's group, from its content)
        sampler=plan.make_sampler(store.num_units, groups=store_groups(store, plan.cycle)
                                  if plan.correlated else None),
        noise=(bound_stream(plan.factorization(), strategy, clipper.params, device)
               if plan.correlated and plan.dp else None),
        min_micro_steps=fixed_micro_steps(plan, store.spec.max_rows_per_unit, world,
                                          cfg.train.physical_batch_size),
        eval_store=open_store(spec.paths.eval_store_dir) if spec.paths.eval_store_dir else None,
        eval_fn=strategy.loss_fn(row_eval_stats),
        tokenizer=tokenizer,
    )
    _gradient_canaries(run)
    return run


def _gradient_canaries(run: Training) -> None:
    """An audit run with gradient canaries (``llmdp audit --canary-kind gradient``: its
    audit/ folder holds gradient.json): every canary row's loss becomes its probe, and rank 0
    keeps each step's projections (``llmdp.audit.gradient``)."""
    from llmdp.audit import gradient as gc

    folder = os.path.join(run.spec.run_dir, "audit")
    if not os.path.exists(os.path.join(folder, gc.SPEC)):
        return
    from llmdp.audit.canaries import read_key

    can = gc.load(folder, run.model, read_key(os.path.join(folder, "key")))
    module = run.model.get_submodule(can.target)
    if hasattr(module.weight, "full_tensor") or not run.spec.dp:
        # (``llmdp audit`` refuses this first; a sharded update is never projected partly)
        raise ValueError("gradient canaries need a DP run with unsharded parameters; audit "
                         "with scaling.strategy=replicated")
    run.loss_fn = gc.probe_loss(run.loss_fn, module, can, run.spec.plan.max_grad_norm)
    run.canaries = (folder, can, module)


def _record_canaries(run: Training, step: int) -> None:
    """Rank 0, after the noise: the noisy update's projection on every canary direction."""
    from llmdp.audit import gradient as gc

    folder, can, module = run.canaries
    bias = module.bias.grad if can.bias else None
    gc.record_iterate(folder, step, gc.projections(can, module.weight.grad, bias,
                                                   run.spec.plan.expected_batch_size,
                                                   run.spec.plan.max_grad_norm,
                                                   run.spec.plan.noise_multiplier))


def resume(run: Training) -> None:
    """Load the checkpoint Ray Train restored, if any (either format, ``llmdp.record.checkpoints``;
    a sharded one written on any number of workers). [sync point under fsdp]"""
    ckpt_dir = run.context.get_checkpoint_dir()
    if not ckpt_dir or checkpoints.state_file(ckpt_dir) is None:
        return
    # Rank 0 reads it whole against its manifest, unless the driver did just before this
    # launch (`llmdp.run.restore`); a checkpoint registered during this launch (restored by
    # a worker group's restart) is read here. [sync point]
    damaged = b""
    if run.rank == 0 and os.path.basename(os.path.normpath(ckpt_dir)) != run.spec.verified_checkpoint:
        damaged = (checkpoints.verify(ckpt_dir) or "").encode()[:4000]
    damaged = broadcast_bytes(damaged.ljust(4000, b"\0") if run.rank == 0 else None, 4000,
                              run.device).rstrip(b"\0").decode(errors="replace")
    if damaged:
        raise checkpoints.CheckpointError(
            f"the checkpoint to resume from ({ckpt_dir}) is damaged: {damaged}. Re-run the same "
            f"command: the launch falls back to the newest intact checkpoint (the damaged one is "
            f"kept, set aside)")
    state = run.strategy.load_checkpoint(run.model, run.optimizer, run.names, ckpt_dir,
                                         noise=run.noise.stream if run.noise is not None else None)
    run.scheduler.load_state_dict(state["scheduler"])
    run.start = int(state["step"])
    run.nonfinite_steps = int(state.get("nonfinite_steps", 0))
    run.restored = state


def choose_segment(run: Training) -> None:
    """A correlated mechanism resumed: continue the restored segment bit for bit when rank 0's
    ledger proves that no row after the checkpoint was released, else start a new one
    (``llmdp.train.correlated``). Every worker learns rank 0's answer. [sync point]"""
    if run.noise is None or run.start == 0:
        return
    go_on = b"\x01" if run.rank == 0 and may_continue(run.restored, run.ledger) else b"\x00"
    go_on = broadcast_bytes(go_on if run.rank == 0 else None, 1, run.device) == b"\x01"
    if not go_on:
        run.noise.new_segment()
    if run.rank == 0:
        _metrics_line(run.spec.paths.metrics, {"event": "noise_segment", "step": run.start,
                                               "continued": go_on, "row": run.noise.stream.t})


def open_ledger(run: Training) -> None:
    """Rank 0 becomes the client of the run's single ledger writer (a Ray actor on the
    driver, or in-process without Ray). One attempt per (re)start of the worker group:
    re-executed steps are counted again, as they must be. A NON-PRIVATE baseline has no
    ledger (``spec.ledger`` None): ``run.ledger`` stays None and every ledger call is skipped."""
    if run.rank != 0:
        return
    if run.spec.ledger is not None:
        run.ledger = run.spec.ledger.client()
        run.attempt = run.ledger.start_attempt()
    _metrics_line(run.spec.paths.metrics, {"event": "start", "step": run.start, "time": time.time(),
                                           "world_size": run.world, **_label(run.spec)})


def seeded_scope(run: Training) -> None:
    """``privacy.rng: seeded``: every rank keys its draws by the run id and rank 0's attempt
    (the ledger service's id; without a ledger, a fresh random one), so that no two runs
    and no two attempts of a run share a step's noise (`keys.seeded_key`). [sync point]"""
    if run.spec.cfg.privacy.rng != "seeded":
        return
    mine = (run.attempt or secrets.token_hex(16)).encode().ljust(64, b"\0") if run.rank == 0 else None
    attempt = broadcast_bytes(mine, 64, run.device).rstrip(b"\0").decode()
    run.key_scope = (run.spec.run_id, attempt)


GO, LEDGER_STOP, INTERRUPT, NO_SPACE = b"\x01", b"\x00", b"\x02", b"\x03"


def _nbytes(tensors) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors if torch.is_tensor(t))


def checkpoint_bytes(run: Training) -> int:
    """About how many bytes one checkpoint takes: the trainable parameters, the optimizer
    state (before its first step: AdamW's two moments), a correlated stream's state."""
    params = _nbytes(run.clipper.params)
    state = _nbytes(t for st in run.optimizer.state.values() for t in st.values())
    noise = _nbytes(run.noise.stream.state_tensors()) if run.noise is not None else 0
    return params + (state or 2 * params) + noise


def model_bytes(run: Training) -> int:
    """About how many bytes the final model takes (a PEFT model saves its adapter only)."""
    if hasattr(run.model, "peft_config"):
        return _nbytes(run.clipper.params)
    return _nbytes(run.model.parameters())


def room_for_interval(run: Training, step: int) -> str | None:
    """Rank 0, before the steps up to the next checkpoint: why the disks lack room for that
    checkpoint (staged in the temporary folder, then stored by Ray Train in the run
    directory), and after the last step for the final model too; else None. Checked before
    the steps, not before the write: a checkpoint that cannot be written loses its steps,
    whose releases are already in the ledger; stopping here spends nothing. An estimate:
    a write that fails anyway ends the run with its one message (`checkpoint`)."""
    every, steps = run.spec.cfg.train.checkpoint_every, run.spec.plan.steps
    if step != run.start and step % every != 0:
        return None
    need = int(checkpoint_bytes(run) * 1.1)
    storage = getattr(run.context, "checkpoint_dir", None) or run.spec.run_dir
    needs = {tempfile.gettempdir(): need}
    needs[storage] = needs.get(storage, 0) + need
    if min(steps, (step // every + 1) * every) >= steps:  # the last interval: the model too
        needs[run.spec.paths.model] = int(model_bytes(run) * 1.1)
    what = f"the checkpoint after step {min(steps, (step // every + 1) * every)}"
    try:
        check_free(needs, what)
    except StorageError as e:
        return str(e)
    return None


def admitted(run: Training, step: int) -> tuple[bytes, str]:
    """Before each step, rank 0 decides and every worker learns it [sync point]: ``GO``;
    ``INTERRUPT`` when the driver asked for a graceful stop (the first Ctrl-C: its file
    `rundir.STOP_REQUEST` in the run directory); or ``LEDGER_STOP`` (with why) when the
    ledger service refuses the step (budget, target ε). The ledger is asked before every
    step whatever the recipe says (``LedgerSpec.admits``); ``NO_SPACE`` (with why) when,
    before the steps up to the next checkpoint, the disk has no room for it
    (`room_for_interval`)."""
    code, why = GO, ""
    if run.rank == 0:
        if os.path.exists(os.path.join(run.spec.run_dir, STOP_REQUEST)):
            code = INTERRUPT
        elif (why := room_for_interval(run, step) or "") != "":
            code = NO_SPACE
        elif run.ledger is not None and run.spec.ledger is not None and run.spec.ledger.admits:
            ok, why = run.ledger.admit(run.spec.plan.ledger_index(step))
            code = GO if ok else LEDGER_STOP
    return broadcast_bytes(code if run.rank == 0 else None, 1, run.device), why


def stop_gracefully(run: Training, step: int) -> dict:
    """The first Ctrl-C, seen before step ``step`` (every worker has finished the steps
    before it): rank 0 voids the steps its attempt reserved and will not run (the ledger
    service takes them out of its reservation in the same call: `LedgerService.void_unrun`),
    the state after ``step`` steps is checkpointed (unless that is the restored or the last
    saved one), and the run ends without its final evaluation: the same command resumes it
    from here, and the ledger holds exactly the steps that ran."""
    voided = {"steps_voided": 0, "attempt": None}
    if run.ledger is not None:
        # in ledger units: a correlated mechanism's rounds begun by `step` steps stay released
        plan = run.spec.plan
        voided = run.ledger.void_unrun(plan.ledger_begun(step),
                                       "interrupted (Ctrl-C): reserved steps that never ran",
                                       attempt=run.attempt)
    if step > run.start and (step % run.spec.cfg.train.checkpoint_every != 0 or run.noise):
        checkpoint(run, step, graceful=True)  # correlated: marked, so its segment can go on
    if run.rank == 0:
        _metrics_line(run.spec.paths.metrics, {
            "event": "interrupted", "graceful": True, "step": step, **voided, "time": time.time()})
    return {"steps": step, "interrupted": True}


def stop_for_storage(run: Training, step: int, why: str) -> None:
    """No room for the next checkpoint, seen before step ``step`` (a checkpoint boundary, or
    this launch's first step: its state is on disk): rank 0 voids the steps its attempt
    reserved and will not run, as a graceful stop does, and every worker raises one
    `StorageError`. Nothing was spent on steps that could not be saved."""
    if run.ledger is not None:
        run.ledger.void_unrun(run.spec.plan.ledger_begun(step),
                              "no room on disk for the next checkpoint: reserved steps that never ran",
                              attempt=run.attempt)
    if run.rank == 0:
        _metrics_line(run.spec.paths.metrics, {"event": "no_space", "step": step, "time": time.time()})
    raise StorageError(why or "rank 0 found no room on disk for the next checkpoint (its message "
                              "says where)")


def dp_step(run: Training, step: int) -> dict:
    """One logical DP-SGD step (module docstring); returns rank 0's metrics record."""
    plan, cfg = run.spec.plan, run.spec.cfg
    t0 = time.perf_counter()
    keys = StepKeys.draw(step, cfg.privacy.rng, cfg.privacy.seed, run.device, run.key_scope)
    if plan.correlated:  # a cyclic sampler: group step mod cycle
        sample, truncated = run.sampler.sample_with_info(keys.sample, step)  # secret: never logged
    else:
        sample, truncated = run.sampler.sample_with_info(keys.sample)  # secret: never logged
    # Every worker computes the same assignment from the same sample; it reads only its own rows.
    bucket = cfg.train.length_bucketing
    mine = assign_micro_batches(
        sample, run.store.unit_row_count, run.store.unit_max_row_length, world_size=run.world,
        physical_batch_size=cfg.train.physical_batch_size, bucket=bucket,
        min_micro_steps=run.min_micro_steps,
    )[run.rank]
    micro = len(mine)
    stats = accumulate_clipped_sum(
        run.model, run.clipper, run.store, mine, run.device, loss_fn=run.loss_fn,
        debug_check=cfg.privacy.debug_check and step == run.start,
        width="auto" if bucket else None,
    )
    if run.ledger is not None:
        # Write-ahead: the step's event is durable before any replica applies the update.
        # The other ranks cannot pass the reduction below before rank 0 reaches it.
        run.ledger.ensure(plan.ledger_index(step))  # its step, or its round (correlated)
    # replicated: all-reduce; fsdp: reduce-scatter, each shard noised from its own stream.
    # [sync point] Either way: sum, noise once, ÷ q·N, left in p.grad.
    run.strategy.privatize(run.clipper.params, run.sinks, keys.noise, plan.noise_multiplier,
                           plan.max_grad_norm, plan.expected_batch_size, correlated=run.noise)
    if run.canaries is not None and run.rank == 0:
        _record_canaries(run, step)  # the audit's every-iterate statistic (secret)
    maybe_inject_fault(step, run.rank)
    units, rows, tokens, nonfinite = parallel.sum_over_workers(
        [stats.units, stats.rows, stats.tokens, stats.nonfinite], run.device)  # [sync point]
    run.nonfinite_steps += nonfinite > 0  # every worker counts the same steps
    run.optimizer.step()
    run.strategy.after_update(run.optimizer)
    run.scheduler.step()
    del sample, mine
    dt = time.perf_counter() - t0

    def rate(n: int) -> float | None:
        return n / dt if dt > 0 else None

    return {
        **_label(run.spec),
        "step": step + 1,
        "lr": run.scheduler.get_last_lr()[0],
        "step_time_s": dt,
        # computed on private data without DP: internal (see the report)
        "train_loss": stats.loss_sum / stats.units if stats.units else None,
        "worker0_units": stats.units,
        "worker0_tokens": stats.tokens,
        "worker0_tokens_per_s": rate(stats.tokens),
        "worker0_units_per_s": rate(stats.units),
        "units": units,
        "rows": rows,
        "tokens": tokens,
        "tokens_per_s": rate(tokens),
        "units_per_s": rate(units),
        "tokens_per_s_per_worker": tokens / dt / run.world if dt > 0 else None,
        "units_per_s_per_worker": units / dt / run.world if dt > 0 else None,
        "worker0_clipped_fraction": stats.clipped / stats.units if stats.units else None,
        "micro_steps": micro,
        "sample_truncated": bool(truncated),
        "nonfinite_units": nonfinite,  # internal: units whose gradient was NaN/inf
        # internal: the clipping norms' rounding bounds on rank 0 (clipping/norms.py)
        "worker0_norm_fallbacks": stats.norm_fallbacks,
        "worker0_norm_bound_max": stats.norm_bound_max,
    }


def checkpoint(run: Training, step: int, graceful: bool = False) -> None:
    """Save the state after ``step`` steps through the context (Ray Train's checkpoint);
    ``graceful``: written by `stop_gracefully` (its attempt runs no more steps). Each writer
    seals its folder (`checkpoints.seal`); a write the disk refuses ends the run with one
    `StorageError` (the steps since the last checkpoint stay in the ledger: over-count).
    ``ray.train.report`` is a barrier: every worker reaches it at the same steps."""
    meta = {"scheduler": run.scheduler.state_dict(), "step": step, "run_id": run.spec.run_id,
            "ledger": run.ledger.position() if run.ledger is not None else None,
            "nonfinite_steps": run.nonfinite_steps, "graceful": graceful}
    storage = getattr(run.context, "checkpoint_dir", None) or os.path.join(run.spec.run_dir, "checkpoints")
    with disk_errors(f"writing the checkpoint after step {step}", storage), \
            tempfile.TemporaryDirectory() as tmp:
        # replicated: rank 0 writes the full state; fsdp: every rank its own shards. [sync point]
        mine = run.strategy.save_checkpoint(run.model, run.optimizer, run.names, tmp, meta,
                                            noise=run.noise.stream if run.noise else None)
        if mine:  # written last: the folder is whole only with every writer's manifest
            checkpoints.seal(tmp, run.rank, run.strategy.checkpoint_writers(run.world), step)
        run.context.report({"step": step}, tmp if mine else None)


def _warn_nonfinite(run: Training) -> None:
    """Units with a NaN/inf gradient added nothing (factor 0), so every update stays DP.
    How many steps had one is a count over private data without DP: it may warn the
    operator (rank 0's console and the internal metrics.jsonl, both internal) but never
    changes what the run does or publishes (DESIGN, invariant `published-from-dp-only`): the run never stops
    on it, so its length, status and report are the same with or without such units."""
    limit = run.spec.cfg.train.max_nonfinite_steps
    if run.rank != 0 or run.nonfinite_warned or run.nonfinite_steps <= limit:
        return
    run.nonfinite_warned = True
    msg = (f"{run.nonfinite_steps} steps had privacy units whose gradient was not finite "
           f"(NaN/inf; they contributed nothing), more than train.max_nonfinite_steps={limit}. "
           "The run goes on (stopping on a count of private data would publish it); consider "
           "a lower optim.lr or float32 (model.dtype). Internal: not in the published report.")
    _metrics_line(run.spec.paths.metrics, {"event": "warning", "internal": True, "message": msg,
                                           "time": time.time()})
    print(f"llmdp: warning (internal): {msg}", file=sys.stderr, flush=True)


def finish(run: Training, stopped: dict | None) -> dict:
    """Save the final model (and, for a run stopped early, its last state)."""
    every = run.spec.cfg.train.checkpoint_every
    if stopped is not None and stopped["step"] % every != 0 and stopped["step"] > run.start:
        # Stopped before step `stopped["step"]`: save what was trained (every update so far
        # is in the ledger), unless that state was just checkpointed.
        checkpoint(run, stopped["step"])
    done = run.spec.plan.steps if stopped is None else stopped["step"]
    maybe_wait_for_ctrl_c(run, "final")
    if done > run.start or stopped is None:  # the final model's held-out and DP evaluation
        evaluation.evaluate_held_out(run, done, final=True, write=_writer(run))  # [sync point]
    with disk_errors("saving the final model", run.spec.paths.model):
        run.strategy.save_model(run.model, run.spec.paths.model)  # fsdp: streamed, tensor by tensor [sync point]
        if run.rank == 0:
            _save_tokenizer(run.spec.paths)
            write_provenance(run.spec, run.spec.paths.model)  # what a run starting from it composes
            _generations(run)
        end = {"event": "end", "step": run.spec.plan.steps} if stopped is None else \
            {"event": "stopped", "step": stopped["step"], "reason": stopped["reason"],
             "cause": stopped.get("cause")}
        _metrics_line(run.spec.paths.metrics, {**end, "time": time.time()})
        try:
            run.explog.close()
        except Exception as e:  # noqa: BLE001 - as in _emit: never fail a finished run for it
            _explog_failed(run, e)
    if stopped is not None:
        return {"steps": stopped["step"], "stopped": stopped["reason"]}
    return {"steps": run.spec.plan.steps}


def _writer(run: Training) -> Callable[[dict], None]:
    return lambda record: _emit(run, record)


def _emit(run: Training, record: dict) -> None:  # rank 0: metrics.jsonl and the experiment log
    _metrics_line(run.spec.paths.metrics, record)
    try:
        run.explog.record(record)
    except Exception as e:  # noqa: BLE001 - any backend's failure: the run must not stop for it
        _explog_failed(run, e)


def _explog_failed(run: Training, e: BaseException) -> None:
    """The experiment log could not be written (a full disk, a locked SQLite store, a
    backend's bug): say so once and go on without it. Stopping would lose the steps still
    to run while their budget may already be held; metrics.jsonl has every record."""
    backend = run.spec.cfg.logging.backend
    msg = (f"logging.backend {backend}: writing the experiment log failed ({type(e).__name__}: "
           f"{str(e)[:200]}); the run goes on without it (metrics.jsonl in the run directory "
           f"has every record)")
    run.explog = NO_LOG
    _metrics_line(run.spec.paths.metrics, {"event": "warning", "internal": True, "message": msg,
                                           "time": time.time()})
    print(f"llmdp: warning: {msg}", file=sys.stderr, flush=True)


def _generations(run: Training) -> None:
    """Continuations of ``eval.prompts`` from the final model (rank 0; replicated only)."""
    e = run.spec.cfg.eval
    if not e.prompts:
        return
    path = os.path.join(run.spec.run_dir, "generations.json")
    settings = {"max_new_tokens": e.max_new_tokens, "temperature": e.temperature,
                "top_p": e.top_p, "seed": run.spec.cfg.train.seed}
    if run.world > 1 and run.strategy.name != Replicated.name:
        evaluation.write_generations(path, [], {**settings, "skipped": (
            f"generations need the whole model on one worker; scaling.strategy "
            f"{run.strategy.name!r} shards it: generate from the exported model instead")})
        return
    gens = evaluation.generate_from_prompts(
        run.model, run.tokenizer, e.prompts, max_new_tokens=e.max_new_tokens,
        temperature=e.temperature, top_p=e.top_p, seed=run.spec.cfg.train.seed, device=run.device)
    evaluation.write_generations(path, gens, settings)


def train_loop_per_worker(spec: RunSpec, context=None) -> dict:
    """The whole job on one worker: set up, resume, run the remaining steps, finish."""
    with private_files(spec.cfg.output.group_readable):  # checkpoints, metrics: owner-only
        return _train_loop(spec, context)


def ray_entry(spec: RunSpec) -> None:
    """Ray Train's train function: the driver ships ``functools.partial(ray_entry, spec)``
    (`launch._fit`), and each worker unpickles it by reference, importing this module. It
    lives here, not in the driver's module, so that a worker imports the training loop and
    not the driver's launch, planning and export (~0.5 CPU-s a worker)."""
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    train_loop_per_worker(spec)


def _train_loop(spec: RunSpec, context) -> dict:
    run = setup(spec, context if context is not None else RayContext())
    if run.rank == 0:
        run.explog = open_log(spec.cfg, spec.run_dir)  # prints its warning once
    resume(run)
    open_ledger(run)
    seeded_scope(run)  # [sync point, seeded runs]
    choose_segment(run)
    if run.start == 0:  # the model before training: the baseline every evaluation compares to
        evaluation.evaluate_held_out(run, 0, write=_writer(run))  # [sync point]
    steps, every = spec.plan.steps, spec.cfg.train.checkpoint_every
    stopped = None
    with setup_kept():  # the run's objects out of the collector's walks
        for step in range(run.start, steps):
            maybe_wait_for_ctrl_c(run, str(step))
            decision, why = admitted(run, step)
            if decision == INTERRUPT:
                return stop_gracefully(run, step)
            if decision == NO_SPACE:
                stop_for_storage(run, step, why)
            if decision != GO:
                # A ledger decision (budget, target ε): a function of the recorded releases only.
                stopped = {"step": step, "reason": why, "cause": "ledger"}
                break
            record = dp_step(run, step)
            if run.rank == 0:
                _emit(run, record)
            if evaluation.due(spec, step + 1):
                evaluation.evaluate_held_out(run, step + 1, write=_writer(run))  # [sync point]
            last = step + 1 == steps
            if (step + 1) % every == 0 or last:
                checkpoint(run, step + 1)
            _warn_nonfinite(run)
    return finish(run, stopped)


@contextlib.contextmanager
def setup_kept():
    """The steps run with the objects alive at their start (the model, its hooks, the
    optimizer, the data: the run's, alive until it ends) moved out of the garbage
    collector's reach (``gc.freeze``), and back in after them. The clipping engine makes a
    few thousand short-lived Python objects per step; as they outlive the collector's young
    generations, every ~60 steps it walks the whole heap (~420k objects: ~250 ms at the
    LoRA benchmark's shape, the host stalled and with it the device), for nothing the run
    frees. Reference counts free objects as before; only a reference cycle among the frozen
    ones (none of the run's own, alive until it ends) waits to be collected until the end
    of the steps (or a stop) gives them back. A process that froze objects itself (the
    caller's own policy: ``gc.unfreeze`` would undo it) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _device(use_gpu: bool) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _save_tokenizer(paths: RunPaths) -> None:
    """The run's tokenizer beside the final model (rank 0)."""
    if paths.tokenizer_dir:
        from transformers import AutoTokenizer  # lazy: only rank 0, once, at the end

        AutoTokenizer.from_pretrained(paths.tokenizer_dir).save_pretrained(paths.model)
