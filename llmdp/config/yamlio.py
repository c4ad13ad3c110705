"""A config's text side: YAML files in and out, plain copies, ``key.sub=value`` overrides.

The other half of :mod:`llmdp.config.load` (which builds a frozen dataclass from a
mapping, checked field by field), for :mod:`llmdp.config.schema`. :func:`read_yaml` rejects
duplicate keys (PyYAML keeps the last one silently) and names the line of a syntax error;
:func:`to_dict` gives the plain, YAML- and JSON-able copy that :func:`config_hash` hashes
and :func:`dump_yaml` writes; :func:`apply_overrides` sets ``key.sub=value`` overrides
(values read as YAML) on a raw recipe, each key checked against the recipe's dataclass.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from llmdp.config.choices import Choice
from llmdp.config.load import _hints, _section_type, schema_keys
from llmdp.config.validate import ConfigError, fmt, unknown_key_error

# ---------------------------------------------------------------- plain copies

def to_dict(cfg: Any) -> Any:
    """A plain, YAML- and JSON-able copy: dataclasses become dicts, tuples become lists, a
    `Choice` (``privacy.accountant``, ...) its plain string (what the recipe said)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Choice):
        return cfg.value
    return cfg


def config_hash(cfg: Any) -> str:
    """sha256 hex digest of the canonical JSON of :func:`to_dict` (sorted keys)."""
    text = json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def dump_yaml(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config; :func:`load_recipe` on the file gives an equal config."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    text = (
        "# Resolved llmdp recipe: every default filled in, every path absolute.\n"
        f"# config_hash: {config_hash(cfg)}\n"
        + yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
    )
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written config.yaml


# ------------------------------------------------------------------- overrides

_KEY_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"privacy.target_epsilon=4"`` -> ``(("privacy", "target_epsilon"), 4)``.

    The value is read with ``yaml.safe_load``: ``null``, lists and mappings work.
    """
    example = "e.g. privacy.target_epsilon=4"
    if not isinstance(text, str):
        raise ConfigError(f"override {text!r}: expected a string key=value ({example})")
    key, sep, raw_value = text.partition("=")
    if not sep:
        raise ConfigError(f"override {text!r}: no '='; expected key=value ({example})")
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key; expected key=value ({example})")
    parts = tuple(key.split("."))
    if not all(_KEY_PART.fullmatch(p) for p in parts):
        raise ConfigError(
            f"override {text!r}: malformed key {key!r}; expected dotted names such as "
            f"privacy.target_epsilon",
            key=key,
        )
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"override {text!r}: the value {raw_value!r} is not valid YAML ({problem})", key=key
        ) from None
    return parts, value


def _check_override_keys(keys: tuple[str, ...], text: str, root: type) -> None:
    cls: type | None = root
    for i, name in enumerate(keys):
        dotted = ".".join(keys[: i + 1])
        if cls is None:
            raise ConfigError(
                f"{dotted}: unknown key in override {text!r}; {'.'.join(keys[:i])!r} is a "
                f"value, not a section",
                key=dotted,
            )
        hints = _hints(cls)
        if name not in hints:
            raise unknown_key_error(dotted, schema_keys(root), where=f"in override {text!r}")
        cls = _section_type(hints[name])


def apply_overrides(d: Mapping[str, Any] | None, overrides: Sequence[str],
                    root: type) -> dict[str, Any]:
    """A copy of the raw recipe ``d`` with each ``key.sub=value`` override set, in order;
    each key is checked against the dataclass ``root`` (the recipe's type).

    Setting a key inside an absent or null section creates it (``model.lora.r=4`` turns
    LoRA on with r=4 and the other LoRA defaults).
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    out: dict[str, Any] = copy.deepcopy(dict(d)) if d is not None else {}
    for text in overrides:
        keys, value = parse_override(text)
        _check_override_keys(keys, text, root)
        node = out
        for i, name in enumerate(keys[:-1]):
            child = node.get(name)
            if child is None:
                child = node[name] = {}
            elif not isinstance(child, dict):
                dotted = ".".join(keys[: i + 1])
                raise ConfigError(
                    f"{dotted}: {fmt(child)} is not a mapping, so override {text!r} cannot "
                    f"set a key inside it",
                    key=dotted,
                )
            node = child
        node[keys[-1]] = value
    return out


# ------------------------------------------------------------------------ YAML

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one, so a
    second ``privacy:`` section would quietly replace the first)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[str, yaml.Mark] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        if key_node.value in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key_node.value!r} (first defined at line "
                f"{seen[key_node.value].line + 1})",
                key_node.start_mark,
            )
        seen[key_node.value] = key_node.start_mark
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML syntax error: {exc}") from None


def read_recipe_file(path: str | os.PathLike, what: str) -> tuple[str, str, Any]:
    """``(path as given, absolute path, parsed YAML)`` of a recipe file; ``what`` ("recipe",
    "tokenizer recipe") names it in the errors for a missing file or a directory."""
    given = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(given))
    if not os.path.exists(full):
        raise ConfigError(f"{what} file not found: {given!r} (looked for {full})")
    if os.path.isdir(full):
        raise ConfigError(f"{what} path is a directory, not a YAML file: {full}")
    return given, full, read_yaml(full)


def file_stem(path: str) -> str:
    """The default run name: ``recipes/tiny.yaml`` -> ``tiny``."""
    return os.path.splitext(os.path.basename(path))[0]
