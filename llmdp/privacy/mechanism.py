"""The mechanism-specific inputs of a DP plan: one frozen config per `Mechanism`.

`make_plan` takes the inputs every mechanism shares (N, B, C, T, δ, the target or σ, the
accountant, the sampler) as its own arguments, and the rest as one of these:

- `DpSgd`: independent noise each step; nothing beyond the shared inputs;
- `BandedMf`: banded matrix factorization, C with ``bands`` diagonals;
- `Blt`: buffered linear Toeplitz, at most ``buffers`` buffers.

The correlated two also carry ``cycle`` (the cyclic sampler's groups; None: its default,
`llmdp.privacy.mf.plan.resolve_cycle`), the workload their strategy is optimized for
(``momentum``, ``learning_rates``: the per-step multipliers, or a function of T that gives
them) and the strategy cache. Each field is written here once: `mechanism_config` reads
the fields a config declares, by name, from the recipe's ``privacy`` section or the command
line's flags, and the config builds its part of the plan (its sampler checked, its cycle,
its strategy; `llmdp.privacy.mf.plan` holds the analyses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from llmdp.config.choices import Mechanism, Sampler
from llmdp.privacy.accounting import PlanError

__all__ = ["BandedMf", "Blt", "CONFIGS", "DpSgd", "MechanismConfig", "check_config",
           "mechanism_config"]


@dataclass(frozen=True, kw_only=True)
class DpSgd:
    """DP-SGD: N(0, σ²C²) added to each step's clipped sum, independently (Poisson or
    truncated-Poisson sampling)."""

    mechanism: ClassVar[Mechanism] = Mechanism.DP_SGD
    bands: ClassVar[None] = None  # what the sampler rules read (`mechanism_problem`)
    cycle: ClassVar[None] = None


@dataclass(frozen=True, kw_only=True)
class _Correlated:
    """What both correlated mechanisms take: their cyclic sampler's groups, the workload
    their strategy is optimized for, and where optimized strategies are cached."""

    mechanism: ClassVar[Mechanism]
    bands: ClassVar[int | None] = None
    cycle: int | None = None  # None: cyclic-poisson's bands, fixed-cycle's round(N / B)
    momentum: float = 0.0
    learning_rates: Any = None  # per-step multipliers, a function T -> them, or None
    strategy_cache: str | None = None

    def resolve(self, sampler, *, dp: bool, dataset_size: int,
                expected_batch_size: float) -> tuple[int, float]:
        """(cycle, expected batch size) of the cyclic sampler: the combination checked
        before and after the cycle is resolved, a fixed cycle's batch N / cycle."""
        from llmdp.privacy import mf as _mf

        _mf.check_mechanism(self.mechanism, sampler, bands=self.bands, cycle=self.cycle, dp=dp)
        cyc = _mf.resolve_cycle(sampler, bands=self.bands, cycle=self.cycle,
                                dataset_size=int(dataset_size),
                                expected_batch_size=expected_batch_size)
        _mf.check_mechanism(self.mechanism, sampler, bands=self.bands, cycle=cyc, dp=dp)
        batch = int(dataset_size) / cyc if sampler == Sampler.FIXED_CYCLE else float(expected_batch_size)
        return cyc, batch

    def strategy(self, sampler, *, steps: int, cycle: int):
        """The optimized strategy C for ``steps`` steps (`llmdp.privacy.mf.plan.build_strategy`:
        scaled so that the sensitivity its sampler's analysis uses is 1)."""
        from llmdp.privacy import mf as _mf

        rates = self.learning_rates(steps) if callable(self.learning_rates) else self.learning_rates
        return _mf.build_strategy(self.mechanism, sampler, steps=steps, cycle=cycle,
                                  **self._size(), momentum=self.momentum,
                                  learning_rates=rates, cache_dir=self.strategy_cache)

    def _size(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class BandedMf(_Correlated):
    """Banded MF: C with ``bands`` diagonals (sampler cyclic-poisson, amplified, with
    bands <= cycle; or fixed-cycle)."""

    mechanism: ClassVar[Mechanism] = Mechanism.BANDED_MF
    bands: int | None = None  # required with DP (the sampler rules say so, naming the field)

    def _size(self) -> dict:
        return {"bands": self.bands}


@dataclass(frozen=True, kw_only=True)
class Blt(_Correlated):
    """BLT: buffered linear Toeplitz C with at most ``buffers`` buffers (sampler fixed-cycle)."""

    mechanism: ClassVar[Mechanism] = Mechanism.BLT
    buffers: int = 8

    def _size(self) -> dict:
        return {"buffers": self.buffers}


MechanismConfig = DpSgd | BandedMf | Blt
# Each Mechanism's config (tests/privacy/test_mechanism.py: every Mechanism has one).
CONFIGS: dict[Mechanism, type] = {c.mechanism: c for c in (DpSgd, BandedMf, Blt)}


def mechanism_config(mechanism, settings: Any = None, **given) -> MechanismConfig:
    """The config of ``mechanism`` (a `Mechanism` or its string): each of its fields from
    ``given`` if there, else the attribute of that name of ``settings`` (the recipe's
    ``privacy`` section, the command line's flags) if it has one, else its default. Names in
    ``given`` that the config does not declare (a workload for DP-SGD) are not its inputs."""
    kind = Mechanism.get(mechanism)
    if kind is None:
        raise PlanError(f"privacy.mechanism must be one of {Mechanism.choices()}, got "
                        f"mechanism={mechanism!r}")
    cls = CONFIGS[kind]
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kw[f.name] = given[f.name]
        elif settings is not None and hasattr(settings, f.name):
            kw[f.name] = getattr(settings, f.name)
    return cls(**kw)


def check_config(config) -> MechanismConfig:
    """``config`` if it is a mechanism config, else a `PlanError` naming the fix."""
    if not isinstance(config, tuple(CONFIGS.values())):
        raise PlanError(f"mechanism must be a mechanism config (DpSgd(), BandedMf(bands=...), "
                        f"Blt(...): llmdp.privacy.mechanism), got mechanism={config!r}")
    return config
