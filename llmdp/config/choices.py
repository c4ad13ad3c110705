"""The closed choice lists of llmdp, each spelled out exactly once.

The privacy plan's choices are ``str`` enums (`Choice`): `Accountant`, `Sampler`,
`Mechanism`, `Relation`. Config validation (`llmdp.config.schema`: a field typed with one
of them accepts exactly its values, and its error lists them), the privacy plan and
accountant, the ledgers, the report and the command line all take their choices from
here, so a new choice is one new member. A member *is* its string (``Sampler.POISSON ==
"poisson"``, the same hash, ``str()``, ``format()`` and ``repr()`` as ``'poisson'``, and
``json.dumps`` writes ``"poisson"``), so recipes, plan.json, ledger records and reports
hold exactly the strings they always held, and a string read back from any of them
compares equal to its member. (YAML is written from `llmdp.config.yamlio.to_dict`, which
turns a member into its plain string.)

The other closed lists (parallel strategies, precision) are tuples; the rules of which
mechanism goes with which sampler (`mechanism_problem`) are here too, read by the recipe
checks and by the correlated mechanisms' plan alike.
This module imports nothing from llmdp, so anything may import it (it is in ``config``,
layer 1, the lowest layer that reads these choices: the recipe).
"""

from __future__ import annotations

import enum

__all__ = ["Accountant", "CORRELATED_MECHANISMS", "CYCLIC_SAMPLERS", "Choice", "Mechanism",
           "MIXED_PRECISION", "Relation", "Sampler", "STRATEGIES", "mechanism_problem"]


class Choice(str, enum.Enum):
    """A closed choice that is its own string: equal to it, hashed, printed, formatted and
    repr'd as it (so every message that showed ``'pld'`` still does), and JSON-encoded as
    it. ``Choice`` subclasses list their values in order (``tuple(Accountant)``)."""

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def choices(cls) -> tuple:
        """Every member, in declaration order (their repr is ``('pld', 'rdp')``)."""
        return tuple(cls)

    @classmethod
    def get(cls, value):
        """The member equal to ``value`` (a member or its string), or None."""
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        return None


class Accountant(Choice):
    """privacy.accountant: dp-accounting's PLD or RDP accountant."""

    PLD = "pld"
    RDP = "rdp"


class Sampler(Choice):
    """privacy.sampler: exact Poisson sampling, or Poisson capped at max_batch_size units
    (DP-SGD); the cyclic samplers of the correlated mechanisms: units in `privacy.cycle`
    fixed groups, step t draws from group t mod cycle only (Poisson within it, or all of it)."""

    POISSON = "poisson"
    TRUNCATED_POISSON = "truncated-poisson"
    CYCLIC_POISSON = "cyclic-poisson"
    FIXED_CYCLE = "fixed-cycle"

    @property
    def cyclic(self) -> bool:
        """Whether this is a correlated mechanism's cyclic sampler."""
        return self in (Sampler.CYCLIC_POISSON, Sampler.FIXED_CYCLE)


class Mechanism(Choice):
    """privacy.mechanism: independent noise per step, or correlated noise by matrix
    factorization (`llmdp.privacy.mf`)."""

    DP_SGD = "dp-sgd"
    BANDED_MF = "banded-mf"
    BLT = "blt"

    @property
    def correlated(self) -> bool:
        """Whether the noise is correlated across steps (banded MF, BLT)."""
        return self is not Mechanism.DP_SGD

    @property
    def default_sampler(self) -> Sampler:
        """The sampler of this mechanism when none is named (`llmdp privacy epsilon`): Poisson
        (DP-SGD), cyclic Poisson (banded MF, amplified), a fixed cycle (BLT)."""
        return {Mechanism.DP_SGD: Sampler.POISSON, Mechanism.BANDED_MF: Sampler.CYCLIC_POISSON,
                Mechanism.BLT: Sampler.FIXED_CYCLE}[self]


class Relation(Choice):
    """The neighbouring relation every guarantee is accounted under."""

    ADD_OR_REMOVE_ONE = "add_or_remove_one"


CYCLIC_SAMPLERS = tuple(s for s in Sampler if s.cyclic)
CORRELATED_MECHANISMS = tuple(m for m in Mechanism if m.correlated)
# scaling.strategy: a whole model per worker, or FSDP shards.
STRATEGIES = ("replicated", "fsdp")
# scaling.mixed_precision: the model's dtype, or bf16 autocast over float32 weights.
MIXED_PRECISION = ("none", "bf16")


def mechanism_problem(mechanism: str, sampler: str, *, bands=None, cycle=None,
                      dp: bool = True) -> tuple[str, str] | None:
    """Why no analysis here covers this (mechanism, sampler, bands, cycle), as (message, the
    field under ``privacy`` to change), or None. Raised as ``privacy.mf.MechanismError`` by the
    plan and as a ``ConfigError`` by the recipe checks (DESIGN, invariant `sampling-as-accounted`)."""
    mechanism, sampler = Mechanism.get(mechanism) or mechanism, Sampler.get(sampler) or sampler
    if not isinstance(mechanism, Mechanism):
        return (f"{mechanism!r} is not one of {Mechanism.choices()}", "mechanism")
    if mechanism is Mechanism.DP_SGD:
        if sampler in CYCLIC_SAMPLERS:
            return (
                f"sampler {sampler!r} is for the correlated mechanisms ({', '.join(CORRELATED_MECHANISMS)}); DP-SGD "
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
    if mechanism is Mechanism.BLT and sampler is Sampler.CYCLIC_POISSON:
        return (
            "'cyclic-poisson' with mechanism 'blt': amplification by sampling is proven here for "
            "banded strategies only (BLT's columns are not banded, so a unit's participations "
            "share rows); set sampler: fixed-cycle (BLT without amplification) or mechanism: "
            "banded-mf", "sampler")
    if mechanism is Mechanism.BANDED_MF and bands is None and dp:
        return ("required with mechanism 'banded-mf': the number of bands b of C "
                "(1 is DP-SGD; 2-64 typical)", "bands")
    if mechanism is Mechanism.BLT and bands is not None:
        return (f"{bands!r} is only used by mechanism 'banded-mf' (mechanism is "
                "'blt': set privacy.buffers instead); remove bands", "bands")
    if sampler is Sampler.CYCLIC_POISSON and cycle is not None and bands is not None and bands > cycle:
        return (
            f"bands {bands} is more than cycle {cycle} with sampler 'cyclic-poisson': the amplified "
            "analysis needs b <= cycle (a unit's participations then touch disjoint rows of C·G); "
            "lower bands or raise cycle", "bands")
    return None
