"""Ctrl-C (issue 30 item 1): the first stops a Ray run after a whole step, checkpoints it and
voids in the ledger the reserved steps that never ran; the same command resumes it, and the
run finishes at its target with ε = dp-accounting on the steps that ran. A real SIGINT to
the launch's process group (a terminal's Ctrl-C), at step 0, in the middle of a reserved
block and during the workers' finalization; the second Ctrl-C (stop at once) on the
driver's handler itself."""

from __future__ import annotations

import json
import os
import signal
import time

import dp_accounting
import pytest

from tests.helpers import TINY_MODEL_YAML, Command, tiny_tokenizer_dir, write_notes

RECIPE = TINY_MODEL_YAML + """data: {{path: notes.jsonl, sequence_length: 32}}
privacy: {{target_epsilon: 4.0, max_grad_norm: 0.5, delta: 1.0e-5, accountant: rdp}}  # (RDP: planned at once, 3 launches; PLD: test_e2e)
optim: {{name: sgd, lr: 0.5, schedule: constant}}
train: {{expected_batch_size: 12, steps: 24, physical_batch_size: 4, checkpoint_every: 10}}
scaling: {{num_workers: 1}}
output: {{dir: runs, name: ctrl-c}}
"""


def _launch_and_ctrl_c(tmp_path, at: str) -> tuple[int, str]:
    """`llmdp train` in its own session, paused by rank 0 at ``at`` (a step, or "final")
    until the first Ctrl-C: a SIGINT to the whole process group, as a terminal sends it."""
    marker = tmp_path / f"paused-at-{at}"
    env = {**os.environ, "LLMDP_TEST_PAUSE": f"at={at},marker={marker}"}
    p = Command(["train", "r.yaml"], cwd=tmp_path, env=env, new_session=True,
                log=tmp_path / f"launch-{at}.log")
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert p.poll() is None, f"the launch ended before step {at}:\n{p.output()}"
            assert time.monotonic() < deadline, f"no pause at {at} within 600 s"
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, p.output()


def _ledger(run_dir) -> list[dict]:
    path = run_dir / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _net_steps(records) -> int:
    """The steps that ran: the release counts less the voided steps (computed here, on the
    raw lines, not by llmdp's code)."""
    released = sum(r["count"] for r in records if r["kind"] == "release")
    return released - sum(r["steps"] for r in records if r["kind"] == "void")


def _report(run_dir) -> dict:
    return json.loads((run_dir / "privacy_report.json").read_text())


@pytest.mark.slow
def test_ctrl_c_at_step_0_mid_block_and_in_finalization_each_resumes_to_its_target(tmp_path):
    from llmdp.privacy.accounting.accountant import RDP_ORDERS
    from llmdp.privacy.accounting.events import event_from_json
    from llmdp.record import checkpoints
    from llmdp.record.rundir import STOP_REQUEST, RunDir

    write_notes(tmp_path / "notes.jsonl", 120)
    (tmp_path / "r.yaml").write_text(RECIPE.format(tok=tiny_tokenizer_dir()))
    run_dir = tmp_path / "runs" / "ctrl-c"

    # 1. At step 0: nothing was reserved, nothing is charged, nothing to resume from.
    rc, out = _launch_and_ctrl_c(tmp_path, "0")
    assert rc == 130, out
    assert "Ctrl-C: stopping after the current step" in out
    assert "stopped by Ctrl-C after step 0 of 24; re-run the same command to resume" in out
    assert not [r for r in _ledger(run_dir) if r["kind"] in ("release", "void")]
    assert _report(run_dir)["status"] == "interrupted" and _report(run_dir)["steps"] == 0
    assert not (run_dir / STOP_REQUEST).exists()

    # 2. Mid-block: steps 10..19 were reserved in one record; 13..19 never ran and are void.
    rc, out = _launch_and_ctrl_c(tmp_path, "13")
    assert rc == 130, out
    assert "stopped by Ctrl-C after step 13 of 24" in out and "Traceback" not in out
    records = _ledger(run_dir)
    blocks = [(r["first_step"], r["count"]) for r in records if r["kind"] == "release"]
    voids = [r for r in records if r["kind"] == "void"]
    assert blocks == [(0, 10), (10, 10)]
    assert [(v["first_step"], v["steps"]) for v in voids] == [(13, 7)]
    assert voids[0]["release"] == records[[r["kind"] for r in records].index("release") + 1]["hash"]
    assert _net_steps(records) == 13
    report = _report(run_dir)
    assert report["status"] == "interrupted" and report["steps"] == 13 == report["steps_completed"]
    # two attempts, both stopped by a Ctrl-C (the first at step 0), no step lost
    assert report["attempts"] == 2 == report["interruptions"]
    assert report["steps_lost_to_failures"] == 0
    assert report["steps_voided"] == 7
    assert checkpoints.read_meta(RunDir(run_dir).latest_checkpoint())["step"] == 13

    # 3. During the workers' finalization (after the last step): the run finishes.
    rc, out = _launch_and_ctrl_c(tmp_path, "final")
    assert rc == 0, out
    assert "resuming from step 13 of 24" in out
    assert "Ctrl-C came after the last step: the run finished" in out
    records = _ledger(run_dir)
    report = _report(run_dir)
    assert report["status"] == "complete" and report["steps_completed"] == 24
    assert report["attempts"] == 3 and report["interruptions"] == 2
    assert _net_steps(records) == 24 == report["steps"]  # 31 reserved, 7 of them void
    assert sum(r["count"] for r in records if r["kind"] == "release") == 31
    assert (run_dir / "model").is_dir()

    # ε = dp-accounting on the 24 steps that ran (not the 31 reserved): the target's.
    events = {json.dumps(r["event"], sort_keys=True) for r in records if r["kind"] == "release"}
    assert len(events) == 1
    acc = dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS,
                                          neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(event_from_json(json.loads(events.pop())), 24))
    expected = acc.get_epsilon(report["delta_accountant"])
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert 3.99 < report["epsilon"] <= 4.0 + 1e-9


class _Controller:
    """What the handler calls on Ray Train's controller actor: ``abort.remote()``."""

    def __init__(self):
        self.aborted = 0
        self.abort = self

    def remote(self):
        self.aborted += 1
        return "an object ref"


def test_the_second_ctrl_c_stops_at_once(tmp_path, monkeypatch):
    """The driver's handler: the first SIGINT only writes the stop request (the workers stop
    after their step); the second aborts the run at once and raises KeyboardInterrupt."""
    import ray

    from llmdp.record.rundir import STOP_REQUEST
    from llmdp.run.launch import GracefulInterrupt

    (tmp_path / STOP_REQUEST).write_text("left by an earlier launch\n")
    lines = []
    gi = GracefulInterrupt(str(tmp_path), lines.append)
    assert not (tmp_path / STOP_REQUEST).exists() and not gi.requested
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: None)
    controller = _Controller()
    previous = signal.getsignal(signal.SIGINT)
    try:
        gi.install(controller)
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while not gi.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gi.requested and (tmp_path / STOP_REQUEST).exists() and controller.aborted == 0
        assert "Ctrl-C again to stop at once" in lines[-1]
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        assert controller.aborted == 1 and "stopping at once" in lines[-1]
    finally:
        signal.signal(signal.SIGINT, previous)
    gi.clear()
    assert not (tmp_path / STOP_REQUEST).exists()
