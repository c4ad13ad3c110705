"""Issue 13 through real runs: one identity per dataset (working directory, edited data,
declared id), one launch per run directory, target vs re-executed steps, and (slow, Ray)
two concurrent runs under a budget that fits one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import dp_accounting
import pytest

from llmdp.config.schema import recipe_from_dict
from llmdp.privacy.ledger.records import Ledger
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.helpers import Command, dataset_records, simulate_steps, tiny_tokenizer_dir, write_notes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _raw(tmp_path, data, name="t", **privacy):
    return {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4, **privacy},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 2},
        "output": {"dir": str(tmp_path / "runs"), "name": name},
    }


def _prepare(cfg, lines=None):
    from llmdp.run.launch import prepare

    return prepare(cfg, log=(lines.append if lines is not None else (lambda *a: None)))


def _releases(ds):
    return [r for r in dataset_records(None, dataset_id=ds) if r["kind"] == "release"]


# ------------------------------------------------------------------ one identity per dataset


def test_two_working_directories_and_an_edited_record_charge_one_budget(tmp_path, monkeypatch, capsys):
    """The ledger does not depend on the working directory ($LLMDP_HOME), nor on the data's
    bytes: with a declared data.dataset_id, the same recipe run from two directories and
    then on the file with one record changed charges one ledger; the changed content is a
    data_version record with a note, and the budget counts every run."""
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    data = write_notes(tmp_path / "notes.jsonl", 30)
    runs = []
    for i, cwd in enumerate(("a", "b")):
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        raw = _raw(tmp_path, data, name=f"run{i}")
        raw["data"]["dataset_id"] = "clinic-notes-2026"
        lines = []
        prep = _prepare(recipe_from_dict(raw), lines)
        assert any(f"ledger: dataset 'clinic-notes-2026' in {tmp_path / 'home' / 'ledger.sqlite'}" in x
                   for x in lines), lines
        simulate_steps(prep)
        runs.append(prep)
    # One record of the data changes (a new hash): the same dataset, the same budget.
    text = open(data).read().splitlines()
    rec = json.loads(text[3])
    rec["text"] += " (amended)"
    text[3] = json.dumps(rec)
    open(data, "w").write("\n".join(text) + "\n")
    raw = _raw(tmp_path, data, name="run2", budget_epsilon=100.0)
    raw["data"]["dataset_id"] = "clinic-notes-2026"
    lines = []
    prep = _prepare(recipe_from_dict(raw), lines)
    assert any("changed since its ledger was started" in x and "same budget" in x for x in lines), lines
    simulate_steps(prep)
    recs = dataset_records(None, dataset_id="clinic-notes-2026")
    assert [r["kind"] for r in recs if r["kind"] in ("dataset", "data_version")] == ["dataset", "data_version"]
    assert {r["run_id"] for r in recs if r["kind"] == "release"} == {p.run_id for p in runs + [prep]}
    assert sum(r["count"] for r in recs if r["kind"] == "release") == 18
    # The budget status composes all 18 steps (the edited data may pack into one more
    # sequence: another q for the third run): dp-accounting directly, record by record.
    from llmdp.privacy.accounting.events import event_from_json

    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for r in recs:
        if r["kind"] == "release":
            acc.compose(event_from_json(r["event"]), r["count"])
    want = acc.get_epsilon(prep.plan.accountant_delta)  # δ less the noise tails
    from llmdp.report.build import build_report

    rep = build_report(prep.run_dir)
    assert rep["dataset_ledger"]["epsilon_spent"] == pytest.approx(want, rel=1e-9)
    assert rep["dataset_ledger"]["dataset_id"] == "clinic-notes-2026"


def test_default_id_is_the_source_and_lookalikes_are_refused(tmp_path, monkeypatch):
    """Without a declared id the ledger is the source's real path (any working directory);
    a copy of the data under another name would start a new ledger for the same
    individuals: refused (issue 29 item 5; it was a warning), naming the ledger whose data
    it looks like and how to share one budget. Declared, it runs (with the warning)."""
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    data = write_notes(tmp_path / "notes.jsonl", 30)
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    prep = _prepare(recipe_from_dict(_raw(tmp_path, "../notes.jsonl")))
    assert prep.ledger.service["dataset_id"] == "path:" + os.path.realpath(data)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(open(data, "rb").read())
    from llmdp.config.validate import ConfigError

    with pytest.raises(ConfigError) as e:
        _prepare(recipe_from_dict(_raw(tmp_path, copy, name="t2")))
    assert "the same content hash" in str(e.value)
    assert f"set data.dataset_id: path:{os.path.realpath(data)}" in str(e.value)
    assert not (tmp_path / "runs" / "t2").exists()
    raw = _raw(tmp_path, copy, name="t2")
    raw["data"]["dataset_id"] = "copy-of-notes"
    lines = []
    prep2 = _prepare(recipe_from_dict(raw), lines)
    assert prep2.ledger.service["dataset_id"] == "copy-of-notes"
    warn = [x for x in lines if x.startswith("warning: starting a new ledger")]
    assert warn and "the same content hash" in warn[0] and \
        f"data.dataset_id: path:{os.path.realpath(data)}" in warn[0]


def test_a_file_and_its_folder_charge_one_budget(tmp_path, monkeypatch):
    """Issue 29 item 5 through two real runs: a run on ``data/sub/notes.jsonl``, then one
    on the folder ``data/sub`` (holding only that file) was a second ledger at ε = 0. Now
    the folder run is refused, naming the file's ledger; declaring that ledger's id, its
    steps are charged to the same budget, which counts both runs (dp-accounting)."""
    from llmdp.config.validate import ConfigError
    from llmdp.privacy.accounting.events import event_from_json

    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    sub = tmp_path / "data" / "sub"
    sub.mkdir(parents=True)
    data = write_notes(sub / "notes.jsonl", 30)
    first = _prepare(recipe_from_dict(_raw(tmp_path, data, name="file", budget_epsilon=50.0)))
    simulate_steps(first)
    ds = "path:" + os.path.realpath(data)
    assert first.ledger.service["dataset_id"] == ds
    with pytest.raises(ConfigError) as e:
        _prepare(recipe_from_dict(_raw(tmp_path, sub, name="folder", budget_epsilon=50.0)))
    assert f"the ledger(s) {ds!r} (overlapping sources: it reads the file {os.path.realpath(data)}" in str(e.value)
    assert f"set data.dataset_id: {ds}" in str(e.value)
    raw = _raw(tmp_path, sub, name="folder", budget_epsilon=50.0)
    raw["data"]["dataset_id"] = ds
    second = _prepare(recipe_from_dict(raw))
    simulate_steps(second)
    recs = dataset_records(None, dataset_id=ds)
    assert {r["run_id"] for r in recs if r["kind"] == "release"} == {first.run_id, second.run_id}
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for r in recs:
        if r["kind"] == "release":
            acc.compose(event_from_json(r["event"]), r["count"])
    from llmdp.report.build import build_report

    rep = build_report(second.run_dir)
    # at the dataset budget's δ less the run's noise tails (the accountant's δ)
    assert rep["dataset_ledger"]["epsilon_spent"] == pytest.approx(acc.get_epsilon(second.plan.accountant_delta), rel=1e-9)
    assert sum(r["count"] for r in recs if r["kind"] == "release") == 12


def test_a_legacy_jsonl_dataset_ledger_is_imported_once(tmp_path, monkeypatch):
    """An earlier llmdp's dataset ledger (<cache>/ledgers/<sha16>.jsonl) is imported into the
    database at the first run on that data, and only once."""
    from llmdp.data.sources import source_fingerprint
    from llmdp.privacy.accounting.events import event_to_json

    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))
    data = write_notes(tmp_path / "notes.jsonl", 30)
    sha = source_fingerprint(path=str(data))
    legacy = tmp_path / "cache" / "ledgers" / f"{sha[:16]}.jsonl"
    legacy.parent.mkdir(parents=True)
    ev = event_to_json(dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(1.0)))
    legacy.write_text("".join(json.dumps({"kind": "release", "event": ev, "count": c, "run_id": "old",
                                          "attempt": "1", "meta": {"unit": {"kind": "sequence"}}}) + "\n"
                              for c in (4, 4)))
    lines = []
    prep = _prepare(recipe_from_dict(_raw(tmp_path, data)), lines)
    assert any("imported 2 release record(s)" in x for x in lines), lines
    _prepare(recipe_from_dict(_raw(tmp_path, data, name="t2")), lines := [])
    assert not any("imported" in x for x in lines)
    old = [r for r in _releases(prep.ledger.service["dataset_id"]) if r["run_id"] == "old"]
    assert [r["count"] for r in old] == [4, 4] and all(r["imported_from"] == str(legacy) for r in old)


# ------------------------------------------------------------------ a budget belongs to the dataset


def test_the_budget_is_the_datasets_whatever_the_recipe_says(tmp_path, monkeypatch):
    """Issue 29 items 2 and 7 through `trainer.prepare`: the first budgeted launch records its
    budget in the dataset ledger; a recipe without a budget is checked against it and holds
    (its log line says whose budget); a recipe with another ε, δ or accountant is refused,
    naming both budgets and the command that changes it; a run for another privacy unit is
    refused, naming both units. A refusal records nothing and leaves no run directory."""
    from llmdp.privacy.ledger.service import BudgetError

    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    data = write_notes(tmp_path / "notes.jsonl", 30)
    lines = []
    a = _prepare(recipe_from_dict(_raw(tmp_path, data, name="a", budget_epsilon=50.0)), lines)
    ds = a.ledger.service["dataset_id"]
    assert any(x.startswith("budget: ε spent on this dataset for the privacy unit 'a sequence of "
                            "24 tokens (packed across document boundaries)' = 0.0000 of 50 at δ = "
                            "0.0001 (privacy.budget_epsilon, now recorded as the dataset's budget)")
               for x in lines), lines
    (budget,) = [r for r in dataset_records(None, dataset_id=ds) if r["kind"] == "budget"]
    assert (budget["epsilon"], budget["delta"], budget["accountant"]) == (50.0, 1e-4, "pld")
    assert budget["unit_key"] == "a sequence of 24 tokens (packed across document boundaries)"
    assert f"run {a.run_id}" in budget["set_by"]
    lines = []
    b = _prepare(recipe_from_dict(_raw(tmp_path, data, name="b")), lines)
    assert any("(the dataset's budget, recorded in its ledger: this recipe sets no "
               "privacy.budget_epsilon); this run holds its 6 remaining step(s)" in x for x in lines), lines
    assert [r["run_id"] for r in dataset_records(None, dataset_id=ds) if r["kind"] == "hold"] == \
        [a.run_id, b.run_id]
    before = dataset_records(None, dataset_id=ds)
    for change, differ in (({"budget_epsilon": 60.0}, "ε"),
                           ({"budget_epsilon": 50.0, "delta": 1e-3}, "δ"),
                           ({"budget_epsilon": 50.0, "accountant": "rdp"}, "accountant")):
        with pytest.raises(BudgetError) as e:
            _prepare(recipe_from_dict(_raw(tmp_path, data, name="c", **change)))
        msg = str(e.value)
        assert msg.startswith(f"privacy.budget_epsilon={change['budget_epsilon']:g} (at privacy.delta")
        assert f"is not the budget of the dataset ledger {ds!r}" in msg
        assert "that is ε = 50 at δ = 0.0001 (pld) for the privacy unit 'a sequence of 24" in msg
        assert f"(they differ in {differ})" in msg and "llmdp privacy ledger set-budget --dataset" in msg
        assert not (tmp_path / "runs" / "c").exists()
    raw = _raw(tmp_path, data, name="d")
    raw["data"]["sequence_length"] = 23
    with pytest.raises(BudgetError) as e:
        _prepare(recipe_from_dict(raw))
    msg = str(e.value)
    assert "a privacy budget for the privacy unit 'a sequence of 24 tokens" in msg
    assert "this release is for the privacy unit 'a sequence of 23 tokens" in msg
    assert not (tmp_path / "runs" / "d").exists()
    assert dataset_records(None, dataset_id=ds) == before


# ------------------------------------------------------------------ one launch per run directory


def test_a_second_launch_into_one_run_directory_is_refused(tmp_path, capsys):
    """A launch holds the run directory's lock for its lifetime: a second launch (another
    process) is refused before it writes anything, naming the holder's PID and host."""
    import socket

    from llmdp.cli import main

    data = write_notes(tmp_path / "notes.jsonl", 30)
    recipe = tmp_path / "r.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump(_raw(tmp_path, data)))
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from llmdp._fs import RunLock
            lock = RunLock({str(tmp_path / 'runs' / 't')!r})
            print("held", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert f"in use by another launch (PID {holder.pid} on host {socket.gethostname()}" in err
        assert "output.name" in err and "Traceback" not in err
        assert not (tmp_path / "runs" / "t").exists()  # nothing was written
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    from llmdp._fs import RunLock

    RunLock(str(tmp_path / "runs" / "t")).release()  # free again once the holder is gone


# ------------------------------------------------------------------ target vs re-executed steps


def _fail_then_resume(tmp_path, monkeypatch, allow: bool):
    """A run calibrated to target_epsilon whose worker fails after reserving steps 2-3 (the
    block) and applying step 2; it resumes from the step-2 checkpoint."""
    data = write_notes(tmp_path / "notes.jsonl", 30)
    raw = _raw(tmp_path, data, allow_exceed_target_on_failure=allow)
    raw["privacy"].pop("noise_multiplier")
    raw["privacy"]["target_epsilon"] = 8.0
    prep = _prepare(recipe_from_dict(raw))
    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setenv("LLMDP_FAULT", f"step=3,rank=0,marker={tmp_path / 'fault'}")
    with pytest.raises(RuntimeError, match="injected fault"):
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    out = train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
    return prep, out


def test_failures_stop_the_run_at_its_target(tmp_path, monkeypatch):
    from llmdp.report.build import build_report
    from llmdp.report.render import render_markdown

    prep, out = _fail_then_resume(tmp_path, monkeypatch, allow=False)
    plan = prep.plan
    # Steps 2-3 were reserved twice: only plan.steps ledger steps fit in the target.
    assert out["steps"] < plan.steps and "privacy.target_epsilon=8 reached" in out["stopped"]
    assert "allow_exceed_target_on_failure: true" in out["stopped"]
    led = Ledger(os.path.join(prep.run_dir, "ledger.jsonl"))
    assert led.total_count() == plan.steps
    rep = build_report(prep.run_dir)
    assert rep["status"] == "stopped" and rep["epsilon"] <= 8.0 + 1e-9
    assert rep["exceeds_target"] is None
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert rep["epsilon"] == pytest.approx(
        acc.compose(plan.step_event(), plan.steps).get_epsilon(plan.accountant_delta), rel=1e-9)
    assert "Run status: **stopped**" in render_markdown(rep)


def test_allowed_failures_finish_and_the_report_says_so_first(tmp_path, monkeypatch):
    from llmdp.report.build import build_report
    from llmdp.report.render import render_markdown
    from llmdp.report.spent import epsilon_curve

    prep, out = _fail_then_resume(tmp_path, monkeypatch, allow=True)
    plan = prep.plan
    assert out == {"steps": plan.steps}
    rep = build_report(prep.run_dir)
    assert rep["steps"] == plan.steps + 2 and rep["epsilon"] > 8.0
    assert rep["exceeds_target"].startswith(f"ε = {rep['epsilon']:.4f} exceeds privacy.target_epsilon")
    assert "allow_exceed_target_on_failure: true" in rep["exceeds_target"]
    first = render_markdown(rep).splitlines()[0]
    assert first.startswith("**Warning: ε =") and "exceeds privacy.target_epsilon" in first
    # The plot's curve is the ledger's: it ends at the report's ε, above the target.
    assert epsilon_curve(prep.run_dir)[-1] == (plan.steps + 2, rep["epsilon"])


# ------------------------------------------------------------------ two concurrent Ray runs


@pytest.mark.slow
def test_two_concurrent_runs_under_a_budget_that_fits_one(tmp_path, monkeypatch):
    """Two `llmdp train` processes on the same data at once, with a budget that fits one
    plan: exactly one trains; the other is refused before its first step (its plan does
    not fit beside the first's hold), with a message naming the run that holds the budget.
    The dataset ledger never crosses the budget."""
    import yaml

    data = write_notes(tmp_path / "notes.jsonl", 40)
    procs, recipes = [], []
    env = {**os.environ, "LLMDP_HOME": str(tmp_path / "home"), "LLMDP_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": REPO}
    # Build the unit store and the plan once (a probe, here), so that both launches start
    # together.
    from llmdp.config.schema import recipe_from_dict
    from llmdp.run.launch import prepare

    with monkeypatch.context() as m:
        for k in ("LLMDP_HOME", "LLMDP_CACHE"):
            m.setenv(k, env[k])
        prepare(recipe_from_dict({**_raw(tmp_path, data),
                                  "output": {"dir": str(tmp_path / "probe"), "name": "p"}}), log=print)
    for name in ("a", "b"):
        raw = _raw(tmp_path, data, name=name)
        raw["privacy"]["budget_epsilon"] = 0.0  # replaced below
        recipes.append(raw)
    # The budget fits one plan (6 steps) and not two: between eps(6) and eps(12).
    from llmdp.privacy.plan import DPPlan

    info = json.load(open(tmp_path / "probe" / "p" / "plan.json"))
    p = DPPlan.from_dict(info["plan"])
    acc = lambda k: dp_accounting.pld.PLDAccountant(  # noqa: E731
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE).compose(p.step_event(), k).get_epsilon(p.accountant_delta)
    budget = (acc(6) + acc(12)) / 2
    for raw in recipes:
        raw["privacy"]["budget_epsilon"] = budget
        raw["scaling"] = {"num_workers": 1, "cpus_per_worker": 1}
        path = tmp_path / f"{raw['output']['name']}.yaml"
        path.write_text(yaml.safe_dump(raw))
        procs.append(Command(["train", str(path)], env=env, cwd=REPO,
                             log=tmp_path / f"{raw['output']['name']}.log"))
    codes = [pr.wait(timeout=600) for pr in procs]
    outs = [pr.output() for pr in procs]
    assert sorted(codes) == [0, 2], (codes, outs)
    loser = outs[codes.index(2)]
    winner_name = "ab"[codes.index(0)]
    assert "privacy.budget_epsilon=" in loser and "hold" in loser and "Traceback" not in loser, loser
    winner = json.load(open(tmp_path / "runs" / winner_name / "privacy_report.json"))
    assert winner["status"] == "complete" and winner["steps"] == 6
    assert winner["run_id"] in loser  # the refusal names the run holding the budget
    ds = "path:" + os.path.realpath(data)
    from llmdp.privacy.ledger.database import LedgerDB

    recs = LedgerDB(str(tmp_path / "home" / "ledger.sqlite")).records(ds)
    steps = sum(r["count"] for r in recs if r["kind"] == "release")
    assert steps == 6 and acc(steps) <= budget
    assert not [r for r in recs if r["kind"] == "hold" and r["run_id"] != winner["run_id"]]
    assert [r["kind"] for r in recs if r["run_id"] == winner["run_id"]][-1] == "hold_end"
    assert os.path.isdir(tmp_path / "runs" / winner_name / "model")


def test_a_damaged_run_ledger_stops_a_resume_before_any_release(tmp_path, monkeypatch, capsys):
    """A run whose ledger.jsonl lost its last line (the dataset ledger still has it) is not
    resumed: `llmdp train` exits 2 with the message and the repair command, and records
    nothing; after `llmdp privacy ledger repair RUN_DIR` it resumes."""
    import yaml

    from llmdp.cli import main

    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    data = write_notes(tmp_path / "notes.jsonl", 30)
    raw = _raw(tmp_path, data)
    prep = _prepare(recipe_from_dict(raw))
    simulate_steps(prep, steps=4)  # two blocks of 2
    path = os.path.join(prep.run_dir, "ledger.jsonl")
    lines = open(path).read().splitlines(keepends=True)
    open(path, "w").write("".join(lines[:-1]))
    before = dataset_records(None, dataset_id=prep.ledger.service["dataset_id"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "lacks 1 of this run's record(s)" in err and "llmdp privacy ledger repair" in err
    assert "Traceback" not in err
    assert dataset_records(None, dataset_id=prep.ledger.service["dataset_id"]) == before
    assert main(["privacy", "ledger", "repair", prep.run_dir]) == 0
    assert Ledger(path).total_count() == 4
    _prepare(recipe_from_dict(raw))  # accepted again


def test_a_removed_lock_file_cannot_be_held_twice(tmp_path, monkeypatch):
    """Issue 30 item 12: `RunLock.release(remove=True)` deletes the file while holding it. A
    launch that opened the old file just before and flocks it after the removal must not
    think it holds the run: it re-checks the name and takes the new file, and a third
    launch is then refused."""
    import fcntl

    from llmdp._fs import RunDirInUse, RunLock

    run_dir = str(tmp_path / "runs" / "t")
    first = RunLock(run_dir)
    real = fcntl.flock
    fired = []

    def flock_after_removal(fd, op):
        if not fired:  # the contender's first flock: the holder removes and releases first
            fired.append(fd)
            first.release(remove=True)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_removal)
    second = RunLock(run_dir)
    monkeypatch.setattr(fcntl, "flock", real)
    assert os.path.exists(second.path)
    assert os.stat(second.path).st_ino == os.fstat(second._fd).st_ino
    with pytest.raises(RunDirInUse):
        RunLock(run_dir)
    second.release(remove=True)
    assert not os.path.exists(second.path)
    RunLock(run_dir).release()


def test_budget_lines_name_the_unit_the_total_after_the_run_and_the_holders(tmp_path, monkeypatch):
    """Issue 30 item 7: the budget line names the privacy unit and the dataset's ε once the
    run has released what it holds; a refusal names the live runs by output.name; a new
    ledger is said."""
    import re

    from llmdp._fs import RunLock
    from llmdp.privacy.ledger.service import BudgetError
    from llmdp.run.launch import prepare

    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home"))
    data = write_notes(tmp_path / "notes.jsonl", 30)
    lines = []
    cfg_a = recipe_from_dict(_raw(tmp_path, data, name="alpha", budget_epsilon=5.0))
    lock = RunLock(cfg_a.run_dir)
    a = prepare(cfg_a, log=lines.append, lock=lock)
    assert sum("a NEW dataset ledger was started" in x for x in lines) == 1, lines
    line = next(x for x in lines if x.startswith("budget:"))
    assert "for the privacy unit 'a sequence of 24 tokens" in line, line
    after = float(re.search(r"after it the dataset is at ε = ([\d.]+) of 5", line).group(1))
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(a.plan.step_event(), a.plan.steps)
    assert after == pytest.approx(acc.get_epsilon(a.plan.accountant_delta), abs=2e-4)
    lines.clear()
    raw_b = _raw(tmp_path, data, name="beta", budget_epsilon=5.0, noise_multiplier=0.5)
    raw_b["train"]["steps"] = 3000  # far more than what is left of 5
    cfg_b = recipe_from_dict(raw_b)
    with pytest.raises(BudgetError) as e:
        prepare(cfg_b, log=lines.append)
    assert f"the live run(s) alpha (run {a.run_id}) hold" in str(e.value), str(e.value)
    assert not any("a NEW dataset ledger" in x for x in lines)
    lock.release()
