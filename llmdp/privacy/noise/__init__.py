"""Gaussian noise: the one place it is drawn, and what its truncated tails cost.

- `gaussian`: noise drawn from the ChaCha20 keystream (`llmdp.privacy.rng`) in place,
  chunked and seekable (an FSDP shard draws exactly its slice), Box-Muller in float64;
- `tail`: the δ the generator's truncated tails add per release (η), folded into the
  published δ.

Names are looked up in their modules on first use: importing this package loads nothing.
"""

from __future__ import annotations

from llmdp.privacy import entry_point

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "gaussian": ("NOISE_METHOD", "_check_std", "add_gaussian_", "add_noise_", "keyed_normal"),
    "tail": ("MAX_TAIL_FRACTION", "NOISE_TAIL", "NoiseTail", "noise_tail",
             "truncation_delta_per_step"),
}
__all__, __getattr__, __dir__, _HOMES = entry_point(__name__, _NAMES)
