"""Writing an export folder (`llmdp.hub.export`, `llmdp.hub.public`): reading a run's files,
the weights (full, adapter or merged) and tokenizer, local paths scrubbed from what is
published, and ``llmdp_export.json``. Shared by the export of a DP run and of a run on data
declared public; no verification here."""

from __future__ import annotations

import datetime as _dt
import glob
import json
import os
import shutil

import torch
import yaml

from llmdp.record.provenance import PROVENANCE, publishable, read_provenance

EXPORT_INFO = "llmdp_export.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "spm.model", "vocab.json", "merges.txt", "chat_template.jinja",
                    "added_tokens.json")
_MODEL_FILES = ("config.json", "generation_config.json")


class ExportError(RuntimeError):
    """The run cannot be exported or published as asked; the message says why and what to do."""


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from None


def _config_hash_header(run_dir: str) -> str | None:
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("# config_hash:"):
                return line.split(":", 1)[1].strip()
    return None


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except FileNotFoundError:
        return {}


def _check_destination(to: str, report: dict) -> None:
    info = _read_json(os.path.join(to, EXPORT_INFO)) if os.path.isdir(to) else None
    if os.path.exists(to) and (not os.path.isdir(to) or (os.listdir(to) and (
            info is None or info.get("run_id") != report.get("run_id")))):
        raise ExportError(f"--to: {to} exists and is not an export of this run; choose an empty or "
                          f"new folder")


def _gate_problems(run_dir: str, problems: list[str], allow_unverified: bool, log) -> None:
    """Refuse an unverified run unless --allow-unverified, which logs each problem (the
    card then lists them at the top)."""
    if problems and not allow_unverified:
        raise ExportError(
            f"{run_dir} cannot be exported as verified:\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nFix the run (or rebuild its report), or pass --allow-unverified to export anyway; "
              "the model card then lists these problems at the top")
    for p in problems:
        log(f"UNVERIFIED: {p}")


def _local_roots(run_dir: str) -> tuple[str, ...]:
    """The local paths ``_scrub`` removes from what an export publishes, longest first."""
    return tuple(sorted({run_dir, os.path.dirname(run_dir), os.getcwd(), os.path.expanduser("~")},
                        key=len, reverse=True))


def _write_export_info(folder: str, info: dict) -> None:
    info = {**info, "exported_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    with open(os.path.join(folder, EXPORT_INFO), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------- local paths, Hub ids


def _is_hub_id(name) -> bool:
    return (isinstance(name, str) and not os.path.isabs(name) and not name.startswith((".", "~"))
            and name.count("/") <= 1 and not os.path.exists(name))


def _scrub(obj, roots: tuple[str, ...] = ()):
    """A copy with local absolute paths replaced by ``<local>/<last component>``."""
    if isinstance(obj, dict):
        return {k: _scrub(v, roots) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v, roots) for v in obj]
    if isinstance(obj, str) and obj.startswith(os.sep) and len(obj) > 1 and "\n" not in obj:
        return "<local>/" + os.path.basename(obj.rstrip(os.sep))
    if isinstance(obj, str):
        for r in roots:
            if r and r in obj:
                obj = obj.replace(r, "<local>")
    return obj


# ----------------------------------------------------------------------------- the folder


def _copy_files(src: str, dst: str, names) -> list[str]:
    done = []
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, n))
            done.append(n)
    return done


def _scrub_config_json(path: str, base_model: str | None) -> None:
    """config.json / adapter_config.json: no local path in the published folder."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    for key in ("_name_or_path", "base_model_name_or_path"):
        if key in cfg and (cfg[key] is None or not _is_hub_id(cfg[key])):
            if key == "base_model_name_or_path":
                cfg[key] = base_model
            else:
                cfg.pop(key)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def _base_model_id(cfg: dict, given: str | None, *, push: str | None = None,
                   merge: bool = False) -> str | None:
    """The base model the export names (card, adapter_config.json): ``given``
    (``--base-model``), else the recipe's pretrained ``model.name_or_path`` if it is a Hub
    id. A published export (``push``) names a Hub id only, never a local path. A local
    export (no ``push``: an in-house registry) records the base as given, a local path too,
    and an adapter (LoRA, not merged) on a local base names that base, since it does not
    load without it; full weights from a local base name none (they load alone)."""
    if given is not None:
        if push is not None and not _is_hub_id(given):
            raise ExportError(f"--base-model: {given!r} is not a Hub id (ORG/NAME); a published "
                              f"card and adapter_config.json name the base by its Hub id, never a "
                              f"local path (an export without --push records it as given)")
        return given
    name = cfg["model"].get("name_or_path")
    if cfg["model"].get("init") != "pretrained" or not name:
        return None
    if _is_hub_id(name):
        return name
    if push is None and cfg["model"].get("lora") is not None and not merge:
        return name
    return None


def _write_model(run_dir: str, out: str, cfg: dict, *, merge: bool, base_model: str | None, log) -> str:
    """Write the weights into ``out``, with the model's provenance (no local path: a run
    starting from the export names it, `llmdp.record.provenance`); returns the format:
    adapter | merged | full."""
    fmt = _write_weights(run_dir, out, cfg, merge=merge, base_model=base_model, log=log)
    info = read_provenance(os.path.join(run_dir, "model"))
    if info is not None:
        with open(os.path.join(out, PROVENANCE), "w", encoding="utf-8") as f:
            json.dump(publishable(info, _scrub), f, indent=2, sort_keys=True)
            f.write("\n")
    return fmt


def _write_weights(run_dir: str, out: str, cfg: dict, *, merge: bool, base_model: str | None, log) -> str:
    model_dir = os.path.join(run_dir, "model")
    is_adapter = os.path.exists(os.path.join(model_dir, "adapter_config.json"))
    adapted = cfg["model"].get("base_tokenizer") is not None
    if not is_adapter:
        _copy_files(model_dir, out, _MODEL_FILES)
        for p in glob.glob(os.path.join(model_dir, "*.safetensors")) + glob.glob(
                os.path.join(model_dir, "*.safetensors.index.json")):
            shutil.copyfile(p, os.path.join(out, os.path.basename(p)))
        _scrub_config_json(os.path.join(out, "config.json"), base_model)
        return "full"
    with open(os.path.join(model_dir, "adapter_config.json"), encoding="utf-8") as f:
        local_base = json.load(f).get("base_model_name_or_path")
    if not merge:
        if adapted:
            raise ExportError(
                f"the base model was adapted to a new vocabulary (model.base_tokenizer): the adapter "
                f"does not apply to {cfg['model'].get('name_or_path')!r} as published. Export merged "
                f"weights with --merge")
        if base_model is None:
            tiny = cfg["model"].get("init") == "tiny"
            raise ExportError(
                f"the adapter's base {local_base!r} is not a Hub model "
                f"({'built from a config' if tiny else 'a local path'}); "
                f"export merged weights with --merge, or name the published base with --base-model ORG/NAME"
                + ("" if tiny else ", or export without --push (a local export names the local base)"))
        _copy_files(model_dir, out, ("adapter_config.json", "adapter_model.safetensors", "README.md"))
        if os.path.exists(os.path.join(out, "README.md")):
            os.remove(os.path.join(out, "README.md"))  # peft's template card; ours replaces it
        _scrub_config_json(os.path.join(out, "adapter_config.json"), base_model)
        return "adapter"
    from peft import PeftModel  # lazy: peft and transformers are heavy; only --merge loads a model
    from transformers import AutoModelForCausalLM  # lazy: as above

    if not local_base or not os.path.isdir(local_base):
        if not _is_hub_id(local_base):
            raise ExportError(f"--merge: the adapter's base {local_base!r} is not available here; "
                              f"rebuild it (re-run the recipe's preparation) or export the adapter")
    log(f"merging the adapter into {os.path.basename(str(local_base))}")
    base = AutoModelForCausalLM.from_pretrained(local_base, dtype=_saved_dtype(local_base))
    from llmdp.base.hf import quiet_peft

    with quiet_peft():
        merged = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
    merged.save_pretrained(out)
    _scrub_config_json(os.path.join(out, "config.json"), base_model)
    return "merged"


def _saved_dtype(model_dir: str):
    cfg = _read_json(os.path.join(model_dir, "config.json")) or {}
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, str(name), torch.float32)


def _list_files(folder: str) -> list[tuple[str, int]]:
    out = []
    for root, _, files in os.walk(folder):
        for n in files:
            p = os.path.join(root, n)
            out.append((os.path.relpath(p, folder), os.path.getsize(p)))
    return sorted(out)
