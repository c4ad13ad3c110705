"""Hyper-parameters chosen on a public proxy (issue 32 item 4): the file `llmdp sweep ...
--write-best FILE` writes (`llmdp.tune.public`), and a recipe's ``train.hyperparameters_from:
FILE``, whose overrides are applied when the recipe is read (a key the recipe sets to
another value is refused) and whose origin the run's plan and report state."""

from __future__ import annotations

import json
import os

import yaml

from llmdp.config.validate import ConfigError
from llmdp.config.yamlio import apply_overrides

BEST_KIND = "llmdp-best-hyperparameters"


def read_best_file(path: str) -> dict:
    """A --write-best file, checked: its overrides and where they came from."""
    key = "train.hyperparameters_from"
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{key}: {path} cannot be read ({e.strerror}); give the file "
                          f"`llmdp sweep ... --write-best FILE` wrote", key=key) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: {path} is not YAML ({e})", key=key) from None
    if not isinstance(doc, dict) or doc.get("kind") != BEST_KIND or not isinstance(doc.get("overrides"), dict):
        raise ConfigError(f"{key}: {path} is not a file `llmdp sweep ... --write-best` wrote (its "
                          f"kind is not {BEST_KIND!r} with an overrides mapping); write it with "
                          f"--write-best", key=key)
    return doc


_UNSET = object()


def _get(raw: dict, dotted: str):
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNSET
        node = node[part]
    return node


def apply_best(raw: dict, base_dir: str, root: type) -> dict:
    """``raw`` (a recipe mapping) with the overrides of its ``train.hyperparameters_from``
    file applied, the path made absolute; unchanged without the key. A key the recipe (or a
    command-line override) also sets to another value is refused: neither silently wins."""
    train = raw.get("train") if isinstance(raw, dict) else None
    path = train.get("hyperparameters_from") if isinstance(train, dict) else None
    if not path:
        return raw
    path = os.path.abspath(os.path.join(base_dir, os.path.expanduser(str(path))))
    doc = read_best_file(path)
    for k, v in doc["overrides"].items():
        mine = _get(raw, k)
        if mine is not _UNSET and mine != v:
            raise ConfigError(
                f"{k}: {mine!r} in the recipe, but train.hyperparameters_from ({path}) sets it to "
                f"{v!r}; remove it from the recipe (or its override) to take the tuned value, or "
                f"remove train.hyperparameters_from", key=k)
    items = [f"{k}={json.dumps(v)}" for k, v in doc["overrides"].items()]
    out = apply_overrides(raw, items, root)
    out["train"]["hyperparameters_from"] = path
    return out


def hyperparameter_note(cfg) -> dict | None:
    """What plan.json and the report say of a recipe's tuned hyper-parameters (None: the
    recipe names no --write-best file)."""
    path = cfg.train.hyperparameters_from
    if not path:
        return None
    doc = read_best_file(path)
    sim = doc.get("simulated_noise")
    how = ("" if not isinstance(sim, dict) else
           f", each trial with the DP noise of a private run simulated (σ = "
           f"{sim.get('noise_multiplier'):.4g}, σC/B = {sim.get('noise_std_per_step'):.4g})")
    return {"chosen_on": doc.get("chosen_on"), "source": doc.get("source"), "sweep": doc.get("sweep"),
            "values": doc["overrides"], "epsilon": 0.0,
            **({"simulated_noise": sim} if isinstance(sim, dict) else {}),
            "note": f"hyper-parameters {', '.join(f'{k}={v}' for k, v in doc['overrides'].items())} "
                    f"were chosen by the sweep {doc.get('sweep')!r} on data declared public "
                    f"({doc.get('source')}){how}, at zero privacy cost"}
