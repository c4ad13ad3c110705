"""The NON-PRIVATE baseline (``privacy.dp: false``): the same recipe trained without clipping
or noise, for comparison only.

Same compute as the DP run: the same Poisson sampling with q = B/N (under the step's
sample key), micro-batching, optimizer, schedule and steps; the update is Σ_u g_u ÷ q·N,
the unclipped per-unit normalized loss gradients summed and divided by the expected batch
size. Where it differs, and where that is decided:

- the plan (`llmdp.privacy.plan.DPPlan` ``dp=False``): σ = 0, no target, ε = inf, no DP
  event; the clipping engine runs with ``clip_bound`` = inf (every factor is exactly 1);
- the driver (`llmdp.run.launch.prepare`): no dataset ledger is opened, nothing is recorded
  or held, no ``ledger.jsonl``: ``RunSpec.ledger`` is None and ``RunSpec.dp`` is False;
- the worker: every ledger call is skipped; the metrics' start line and step records
  carry ``"privacy": "NON-PRIVATE"``;
- the report: :func:`baseline_report` / :func:`render_baseline_markdown` (no ε, no ledger
  section, the :data:`BANNER` first), the progress bar and the plot say NON-PRIVATE;
- the export refuses it (`llmdp.hub.export.verify_run`), and the config refuses
  ``output.push_to``, ``privacy.budget_epsilon`` and a DP evaluation with it.
"""

from __future__ import annotations

import os
from typing import Any

from llmdp.evaluation.report import evaluation_markdown

NON_PRIVATE = "NON-PRIVATE"
BANNER = ("NON-PRIVATE BASELINE: trained without clipping or noise; no privacy guarantee; "
          "for comparison only")


def public_banner(data_cfg: dict, simulated: bool = False) -> str:
    """The first line of a run on data its recipe declares public (``data.public: true``);
    ``simulated``: the run simulated a private run's DP noise (``privacy.simulate``)."""
    source = data_cfg.get("path") or data_cfg.get("dataset")
    how = ("trained with a private run's DP noise simulated, which guarantees nothing here"
           if simulated else "trained without DP")
    return (f"DECLARED PUBLIC DATA: the recipe declared its training data ({source}) public "
            f"(data.public: true); {how}; llmdp makes no guarantee about this data, "
            "and the declaration is the user's responsibility")


def _config_hash(run_dir: str) -> str | None:
    """The ``# config_hash:`` header of the run's config.yaml (`config.dump_yaml`)."""
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            for line in f:
                if line.startswith("# config_hash:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def baseline_report(rd, metrics: list[dict], state: dict, *, internal_metrics: dict) -> dict[str, Any]:
    """The report of a baseline run (``rd``: its `llmdp.record.rundir.RunDir`; ``metrics``: its
    metrics.jsonl records; ``state``: where it stands, `llmdp.report.build.run_state`): status,
    steps and the recipe's facts; no ε, no ledger."""
    cfg, info, plan = rd.config(), rd.info, rd.plan
    state = dict(state)
    completed = state.pop("completed")
    data_cfg, train, priv = cfg["data"], cfg.get("train") or {}, cfg.get("privacy") or {}
    stats = dict(info.get("data") or {})
    public = bool(data_cfg.get("public"))
    sim = info.get("simulated")  # privacy.simulate: the DP mechanism ran on public data
    out = {
        "privacy": NON_PRIVATE,
        "dp": False,
        "banner": public_banner(data_cfg, bool(sim)) if public else BANNER,
        "declared_public": public,
        "run_id": info.get("run_id"),
        **state,  # status, failure, resume, stopped
        # ---- no guarantee
        "epsilon": None,
        "delta": None,
        "accountant": None,
        "guarantee": "none",
        "guarantee_note": ("Trained without clipping or noise on data the recipe declares "
                           "public: the model and its checkpoints may reveal any training unit"
                           if public else
                           "Trained on the private data without clipping or noise: the model "
                           "and its checkpoints may reveal any training unit"),
        "ledger": None,
        "starting_model": info.get("starting_model"),
        # ---- what ran (the DP recipe's compute)
        "steps": completed,
        "steps_planned": plan.steps,
        "steps_completed": completed,
        "starts": sum(1 for m in metrics if m.get("event") == "start"),
        "unit": data_cfg.get("unit"),
        "dataset_size": plan.dataset_size,
        "expected_batch_size": plan.expected_batch_size,
        "sampling_probability": plan.sampling_probability,
        "sampler": plan.sampler,
        "max_batch_size": plan.max_batch_size,
        "sampling": "the DP recipe's: every unit independently with probability q at every step"
        + (f", capped at {plan.max_batch_size} units" if plan.truncated else ""),
        "clipping": f"none (the recipe's privacy.max_grad_norm = {plan.max_grad_norm:g} is not "
        "applied)",
        "noise_multiplier": 0.0,
        "normalization": "sum of the unclipped unit gradients divided by the expected batch "
        "size q*N",
        "rng_mode": priv.get("rng"),
        "recipe": {
            "model": (cfg.get("model") or {}).get("name_or_path") or (cfg.get("model") or {}).get("init"),
            "optim": cfg.get("optim"),
            "physical_batch_size": train.get("physical_batch_size"),
            "steps": train.get("steps"),
            "epochs": train.get("epochs"),
        },
        "data_statistics": {
            "computed_on_private_data": True,
            "note": "counts computed on the private corpus (internal)",
            **{k: v for k, v in stats.items() if not k.startswith("parameters_")},
        },
        "internal_metrics": internal_metrics,
        "config_hash": _config_hash(rd.path),
    }
    if sim:
        out.update({
            "simulated": dict(sim),
            "guarantee_note": ("Trained on data the recipe declares public with the DP "
                               "mechanism of a private run simulated (clipping and noise as "
                               "planned for that run), to tune at zero privacy cost: nothing "
                               "was released, and the model may reveal any training unit"),
            "clipping": f"each unit's gradient to norm C = {plan.max_grad_norm:g} (simulated)",
            "noise_multiplier": plan.noise_multiplier,
            "normalization": "sum of the clipped unit gradients plus the simulated noise, "
            "divided by the expected batch size q*N",
        })
    return out


def render_baseline_markdown(r: dict) -> str:
    """The Markdown of a baseline's report: the banner is its first line."""
    status = r.get("status")
    if r.get("declared_public"):
        lines = [
            r["banner"],
            "",
            "# Training report: a run on data declared public",
            "",
            f"> **No privacy guarantee.** {r['guarantee_note']}. There is no ε; nothing was "
            "recorded in a privacy ledger.",
            "",
        ]
    else:
        lines = [
            BANNER,
            "",
            "# Training report: NON-PRIVATE baseline",
            "",
            f"> **No privacy guarantee.** {r['guarantee_note']}. There is no ε; nothing was "
            "recorded in a privacy ledger; this run cannot be exported.",
            "",
        ]
    start = r.get("starting_model")
    if start:
        lines += [f"Starting model: {start.get('shown')} ({start.get('description')}).", ""]
    if status != "complete":
        lines += [f"> Run status: **{status}**" + (f" ({r['failure']})" if r.get("failure") else "")
                  + (f" ({r['stopped']})" if r.get("stopped") else "")
                  + (f" ({r['resume']})" if r.get("resume") else "") + ".", ""]
    trunc = ([f"| Cap B_max | {r['max_batch_size']} units |"] if r.get("max_batch_size") else [])
    lines += [
        "| item | value |",
        "| --- | --- |",
        ("| Privacy | none: simulated DP (privacy.simulate), no ε, nothing spent |"
         if r.get("simulated") else f"| Privacy | {r['privacy']}: no clipping, no noise, no ε |"),
        f"| Status | {status} |",
        f"| Steps | {r['steps_completed']} completed of {r['steps_planned']} planned |",
        f"| Unit | {r['unit']} |",
        f"| Dataset size N | {r['dataset_size']} units |",
        f"| Sampling | {r['sampling']} |",
        f"| Sampling probability q | {r['sampling_probability']:.6g} |",
        f"| Expected batch size q·N | {r['expected_batch_size']:g} units |",
        *trunc,
        f"| Clipping | {r['clipping']} |",
        *(_simulated_rows(r["simulated"]) if r.get("simulated") else ["| Noise | none (σ = 0) |"]),
        f"| Update | {r['normalization']} |",
        f"| RNG mode | {r['rng_mode']} |",
        "",
    ]
    lines += evaluation_markdown(r.get("evaluation"))
    if "internal_metrics" in r:
        lines += [
            "## Metrics computed on private data without DP (internal: do not publish)",
            "",
            *[f"- `{k}`: {v}" for k, v in r["internal_metrics"].items()],
            "",
        ]
    lines += ["![training loss (NON-PRIVATE)](privacy_report.png)", ""]
    return "\n".join(lines)


def _simulated_rows(sim: dict) -> list[str]:
    """The report's rows of what a simulated run (privacy.simulate) simulated."""
    target = ("" if sim.get("target_epsilon") is None
              else f" at privacy.target_epsilon = {sim['target_epsilon']:g}")
    return [f"| Noise | simulated: σ = {sim['noise_multiplier']:.4f}, the σ of a private run "
            f"of {sim['private_units']} units{target} ({sim['mechanism']}) |",
            f"| Noise std per averaged step σC/B | {sim['noise_std_per_step']:.4g} (the private "
            f"run's) |"]


def baseline_panel(ax) -> None:
    """The plot's ε panel for a baseline: no curve, the label instead."""
    ax.text(0.5, 0.5, "NON-PRIVATE BASELINE\nno clipping, no noise:\nno ε, no guarantee",
            ha="center", va="center", transform=ax.transAxes, color="tab:red", fontsize=11)
    ax.set_axis_off()
    ax.set_title("privacy: NONE (baseline)")
