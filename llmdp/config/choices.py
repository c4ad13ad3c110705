"""The closed choice lists of llmdp, each spelled out exactly once.

Config validation (`llmdp.config.schema`), the privacy plan and accountant, and the parallel
strategies all import their choices from here, so a new choice is added in one place.
This module imports nothing from llmdp, so anything may import it.
"""

from __future__ import annotations

__all__ = ["ACCOUNTANTS", "CYCLIC_SAMPLERS", "MECHANISMS", "MIXED_PRECISION", "RELATIONS", "SAMPLERS",
           "STRATEGIES"]

# privacy.accountant: dp-accounting's PLD or RDP accountant.
ACCOUNTANTS = ("pld", "rdp")
# privacy.sampler: exact Poisson sampling, or Poisson capped at max_batch_size units (DP-SGD);
# the cyclic samplers of the correlated mechanisms: units in `privacy.cycle` fixed groups,
# step t draws from group t mod cycle only (Poisson within it, or all of it).
CYCLIC_SAMPLERS = ("cyclic-poisson", "fixed-cycle")
SAMPLERS = ("poisson", "truncated-poisson") + CYCLIC_SAMPLERS
# privacy.mechanism: independent noise per step, or correlated noise by matrix factorization.
MECHANISMS = ("dp-sgd", "banded-mf", "blt")
# The neighbouring relation every guarantee is stated for.
RELATIONS = ("add_or_remove_one",)
# scaling.strategy: a whole model per worker, or FSDP shards.
STRATEGIES = ("replicated", "fsdp")
# scaling.mixed_precision: the model's dtype, or bf16 autocast over float32 weights.
MIXED_PRECISION = ("none", "bf16")
