"""The progress bar (issue 30 item 13): its last `eval` / `dp_eval` are the report's last
rows (the final evaluation comes after the last step line), and the report's held-out table
has one row per step."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tqdm import tqdm

from llmdp.evaluation.report import evaluation_section
from llmdp.privacy.mechanism import Blt
from llmdp.run.progress import Progress


def _metrics(path, lines) -> None:
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))


def test_the_last_evaluations_shown_are_the_reports(tmp_path):
    lines = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "loss": 7.0},
             {"step": 1, "train_loss": 6.0}, {"step": 2, "train_loss": 5.5},
             {"event": "eval", "step": 2, "loss": 5.4},
             # the run's final evaluations, written after its last step line
             {"event": "eval", "step": 2, "loss": 5.3},
             {"event": "dp_eval", "step": 2, "loss": 5.25, "loss_std": 0.01}]
    _metrics(tmp_path / "metrics.jsonl", lines)
    progress = Progress(str(tmp_path / "metrics.jsonl"), SimpleNamespace(steps=2, dp=False))
    progress._offset = 0
    bar, shown = tqdm(total=2, disable=True), {}
    progress._read_metrics(bar, shown)
    assert shown["post"]["eval"] == "5.300" and shown["post"]["dp_eval"] == "5.250"
    assert shown["post"]["loss"] == "5.500"
    section = evaluation_section(str(tmp_path), {"eval_data": "private"}, lines, [])
    assert [r["step"] for r in section["internal"]] == [0, 2]  # one row per step
    assert section["internal"][-1]["loss"] == 5.3 and section["dp"][-1]["loss"] == 5.25



def test_the_bar_and_the_plan_line_name_the_mechanism_and_why_b_changed(tmp_path, capsys):
    """Issue 51 item 10: under blt (banded-mf) the bar is labelled blt, not dp-sgd; a
    fixed-cycle sampler's B (N/cycle: 31.33 for N = 94 and B = 32) is explained where the
    plan line prints it; B as asked needs no note."""
    from llmdp.privacy.plan import make_plan
    from llmdp.run.progress import batch_note, mechanism_label

    blt = make_plan(dataset_size=94, expected_batch_size=32, max_grad_norm=1.0, steps=6,
                    delta=1e-4, noise_multiplier=2.0, sampler="fixed-cycle",
                    mechanism=Blt(buffers=2, strategy_cache=str(tmp_path / "mf")))
    sgd = make_plan(dataset_size=94, expected_batch_size=32, max_grad_norm=1.0, steps=6,
                    delta=1e-4, noise_multiplier=2.0)
    assert mechanism_label(blt) == "blt" and mechanism_label(sgd) == "dp-sgd"
    assert abs(blt.expected_batch_size - 94 / 3) < 1e-12
    note = batch_note(blt, 32)
    assert "fixed-cycle" in note and "3 groups" in note and "31.33" in note
    assert "train.expected_batch_size = 32" in note
    assert batch_note(sgd, 32) == ""
    (tmp_path / "metrics.jsonl").write_text("")
    progress = Progress(str(tmp_path / "metrics.jsonl"), blt, ledger_path=str(tmp_path / "none"))
    progress.stop.set()
    progress.run()
    err = capsys.readouterr()
    assert "blt" in err.out + err.err and "dp-sgd" not in err.out + err.err


def test_the_first_ctrl_c_says_what_the_stop_keeps(tmp_path):
    """Issue 51 item 10: the first Ctrl-C's message is true of the stop: after the current
    step, not at the next checkpoint boundary; under a correlated mechanism the ledger keeps
    the rounds begun whole (it said "only the steps that ran" whatever the mechanism)."""
    from llmdp.privacy.plan import make_plan
    from llmdp.run.interrupt import GracefulInterrupt

    common = dict(dataset_size=94, expected_batch_size=32, max_grad_norm=1.0, steps=6,
                  delta=1e-4, noise_multiplier=2.0)
    blt = make_plan(**common, sampler="fixed-cycle",
                    mechanism=Blt(buffers=2, strategy_cache=str(tmp_path / "mf")))
    said = GracefulInterrupt(str(tmp_path), print, blt).first_message()
    assert "after the current step, not at the next checkpoint" in said
    assert "every round of 3 steps begun, whole" in said and "only the steps that ran" not in said
    sgd = GracefulInterrupt(str(tmp_path), print, make_plan(**common)).first_message()
    assert "Ctrl-C: stopping after the current step" in sgd  # test_interrupt's end-to-end check
    assert "the ledger keeps only the steps that ran" in sgd and "round" not in sgd
