"""The whole worker loop in one process (no Ray): ledger write-ahead, crash, resume."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from llmdp.config.schema import recipe_from_dict, to_dict
from llmdp.privacy.ledger.records import Ledger
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.helpers import dataset_records, tiny_tokenizer_dir, write_notes


def make_recipe(tmp_path, **train):
    data = write_notes(tmp_path / "notes.jsonl", 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 2, **train},
        "output": {"dir": str(tmp_path / "runs"), "name": "t"},
    }
    return recipe_from_dict(raw)


def prepared_config(cfg):
    from llmdp.run.launch import prepare

    return prepare(cfg, log=lambda *a: None)


class Crash(RuntimeError):
    pass


def test_crash_after_ledger_write_leaves_every_applied_step_counted(tmp_path, monkeypatch):
    cfg = make_recipe(tmp_path)
    prep = prepared_config(cfg)
    ckpt = str(tmp_path / "ckpt")
    applied = {"n": 0}
    real_step = torch.optim.AdamW.step

    def step_or_crash(self, *a, **k):
        if applied["n"] == 3:  # the 4th update never happens: its ledger line was written
            raise Crash("node lost")
        applied["n"] += 1
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_or_crash)
    with pytest.raises(Crash):
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    ledger = Ledger(os.path.join(prep.run_dir, "ledger.jsonl"))
    assert ledger.total_count() >= applied["n"] == 3

    # Resume from the last checkpoint (step 2): steps 2..5 run again, fresh randomness.
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    executed = 3 + (6 - 2)
    assert Ledger(os.path.join(prep.run_dir, "ledger.jsonl")).total_count() >= executed
    # Block reservation: lines, not one per step.
    assert len(ledger.records()) < executed
    assert os.path.exists(os.path.join(prep.run_dir, "model", "config.json"))


def test_local_loop_writes_metrics_and_a_report_matching_dp_accounting(tmp_path):
    import dp_accounting

    from llmdp.report.build import write_report

    cfg = make_recipe(tmp_path)
    prep = prepared_config(cfg)
    train_loop_per_worker(prep, LocalContext())
    rep = write_report(prep.run_dir)
    q, T = prep.plan.sampling_probability, prep.plan.steps
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), T)
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct = acc.compose(event).get_epsilon(1e-4)
    assert rep["steps"] == T
    assert rep["epsilon"] == pytest.approx(direct, rel=1e-6)
    assert rep["status"] == "complete"
    lines = [json.loads(x) for x in open(os.path.join(prep.run_dir, "metrics.jsonl"))]
    steps = [x["step"] for x in lines if "event" not in x]
    assert steps == list(range(1, T + 1))
    for x in lines:
        if "event" not in x:  # one worker: the totals are rank 0's counts
            assert (x["units"], x["tokens"]) == (x["worker0_units"], x["worker0_tokens"])
            assert x["tokens_per_s"] == pytest.approx(x["tokens"] / x["step_time_s"])
            assert x["units_per_s"] == pytest.approx(x["units"] / x["step_time_s"])
            assert x["tokens_per_s_per_worker"] == pytest.approx(x["tokens_per_s"])  # one worker
    for x in lines:  # secrets stay secret: no sampled indices, no per-unit norms
        assert not {"indices", "sample", "norms"} & set(x)
    assert os.path.exists(os.path.join(prep.run_dir, "privacy_report.png"))
    assert to_dict(cfg)["privacy"]["rng"] == rep["rng_mode"] == "secure"


def make_unit_recipe(tmp_path, name, **data):
    cfg = make_recipe(tmp_path)
    raw = to_dict(cfg)
    raw["data"].update(data)
    raw["output"]["name"] = name
    return recipe_from_dict(raw)


def test_user_units_with_truncated_poisson_report_what_ran(tmp_path):
    """User units through the local loop, truncated-Poisson sampled: the report states the
    unit, its bound, the cap, and an ε equal to dp-accounting's truncated event composed T times."""
    import dp_accounting

    from llmdp.config.schema import ConfigError
    from llmdp.report.build import write_report

    cfg = make_unit_recipe(tmp_path, "user", unit="user", user_field="user_id", max_rows_per_unit=3)
    raw = to_dict(cfg)
    raw["privacy"]["sampler"] = "truncated-poisson"
    raw["train"]["expected_batch_size"] = 64
    with pytest.raises(ConfigError, match=r"train.expected_batch_size: 64 is more than the \d+ user units"):
        prepared_config(recipe_from_dict(raw))
    raw["train"]["expected_batch_size"] = 3
    cfg = recipe_from_dict(raw)
    prep = prepared_config(cfg)
    plan = prep.plan
    assert plan.sampler == "truncated-poisson" and plan.max_batch_size >= plan.expected_batch_size
    train_loop_per_worker(prep, LocalContext())
    rep = write_report(prep.run_dir)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            plan.dataset_size + 1, plan.sampling_probability, plan.max_batch_size, plan.noise_multiplier),
        plan.steps)
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert rep["epsilon"] == pytest.approx(acc.compose(event).get_epsilon(rep["delta_accountant"]), rel=1e-6)
    assert rep["unit"] == "user" and "'user_id'" in rep["unit_description"]
    assert rep["unit_size"]["max_rows_per_unit"] == 3
    assert "at most 3 row(s) of 24 tokens" in rep["contribution_bound"]
    assert rep["dataset_size"] == prep.data_stats["num_users"] == prep.data_stats["num_units"]
    assert rep["data_statistics"]["computed_on_private_data"] is True
    assert rep["sampling"]["max_batch_size"] == plan.max_batch_size
    assert rep["sampling"]["truncation_epsilon_cost"] == pytest.approx(plan.truncation_cost)
    md = open(os.path.join(prep.run_dir, "privacy_report.md")).read()
    assert "Truncation cap B_max" in md and "user: a user" in md


def test_a_run_directory_is_not_reused_by_another_recipe(tmp_path):
    from llmdp.config.schema import ConfigError

    cfg = make_recipe(tmp_path)
    prepared_config(cfg)
    prepared_config(cfg)  # the same recipe: fine (a resume)
    # A config written before a schema field existed is not a different recipe.
    import yaml

    path = os.path.join(cfg.run_dir, "config.yaml")
    old = yaml.safe_load(open(path))
    del old["data"]["num_proc"]
    yaml.safe_dump(old, open(path, "w"))
    prepared_config(cfg)
    other = make_unit_recipe(tmp_path, "t", unit="document", max_rows_per_unit=2)
    with pytest.raises(ConfigError, match=r"output.name: 't' already holds a run .*data.unit: "
                                          r"'sequence' -> 'document'.*output.name=t-2"):
        prepared_config(other)


def test_budget_refuses_to_start_and_stops_before_crossing(tmp_path):
    """A dataset ledger shared by two runs: the second is refused at start when its plan does
    not fit; when it starts but the budget runs out, it stops before the crossing step."""
    import dp_accounting

    from llmdp.privacy.ledger.service import BudgetError
    from llmdp.report.build import write_report

    first = make_recipe(tmp_path)
    raw = to_dict(first)
    raw["privacy"]["ledger"] = str(tmp_path / "ledgers.sqlite")  # this test's own database
    first = recipe_from_dict(raw)
    prep = prepared_config(first)
    train_loop_per_worker(prep, LocalContext())
    loc, ds = prep.ledger.service["location"], prep.ledger.service["dataset_id"]

    def total():
        return sum(int(r["count"]) for r in dataset_records(loc, dataset_id=ds) if r["kind"] == "release")

    assert total() == 6
    ev = prep.plan.step_event()

    def eps(k):
        acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        return acc.compose(ev, k).get_epsilon(prep.plan.accountant_delta)  # δ less the noise tails

    raw = to_dict(first)
    raw["output"]["name"] = "second"
    raw["privacy"]["budget_epsilon"] = eps(6 + 3) * (1 + 1e-9)  # 3 more steps fit, the plan needs 6
    with pytest.raises(BudgetError, match=r"privacy.budget_epsilon=.*has spent ε = "
                                          rf"{eps(6):.4f}.*only 3 of its 6 remaining steps fit"):
        prepared_config(recipe_from_dict(raw))

    # The same budget met mid-run (as after failures): stop cleanly before step 4.
    raw["privacy"]["budget_epsilon"] = None
    prep2 = prepared_config(recipe_from_dict(raw))
    service = {**prep2.ledger.service, "budget_epsilon": eps(9) * (1 + 1e-9)}
    spec = dataclasses.replace(prep2, ledger=dataclasses.replace(prep2.ledger, service=service))
    assert spec.ledger.admits
    ctx = LocalContext(checkpoint_dir=str(tmp_path / "ckpt2"))
    out = train_loop_per_worker(spec, ctx)
    assert out["steps"] == 3 and "before step 4 of 6" in out["stopped"]
    assert [r["step"] for r in ctx.reports] == [2, 3]  # the stopped state is checkpointed
    state = torch.load(tmp_path / "ckpt2" / "state.pt", weights_only=False)
    assert state["step"] == 3 and state["ledger"]["run_steps_recorded"] == 3
    assert total() == 9
    assert Ledger(os.path.join(prep2.run_dir, "ledger.jsonl")).total_count() == 3
    rep = write_report(prep2.run_dir)
    assert rep["status"] == "stopped" and "privacy.budget_epsilon" in rep["stopped"]
    assert rep["steps"] == 3 and rep["dataset_ledger"]["epsilon_spent"] == pytest.approx(eps(9), rel=1e-9)


def test_a_finished_run_is_not_run_again(tmp_path, capsys):
    from llmdp.report.build import write_report
    from llmdp.run.launch import run

    cfg = make_recipe(tmp_path)
    prep = prepared_config(cfg)
    train_loop_per_worker(prep, LocalContext())
    write_report(prep.run_dir)
    before = Ledger(os.path.join(prep.run_dir, "ledger.jsonl")).total_count()
    lines = []
    assert run(cfg, log=lines.append) == prep.run_dir  # no Ray started: nothing to do
    assert "already complete (6 of 6 steps" in lines[0] and "nothing to do" in lines[0]
    assert Ledger(os.path.join(prep.run_dir, "ledger.jsonl")).total_count() == before


@pytest.mark.parametrize("unit", ["document", "user"])
def test_a_run_stopped_before_its_first_release_reports_its_own_unit(tmp_path, unit):
    """Issue 30 item 6: a document (user) run interrupted at step 0 has no release yet; its
    report still names its unit, not "a sequence of N tokens"."""
    from llmdp.report.build import write_report

    overrides = {"unit": unit, "max_rows_per_unit": 2, **({"user_field": "user_id"} if unit == "user" else {})}
    cfg = make_recipe(tmp_path)
    cfg = type(cfg)(**{**cfg.__dict__, "data": type(cfg.data)(**{**cfg.data.__dict__, **overrides}),
                       "train": type(cfg.train)(**{**cfg.train.__dict__, "expected_batch_size": 2})})
    prep = prepared_config(cfg)
    rep = write_report(prep.run_dir, interrupted=True)
    assert rep["status"] == "interrupted" and rep["steps_completed"] == 0
    assert rep["unit"] == unit
    assert rep["unit_description"].startswith("a document" if unit == "document" else "a user")
    assert "sequence of" not in rep["adjacency"]


def test_a_lora_run_on_a_tiny_base_says_so_and_warns_of_nothing_else(tmp_path):
    """Issue 30 item 10: LoRA on a randomly initialised `init: tiny` base is said (it is a
    pipeline test, not a fine-tune), and a LoRA run shows no transformers FutureWarning."""
    import warnings

    from llmdp.config.schema import LoraConfig
    from llmdp.run.launch import prepare
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    cfg = make_recipe(tmp_path, steps=2)
    cfg = type(cfg)(**{**cfg.__dict__, "model": type(cfg.model)(**{
        **cfg.model.__dict__, "lora": LoraConfig(r=2, target_modules=("q_proj", "v_proj"))})})
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prep = prepare(cfg, log=lines.append)
        train_loop_per_worker(prep, LocalContext())
    assert any("model.lora on model.init: tiny" in x and "RANDOMLY" in x for x in lines), lines
    assert not [str(w.message) for w in caught if "gradient_checkpointing" in str(w.message)]


def test_the_report_opens_with_a_plain_sentence_and_warns_of_a_unit_smaller_than_a_person(tmp_path):
    """Issue 30 item 14: the report (and card) open with a plain-language sentence; a
    sequence run on records that carry a person field (the notes' user_id) says, in the
    internal report only, that the unit does not protect that person."""
    from llmdp.record.publish import publishable_report
    from llmdp.report.build import write_report
    from llmdp.report.card import model_card
    from llmdp.report.render import render_markdown
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    cfg = make_recipe(tmp_path, steps=2)
    prep = prepared_config(cfg)
    train_loop_per_worker(prep, LocalContext())
    rep = write_report(prep.run_dir)
    md = render_markdown(rep).splitlines()
    body = [x for x in md if x.strip()]
    assert body[0] == "# Privacy report"
    assert body[1].startswith("In plain words: a person who sees this model learns ")
    assert "whether any one 24-token passage was in the training data" in body[1]
    assert "'user_id'" in rep["unit_warning"] and "not a person" in rep["unit_warning"]
    assert any(x.startswith("> **Unit warning (internal):**") for x in md)
    pub = publishable_report(rep)
    assert "unit_warning" not in pub and "Unit warning" not in render_markdown(pub)
    assert render_markdown(pub).splitlines()[2].startswith("In plain words")
    import yaml

    card = model_card(pub, yaml.safe_load(open(os.path.join(prep.run_dir, "config.yaml"))),
                      fmt="full", base_model=None, license=None, unverified=[])
    assert "In plain words: a person who sees this model" in str(card)


def test_a_ctrl_c_during_finalization_does_not_strand_the_run(tmp_path, monkeypatch):
    """Issue 30 item 2: every step, the final evaluation and the model were done ("end" in
    metrics.jsonl) when Ctrl-C reached the driver. The report says complete, not
    interrupted; a re-run finishes the finalization without training or spending; export
    accepts the run."""
    import json

    import llmdp.run.launch
    from llmdp.hub.export import export_run
    from llmdp.privacy.ledger.records import Ledger
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    cfg = make_recipe(tmp_path, steps=4)

    def fit_then_ctrl_c(prepared, log, interrupts=None):
        train_loop_per_worker(prepared, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
        raise KeyboardInterrupt  # after "end": during the driver's finalization

    monkeypatch.setattr(llmdp.run.launch, "_fit", fit_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llmdp.run.launch.run(cfg, log=lambda *a: None)
    run_dir = cfg.run_dir
    report = json.load(open(os.path.join(run_dir, "privacy_report.json")))
    assert report["status"] == "complete", report["status"]
    released = Ledger(os.path.join(run_dir, "ledger.jsonl")).records()

    # A stale report (as an older version wrote it): the re-run finalizes, never trains.
    report["status"] = "interrupted"
    open(os.path.join(run_dir, "privacy_report.json"), "w").write(json.dumps(report))
    monkeypatch.setattr(llmdp.run.launch, "_fit", lambda *a: pytest.fail("trained again"))
    lines = []
    llmdp.run.launch.run(cfg, log=lines.append)
    assert any("is already complete" in x for x in lines), lines
    assert json.load(open(os.path.join(run_dir, "privacy_report.json")))["status"] == "complete"
    assert Ledger(os.path.join(run_dir, "ledger.jsonl")).records() == released  # nothing spent
    res = export_run(run_dir, tmp_path / "export", log=lambda *a: None, allow_unverified=True)
    assert not any("status" in p for p in res["problems"]), res["problems"]


def test_the_steps_run_with_the_runs_objects_frozen_and_give_them_back(tmp_path, monkeypatch):
    """`setup_kept`: every step runs with the objects alive at the steps' start out of the
    collector's walks (``gc.freeze``: the model among them), and the loop gives them back
    when the steps end, nothing frozen left in this process."""
    import gc

    from llmdp.train import loop

    assert gc.get_freeze_count() == 0
    seen = []
    real = loop.dp_step

    def step(run, i):
        seen.append((gc.get_freeze_count(), any(o is run.model for o in gc.get_objects(2))))
        return real(run, i)

    monkeypatch.setattr(loop, "dp_step", step)
    prep = prepared_config(make_recipe(tmp_path))
    train_loop_per_worker(prep, LocalContext())
    assert len(seen) == prep.plan.steps
    assert all(frozen > 1000 and not in_gen2 for frozen, in_gen2 in seen), seen
    assert gc.get_freeze_count() == 0


def test_the_steps_leave_a_callers_own_frozen_objects_frozen():
    """A process that froze objects itself keeps them frozen: `setup_kept` does nothing there
    (its ``gc.unfreeze`` would have undone the caller's freeze)."""
    import gc

    from llmdp.train.loop import setup_kept

    gc.freeze()
    try:
        # (frozen objects that other threads free leave the count: it may only shrink)
        frozen = gc.get_freeze_count()
        with setup_kept():
            assert 0 < gc.get_freeze_count() <= frozen  # nothing newer frozen
        assert 0 < gc.get_freeze_count() <= frozen  # and nothing unfrozen
    finally:
        gc.unfreeze()
