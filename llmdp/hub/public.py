"""The export of a run on data its recipe declared public (``data.public: true``, issue 32):
the weights and tokenizer as for a DP run (`llmdp.hub.export`), a model card whose first line
is the recipe's declaration and which states no guarantee (`llmdp.report.card.public_model_card`),
the report without its internal statistics, and ``llmdp_export.json`` with no ε. Verified:
the run finished and its report is the declared-public one of this config."""

from __future__ import annotations

import json
import os

from llmdp._fs import building_dir, replace_dir
from llmdp.hub.folder import (
    _TOKENIZER_FILES,
    ExportError,
    _check_destination,
    _config_hash_header,
    _copy_files,
    _gate_problems,
    _local_roots,
    _read_json,
    _read_yaml,
    _scrub,
    _write_export_info,
    _write_model,
)
from llmdp.record.baseline import NON_PRIVATE, public_banner
from llmdp.record.provenance import lineage, read_provenance, taint
from llmdp.report.card import public_model_card


def declared_public(run_dir: str) -> bool:
    """A run on data its recipe declared public (``data.public: true``, ``privacy.dp: false``,
    the declaration first in its plan.json): exported without a guarantee (`llmdp.hub.public`)."""
    cfg = _read_yaml(os.path.join(run_dir, "config.yaml"))
    info = _read_json(os.path.join(run_dir, "plan.json")) or {}
    return (bool((cfg.get("data") or {}).get("public")) and (cfg.get("privacy") or {}).get("dp") is False
            and bool(info.get("declared_public")))


def _refuse_baseline(run_dir: str) -> None:
    """A NON-PRIVATE baseline (privacy.dp: false) is never exported, verified or not; a run on
    data declared public is (`verify_public_run`)."""
    cfg = _read_yaml(os.path.join(run_dir, "config.yaml"))
    info = _read_json(os.path.join(run_dir, "plan.json")) or {}
    if (cfg.get("privacy") or {}).get("simulate"):
        raise ExportError(
            f"{run_dir} is a simulated run (privacy.simulate: true): the DP mechanism of a "
            f"private run simulated on public data, to choose hyper-parameters at zero ε. It "
            f"released nothing and is not exported; export the private run trained with the "
            f"chosen hyper-parameters (train.hyperparameters_from)")
    if not declared_public(run_dir) and (
            (cfg.get("privacy") or {}).get("dp") is False or (info.get("plan") or {}).get("dp") is False
            or info.get("privacy") == NON_PRIVATE):
        raise ExportError(
            f"{run_dir} is a NON-PRIVATE baseline (privacy.dp: false): it was trained without "
            f"clipping or noise, carries no privacy guarantee and cannot be exported, not even "
            f"with --allow-unverified. It is for comparison only; to publish a model, train the "
            f"recipe with privacy.dp: true")
    prov = read_provenance(os.path.join(run_dir, "model")) if os.path.isdir(
        os.path.join(run_dir, "model")) else None
    bad = None if prov is None else taint(lineage(prov)[1:])
    if bad is not None:  # provenance is transitive: what the baseline learned is in this model
        raise ExportError(
            f"{run_dir} descends from llmdp run {bad.get('run_id')}, a NON-PRIVATE baseline "
            f"(trained without DP on data not declared public): what it learned without DP is in "
            f"this model, which cannot be exported, not even with --allow-unverified. Train it "
            f"again from a DP run's model, a declared-public run's with no baseline in its "
            f"chain, or a pretrained model")
    if info.get("planted"):
        raise ExportError(
            f"{run_dir} was trained with a planted bug ({info['planted']}, the test-only switch "
            f"LLMDP_TEST_PLANT): its mechanism was broken on purpose, it carries no privacy "
            f"guarantee and cannot be exported, not even with --allow-unverified")


def verify_public_run(run_dir: str) -> tuple[list[str], dict]:
    """(problems, report) of a run on data declared public: it finished, its report is the
    declared-public one and belongs to this config. No guarantee is checked: there is none."""
    _refuse_baseline(run_dir)  # the planted-bug refusal
    if not os.path.isdir(os.path.join(run_dir, "model")):
        raise ExportError(f"{run_dir}: no final model (model/); the run did not finish. Resume it "
                          f"with `llmdp train` and the same recipe and output.name")
    report = _read_json(os.path.join(run_dir, "privacy_report.json"))
    if report is None:
        raise ExportError(f"{run_dir}: no privacy_report.json; write it with `llmdp privacy report "
                          f"{run_dir}`, then export again")
    problems = []
    if not report.get("declared_public"):
        problems.append("privacy_report.json does not say that the data was declared public: "
                        "rebuild it with `llmdp privacy report`")
    if report.get("status") != "complete":
        problems.append(f"the run's status is {report.get('status')!r}, not complete")
    want = _config_hash_header(run_dir)
    if want and report.get("config_hash") != want:
        problems.append("privacy_report.json was written for another config.yaml: rebuild it with "
                        "`llmdp privacy report`")
    return problems, report


_PUBLIC_REPORT_KEYS = ("privacy", "dp", "banner", "declared_public", "run_id", "status", "epsilon",
                       "delta", "guarantee", "guarantee_note", "steps", "steps_planned",
                       "steps_completed", "unit", "dataset_size", "expected_batch_size",
                       "sampling_probability", "recipe", "evaluation", "config_hash")


def export_public(run_dir: str, to: str, cfg: dict, *, merge: bool, base_model: str | None,
                   license: str | None, push: str | None, allow_unverified: bool, log) -> tuple:
    """The export folder of a run on data declared public: the weights, the tokenizer, a card
    whose first line is the declaration, and the report without its internal statistics."""
    problems, report = verify_public_run(run_dir)
    _gate_problems(run_dir, problems, allow_unverified, log)
    _check_destination(to, report)
    with building_dir(to, ".tmp-export-") as tmp:
        fmt = _write_model(run_dir, tmp, cfg, merge=merge, base_model=base_model, log=log)
        _copy_files(os.path.join(run_dir, "model"), tmp, _TOKENIZER_FILES)
        roots = _local_roots(run_dir)
        clean_cfg = _scrub(cfg, roots)
        clean = _scrub({k: report[k] for k in _PUBLIC_REPORT_KEYS if k in report}, roots)
        clean["banner"] = public_banner(clean_cfg["data"])  # names the source, no local path
        with open(os.path.join(tmp, "privacy_report.json"), "w", encoding="utf-8") as f:
            json.dump(clean, f, indent=2)
        public_model_card(clean, clean_cfg, fmt=fmt, base_model=base_model, license=license,
                          unverified=problems, repo_id=push).save(os.path.join(tmp, "README.md"))
        _write_export_info(tmp, {"run_id": report.get("run_id"), "format": fmt, "base_model": base_model,
                                 "verified": not problems, "problems": problems,
                                 "declared_public": clean["banner"], "epsilon": None, "delta": None})
        replace_dir(tmp, to)
    return fmt, problems, report
