"""Accounted hyper-parameter tuning: `llmdp sweep RECIPE [--grid key=v1,v2 ...]`.

Every trial is an ordinary DP run (`trainer.run`) named ``<output.name>-trial-<i>`` (a
random search: ``<output.name>-trial-<random id>``, a name that does not reveal K) in
``output.dir``, recorded in the dataset's ledger like any run (the same data, the same
``data.dataset_id``: the ledger composes the trials, and every budget counts them). Trials
are chosen by `llmdp.tune.grid` (every grid point, or a Papernot-Steinke random search);
the selection reads only the trials' DP evaluations (the last ``evaluation.dp`` entry of
each report: the lowest DP eval loss), never a metric computed without DP.

What the sweep costs (`sweep_cost`), in ``<output.dir>/<output.name>-sweep/sweep.json`` (a
random search: ``sweep.internal.json``, see below):

(a) always: the composition of every trial's recorded releases (each trial's
    ``ledger.jsonl``) and, once, the earlier releases they build on (a private tokenizer:
    ``plan.json``'s ``prior_releases``, the same release for every trial), at the recipe's
    δ with its accountant. It covers every trial's model and DP evaluations (trials draw
    from the OS: a seeded recipe, whose noise anyone with the seed recomputes, is refused).
(b) random trials: Papernot & Steinke's bound, ``RepeatAndSelectDpEvent(one trial's
    releases, μ, shape)`` with dp-accounting's RDP accountant (composed with the earlier
    releases). It covers only the selected trial's output (its model and its DP
    evaluation): the other trials' models must not be released. It needs every trial to
    make the same releases: a random sweep whose grid changes them is refused.

Before any trial runs, a recipe with ``privacy.budget_epsilon`` is checked: what the dataset
ledger has spent for the unit, what live runs hold, and every trial still to run, composed,
must fit, else `BudgetError` (each trial's run still holds its own steps, as any run does).
A random sweep's draw (K, the grid points and the trials' names) is written to
sweep.internal.json before that check and before the first trial: re-running the same
command resumes the same draw, and a finished trial is not run again (`trainer.run` says
"already complete").

What may be published (`publication`). (b) holds only with K hidden, so a random search
splits its output: sweep.md and sweep.json are the publishable part (the selected trial
and (b): the same content whatever K was drawn), sweep.internal.md and .json hold
everything else (K, every trial, (a), the budget figures), marked internal, and the console
never prints K. (a) holds for every K: under (a) everything may be published, and when
(a) is the smaller ε, sweep.internal.md says it is the better statement. A grid sweep has no
K: its sweep.md and sweep.json hold everything, publishable under (a).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets

from llmdp.config.validate import ConfigError
from llmdp.config.yamlio import to_dict
from llmdp.tune.cost import (
    check_sweep_budget,
    event_key,
    merge_entries,
    own_entries,
    sweep_cost,
    unique_priors,
)
from llmdp.tune.grid import SweepSpec, draw_random_trials, resolve_sweep
from llmdp.tune.trials import _describe, _read_json, _trial_config, _write_json

__all__ = ["SWEEP_JSON", "SWEEP_MD", "SWEEP_INTERNAL_JSON", "SWEEP_INTERNAL_MD", "sweep_cost",
           "select_trial", "selection_refusal", "check_sweep_budget", "run_sweep", "render_markdown",
           "render_public_markdown", "publishable_state", "publication"]  # sweep_cost, check_sweep_budget: llmdp.tune.cost

SWEEP_JSON, SWEEP_MD = "sweep.json", "sweep.md"
# A random search's internal part: K, every trial, bound (a). Bound (b) assumes K hidden.
SWEEP_INTERNAL_JSON, SWEEP_INTERNAL_MD = "sweep.internal.json", "sweep.internal.md"
SWEEP_VERSION = 1
INTERNAL_NOTE = ("INTERNAL, not for publication under bound (b): this file reveals K, the "
                 "number of trials drawn, which bound (b) assumes "
                 "hidden (it holds for the selected trial's output only while K is secret: "
                 "published beside K, that output's ε is much larger). Publishable under (b): "
                 f"{SWEEP_MD} and {SWEEP_JSON}. Everything may be published only under bound (a).")


def _last_dp_eval(report: dict | None) -> dict | None:
    """The last DP evaluation of a report (``evaluation.dp[-1]``), or None."""
    ev = (report or {}).get("evaluation") or {}
    dp = ev.get("dp") if isinstance(ev, dict) else None
    return dp[-1] if isinstance(dp, list) and dp and isinstance(dp[-1], dict) else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def select_trial(rows: list[dict]) -> dict | None:
    """The trial with the lowest DP eval loss (``row["dp_eval"]["loss"]``; ties: the first);
    None if no trial has one. Reads nothing else: internal metrics are never selected on."""
    ok = [r for r in rows if _finite((r.get("dp_eval") or {}).get("loss"))]
    return min(ok, key=lambda r: (r["dp_eval"]["loss"], r["trial"])) if ok else None


def selection_refusal(rows: list[dict]) -> str | None:
    """Why no trial may be selected (None: one may): the DP evaluations' noise std is larger
    than the spread of the DP losses the selection would choose between, so the choice would
    be made by the noise (issue 30: 5.19 ± 2.94 was selected over 8.00 ± 3.47 while the
    internal losses ranked them the other way)."""
    ok = [r["dp_eval"] for r in rows if _finite((r.get("dp_eval") or {}).get("loss"))]
    if len(ok) < 2:
        return None
    losses = [d["loss"] for d in ok]
    spread = max(losses) - min(losses)
    std = max(float(d.get("loss_std") or 0.0) for d in ok)
    if std <= spread:
        return None
    return (f"the trials' DP evaluation losses span {spread:.3g}, less than their noise std "
            f"(up to ± {std:.3g}): a selection on them would be made by the noise, so none is "
            f"made. Hold out more units or raise eval.epsilon so that the std is well below "
            f"the differences between trials")


# ---------------------------------------------------------------------- planning
def _check_trials(cfgs: list, points: list) -> None:
    """Every trial: a DP run with a DP evaluation, on one dataset ledger."""
    from llmdp.data.sources import dataset_identity
    from llmdp.privacy.ledger import resolve_location

    def where(p, prefix: str) -> str:  # the grid point if it sets that key, else the recipe
        return (f"the grid point ({_describe(p)})"
                if any(o.split("=", 1)[0].startswith(prefix) for o in p) else "the recipe")

    for c, p in zip(cfgs, points):
        if not c.privacy.dp:
            raise ConfigError(
                f"privacy.dp: false in {where(p, 'privacy.dp')}: a sweep's trials are DP runs "
                f"(selected by their DP evaluation, recorded in the dataset ledger); a "
                f"non-private baseline is a separate `llmdp train` run", key="privacy.dp")
        if c.privacy.rng == "seeded":
            # Bounds (a)/(b) would not hold against whoever knows the seed: they recompute
            # every trial's noise (and sweep.md says (a) covers every trial's model).
            raise ConfigError(
                f"privacy.rng: seeded in {where(p, 'privacy.rng')}: a sweep publishes its trials "
                f"under bound (a) or (b), which no seeded run has against anyone who knows the "
                f"seed; set privacy.rng: secure (and no privacy.seed) for a sweep",
                key="privacy.rng")
        if c.eval.epsilon is None and c.eval.noise_multiplier is None:
            raise ConfigError(
                f"eval.epsilon: not set in {where(p, 'eval.')}: a sweep selects its trial by a DP "
                f"evaluation (selecting on metrics computed without DP would leak the held-out data), so "
                f"every trial needs one: set eval.epsilon (e.g. eval.epsilon=0.5) or "
                f"eval.noise_multiplier, and held-out data (e.g. data.eval.fraction=0.05)",
                key="eval.epsilon")
    where = {(dataset_identity(c.data)["dataset_id"], resolve_location(c.privacy.ledger))
             for c in cfgs}
    if len(where) > 1:
        raise ConfigError(
            f"sweep.grid: the trials would be recorded in different dataset ledgers ({sorted(where)}); "
            f"a sweep's trials are on one dataset: do not sweep data sources, data.dataset_id or "
            f"privacy.ledger", key="sweep.grid")


def _plan_all(cfgs: list, points: list, plan_trial, log) -> list:
    """plan_trial per grid point; points that differ only in what cannot change the plan
    (optim, scaling, output) share one plan."""
    memo, out = {}, []
    for c, p in zip(cfgs, points):
        d = to_dict(c)
        key = json.dumps({k: v for k, v in d.items() if k not in ("optim", "scaling", "output", "sweep")},
                         sort_keys=True, default=str)
        if key not in memo:
            log(f"sweep: planning {_describe(p)}")
            memo[key] = plan_trial(c, log=log)
        out.append(memo[key])
    return out


def _check_same_releases(planned: list, points: list) -> None:
    def sig(p):
        return sorted((event_key(e), c) for e, c in merge_entries(p.entries()))

    first = sig(planned[0])
    for p, pt in zip(planned[1:], points[1:]):
        if sig(p) != first:
            def desc(x):
                pl = x.plan
                return (f"q={pl.sampling_probability:.4g}, σ={pl.noise_multiplier:.4g}, "
                        f"T={pl.steps}, {sum(c for _, c in x.entries())} release(s)")

            raise ConfigError(
                f"sweep.trials: random (Papernot-Steinke) bounds the selected trial with ONE "
                f"trial's privacy loss, so every grid point must make the same DP releases; "
                f"{_describe(points[0])} ({desc(planned[0])}) and {_describe(pt)} ({desc(p)}) "
                f"differ. Sweep only keys that leave the privacy unchanged (optim.*, ...), or use "
                f"trials: grid (cost: the composition of all trials)", key="sweep.trials")


# ---------------------------------------------------------------------- state
def _resumed_draw(state: dict | None, spec: SweepSpec, points: list, path: str):
    """The trials' grid points of an earlier launch of this sweep (None: a new sweep); a
    sweep.json of another grid is refused."""
    if state is None:
        return None
    if state.get("spec") != json.loads(json.dumps(spec.to_dict())) or \
            state.get("points") != [list(p) for p in points]:
        raise ConfigError(
            f"{path} belongs to a sweep with another grid or trials setting ({state.get('spec')}); "
            f"its trials (and a random sweep's draw) are that sweep's. Give this sweep its own "
            f"output.name", key="output.name")
    return state.get("trial_points")


def _trial_row(i: int, point, cfg, point_index: int) -> dict:
    from llmdp.record.rundir import RunDir

    rd = RunDir(cfg.run_dir)
    report = _read_json(rd.file("privacy_report.json"))
    dp = _last_dp_eval(report)
    keep = ("step", "loss", "loss_std", "accuracy", "accuracy_std", "count", "noise_multiplier")
    return {"trial": i, "name": cfg.output.name, "point": point_index, "overrides": list(point),
            "run_dir": rd.path, "status": (report or {}).get("status", "not run"),
            "epsilon": (report or {}).get("epsilon"), "delta": (report or {}).get("delta"),
            "dp_eval": None if dp is None else {k: dp.get(k) for k in keep if k in dp}}


def _recorded(cfg, planned) -> tuple[list, list, object]:
    """(this trial's releases in its ledger.jsonl, the earlier releases in its plan.json, the
    noise tails of its recorded releases at its plan's noise: `spent.ledger_noise_tail`)."""
    from llmdp.privacy.ledger import Ledger
    from llmdp.record.rundir import RunDir
    from llmdp.report.spent import ledger_noise_tail

    rd = RunDir(cfg.run_dir)
    ledger = Ledger(rd.ledger_path) if os.path.exists(rd.ledger_path) else None
    entries = ledger.entries() if ledger is not None else []
    tail = ledger_noise_tail(planned.plan, ledger.records() if ledger is not None else [])
    return entries, (rd.prior_releases if rd.exists() else list(planned.prior_releases)), tail


# ---------------------------------------------------------------------- the sweep
def run_sweep(cfg, grid=(), **kw) -> dict:
    """`_run_sweep` with everything it writes owner-only (``output.group_readable``: group
    too): the sweep's internals are computed on the private data."""
    from llmdp._fs import private_files

    with private_files(cfg.output.group_readable):
        return _run_sweep(cfg, grid, **kw)


def _run_sweep(cfg, grid=(), *, trials: str | None = None, mean_trials: float | None = None,
               distribution: str | None = None, log=print, run_trial=None, plan_trial=None,
               rng=None, write_best: str | None = None) -> dict:
    """Run the sweep of recipe ``cfg`` (its ``sweep`` section with the command line's
    ``grid`` entries and flags); returns its whole state (sweep.json's content for a grid
    sweep; sweep.internal.json's for a random one, whose publishable part is under
    ``"publishable"``). ``run_trial(cfg, log=)`` (the run of one trial: `trainer.run`),
    ``plan_trial(cfg, log=)`` (`planning.plan_run`) and ``rng`` (the random draw and the
    trials' names: OS entropy) are injectable for tests. A recipe whose data is declared
    public runs `llmdp.tune.public.run_public_sweep` (non-private trials, nothing spent;
    ``write_best``: the selected point as a file a private recipe takes)."""
    from llmdp._fs import RunLock
    from llmdp.run.launch import run
    from llmdp.run.planning import plan_run

    run_trial = run_trial or run
    plan_trial = plan_trial or plan_run
    spec = resolve_sweep(cfg.sweep, grid, trials, mean_trials, distribution)
    sweep_dir = os.path.abspath(os.path.join(cfg.output.dir, f"{cfg.output.name}-sweep"))
    if write_best and not cfg.data.public:
        raise ConfigError(f"--write-best {write_best}: only a sweep of data declared public "
                          f"(data.public: true) writes its selection for a private recipe (chosen "
                          f"at zero privacy cost); a private sweep's selection is in sweep.json",
                          key="data.public")
    lock = RunLock(sweep_dir)  # one launch per sweep (its draw and its trials)
    try:
        if cfg.data.public:
            from llmdp.tune.public import run_public_sweep

            return run_public_sweep(cfg, spec, log=log, run_trial=run_trial, write_best=write_best)
        return _run_locked(cfg, spec, sweep_dir, log, run_trial, plan_trial, rng)
    finally:
        lock.release(remove=not os.path.isdir(sweep_dir))  # a refused sweep leaves no lock file


def _trial_names(name: str, k: int, rng) -> list[str]:
    """K trial names ``<name>-trial-<8 hex digits>`` from OS entropy (``rng``: an injected
    generator, tests only), distinct: unlike ``-trial-<i>``, a name says nothing about how
    many trials were drawn."""
    out: list[str] = []
    while len(out) < k:
        tag = secrets.token_hex(4) if rng is None else f"{rng.getrandbits(32):08x}"
        if f"{name}-trial-{tag}" not in out:
            out.append(f"{name}-trial-{tag}")
    return out


def _read_state(sweep_dir: str, random: bool) -> dict | None:
    """The state an earlier launch of this sweep wrote: a random sweep's in
    sweep.internal.json (an earlier llmdp kept it in sweep.json, with K: read there too)."""
    if random:
        state = _read_json(os.path.join(sweep_dir, SWEEP_INTERNAL_JSON))
        if state is not None:
            return state
        old = _read_json(os.path.join(sweep_dir, SWEEP_JSON))
        return old if old is not None and "publishable" not in old else None
    return _read_json(os.path.join(sweep_dir, SWEEP_JSON))


def _run_locked(cfg, spec: SweepSpec, sweep_dir: str, log, run_trial, plan_trial, rng) -> dict:
    from llmdp.base.localray import shared_local_ray
    from llmdp.privacy.accounting import release_entries
    from llmdp.run.launch import finished_run, run

    points = spec.points()
    name = cfg.output.name
    point_cfgs = [_trial_config(cfg, p, f"{name}-trial-{j}", f"the grid point ({_describe(p)})")
                  for j, p in enumerate(points)]
    _check_trials(point_cfgs, points)
    planned = _plan_all(point_cfgs, points, plan_trial, log)
    random = spec.trials == "random"
    if random:
        _check_same_releases(planned, points)
    # A random search's state (K, the trials, bound (a)) is internal: bound (b) holds only
    # with K hidden. A grid sweep's is all publishable under bound (a).
    path = os.path.join(sweep_dir, SWEEP_INTERNAL_JSON if random else SWEEP_JSON)
    earlier = _read_state(sweep_dir, random)
    drawn = _resumed_draw(earlier, spec, points, path)
    state = {"sweep_version": SWEEP_VERSION, "name": name, "sweep_dir": sweep_dir,
             "spec": spec.to_dict(), "points": [list(p) for p in points]}
    if random:
        state["internal"] = INTERNAL_NOTE
    if drawn is None:
        if random:
            drawn = draw_random_trials(spec.mean_trials, spec.distribution, len(points), rng)
            names = _trial_names(name, len(drawn), rng)
            state["draw"] = {"K": len(drawn), "entropy": "OS (random.SystemRandom)" if rng is None
                             else "an injected generator (tests only: no guarantee)"}
        else:
            drawn = list(range(len(points)))
            names = [f"{name}-trial-{i}" for i in drawn]
    else:
        state["draw"] = earlier.get("draw")
        # (a random sweep of an earlier llmdp named its trials -trial-<i>: kept, to resume)
        names = earlier.get("trial_names") or [f"{name}-trial-{i}" for i in range(len(drawn))]
        log(f"sweep: resuming {sweep_dir}" + ("" if random else f" ({len(drawn)} trial(s))"))
    state["trial_points"] = drawn
    state["trial_names"] = names
    state["status"] = "planned"
    _write_json(path, state)  # the draw is durable before the budget check and any trial
    if random:
        log(f"sweep: random search ({spec.distribution}, mean {spec.mean_trials:g}): the number "
            f"of trials K and their grid points are internal ({path}); bound (b) holds only "
            f"with K hidden, so it is never printed")

    tcfgs = [dataclasses.replace(point_cfgs[j], output=dataclasses.replace(
        point_cfgs[j].output, name=names[i])) for i, j in enumerate(drawn)]
    tplanned = [planned[j] for j in drawn]
    todo = [k for k, c in enumerate(tcfgs) if finished_run(c) is None]
    state["budget"] = check_sweep_budget([tcfgs[k] for k in todo], [tplanned[k] for k in todo],
                                         log, hide_count=random)

    delta = min(p.plan.delta for p in planned)
    accountant = cfg.privacy.accountant
    prior = unique_priors([p.prior_releases for p in (tplanned or planned[:1])])
    prior_entries, prior_thr = release_entries(prior)
    rs = (spec.mean_trials, spec.shape) if random else None
    state["cost_planned"] = sweep_cost([own_entries(p) for p in tplanned], prior_entries, delta,
                                       accountant, rs, prior_delta_threshold=prior_thr,
                                       planned_trial=own_entries(planned[0]),
                                       trial_tails=[p.plan.noise_tail() for p in tplanned],
                                       planned_tail=planned[0].plan.noise_tail())
    log("planned " + _cost_line(state["cost_planned"], random))
    state["status"] = "running"
    _write_json(path, state)
    rows: list[dict] = []
    state["trials"] = rows
    # One local Ray for every trial still to run (not one start-up per trial).
    shared = (shared_local_ray(sweep_dir, [tcfgs[k] for k in todo], log) if run_trial is run
              else contextlib.nullcontext())
    try:
        with shared:
            for i, (j, c) in enumerate(zip(drawn, tcfgs)):
                log(f"sweep: trial {c.output.name} ({_describe(points[j])})" if random else
                    f"sweep: trial {i + 1} of {len(tcfgs)}: {c.output.name} ({_describe(points[j])})")
                run_trial(c, log=log)
                rows.append(_trial_row(i, points[j], c, j))
                state["trials"] = rows
                _write_json(path, state)
    except BaseException as e:
        state["status"] = f"stopped at trial {len(rows)}: {type(e).__name__}: {e}"
        state["trials"] = rows + [_trial_row(k, points[drawn[k]], tcfgs[k], drawn[k])
                                  for k in range(len(rows), len(tcfgs))]
        _write_json(path, state)
        raise
    recorded = [_recorded(c, p) for c, p in zip(tcfgs, tplanned)]
    prior = unique_priors([r for _, r, _ in recorded] or [prior])
    prior_entries, prior_thr = release_entries(prior)
    state["cost"] = sweep_cost([e for e, _, _ in recorded], prior_entries, delta, accountant, rs,
                               prior_delta_threshold=prior_thr,
                               planned_trial=own_entries(planned[0]),
                               trial_tails=[t for _, _, t in recorded],
                               planned_tail=planned[0].plan.noise_tail())
    state["earlier_releases"] = [{k: r.get(k) for k in ("release_id", "run_id", "epsilon")}
                                 for r in prior]
    refused = selection_refusal(rows)
    state["selected"] = None if refused else select_trial(rows)
    if refused:
        state["selection_refused"] = refused
        log(f"no trial selected: {refused}")
    state["selection"] = "the lowest DP evaluation loss (the last evaluation.dp entry of each report)"
    state["publication"] = publication(state)
    state["status"] = "complete"
    if random:
        state["publishable"] = publishable_state(state)
    _write_json(path, state)
    md = os.path.join(sweep_dir, SWEEP_INTERNAL_MD if random else SWEEP_MD)
    with open(md, "w", encoding="utf-8") as f:
        f.write(render_markdown(state))
    if random:  # the publishable part: the selected trial and bound (b), nothing about K
        _write_json(os.path.join(sweep_dir, SWEEP_JSON), state["publishable"])
        with open(os.path.join(sweep_dir, SWEEP_MD), "w", encoding="utf-8") as f:
            f.write(render_public_markdown(state["publishable"]))
    sel = state["selected"]
    log("sweep: " + ("" if random else f"{len(rows)} trial(s); ") + "selected: "
        + (f"{sel['name']} ({_describe(sel['overrides'])}), DP eval loss {sel['dp_eval']['loss']:.4f}"
           if sel else "none (" + ("the DP evaluations' noise exceeds the spread between trials"
                                   if state.get("selection_refused") else
                                   "no trial has a DP evaluation") + ")"))
    log(_cost_line(state["cost"], random))
    if random:
        log(f"sweep: publishable under bound (b): {os.path.join(sweep_dir, SWEEP_MD)} and "
            f"{SWEEP_JSON}; INTERNAL, not for publication (K, every trial, bound (a) and which "
            f"bound is the better statement): {os.path.join(sweep_dir, SWEEP_INTERNAL_MD)} and "
            f"{SWEEP_INTERNAL_JSON}")
    else:
        log(f"sweep: {os.path.join(sweep_dir, SWEEP_MD)}")
    return state


def publication(state: dict) -> dict:
    """Which files may be published under which bound (sweep.json ``publication``).

    Grid trials: bound (a) covers every trial's model and DP evaluations: everything. Random
    trials: bound (b) covers only the selected trial's output, with the number of trials K
    hidden; so under (b) only sweep.md and sweep.json (the selected trial and (b), nothing
    that reveals K). Bound (a) holds for every K (K is drawn independently of the data), so a
    random sweep may instead be published under (a), and then everything may be; when (a) is
    the smaller ε here, it is the better statement (`a_is_better`)."""
    cost = state.get("cost") or state.get("cost_planned") or {}
    a = (cost.get("composition") or {}).get("epsilon")
    b = (cost.get("repeat_and_select") or {}).get("epsilon")
    if state["spec"]["trials"] != "random":
        return {"bound": "a", "publishable": [SWEEP_JSON, SWEEP_MD, "every trial's run directory"],
                "internal": []}
    better = _finite(a) and _finite(b) and a <= b
    return {"bound": "b",
            "publishable": [SWEEP_JSON, SWEEP_MD, "the selected trial's model and its DP evaluation"],
            "internal": [SWEEP_INTERNAL_JSON, SWEEP_INTERNAL_MD, "every other trial's run directory",
                         "the selected trial's local privacy report (its ε is the trial's alone and "
                         "its dataset-ledger section composes every trial: it reveals K; the "
                         "publishable report of its export holds no dataset-wide total)"],
            "a_is_better": bool(better),
            "under_a": "every file (K included) may be published, with bound (a)"}


def publishable_state(state: dict) -> dict:
    """sweep.json of a random search: the selected trial and bound (b), nothing that reveals
    the number of trials K (no count, no per-trial rows, no trial index, no bound (a), no
    budget figures: each depends on K). Its shape is the same whatever K was drawn."""
    sel = state.get("selected")
    cost = state.get("cost") or {}
    return {"sweep_version": state["sweep_version"], "name": state["name"], "publishable": True,
            "bound": "b", "spec": state["spec"], "points": state["points"],
            "selection": state.get("selection"),
            "selected": None if sel is None else {
                k: sel.get(k) for k in ("name", "run_dir", "point", "overrides", "dp_eval")},
            "cost": {"delta": cost.get("delta"), "repeat_and_select": cost.get("repeat_and_select")},
            "publication": {k: v for k, v in state["publication"].items()
                            if k in ("bound", "publishable", "internal", "under_a")},
            "status": state.get("status")}


def _cost_line(cost: dict, random: bool) -> str:
    b = cost.get("repeat_and_select")
    if random and b:  # (a) composes the K trials: its value reveals K, never printed
        return (f"sweep cost (b) random search (Papernot-Steinke): ε = {b['epsilon']:.4f} at δ = "
                f"{cost['delta']:.3g} ({b['accountant']}), covering ONLY the selected trial's "
                f"output, with K hidden; (a) is in {SWEEP_INTERNAL_MD} (internal)")
    a = cost["composition"]
    return (f"sweep cost (a) all trials composed: ε = {a['epsilon']:.4f} at δ = {cost['delta']:.3g} "
            f"({a['accountant']})")


def _fmt(x, spec: str = ".4f") -> str:
    return format(x, spec) if _finite(x) else "–"


def _delta_note(cost: dict, bound: str) -> str:
    d = (cost.get(bound) or {}).get("delta_accountant")
    if d is None or d == cost.get("delta"):
        return ""
    return f"; δ includes the noise generator's truncated tails (the accountant's δ: {d:.6g})"


def render_markdown(state: dict) -> str:
    """sweep.md of a grid sweep (all publishable under bound (a)); sweep.internal.md of a
    random one (INTERNAL: it reveals K; its publishable part is `render_public_markdown`)."""
    spec = state["spec"]
    rows = state.get("trials") or []
    cost = state.get("cost") or state.get("cost_planned") or {}
    random = spec["trials"] == "random"
    how = (f"random search: K = {len(state.get('trial_points') or [])} trial(s) drawn "
           f"({spec['distribution']}, mean {spec['mean_trials']:g}), each a uniform grid point"
           if random else f"grid: every one of {len(state['points'])} point(s)")
    out = [f"# Sweep {state['name']}" + (" (INTERNAL)" if random else ""), ""]
    if random:
        out += [f"> **{INTERNAL_NOTE}**", ""]
    out += [f"Trials: {how}. Selection: {state.get('selection', '–')}.",
            "", "| trial | overrides | run | status | ε alone (δ) | DP eval loss ± std |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        dp = r.get("dp_eval") or {}
        out.append(f"| {r['trial']} | {_describe(r['overrides'])} | {r['run_dir']} | {r['status']} | "
                   f"{_fmt(r.get('epsilon'))} ({_fmt(r.get('delta'), '.3g')}) | "
                   f"{_fmt(dp.get('loss'))} ± {_fmt(dp.get('loss_std'))} |")
    sel = state.get("selected")
    out += ["", "**Selected:** " + (f"trial {sel['trial']} ({_describe(sel['overrides'])}), "
                                     f"{sel['run_dir']}" if sel else "none"
                                     + (f": {state['selection_refused']}" if state.get("selection_refused") else "")), ""]
    if cost:
        a = cost["composition"]
        out += ["## Privacy cost of the sweep", "",
                f"- (a) every trial composed: ε = {a['epsilon']:.4f} at δ = {cost['delta']:.3g} "
                f"({a['accountant'].upper()}){_delta_note(cost, 'composition')}; covers "
                f"{a['covers']}."]
        b = cost.get("repeat_and_select")
        if b:
            out.append(f"- (b) random search (trials: random): ε = "
                       f"{b['epsilon']:.4f} at δ = {cost['delta']:.3g} (RDP, RepeatAndSelectDpEvent, "
                       f"K {b['distribution']} of mean {b['mean_trials']:g}; {b['reference']})"
                       f"{_delta_note(cost, 'repeat_and_select')}; with K hidden, it covers "
                       f"{b['covers']}.")
        out.append("")
    out += _publication_lines(state)
    return "\n".join(out)


def _publication_lines(state: dict) -> list[str]:
    pub = state.get("publication") or publication(state)
    if pub["bound"] == "a":
        return ["## What may be published", "",
                "Bound (a) covers every trial's model and DP evaluations: everything here may be "
                "published (this file, sweep.json, every trial's run directory), with (a).", ""]
    cost = state.get("cost") or {}
    a = (cost.get("composition") or {}).get("epsilon")
    b = (cost.get("repeat_and_select") or {}).get("epsilon")
    out = ["## What may be published", ""]
    if pub.get("a_is_better"):
        out += [f"**(a) is the better statement here**: ε = {_fmt(a)} for every trial's output, "
                f"K included, against ε = {_fmt(b)} for the selected trial's output alone under "
                f"(b). Publish under (a): then every file may be published (this one, "
                f"{SWEEP_INTERNAL_JSON}, {SWEEP_MD}, {SWEEP_JSON}, every trial's run directory). "
                "Choosing (a) because K came out small is sound ((a) holds for every K, and K is "
                "drawn independently of the data); but a (b) statement made only when (a) came out "
                "worse would tell readers that K was large, which (b) does not cover: decide on (b) "
                "before the draw, or use (a).", ""]
    else:
        out += [f"(b) is the smaller ε here ({_fmt(b)}, against {_fmt(a)} under (a))." if
                _finite(a) and _finite(b) else "", ""]
    out += [f"- Under (b): publish only {SWEEP_MD} and {SWEEP_JSON} (the selected trial and (b)) "
            "and the selected trial's model and DP evaluation. Keep internal: "
            + "; ".join(pub["internal"]) + ".",
            f"- Under (a): {pub['under_a']}.", ""]
    return out


def render_public_markdown(pub: dict) -> str:
    """sweep.md of a random search: publishable under bound (b). The same lines whatever
    K was drawn (no count, no per-trial lines, no trial index, no bound (a))."""
    spec = pub["spec"]
    grid = "; ".join(f"{a['key']} in {{{', '.join(a['values'])}}}" for a in spec["grid"]) or "–"
    sel = pub.get("selected")
    b = (pub.get("cost") or {}).get("repeat_and_select") or {}
    out = [f"# Sweep {pub['name']}", "",
           f"Trials: random search (Papernot & Steinke) over the grid {grid}: the number of "
           f"trials K is drawn from a {spec['distribution']} distribution of mean "
           f"{spec['mean_trials']:g} and kept secret (the bound below assumes it hidden), each "
           f"trial a uniformly random grid point. Selection: {pub.get('selection', '–')}.", ""]
    if sel:
        dp = sel.get("dp_eval") or {}
        acc = (f"; token accuracy {_fmt(dp.get('accuracy'))} ± {_fmt(dp.get('accuracy_std'))}"
               if dp.get("accuracy") is not None else "")
        out.append(f"**Selected:** {_describe(sel['overrides'])}: `{sel['name']}` ({sel['run_dir']}); "
                   f"DP evaluation loss {_fmt(dp.get('loss'))} ± {_fmt(dp.get('loss_std'))}{acc}.")
    else:
        out.append("**Selected:** none (no trial, or no trial with a DP evaluation).")
    out.append("")
    if b:
        cost = pub["cost"]
        out += ["## Privacy", "",
                f"(ε = {b['epsilon']:.4f}, δ = {cost['delta']:.3g}) for the selected trial's output "
                f"(its model and its DP evaluation), with K hidden: Papernot & Steinke's "
                f"repeat-and-select bound, dp-accounting's RepeatAndSelectDpEvent under RDP "
                f"(K {b['distribution']} of mean {b['mean_trials']:g}; {b['reference']})"
                f"{_delta_note(cost, 'repeat_and_select')}. It does not cover the other trials' "
                "models, nor the number of trials.", ""]
    out += ["## What may be published", "",
            f"This file, {SWEEP_JSON}, and the selected trial's model and DP evaluation, with the "
            f"bound above. Not: " + "; ".join(pub["publication"]["internal"]) + ".", ""]
    return "\n".join(out)
