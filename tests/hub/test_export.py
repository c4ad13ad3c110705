"""`llmdp export`: the folder loads offline and generates what the trained model generates,
the card states the report, the Hub upload is called exactly, and bad runs are refused.

Owns invariant `only-dp-outputs-leave` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import json
import os
import shutil
from unittest import mock

import pytest
import torch

from llmdp.config.schema import recipe_from_dict
from llmdp.hub.export import ExportError, export_run
from tests.helpers import tiny_tokenizer_dir, write_notes

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def _run(tmp_path, *, lora: bool, rng: str = "secure", name: str = "run", data=None,
         tokenizer=None, unit: str = "sequence", base=None):
    """A finished run made by the worker loop in this process (no Ray): final model,
    ledger, report and a checkpoint where Ray would put it; ``base``: a local pretrained
    model folder to start from (else a tiny model built from a config)."""
    from llmdp.report.build import write_report
    from llmdp.run.launch import prepare
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    data = data or write_notes(tmp_path / "notes.jsonl", 30)
    raw = {
        "model": {"init": "tiny", "tokenizer": tokenizer or tiny_tokenizer_dir(),
                  "tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "intermediate_size": 32, "max_position_embeddings": 64},
                  "lora": LORA if lora else None} if base is None else
                 {"init": "pretrained", "name_or_path": str(base), "lora": LORA if lora else None},
        "data": {"path": str(data), "sequence_length": 24, "unit": unit,
                 **({} if unit == "sequence" else {"max_rows_per_unit": 2})},
        # A fixed sigma: no calibration, and a cheap PLD in every report this file rebuilds.
        # Each run its own ledgers' database: the module's runs train on the same bytes in
        # different folders, which would otherwise be refused as one dataset's new ledger.
        "privacy": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "rng": rng,
                    "ledger": str(tmp_path / "ledger.sqlite"),
                    **({"seed": 3} if rng == "seeded" else {})},
        "optim": {"name": "adamw", "lr": 5e-2, "schedule": "constant"},
        "train": {"expected_batch_size": 8, "steps": 4, "physical_batch_size": 4,
                  "checkpoint_every": 2},
        "output": {"dir": str(tmp_path / "runs"), "name": name},
    }
    # ... and its own registry of ledger databases (a user's: issue 49 item 3 refuses data
    # with a spent ledger in another database of the same registry).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(tmp_path / "registry"))
        prep = prepare(recipe_from_dict(raw), log=lambda *a: None)
        ckpt = os.path.join(prep.run_dir, "checkpoints", "checkpoint_000000")
        train_loop_per_worker(prep, LocalContext(checkpoint_dir=ckpt))
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
    old = os.umask(0o022)
    try:
        res = export_run(full_run, out, log=lambda *a: None)
    finally:
        os.umask(old)
    assert res["format"] == "full" and res["verified"] and res["problems"] == []
    # meant for publication: ordinary permissions (issue 37), though the run's files are 0600
    assert os.stat(out).st_mode & 0o777 == 0o755
    assert all(os.stat(os.path.join(r, n)).st_mode & 0o777 == 0o644 for r, _, ns in os.walk(out) for n in ns)
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
    with pytest.raises(ExportError, match=r"--base-model: .*not a Hub id"):  # published: a Hub id
        export_run(lora_run, tmp_path / "a", base_model=str(tmp_path), push="org/name",
                   dry_run=True, log=lambda *a: None)
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


def test_a_local_lora_export_names_its_local_base_as_given(tmp_path):
    """Issue 51 item 8: a LoRA run on a local base (an in-house registry, no Hub id) exports
    locally (no --push): adapter_config.json and the card name the base as the recipe gave
    it, and the folder loads on it; publishing it (--push) still needs a Hub id."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import TINY_VOCAB, tiny_model, tiny_tokenizer

    base = tmp_path / "in-house" / "base-7"
    tiny_model("llama", vocab_size=TINY_VOCAB, num_layers=1).save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    run = _run(tmp_path, lora=True, base=base, name="local-base")
    out = tmp_path / "adapter"
    res = export_run(run, out, log=lambda *a: None)
    assert res["format"] == "adapter"
    assert json.load(open(out / "adapter_config.json"))["base_model_name_or_path"] == str(base)
    card = (out / "README.md").read_text()
    assert f"a LoRA adapter (PEFT) for `{base}`" in card
    assert json.load(open(out / "llmdp_export.json"))["base_model"] == str(base)
    _, trained = _trained_peft(run)
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(out))
    assert _greedy(exported) == _greedy(trained)
    # given explicitly (where the registry keeps the base): recorded as given
    given = str(tmp_path / "registry" / "base-7")
    export_run(run, tmp_path / "b", base_model=given, log=lambda *a: None)
    assert json.load(open(tmp_path / "b" / "adapter_config.json"))["base_model_name_or_path"] == given
    with pytest.raises(ExportError, match=r"not a Hub model \(a local path\).*--base-model ORG/NAME"):
        export_run(run, tmp_path / "c", push="org/name", dry_run=True, log=lambda *a: None)
    assert not (tmp_path / "c").exists()


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
    monkeypatch.setattr("llmdp.hub.export.HfApi", lambda *a, **k: api)
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


def _copy(run_dir, tmp_path, name="copy", own_ledger=False):
    """A copy of a run directory. ``own_ledger``: with a copy of its dataset ledger's
    database, so that changing the copy's releases leaves the original's ledger alone."""
    dst = tmp_path / name
    shutil.copytree(run_dir, dst)
    if own_ledger:
        import sqlite3

        plan_path = dst / "plan.json"
        info = json.load(open(plan_path))
        db_copy = str(tmp_path / f"{name}-ledger.sqlite")
        src = sqlite3.connect(info["dataset_ledger"]["location"])
        src.execute("VACUUM INTO ?", (db_copy,))
        src.close()
        info["dataset_ledger"]["location"] = db_copy
        json.dump(info, open(plan_path, "w"))
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
    from llmdp.report.build import write_report

    write_report(run)  # a run stopped after 3 of 4 steps, whose report says so
    with pytest.raises(ExportError, match="(?s)status is 'incomplete'.*last checkpoint is at step 4, "
                                          "the report at 3"):
        export_run(run, tmp_path / "e5", **quiet)

    # Issue 29 item 3: a run an older version stopped on its count of non-finite units
    # (its length depends on private data without DP) is refused; a ledger stop is not.
    for cause, refused in ((None, True), ("ledger", False)):
        run = _copy(full_run, tmp_path, f"stopped-{cause}")
        lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
        lines = [x for x in lines if x.get("step") != 4 and x.get("event") != "end"]
        lines.append({"event": "stopped", "step": 3, "reason": "3 steps had privacy units whose "
                      "gradient was not finite, more than train.max_nonfinite_steps=2",
                      **({"cause": cause} if cause else {})})
        open(os.path.join(run, "metrics.jsonl"), "w").write("".join(json.dumps(x) + "\n" for x in lines))
        assert write_report(run)["status"] == "stopped"
        with pytest.raises(ExportError) as err:
            export_run(run, tmp_path / f"e-stopped-{cause}", **quiet)
        assert ("stopped early" in str(err.value) and "statistic of private data" in str(err.value)) is refused

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
    from llmdp.config.schema import ConfigError
    from llmdp.run import launch as trainer
    from llmdp.train.loop import LocalContext, train_loop_per_worker

    with pytest.raises(ConfigError, match=r"output\.push_to"):
        recipe_from_dict({"model": {"init": "tiny", "tokenizer": tiny_tokenizer_dir()},
                          "data": {"path": "x.jsonl"}, "privacy": {"target_epsilon": 1},
                          "train": {"steps": 3, "expected_batch_size": 2},
                          "output": {"name": "x", "push_to": "no-slash"}})

    def local_fit(prepared, log, interrupts=None):  # the worker loop in this process instead of Ray
        ckpt = os.path.join(prepared.run_dir, "checkpoints", "checkpoint_000000")
        train_loop_per_worker(prepared, LocalContext(checkpoint_dir=ckpt))

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


# ----------------------------------------------------------------------------- what is published

# Names of metrics and statistics computed on the private data without DP, and of hashes of
# it: none may appear in a published file (DESIGN, invariant `only-dp-outputs-leave`).
INTERNAL_NAMES = ("train_loss", "worker0_units", "worker0_tokens", "tokens_per_s", "units_per_s",
                  "worker0_clipped_fraction", "worker0_norm_fallbacks", "worker0_norm_bound_max",
                  "micro_steps", "sample_truncated", "step_time_s",
                  "data_statistics", "steps_truncated", "dataset_fingerprint", "internal_metrics",
                  "sha256", "num_records", "num_units", "training loss")
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "spm.model", "tokenizer.model")


def _files(*folders):
    for folder in folders:
        for root, _, names in os.walk(folder):
            for n in names:
                yield os.path.join(root, n)


def _private_tokenizer(tmp_path, corpus):
    from llmdp.config.schema import tokenizer_recipe_from_dict
    from llmdp.tokenizer.train import train_tokenizer

    cfg = tokenizer_recipe_from_dict({
        "data": {"path": str(corpus), "unit": "document"},
        "privacy": {"target_epsilon": 8.0, "max_words_per_unit": 32,
                    "ledger": str(tmp_path / "ledger.sqlite")},  # the run's (`_run`) database
        "tokenizer": {"model_type": "bpe", "vocab_size": 400},
        "output": {"dir": str(tmp_path / "tokenizers"), "name": "tok"},
    })
    train_tokenizer(cfg, log=lambda *a: None)
    return cfg.out_dir


def test_export_and_private_tokenizer_publish_no_private_statistics_or_hashes(tmp_path, monkeypatch):
    """A run trained with a private tokenizer on the same notes, exported: neither the
    export nor the tokenizer folder holds an internal metric, a data statistic (name or
    value) or a hash of the data (12+ hex prefix), in any file, PNG and safetensors
    included; the published ledger alone gives the published ε; the local run keeps all."""
    import hashlib
    import re

    from PIL import Image
    from safetensors import safe_open

    from llmdp.data.sources import source_fingerprint
    from llmdp.privacy.accounting import accountant
    from llmdp.privacy.accounting.events import event_from_json

    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "cache"))  # the dataset ledger is named by the hash
    corpus = write_notes(tmp_path / "notes.jsonl", 120, seed=5)
    tok_dir = _private_tokenizer(tmp_path, corpus)
    run = _run(tmp_path, lora=False, name="private-tok", data=corpus, tokenizer=tok_dir, unit="document")
    out = tmp_path / "export"
    res = export_run(run, out, log=lambda *a: None)
    assert res["verified"], res["problems"]  # verified against the full local report

    full = json.load(open(os.path.join(run, "privacy_report.json")))
    assert full["tokenizer"]["composed_into_guarantee"]
    raw = open(corpus, "rb").read()
    hashes = {hashlib.sha256(raw).hexdigest(), source_fingerprint(path=str(corpus)), full["dataset_fingerprint"]}
    assert all(isinstance(h, str) and len(h) >= 32 for h in hashes)
    stats = {k: v for k, v in full["data_statistics"].items()
             if k not in ("note", "computed_on_private_data", "kind", "sequence_length")}  # not counts
    names = set(INTERNAL_NAMES) | set(stats)
    # Counts computed without DP; N (dataset_size) is used by the accountant and published as is.
    values = {v for v in stats.values() if isinstance(v, int) and not isinstance(v, bool)
              and v >= 100 and v != full["dataset_size"]}
    assert values and "num_tokens" in stats
    # The local run keeps everything (so the checks below can fail): the hash in its ledger,
    # the statistics and internal metrics in its report.
    local = open(os.path.join(run, "ledger.jsonl")).read() + open(os.path.join(run, "privacy_report.json")).read()
    assert full["dataset_fingerprint"] in local and "train_loss" in local and "num_tokens" in local

    published = list(_files(out, tok_dir))
    assert {"privacy_report.json", "privacy_report.md", "privacy_report.png", "ledger.jsonl",
            "README.md", "model.safetensors", "llmdp_tokenizer.json"} <= {os.path.basename(p) for p in published}
    for path in published:
        data = open(path, "rb").read()
        low = data.lower()
        for h in hashes:
            assert h[:12].encode() not in low, (path, h[:12])
        for name in names:
            assert name.encode() not in data, (path, name)
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                meta = json.dumps(f.metadata() or {})
            assert not any(n in meta for n in names) and not any(h[:12] in meta for h in hashes)
        if os.path.basename(path) in _VOCAB_FILES or path.endswith((".png", ".safetensors")):
            continue  # token ids and weights: numbers that are no statistic
        text = data.decode("utf-8")
        for v in values:
            assert not re.search(rf"(?<![\d.]){v}(?![\d.])", text), (path, v)

    # The published plot is the ε panel alone (the local one also has the loss curve).
    assert Image.open(out / "privacy_report.png").size[0] < 0.6 * Image.open(
        os.path.join(run, "privacy_report.png")).size[0]
    # The published ledger is complete: the tokenizer's release and every step, without
    # fingerprints, and ε recomputed from it alone is the published one.
    recs = [json.loads(line) for line in open(out / "ledger.jsonl")]
    assert recs[0]["meta"]["mechanism"] == "private-tokenizer" and recs[0]["extra"]["delta_threshold"] > 0
    assert sum(r["count"] for r in recs[1:]) == full["steps"]
    pub = json.load(open(out / "privacy_report.json"))
    eps = accountant.epsilon_with_threshold([(event_from_json(r["event"]), r["count"]) for r in recs],
                                            pub["delta_accountant"], accountant.threshold_delta(recs),
                                            pub["accountant"])
    assert eps == pytest.approx(pub["epsilon"], rel=1e-9) and pub["epsilon"] == full["epsilon"]
    assert pub["epsilon_curve"][-1][1] == full["epsilon"]
    # The private tokenizer's facts stay beside its folder, for training runs on this machine.
    from llmdp.tokenizer.train import private_facts_path, read_tokenizer_info

    assert not private_facts_path(tok_dir).startswith(os.path.abspath(tok_dir) + os.sep)
    assert read_tokenizer_info(tok_dir)["data"]["sha256"] == hashlib.sha256(raw).hexdigest()


def test_step_time_is_an_internal_metric(full_run, tmp_path):
    """step_time_s grows with the realized sample size: listed as internal, never published."""
    report = json.load(open(os.path.join(full_run, "privacy_report.json")))
    steps = [json.loads(x) for x in open(os.path.join(full_run, "metrics.jsonl")) if '"event"' not in x]
    assert steps and all("step_time_s" in m for m in steps)
    assert "step_time_s" in report["internal_metrics"]
    assert "`step_time_s`" in open(os.path.join(full_run, "privacy_report.md")).read()
    out = tmp_path / "export"
    export_run(full_run, out, log=lambda *a: None)
    for path in _files(out):
        assert b"step_time_s" not in open(path, "rb").read(), path


def test_curve_and_progress_count_the_ledger_not_completed_steps(full_run, tmp_path):
    """Steps re-executed after a failure are in the ledger twice: the plot's curve and the
    progress bar end at the report's ε, which composes every step of the ledger."""
    from tqdm import tqdm

    from llmdp.privacy.ledger.records import Ledger
    from llmdp.privacy.ledger.service import LedgerService
    from llmdp.privacy.plan import DPPlan
    from llmdp.report.build import write_report
    from llmdp.report.spent import epsilon_curve
    from llmdp.run.progress import Progress

    run = _copy(full_run, tmp_path, "re-executed", own_ledger=True)
    path = os.path.join(run, "ledger.jsonl")
    last = [r for r in Ledger(path).records() if r["kind"] == "release"][-1]
    info = json.load(open(os.path.join(run, "plan.json")))
    plan = DPPlan.from_dict(info["plan"])
    # A second attempt that re-ran steps 3-4 after the first one had reserved them.
    svc = LedgerService(location=info["dataset_ledger"]["location"],
                        dataset_id=info["dataset_ledger"]["dataset_id"], run_ledger=path,
                        run_id=last["run_id"], meta=last["meta"], block_size=2,
                        total_steps=plan.steps, event_json=last["event"], delta=plan.delta,
                        accountant=plan.accountant)
    svc.start_attempt()
    svc.ensure(2)
    report = write_report(run)
    assert report["steps"] == plan.steps + 2 and report["steps_completed"] == plan.steps
    assert report["epsilon"] > plan.epsilon() * 1.01  # the extra steps matter

    curve = epsilon_curve(run)
    assert curve[0] == (0, 0.0) and curve[-1] == (plan.steps + 2, report["epsilon"])
    assert all(a[1] <= b[1] for a, b in zip(curve, curve[1:]))
    assert report["epsilon_curve"][-1] == [plan.steps + 2, report["epsilon"]]

    progress = Progress(os.path.join(run, "metrics.jsonl"), plan, info.get("prior_releases") or [])
    progress._offset = 0  # replay the whole metrics file
    bar, shown = tqdm(total=plan.steps, disable=True), {}
    progress._read_metrics(bar, shown)
    assert bar.n == plan.steps
    # While running: the display grid, conservative (never below the ledger's ε).
    assert report["epsilon"] <= shown["eps"] <= report["epsilon"] * 1.01
    progress._poll(bar, shown, final=True)
    assert shown["eps"] == report["epsilon"]


def test_publishable_report_is_an_allow_list(full_run):
    """A key the allow-list does not name stays out (a new internal metric is private by
    default), and a hash of the data inside an allowed text (a stop reason naming the
    dataset ledger file) is redacted; the guarantee's numbers are kept as they are."""
    from llmdp.privacy.ledger.records import Ledger
    from llmdp.record.publish import PUBLISHABLE_REPORT, publishable_ledger, publishable_report

    full = json.load(open(os.path.join(full_run, "privacy_report.json")))
    fp = full["dataset_fingerprint"]
    full["new_internal_count"] = 12345
    full["sampling"] = {**full["sampling"], "new_internal_rate": 0.5}
    full["stopped"] = f"budget reached on the dataset ledger /c/ledgers/{fp[:16]}.jsonl"
    pub = publishable_report(full)
    assert "new_internal_count" not in pub and "new_internal_rate" not in pub["sampling"]
    assert set(pub) - {"publishable", "withheld"} <= set(PUBLISHABLE_REPORT)
    # the stop's local text (it names the dataset ledger and what other runs spent on it) is
    # replaced by one that depends on this run alone
    assert fp[:12] not in json.dumps(pub) and "ledgers/" not in pub["stopped"]
    assert pub["stopped"] == "stopped early (the reason is internal)"
    for key in ("epsilon", "delta", "epsilon_by_accountant", "noise_multiplier", "steps", "dataset_size"):
        assert pub[key] == full[key]
    assert all("time" not in r for r in pub["ledger"]["releases"])
    records = Ledger(os.path.join(full_run, "ledger.jsonl")).records()
    assert fp in json.dumps(records)  # the local ledger has it in every line's meta
    lines = publishable_ledger(records)
    assert lines and fp[:12] not in json.dumps(lines)
    assert [(r["event"], r["count"]) for r in lines] == [
        (r["event"], r["count"]) for r in records if r["kind"] == "release"]
