"""ε spent by a run: its ledger's releases (and the earlier ones it builds on), composed.

The one computation behind the number the progress bar shows, the report states and the
plot draws: the ledger, not the completed steps (steps re-executed after a failure were
released twice; write-ahead blocks count too).
"""

from __future__ import annotations

import os

from llmdp.privacy import accountant
from llmdp.privacy.ledger import Ledger, is_step_release, release_entries, step_count
from llmdp.privacy.prior import release_entries as prior_release_entries
from llmdp.rundir import RunDir


def ledger_epsilon(ledger_path: str, plan, prior_releases=(), steps: int | None = None,
                   exact: bool = True) -> tuple[int, float]:
    """(ledger steps, ε) of the prior releases composed with the releases recorded in the
    run's ledger up to its first `steps` steps (all by default: then every release,
    DP evaluations after the last step included), at the plan's δ with its accountant: the
    report's ε when all are taken and ``exact``. The ledger, not the completed steps: steps
    re-executed after a failure were released twice, and write-ahead blocks count too.
    ``exact=False``: PLD on the coarser display grid (conservative, ~10x faster)."""
    records = Ledger(ledger_path).records() if os.path.exists(ledger_path) else []
    releases = [r for r in records if r.get("kind") == "release" and r.get("count")]
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
    interval = None if exact or plan.accountant != "pld" else accountant.PLD_DISPLAY_DISCRETIZATION_INTERVAL
    return steps, accountant.epsilon_with_threshold(prior + entries, plan.delta, d_thr, plan.accountant, interval)


def epsilon_curve(run_dir: str | RunDir, points: int = 16) -> list[tuple[int, float]]:
    """ε after the first t steps recorded in the run's ledger, at a few t: the curve of the
    plot. Starts at the earlier releases' ε (a private tokenizer's), and its last point is
    the reported ε (same composition, same grid); the others use the display grid. Empty
    for a NON-PRIVATE baseline."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    plan, prior, path = rd.plan, rd.prior_releases, rd.ledger_path
    if not plan.dp:  # a NON-PRIVATE baseline spends no ε: it has no curve
        return []
    total = step_count(Ledger(path).records()) if os.path.exists(path) else 0
    ts = sorted({max(1, round(total * i / points)) for i in range(1, points + 1)}) if total else []
    return [ledger_epsilon(path, plan, prior, steps=t, exact=(t == total)) for t in [0] + ts]
