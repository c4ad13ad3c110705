import dataclasses
import json
import os
import pathlib

import pytest
import torch
from torch import nn

from llmdp.config.schema import LoraConfig, ModelConfig
from llmdp.train.models import (
    build_tiny_model,
    count_parameters,
    load_model,
    tiny_config_hash,
    trainable_parameters,
    validate_trainable_modules,
)
from tests.helpers import random_rows, tiny_model, tiny_model_config, tiny_tokenizer_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO_TOKENIZER = REPO / "tokenizers" / "demo-public"
FAMILIES = ["llama", "gpt2", "gemma", "qwen2"]
LORA_TARGETS = {"llama": ("q_proj", "v_proj"), "gpt2": ("c_attn",), "gemma": ("q_proj", "v_proj"),
                "qwen2": ("q_proj", "v_proj")}


def _tiny_cfg(family, **kw):
    return ModelConfig(init="tiny", tokenizer=tiny_tokenizer_dir(),
                       tiny=tiny_model_config(family), **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_build_and_load_offline(tmp_path, family):
    model, tok = load_model(_tiny_cfg(family), cache_dir=tmp_path)
    (built,) = [p for p in tmp_path.iterdir() if p.name.startswith("tiny-")]
    assert (built / "config.json").exists() and list(built.glob("*.safetensors"))
    assert model.config.model_type == family
    assert model.get_input_embeddings().num_embeddings == len(tok)
    assert model.config._attn_implementation == "eager"
    assert model.dtype == torch.float32
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop"):
        assert getattr(model.config, name, 0.0) == 0.0
    b = random_rows(2, 12, vocab_size=len(tok))
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
    assert out.logits.shape == (2, 12, len(tok)) and torch.isfinite(out.loss)

    # Loading again reuses the built folder; the weights are the same (seeded build).
    marker = built / "llmdp_tiny.json"
    mtime = marker.stat().st_mtime_ns
    model2, _ = load_model(_tiny_cfg(family), cache_dir=tmp_path)
    assert marker.stat().st_mtime_ns == mtime
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n


def test_build_tiny_model_skips_and_rebuilds(tmp_path):
    cfg = tiny_model_config("llama")
    out = tmp_path / "m"
    state = torch.random.get_rng_state()
    assert build_tiny_model(out, cfg, 64, 2, 0, 1) == str(out)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    marker = out / "llmdp_tiny.json"
    mtime = marker.stat().st_mtime_ns
    build_tiny_model(out, cfg, 64, 2, 0, 1)
    assert marker.stat().st_mtime_ns == mtime
    wider = dataclasses.replace(cfg, hidden_size=32)
    build_tiny_model(out, wider, 64, 2, 0, 1)
    assert json.loads(marker.read_text())["spec"]["hidden_size"] == 32
    assert tiny_config_hash(cfg, 64, 2, 0, 1) != tiny_config_hash(wider, 64, 2, 0, 1)
    assert tiny_config_hash(cfg, 64, 2, 0, 1) != tiny_config_hash(cfg, 65, 2, 0, 1)
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []


def test_dtype_and_pretrained_path(tmp_path):
    d = build_tiny_model(tmp_path / "ckpt", tiny_model_config("qwen2"), 300, 2, 0, 1)
    cfg = ModelConfig(init="pretrained", name_or_path=d, tokenizer=tiny_tokenizer_dir(),
                      dtype="float64")
    model, tok = load_model(cfg, cache_dir=tmp_path / "cache")
    assert model.dtype == torch.float64
    assert model.config._attn_implementation == "sdpa"
    assert not (tmp_path / "cache").exists()  # nothing built for a checkpoint


def test_a_pretrained_gpt_oss_loads_with_eager_attention(tmp_path):
    """gpt-oss has no sdpa attention (its sinks) and transformers refuses sdpa for it: a
    pretrained gpt-oss checkpoint loads with eager attention, not a raw ValueError."""
    d = build_tiny_model(tmp_path / "ckpt", tiny_model_config("gpt_oss"), 300, 2, 0, 1)
    cfg = ModelConfig(init="pretrained", name_or_path=d, tokenizer=tiny_tokenizer_dir())
    model, _ = load_model(cfg, cache_dir=tmp_path / "cache")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_only_adapters_trainable(tmp_path, family):
    cfg = _tiny_cfg(family, lora=LoraConfig(r=4, alpha=8.0, target_modules=LORA_TARGETS[family]))
    model, _ = load_model(cfg, cache_dir=tmp_path)
    named = trainable_parameters(model)
    assert named and all("lora_" in n for n, _ in named)
    counts = count_parameters(model)
    assert counts["trainable"] == sum(p.numel() for _, p in named)
    assert 0 < counts["trainable"] < counts["total"]


def test_lora_bad_targets_name_the_field(tmp_path):
    cfg = _tiny_cfg("llama", lora=LoraConfig(target_modules=("c_attn",)))
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules.*q_proj"):
        load_model(cfg, cache_dir=tmp_path)


def test_gradient_checkpointing(tmp_path):
    model, _ = load_model(_tiny_cfg("llama", gradient_checkpointing=True), cache_dir=tmp_path)
    assert model.is_gradient_checkpointing and model.config.use_cache is False


def test_full_finetuning_counts():
    model = tiny_model("llama")
    counts = count_parameters(model)
    assert counts["trainable"] == counts["total"] == sum(p.numel() for p in model.parameters())
    model.model.embed_tokens.weight.requires_grad_(False)
    assert "model.embed_tokens.weight" not in dict(trainable_parameters(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_give_exact_per_sample_grads(family):
    """Eager attention works with both batched autograd and torch.func.vmap (float64).

    ``exact=True``: RMSNorm and softmax in float64 (transformers runs them in float32).
    """
    from torch.func import functional_call, grad, vmap

    model = tiny_model(family, dtype=torch.float64, exact=True)
    b = random_rows(3, 10, vocab_size=64, seed=1)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def unit_loss(p, ids, mask, labels):
        logits = functional_call(model, p, (), {"input_ids": ids[None],
                                                "attention_mask": mask[None]}).logits[0]
        return nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)

    batched = vmap(grad(unit_loss), in_dims=(None, 0, 0, 0))(
        params, b["input_ids"], b["attention_mask"], b["labels"])
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    losses = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), b["labels"][:, 1:],
                                         ignore_index=-100, reduction="none").sum(1)
    losses = losses / b["num_target_tokens"]
    plist = list(model.parameters())
    autograd = torch.autograd.grad(losses, plist, grad_outputs=torch.eye(3, dtype=losses.dtype),
                                   is_grads_batched=True)
    for (name, _), g in zip(model.named_parameters(), autograd):
        for i in range(3):
            single = grad(unit_loss)(params, b["input_ids"][i], b["attention_mask"][i],
                                     b["labels"][i])[name]
            torch.testing.assert_close(batched[name][i], single, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(g[i], single, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_helper_matches_transformers(family):
    b = random_rows(3, 10, vocab_size=64, seed=2)
    ref = tiny_model(family, dtype=torch.float64)
    exact = tiny_model(family, dtype=torch.float64, exact=True)
    kw = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    # Same math; transformers' float32 round trips only (float32 epsilon ~1.2e-7).
    torch.testing.assert_close(exact(**kw).logits, ref(**kw).logits, rtol=0, atol=1e-6)


class _Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), norm)


def test_batchnorm_is_refused_with_its_path():
    with pytest.raises(ValueError) as exc:
        validate_trainable_modules(_Net(nn.BatchNorm1d(4)))
    msg = str(exc.value)
    assert "'block.1'" in msg and "BatchNorm1d" in msg and "mixes examples" in msg

    frozen = _Net(nn.BatchNorm1d(4))
    frozen.block[1].requires_grad_(False)
    with pytest.raises(ValueError, match="training mode"):
        validate_trainable_modules(frozen)  # frozen, but training mode uses batch statistics
    frozen.eval()
    validate_trainable_modules(frozen)  # frozen and in eval mode: per-example
    with pytest.raises(ValueError):
        validate_trainable_modules(frozen, assume_training=True)

    with pytest.raises(ValueError, match="SyncBatchNorm"):
        validate_trainable_modules(_Net(nn.SyncBatchNorm(4)).eval())
    with pytest.raises(ValueError, match="InstanceNorm1d"):
        validate_trainable_modules(_Net(nn.InstanceNorm1d(4, track_running_stats=True)))
    validate_trainable_modules(_Net(nn.InstanceNorm1d(4)))
    validate_trainable_modules(_Net(nn.GroupNorm(2, 4)))
    validate_trainable_modules(_Net(nn.LayerNorm(4)))
    validate_trainable_modules(tiny_model("gemma"))


def test_demo_public_tokenizer_ships_and_round_trips():
    from transformers import AutoTokenizer

    size = sum(f.stat().st_size for f in DEMO_TOKENIZER.iterdir())
    assert size < 1_000_000
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    assert len(tok) == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>", "</s>", "<pad>", "<unk>")
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    text = ("Patient: Doe, Jane    MRN: 12345678\n  - metformin 500 mg PO BID\n"
            "Naïve café — 37.2 °C , spaced  out ,\tdone 😀")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok(text)["input_ids"] == ids  # no BOS/EOS added on encode
    assert len(ids) < len(text.encode())  # merges learned


def test_public_corpus_has_no_private_markers():
    from llmdp.data.synthetic import generate_clinical_notes
    from llmdp.tokenizer.public import generate_public_corpus

    lines = generate_public_corpus(3000, seed=0)
    assert lines == generate_public_corpus(3000, seed=0)
    assert len(set(lines)) > 1500
    blob = "\n".join(lines)
    for marker in ("MRN", "DOB", "Patient:", "Name:", "Chief complaint", "HPI:",
                   "Electronically signed", "Date of service", "Assessment and plan"):
        assert marker not in blob, marker
    private_lines = {line.strip() for r in generate_clinical_notes(300, seed=0)
                     for line in r["text"].splitlines() if len(line.strip()) > 20}
    assert private_lines.isdisjoint(line.strip() for line in lines)


def test_train_public_tokenizer_is_deterministic(tmp_path):
    from llmdp.tokenizer.public import train_public_tokenizer

    a = train_public_tokenizer(tmp_path / "a", vocab_size=280, num_lines=400, seed=0)
    b = train_public_tokenizer(tmp_path / "b", vocab_size=280, num_lines=400, seed=0)
    ta = pathlib.Path(a, "tokenizer.json").read_bytes()
    assert ta == pathlib.Path(b, "tokenizer.json").read_bytes()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        assert pathlib.Path(a, name).exists()
    c = train_public_tokenizer(tmp_path / "c", vocab_size=280, num_lines=400, seed=1)
    assert pathlib.Path(c, "tokenizer.json").read_bytes() != ta
    with pytest.raises(ValueError, match="vocab_size"):
        train_public_tokenizer(tmp_path / "d", vocab_size=100)
