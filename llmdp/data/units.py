"""Privacy units: what one unit of the DP guarantee is, and how text becomes units.

Only *sequence-level* units exist so far (the DP-fy guide, §5.1): every document is
tokenized, followed by EOS, all documents are concatenated into one token stream, and the
stream is cut into rows of exactly ``sequence_length`` tokens. Each row is one privacy
unit. The guarantee therefore protects any one row of ``sequence_length`` tokens, which
may span the end of one document and the start of the next; it does *not* protect a whole
document, let alone a whole user, when those span several rows (the report says so).

The final partial row is kept (padded with the pad id, attention mask 0), so padding
is exercised by every run, unless it has fewer than 2 tokens (nothing to predict).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

SUPPORTED_KINDS = ("sequence",)


@dataclass(frozen=True)
class UnitSpec:
    """What one privacy unit is. ``kind="sequence"``: ``sequence_length`` packed tokens."""

    kind: str = "sequence"
    sequence_length: int = 128

    def __post_init__(self):
        if self.kind not in SUPPORTED_KINDS:
            raise ValueError(
                f"privacy unit kind {self.kind!r} is not supported; supported: {list(SUPPORTED_KINDS)}"
            )
        if not isinstance(self.sequence_length, int) or self.sequence_length < 2:
            raise ValueError(
                f"sequence_length must be an int >= 2 (one input and one target token), "
                f"got {self.sequence_length!r}"
            )

    def describe(self) -> str:
        return f"a sequence of {self.sequence_length} tokens (packed across document boundaries)"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "sequence_length": self.sequence_length}


def special_ids(tokenizer) -> tuple[int, int]:
    """(eos_id, pad_id) of a Hugging Face tokenizer; pad falls back to EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no EOS token; sequence units need one "
            "to separate packed documents"
        )
    pad = tokenizer.pad_token_id
    return int(eos), int(eos if pad is None else pad)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids: the serialized tokenizer / vocab, EOS and pad ids."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Padding / truncation are call-time settings transformers toggles on the backend;
        # they do not change how text is tokenized here.
        state.pop("padding", None)
        state.pop("truncation", None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        sp = getattr(tokenizer, "sp_model", None)
        if sp is not None and hasattr(sp, "serialized_model_proto"):
            h.update(sp.serialized_model_proto())
    eos, pad = special_ids(tokenizer)
    h.update(json.dumps({"eos": eos, "pad": pad}).encode())
    return h.hexdigest()


def iter_document_tokens(
    texts: Iterable[list[str]], tokenizer, eos_id: int
) -> Iterator[tuple[np.ndarray, int]]:
    """For each batch of texts: (int32 ids of the batch's documents, each + EOS; #documents).

    No BOS and no other special tokens: the stream is documents separated by EOS.
    """
    for batch in texts:
        batch = ["" if t is None else str(t) for t in batch]
        enc = tokenizer(batch, add_special_tokens=False)["input_ids"]
        total = sum(len(ids) for ids in enc) + len(enc)
        out = np.empty(total, dtype=np.int32)
        pos = 0
        for ids in enc:
            n = len(ids)
            out[pos : pos + n] = ids
            out[pos + n] = eos_id
            pos += n + 1
        yield out, len(enc)


def pack_stream(stream: np.ndarray, sequence_length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut a 1-D token stream into rows of ``sequence_length``.

    Returns ``tokens`` int32 [N, L] (the final partial row padded with ``pad_id``) and
    ``lengths`` int32 [N] (real tokens per row). A final partial row of < 2 tokens is dropped.
    """
    L = sequence_length
    stream = np.asarray(stream, dtype=np.int32).reshape(-1)
    n_full, rest = divmod(stream.size, L)
    keep_partial = rest >= 2
    n = n_full + int(keep_partial)
    tokens = np.full((n, L), pad_id, dtype=np.int32)
    lengths = np.full(n, L, dtype=np.int32)
    tokens[:n_full] = stream[: n_full * L].reshape(n_full, L)
    if keep_partial:
        tokens[n_full, :rest] = stream[n_full * L :]
        lengths[n_full] = rest
    return tokens, lengths


def build_sequence_units(
    texts: Iterable[list[str]], tokenizer, spec: UnitSpec, max_units: int | None = None
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Tokenize batches of documents and pack them into sequence units.

    With ``max_units``, tokenization stops as soon as enough tokens are in hand and the
    result has at most ``max_units`` rows. Returns (tokens, lengths, counts) where counts
    holds num_documents (documents read) and num_tokens (real tokens in the rows).
    """
    if max_units is not None and max_units < 1:
        raise ValueError(f"max_units must be >= 1 or None, got {max_units}")
    eos_id, pad_id = special_ids(tokenizer)
    L = spec.sequence_length
    chunks: list[np.ndarray] = []
    n_tokens = 0
    n_docs = 0
    for ids, n in iter_document_tokens(texts, tokenizer, eos_id):
        chunks.append(ids)
        n_tokens += ids.size
        n_docs += n
        if max_units is not None and n_tokens >= max_units * L:
            break
    stream = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int32)
    if max_units is not None:
        stream = stream[: max_units * L]
    tokens, lengths = pack_stream(stream, L, pad_id)
    counts = {"num_documents": n_docs, "num_tokens": int(lengths.sum())}
    return tokens, lengths, counts
