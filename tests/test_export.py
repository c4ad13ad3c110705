"""`llmdp export`: the folder loads offline and generates what the trained model generates,
the card states the report, the Hub upload is called exactly, and bad runs are refused."""

from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest
import torch

from llmdp.config import recipe_from_dict
from llmdp.export import ExportError, export_run
from tests.helpers import tiny_tokenizer_dir, write_notes

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def _run(tmp_path, *, lora: bool, rng: str = "secure", name: str = "run"):
    """A finished run made by the worker loop in this process (no Ray): final model,
    ledger, report and a checkpoint where Ray would put it."""
    from llmdp.report import write_report
    from llmdp.trainer import prepare
    from llmdp.worker import LocalContext, train_loop_per_worker

    data = write_notes(tmp_path / "notes.jsonl", 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64},
                  "lora": LORA if lora else None},
        "data": {"path": str(data), "sequence_length": 24},
        # A fixed sigma: no calibration, and a cheap PLD in every report this file rebuilds.
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "rng": rng,
                    **({"seed": 3} if rng == "seeded" else {})},
        "optim": {"name": "adamw", "lr": 5e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 4, "physical_batch_size": 4,
                  "checkpoint_every": 2, "log_every": 1},
        "output": {"dir": str(tmp_path / "runs"), "name": name},
    }
    prep = prepare(recipe_from_dict(raw), log=lambda *a: None)
    ckpt = os.path.join(prep.run_dir, "checkpoints", "checkpoint_000000")
    train_loop_per_worker(prep.worker_config(), LocalContext(checkpoint_dir=ckpt))
    write_report(prep.run_dir)
    return prep.run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("full"), lora=False)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora"), lora=True)


PROMPT = torch.tensor([[5, 17, 9, 33, 12]])


def _greedy(model) -> list[int]:
    model.eval()
    with torch.no_grad():
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=10,
                             do_sample=False, pad_token_id=0)
    return out[0, PROMPT.shape[1]:].tolist()


def _trained_peft(run_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with open(os.path.join(run_dir, "model", "adapter_config.json")) as f:
        base_dir = json.load(f)["base_model_name_or_path"]
    return base_dir, PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                               os.path.join(run_dir, "model"))


def _text_files(folder):
    for root, _, files in os.walk(folder):
        for n in files:
            if n.endswith((".json", ".md", ".jsonl", ".txt")):
                yield os.path.join(root, n), open(os.path.join(root, n), encoding="utf-8").read()


def _check_card(folder, report, *, library, base_model):
    from huggingface_hub import ModelCard

    card = ModelCard.load(os.path.join(folder, "README.md"))
    d = card.data.to_dict()
    dp = d["differential_privacy"]
    assert dp["epsilon"] == report["epsilon"] and dp["delta"] == report["delta"]
    assert dp["unit"] == report["unit"] and dp["adjacency"] == report["adjacency"]
    assert dp["accountant"] == report["accountant"] and dp["steps"] == report["steps"]
    assert d["library_name"] == library and d.get("base_model") == base_model
    assert {"differential-privacy", "dp-sgd"} <= set(d["tags"]) and d["license"] == "other"
    assert "datasets" not in d  # private data is never named as a dataset
    assert f"({report['epsilon']:.4f}, {report['delta']:.3g})-differential privacy" in card.text
    return card


# ----------------------------------------------------------------------------- the folder


def test_full_weights_export_loads_offline_and_generates_the_same(full_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    res = export_run(full_run, out, log=lambda *a: None)
    assert res["format"] == "full" and res["verified"] and res["problems"] == []
    report = json.load(open(os.path.join(full_run, "privacy_report.json")))
    trained = AutoModelForCausalLM.from_pretrained(os.path.join(full_run, "model"))
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert _greedy(exported) == _greedy(trained)
    assert AutoTokenizer.from_pretrained(out)("a test").input_ids
    _check_card(out, report, library="transformers", base_model=None)
    names = {n for n, _ in res["files"]}
    assert {"README.md", "privacy_report.json", "privacy_report.md", "privacy_report.png",
            "ledger.jsonl", "config.json", "model.safetensors", "tokenizer.json",
            "llmdp_export.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)  # safetensors only
    exported_report = json.load(open(out / "privacy_report.json"))
    assert exported_report["epsilon"] == report["epsilon"]
    for path, text in _text_files(out):  # no local path is published
        assert str(tmp_path.parent) not in text and full_run not in text, path
    # Exporting again to the same folder replaces it.
    export_run(full_run, out, log=lambda *a: None)


def test_lora_adapter_export_names_the_base_by_hub_id(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with pytest.raises(ExportError, match=r"--merge.*--base-model"):
        export_run(lora_run, tmp_path / "a", log=lambda *a: None)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ExportError, match=r"--base-model: .*not a Hub id"):
        export_run(lora_run, tmp_path / "a", base_model=str(tmp_path), log=lambda *a: None)
    out = tmp_path / "adapter"
    res = export_run(lora_run, out, base_model="test-org/tiny-base", log=lambda *a: None)
    assert res["format"] == "adapter"
    assert json.load(open(out / "adapter_config.json"))["base_model_name_or_path"] == "test-org/tiny-base"
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    report = json.load(open(os.path.join(lora_run, "privacy_report.json")))
    card = _check_card(out, report, library="peft", base_model="test-org/tiny-base")
    assert "lora" in card.data.to_dict()["tags"]
    # Loads offline with PeftModel on the base and generates what the trained model does.
    base_dir, trained = _trained_peft(lora_run)
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(out))
    assert _greedy(exported) == _greedy(trained)
    assert any(p.abs().sum() > 0 for n, p in exported.named_parameters() if "lora_B" in n)  # trained


def test_lora_merged_export_generates_the_same(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    res = export_run(lora_run, out, merge=True, log=lambda *a: None)
    assert res["format"] == "merged" and not (out / "adapter_config.json").exists()
    _, trained = _trained_peft(lora_run)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert _greedy(merged) == _greedy(trained)
    assert "_name_or_path" not in json.load(open(out / "config.json"))
    report = json.load(open(os.path.join(lora_run, "privacy_report.json")))
    _check_card(out, report, library="transformers", base_model=None)


# ----------------------------------------------------------------------------- publishing


@pytest.fixture
def hf(monkeypatch):
    """An autospec'd HfApi instead of the network, and a token in the environment."""
    from huggingface_hub import HfApi

    api = mock.create_autospec(HfApi, instance=True)
    api.upload_folder.return_value = mock.Mock(commit_url="https://hub.test/org/name/commit/1")
    monkeypatch.setattr("llmdp.export.HfApi", lambda *a, **k: api)
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    return api


def test_push_calls_the_hub_with_the_exact_repo_folder_and_flags(full_run, tmp_path, hf, capsys):
    from llmdp.cli import main

    out = tmp_path / "pub"
    assert main(["export", full_run, "--to", str(out), "--push", "my-org/tiny-dp", "--private"]) == 0
    hf.create_repo.assert_called_once_with("my-org/tiny-dp", private=True, exist_ok=True, repo_type="model")
    hf.upload_folder.assert_called_once_with(
        repo_id="my-org/tiny-dp", folder_path=str(out), repo_type="model", commit_message=mock.ANY)
    printed = capsys.readouterr()
    assert "hf_supersecret" not in printed.out + printed.err
    assert "published my-org/tiny-dp (private)" in printed.out
    from huggingface_hub import ModelCard

    assert "my-org/tiny-dp" in ModelCard.load(out / "README.md").text  # usage snippet


def test_dry_run_lists_exactly_the_folder_and_contacts_nothing(full_run, tmp_path, hf, capsys):
    out = tmp_path / "dry"
    res = export_run(full_run, out, push="my-org/tiny-dp", dry_run=True)
    hf.create_repo.assert_not_called()
    hf.upload_folder.assert_not_called()
    text = capsys.readouterr().out
    listed = [line.strip().split("  (")[0] for line in text.splitlines() if line.startswith("  ")]
    on_disk = sorted(os.path.relpath(os.path.join(r, n), out) for r, _, fs in os.walk(out) for n in fs)
    assert sorted(listed) == on_disk == [n for n, _ in res["files"]]
    assert "public model repo my-org/tiny-dp" in text


def test_unauthenticated_offline_and_failed_uploads_keep_the_folder(full_run, tmp_path, hf, monkeypatch):
    out = tmp_path / "kept"
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ExportError, match="no Hugging Face token: set HF_TOKEN"):
        export_run(full_run, out, push="my-org/x", log=lambda *a: None)
    assert (out / "README.md").exists()
    hf.create_repo.assert_not_called()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ExportError, match="HF_HUB_OFFLINE is set"):
        export_run(full_run, out, push="my-org/x", log=lambda *a: None)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_supersecret")
    hf.upload_folder.side_effect = OSError("connection refused")
    with pytest.raises(ExportError, match=r"publishing to my-org/x failed \(OSError.*intact") as e:
        export_run(full_run, out, push="my-org/x", log=lambda *a: None)
    assert "hf_supersecret" not in str(e.value)
    assert (out / "model.safetensors").exists()


# ----------------------------------------------------------------------------- refusals


def _copy(run_dir, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(run_dir, dst)
    return str(dst)


def test_refusals_name_the_problem(full_run, tmp_path):
    quiet = dict(log=lambda *a: None)
    run = _copy(full_run, tmp_path, "no-ledger")
    os.remove(os.path.join(run, "ledger.jsonl"))
    with pytest.raises(ExportError, match="(?s)ledger.jsonl is missing.*--allow-unverified"):
        export_run(run, tmp_path / "e1", **quiet)
    res = export_run(run, tmp_path / "e1", allow_unverified=True, **quiet)
    assert not res["verified"]
    text = open(tmp_path / "e1" / "README.md").read()
    assert "UNVERIFIED EXPORT" in text and "ledger.jsonl is missing" in text
    from huggingface_hub import ModelCard

    assert ModelCard.load(tmp_path / "e1" / "README.md").data.to_dict()["differential_privacy"]["verified"] is False

    run = _copy(full_run, tmp_path, "no-report")
    os.remove(os.path.join(run, "privacy_report.json"))
    with pytest.raises(ExportError, match="privacy_report.json is missing"):
        export_run(run, tmp_path / "e2", **quiet)

    run = _copy(full_run, tmp_path, "edited")
    rep = json.load(open(os.path.join(run, "privacy_report.json")))
    rep["epsilon"] = rep["epsilon"] / 2
    json.dump(rep, open(os.path.join(run, "privacy_report.json"), "w"))
    with pytest.raises(ExportError, match="privacy_report.json says epsilon = .* but the ledger gives"):
        export_run(run, tmp_path / "e3", **quiet)

    run = _copy(full_run, tmp_path, "weights")
    from safetensors.torch import load_file, save_file

    path = os.path.join(run, "model", "model.safetensors")
    tensors = load_file(path)
    k = next(iter(tensors))
    tensors[k] = tensors[k] + 1e-3
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ExportError, match="differs from the last checkpoint"):
        export_run(run, tmp_path / "e4", **quiet)

    run = _copy(full_run, tmp_path, "incomplete")
    lines = open(os.path.join(run, "metrics.jsonl")).read().splitlines()
    open(os.path.join(run, "metrics.jsonl"), "w").write("\n".join(
        x for x in lines if json.loads(x).get("step") != 4) + "\n")
    from llmdp.report import write_report

    write_report(run)  # a run stopped after 3 of 4 steps, whose report says so
    with pytest.raises(ExportError, match="(?s)status is 'incomplete'.*last checkpoint is at step 4, "
                                          "the report at 3"):
        export_run(run, tmp_path / "e5", **quiet)

    run = _copy(full_run, tmp_path, "no-model")
    shutil.rmtree(os.path.join(run, "model"))
    with pytest.raises(ExportError, match="no final model"):
        export_run(run, tmp_path / "e6", allow_unverified=True, **quiet)

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("mine")
    with pytest.raises(ExportError, match="--to: .* not an export of this run"):
        export_run(full_run, tmp_path / "busy", **quiet)
    assert (tmp_path / "busy" / "x.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="--push: 'nope' is not a Hub repo id"):
        export_run(full_run, tmp_path / "e7", push="nope", **quiet)


def test_a_seeded_run_is_refused(tmp_path):
    run = _run(tmp_path, lora=False, rng="seeded", name="seeded")
    with pytest.raises(ExportError, match="seeded RNG"):
        export_run(run, tmp_path / "out", log=lambda *a: None)
    res = export_run(run, tmp_path / "out", allow_unverified=True, log=lambda *a: None)
    assert any("seeded" in p for p in res["problems"])
    assert "no guarantee against anyone who knows the seed" in open(tmp_path / "out" / "README.md").read()


def test_recipe_push_to_exports_after_training(tmp_path, hf, monkeypatch):
    """output.push_to: a successful `llmdp train` exports to <run>/export and publishes."""
    from llmdp import trainer
    from llmdp.config import ConfigError
    from llmdp.worker import LocalContext, train_loop_per_worker

    with pytest.raises(ConfigError, match=r"output\.push_to"):
        recipe_from_dict({"model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir()},
                          "data": {"path": "x.jsonl"}, "privacy": {"target_epsilon": 1},
                          "train": {"steps": 3, "expected_batch_size": 2},
                          "output": {"name": "x", "push_to": "no-slash"}})

    def local_fit(prepared, log):  # the worker loop in this process instead of Ray
        ckpt = os.path.join(prepared.run_dir, "checkpoints", "checkpoint_000000")
        train_loop_per_worker(prepared.worker_config(), LocalContext(checkpoint_dir=ckpt))

    monkeypatch.setattr(trainer, "_fit", local_fit)
    data = write_notes(tmp_path / "notes.jsonl", 30)
    cfg = recipe_from_dict({
        "model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64}},
        "data": {"path": str(data), "sequence_length": 24},
        "privacy": {"noise_multiplier": 1.0},
        "train": {"expected_batch_size": 8, "steps": 2, "physical_batch_size": 4, "checkpoint_every": 2},
        "output": {"dir": str(tmp_path / "runs"), "name": "pushed", "push_to": "my-org/pushed",
                   "license": "apache-2.0"},
    })
    run_dir = trainer.run(cfg, log=lambda *a: None)
    hf.upload_folder.assert_called_once_with(
        repo_id="my-org/pushed", folder_path=os.path.join(run_dir, "export"), repo_type="model",
        commit_message=mock.ANY)
    hf.create_repo.assert_called_once_with("my-org/pushed", private=False, exist_ok=True, repo_type="model")
    from huggingface_hub import ModelCard

    assert ModelCard.load(os.path.join(run_dir, "export", "README.md")).data.license == "apache-2.0"
