"""Tuning on a public proxy (issue 32 item 4): `llmdp sweep` on a recipe whose data is
declared public (``data.public: true``) costs no privacy.

Every grid point is an ordinary declared-public run (no DP, no ledger, no accounting: the
declaration is the recipe's, `llmdp.record.baseline.public_banner`), selected by its final
held-out loss (computed without DP: the data is public). ``--write-best FILE`` writes the
selected point as dotted overrides with where they came from; a private recipe takes
them with ``train.hyperparameters_from: FILE`` (`llmdp.config.best`), and its report says that its
hyper-parameters were chosen on public data, at zero privacy cost
(`llmdp.config.best.hyperparameter_note`).

Files: ``<output.dir>/<output.name>-sweep/sweep.json`` and ``sweep.md`` (everything may be
published: nothing in them was computed on private data).
"""

from __future__ import annotations

import math
import os

import yaml

from llmdp.config.best import BEST_KIND
from llmdp.config.validate import ConfigError


def run_public_sweep(cfg, spec, *, log=print, run_trial=None, write_best: str | None = None) -> dict:
    """The sweep of the declared-public recipe ``cfg`` over ``spec``'s grid (a
    `llmdp.tune.grid.SweepSpec`; grid trials only: a random search exists to hide K from
    a DP guarantee, and there is none here). Returns sweep.json's content."""
    from llmdp.run.launch import run

    check_public_sweep(cfg, spec)  # refused before anything is made
    run_trial = run_trial or run
    sweep_dir = os.path.abspath(os.path.join(cfg.output.dir, f"{cfg.output.name}-sweep"))
    if run_trial is not run:  # trials run by the caller (tests: in process)
        return _run_public_sweep(cfg, spec, sweep_dir, log, run_trial, write_best)
    from llmdp.base.localray import shared_local_ray

    os.makedirs(sweep_dir, exist_ok=True)  # the trials' one Ray keeps its record there
    with shared_local_ray(sweep_dir, [cfg], log):
        return _run_public_sweep(cfg, spec, sweep_dir, log, run_trial, write_best)


def _run_public_sweep(cfg, spec, sweep_dir: str, log, run_trial, write_best) -> dict:
    from llmdp.record.baseline import public_banner
    from llmdp.record.provenance import shown
    from llmdp.record.rundir import RunDir
    from llmdp.tune.trials import _describe, _read_json, _trial_config, _write_json

    banner = public_banner(_data_dict(cfg), bool(cfg.privacy.simulate))
    log(banner)
    simulated = bool(cfg.privacy.simulate)
    kind = "simulated-DP" if simulated else "non-private"
    log(f"sweep: {len(spec.points())} {kind} trial(s) on data declared public: no ledger, no "
        f"accounting, nothing spent")
    rows = []
    for i, point in enumerate(spec.points()):
        name = f"{cfg.output.name}-trial-{i}"
        tcfg = _trial_config(cfg, point, name, f"sweep trial {i} ({_describe(point)})")
        run_dir = run_trial(tcfg, log=log)
        report = _read_json(RunDir(run_dir).file("privacy_report.json")) or {}
        ev = report.get("evaluation") or {}
        held = (ev.get("public") or []) + (ev.get("internal") or [])
        loss = held[-1].get("loss") if held else None
        before = held[0].get("loss") if held and held[0].get("step") == 0 else None
        rows.append({"trial": i, "name": name, "point": list(point), "run_dir": run_dir,
                     "status": report.get("status"), "held_out_loss": loss,
                     "held_out_loss_before": before,
                     **({"simulated": report.get("simulated")} if simulated else {})})
    best, warning = select(rows)
    state = {
        "declared_public": banner,
        "privacy": ("none: every trial ran the DP mechanism of the private run it simulates "
                    "(privacy.simulate: its clipping, its noise σ) on data the recipe declared "
                    "public; nothing was recorded in a privacy ledger and no ε was spent"
                    if simulated else
                    "none: every trial is a non-private run on data the recipe declared public; "
                    "nothing was recorded in a privacy ledger and no ε was spent"),
        "simulated": simulated,
        "epsilon": 0.0,
        "source": shown(cfg.data.dataset or cfg.data.path),
        "selection": "the lowest final held-out loss (computed without DP: the data is public)",
        "trials": rows,
        "selected": best,
        **({"warning": warning} if warning else {}),
    }
    os.makedirs(sweep_dir, exist_ok=True)
    _write_json(os.path.join(sweep_dir, "sweep.json"), state)
    with open(os.path.join(sweep_dir, "sweep.md"), "w", encoding="utf-8") as f:
        f.write(_markdown(state))
    if warning:
        log(f"sweep: WARNING: {warning}")
    if best is None:
        log("sweep: no trial completed with a finite held-out loss: nothing selected")
    else:
        log(f"sweep: selected trial {best['trial']} ({_describe(best['point'])}), held-out loss "
            f"{best['held_out_loss']:.4f}")
        if write_best:
            write_best_file(write_best, best, state, cfg.output.name)
            log(f"sweep: the selected hyper-parameters -> {write_best} (a private recipe takes "
                f"them with train.hyperparameters_from: {write_best})")
    return state


def select(rows: list[dict]) -> tuple[dict | None, str | None]:
    """The complete trial of lowest final held-out loss among the finite ones (a diverged
    trial's NaN compares false with everything: it must not stand as the minimum), and a
    warning when even that trial ended worse than its model before the first step: every
    grid point made the model worse (its rates too large, typically), a choice to reject."""
    done = [r for r in rows if r["status"] == "complete" and r["held_out_loss"] is not None
            and math.isfinite(r["held_out_loss"])]
    if not done:
        return None, None
    best = min(done, key=lambda r: r["held_out_loss"])
    before = best.get("held_out_loss_before")
    if before is None or best["held_out_loss"] < before:
        return best, None
    from llmdp.tune.trials import _describe

    return best, (f"the selected trial {best['trial']} ({_describe(best['point'])}) ended at "
                  f"held-out loss {best['held_out_loss']:.4f}, no better than before its first "
                  f"step ({before:.4f}): every trial made the model worse; widen the grid "
                  f"(smaller learning rates) before using this selection")


def check_public_sweep(cfg, spec) -> None:
    """What a sweep of data declared public is refused for, before anything is made."""
    if spec.trials != "grid":
        raise ConfigError("sweep.trials: random searches are for private data (their bound hides "
                          "the number of trials); a sweep of data declared public runs every grid "
                          "point: use --trials grid", key="sweep.trials")
    if cfg.data.eval is None:
        raise ConfigError("data.eval: a sweep of data declared public selects by held-out loss; set "
                          "data.eval.fraction (e.g. 0.1) or data.eval.path", key="data.eval")


def _data_dict(cfg) -> dict:
    from llmdp.config.yamlio import to_dict

    return to_dict(cfg)["data"]


def _markdown(state: dict) -> str:
    lines = [state["declared_public"], "", "# Sweep on data declared public", "",
             f"> **Privacy:** {state['privacy']}.", "",
             f"Selection: {state['selection']}.", "",
             "| trial | point | status | held-out loss |", "| ---: | --- | --- | ---: |"]
    for r in state["trials"]:
        loss = "–" if r["held_out_loss"] is None else f"{r['held_out_loss']:.4f}"
        lines.append(f"| {r['trial']} | {', '.join(r['point']) or 'the recipe'} | {r['status']} | {loss} |")
    sel = state["selected"]
    lines += ["", "Selected: " + ("none" if sel is None else f"trial {sel['trial']}"), ""]
    if state.get("warning"):
        lines += [f"**Warning:** {state['warning']}.", ""]
    return "\n".join(lines)


def write_best_file(path: str, best: dict, state: dict, sweep: str) -> None:
    """The selected point as dotted overrides, with where they came from."""
    overrides = {}
    for item in best["point"]:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    doc = {"kind": BEST_KIND, "chosen_on": "public data", "source": state["source"],
           "sweep": sweep, "trial": best["name"], "selection": state["selection"],
           "held_out_loss": best["held_out_loss"], "epsilon": 0.0,
           # the private run's noise the trials simulated (privacy.simulate), or None
           "simulated_noise": best.get("simulated"), "overrides": overrides}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        shown = os.path.basename(path) if os.path.isabs(path) else path  # as the user gave it
        f.write(f"# Hyper-parameters selected by `llmdp sweep` on data declared public "
                f"({state['source']}): 0 ε.\n# A private recipe takes them with "
                f"train.hyperparameters_from: {shown}\n")
        yaml.safe_dump(doc, f, sort_keys=False)
