"""Small checks whose messages name the field, the value, and what was expected.

Every check raises :class:`ConfigError` with one line of the form

    privacy.accountant: 'pdl' is not one of ['pld', 'rdp']; did you mean 'pld'?
    train.expected_batch_size: 0 is out of range; expected an integer >= 1
    privacy.noise_multipler: unknown key; did you mean 'privacy.noise_multiplier'?

so that a user can fix a recipe from the message alone. Checks return the (possibly
converted) value, so they can be chained in an expression.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "ConfigError",
    "check_choice",
    "check_exactly_one",
    "check_range",
    "check_type",
    "describe_range",
    "describe_type",
    "fmt",
    "suggest",
    "unknown_key_error",
]


class ConfigError(ValueError):
    """A recipe, an override or a config value is invalid.

    ``key`` is the full dotted key the message is about (``"privacy.delta"``), or None
    for errors about the recipe as a whole (missing file, YAML syntax).
    """

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key

    def __reduce__(self):
        # Keep `key` across pickling (Ray ships exceptions between processes).
        return (self.__class__, (str(self),), {"key": self.key})


_MAX_REPR = 80


def fmt(value: Any) -> str:
    """The value as it appears in messages: repr, shortened when long."""
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 3] + "..."
    return text


def _num(x: float | int) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


_TYPE_NAMES = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def describe_type(expected: type, *, nullable: bool = False) -> str:
    """'an integer', 'a number or null', ..."""
    text = _TYPE_NAMES.get(expected, getattr(expected, "__name__", str(expected)))
    return text + (" or null" if nullable else "")


def check_type(key: str, value: Any, expected: type, *, nullable: bool = False) -> Any:
    """Check a scalar against ``bool``, ``int``, ``float`` or ``str``; return it converted.

    Rules (YAML makes each of these a real pitfall):
    - bools are never numbers (YAML reads ``yes``/``on`` as true);
    - ints are accepted for floats (and become floats);
    - integral floats are accepted for ints (``1000.0`` -> 1000), other floats are not;
    - strings that parse as a number are accepted for floats only: PyYAML follows YAML 1.1
      and reads ``1e-3`` (no dot) as the string ``'1e-3'``;
    - non-finite floats (``.nan``, ``.inf``) are rejected.
    """
    if value is None:
        if nullable:
            return None
        raise ConfigError(
            f"{key}: null is not allowed; expected {describe_type(expected)}", key=key
        )

    hint = ""
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in {"true", "false", "yes", "no"}:
            hint = " (write true or false without quotes)"
    elif expected is int:
        if isinstance(value, bool):
            hint = " (YAML reads yes/no/on/off/true/false as booleans)"
        elif isinstance(value, int):
            return value
        elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        elif isinstance(value, str):
            parsed = _parse_float(value)
            if parsed is not None and math.isfinite(parsed) and parsed.is_integer():
                hint = f" (YAML reads {value} as text; write it as {int(parsed)})"
    elif expected is float:
        number: float | None = None
        if isinstance(value, bool):
            hint = " (YAML reads yes/no/on/off/true/false as booleans)"
        elif isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            number = _parse_float(value)
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(
                    f"{key}: {fmt(value)} is not a finite number; expected "
                    f"{describe_type(float, nullable=nullable)}",
                    key=key,
                )
            return number
    elif expected is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            hint = " (quote it to make it a string)"
    else:  # pragma: no cover - programming error, not a user error
        raise TypeError(f"check_type does not handle {expected!r}")

    raise ConfigError(
        f"{key}: {fmt(value)} has the wrong type ({type(value).__name__}); expected "
        f"{describe_type(expected, nullable=nullable)}{hint}",
        key=key,
    )


def _parse_float(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def check_choice(key: str, value: Any, choices: Sequence[Any]) -> Any:
    """Value must be one of ``choices`` (case-sensitive); the message lists them."""
    if value in choices:
        return value
    message = f"{key}: {fmt(value)} is not one of {list(choices)!r}"
    if isinstance(value, str):
        strings = [c for c in choices if isinstance(c, str)]
        folded = [c for c in strings if c.lower() == value.lower()]
        close = folded or difflib.get_close_matches(value, strings, n=1, cutoff=0.6)
        if close:
            message += f"; did you mean {close[0]!r}?"
        if folded:
            message += " (choices are case-sensitive)"
    raise ConfigError(message, key=key)


def describe_range(
    lo: float | None = None,
    hi: float | None = None,
    lo_inclusive: bool = True,
    hi_inclusive: bool = True,
) -> str:
    """'>= 1', '> 0', '< 1', 'in [0, 1)', ..."""
    if lo is not None and hi is not None:
        left = "[" if lo_inclusive else "("
        right = "]" if hi_inclusive else ")"
        return f"in {left}{_num(lo)}, {_num(hi)}{right}"
    if lo is not None:
        return f"{'>=' if lo_inclusive else '>'} {_num(lo)}"
    if hi is not None:
        return f"{'<=' if hi_inclusive else '<'} {_num(hi)}"
    return "any value"


def check_range(
    key: str,
    value: float | int,
    lo: float | None = None,
    hi: float | None = None,
    lo_inclusive: bool = True,
    hi_inclusive: bool = True,
) -> float | int:
    """lo <= value <= hi with the given inclusivity; either bound may be None."""
    ok = True
    if lo is not None:
        ok = ok and (value >= lo if lo_inclusive else value > lo)
    if hi is not None:
        ok = ok and (value <= hi if hi_inclusive else value < hi)
    if ok:
        return value
    kind = "an integer" if isinstance(value, int) and not isinstance(value, bool) else "a number"
    raise ConfigError(
        f"{key}: {fmt(value)} is out of range; expected {kind} "
        f"{describe_range(lo, hi, lo_inclusive, hi_inclusive)}",
        key=key,
    )


def check_exactly_one(values: Mapping[str, Any]) -> str:
    """Exactly one of the dotted keys in ``values`` may be non-null; return that key."""
    given = [k for k, v in values.items() if v is not None]
    names = " and ".join(values) if len(values) == 2 else ", ".join(values)
    if len(given) == 1:
        return given[0]
    if not given:
        raise ConfigError(
            f"{names}: set exactly one of them; neither is set", key=next(iter(values))
        )
    got = ", ".join(f"{k}={fmt(values[k])}" for k in given)
    raise ConfigError(f"{names}: set exactly one of them, not both (got {got})", key=given[0])


def _split(key: str) -> tuple[str, str]:
    parent, _, leaf = key.rpartition(".")
    return parent, leaf


def suggest(key: str, candidates: Iterable[str]) -> str | None:
    """The closest valid dotted key to a mistyped ``key``, or None.

    ``candidates`` are full dotted keys. Keys in the same section are compared by their
    last part first (``privacy.noise_multipler`` -> ``privacy.noise_multiplier``); failing
    that, a key with the same or a very close name in another section is offered
    (``train.lr`` -> ``optim.lr``).
    """
    parent, leaf = _split(key)
    cands = list(dict.fromkeys(candidates))
    siblings: dict[str, str] = {}
    for c in cands:
        c_parent, c_leaf = _split(c)
        if c_parent == parent:
            siblings.setdefault(c_leaf, c)
    folded = {name.lower(): full for name, full in siblings.items()}
    if leaf.lower() in folded:
        return folded[leaf.lower()]
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]

    elsewhere: dict[str, str] = {}
    for c in cands:
        elsewhere.setdefault(_split(c)[1], c)
    for name, full in elsewhere.items():
        if name.lower() == leaf.lower():
            return full
    close = difflib.get_close_matches(leaf, list(elsewhere), n=1, cutoff=0.85)
    if close:
        return elsewhere[close[0]]
    return None


def unknown_key_error(key: str, candidates: Iterable[str], *, where: str = "") -> ConfigError:
    """The error for an unknown key: a suggestion, or else the valid keys at that level."""
    cands = list(candidates)
    context = f" {where}" if where else ""
    best = suggest(key, cands)
    if best is not None:
        return ConfigError(f"{key}: unknown key{context}; did you mean {best!r}?", key=key)
    parent, _ = _split(key)
    valid = [c_leaf for c_parent, c_leaf in map(_split, cands) if c_parent == parent]
    return ConfigError(f"{key}: unknown key{context}; expected one of {valid!r}", key=key)


# ---- checks of numeric arguments (the privacy plan, the accountant, the tokenizer).
# Their messages read "<name> must be ..., got <name>=<value>"; `error` is the exception
# class the caller's users expect (ValueError, or a subclass such as PlanError).


def _is_number(x: Any) -> bool:
    """A real number, not a bool (numpy's bool is not a `numbers.Real`)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_positive(name: str, value: Any, what: str | None = None, *,
                    error: type[Exception] = ValueError) -> float:
    """`value` as a float if it is a finite number > 0; `what` says what `name` is."""
    if not _is_number(value) or not (0 < value < math.inf):
        label = name if what is None else f"{name} ({what})"
        raise error(f"{label} must be a finite number > 0, got {name}={value!r}")
    return float(value)


def _check_steps(steps: Any, minimum: int = 1, *, error: type[Exception] = ValueError) -> int:
    """`steps` as an int if it is an integer >= `minimum`."""
    if not _is_int(steps) or steps < minimum:
        raise error(f"steps must be an integer >= {minimum}, got steps={steps!r}")
    return int(steps)


def _check_delta(delta: Any, dataset_size: int | None = None, *,
                 default: float | None = None, error: type[Exception] = ValueError) -> float:
    """`delta` as a float if it is in (0, 1), or, with `dataset_size` N, in (0, 1/N)
    (then `default`, the suggested delta for N, is named in the messages)."""
    if dataset_size is None:
        if not _is_number(delta) or not (0.0 < delta < 1.0):
            raise error(f"delta must be in the open interval (0, 1), got delta={delta!r}")
        return float(delta)
    hint = f"default_delta({dataset_size}) = {default:g}"
    if not _is_number(delta) or not (delta > 0):
        raise error(f"delta must be > 0 (and below 1/N), got delta={delta!r}; use e.g. {hint}")
    if not (delta < 1.0 / dataset_size):
        raise error(
            f"delta must be below 1/N = {1.0 / dataset_size:.6g} (N = dataset_size = {dataset_size}), "
            f"got delta={delta!r}: a delta that large allows publishing a whole privacy unit. "
            f"Use a smaller delta, e.g. {hint}"
        )
    return float(delta)
