"""Sampling of privacy units: exactly the sampling the accountant assumes (DESIGN §3.3).

- `poisson`: Poisson and truncated-Poisson samplers from a ChaCha20 keystream, exact coins
  (`make_sampler`);
- `cyclic`: the correlated mechanisms' samplers (units in `cycle` groups by a keyed hash of
  their content; cyclic Poisson, fixed cycle);
- `reference`: the per-unit reference sampler the tests compare with;
- `_dyadic`: the exact arithmetic behind the coins.

Names are looked up in their modules on first use: importing this package loads nothing.
"""

from __future__ import annotations

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "poisson": ("make_sampler",),
    "cyclic": ("CyclicPoissonSampler", "FixedCycleSampler", "store_groups"),
}
_HOMES = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(name for name in _HOMES if not name.startswith("_"))


def __getattr__(name: str):
    # Looked up in the defining module at every access, never cached here: a test that
    # patches that module's attribute is seen by every caller that reaches it through here.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
