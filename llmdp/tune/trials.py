"""What a sweep of either kind (`llmdp.tune.sweep`: DP trials; `llmdp.tune.public`: trials
on data declared public) needs alike: a trial's recipe from a grid point, and its state files
written atomically in strict JSON."""

from __future__ import annotations

import json
import math
import os

from llmdp.config.validate import ConfigError
from llmdp.config.yamlio import to_dict


def _trial_config(cfg, point, name: str, label: str):
    from llmdp.config.schema import apply_overrides, recipe_from_dict

    base = to_dict(cfg)
    base["sweep"] = None
    try:
        return recipe_from_dict(apply_overrides(base, [*point, f"output.name={name}"]),
                                base_dir=os.getcwd())
    except ConfigError as e:
        raise ConfigError(f"{label}: {e}", key=e.key) from None


def _describe(point) -> str:
    return ", ".join(point) or "the recipe as it is"


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _jsonable(x):
    """Strict JSON: a non-finite number (an ε of inf, a NaN loss) becomes its name."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_jsonable(obj), f, indent=2, default=str, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
