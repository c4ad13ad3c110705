"""Correlated noise by matrix factorization (DP-FTRL): banded MF and BLT.

- `factorization`: `Factorization`, the Toeplitz strategy C (banded coefficients or BLT
  buffers; scale, digest);
- `sensitivity`: column norms, min-separation sensitivity;
- `workload`: the objective (the SGD workload, ‖A·C⁻¹‖_F², the RMSE figure of merit);
- `banded`, `blt`: the two optimizers; `optimize`: their cached front door;
- `plan`: the correlated mechanisms' part of a DP plan (samplers covered, the round event,
  the commitment the ledger records);
- `stream`: the streaming noise, row t of (scale·C)⁻¹Z, from O(state) memory.

Names are looked up in their modules on first use: importing this package loads nothing.
"""

from __future__ import annotations

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "factorization": ("Factorization",),
    "plan": ("MechanismError", "build_strategy", "check_mechanism", "mf_commitment",
             "participation_text", "resolve_cycle", "round_factor", "scaled_sensitivity"),
    "stream": ("CorrelatedNoise",),
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
