"""Held-out units for evaluation (``data.eval``): which units of a corpus are held out.

Unit u is held out iff a keyed hash of its own content is below the fraction (see
:class:`Holdout`): the split depends on each unit alone, like ``data.unit_fraction``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from llmdp.data.units import UnitArrays, _unit_content, select_units

__all__ = ["Holdout", "split_hash", "split_units"]


@dataclass(frozen=True)
class Holdout:
    """Units held out for evaluation (``data.eval.fraction``): unit u is held out iff
    ``split_hash(its content, key) < fraction``. Its content alone decides (a user unit's
    rows are a function of that user's records only), so the split is the same at every
    launch, disjoint by construction, and adding or removing a unit never moves another.
    ``max_units``: the evaluation set is the held-out units with the smallest hashes, at
    most that many (each unit's place still depends on its own content only)."""

    fraction: float
    key: str = "llmdp.eval_split.v1"
    max_units: int | None = None

    def to_dict(self) -> dict:
        return {"fraction": self.fraction, "key": self.key, "max_units": self.max_units}


def split_hash(content: bytes, key: str) -> float:
    """A keyed hash of a unit's content, uniform in [0, 1); the key: ``data.eval.split_key``
    (public), domain-separated from the unit-selection hash."""
    k = hashlib.sha256(b"llmdp.eval_split:" + key.encode("utf-8")).digest()
    h = hashlib.blake2b(content, key=k, digest_size=8)
    return int.from_bytes(h.digest(), "big") / 2.0**64


def split_units(units: UnitArrays, holdout: Holdout) -> tuple[UnitArrays, UnitArrays]:
    """(training units, evaluation units) of ``units`` (see :class:`Holdout`). Held-out
    units beyond ``max_units`` are not evaluated and stay out of training: the training
    set depends on the fraction and the key only."""
    h = np.fromiter((split_hash(_unit_content(units, u), holdout.key) for u in range(units.num_units)),
                    dtype=np.float64, count=units.num_units)
    held = h < holdout.fraction
    train_idx = np.flatnonzero(~held)
    eval_idx = np.flatnonzero(held)
    eval_idx = eval_idx[np.argsort(h[eval_idx], kind="stable")]
    if holdout.max_units is not None:
        eval_idx = eval_idx[: holdout.max_units]
    train, ev = select_units(units, train_idx), select_units(units, eval_idx)
    for part in (train, ev):
        part.counts = {**units.counts, "num_units": part.num_units, "num_rows": part.num_rows,
                       "num_tokens": int(part.tokens.size),
                       "num_target_tokens": int(part.unit_target_tokens().sum()),
                       "units_held_out": int(held.sum()), "units_training": int(train_idx.size),
                       "units_evaluated": int(eval_idx.size)}
    return train, ev
