"""Privacy report of a run: JSON + Markdown + plot, answering the DP-fy guide's checklist (§5.3.3).

Everything is recomputed from the durable artifacts of the run directory: the ledger (what
was released), the resolved config and plan (how), and metrics.jsonl (what happened). The
ε reported is the composition of *every* release in the ledger, not the plan's promise.

This module builds the report (`build_report`) and writes the run's local files
(`write_report`: privacy_report.json / .md / .png). Its Markdown and the ε panel of its plots
are rendered by `llmdp.report.render`; what of it may be published is `llmdp.record.publish`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from llmdp.audit.section import audit_section
from llmdp.config.choices import Accountant, Mechanism, Sampler
from llmdp.evaluation.report import dp_eval_covered, evaluation_section
from llmdp.privacy import accounting
from llmdp.privacy.accounting import is_truncated, release_entries
from llmdp.privacy.ledger import (
    VOID_KIND,
    LedgerDamaged,
    LedgerDB,
    LedgerError,
    budget_status,
    cross_check,
    is_step_release,
    net_records,
    recorded_budget,
    release_entries_of,
    resolve_location,
    step_count,
)
from llmdp.privacy.noise import NOISE_METHOD, NOISE_TAIL, truncation_delta_per_step
from llmdp.record.baseline import baseline_report
from llmdp.record.provenance import SOURCE, scope
from llmdp.record.rundir import RunDir, read_jsonl, run_state
from llmdp.report.adjacency import adjacency, published_counts
from llmdp.report.render import _epsilon_panel, render_markdown
from llmdp.report.spent import epsilon_curve, ledger_noise_tail
from llmdp.tokenizer.train import read_tokenizer_info

REPORT_VERSION = 1

# Metrics in metrics.jsonl that are computed on private data without DP. They are useful to
# the trainer and must not be published (DESIGN, invariant `secrets-stay-secret`).
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
    "step_time_s": "wall time of the step (grows with the realized sample size)",
    "nonfinite_units": "units whose gradient was not finite in the step (given no weight; a "
    "warning after train.max_nonfinite_steps such steps; the run never stops on it)",
    "worker0_norm_fallbacks / worker0_norm_bound_max": "rank 0's clipping-norm rounding "
    "bounds: (layer call, unit) pairs recomputed as the exact float64 gradient because the "
    "bound was over 1 % of the unit's norm, and the largest share of a used norm that was "
    "bound (DESIGN, invariant `precision-never-widens`)",
    "eval (held-out loss, perplexity, accuracy, units, tokens)": "the model's metrics on the "
    "private held-out units without DP (`evaluation.internal`; the DP evaluation is publishable)",
}


def build_report(run_dir: str | RunDir, failure: str | None = None, interrupted: bool = False) -> dict[str, Any]:
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    run_dir = rd.path
    cfg = rd.config()
    plan_info = rd.info
    plan = rd.plan
    # a NON-PRIVATE baseline, or a simulated run (DP noise on public data): no ledger, no ε
    # (llmdp.record.baseline)
    if not plan.dp or plan_info.get("simulated"):
        metrics = rd.metrics
        return {"report_version": REPORT_VERSION, **baseline_report(
            rd, metrics, run_state(metrics, plan.steps, failure, interrupted),
            internal_metrics=INTERNAL_METRICS),
            "evaluation": evaluation_section(run_dir, plan_info, metrics, [])}
    # Each file read once (RunDir caches it): the curve and the sections take the same records.
    ledger_path = rd.ledger_path
    ledger = rd.ledger
    records = rd.ledger_records
    entries = release_entries_of(records, ledger_path) if records else []
    delta = plan.delta  # the published δ
    # The noise generator's truncated tails over what the ledger released are part of the
    # published δ: every ε below is computed at what is left of it (a plan of an earlier
    # llmdp does not fold them in: δ is the accountant's, as it was).
    tail = ledger_noise_tail(plan, records)
    delta_acc = delta if tail is None else tail.accountant_delta(delta)

    # Every accountant that supports every recorded event (RDP cannot account truncated
    # Poisson: it is left out rather than approximated).
    usable = [name for name in Accountant
              if name == plan.accountant or not any(is_truncated(e) for e, _ in entries)]
    # Releases this run's model builds on, made before it on the same units (a private
    # tokenizer): composed into the guarantee, thresholds' delta included.
    prior = list(plan_info.get("prior_releases") or [])
    prior_entries, prior_dthr = release_entries(prior)
    left = delta_acc > prior_dthr  # else the tails (and thresholds) spend all of δ: ε is inf
    eps = {name: accounting.epsilon_with_threshold(prior_entries + entries, delta_acc, prior_dthr, name)
           if left else math.inf for name in usable}
    # The training steps alone (as plan.json's epsilon_planned_training_only): neither an
    # earlier release it builds on (a private tokenizer) nor its DP evaluations.
    # Counts net of voids: reserved steps that a graceful stop recorded as never run.
    net = net_records(records)
    step_records = [r for r in net if r.get("kind") == "release" and is_step_release(r)]
    eps_training = ((accounting.epsilon(release_entries_of(step_records), delta_acc, plan.accountant)
                     if delta_acc > 0 else math.inf) if step_records else 0.0)
    ledger_steps = step_count(records)  # DP evaluations are releases, not steps

    metrics = rd.metrics
    state = run_state(metrics, plan.steps, failure, interrupted)
    completed = state.pop("completed")
    # Attempts that ended on a graceful stop (the first Ctrl-C): each voided what it reserved
    # and did not run, so none of them lost a step (one stopped at its first step released
    # nothing, and is an attempt all the same).
    stopped_attempts = {r.get("attempt") for r in records if r.get("kind") == VOID_KIND} | {
        m.get("attempt") for m in metrics if m.get("event") == "interrupted" and m.get("graceful")}
    stopped_attempts.discard(None)
    interruptions = len(stopped_attempts)
    attempts = sorted({r.get("attempt") for r in records if r.get("kind") == "release"} | stopped_attempts)
    priv = cfg["privacy"]
    # Every DP release behind this model that drew its randomness from a fixed seed: the
    # training run's, and a private tokenizer's (composed or declared independent: its
    # vocabulary is part of the model either way).
    seeded_from = seeded_sources(cfg, plan_info)
    seeded = bool(seeded_from)
    # The run's meta, from its last release (a hold or hold_end record carries no unit).
    last_meta = next((r["meta"] for r in reversed(records)
                      if r.get("kind") == "release" and r.get("meta")), {})
    # Before any release (a run stopped at step 0), plan.json states the unit; a run of an
    # older version without it is described from its recipe.
    unit_meta = last_meta.get("unit") or plan_info.get("unit") or {}
    data_cfg = cfg["data"]
    unit_desc = unit_meta.get("description") or _describe_unit_from_recipe(data_cfg)
    unit_kind = unit_meta.get("kind") or data_cfg["unit"]
    rows_cap = int(unit_meta.get("max_rows_per_unit") or data_cfg.get("max_rows_per_unit") or 1)
    seq_len = int(unit_meta.get("sequence_length") or data_cfg["sequence_length"])
    data_stats = dict(plan_info.get("data") or {})
    truncated_steps = sum(1 for m in metrics if "event" not in m and m.get("sample_truncated"))
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
            "count": r.get("count"),  # net of the steps voided (reserved, never run)
            "voided": r.get("voided", 0),
            "event": r.get("event"),
            "mechanism": (r.get("meta") or {}).get("mechanism", Mechanism.DP_SGD),
            "time": r.get("time"),
        }
        for r in net
        if r.get("kind") == "release"
    ]
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "run_id": plan_info.get("run_id"),
        **state,  # status, failure, resume, stopped
        # ---- the guarantee
        "epsilon": eps[plan.accountant],
        "delta": delta,  # the published δ: the accountant's and the noise tails' together
        "delta_accountant": delta_acc,
        "delta_noise_tail": None if tail is None else delta - delta_acc,
        "accountant": plan.accountant,
        "epsilon_by_accountant": eps,
        "epsilon_training_only": eps_training,
        "delta_threshold_of_earlier_releases": prior_dthr,
        "target_epsilon": plan.target_epsilon,
        "epsilon_planned": plan_info.get("epsilon_planned"),
        "dp_setting": "central DP: a trusted trainer holds the raw data; the released "
        "artifact is the final model (with the DP evaluations); checkpoints are internal",
        "unit": unit_kind,
        "unit_description": unit_desc,
        "unit_formation": unit_meta.get("formation"),  # a store built on Ray Data
        "records": _describe_records(data_cfg),
        "record_format": _describe_encoding(plan_info.get("record_encoding")),
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
        # N is published exactly: the adjacency stated is the one true of that (`adjacency`)
        "adjacency": adjacency(plan, unit_desc),
        "accounting_relation": plan.relation,
        "published_counts": published_counts(plan, plan_info),
        # Internal (names fields of the private records): a unit smaller than the person the
        # records seem to be about protects that person only through group privacy.
        "unit_warning": _unit_warning(unit_kind, seq_len, data_stats.get("person_like_fields")),
        "mechanism_output": "the model weights after each of the T noisy updates (the final "
        "model's included); only the weights are covered, not the checkpoints",
        "checkpoints": _checkpoints_note(plan),
        "starting_model": plan_info.get("starting_model"),
        "hyperparameters": plan_info.get("hyperparameters"),  # chosen on public data (0 ε)
        "guarantee_scope": scope(plan_info.get("starting_model")),
        "data_accesses_covered": [
            f"the private tokenizer's release {r.get('release_id')} on the same units "
            f"(ε_tok = {r.get('epsilon'):.4f} alone; Gaussian partition selection, threshold δ "
            f"{(r.get('extra') or {}).get('delta_threshold'):.3g})"
            for r in prior if r.get("source") != SOURCE
        ] + _start_covered(plan_info.get("starting_model"), prior) + [
            (f"this run's DP-SGD training steps on the private corpus, as recorded in the ledger "
             f"({ledger_steps} steps over {len(attempts)} attempt(s))" if not plan.correlated else
             f"this run's training steps with correlated noise ({plan.mechanism}) on the private "
             f"corpus, as recorded in the ledger ({ledger_steps} rounds of {plan.cycle} steps over "
             f"{len(attempts)} attempt(s))"),
        ] + dp_eval_covered(plan_info, records),
        "data_accesses_not_covered": [
            _tuning_not_covered(plan_info.get("hyperparameters")),
            ("the starting model's training data other than this dataset" if (
                plan_info.get("starting_model") or {}).get("composed") else
             "the pretrained model's training data")
            + ", and the tokenizer's unless it is a DP release listed above (a tokenizer not "
            "made by llmdp is assumed public)",
            *_tokenizer_not_covered(plan_info),
            "dataset statistics used to plan the run: N, the number of units, is published "
            "exactly and treated as public (see the adjacency)",
            "metrics computed on the private data without DP (internal: listed in the local "
            "report, never published)",
            *(["the number of held-out units used by the DP evaluation (eval.count: public): "
               "published as is, like N"]
              if (plan_info.get("dp_eval") or {}).get("count") == "public" else []),
        ],
        "tokenizer": _tokenizer_section(cfg, plan_info),
        # ---- the mechanism's numbers
        "steps": ledger_steps,
        "steps_planned": plan.steps,
        "steps_completed": completed,
        "attempts": len(attempts),
        # Attempts that a first Ctrl-C ended after a whole step (none of their steps lost).
        "interruptions": interruptions,
        "steps_voided": sum(int(r.get("voided", 0)) for r in net if r.get("kind") == "release"),
        # Steps in the ledger beyond those that produced the final model: executed (or
        # reserved write-ahead) by attempts that failed or were stopped at once (a crash, a
        # killed process, a second Ctrl-C), then re-executed after a resume.
        "steps_lost_to_failures": max(0, ledger_steps - plan.ledger_begun(completed)),
        # a correlated mechanism (llmdp.privacy.mf.plan): its strategy, sampler, participation
        "correlated_noise": _correlated_section(plan),
        "dataset_ledger": _dataset_ledger(plan_info, plan, unit_meta or {
            "kind": unit_kind, "sequence_length": seq_len, "user_field": data_cfg.get("user_field"),
            "document_masking": bool(data_cfg.get("document_masking"))}, records,
            plan_info.get("run_id")),
        # a test switched a planted bug on (llmdp.base.plants): no guarantee at all
        "planted": plan_info.get("planted"),
        "exceeds_target": _exceeds(eps[plan.accountant], plan, plan_info, ledger_steps, completed,
                                   len(attempts)),
        "noise_multiplier": plan.noise_multiplier,
        "sampling_probability": plan.sampling_probability,
        "expected_batch_size": plan.expected_batch_size,
        "dataset_size": plan.dataset_size,
        "max_grad_norm": plan.max_grad_norm,
        "noise_std_per_coordinate": plan.noise_std,
        "noise_generator": _noise_generator(plan, (plan_info.get("data") or {}).get("parameters_trainable"),
                                            ledger_steps, tail),
        "clipping": "flat: each unit's gradient over all trainable parameters clipped to L2 <= C",
        "normalization": "noisy sum divided by the expected batch size q*N",
        "sampling": _sampling_section(plan, seeded, truncated_steps, completed),
        "rng_mode": "seeded" if seeded else priv.get("rng"),
        "rng_seeded_sources": seeded_from,
        "rng_warning": (
            ("This run used a fixed seed for sampling and noise" if priv.get("rng") == "seeded" else
             "A fixed seed drew the noise of a DP release this model is built on")
            + f" ({'; '.join(seeded_from)}): it carries NO privacy guarantee against anyone who "
            "knows that seed." if seeded else None
        ),
        "ledger": {
            "path": "ledger.jsonl",
            "lines": len(records),
            "torn_lines": getattr(ledger, "torn_lines", 0),
            "releases": releases,
        },
        "evaluation": evaluation_section(run_dir, plan_info, metrics, records),
        # `llmdp audit`'s lower bound beside the guarantee (aggregate numbers only)
        "empirical_audit": audit_section(run_dir),
        "internal_metrics": INTERNAL_METRICS,
        "config_hash": last_meta.get("config_hash"),
        "dataset_fingerprint": last_meta.get("dataset_fingerprint"),
    }
    return report


def _checkpoints_note(plan) -> str:
    """What a checkpoint is: an internal artifact, never covered by the guarantee and never
    exported. Beside the weights it holds the optimizer state and counters of the private
    data without DP (`nonfinite_steps`), and for a correlated mechanism the state of its
    noise stream: the secret noise of earlier steps, with which the model after step t and
    the checkpoint at step t+1 give back that step's clipped sum almost without noise."""
    return ("checkpoints are internal artifacts, not covered by this guarantee and never "
            "published: besides the weights they hold the optimizer state and counters "
            "computed on the private data without DP"
            + (f", and the secret state of the correlated noise stream ({plan.mechanism}), "
               "which with the weights reveals the noise added at each step"
               if plan.correlated else ""))


def _tuning_not_covered(tuned: dict | None) -> str:
    if tuned:
        return (f"the choice of hyper-parameters other than {', '.join(tuned.get('values') or {})} "
                f"(those: {tuned['note']}) if it was tuned on this private data: that tuning is "
                f"not accounted")
    return ("the choice of hyper-parameters (C, learning rate, batch size, steps) if it was "
            "tuned on this private data: that tuning is not accounted")


def _start_covered(start: dict | None, prior: list[dict]) -> list[str]:
    """The covered-accesses line of a starting checkpoint composed into the guarantee."""
    mine = [r for r in prior if r.get("source") == SOURCE]
    if not start or not start.get("composed") or not mine:
        return []
    runs = ", ".join(start.get("composed_runs") or [start["run_id"]])
    return [f"the starting model's own DP training on this dataset (llmdp run {runs}: "
            f"{sum(int(r['count']) for r in mine)} release(s), ε = {start['epsilon_alone']:.4f} "
            f"alone), composed"]


def _exceeds(eps: float, plan, plan_info: dict, steps: int, completed: int, attempts: int) -> str | None:
    """Why ε is above privacy.target_epsilon (or the planned ε), or None."""
    target = plan.target_epsilon
    planned = plan_info.get("epsilon_planned")
    bound, what = ((target, "privacy.target_epsilon") if target is not None else
                   (planned, "the planned ε"))
    if bound is None or eps <= bound * (1 + 1e-9):
        return None
    allowed = (" (privacy.allow_exceed_target_on_failure: true)"
               if plan_info.get("allow_exceed_target_on_failure") and target is not None else "")
    if plan.correlated:  # the ledger counts rounds of `cycle` steps
        return (f"ε = {eps:.4f} exceeds {what} = {bound:.4f}{allowed}: the ledger records {steps} "
                f"rounds of {plan.cycle} steps (the plan: {plan.ledger_steps}) for {completed} steps "
                f"completed over {attempts} attempt(s); a resumed attempt records again the round "
                f"its first step falls in (and every round it begins after a failure: a new "
                f"segment of the mechanism), and every release counts")
    return (f"ε = {eps:.4f} exceeds {what} = {bound:.4f}{allowed}: the ledger records {steps} "
            f"steps for {completed} completed over {attempts} attempt(s); steps re-executed after "
            f"failures (and reserved write-ahead by failed attempts) were released again, and "
            f"every release counts")


def seeded_sources(cfg: dict, plan_info: dict) -> list[str]:
    """The DP releases behind a run's model whose randomness came from a fixed seed (empty:
    fresh OS entropy everywhere): the training run (``privacy.rng: seeded``) and a private
    tokenizer whose release was seeded (its ``llmdp_tokenizer.json`` ``privacy.rng``), whether
    its release is composed or declared independent. Read by the report and by
    `export.verify_run`, which refuses to publish such a model as verified."""
    out = []
    if (cfg.get("privacy") or {}).get("rng") == "seeded":
        out.append("training: privacy.rng: seeded")
    tok = plan_info.get("tokenizer") or {}
    priors = plan_info.get("prior_releases") or []
    rngs = [r.get("rng") for r in priors if r.get("source") != SOURCE]
    seeded_start = sorted({r.get("run_id") for r in priors
                           if r.get("source") == SOURCE and r.get("rng") == "seeded"})
    if tok.get("kind") == "private-dp":
        rng = tok.get("rng")
        if rng is None:  # a plan.json written before the tokenizer's rng was carried
            try:
                rng = ((read_tokenizer_info(tok.get("path")) or {}).get("privacy") or {}).get("rng")
            except Exception:
                rng = None
        rngs.append(rng)
    if "seeded" in rngs:
        out.append(f"the private tokenizer {tok.get('path')}: its recipe's privacy.rng: seeded")
    out += [f"the starting model's run {rid}: privacy.rng: seeded" for rid in seeded_start]
    return out


def _tokenizer_not_covered(plan_info: dict) -> list[str]:
    """A private tokenizer's release that the user declared independent (not composed)."""
    tok = plan_info.get("tokenizer") or {}
    if tok.get("kind") != "private-dp" or tok.get("compose"):
        return []
    return [f"the private tokenizer's DP release on another data source ({tok.get('path')}): "
            "not composed: declared independent by model.tokenizer_data; if the two sources "
            "share individuals, the ε add up"]


def _noise_generator(plan, trainable: int | None, steps: int, tail=None) -> dict:
    """What the noise generator adds beyond the accountant's exact Gaussian (issue 12, 8c;
    issue 29, 8): its tail truncation, with the δ it adds (`llmdp.privacy.noise.tail`:
    folded into the published δ for a plan that knows its noise coordinates, ``tail`` from
    the ledger's releases; stated beside δ, not in it, for a plan of an earlier llmdp), its
    float32 rounding (not quantified), and that the accountant assumes a continuous
    Gaussian (issue 14)."""
    per_step = (truncation_delta_per_step(int(trainable), plan.noise_multiplier)
                if trainable and plan.noise_multiplier > 0 else None)
    out = {
        "method": NOISE_METHOD,
        "tail_truncation_std": NOISE_TAIL,
        "trainable_parameters": trainable,
        "truncation_delta_per_step": per_step,
        "truncation_delta_run": None if per_step is None else min(1.0, per_step * steps),
        "included_in_delta": tail is not None,
        "float32_rounding": "each draw is rounded to float32 and added to a float32 sum; "
                            "this floating-point effect is not covered by the accountant",
        "accountant_assumes": "an exact continuous Gaussian; the generator is a floating-point "
                              "approximation of it (truncated tail, float grid)",
    }
    if tail is None:
        out["note"] = ("a plan of an earlier llmdp (plan.json without noise_coordinates): the "
                       "tails' δ is stated here and NOT included in δ, which is the accountant's")
        return out
    delta = plan.delta
    out.update({
        # δ = δ_accountant / Z + Σ count·η  (llmdp.privacy.noise.tail), per kind of release
        "truncation_delta_releases": [
            {"releases": what, "count": count, "coordinates": coords, "noise_multiplier": sigma,
             "delta": eta} for what, count, coords, sigma, eta in tail.parts],
        "truncation_delta_total": tail.eta,
        "kept_mass_at_least": 1.0 - tail.lost_mass,
        "delta_noise_tail": tail.delta(delta),
        "delta_accountant": tail.accountant_delta(delta),
        "note": "included in δ: δ = δ_accountant / Z + Σ count·η, Z >= 1 - Σ count·k·2**-106 "
                "the mass the truncation keeps; every ε is computed at δ_accountant",
    })
    return out


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
        # What the user declared about the tokenizer's data (model.tokenizer_data; private-dp
        # only) and what llmdp did with its release.
        "tokenizer_data": tok.get("tokenizer_data") if kind == "private-dp" else None,
        "composition": tok.get("composition"),
        "rng": tok.get("rng") if kind == "private-dp" else None,
        "model_vocabulary": vocab,
        "vocab_size": tok.get("vocab_size"),
        "vocab_adaptation": tok.get("vocab_adaptation"),
        "trained_by_this_run": False,
        "note": (tok.get("summary") or "not fit on the private corpus by llmdp; a tokenizer fit "
                 "on this private data elsewhere is not covered") + f"; model vocabulary: {vocab}",
    }


def _dataset_ledger(plan_info: dict, plan, unit: dict, run_records: list[dict],
                    run_id: str | None) -> dict | None:
    """ε composed over the releases recorded on this dataset (every run, every tokenizer) for
    this run's privacy unit; releases for other units are listed, not composed. The run's
    ``ledger.jsonl`` is cross-checked against the dataset ledger: a damaged dataset ledger,
    or a run ledger that lacks one of the run's records (a deleted line) or holds one the
    dataset ledger does not, raises `LedgerError`. A database that cannot be reached is
    stated (``"error"``), not guessed."""
    info = plan_info.get("dataset_ledger")
    if not info:
        return None
    if isinstance(info, str):  # a run of an earlier llmdp: a JSONL dataset ledger
        return {"ledger": info, "error": "a JSONL dataset ledger of an earlier llmdp: not "
                "cross-checked (it is imported into the ledgers' database by the next run on "
                "this data)"}
    location = info["location"]
    db = LedgerDB(resolve_location(location), read_only=True)
    try:
        try:
            records = db.records(info["dataset_id"])
        except LedgerDamaged:
            raise
        except LedgerError as e:
            return {"ledger": location, "dataset_id": info["dataset_id"],
                    "error": f"not reachable: {e}"}
    finally:
        db.close()
    problems = cross_check(run_records, records, run_id) if run_id else []
    if problems:
        raise LedgerError(problems[0])
    # The dataset's budget, whatever the recipe said, at its δ less this run's noise tails
    # (as the ledger service checks it); without one, at this run's accountant δ.
    tail = max(0.0, plan.delta - plan.accountant_delta)
    b = recorded_budget(records)
    out = budget_status(records, plan_info.get("budget_epsilon"), plan.accountant_delta, plan.accountant,
                        unit, location, info["dataset_id"]) if b is None else \
        {**budget_status(records, b.epsilon, b.delta - tail, b.accountant, unit, location,
                         info["dataset_id"]), "budget": b.describe()}
    out["cross_checked"] = True
    declared = next((r for r in records if r.get("kind") == "dataset" and r.get("distinct_from")),
                    None)
    if declared is not None:  # internal: data.distinct_from, as the new ledger recorded it
        out["distinct_from"] = {"ledgers": list(declared["distinct_from"]),
                                "reason": declared.get("distinct_reason")}
    return out


def _unit_warning(kind: str, seq_len: int, fields) -> str | None:
    if kind == "user" or not fields:
        return None
    what = f"one {seq_len}-token passage" if kind == "sequence" else "one document"
    names = ", ".join(repr(f) for f in fields)
    return (f"the unit protects {what}, not a person: the records carry {names}, which looks "
            f"like it names a person (a patient, a user). Someone with k units in the data is "
            f"protected only by group privacy (about k·ε). To protect each person, train with "
            f"data.unit: user and data.user_field: {fields[0]}")


def _describe_unit_from_recipe(data_cfg: dict) -> str:
    """The unit's description from the recipe's data section (as planning builds it)."""
    from llmdp.data.units import UnitSpec

    kind = data_cfg.get("unit") or "sequence"
    try:
        return UnitSpec(kind=kind, sequence_length=int(data_cfg["sequence_length"]),
                        max_rows_per_unit=1 if kind == "sequence" else int(data_cfg.get("max_rows_per_unit") or 1),
                        document_masking=bool(data_cfg.get("document_masking")),
                        user_field=data_cfg.get("user_field") if kind == "user" else None).describe()
    except (ValueError, TypeError, KeyError):
        return f"a {kind} unit (data.unit={kind!r})"


def _describe_records(data_cfg: dict) -> str:
    from llmdp.data.sources import describe_records  # lazy: it imports `datasets` (~1 s)

    return describe_records(data_cfg)


def _describe_encoding(encoding) -> str | None:
    from llmdp.data.sources import describe_encoding  # lazy: it imports `datasets` (~1 s)

    return describe_encoding(encoding)


def _contribution_bound(kind: str, rows: int, seq_len: int, user_field) -> str:
    if kind == "sequence":
        return f"one unit is one row of {seq_len} tokens; its gradient is clipped to C"
    what = "document" if kind == "document" else f"user (records sharing {user_field!r})"
    return (f"each {what} contributes at most {rows} row(s) of {seq_len} tokens "
            f"({rows * seq_len} tokens), clipped together to C; the rest is dropped")


def _correlated_section(plan) -> dict | None:
    """The correlated mechanism in plain words and numbers (public configuration only)."""
    if not plan.correlated:
        return None
    from llmdp.privacy.mf import mf_commitment, participation_text

    out = {**(mf_commitment(plan) if plan.dp else {"cycle": plan.cycle, "sampler": plan.sampler}),
           "mechanism": plan.mechanism,
           "participation": participation_text(plan.mechanism, plan.sampler, plan.cycle, plan.steps,
                                               plan.event_probability),
           "ledger_unit": f"a round of {plan.cycle} steps (every group's turn once), recorded "
                          "before its first step"}
    fact = plan.factorization()
    if fact is not None:
        out["strategy_meta"] = {k: v for k, v in fact.meta.items() if isinstance(v, (int, float, str))}
        out["round_accounting"] = (
            "K rounds compose to exactly the one-release analysis" if plan.round_factor_exact else
            "the rounds over-count the one-release analysis (the prefix sensitivity grows faster "
            "than linearly somewhere): the reported ε is an upper bound")
    return out


def _sampling_section(plan, seeded: bool, truncated_steps: int, completed: int) -> dict:
    source = ("a seeded generator (ChaCha20 keyed from the seed: reproducible, no guarantee "
              "against anyone who knows the seed)" if seeded else
              "fresh OS entropy per step (ChaCha20 keystream, RFC 8439)")
    if plan.correlated:
        from llmdp.privacy.mf import participation_text

        return {
            "assumed": participation_text(plan.mechanism, plan.sampler, plan.cycle, plan.steps,
                                          plan.event_probability),
            "used": f"{plan.sampler} ({plan.cycle} groups by a keyed hash of each unit's content) "
                    "from " + source,
            "honoured": True,
            "note": "empty samples run as noise-only steps; a unit never appears at two steps "
                    f"less than {plan.cycle} apart",
        }
    if plan.sampler == Sampler.TRUNCATED_POISSON:
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


def write_report(run_dir: str, failure: str | None = None, interrupted: bool = False,
                 baseline: str | None = None) -> dict[str, Any]:
    """(Re)write the run's privacy_report.json, .md and .png. A file it creates is
    owner-only (group-readable with the run's ``output.group_readable``) whoever calls it
    (`llmdp privacy report` too): the report holds internal statistics of private data.
    ``baseline``: a NON-PRIVATE run from the same start, whose gain the report says how much
    of this run recovers (``non_private_gain``: internal, never in the publishable report,
    whose allow-list does not name it)."""
    import yaml  # lazy: only the readers that need the recipe pay for it

    from llmdp._fs import private_files

    rd = RunDir(run_dir)  # plan.json and config.yaml read once for the report and its curve
    try:
        group = bool((rd.config().get("output") or {}).get("group_readable"))
    except (OSError, AttributeError, yaml.YAMLError):  # no readable recipe: build_report says so
        group = False
    with private_files(group):
        return _write_report(rd, run_dir, failure, interrupted, baseline)


def _write_report(rd: RunDir, run_dir: str, failure: str | None, interrupted: bool,
                  baseline: str | None = None) -> dict[str, Any]:
    report = build_report(rd, failure=failure, interrupted=interrupted)
    if baseline is not None:
        from llmdp.report.compare import gain_against

        report["non_private_gain"] = gain_against(run_dir, baseline, report)
    try:  # the plot's curve, kept for the publishable report (export renders its PNG from it)
        report["epsilon_curve"] = [[t, e] for t, e in epsilon_curve(rd)]
    except Exception as e:  # a curve must never lose a report
        report["plot_error"] = repr(e)
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
    """The local run's plot: ε spent (from the ledger) and the internal training loss."""
    import matplotlib  # lazy: only drawing needs matplotlib (slow to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

    curve = report.get("epsilon_curve") or epsilon_curve(run_dir)
    metrics = [m for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
               if "event" not in m and m.get("train_loss") is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    _epsilon_panel(ax1, curve, report)
    if report.get("dp") is False:
        fig.suptitle("NON-PRIVATE BASELINE: no privacy guarantee", color="tab:red")
    if metrics:
        steps = [m["step"] for m in metrics]
        loss = [m["train_loss"] for m in metrics]
        ax2.plot(steps, loss, alpha=0.35, color="tab:blue")
        k = max(1, len(loss) // 20)
        smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
        ax2.plot(steps, smooth, color="tab:blue", label="train (internal)")
    ev = report.get("evaluation") or {}
    held = ev.get("internal") or ev.get("public") or []
    if held:
        ax2.plot([m["step"] for m in held], [m["loss"] for m in held], "o-", color="tab:green",
                 label="held-out" + (" (internal)" if ev.get("internal") else " (public data)"))
    if ev.get("dp"):
        ax2.errorbar([m["step"] for m in ev["dp"]], [m["loss"] for m in ev["dp"]],
                     yerr=[m["loss_std"] for m in ev["dp"]], fmt="s", color="tab:red",
                     capsize=3, label="held-out, DP release (± std)")
    if held or ev.get("dp"):
        ax2.legend(fontsize=8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss (normalized per unit)")
    ax2.set_title("training and held-out loss" if report.get("dp", True)
                  else "training and held-out loss (NON-PRIVATE)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    out = os.path.join(run_dir, "privacy_report.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
