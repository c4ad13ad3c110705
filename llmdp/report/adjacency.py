"""The neighbouring relation a report states, true of what is published (DESIGN, invariant `published-from-dp-only`).

The report publishes N, the number of privacy units, exactly (q = B/N and δ are functions
of it). Under add-or-remove adjacency N differs between neighbours, so an exact N is a
count of private data released without noise. The statement is therefore made in a form
that is true of what is published:

- zero-out (the default): one unit replaced by a null unit that contributes nothing (a
  zero clipped gradient, nothing to any evaluation aggregate or tokenizer histogram) and
  keeps its place (its held-out split, its cyclic group), so N is the same in both
  datasets. Where each unit's participation is drawn independently of the others
  (Poisson, cyclic Poisson, a fixed cycle), the zeroed-out dataset's output has exactly the
  distribution of the dataset without that unit at the same public N, q and B, so ε is the
  number accounted under add-or-remove-one;
- truncated Poisson is accounted by dp-accounting under add-or-remove-one only, and a null
  unit would take a place under the cap B_max (zero-out does not carry over): it is stated
  as add-or-remove with N treated as public;
- replace-one keeps N by definition.
"""

from __future__ import annotations

from llmdp.config.choices import Relation, Sampler

__all__ = ["adjacency", "published_counts"]

_ZERO_OUT_RELATIONS = (Relation.ADD_OR_REMOVE_ONE,)
# Not a `Relation` (nothing here is accounted under it, `DPPlan` refuses it): its wording is
# kept for a plan that states it.
_REPLACE_ONE = "replace_one"


def adjacency(plan, unit_desc: str) -> str:
    """The adjacency the guarantee is stated for, given the plan's accounting relation
    (``plan.relation``) and sampler (``plan.sampler``)."""
    relation, sampler = plan.relation, plan.sampler
    if relation == _REPLACE_ONE:
        if sampler == Sampler.TRUNCATED_POISSON:
            raise ValueError("privacy.relation: replace_one with privacy.sampler: truncated-poisson: "
                             "dp-accounting accounts truncated Poisson only under add_or_remove_one; "
                             "use relation add_or_remove_one or sampler poisson")
        return (f"replace-one: one privacy unit ({unit_desc}) replaced by any other unit, N the "
                "same in both datasets (the relation it is accounted under)")
    if relation not in _ZERO_OUT_RELATIONS:
        raise ValueError(f"privacy.relation: {relation!r} is not a relation a report can state; "
                         f"expected one of {[*_ZERO_OUT_RELATIONS, _REPLACE_ONE]}")
    if sampler == Sampler.TRUNCATED_POISSON:
        return (f"add-or-remove one privacy unit ({unit_desc}), with N treated as public: "
                "dp-accounting accounts truncated Poisson only under add-or-remove-one, and a "
                "zeroed-out unit would still take a place under the cap B_max; N is published "
                "exactly, so this guarantee does not hide it")
    return (f"zero-out: one privacy unit ({unit_desc}) replaced by a null unit that contributes "
            "nothing and keeps its place (its held-out split, its group), N the same in both "
            "datasets; every unit's participation is drawn independently of the others', so "
            "this is the same ε as add-or-remove-one's, the relation it is accounted under")


def published_counts(plan, plan_info: dict) -> str:
    """The counts of private data the report publishes exactly, without noise, and so
    treats as public: N (and q, q·N, δ, which are functions of it), and the number of
    held-out units of a DP evaluation with ``eval.count: public``."""
    out = (f"N = {plan.dataset_size} units is published exactly, without noise, and treated as "
           "public, as are q = B/N, the expected batch size q·N and δ (set below 1/N): the "
           "guarantee does not hide N")
    if ((plan_info or {}).get("dp_eval") or {}).get("count") == "public":
        out += ("; so is the number of held-out units of each DP evaluation (eval.count: public), "
                "published exactly")
    return out
