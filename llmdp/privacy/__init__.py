"""Privacy core: events, plan, accountant, ledger, sampling and noise.

Importable without Ray. The package's public names (``from llmdp.privacy import
make_plan``) are looked up in their modules on first use, so that a process that needs
only the ledger or the accountant (the ledger service's actor, ``llmdp privacy``) does not
load torch, which the ChaCha20 keystream behind sampling and noise (`chacha`) is computed
with.
"""

from __future__ import annotations

# Each public name and the module that defines it.
_HOMES = {
    "SAMPLERS": "llmdp.config.choices",
    **dict.fromkeys(("ACCOUNTANTS", "delta_for_epsilon", "epsilon", "epsilon_estimate",
                     "epsilon_for"), "llmdp.privacy.accounting.accountant"),
    "chacha20_keystream": "llmdp.privacy.rng.chacha",
    **dict.fromkeys(("compose", "dpsgd_step_event", "event_from_json", "event_to_json",
                     "is_truncated"), "llmdp.privacy.accounting.events"),
    **dict.fromkeys(("secure_key", "seeded_key"), "llmdp.privacy.rng.keys"),
    **dict.fromkeys(("LEDGER_FILENAME", "Ledger", "LedgerError"), "llmdp.privacy.ledger.records"),
    **dict.fromkeys(("add_gaussian_", "add_noise_", "gaussian_like"), "llmdp.privacy.noise.gaussian"),
    **dict.fromkeys(("DPPlan", "PlanError", "calibrate_noise", "default_delta", "make_plan",
                     "steps_for_epochs"), "llmdp.privacy.plan"),
    "ReferencePoissonSampler": "llmdp.privacy.sampling.reference",
    **dict.fromkeys(("PoissonSampler", "TruncatedPoissonSampler", "make_sampler",
                     "uniform_stream"), "llmdp.privacy.sampling.poisson"),
    **dict.fromkeys(("truncation_cost", "truncation_probability"), "llmdp.privacy.accounting.truncation"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'llmdp.privacy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
