"""Models: build tiny models from a config, load any HF causal LM + tokenizer, LoRA, checks.

Model I/O is transformers' and peft's: a tiny model is built once with
``save_pretrained`` into a cache folder and then loaded with ``from_pretrained`` exactly
like a downloaded checkpoint, so the tiny demo exercises the same code path as a real
model.

Attention implementation: tiny models use ``"eager"``. Both ``"eager"`` and ``"sdpa"``
give exact per-sample gradients through ``torch.autograd.grad(..., is_grads_batched=True)``
(checked in float64 for all four families), but only ``"eager"`` also works under
``torch.func.vmap`` (transformers' SDPA mask path makes a data-dependent check that vmap
rejects), which the reference per-unit gradients (``llmdp.clipping.reference``) use.
Pretrained models default to ``"sdpa"`` for speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from llmdp._fs import building_dir, install_dir
from llmdp.base.hf import (
    dtype_kwarg,
    hub_offline_flag,
    is_connection_error,
    quiet_peft,
    save_kwargs,
)
from llmdp.config.validate import ConfigError
from llmdp.tokenizer.adapt import adapted_model_hash, build_adapted_model

log = logging.getLogger(__name__)

TINY_ATTN_IMPLEMENTATION = "eager"
PRETRAINED_ATTN_IMPLEMENTATION = "sdpa"
FAMILIES = ("llama", "gpt2", "gemma", "qwen2", "qwen3_moe", "gpt_oss")
MOE = ("qwen3_moe", "gpt_oss")  # tiny mixtures of experts: 4 experts, top-2, every layer sparse
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_TINY_FIELDS = (
    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
    "max_position_embeddings", "tie_word_embeddings", "seed",
)
_TINY_MARKER = "llmdp_tiny.json"


# ----------------------------------------------------------------------------- tiny models


def _tiny_spec(tiny_cfg, family, vocab_size, pad_token_id, bos_token_id, eos_token_id) -> dict:
    family = family or getattr(tiny_cfg, "family", None) or "llama"
    if family not in FAMILIES:
        raise ValueError(f"model.tiny.family={family!r} is not one of {list(FAMILIES)}")
    spec: dict[str, Any] = {"family": family}
    for name in _TINY_FIELDS:
        if not hasattr(tiny_cfg, name):
            raise ValueError(f"model.tiny has no field {name!r} (got {type(tiny_cfg).__name__})")
        spec[name] = getattr(tiny_cfg, name)
    spec.update(vocab_size=int(vocab_size), pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                eos_token_id=eos_token_id, format_version=1)
    return spec


def tiny_config_hash(tiny_cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id,
                     family: str | None = None) -> str:
    spec = _tiny_spec(tiny_cfg, family, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def tiny_hf_config(tiny_cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id,
                   family: str | None = None):
    """The transformers config of a tiny model (dropout 0 everywhere)."""
    s = _tiny_spec(tiny_cfg, family, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    if s["hidden_size"] % s["num_heads"]:
        raise ValueError(
            f"model.tiny.hidden_size={s['hidden_size']} is not divisible by "
            f"model.tiny.num_heads={s['num_heads']}"
        )
    ids = dict(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    common = dict(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"], intermediate_size=s["intermediate_size"],
        max_position_embeddings=s["max_position_embeddings"],
        tie_word_embeddings=s["tie_word_embeddings"], attention_dropout=0.0, **ids,
    )
    fam = s["family"]
    if fam in MOE:
        from transformers import AutoConfig

        head_dim = s["hidden_size"] // s["num_heads"]
        moe = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=s["intermediate_size"], decoder_sparse_step=1,
                   mlp_only_layers=[], head_dim=head_dim)
        if fam == "gpt_oss":  # alternating sliding-window and full attention, with sinks
            moe.update(layer_types=[("sliding_attention", "full_attention")[i % 2]
                                    for i in range(s["num_layers"])],
                       sliding_window=max(2, s["max_position_embeddings"] // 4))
        return AutoConfig.for_model(fam, **common, **moe)
    if fam == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if fam == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(use_sliding_window=False, **common)
    if fam == "gemma":
        from transformers import GemmaConfig

        # Gemma's default head_dim is 256 whatever the width; keep hidden = heads * head_dim.
        return GemmaConfig(head_dim=s["hidden_size"] // s["num_heads"], **common)
    from transformers import GPT2Config

    # GPT-2 has multi-head attention only: num_kv_heads does not apply.
    return GPT2Config(
        vocab_size=s["vocab_size"], n_embd=s["hidden_size"], n_layer=s["num_layers"],
        n_head=s["num_heads"], n_inner=s["intermediate_size"],
        n_positions=s["max_position_embeddings"], tie_word_embeddings=s["tie_word_embeddings"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, **ids,
    )


def _read_marker(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, _TINY_MARKER)) as f:
            return json.load(f).get("hash")
    except (OSError, ValueError):
        return None


def build_tiny_model(out_dir, tiny_cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id,
                     *, family: str | None = None) -> str:
    """Build a randomly initialized tiny model of ``tiny_cfg.family`` and save it to ``out_dir``.

    Initialization is seeded by ``tiny_cfg.seed`` (the global torch RNG is left as it was).
    Skipped when ``out_dir`` already holds a model built from the same config (recorded in
    ``llmdp_tiny.json``). The folder is written to a temporary sibling and renamed into
    place, so concurrent builders (several Ray workers) are safe.
    """
    from transformers import AutoModelForCausalLM

    out_dir = os.path.abspath(os.fspath(out_dir))
    spec = _tiny_spec(tiny_cfg, family, vocab_size, pad_token_id, bos_token_id, eos_token_id)
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    if _read_marker(out_dir) == h:
        return out_dir

    config = tiny_hf_config(tiny_cfg, vocab_size, pad_token_id, bos_token_id, eos_token_id, family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(spec["seed"]))
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=TINY_ATTN_IMPLEMENTATION, dtype=torch.float32
        )

    with building_dir(out_dir, ".tmp-tiny-") as tmp:
        model.save_pretrained(tmp, **save_kwargs(model))
        with open(os.path.join(tmp, _TINY_MARKER), "w") as f:  # written last
            json.dump({"hash": h, "spec": spec}, f, indent=2, sort_keys=True)
            f.write("\n")
        if not install_dir(tmp, out_dir, lambda: _read_marker(out_dir) == h):
            return out_dir  # a concurrent builder finished first
    log.info("built tiny %s model in %s", spec["family"], out_dir)
    return out_dir


# ------------------------------------------------------------------------------- loading


def check_local_path(name_or_path, key: str) -> None:
    """A value that is a local path (absolute, or ./ ../ ~; the recipe loader makes every
    path-like value absolute) must exist: it is never sent to a hub as a model id, where
    it would be retried against the network and fail with a long traceback. Anything else
    that is not an existing folder is a Hub id: cached, or reachable (``check_hub_model``)."""
    value = os.fspath(name_or_path)
    if (os.path.isabs(value) or value.startswith(("./", "../", "~"))) \
            and not os.path.exists(os.path.expanduser(value)):
        raise ConfigError(
            f"{key}: {value} does not exist (a local path, so it is not looked up on the "
            f"Hugging Face Hub); fix the path, create it first, or give a Hub id like org/name",
            key=key,
        )
    if not os.path.exists(os.path.expanduser(value)):
        check_hub_model(value, key)


# Files a saved tokenizer consists of (one of them at least): a folder without any holds no
# tokenizer, and transformers would build an empty one from the model's config alone.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _has_tokenizer_files(folder: str) -> bool:
    names = os.listdir(folder)
    return any(n in TOKENIZER_FILES or n.endswith((".tiktoken", ".spm")) for n in names)


def _no_tokenizer_fix(key: str) -> str:
    if key == "model.name_or_path":
        return ("copy the model's tokenizer files into that folder, or set model.tokenizer to "
                "the folder or Hub id of its tokenizer")
    return f"set {key} to a folder that holds a saved tokenizer, or to a Hub id"


def check_tokenizer_vocabulary(tokenizer, name_or_path, key: str) -> None:
    """A tokenizer with no token besides its special ones encodes every text to nothing
    (what transformers builds from a model folder without tokenizer files): refused, before
    any data is encoded with it and anything is spent."""
    special = set(tokenizer.all_special_ids)
    size = len(tokenizer)
    if size - len(special & set(range(size))) < 1:
        raise ConfigError(
            f"{key}: the tokenizer of {os.fspath(name_or_path)!r} has a vocabulary of {size} "
            f"token(s), all special ({', '.join(map(str, tokenizer.all_special_tokens)) or 'none'}): "
            f"it encodes every text to nothing, so the run would train on nothing and still "
            f"spend its ε. Fix: {_no_tokenizer_fix(key)}", key=key)


def load_tokenizer(name_or_path, key: str = "model.tokenizer"):
    """``AutoTokenizer.from_pretrained``; pad falls back to EOS when the tokenizer has none.
    A local folder without tokenizer files, or a tokenizer without an ordinary token, is
    refused with ``key`` (it would encode every text to nothing)."""
    from transformers import AutoTokenizer

    check_local_path(name_or_path, key)
    folder = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(folder) and not _has_tokenizer_files(folder):
        raise ConfigError(
            f"{key}: {os.fspath(name_or_path)} holds no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES[:4])}, ...): transformers would build an empty "
            f"tokenizer from the model's config, which encodes every text to nothing, and the "
            f"run would train on nothing and still spend its ε. Fix: {_no_tokenizer_fix(key)}",
            key=key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except OSError as e:  # not a local folder, and not a Hub id that could be fetched
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{key}: {name_or_path!r} is neither a tokenizer folder (none at "
            f"{os.path.abspath(os.fspath(name_or_path))}) nor a Hub id that could be loaded "
            f"({why}); give an existing local folder (./path) or a reachable Hub id (org/name)",
            key=key,
        ) from None
    check_tokenizer_vocabulary(tokenizer, name_or_path, key)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {name_or_path!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pretrained_attention(path) -> str:
    """The attention a pretrained checkpoint is loaded with: ``PRETRAINED_ATTN_IMPLEMENTATION``
    (sdpa) where its model class implements it, else eager (gpt-oss: its attention sinks
    have no sdpa kernel, and transformers refuses sdpa for it rather than falling back)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))]
    except (KeyError, ValueError, OSError):  # a class transformers does not map: its own default
        return PRETRAINED_ATTN_IMPLEMENTATION
    return PRETRAINED_ATTN_IMPLEMENTATION if getattr(cls, "_supports_sdpa", True) else TINY_ATTN_IMPLEMENTATION


def load_model(model_cfg, *, vocab_size: int | None = None, cache_dir) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for ``model_cfg`` (an ``llmdp.config.schema.ModelConfig``).

    ``init == "tiny"``: build ``model_cfg.tiny`` into ``<cache_dir>/tiny-<hash>/`` (once)
    sized to the tokenizer (or ``vocab_size``), then load it like any checkpoint.
    ``init == "pretrained"``: ``from_pretrained(model_cfg.name_or_path)``; with
    ``vocab_size`` different from the checkpoint's, the embeddings are resized. With
    ``model_cfg.base_tokenizer`` (the checkpoint's own tokenizer), the checkpoint is first
    adapted to ``model_cfg.tokenizer`` into ``<cache_dir>/adapted-<hash>/`` (once; see
    ``llmdp.tokenizer.adapt.build_adapted_model``) and loaded from there; the adaptation
    counts are ``model.llmdp_vocab_adaptation``.
    Then LoRA (``model_cfg.lora``) and gradient checkpointing, and the module check of
    :func:`validate_trainable_modules` (as for training).
    """
    from transformers import AutoModelForCausalLM

    init = getattr(model_cfg, "init", "pretrained")
    adaptation = None
    tok_src = getattr(model_cfg, "tokenizer", None) or model_cfg.name_or_path
    if tok_src is None:
        raise ValueError("model.tokenizer: required when model.init is 'tiny'")
    if init == "pretrained" and model_cfg.name_or_path is not None:
        check_local_path(model_cfg.name_or_path, "model.name_or_path")  # before its tokenizer
    own = getattr(model_cfg, "tokenizer", None) not in (None, model_cfg.name_or_path)
    tokenizer = load_tokenizer(tok_src, "model.tokenizer" if own else "model.name_or_path")
    if getattr(model_cfg, "base_tokenizer", None) is not None:
        check_local_path(model_cfg.base_tokenizer, "model.base_tokenizer")
    dtype_name = getattr(model_cfg, "dtype", "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"model.dtype={dtype_name!r} is not one of {list(DTYPES)}")
    load_kwargs = {dtype_kwarg(): DTYPES[dtype_name]}

    if init == "tiny":
        V = int(vocab_size) if vocab_size is not None else len(tokenizer)
        ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        h = tiny_config_hash(model_cfg.tiny, V, *ids)
        path = build_tiny_model(os.path.join(os.fspath(cache_dir), f"tiny-{h[:16]}"),
                                model_cfg.tiny, V, *ids)
        attn = TINY_ATTN_IMPLEMENTATION
    elif init == "pretrained":
        path = model_cfg.name_or_path
        if path is None:
            raise ValueError("model.name_or_path: required when model.init is 'pretrained'")
        attn = getattr(model_cfg, "attn_implementation", None)
        base_tok = getattr(model_cfg, "base_tokenizer", None)
        if base_tok is not None:  # adapt the embeddings to model.tokenizer (built once)
            h = adapted_model_hash(path, base_tok, tok_src)
            path, adaptation = build_adapted_model(
                path, base_tok, tok_src,
                os.path.join(os.fspath(cache_dir), f"adapted-{h[:16]}"))
    else:
        raise ValueError(f"model.init={init!r} is not one of ['pretrained', 'tiny']")

    if attn is None:
        attn = pretrained_attention(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, **load_kwargs)
    if init == "pretrained":
        if vocab_size is not None and vocab_size != model.get_input_embeddings().num_embeddings:
            log.warning("resizing the embeddings of %s from %d to %d", path,
                        model.get_input_embeddings().num_embeddings, vocab_size)
            model.resize_token_embeddings(int(vocab_size))
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id

    if getattr(model_cfg, "gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False

    if adaptation is not None:
        model.llmdp_vocab_adaptation = adaptation
    lora = getattr(model_cfg, "lora", None)
    if lora is not None:
        model = apply_lora(model, lora)
        if adaptation is not None:
            model.llmdp_vocab_adaptation = adaptation

    validate_trainable_modules(model, assume_training=True)
    return model, tokenizer


def apply_lora(model: nn.Module, lora) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters; only the adapters stay trainable."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=int(lora.r),
        lora_alpha=float(getattr(lora, "alpha", getattr(lora, "lora_alpha", 16.0))),
        lora_dropout=float(getattr(lora, "dropout", getattr(lora, "lora_dropout", 0.0))),
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
        **({"target_parameters": list(lora.target_parameters)} if getattr(lora, "target_parameters", ()) else {}),
    )
    tp = tuple(getattr(lora, "target_parameters", ()) or ())
    names = [n for n, _ in model.named_parameters()]
    missing = [t for t in tp if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:  # peft would only warn, and train no adapter there
        three_d = sorted({n.split(".layers.", 1)[-1].split(".", 1)[-1] for n, p in model.named_parameters()
                          if p.dim() == 3})
        raise ValueError(
            f"model.lora.target_parameters={list(tp)!r}: {missing} match no parameter of this "
            f"model; its 3-D parameters: {three_d[:6] or 'none'} (name them by their path's end, "
            f"e.g. 'mlp.experts.gate_up_proj')")
    try:
        with quiet_peft():
            return get_peft_model(model, cfg)
    except ValueError as exc:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ValueError(
            f"model.lora.target_modules={list(lora.target_modules)!r}: {exc}; "
            f"linear layers of this model: {linear}"
        ) from exc


# ------------------------------------------------------------------------------- checks


def _mixes_examples(module: nn.Module) -> bool:
    """Does this module compute with statistics of the whole batch (in training mode)?"""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # BatchNorm1d/2d/3d, SyncBatchNorm, Lazy*
        return True
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        # Per-instance normalization, but running statistics are averaged over the batch.
        return bool(module.track_running_stats)
    return False


def validate_trainable_modules(model: nn.Module, *, assume_training: bool = False) -> None:
    """Refuse layers that mix examples (DESIGN invariant `no-silent-fallbacks`).

    A BatchNorm (or an InstanceNorm tracking running stats) that has trainable parameters
    or is in training mode makes one unit's output, gradient or buffers depend on the other
    units in the batch, so per-unit clipping would not bound a unit's influence. With
    ``assume_training`` the check is made as if ``model.train()`` were called (as the
    training loop does). GroupNorm / LayerNorm / RMSNorm are per-example and fine.
    """
    for name, module in model.named_modules():
        if not _mixes_examples(module):
            continue
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        training = module.training or assume_training
        if trainable or training:
            why = "has trainable parameters" if trainable else "is in training mode"
            raise ValueError(
                f"module {name or '<root>'!r} ({type(module).__name__}) {why} and mixes "
                f"examples across the batch (it normalizes with batch statistics), so "
                f"per-unit gradients are not independent and DP-SGD's per-unit clipping "
                f"would not bound a unit's influence. Replace it with GroupNorm/LayerNorm, "
                f"or freeze it (requires_grad=False) and keep it in eval mode."
            )


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter the optimizer and the clipping engine see."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable}


def check_hub_model(name: str, key: str) -> None:
    """A ``model.name_or_path`` / ``model.tokenizer`` that is not a local folder is a Hub id:
    it must be in the local Hugging Face cache or reachable, else one message says how to
    bring it to an air-gapped machine (transformers would retry the network for about a
    minute and end in an OSError traceback). Raises ``ConfigError``."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        for fname in ("config.json", "tokenizer_config.json", "tokenizer.json"):
            if isinstance(try_to_load_from_cache(name, fname), str):
                return  # cached: transformers loads it (offline too)
    except HFValidationError as e:
        raise ConfigError(f"{key}: {name!r} is neither a local folder nor a Hub id like org/name "
                          f"({e}); fix the path or the id", key=key) from None
    fix = (f"on a machine with network run `hf download {name} --local-dir DIR`, copy DIR "
           f"here and set {key}=DIR (a local folder), or copy that machine's Hugging Face cache "
           f"(HF_HOME)")
    if hub_offline_flag():
        raise ConfigError(f"{key}: {name!r} is not a local folder and not in the Hugging Face "
                          f"cache, and offline mode is on (HF_HUB_OFFLINE): {fix}", key=key)
    try:
        HfApi().model_info(name, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        gated = isinstance(e, GatedRepoError)
        raise ConfigError(f"{key}: {name!r} is not a local folder, and the Hub "
                          + ("holds it as a gated model: accept its terms and `hf auth login`"
                             if gated else "has no such model (check the id; a private model "
                             "needs `hf auth login`)"), key=key) from None
    except Exception as e:  # noqa: BLE001 - sorted below
        if not is_connection_error(e):
            raise
        raise ConfigError(f"{key}: {name!r} is not a local folder and not in the Hugging Face "
                          f"cache, and the Hub cannot be reached ({type(e).__name__}: {e}): "
                          f"{fix}", key=key) from None
