"""The model `llmdp generate` samples, and the guarantee its samples inherit.

A source is a run folder (``plan.json``) or an export folder (``llmdp_export.json``). Its
(ε, δ), unit and accountant are read from the run's privacy report (checked against the
ledger by `llmdp.hub.export.verify_run`) or from the export's report (checked against
``llmdp_export.json``), never recomputed here. Sampling is post-processing of the model, so
the corpus inherits exactly that statement, provided the model deserves it. Refused, each
with one message naming the file, the field, the value and the fix (`GenerateError`):

- a model trained without DP (a NON-PRIVATE baseline, ``privacy.dp: false``, or a run on
  data declared public): there is no guarantee to carry over;
- a NON-PRIVATE baseline anywhere in the model's provenance chain (DESIGN, invariant
  `only-dp-outputs-leave`; provenance is transitive: what it learned without DP is in every
  descendant);
- a run or an export that does not verify (incomplete, report and ledger disagree, weights
  that are not the last checkpoint's, an export made with ``--allow-unverified``);
- a model whose DP releases drew their randomness from a fixed seed when its report does
  not carry the statement that it has no guarantee against anyone who knows that seed (the
  card repeats that statement when it is there).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

SEED_STATEMENT = "knows that seed"  # what a seeded run's report says (`report.build`, rng_warning)


class GenerateError(ValueError):
    """`llmdp generate` / `llmdp synthetic check` refused; the message names the file or flag,
    the value and the fix."""


@dataclass(frozen=True)
class Schema:
    """The records' shape, as the recipe declared it (``data.*_field``)."""

    mode: str = "text"  # text | chat | instruction
    text_field: str = "text"
    messages_field: str | None = None
    prompt_field: str | None = None
    response_field: str | None = None
    user_field: str | None = None
    chat_template: str = "auto"

    def describe(self) -> dict:
        out = {"mode": self.mode}
        if self.mode == "text":
            out["text_field"] = self.text_field
        elif self.mode == "chat":
            out["messages_field"] = self.messages_field
        else:
            out.update(prompt_field=self.prompt_field, response_field=self.response_field)
        if self.user_field:
            out["user_field"] = self.user_field
        return out


@dataclass
class ModelSource:
    kind: str  # "run" | "export"
    path: str
    model_dir: str
    run_id: str | None
    report: dict
    guarantee: dict
    chain: list[dict]
    schema: Schema
    seeded: list[str] = field(default_factory=list)
    config: dict | None = None  # the run's resolved recipe (None for an export)

    @property
    def shown(self) -> str:
        from llmdp.record.provenance import shown

        return shown(self.path)

    def private_paths(self) -> list[tuple[str, str]]:
        """(recipe field, local path) of every private source the recipe names."""
        if self.config is None:
            return []
        data = self.config.get("data") or {}
        out = []
        if data.get("path") and not data.get("public") and "://" not in str(data["path"]):
            out.append(("data.path", str(data["path"])))
        ev = data.get("eval") or {}
        if ev.get("path") and ev.get("public") is not True and "://" not in str(ev["path"]):
            out.append(("data.eval.path", str(ev["path"])))
        return out

    def ledger_location(self) -> str | None:
        if self.config is None:
            return None
        return (self.config.get("privacy") or {}).get("ledger")


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except FileNotFoundError:
        raise GenerateError(f"{path}: missing; {what}") from None
    except ValueError as e:
        raise GenerateError(f"{path}: not valid JSON ({e}); restore it from the run it came "
                            f"from") from None
    if not isinstance(out, dict):
        raise GenerateError(f"{path}: not a JSON object; restore it from the run it came from")
    return out


def load_source(path) -> ModelSource:
    """The run or export folder ``path``, checked (see the module doc)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise GenerateError(f"RUN_DIR|EXPORT_DIR: {path} is not a folder; give a finished run "
                            f"(runs/NAME) or an `llmdp export` folder")
    if os.path.isfile(os.path.join(path, "plan.json")):
        return _run_source(path)
    from llmdp.hub.export import EXPORT_INFO

    if os.path.isfile(os.path.join(path, EXPORT_INFO)):
        return _export_source(path)
    raise GenerateError(f"RUN_DIR|EXPORT_DIR: {path} holds neither plan.json (a run folder) nor "
                        f"{EXPORT_INFO} (an `llmdp export` folder); give one of those")


# ----------------------------------------------------------------------------- a run folder


def _run_source(path: str) -> ModelSource:
    from llmdp.hub.export import ExportError, verify_run
    from llmdp.record.provenance import PROVENANCE, lineage, read_provenance
    from llmdp.record.rundir import RunDir
    from llmdp.report.build import seeded_sources

    rd = RunDir(path)
    try:
        cfg, info = rd.config(), rd.info
    except (OSError, ValueError) as e:
        raise GenerateError(f"{path}: its config.yaml or plan.json cannot be read ({e}); give a "
                            f"finished run folder") from None
    priv, data = cfg.get("privacy") or {}, cfg.get("data") or {}
    if priv.get("simulate"):
        raise GenerateError(
            f"{path}/config.yaml: privacy.simulate is true: the model was trained on public data "
            f"with a private run's DP noise simulated, to tune hyper-parameters; it released "
            f"nothing and carries no guarantee. Sample from the private run's model")
    if data.get("public") and priv.get("dp") is False:
        raise GenerateError(
            f"{path}/config.yaml: data.public is true and privacy.dp is false: the model was "
            f"trained without DP on data its recipe declared public, so there is no guarantee "
            f"to carry over to a synthetic corpus. Sample from a DP run's model (privacy.dp: true)")
    if priv.get("dp") is False or (info.get("plan") or {}).get("dp") is False:
        raise GenerateError(
            f"{path}/config.yaml: privacy.dp is false: this is a NON-PRIVATE baseline, trained "
            f"without clipping or noise; its samples carry no guarantee and may copy any "
            f"training record. Sample from the DP run of the same recipe (privacy.dp: true)")
    model_dir = rd.file("model")
    if not os.path.isdir(model_dir):
        raise GenerateError(f"{path}: no final model (model/): the run did not finish; resume it "
                            f"with `llmdp train` and the same recipe, then generate")
    prov = read_provenance(model_dir)
    if prov is None:
        raise GenerateError(f"{model_dir}/{PROVENANCE}: missing: the model's provenance chain "
                            f"cannot be checked for a NON-PRIVATE ancestor; restore the file "
                            f"from the run, or train again")
    chain = lineage(prov)
    _refuse_taint(chain, f"{model_dir}/{PROVENANCE}")
    try:
        problems, report = verify_run(path)
    except ExportError as e:
        raise GenerateError(str(e)) from None
    seeded = list(seeded_sources(cfg, info))
    if report.get("rng_mode") == "seeded" and not seeded:
        seeded = ["privacy_report.json: rng_mode seeded"]
    problems = [p for p in problems if not p.startswith("a DP release of this model used a seeded RNG")]
    if problems:
        raise GenerateError(
            f"{path} does not verify, so its privacy report cannot be carried over to a "
            f"synthetic corpus:\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nFix the run (finish it, or rebuild its report with `llmdp privacy report "
              f"{path}`), then generate")
    _check_seed_statement(seeded, report, f"{path}/privacy_report.json",
                          f"rebuild the report with `llmdp privacy report {path}` (it states it)")
    return ModelSource(kind="run", path=path, model_dir=model_dir, run_id=report.get("run_id"),
                       report=report, guarantee=guarantee_of(report, "privacy_report.json"),
                       chain=_public_chain(chain), schema=_schema_of_recipe(data), seeded=seeded,
                       config=cfg)


# ----------------------------------------------------------------------------- an export


def _export_source(path: str) -> ModelSource:
    from llmdp.hub.export import EXPORT_INFO
    from llmdp.record.baseline import NON_PRIVATE
    from llmdp.record.provenance import PROVENANCE, lineage, read_provenance

    einfo = _read_json(os.path.join(path, EXPORT_INFO), "not an `llmdp export` folder")
    report = _read_json(os.path.join(path, "privacy_report.json"),
                        "an export carries its privacy report; export the run again")
    if (report.get("privacy") == NON_PRIVATE or report.get("dp") is False
            or report.get("declared_public") or einfo.get("epsilon") is None):
        raise GenerateError(
            f"{path}/privacy_report.json: privacy is {report.get('privacy') or 'not DP'!r}: the "
            f"exported model was trained without DP, so there is no guarantee to carry over to "
            f"a synthetic corpus. Sample from the export of a DP run")
    for key in ("epsilon", "delta"):
        if einfo.get(key) != report.get(key):
            raise GenerateError(
                f"{path}/privacy_report.json: {key} is {report.get(key)!r} but {EXPORT_INFO} says "
                f"{einfo.get(key)!r}: the folder was edited; export the run again")
    prov = read_provenance(path)
    if prov is None:
        raise GenerateError(f"{path}/{PROVENANCE}: missing: the model's provenance chain cannot "
                            f"be checked for a NON-PRIVATE ancestor; export the run again")
    chain = lineage(prov)
    _refuse_taint(chain, f"{path}/{PROVENANCE}")
    seeded = ["privacy_report.json: rng_mode seeded"] if report.get("rng_mode") == "seeded" else []
    for a in [prov, *(prov.get("ancestry") or [])]:
        if any(((r.get("meta") or {}).get("rng")) == "seeded" for r in a.get("releases") or []):
            seeded.append(f"{PROVENANCE}: run {a.get('run_id')}'s releases were seeded")
    problems = [p for p in einfo.get("problems") or []
                if not str(p).startswith("a DP release of this model used a seeded RNG")]
    if not einfo.get("verified") and problems:
        raise GenerateError(
            f"{path}/{EXPORT_INFO}: verified is false (exported with --allow-unverified):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nIts report cannot be carried over to a synthetic corpus; fix the run and "
              "export it again without --allow-unverified")
    _check_seed_statement(seeded, report, f"{path}/privacy_report.json",
                          "export the run again with this llmdp (its report states it)")
    return ModelSource(kind="export", path=path, model_dir=path, run_id=einfo.get("run_id"),
                       report=report, guarantee=guarantee_of(report, "the export's privacy_report.json"),
                       chain=_public_chain(chain),
                       schema=(_schema_of_recipe(einfo["record_schema"]) if einfo.get("record_schema")
                               else _schema_of_report(report, path)),
                       seeded=seeded, config=None)


# ----------------------------------------------------------------------------- shared


def _refuse_taint(chain: list[dict], where: str) -> None:
    from llmdp.record.provenance import taint

    bad = taint(chain)
    if bad is None:
        return
    how = "is" if bad is chain[0] else "descends from"
    raise GenerateError(
        f"{where}: the model {how} llmdp run {bad.get('run_id')}, a NON-PRIVATE baseline "
        f"(kind: non-private, trained without DP on data not declared public): what it learned "
        f"without DP is in every sample, so no DP statement can be made for a synthetic corpus. "
        f"Sample from a DP model with no baseline in its chain")


def _check_seed_statement(seeded: list[str], report: dict, where: str, fix: str) -> None:
    if not seeded:
        return
    warning = report.get("rng_warning") or ""
    if SEED_STATEMENT not in warning:
        raise GenerateError(
            f"{where}: rng_warning is {report.get('rng_warning')!r}, but the model's DP releases "
            f"drew their randomness from a fixed seed ({'; '.join(seeded)}): its report must state "
            f"that it carries no guarantee against anyone who knows that seed, and the card would "
            f"repeat it. Fix: {fix}; or train with privacy.rng: secure")


def guarantee_of(report: dict, read_from: str) -> dict:
    """The statement a synthetic corpus inherits, copied from the report as it is."""
    keys = ("epsilon", "delta", "accountant", "epsilon_by_accountant", "unit", "unit_description",
            "adjacency", "guarantee_scope", "dp_setting", "run_id", "rng_mode", "rng_warning")
    return {**{k: report.get(k) for k in keys}, "read_from": read_from}


def _public_chain(chain: list[dict]) -> list[dict]:
    """The provenance chain as the card names it: run ids and kinds, no local path."""
    from llmdp.record.provenance import kind_of, shown

    return [{"run_id": a.get("run_id"), "kind": kind_of(a),
             **({"public_source": shown(a.get("public_source"))} if a.get("public_source") else {}),
             **({"shown": a.get("shown")} if a.get("shown") else {})} for a in chain]


def _schema_of_recipe(data: dict) -> Schema:
    if data.get("messages_field"):
        mode = "chat"
    elif data.get("prompt_field"):
        mode = "instruction"
    else:
        mode = "text"
    return Schema(mode=mode, text_field=data.get("text_field") or "text",
                  messages_field=data.get("messages_field"), prompt_field=data.get("prompt_field"),
                  response_field=data.get("response_field"), user_field=data.get("user_field"),
                  chat_template=data.get("chat_template") or "auto")


def _schema_of_report(report: dict, path: str) -> Schema:
    """An export of an earlier llmdp (no ``record_schema`` in llmdp_export.json): its report's
    ``record_format`` names the record's fields
    (``data.text_field='text'``), its ``unit_size.user_field`` the user field."""
    fmt = report.get("record_format") or ""
    fields = dict(re.findall(r"data\.(\w+_field)='([^']*)'", fmt))
    user = (report.get("unit_size") or {}).get("user_field")
    if fmt.startswith("chat records"):
        mode = "chat"
    elif fmt.startswith("instruction records"):
        mode = "instruction"
    elif fmt.startswith("plain text records") or not fmt:
        mode = "text"
    else:
        raise GenerateError(f"{path}/privacy_report.json: record_format {fmt!r} names no record "
                            f"shape llmdp knows; export the run again with this llmdp")
    return Schema(mode=mode, text_field=fields.get("text_field", "text"),
                  messages_field=fields.get("messages_field"), prompt_field=fields.get("prompt_field"),
                  response_field=fields.get("response_field"), user_field=user,
                  chat_template="none" if "no chat template" in fmt else "auto")


def load_model(folder: str, device: str = "cpu"):
    """(model, tokenizer) of the final weights in ``folder`` (a run's model/ or an export), in
    eval mode: full weights, or a LoRA adapter on its base (named in adapter_config.json)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmdp.train.models import load_tokenizer

    tokenizer = load_tokenizer(folder, key="RUN_DIR|EXPORT_DIR")
    adapter = os.path.join(folder, "adapter_config.json")
    if os.path.isfile(adapter):
        from peft import PeftModel

        with open(adapter, encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path")
        if not base:
            raise GenerateError(f"{adapter}: base_model_name_or_path is empty; export merged "
                                f"weights (llmdp export --merge) and generate from that folder")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
        model = model.merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
    model.to(device=device, dtype=torch.float32).eval()
    return model, tokenizer
