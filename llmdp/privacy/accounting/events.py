"""DP events: the only place `dp_accounting.DpEvent`s are built from a plan.

Every DP release llmdp makes is described by a small immutable dp-accounting event,
stored in the ledger as `(event, count)` and handed to an accountant. Building them
in one module keeps what the trainer *does* and what the accountant *assumes* in one
place (DESIGN, invariant `sampling-as-accounted`: sampling is what the accountant assumes).

Events are serialized to JSON through dp-accounting's own `to_named_tuple` /
`from_named_tuple`, so the ledger stores the library's structure verbatim rather
than a private encoding of ours.
"""

from __future__ import annotations

import collections
import importlib
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

# dp-accounting (with the scipy it loads, ~1 CPU-s) is imported by the functions that build
# or read an event, not with this module: a training worker loads it (through the run's
# spec) and never does either; the ledger's writer and the driver do.
if TYPE_CHECKING:
    import dp_accounting

__all__ = ["dpsgd_step_event", "is_truncated", "event_to_json", "event_from_json", "compose"]

# A ledger file is data, not code: `from_named_tuple` would import whatever module a
# line names. Only dp-accounting's own event classes may be rebuilt from JSON.
_ALLOWED_MODULE_PREFIX = "dp_accounting"


def _check_count(name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({what}), got {name}={value!r}")
    return int(value)


def dpsgd_step_event(
    sampling_probability: float,
    noise_multiplier: float,
    *,
    dataset_size: int | None = None,
    max_batch_size: int | None = None,
) -> dp_accounting.DpEvent:
    """The event of one DP-SGD step: (truncated) Poisson subsampling, then a Gaussian sum.

    `noise_multiplier` is sigma, the noise std in units of the clipping bound C
    (sensitivity 1 after dividing by C).

    * `max_batch_size=None`: `PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`, made
      true by `sampling.PoissonSampler`.
    * `max_batch_size=B_max`: `TruncatedSubsampledGaussianDpEvent(N + 1, q, B_max, sigma)`
      with N = `dataset_size` (then required), made true by
      `sampling.TruncatedPoissonSampler(N, q, B_max)`. dp-accounting accounts it with
      its PLD accountant only (`accountant.py`). B_max >= N is allowed (no truncation
      can happen; epsilon equals the Poisson event's).

    Why N + 1: dp-accounting's `dataset_size` is the size of the dataset that *contains*
    the differing unit (its PLD truncates with probability
    P(Binomial(dataset_size - 1, q) >= B_max) given that unit was drawn). Under
    add-or-remove-one, the neighbours of the N-unit dataset we sample are D minus a unit
    (the larger one has N units) and D plus a unit (N + 1 units); truncation is likelier,
    and epsilon larger, with more units, so N + 1 covers both. The sampling rate stays
    q = B/N, the rate the sampler actually uses.
    """
    import dp_accounting

    q = float(sampling_probability)
    sigma = float(noise_multiplier)
    if not (0.0 < q <= 1.0):
        raise ValueError(
            f"sampling_probability must be in (0, 1], got sampling_probability={sampling_probability!r}"
        )
    if not (sigma > 0.0 and math.isfinite(sigma)):
        raise ValueError(
            f"noise_multiplier must be a finite number > 0, got noise_multiplier={noise_multiplier!r}"
        )
    if dataset_size is not None:
        dataset_size = _check_count("dataset_size", dataset_size, "the number of privacy units N")
    if max_batch_size is None:
        return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    max_batch_size = _check_count(
        "max_batch_size", max_batch_size, "the truncated-Poisson cap B_max on units per step"
    )
    if dataset_size is None:
        raise ValueError(
            f"dataset_size is required with max_batch_size={max_batch_size} (the truncated "
            "event depends on the number of privacy units N): pass dataset_size=N, the N "
            "the sampler draws from"
        )
    return dp_accounting.TruncatedSubsampledGaussianDpEvent(
        dataset_size=dataset_size + 1,  # the add-neighbour's size: see the docstring
        sampling_probability=q,
        truncated_batch_size=max_batch_size,
        noise_multiplier=sigma,
    )


def is_truncated(event: dp_accounting.DpEvent) -> bool:
    """Whether `event` is, or contains, a `TruncatedSubsampledGaussianDpEvent`."""
    import dp_accounting

    if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
        return True
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return is_truncated(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(is_truncated(e) for e in event.events)
    return False


def _is_event_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields") and "class_name" in value._fields


def _plain(value: Any) -> Any:
    """Named tuples -> dicts, sequences -> lists, numpy scalars -> Python scalars."""
    if _is_event_tuple(value):
        return {name: _plain(getattr(value, name)) for name in value._fields}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy scalar
        return value.item()
    raise TypeError(f"cannot serialize event field value {value!r} of type {type(value).__name__}")


def event_to_json(event: dp_accounting.DpEvent) -> dict:
    """A plain, JSON-able dict of `event` (keeps `module_name`, `class_name`, all fields)."""
    from dp_accounting import dp_event

    if not isinstance(event, dp_event.DpEvent):
        raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}")
    return _plain(event.to_named_tuple())


def _event_class(module_name: Any, class_name: Any) -> type:
    from dp_accounting import dp_event

    if not (
        isinstance(module_name, str)
        and (
            module_name == _ALLOWED_MODULE_PREFIX
            or module_name.startswith(_ALLOWED_MODULE_PREFIX + ".")
        )
    ):
        raise ValueError(
            f"event module_name must be a dp_accounting module, got module_name={module_name!r}"
        )
    module = importlib.import_module(module_name)
    cls = getattr(module, str(class_name), None)
    if not (isinstance(cls, type) and issubclass(cls, dp_event.DpEvent)):
        raise ValueError(f"event class_name={class_name!r} is not a DpEvent class in {module_name}")
    return cls


def _to_named_tuples(value: Any) -> Any:
    """Inverse of `_plain`: dicts carrying class_name become named tuples, recursively."""
    if isinstance(value, Mapping):
        if "module_name" in value and "class_name" in value:
            _event_class(value["module_name"], value["class_name"])
            names = list(value.keys())
            nt = collections.namedtuple(f"_{value['class_name']}Json", names)
            return nt(**{k: _to_named_tuples(v) for k, v in value.items()})
        return {k: _to_named_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_named_tuples(v) for v in value]
    return value


def event_from_json(d: dict) -> dp_accounting.DpEvent:
    """Rebuild the DpEvent that `event_to_json` produced (exact round trip)."""
    from dp_accounting import dp_event

    if not (isinstance(d, Mapping) and "module_name" in d and "class_name" in d):
        raise ValueError(f"not a serialized DpEvent (needs module_name and class_name): {d!r}")
    return dp_event.DpEvent.from_named_tuple(_to_named_tuples(d))


def compose(entries: Iterable[tuple[dp_accounting.DpEvent, int]]) -> dp_accounting.DpEvent:
    """One ComposedDpEvent of `SelfComposedDpEvent(event, count)` per entry (count 0 skipped)."""
    import dp_accounting

    parts = []
    for event, count in entries:
        if not isinstance(event, dp_accounting.DpEvent):
            raise TypeError(
                f"entry event must be a dp_accounting.DpEvent, got {type(event).__name__}"
            )
        if isinstance(count, bool) or int(count) != count or count < 0:
            raise ValueError(f"entry count must be an integer >= 0, got count={count!r}")
        if count:
            parts.append(dp_accounting.SelfComposedDpEvent(event, int(count)))
    return dp_accounting.ComposedDpEvent(parts)
