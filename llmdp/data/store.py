"""The unit store: tokenized privacy units on disk, memory-mapped, and batch assembly.

A store is a directory ``<cache_dir>/<fingerprint>/`` holding

- ``tokens.npy``  int32 [N, L]: unit ``i`` is row ``i`` (padded with the pad id),
- ``lengths.npy`` int32 [N]: real tokens in row ``i`` (L except possibly the last row),
- ``meta.json``   counts, ids, the spec and what the fingerprint was computed over.

The fingerprint hashes the data file's bytes, the tokenizer, the unit spec and
``max_units``, so a store is rebuilt exactly when one of them changes. Building writes a
temporary directory and renames it into place, so readers in other processes (Ray
workers call ``open_store(abs_dir)``) never see a half-written store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
import torch

from llmdp.data.sources import data_files, fingerprint_file, load_texts, resolve_format
from llmdp.data.units import UnitSpec, build_sequence_units, special_ids, tokenizer_fingerprint

__all__ = ["UnitSpec", "UnitStore", "build_store", "open_store", "store_fingerprint"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
IGNORE_INDEX = -100
_TOKENIZE_BATCH = 1000


class UnitStore:
    """Read access to a built store. Cheap to open; pickles as its path."""

    def __init__(self, store_dir):
        self.path = os.path.abspath(os.fspath(store_dir))
        meta_path = os.path.join(self.path, "meta.json")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"no unit store at {self.path!r} (missing meta.json)")
        with open(meta_path) as f:
            self.meta: dict = json.load(f)
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"unit store {self.path!r} has format_version {self.meta.get('format_version')}, "
                f"expected {FORMAT_VERSION}; delete it to rebuild"
            )
        self._tokens = np.load(os.path.join(self.path, "tokens.npy"), mmap_mode="r")
        self._lengths = np.load(os.path.join(self.path, "lengths.npy"), mmap_mode="r")
        self.num_units: int = int(self.meta["num_units"])
        self.sequence_length: int = int(self.meta["sequence_length"])
        self.fingerprint: str = self.meta["fingerprint"]
        self.pad_id: int = int(self.meta["pad_id"])
        self.eos_id: int = int(self.meta["eos_id"])
        self.spec = UnitSpec(**self.meta["spec"])
        if self._tokens.shape != (self.num_units, self.sequence_length):
            raise ValueError(f"unit store {self.path!r} is inconsistent with its meta.json")

    def __len__(self) -> int:
        return self.num_units

    def __reduce__(self):
        # Ship the path, not the memory maps: the receiving process maps the files itself.
        return (open_store, (self.path,))

    def __repr__(self) -> str:
        return (f"UnitStore({self.path!r}, num_units={self.num_units}, "
                f"sequence_length={self.sequence_length})")

    def rows(self, unit_indices) -> dict[str, torch.Tensor]:
        """The batch rows of ``unit_indices`` (a sequence unit is one row).

        ``input_ids`` / ``attention_mask`` / ``labels`` int64 [R, L]; ``labels`` equals
        ``input_ids`` except -100 at padding (the caller shifts: logits[:, :-1] vs
        labels[:, 1:]). ``row_units[r]`` is the position in ``unit_indices`` of row r's unit;
        ``num_target_tokens[r]`` is the number of target tokens of that unit after the shift.
        """
        idx = as_indices(unit_indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_units):
            raise IndexError(f"unit index out of range [0, {self.num_units})")
        L = self.sequence_length
        tokens = torch.from_numpy(np.asarray(self._tokens[idx], dtype=np.int64)).reshape(-1, L)
        lengths = torch.from_numpy(np.asarray(self._lengths[idx], dtype=np.int64))
        mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).long()
        input_ids = torch.where(mask.bool(), tokens, torch.full_like(tokens, self.pad_id))
        labels = torch.where(mask.bool(), tokens, torch.full_like(tokens, IGNORE_INDEX))
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "labels": labels,
            "row_units": torch.arange(idx.size, dtype=torch.int64),
            "num_target_tokens": (labels[:, 1:] != IGNORE_INDEX).sum(dim=1),
        }

    @staticmethod
    def pad_batch(batch: dict, num_rows: int, pad_id: int = 0) -> dict:
        """Append padding rows up to ``num_rows`` (fixed shapes for every micro-batch).

        Padding rows: input_ids ``pad_id`` (any valid id; it is masked), attention_mask 0,
        labels -100, row_units -1 (no unit: contributes exactly zero), num_target_tokens 1
        (so a per-unit mean never divides by zero).
        """
        R, L = batch["input_ids"].shape
        if num_rows < R:
            raise ValueError(f"pad_batch: batch has {R} rows, more than num_rows={num_rows}")
        extra = num_rows - R
        if extra == 0:
            return dict(batch)
        fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX,
                "row_units": -1, "num_target_tokens": 1}
        out = {}
        for key, value in batch.items():
            if key not in fill:
                raise KeyError(f"pad_batch does not know how to pad {key!r}")
            shape = (extra, L) if value.dim() == 2 else (extra,)
            pad = torch.full(shape, fill[key], dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, pad], dim=0)
        return out

    def stats(self) -> dict:
        """Counts computed on the private data: the report must mark them internal."""
        return {
            "num_units": self.num_units,
            "num_tokens": int(self.meta["num_tokens"]),
            "num_documents": int(self.meta["num_documents"]),
            "sequence_length": self.sequence_length,
        }


def open_store(store_dir) -> UnitStore:
    """Open a built store (any process; the files are memory-mapped read-only)."""
    return UnitStore(store_dir)


def store_fingerprint(
    *, data_sha256: str, data_format: str, text_field: str, tokenizer_sha256: str,
    spec: UnitSpec, max_units: int | None,
) -> str:
    payload = {
        "format_version": FORMAT_VERSION,
        "data_sha256": data_sha256,
        "data_format": data_format,
        "text_field": text_field,
        "tokenizer_sha256": tokenizer_sha256,
        "spec": spec.to_dict(),
        "max_units": max_units,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_store(
    cache_dir, *, data_path, data_format: str = "auto", text_field: str = "text", tokenizer,
    spec: UnitSpec, max_units: int | None = None,
) -> UnitStore:
    """Build (or reuse) the unit store for this data file, tokenizer and spec.

    Returns the store at ``<cache_dir>/<fingerprint>/``; it is rebuilt only when the
    fingerprint changes. Safe against concurrent builders: each writes its own temporary
    directory and the first rename wins.
    """
    data_path = os.path.abspath(os.fspath(data_path))
    data_files(data_path)  # a clear error naming data.path if there is nothing to read
    fmt = resolve_format(data_path, data_format)
    data_sha = fingerprint_file(data_path)
    tok_sha = tokenizer_fingerprint(tokenizer)
    fp = store_fingerprint(data_sha256=data_sha, data_format=fmt, text_field=text_field,
                           tokenizer_sha256=tok_sha, spec=spec, max_units=max_units)
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    final = os.path.join(cache_dir, fp)
    if os.path.isfile(os.path.join(final, "meta.json")):
        return open_store(final)

    ds = load_texts(data_path, format=fmt, text_field=text_field)
    batches = (b[text_field] for b in ds.select_columns([text_field]).iter(batch_size=_TOKENIZE_BATCH))
    tokens, lengths, counts = build_sequence_units(batches, tokenizer, spec, max_units)
    if tokens.shape[0] == 0:
        raise ValueError(
            f"data.path={data_path!r} (data.text_field={text_field!r}) yields no privacy units "
            f"of {spec.sequence_length} tokens: it holds fewer than 2 tokens"
        )
    eos_id, pad_id = special_ids(tokenizer)
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "num_units": int(tokens.shape[0]),
        "sequence_length": spec.sequence_length,
        "num_tokens": counts["num_tokens"],
        "num_documents": counts["num_documents"],
        "pad_id": pad_id,
        "eos_id": eos_id,
        "spec": spec.to_dict(),
        "max_units": max_units,
        "data": {"path": data_path, "format": fmt, "text_field": text_field, "sha256": data_sha},
        "tokenizer_sha256": tok_sha,
    }

    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{fp[:12]}-", dir=cache_dir)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the store is read by other processes
        np.save(os.path.join(tmp, "tokens.npy"), tokens)
        np.save(os.path.join(tmp, "lengths.npy"), lengths)
        with open(os.path.join(tmp, "meta.json"), "w") as f:  # written last
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "meta.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process built it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built unit store %s: %d units of %d tokens", final, meta["num_units"],
             spec.sequence_length)
    return open_store(final)


def as_indices(unit_indices: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Unit indices as an int64 numpy vector (helper for samplers and tests)."""
    if isinstance(unit_indices, torch.Tensor):
        unit_indices = unit_indices.detach().cpu().numpy()
    return np.asarray(unit_indices, dtype=np.int64).reshape(-1)
