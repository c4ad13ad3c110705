"""Sampling of privacy units: exactly the sampling the accountant assumes (DESIGN, invariant `sampling-as-accounted`).

- `poisson`: Poisson and truncated-Poisson samplers from a ChaCha20 keystream, exact coins
  (`make_sampler`);
- `cyclic`: the correlated mechanisms' samplers (units in `cycle` groups by a keyed hash of
  their content; cyclic Poisson, fixed cycle);
- `reference`: the per-unit reference sampler the tests compare with;
- `_dyadic`: the exact arithmetic behind the coins.

Names are looked up in their modules on first use: importing this package loads nothing.
"""

from __future__ import annotations

from llmdp.privacy import entry_point

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "poisson": ("make_sampler",),
    "cyclic": ("CyclicPoissonSampler", "FixedCycleSampler", "store_groups"),
}
__all__, __getattr__, __dir__, _HOMES = entry_point(__name__, _NAMES)
