"""The grid of a sweep (`llmdp sweep`): ``key=v1,v2,...`` entries, their trials, the draw of
a random search.

An entry comes from the recipe (``sweep.grid[i]``) or the command line (``--grid``); a
command-line entry for a key replaces the recipe's entry for that key, others are added.
Each value is read as YAML exactly like a ``key=value`` override
(`llmdp.config.yamlio.parse_override`), and a trial's values are handed to the recipe loader
as such overrides, so a swept value means what it would mean on `llmdp train`'s command line.

Random search (Papernot & Steinke, ICLR 2022, "Hyperparameter tuning with Renyi differential
privacy"): the number of trials K is drawn from a Poisson distribution of mean μ (K = 0 is
possible: then nothing runs and nothing is selected) or from a geometric one of mean μ
(support 1, 2, ...; P(K = k) = γ(1-γ)^(k-1), γ = 1/μ: the truncated negative binomial of
shape 1), exactly the distributions of dp-accounting's ``RepeatAndSelectDpEvent(event, μ,
shape)`` with shape = inf and shape = 1 (`_gamma_truncated_negative_binomial`: γ = 1/μ for
shape 1). Each trial is a uniformly random grid point. The draw uses fresh OS entropy
(`random.SystemRandom`, i.e. ``os.urandom``); tests inject a seeded ``random.Random``.
"""

from __future__ import annotations

import itertools
import json
import math
import random as _random
from dataclasses import dataclass

from llmdp.config.schema import RecipeConfig
from llmdp.config.validate import ConfigError
from llmdp.config.yamlio import apply_overrides, parse_override

__all__ = ["GridAxis", "SweepSpec", "SHAPES", "parse_grid_entry", "resolve_sweep", "expand_grid",
           "draw_random_trials"]

# dp-accounting's RepeatAndSelectDpEvent shape of each distribution of K.
SHAPES = {"poisson": math.inf, "geometric": 1.0}
# Keys a trial may not change: they name the sweep's own runs and its grid.
_FIXED_PREFIXES = ("output", "sweep")
_EXAMPLE = "e.g. --grid optim.lr=1e-3,3e-3"


@dataclass(frozen=True)
class GridAxis:
    """One swept key: its values as written (``raw``, handed to the loader as overrides) and
    as read (``values``, YAML); ``where`` names the entry in messages."""

    key: str
    raw: tuple[str, ...]
    values: tuple
    where: str

    def overrides(self) -> list[str]:
        return [f"{self.key}={r}" for r in self.raw]


def _split_values(text: str) -> list[str]:
    """Split at the commas outside brackets and quotes: ``1,[2,3],'a,b'`` -> 3 values."""
    out, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur))
    return [v.strip() for v in out]


def parse_grid_entry(text, where: str) -> GridAxis:
    """``"optim.lr=1e-3,3e-3"`` -> a `GridAxis`; a bad entry is a `ConfigError` naming
    ``where`` (``--grid '...'`` or ``sweep.grid[i]``)."""
    if not isinstance(text, str):
        raise ConfigError(f"{where}: {text!r} is not key=v1,v2,... ({_EXAMPLE})", key="sweep.grid")
    key, eq, values = text.partition("=")
    key = key.strip()
    if not eq or not key or not values.strip():
        raise ConfigError(f"{where}: {text!r} is not key=v1,v2,... ({_EXAMPLE})", key="sweep.grid")
    if key.split(".")[0] in _FIXED_PREFIXES:
        raise ConfigError(
            f"{where}: {key!r} cannot be swept: output.* names the sweep's own runs "
            f"(<output.name>-trial-<i>) and sweep.* is the grid itself", key=key)
    raw = _split_values(values)
    if any(not r for r in raw):
        raise ConfigError(f"{where}: {text!r} has an empty value (a stray comma?); "
                          f"list the values as key=v1,v2,...", key=key)
    parsed = []
    for r in raw:
        try:
            _, value = parse_override(f"{key}={r}")
            # The key against the recipe's schema (the loader checks the value later).
            apply_overrides({}, [f"{key}={r}"], RecipeConfig)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}", key=e.key or key) from None
        parsed.append(value)
    seen = [json.dumps(v, sort_keys=True, default=str) for v in parsed]
    dup = next((raw[i] for i in range(len(seen)) if seen[i] in seen[:i]), None)
    if dup is not None:
        raise ConfigError(f"{where}: the value {dup!r} of {key} is listed twice; list each "
                          f"value once", key=key)
    return GridAxis(key=key, raw=tuple(raw), values=tuple(parsed), where=where)


@dataclass(frozen=True)
class SweepSpec:
    """What `llmdp sweep` runs: the grid, and grid or random trials."""

    axes: tuple[GridAxis, ...]
    trials: str  # "grid" | "random"
    mean_trials: float | None
    distribution: str  # "poisson" | "geometric" (random)

    @property
    def shape(self) -> float:
        return SHAPES[self.distribution]

    def points(self) -> list[tuple[str, ...]]:
        """Every grid point (the cartesian product, first axis slowest), as overrides."""
        return [tuple(p) for p in itertools.product(*(a.overrides() for a in self.axes))]

    def to_dict(self) -> dict:
        return {"grid": [{"key": a.key, "values": list(a.raw)} for a in self.axes],
                "trials": self.trials, "mean_trials": self.mean_trials,
                "distribution": self.distribution if self.trials == "random" else None}


def resolve_sweep(section=None, grid=(), trials: str | None = None,
                  mean_trials: float | None = None, distribution: str | None = None) -> SweepSpec:
    """The recipe's ``sweep`` section (a `llmdp.config.schema.SweepConfig` or None) with the
    command line's ``--grid`` entries (a key given there replaces the recipe's entry for it)
    and ``--trials`` / ``--mean-trials`` / ``--distribution`` (None: the recipe's)."""
    axes: dict[str, GridAxis] = {}
    for i, text in enumerate(section.grid if section is not None else ()):
        a = parse_grid_entry(text, f"sweep.grid[{i}]")
        if a.key in axes:
            raise ConfigError(f"sweep.grid[{i}]: {a.key!r} is already swept by "
                              f"{axes[a.key].where}; give each key one entry", key="sweep.grid")
        axes[a.key] = a
    cli: dict[str, GridAxis] = {}
    for text in grid or ():
        a = parse_grid_entry(text, f"--grid {text!r}")
        if a.key in cli:
            raise ConfigError(f"{a.where}: {a.key!r} is already swept by {cli[a.key].where}; "
                              f"give each key one --grid", key=a.key)
        cli[a.key] = a
    axes.update(cli)  # a command-line entry replaces the recipe's entry for its key
    from_flag = {"trials": trials is not None, "mean": mean_trials is not None}
    trials = trials if trials is not None else (section.trials if section is not None else "grid")
    if trials not in ("grid", "random"):
        raise ConfigError(f"--trials {trials!r}: choose grid or random", key="sweep.trials")
    mean = mean_trials if mean_trials is not None else (section.mean_trials if section is not None else None)
    dist = distribution or (section.distribution if section is not None else "poisson")
    mean_name = "--mean-trials" if from_flag["mean"] else "sweep.mean_trials"
    trials_name = "--trials" if from_flag["trials"] else "sweep.trials"
    if dist not in SHAPES:
        raise ConfigError(f"--distribution {dist!r}: choose poisson or geometric",
                          key="sweep.distribution")
    if trials == "grid":
        if mean is not None:
            raise ConfigError(f"{mean_name} {mean:g}: only used with random trials ({trials_name} "
                              f"is grid); remove it or use --trials random", key="sweep.mean_trials")
        if not axes:
            raise ConfigError("sweep: no grid to try: give --grid key=v1,v2 (or sweep.grid in the "
                              "recipe), e.g. --grid optim.lr=1e-3,3e-3", key="sweep.grid")
    else:
        if mean is None:
            raise ConfigError(f"{trials_name} random needs --mean-trials (or sweep.mean_trials): the "
                              f"expected number of trials, e.g. --mean-trials 4", key="sweep.mean_trials")
        if isinstance(mean, bool) or not (isinstance(mean, (int, float)) and math.isfinite(mean)
                                          and mean >= 1):
            raise ConfigError(f"{mean_name} {mean!r}: the expected number of trials must be a "
                              f"finite number >= 1 (Papernot-Steinke's bound, as dp-accounting "
                              f"computes it, needs a mean of at least 1)", key="sweep.mean_trials")
    return SweepSpec(axes=tuple(axes.values()), trials=trials,
                     mean_trials=None if mean is None else float(mean), distribution=dist)


def expand_grid(spec: SweepSpec) -> list[tuple[str, ...]]:
    """The grid points of ``spec`` as tuples of overrides (the cartesian product)."""
    return spec.points()


def draw_random_trials(mean: float, distribution: str, n_points: int,
                       rng: _random.Random | None = None) -> list[int]:
    """K trials' grid points (indices in [0, n_points)), K ~ Poisson(mean) (K = 0 possible)
    or geometric of that mean (K >= 1), each point uniform. ``rng`` None: OS entropy
    (`random.SystemRandom`); a seeded ``random.Random`` is for tests only."""
    if n_points < 1:
        raise ValueError(f"n_points must be >= 1, got {n_points}")
    if distribution not in SHAPES:
        raise ValueError(f"distribution must be one of {sorted(SHAPES)}, got {distribution!r}")
    mean = float(mean)
    if not (math.isfinite(mean) and mean >= 1):
        raise ValueError(f"mean must be a finite number >= 1, got {mean!r}")
    rng = rng if rng is not None else _random.SystemRandom()
    if distribution == "poisson":
        # K = the number of arrivals of a unit-rate Poisson process in [0, mean]: exact in
        # distribution (no e^-mean underflow for large means).
        k, t = 0, rng.expovariate(1.0)
        while t <= mean:
            k += 1
            t += rng.expovariate(1.0)
    else:
        # Bernoulli(1/mean) trials up to the first success: P(K = k) = γ(1-γ)^(k-1).
        k, gamma = 1, 1.0 / mean
        while rng.random() >= gamma:
            k += 1
    return [rng.randrange(n_points) for _ in range(k)]
