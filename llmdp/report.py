"""Privacy report of a run: JSON + Markdown + plot, answering the DP-fy guide's checklist (§5.3.3).

Everything is recomputed from the durable artifacts of the run directory: the ledger (what
was released), the resolved config and plan (how), and metrics.jsonl (what happened). The
ε reported is the composition of *every* release in the ledger, not the plan's promise.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

REPORT_VERSION = 1

# Metrics in metrics.jsonl that are computed on private data without DP. They are useful to
# the trainer and must not be published (DESIGN §3.7).
INTERNAL_METRICS = {
    "train_loss": "mean normalized training loss of the sampled units (per step)",
    "worker0_units": "number of units rank 0 processed (reveals the realized sample size)",
    "worker0_tokens": "number of real tokens rank 0 processed",
    "worker0_tokens_per_s": "throughput of rank 0 (derived from the token count)",
    "worker0_units_per_s": "throughput of rank 0 in units",
    "units / rows / tokens": "units, rows and real tokens processed by all workers (the realized sample)",
    "tokens_per_s / units_per_s (and _per_worker)": "throughput of all workers together, and its "
    "mean per worker (derived from the realized sample)",
    "worker0_clipped_fraction": "fraction of rank 0's units whose gradient norm exceeded C",
    "micro_steps": "micro-steps per worker (reveals the realized sample size)",
    "sample_truncated": "whether the step's Poisson draw exceeded max_batch_size (truncated Poisson)",
    "data_statistics": "counts of records, rows, tokens, truncated documents and capped users "
    "(N, the number of units, is used by the accountant and published as is)",
}


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line after a crash
    return out


def build_report(run_dir: str, failure: str | None = None) -> dict[str, Any]:
    from llmdp.privacy import accountant
    from llmdp.privacy.ledger import Ledger
    from llmdp.privacy.plan import DPPlan

    run_dir = os.path.abspath(run_dir)
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as f:
        plan_info = json.load(f)
    plan = DPPlan.from_dict(plan_info["plan"])
    ledger_path = os.path.join(run_dir, "ledger.jsonl")
    ledger = Ledger(ledger_path)
    records = ledger.records() if os.path.exists(ledger_path) else []
    entries = ledger.entries() if records else []
    delta = plan.delta
    from llmdp.privacy.events import is_truncated

    # Every accountant that supports every recorded event (RDP cannot account truncated
    # Poisson: it is left out rather than approximated).
    usable = [name for name in accountant.ACCOUNTANTS
              if name == plan.accountant or not any(is_truncated(e) for e, _ in entries)]
    # Releases this run's model builds on, made before it on the same units (a private
    # tokenizer): composed into the guarantee, thresholds' delta included.
    from llmdp.privacy.plan import release_entries

    prior = list(plan_info.get("prior_releases") or [])
    prior_entries, prior_dthr = release_entries(prior)
    eps = {name: accountant.epsilon_with_threshold(prior_entries + entries, delta, prior_dthr, name)
           for name in usable}
    eps_training = accountant.epsilon(entries, delta, plan.accountant) if prior else eps[plan.accountant]
    ledger_steps = sum(int(r["count"]) for r in records if r.get("kind") == "release")

    metrics = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    step_records = [m for m in metrics if "event" not in m and "step" in m]
    completed = max((m["step"] for m in step_records), default=0)
    stop = next((m for m in reversed(metrics) if m.get("event") == "stopped"), None)
    attempts = sorted({r.get("attempt") for r in records if r.get("kind") == "release"})
    priv = cfg["privacy"]
    seeded = priv.get("rng") == "seeded"
    unit_meta = records[-1]["meta"]["unit"] if records else {}
    data_cfg = cfg["data"]
    unit_desc = unit_meta.get("description") or f"a sequence of {data_cfg['sequence_length']} tokens"
    unit_kind = unit_meta.get("kind") or data_cfg["unit"]
    rows_cap = int(unit_meta.get("max_rows_per_unit") or data_cfg.get("max_rows_per_unit") or 1)
    seq_len = int(unit_meta.get("sequence_length") or data_cfg["sequence_length"])
    data_stats = dict(plan_info.get("data") or {})
    truncated_steps = sum(1 for m in step_records if m.get("sample_truncated"))
    releases = [
        {
            "run_id": r.get("run_id"),
            "attempt": None,
            "first_step": None,
            "count": r.get("count"),
            "event": r.get("event"),
            "mechanism": r.get("mechanism", "private-tokenizer"),
            "epsilon_alone": r.get("epsilon"),
            "delta_threshold": (r.get("extra") or {}).get("delta_threshold"),
            "recorded_in": r.get("ledger"),
        }
        for r in prior
    ] + [
        {
            "run_id": r.get("run_id"),
            "attempt": r.get("attempt"),
            "first_step": r.get("first_step"),
            "count": r.get("count"),
            "event": r.get("event"),
            "mechanism": (r.get("meta") or {}).get("mechanism", "dp-sgd"),
            "time": r.get("time"),
        }
        for r in records
        if r.get("kind") == "release"
    ]
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "run_id": plan_info.get("run_id"),
        "status": "failed" if failure else ("complete" if completed >= plan.steps else
                                            "stopped" if stop else "incomplete"),
        "failure": failure,
        "stopped": stop["reason"] if stop else None,
        # ---- the guarantee
        "epsilon": eps[plan.accountant],
        "delta": delta,
        "accountant": plan.accountant,
        "epsilon_by_accountant": eps,
        "epsilon_training_only": eps_training,
        "delta_threshold_of_earlier_releases": prior_dthr,
        "target_epsilon": plan.target_epsilon,
        "epsilon_planned": plan_info.get("epsilon_planned"),
        "dp_setting": "central DP: a trusted trainer holds the raw data; the released "
        "artifacts are the model checkpoints and the final model",
        "unit": unit_kind,
        "unit_description": unit_desc,
        "records": _describe_records(data_cfg),
        "unit_size": {
            "sequence_length": seq_len,
            "max_rows_per_unit": rows_cap,
            "max_tokens_per_unit": rows_cap * seq_len,
            "user_field": unit_meta.get("user_field", data_cfg.get("user_field")),
            "document_masking": bool(unit_meta.get("document_masking", data_cfg.get("document_masking"))),
        },
        "contribution_bound": _contribution_bound(unit_kind, rows_cap, seq_len,
                                                  unit_meta.get("user_field", data_cfg.get("user_field"))),
        "data_statistics": {
            "computed_on_private_data": True,
            "note": "counts computed on the private corpus without DP (internal); only N is "
            "used by the accountant",
            **{k: v for k, v in data_stats.items() if not k.startswith("parameters_")},
        },
        "adjacency": "add-or-remove one privacy unit (" + unit_desc + ")",
        "mechanism_output": "every intermediate model (all T noisy updates); the final model "
        "and every checkpoint are covered",
        "data_accesses_covered": [
            f"the private tokenizer's release {r.get('release_id')} on the same units "
            f"(ε_tok = {r.get('epsilon'):.4f} alone; Gaussian partition selection, threshold δ "
            f"{(r.get('extra') or {}).get('delta_threshold'):.3g})"
            for r in prior
        ] + [
            "this run's DP-SGD training steps on the private corpus, as recorded in the ledger "
            f"({ledger_steps} steps over {len({r.get('attempt') for r in records})} attempt(s))",
        ],
        "data_accesses_not_covered": [
            "the choice of hyper-parameters (C, learning rate, batch size, steps) if it was "
            "tuned on this private data: that tuning is not accounted",
            "the pretrained model's training data, and the tokenizer's unless it is a DP "
            "release on this data listed above (public, or covered by their own guarantees)",
            "dataset statistics used to plan the run (N, number of units) are published as is",
            "metrics listed under internal_metrics",
        ],
        "tokenizer": _tokenizer_section(cfg, plan_info),
        # ---- the mechanism's numbers
        "steps": ledger_steps,
        "steps_planned": plan.steps,
        "steps_completed": completed,
        "attempts": len(attempts),
        # Steps in the ledger beyond those that produced the final model: executed (or
        # reserved write-ahead) by attempts that failed, then re-executed after a resume.
        "steps_lost_to_failures": max(0, ledger_steps - completed),
        "dataset_ledger": _dataset_ledger(plan_info, plan),
        "noise_multiplier": plan.noise_multiplier,
        "sampling_probability": plan.sampling_probability,
        "expected_batch_size": plan.expected_batch_size,
        "dataset_size": plan.dataset_size,
        "max_grad_norm": plan.max_grad_norm,
        "noise_std_per_coordinate": plan.noise_std,
        "clipping": "flat: each unit's gradient over all trainable parameters clipped to L2 <= C",
        "normalization": "noisy sum divided by the expected batch size q*N",
        "sampling": _sampling_section(plan, seeded, truncated_steps, completed),
        "rng_mode": priv.get("rng"),
        "rng_warning": (
            "This run used a fixed seed for sampling and noise: it carries NO privacy guarantee "
            "against anyone who knows that seed." if seeded else None
        ),
        "ledger": {
            "path": "ledger.jsonl",
            "lines": len(records),
            "torn_lines": getattr(ledger, "torn_lines", 0),
            "releases": releases,
        },
        "internal_metrics": INTERNAL_METRICS,
        "config_hash": records[-1]["meta"].get("config_hash") if records else None,
        "dataset_fingerprint": records[-1]["meta"].get("dataset_fingerprint") if records else None,
    }
    return report


def _tokenizer_section(cfg: dict, plan_info: dict) -> dict:
    tok = plan_info.get("tokenizer") or {}
    path = cfg["model"].get("tokenizer") or cfg["model"].get("name_or_path")
    kind = tok.get("kind", "external")
    if kind == "private-dp":
        vocab = ("trained from scratch: the model is built from a config with the private "
                 "tokenizer's vocabulary" if cfg["model"].get("init") == "tiny" else
                 "pretrained model adapted to the private tokenizer: embeddings resized, each new "
                 "token initialized from the base tokenizer's pieces of the same string (a public "
                 "computation)")
    elif cfg["model"].get("init") == "tiny":
        vocab = "trained from scratch with this tokenizer's vocabulary"
    else:
        vocab = "the pretrained model with " + ("an adapted vocabulary" if cfg["model"].get(
            "base_tokenizer") else "its tokenizer as given")
    return {
        "path": path,
        "kind": kind,
        "composed_into_guarantee": bool(tok.get("compose")),
        "model_vocabulary": vocab,
        "vocab_size": tok.get("vocab_size"),
        "vocab_adaptation": tok.get("vocab_adaptation"),
        "trained_by_this_run": False,
        "note": (tok.get("summary") or "not fit on the private corpus by llmdp; a tokenizer fit "
                 "on this private data elsewhere is not covered") + f"; model vocabulary: {vocab}",
    }


def _dataset_ledger(plan_info: dict, plan) -> dict | None:
    """ε composed over everything recorded on this dataset (every run, every tokenizer)."""
    path = plan_info.get("dataset_ledger")
    if not path:
        return None
    from llmdp.privacy.service import budget_status

    try:
        return budget_status(path, plan_info.get("budget_epsilon"), plan.delta, plan.accountant)
    except Exception as e:  # the run's own report must not depend on another file's health
        return {"ledger": path, "error": repr(e)}


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
        f"| Steps truncated (internal) | {s['steps_truncated']} |",
    ]


def _dataset_rows(r: dict) -> list[str]:
    d = r.get("dataset_ledger")
    if not d or "epsilon_spent" not in d:
        return []
    budget = (f"; budget ε = {d['budget_epsilon']:g}, remaining {d['epsilon_remaining']:.4f}"
              if d.get("budget_epsilon") is not None else "; no budget set")
    return [f"| Dataset ledger (all releases on this data) | ε = {d['epsilon_spent']:.4f} at δ = "
            f"{d['delta']:.3g}{budget} |"]


def _describe_records(data_cfg: dict) -> str:
    from llmdp.data.sources import describe_records

    return describe_records(data_cfg)


def _contribution_bound(kind: str, rows: int, seq_len: int, user_field) -> str:
    if kind == "sequence":
        return f"one unit is one row of {seq_len} tokens; its gradient is clipped to C"
    what = "document" if kind == "document" else f"user (records sharing {user_field!r})"
    return (f"each {what} contributes at most {rows} row(s) of {seq_len} tokens "
            f"({rows * seq_len} tokens), clipped together to C; the rest is dropped")


def _sampling_section(plan, seeded: bool, truncated_steps: int, completed: int) -> dict:
    source = "a seeded generator" if seeded else "fresh OS entropy (SHAKE-256 stream)"
    if plan.sampler == "truncated-poisson":
        return {
            "assumed": "truncated Poisson: every unit independently with probability q, then, "
            f"if more than B_max = {plan.max_batch_size} units were drawn, a uniformly random "
            "subset of B_max of them (dp-accounting's TruncatedSubsampledGaussianDpEvent, "
            "add-or-remove-one relation, PLD accountant)",
            "used": "truncated Poisson from " + source,
            "honoured": True,
            "max_batch_size": plan.max_batch_size,
            "truncation_probability_per_step": plan.truncation_probability,
            "truncation_epsilon_cost": plan.truncation_cost,
            "steps_truncated": truncated_steps,
            "steps_truncated_note": "computed on private data (internal)",
            "note": "every step runs the micro-steps of B_max units (padding below it)",
        }
    return {
        "assumed": "Poisson: every unit independently with probability q at every step",
        "used": "Poisson from " + source,
        "honoured": True,
        "note": "empty samples run as noise-only steps; no truncation, no shuffling",
    }


def epsilon_curve(run_dir: str, points: int = 16) -> list[tuple[int, float]]:
    """ε after t steps of this run's plan, at a few t: the curve of the plot (a fast,
    conservative PLD estimate; the reported ε is computed from the ledger)."""
    from llmdp.privacy.plan import DPPlan

    with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as f:
        plan = DPPlan.from_dict(json.load(f)["plan"])
    with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as f:
        prior = json.load(f).get("prior_releases") or []
    ts = sorted({max(1, round(plan.steps * i / points)) for i in range(1, points + 1)})
    if not prior:
        return [(0, 0.0)] + [(t, plan.epsilon_estimate(t)) for t in ts]
    from llmdp.privacy.plan import composed_epsilon

    # Starts at the tokenizer's ε: the model's guarantee covers both releases.
    return [(t, composed_epsilon(plan, prior, steps=t)) for t in [0] + ts]


def write_report(run_dir: str, failure: str | None = None) -> dict[str, Any]:
    report = build_report(run_dir, failure=failure)
    with open(os.path.join(run_dir, "privacy_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(run_dir, "privacy_report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(report))
    try:
        plot(run_dir, report)
    except Exception as e:  # a plot must never lose a report
        report["plot_error"] = repr(e)
    return report


def plot(run_dir: str, report: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = epsilon_curve(run_dir)
    metrics = [m for m in _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
               if "event" not in m and m.get("train_loss") is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot([t for t, _ in curve], [e for _, e in curve], color="tab:red")
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"epsilon at delta={report['delta']:.0e} ({report['accountant']})")
    ax1.set_title("privacy spent")
    ax1.grid(alpha=0.3)
    if report.get("target_epsilon"):
        ax1.axhline(report["target_epsilon"], ls="--", color="gray", label="target")
        ax1.legend()
    if metrics:
        steps = [m["step"] for m in metrics]
        loss = [m["train_loss"] for m in metrics]
        ax2.plot(steps, loss, alpha=0.35, color="tab:blue")
        k = max(1, len(loss) // 20)
        smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
        ax2.plot(steps, smooth, color="tab:blue")
    ax2.set_xlabel("step")
    ax2.set_ylabel("train loss (internal, not DP)")
    ax2.set_title("training loss")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    out = os.path.join(run_dir, "privacy_report.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def render_markdown(r: dict) -> str:
    eps = r["epsilon_by_accountant"]
    lines = [
        "# Privacy report",
        "",
        f"**Guarantee:** (ε = {r['epsilon']:.4f}, δ = {r['delta']:.3g})-differential privacy "
        f"with respect to {r['adjacency']}, accounted with {r['accountant'].upper()} "
        "(" + "; ".join(f"{k.upper()}: ε = {v:.4f}" for k, v in eps.items()) + ").",
        "",
    ]
    if r.get("rng_warning"):
        lines += [f"> **Warning:** {r['rng_warning']}", ""]
    if r["status"] != "complete":
        lines += [f"> Run status: **{r['status']}**" + (f" ({r['failure']})" if r.get("failure") else "")
                  + (f" ({r['stopped']})" if r.get("stopped") else "")
                  + ". The ε above covers every step recorded in the ledger.", ""]
    lines += [
        "## Checklist (How to DP-fy ML, §5.3.3)",
        "",
        "| item | value |",
        "| --- | --- |",
        f"| DP setting | {r['dp_setting']} |",
        f"| Unit of privacy | {r['unit']}: {r['unit_description']} |",
        f"| Records | {r.get('records', '')} |",
        f"| Unit size / contribution bound | {r['contribution_bound']} |",
        f"| Adjacency | {r['adjacency']} |",
        f"| Mechanism output | {r['mechanism_output']} |",
        f"| Accounting | {r['accountant'].upper()} (reported); also computed: {', '.join(k.upper() for k in r['epsilon_by_accountant'] if k != r['accountant']) or 'none (truncated Poisson is accounted by PLD only)'}; δ = {r['delta']:.3g} (< 1/N = {1 / r['dataset_size']:.3g}) |",
        f"| ε at δ | {r['epsilon']:.4f} (target {r['target_epsilon'] if r['target_epsilon'] is not None else 'none: σ given'})"
        + (f"; training alone {r['epsilon_training_only']:.4f}, composed with the private tokenizer's release"
           if r["tokenizer"].get("composed_into_guarantee") else "") + " |",
        f"| Sampling assumed | {r['sampling']['assumed']} |",
        f"| Sampling used | {r['sampling']['used']}; honoured: {'yes' if r['sampling']['honoured'] else 'NO'} ({r['sampling']['note']}) |",
        f"| Sampling probability q | {r['sampling_probability']:.6g} |",
        f"| Expected batch size q·N | {r['expected_batch_size']:g} units |",
        f"| Dataset size N | {r['dataset_size']} units |",
        *_truncation_rows(r),
        f"| Noise multiplier σ | {r['noise_multiplier']:.6g} |",
        f"| Clipping norm C | {r['max_grad_norm']:g} ({r['clipping']}) |",
        f"| Steps T (ledger) | {r['steps']} (planned {r['steps_planned']}, completed {r['steps_completed']}; "
        f"{r['attempts']} attempt(s), {r['steps_lost_to_failures']} step(s) lost to failures and re-executed) |",
        *_dataset_rows(r),
        f"| Noise std per coordinate of the averaged gradient | σC/(qN) = {r['noise_std_per_coordinate']:.4g} |",
        f"| RNG mode | {r['rng_mode']} |",
        f"| Tokenizer | {r['tokenizer']['note']} |",
        "",
        "## Data accesses covered",
        "",
        *[f"- {x}" for x in r["data_accesses_covered"]],
        "",
        "## Not covered by this guarantee",
        "",
        *[f"- {x}" for x in r["data_accesses_not_covered"]],
        "",
        "## Metrics computed on private data without DP (internal: do not publish)",
        "",
        *[f"- `{k}`: {v}" for k, v in r["internal_metrics"].items()],
        "",
        "Data statistics (internal): " + ", ".join(
            f"{k}={v}" for k, v in r["data_statistics"].items()
            if k not in ("computed_on_private_data", "note")) + ".",
        "",
        "## Ledger",
        "",
        f"{r['ledger']['lines']} line(s) in `ledger.jsonl`"
        + (" plus the tokenizer's release (recorded in the dataset ledger)" if r["tokenizer"].get(
            "composed_into_guarantee") else "") + "; every DP release, composed above:",
        "",
        "| run | attempt | first step | count | mechanism |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {x['run_id']} | {x['attempt'] or '-'} | {x['first_step'] if x['first_step'] is not None else '-'} | {x['count']} | {x['mechanism']} |"
          for x in r["ledger"]["releases"]],
        "",
        "![epsilon and loss](privacy_report.png)",
        "",
    ]
    return "\n".join(lines)
