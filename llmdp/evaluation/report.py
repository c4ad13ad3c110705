"""The evaluation section of a run's privacy report (``llmdp.report.build_report``): held-out
metrics (internal on private data, publishable on public data), the DP evaluations and
their plan, the generations; and the line the DP evaluations add to "covered"."""

from __future__ import annotations

import json
import os

from llmdp.privacy.ledger import EVAL_MECHANISM

__all__ = ["evaluation_section", "dp_eval_covered"]


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
    held = [{k: m.get(k) for k in keep} for m in metrics if m.get("event") == "eval"]
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
