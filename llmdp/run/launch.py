"""Driver: prepare the run (data, model, plan), run the workers on Ray Train, write the report.

Every path handed to workers is absolute (Ray workers chdir into their own folder).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
import uuid

from llmdp._fs import RunLock, StorageError, cache_root, check_free, private_files, storage_error
from llmdp.base.localray import run_env, start_local_ray
from llmdp.config.schema import RecipeConfig, config_hash, dump_yaml, to_dict
from llmdp.hub.export import ExportError, export_run
from llmdp.privacy.accounting import event_to_json
from llmdp.privacy.ledger import (
    BudgetError,
    LedgerError,
    LedgerService,
    check_declared_public,
    open_dataset_ledger,
    run_ledger_problems,
)
from llmdp.privacy.mf import mf_commitment
from llmdp.record.baseline import BANNER, public_banner
from llmdp.record.provenance import SOURCE, copy_declared_releases
from llmdp.record.rundir import RESUME_HINT, RunDir
from llmdp.record.spec import LedgerSpec, RunPaths, RunSpec
from llmdp.report.build import write_report
from llmdp.run.interrupt import GracefulInterrupt, stopped_gracefully
from llmdp.run.planning import plan_run, warn_open
from llmdp.run.preflight import check_run_dir, run_lock, truncation_note
from llmdp.run.progress import EPS_KEY, Progress, batch_note, mechanism_label
from llmdp.run.restore import restore_point
from llmdp.tokenizer.train import ensure_release_recorded
from llmdp.train.loop import ray_entry


def _check_run_ledger(run_dir: str, run_id: str, ledger: dict) -> None:
    """Before a resumed run records anything: its ledger.jsonl verifies on its own and
    against the dataset ledger (else `LedgerError`, naming the line and the repair)."""
    path = os.path.join(run_dir, "ledger.jsonl")
    if not os.path.exists(path):
        return

    problems = run_ledger_problems(path, run_id, ledger["location"], ledger["dataset_id"])
    if problems:
        raise LedgerError(problems[0])


def prepare(cfg: RecipeConfig, log=print, lock=None, augment=None) -> RunSpec:
    """Everything the workers need, built once on the driver: data units, model files, the
    plan, the ledger service; returned as one :class:`~llmdp.record.spec.RunSpec`, whose record
    is written to the run directory's plan.json (once)."""

    run_dir = os.path.abspath(cfg.run_dir)
    rd = RunDir(run_dir)
    check_run_dir(run_dir, cfg)
    # runs/<name>/ is created only after every check and the data have passed (below), so a
    # bad recipe or bad data leaves no empty run directory behind.
    cache = cache_root()
    planned = plan_run(cfg, log, augment=augment)  # augment: llmdp audit's canaries
    # a re-launch: the first launch's σ, where this one's search found one as good
    plan = rd.first_plan(planned.plan)
    store, spec, d = planned.store, planned.unit_spec, cfg.data
    source_sha, tok_use = planned.source_sha, planned.tok_use
    prior_releases, data_stats = planned.prior_releases, planned.data_stats
    N = store.num_units
    run_id = rd.run_id() or uuid.uuid4().hex[:12]  # a re-launch resumes the same run
    ledger_meta = {
        "config_hash": config_hash(cfg),
        "unit": {**spec.to_dict(), "description": spec.describe(),
                 **({"formation": store.formation()} if store.formation() else {})},
        "dataset_fingerprint": store.fingerprint,
        "dataset_size": N,
        "rng": cfg.privacy.rng,
        "sampler": cfg.privacy.sampler,
        "relation": plan.relation,
        "mechanism": plan.mechanism,
        # a correlated mechanism is committed with its every parameter (llmdp.privacy.mf.plan)
        **({"mf": mf_commitment(plan)} if plan.correlated and plan.dp else {}),
    }

    # A NON-PRIVATE baseline (privacy.dp: false) opens no ledger and records nothing; nor
    # does a simulated run (privacy.simulate: the DP mechanism on data declared public).
    ledger = (open_dataset_ledger(d, cfg.privacy.ledger, source_sha, log=log)
              if plan.dp and not cfg.privacy.simulate else None)
    if d.public:  # declared public: refused on data that was treated as private (its ledger)
        check_declared_public(d, cfg.privacy.ledger, source_sha, run_dir=run_dir, log=log)
    if ledger is not None:
        _check_run_ledger(run_dir, run_id, ledger)  # a resumed run: its ledger.jsonl is whole
    eval_ledger = None if ledger is None or planned.eval_plan is None else \
        _eval_source_ledger(cfg, planned.eval_store, ledger, log)
    # The newest intact checkpoint, and Ray Train's record of them repaired to name it
    # (damaged ones set aside, never deleted): what this launch resumes from.
    verified = restore_point(run_dir, log=log)
    # A resumed run holds (and may need) only the steps after its checkpoint.
    resumed_at = rd.checkpoint_step()
    resumed_at = resumed_at if isinstance(resumed_at, int) else 0
    service = None if ledger is None else {
        "location": ledger["location"], "dataset_id": ledger["dataset_id"],
        "head_log": ledger["head_log"],
        "run_ledger": os.path.join(run_dir, "ledger.jsonl"),
        "run_id": run_id, "meta": ledger_meta,
        # in ledger units: steps, or a correlated mechanism's rounds (DPPlan.ledger_steps)
        "block_size": plan.ledger_index(int(cfg.train.checkpoint_every) - 1) + 1,
        "total_steps": plan.ledger_steps,
        # the δ every ε of this run is accounted at: privacy.delta less the noise tails
        "event_json": event_to_json(plan.step_event()), "delta": plan.delta,
        "accountant_delta": plan.accountant_delta,
        "accountant": plan.accountant, "budget_epsilon": cfg.privacy.budget_epsilon,
        "target_epsilon": plan.target_epsilon, "prior_releases": prior_releases,
        "allow_exceed_target": cfg.privacy.allow_exceed_target_on_failure,
        "lock": lock.info if lock is not None else None,
        "eval_event_json": None if planned.eval_plan is None else event_to_json(planned.eval_plan.event()),
        "eval_releases": 0 if planned.eval_plan is None else planned.eval_plan.releases,
        "eval_ledger": eval_ledger,
    }
    if prior_releases:
        meta = {"dataset_fingerprint": store.fingerprint, "dataset_size": N, "unit": ledger_meta["unit"]}
        copy_declared_releases(prior_releases, ledger, meta, log=log)  # model.start_data: same
        for rel in prior_releases:
            if rel.get("source") == SOURCE:
                continue  # a starting checkpoint's: in this dataset's ledger (or copied above)
            if ensure_release_recorded(rel, ledger, {**meta, "tokenizer": rel["tokenizer"]}):
                log(f"tokenizer release {rel['release_id']} copied into the dataset ledger "
                    f"{ledger['dataset_id']!r}")
    tok_dir = cfg.model.tokenizer or cfg.model.name_or_path
    spec = RunSpec(
        cfg=cfg, plan=plan, run_id=run_id,
        paths=RunPaths(run_dir=run_dir, store_dir=os.path.abspath(store.path),
                       model_cache=os.path.join(cache, "models"),
                       tokenizer_dir=os.path.abspath(tok_dir) if tok_dir and os.path.isdir(tok_dir) else None,
                       eval_store_dir=None if planned.eval_store is None else os.path.abspath(planned.eval_store.path)),
        ledger=None if service is None else LedgerSpec(service=service),
        dataset_ledger=None if ledger is None else {"location": ledger["shown"],
                                                    "dataset_id": ledger["dataset_id"]},
        prior_releases=tuple(prior_releases), tokenizer=tok_use, data_stats=data_stats,
        eval_plan=planned.eval_plan, unit=ledger_meta["unit"],
        starting_model=planned.starting_model, verified_checkpoint=verified,
    )
    if spec.ledger is not None and plan.ledger_index(resumed_at) < plan.ledger_steps:
        # Every DP run, whatever its recipe says: the dataset's budget (its ledger's) applies.
        # (A run whose every step ran, resumed to save its model, holds nothing.)
        check_budget(spec.ledger, plan, remaining=plan.ledger_steps - plan.ledger_index(resumed_at),
                     resuming=resumed_at > 0, log=log)
    os.makedirs(run_dir, exist_ok=True)
    dump_yaml(cfg, os.path.join(run_dir, "config.yaml"))
    rd.write_plan(spec.plan_record())
    return spec


def _eval_source_ledger(cfg: RecipeConfig, eval_store, ledger: dict, log) -> dict | None:
    """The own dataset ledger of a separate private evaluation source (``data.eval.path`` or
    ``data.eval.dataset`` with ``public: false``): data about individuals, so every DP
    evaluation on it is a release on *that* dataset too, recorded (and checked against its
    budget) in its ledger besides the training data's; a later run on it starts from what
    these evaluations spent. None for held-out units of the corpus (``data.eval.fraction``:
    the training data's ledger holds them) and when the source is the training dataset."""
    from llmdp.data.sources import source_fingerprint

    ev = cfg.data.eval
    if ev is None or ev.fraction is not None or ev.public is not False:
        return None
    sha = source_fingerprint(path=ev.path, dataset=ev.dataset, split=ev.split,
                             config_name=ev.config_name, format=ev.format)
    # `ev` names its source as data does (path / dataset, config_name, dataset_id).
    opened = open_dataset_ledger(ev, cfg.privacy.ledger, sha, recipe_legacy=False,
                                 log=lambda m: log(f"evaluation source {m}" if m.startswith("ledger:") else m))
    if opened["dataset_id"] == ledger["dataset_id"]:
        return None
    return {"dataset_id": opened["dataset_id"], "location": opened["shown"],
            "meta": {"dataset_fingerprint": eval_store.fingerprint,
                     "dataset_size": eval_store.num_units}}


def _tail_note(plan) -> str:
    """The noise tails' share of δ, for the plan's log line (empty when not folded in)."""
    tail = plan.noise_tail_delta
    return "" if tail is None else f" (noise tails {tail:.2g}, accountant {plan.accountant_delta:.3g})"


def finished_run(cfg: RecipeConfig) -> dict | None:
    """The report of ``cfg``'s run directory if that run completed all its steps, else None.
    (A different recipe in that directory is refused by ``check_run_dir`` in ``prepare``.)"""
    run_dir = os.path.abspath(cfg.run_dir)
    try:
        with open(os.path.join(run_dir, "privacy_report.json"), encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    check_run_dir(run_dir, cfg)
    if report.get("status") != "complete" and os.path.isdir(os.path.join(run_dir, "model")):
        # Interrupted during finalization (every step, the final evaluation and the model
        # were done): finish it here, without training or spending — rebuild the report
        # from the ledger (its hold is ended by the next run on the dataset: its lock is free).
        if RunDir(run_dir).finished_training():
            with RunLock(run_dir):
                report = report_or_storage_error(run_dir)
    if report.get("status") == "complete" and os.path.isdir(os.path.join(run_dir, "model")):
        return {"steps": report["steps_completed"], "epsilon": report["epsilon"], "delta": report["delta"]}
    return None


class RunInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C, SIGTERM); its report says `status: interrupted`."""


def check_budget(ledger: LedgerSpec, plan, *, remaining: int, resuming: bool, log=print) -> dict:
    """Hold this run's remaining steps of the dataset's budget, in one transaction with the
    check (`LedgerService.hold`): a run whose plan does not fit in what remains, after the
    releases and what live runs hold, is refused before it starts (a resumed run starts if
    one step fits, and stops before the step that would cross it). The budget is the
    dataset's, recorded in its ledger, whatever the recipe says: a recipe without
    ``privacy.budget_epsilon`` on a budgeted dataset is checked against (and holds) it; a
    recipe that states another budget, or a run for another privacy unit, is refused
    (`BudgetError`). The first budgeted run records its recipe's budget. A separate private
    evaluation source's own ledger is checked for the run's DP evaluations too."""

    svc = ledger.open()
    try:
        st = svc.hold(remaining, need=1 if resuming else remaining)
        ev = svc.check_eval_source()
    finally:
        svc.db.close()
    if ev is not None and ev.get("budget_epsilon") is not None:
        log(f"evaluation source: its dataset ledger {ev['dataset_id']!r} has spent ε = "
            f"{ev['epsilon_spent']:.4f} of its budget {ev['budget_epsilon']:g}; this run's DP "
            f"evaluations are recorded and checked there too")
    elif ev is not None:
        log(f"evaluation source: this run's DP evaluations are recorded in its own dataset "
            f"ledger {ev['dataset_id']!r} too")
    if st["budget"] is None:
        return st  # no budget on this dataset, none in the recipe: nothing held
    if not st["held"]:
        holders = [(f"{h['name']} (run {h['run_id']})" if h.get("name") else h["run_id"])
                   for h in st["live_holds"] if h["run_id"] != ledger.service["run_id"]]
        raise BudgetError(
            f"{st['budget_label']}: the dataset ledger "
            f"{st['dataset_id']!r} ({st['ledger']}) has spent ε = {st['epsilon_spent']:.4f} at "
            f"δ = {st['delta']:.3g} for the privacy unit {st.get('unit')!r}"
            + (f", and the live run(s) {', '.join(holders)} hold {st['held_steps']} more step(s)"
               if holders else "")
            + f"; this plan needs ε = {plan.epsilon():.4f} for T = {plan.steps} steps and only "
            f"{st['fit']} of its {remaining} remaining steps fit. Lower privacy.target_epsilon / "
            f"train.steps, raise the dataset's budget (`llmdp privacy ledger set-budget --dataset "
            f"{st['dataset_id']} --epsilon ...`, recorded), or wait for the other run(s) to end")
    whose = ("the dataset's budget, recorded in its ledger: this recipe sets no "
             "privacy.budget_epsilon" if ledger.budget_epsilon is None else
             "privacy.budget_epsilon, now recorded as the dataset's budget" if st["budget_set_now"]
             else "the dataset's budget, recorded in its ledger, as this recipe states")
    after = st.get("epsilon_after_run")
    others = st.get("held_steps", 0) - st["held"]
    log(f"budget: ε spent on this dataset for the privacy unit {st.get('unit')!r} = "
        f"{st['epsilon_spent']:.4f} of {st['budget_epsilon']:g} at δ = {st['delta']:.3g} ({whose}); "
        f"this run holds its {st['held']} remaining step(s)"
        + (f": after it the dataset is at ε = {after:.4f} of {st['budget_epsilon']:g}"
           + (" (with what other live runs hold)" if others > 0 else "") if after is not None else ""))
    return st


def run(cfg: RecipeConfig, log=print, augment=None) -> str:
    """Run the recipe end to end; returns the run directory. Ctrl-C raises RunInterrupted
    after the report (status: interrupted) is written."""
    done = finished_run(cfg)
    if done is not None:
        eps = (f"ε = {done['epsilon']:.4f} at δ = {done['delta']:.3g}" if done["epsilon"] is not None
               else "a NON-PRIVATE baseline, no ε")
        log(f"run {cfg.run_dir} is already complete ({done['steps']} of {done['steps']} steps, "
            f"{eps}); nothing to do. Give a new output.name to train again.")
        return os.path.abspath(cfg.run_dir)

    with private_files(cfg.output.group_readable):  # private data at rest: owner-only
        warn_open(cfg, log)
        lock = run_lock(cfg)  # one launch per run directory, before anything is written
        try:
            return _run_locked(cfg, lock, log, augment)
        finally:
            # A launch refused before it created the run directory (bad input, budget) leaves
            # no lock file behind; a run directory keeps its lock file beside it.
            lock.release(remove=not os.path.isdir(cfg.run_dir))


def simulated_line(spec: RunSpec) -> str:
    """The console's account of a simulated run (``privacy.simulate``): `RunSpec.simulation`."""
    plan, p, sim = spec.plan, spec.cfg.privacy, spec.simulation()
    target = (f"ε = {p.target_epsilon:g}" if p.target_epsilon is not None
              else f"σ = {p.noise_multiplier:g}")
    return (f"SIMULATED DP (privacy.simulate): {mechanism_label(plan)} at the noise of a private "
            f"run planned for {target} over {sim['private_units']} units: sigma="
            f"{plan.noise_multiplier:.4f}, C={plan.max_grad_norm:g}, B={plan.expected_batch_size:g}, "
            f"T={plan.steps} (noise std per averaged step sigma*C/B = "
            f"{sim['noise_std_per_step']:.4g}); on this corpus N={plan.dataset_size}, "
            f"q={plan.sampling_probability:.5g}; no ledger, nothing spent")


def report_banner(spec: RunSpec) -> str:
    """The console's label of a run without DP: the declaration of data declared public,
    else the NON-PRIVATE baseline's banner."""
    return (public_banner(to_dict(spec.cfg)["data"], spec.simulated)
            if spec.cfg.data.public else BANNER)


def _end_hold(spec: RunSpec, status: str, log) -> None:
    """The run's hold on the budget ends with the launch (a resumed run holds anew)."""
    if spec.ledger is None:
        return
    try:
        svc = spec.ledger.open()
        svc.end(f"launch ended: {status}")
        svc.db.close()
    except Exception as e:  # noqa: BLE001 - a hold of a dead run is ended by the next user
        log(f"warning: could not end this run's hold on the budget ({e}); the next run on "
            f"this dataset ends it (this launch's lock is free)")


def _run_locked(cfg: RecipeConfig, lock, log, augment=None) -> str:
    prepared = prepare(cfg, log=log, lock=lock, augment=augment)
    plan = prepared.plan
    label = report_banner(prepared)
    start = prepared.starting_model
    if start is not None:
        log(f"starting model: {start['shown']} ({start['description']})")
    if not prepared.dp:
        log(f"{label}. plan: N={plan.dataset_size} units, q={plan.sampling_probability:.5g}, "
            f"B={plan.expected_batch_size:g}, T={plan.steps}; no clipping, no noise, no ledger")
    elif prepared.simulated:
        log(f"{label}. {simulated_line(prepared)}")
    else:
        log(f"plan: {mechanism_label(plan)}, N={plan.dataset_size} units, "
            f"q={plan.sampling_probability:.5g}, B={plan.expected_batch_size:g}"
            f"{batch_note(plan, cfg.train.expected_batch_size)}, T={plan.steps}, "
            f"sigma={plan.noise_multiplier:.4f}, "
            f"C={plan.max_grad_norm:g}, delta={plan.delta:.3g}{_tail_note(plan)}, planned epsilon="
            f"{prepared.epsilon_planned:.4f} ({plan.accountant})")
    note = truncation_note(prepared.data_stats, cfg.data.max_rows_per_unit, cfg.data.sequence_length)
    if note:  # counted on the private data: the console's and plan.json's (internal)
        log(note)
    if prepared.dp and prepared.tokenizer.get("kind") == "private-dp":
        log(f"tokenizer: {prepared.tokenizer['summary']}")
    resume = RunDir(prepared.run_dir).resume_point()
    if resume is not None:
        log(f"resuming from step {resume['step']} of {plan.steps} (attempt {resume['attempt']})")
        # (every step ran: the launch only finishes the model; no step to refuse)
        why = _target_stop(prepared, resume["step"]) if resume["step"] < plan.steps else None
        if why is not None:  # not one step fits: say so without starting Ray
            _end_hold(prepared, "stopped", log)
            _driver_event(prepared, {"event": "stopped", "step": resume["step"], "reason": why,
                                     "cause": "ledger"})
            report = report_or_storage_error(prepared.run_dir)
            log(f"stopped early: {why} (found before starting the workers: nothing ran)")
            log(f"privacy report: {os.path.join(prepared.run_dir, 'privacy_report.md')}")
            log(f"epsilon = {report['epsilon']:.4f} at delta = {report['delta']:.3g} ({report['accountant']})")
            return prepared.run_dir
    error = None
    interrupted = False
    interrupts = GracefulInterrupt(prepared.run_dir, log, prepared.plan)
    try:
        _fit(prepared, log, interrupts)
        # The first Ctrl-C: the workers stopped after a whole step (or, when it came after
        # the last step, finished the run: then nothing was interrupted).
        interrupted = interrupts.requested and stopped_gracefully(prepared.run_dir)
    except (KeyboardInterrupt, SystemExit) as e:
        # A Ctrl-C before the workers started, a second one (stop at once), or SIGTERM:
        # nothing failed, and the same command resumes from the last checkpoint.
        error, interrupted = e, True
        _driver_event(prepared, {"event": "interrupted", "by": type(e).__name__})
    except BaseException as e:  # the ledger is durable; still write what we know
        # A disk that refused a write (or had no room for the next checkpoint): one message.
        error = storage_error(e, "the run", prepared.run_dir) or e
    finally:
        interrupts.clear()
    if interrupts.requested and not interrupted and error is None:
        log("Ctrl-C came after the last step: the run finished")
    _end_hold(prepared, "interrupted" if interrupted else "failed" if error else "ended", log)
    failure = None if not error or interrupted else \
        str(error) if isinstance(error, StorageError) else repr(error)
    report = report_or_storage_error(prepared.run_dir, failure=failure, interrupted=interrupted,
                                     after=error if isinstance(error, StorageError) else None)
    if report.get("stopped"):
        log(f"stopped early: {report['stopped']}")
    dp_evals = ((report.get("evaluation") or {}).get("dp") or [])
    if dp_evals:
        m = dp_evals[-1]
        log(f"DP evaluation after step {m['step']} (released with DP, publishable): loss "
            f"{m['loss']:.4f} ± {m['loss_std']:.4f}, token accuracy {m['accuracy']:.4f} ± "
            f"{m['accuracy_std']:.4f} (± the std of its noise)")
    log(f"run directory: {prepared.run_dir}")
    log(f"privacy report: {os.path.join(prepared.run_dir, 'privacy_report.md')}")
    if report.get("simulated"):
        log(f"{label}: simulated DP, nothing spent (no epsilon)")
    elif report.get("dp") is False:
        log(f"{label} (no epsilon)")
    else:
        log(f"epsilon = {report['epsilon']:.4f} at delta = {report['delta']:.3g} ({report['accountant']})")
    if interrupted:
        how = ("stopped by Ctrl-C after step" if error is None else "interrupted after step")
        raise RunInterrupted(f"{how} {report['steps_completed']} of {plan.steps}; "
                             f"{RESUME_HINT}") from None
    if error is not None:
        raise error
    out = cfg.output
    if out.push_to is not None and report.get("status") == "complete":
        try:
            export_run(prepared.run_dir, os.path.join(prepared.run_dir, "export"), merge=out.merge,
                       push=out.push_to, private=out.private, base_model=out.base_model,
                       license=out.license, log=log)
        except ExportError as e:
            raise ExportError(
                f"{e}\nThe model is trained and saved in {prepared.run_dir}; publish it later with "
                f"`llmdp export {prepared.run_dir} --to {os.path.join(prepared.run_dir, 'export')} "
                f"--push {out.push_to}`") from None
    return prepared.run_dir


def report_or_storage_error(run_dir: str, after: StorageError | None = None, **kw) -> dict:
    """`write_report`, after a check that its disk has room; a write the disk refuses is one
    `StorageError` naming the path, the error and the fix (the ledger is durable: a re-run
    writes the report). ``after``: the run's own disk error, said first."""
    try:
        check_free({run_dir: 0}, "the privacy report")
        return write_report(run_dir, **kw)
    except Exception as e:  # noqa: BLE001 - re-raised unless the disk is the cause
        err = storage_error(e, "writing the privacy report", os.path.join(run_dir, "privacy_report.json"))
        if err is None:
            raise
        first = f"{after}\nThe report could not be written either: " if after is not None else ""
        raise StorageError(f"{first}{err}") from None


def _driver_event(prepared: RunSpec, record: dict) -> None:
    """A line the driver adds to metrics.jsonl (rank 0 writes every other one)."""
    with open(prepared.paths.metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")


def _target_stop(prepared: RunSpec, step: int) -> str | None:
    """Why the run's target ε refuses its next step already (`LedgerService.target_refusal`)."""
    if prepared.ledger is None:
        return None
    svc = prepared.ledger.open()
    try:
        return svc.target_refusal(step)
    finally:
        svc.db.close()


def _fit(prepared: RunSpec, log, interrupts: GracefulInterrupt | None = None) -> None:
    interrupts = interrupts or GracefulInterrupt(prepared.run_dir, log, prepared.plan)
    import ray  # lazy: Ray (and its start-up cost) only where the run goes on Ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cfg = prepared.cfg
    started_ray = False
    local = None
    if not ray.is_initialized():
        # A local Ray sized for the workers, watched so that none of its processes outlives
        # this driver (even SIGKILLed); or, on a cluster node, that cluster (local is None).
        local = start_local_ray(prepared.run_dir, [cfg], log)
        started_ray = True

    # The single ledger writer, on the driver's node, shared by every attempt of the workers.
    actor_name = f"llmdp-ledger-{prepared.run_id}"
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # This run's environment for its workers and actor, given per run: the Ray may outlive
    # this run (localray.run_env).
    env = {"env_vars": run_env()}
    actor = None if prepared.ledger is None else ray.remote(LedgerService).options(  # baseline: none
        name=actor_name, num_cpus=0, scheduling_strategy=here,
        runtime_env=env).remote(**prepared.ledger.service)
    spec = prepared.with_ledger_actor(actor_name)
    if spec.spends:
        log(f"progress: {EPS_KEY} is the ε the ledger has charged so far, with the steps reserved "
            f"ahead of the current one (up to train.checkpoint_every={cfg.train.checkpoint_every}); "
            f"its last value is the report's")
    progress = Progress(spec.paths.metrics, spec.plan, spec.prior_releases,
                        spends=spec.spends)
    progress.start()
    try:
        trainer = TorchTrainer(
            functools.partial(ray_entry, spec),  # the run spec, shipped as it is
            scaling_config=ScalingConfig(
                num_workers=cfg.scaling.num_workers,
                use_gpu=cfg.scaling.use_gpu,
                resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
            ),
            run_config=RunConfig(
                name="checkpoints",
                storage_path=prepared.run_dir,
                # A failed worker group restarts from the latest checkpoint, up to this many times.
                failure_config=FailureConfig(max_failures=cfg.train.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                worker_runtime_env=env,
            ),
        )
        _without_unused_actors(trainer, own_ray=local is not None)
        # Ctrl-C: ours instead of Ray Train's (which aborts the workers mid-step): the first
        # stops the run after its current step, the second at once (`GracefulInterrupt`).
        trainer._register_sigint_handler = interrupts.install
        sigint = signal.getsignal(signal.SIGINT)
        try:
            trainer.fit()
        finally:
            if threading.current_thread() is threading.main_thread() and sigint is not None:
                signal.signal(signal.SIGINT, sigint)  # Ctrl-C while the report is written
    finally:
        progress.stop.set()
        progress.join(timeout=5)
        if actor is not None:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
        if local is not None:
            local.stop()  # after the shutdown: ends what is left of that Ray (agents)


def _without_unused_actors(trainer, own_ray: bool) -> None:
    """Leave out of Ray Train's default callbacks two that start an actor (a process of its
    own, ~1.3-2.7 CPU-s of imports each) that a llmdp run never uses:
    - the datasets callback, whose actor hands the workers shards of the trainer's Ray
      Datasets, started for every worker group: llmdp gives the trainer none (the workers
      draw their units from the unit store themselves);
    - on a Ray this launch started, the placement-group cleaner: a detached actor that
      frees the workers' placement group should the controller die without doing so. That
      Ray, with all it holds, ends with this driver (`_fit`'s `finally`, or, were the driver
      killed, its watchdog: `localray`). On a Ray that outlives the run (a cluster this
      driver joined, or one it found started: a sweep's, a caller's) it stays.
    (Ray Train's preemption watcher is left out by that local Ray's environment:
    `localray.LOCAL_RAY_ENV`.) Another Ray Train, without these classes, keeps its defaults."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import (
            PlacementGroupCleanerCallback,
        )
    except ImportError:  # pragma: no cover - a Ray Train without them
        return
    defaults = getattr(trainer, "_create_default_callbacks", None)
    if defaults is None:  # pragma: no cover - idem
        return
    unused = (DatasetsCallback, PlacementGroupCleanerCallback) if own_ray else (DatasetsCallback,)
    trainer._create_default_callbacks = lambda: [
        cb for cb in defaults() if not isinstance(cb, unused)]

