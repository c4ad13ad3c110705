"""The command line: accounting commands against dp-accounting called directly, and errors."""

from __future__ import annotations

import json
import os

import dp_accounting
import pytest

from llmdp.cli import main
from llmdp.privacy.mechanism import BandedMf, Blt, DpSgd
from llmdp.record.rundir import RunDir


def direct_epsilon(q, sigma, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return acc.compose(event).get_epsilon(delta)


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_calibrate_acceptance(capsys):
    out = run_json(capsys, ["privacy", "calibrate", "--dataset-size", "50000", "--batch-size", "512",
                            "--steps", "1953", "--target-epsilon", "8", "--delta", "1e-5", "--json"])
    sigma = out["noise_multiplier"]
    eps = direct_epsilon(512 / 50000, sigma, 1953, 1e-5)
    assert 7.9 <= eps <= 8.0, (sigma, eps)


def test_epsilon_matches_dp_accounting(capsys):
    out = run_json(capsys, ["privacy", "epsilon", "--dataset-size", "20000", "--batch-size", "400",
                            "--steps", "300", "--noise-multiplier", "0.9", "--delta", "1e-6", "--json"])
    assert out["epsilon"] == pytest.approx(direct_epsilon(400 / 20000, 0.9, 300, 1e-6), rel=1e-9)
    assert out["sampling_probability"] == pytest.approx(0.02)


# The planner's own names: a user of the command line never typed them.
INTERNAL_NAMES = ("expected_batch_size", "dataset_size", "default_delta", "target_epsilon",
                  "noise_multiplier", "max_noise_multiplier", "sampling_probability", "steps=",
                  "epochs=", "delta=", "accountant=")

GOOD = {"--dataset-size": "1000", "--batch-size": "10", "--steps": "5", "--noise-multiplier": "1",
        "--target-epsilon": "3", "--delta": "1e-5"}


def _argv(command, **bad):
    flags = dict(GOOD)
    flags.pop("--target-epsilon" if command == "epsilon" else "--noise-multiplier")
    for k, v in bad.items():
        flag = "--" + k.replace("_", "-")
        if flag == "--epochs":
            flags.pop("--steps")
        flags[flag] = v
    return ["privacy", command, *(f"{k}={v}" for k, v in flags.items())]


@pytest.mark.parametrize(
    "command,bad,needle",
    [
        ("epsilon", {"dataset_size": "0"}, "--dataset-size 0"),
        ("epsilon", {"dataset_size": "-5"}, "--dataset-size -5"),
        ("epsilon", {"batch_size": "0"}, "--batch-size 0"),
        ("calibrate", {"batch_size": "-1"}, "--batch-size -1"),
        ("epsilon", {"batch_size": "nan"}, "--batch-size nan"),
        ("epsilon", {"batch_size": "inf"}, "--batch-size inf"),
        ("epsilon", {"batch_size": "2000"}, "--batch-size 2000 is more than --dataset-size 1000"),
        ("calibrate", {"batch_size": "2000"}, "--batch-size 2000 is more than --dataset-size 1000"),
        ("epsilon", {"steps": "0"}, "--steps 0"),
        ("calibrate", {"steps": "-2"}, "--steps -2"),
        ("epsilon", {"epochs": "0"}, "--epochs 0"),
        ("calibrate", {"epochs": "nan"}, "--epochs nan"),
        ("epsilon", {"noise_multiplier": "0"}, "--noise-multiplier 0"),
        ("epsilon", {"noise_multiplier": "-1"}, "--noise-multiplier -1"),
        ("epsilon", {"noise_multiplier": "inf"}, "--noise-multiplier inf"),
        ("calibrate", {"target_epsilon": "0"}, "--target-epsilon 0"),
        ("calibrate", {"target_epsilon": "-3"}, "--target-epsilon -3"),
        ("calibrate", {"target_epsilon": "nan"}, "--target-epsilon nan"),
        ("epsilon", {"delta": "0"}, "--delta 0 must be a number > 0; use e.g. --delta 1e-05"),
        ("calibrate", {"delta": "-1e-5"}, "--delta -1e-05 must be a number > 0"),
        ("epsilon", {"delta": "0.01"}, "--delta 0.01 must be below 1/N = 0.001 (--dataset-size 1000)"),
        ("calibrate", {"delta": "2"}, "--delta 2 must be below 1/N"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_not_internal_names(capsys, command, bad, needle):
    assert main(_argv(command, **bad)) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmdp: error:") and needle in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not [n for n in INTERNAL_NAMES if n in err], err


def test_unreachable_target_names_the_flags(capsys):
    rc = main(["privacy", "calibrate", "--dataset-size", "1000", "--batch-size", "900", "--steps",
               "10000", "--target-epsilon", "0.01", "--delta", "1e-5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--target-epsilon 0.01 is unreachable" in err and "--steps" in err and "--batch-size" in err
    # The floor it quotes is the epsilon at the largest noise multiplier tried, from dp-accounting.
    assert f"epsilon = {direct_epsilon(0.9, 100.0, 10000, 1e-5):.4g}" in err, err
    assert not [n for n in INTERNAL_NAMES if n in err], err


def test_version_is_the_package_version(capsys):
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmdp {version}"


BASE = """
model: {init: tiny, tokenizer: tok}
data: {path: notes.jsonl}
privacy: {target_epsilon: 3}
train: {steps: 10}
"""


@pytest.mark.parametrize(
    "edit,needle",
    [
        ("privacy: {target_epsilon: 3, accountant: pdl}", "privacy.accountant: 'pdl' is not one of"),
        ("privacy: {target_epsilon: 3, noise_multipler: 1}", "did you mean 'privacy.noise_multiplier'"),
        ("privacy: {target_epsilon: 3, noise_multiplier: 1}", "privacy.noise_multiplier"),
        ("train: {steps: -3}", "train.steps: -3"),
        ("train: {steps: ten}", "train.steps"),
        ("privacy: {target_epsilon: 3, delta: 1.5}", "privacy.delta: 1.5"),
        ("privacy: {target_epsilon: 3, rng: seeded}", "privacy.seed"),
        ("scaling: {num_workers: 0}", "scaling.num_workers: 0"),
    ],
)
def test_malformed_recipes_stop_with_their_message(tmp_path, monkeypatch, capsys, edit, needle):
    monkeypatch.chdir(tmp_path)
    section = edit.split(":")[0]
    text = "\n".join(line for line in BASE.strip().splitlines() if not line.startswith(section + ":"))
    (tmp_path / "r.yaml").write_text(text + "\n" + edit + "\n")
    assert main(["train", "r.yaml"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_override_typo_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text(BASE)
    assert main(["train", "r.yaml", "optim.lrr=0.1"]) == 2
    assert "did you mean 'optim.lr'" in capsys.readouterr().err


# ------------------------------------------- first contact: interrupt, resume, Ray's notice


def _tiny_run_recipe(tmp_path) -> str:
    import yaml

    from tests.helpers import tiny_tokenizer_dir, write_notes

    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": write_notes(tmp_path / "notes.jsonl", 30), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-4},
        "optim": {"name": "adamw", "lr": 1e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 6, "physical_batch_size": 4,
                  "checkpoint_every": 2},
        "output": {"dir": str(tmp_path / "runs"), "name": "t"},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _main(argv) -> int:
    """main(), with a Ctrl-C that escapes it turned into a test failure (not the end of pytest)."""
    try:
        return main(argv)
    except (KeyboardInterrupt, SystemExit) as e:
        pytest.fail(f"{type(e).__name__} escaped llmdp's CLI: a traceback for the user")


def _local_fit(interrupt_after: int | None, exc=KeyboardInterrupt):
    """trainer._fit without Ray: the worker loop in this process, checkpointing where Ray
    Train does (<run>/checkpoints/checkpoint_*); `exc` is raised at the optimizer step after
    `interrupt_after` applied steps, as Ctrl-C would arrive in the middle of a step."""
    import torch

    from llmdp.train.loop import LocalContext, train_loop_per_worker

    def fit(prepared, log, interrupts=None):
        ckpt = os.path.join(prepared.run_dir, "checkpoints", "checkpoint_000000")
        real_step, applied = torch.optim.AdamW.step, {"n": 0}

        def step(self, *a, **k):
            if interrupt_after is not None and applied["n"] == interrupt_after:
                raise exc(1) if exc is SystemExit else exc()
            applied["n"] += 1
            return real_step(self, *a, **k)

        torch.optim.AdamW.step = step
        try:
            train_loop_per_worker(prepared, LocalContext(checkpoint_dir=ckpt))
        finally:
            torch.optim.AdamW.step = real_step
    return fit


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])  # SystemExit: Ray's SIGINT handler
def test_ctrl_c_leaves_status_interrupted_and_the_rerun_resumes_and_says_so(
        tmp_path, monkeypatch, capsys, exc):
    import llmdp.run.launch as trainer
    from llmdp.report.build import build_report

    recipe = _tiny_run_recipe(tmp_path)
    run_dir = tmp_path / "runs" / "t"
    monkeypatch.setattr(trainer, "_fit", _local_fit(interrupt_after=3, exc=exc))
    assert _main(["train", recipe]) == 130
    cap = capsys.readouterr()
    assert "resuming" not in cap.out  # a fresh run
    assert cap.err.strip().splitlines()[-1] == (
        "llmdp: interrupted after step 3 of 6; re-run the same command to resume"), cap.err
    assert "Traceback" not in cap.err
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert report["status"] == "interrupted" and report["failure"] is None, report["status"]
    assert report["resume"] == "re-run the same command to resume"
    md = (run_dir / "privacy_report.md").read_text()
    assert "Run status: **interrupted** (re-run the same command to resume)" in md
    assert "SystemExit" not in md and "KeyboardInterrupt" not in md
    # `llmdp privacy report` rebuilds it from the run directory: still interrupted.
    assert build_report(str(run_dir))["status"] == "interrupted"

    # The same command again: resumes from the checkpoint of step 2, the second attempt.
    monkeypatch.setattr(trainer, "_fit", _local_fit(interrupt_after=None))
    assert _main(["train", recipe]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 2 of 6 (attempt 2)\n" in out, out
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert report["status"] == "complete" and report["resume"] is None and report["attempts"] == 2


def test_resume_point_counts_attempts_like_the_report(tmp_path, monkeypatch, capsys):
    import llmdp.run.launch as trainer

    recipe = _tiny_run_recipe(tmp_path)
    run_dir = str(tmp_path / "runs" / "t")
    assert RunDir(run_dir).resume_point() is None  # nothing there yet
    # Interrupted after 1 step: before the first checkpoint (step 2), after a ledger record.
    monkeypatch.setattr(trainer, "_fit", _local_fit(interrupt_after=1))
    assert _main(["train", recipe]) == 130
    assert RunDir(run_dir).resume_point() == {"step": 0, "attempt": 2}
    monkeypatch.setattr(trainer, "_fit", _local_fit(interrupt_after=2))
    assert _main(["train", recipe]) == 130
    assert "resuming from step 0 of 6 (attempt 2)\n" in capsys.readouterr().out
    report = json.loads(open(os.path.join(run_dir, "privacy_report.json")).read())
    assert report["attempts"] == 2 and report["status"] == "interrupted"
    assert RunDir(run_dir).resume_point() == {"step": 2, "attempt": 3}


def test_a_run_stopped_at_its_target_is_told_so_without_starting_the_workers(
        tmp_path, monkeypatch, capsys):
    """Issue 30 item 1: stops at once (a second Ctrl-C, a killed process) re-execute steps;
    once the target refuses the next step, a re-run says so before starting Ray."""
    import yaml

    import llmdp.run.launch as trainer

    recipe = _tiny_run_recipe(tmp_path)
    raw = yaml.safe_load(open(recipe))
    raw["privacy"] = {"target_epsilon": 2.0, "max_grad_norm": 1.0, "delta": 1e-4}
    open(recipe, "w").write(yaml.safe_dump(raw))
    run_dir = tmp_path / "runs" / "t"
    # Stopped at once inside step 4 (steps 0-3 applied, [2, 4) reserved twice over the
    # attempts): the ledger then holds more steps than ran, and the target is reached.
    monkeypatch.setattr(trainer, "_fit", _local_fit(interrupt_after=3))
    assert _main(["train", recipe]) == 130
    monkeypatch.setattr(trainer, "_fit", _local_fit(interrupt_after=None))
    assert _main(["train", recipe]) == 0
    report = json.loads((run_dir / "privacy_report.json").read_text())
    assert report["status"] == "stopped" and report["steps_completed"] == 4, report["status"]
    capsys.readouterr()

    def no_workers(*a, **k):
        raise AssertionError("the workers were started for a run that cannot take a step")

    monkeypatch.setattr(trainer, "_fit", no_workers)
    assert _main(["train", recipe]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 4 of 6" in out
    assert "privacy.target_epsilon=2 reached" in out and "nothing ran" in out
    assert "a first Ctrl-C loses none" in out
    again = json.loads((run_dir / "privacy_report.json").read_text())
    assert again["status"] == "stopped" and again["epsilon"] == report["epsilon"]


def _auth_records(emit) -> list[str]:
    import logging

    from ray._private.authentication import authentication_token_setup as auth

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger(auth.__name__)
    handler = Keep()
    logger.addHandler(handler)
    try:
        emit(auth)
    finally:
        logger.removeHandler(handler)
    return seen


def test_fit_hides_rays_token_auth_notice_before_ray_init(monkeypatch, tmp_path):
    """What a local `ray.init` logs (Ray 2.5x) never reaches the user; Ray's warning that
    authentication is *disabled* still does."""
    from types import SimpleNamespace

    import ray

    import llmdp.run.launch as trainer

    class Started(Exception):
        pass

    seen: list[str] = []

    def fake_init(*a, **k):  # Ray's own code path: enable_token_auth_by_default() warns
        seen.extend(_auth_records(lambda auth: auth._warn_token_auth_enabled()))
        raise Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    prepared = SimpleNamespace(run_dir=str(tmp_path), plan=None, cfg=SimpleNamespace(
        scaling=SimpleNamespace(num_workers=1, cpus_per_worker=1)))
    with pytest.raises(Started):
        trainer._fit(prepared, print)
    assert seen == []
    disabled = _auth_records(lambda auth: auth._warn_token_auth_disabled())
    assert len(disabled) == 1 and "Token authentication is disabled" in disabled[0]


@pytest.mark.parametrize("argv,command", [
    (["train", "r.yaml", "--debug", "output.name=x", "train.steps=3"], "train"),
    (["audit", "r.yaml", "--canaries", "100", "output.name=x", "train.steps=3"], "audit"),
    (["train", "r.yaml", "output.name=x", "--debug", "train.steps=3"], "train"),
])
def test_overrides_may_follow_flags(argv, command, monkeypatch):
    """Issue 30 item 8: `llmdp train notes.yaml --debug output.name=x` and `llmdp audit
    notes.yaml --canaries 100 data.path=...` take the overrides (argparse alone leaves them
    over as unrecognized arguments)."""
    import llmdp.config.schema

    seen = {}

    def fake_load(path, overrides):
        seen["overrides"] = list(overrides)
        raise llmdp.config.schema.ConfigError("stop here")

    monkeypatch.setattr(llmdp.config.schema, "load_recipe", fake_load)
    assert main(argv) == 2
    assert seen["overrides"][:2] == ["output.name=x", "train.steps=3"]


def test_top_level_help_lists_every_privacy_command(capsys):
    """Issue 30 item 13: `llmdp --help` named epsilon, calibrate and report, not ledger."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    entry = " ".join(out[out.index("\n    privacy "):].split("\n    tokenizer")[0].split())
    assert all(c in entry for c in ("epsilon", "calibrate", "report", "ledger")), entry


@pytest.mark.parametrize("argv", [["train"], ["compare"], ["export"], ["privacy", "report"],
                                  ["privacy", "ledger", "list"], ["tokenizer", "train"],
                                  ["generate"], ["synthetic", "check"]])
def test_every_command_help_has_a_description(argv, capsys):
    """Issue 51 item 10: `llmdp train --help` and `llmdp compare --help` printed the usage
    and the options with no word on what the command does; every command has one."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    between = out.split("\n\n")[1]  # usage, then the description, then the arguments
    assert not between.startswith(("positional arguments", "options")), out
    assert len(between.split()) >= 4, between


@pytest.mark.parametrize("flags,config", [
    ([], lambda cache: DpSgd()),
    (["--mechanism", "banded-mf", "--bands", "2"], lambda cache: BandedMf(bands=2, strategy_cache=cache)),
    (["--mechanism", "blt", "--buffers", "1", "--cycle", "3"],
     lambda cache: Blt(buffers=1, cycle=3, strategy_cache=cache)),
])
def test_the_flags_make_the_plan_their_mechanism_config_makes(capsys, monkeypatch, tmp_path, flags, config):
    """Issue 53: `llmdp privacy epsilon`'s flags become one mechanism config (its fields by
    name); the plan is the one make_plan builds from that config."""
    from llmdp.config.choices import Mechanism
    from llmdp.privacy.mf import mf_commitment
    from llmdp.privacy.plan import make_plan

    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path))
    assert main(["privacy", "epsilon", "--dataset-size", "6000", "--batch-size", "60", "--steps", "6",
                 "--noise-multiplier", "1.2", "--delta", "1e-5", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    mech = config(os.path.join(str(tmp_path), "mf"))
    plan = make_plan(dataset_size=6000, expected_batch_size=60, max_grad_norm=1.0, steps=6, delta=1e-5,
                     noise_multiplier=1.2, sampler=mech.mechanism.default_sampler, mechanism=mech)
    assert out["epsilon"] == plan.epsilon() and out["accountant"] == "pld"
    if mech.mechanism is not Mechanism.DP_SGD:
        assert (out["mechanism"], out["sampler"]) == (mech.mechanism.value, plan.sampler.value)
        assert out["commitment"] == json.loads(json.dumps(mf_commitment(plan)))
