"""Gaussian noise: the one place it is drawn, and what its truncated tails cost.

- `gaussian`: noise drawn from the ChaCha20 keystream (`llmdp.privacy.rng`) in place,
  chunked and seekable (an FSDP shard draws exactly its slice), Box-Muller in float64;
- `tail`: the δ the generator's truncated tails add per release (η), folded into the
  published δ.

Names are looked up in their modules on first use: importing this package loads nothing.
"""

from __future__ import annotations

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "gaussian": ("NOISE_METHOD", "_check_std", "add_gaussian_", "add_noise_", "keyed_normal"),
    "tail": ("MAX_TAIL_FRACTION", "NOISE_TAIL", "NoiseTail", "noise_tail",
             "truncation_delta_per_step"),
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
