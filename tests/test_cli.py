"""The command line: accounting commands against dp-accounting called directly, and errors."""

from __future__ import annotations

import json

import dp_accounting
import pytest

from llmdp.cli import main


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


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--dataset-size", "1000", "--batch-size", "10", "--steps", "5", "--noise-multiplier", "1",
          "--delta", "0.01"], "below 1/N"),
        (["--dataset-size", "1000", "--batch-size", "2000", "--steps", "5", "--noise-multiplier", "1"],
         "expected_batch_size"),
        (["--dataset-size", "1000", "--batch-size", "10", "--steps", "0", "--noise-multiplier", "1"],
         "steps"),
    ],
)
def test_bad_plans_exit_2_with_a_message(capsys, argv, needle):
    assert main(["privacy", "epsilon", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("llmdp: error:")


def test_unreachable_target_names_the_knobs(capsys):
    rc = main(["privacy", "calibrate", "--dataset-size", "1000", "--batch-size", "900", "--steps",
               "10000", "--target-epsilon", "0.01", "--delta", "1e-5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unreachable" in err and "steps" in err


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
