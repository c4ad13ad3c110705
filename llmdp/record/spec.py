"""The run spec: everything the driver decided, handed to every worker as one typed value.

``trainer.prepare`` builds a :class:`RunSpec` once (validated recipe, DP plan, ledger
service, earlier releases, tokenizer, paths); Ray ships it to the workers as it is (it is
frozen and picklable), and the worker loop reads typed fields: it never re-validates the
recipe, restates a default, or reads plan.json back. plan.json is the spec's published
record (:meth:`RunSpec.plan_record`), written once and read by ``llmdp.record.rundir.RunDir``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmdp.config.best import hyperparameter_note
from llmdp.config.schema import RecipeConfig, to_dict
from llmdp.evaluation.dp import DpEvalPlan
from llmdp.privacy.accounting import composed_epsilon, event_to_json
from llmdp.privacy.ledger import LedgerService
from llmdp.privacy.plan import DPPlan
from llmdp.record.baseline import NON_PRIVATE, public_banner
from llmdp.record.provenance import summary


@dataclass(frozen=True)
class RunPaths:
    """Absolute paths (Ray workers chdir into their own folder)."""

    run_dir: str
    store_dir: str  # the unit store (memory-mapped by every worker)
    model_cache: str  # where model files are cached (``models.load_model(cache_dir=...)``)
    tokenizer_dir: str | None = None  # a local tokenizer folder, saved next to the model
    eval_store_dir: str | None = None  # the held-out units (None: no evaluation)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not os.path.isabs(v):
                raise ValueError(f"RunPaths.{f.name}: {v!r} is not an absolute path")

    @property
    def metrics(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")

    @property
    def model(self) -> str:
        return os.path.join(self.run_dir, "model")


class _ActorLedger:
    """The ledger service's methods, called on its Ray actor (blocking: write-ahead)."""

    def __init__(self, name: str):
        import ray  # lazy: only a run under Ray has an actor

        self._ray, self._actor = ray, ray.get_actor(name)

    def __getattr__(self, method):
        remote = getattr(self._actor, method)
        return lambda *a, **k: self._ray.get(remote.remote(*a, **k))


@dataclass(frozen=True)
class LedgerSpec:
    """How the run reaches its single ledger writer: ``service`` holds the
    :class:`~llmdp.privacy.ledger.service.LedgerService` arguments; ``actor`` names the Ray actor
    serving them on the driver, once started (None: rank 0 opens the service in-process)."""

    service: Mapping[str, Any]
    actor: str | None = None

    @property
    def budget_epsilon(self) -> float | None:
        return self.service.get("budget_epsilon")

    @property
    def admits(self) -> bool:
        """Rank 0 asks the service before every block of steps, whatever the recipe says:
        the dataset's budget is in its ledger (recorded maybe by another run, or by
        ``llmdp privacy ledger set-budget`` while this one runs), not in the recipe; a run
        stops cleanly before a step the budget (or the target after failures) refuses."""
        return True

    def open(self) -> LedgerService:
        """A new in-process service (the driver's budget checks, tests)."""
        return LedgerService(**self.service)

    def client(self):
        """The run's ledger service: the named Ray actor if the driver made one, else in-process."""
        return _ActorLedger(self.actor) if self.actor else self.open()


@dataclass(frozen=True)
class RunSpec:
    """One run, as the driver prepared it (``trainer.prepare``)."""

    cfg: RecipeConfig
    plan: DPPlan
    run_id: str
    paths: RunPaths
    # None for a NON-PRIVATE baseline (privacy.dp: false; ``dp`` False): it opens no ledger
    # and every ledger call is skipped.
    ledger: LedgerSpec | None
    dataset_ledger: Mapping[str, str] | None  # {"location" (without password), "dataset_id"}
    prior_releases: tuple[Mapping[str, Any], ...] = ()  # e.g. a private tokenizer's release
    tokenizer: Mapping[str, Any] = field(default_factory=dict)  # what the tokenizer means for ε
    data_stats: Mapping[str, Any] = field(default_factory=dict)  # internal: computed on private data
    eval_plan: DpEvalPlan | None = None  # the DP evaluations (None: none)
    unit: Mapping[str, Any] = field(default_factory=dict)  # the privacy unit (kind, description, ...)
    # the model the run starts from and what it means for ε (llmdp.record.provenance; None:
    # random weights); its composed releases are in prior_releases
    starting_model: Mapping[str, Any] | None = None
    # the checkpoint folder (its name) the driver read whole against its manifest before this
    # launch (`llmdp.run.restore`): the worker that restores it does not read it again
    verified_checkpoint: str | None = None

    @property
    def run_dir(self) -> str:
        return self.paths.run_dir

    @property
    def dp(self) -> bool:
        """False for a NON-PRIVATE baseline (privacy.dp: false): no clipping, no noise, no
        ledger, labelled NON-PRIVATE everywhere (``llmdp.record.baseline``)."""
        return self.plan.dp

    @property
    def simulated(self) -> bool:
        """True for a simulated run (privacy.simulate: the DP mechanism on data declared
        public): clipping and noise as planned, but no ledger and no ε (nothing released)."""
        return self.dp and self.cfg.privacy.simulate

    @property
    def spends(self) -> bool:
        """Whether the run releases anything with DP (a ledger, an ε): a DP run that is not
        simulated."""
        return self.dp and not self.simulated

    @functools.cached_property  # computed once (a PLD), for the log line and plan.json
    def epsilon_planned(self) -> float:
        """ε of the whole plan (its steps and DP evaluations) composed with the earlier
        releases (inf for a baseline or a simulated run: no guarantee, no accountant asked)."""
        if not self.spends:
            return math.inf
        return composed_epsilon(self.plan, list(self.prior_releases) + self.planned_evals())

    def planned_evals(self) -> list[dict]:
        """The DP evaluations as releases to compose (``prior_releases``' shape)."""
        if self.eval_plan is None:
            return []
        return [{"event": event_to_json(self.eval_plan.event()), "count": self.eval_plan.releases}]

    @property
    def eval_data(self) -> str | None:
        """"private" or "public" held-out data; None without evaluation."""
        ev = self.cfg.data.eval
        if ev is None:
            return None
        return "public" if ev.public else "private"

    def _eval_ledger(self) -> dict | None:
        e = None if self.ledger is None else self.ledger.service.get("eval_ledger")
        return None if not e else {"location": e.get("location"), "dataset_id": e["dataset_id"]}

    def with_ledger_actor(self, name: str) -> RunSpec:
        if self.ledger is None:  # a baseline has no ledger service
            return self
        return dataclasses.replace(self, ledger=dataclasses.replace(self.ledger, actor=name))

    def simulation(self) -> dict[str, Any]:
        """What a simulated run simulates: the private run's noise (σ, C, B, T, the
        mechanism, σC/B) planned for ``privacy.simulate_units`` units at its target."""
        p, plan = self.cfg.privacy, self.plan
        return {"private_units": p.simulate_units or plan.dataset_size,
                "target_epsilon": p.target_epsilon, "noise_multiplier": plan.noise_multiplier,
                "max_grad_norm": plan.max_grad_norm, "expected_batch_size": plan.expected_batch_size,
                "steps": plan.steps, "mechanism": str(plan.mechanism),
                "noise_std_per_step": plan.noise_multiplier * plan.max_grad_norm
                / plan.expected_batch_size}

    def plan_record(self) -> dict[str, Any]:
        """What plan.json holds (a baseline's: ``"privacy": "NON-PRIVATE"``, no ε, no ledger)."""
        from llmdp.base import plants as plant  # the test-only planted bug, if one is switched on

        planted = plant.active()
        return {
            # A run on data its recipe declares public says so first.
            **({"declared_public": public_banner(to_dict(self.cfg)["data"], self.simulated)}
               if self.cfg.data.public else {}),
            **({} if self.dp else {"privacy": NON_PRIVATE}),
            # A test switched a planted bug on (LLMDP_TEST_PLANT, never a recipe): the run
            # carries no guarantee; the report says so first and export refuses it.
            **({"planted": planted} if planted else {}),
            "plan": self.plan.to_dict(),
            # a simulated run (privacy.simulate) releases nothing: it has no ε, only the
            # private run's noise it simulates
            **({"simulated": self.simulation()} if self.simulated else {}),
            "epsilon_planned": self.epsilon_planned if self.spends else None,
            "epsilon_planned_training_only": self.plan.epsilon() if self.spends else None,
            "dp_eval": None if self.eval_plan is None else {
                **self.eval_plan.to_dict(), "epsilon_alone": self.eval_plan.epsilon()},
            "eval_data": self.eval_data,
            "run_id": self.run_id,
            # The privacy unit, so that a report written before any release (a run stopped
            # at step 0) states the run's own unit, not a default.
            "unit": dict(self.unit),
            "tokenizer": dict(self.tokenizer),
            "prior_releases": [dict(r) for r in self.prior_releases],
            "starting_model": summary(self.starting_model),
            # hyper-parameters from a sweep on data declared public (train.hyperparameters_from)
            "hyperparameters": hyperparameter_note(self.cfg),
            "data": dict(self.data_stats),
            # how records became tokens (format, chat template, targets): the report says it
            "record_encoding": _store_encoding(self.paths.store_dir),
            "dataset_ledger": None if self.dataset_ledger is None else dict(self.dataset_ledger),
            # A separate private evaluation source's own ledger: its DP evaluations are
            # recorded there too (None: none, or the training data's ledger holds them).
            "eval_dataset_ledger": self._eval_ledger(),
            "budget_epsilon": self.cfg.privacy.budget_epsilon,
            "allow_exceed_target_on_failure": self.cfg.privacy.allow_exceed_target_on_failure,
        }


def _store_encoding(store_dir: str) -> dict | None:
    """The unit store's record encoding (``RecordEncoder.describe()``: public configuration),
    or None when its meta.json has none."""
    try:
        with open(os.path.join(store_dir, "meta.json"), encoding="utf-8") as f:
            return ((json.load(f).get("data") or {}).get("encoding")) or None
    except (OSError, ValueError):
        return None
