"""Seeded keys belong to one run and one attempt (issue 49 item 6).

With a seed and the step alone in the key, two runs (two trials of a grid sweep over C)
with the same seed drew the same noise: whoever holds both updates cancels it exactly. The
key is (seed, run, attempt, step, purpose): distinct runs and distinct attempts of one run
draw independent noise; the same run and attempt reproduce it.
"""

from __future__ import annotations

import types

import pytest
import torch

from llmdp.privacy.rng import keys
from llmdp.train.step import StepKeys

CPU = torch.device("cpu")


def test_two_runs_with_one_seed_draw_different_keys_and_one_attempt_reproduces():
    a = StepKeys.draw(3, "seeded", 7, CPU, scope=("run-a", "attempt-1"))
    assert a == StepKeys.draw(3, "seeded", 7, CPU, scope=("run-a", "attempt-1"))
    for other in (("run-b", "attempt-1"), ("run-a", "attempt-2")):
        b = StepKeys.draw(3, "seeded", 7, CPU, scope=other)
        assert a.noise != b.noise and a.sample != b.sample, other
    assert keys.seeded_key(7, 0, "eval", run="a", attempt="1") != \
        keys.seeded_key(7, 0, "eval", run="b", attempt="1")
    # (run, attempt) is not a concatenation: "ab"+"c" and "a"+"bc" are different scopes
    assert keys.seeded_key(7, 0, "x", run="ab", attempt="c") != keys.seeded_key(7, 0, "x", run="a", attempt="bc")


def test_a_seeded_draw_without_the_runs_scope_is_refused():
    with pytest.raises(ValueError, match=r"seeded.*run id.*attempt"):
        StepKeys.draw(0, "seeded", 7, CPU)


def test_the_loop_keys_a_seeded_run_by_its_run_id_and_attempt():
    """`loop.seeded_scope`: what every rank keys its seeded draws with (the run id, and the
    attempt rank 0's ledger service started): two specs with one seed differ, and so do
    two attempts of one run."""
    from llmdp.train import loop

    def run(run_id, attempt):
        cfg = types.SimpleNamespace(privacy=types.SimpleNamespace(rng="seeded", seed=7))
        spec = types.SimpleNamespace(run_id=run_id, cfg=cfg)
        return types.SimpleNamespace(spec=spec, rank=0, device=CPU, attempt=attempt, key_scope=None)

    scopes = {}
    for rid, att in (("trial-0", "a1"), ("trial-1", "a1"), ("trial-0", "a2")):
        r = run(rid, att)
        loop.seeded_scope(r)
        scopes[(rid, att)] = r.key_scope
        assert r.key_scope == (rid, att)
    draws = {s: StepKeys.draw(0, "seeded", 7, CPU, scope=s).noise for s in scopes.values()}
    assert len(set(draws.values())) == 3
    # no ledger (a NON-PRIVATE baseline): a fresh random attempt, still keyed by the run
    r = run("base", None)
    loop.seeded_scope(r)
    assert r.key_scope[0] == "base" and r.key_scope[1]
