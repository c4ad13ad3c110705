"""The test helpers' worker processes (`tests.helpers.start_processes`), commands
(`tests.helpers.Command`) and benchmark scripts (`tests.helpers.ForkedScripts`): forked
from the preloaded forkserver, yet each with the caller's environment and working
directory, as a spawned process has them; and dp-accounting's step builders, memoized per
test process (`tests.helpers.memoize_accounting_steps`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Command, ForkedScripts, forkserver, start_processes


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


SCRIPT = """
import os, sys
import shown_by_pythonpath
print("out", os.getcwd(), os.environ["LLMDP_HELPER_CHECK"], sys.argv[1:], __name__, flush=True)
print("err", shown_by_pythonpath.WHERE, file=sys.stderr, flush=True)
if sys.argv[1] == "wait":
    import signal
    signal.pause()
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_script_runs_as_a_fresh_interpreter_would(tmp_path):
    """``python SCRIPT ARGS`` as `subprocess.run` gives it: the script as ``__main__`` with
    its arguments, the given environment (its PYTHONPATH on the module path) and directory,
    its exit code, its stdout and stderr; past the timeout it is killed and TimeoutExpired
    carries what it wrote."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "shown_by_pythonpath.py").write_text("WHERE = 'lib'\n")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, LLMDP_HELPER_CHECK="given", PYTHONPATH=str(lib))
    done = ForkedScripts.run([sys.executable, str(script), "3"], capture_output=True, text=True,
                             env=env, cwd=str(work), timeout=120)
    assert done.returncode == 3
    assert done.stdout == f"out {work} given ['3'] __main__\n" and done.stderr == "err lib\n"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        ForkedScripts.run([sys.executable, str(script), "wait"], env=env, cwd=str(work), timeout=5)
    assert e.value.output.startswith("out ") and e.value.stderr == "err lib\n"
    with pytest.raises(ValueError, match="runs `python SCRIPT.py"):
        ForkedScripts.run(["ls"], env=env)


def test_the_memoized_accounting_steps_are_the_same_builds_kept_read_only():
    """conftest memoizes dp-accounting's step builders (`memoize_accounting_steps`): a
    repeated call is the kept object, equal bit for bit to a fresh build; an argument that
    differs in value, spelling aside, or only in type is another build; what is kept
    cannot be written into."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution as pld
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    build = pld.from_gaussian_mechanism
    assert build.memoized
    a = build(2.0, value_discretization_interval=1e-3, sampling_prob=0.02)
    # the same call spelled otherwise (keywords, defaults written out) is the kept one
    assert build(standard_deviation=2.0, sensitivity=1, value_discretization_interval=1e-3,
                 sampling_prob=0.02) is a
    fresh = build.__wrapped__(2.0, value_discretization_interval=1e-3, sampling_prob=0.02)
    for pmf, ref in ((a._pmf_remove, fresh._pmf_remove), (a._pmf_add, fresh._pmf_add)):
        assert pmf._lower_loss == ref._lower_loss and pmf._infinity_mass == ref._infinity_mass
        assert np.array_equal(pmf._probs, ref._probs)
        with pytest.raises(ValueError, match="read-only"):
            pmf._probs[0] = 1.0
    assert a.get_epsilon_for_delta(1e-5) == fresh.get_epsilon_for_delta(1e-5)
    assert build(2.0, value_discretization_interval=1e-3, sampling_prob=0.021) is not a
    assert build(np.float32(2.0), value_discretization_interval=1e-3, sampling_prob=0.02) is not a

    step = rdp._compute_rdp_poisson_subsampled_gaussian
    orders = np.array([2.0, 4.0, 32.0])
    v = step(q=0.01, noise_multiplier=1.5, orders=orders)
    assert step(0.01, 1.5, np.array([2.0, 4.0, 32.0])) is v
    assert np.array_equal(v, step.__wrapped__(0.01, 1.5, orders)) and not v.flags.writeable
    assert step(0.01, 1.5, np.array([2.0, 4.0, 33.0])) is not v
