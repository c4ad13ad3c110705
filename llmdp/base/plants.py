"""Planted bugs: a test-only switch that breaks the mechanism on purpose, so that the
auditor's tests can show that they *detect* a broken mechanism (issue 19).

The switch is the environment variable ``LLMDP_TEST_PLANT`` and nothing else: no recipe
field, no command-line flag and no RunSpec field sets it, so a recipe can never turn a bug
on. A run that starts with a plant active says so in ``plan.json`` (``"planted"``), its
privacy report's first line is a warning that it carries no guarantee, and ``llmdp export``
refuses it.

The plants, each at the one place the real mechanism does that thing:

    clip-scale        every clipping factor × 1.01 (``clipping/engine.py``): a unit adds
                      up to 1.01·C
    bf16-sum          each clipped sum rounded to bfloat16 before the reduction
                      (``privatize.privatize_`` / ``privatize_sharded_``)
    extra-micro-step  one more (padding) micro-step when this worker's share holds an odd
                      number of target tokens (``step.accumulate_clipped_sum``): control
                      flow that depends on the data
    noise-off         no noise is added (``privatize.privatize_`` / ``privatize_sharded_``)
    clip-off          every finite unit's factor is 1 (``clipping/engine.py``): nothing is
                      clipped
    fixed-batches     the sampler is replaced by fixed batches: one permutation drawn from
                      a fixed seed, cut into batches of round(q·N) units, taken in turn,
                      accounted as if Poisson (``privacy/sampling.make_sampler``)
"""

from __future__ import annotations

import os

import numpy as np

ENV = "LLMDP_TEST_PLANT"
PLANTS = ("clip-scale", "bf16-sum", "extra-micro-step", "noise-off", "clip-off", "fixed-batches")

__all__ = ["ENV", "PLANTS", "FixedBatches", "active", "on"]


def active() -> str | None:
    """The plant switched on in this process, or None. An unknown name is an error (a typo
    must not silently test the unbroken mechanism)."""
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    if name not in PLANTS:
        raise ValueError(f"{ENV}={name!r} is not one of {list(PLANTS)}")
    return name


def on(name: str) -> bool:
    """Whether plant ``name`` is switched on (cheap: one environment lookup)."""
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}; one of {list(PLANTS)}")
    return active() == name


class FixedBatches:
    """The ``fixed-batches`` plant: the sampler interface (``sample``, ``sample_with_info``)
    over fixed batches. One permutation of the N units from a fixed seed, cut into batches
    of round(q·N) units; call k returns batch k mod (number of batches), whatever the key.
    Every unit is in exactly one batch per pass: no amplification by sampling."""

    def __init__(self, num_units: int, q: float, seed: int = 0):
        self.num_units = int(num_units)
        self.batch = max(1, int(round(q * self.num_units)))
        self._order = np.random.default_rng(seed).permutation(self.num_units).astype(np.int64)
        self._batches = max(1, self.num_units // self.batch)
        self._calls = 0

    def sample_with_info(self, key: bytes) -> tuple[np.ndarray, bool]:
        k = self._calls % self._batches
        self._calls += 1
        return np.sort(self._order[k * self.batch : (k + 1) * self.batch]), False

    def sample(self, key: bytes) -> np.ndarray:
        return self.sample_with_info(key)[0]
