"""Grey-box neighbour replay (issue 19, item 0): run the real DP step on D and on D∖{u}
with the same randomness, and check what the guarantee needs of the mechanism.

The step is the real one: :func:`llmdp.train.loop.dp_step` on a :class:`~llmdp.train.loop.Training`
built by :func:`llmdp.train.loop.setup` (sampling, micro-batching, the clipping engine, the
reduction, the noise, the division). Two trainings are built from the same RunSpec; the
neighbour's keeps everything public (model, noise multiplier, C, q, B_max, the minimum
micro-step count) and changes only the data: its store is a view of D's store without
unit u (:class:`WithoutUnit`) and its sampler draws from N−1 units at D's q. With
``privacy.rng: seeded`` both sides draw the same step keys (one run id, one attempt).

What is checked, per step (:class:`ReplayResult.violations` lists what failed, each
line tagged with its check, "(a)" or "(b)", and naming the unit, step and rank):

(a) sensitivity: the clipped sums at the moment the noise is added (after the
    cross-worker reduction; captured by wrapping ``llmdp.privacy.noise.gaussian.add_noise_``; under
    fsdp every rank captures its shard at its offsets and the full vector is assembled)
    differ by at most C·(1 + tol) in float64. With ``expect_clipped`` also by at least
    C·(1 − floor_tol): the removed unit is clipped, so its contribution is exactly C and the
    upper bound is not vacuous.
(b) nothing but the sum depends on the data:
    - the micro-steps executed (forward calls of the model, counted by a pre-hook) are
      what :func:`~llmdp.data.batching.assign_micro_batches` assigns to that side's sample.
      Plain Poisson: that count follows the sample (a function of the sampled units'
      row counts, ``min_micro_steps`` 0), so the two sides may legitimately differ and all
      the check can ask is that it be the assignment's; the step's duration then depends
      on the sample, which the guarantee on the released model does not speak about.
      Truncated Poisson pads every step to B_max units of compute (``min_micro_steps``),
      so the count is a constant: D and D∖{u} must agree.
    - the collectives the step issues (``torch.distributed`` calls and the reductions of
      ``llmdp.train.parallel``: name, shapes and dtypes, in order) are the same on both sides
      (plain Poisson: when both ran as many micro-steps; otherwise ``notes`` says so).
      Functional collectives that DTensor issues through ``torch.ops`` are not seen.
    - the ledger records the step writes are the same on both sides, except what names
      the run or the moment (time, hash chain, seq, run id, attempt).

A correlated mechanism (cyclic samplers, ``privacy.mechanism`` banded-mf / blt) is
replayed the same way: its clipped sums are captured where its stream takes them
(``llmdp.train.correlated.StepNoise.add_``: the mechanism adds its noise to exactly the
sums DP-SGD would), the neighbour's groups are D's without u's (each unit's group is
keyed by its own content), and at a step of another group than u's the sums must be
equal (‖Δ‖ = 0: u takes part only at its group's steps, the participation the analysis
assumes), at its group's steps within C.

The neighbour's sample must be D's sample without u, at the same positions otherwise:
with q = 1 always; with q < 1 when u is the *last* unit and N, q are such that removing
it moves no other unit's coin (not every pair: see :func:`aligned_draw`, which checks it
on the real sampler) and the step key samples u (:func:`sampled_seed` searches seeds
deterministically). :func:`replay` refuses a neighbour whose sample is not aligned
(:class:`ReplayError`): the sums would not be comparable. Test-only: nothing here is part
of a training run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmdp.config.choices import Sampler
from llmdp.data.batching import assign_micro_batches
from llmdp.data.store import UnitStore, as_indices
from llmdp.privacy import noise as dp_noise
from llmdp.privacy.sampling import make_sampler
from llmdp.record.spec import RunSpec
from llmdp.train import correlated, parallel, privatize
from llmdp.train.step import StepKeys

__all__ = ["ReplayError", "ReplayResult", "Side", "WithoutUnit", "aligned", "aligned_draw", "replay",
           "sampled_seed", "with_model", "with_seed"]

# The torch.distributed calls a step may issue (FSDP2 all-gathers parameters and the
# strategy reduces the sums through these; names absent from this torch are skipped).
_DIST_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
             "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "gather",
             "scatter", "send", "recv", "isend", "irecv", "all_gather_object",
             "broadcast_object_list")
# llmdp.train.parallel's own collectives, looked up through the module at call time, and
# the privatization step's two entry points (llmdp.train.privatize).
_PARALLEL_OPS = ("all_reduce_", "sum_over_workers", "broadcast_bytes", "barrier", "reduce_scatter_")
_PRIVATIZE_OPS = ("privatize_", "privatize_sharded_")
# Ledger fields that name the run or the moment, not the release.
_LEDGER_VOLATILE = frozenset({"time", "hash", "prev", "prev_hash", "run_prev", "seq", "run_id", "attempt",
                              "dataset_id", "run_ledger", "txn"})
_ATTEMPT = "replay"  # the seeded keys' attempt on both sides (`loop.seeded_scope`): the same draws


class ReplayError(RuntimeError):
    """The replay cannot compare the two sides (not a finding about the mechanism)."""


class WithoutUnit:
    """A view of a unit store without unit ``unit``: D∖{u} with the indices of the others
    shifted down, as a store built from the data without u would number them."""

    pad_batch = staticmethod(UnitStore.pad_batch)

    def __init__(self, store, unit: int):
        if not 0 <= int(unit) < store.num_units:
            raise IndexError(f"unit {unit} is not in [0, {store.num_units})")
        self.base, self.removed = store, int(unit)
        self.keep = np.delete(np.arange(store.num_units, dtype=np.int64), self.removed)
        self.num_units = store.num_units - 1
        for name in ("unit_row_start", "unit_row_count", "unit_target_tokens", "unit_max_row_length"):
            setattr(self, name, np.asarray(getattr(store, name))[self.keep])

    def rows(self, unit_indices, width=None):
        return self.base.rows(self.keep[as_indices(unit_indices)], width=width)

    def __getattr__(self, name: str) -> Any:  # pad_id, sequence_length, spec, ...
        if name == "base":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)


@dataclass
class Side:
    """What one side (D or D∖{u}) did in one step, on this rank."""

    sample: np.ndarray  # in D's unit numbering (secret in a real run: test-only)
    micro_steps: int  # forward calls of the model
    predicted_micro_steps: int  # assign_micro_batches on this side's sample
    collectives: list[tuple]  # (name, shapes/dtypes ...) in call order
    ledger: list[dict]  # the records written, without the volatile fields
    sums: torch.Tensor | None  # float64, the full pre-noise sum (None: no noise was added)
    metrics: dict = field(default_factory=dict)  # dp_step's record (internal statistics)


@dataclass
class ReplayResult:
    """The verdict: ``violations`` is empty iff every check passed."""

    unit: int
    clip_bound: float
    sampler: str
    steps: list[tuple[Side, Side]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # ‖Δ‖/C per step
    full_norms: list[float] = field(default_factory=list)  # ‖Σ_D‖/C per step
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was legitimately not compared

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        head = (f"replay of unit {self.unit} ({self.sampler}, C={self.clip_bound:g}): "
                f"‖Δ‖/C = {', '.join(f'{r:.8f}' for r in self.ratios)}; "
                f"‖Σ_D‖/C = {', '.join(f'{r:.1f}' for r in self.full_norms)}")
        tail = [*self.violations, *(f"note: {n}" for n in self.notes)]
        return "\n  ".join([head, *tail]) if self.violations else "\n  ".join([head + "; ok", *tail])


# --------------------------------------------------------------------------- neighbours


def with_seed(spec: RunSpec, seed: int) -> RunSpec:
    """``spec`` with ``privacy.seed`` replaced (seeded randomness only)."""
    if spec.cfg.privacy.rng != "seeded":
        raise ReplayError("the replay needs privacy.rng: seeded (both sides draw the same keys)")
    cfg = dataclasses.replace(spec.cfg, privacy=dataclasses.replace(spec.cfg.privacy, seed=int(seed)))
    return dataclasses.replace(spec, cfg=cfg)


def with_model(spec: RunSpec, build: Callable[[int], torch.nn.Module]) -> Callable[[], Any]:
    """A training factory for :func:`replay`: the real ``worker.setup`` of ``spec`` (its
    data, sampler, strategy, noise, ledger), with the model replaced by ``build(vocab_size)``
    (the recipe's model's vocabulary) and the engine, optimizer and schedule rebuilt on it
    as ``setup`` builds them. For constructions no recipe expresses — e.g. weights that
    make the clipping norm a small difference of huge terms (issue 29 item 1). The model
    takes ``input_ids``/``attention_mask`` and returns an object with ``.logits``."""
    from llmdp.clipping import GhostClipper
    from llmdp.train.loop import LocalContext, build_optimizer, lr_lambda, setup

    def factory():
        run = setup(spec, LocalContext())
        cfg, plan = spec.cfg, spec.plan
        vocab = int(run.model.get_input_embeddings().weight.shape[0])
        run.clipper.remove_hooks()
        model = build(vocab).to(run.device)
        model.train()
        clipper = GhostClipper(model, plan.clip_bound, engine=cfg.privacy.clipping,
                               mode=cfg.privacy.clipping_mode,
                               grad_buffers=run.strategy.grad_sinks(model))
        optimizer = build_optimizer(clipper.params, cfg.optim)
        return dataclasses.replace(
            run, model=model, clipper=clipper, names=list(clipper.param_names), optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, plan.steps)))

    return factory


def unit_groups_of(spec: RunSpec) -> np.ndarray | None:
    """A correlated mechanism's cyclic groups of D's units (`cyclic.store_groups`: keyed by
    each unit's own content, so D∖{u}'s are D's without u's); None for DP-SGD."""
    if not spec.plan.correlated:
        return None
    from llmdp.data.store import open_store
    from llmdp.privacy.sampling import store_groups

    return store_groups(open_store(spec.paths.store_dir), spec.plan.cycle)


def _sampler(spec: RunSpec, unit: int | None = None, groups: np.ndarray | None = None):
    """The real sampler of D (``unit`` None) or of D∖{unit}: N−1 units at D's q and B_max,
    or, cyclic, D's groups without u's at D's q_g (the mechanism is unchanged)."""
    plan = spec.plan
    if plan.correlated:
        from llmdp.privacy.sampling import CyclicPoissonSampler, FixedCycleSampler

        g = unit_groups_of(spec) if groups is None else groups
        g = g if unit is None else np.delete(g, int(unit))
        if plan.sampler == Sampler.FIXED_CYCLE:
            return FixedCycleSampler(g, plan.cycle)
        return CyclicPoissonSampler(g, plan.cycle, plan.event_probability)
    n = int(plan.dataset_size) - (unit is not None)
    return make_sampler(n, plan.sampling_probability, plan.max_batch_size)


def _draw(sampler, key: bytes, step: int) -> tuple[np.ndarray, bool]:
    """The sampler's draw at ``step`` (a cyclic sampler samples the step's group)."""
    if hasattr(sampler, "group_at"):
        return sampler.sample_with_info(key, step)
    return sampler.sample_with_info(key)


def aligned_draw(num_units: int, q: float, max_batch_size: int | None, unit: int,
                 sample_key: bytes) -> bool:
    """Whether the real sampler for N−1 units at q, on ``sample_key``, draws the real
    N-unit sample without ``unit``, every other unit at its shifted index.

    Not always so, even for the last unit: the Poisson walk draws its geometric skips in
    chunks sized from ⌊N·q⌋ (float64), so when ⌊N·q⌋ ≠ ⌊(N−1)·q⌋ (e.g. q = B/N exactly)
    the keystream words land on other skips and the other units' coins move. That is not
    a privacy defect (the coins are i.i.d. either way), but the two sums would then be of
    different samples: the replay needs the coupling in which they do not move."""
    s_d, _ = make_sampler(num_units, q, max_batch_size).sample_with_info(sample_key)
    s_n, _ = make_sampler(num_units - 1, q, max_batch_size).sample_with_info(sample_key)
    keep = np.delete(np.arange(num_units, dtype=np.int64), int(unit))
    return np.array_equal(keep[s_n], s_d[s_d != unit])


def aligned(spec: RunSpec, unit: int, step: int = 0, groups: np.ndarray | None = None) -> bool:
    """:func:`aligned_draw` for ``spec``'s plan at ``step`` (its seed's step keys); for a
    cyclic sampler, the same comparison of its D and D∖{u} draws."""
    keys = StepKeys.draw(step, "seeded", spec.cfg.privacy.seed, torch.device("cpu"), (spec.run_id, _ATTEMPT))
    plan = spec.plan
    if not plan.correlated:
        return aligned_draw(int(plan.dataset_size), plan.sampling_probability, plan.max_batch_size,
                            unit, keys.sample)
    groups = unit_groups_of(spec) if groups is None else groups
    s_d, _ = _draw(_sampler(spec, None, groups), keys.sample, step)
    s_n, _ = _draw(_sampler(spec, unit, groups), keys.sample, step)
    keep = np.delete(np.arange(groups.size, dtype=np.int64), int(unit))
    return np.array_equal(keep[s_n], s_d[s_d != unit])


def sampled_seed(spec: RunSpec, unit: int, step: int = 0, tries: int = 2000) -> int:
    """The smallest seed whose step ``step`` samples ``unit`` on D, without truncation,
    with the neighbour's sample aligned (:func:`aligned`) and, under plain Poisson, as many
    micro-steps on every rank for D and D∖{unit} (so that their collectives are compared,
    not only noted: the draws depend on the run id, a new one each launch)."""
    groups = unit_groups_of(spec)
    store = None
    for seed in range(tries):
        s = with_seed(spec, seed)
        keys = StepKeys.draw(step, "seeded", seed, torch.device("cpu"), (spec.run_id, _ATTEMPT))
        s_d, truncated = _draw(_sampler(s, None, groups), keys.sample, step)
        if unit not in s_d or truncated or not aligned(s, unit, step, groups):
            continue
        if spec.plan.sampler == Sampler.POISSON and not spec.plan.correlated:
            if store is None:
                from llmdp.data.store import open_store

                store = open_store(spec.paths.store_dir)
            if _micro_steps(spec, store, s_d) != _micro_steps(spec, store, s_d[s_d != unit]):
                continue
        return seed
    raise ReplayError(f"no seed below {tries} samples unit {unit} at step {step}")


def _micro_steps(spec: RunSpec, store: UnitStore, sample: np.ndarray) -> list[int]:
    """Micro-steps per rank that plain Poisson's assignment gives ``sample`` (D's ids)."""
    plan = assign_micro_batches(np.asarray(sample, dtype=np.int64), store.unit_row_count,
                                store.unit_max_row_length, world_size=spec.cfg.scaling.num_workers,
                                physical_batch_size=spec.cfg.train.physical_batch_size,
                                bucket=spec.cfg.train.length_bucketing)
    return [len(p) for p in plan]


# --------------------------------------------------------------------------- recording


def _describe(x: Any) -> Any:
    """What a collective's argument says publicly: shapes and dtypes, never values."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype))
    if isinstance(x, (list, tuple)):
        return ("seq", len(x), tuple(_describe(v) for v in x if isinstance(v, torch.Tensor)))
    if isinstance(x, (bytes, bytearray)):
        return ("bytes", len(x))
    return type(x).__name__


@contextmanager
def _recording(model: torch.nn.Module) -> Iterator[dict]:
    """Count the model's forward calls, log the collectives, capture the sums at the noise."""
    rec: dict = {"forwards": 0, "collectives": [], "noised": []}
    undo: list[Callable[[], None]] = []

    def patch(module, name: str, label: str, capture=None):
        real = getattr(module, name, None)
        if real is None:
            return

        def wrapper(*args, **kwargs):
            rec["collectives"].append((label, tuple(_describe(a) for a in args),
                                       tuple((k, _describe(v)) for k, v in sorted(kwargs.items()))))
            if capture is not None:
                capture(*args, **kwargs)
            return real(*args, **kwargs)

        setattr(module, name, wrapper)
        undo.append(lambda: setattr(module, name, real))

    def at_noise(tensors, key, std, offsets=None, totals=None):
        # The moment the noise is added: the reduced (fsdp: reduce-scattered) clipped sums.
        n = len(tensors)
        offs = list(offsets) if offsets is not None else [0] * n
        tots = list(totals) if totals is not None else [t.numel() for t in tensors]
        rec["noised"].append([(i, int(o), int(m), t.detach().reshape(-1).double().cpu().clone())
                              for i, (t, o, m) in enumerate(zip(tensors, offs, tots))])

    for name in _DIST_OPS:
        patch(dist, name, f"dist.{name}")
    for name in _PARALLEL_OPS:
        patch(parallel, name, f"parallel.{name}")
    for name in _PRIVATIZE_OPS:
        patch(privatize, name, f"privatize.{name}")
    patch(dp_noise, "add_noise_", "noise.add_noise_", capture=at_noise)
    # A correlated mechanism's noise enters here instead (its z_t is drawn into buffers of
    # its own: the sums are what it is handed).
    real_corr = correlated.StepNoise.add_

    def corr_add(self, tensors, key, std, offsets=None, totals=None):
        rec["collectives"].append(("correlated.add_", (_describe(list(tensors)),), ()))
        at_noise(tensors, key, std, offsets, totals)
        return real_corr(self, tensors, key, std, offsets, totals)

    correlated.StepNoise.add_ = corr_add
    undo.append(lambda: setattr(correlated.StepNoise, "add_", real_corr))
    handle = model.register_forward_pre_hook(lambda *_: rec.__setitem__("forwards", rec["forwards"] + 1))
    try:
        yield rec
    finally:
        handle.remove()
        for f in reversed(undo):
            f()


def _assemble(pieces_by_rank: list[list]) -> torch.Tensor | None:
    """The full float64 vector from every rank's captured (index, offset, total, values)."""
    pieces = [p for rank in pieces_by_rank for p in rank]
    if not pieces:
        return None
    totals: dict[int, int] = {}
    for i, _, total, _ in pieces:
        totals[i] = total
    full = {i: torch.full((n,), math.nan, dtype=torch.float64) for i, n in totals.items()}
    for i, off, _, values in pieces:
        full[i][off: off + values.numel()] = values
    out = torch.cat([full[i] for i in sorted(full)])
    if torch.isnan(out).any():
        raise ReplayError("the shards captured at the noise do not cover the parameters")
    return out


def _ledger_records(run) -> list[dict]:
    return list(run.ledger.records()) if run.ledger is not None else []


# --------------------------------------------------------------------------- the replay


def _side(factory: Callable[[], Any], spec: RunSpec, unit: int | None, steps: int,
          layer_policy: str | None, snapshots: list, sync_from: list | None,
          groups: np.ndarray | None = None) -> tuple[Any, list[Side]]:
    from llmdp.train.loop import dp_step, open_ledger

    run = factory()
    if layer_policy is not None:
        run.clipper.layer_policy = layer_policy  # read at every backward; not a recipe field
    if unit is not None:
        run.store = WithoutUnit(run.store, unit)
        run.sampler = _sampler(spec, unit, groups)
    open_ledger(run)
    run.key_scope = (spec.run_id, _ATTEMPT)  # both sides, every rank: the same seeded draws
    keep = run.store.keep if unit is not None else None
    out = []
    for step in range(steps):
        if sync_from is not None and step > 0:
            # Step t compares the sums at the same parameters: D's, before its step t.
            with torch.no_grad():
                for p, q in zip(run.clipper.params, sync_from[step]):
                    p.copy_(q)
        snapshots.append([p.detach().clone() for p in run.clipper.params] if steps > 1 else [])
        before = len(_ledger_records(run))
        keys = StepKeys.draw(step, "seeded", spec.cfg.privacy.seed, run.device, run.key_scope)
        sample, _ = _draw(run.sampler, keys.sample, step)
        predicted = len(assign_micro_batches(
            sample, run.store.unit_row_count, run.store.unit_max_row_length, world_size=run.world,
            physical_batch_size=spec.cfg.train.physical_batch_size,
            bucket=spec.cfg.train.length_bucketing, min_micro_steps=run.min_micro_steps)[run.rank])
        with _recording(run.model) as rec:
            metrics = dp_step(run, step)
        pieces = rec["noised"][0] if rec["noised"] else []
        if parallel.world()[1] > 1:
            gathered: list = [None] * parallel.world()[1]
            dist.all_gather_object(gathered, pieces)
        else:
            gathered = [pieces]
        new = _ledger_records(run)[before:]
        out.append(Side(
            sample=np.asarray(sample if keep is None else keep[sample], dtype=np.int64),
            micro_steps=rec["forwards"], predicted_micro_steps=predicted,
            collectives=rec["collectives"],
            ledger=[{k: v for k, v in r.items() if k not in _LEDGER_VOLATILE} for r in new],
            sums=_assemble(gathered), metrics=metrics))
    return run, out


def replay(spec_or_factory: RunSpec | Callable[[], Any], remove: int, steps: int = 1, *,
           spec: RunSpec | None = None, layer_policy: str | None = None,
           expect_clipped: bool = False, tol: float = 1e-6,
           floor_tol: float = 1e-3) -> ReplayResult:
    """Run ``steps`` real DP steps on D and on D∖{``remove``} and check them (module
    docstring). Every rank of a process group calls it (the step's collectives).

    ``spec_or_factory``: a RunSpec of ``trainer.prepare`` (the trainings are built by
    ``worker.setup`` with a ``LocalContext``), or a callable returning a fresh Training
    (then ``spec`` defaults to its ``.spec``). ``layer_policy``: force the engine's
    ``"ghost"`` / ``"instantiate"`` layer policy on both sides. From the second step on,
    the neighbour starts each step from D's parameters, so every step compares the sums
    of one function of the data. ``tol``: the upper bound is C·(1 + tol); ``floor_tol``:
    with ``expect_clipped`` the lower one is C·(1 − floor_tol) (unplanted runs of the test
    matrix stay within 5e-7 of C either way: float32 sums of ~10–30 C).
    """
    from llmdp.train.loop import LocalContext, setup

    if isinstance(spec_or_factory, RunSpec):
        spec = spec_or_factory
        factory: Callable[[], Any] = lambda: setup(spec, LocalContext())  # noqa: E731
    else:
        factory = spec_or_factory
    if spec is None:
        spec = factory().spec  # one training more; pass spec= to save it
    if spec.cfg.privacy.rng != "seeded":
        raise ReplayError("the replay needs privacy.rng: seeded (both sides draw the same keys)")
    if spec.plan.noise_multiplier <= 0:
        raise ReplayError("the replay captures the sums where the noise is added: σ must be > 0")
    C = float(spec.plan.max_grad_norm)
    groups = unit_groups_of(spec)
    for step in range(steps):
        if not aligned(spec, remove, step, groups):
            raise ReplayError(f"step {step}: the neighbour's sample is not D's without unit {remove} "
                              "(use q = 1, or remove the last unit)")

    # D first, keeping its parameters before each step for the neighbour.
    before_d: list = []
    run_d, sides_d = _side(factory, spec, None, steps, layer_policy, before_d, None, groups)
    _, sides_n = _side(factory, spec, remove, steps, layer_policy, [], before_d, groups)
    res = ReplayResult(unit=int(remove), clip_bound=C, sampler=spec.plan.sampler)
    truncated = spec.plan.max_batch_size is not None and spec.plan.sampler == Sampler.TRUNCATED_POISSON
    rank = run_d.rank
    for t, (d, n) in enumerate(zip(sides_d, sides_n)):
        res.steps.append((d, n))
        where = f"unit {remove}, step {t}, rank {rank}"
        # A cyclic sampler: the unit may take part only at the steps of its group (t ≡ g
        # mod cycle); at the others its removal must change nothing at all.
        off_turn = groups is not None and t % spec.plan.cycle != int(groups[remove])
        if not off_turn and remove not in set(d.sample.tolist()):
            res.violations.append(f"(a) {where}: the unit was not sampled on D (the check is vacuous)")
        if off_turn and remove in set(d.sample.tolist()):
            res.violations.append(f"(a) {where}: the unit of group {int(groups[remove])} was sampled "
                                  f"at a step of group {t % spec.plan.cycle}")
        if d.sums is None or n.sums is None:
            res.violations.append(f"(a) {where}: no noise was added (no sum captured)")
        else:
            ratio = float((d.sums - n.sums).norm()) / C
            res.ratios.append(ratio)
            res.full_norms.append(float(d.sums.norm()) / C)
            if ratio > 1 + tol:
                res.violations.append(f"(a) {where}: sensitivity ‖Δ‖/C = {ratio:.6f} > 1 + {tol:g}")
            if off_turn and ratio != 0:
                res.violations.append(f"(a) {where}: ‖Δ‖/C = {ratio:.6g} ≠ 0 at a step outside the "
                                      "unit's group (its participation is not what the analysis assumes)")
            elif not off_turn and expect_clipped and ratio < 1 - floor_tol:
                res.violations.append(f"(a) {where}: ‖Δ‖/C = {ratio:.6f} < 1 − {floor_tol:g} for a clipped unit "
                                      "(its contribution is exactly C)")
        for name, s in (("D", d), ("D∖u", n)):
            if s.micro_steps != s.predicted_micro_steps:
                res.violations.append(
                    f"(b) {where}: {name} ran {s.micro_steps} micro-steps, its assignment has "
                    f"{s.predicted_micro_steps}")
        if truncated and d.micro_steps != n.micro_steps:
            res.violations.append(f"(b) {where}: micro-steps D {d.micro_steps} ≠ D∖u {n.micro_steps} "
                                  "under truncated Poisson")
        if not truncated and d.micro_steps != n.micro_steps:
            # Plain Poisson: more micro-steps, more per-micro-step collectives (fsdp's
            # all-gathers), legitimately; the traces are comparable only at equal counts.
            res.notes.append(f"{where}: collectives not compared: plain Poisson ran "
                             f"{d.micro_steps} vs {n.micro_steps} micro-steps")
        elif d.collectives != n.collectives:
            i = next((i for i, (a, b) in enumerate(zip(d.collectives, n.collectives)) if a != b),
                     min(len(d.collectives), len(n.collectives)))
            res.violations.append(
                f"(b) {where}: collectives differ at call {i} of {len(d.collectives)} vs "
                f"{len(n.collectives)}: {d.collectives[i] if i < len(d.collectives) else None} vs "
                f"{n.collectives[i] if i < len(n.collectives) else None}")
        if d.ledger != n.ledger:
            res.violations.append(f"(b) {where}: ledger records differ: {d.ledger} vs {n.ledger}")
    if parallel.world()[1] > 1:  # every rank's verdict on every rank
        everyone: list = [None] * parallel.world()[1]
        dist.all_gather_object(everyone, res.violations)
        res.violations = [v for vs in everyone for v in vs]
    return res
