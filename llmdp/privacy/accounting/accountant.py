"""Privacy accounting: pure functions from `(DpEvent, count)` entries to epsilon / delta.

All the mathematics is dp-accounting's (DESIGN §5: accounting is not re-implemented
here). This module only fixes the choices that make numbers comparable across llmdp:
the neighbouring relation (add-or-remove-one privacy unit), the PLD discretization and
the RDP order grid.

Truncated Poisson sampling (`TruncatedSubsampledGaussianDpEvent`) is accounted by
dp-accounting's PLD accountant only (its RDP accountant does not support the event), and
only under the add-or-remove-one relation here (DESIGN, invariant `sampling-as-accounted`); asking RDP for it raises.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Iterable

import dp_accounting
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from llmdp.config.choices import Accountant
from llmdp.config.validate import _check_delta, _check_steps
from llmdp.privacy.accounting.events import dpsgd_step_event, is_truncated
from llmdp.privacy.accounting.grids import (
    PLD_DISPLAY_DISCRETIZATION_INTERVAL,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
)

__all__ = [
    "NEIGHBORING_RELATION",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "RDP_ORDERS",
    "make_accountant",
    "epsilon",
    "delta_for_epsilon",
    "epsilon_for",
    "epsilon_estimate",
    "check_supported",
]



class _DroppedOrderFilter:
    """dp-accounting logs a warning for every fractional RDP order whose series does not
    converge, then (correctly) leaves that order out of the minimum. The result is still a
    valid bound; the warnings only drown the progress output, so they are dropped."""

    def filter(self, record) -> bool:
        return "failed to converge" not in record.getMessage()


def _quiet_dropped_orders() -> None:
    import logging

    for name in ("absl", "dp_accounting"):
        logging.getLogger(name).addFilter(_DroppedOrderFilter())
    try:
        from absl import logging as absl_logging

        absl_logging.get_absl_logger().addFilter(_DroppedOrderFilter())
    except ImportError:  # pragma: no cover
        pass


_quiet_dropped_orders()

# Adding or removing one privacy unit: the relation Poisson subsampling is analysed under.
NEIGHBORING_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

# RDP converts to (eps, delta) by minimizing over orders, so the grid decides how tight
# the bound is: fractional orders near 1 (they win at large epsilon), every 0.1 up to
# 11, integers up to 64 (the usual DP-SGD optimum), a coarser tail to 256 and a few
# large orders for very large noise. Fractional orders are the costly ones (a series
# per order), and below ~1.1 dp-accounting often cannot converge for large q and then
# drops the order with a warning, so the grid there is sparse.
RDP_ORDERS = tuple(
    float(a)
    for a in np.unique(
        np.round(
            np.concatenate(
                [
                    [1.01, 1.02, 1.03, 1.05, 1.075],
                    1.0 + np.arange(1, 101) / 10.0,  # 1.1 .. 11.0
                    np.arange(12, 65),  # 12 .. 64
                    np.arange(68, 257, 4),  # 68 .. 256
                    [320, 384, 448, 512, 768, 1024, 2048, 4096, 8192],
                ]
            ),
            6,
        )
    )
)


def _check_accountant(accountant) -> Accountant:
    if Accountant.get(accountant) is None:
        raise ValueError(f"accountant must be one of {Accountant.choices()}, got accountant={accountant!r}")
    return Accountant(accountant)


def _check_epsilon(eps: float) -> float:
    if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float, np.floating))
        or not (0.0 <= eps < math.inf)
    ):
        raise ValueError(f"epsilon must be a finite number >= 0, got epsilon={eps!r}")
    return float(eps)


# ---- one step's PLD, built once per process
#
# A run asks dp-accounting for the same step many times: the ledger after every block, the
# budget's search over step counts, the report, a resumed plan, a sweep's trials, and a
# calibration walks the same sigmas again. dp-accounting's PLDAccountant builds the step's
# PLD afresh each time (0.1 to 1.5 s at the reporting grid) and then self-composes it.
# `_MemoPLDAccountant` is that accountant with the step's PLD kept (and a DP evaluation's
# Gaussian release's): for these events it calls the very constructor dp-accounting's
# `_maybe_compose` calls, with the same arguments, then `self_compose(count)` and `compose`
# as it does; the numbers are the same bit for bit (tests/privacy/accounting/test_accountant.py checks
# them against a plain PLDAccountant, and that a kept PLD is never changed by use). Nothing
# is re-implemented; every other event is dp-accounting's code path as is.
_STEP_PLDS_KEPT = 32  # each a few MB at most: two pmfs of up to ~250k floats


def _memoized_step(event) -> bool:
    """The events whose PLD is kept: a Poisson-subsampled Gaussian and a truncated
    Poisson-subsampled Gaussian, both with noise (the zero cases stay dp-accounting's)."""
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        inner = event.event
        return (isinstance(inner, dp_event.GaussianDpEvent) and event.sampling_probability != 0
                and inner.noise_multiplier != 0)
    if isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent):
        return (event.sampling_probability != 0 and event.truncated_batch_size != 0
                and event.dataset_size != 0 and event.noise_multiplier != 0)
    return False


@functools.lru_cache(maxsize=_STEP_PLDS_KEPT)
def _gaussian_pld(standard_deviation: float, interval: float):
    """dp-accounting's PLD of a Gaussian mechanism (a DP evaluation's release), as its
    PLDAccountant builds it for `GaussianDpEvent` composed `count` times (standard
    deviation noise_multiplier / sqrt(count), not self-composed)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld.from_gaussian_mechanism(standard_deviation=standard_deviation,
                                       value_discretization_interval=interval,
                                       neighboring_relation=NEIGHBORING_RELATION)


@functools.lru_cache(maxsize=_STEP_PLDS_KEPT)
def _step_pld(event, interval: float):
    """dp-accounting's PLD of one `event` (`_memoized_step`), as its PLDAccountant builds it."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return pld.from_gaussian_mechanism(
            standard_deviation=event.event.noise_multiplier,
            value_discretization_interval=interval,
            sampling_prob=event.sampling_probability,
            neighboring_relation=NEIGHBORING_RELATION,
        )
    return pld.from_truncated_subsampled_gaussian_mechanism(
        dataset_size=event.dataset_size,
        sampling_probability=event.sampling_probability,
        truncated_batch_size=event.truncated_batch_size,
        noise_multiplier=event.noise_multiplier,
        value_discretization_interval=interval,
        neighboring_relation=NEIGHBORING_RELATION,
    )


class _MemoPLDAccountant(PLDAccountant):
    """dp-accounting's PLD accountant, a DP-SGD step's PLD (`_step_pld`) and a Gaussian
    release's (`_gaussian_pld`) built once."""

    def _maybe_compose(self, event, count, do_compose):
        if not do_compose or self.neighboring_relation != NEIGHBORING_RELATION:
            return super()._maybe_compose(event, count, do_compose)
        interval = self._value_discretization_interval
        if _memoized_step(event):
            self._pld = self._pld.compose(_step_pld(event, interval).self_compose(count))
            return None
        if isinstance(event, dp_event.GaussianDpEvent) and event.noise_multiplier != 0:
            sd = event.noise_multiplier / math.sqrt(count)
            self._pld = self._pld.compose(_gaussian_pld(sd, interval))
            return None
        return super()._maybe_compose(event, count, do_compose)


# ---- one step's RDP, computed once per process
#
# The same holds for RDP: dp-accounting's RdpAccountant computes a Poisson-subsampled
# Gaussian step's RDP at every order afresh on each composition (0.3-0.4 s at RDP_ORDERS,
# whose large integer orders sum thousands of terms), then adds count times it: a report's
# ε curve asked 17 times for the same step (6.5 s). `_MemoRdpAccountant` keeps the step's
# RDP vector: it calls the very function dp-accounting's `_maybe_compose` calls, with the
# same arguments, and adds `count *` it to the total as it does (bit for bit:
# tests/privacy/accounting/test_accountant.py); the kept vector is read-only.
_STEP_RDPS_KEPT = 64  # each RDP_ORDERS floats


def _memoized_rdp_step(event) -> bool:
    """A Poisson-subsampled Gaussian (a DP-SGD step), its subevent a Gaussian itself."""
    return (isinstance(event, dp_event.PoissonSampledDpEvent)
            and isinstance(event.event, dp_event.GaussianDpEvent))


@functools.lru_cache(maxsize=_STEP_RDPS_KEPT)
def _step_rdp(q: float, noise_multiplier: float, orders: tuple[float, ...]) -> np.ndarray:
    """dp-accounting's RDP of one Poisson-subsampled Gaussian step at ``orders``."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    out = rdp._compute_rdp_poisson_subsampled_gaussian(
        q=q, noise_multiplier=noise_multiplier, orders=np.array(orders))
    out = np.asarray(out)
    out.flags.writeable = False  # shared by every later composition of this step
    return out


class _MemoRdpAccountant(RdpAccountant):
    """dp-accounting's RDP accountant, a DP-SGD step's RDP vector (`_step_rdp`) computed once."""

    def __init__(self, orders, neighboring_relation):
        super().__init__(orders=orders, neighboring_relation=neighboring_relation)
        self._orders_key = tuple(float(a) for a in orders)

    def _maybe_compose(self, event, count, do_compose):
        if do_compose and _memoized_rdp_step(event) and self._neighboring_relation in (
                dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                dp_accounting.NeighboringRelation.REPLACE_SPECIAL):
            self._rdp += count * _step_rdp(event.sampling_probability, event.event.noise_multiplier,
                                           self._orders_key)
            return None
        return super()._maybe_compose(event, count, do_compose)


def make_accountant(
    accountant: Accountant = Accountant.PLD, *, value_discretization_interval: float | None = None
) -> dp_accounting.PrivacyAccountant:
    """A fresh, empty dp-accounting accountant configured the llmdp way.

    `value_discretization_interval` (PLD only) defaults to
    `PLD_VALUE_DISCRETIZATION_INTERVAL`, the grid of every reported number; a coarser one
    is for estimates (display, planning searches).
    """
    _check_accountant(accountant)
    if accountant == Accountant.PLD:
        interval = (
            PLD_VALUE_DISCRETIZATION_INTERVAL
            if value_discretization_interval is None
            else float(value_discretization_interval)
        )
        if not (0.0 < interval < math.inf):
            raise ValueError(
                "value_discretization_interval must be a finite number > 0, got "
                f"value_discretization_interval={value_discretization_interval!r}"
            )
        return _MemoPLDAccountant(NEIGHBORING_RELATION, value_discretization_interval=interval)
    if value_discretization_interval is not None:
        raise ValueError("value_discretization_interval is a PLD setting; accountant='rdp' has none")
    return _MemoRdpAccountant(RDP_ORDERS, NEIGHBORING_RELATION)


def check_supported(event: dp_accounting.DpEvent, accountant: str) -> None:
    """Raise a ValueError that names the fix if `accountant` cannot account `event`.

    The truncated-Poisson event is supported by dp-accounting's PLD accountant only
    (`RdpAccountant.supports` is False for it), and llmdp accounts it under the
    add-or-remove-one relation only (DESIGN, invariant `sampling-as-accounted`).
    """
    _check_accountant(accountant)
    if not is_truncated(event):
        return
    if accountant != Accountant.PLD:
        raise ValueError(
            f"privacy.accountant={accountant!r} cannot account truncated Poisson sampling "
            "(TruncatedSubsampledGaussianDpEvent, privacy.sampler='truncated-poisson'): "
            "dp-accounting supports that event only in its PLD accountant, under the "
            "add-or-remove-one relation. Fix: set privacy.accountant: pld "
            "(accountant='pld'), or use privacy.sampler: poisson"
        )
    if NEIGHBORING_RELATION != dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE:
        raise ValueError(  # pragma: no cover - the relation is a module constant
            "truncated Poisson sampling is accounted only under the add-or-remove-one "
            f"relation, not {NEIGHBORING_RELATION}"
        )


def _normalize_entries(entries) -> list[tuple[dp_accounting.DpEvent, int]]:
    # A Ledger is accepted directly so callers can write epsilon(ledger, delta).
    if hasattr(entries, "entries") and callable(entries.entries):
        entries = entries.entries()
    out = []
    for i, entry in enumerate(entries):
        try:
            event, count = entry
        except (TypeError, ValueError) as e:
            raise ValueError(f"entries[{i}] must be an (event, count) pair, got {entry!r}") from e
        if not isinstance(event, dp_event.DpEvent):
            raise ValueError(
                f"entries[{i}] event must be a dp_accounting.DpEvent, got {type(event).__name__}"
            )
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"entries[{i}] count must be an integer >= 0, got count={count!r}")
        if count:
            out.append((event, int(count)))
    return out


def _composed(
    entries, accountant: str, value_discretization_interval: float | None = None
) -> dp_accounting.PrivacyAccountant | None:
    items = _normalize_entries(entries)
    if not items:
        return None
    for event, _ in items:
        check_supported(event, accountant)  # before any (possibly slow) composition
    acc = make_accountant(accountant, value_discretization_interval=value_discretization_interval)
    for event, count in items:
        if not acc.supports(event):
            raise ValueError(
                f"accountant={accountant!r} does not support event {event!r} under the "
                f"add-or-remove-one relation; try the other accountant in {Accountant.choices()}"
            )
        try:
            acc.compose(event, count)
        except MemoryError as e:
            # PLD support grows with the privacy loss; a tiny noise multiplier can need
            # tens of GiB. Say so instead of letting numpy's message stand alone.
            raise MemoryError(
                f"{accountant.upper()} accounting of {count} x {event!r} ran out of memory "
                "(very small noise multiplier / very large epsilon?); use accountant='rdp'"
            ) from e
    return acc


def epsilon(
    entries: Iterable[tuple[dp_accounting.DpEvent, int]], delta: float, accountant: Accountant = Accountant.PLD,
    value_discretization_interval: float | None = None,
) -> float:
    """Epsilon at `delta` of the composition of `(event, count)` entries; 0.0 if empty.
    (`value_discretization_interval`: a coarser PLD grid, for searches only.)"""
    delta = _check_delta(delta)
    _check_accountant(accountant)
    items = _normalize_entries(entries)
    # Kept per process (`_EPSILONS`): a pure function of the entries, δ and the grid.
    entries_repr = repr(items)
    key = (entries_repr, delta, accountant, value_discretization_interval)
    if key in _EPSILONS:
        _EPSILONS.move_to_end(key)
        return _EPSILONS[key]
    acc = _composed(items, accountant, value_discretization_interval)
    value = 0.0 if acc is None else float(acc.get_epsilon(delta))
    if len(entries_repr) <= _KEY_CHARS_KEPT:
        _EPSILONS[key] = value
        if len(_EPSILONS) > _EPSILONS_KEPT:
            _EPSILONS.popitem(last=False)
    return value


# The ε of a composition, kept per process (least recently used out): a plan is searched
# again for every trial of a sweep, by a re-launch, by the report and the progress line,
# and each is the same dp-accounting computation on the same entries. The key is the
# entries' repr (dp-accounting's events are attrs classes: every field, floats exactly),
# δ, the accountant and the grid; the value is the number `_composed` gave the first time.
# Only short compositions are kept (a plan, a sweep's trial, a few blocks: < 4 KiB of repr,
# at most 4096 of them, ~16 MiB): a long-running ledger composes one entry per block, and
# keeping each of its growing prefixes would grow with the square of the run's length.
_EPSILONS: collections.OrderedDict = collections.OrderedDict()
_EPSILONS_KEPT = 4096
_KEY_CHARS_KEPT = 4096


def threshold_delta(releases: Iterable[dict]) -> float:
    """Combined delta of the thresholds of thresholded releases: 1 - prod (1 - d_i)^count
    over records (ledger lines, or releases carried by a plan) whose ``extra`` has a
    ``delta_threshold`` d_i; 0.0 if none."""
    keep = 1.0
    for rec in releases:
        d = (rec.get("extra") or {}).get("delta_threshold")
        if d is not None and rec.get("count", 1):
            keep *= (1.0 - float(d)) ** int(rec.get("count", 1))
    return 1.0 - keep


def epsilon_with_threshold(
    entries: Iterable[tuple[dp_accounting.DpEvent, int]],
    delta: float,
    delta_threshold: float,
    accountant: Accountant = Accountant.PLD,
    value_discretization_interval: float | None = None,
) -> float:
    """Epsilon at `delta` of `entries` composed with mechanisms that each are, with
    probability at least 1 - d_i, exactly one of the entries' mechanisms, and anything
    otherwise (a thresholded release: `llmdp.tokenizer.private`); `delta_threshold` =
    1 - prod(1 - d_i).

    eps = eps_entries(delta - delta_threshold) - log(1 - delta_threshold): in the add
    direction the hockey-stick divergence grows by at most delta_threshold, in the remove
    direction the likelihood ratio by at most 1 / (1 - delta_threshold). With
    delta_threshold = 0 this is `epsilon`.
    """
    d_thr = float(delta_threshold)
    delta = _check_delta(delta)
    if not (0.0 <= d_thr < delta):
        raise ValueError(
            f"delta_threshold={delta_threshold!r} must be in [0, delta={delta!r}): the "
            "thresholded releases alone spend more than the target delta; report at a larger "
            "delta or train the tokenizer with a smaller one"
        )
    if d_thr == 0.0:
        return epsilon(entries, delta, accountant, value_discretization_interval)
    return epsilon(entries, delta - d_thr, accountant, value_discretization_interval) - math.log1p(-d_thr)


def delta_for_epsilon(
    entries: Iterable[tuple[dp_accounting.DpEvent, int]], epsilon: float, accountant: Accountant = Accountant.PLD
) -> float:
    """Smallest delta at which the entries are (epsilon, delta)-DP; 0.0 if empty."""
    eps = _check_epsilon(epsilon)
    _check_accountant(accountant)
    acc = _composed(entries, accountant)
    if acc is None:
        return 0.0
    return float(acc.get_delta(eps))


def _event_for(sampling_probability, noise_multiplier, dataset_size, max_batch_size):
    return dpsgd_step_event(
        sampling_probability,
        noise_multiplier,
        dataset_size=dataset_size,
        max_batch_size=max_batch_size,
    )


def epsilon_for(
    sampling_probability: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: Accountant = Accountant.PLD,
    *,
    dataset_size: int | None = None,
    max_batch_size: int | None = None,
) -> float:
    """Epsilon of `steps` DP-SGD steps at sampling rate q and noise multiplier sigma.

    With `max_batch_size` (and then `dataset_size`), the steps use truncated Poisson
    sampling and are accounted with `TruncatedSubsampledGaussianDpEvent` (PLD only).
    Memoized: a pure function of its arguments.
    """
    return _epsilon_cached(
        sampling_probability,
        noise_multiplier,
        steps,
        delta,
        accountant,
        dataset_size,
        max_batch_size,
        None,
    )


def _epsilon_cached(
    sampling_probability,
    noise_multiplier,
    steps,
    delta,
    accountant,
    dataset_size,
    max_batch_size,
    value_discretization_interval,
) -> float:
    # The driver asks the same question several times (plan, log line, report), the
    # planner many more: `epsilon` keeps the answer.
    steps = _check_steps(steps, 0)
    event = _event_for(sampling_probability, noise_multiplier, dataset_size, max_batch_size)
    return epsilon([(event, steps)], delta, accountant, value_discretization_interval)


def epsilon_estimate(
    sampling_probability: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    *,
    dataset_size: int | None = None,
    max_batch_size: int | None = None,
    value_discretization_interval: float = PLD_DISPLAY_DISCRETIZATION_INTERVAL,
) -> float:
    """A fast, conservative PLD epsilon of `steps` DP-SGD steps, for display and planning
    searches (not for reports). `dataset_size`/`max_batch_size` as in `epsilon_for`."""
    if isinstance(steps, (int, np.integer)) and not isinstance(steps, bool) and steps <= 0:
        return 0.0
    return _epsilon_cached(
        sampling_probability,
        noise_multiplier,
        steps,
        delta,
        Accountant.PLD,
        dataset_size,
        max_batch_size,
        float(value_discretization_interval),
    )
