"""Lost nodes and lost drivers (issue 18, part 3), on Ray on this machine.

- A simulated multi-node cluster (`ray.cluster_utils.Cluster`): a head node with no CPU (the
  driver, its ledger actor and Ray Train's controller) and three 1-CPU worker nodes, so the
  two workers land on different nodes and one node stands by. The run is fsdp: its
  checkpoints are sharded (DCP), written by each worker on its node. A worker hangs after the
  ledger write of step 5; its whole node is killed; the restarted worker group runs on the
  survivor and the standby node, resumes from the step-3 checkpoint and completes, and
  every executed step is in the ledger. (The standby node is there from the start: Ray's
  `Cluster.add_node` installs a SIGTERM handler, so it cannot be called from the thread that
  kills the node while the main thread runs the training.)
- `llmdp train` (the CLI, its own local Ray) SIGKILLed while its worker hangs at step 5, then
  launched again: no Ray process of the killed driver survives it, the relaunch resumes
  from the checkpoint and completes with every executed step counted, its budget hold
  replaces the dead launch's, and no Ray process of the relaunch survives it either.

A worker hangs at a chosen step through the loop's test hook (``LLMDP_FAULT=...,action=hang``),
so the node or the driver is killed at a known point, not at a race with the clock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import dp_accounting
import pytest

from llmdp.cli import main
from tests.helpers import TINY_MODEL_YAML, Command, dataset_records, tiny_tokenizer_dir, write_notes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

RECIPE = TINY_MODEL_YAML + """data: {{path: notes.jsonl, sequence_length: 32}}
privacy: {{noise_multiplier: 1.0, max_grad_norm: 0.5}}  # (sigma given: no calibration per launch)
optim: {{name: sgd, lr: 0.5, schedule: constant}}
train: {{expected_batch_size: 12, steps: 6, physical_batch_size: 4, checkpoint_every: 3,
         max_failures: 1}}
scaling: {{num_workers: 2, cpus_per_worker: 1}}
output: {{dir: runs, name: {name}}}
"""

HANG_STEP = 4  # 0-based: the worker hangs in step 5, after its ledger write; checkpoint at 3
GUARD_S = 300  # a guard against a hung test, never an assertion about speed


def _write_recipe(tmp_path: Path, name: str) -> None:
    write_notes(tmp_path / "notes.jsonl", 80)
    (tmp_path / "r.yaml").write_text(RECIPE.format(tok=tiny_tokenizer_dir(), name=name))


def _wait_for(what: str, cond, stop: threading.Event | None = None) -> bool:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        if stop is not None and stop.is_set():
            return False
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)
    return True


def _checkpoint_registered(run_dir: Path) -> bool:
    """Ray Train has registered a checkpoint (its snapshot names one): a restart or a
    relaunch resumes from it."""
    try:
        snap = json.loads((run_dir / "checkpoints" / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(snap.get("latest_checkpoint_result"))


def _check_the_resumed_run(run_dir: Path, capsys) -> dict:
    """Resumed from the step-3 checkpoint, completed; every executed step (re-executed ones
    included) has its release in the ledger; the report's ε is dp-accounting's on the
    recorded releases. Returns the report."""
    from llmdp.privacy.ledger.records import Ledger, is_step_release

    metrics = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics if m.get("event") == "start"] == [0, 3]
    executed = Counter(m["step"] - 1 for m in metrics if "event" not in m)
    # the first launch ran steps 0-3, the second 3-5: step 3 twice
    assert executed == Counter({0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1})
    releases = [r for r in Ledger(run_dir / "ledger.jsonl").records() if is_step_release(r)]
    covered = Counter(s for r in releases for s in range(r["first_step"], r["first_step"] + r["count"]))
    assert all(covered[s] >= n for s, n in executed.items()), (executed, covered)
    # blocks of 3, write-ahead: [0,3) and [3,6) by the first attempt, [3,6) again by the second
    total = sum(r["count"] for r in releases)
    assert total == 9 and len({r["attempt"] for r in releases}) == 2

    capsys.readouterr()
    assert main(["privacy", "report", str(run_dir), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "complete" and rep["steps_completed"] == 6 and rep["steps"] == total
    assert rep["attempts"] == 2 and rep["steps_lost_to_failures"] == 3
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        rep["sampling_probability"], dp_accounting.GaussianDpEvent(rep["noise_multiplier"])), total)
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert rep["epsilon"] == pytest.approx(acc.compose(event).get_epsilon(rep["delta_accountant"]), rel=1e-6)
    assert (run_dir / "model").is_dir()
    return rep


# --------------------------------------------------------------------------- a lost node


@pytest.fixture
def cluster(monkeypatch):
    """Head (0 CPUs) + three 1-CPU worker nodes; always shut down. Ray's temp dir is this
    test's own: the cluster's address file there is found by no other `ray.init()` on the
    machine (short: Unix socket paths are limited)."""
    import ray
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="llmdp-ray-")
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(3):
            c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _workers():
    """Ray Train's worker actors (alive or dead), in start order."""
    import ray._private.state as state

    found = [a for a in state.actors().values() if a["ActorClassName"] == "RayTrainWorker"]
    return sorted(found, key=lambda a: a["StartTime"])


def test_a_killed_node_resumes_on_a_standby_node_and_counts_every_step(
        cluster, tmp_path, monkeypatch, capsys):
    import ray

    monkeypatch.chdir(tmp_path)
    _write_recipe(tmp_path, "nodes")
    run_dir = tmp_path / "runs" / "nodes"
    marker = tmp_path / "hung"
    # The fault reaches the run's workers through the run's own environment
    # (localray.run_env), as any test switch does.
    monkeypatch.setenv("LLMDP_FAULT", f"step={HANG_STEP},rank=1,marker={marker},action=hang")
    # The launch joins the cluster itself, as `llmdp train` on a cluster node does.
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    head = cluster.head_node.node_id

    stop, lost = threading.Event(), {}

    def kill_the_hung_workers_node():
        try:
            if not _wait_for("the hang and a registered checkpoint",
                             lambda: marker.exists() and _checkpoint_registered(run_dir), stop):
                return
            pid = json.loads(marker.read_text())["pid"]
            node_id = next(a["Address"]["NodeID"] for a in _workers() if a["Pid"] == pid)
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            cluster.remove_node(node, allow_graceful=False)  # the whole node: raylet, workers
            lost["node"] = node_id
        except BaseException as e:  # noqa: BLE001 - reported below; the run is aborted
            lost["error"] = e
            # llmdp's handler: the first Ctrl-C waits for the step (hung), the second aborts
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGINT)

    killer = threading.Thread(target=kill_the_hung_workers_node, daemon=True)
    killer.start()
    try:
        # fsdp: the checkpoint is sharded (each worker writes its shards on its own node,
        # Ray Train gathers the folders into one), and the restarted group reshards it.
        rc = main(["train", "r.yaml", "scaling.strategy=fsdp"])
    except KeyboardInterrupt:  # aborted by the thread (not pytest's own Ctrl-C: reported below)
        rc = None
    finally:
        stop.set()
        killer.join(timeout=60)
    assert "error" not in lost, lost.get("error")
    assert rc == 0 and lost.get("node"), "the node was killed mid-run, and the run completed"
    assert not ray.is_initialized()  # the launch left the cluster it joined ...
    ray.init(address=cluster.address)
    import ray._private.state as state

    actors = list(state.actors().values())
    # ... which kept Ray Train's placement-group cleaner and preemption watcher (only a
    # local Ray of llmdp's goes without them); the driver, hence its ledger actor, was on
    # the head, where no worker fits (0 CPUs)
    assert {"PlacementGroupCleaner", "PreemptionWatcher"} <= {a["ActorClassName"] for a in actors}
    assert [a["Address"]["NodeID"] for a in actors if a["ActorClassName"] == "LedgerService"] == [head]

    workers = _workers()
    assert len(workers) == 4  # two attempts of two workers
    first = [w["Address"]["NodeID"] for w in workers[:2]]
    second = [w["Address"]["NodeID"] for w in workers[2:]]
    # each attempt's workers on two different worker nodes; the lost one hosted a first-attempt
    # worker, and the restart ran on the survivor and the standby node
    standby = {n.node_id for n in cluster.worker_nodes} - set(first)
    assert len(set(first)) == 2 and head not in first and lost["node"] in first
    assert len(standby) == 1 and set(second) == (set(first) - {lost["node"]}) | standby
    _check_the_resumed_run(run_dir, capsys)
    from llmdp.hub.export import verify_run
    from llmdp.record import checkpoints
    from llmdp.record.rundir import RunDir

    last = RunDir(run_dir).latest_checkpoint()
    assert checkpoints.read_meta(last)["step"] == 6
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", checkpoints.META} <= set(os.listdir(last))
    problems, _ = verify_run(str(run_dir))  # the final model is the last checkpoint's
    assert not any("checkpoint" in p for p in problems), problems


# --------------------------------------------------------------------------- a lost driver


def _live(procs: dict[int, tuple[float, str]]) -> list[str]:
    """The processes of ``procs`` (pid -> (start time, name)) still alive as recorded."""
    import psutil

    out = []
    for pid, (created, name) in procs.items():
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - created) < 1e-3:
                out.append(f"{pid} {name}")
        except psutil.Error:
            pass
    return out


def _remember_descendants(pid: int, seen: dict[int, tuple[float, str]]) -> None:
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for k in kids:
        try:
            # The process name and its whole command line, never cut: under a long checkout
            # path the executable's path alone is longer than any fixed prefix.
            seen.setdefault(k.pid, (k.create_time(), " ".join([k.name(), *k.cmdline()])))
        except psutil.Error:
            pass


def _gone_within_grace(procs, grace_s: float = 20.0) -> list[str]:
    """Survivors of ``procs`` after a short grace period (Ray's own shutdown paths included;
    before the watchdog, its two agents lived about a minute longer)."""
    deadline = time.monotonic() + grace_s
    while _live(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _live(procs)


def _launch(tmp_path: Path, env: dict, seen: dict, until=None) -> Command:
    """`llmdp train r.yaml` as its own process; remembers every process under it (every Ray
    process it starts) until it exits or ``until()`` holds."""
    # With a budget: the relaunch holds its remaining steps again. One worker: the driver is
    # what this test loses.
    proc = Command(["train", "r.yaml", "privacy.budget_epsilon=50", "scaling.num_workers=1"],
                   cwd=tmp_path, env=env, log=tmp_path / "driver.log")
    deadline = time.monotonic() + GUARD_S
    while proc.poll() is None and not (until is not None and until()):
        _remember_descendants(proc.pid, seen)
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the driver ran past the guard")
        time.sleep(0.2)
    _remember_descendants(proc.pid, seen)
    return proc


def test_a_sigkilled_driver_leaves_no_ray_process_and_its_relaunch_resumes(tmp_path, capsys):
    from llmdp.base.localray import RECORD
    from llmdp.privacy.ledger.budget import live_holds

    _write_recipe(tmp_path, "driver")
    run_dir = tmp_path / "runs" / "driver"
    marker = tmp_path / "hung"
    ray_tmp = tempfile.mkdtemp(prefix="llmdp-ray-")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "RAY_TMPDIR": ray_tmp,  # its own Ray: nothing else on the machine joins it
           "LLMDP_FAULT": f"step={HANG_STEP},rank=0,marker={marker},action=hang"}
    env.pop("RAY_ADDRESS", None)
    first: dict = {}
    again: dict = {}
    try:
        driver = _launch(tmp_path, env, first,
                         until=lambda: marker.exists() and _checkpoint_registered(run_dir))
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        assert any("raylet" in name for _, name in first.values()), sorted(n for _, n in first.values())
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        survivors = _gone_within_grace(first)
        assert not survivors, f"Ray processes of the SIGKILLed driver survived it: {survivors}"

        # The same command again (the hook fires once: the marker exists).
        relaunch = _launch(tmp_path, env, again)
        log = (tmp_path / "driver.log").read_text()
        assert relaunch.returncode == 0, log[-3000:]
        assert "resuming from step 3 of 6 (attempt 2)" in log
        survivors = _gone_within_grace(again)
        assert not survivors, f"Ray processes of the relaunch survived it: {survivors}"
        assert not (run_dir / RECORD).exists()
    finally:
        for procs in (first, again):
            for p in _live(procs):
                os.kill(int(p.split()[0]), signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)

    _check_the_resumed_run(run_dir, capsys)
    # The relaunch's hold replaced the dead launch's (which wrote no hold_end) and ended
    # with it: nothing of the budget stays held.
    records = dataset_records(None, tmp_path / "notes.jsonl")
    assert [r["run_id"] for r in records if r["kind"] == "hold"] == [json.loads(
        (run_dir / "plan.json").read_text())["run_id"]] * 2
    assert live_holds(records) == {}
