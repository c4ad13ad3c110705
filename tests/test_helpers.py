"""The test helpers' worker processes (`tests.helpers.start_processes`) and commands
(`tests.helpers.Command`): forked from the preloaded forkserver, yet each with the caller's
environment and working directory, as a spawned process has them."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import Command, forkserver, start_processes


def _write_env_and_cwd(rank: int, out: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(f"{os.environ.get('LLMDP_HELPER_CHECK')}\n{os.getcwd()}")


def _noop() -> None:
    pass


def test_a_forked_worker_has_the_callers_environment_and_working_directory(tmp_path, monkeypatch):
    # the server runs before this test's settings (as after an earlier test): what it holds
    # is not what the workers get
    p = forkserver().Process(target=_noop)
    p.start()
    p.join()
    monkeypatch.setenv("LLMDP_HELPER_CHECK", "this test's")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    start_processes(_write_env_and_cwd, (str(tmp_path),), 2)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"this test's\n{work}"


def test_a_forked_command_runs_in_its_directory_and_gives_its_exit_code_and_output(tmp_path):
    p = forkserver().Process(target=_noop)  # a server started before (as by an earlier test)
    p.start()
    p.join()
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "out.log"
    cmd = Command(["train", "absent.yaml"], cwd=work, log=log)
    assert cmd.wait(timeout=120) == 2 == cmd.returncode == cmd.poll()
    assert cmd.output() == log.read_text()
    assert f"recipe file not found: 'absent.yaml' (looked for {work / 'absent.yaml'})" in cmd.output()
