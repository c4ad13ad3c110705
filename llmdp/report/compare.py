"""`llmdp compare RUN_A RUN_B ... [--out FILE.png]`: runs side by side, and the
privacy-utility curve (evaluation loss against ε).

Everything is read from each run's ``privacy_report.json``: ε at δ (or NON-PRIVATE for a
baseline: ``"dp": false``), the final held-out evaluation (``evaluation.internal``, computed
without DP on private held-out data: internal, for the trainer's eyes only; or
``evaluation.public`` on public data) and the final DP evaluation (``evaluation.dp``: a DP
release, with its noise's standard deviation). A run without a section shows "–" there. The
table and the plot are local outputs (they hold internal metrics): not for publication; the
plot's file is written owner-only, like the run's own files.

Runs are pooled (mean ± sd) only when they are seed replicates: their resolved recipes
(``config.yaml``) are equal but for the seeds and the fields that do not change what is
trained (`RECIPE_IGNORED`). Runs at the same ε that differ in anything else (a learning
rate, the number of steps, the data, the model) stay separate entries, and the summary names
the fields they differ in. A run without ``config.yaml`` is never pooled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

from llmdp.config.validate import ConfigError

__all__ = ["load_run", "format_table", "summarize", "format_summary", "gain_recovered",
           "format_gain", "gain_against", "plot", "compare"]

DASH = "–"

# Recipe fields that seed replicates may differ in: the seeds themselves, and what names,
# places or caps a run without changing what it trains (its name and folder, where its
# ledger is, the dataset's budget cap). A prefix ending in "." covers a whole section.
RECIPE_IGNORED = ("train.seed", "model.tiny.seed", "privacy.seed", "output.",
                  "privacy.ledger", "privacy.budget_epsilon")


def _flatten(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_key(cfg) -> dict | None:
    """A run's resolved recipe as ``{dotted.key: value}``, less `RECIPE_IGNORED` (None
    without a recipe)."""
    if not isinstance(cfg, dict):
        return None
    return {k: v for k, v in _flatten(cfg).items()
            if not any(k == i or (i.endswith(".") and k.startswith(i)) for i in RECIPE_IGNORED)}


def _read_recipe(rd) -> dict | None:
    """The run's `recipe_key`; None when it has no readable ``config.yaml`` (never pooled)."""
    import yaml  # lazy: only reading a recipe needs it

    try:
        return recipe_key(rd.config())
    except (OSError, yaml.YAMLError):
        return None


def _last(section) -> dict | None:
    return section[-1] if isinstance(section, list) and section and isinstance(section[-1], dict) else None


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def load_run(path: str) -> dict:
    """One run's row: its privacy and its final metrics (None where the report has none)."""
    from llmdp.record.rundir import RunDir  # lazy: the privacy package imports torch

    rd = RunDir(path).require(ConfigError)
    report_path = rd.file("privacy_report.json")
    try:
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{rd.path}: no privacy_report.json (the run never wrote its report); "
                          f"`llmdp privacy report {path}` builds it") from None
    except ValueError as e:
        raise ConfigError(f"{report_path}: not a JSON report ({e})") from None
    return _row(rd, report)


def _row(rd, report: dict) -> dict:
    """`load_run`'s row of the run at ``rd`` (a RunDir) from its report ``report``."""
    ev = report.get("evaluation")
    ev = ev if isinstance(ev, dict) else {}
    held, source = _last(ev.get("internal")), "internal"
    if held is None:
        held, source = _last(ev.get("public")), "public"
    dp = _last(ev.get("dp"))
    private = report.get("dp") is not False
    first = ev.get(source)
    first = first[0] if isinstance(first, list) and first and isinstance(first[0], dict) else None
    return {
        "run": os.path.basename(rd.path), "path": rd.path, "dp": private,
        "epsilon": _num(report.get("epsilon")) if private else None,
        "delta": _num(report.get("delta")) if private else None,
        "heldout": None if held is None else {
            "source": source, "loss": _num(held.get("loss")), "accuracy": _num(held.get("accuracy")),
            "perplexity": _num(held.get("perplexity")), "step": held.get("step")},
        # The held-out metrics before the first step (the starting model untouched).
        "before": None if first is None or first.get("step") != 0 else {
            "loss": _num(first.get("loss")), "accuracy": _num(first.get("accuracy"))},
        "start": start_label(report.get("starting_model")),
        "dp_eval": None if dp is None else {
            "loss": _num(dp.get("loss")), "loss_std": _num(dp.get("loss_std")),
            "accuracy": _num(dp.get("accuracy")), "accuracy_std": _num(dp.get("accuracy_std")),
            "loss_bound": _num(dp.get("loss_bound")), "step": dp.get("step")},
        # Runs are joined by a line only on the same dataset and δ (their ε are comparable).
        "dataset": (report.get("dataset_ledger") or {}).get("dataset_id")
        or report.get("dataset_fingerprint"),
        "steps": report.get("steps_completed", report.get("steps")),
        "status": report.get("status"),
        "recipe": _read_recipe(rd),
    }


def start_label(start) -> str:
    """A short name of a run's starting model (its report's ``starting_model``)."""
    if not isinstance(start, dict):
        return "random weights"
    kind, run_id = start.get("kind"), start.get("run_id")
    if kind == "public" and run_id:
        return f"public run {run_id}"
    if kind == "dp" and run_id:
        return f"DP run {run_id}"
    if kind == "non-private" and run_id:
        return f"NON-PRIVATE run {run_id}"
    return str(start.get("shown") or start.get("name") or "external checkpoint")


def _f(x, spec: str = ".4f") -> str:
    return DASH if x is None else format(x, spec)


def _pm(x, std) -> str:
    return DASH if x is None else f"{x:.4f} ± {_f(std)}"


def _stats(xs) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None for one value) of the values that exist."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None)


def _recipe_id(r: dict) -> str:
    """Equal for runs whose recipes are equal but for `RECIPE_IGNORED`; a run without a
    recipe is its own."""
    rec = r.get("recipe")
    if rec is None:
        return "run:" + str(r.get("path") or r["run"])
    return json.dumps(rec, sort_keys=True, default=str)


def differing_fields(rows: list[dict]) -> list[str]:
    """The recipe fields (dotted) whose values are not the same in all of ``rows`` that have
    a recipe (the seeds and `RECIPE_IGNORED` left out)."""
    recipes = [r["recipe"] for r in rows if r.get("recipe") is not None]
    keys = sorted({k for rec in recipes for k in rec})
    return [k for k in keys if len({json.dumps(rec.get(k, DASH), sort_keys=True, default=str)
                                    for rec in recipes}) > 1]


def summarize(rows: list[dict]) -> list[dict]:
    """Runs that differ only by their seed, pooled: one entry per recipe (less its seeds,
    `RECIPE_IGNORED`), starting model, dataset, δ, privacy and ε (to two decimals; targets
    are met to 1e-4), with ``n``, ``runs``, the mean, sample standard deviation, minimum and
    maximum of the final held-out loss, the mean and standard deviation of its accuracy, the
    held-out loss and accuracy before the first step (the starting model untouched), and
    ``differs``: the entry's values of the recipe fields in which the entries differ."""
    buckets: dict = {}
    for r in rows:
        eps = round(r["epsilon"], 2) if r["dp"] and r["epsilon"] is not None else None
        buckets.setdefault((r["start"], r["dataset"] if r["dp"] else None,
                            r["delta"], r["dp"], eps, _recipe_id(r)), []).append(r)
    varying = differing_fields(rows)
    out = []
    for (start, dataset, delta, dp, eps, _), members in buckets.items():
        rec = members[0].get("recipe")
        held = [m["heldout"] or {} for m in members]
        losses = [h.get("loss") for h in held if h.get("loss") is not None]
        (loss, loss_sd), (acc, acc_sd) = _stats(losses), _stats([h.get("accuracy") for h in held])
        before = [m["before"] or {} for m in members]
        out.append({
            "start": start, "dataset": dataset, "delta": delta, "dp": dp,
            "epsilon": None if eps is None else _stats([m["epsilon"] for m in members])[0],
            "n": len(members), "runs": [m["run"] for m in members],
            "source": "/".join(sorted({h["source"] for h in held if h.get("source")})) or None,
            "loss": loss, "loss_sd": loss_sd, "loss_min": min(losses, default=None),
            "loss_max": max(losses, default=None), "accuracy": acc, "accuracy_sd": acc_sd,
            "before_loss": _stats([b.get("loss") for b in before])[0],
            "before_accuracy": _stats([b.get("accuracy") for b in before])[0],
            "differs": None if rec is None else {k: rec.get(k) for k in varying}})
    return sorted(out, key=lambda s: (s["start"], not s["dp"], s["epsilon"] or 0.0,
                                      json.dumps(s["differs"], sort_keys=True, default=str)))


def _differs_text(s: dict) -> str:
    if s["differs"] is None:
        return "no config.yaml: not pooled"
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=str)}"
                     for k, v in s["differs"].items()) or DASH


def format_summary(pooled: list[dict]) -> str:
    """`summarize`'s entries as an aligned text table."""
    head = ["starting model", "privacy", "ε", "runs", "held-out loss mean ± sd [min, max]",
            "accuracy mean ± sd", "before training: loss, accuracy"]
    show_recipe = any(s["differs"] for s in pooled) or any(s["differs"] is None for s in pooled)
    if show_recipe:
        head.append("recipe (where the runs differ)")
    body = [[s["start"], "DP" if s["dp"] else "NON-PRIVATE", _f(s["epsilon"]) if s["dp"] else DASH,
             str(s["n"]),
             DASH if s["loss"] is None else
             f"{_pm(s['loss'], s['loss_sd'])} [{_f(s['loss_min'])}, {_f(s['loss_max'])}]",
             _pm(s["accuracy"], s["accuracy_sd"]),
             f"{_f(s['before_loss'])}, {_f(s['before_accuracy'])}"]
            + ([_differs_text(s)] if show_recipe else []) for s in pooled]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
                     for row in [head, ["-" * w for w in widths], *body])


def gain_recovered(pooled: list[dict]) -> list[dict]:
    """For each DP entry of `summarize` with a NON-PRIVATE entry from the same starting
    model: the fraction of the non-private gain it recovers, (start − DP) / (start −
    NON-PRIVATE), with the three held-out losses (start: the DP entry's loss before its first
    step, else the baseline's). None where a loss is missing or fine-tuning without DP gained
    nothing (start ≤ NON-PRIVATE: no gain to recover)."""
    out = []
    for e in pooled:
        if not e["dp"]:
            continue
        for b in pooled:
            if b["dp"] or b["start"] != e["start"]:
                continue
            start = e["before_loss"] if e["before_loss"] is not None else b["before_loss"]
            frac = None
            if None not in (start, e["loss"], b["loss"]) and start - b["loss"] > 0:
                frac = (start - e["loss"]) / (start - b["loss"])
            out.append({"start": e["start"], "epsilon": e["epsilon"], "differs": e["differs"],
                        "start_loss": start, "dp_loss": e["loss"], "non_private_loss": b["loss"],
                        "baseline_differs": b["differs"], "fraction": frac})
    return out


def gain_against(run_dir: str, baseline_dir: str, report: dict | None = None) -> dict:
    """A DP run's fraction of the non-private gain against one NON-PRIVATE ``baseline_dir``
    from the same starting model (`llmdp privacy report RUN --baseline BASELINE`): the
    three held-out losses and (start − DP) / (start − NON-PRIVATE) (None when a loss is
    missing or the baseline gained nothing). Internal: the losses are computed on private
    held-out data without DP. ``report``: the run's report as it is being built (else read)."""
    from llmdp.record.rundir import RunDir  # lazy, as in load_run

    run = load_run(run_dir) if report is None else _row(RunDir(run_dir), report)
    base = load_run(baseline_dir)
    if base["dp"]:
        raise ConfigError(f"--baseline {baseline_dir}: a DP run; give a NON-PRIVATE baseline "
                          f"(a run with privacy.dp: false from the same starting model)")
    if not run["dp"]:
        raise ConfigError(f"{run_dir}: a NON-PRIVATE baseline itself; --baseline is for a DP run")
    if run["start"] != base["start"]:
        raise ConfigError(f"--baseline {baseline_dir}: it started from {base['start']}, the run "
                          f"from {run['start']}; the gains compare only from the same start")
    start = (run["before"] or {}).get("loss")
    if start is None:
        start = (base["before"] or {}).get("loss")
    dp_loss, np_loss = (run["heldout"] or {}).get("loss"), (base["heldout"] or {}).get("loss")
    frac = None
    if None not in (start, dp_loss, np_loss) and start - np_loss > 0:
        frac = (start - dp_loss) / (start - np_loss)
    return {"baseline": base["run"], "start": run["start"], "start_loss": start,
            "dp_loss": dp_loss, "non_private_loss": np_loss, "fraction": frac}


def format_gain(gains: list[dict]) -> str:
    """`gain_recovered` as an aligned text table."""
    head = ["starting model", "ε", "start loss", "DP loss", "NON-PRIVATE loss",
            "gain recovered (start − DP) / (start − NON-PRIVATE)"]
    body = [[g["start"], _f(g["epsilon"]), _f(g["start_loss"]), _f(g["dp_loss"]),
             _f(g["non_private_loss"]), DASH if g["fraction"] is None else f"{g['fraction']:.1%}"]
            for g in gains]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
                     for row in [head, ["-" * w for w in widths], *body])


def format_table(rows: list[dict]) -> str:
    """The runs as an aligned text table."""
    head = ["run", "privacy", "ε (δ)", "held-out loss", "held-out accuracy",
            "DP eval loss ± std", "DP accuracy ± std", "steps"]
    body = []
    for r in rows:
        h, d = r["heldout"] or {}, r["dp_eval"] or {}
        src = f" ({h['source']})" if h.get("loss") is not None else ""
        body.append([
            r["run"], "DP" if r["dp"] else "NON-PRIVATE",
            f"{_f(r['epsilon'])} ({_f(r['delta'], '.3g')})" if r["dp"] else DASH,
            _f(h.get("loss")) + src, _f(h.get("accuracy")),
            _pm(d.get("loss"), d.get("loss_std")), _pm(d.get("accuracy"), d.get("accuracy_std")),
            DASH if r["steps"] is None else str(r["steps"])])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = "  ".join("-" * w for w in widths)
    return "\n".join(["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
                      for row in [head]] + [line] + [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in body])


def plot(rows: list[dict], out: str) -> dict:
    """Evaluation loss against ε (one point per DP run: held-out loss, DP eval loss with its
    std); each non-private run is a horizontal dashed line labelled NON-PRIVATE. Returns what
    was drawn: ``{"heldout": [(ε, loss, run)], "dp_eval": [(ε, loss, std, run)],
    "dp_eval_bars": [(below, above)], "groups": [[dataset, δ]], "non_private": [(loss,
    label)], "path": out}``. Runs on different datasets or at different δ are separate
    curves; error bars stay inside the loss's range [0, L]."""
    import matplotlib  # lazy: only drawing needs matplotlib (slow to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dp_rows = sorted((r for r in rows if r["dp"] and r["epsilon"] is not None),
                     key=lambda r: r["epsilon"])
    drawn = False
    baselines = []
    # One curve per (dataset, δ, starting model): ε of runs on other data or at another δ
    # are not points of one privacy-utility curve, and two starts are two curves.
    groups: dict = {}
    for r in dp_rows:
        groups.setdefault((r.get("dataset"), r["delta"], r["start"]), []).append(r)
    keys = list(groups)
    held, dpe, yerr, means = [], [], [], []
    colors: dict = {}  # starting model -> its curve's colour (its NON-PRIVATE line's too)
    for (dataset, delta, start), members in groups.items():
        tag = _tag(keys, dataset, delta, start)
        h = [(r["epsilon"], r["heldout"]["loss"], r) for r in members
             if r["heldout"] and r["heldout"]["loss"] is not None]
        pooled = [s for s in summarize([r for _, _, r in h]) if s["loss"] is not None]
        if h and all(s["n"] == 1 for s in pooled):
            sources = sorted({r["heldout"]["source"] for _, _, r in h})
            line = ax.plot([x for x, _, _ in h], [y for _, y, _ in h], "o-",
                           label=f"held-out loss ({', '.join(sources)}){tag}")
            colors.setdefault(start, line[0].get_color())
        elif h:
            # Repeated runs (seeds): the mean with ± one standard deviation, each run a dot.
            sources = sorted({r["heldout"]["source"] for _, _, r in h})
            line = ax.errorbar([s["epsilon"] for s in pooled], [s["loss"] for s in pooled],
                               yerr=[s["loss_sd"] or 0.0 for s in pooled], fmt="o-", capsize=3,
                               label=f"held-out loss ({', '.join(sources)}), mean ± sd of "
                                     f"{min(s['n'] for s in pooled)}+ runs{tag}")
            ax.plot([x for x, _, _ in h], [y for _, y, _ in h], ".", alpha=0.35,
                    color=line[0].get_color())
            colors.setdefault(start, line[0].get_color())
            means += [(s["epsilon"], s["loss"], s["loss_sd"], s["n"], start) for s in pooled]
        held += h
        drawn = drawn or bool(h)
        d = [(r["epsilon"], r["dp_eval"]["loss"], r["dp_eval"]["loss_std"] or 0.0, r) for r in members
             if r["dp_eval"] and r["dp_eval"]["loss"] is not None]
        if d:
            # The bars stop at the loss's range [0, L]: a released loss never leaves it, and
            # a bar below 0 would draw a value the metric cannot take.
            err = [_clipped_bar(y, sd, r["dp_eval"].get("loss_bound")) for _, y, sd, r in d]
            ax.errorbar([x for x, *_ in d], [y for _, y, *_ in d],
                        yerr=[[lo for lo, _ in err], [hi for _, hi in err]],
                        fmt="s--", capsize=3, label=f"DP eval loss ± std{tag}")
            dpe += d
            yerr += err
            drawn = True
    named = set()
    if not means:  # with repeated runs the dots are not named (the table lists them)
        for x, y, r in held + [(x, y, r) for x, y, _, r in dpe]:
            if r["path"] not in named:  # each run named once, labels staggered
                named.add(r["path"])
                ax.annotate(r["run"], (x, y), textcoords="offset points",
                            xytext=(4, 4 + 9 * (len(named) % 3)), fontsize=7)
    base_rows = [r for r in rows if not r["dp"] and r["heldout"] and r["heldout"]["loss"] is not None]
    starts = sorted({r["start"] for r in rows})
    for s in summarize(base_rows):
        who = (s["runs"][0] if s["n"] == 1 else f"mean ± sd of {s['n']} runs") + \
            (f", from {s['start']}" if len(starts) > 1 else "")
        label = f"NON-PRIVATE ({who}, {s['source']})"
        line = ax.axhline(s["loss"], ls="--", label=label,
                          color="0.4" if len(starts) == 1 else colors.get(s["start"], "0.4"))
        if s["loss_sd"]:
            ax.axhspan(s["loss"] - s["loss_sd"], s["loss"] + s["loss_sd"], alpha=0.12,
                       color=line.get_color())
        ax.annotate("NON-PRIVATE", (1.0, s["loss"]), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(-4, 3), ha="right", fontsize=7,
                    color="0.3")
        baselines.append((s["loss"], label))
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no evaluation metrics in these runs", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("ε (at each run's δ)")
    ax.set_ylabel("evaluation loss")
    ax.set_title("privacy-utility (local: held-out metrics are internal)")
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        _save_private(fig, out)
    finally:
        plt.close(fig)
    return {"heldout": [(x, y, r["run"]) for x, y, r in held],
            "dp_eval": [(x, y, sd, r["run"]) for x, y, sd, r in dpe],
            "dp_eval_bars": yerr, "groups": [list(k) for k in groups], "heldout_mean": means,
            "non_private": baselines, "path": out}


def _save_private(fig, out: str) -> None:
    """Write the figure to ``out`` owner-only (0600, whatever the umask; a folder it creates
    0700), like the run's other internal files (`llmdp._fs.private_files`): the plot holds
    internal metrics. It is drawn into a new file beside ``out`` and renamed over it, so that
    a plot already there (with wider permissions) is replaced, never left readable or half
    written. The format is ``out``'s extension (matplotlib's default, PNG, without one)."""
    import tempfile

    from llmdp._fs import private_files

    folder = os.path.dirname(os.path.abspath(out))
    ext = os.path.splitext(out)[1]
    with private_files():
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".compare-", suffix=ext, dir=folder)  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                fig.savefig(f, dpi=120, format=ext[1:] or None)
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _tag(keys, dataset, delta, start) -> str:
    """The legend's note on a curve: what tells it apart from the others drawn with it."""
    parts = []
    if len({k[0] for k in keys}) > 1 or len({k[1] for k in keys}) > 1:
        parts.append(f"{_short(dataset)}, δ={delta:.3g}")
    if len({k[2] for k in keys}) > 1:
        parts.append(f"from {start}")
    return f" [{'; '.join(parts)}]" if parts else ""


def _clipped_bar(y: float, sd: float, bound: float | None) -> tuple[float, float]:
    """(below, above) of a ± sd bar at y, kept inside [0, bound]."""
    lo = min(sd, max(0.0, y))
    hi = sd if bound is None else min(sd, max(0.0, bound - y))
    return lo, hi


def _short(dataset: str | None) -> str:
    if not dataset:
        return "dataset ?"
    return dataset if len(dataset) <= 28 else "…" + dataset[-27:]


def compare(paths, out: str | None = None, log=print) -> list[dict]:
    """Print the table of the runs at ``paths`` (and plot to ``out``); returns the rows."""
    rows = [load_run(p) for p in paths]
    names = [r["run"] for r in rows]
    for r in rows:
        if names.count(r["run"]) > 1:
            r["run"] = os.path.relpath(r["path"])
    log(format_table(rows))
    pooled = summarize(rows)
    same_eps: dict = {}  # runs at one (start, dataset, δ, privacy, ε): pooled or told apart
    for s in pooled:
        same_eps.setdefault((s["start"], s["dataset"], s["delta"], s["dp"],
                             None if s["epsilon"] is None else round(s["epsilon"], 2)), []).append(s)
    if any(s["n"] > 1 for s in pooled) or len({r["start"] for r in rows}) > 1 \
            or any(len(v) > 1 for v in same_eps.values()):
        log("\nby starting model and ε (runs that differ only by seed pooled; runs whose "
            "recipes differ otherwise are separate entries):")
        log(format_summary(pooled))
    gains = gain_recovered(pooled)
    if gains:
        log("\nfraction of the non-private gain recovered (held-out losses: internal, not for "
            "publication):")
        log(format_gain(gains))
    missing = [r["run"] for r in rows if r["heldout"] is None and r["dp_eval"] is None]
    if missing:
        log(f"no evaluation metrics in {', '.join(missing)} (listed with {DASH})")
    if out is not None:
        log(f"plot: {plot(rows, out)['path']}")
    return rows
