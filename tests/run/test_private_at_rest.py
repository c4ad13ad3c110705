"""Private data at rest (issue 37): what llmdp derives from private data is owner-only
(0600/0700) whatever the umask, group-readable (0640/0750) with output.group_readable, never
world-readable; what is meant for publication keeps ordinary permissions; a folder found
too open is reported at launch with the command that fixes it. (The Ray run, the Ray Data
store, the fsdp checkpoint, the tokenizer and the export are checked in their own tests:
test_e2e.py, test_checkpoint_dcp.py, tokenizer/test_train.py, test_export.py.)

Owns invariant `secrets-stay-secret` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat

import pytest

from llmdp import _fs


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _write_tree(root: str) -> tuple[str, str]:
    os.makedirs(os.path.join(root, "sub"))
    f = os.path.join(root, "sub", "units.arrow")
    with open(f, "w") as fh:
        fh.write("x")
    return os.path.join(root, "sub"), f


@pytest.mark.parametrize("user_umask", [0o022, 0o002, 0o000])
@pytest.mark.parametrize("group,dmode,fmode", [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_private_files_whatever_the_umask_and_publish_tree_ordinary(tmp_path, user_umask, group, dmode, fmode):
    with umask(user_umask):
        with _fs.private_files(group):
            d, f = _write_tree(str(tmp_path / "run"))
            assert _fs.user_umask() == user_umask  # what an export inside a run publishes with
        assert (mode(d), mode(f)) == (dmode, fmode)
        assert _fs.too_open(str(tmp_path / "run"), group) == []
        assert os.umask(user_umask) == user_umask  # restored after the block
        _fs.publish_tree(str(tmp_path / "run"))
        assert (mode(d), mode(f)) == (0o777 & ~user_umask, 0o666 & ~user_umask)


def test_too_open_names_what_others_can_read_and_the_fix(tmp_path):
    with umask(0o022):
        d, f = _write_tree(str(tmp_path / "run"))
    assert set(_fs.too_open(str(tmp_path / "run"))) == {str(tmp_path / "run"), d, f}
    os.chmod(str(tmp_path / "run"), 0o750)
    os.chmod(d, 0o750)
    os.chmod(f, 0o640)
    assert _fs.too_open(str(tmp_path / "run"), group_readable=True) == []
    assert len(_fs.too_open(str(tmp_path / "run"))) == 3  # owner-only is the default
    assert _fs.fix_command([str(tmp_path / "run")]) == f"chmod -R go-rwx {tmp_path / 'run'}"
    assert _fs.too_open(str(tmp_path / "missing")) == []


def _cfg(tmp_path, **output):
    from llmdp.config.schema import load_recipe
    from tests.helpers import tiny_tokenizer_dir

    (tmp_path / "r.yaml").write_text(
        "model: {init: tiny, tiny: {family: llama, hidden_size: 16, num_layers: 1, num_heads: 2, "
        f"num_kv_heads: 1, intermediate_size: 32, max_position_embeddings: 64}}, tokenizer: {tiny_tokenizer_dir()}}}\n"
        f"data: {{path: {tmp_path / 'notes.jsonl'}, sequence_length: 16}}\n"
        "privacy: {noise_multiplier: 1.0, max_grad_norm: 1.0, delta: 1.0e-5}\n"
        "train: {expected_batch_size: 4, steps: 1, physical_batch_size: 4}\n"
        f"output: {{dir: {tmp_path / 'runs'}, name: r}}\n")
    cfg = load_recipe(str(tmp_path / "r.yaml"), [])
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, **output))


@pytest.mark.parametrize("group,dmode,fmode", [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_a_launch_and_a_worker_write_with_the_recipes_permissions(tmp_path, monkeypatch, group, dmode, fmode):
    """`launch.run` and `train_loop_per_worker` hold the recipe's umask (output.group_readable)
    for everything they write, whatever the process's; the process's is restored after."""
    from llmdp.run import launch
    from llmdp.train import loop

    cfg = _cfg(tmp_path, group_readable=group)
    written = {}

    def fake_run(cfg, lock, log, augment=None):  # what the launch writes (stores, run folder)
        written["launch"] = _write_tree(cfg.run_dir)
        return cfg.run_dir

    def fake_loop(spec, context):  # what a worker writes (checkpoints, metrics)
        written["worker"] = _write_tree(os.path.join(spec.cfg.run_dir, "checkpoints"))
        return {}

    monkeypatch.setattr(launch, "_run_locked", fake_run)
    monkeypatch.setattr(loop, "_train_loop", fake_loop)
    with umask(0o002):
        launch.run(cfg, log=lambda *a: None)
        loop.train_loop_per_worker(type("Spec", (), {"cfg": cfg})())
        assert os.umask(0o002) == 0o002
    for d, f in written.values():
        assert (mode(d), mode(f)) == (dmode, fmode)
    assert mode(cfg.run_dir) == dmode and mode(os.path.dirname(cfg.run_dir)) == dmode


def test_a_run_folder_left_open_is_reported_at_launch_with_the_fix(tmp_path, monkeypatch):
    from llmdp.run.planning import warn_open

    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))  # only this test's folders
    cfg = _cfg(tmp_path)
    with umask(0o022):  # as an older llmdp left it
        _write_tree(cfg.run_dir)
    lines = []
    warn_open(cfg, lines.append)
    assert len(lines) == 1 and cfg.run_dir in lines[0]
    assert f"chmod -R go-rwx {os.path.abspath(cfg.run_dir)}" in lines[0]
    os.system(f"chmod -R go-rwx {cfg.run_dir}")  # the fix it names
    lines.clear()
    warn_open(cfg, lines.append)
    assert lines == []
    # with output.group_readable, group read is expected, group write is not
    os.system(f"chmod -R g+rX {cfg.run_dir}")
    warn_open(_cfg(tmp_path, group_readable=True), lines.append)
    assert lines == []
    warn_open(cfg, lines.append)
    assert len(lines) == 1


def test_privacy_report_recreates_its_files_owner_only(tmp_path, capsys):
    """Issue 51 item 6: `llmdp privacy report` re-creates a missing privacy_report.md / .png
    (and .json) owner-only whatever the umask: the report holds internal statistics."""
    from llmdp.cli import main
    from llmdp.run.launch import prepare
    from tests.helpers import simulate_steps, write_notes

    write_notes(tmp_path / "notes.jsonl", 20)
    prep = prepare(_cfg(tmp_path), log=lambda *a: None)
    simulate_steps(prep)
    for name in ("privacy_report.json", "privacy_report.md", "privacy_report.png"):
        if os.path.exists(os.path.join(prep.run_dir, name)):
            os.remove(os.path.join(prep.run_dir, name))
    with umask(0o022):
        assert main(["privacy", "report", prep.run_dir]) == 0
    capsys.readouterr()
    for name in ("privacy_report.json", "privacy_report.md", "privacy_report.png"):
        assert mode(os.path.join(prep.run_dir, name)) == 0o600, name


def test_an_audit_writes_its_folder_and_results_owner_only(tmp_path, monkeypatch):
    """Issue 51 item 6: `llmdp audit` creates `<name>-audit/` 0700 before the launch looks
    at it (no "private data readable by others" about its own folder), and audit.json /
    audit.md 0600, whatever the umask."""
    import json

    from llmdp.audit import gradient as gc
    from llmdp.report import build
    from llmdp.run import audit, launch, planning
    from tests.helpers import write_notes

    write_notes(tmp_path / "notes.jsonl", 20)
    cfg = _cfg(tmp_path)
    seen = {}

    def fake_run(acfg, log, augment=None):  # the launch: what its warn_open would find
        seen["open"] = _fs.too_open(acfg.run_dir)
        with open(os.path.join(acfg.run_dir, "privacy_report.json"), "w") as f:
            json.dump({"status": "complete", "steps_completed": 1, "noise_multiplier": 1.0,
                       "sampling_probability": 0.1}, f)

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr(planning, "plan_run", lambda c, log=None: type(
        "P", (), {"store": type("S", (), {"num_units": 200})()})())
    monkeypatch.setattr(gc, "read_iterates", lambda *a: None)
    monkeypatch.setattr(gc, "scores", lambda *a: [0.0] * 4)
    monkeypatch.setattr(audit, "summarize", lambda *a, **k: {"violation": False})
    monkeypatch.setattr(audit, "render_audit", lambda r: "audit\n")
    monkeypatch.setattr(audit, "audit_line", lambda r: "audit")
    monkeypatch.setattr(build, "write_report", lambda run_dir: None)
    with umask(0o022):
        audit.run_audit(cfg, audit.AuditSettings(canaries=4, canary_kind="gradient"),
                        log=lambda *a: None)
    run_dir = audit.audit_run_dir(cfg)
    assert seen["open"] == []
    assert mode(run_dir) == 0o700
    assert mode(os.path.join(run_dir, "audit.json")) == 0o600
    assert mode(os.path.join(run_dir, "audit.md")) == 0o600
