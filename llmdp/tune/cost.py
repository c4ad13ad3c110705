"""What a sweep costs (`llmdp sweep`, `llmdp.tune.sweep`): pure accounting over (event, count)
releases with dp-accounting, and the budget check made before any trial runs.

(a) `sweep_cost` ``composition``: every trial's releases and, once, the earlier releases they
    all build on (a private tokenizer), composed with the recipe's accountant.
(b) `sweep_cost` ``repeat_and_select`` (random trials): Papernot & Steinke (ICLR 2022),
    ``RepeatAndSelectDpEvent(one trial's releases, mean, shape)`` with dp-accounting's RDP
    accountant, composed with the earlier releases: a bound on the selected trial's output
    only.
"""

from __future__ import annotations

import json
import math

from dp_accounting import dp_event

from llmdp.config.choices import Accountant
from llmdp.config.validate import ConfigError
from llmdp.privacy import accounting as _acc
from llmdp.privacy.accounting import compose, event_to_json, is_truncated, release_entries
from llmdp.privacy.ledger import (
    BudgetError,
    DatasetBudget,
    LedgerDB,
    budget_refusal,
    hold_entries,
    holder_alive,
    live_holds,
    open_dataset_ledger,
    recipe_mismatch,
    recorded_budget,
    release_entries_of,
    split_by_unit,
    unit_key,
)
from llmdp.privacy.noise import NoiseTail

__all__ = ["COVERS_COMPOSITION", "COVERS_RANDOM", "sweep_cost", "check_sweep_budget",
           "own_entries", "unique_priors", "merge_entries", "event_key"]

COVERS_COMPOSITION = ("every trial's model and DP evaluations (all trials composed; the earlier "
                      "releases they build on counted once)")
COVERS_RANDOM = ("ONLY the selected trial's output (its model and its DP evaluation); the other "
                 "trials' models must not be released. The dataset ledger records every trial "
                 "and its budgets compose them all (conservative)")


def event_key(event) -> str:
    """An event's canonical JSON: equal events, equal keys."""
    return json.dumps(event_to_json(event), sort_keys=True)


def merge_entries(entries) -> list:
    """Identical events merged into one (event, count) (composition is commutative)."""
    events, counts = {}, {}
    for e, c in entries:
        k = event_key(e)
        events.setdefault(k, e)
        counts[k] = counts.get(k, 0) + int(c)
    return [(events[k], counts[k]) for k in events if counts[k]]


def _upper(entry_lists) -> list:
    """Per event, the largest count of any list: a composition that dominates each (RDP is
    additive and >= 0 per event). Equal lists give that list."""
    events, counts = {}, {}
    for entries in entry_lists:
        for e, c in merge_entries(entries):
            k = event_key(e)
            events.setdefault(k, e)
            counts[k] = max(counts.get(k, 0), c)
    return [(events[k], counts[k]) for k in events]


def _tails(tails, scale: float = 1.0) -> NoiseTail | None:
    """The noise tails of several trials together (bad events add, lost masses add:
    `noise_tail`), times ``scale``; None when no trial folds its tails in."""
    tails = [t for t in tails if t is not None]
    if not tails:
        return None
    return NoiseTail(eta=min(1.0, scale * sum(t.eta for t in tails)),
                     lost_mass=min(1.0, scale * sum(t.lost_mass for t in tails)))


def _epsilon_at(entries, delta: float, tail: NoiseTail | None, d_thr: float, accountant: str):
    """(ε, δ_accountant): ε at ``delta`` less the noise ``tail`` (inf when nothing is left)."""
    d_acc = float(delta) if tail is None else tail.accountant_delta(delta)
    if d_acc <= d_thr:
        return math.inf, d_acc
    return _acc.epsilon_with_threshold(entries, d_acc, d_thr, accountant), d_acc


def sweep_cost(trial_entries, prior_entries, delta: float, accountant: Accountant = Accountant.PLD,
               random: tuple[float, float] | None = None, *, prior_delta_threshold: float = 0.0,
               planned_trial=None, trial_tails=None, planned_tail=None) -> dict:
    """What a sweep's trials cost together, at the published ``delta``.

    ``trial_entries``: per trial, its (event, count) releases (without the earlier ones);
    ``prior_entries``: the earlier releases they all build on (counted once; their
    thresholds' δ: ``prior_delta_threshold``). (a) ``composition``: all of them composed with
    ``accountant``. (b) ``random=(mean, shape)``: ε of ``RepeatAndSelectDpEvent(one trial,
    mean, shape)`` composed with the earlier releases, RDP; one trial = per event the
    largest count among the trials (and ``planned_trial``, a trial's planned releases), which
    is every trial's releases when they are equal.

    The noise generator's truncated tails (``trial_tails``: per trial its `NoiseTail` over
    its recorded releases, None for one that does not fold them in; ``planned_tail``: a
    trial's planned one) are part of ``delta``, as in a run's report: (a) is computed at δ
    less every trial's tails together; (b) at δ less μ times one trial's (the largest): the
    bad events of the K trials run add up to E[K]·η = μ·η (Wald), and the kept mass is at
    least E[Z**K] >= Z**μ >= 1 - μ·(1 - Z) (Jensen). Each bound states its
    ``delta_accountant``.
    """
    prior = list(prior_entries)
    everything = merge_entries(prior + [e for t in trial_entries for e in t])
    trial_tails = list(trial_tails or [])
    eps_a, d_acc_a = _epsilon_at(everything, delta, _tails(trial_tails), prior_delta_threshold,
                                 accountant)
    out = {
        "delta": float(delta),
        "composition": {
            "epsilon": eps_a, "delta_accountant": d_acc_a,
            "accountant": accountant, "trials": len(trial_entries), "covers": COVERS_COMPOSITION},
        "repeat_and_select": None,
    }
    if random is None:
        return out
    mean, shape = float(random[0]), float(random[1])
    one = _upper(list(trial_entries) + ([planned_trial] if planned_trial else []))
    if not one:
        raise ValueError("sweep_cost: random trials need one trial's releases (trial_entries or "
                         "planned_trial)")
    if any(is_truncated(e) for e, _ in one):
        raise ConfigError(
            "sweep.trials: random is bounded with dp-accounting's RDP accountant "
            "(RepeatAndSelectDpEvent), which cannot account truncated Poisson sampling "
            "(privacy.sampler: truncated-poisson); use privacy.sampler: poisson or trials: grid",
            key="sweep.trials")
    event = dp_event.RepeatAndSelectDpEvent(compose(one), mean, shape)
    ones = [t for t in trial_tails + [planned_tail] if t is not None]
    one_tail = None if not ones else NoiseTail(eta=max(t.eta for t in ones),
                                               lost_mass=max(t.lost_mass for t in ones))
    eps_b, d_acc_b = _epsilon_at(prior + [(event, 1)], delta, _tails([one_tail], mean),
                                 prior_delta_threshold, Accountant.RDP)
    out["repeat_and_select"] = {
        "epsilon": eps_b, "delta_accountant": d_acc_b,
        "accountant": Accountant.RDP, "mean_trials": mean, "shape": shape if math.isfinite(shape) else "inf",
        "distribution": "poisson" if math.isinf(shape) else "geometric" if shape == 1 else f"shape {shape:g}",
        "reference": "Papernot & Steinke, Hyperparameter tuning with Renyi differential privacy "
                     "(ICLR 2022)",
        "covers": COVERS_RANDOM,
    }
    return out


def own_entries(planned) -> list:
    """A planned trial's releases without the earlier ones it builds on."""
    left = {}
    for e, c in release_entries(planned.prior_releases)[0]:
        left[event_key(e)] = left.get(event_key(e), 0) + c
    out = []
    for e, c in merge_entries(planned.entries()):
        drop = min(c, left.get(event_key(e), 0))
        left[event_key(e)] = left.get(event_key(e), 0) - drop
        if c - drop:
            out.append((e, c - drop))
    return out


def unique_priors(release_lists) -> list[dict]:
    """The earlier releases of several trials (plan.json ``prior_releases``), each once (by
    release id): every trial that builds on a private tokenizer builds on the same release."""
    seen, out = set(), []
    for rels in release_lists:
        for r in rels:
            k = r.get("release_id") or r.get("run_id") or json.dumps(r.get("event"), sort_keys=True)
            if k not in seen:
                seen.add(k)
                out.append(r)
    return out


def _recorded_budget_of(cfg) -> DatasetBudget | None:
    """The recorded budget of ``cfg``'s dataset, read without starting its ledger."""
    import os

    from llmdp.data.sources import dataset_identity  # lazy: it imports datasets
    from llmdp.privacy.ledger import is_url, resolve_location

    location = resolve_location(cfg.privacy.ledger)
    if not is_url(location) and not os.path.exists(location):
        return None
    db = LedgerDB(location, read_only=True)
    try:
        return recorded_budget(db.records(dataset_identity(cfg.data)["dataset_id"]))
    finally:
        db.close()


def check_sweep_budget(cfgs: list, planned: list, log=print, hide_count: bool = False) -> dict | None:
    """Refuse (`BudgetError`) a sweep whose trials still to run do not fit in the dataset's
    budget (recorded in its ledger, whatever the recipes say; without one, the trials'
    ``privacy.budget_epsilon``, the smallest) with what the dataset ledger has spent for their
    unit and what live runs hold; None without a budget. A trial recipe stating another
    budget than the recorded one, or another privacy unit, is refused here already (each
    trial's launch would be). ``hide_count``: a random search under bound (b), whose number
    of trials K stays internal: neither the log line nor the refusal names how many trials
    are to run or what they add up to."""
    if not cfgs:
        return None
    budgets = [c.privacy.budget_epsilon for c in cfgs if c.privacy.budget_epsilon is not None]
    if not budgets and _recorded_budget_of(cfgs[0]) is None:
        return None
    ledger = open_dataset_ledger(cfgs[0].data, cfgs[0].privacy.ledger, planned[0].source_sha, log=log)
    db = LedgerDB(ledger["location"])
    try:
        records = db.records(ledger["dataset_id"])
    finally:
        db.close()
    ds_budget = recorded_budget(records)
    budget = ds_budget.epsilon if ds_budget is not None else min(budgets)
    holds = {rid: h for rid, h in live_holds(records).items() if holder_alive(h["hold"].get("lock"))}
    groups: dict[str, list] = {}
    for c, p in zip(cfgs, planned):
        meta = {"unit": {**p.unit_spec.to_dict(), "description": p.unit_spec.describe()}}
        groups.setdefault(unit_key(meta), []).append((c, p, meta))
    out = {}
    for unit, members in groups.items():
        meta = members[0][2]
        same, _ = split_by_unit(records, meta)
        recorded = {r.get("run_id") for r in records}
        missing = [r for r in unique_priors([p.prior_releases for _, p, _ in members])
                   if r.get("run_id") not in recorded]  # earlier releases not in this ledger yet
        trials = [e for _, p, _ in members for e in own_entries(p)]
        # at the δ each trial's ledger service checks budgets at (δ less its noise tails)
        delta = min(p.plan.accountant_delta for _, p, _ in members)
        acc = members[0][0].privacy.accountant
        if ds_budget is not None:  # the dataset's budget: its δ, its accountant, its unit
            for c, p, m in members:
                mine = None if c.privacy.budget_epsilon is None else DatasetBudget(
                    c.privacy.budget_epsilon, p.plan.delta, c.privacy.accountant, m["unit"])
                why = (recipe_mismatch(records, mine, dataset_id=ledger["dataset_id"],
                                       where=ledger["shown"])
                       or budget_refusal(records, m, recipe=None, dataset_id=ledger["dataset_id"],
                                         where=ledger["shown"])[1])
                if why:
                    raise BudgetError(f"{why}. No trial was run")
            # the dataset's δ less the trials' noise tails (as each trial's service checks it)
            delta = ds_budget.delta - max(p.plan.delta - p.plan.accountant_delta for _, p, _ in members)
            acc = ds_budget.accountant
        entries = (release_entries_of(same) + hold_entries(holds, meta)
                   + release_entries(missing)[0] + trials)
        total = _acc.epsilon_with_threshold(merge_entries(entries), delta,
                                            _acc.threshold_delta(same + missing), acc)
        spent = _acc.epsilon_with_threshold(release_entries_of(same), delta,
                                            _acc.threshold_delta(same), acc)
        held = hold_entries(holds, meta)
        holders = sorted(rid for rid, h in holds.items() if unit_key(h["hold"].get("meta")) == unit)
        out[unit] = {"budget_epsilon": budget, "epsilon_spent": spent, "epsilon_with_sweep": total,
                     "trials_to_run": len(members), "delta": delta, "accountant": acc,
                     "live_holds": holders}
        trials_text = ("the drawn trials (their number stays internal: sweep.internal.json)"
                       if hide_count else f"the {len(members)} trial(s)")
        if total > budget:
            raise BudgetError(
                (f"privacy.budget_epsilon={budget:g}" if ds_budget is None else
                 f"the dataset's budget ε = {budget:g} (recorded in its ledger)")
                + f": the sweep does not fit. The dataset ledger "
                f"{ledger['dataset_id']!r} ({ledger['shown']}) has spent ε = {spent:.4f} at δ = "
                f"{delta:.3g} for the privacy unit {unit!r}"
                + (f", live run(s) {', '.join(holders)} hold {sum(c for _, c in held)} more "
                   f"step(s)" if held else "")
                + f"; with {trials_text} still to run it would be "
                + ("over the budget" if hide_count else f"ε = {total:.4f} > {budget:g}")
                + ". No trial was run. Fewer trials (a smaller grid or --mean-trials), a "
                "smaller privacy.target_epsilon per trial, or a larger budget")
        log(f"sweep budget: ε spent = {spent:.4f}; " + (
            f"{trials_text} fit in {budget:g}" if hide_count else
            f"with the {len(members)} trial(s) to run ε = {total:.4f} <= {budget:g}"))
    return out
