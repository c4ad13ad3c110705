"""ε spent by a run: its ledger's releases (and the earlier ones it builds on), composed.

The one computation behind the number the progress bar shows, the report states and the
plot draws: the ledger, not the completed steps (steps re-executed after a failure were
released twice; write-ahead blocks count too).
"""

from __future__ import annotations

import math
import os

from llmdp.config.choices import Accountant
from llmdp.privacy import accounting
from llmdp.privacy.accounting import release_entries as prior_release_entries
from llmdp.privacy.ledger import (
    EVAL_MECHANISM,
    Ledger,
    is_step_release,
    net_records,
    release_entries,
    step_count,
)
from llmdp.record.rundir import RunDir


def ledger_noise_tail(plan, releases):
    """The noise generator's tails (`llmdp.privacy.noise.tail.NoiseTail`) of the releases a
    run's ledger records (``releases``: its records): its steps at the plan's noise
    coordinates and σ, its DP evaluations at the plan's ``eval_noise``. The ledger's counts,
    not the plan's: steps re-executed after a failure were released, and drew noise, twice.
    None when the plan does not fold the tails into δ (a plan.json of an earlier llmdp)."""
    if plan.noise_tail() is None:
        return None
    evals = sum(int(r.get("count") or 0) for r in net_records(releases)
                if r.get("kind") == "release" and (r.get("meta") or {}).get("mechanism") == EVAL_MECHANISM)
    return plan.noise_tail(steps=step_count(releases), eval_releases=evals)


def accountant_delta(plan, releases) -> float:
    """The δ the ε of these ledger releases is computed at: the plan's published δ less
    their noise tails (`ledger_noise_tail`); the plan's δ itself when not folded in."""
    tail = ledger_noise_tail(plan, releases)
    return plan.delta if tail is None else tail.accountant_delta(plan.delta)


def ledger_epsilon(ledger_path: str, plan, prior_releases=(), steps: int | None = None,
                   exact: bool = True, records: list[dict] | None = None) -> tuple[int, float]:
    """(ledger steps, ε) of the prior releases composed with the releases recorded in the
    run's ledger up to its first `steps` steps (all by default: then every release,
    DP evaluations after the last step included), at the plan's δ with its accountant: the
    report's ε when all are taken and ``exact``. The ledger, not the completed steps: steps
    re-executed after a failure were released twice, and write-ahead blocks count too.
    The δ is the plan's published δ less the noise tails of the releases taken
    (`accountant_delta`): the last point of the curve is the report's (ε, δ).
    ``exact=False``: PLD on the coarser display grid (conservative, ~10x faster)."""
    if records is None:  # else: the run's records, read once by its caller
        records = Ledger(ledger_path).records() if os.path.exists(ledger_path) else []
    # Counts net of voids: reserved steps that a graceful stop recorded as never run.
    releases = [r for r in net_records(records) if r.get("kind") == "release" and r.get("count")]
    total = step_count(releases)
    steps = total if steps is None else min(int(steps), total)
    kept, left = [], steps
    for r in releases:  # in ledger order, up to the `steps`-th step
        if steps < total and left <= 0:
            break
        if is_step_release(r):
            take = min(int(r["count"]), left)
            left -= take
            if take:
                kept.append({**r, "count": take})
        else:
            kept.append(r)  # a DP evaluation made before that point
    entries = release_entries(enumerate(kept, 1), ledger_path)
    prior, d_thr = prior_release_entries(list(prior_releases))
    if not prior and not entries:
        return steps, 0.0
    interval = None if exact or plan.accountant != Accountant.PLD else accounting.PLD_DISPLAY_DISCRETIZATION_INTERVAL
    delta = accountant_delta(plan, kept)
    if delta <= d_thr:
        return steps, math.inf  # the noise tails (and thresholds) spend all of δ
    return steps, accounting.epsilon_with_threshold(prior + entries, delta, d_thr, plan.accountant, interval)


def epsilon_curve(run_dir: str | RunDir, points: int = 16) -> list[tuple[int, float]]:
    """ε after the first t steps recorded in the run's ledger, at a few t: the curve of the
    plot. Starts at the earlier releases' ε (a private tokenizer's), and its last point is
    the reported ε (same composition, same grid); the others use the display grid. Empty
    for a NON-PRIVATE baseline."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    plan, prior, path = rd.plan, rd.prior_releases, rd.ledger_path
    if not plan.dp:  # a NON-PRIVATE baseline spends no ε: it has no curve
        return []
    records = rd.ledger_records  # read and verified once for every point
    total = step_count(records)
    ts = sorted({max(1, round(total * i / points)) for i in range(1, points + 1)}) if total else []
    return [ledger_epsilon(path, plan, prior, steps=t, exact=(t == total), records=records)
            for t in [0] + ts]
