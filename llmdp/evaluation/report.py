"""The evaluation section of a run's privacy report (``llmdp.report.build.build_report``): held-out
metrics (internal on private data, publishable on public data), the DP evaluations and
their plan, the generations; the line the DP evaluations add to "covered"; and the
section's Markdown (report, baseline report, model card)."""

from __future__ import annotations

import json
import os

from llmdp.privacy.ledger import EVAL_MECHANISM

__all__ = ["evaluation_section", "dp_eval_covered", "evaluation_markdown"]


def evaluation_section(run_dir: str, plan_info: dict, metrics: list[dict],
                        records: list[dict]) -> dict | None:
    """Held-out metrics (internal on private data, publishable on public data), the DP
    evaluations (publishable) and the generations from public prompts (publishable)."""
    kind = plan_info.get("eval_data")
    gens_path = os.path.join(run_dir, "generations.json")
    gens = None
    if os.path.exists(gens_path):
        with open(gens_path, encoding="utf-8") as f:
            gens = json.load(f)
    if kind is None and gens is None:
        return None
    keep = ("step", "loss", "perplexity", "accuracy", "units", "tokens")
    # One row per step: a step evaluated again (re-executed after a resume from an earlier
    # checkpoint) keeps its latest evaluation, that of the model the run went on from.
    by_step = {m.get("step"): {k: m.get(k) for k in keep} for m in metrics if m.get("event") == "eval"}
    held = [by_step[s] for s in sorted(by_step, key=lambda s: -1 if s is None else s)]
    dp = [{k: v for k, v in m.items() if k not in ("event", "time")}
          for m in metrics if m.get("event") == "dp_eval" and "refused" not in m]
    plan = plan_info.get("dp_eval")
    out = {
        "data": kind,
        "internal": held if kind == "private" else [],
        "public": held if kind == "public" else [],
        "dp": dp,
        "dp_refused": [m["refused"] for m in metrics if m.get("event") == "dp_eval" and "refused" in m],
        "dp_plan": None if plan is None else {
            "noise_multiplier": plan["noise_multiplier"], "releases_planned": plan["releases"],
            "releases_recorded": sum(1 for r in records if r.get("kind") == "release"
                                     and (r.get("meta") or {}).get("mechanism") == EVAL_MECHANISM),
            "epsilon_alone": plan.get("epsilon_alone"), "target_epsilon": plan.get("target_epsilon"),
            "loss_bound": plan["loss_bound"], "count": plan["count"], "steps": plan.get("steps"),
            "aggregates": ["loss", "accuracy"] + (["count"] if plan["count"] == "noised" else []),
            "mechanism": "per-unit loss clipped to [0, loss_bound] and token accuracy in [0, 1], "
            "each scaled to [0, 1]" + (", and a count of 1 per unit" if plan["count"] == "noised" else "")
            + "; summed; one Gaussian noise of std noise_multiplier x sqrt(aggregates) per scaled "
            "sum (L2 sensitivity sqrt(aggregates)); means are post-processing",
        },
        "generations": (gens or {}).get("generations") or [],
        "generation_settings": (gens or {}).get("settings"),
    }
    return out


def dp_eval_covered(plan_info: dict, records: list[dict]) -> list[str]:
    plan = plan_info.get("dp_eval")
    n = sum(1 for r in records if r.get("kind") == "release"
            and (r.get("meta") or {}).get("mechanism") == EVAL_MECHANISM)
    if not plan or not n:
        return []
    return [f"this run's DP evaluations of held-out loss and accuracy ({n} release(s) recorded, "
            f"Gaussian noise multiplier {plan['noise_multiplier']:.4g}; ε = "
            f"{plan.get('epsilon_alone') or float('nan'):.4f} for the {plan['releases']} planned, "
            "alone), composed above"]


def evaluation_markdown(ev: dict | None, heading: str = "##") -> list[str]:
    """The evaluation section: DP evaluations (publishable), held-out metrics (internal on
    private data; absent from a publishable report), generations."""
    if not ev:
        return []
    lines = [f"{heading} Evaluation", ""]
    plan = ev.get("dp_plan")
    if ev.get("dp"):
        lines += [
            "DP evaluation on held-out units (publishable: released with DP, composed into ε above"
            + (f"; noise multiplier {plan['noise_multiplier']:.4g}, loss clipped to "
               f"[0, {plan['loss_bound']:.4g}], count {plan['count']}" if plan else "") + "):",
            "",
            "| after step | loss ± std | perplexity ± std | token accuracy ± std | units |",
            "| ---: | --- | --- | --- | ---: |",
            # perplexity's std: the loss std through exp (delta method)
            *[f"| {m['step']} | {m['loss']:.4f} ± {m['loss_std']:.4f} | {m['perplexity']:.2f} ± "
              f"{m['perplexity'] * m['loss_std']:.2f} | "
              f"{m['accuracy']:.4f} ± {m['accuracy_std']:.4f} | {m['count']:.0f}"
              + (" (noised)" if m.get("count_kind") == "noised" else "") + " |" for m in ev["dp"]],
            "",
        ]
    for why in ev.get("dp_refused") or []:
        lines += [f"> DP evaluation not released: {why}", ""]
    for key, what in (("public", "Held-out metrics on public data (publishable)"),
                      ("internal", "Held-out metrics on private data, without DP (internal: do not publish)")):
        rows = ev.get(key) or []
        if rows:
            lines += [f"{what}:", "", "| after step | loss | perplexity | token accuracy | units |",
                      "| ---: | ---: | ---: | ---: | ---: |",
                      *[f"| {m['step']} | {m['loss']:.4f} | {m['perplexity']:.2f} | "
                        f"{m['accuracy']:.4f} | {m['units']} |" for m in rows], ""]
    gens = ev.get("generations") or []
    settings = ev.get("generation_settings") or {}
    if settings.get("skipped"):
        lines += [f"Generations: {settings['skipped']}.", ""]
    if gens:
        lines += [f"Generations from public prompts (greedy, and sampled at temperature "
                  f"{settings.get('temperature')}, top-p {settings.get('top_p')}, seed "
                  f"{settings.get('seed')}; at most {settings.get('max_new_tokens')} new tokens):", ""]
        for g in gens:
            lines += [f"- **{_md(g['prompt'])}** → greedy: {_md(g['greedy'])} · sampled: "
                      f"{_md(g['sampled'])}"]
        lines += [""]
    return lines


def _md(text: str) -> str:
    """A generated string on one Markdown line, as code (nothing in it is rendered)."""
    one = " ".join(str(text).split()).replace("`", "'")
    if one:
        return f"`{one}`"
    # Nothing visible: say what it was (a newline and spaces is not "nothing").
    return f"(whitespace only: `{text!r}`)" if text else "(empty)"
