"""Choosing a correlated-noise strategy: `strategy_for`, the cached front door to the
banded-MF and BLT optimizers (their objective and the RMSE figure of merit: `workload`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from llmdp._fs import atomic_write
from llmdp.config.choices import CORRELATED_MECHANISMS, Mechanism
from llmdp.privacy.mf.factorization import Factorization
from llmdp.privacy.mf.workload import ERRORS, Workload

__all__ = ["strategy_for"]

# bump a mechanism's format when its optimizer's result for the same inputs changes (a
# cached strategy of an older optimizer is then not reused). blt 2: near-1 starts (mf_blt)
_CACHE_FORMAT = {Mechanism.BANDED_MF: 1, Mechanism.BLT: 2}


# ---- the front door, cached
def _cache_inputs(mechanism, n, bands, min_sep, max_participations, max_buffers, momentum,
                  learning_rates, error) -> dict:
    return {"format": _CACHE_FORMAT[mechanism], "mechanism": mechanism, "n": n, "bands": bands,
            "min_sep": min_sep, "max_participations": max_participations,
            "max_buffers": max_buffers, "workload": "prefix", "momentum": momentum,
            "learning_rates": None if learning_rates is None else list(learning_rates),
            "error": error}


def _read_cache(path: Path, inputs: dict) -> Factorization | None:
    """The cached strategy, or None when the file is missing, unreadable, or not for
    exactly these inputs."""
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(blob, dict) or blob.get("inputs") != inputs:
            return None
        return Factorization.from_dict(blob["factorization"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _write_cache(path: Path, inputs: dict, fact: Factorization) -> None:
    """Atomically (`llmdp._fs.atomic_write`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = json.dumps({"inputs": inputs, "factorization": fact.to_dict()}, sort_keys=True)
    atomic_write(path, lambda f: f.write(blob), text=True)


def strategy_for(mechanism: str, n: int, *, bands: int | None = None,
                 min_sep: int | None = None, max_participations: int | None = None,
                 max_buffers: int = 8, momentum: float = 0.0, learning_rates=None,
                 cache_dir: str | os.PathLike | None = None,
                 error: str = "mean") -> Factorization:
    """The optimized strategy for ``mechanism`` ("banded-mf": `banded.optimize_banded`
    with ``bands``; "blt": `blt.optimize_blt` with up to ``max_buffers`` buffers) over n
    steps, for Poisson sampling (``min_sep`` None: sensitivity = largest column norm) or
    (k, b)-min-sep participation, on the SGD workload (``momentum``, ``learning_rates``).

    With ``cache_dir``, the result is stored as ``<sha256 of the inputs>.json`` there and a
    later call with the same inputs returns it (``meta["cached"]`` True, ``meta["seconds"]``
    the original optimization's wall time); a file that does not parse or holds other
    inputs is ignored and rewritten."""
    if mechanism not in CORRELATED_MECHANISMS:
        raise ValueError(f"mechanism must be one of {CORRELATED_MECHANISMS}, got {mechanism!r}")
    if error not in ERRORS:
        raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
    n = int(n)
    if mechanism == Mechanism.BANDED_MF:
        if bands is None:
            raise ValueError("banded-mf needs bands (1 <= bands <= n)")
        bands, max_buffers = int(bands), None
    else:
        if bands is not None:
            raise ValueError("bands is for banded-mf; a BLT's size is max_buffers")
        max_buffers = int(max_buffers)
    min_sep = None if min_sep is None else int(min_sep)
    max_participations = None if max_participations is None else int(max_participations)
    W = Workload.build(n, "prefix", momentum, learning_rates)
    inputs = _cache_inputs(mechanism, n, bands, min_sep, max_participations, max_buffers,
                           W.momentum, W.learning_rates, error)
    path = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode("utf-8")).hexdigest()
        path = Path(cache_dir) / f"{key}.json"
        hit = _read_cache(path, inputs)
        if hit is not None:
            return dataclasses.replace(hit, meta={**hit.meta, "cached": True})
    if mechanism == Mechanism.BANDED_MF:
        from llmdp.privacy.mf.banded import optimize_banded

        fact = optimize_banded(n, bands, momentum=W.momentum, learning_rates=W.learning_rates,
                               min_sep=min_sep, max_participations=max_participations,
                               error=error)
    else:
        from llmdp.privacy.mf.blt import optimize_blt

        if min_sep is None:  # Poisson sampling: one participation per release
            if max_participations not in (None, 1):
                raise ValueError("max_participations needs min_sep")
            min_sep, max_participations = 1, 1
        fact = optimize_blt(n, max_buffers=max_buffers, min_sep=min_sep,
                            max_participations=max_participations, momentum=W.momentum,
                            learning_rates=W.learning_rates, error=error)
    fact = dataclasses.replace(fact, meta={**fact.meta, "cached": False})
    if path is not None:
        _write_cache(path, inputs, fact)
    return fact
