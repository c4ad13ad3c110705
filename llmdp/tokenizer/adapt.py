"""Adapt a pretrained causal LM to a new tokenizer (embedding re-initialization).

A user may train a private tokenizer (`llmdp.tokenizer.private`) and fine-tune a
*pretrained* model with it. The model's embeddings are indexed by its own ("base")
tokenizer's vocabulary, so they are rebuilt for the new one: every new token's row starts
as the mean of the base model's rows for the base tokenizer's pieces of the same string.
This is a public computation: a function of the (already released) new vocabulary and the
public model only; it spends no privacy budget.

* `token_texts(tokenizer)`: the exact UTF-8 bytes each id stands for in text (None for
  special tokens), for SentencePiece-style ("▁" = space, ``<0xNN>`` byte-fallback pieces)
  and byte-level BPE (GPT-2 ``bytes_to_unicode`` alphabet) tokenizers.
* `adapt_embeddings(model, base_tokenizer, new_tokenizer)`: in place.
* `build_adapted_model(model_dir, base_tokenizer, new_tokenizer_dir, out_dir)`: load, adapt
  and save a complete model + tokenizer folder (once; cached by a hash in
  ``llmdp_adapted.json``), as `llmdp.train.models.load_model` does for ``model.base_tokenizer``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil

import torch

from llmdp._fs import building_dir, install_dir, sha256_file
from llmdp.base.hf import dtype_kwarg, save_kwargs

log = logging.getLogger(__name__)

__all__ = [
    "ADAPTED_MARKER",
    "FORMAT_VERSION",
    "bytes_to_unicode",
    "tokenizer_style",
    "token_texts",
    "adapt_embeddings",
    "adapted_model_hash",
    "build_adapted_model",
    "vocab_adaptation_stats",
]

ADAPTED_MARKER = "llmdp_adapted.json"
FORMAT_VERSION = 1
METASPACE = "\u2581"  # "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ROLES = ("bos", "eos", "unk", "pad")


# ----------------------------------------------------------------------------- token texts


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _backend_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no backend_tokenizer (a 'fast' Hugging "
            f"Face tokenizer is required to read its vocabulary style)"
        )
    return json.loads(backend.to_str())


def _components(node) -> list[dict]:
    """The component dicts of a normalizer / pre-tokenizer / decoder (Sequence flattened)."""
    if node is None:
        return []
    if isinstance(node, list):
        return [c for n in node for c in _components(n)]
    if not isinstance(node, dict):
        return []
    out = [node]
    for key in ("normalizers", "pretokenizers", "decoders"):
        if key in node:
            out.extend(_components(node[key]))
    return out


def _replace_of(c: dict) -> tuple[str | None, str | None]:
    pat = c.get("pattern")
    pat = pat.get("String") if isinstance(pat, dict) else None
    return pat, c.get("content")


def tokenizer_style(tokenizer) -> str:
    """``"byte_level"`` or ``"metaspace"``, from the backend's pipeline (not its strings).

    byte_level: a ByteLevel pre-tokenizer or decoder. metaspace (SentencePiece style): a
    Metaspace pre-tokenizer / decoder, a normalizer replacing " " with "▁" (or prepending
    "▁"), or a decoder replacing "▁" with " ". Anything else (WordPiece, ...) is a
    ValueError.
    """
    d = _backend_json(tokenizer)
    norm, pre, dec = (_components(d.get(k)) for k in ("normalizer", "pre_tokenizer", "decoder"))
    byte_level = any(c.get("type") == "ByteLevel" for c in pre + dec)
    metaspace = any(c.get("type") == "Metaspace" for c in pre + dec)
    for c in norm:
        if c.get("type") == "Replace" and _replace_of(c) == (" ", METASPACE):
            metaspace = True
        if c.get("type") == "Prepend" and c.get("prepend") == METASPACE:
            metaspace = True
    for c in dec:
        if c.get("type") == "Replace" and _replace_of(c) == (METASPACE, " "):
            metaspace = True
    model_type = (d.get("model") or {}).get("type")
    if byte_level and metaspace:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} mixes a ByteLevel and a "
            f"Metaspace ('▁') pipeline; token texts are ambiguous"
        )
    if not (byte_level or metaspace):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} (model {model_type}) is "
            f"neither byte-level BPE (ByteLevel pre-tokenizer/decoder) nor SentencePiece "
            f"style (Metaspace, or a '▁' Replace/Prepend normalizer); embedding adaptation "
            f"supports only those two"
        )
    return "byte_level" if byte_level else "metaspace"


def _byte_fallback(d: dict) -> bool:
    if (d.get("model") or {}).get("byte_fallback"):
        return True
    return any(c.get("type") == "ByteFallback" for c in _components(d.get("decoder")))


def _special_ids(tokenizer, d: dict) -> set[int]:
    ids = {int(i) for i in (tokenizer.all_special_ids or []) if i is not None}
    ids |= {int(t["id"]) for t in d.get("added_tokens") or [] if t.get("special")}
    return ids


def token_texts(tokenizer) -> list[bytes | None]:
    """For every id ``0..len(tokenizer)-1``, the exact UTF-8 bytes the token stands for in
    text, or None for special / control tokens.

    SentencePiece style: "▁" is a space (so "▁word" is b" word": the dummy prefix space
    is part of the first piece), ``<0xNN>`` byte-fallback pieces are that byte. Byte-level
    BPE: each character maps back through GPT-2's ``bytes_to_unicode``. Non-special added
    tokens are their literal content. A piece that cannot be mapped is a ValueError.
    """
    style = tokenizer_style(tokenizer)
    d = _backend_json(tokenizer)
    special = _special_ids(tokenizer, d)
    added = {int(t["id"]): t for t in d.get("added_tokens") or []}
    byte_fb = style == "metaspace" and _byte_fallback(d)
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    normalizer = tokenizer.backend_tokenizer.normalizer
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
            continue
        if i in added:
            # Matched in the text as is, or (normalized) in the normalized text.
            content = added[i]["content"]
            if added[i].get("normalized") and normalizer is not None:
                content = normalizer.normalize_str(content)
                if style == "metaspace":
                    content = content.replace(METASPACE, " ")
            out.append(content.encode("utf-8"))
            continue
        if style == "byte_level":
            try:
                out.append(bytes(decoder[c] for c in piece))
            except KeyError as exc:
                raise ValueError(
                    f"token {i} {piece!r} has a character outside the byte-level alphabet"
                ) from exc
            continue
        m = _BYTE_PIECE.fullmatch(piece) if byte_fb else None
        out.append(bytes([int(m.group(1), 16)]) if m else
                   piece.replace(METASPACE, " ").encode("utf-8"))
    return out


# ------------------------------------------------------------------------------- base ids


class _BaseIds:
    """Base-tokenizer ids of a byte string (see `adapt_embeddings`)."""

    def __init__(self, base):
        self.base = base
        self.style = tokenizer_style(base)
        d = _backend_json(base)
        self.model = base.backend_tokenizer.model
        self.unk = base.unk_token_id
        enc = bytes_to_unicode()
        if self.style == "byte_level":
            self.byte_token = {b: enc[b] for b in range(256)}
        elif _byte_fallback(d):
            self.byte_token = {b: f"<0x{b:02X}>" for b in range(256)}
        else:
            self.byte_token = {}
        vocab = base.get_vocab()
        self.byte_id = {b: vocab[t] for b, t in self.byte_token.items() if t in vocab}
        # A SentencePiece-style base that prepends "▁" itself (dummy prefix) would turn the
        # text " word" into "▁▁word"; its model is asked for the pieces of "▁word" directly.
        comps = _components(d.get("normalizer")) + _components(d.get("pre_tokenizer"))
        self.raw_model = self.style == "metaspace" and any(
            (c.get("type") == "Prepend" and c.get("prepend") == METASPACE)
            or (c.get("type") == "Metaspace"
                and (c.get("prepend_scheme", "always") != "never"
                     if "prepend_scheme" in c else c.get("add_prefix_space", True)))
            for c in comps
        )

    def __call__(self, data: bytes) -> list[int]:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            # Not text on its own (e.g. one byte >= 0x80 of a multi-byte character): the
            # base's byte tokens when it has them (byte-level BPE, byte fallback).
            if all(b in self.byte_id for b in data):
                if self.style == "byte_level":
                    s = "".join(self.byte_token[b] for b in data)
                    return [t.id for t in self.model.tokenize(s)]
                return [self.byte_id[b] for b in data]
            return []
        if self.raw_model:
            ids = [t.id for t in self.model.tokenize(text.replace(" ", METASPACE))]
        else:
            ids = list(self.base(text, add_special_tokens=False)["input_ids"])
        if self.unk is not None and self.unk in ids:
            return []  # the base cannot represent it: fallback rather than the unk row
        return ids


def _role_ids(tok) -> dict[str, int | None]:
    return {r: getattr(tok, f"{r}_token_id", None) for r in _ROLES}


def _mean_rows(w64: torch.Tensor, rows: list[list[int]]) -> torch.Tensor:
    flat = torch.tensor([i for r in rows for i in r], dtype=torch.long, device=w64.device)
    offsets = torch.tensor([0] + [len(r) for r in rows[:-1]], dtype=torch.long,
                           device=w64.device).cumsum(0)
    return torch.nn.functional.embedding_bag(flat, w64, offsets, mode="mean")


@torch.no_grad()
def adapt_embeddings(model, base_tokenizer, new_tokenizer) -> dict:
    """Rebuild ``model``'s embeddings (in place) for ``new_tokenizer``'s vocabulary.

    For each new id: the new tokenizer's bos/eos/unk/pad token takes the base tokenizer's
    token of the same role (pad falls back to the base's eos); any other token takes the
    mean of the base rows of ``base_tokenizer``'s ids for its text (`token_texts`; a text
    that is one base token copies that row exactly). Bytes that are not valid UTF-8 alone
    use the base's byte tokens (byte-level BPE, or ``<0xNN>`` byte-fallback pieces). A
    text the base cannot encode (no ids, or its unk) and a special token without a base
    counterpart get the fallback: the mean of all base rows (the first
    ``len(base_tokenizer)`` rows when the matrix is padded beyond the tokenizer).

    The output embeddings (``lm_head``) are rebuilt from the same ids when untied, and
    stay tied when tied. Computed in float64, cast to the weights' dtype, on their device.
    ``config.vocab_size`` and the pad/bos/eos ids (config and generation config) become
    the new tokenizer's. Returns the counts ``vocab_size_base``, ``vocab_size_new``,
    ``copied``, ``mean_of_pieces``, ``special``, ``fallback`` and ``tied``.
    """
    emb = model.get_input_embeddings()
    out_emb = model.get_output_embeddings()
    w_in = emb.weight
    V_base = int(w_in.shape[0])
    tied = out_emb is not None and (
        out_emb.weight is w_in or out_emb.weight.data_ptr() == w_in.data_ptr()
    )
    n_base = min(V_base, len(base_tokenizer))

    texts = token_texts(new_tokenizer)
    base_ids = _BaseIds(base_tokenizer)
    base_roles = _role_ids(base_tokenizer)
    if base_roles["pad"] is None:
        base_roles["pad"] = base_roles["eos"]
    by_id: dict[int, int | None] = {}
    for role, i in _role_ids(new_tokenizer).items():
        if i is not None and i not in by_id:
            by_id[int(i)] = base_roles[role]

    stats = {"vocab_size_base": V_base, "vocab_size_new": len(texts), "copied": 0,
             "mean_of_pieces": 0, "special": 0, "fallback": 0, "tied": bool(tied)}
    rows: list[list[int]] = []  # [] = fallback
    for i, data in enumerate(texts):
        if i in by_id:
            b = by_id[i]
            ids = [int(b)] if b is not None and 0 <= b < V_base else []
            kind = "special" if ids else "fallback"
        elif data is None:
            ids, kind = [], "fallback"
        else:
            ids = base_ids(data)
            kind = ("copied" if len(ids) == 1 else "mean_of_pieces") if ids else "fallback"
        bad = [j for j in ids if not 0 <= j < V_base]
        if bad:
            raise ValueError(
                f"base tokenizer id(s) {bad} for new token {i} ({data!r}) are outside the "
                f"model's {V_base} embedding rows: is base_tokenizer the model's own tokenizer?"
            )
        stats[kind] += 1
        rows.append(ids)
    fallback = torch.tensor([not r for r in rows], device=w_in.device)

    def rebuild(weight: torch.Tensor) -> torch.Tensor:
        w64 = weight.detach().to(torch.float64)
        new = _mean_rows(w64, [r or [0] for r in rows])
        new[fallback] = w64[:n_base].mean(0)
        return new.to(dtype=weight.dtype)

    new_in = torch.nn.Parameter(rebuild(w_in), requires_grad=w_in.requires_grad)
    V_new = len(texts)
    if out_emb is not None and not tied:
        w_out = out_emb.weight
        if w_out.shape[0] != V_base:
            raise ValueError(f"output embeddings have {w_out.shape[0]} rows, input {V_base}")
        out_emb.weight = torch.nn.Parameter(rebuild(w_out), requires_grad=w_out.requires_grad)
        bias = getattr(out_emb, "bias", None)
        if bias is not None:
            out_emb.bias = torch.nn.Parameter(rebuild(bias[:, None])[:, 0],
                                              requires_grad=bias.requires_grad)
    emb.weight = new_in
    emb.num_embeddings = V_new
    new_roles = _role_ids(new_tokenizer)
    if getattr(emb, "padding_idx", None) is not None:
        # As a fresh load of the saved config builds it (padding_idx = pad_token_id).
        emb.padding_idx = new_roles["pad"]
    if out_emb is not None:
        if tied:
            out_emb.weight = emb.weight
        if hasattr(out_emb, "out_features"):
            out_emb.out_features = V_new

    configs = [model.config]
    if hasattr(model.config, "get_text_config"):
        text_cfg = model.config.get_text_config()
        if text_cfg is not model.config:
            configs.append(text_cfg)
    for cfg in configs:
        cfg.vocab_size = V_new
        for r in ("pad", "bos", "eos"):
            setattr(cfg, f"{r}_token_id", new_roles[r])
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        for r in ("pad", "bos", "eos"):
            setattr(gen, f"{r}_token_id", new_roles[r])
    return stats


# ----------------------------------------------------------------------------- build + cache


_ID_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "spm.model", "vocab.json",
             "merges.txt", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _identity(src) -> dict:
    """A source's identity: its path (or hub id) and, for a local folder, the sha256 of
    its config / tokenizer files and the names and sizes of its weight files."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        return {"id": src}
    path = os.path.abspath(src)
    files, weights = {}, {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        if name in _ID_FILES:
            files[name] = sha256_file(full)
        elif name.endswith(_WEIGHT_SUFFIXES):
            weights[name] = os.path.getsize(full)
    return {"path": path, "sha256": files, "weights": weights}


def adapted_model_hash(model_dir, base_tokenizer, new_tokenizer_dir) -> str:
    """The cache key of `build_adapted_model` (sha256 hex)."""
    spec = {
        "format_version": FORMAT_VERSION,
        "model": _identity(model_dir),
        "base_tokenizer": _identity(base_tokenizer),
        "new_tokenizer": _identity(new_tokenizer_dir),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _read_adapted_marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, ADAPTED_MARKER)) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def vocab_adaptation_stats(out_dir) -> dict | None:
    """The stats stored by `build_adapted_model` in ``out_dir`` (None if not built)."""
    marker = _read_adapted_marker(os.fspath(out_dir))
    return None if marker is None else marker.get("stats")


_MODEL_FILES = ("config.json", "generation_config.json", ADAPTED_MARKER, "llmdp_tiny.json")


def _copy_tokenizer(src, dst: str, tokenizer) -> None:
    src = os.fspath(src)
    if not os.path.isdir(src):
        tokenizer.save_pretrained(dst)
        return
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if (os.path.isfile(full) and name not in _MODEL_FILES
                and not name.endswith(_WEIGHT_SUFFIXES) and not name.endswith(".index.json")):
            shutil.copyfile(full, os.path.join(dst, name))


def build_adapted_model(model_dir, base_tokenizer, new_tokenizer_dir, out_dir) -> tuple[str, dict]:
    """Load ``model_dir`` (float32), `adapt_embeddings` to ``new_tokenizer_dir`` and save a
    complete model + tokenizer folder to ``out_dir``; returns (out_dir, stats).

    ``base_tokenizer``: the model's own tokenizer (path or hub id). Skipped (the stored
    stats returned) when ``out_dir``'s ``llmdp_adapted.json`` holds the same
    `adapted_model_hash`. Written to a temporary sibling and renamed into place, so
    concurrent builders are safe.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = os.path.abspath(os.fspath(out_dir))
    h = adapted_model_hash(model_dir, base_tokenizer, new_tokenizer_dir)
    marker = _read_adapted_marker(out_dir)
    if marker is not None and marker.get("hash") == h:
        return out_dir, marker["stats"]

    base_tok = AutoTokenizer.from_pretrained(os.fspath(base_tokenizer))
    new_tok = AutoTokenizer.from_pretrained(os.fspath(new_tokenizer_dir))
    model = AutoModelForCausalLM.from_pretrained(os.fspath(model_dir),
                                                 **{dtype_kwarg(): torch.float32})  # 4.x / 5.x name
    stats = adapt_embeddings(model, base_tok, new_tok)

    with building_dir(out_dir, ".tmp-adapted-") as tmp:
        model.save_pretrained(tmp, **save_kwargs(model))
        _copy_tokenizer(new_tokenizer_dir, tmp, new_tok)
        with open(os.path.join(tmp, ADAPTED_MARKER), "w") as f:  # written last
            json.dump({
                "hash": h, "format_version": FORMAT_VERSION, "stats": stats,
                "model": os.fspath(model_dir), "base_tokenizer": os.fspath(base_tokenizer),
                "new_tokenizer": os.fspath(new_tokenizer_dir),
            }, f, indent=2, sort_keys=True)
            f.write("\n")

        def current() -> bool:
            marker = _read_adapted_marker(out_dir)
            return marker is not None and marker.get("hash") == h

        if not install_dir(tmp, out_dir, current):  # a concurrent builder won
            return out_dir, _read_adapted_marker(out_dir)["stats"]
    log.info("adapted %s to tokenizer %s in %s: %s", model_dir, new_tokenizer_dir, out_dir, stats)
    return out_dir, stats


