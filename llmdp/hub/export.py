"""Export a finished run as a Hugging Face folder with its privacy statement, and publish it.

    llmdp export RUN_DIR --to DIR [--merge] [--push ORG/NAME] [--private] [--dry-run]
                 [--allow-unverified] [--base-model HUB_ID] [--license ID]

The folder (`export_run`):

- the model: the LoRA adapter in PEFT format (``adapter_config.json`` naming the base by
  its Hub id, never a local path, when published with ``--push``; a local export names a
  local base as given, for an in-house registry), or, with ``--merge``, the base with the adapter merged
  in (``merge_and_unload``); a full fine-tune is exported as full weights. safetensors only;
- the tokenizer;
- the publishable ``privacy_report.json`` / ``.md`` / ``.png`` and ``ledger.jsonl``
  (`llmdp.record.publish.publishable_report` / `publishable_ledger`: allow-lists of DP outputs and
  public configuration; no data statistics, internal metrics, loss curve or data hash;
  local paths replaced by their last component). The run directory keeps the full ones;
- ``README.md``: a model card whose YAML metadata (license, base_model, library_name,
  tags, datasets when public, and a ``differential_privacy`` block) and privacy section are
  generated from the publishable report (`llmdp.report.card.model_card`);
- ``llmdp_export.json``: what was exported, whether the run was verified, and the record
  fields of its recipe (public configuration, read by `llmdp generate`).

Before anything is written the run is verified (`verify_run`): its ledger and report exist
and agree (the report is rebuilt from the ledger and compared), the run is complete (or
stopped by its budget), the exported weights equal the last checkpoint's, which belongs to
this run and is at the last completed step, the ledger's config hash is the run's, and the
RNG is secure. A run that fails any check is refused, unless ``--allow-unverified``: the
card then says, at the top, which checks failed.

Publishing (`push_folder`) uses huggingface_hub (``create_repo``, ``upload_folder``) with the
token of the environment (``HF_TOKEN``) or of ``hf auth login``; it is never printed. Offline,
unauthenticated or failed uploads raise `ExportError` and leave the folder as it is.
``--dry-run`` builds the folder and lists exactly what would be uploaded, contacting nothing.
"""

from __future__ import annotations

import json
import os

import yaml

from llmdp._fs import building_dir, replace_dir
from llmdp.hub.folder import (  # noqa: F401 - EXPORT_INFO, ExportError: this module's API too
    _TOKENIZER_FILES,
    EXPORT_INFO,
    ExportError,
    _base_model_id,
    _check_destination,
    _config_hash_header,
    _copy_files,
    _gate_problems,
    _is_hub_id,
    _list_files,
    _local_roots,
    _read_json,
    _read_yaml,
    _scrub,
    _write_export_info,
    _write_model,
)
from llmdp.hub.public import _refuse_baseline, declared_public, export_public
from llmdp.privacy.ledger import Ledger
from llmdp.record import checkpoints
from llmdp.record.publish import publishable_ledger, publishable_report
from llmdp.record.rundir import RunDir
from llmdp.report.build import build_report, seeded_sources
from llmdp.report.card import model_card
from llmdp.report.render import plot_publishable, render_markdown
from llmdp.report.spent import epsilon_curve

__all__ = ["ExportError", "verify_run", "export_run", "push_folder", "HfApi"]

def HfApi(*args, **kwargs):  # noqa: N802 - patched in tests; the real class otherwise
    from huggingface_hub import HfApi as _HfApi  # lazy: slow to import; only publishing needs it

    return _HfApi(*args, **kwargs)


# ----------------------------------------------------------------------------- reading a run


def _run_config(run_dir: str) -> dict:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ExportError(f"{run_dir}: not a run directory (no config.yaml)")
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _plan_info(rd: RunDir) -> dict:
    """plan.json (``ExportError`` if it is not valid JSON)."""
    try:
        return rd.info
    except ValueError as e:
        raise ExportError(f"{rd.plan_path}: not valid JSON ({e})") from None


def verify_run(run_dir: str) -> tuple[list[str], dict | None]:
    """(problems, report): every reason not to publish the run as is (empty: verified),
    and the report to state (the stored one, or rebuilt from the ledger when missing)."""
    run_dir = os.path.abspath(run_dir)
    _refuse_baseline(run_dir)
    problems: list[str] = []
    if not os.path.isdir(os.path.join(run_dir, "model")):
        raise ExportError(f"{run_dir}: no final model (model/); the run did not finish. Resume it "
                          f"with `llmdp train` and the same recipe and output.name")
    rd = RunDir(run_dir).require(ExportError)
    stored = _read_json(os.path.join(run_dir, "privacy_report.json"))
    has_ledger = os.path.exists(os.path.join(run_dir, "ledger.jsonl"))
    rebuilt = build_report(run_dir) if has_ledger else None
    if not has_ledger:
        problems.append("ledger.jsonl is missing: the guarantee cannot be recomputed from the releases")
    if stored is None:
        problems.append("privacy_report.json is missing (the card states the report rebuilt from the ledger)")
    report = stored if stored is not None else rebuilt
    if report is None:
        raise ExportError(f"{run_dir}: neither privacy_report.json nor ledger.jsonl: nothing states "
                          f"the guarantee; this run cannot be exported")
    if stored is not None and rebuilt is not None:
        for key in ("epsilon", "delta", "steps", "steps_completed", "dataset_size", "noise_multiplier"):
            a, b = stored.get(key), rebuilt.get(key)
            same = (a == b) if not isinstance(a, float) or not isinstance(b, float) else (
                abs(a - b) <= 1e-9 * max(1.0, abs(b)))
            if not same:
                problems.append(f"privacy_report.json says {key} = {a!r} but the ledger gives {b!r}: "
                                f"rebuild it with `llmdp privacy report {run_dir}` and check why they differ")
    if report.get("status") not in ("complete", "stopped"):
        problems.append(f"the run's status is {report.get('status')!r}, not complete"
                        + (f" ({report.get('failure')})" if report.get("failure") else ""))
    if report.get("status") == "stopped" and report.get("stop_cause") != "ledger":
        problems.append(f"the run stopped early ({report.get('stopped')}) on something other than "
                        "its ledger: its length depends on a statistic of private data that no DP "
                        "release accounts, so publishing it would leak that statistic")
    # The run's own seed, or a private tokenizer's (llmdp_tokenizer.json privacy.rng), read
    # from the run's files, not only from the report (which may predate the tokenizer check).
    seeded_from = seeded_sources(_run_config(run_dir), _plan_info(rd))
    if report.get("rng_mode") == "seeded" or seeded_from:
        problems.append("a DP release of this model used a seeded RNG ("
                        + ("; ".join(seeded_from) or "privacy.rng: seeded")
                        + "): it carries no guarantee against anyone who knows the seed")
    # The ledger counts ledger units: steps, or a correlated mechanism's rounds of `cycle` steps.
    begun = rd.plan.ledger_begun(report.get("steps_completed", 0))
    if report.get("steps", 0) < begun:
        unit = "round(s)" if rd.plan.correlated else "steps"
        problems.append(f"the ledger records {report.get('steps')} {unit} but the "
                        f"{report.get('steps_completed')} completed steps began {begun}: "
                        f"{unit} are missing from the ledger")
    if rebuilt is not None:
        # build_report cross-checked the run's ledger with the dataset ledger (and stopped
        # on any difference); a database it could not reach is a reason not to verify.
        d = rebuilt.get("dataset_ledger") or {}
        if d.get("error"):
            problems.append(f"the run's releases could not be cross-checked against the dataset "
                            f"ledger {d.get('dataset_id', '')!r} ({d.get('ledger')}): {d['error']}")
    if has_ledger:
        ledger_file = Ledger(os.path.join(run_dir, "ledger.jsonl"))
        all_recs = ledger_file.records()
        if ledger_file.legacy:
            problems.append("ledger.jsonl was written by an earlier llmdp, without hash-chained "
                            "records: it cannot be checked for deleted or edited lines")
        recs = [r for r in all_recs if r["kind"] == "release"]
        want = _config_hash_header(run_dir)
        got = (recs[-1].get("meta") or {}).get("config_hash") if recs else None
        if recs and want and got != want:
            problems.append(f"the ledger's last release was made under config {str(got)[:12]}, not this "
                            f"run's config.yaml ({want[:12]})")
    ckpt = rd.latest_checkpoint()
    if ckpt is None:
        problems.append("no checkpoint to check the final model against")
    else:
        try:
            state = checkpoints.read_meta(ckpt)
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint is a reason not to verify
            return [*problems, checkpoints.unreadable(e)], report
        if state.get("run_id") != report.get("run_id"):
            problems.append(f"the last checkpoint belongs to run {state.get('run_id')!r}, not "
                            f"{report.get('run_id')!r}")
        if int(state.get("step", -1)) != int(report.get("steps_completed", -2)):
            problems.append(f"the last checkpoint is at step {state.get('step')}, the report at "
                            f"{report.get('steps_completed')} completed steps")
        problems += checkpoints.check_model(ckpt, os.path.join(run_dir, "model"))
        pos = state.get("ledger") or {}
        if has_ledger and pos.get("run_last_hash"):
            # The checkpoint knows how far the run's ledger had come: its last record must
            # still be there, at the same line.
            n = int(pos.get("run_records") or 0)
            if n > len(all_recs) or all_recs[n - 1].get("hash") != pos["run_last_hash"]:
                problems.append(f"the last checkpoint was written when ledger.jsonl held {n} "
                                f"record(s) ending with {pos['run_last_hash'][:12]}, which it no "
                                f"longer does: lines were deleted or replaced")
    return problems, report


def _publishable(run_dir: str, report: dict) -> dict:
    """The publishable report of the run (`llmdp.record.publish.publishable_report`), with the
    ledger's ε curve (computed now when the stored report has none)."""
    full = dict(report)
    if not full.get("epsilon_curve") and os.path.exists(os.path.join(run_dir, "ledger.jsonl")):
        full["epsilon_curve"] = [[t, e] for t, e in epsilon_curve(run_dir)]
    return publishable_report(full)


def _write_publishable(run_dir: str, out: str, pub: dict) -> None:
    """privacy_report.json / .md / .png and ledger.jsonl of the export, from `pub` and the
    run's ledger through the allow-lists of llmdp.record.publish; nothing is copied as is."""
    with open(os.path.join(out, "privacy_report.json"), "w", encoding="utf-8") as f:
        json.dump(pub, f, indent=2)
    with open(os.path.join(out, "privacy_report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(pub))
    plot_publishable(pub, os.path.join(out, "privacy_report.png"))
    path = os.path.join(run_dir, "ledger.jsonl")
    if os.path.exists(path):
        prior = _plan_info(RunDir(run_dir)).get("prior_releases") or []
        lines = publishable_ledger(Ledger(path).records(), prior)
        with open(os.path.join(out, "ledger.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(rec, sort_keys=True) + "\n" for rec in lines)


def export_run(
    run_dir,
    to,
    *,
    merge: bool = False,
    push: str | None = None,
    private: bool = False,
    dry_run: bool = False,
    allow_unverified: bool = False,
    base_model: str | None = None,
    license: str | None = None,
    log=print,
) -> dict:
    """Verify ``run_dir``, write the export folder ``to``, and push it to ``push`` (a Hub
    repo id) unless ``dry_run``. Returns ``{"folder", "format", "files", "verified",
    "problems", "pushed"}``."""
    run_dir = os.path.abspath(os.fspath(run_dir))
    to = os.path.abspath(os.fspath(to))
    if push is not None and not _is_hub_id(push) or (push is not None and push.count("/") != 1):
        raise ExportError(f"--push: {push!r} is not a Hub repo id; expected ORG/NAME")
    cfg = _run_config(run_dir)
    if declared_public(run_dir):
        base_id = _base_model_id(cfg, base_model, push=push, merge=merge)
        fmt, problems, report = export_public(run_dir, to, cfg, merge=merge, base_model=base_id,
                                               license=license, push=push,
                                               allow_unverified=allow_unverified, log=log)
        return _finish_export(to, fmt, problems, push, private, dry_run, log,
                              "DECLARED PUBLIC DATA: no privacy guarantee")
    problems, report = verify_run(run_dir)
    _gate_problems(run_dir, problems, allow_unverified, log)
    base_id = _base_model_id(cfg, base_model, push=push, merge=merge)
    _check_destination(to, report)
    with building_dir(to, ".tmp-export-") as tmp:
        fmt = _write_model(run_dir, tmp, cfg, merge=merge, base_model=base_id, log=log)
        _copy_files(os.path.join(run_dir, "model"), tmp, _TOKENIZER_FILES)
        roots = _local_roots(run_dir)
        # Only DP outputs and public configuration leave (DESIGN, invariant `only-dp-outputs-leave`): the report, its plot,
        # the ledger and the card are the publishable ones, derived from the local report.
        clean = _scrub(_publishable(run_dir, report), roots)
        _write_publishable(run_dir, tmp, clean)
        card = model_card(clean, _scrub(cfg, roots), fmt=fmt, base_model=base_id, license=license,
                          unverified=problems, repo_id=push)
        card.save(os.path.join(tmp, "README.md"))
        _write_export_info(tmp, {"run_id": report.get("run_id"), "format": fmt, "base_model": base_id,
                                 "verified": not problems, "problems": problems,
                                 "epsilon": report["epsilon"], "delta": report["delta"],
                                 "record_schema": record_schema(cfg)})
        replace_dir(tmp, to)
    return _finish_export(to, fmt, problems, push, private, dry_run, log,
                          f"ε = {report['epsilon']:.4f} at δ = {report['delta']:.3g}")


def record_schema(cfg: dict) -> dict:
    """The record fields of the recipe (public configuration): what `llmdp generate` writes
    records of, from an export that has no recipe."""
    data = cfg.get("data") or {}
    return {k: data.get(k) for k in ("text_field", "messages_field", "prompt_field",
                                     "response_field", "user_field", "chat_template")}


def _finish_export(to, fmt, problems, push, private, dry_run, log, what: str) -> dict:
    from llmdp._fs import publish_tree

    publish_tree(to)  # meant for publication: ordinary permissions (copies of 0600 files)
    files = _list_files(to)
    log(f"exported {fmt} to {to} ({len(files)} files, {sum(s for _, s in files) / 1e6:.1f} MB); "
        f"{what}" + ("" if not problems else " (UNVERIFIED)"))
    result = {"folder": to, "format": fmt, "files": files, "verified": not problems,
              "problems": problems, "pushed": None}
    if push is not None:
        if dry_run:
            log(f"dry run: would create {'a private' if private else 'a public'} model repo {push} "
                f"(if missing) and upload these {len(files)} files:")
            for name, size in files:
                log(f"  {name}  ({size:,} bytes)")
        else:
            result["pushed"] = push_folder(to, push, private=private, log=log)
    elif dry_run:
        log("dry run: nothing to upload (no --push)")
    return result


# ----------------------------------------------------------------------------- publishing


def push_folder(folder: str, repo_id: str, *, private: bool = False, log=print) -> str:
    """``create_repo`` (if missing) then ``upload_folder``; returns the commit URL. Raises
    ExportError when offline, unauthenticated or on any Hub error; the folder is kept."""
    # lazy: huggingface_hub is slow to import and only publishing needs it; read at call time,
    # so that the token and HF_HUB_OFFLINE are the current ones (tests patch both)
    from huggingface_hub import get_token
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ExportError(f"HF_HUB_OFFLINE is set: cannot publish to {repo_id}. The export is in "
                          f"{folder}; unset HF_HUB_OFFLINE and run the same command again")
    if get_token() is None:
        raise ExportError(f"no Hugging Face token: set HF_TOKEN or run `hf auth login`, then run the "
                          f"same command again (the export is in {folder})")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                   commit_message="llmdp export: DP model with its privacy report")
    except Exception as e:
        raise ExportError(f"publishing to {repo_id} failed ({type(e).__name__}: {str(e)[:300]}); "
                          f"the export is intact in {folder}") from None
    url = getattr(commit, "commit_url", None) or str(commit)
    log(f"published {repo_id} ({'private' if private else 'public'}): {url}")
    return url
