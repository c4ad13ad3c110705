"""Loading a config: a mapping or a YAML file -> a frozen dataclass, checked field by field.

The generic half of :mod:`llmdp.config`, which keeps the schema (its dataclasses) and the
checks that involve two fields or two sections. Nothing here knows a recipe's sections:
:func:`build` works on any (frozen) dataclass type given to it, nested dataclasses being
sections, and applies

* each field's declared type (``int``, ``float``, ``str``, ``bool``, ``X | None``,
  ``tuple[...]``, a nested dataclass) and the value checks in its metadata, declared with
  :func:`field_spec` (choices, bounds, non-empty, a pattern, path resolution);
* then, per dataclass, the cross-field check given for its type in ``checks``.

It stops at the first problem with one :class:`~llmdp._validate.ConfigError` that names the
full dotted key, the value and what was expected, with a "did you mean" for an unknown
key. Also here: :func:`to_dict` (and :func:`config_hash`, :func:`dump_yaml` on it), YAML
reading that rejects duplicate keys, and ``key.sub=value`` overrides.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, field
from typing import Any

import yaml

from llmdp._validate import (
    ConfigError,
    check_choice,
    check_range,
    check_type,
    describe_type,
    fmt,
    unknown_key_error,
)

# ------------------------------------------------------------------- field metadata


def field_spec(
    default: Any = MISSING,
    *,
    factory: Any = MISSING,
    choices: Sequence[Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    items: Mapping[str, float] | None = None,
    nonempty: bool = False,
    path: str | None = None,
    pattern: str | None = None,
    help: str = "",
) -> Any:
    """A dataclass field plus the checks the loader applies to it.

    ``ge/gt/le/lt``: bounds; ``items``: the same bounds for every item of a tuple;
    ``path``: "always" (resolved to an absolute path) or "maybe" (a local path if it
    exists or starts with ./ ../ / ~, else kept as a hub id); ``help``: added to the
    message when a required field is missing.
    """
    meta: dict[str, Any] = {}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if ge is not None or gt is not None or le is not None or lt is not None:
        meta["range"] = _bounds(ge=ge, gt=gt, le=le, lt=lt)
    if items is not None:
        meta["items"] = _bounds(**items)
    if nonempty:
        meta["nonempty"] = True
    if path is not None:
        meta["path"] = path
    if pattern is not None:
        meta["pattern"] = pattern
    if help:
        meta["help"] = help
    return field(default=default, default_factory=factory, metadata=meta)


def _bounds(ge=None, gt=None, le=None, lt=None) -> tuple:
    lo, lo_inc = (ge, True) if ge is not None else (gt, False)
    hi, hi_inc = (le, True) if le is not None else (lt, False)
    return (lo, hi, lo_inc, hi_inc)


# -------------------------------------------------------------------- schema walking

@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, nullable) for ``X | None``; (tp, False) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:  # pragma: no cover - the schema has no such fields
            raise TypeError(f"unsupported union {tp!r}")
        return args[0], True
    return tp, False


def _section_type(tp: Any) -> type | None:
    inner, _ = _unwrap_optional(tp)
    return inner if dataclasses.is_dataclass(inner) else None


@functools.cache
def schema_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of dataclass ``cls``, sections first then their fields, in field
    order: the "did you mean" candidates for an unknown key."""
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        keys.append(key)
        sub = _section_type(_hints(cls)[f.name])
        if sub is not None:
            keys.extend(schema_keys(sub, key))
    return tuple(keys)


# ------------------------------------------------------------------------ building

def _describe(tp: Any) -> str:
    inner, nullable = _unwrap_optional(tp)
    if dataclasses.is_dataclass(inner):
        text = "a mapping"
    elif typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        if args[-1] is Ellipsis:
            text = f"a list of {_plural(args[0])}"
        else:
            text = f"a list of {len(args)} {_plural(args[0])}"
    else:
        return describe_type(inner, nullable=nullable)
    return text + (" or null" if nullable else "")


def _plural(tp: type) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}[tp]


def _wrong_type(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(
        f"{key}: {fmt(value)} has the wrong type ({type(value).__name__}); "
        f"expected {_describe(tp)}",
        key=key,
    )


Check = Callable[[Any, str, str], Any]


@dataclasses.dataclass(frozen=True)
class _Ctx:
    """What one :func:`build` call passes down: the directory relative paths resolve
    against, the cross-field check per dataclass type, and the valid dotted keys."""

    base_dir: str
    checks: Mapping[type, Check]
    keys: tuple[str, ...]


def build(
    cls: type,
    d: Any,
    *,
    what: str,
    base_dir: str | os.PathLike | None = None,
    checks: Mapping[type, Check] | None = None,
) -> Any:
    """Dataclass ``cls`` from the mapping ``d`` (as read from YAML), every field checked.

    Relative paths resolve against ``base_dir`` (default: the current directory).
    ``checks[T](obj, dotted_prefix, base_dir)`` runs on each ``T`` built (after its fields)
    and returns it, possibly completed; ``what`` names the document in the error for a
    top level that is not a mapping.
    """
    if not isinstance(d, Mapping):
        sections = [f.name for f in dataclasses.fields(cls)]
        raise ConfigError(
            f"{what}: the top level must be a mapping with the sections {sections}; "
            f"got {type(d).__name__}"
        )
    base = os.path.abspath(os.fspath(base_dir)) if base_dir is not None else os.getcwd()
    return _build(cls, d, "", _Ctx(base, checks or {}, schema_keys(cls)))


def _coerce(key: str, value: Any, tp: Any, ctx: _Ctx) -> Any:
    """Check ``value`` against the declared type ``tp``; return it converted."""
    inner, nullable = _unwrap_optional(tp)
    if value is None:
        if nullable:
            return None
        if dataclasses.is_dataclass(inner):
            value = {}  # `scaling:` with everything commented out means the defaults
        else:
            raise ConfigError(f"{key}: null is not allowed; expected {_describe(tp)}", key=key)

    if dataclasses.is_dataclass(inner):
        if not isinstance(value, Mapping):
            raise _wrong_type(key, value, tp)
        return _build(inner, value, key, ctx)

    if typing.get_origin(inner) is tuple:
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(key, value, tp)
        args = typing.get_args(inner)
        if args[-1] is Ellipsis:
            item_types = [args[0]] * len(value)
        else:
            if len(value) != len(args):
                raise ConfigError(
                    f"{key}: {fmt(value)} has {len(value)} items; expected {_describe(tp)}",
                    key=key,
                )
            item_types = list(args)
        return tuple(
            _coerce(f"{key}[{i}]", v, t, ctx)
            for i, (v, t) in enumerate(zip(value, item_types))
        )

    out = check_type(key, value, inner, nullable=nullable)
    if isinstance(out, str) and not out.strip():
        raise ConfigError(f"{key}: empty string; expected a non-empty string", key=key)
    return out


def _resolve_path(value: str, base_dir: str) -> str:
    p = os.path.expanduser(value)
    if not os.path.isabs(p):
        p = os.path.join(base_dir, p)
    return os.path.normpath(p)


# A Hugging Face Hub id: `name` or `org/name`, letters, digits, '-', '_', '.' (no '--' or
# '..', at most 96 characters).
_HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*")


def _is_local_path(value: str, base_dir: str) -> bool:
    """Whether a `path="maybe"` value (model.name_or_path, model.tokenizer, ...) is a local
    path rather than a Hub id. A local path that does not exist is then reported as
    missing, never looked up on a hub: anything that is not a well-formed Hub id
    (`org/name`), starts with ./ ../ / ~, contains a backslash, or whose first component
    is an existing directory (runs/tok when runs/ exists) is a path."""
    if value in (".", "..") or value.startswith(("./", "../", "/", "~")):
        return True
    if os.path.exists(os.path.join(base_dir, value)):
        return True
    if "\\" in value or os.sep in value.replace("/", "") or value.endswith("/"):
        return True
    if not _HUB_ID.fullmatch(value) or len(value) > 96 or "--" in value or ".." in value:
        return True
    head = value.split("/", 1)[0]
    return "/" in value and os.path.isdir(os.path.join(base_dir, head))


def _field_value(key: str, raw: Any, f: dataclasses.Field, tp: Any, ctx: _Ctx) -> Any:
    value = _coerce(key, raw, tp, ctx)
    if value is None:
        return None
    meta = f.metadata
    if "choices" in meta:
        check_choice(key, value, meta["choices"])
    if "range" in meta:
        check_range(key, value, *meta["range"])
    if "items" in meta:
        for i, item in enumerate(value):
            check_range(f"{key}[{i}]", item, *meta["items"])
    if meta.get("nonempty") and len(value) == 0:
        raise ConfigError(f"{key}: empty; expected {_describe(tp)} with at least one item", key=key)
    if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
        raise ConfigError(
            f"{key}: {fmt(value)} does not match {meta['pattern']} "
            f"(letters, digits, '.', '_' and '-' only)",
            key=key,
        )
    if meta.get("path") == "ledger":
        if value.startswith(("postgresql://", "postgres://")):
            from urllib.parse import urlsplit

            if urlsplit(value).password is not None:
                raise ConfigError(
                    f"{key}: the URL carries a password, which would be written to the run's "
                    f"config.yaml and plan.json; remove it and give it in PGPASSWORD or "
                    f"~/.pgpass (e.g. {key}=postgresql://user@host/db)", key=key)
            return value
        return _resolve_path(value, ctx.base_dir)
    if meta.get("path") == "always" or (
        meta.get("path") == "maybe" and _is_local_path(value, ctx.base_dir)
    ):
        value = _resolve_path(value, ctx.base_dir)
    return value


def _build(cls: type, raw: Mapping, prefix: str, ctx: _Ctx) -> Any:
    """Build dataclass ``cls`` from mapping ``raw``, checking keys in the order written."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, raw_value in raw.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if not isinstance(name, str):
            raise ConfigError(
                f"{key}: keys must be strings, got {type(name).__name__} {name!r}", key=key
            )
        if name not in fields:
            raise unknown_key_error(key, ctx.keys)
        values[name] = _field_value(key, raw_value, fields[name], hints[name], ctx)
    for name, f in fields.items():
        if name in values:
            continue
        key = f"{prefix}.{name}" if prefix else name
        inner, nullable = _unwrap_optional(hints[name])
        if dataclasses.is_dataclass(inner) and not nullable:
            values[name] = _build(inner, {}, key, ctx)
        elif f.metadata.get("path") and f.default not in (MISSING, None):
            # A default path (output.dir: runs) is relative too: resolve it like one given.
            values[name] = _field_value(key, f.default, f, hints[name], ctx)
        elif f.default is MISSING and f.default_factory is MISSING:
            help_text = f.metadata.get("help")
            raise ConfigError(f"{key}: required" + (f"; {help_text}" if help_text else ""), key=key)
    obj = cls(**values)
    check = ctx.checks.get(cls)
    return check(obj, prefix, ctx.base_dir) if check else obj


# ---------------------------------------------------------------- plain copies

def to_dict(cfg: Any) -> Any:
    """A plain, YAML- and JSON-able copy: dataclasses become dicts, tuples become lists."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
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
