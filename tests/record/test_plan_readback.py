"""A plan read back from plan.json is re-derived, and an edited one is refused (issue 49 (c)).

The report, the export and `llmdp privacy report` read a run's plan from plan.json: an
edited ``round_factor`` (5.0 for the derived 1.0 cut the reported ε from 2.6 to 0.2), a
tripled strategy ``scale`` or a lowered σ must not change what is reported. Every derived
field is derived again from the plan's inputs and a mismatch names plan.json, the field,
both values, and that the file was edited or damaged.
"""

from __future__ import annotations

import json
import re

import pytest

from llmdp.privacy.accounting.calibrate import PlanError
from llmdp.privacy.mechanism import mechanism_config
from llmdp.privacy.plan import make_plan
from llmdp.record.rundir import RunDir

N = 6000


def _plan_dir(tmp_path, name, mechanism="dp-sgd", bands=None, **kw):
    config = mechanism_config(mechanism, bands=bands, strategy_cache=str(tmp_path / "mf"))
    plan = make_plan(dataset_size=N, expected_batch_size=60, max_grad_norm=1.0, delta=1e-5,
                     mechanism=config, **kw)
    rd = RunDir(str(tmp_path / name))
    rd.write_plan({"run_id": name, "plan": plan.to_dict()})
    return rd, plan


def _edit(rd, change) -> RunDir:
    with open(rd.plan_path, encoding="utf-8") as f:
        info = json.load(f)
    change(info["plan"])
    with open(rd.plan_path, "w", encoding="utf-8") as f:
        json.dump(info, f)
    return RunDir(rd.path)  # a fresh reader (the report's, the export's)


@pytest.mark.parametrize("sampler", ["cyclic-poisson", "fixed-cycle"])
def test_an_edited_correlated_plan_is_refused_and_an_unedited_one_reads_back(tmp_path, sampler):
    rd, plan = _plan_dir(tmp_path, sampler, mechanism="banded-mf", sampler=sampler, bands=4,
                         steps=24, noise_multiplier=1.2)
    assert RunDir(rd.path).plan == plan  # unedited: read back as written
    edited = _edit(rd, lambda p: p.update(round_factor=5.0))
    with pytest.raises(PlanError, match=rf"plan.json: round_factor is 5(\.0)? but re-derived "
                                        rf".*{re.escape(repr(plan.round_factor))}.*edited or damaged"):
        _ = edited.plan
    rd2, _ = _plan_dir(tmp_path, sampler + "-scale", mechanism="banded-mf", sampler=sampler,
                       bands=4, steps=24, noise_multiplier=1.2)
    edited = _edit(rd2, lambda p: p["strategy"].update(scale=3 * p["strategy"]["scale"]))
    with pytest.raises(PlanError, match=r"plan.json: .*strategy.*scale.*edited or damaged"):
        _ = edited.plan
    third = _edit(RunDir(rd2.path), lambda p: p["strategy"].update(scale=p["strategy"]["scale"] / 9))
    with pytest.raises(PlanError, match=r"plan.json: .*strategy.*scale.*edited or damaged"):
        _ = third.plan


def test_an_edited_noise_multiplier_under_a_target_is_refused(tmp_path):
    """σ calibrated to a target ε: a lowered σ (ε above the target) is refused."""
    rd, plan = _plan_dir(tmp_path, "sgd", steps=50, target_epsilon=2.0)
    assert RunDir(rd.path).plan == plan
    edited = _edit(rd, lambda p: p.update(noise_multiplier=p["noise_multiplier"] / 2))
    with pytest.raises(PlanError, match=r"plan.json: noise_multiplier .*target_epsilon.*edited or damaged"):
        _ = edited.plan


def test_an_edited_planned_epsilon_is_refused(tmp_path):
    """plan.json's planned ε (reported as the plan's) is re-derived from the plan too."""
    plan = make_plan(dataset_size=N, expected_batch_size=60, max_grad_norm=1.0, delta=1e-5,
                     steps=50, noise_multiplier=1.1)
    rd = RunDir(str(tmp_path / "r"))
    rd.write_plan({"run_id": "r", "plan": plan.to_dict(), "epsilon_planned": plan.epsilon(),
                   "epsilon_planned_training_only": plan.epsilon()})
    assert RunDir(rd.path).plan == plan
    with open(rd.plan_path, encoding="utf-8") as f:
        info = json.load(f)
    info["epsilon_planned"] = plan.epsilon() / 10
    with open(rd.plan_path, "w", encoding="utf-8") as f:
        json.dump(info, f)
    with pytest.raises(PlanError, match=r"plan.json: epsilon_planned is .* edited or damaged"):
        _ = RunDir(rd.path).plan
