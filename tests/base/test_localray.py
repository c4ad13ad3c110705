"""The local Ray's watchdog and the relaunch's cleanup (`llmdp.base.localray`), without Ray:
stand-in process trees, the watchdog run as the driver runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from llmdp.base import localray as _localray
from llmdp.base.localray import RECORD, reap_leftovers

REPO = Path(__file__).resolve().parents[2]
GUARD_S = 60  # a guard against a hung test, never an assertion about speed


def _tree() -> tuple[subprocess.Popen, psutil.Process]:
    """A stand-in for a Ray process with a child of its own (an agent): (root, grandchild)."""
    root = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    deadline = time.monotonic() + GUARD_S
    while not psutil.Process(root.pid).children():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return root, psutil.Process(root.pid).children()[0]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _dead_process() -> tuple[int, float]:
    p = subprocess.Popen(["true"])
    created = psutil.Process(p.pid).create_time()
    p.wait()
    return p.pid, created


def _wait(cond) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_watchdog_records_the_tree_and_ends_it_when_the_pipe_closes(tmp_path):
    root, grandchild = _tree()
    record = tmp_path / RECORD
    read_fd, write_fd = os.pipe()
    me = psutil.Process()
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "llmdp.base.localray", str(record), str(me.pid),
         f"{root.pid}:{psutil.Process(root.pid).create_time()!r}"],
        stdin=read_fd, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    os.close(read_fd)
    try:
        # While the driver (this test) lives: the root and the grandchild it started, recorded.
        _wait(lambda: record.exists() and grandchild.pid in
              [p[0] for p in json.loads(record.read_text())["processes"]])
        rec = json.loads(record.read_text())
        assert rec["driver"][0] == me.pid and rec["watchdog"][0] == watchdog.pid
        assert rec["host"] == socket.gethostname()
        assert _alive(grandchild) and root.poll() is None
        os.close(write_fd)  # what the driver's death does
        write_fd = None
        watchdog.wait(timeout=GUARD_S)
        root.wait(timeout=GUARD_S)
        assert not _alive(grandchild)  # the orphan too, not only its parent
        assert not record.exists()
    finally:
        if write_fd is not None:
            os.close(write_fd)
        for p in (root, watchdog):
            if p.poll() is None:
                p.kill()
        if _alive(grandchild):
            grandchild.kill()


def test_the_watchdog_reads_the_process_table_once_per_look_whatever_the_roots(tmp_path, monkeypatch):
    """One look (``_Descendants``) reads /proc once for all the roots (Ray starts five or
    more; psutil's ``children`` reads it once per root, and psutil's ``process_iter`` is
    not used either) and finds what psutil's ``children(recursive=True)`` finds below each
    live root: not a zombie, nothing below a root that is gone or whose pid now names
    another process; without /proc, psutil finds the same."""
    (root1, grandchild1), (root2, grandchild2) = _tree(), _tree()
    # a root whose child exited unreaped: a zombie, gone for the watchdog
    # (os.fork, not subprocess: a dropped Popen polls its child once when it is collected,
    # and reaps it if it has already exited, as it may on a loaded machine)
    zroot = subprocess.Popen([sys.executable, "-c", "import os, time\n"
                              "if os.fork() == 0:\n    os._exit(0)\ntime.sleep(600)"],
                             start_new_session=True)
    try:
        _wait(lambda: [c for c in psutil.Process(zroot.pid).children()
                       if c.status() == psutil.STATUS_ZOMBIE])
        roots = [(r.pid, psutil.Process(r.pid).create_time()) for r in (root1, root2, zroot)]
        expected = {(c.pid, c.create_time()) for r in (root1, root2)
                    for c in psutil.Process(r.pid).children(recursive=True)}
        assert {grandchild1.pid, grandchild2.pid} <= {pid for pid, _ in expected}
        scans = []
        real_iter = psutil.process_iter
        monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: scans.append(1) or real_iter(*a, **k))
        real_children = psutil.Process.children
        monkeypatch.setattr(psutil.Process, "children", lambda *a, **k: pytest.fail("a scan per root"))
        gone, reused = _dead_process(), (root1.pid, roots[0][1] - 100.0)
        look = _localray._Descendants()
        assert set(look(roots + [gone])) == expected
        assert set(look(roots)) == expected and not scans  # /proc read directly, once a look
        assert look([gone, reused]) == []
        # where there is no /proc: psutil, the same processes
        monkeypatch.setattr(_localray, "_proc_table", lambda: None)
        monkeypatch.setattr(psutil.Process, "children", real_children)
        assert set(look(roots + [gone])) == expected
    finally:
        for p in (root1, root2, zroot):
            p.kill()
            p.wait()
        for g in (grandchild1, grandchild2):
            if _alive(g):
                g.kill()


def _record(path: Path, procs, driver, host=None) -> None:
    path.write_text(json.dumps({"host": host or socket.gethostname(), "driver": list(driver),
                                "processes": [[p.pid, p.create_time(), p.name()] for p in procs]}))


@pytest.fixture
def stray():
    """A process left running by a 'dead launch'; killed at the end whatever happens."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield psutil.Process(p.pid)
    if p.poll() is None:
        p.kill()
    p.wait()


def test_a_relaunch_ends_what_a_dead_launch_left_and_nothing_else(tmp_path, stray):
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        # The record's second process is a reused pid: alive, but started at another time.
        (tmp_path / RECORD).write_text(json.dumps({
            "host": socket.gethostname(), "driver": list(_dead_process()),
            "processes": [[stray.pid, stray.create_time(), "ray::DashboardAgent"],
                          [other.pid, psutil.Process(other.pid).create_time() - 100.0, "raylet"]]}))
        lines = []
        assert reap_leftovers(str(tmp_path), log=lines.append) == [stray.pid]
        assert not _alive(stray) and other.poll() is None
        assert f"PIDs {stray.pid}" in lines[0] and not (tmp_path / RECORD).exists()
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("case", ["driver alive", "other host"])
def test_a_record_of_a_live_driver_or_another_host_is_left_alone(tmp_path, stray, case):
    me = psutil.Process()
    driver = (me.pid, me.create_time()) if case == "driver alive" else _dead_process()
    _record(tmp_path / RECORD, [stray], driver, host="elsewhere" if case == "other host" else None)
    assert reap_leftovers(str(tmp_path), log=lambda m: None) == []
    assert _alive(stray) and (tmp_path / RECORD).exists()


def test_no_record_nothing_to_do(tmp_path):
    assert reap_leftovers(str(tmp_path), log=lambda m: pytest.fail(m)) == []
    assert _localray.kill_recorded([]) == []


def test_a_runs_environment_carries_its_own_test_switches_and_clears_an_earlier_runs(monkeypatch):
    """A Ray that outlives a run (a sweep's, a test session's) merges each run's env_vars into
    its own: a switch a run does not set is given as empty, so an earlier run's cannot leak
    into it; the offline settings are always there."""
    for k in _localray.TEST_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LLMDP_TEST_PLANT", "noise-off")
    first = _localray.run_env()
    assert first["LLMDP_TEST_PLANT"] == "noise-off" and first["LLMDP_FAULT"] == ""
    monkeypatch.delenv("LLMDP_TEST_PLANT")
    later = _localray.run_env()
    assert {k: later[k] for k in _localray.TEST_ENV} == dict.fromkeys(_localray.TEST_ENV, "")
    assert {k: later[k] for k in _localray.WORKER_ENV} == _localray.WORKER_ENV


def test_a_runs_environment_sets_the_allocator_unless_the_driver_does(monkeypatch):
    """glibc's allocator settings (``ALLOCATOR_ENV``) are in every run's environment; a key
    the driver's environment sets (its own choice, or a Ray job's runtime env, which Ray
    refuses to merge with a run's) is left out, so the driver's value is what workers get."""
    for k in _localray.ALLOCATOR_ENV:
        monkeypatch.delenv(k, raising=False)
    env = _localray.run_env()
    assert {k: env[k] for k in _localray.ALLOCATOR_ENV} == _localray.ALLOCATOR_ENV
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 32 << 20  # in bytes, as glibc reads it
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    env = _localray.run_env()
    assert "MALLOC_TRIM_THRESHOLD_" not in env and env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
def test_a_ray_worker_starts_with_the_allocator_settings(monkeypatch):
    """Given as a run gives its workers their environment (``runtime_env``), the settings are
    in the worker process's environment *at its start* (``/proc/self/environ``: what the
    process was exec'd with, which is when glibc reads them), not only in ``os.environ``."""
    import ray

    for k in _localray.ALLOCATOR_ENV:
        monkeypatch.delenv(k, raising=False)

    @ray.remote(num_cpus=0)
    def start_environment() -> dict:
        raw = Path("/proc/self/environ").read_bytes().split(b"\0")
        return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)

    got = ray.get(start_environment.options(runtime_env={"env_vars": _localray.run_env()}).remote())
    assert {k: got.get(k) for k in _localray.ALLOCATOR_ENV} == _localray.ALLOCATOR_ENV
