"""Privacy accounting: DpEvents, ε / δ over dp-accounting, and the σ search.

- `events`: the only place DpEvents are built from a plan, and their JSON form;
- `accountant`: ε(δ) / δ(ε) of `(event, count)` entries (PLD and RDP);
- `grids`: the PLD grids (reporting; displays and searches), plain numbers;
- `calibrate`: the one σ search (`calibrate_sigma`) and the curves it runs on;
- `truncation`: what truncated Poisson's cap B_max costs, and its search;
- `prior`: composition with earlier releases on the same units (σ raised for them).

Names are looked up in their modules on first use: importing this package loads nothing
(the ledger service's actor and ``llmdp privacy`` use it without torch).
"""

from __future__ import annotations

from llmdp.privacy import entry_point

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "events": ("compose", "dpsgd_step_event", "event_from_json", "event_to_json", "is_truncated"),
    "grids": ("PLD_DISPLAY_DISCRETIZATION_INTERVAL",),
    "accountant": ("epsilon",
                   "epsilon_estimate", "epsilon_for", "epsilon_with_threshold", "make_accountant",
                   "threshold_delta"),
    "calibrate": ("SIGMA_RTOL", "EpsilonCurve", "PlanError", "calibrate_curve", "calibrate_sigma"),
    "truncation": ("DEFAULT_TRUNCATION_BUDGET", "calibrate_truncated", "plan_truncated",
                   "truncation_cost", "truncation_probability"),
    "prior": ("calibrate_with_prior", "composed_epsilon", "release_entries"),
}
__all__, __getattr__, __dir__, _HOMES = entry_point(__name__, _NAMES)
