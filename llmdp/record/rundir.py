"""One run directory, read (``runs/<name>/``): the single reader of the files a run leaves.

    config.yaml          the resolved recipe (``trainer.prepare``)
    plan.json            the plan and what the driver decided: written once, by ``prepare``
    ledger.jsonl         the run's ledger (the ledger service writes it, write-ahead)
    metrics.jsonl        per-step metrics (rank 0)
    checkpoints/         Ray Train's checkpoints (``checkpoint_*/``: ``state.pt``, or
                         ``state.json`` + DCP shards; ``llmdp.record.checkpoints``) and its record
                         of them (``checkpoint_manager_snapshot.json``)
    local_ray.json       while a local Ray started by the run lives: its processes
                         (``llmdp.base.localray``; a relaunch ends what a dead launch left)
    model/               the trained model (``save_pretrained``)
    privacy_report.*     the report (``llmdp.report.build``)

The run itself never reads plan.json back: the driver hands the workers a
:class:`llmdp.record.spec.RunSpec`. The report, the export and the CLI read it here, and
every field derived from the plan's inputs is derived again (`check_read_back`): an
edited or damaged plan.json is refused, never reported.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from functools import cached_property
from typing import Any

from llmdp.config.choices import Sampler
from llmdp.privacy.accounting import SIGMA_RTOL, PlanError
from llmdp.privacy.ledger import Ledger
from llmdp.privacy.plan import DPPlan
from llmdp.record import checkpoints

PLAN_JSON = "plan.json"
RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of its checkpoints
# The driver's request for a graceful stop (the first Ctrl-C): rank 0 looks for this file
# before every step (`llmdp.train.loop.admitted`); a launch removes one left by the last.
STOP_REQUEST = "stop_requested"


class NotARunDirectory(ValueError):
    """The folder holds no run (no plan.json)."""


def check_read_back(plan: DPPlan, path: str, info: dict | None = None) -> DPPlan:
    """``plan`` as read from ``path``, or one `PlanError` naming the first derived field that
    its inputs do not give: the strategy's scale (its sensitivity must be 1), the round
    factor and its exactness (from the strategy), a fixed cycle's batch (N / cycle), σ under
    a target ε (its ε, through the accountant, within the target), and ``info``'s (the
    whole plan.json's) planned ε. `DPPlan.__post_init__` re-derives the truncation
    probability. Cheap: no strategy is optimized again, no σ calibrated again."""
    for field, stored, derived in [*_mismatches(plan), *_planned_mismatches(plan, info or {})]:
        raise PlanError(
            f"{path}: {field} is {stored!r} but re-derived from the plan's inputs it is "
            f"{derived}: the file was edited or damaged (llmdp writes it once and never edits "
            f"it); restore it, or run again, and report nothing from this one")
    return plan


def _planned_mismatches(plan: DPPlan, info: dict):
    """plan.json's ``epsilon_planned_training_only`` and ``epsilon_planned`` (the steps with
    the earlier releases and the DP evaluations, `RunSpec.epsilon_planned`), re-derived."""
    if not plan.dp or info.get("epsilon_planned") is None:
        return
    from llmdp.evaluation.dp import DpEvalPlan
    from llmdp.privacy.accounting import composed_epsilon, event_to_json

    evals = []
    if info.get("dp_eval"):
        ev = DpEvalPlan.from_dict({k: v for k, v in info["dp_eval"].items() if k != "epsilon_alone"})
        evals = [{"event": event_to_json(ev.event()), "count": ev.releases}]
    for field, derived in (("epsilon_planned_training_only", plan.epsilon()),
                           ("epsilon_planned", composed_epsilon(
                               plan, list(info.get("prior_releases") or []) + evals))):
        stored = info.get(field)
        if stored is not None and not math.isclose(stored, derived, rel_tol=1e-9):
            yield (field, stored, repr(derived))


def _mismatches(plan: DPPlan):
    if plan.correlated and plan.dp:
        from llmdp.privacy import mf

        fact, kw = plan.factorization(), {"steps": plan.steps, "cycle": plan.cycle}
        sens = mf.scaled_sensitivity(fact, plan.sampler, **kw)
        if not abs(sens - 1.0) <= 1e-9:  # linear in the scale: 1 at scale / sens
            yield ("strategy.scale", fact.scale, f"{fact.scale / sens!r} (the scale at which the "
                   f"strategy's sensitivity is 1; at the stored scale it is {sens!r})")
            return
        f, exact = mf.round_factor(fact, plan.sampler, **kw)
        if not math.isclose(plan.round_factor, f, rel_tol=1e-12):
            yield ("round_factor", plan.round_factor, repr(f))
        if plan.round_factor_exact != exact:
            yield ("round_factor_exact", plan.round_factor_exact, repr(exact))
    if plan.correlated and plan.sampler == Sampler.FIXED_CYCLE:
        batch = int(plan.dataset_size) / plan.cycle
        if not math.isclose(plan.expected_batch_size, batch, rel_tol=1e-12):
            yield ("expected_batch_size", plan.expected_batch_size, f"{batch!r} (N / cycle)")
    if plan.dp and plan.target_epsilon is not None:
        eps = plan.epsilon()
        if not eps <= plan.target_epsilon * (1 + 1e-6):
            yield ("noise_multiplier", plan.noise_multiplier,
                   f"one whose ε is within target_epsilon {plan.target_epsilon!r} (the stored "
                   f"one's is {eps:.6g})")


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    def file(self, *names: str) -> str:
        return os.path.join(self.path, *names)

    @property
    def plan_path(self) -> str:
        return self.file(PLAN_JSON)

    @property
    def ledger_path(self) -> str:
        return self.file("ledger.jsonl")

    def exists(self) -> bool:
        return os.path.isfile(self.plan_path)

    def require(self, error: type[Exception] = NotARunDirectory) -> RunDir:
        """``self``, or ``error`` naming the folder if it holds no run."""
        if not self.exists():
            raise error(f"{self.path}: not a run directory (no {PLAN_JSON})")
        return self

    # ---- plan.json

    @cached_property
    def info(self) -> dict[str, Any]:
        """plan.json, read once (``NotARunDirectory`` if there is none)."""
        self.require()
        with open(self.plan_path, encoding="utf-8") as f:
            return json.load(f)

    @cached_property
    def plan(self) -> DPPlan:
        """plan.json's plan, its derived fields derived again (`check_read_back`)."""
        return check_read_back(DPPlan.from_dict(self.info["plan"]), self.plan_path, self.info)

    @property
    def prior_releases(self) -> list[dict]:
        return list(self.info.get("prior_releases") or [])

    def run_id(self) -> str | None:
        """The run's id if plan.json holds one (a re-launch resumes the same run), else None."""
        try:
            return self.info.get("run_id")
        except (OSError, ValueError):
            return None

    def first_plan(self, plan: DPPlan) -> DPPlan:
        """The plan a re-launch goes on with: plan.json's (its derived fields derived again:
        σ's ε within the target, `check_read_back`) where ``plan``, this launch's, differs
        from it only in a σ calibrated to the same target, by no more than two σ searches
        may (twice `SIGMA_RTOL`: another version of the search, or another machine's last
        bits of dp-accounting's FFT, finds a σ as good); the run's releases so far were made
        at the first σ. Otherwise ``plan`` itself (`write_plan` refuses it if it differs)."""
        if not os.path.exists(self.plan_path):
            return plan
        try:
            first = DPPlan.from_dict(self.info["plan"])
        except (OSError, ValueError, KeyError, TypeError):
            return plan  # `write_plan` says what is wrong with it
        if (first == plan or plan.target_epsilon is None
                or not math.isclose(first.noise_multiplier, plan.noise_multiplier,
                                    rel_tol=2 * SIGMA_RTOL)
                or dataclasses.replace(plan, noise_multiplier=first.noise_multiplier) != first):
            return plan
        return self.plan

    def write_plan(self, record: dict[str, Any]) -> None:
        """Write plan.json, once. A re-launch of the same run (same recipe, checked by
        ``trainer.check_run_dir``) computes the same record: the file is left as it is. A
        record whose plan or earlier releases differ is refused: the directory's
        checkpoints and ledger were made under the first."""
        record = json.loads(json.dumps(record))
        if os.path.exists(self.plan_path):
            old = self.info
            changed = [k for k in ("run_id", "prior_releases") if old.get(k) != record.get(k)]
            if DPPlan.from_dict(old["plan"]) != DPPlan.from_dict(record["plan"]):
                changed.insert(0, "plan")
            if changed:
                raise ValueError(
                    f"{self.plan_path} holds a different {', '.join(changed)} than this launch "
                    f"computed; this run directory belongs to another run. Give this run its own "
                    f"output.name or delete {self.path}")
            return
        os.makedirs(self.path, exist_ok=True)
        tmp = self.plan_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, self.plan_path)
        self.__dict__["info"] = record
        self.__dict__.pop("plan", None)

    # ---- metrics.jsonl and ledger.jsonl, each read once per RunDir (a report, an export)

    @cached_property
    def metrics(self) -> list[dict]:
        """metrics.jsonl's records (a torn last line after a crash is left out)."""
        return read_jsonl(self.file("metrics.jsonl"))

    @cached_property
    def ledger(self) -> Ledger:
        return Ledger(self.ledger_path)

    @cached_property
    def ledger_records(self) -> list[dict]:
        """ledger.jsonl's records, verified once (`LedgerError` if damaged); [] if none."""
        return self.ledger.records() if os.path.exists(self.ledger_path) else []

    # ---- config.yaml

    def config(self) -> dict:
        """The resolved recipe, as a dict (``FileNotFoundError`` if there is none)."""
        import yaml  # lazy: only the readers that need the recipe pay for it

        with open(self.file("config.yaml"), encoding="utf-8") as f:
            return yaml.safe_load(f) or {}

    # ---- checkpoints

    def latest_checkpoint(self) -> str | None:
        """The checkpoint folder Ray Train restores (either format of
        ``llmdp.record.checkpoints``), or None: the latest one its controller registered
        (``checkpoint_manager_snapshot.json``; none registered: None), else (no snapshot)
        the newest folder. A driver killed between a worker's upload and the registration
        leaves a newer folder that Ray Train does not resume from."""
        def is_checkpoint(folder: str) -> bool:
            return any(os.path.exists(os.path.join(folder, name))
                       for name in (checkpoints.FULL, checkpoints.META))

        try:
            with open(self.file("checkpoints", RAY_TRAIN_SNAPSHOT), encoding="utf-8") as f:
                snapshot = json.load(f)
        except (OSError, ValueError):
            snapshot = None  # none (a run written without Ray Train), or unreadable
        if isinstance(snapshot, dict):
            latest = (snapshot.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
            folder = self.file("checkpoints", latest) if latest else None
            return folder if folder and is_checkpoint(folder) else None
        found = sorted({os.path.dirname(p) for name in (checkpoints.FULL, checkpoints.META)
                        for p in glob.glob(self.file("checkpoints", "checkpoint_*", name))})
        return found[-1] if found else None

    def checkpoint_step(self) -> int | str:
        """The step of the latest checkpoint (0 without one; "?" if it cannot be read)."""
        ckpt = self.latest_checkpoint()
        if ckpt is None:
            return 0
        try:  # the meta only: not the parameters or the optimizer state
            return int(checkpoints.read_meta(ckpt)["step"])
        except Exception:  # noqa: BLE001 - a checkpoint Ray cannot read either fails the run later
            return "?"

    def finished_training(self) -> bool:
        """Whether the workers finished every planned step after their latest (re)start: the
        final evaluation and model were saved and "end" was written (`run_state`)."""
        metrics = read_jsonl(self.file("metrics.jsonl"))  # read now, not self.metrics: it may grow
        return run_state(metrics, int(self.plan.steps), None, True)["status"] == "complete"

    def resume_point(self) -> dict | None:
        """Where a re-launch starts: ``{"step": k, "attempt": n}`` (k: the step of the latest
        checkpoint, the one Ray Train restores; n: this launch's attempt, counted like the
        report's attempts), or None for a fresh run."""
        if not os.path.isdir(self.path):
            return None
        try:
            records = Ledger(self.ledger_path).records() if os.path.exists(self.ledger_path) else []
        except Exception:  # noqa: BLE001 - a damaged ledger is reported by the report, not here
            records = []
        attempts = {r.get("attempt") for r in records if r.get("kind") == "release"}
        if self.latest_checkpoint() is None and not attempts:
            return None
        return {"step": self.checkpoint_step(), "attempt": len(attempts) + 1}


def read_jsonl(path: str) -> list[dict]:
    """The JSON records of a JSON-lines file ([] if there is none); a torn last line (a
    crash while it was written) is left out."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


RESUME_HINT = "re-run the same command to resume"


def run_state(metrics: list[dict], steps_planned: int, failure: str | None,
              interrupted: bool) -> dict[str, Any]:
    """Where a run stands, from its metrics.jsonl records: the steps completed and the
    report's ``status`` / ``failure`` / ``resume`` / ``stopped`` fields (a DP run's report
    and a baseline's alike)."""
    completed = max((m["step"] for m in metrics if "event" not in m and "step" in m), default=0)
    stop = next((m for m in reversed(metrics) if m.get("event") == "stopped"), None)
    # Interrupted (Ctrl-C, SIGTERM) if the driver said so after the latest (re)start.
    last = next((m for m in reversed(metrics) if m.get("event") in ("interrupted", "start")), None)
    interrupted = interrupted or (last is not None and last["event"] == "interrupted")
    # The workers finished everything after the latest (re)start (the final evaluation and
    # model saved, then "end"): an interrupt after that hit only the driver's finalization
    # (report, hold), which a re-run or this report completes. Not interrupted.
    start = max((i for i, m in enumerate(metrics) if m.get("event") == "start"), default=-1)
    if any(m.get("event") == "end" and int(m.get("step") or 0) >= steps_planned
           for m in metrics[start + 1:]) and completed >= steps_planned:
        interrupted = False
    return {
        "completed": completed,
        "status": "failed" if failure else ("interrupted" if interrupted else
                                            "complete" if completed >= steps_planned else
                                            "stopped" if stop else "incomplete"),
        "failure": failure,
        "resume": RESUME_HINT if interrupted and not failure else None,
        "stopped": stop["reason"] if stop else None,
        # "ledger": a budget or target-ε stop, a function of the recorded releases only.
        # Anything else (an older version's stop on a count of non-finite units) made the
        # run's length depend on private data without DP: export refuses it.
        "stop_cause": (stop.get("cause") if stop else None),
    }
