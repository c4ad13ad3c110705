"""The "Empirical audit" section: read from a run's ``audit.json`` (written by
``llmdp audit``), rendered in ``audit.md``, the privacy report and the model card.
Aggregate numbers only (no canary, coin, score or key): publishable."""

from __future__ import annotations

import json
import os

__all__ = ["audit_line", "audit_markdown", "audit_section", "render_audit"]

# What the report (and so an export) carries of audit.json. Never the realized number of
# included canaries (an earlier llmdp's `canaries_included`): it depends on the secret key.
SECTION_KEYS = ("audit_version", "method", "confidence", "canaries", "canary_kinds",
                "delta", "epsilon_claimed", "epsilon_training",
                "empirical_epsilon_lower_bound", "ratio_to_training_epsilon", "violation",
                "f_dp_mu_lower_bound", "f_dp_epsilon", "f_dp_curve_epsilon",
                "f_dp_curve_noise_multiplier", "ceiling", "canary_kind",
                "scores", "time_s", "settings", "planted")


def audit_section(run_dir: str) -> dict | None:
    """The run's empirical audit (audit.json's public keys), or None without one."""
    path = os.path.join(run_dir, "audit.json")
    try:
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        return {"error": f"audit.json is not valid JSON ({e})"}
    return {k: r[k] for k in SECTION_KEYS if k in r}


def audit_line(r: dict) -> str:
    head = (f"empirical audit: ε ≥ {r['empirical_epsilon_lower_bound']:.3f} with "
            f"{100 * r['confidence']:.0f}% confidence ({r['canaries']} canaries), against the "
            f"run's guarantee ε = {r['epsilon_training']:.4f} at δ = {r['delta']:.3g} (ratio "
            f"{r['ratio_to_training_epsilon']:.3f})")
    ceil = r.get("ceiling") or {}
    if r.get("f_dp_curve_epsilon") is not None:
        sig = r.get("f_dp_curve_noise_multiplier")
        head += (f"; f-DP on this mechanism's own curve: ε ≥ {r['f_dp_curve_epsilon']:.3f}"
                 + (f" (it behaved as if its noise multiplier were below {sig:.3f})" if sig else ""))
        if ceil.get("epsilon") is not None:
            head += (f", of a reachable {ceil['epsilon']:.3f} (the same estimator on ideal "
                     "gradient canaries scored on every iterate of this mechanism)")
    if r.get("f_dp_epsilon") is not None:
        head += (f"; f-DP (Gaussian): the run is not μ-GDP for μ < {r['f_dp_mu_lower_bound']:.3f}, "
                 f"ε ≥ {r['f_dp_epsilon']:.3f} on that curve")
        if ceil.get("mu") is not None:
            head += f" (reachable: μ {ceil['mu']:.3f})"
    if r["violation"]:
        head += (". VIOLATION: the empirical lower bound exceeds the claimed ε: the mechanism "
                 "does not give the guarantee it reports")
    return head


def render_audit(r: dict) -> str:
    """audit.md: the section alone."""
    return "\n".join(audit_markdown(r))


def audit_markdown(r: dict | None) -> list[str]:
    """The "Empirical audit" section's lines (none without an audit)."""
    if not r:
        return []
    if "error" in r:
        return ["## Empirical audit", "", r["error"], ""]
    lines = ["## Empirical audit", ""]
    if r.get("planted"):
        lines += [f"**A planted bug ({r['planted']}) was switched on for this audit "
                  "(the auditor's self-test).**", ""]
    lines += [
        audit_line(r) + ".", "",
        f"Method: {r['method']}. {r['canaries']} canaries "
        f"({r['canary_kinds'].get('record', 0)} synthetic records, "
        f"{r['canary_kinds'].get('random', 0)} random-token), each one privacy unit, each "
        "included in training with probability 1/2 by a secret keyed coin. An empirical "
        "lower bound can only show that ε is at least this large; it never certifies the "
        "guarantee.", "",
        "| score | ε lower bound | guesses | correct | f-DP, own curve: ε | f-DP μ lower bound | f-DP (Gaussian) ε | TPR at FPR 1% | TPR at FPR 10% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for kind, b in r["scores"].items():
        t = b.get("tpr_at_fpr", {})
        f = b.get("f_dp") or {}
        own = b.get("f_dp_curve") or {}
        lines.append(f"| {kind} | {b['epsilon_lower_bound']:.3f} | {b['r']} | {b['v']} | "
                     f"{own.get('epsilon', nan):.3f} | "
                     f"{f.get('mu_lower_bound', nan):.3f} | {f.get('epsilon', nan):.3f} | "
                     f"{t.get('0.01', nan):.3f} | {t.get('0.1', nan):.3f} |")
    ceil = r.get("ceiling") or {}
    if ceil:
        gauss = f"; Gaussian curves: μ {ceil['mu']:.3f}" if ceil.get("mu") is not None else ""
        lines += ["", ("Ceiling: " + (f"ε {ceil['epsilon']:.3f} on the mechanism's own curve{gauss}: "
                                     f"the f-DP bounds on ideal scores of this mechanism (q = {ceil['q']:.4g}, "
                                     f"σ = {ceil['sigma']:.4g}, T = {ceil['steps']}, {ceil['canaries']} "
                                     f"canaries, median of {ceil['draws']} seeded draws): what an audit "
                                     "with gradient canaries scored on every iterate could reach."
                                     if ceil.get("epsilon") is not None else f"none ({ceil.get('reason')})."))]
    lines += ["", f"Time: {r['time_s'].get('total', 0):.0f} s "
              f"(training {r['time_s'].get('train', 0):.0f} s, scores {r['time_s'].get('score', 0):.0f} s).", ""]
    return lines
