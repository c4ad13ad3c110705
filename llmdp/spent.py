"""ε spent by a run: its ledger's releases (and the earlier ones it builds on), composed.

The one computation behind the number the progress bar shows, the report states and the
plot draws: the ledger, not the completed steps (steps re-executed after a failure were
released twice; write-ahead blocks count too).
"""

from __future__ import annotations

import os

from llmdp.privacy import accountant
from llmdp.privacy.ledger import Ledger
from llmdp.privacy.prior import release_entries
from llmdp.rundir import RunDir


def ledger_epsilon(ledger_path: str, plan, prior_releases=(), steps: int | None = None,
                   exact: bool = True) -> tuple[int, float]:
    """(ledger steps, ε) of the prior releases composed with the first `steps` steps (all
    by default) recorded in the run's ledger, at the plan's δ with its accountant: the
    report's ε when all are taken and ``exact``. The ledger, not the completed steps: steps
    re-executed after a failure were released twice, and write-ahead blocks count too.
    ``exact=False``: PLD on the coarser display grid (conservative, ~10x faster)."""
    entries = Ledger(ledger_path).entries() if os.path.exists(ledger_path) else []
    total = sum(int(c) for _, c in entries)
    steps = total if steps is None else min(int(steps), total)
    kept, left = [], steps
    for event, count in entries:  # the first `steps` steps, in ledger order
        if left <= 0:
            break
        kept.append((event, min(int(count), left)))
        left -= kept[-1][1]
    prior, d_thr = release_entries(list(prior_releases))
    if not prior and not kept:
        return steps, 0.0
    interval = None if exact or plan.accountant != "pld" else accountant.PLD_DISPLAY_DISCRETIZATION_INTERVAL
    return steps, accountant.epsilon_with_threshold(prior + kept, plan.delta, d_thr, plan.accountant, interval)


def epsilon_curve(run_dir: str | RunDir, points: int = 16) -> list[tuple[int, float]]:
    """ε after the first t steps recorded in the run's ledger, at a few t: the curve of the
    plot. Starts at the earlier releases' ε (a private tokenizer's), and its last point is
    the reported ε (same composition, same grid); the others use the display grid. Empty
    for a NON-PRIVATE baseline."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    plan, prior, path = rd.plan, rd.prior_releases, rd.ledger_path
    if not plan.dp:  # a NON-PRIVATE baseline spends no ε: it has no curve
        return []
    total = sum(int(c) for _, c in Ledger(path).entries()) if os.path.exists(path) else 0
    ts = sorted({max(1, round(total * i / points)) for i in range(1, points + 1)}) if total else []
    return [ledger_epsilon(path, plan, prior, steps=t, exact=(t == total)) for t in [0] + ts]
