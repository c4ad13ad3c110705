"""Loading a config: a mapping or a YAML file -> a frozen dataclass, checked field by field.

The generic half of :mod:`llmdp.config.schema`, which keeps the schema (its dataclasses) and the
checks that involve two fields or two sections. Nothing here knows a recipe's sections:
:func:`build` works on any (frozen) dataclass type given to it, nested dataclasses being
sections, and applies

* each field's declared type (``int``, ``float``, ``str``, ``bool``, ``X | None``,
  ``tuple[...]``, a nested dataclass) and the value checks in its metadata, declared with
  :func:`field_spec` (choices, bounds, non-empty, a pattern, path resolution);
* then, per dataclass, the cross-field check given for its type in ``checks``.

It stops at the first problem with one :class:`~llmdp.config.validate.ConfigError` that names the
full dotted key, the value and what was expected, with a "did you mean" for an unknown
key. The text side (YAML files in and out, :func:`~llmdp.config.yamlio.to_dict`, and
``key.sub=value`` overrides) is :mod:`llmdp.config.yamlio`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, field
from typing import Any

from llmdp.config.choices import Choice
from llmdp.config.validate import (
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
    ``path``: "always" (resolved to an absolute path; a leading ``$LLMDP_CACHE`` is llmdp's
    cache folder) or "maybe" (a local path if it exists or starts with ./ ../ / ~, else kept
    as a hub id); ``help``: added to the
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

def _choice_type(tp: Any) -> type[Choice] | None:
    """The `Choice` enum a field is typed with (``accountant: Accountant``), or None."""
    inner, _ = _unwrap_optional(tp)
    return inner if isinstance(inner, type) and issubclass(inner, Choice) else None


def _describe(tp: Any) -> str:
    inner, nullable = _unwrap_optional(tp)
    if _choice_type(inner) is not None:  # written as a string
        return describe_type(str, nullable=nullable)
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

    choice = _choice_type(inner)
    out = check_type(key, value, str if choice is not None else inner, nullable=nullable)
    if isinstance(out, str) and not out.strip():
        raise ConfigError(f"{key}: empty string; expected a non-empty string", key=key)
    if choice is not None:  # the enum is the list: its values, its error (check_choice)
        return choice(check_choice(key, out, choice.choices()))
    return out


# A path that starts with this names llmdp's cache folder (`llmdp._fs.cache_root`:
# $LLMDP_CACHE, else .cache/llmdp under the working directory), e.g. the demo recipes'
# generated corpora: `path: $LLMDP_CACHE/demo/clinical_notes.jsonl`.
CACHE_VAR = re.compile(r"^\$(?:LLMDP_CACHE\b|\{LLMDP_CACHE\})")


def _resolve_path(value: str, base_dir: str) -> str:
    if CACHE_VAR.match(value):
        from llmdp._fs import cache_root  # lazy: a leaf module, but only these paths need it

        value = cache_root() + CACHE_VAR.sub("", value)
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
    if meta.get("path") == "always" and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value):
        return value  # a URI (data.path on a pyarrow filesystem): not a local path
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
