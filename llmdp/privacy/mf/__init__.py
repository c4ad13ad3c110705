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

from llmdp.privacy import entry_point

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "factorization": ("Factorization",),
    "plan": ("MechanismError", "build_strategy", "check_mechanism", "mf_commitment",
             "participation_text", "resolve_cycle", "round_factor", "scaled_sensitivity"),
    "stream": ("CorrelatedNoise",),
}
__all__, __getattr__, __dir__, _HOMES = entry_point(__name__, _NAMES)
