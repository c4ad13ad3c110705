"""The progress bar (issue 30 item 13): its last `eval` / `dp_eval` are the report's last
rows (the final evaluation comes after the last step line), and the report's held-out table
has one row per step."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tqdm import tqdm

from llmdp.evaluation.report import evaluation_section
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

