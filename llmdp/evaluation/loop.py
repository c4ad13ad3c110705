"""The worker loop's evaluations (``llmdp.train.loop``): held-out metrics before the first
step, every ``train.eval_every`` steps and after the last; a DP evaluation after each of
``eval.steps`` and after the last step; generations from ``eval.prompts`` at the end.

Held-out metrics are written to metrics.jsonl as ``{"event": "eval", ...}`` lines (internal
on private held-out data, publishable on public data); a DP evaluation as a
``{"event": "dp_eval", ...}`` line, after its release is durable in the ledger (write-ahead,
`LedgerService.release_eval`); generations to ``generations.json``.
"""

from __future__ import annotations

import json
import os
import time

import torch

from llmdp.base.collectives import sum_floats_over_workers
from llmdp.evaluation import dp as dp_eval
from llmdp.evaluation.metrics import evaluate
from llmdp.privacy import rng

__all__ = ["due", "evaluate_held_out", "generate_from_prompts"]


def due(spec, step: int) -> bool:
    """Whether the held-out data is evaluated after ``step`` steps inside the loop (the last
    step's evaluation is :func:`evaluate_held_out` from ``finish``)."""
    if spec.paths.eval_store_dir is None or step >= spec.plan.steps:
        return False
    every = spec.cfg.train.eval_every
    dp_at = spec.eval_plan.steps if spec.eval_plan is not None else ()
    return bool(every and step % every == 0) or step in dp_at


def evaluate_held_out(run, step: int, *, final: bool = False, write=None) -> dict | None:
    """Held-out metrics after ``step`` steps on every worker [sync point], and, when the
    plan releases one here, a DP evaluation (rank 0 records it, then draws the noise).
    Returns rank 0's ``eval`` record (None on other ranks or without held-out data)."""
    spec = run.spec
    if run.eval_store is None:
        return None
    t0 = time.perf_counter()
    metrics, mine = evaluate(run.model, run.eval_store, run.device, run.rank, run.world,
                             spec.cfg.train.physical_batch_size, run.eval_fn)
    plan = spec.eval_plan
    private = spec.cfg.privacy.dp
    release = private and plan is not None and (final or step in plan.steps)
    released = None
    if release:
        sums = dp_eval.normalized_sums(mine["loss"], mine["accuracy"], plan.loss_bound)
        total = sum_floats_over_workers(list(sums), run.device)  # [sync point]
        if run.rank == 0:
            ok, why = run.ledger.release_eval(step)  # write-ahead: durable before the noise
            if ok:
                cfg = spec.cfg.privacy
                # seeded: keyed by the run and its attempt too (`train.loop.seeded_scope`)
                key = (rng.seeded_key(int(cfg.seed), step, "eval", *run.key_scope)
                       if cfg.rng == "seeded" else rng.secure_key())
                released = {"event": "dp_eval", **dp_eval.release(total, plan, key, step)}
            else:
                released = {"event": "dp_eval", "step": step, "refused": why}
    if run.rank != 0:
        return None
    record = {"event": "eval", "step": step, **metrics, "data": spec.eval_data,
              "eval_time_s": time.perf_counter() - t0, "time": time.time()}
    if not private:
        record["privacy"] = "NON-PRIVATE"
    if write is not None:
        write(record)
        if released is not None:
            write({**released, "time": time.time()})
    return record


@torch.no_grad()
def generate_from_prompts(model, tokenizer, prompts, *, max_new_tokens: int, temperature: float,
                          top_p: float, seed: int, device) -> list[dict]:
    """Greedy and sampled continuations of each public prompt (post-processing of the
    final model). The sampled one is seeded by ``train.seed`` (public)."""
    out = []
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt").to(device)
            n = enc["input_ids"].shape[1]
            common = dict(max_new_tokens=max_new_tokens, pad_token_id=pad,
                          attention_mask=enc["attention_mask"])
            greedy = model.generate(enc["input_ids"], do_sample=False, **common)
            torch.manual_seed(seed)
            sampled = model.generate(enc["input_ids"], do_sample=True, temperature=temperature,
                                     top_p=top_p, **common)
            out.append({"prompt": prompt,
                        "greedy": tokenizer.decode(greedy[0, n:], skip_special_tokens=True),
                        "sampled": tokenizer.decode(sampled[0, n:], skip_special_tokens=True)})
    finally:
        model.train(was_training)
    return out


def write_generations(path: str, generations: list[dict], settings: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"settings": settings, "generations": generations}, f, indent=2, ensure_ascii=False)
    os.replace(tmp, path)
