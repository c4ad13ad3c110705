"""The local Ray a driver starts, and what is left of it when that driver dies.

`llmdp train` on a machine that is not part of a Ray cluster starts its own Ray
(`ray.init(num_cpus=...)`). Ray starts its GCS server, raylet, dashboard and monitors as
children of the driver with the kernel's parent-death signal (``PR_SET_PDEATHSIG``,
SIGKILL), so they die with it even when the driver is SIGKILLed. The raylet starts two
agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) without that signal: they see
their raylet die, find no "SIGTERM" in its log, and before exiting publish "Raylet is
terminated. Termination is unexpected" to the GCS (``ray._private.process_watcher``:
``publish_error_to_driver`` with a 60 s timeout) -- a GCS that died with the driver. So a
SIGKILLed driver leaves both agents behind for about a minute, reparented to init.

:func:`start` starts the local Ray together with a watchdog process (this module, run
with ``-m``; standard library and psutil only). The watchdog reads a pipe whose only
write end the driver holds: EOF comes when the driver ends, whether it closed it
(:meth:`LocalRay.stop`, after ``ray.shutdown()``) or died. While the driver lives, the
watchdog records every descendant of the processes ``ray.init`` started (pid and start
time) in the run directory (:data:`RECORD`); at EOF it SIGKILLs those still alive, the
same pid *and* start time (a reused pid is never touched), and removes the record.

If the watchdog died too (the whole session was killed), the next launch of the same run
directory ends what the record names (:func:`reap_leftovers`): it holds the run's lock, so
the launch that wrote the record is gone. Only processes of a Ray that llmdp started
itself are recorded: a driver that joins a cluster (``RAY_ADDRESS``, a Ray job, ``ray
start``ed nodes) starts no watchdog and touches none of the cluster's processes.

:func:`start_local_ray` is how a launch starts it (the workers' environment, :data:`WORKER_ENV`,
and CPUs for its workers); :func:`shared_local_ray` keeps one for several launches in a row
(a sweep's trials). Both import Ray lazily: the watchdog itself needs neither.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

RECORD = "local_ray.json"  # in the run directory, while a local Ray of this run lives
_POLL_S = 0.5  # how often the watchdog looks for new Ray processes
_KILL_WAIT_S = 10.0  # how long a SIGKILLed process may take to disappear


def _psutil():
    import psutil  # lazy: only a driver that starts its own Ray needs it

    return psutil


def _key(p) -> tuple[int, float] | None:
    """(pid, start time) of a live process, None if it is gone (a zombie is gone)."""
    psutil = _psutil()
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.pid, p.create_time()
    except psutil.Error:
        return None


def _alive(pid: int, created: float):
    """The process ``pid`` if it is alive and started at ``created`` (not a reused pid)."""
    psutil = _psutil()
    try:
        p = psutil.Process(pid)
    except psutil.Error:
        return None
    k = _key(p)
    return p if k is not None and abs(k[1] - created) < 1e-3 else None


def _proc_table() -> dict[int, tuple[int, bool, int]] | None:
    """pid -> (parent pid, zombie, start in clock ticks since boot) of every process, from
    one pass over /proc/*/stat; None where there is no /proc (macOS: psutil instead)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # gone, or not ours to read
            continue
        # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses
        rest = data[data.rfind(b")") + 2:].split()
        try:
            table[int(name)] = (int(rest[1]), rest[0] == b"Z", int(rest[19]))
        except (IndexError, ValueError):
            continue
    return table


class _Descendants:
    """The live processes below the watchdog's roots, looked for every ``_POLL_S``.

    psutil's ``children(recursive=True)`` reads all of /proc once per call: once per root
    (Ray starts five or more) at every look, ~10 ms of a core a look on a machine with a
    hundred processes, more on a busy one, for as long as the Ray lives. Here one look
    reads each /proc/PID/stat once; a process's start time (psutil's ``create_time``, what
    the record holds and ``kill_recorded`` compares) is asked of psutil once per process,
    kept under its pid and start ticks (a reused pid has other ticks). A process is
    followed below its parent only if it started no earlier (a younger parent is a reused
    pid); a zombie is gone, and left out."""

    def __init__(self):
        self._created: dict[tuple[int, int], float | None] = {}

    def _created_at(self, pid: int, ticks: int) -> float | None:
        key = (pid, ticks)
        if key not in self._created:
            psutil = _psutil()
            try:
                self._created[key] = psutil.Process(pid).create_time()
            except psutil.Error:
                self._created[key] = None
        return self._created[key]

    def __call__(self, roots: list[tuple[int, float]]) -> list[tuple[int, float]]:
        table = _proc_table()
        if table is None:
            return _descendants_psutil(roots)
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            kids.setdefault(ppid, []).append(pid)
        # start times of processes gone since the last look are not kept
        self._created = {k: v for k, v in self._created.items() if k[0] in table and table[k[0]][2] == k[1]}
        live = []
        for pid, ct in roots:
            if pid in table and not table[pid][1]:
                made = self._created_at(pid, table[pid][2])
                if made is not None and abs(made - ct) < 1e-3:
                    live.append(pid)
        out, todo, met = [], list(live), set(live)
        while todo:
            parent = todo.pop()
            for pid in kids.get(parent, ()):
                if pid in met or table[pid][2] < table[parent][2]:
                    continue
                met.add(pid)
                todo.append(pid)
                if not table[pid][1] and (made := self._created_at(pid, table[pid][2])) is not None:
                    out.append((pid, made))
        return out


def _descendants_psutil(roots: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``_Descendants`` where there is no /proc: psutil, one read of the table per root."""
    psutil = _psutil()
    out = []
    for pid, ct in roots:
        p = _alive(pid, ct)
        if p is None:
            continue
        try:
            kids = p.children(recursive=True)
        except psutil.Error:
            continue
        out.extend(filter(None, map(_key, kids)))
    return out


def _write_record(path: str, record: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def kill_recorded(processes: list[list]) -> list[int]:
    """SIGKILL every ``[pid, start time, name]`` still alive as recorded; wait for them to
    go. Returns the pids that were killed."""
    psutil = _psutil()
    procs = [p for p in (_alive(int(pid), float(ct)) for pid, ct, *_ in processes) if p is not None]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(procs)
    return [p.pid for p in procs]


def _wait_gone(procs) -> None:
    """Until each of ``procs`` is gone or a zombie (whose parent, often init, reaps it), at
    most ``_KILL_WAIT_S``."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while any(_key(p) is not None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


# Ray's module that logs, on every local `ray.init`, "Token authentication is enabled for
# this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ...": a notice about Ray's own
# default (a local cluster that llmdp starts and stops), nothing a user of llmdp acts on.
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_RAY_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropRayAuthNotice(logging.Filter):
    """Drops that one record; every other Ray warning (the security warning "Token
    authentication is disabled" included) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_RAY_AUTH_NOTICE)


def quiet_ray_notices() -> None:
    """Hide Ray's token-authentication notice from llmdp's users (idempotent). A filter on
    Ray's logger, not RAY_AUTH_MODE: the authentication mode stays Ray's choice."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    if not any(isinstance(f, _DropRayAuthNotice) for f in logger.filters):
        logger.addFilter(_DropRayAuthNotice())


# ------------------------------------------------------------------------ the driver side


class LocalRay:
    """The watchdog of the local Ray this driver started (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, write_fd: int, record: str):
        self._proc, self._fd, self.record = proc, write_fd, record

    def stop(self, timeout: float = 30.0) -> None:
        """After ``ray.shutdown()``: the watchdog ends what is left of this Ray (agents
        still exiting) and the record; returns when it has."""
        if self._fd is not None:
            os.close(self._fd)  # EOF for the watchdog
            self._fd = None
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def start(run_dir: str, log=print, **init) -> LocalRay | None:
    """``ray.init(**init)`` (with ``num_cpus``: a local Ray) and its watchdog. A driver on a
    cluster node joins that cluster instead (Ray refuses ``num_cpus`` there): no watchdog,
    returns None. Leftovers of an earlier launch of ``run_dir`` are ended first."""
    import ray  # lazy: Ray (and its start-up cost) only where the run goes on Ray

    psutil = _psutil()
    reap_leftovers(run_dir, log)
    me = psutil.Process()
    before = {k for k in map(_key, me.children()) if k is not None}
    try:
        ray.init(**init)  # a local Ray sized for the workers
    except ValueError as e:
        # A driver on a cluster node (a Ray job, `ray start`, SLURM symmetric-run, KubeRay)
        # joins that cluster, whose resources and settings are its own: Ray refuses
        # num_cpus there, and what only a one-node Ray of ours may leave out stays.
        if "existing cluster" not in str(e):
            raise
        ray.init(**_joining(init))
        return None
    # What ray.init started: the driver's new children (GCS, raylet, dashboard, monitors).
    roots = [k for k in map(_key, me.children()) if k is not None and k not in before]
    record = os.path.join(run_dir, RECORD)
    _write_record(record, _record(roots, me))
    read_fd, write_fd = os.pipe()  # both non-inheritable: no Ray process holds the write end
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [pkg_parent] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmdp.base.localray", record, str(me.pid)]
            + [f"{pid}:{ct!r}" for pid, ct in roots],
            stdin=read_fd, env=env, start_new_session=True,  # not hit by the terminal's Ctrl-C
            stdout=subprocess.DEVNULL)
    finally:
        os.close(read_fd)
    return LocalRay(proc, write_fd, record)


def _joining(init: dict) -> dict:
    """``init`` for joining a cluster: without the resources and system settings of a new
    Ray, and without :data:`LOCAL_RAY_ENV` (Ray Train's defaults stay on a cluster)."""
    out = {k: v for k, v in init.items() if k not in ("num_cpus", "num_gpus", "_system_config")}
    env = (out.get("runtime_env") or {}).get("env_vars")
    if env:
        out["runtime_env"] = {**out["runtime_env"],
                              "env_vars": {k: v for k, v in env.items() if k not in LOCAL_RAY_ENV}}
    return out


def _record(processes, driver) -> dict:
    return {"host": socket.gethostname(), "driver": [driver.pid, driver.create_time()],
            "processes": [[pid, ct, _name(pid)] for pid, ct in processes]}


def _name(pid: int) -> str:
    psutil = _psutil()
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def reap_leftovers(run_dir: str, log=print) -> list[int]:
    """End the processes of a local Ray that an earlier launch of ``run_dir`` started and
    that outlived it and its watchdog. Called by a launch that holds the run's lock (the
    earlier launch is gone). A record written on another host is left alone."""
    path = os.path.join(run_dir, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        rec = None
    if rec is None or rec.get("host") != socket.gethostname():
        return []  # not decidable here: another machine's processes
    driver = rec.get("driver") or [0, 0.0]
    if _alive(int(driver[0]), float(driver[1])) is not None:
        return []  # its driver still runs (an older llmdp without the run lock?): not ours
    watchdog = rec.get("watchdog")
    if watchdog and (w := _alive(int(watchdog[0]), float(watchdog[1]))) is not None:
        _wait_gone([w])  # it is ending them right now
    killed = kill_recorded(rec.get("processes") or [])
    if killed:
        log(f"ended {len(killed)} Ray process(es) left by an earlier launch of this run "
            f"that died (PIDs {', '.join(map(str, killed))})")
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    return killed


# ------------------------------------------------------------------------ for the launches

# The environment of every worker (and of the local Ray's processes).
WORKER_ENV = {
    # Nothing is downloaded at run time: models and tokenizers are local folders.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


#: glibc's allocator in every worker (and the ledger actor): freed memory below 32 MiB is
#: kept for the next step instead of returned to the kernel (a training step frees and
#: allocates the same tensors again; returned, each page is faulted in and zeroed again on
#: its next use). On a 2-core CPU machine a DP step took thousands of minor page faults and
#: 10–35 ms of kernel time that the non-private step did not, and both steps ran ~10 %
#: slower and twice as unevenly (BENCHMARKS, issue 50). Read by glibc when a process starts,
#: so given in the workers' environment at their start (``run_env``), not set at run time;
#: ignored by other C libraries. A driver whose environment sets one of these (its own
#: choice, or a Ray job's runtime env, which Ray refuses to merge with a run's) keeps its
#: own: the run's environment leaves the key out.
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(8 << 30),
}

#: Test-only switches a worker reads from its environment (fault injection, planted bugs,
#: pauses; never a recipe).
TEST_ENV = ("LLMDP_FAULT", "LLMDP_TEST_PLANT", "LLMDP_TEST_PAUSE")


#: Only on a local Ray that llmdp starts (`start_local_ray`: one node, no autoscaler, gone
#: with its driver): Ray Train's preemption watcher, an actor (a process, ~1.5 CPU-s of
#: imports) per worker group that polls the cluster for nodes being drained, has no node
#: that could be drained. Given in the Ray's job environment, so Ray Train's controller
#: reads it; a value the driver's own environment sets wins (Ray Train hands the driver's
#: to its controller), and a driver that joins a cluster leaves it out (`_joining`).
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}

#: The same Ray's raylet starts no idle Python workers ahead of use (one per CPU, ~0.4 CPU-s
#: each): a launch's actors each carry a runtime environment of their own and never take
#: one, so they idled until the end.
LOCAL_RAY_SYSTEM = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def run_env() -> dict[str, str]:
    """The environment of one run's workers and ledger actor: :data:`WORKER_ENV` and the
    test switches as the driver has them *now*, each present (empty where unset). Given per
    run (``RunConfig.worker_runtime_env``, the actor's ``runtime_env``), not only at
    ``ray.init``: a Ray that outlives one run (a sweep's trials, a test session's) must not
    hand a switch of an earlier run to a later one, and Ray merges a run's ``env_vars`` into
    the job's, so an unset switch is given as empty rather than left out. With them
    :data:`ALLOCATOR_ENV`, each key the driver's environment does not set already."""
    return {**WORKER_ENV, **allocator_env(), **{k: os.environ.get(k, "") for k in TEST_ENV}}


def allocator_env() -> dict[str, str]:
    """The keys of :data:`ALLOCATOR_ENV` this process's environment does not set, with their
    values: what a process started from here is given (a set key is the user's or the job's)."""
    return {k: v for k, v in ALLOCATOR_ENV.items() if k not in os.environ}


def start_local_ray(run_dir: str, cfgs, log, num_cpus: int = 0):
    """A local Ray (`localray.start`, its watchdog's record in ``run_dir``) with CPUs for the
    largest of the runs ``cfgs`` will make (their workers, and the driver's side), and at
    least ``num_cpus``."""
    num_cpus = max(os.cpu_count() or 1, num_cpus,
                   *(int(c.scaling.num_workers * c.scaling.cpus_per_worker) + 1 for c in cfgs))
    init = dict(
        include_dashboard=False,
        logging_level="WARNING",
        # Progress comes from metrics.jsonl; worker logs stay in Ray's session logs
        # (LLMDP_VERBOSE=1 shows them). A failing worker's traceback is still raised here.
        log_to_driver=os.environ.get("LLMDP_VERBOSE", "0") == "1",
        runtime_env={"env_vars": {**run_env(), **LOCAL_RAY_ENV}},
        configure_logging=True,
        _system_config=dict(LOCAL_RAY_SYSTEM),
    )
    quiet_ray_notices()
    return start(run_dir, log=log, num_cpus=num_cpus, **init)


@contextlib.contextmanager
def shared_local_ray(run_dir: str, cfgs, log):
    """One local Ray for several runs in a row (a sweep's trials): each run's `_fit` finds
    it started and leaves it running; it stops when the block ends. Nothing is started when
    a Ray is already there (a cluster, a caller's) or no run will be made."""
    import ray  # lazy: Ray only where runs go on Ray

    cfgs = list(cfgs)
    if not cfgs or ray.is_initialized():
        yield
        return
    local = start_local_ray(run_dir, cfgs, log)
    try:
        yield
    finally:
        ray.shutdown()
        if local is not None:
            local.stop()


# ------------------------------------------------------------------------ the watchdog


def _watch(record: str, driver_pid: int, roots: list[tuple[int, float]]) -> None:
    psutil = _psutil()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    me = psutil.Process()
    seen: dict[int, float] = dict(roots)
    driver = psutil.Process(driver_pid)
    base = {"host": socket.gethostname(), "driver": [driver_pid, driver.create_time()],
            "watchdog": [me.pid, me.create_time()]}
    written = None
    descendants = _Descendants()
    while True:
        for k in descendants(roots):
            seen.setdefault(*k)
        if written != len(seen):
            _write_record(record, {**base, "processes": [[pid, ct, _name(pid)]
                                                        for pid, ct in seen.items()]})
            written = len(seen)
        ready, _, _ = select.select([0], [], [], _POLL_S)
        if ready and not os.read(0, 1):
            break  # EOF: the driver closed the pipe (it stopped Ray) or died
    kill_recorded([[pid, ct] for pid, ct in seen.items()])
    try:
        os.remove(record)
    except FileNotFoundError:
        pass


if __name__ == "__main__":  # the watchdog: RECORD DRIVER_PID PID:START_TIME ...
    _watch(sys.argv[1], int(sys.argv[2]),
           [(int(a.split(":")[0]), float(a.split(":")[1])) for a in sys.argv[3:]])
