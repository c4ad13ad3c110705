"""DP evaluations on a separate private evaluation source: releases on *that* dataset too.

A recipe's ``data.eval.path`` (or ``data.eval.dataset``) with ``public: false`` is data about
individuals, and a DP evaluation on it is a release on it, whatever dataset the run trains
on. So each one is recorded in the evaluation source's own dataset ledger (identity
``data.eval.dataset_id``, else derived from the source like ``data.dataset_id``) and
checked against that dataset's budget, besides the training data's ledger, which composes
it into the run's guarantee (`llmdp.privacy.ledger.service.LedgerService.release_eval`). A later
run on the evaluation file then starts from what the evaluations spent. The run's report
composes its own ``ledger.jsonl`` (the training ledger's records): each evaluation counts
once there.

Pure functions over the evaluation source's records; the service calls them inside its
transactions.
"""

from __future__ import annotations

from llmdp.privacy.ledger.budget import (
    SET_BUDGET_CMD,
    budget_refusal,
    budget_status,
    dataset_epsilon,
    steps_fit,
)
from llmdp.privacy.ledger.records import EVAL_MECHANISM

__all__ = ["eval_meta", "release_refusal", "launch_refusal"]


def eval_meta(run_meta: dict, eval_ledger: dict) -> dict:
    """The meta of a DP evaluation's record in the evaluation source's ledger: the run's
    (its unit: evaluation units are cut like the training units) with that data's
    fingerprint and size."""
    return {**run_meta, **(eval_ledger.get("meta") or {}), "mechanism": EVAL_MECHANISM}


def release_refusal(records, *, meta: dict, event, dataset_id: str, where: str) -> str | None:
    """Why one more DP evaluation (``event``) may not be released on the evaluation source's
    ledger (None: it may): its recorded budget, if it has one, and its unit."""
    budget, why = budget_refusal(records, meta, recipe=None, dataset_id=dataset_id, where=where)
    if why is not None:
        return f"the evaluation source's ledger: {why}"
    if budget is None or steps_fit(records, budget, event, 1) >= 1:
        return None
    eps = dataset_epsilon(records, budget, extra=[(event, 1)])
    return (f"the evaluation source's dataset ledger {dataset_id!r} has the budget "
            f"{budget.describe()}; this DP evaluation would take it to ε = {eps:.4f} (with what "
            f"live runs hold); it was not released")


def launch_refusal(records, *, meta: dict, event, left: int, dataset_id: str, where: str,
                   delta: float, accountant: str) -> tuple[dict, str | None]:
    """At launch: (the evaluation source's budget status, why the run's ``left`` DP
    evaluations not yet recorded there do not fit in its budget, or None). Nothing is held
    there: each release is checked again when it is made."""
    budget, why = budget_refusal(records, meta, recipe=None, dataset_id=dataset_id, where=where)
    if why is not None:
        return {}, f"the evaluation source's ledger (data.eval): {why}"
    if budget is None:
        return budget_status(records, None, delta, accountant, meta, where, dataset_id), None
    status = budget_status(records, budget.epsilon, budget.delta, budget.accountant, meta, where,
                           dataset_id)
    if not left or steps_fit(records, budget, event, left) >= left:
        return status, None
    eps = dataset_epsilon(records, budget, extra=[(event, left)])
    return status, (
        f"the evaluation source (data.eval) has its own dataset ledger {dataset_id!r} ({where}) "
        f"with the budget {budget.describe()}: this run's {left} DP evaluation(s) would take it "
        f"to ε = {eps:.4f} (with what live runs hold). Lower the number of DP evaluations "
        f"(eval.steps) or raise eval.noise_multiplier / lower eval.epsilon, or raise that "
        f"dataset's budget (`{SET_BUDGET_CMD} --dataset {dataset_id} ...`)")
