"""The recipe: its schema (`schema`: one dataclass per section, `load_recipe`), strict YAML
and dotted overrides (`yamlio`), the generic loader (`load`), the cross-field checks
(`checks`), the small validators (`validate`) and the choice lists (`choices`).

``from llmdp.config import load_recipe, RecipeConfig, ConfigError`` keeps working: the
schema's public names are looked up here on first use (importing ``llmdp.config.choices``
alone does not load the schema and what it imports)."""

from __future__ import annotations

_SUBMODULES = ("schema", "checks", "load", "yamlio", "validate", "choices")


def __getattr__(name: str):
    if name.startswith("__") or name in _SUBMODULES:
        raise AttributeError(f"module 'llmdp.config' has no attribute {name!r}")
    import importlib

    schema = importlib.import_module("llmdp.config.schema")
    if name in schema.__all__:
        return getattr(schema, name)
    raise AttributeError(f"module 'llmdp.config' has no attribute {name!r}")
