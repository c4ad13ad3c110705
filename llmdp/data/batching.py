"""Batch assembly: a step's sampled units -> the same number of micro-batches on every worker.

Every worker expands the same sampling key into the same sample (privacy/sampling/poisson.py) and
runs :func:`assign_micro_batches` on it with the store's public-to-workers unit sizes, so
all workers agree on the whole assignment without exchanging indices. Then each reads
only the rows of its own units.

Rules (DESIGN, invariant `unit-is-a-unit` and the loop's lockstep):

- a unit's rows stay together in one micro-batch (it is clipped once, as one unit);
- a micro-batch holds at most ``physical_batch_size`` rows;
- every worker runs the same number of micro-steps (collectives in sharded models would
  otherwise deadlock; a worker with less work runs empty micro-batches on one padding row);
- with length bucketing, units are ordered by their longest row before packing, so rows
  of similar length share a micro-batch and the store pads each micro-batch only to its
  own longest row (``UnitStore.rows(..., width="auto")``).

The assignment depends on the sample (which is secret); it is never logged.
"""

from __future__ import annotations

import numpy as np

__all__ = ["assign_micro_batches", "pack_units"]


def pack_units(unit_rows: np.ndarray, capacity: int) -> np.ndarray:
    """Next-fit packing of units (in the given order) into bins of ``capacity`` rows.

    Returns the bin index of every unit (non-decreasing). Units of one row each (sequence
    units) pack in closed form; otherwise one pass over the units.
    """
    unit_rows = np.asarray(unit_rows, dtype=np.int64)
    if unit_rows.size == 0:
        return np.empty(0, np.int64)
    if unit_rows.max() > capacity:
        raise ValueError(
            f"a privacy unit has {int(unit_rows.max())} rows, more than train.physical_batch_size="
            f"{capacity}: a unit's rows must fit in one micro-batch; raise physical_batch_size to at "
            f"least data.max_rows_per_unit"
        )
    if unit_rows.min() == unit_rows.max():
        per_bin = capacity // int(unit_rows[0])
        return np.arange(unit_rows.size, dtype=np.int64) // per_bin
    out = np.empty(unit_rows.size, dtype=np.int64)
    b, used = 0, 0
    for i, r in enumerate(unit_rows.tolist()):
        if used + r > capacity:
            b, used = b + 1, 0
        out[i] = b
        used += r
    return out


def assign_micro_batches(
    sample,
    unit_rows: np.ndarray,
    unit_lengths: np.ndarray | None,
    *,
    world_size: int,
    physical_batch_size: int,
    bucket: bool = True,
    min_micro_steps: int = 0,
) -> list[list[np.ndarray]]:
    """``out[w][m]``: the unit indices of worker ``w``'s micro-step ``m`` (possibly empty).

    ``unit_rows[u]`` / ``unit_lengths[u]`` are the row count and longest row of unit ``u``
    (the store's ``unit_row_count`` / ``unit_max_row_length``). Every worker gets
    ``max(min_micro_steps, ceil(bins / world_size))`` micro-steps. Bins are dealt
    round-robin, so with bucketing every worker gets a similar mix of lengths.
    """
    for name, value, low in (("world_size", world_size, 1),
                             ("physical_batch_size", physical_batch_size, 1),
                             ("min_micro_steps", min_micro_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {name}={value!r}")
    sample = np.asarray(sample, dtype=np.int64).reshape(-1)
    if bucket and unit_lengths is not None and sample.size:
        # longest first; ties keep index order (stable), so the result is deterministic
        sample = sample[np.argsort(-np.asarray(unit_lengths)[sample], kind="stable")]
    bins = pack_units(np.asarray(unit_rows)[sample], int(physical_batch_size))
    n_bins = int(bins[-1]) + 1 if bins.size else 0
    steps = max(int(min_micro_steps), -(-n_bins // int(world_size)))
    bounds = np.searchsorted(bins, np.arange(n_bins + 1))
    empty = np.empty(0, np.int64)
    out: list[list[np.ndarray]] = [[empty] * steps for _ in range(int(world_size))]
    for j in range(n_bins):
        out[j % world_size][j // world_size] = sample[bounds[j] : bounds[j + 1]]
    return out
