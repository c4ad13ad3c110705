"""How a privacy report reads: its Markdown and the ε panel of its plots.

`render_markdown` renders a report dict, the full local one (`llmdp.report.build.build_report`)
or the publishable one (`llmdp.record.publish.publishable_report`), whose internal sections are
absent and so are not rendered. `plot_publishable` draws the publishable plot (ε only); the
local plot, which adds the internal loss curve, is `llmdp.report.build.plot`. Both draw ε with
`_epsilon_panel`.
"""

from __future__ import annotations

from llmdp.audit.section import audit_markdown
from llmdp.config.choices import Mechanism
from llmdp.evaluation.report import evaluation_markdown
from llmdp.record.baseline import baseline_panel, render_baseline_markdown
from llmdp.record.publish import PUBLISHABLE_NOTE


def _attempts(r: dict) -> str:
    """How the run's attempts went: how many, how many a first Ctrl-C ended (their reserved,
    unrun steps voided in the ledger), and the steps lost to failures and re-executed."""
    stops = r.get("interruptions") or 0
    voided = r.get("steps_voided") or 0
    return (f"{r['attempts']} attempt(s)"
            + (f", {stops} ended by a Ctrl-C after a whole step (no step lost)"
               + (f" ({voided} reserved step(s) that never ran voided in the ledger)" if voided else "")
               if stops else "")
            + f", {r['steps_lost_to_failures']} step(s) lost to failures and re-executed")


def plain_guarantee(r: dict) -> str:
    """The guarantee in one plain sentence for a non-specialist, before the precise one."""
    import math

    eps, delta = r["epsilon"], r["delta"]
    size = r.get("unit_size") or {}
    kind = r.get("unit")
    if kind == "sequence":
        what = f"any one {size.get('sequence_length', '?')}-token passage"
    elif kind == "document":
        what = "any one document"
    elif kind == "user":
        what = f"any one user (all records sharing {size.get('user_field')!r})"
    else:
        what = "any one privacy unit"
    how = "almost nothing" if eps <= 1 else "little" if eps <= 4 else "a bounded amount"
    factor = math.exp(eps) if eps < 700 else math.inf
    times = (f"{factor:,.1f}" if factor < 100 else f"{factor:,.0f}" if factor < 1e9 else f"{factor:.3g}")
    return (f"In plain words: a person who sees this model learns {how} about whether {what} "
            f"was in the training data: anything they conclude is at most {times} times "
            f"(e^ε, ε = {eps:.2f}) more likely with it than without it, except with probability "
            f"δ = {delta:.3g}. The smaller ε, the stronger the protection.")


def _gain_markdown(g: dict | None) -> list[str]:
    """`llmdp privacy report --baseline`'s section (internal: held-out losses without DP)."""
    if not g:
        return []
    def f(x):
        return "–" if x is None else f"{x:.4f}"
    frac = "–" if g["fraction"] is None else f"{g['fraction']:.1%}"
    return ["## Fraction of the non-private gain recovered (internal: do not publish)", "",
            f"(start − DP) / (start − NON-PRIVATE) = **{frac}**: held-out loss {f(g['start_loss'])} "
            f"before training, {f(g['dp_loss'])} after this run, {f(g['non_private_loss'])} after "
            f"the NON-PRIVATE baseline `{g['baseline']}` (from {g['start']}).", ""]


def render_markdown(r: dict) -> str:
    """Markdown of a report: the full local one, or a publishable one (`publishable_report`),
    whose internal sections are absent and so are not rendered."""
    if r.get("dp") is False:  # a NON-PRIVATE baseline: no guarantee to state
        return render_baseline_markdown(r)
    eps = r["epsilon_by_accountant"]
    s = r["sampling"]
    tok = r.get("tokenizer") or {}
    pub = bool(r.get("publishable"))
    lines = ([f"**Warning: a planted bug ({r['planted']}, a test-only switch) broke the mechanism "
               "in this run: it carries NO privacy guarantee; the numbers below are what it "
               "claimed.**", ""] if r.get("planted") else [])
    lines += ([f"**Warning: {r['exceeds_target']}.**", ""] if r.get("exceeds_target") else []) + [
        "# Privacy report",
        "",
        plain_guarantee(r),
        "",
        f"**Guarantee:** (ε = {r['epsilon']:.4f}, δ = {r['delta']:.3g})-differential privacy "
        f"with respect to {r['adjacency']}, accounted with {r['accountant'].upper()} "
        "(" + "; ".join(f"{k.upper()}: ε = {v:.4f}" for k, v in eps.items()) + ")"
        + _delta_split(r) + ".",
        "",
    ]
    if pub:
        lines += [f"> This is the {PUBLISHABLE_NOTE}.", ""]
    if r.get("guarantee_scope"):
        lines += [f"**Scope:** {r['guarantee_scope']}.", ""]
    if r.get("hyperparameters"):
        lines += [f"**Hyper-parameters:** {r['hyperparameters']['note']}.", ""]
    if r.get("unit_warning"):
        lines += [f"> **Unit warning (internal):** {r['unit_warning']}.", ""]
    if r.get("rng_warning"):
        lines += [f"> **Warning:** {r['rng_warning']}", ""]
    if r.get("status") != "complete":
        lines += [f"> Run status: **{r.get('status')}**" + (f" ({r['failure']})" if r.get("failure") else "")
                  + (f" ({r['stopped']})" if r.get("stopped") else "")
                  + (f" ({r['resume']})" if r.get("resume") else "")
                  + ". The ε above covers every step recorded in the ledger.", ""]
    others = ", ".join(k.upper() for k in eps if k != r["accountant"])
    lines += [
        "## Checklist (How to DP-fy ML, §5.3.3)",
        "",
        "| item | value |",
        "| --- | --- |",
        f"| DP setting | {r['dp_setting']} |",
        f"| Unit of privacy | {r['unit']}: {r['unit_description']} |",
        *([f"| Unit formation | {r['unit_formation']} |"] if r.get("unit_formation") else []),
        *([f"| Records | {r['records']} |"] if r.get("records") else []),
        *([f"| Record format | {r['record_format']} |"] if r.get("record_format") else []),
        f"| Unit size / contribution bound | {r['contribution_bound']} |",
        f"| Adjacency | {r['adjacency']} |",
        *([f"| Published counts (public) | {r['published_counts']} |"] if r.get("published_counts") else []),
        *([f"| Accounting relation | {r['accounting_relation']} (dp-accounting) |"]
          if r.get("accounting_relation") else []),
        f"| Mechanism output | {r['mechanism_output']} |",
        *([f"| Checkpoints | {r['checkpoints']} |"] if r.get("checkpoints") else []),
        f"| Accounting | {r['accountant'].upper()} (reported); also computed: "
        f"{others or 'none (truncated Poisson is accounted by PLD only)'}; δ = {r['delta']:.3g} "
        f"(< 1/N = {1 / r['dataset_size']:.3g}){_delta_split(r, short=True)} |",
        f"| ε at δ | {r['epsilon']:.4f} (target {r['target_epsilon'] if r.get('target_epsilon') is not None else 'none: σ given'})"
        + (f"; training steps alone {r['epsilon_training_only']:.4f}"
           + (", composed with the private tokenizer's release" if tok.get("composed_into_guarantee") else "")
           + (" and the DP evaluations" if (r.get("evaluation") or {}).get("dp") else "")
           if r.get("epsilon_training_only") is not None and (
               tok.get("composed_into_guarantee") or (r.get("evaluation") or {}).get("dp")) else "") + " |",
        *([f"| Correlated noise | {r['correlated_noise']['mechanism']}: "
           f"{r['correlated_noise']['participation']}; ledger unit: {r['correlated_noise']['ledger_unit']} |"]
          if r.get("correlated_noise") else []),
        f"| Sampling assumed | {s['assumed']} |",
        f"| Sampling used | {s['used']}; honoured: {'yes' if s.get('honoured') else 'NO'} ({s.get('note', '')}) |",
        f"| Sampling probability q | {r['sampling_probability']:.6g} |",
        f"| Expected batch size q·N | {r['expected_batch_size']:g} units |",
        f"| Dataset size N | {r['dataset_size']} units |",
        *_truncation_rows(r),
        f"| Noise multiplier σ | {r['noise_multiplier']:.6g} |",
        *_noise_line(r),
        f"| Clipping norm C | {r['max_grad_norm']:g} ({r['clipping']}) |",
        f"| Steps T (ledger) | {r['steps']} (planned {r['steps_planned']}, completed {r['steps_completed']}; "
        f"{_attempts(r)}) |",
        *_dataset_rows(r),
        f"| Noise std per coordinate of the averaged gradient | σC/(qN) = {r['noise_std_per_coordinate']:.4g} |",
        f"| RNG mode | {r['rng_mode']} |",
        f"| Tokenizer | {tok.get('note', '–')} |",
        "",
        "## Data accesses covered",
        "",
        *[f"- {x}" for x in r["data_accesses_covered"]],
        "",
        "## Not covered by this guarantee",
        "",
        *[f"- {x}" for x in r["data_accesses_not_covered"]],
        "",
    ]
    if "internal_metrics" in r:
        lines += [
            "## Metrics computed on private data without DP (internal: do not publish)",
            "",
            *[f"- `{k}`: {v}" for k, v in r["internal_metrics"].items()],
            "",
            "Data statistics (internal): " + ", ".join(
                f"{k}={v}" for k, v in r["data_statistics"].items()
                if k not in ("computed_on_private_data", "note")) + ".",
            "",
        ]
    lines += evaluation_markdown(r.get("evaluation"))
    lines += _gain_markdown(r.get("non_private_gain"))
    lines += audit_markdown(r.get("empirical_audit"))
    ledger = r["ledger"]
    lines += [
        "## Ledger",
        "",
        (f"{ledger['lines']} line(s) in `ledger.jsonl`" if "lines" in ledger else
         f"`ledger.jsonl` holds {len(ledger['releases'])} release record(s)")
        + (" plus the tokenizer's release (recorded in the dataset ledger)" if tok.get(
            "composed_into_guarantee") and "lines" in ledger else "") + ": every DP release, composed above:",
        "",
        "| run | attempt | first step | count | mechanism |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {x['run_id']} | {x.get('attempt') or '-'} | {x['first_step'] if x.get('first_step') is not None else '-'} "
          f"| {x['count']} | {x['mechanism']} |" for x in ledger["releases"]],
        "",
        "![epsilon spent](privacy_report.png)" if pub else "![epsilon and loss](privacy_report.png)",
        "",
    ]
    return "\n".join(lines)


def _delta_split(r: dict, short: bool = False) -> str:
    """How δ splits into the accountant's and the noise generator's tails (issue 29, 8)."""
    tail = r.get("delta_noise_tail")
    if tail is None:
        return "" if short or not r.get("noise_generator") else (
            "; δ is the accountant's: the noise generator's truncated tails are not included "
            "(a plan of an earlier llmdp; see the noise generator row)")
    return (f" = {r['delta_accountant']:.6g} (accountant) + {tail:.3g} (the noise generator's "
            "truncated tails)" if short else
            f"; δ includes the noise generator's truncated tails ({tail:.3g}): every ε is "
            f"computed at the accountant's δ = {r['delta_accountant']:.6g}")


def _noise_line(r: dict) -> list[str]:
    g = r.get("noise_generator")
    if not g:
        return []
    if g.get("included_in_delta"):
        d = ("; ".join(f"{x['releases']}: {x['count']} × ≤ {x['delta'] / x['count']:.3g}"
                       for x in g["truncation_delta_releases"] if x["count"])
             + f"; {g['delta_noise_tail']:.3g} in all over the ledger's releases (kept mass "
               f"Z ≥ 1 - {1 - g['kept_mass_at_least']:.3g}), included in δ above")
    elif g["truncation_delta_per_step"] is None:
        d = "not computed (trainable parameter count unknown)"
    else:
        d = (f"≤ {g['truncation_delta_per_step']:.3g} per step, ≤ {g['truncation_delta_run']:.3g} "
             f"over the {r['steps']} ledger steps, not included in δ above (a plan of an "
             f"earlier llmdp)")
    return [f"| Noise generator | {g.get('method', 'Box-Muller')}: |z| ≤ {g['tail_truncation_std']:.4f}·σC "
            f"per coordinate (truncated tail: δ added {d}); draws rounded to float32 (not accounted); "
            "the accountant assumes an exact continuous Gaussian |"]


def _truncation_rows(r: dict) -> list[str]:
    s = r["sampling"]
    if "max_batch_size" not in s:
        return []
    prob = s["truncation_probability_per_step"]
    cost = s["truncation_epsilon_cost"]
    return [
        f"| Truncation cap B_max | {s['max_batch_size']} units; per-step truncation probability "
        f"{prob:.3g}; ε cost of truncation {100 * cost:.3g}% |" if prob is not None and cost is not None
        else f"| Truncation cap B_max | {s['max_batch_size']} units |",
    ] + ([f"| Steps truncated (internal) | {s['steps_truncated']} |"] if "steps_truncated" in s else [])


def _dataset_rows(r: dict) -> list[str]:
    d = r.get("dataset_ledger")
    if not d or "epsilon_spent" not in d:
        return []
    budget = (f"; budget ε = {d['budget_epsilon']:g}, remaining {d['epsilon_remaining']:.4f}"
              if d.get("budget_epsilon") is not None else "; no budget set")
    other = d.get("not_composed") or []
    # A dp-sgd record counts steps (a block of k steps is one record of count k).
    listed = "; ".join(f"{x['run_id']} ({x['mechanism']}, {x['count']} "
                       f"{'step(s)' if x['mechanism'] == Mechanism.DP_SGD else 'release(s)'}, unit {x['unit']}): "
                       f"{x['status']}" for x in other)
    # Internal: totals over every run's releases on the dataset, which other runs move (a
    # random sweep's K among them); the publishable report never holds this section.
    return [f"| Dataset ledger (internal: every run's releases on this data for this run's unit, "
            f"{d.get('unit')}; never published) | ε = "
            f"{d['epsilon_spent']:.4f} at δ = {d['delta']:.3g}{budget} |"] + (
        [f"| Dataset ledger, other privacy units | {listed}; an ε for one unit definition is no "
         f"guarantee for another, and no group-privacy conversion is made |"] if other else []) + (
        [f"| Dataset ledger, declared distinct from {', '.join(d['distinct_from']['ledgers'])} "
         f"(data.distinct_from, internal) | {d['distinct_from']['reason']} |"]
        if d.get("distinct_from") else [])


def _epsilon_panel(ax, curve, report: dict) -> None:
    if report.get("dp") is False:  # a NON-PRIVATE baseline: no ε to draw
        baseline_panel(ax)
        return
    ax.plot([t for t, _ in curve], [e for _, e in curve], color="tab:red")
    corr = report.get("correlated_noise")
    ax.set_xlabel(f"rounds recorded in the ledger ({corr['cycle']} steps each)" if corr
                  else "steps recorded in the ledger")
    ax.set_ylabel(f"epsilon at delta={report['delta']:.0e} ({report['accountant']})")
    ax.set_title("privacy spent")
    ax.grid(alpha=0.3)
    if report.get("target_epsilon"):
        ax.axhline(report["target_epsilon"], ls="--", color="gray", label="target")
        ax.legend()


def plot_publishable(r: dict, out: str) -> str:
    """The publishable plot: ε spent against the steps of the ledger, drawn from the
    publishable report's ``epsilon_curve`` alone (no loss curve, nothing internal)."""
    import matplotlib  # lazy: only drawing needs matplotlib (slow to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

    fig, ax = plt.subplots(1, 1, figsize=(5, 3.6))
    _epsilon_panel(ax, r.get("epsilon_curve") or [], r)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
