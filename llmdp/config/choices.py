"""The closed choice lists of llmdp, each spelled out exactly once.

Config validation (`llmdp.config.schema`), the privacy plan and accountant, and the parallel
strategies all import their choices from here, so a new choice is added in one place; so do
the rules of which mechanism goes with which sampler (`mechanism_problem`), read by the recipe
checks and by the correlated mechanisms' plan alike.
This module imports nothing from llmdp, so anything may import it.
"""

from __future__ import annotations

__all__ = ["ACCOUNTANTS", "CYCLIC_SAMPLERS", "MECHANISMS", "MIXED_PRECISION", "RELATIONS", "SAMPLERS",
           "STRATEGIES", "mechanism_problem"]

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


def mechanism_problem(mechanism: str, sampler: str, *, bands=None, cycle=None,
                      dp: bool = True) -> tuple[str, str] | None:
    """Why no analysis here covers this (mechanism, sampler, bands, cycle), as (message, the
    field under ``privacy`` to change), or None. Raised as ``privacy.mf.MechanismError`` by the
    plan and as a ``ConfigError`` by the recipe checks (DESIGN, invariant `sampling-as-accounted`)."""
    if mechanism not in MECHANISMS:
        return (f"{mechanism!r} is not one of {MECHANISMS}", "mechanism")
    if mechanism == "dp-sgd":
        if sampler in CYCLIC_SAMPLERS:
            return (
                f"sampler {sampler!r} is for the correlated mechanisms (banded-mf, blt); DP-SGD "
                "is accounted for Poisson sampling: set sampler: poisson (or truncated-poisson), "
                "or mechanism: banded-mf", "sampler")
        for name, v in (("bands", bands), ("cycle", cycle)):
            if v is not None:
                return (f"{v!r} is only used by the correlated mechanisms (mechanism is "
                        f"'dp-sgd'); remove {name} or set mechanism: banded-mf", name)
        return None
    if sampler not in CYCLIC_SAMPLERS:
        return (
            f"{sampler!r} with mechanism {mechanism!r}: a correlated mechanism's analysis needs "
            f"a unit's steps at least b apart (you cannot plug in plain Poisson sampling: a unit "
            f"could be drawn at neighbouring steps, whose noise is correlated). Set sampler: "
            f"cyclic-poisson (banded-mf, amplified) or fixed-cycle", "sampler")
    if mechanism == "blt" and sampler == "cyclic-poisson":
        return (
            "'cyclic-poisson' with mechanism 'blt': amplification by sampling is proven here for "
            "banded strategies only (BLT's columns are not banded, so a unit's participations "
            "share rows); set sampler: fixed-cycle (BLT without amplification) or mechanism: "
            "banded-mf", "sampler")
    if mechanism == "banded-mf" and bands is None and dp:
        return ("required with mechanism 'banded-mf': the number of bands b of C "
                "(1 is DP-SGD; 2-64 typical)", "bands")
    if mechanism == "blt" and bands is not None:
        return (f"{bands!r} is only used by mechanism 'banded-mf' (mechanism is "
                "'blt': set privacy.buffers instead); remove bands", "bands")
    if sampler == "cyclic-poisson" and cycle is not None and bands is not None and bands > cycle:
        return (
            f"bands {bands} is more than cycle {cycle} with sampler 'cyclic-poisson': the amplified "
            "analysis needs b <= cycle (a unit's participations then touch disjoint rows of C·G); "
            "lower bands or raise cycle", "bands")
    return None
