"""Privacy accounting: DpEvents, ε / δ over dp-accounting, and the σ search.

- `events`: the only place DpEvents are built from a plan, and their JSON form;
- `accountant`: ε(δ) / δ(ε) of `(event, count)` entries (PLD and RDP);
- `calibrate`: the one σ search (`calibrate_sigma`) and the curves it runs on;
- `truncation`: what truncated Poisson's cap B_max costs, and its search;
- `prior`: composition with earlier releases on the same units (σ raised for them).

Names are looked up in their modules on first use: importing this package loads nothing
(the ledger service's actor and ``llmdp privacy`` use it without torch).
"""

from __future__ import annotations

# Each name code outside this sub-package uses, by the module of it that defines it.
_NAMES = {
    "events": ("compose", "dpsgd_step_event", "event_from_json", "event_to_json", "is_truncated"),
    "accountant": ("ACCOUNTANTS", "PLD_DISPLAY_DISCRETIZATION_INTERVAL", "epsilon",
                   "epsilon_estimate", "epsilon_for", "epsilon_with_threshold", "make_accountant",
                   "threshold_delta"),
    "calibrate": ("EpsilonCurve", "PlanError", "calibrate_curve"),
    "truncation": ("DEFAULT_TRUNCATION_BUDGET", "calibrate_truncated", "plan_truncated",
                   "truncation_cost", "truncation_probability"),
    "prior": ("calibrate_with_prior", "composed_epsilon", "release_entries"),
}
_HOMES = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(name for name in _HOMES if not name.startswith("_"))


def __getattr__(name: str):
    # Looked up in the defining module at every access, never cached here: a test that
    # patches that module's attribute is seen by every caller that reaches it through here.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
