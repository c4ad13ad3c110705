"""What of a run may be published: the publishable report and ledger (DESIGN, invariant `only-dp-outputs-leave`).

Derived from the full local report (`llmdp.report.build.build_report`) and the run's ledger by
allow-lists, with hashes of the private data redacted from their texts. Read by the export
(`llmdp.hub.export`); rendered by `llmdp.report.render`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from llmdp.privacy.allowlist import allow_listed

# DESIGN, invariant `only-dp-outputs-leave`: an export (or anything meant for publication) holds DP releases and public
# configuration only. The publishable report and ledger are derived from the local ones by
# ALLOW-lists: a key not named here (a new internal metric, a data statistic, a hash) stays
# out by default. `True` keeps the value (strings still pass `_redact_hashes`); a dict keeps
# only the keys it names (applied to every item of a list).

_PUBLIC_UNIT = {"kind": True, "description": True, "sequence_length": True, "max_rows_per_unit": True,
                "max_tokens_per_unit": True, "document_masking": True, "user_field": True}

PUBLISHABLE_REPORT: dict[str, Any] = {
    "report_version": True, "run_id": True, "status": True, "stopped": True, "resume": True,
    # the guarantee
    "epsilon": True, "delta": True, "delta_accountant": True, "delta_noise_tail": True,
    "accountant": True, "epsilon_by_accountant": True,
    "epsilon_training_only": True, "delta_threshold_of_earlier_releases": True,
    # what the guarantee covers, given the starting model (no local path: `provenance.shown`)
    "guarantee_scope": True,
    "hyperparameters": {k: True for k in ("chosen_on", "source", "sweep", "values", "epsilon", "note")},
    "starting_model": {**{k: True for k in ("shown", "kind", "run_id", "description", "composed",
                                            "epsilon_alone", "composed_runs")},
                       "ancestry": {k: True for k in ("run_id", "kind", "public_source", "shown")}},
    "target_epsilon": True, "epsilon_planned": True, "dp_setting": True, "unit": True,
    "unit_description": True, "unit_size": _PUBLIC_UNIT, "records": True, "record_format": True, "contribution_bound": True,
    "adjacency": True, "accounting_relation": True, "published_counts": True,
    "mechanism_output": True, "checkpoints": True, "data_accesses_covered": True,
    "data_accesses_not_covered": True,
    "tokenizer": {"kind": True, "composed_into_guarantee": True, "model_vocabulary": True,
                  "vocab_size": True, "vocab_adaptation": True, "trained_by_this_run": True,
                  "tokenizer_data": True, "composition": True, "rng": True, "note": True},
    # the mechanism's numbers (N is used by the accountant and published as is)
    "steps": True, "steps_planned": True, "steps_completed": True, "attempts": True,
    "interruptions": True, "steps_voided": True, "steps_lost_to_failures": True, "exceeds_target": True,
    # Not `dataset_ledger`: ε spent on the dataset and what remains of its budget are totals
    # over every run's releases (a random sweep's K among them); they stay in the local report
    # (DESIGN, invariant `published-from-dp-only`). `stopped` is replaced by `published_stop` (its text names those totals).
    "noise_multiplier": True, "sampling_probability": True, "expected_batch_size": True,
    "dataset_size": True, "max_grad_norm": True, "noise_std_per_coordinate": True,
    "noise_generator": True, "clipping": True, "normalization": True,
    "sampling": {"assumed": True, "used": True, "honoured": True, "max_batch_size": True,
                 "truncation_probability_per_step": True, "truncation_epsilon_cost": True,
                 "note": True},
    "rng_mode": True, "rng_warning": True, "rng_seeded_sources": True,
    "correlated_noise": True,  # the mechanism's public configuration (no data)
    "ledger": {"path": True, "releases": {"run_id": True, "attempt": True, "first_step": True,
                                          "count": True, "voided": True, "event": True,
                                          "mechanism": True,
                                          "epsilon_alone": True, "delta_threshold": True}},
    "epsilon_curve": True,  # ε of ledger prefixes: a function of the releases only
    # DP evaluations, metrics on public held-out data, generations from public prompts (the
    # held-out metrics on private data, `internal`, stay out)
    # `llmdp audit`: aggregate numbers about canaries scored against the DP model; no canary,
    # coin, score or key (those stay in the run's audit/ folder)
    "empirical_audit": True,
    "evaluation": {"data": True, "dp": True, "dp_plan": True, "public": True, "generations": True,
                   "generation_settings": True},
}

PUBLISHABLE_LEDGER_RECORD: dict[str, Any] = {
    "kind": True, "event": True, "count": True, "first_step": True, "eval_step": True, "run_id": True,
    "attempt": True,
    "extra": {"mechanism": True, "noise_std": True, "threshold": True, "max_words_per_unit": True,
              "delta_threshold": True},
    "meta": {"mechanism": True, "unit": _PUBLIC_UNIT, "rng": True, "sampler": True,
             "relation": True, "dataset_size": True, "mf": True},
}

PUBLISHABLE_NOTE = ("publishable copy: DP outputs and public configuration only. Data statistics, "
                    "metrics computed on private data, loss curves and fingerprints of the data "
                    "stay in the local run directory")


# A maximal run of 13+ hex digits with a letter and a digit: a hash (decimal numbers have no
# letter; llmdp's run and release ids have 12 digits).
_HEX_RUN = re.compile(r"(?<![0-9a-fA-F])(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{13,}"
                      r"(?![0-9a-fA-F])")


def _redact_hashes(obj, secrets: tuple[str, ...]):
    """Strings with every hex run of 13+ digits (a hash, never an llmdp run or release id,
    which have 12) and every 12+ prefix of a known data hash replaced by ``<hash>``."""
    if isinstance(obj, dict):
        return {k: _redact_hashes(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_hashes(v, secrets) for v in obj]
    if isinstance(obj, str):
        obj = _HEX_RUN.sub("<hash>", obj)
        for s in secrets:
            if len(s) >= 12 and s[:12] in obj:
                obj = obj.replace(s[:12], "<hash>")
    return obj


def _data_hashes(report: dict) -> tuple[str, ...]:
    """Hashes of the private data a full report may carry (the store's fingerprint, the
    source hash that names the dataset ledger file)."""
    out = [report.get("dataset_fingerprint")]
    d = report.get("dataset_ledger") or {}
    if d.get("ledger"):
        out.append(os.path.splitext(os.path.basename(str(d["ledger"])))[0])
    out += [os.path.splitext(os.path.basename(str(r.get("recorded_in"))))[0]
            for r in (report.get("ledger") or {}).get("releases", []) if r.get("recorded_in")]
    # Only hex digests (a legacy ledger file was named by the source's hash; a database
    # location names no data).
    return tuple(h for h in out if isinstance(h, str) and re.fullmatch(r"[0-9a-f]{12,}", h))


def published_stop(report: dict) -> str | None:
    """Why the run stopped early, in words that depend on no other run: the local text
    (`LedgerService._stop_message`) names the ε spent on the whole dataset and the runs that
    hold the rest of its budget, which other runs move (DESIGN, invariant `published-from-dp-only`)."""
    if not report.get("stopped"):
        return None
    done, planned = report.get("steps_completed"), report.get("steps_planned")
    if report.get("stop_cause") == "ledger":
        return (f"stopped by the ledger before step {(done or 0) + 1} of {planned} (the "
                "dataset's privacy budget or the run's target ε); the dataset-wide figures "
                "are internal")
    return "stopped early (the reason is internal)"


def publishable_report(report: dict) -> dict[str, Any]:
    """The report that may leave the machine, derived from the full local one by the
    `PUBLISHABLE_REPORT` allow-list; hashes are redacted from its texts. Nothing in it
    depends on another run's releases on the dataset."""
    pub = _redact_hashes(allow_listed(report, PUBLISHABLE_REPORT), _data_hashes(report))
    if "stopped" in pub:
        pub["stopped"] = published_stop(report)
    pub["publishable"] = True
    pub["withheld"] = PUBLISHABLE_NOTE
    return pub


def publishable_ledger(records, prior_releases=(), secrets: tuple[str, ...] = ()) -> list[dict]:
    """The releases of a ledger that may be published: (event, count), unit, δ_thr, run and
    release ids (`PUBLISHABLE_LEDGER_RECORD`), preceded by the earlier releases the run's
    guarantee composes (a private tokenizer's), so that ε can be recomputed from it alone.
    No fingerprint, config hash, path or time."""
    prior = [{"kind": "release", "event": r.get("event"), "count": r.get("count", 1),
              "first_step": 0, "run_id": r.get("run_id"), "attempt": None,
              "extra": r.get("extra"), "meta": {"mechanism": r.get("mechanism", "private-tokenizer"),
                                                "unit": {"kind": r.get("unit")}}}
             for r in prior_releases]
    records = list(records)
    secrets = tuple(secrets) + tuple((r.get("meta") or {}).get("dataset_fingerprint") or ""
                                     for r in records)
    out = [allow_listed(r, PUBLISHABLE_LEDGER_RECORD) for r in prior + records
           if r.get("kind") == "release"]
    return _redact_hashes(out, secrets)
