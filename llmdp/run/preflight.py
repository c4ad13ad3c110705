"""What a launch checks and says before it writes a run folder or touches a ledger: the
output folder (`run_lock`), what the contribution bound cut from the data
(`truncation_note`), and `llmdp train RECIPE --dry-run` (`dry_run`): the plan of the run
the same command would make, with what it would spend, and nothing written.

The dry run plans with `llmdp.run.planning.plan_run`, the function the real launch plans
with (`launch.prepare`), so its N, q, σ, T and ε are the run's; it writes only to the shared
caches (unit store, model files), reads the dataset's ledger read-only (never starting one,
holding or recording anything) and makes no run folder.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import yaml

from llmdp._fs import RunLock, private_files
from llmdp.config.schema import ConfigError, RecipeConfig, to_dict

__all__ = ["check_run_dir", "run_lock", "check_output_dir", "truncation_note", "dry_run"]


# What a run directory's checkpoints and ledger depend on: resuming under a recipe that
# changes any of these would mix two different trainings (and two guarantees) in one run.
_RESUME_KEYS = ("model", "data", "privacy", "optim", "train.expected_batch_size", "train.steps",
                "train.epochs", "train.seed")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def check_run_dir(run_dir: str, cfg: RecipeConfig) -> None:
    """Refuse to reuse a run directory that holds a run of a different recipe."""
    old_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(old_path):
        return
    with open(old_path, encoding="utf-8") as f:
        old = _flatten(json.loads(json.dumps(yaml.safe_load(f) or {})))
    old.setdefault("privacy.dp", True)  # written before privacy.dp existed: a DP run
    new = _flatten(json.loads(json.dumps(to_dict(cfg))))
    # A key the old config lacks is a field added to the schema since: not a change.
    changed = sorted(k for k in old
                     if any(k == r or k.startswith(r + ".") for r in _RESUME_KEYS)
                     and old[k] != new.get(k))
    if changed:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise ConfigError(
            f"output.name: {os.path.basename(run_dir)!r} already holds a run ({run_dir}) of a "
            f"different recipe ({shown}{more}); resuming it would mix two trainings. Give this "
            f"run its own name (e.g. output.name={os.path.basename(run_dir)}-2) or delete that "
            f"directory",
            key="output.name",
        )


def check_output_dir(cfg: RecipeConfig) -> None:
    """``output.dir`` must be a folder this process can write, or creatable in one; and the
    run folder ``output.dir/output.name``, when it exists, a folder (`ConfigError` naming
    the field, the value and the fix, before anything is written)."""
    out = os.path.abspath(cfg.output.dir)
    run_dir = os.path.abspath(cfg.run_dir)
    fix = "give a folder you can write (it is created if missing), e.g. output.dir=runs"
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"output.name: {run_dir} is a file, not a run folder; give the run "
                          f"another output.name, or move that file", key="output.name")
    existing = out
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == out else f"cannot be created: {existing} is a file"
        raise ConfigError(f"output.dir: {out} {where}, not a folder; {fix}", key="output.dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == out else f" (its nearest existing folder {existing})"
        raise ConfigError(f"output.dir: {out}{where} is not writable (permission denied, or a "
                          f"read-only file system); {fix}", key="output.dir")


def run_lock(cfg: RecipeConfig) -> RunLock:
    """The launch's `RunLock` on its run folder, after `check_output_dir`; an OS error
    taking it (a read-only file system, say) is a `ConfigError` naming output.dir."""
    check_output_dir(cfg)
    try:
        return RunLock(cfg.run_dir)
    except OSError as e:
        out = os.path.abspath(cfg.output.dir)
        raise ConfigError(
            f"output.dir: {out} cannot be written ({e.strerror or e}); give a folder you can "
            f"write (it is created if missing), e.g. output.dir=runs", key="output.dir") from None


def _truncation(stats: dict) -> dict | None:
    """{units, unit_kind, tokens, share} the contribution bound cut (None: nothing cut)."""
    kind = stats.get("kind")
    units = stats.get("users_capped") if kind == "user" else stats.get("records_truncated")
    cut = int(stats.get("tokens_truncated") or 0)
    if kind not in ("document", "user") or not units or not cut:
        return None
    kept = int(stats.get("num_tokens") or 0)
    return {"units": int(units), "unit_kind": kind, "tokens": cut,
            "share": cut / (cut + kept) if cut + kept else 0.0}


def truncation_note(stats: dict, max_rows: int, sequence_length: int) -> str | None:
    """The launch's line on what ``data.max_rows_per_unit`` cut (counts of the private data:
    the operator's console and the internal report's data statistics, never a published
    report), or None when it cut nothing."""
    t = _truncation(stats)
    if t is None:
        return None
    what = "users" if t["unit_kind"] == "user" else "documents"
    return (f"truncation: {t['units']} {what} are longer than data.max_rows_per_unit="
            f"{max_rows} rows of {sequence_length} tokens and were cut to it; {t['tokens']} "
            f"tokens ({t['share']:.1%} of the data) are not trained on. Raise "
            f"data.max_rows_per_unit (more compute per unit) to keep more (internal: counted "
            f"on the private data)")


def _unit_meta(planned) -> dict:
    spec = planned.unit_spec
    return {"unit": {**spec.to_dict(), "description": spec.describe()}}


def _budget(cfg: RecipeConfig, planned, epsilon: float, log) -> dict:
    """The dataset's budget, what it has spent for this run's unit and what it would be at
    after this run: read from its ledger read-only (a ledger that does not exist yet has
    spent nothing)."""
    from llmdp.data.ids import canonical_id
    from llmdp.data.sources import dataset_identity  # lazy: it imports datasets
    from llmdp.privacy.accounting import release_entries
    from llmdp.privacy.ledger import (
        DatasetBudget,
        LedgerDB,
        dataset_epsilon,
        describe_location,
        is_url,
        recorded_budget,
        resolve_location,
        unit_epsilon,
    )

    plan = planned.plan
    location = resolve_location(cfg.privacy.ledger)
    mine = dataset_identity(cfg.data)["dataset_id"]
    records: list = []
    if is_url(location) or os.path.exists(location):
        db = LedgerDB(location, read_only=True)
        try:
            ids = db.ledgers()
            found = mine if mine in ids else next((i for i in ids if canonical_id(i) == mine), None)
            records = db.records(found) if found is not None else []
            mine = found or mine
        finally:
            db.close()
    meta = _unit_meta(planned)
    rec = recorded_budget(records)
    budget = rec or (None if cfg.privacy.budget_epsilon is None else DatasetBudget(
        float(cfg.privacy.budget_epsilon), plan.delta, plan.accountant, meta["unit"]))
    out = {"dataset_id": mine, "ledger": describe_location(location), "records": len(records),
           "budget_epsilon": None if budget is None else budget.epsilon,
           "budget_recorded": rec is not None, "run_epsilon": epsilon}
    if budget is None:
        spent = unit_epsilon(records, meta, plan.accountant_delta, plan.accountant)
        out.update(epsilon_spent=spent, delta=plan.accountant_delta)
        log(f"budget: the dataset {mine!r} has no budget; ε spent on it for this privacy unit "
            f"= {spent:.4f} at δ = {plan.accountant_delta:.3g}; this run would spend ε = "
            f"{epsilon:.4f}")
        return out
    tail = plan.delta - plan.accountant_delta
    composed = DatasetBudget(budget.epsilon, budget.delta - tail, budget.accountant, budget.unit)
    recorded = {r.get("run_id") for r in records}
    missing = [r for r in planned.prior_releases if r.get("run_id") not in recorded]
    evals = planned.eval_plan.entries() if planned.eval_plan is not None else []
    extra = release_entries(missing)[0] + evals + [(plan.step_event(), plan.ledger_steps)]
    spent = unit_epsilon(records, meta, composed.delta, composed.accountant)
    after = dataset_epsilon(records, composed, extra=extra,
                            extra_threshold=release_entries(missing)[1])
    out.update(epsilon_spent=spent, epsilon_after_run=after, delta=composed.delta,
               epsilon_left=max(0.0, budget.epsilon - spent), fits=after <= budget.epsilon)
    log(f"budget: the dataset {mine!r} has spent ε = {spent:.4f} of its budget "
        f"{budget.epsilon:g} at δ = {composed.delta:.3g} ({budget.accountant}"
        f"{'' if rec is not None else ', privacy.budget_epsilon: not recorded yet'}); ε left = "
        f"{out['epsilon_left']:.4f}. This run would spend ε = {epsilon:.4f}: after it the "
        f"dataset would be at ε = {after:.4f} (with what live runs hold)"
        + ("" if out["fits"] else " > the budget: the real run would be refused"))
    return out


def dry_run(cfg: RecipeConfig, log=print) -> dict:
    """`llmdp train RECIPE --dry-run`: tokenize and plan ``cfg`` as its run would
    (`plan_run`), print the plan, the truncation, the DP evaluation's noise, the memory per
    worker (``llmdp.train.memory``) and the budget, and return them; no run folder, no
    ledger entry, no hold."""
    from llmdp.privacy.accounting import composed_epsilon
    from llmdp.run.planning import plan_run, warn_open

    check_output_dir(cfg)  # what the run would be refused for first
    check_run_dir(os.path.abspath(cfg.run_dir), cfg)
    with private_files(cfg.output.group_readable):  # the unit cache: private data at rest
        warn_open(cfg, log)
        planned = plan_run(cfg, log, memory=True)
    plan, stats = planned.plan, planned.data_stats
    evals = [] if planned.eval_plan is None else [
        {"event": _event_json(planned.eval_plan.event()), "count": planned.eval_plan.releases}]
    spends = plan.dp and not cfg.privacy.simulate  # a simulated run releases nothing
    eps = composed_epsilon(plan, list(planned.prior_releases) + evals) if spends else math.inf
    out = {"dataset_size": plan.dataset_size, "sampling_probability": plan.sampling_probability,
           "expected_batch_size": plan.expected_batch_size, "steps": plan.steps,
           "noise_multiplier": plan.noise_multiplier if plan.dp else None,
           "delta": plan.delta if plan.dp else None,
           "epsilon": eps if spends else None, "accountant": plan.accountant,
           "truncation": _truncation(stats), "dp_eval_std": None, "budget": None,
           "memory_per_worker": planned.memory.to_dict()}
    if not plan.dp:
        log(f"dry run: NON-PRIVATE baseline: N={plan.dataset_size} units, q="
            f"{plan.sampling_probability:.5g}, T={plan.steps}; no noise, no ε, no ledger")
    elif not spends:
        log(f"dry run: simulated DP on data declared public: N={plan.dataset_size} units, q="
            f"{plan.sampling_probability:.5g}, B={plan.expected_batch_size:g}, T={plan.steps} "
            f"steps, sigma={plan.noise_multiplier:.4f} (the private run's, for "
            f"{cfg.privacy.simulate_units or plan.dataset_size} units); no ε, no ledger")
    else:
        log(f"dry run: N={plan.dataset_size} units, q={plan.sampling_probability:.5g}, B="
            f"{plan.expected_batch_size:g}, T={plan.steps} steps, sigma="
            f"{plan.noise_multiplier:.4f}, epsilon={eps:.4f} at delta={plan.delta:.3g} "
            f"({plan.accountant})")
    note = truncation_note(stats, cfg.data.max_rows_per_unit, cfg.data.sequence_length)
    log(note or "truncation: no unit was cut by data.max_rows_per_unit")
    log(planned.memory.line())
    from llmdp.config.best import hyperparameter_note

    if (tuned := hyperparameter_note(cfg)) is not None:  # train.hyperparameters_from
        out["hyperparameters"] = tuned
        log(f"hyper-parameters: {tuned['note']}")
    if planned.eval_plan is not None:
        out["dp_eval_std"] = planned.eval_plan.expected_std(planned.eval_store.num_units)
    if spends:
        out["budget"] = _budget(cfg, planned, eps, log)
    log("dry run: nothing was trained, recorded or held; no run folder was made")
    return out


def _event_json(event):
    from llmdp.privacy.accounting import event_to_json

    return event_to_json(event)
