"""The unit store: tokenized privacy units on disk as memory-mapped Arrow, and row reads.

A store is a directory ``<cache_dir>/<fingerprint>/`` holding

- ``rows.arrow``  Arrow IPC file, one row per model input row: ``input_ids``
  (large_list<int32>, no padding stored), ``target`` (large_list<uint8>, 1 where the token
  is a training target) and, with document masking, ``segment_ids`` (large_list<int32>);
- ``units.arrow`` one row per privacy unit: ``row_start`` (int64), ``row_count`` (int32),
  ``num_target_tokens`` (int64), ``max_row_length`` (int32);
- ``meta.json``   counts, ids, the spec and what the fingerprint was computed over.

Both files are memory-mapped (zero copy): opening a store costs nothing, and a worker
reads from disk only the rows of the units it was given. The fingerprint hashes the data
source, the tokenizer, the record encoding, the unit spec and ``unit_fraction``, so a store is
rebuilt exactly when one of them changes. Building writes a temporary directory and
renames it into place, so readers in other processes (Ray workers call
``open_store(abs_dir)``) never see a half-written store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from llmdp._fs import folder_mode
from llmdp.data.encode import ON_BAD_RECORD, check_records, encode_records
from llmdp.data.files import record_location
from llmdp.data.formats import RecordEncoder
from llmdp.data.holdout import Holdout, split_units
from llmdp.data.units import (
    UnitArrays,
    UnitSpec,
    _ranges,
    build_units,
    special_ids,
    tokenizer_fingerprint,
)

if TYPE_CHECKING:
    import torch

__all__ = ["UnitSpec", "UnitStore", "build_store", "open_store", "store_fingerprint", "write_store"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
IGNORE_INDEX = -100
_BATCH_TOKENS = 1 << 24  # tokens per Arrow record batch (64 MiB of int32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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
        self.num_units: int = int(self.meta["num_units"])
        self.num_rows: int = int(self.meta["num_rows"])
        self.sequence_length: int = int(self.meta["sequence_length"])
        self.fingerprint: str = self.meta["fingerprint"]
        self.pad_id: int = int(self.meta["pad_id"])
        self.eos_id: int = int(self.meta["eos_id"])
        self.spec = UnitSpec(**self.meta["spec"])
        self._open()

    def _open(self) -> None:
        # A store built in one process has one rows/units file pair; one built on Ray Data
        # (llmdp.data.sharded) one pair per shard, listed in meta.json. Units are numbered
        # shard after shard; a shard may use only the first `num_units` units of its file.
        shards = self.meta.get("shards") or [{"rows": "rows.arrow", "units": "units.arrow",
                                              "num_units": self.num_units}]
        cols: dict[str, list[np.ndarray]] = {}
        self._batches = []  # per record batch: {column: (offsets, values)} numpy views
        batch_start = [0]
        for shard in shards:
            units = _read_ipc(os.path.join(self.path, shard["units"]))
            used = int(shard["num_units"])
            for name in units.column_names:
                cols.setdefault(name, []).append(_np(units.column(name))[:used])
            row0 = batch_start[-1]
            if used and row0:  # rows are numbered across shards
                cols["row_start"][-1] = cols["row_start"][-1] + row0
            reader = pa.ipc.open_file(pa.memory_map(os.path.join(self.path, shard["rows"]), "r"))
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                self._batches.append({name: (_np(batch.column(name).offsets),
                                             _np(batch.column(name).values))
                                      for name in batch.schema.names})
                batch_start.append(batch_start[-1] + batch.num_rows)
        col = {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in cols.items()}
        self.unit_row_start: np.ndarray = col["row_start"]
        self.unit_row_count: np.ndarray = col["row_count"]
        self.unit_target_tokens: np.ndarray = col["num_target_tokens"]
        self.unit_max_row_length: np.ndarray = col["max_row_length"]
        self._batch_start = np.asarray(batch_start, dtype=np.int64)
        if self.unit_row_start.size != self.num_units or batch_start[-1] != self.num_rows:
            raise ValueError(f"unit store {self.path!r} is inconsistent with its meta.json")
        self.has_segments = "segment_ids" in (self._batches[0] if self._batches else {})

    def __len__(self) -> int:
        return self.num_units

    def __reduce__(self):
        # Ship the path, not the memory maps: the receiving process maps the files itself.
        return (open_store, (self.path,))

    def __repr__(self) -> str:
        return (f"UnitStore({self.path!r}, kind={self.spec.kind!r}, num_units={self.num_units}, "
                f"sequence_length={self.sequence_length})")

    def _gather(self, rows: np.ndarray, width: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Rows ``rows`` padded/cut to ``width``: per column an int64 [R, width] array, and
        the real length of each row."""
        R = rows.size
        names = ["input_ids", "target"] + (["segment_ids"] if self.has_segments else [])
        out = {k: np.zeros((R, width), dtype=np.int64) for k in names}
        length = np.zeros(R, dtype=np.int64)
        if R == 0:
            return out, length
        b_of = np.searchsorted(self._batch_start, rows, side="right") - 1
        local = rows - self._batch_start[b_of]
        pos = np.arange(width, dtype=np.int64)[None, :]
        for b in np.unique(b_of):
            sel = np.flatnonzero(b_of == b)
            cols = self._batches[int(b)]
            offs = cols["input_ids"][0]
            s = offs[local[sel]].astype(np.int64)
            n = np.minimum(offs[local[sel] + 1] - s, width)
            length[sel] = n
            src = s[:, None] + np.minimum(pos, np.maximum(n[:, None] - 1, 0))
            for k in names:
                out[k][sel] = cols[k][1][src]
        return out, length

    def rows(self, unit_indices, width: int | str | None = None) -> dict[str, torch.Tensor]:
        """The batch rows of ``unit_indices``: every row of every unit, unit by unit.

        ``width``: None pads every row to ``sequence_length``; ``"auto"`` to the longest row
        of the batch rounded up to a multiple of 8 (less padding to compute on); an int to
        that many tokens (>= the longest row). ``input_ids`` / ``attention_mask`` /
        ``labels`` int64 [R, width]; ``labels`` is the token where it is a training target,
        -100 elsewhere (padding, prompts); the caller shifts: logits[:, :-1] vs labels[:, 1:].
        ``row_units[r]`` is the position in ``unit_indices`` of row r's unit;
        ``num_target_tokens[r]`` the number of target tokens of that *unit* after the shift.
        With document masking, ``segment_ids`` [R, width]: the document of each token within
        its row (-1 at padding).
        """
        import torch  # lazy: building a store (llmdp.data.sharded's tasks) needs no torch

        idx = as_indices(unit_indices)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_units):
            raise IndexError(f"unit index out of range [0, {self.num_units})")
        counts = self.unit_row_count[idx].astype(np.int64)
        starts = self.unit_row_start[idx].astype(np.int64)
        rows = _ranges(starts, starts + counts)
        row_units = np.repeat(np.arange(idx.size, dtype=np.int64), counts)
        longest = int(self.unit_max_row_length[idx].max()) if idx.size else 0
        L = self.sequence_length
        if width is None:
            width = L
        elif width == "auto":
            width = min(L, max(8, _round_up(max(longest, 1), 8)))
        elif isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < longest:
            raise ValueError(f"width must be None, 'auto' or an int >= the longest row ({longest}), "
                             f"got {width!r}")
        cols, length = self._gather(rows, int(width))
        mask = np.arange(int(width))[None, :] < length[:, None]
        input_ids = np.where(mask, cols["input_ids"], self.pad_id)
        labels = np.where(mask & (cols["target"] != 0), cols["input_ids"], IGNORE_INDEX)
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "row_units": torch.from_numpy(row_units),
            "num_target_tokens": torch.from_numpy(
                self.unit_target_tokens[idx].astype(np.int64)[row_units]),
        }
        if self.has_segments:
            batch["segment_ids"] = torch.from_numpy(np.where(mask, cols["segment_ids"], -1))
        return batch

    @staticmethod
    def pad_batch(batch: dict, num_rows: int, pad_id: int = 0) -> dict:
        """Append padding rows up to ``num_rows``.

        Padding rows: input_ids ``pad_id`` (any valid id; it is masked), attention_mask 0,
        labels -100, row_units -1 (no unit: contributes exactly zero), num_target_tokens 1
        (so a per-unit mean never divides by zero), segment_ids -1.
        """
        import torch  # lazy: see rows()

        R, L = batch["input_ids"].shape
        if num_rows < R:
            raise ValueError(f"pad_batch: batch has {R} rows, more than num_rows={num_rows}")
        extra = num_rows - R
        if extra == 0:
            return dict(batch)
        fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX,
                "row_units": -1, "num_target_tokens": 1, "segment_ids": -1}
        out = {}
        for key, value in batch.items():
            if key not in fill:
                raise KeyError(f"pad_batch does not know how to pad {key!r}")
            shape = (extra, L) if value.dim() == 2 else (extra,)
            pad = torch.full(shape, fill[key], dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, pad], dim=0)
        return out

    def token_sample(self, limit: int) -> np.ndarray:
        """Up to about ``limit`` of the store's tokens, spread over its record batches (the
        first of each): enough to tell what a tokenizer made of the data."""
        values = [b["input_ids"][1] for b in self._batches if "input_ids" in b]
        per = max(1, int(limit) // max(1, len(values)))
        return np.concatenate([v[:per] for v in values]) if values else np.zeros(0, np.int64)

    def formation(self) -> str | None:
        """How a store built on Ray Data formed its units (public: it depends on the chunk
        plan, not on any record), or None for a store built in one process."""
        pre = self.meta.get("preprocess")
        if not pre:
            return None
        n = int(pre["shards"])
        head = f"built on Ray Data in {n} shard{'s' if n != 1 else ''}"
        if self.spec.kind == "sequence":
            return (f"{head}: rows are packed within a shard, so no row spans two shards and "
                    f"up to {n - 1} more rows are shorter than {self.sequence_length} tokens "
                    "than in one packing of the whole corpus")
        if self.spec.kind == "document":
            return f"{head}: a document is never split across shards (same units as one process)"
        return (f"{head}: records were shuffled by user key, so each user's records formed one "
                "unit as in one process")

    def stats(self) -> dict:
        """Counts computed on the private data: the report must mark them internal (with
        the record fields that look like they name a person, when the store knows them)."""
        out = dict(self.meta["counts"])
        if self.meta.get("person_like_fields"):
            out["person_like_fields"] = list(self.meta["person_like_fields"])
        return out


def _np(array) -> np.ndarray:
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    return array.to_numpy(zero_copy_only=True)


def _read_ipc(path: str) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()


_PERSONISH = re.compile(r"(^|_)(user|patient|person|customer|client|member|subject|account|"
                        r"author|sender|email|mrn|employee)(_|id|$)", re.IGNORECASE)


def person_like_fields(columns) -> list[str]:
    """Record fields whose name suggests they identify a person (``user_id``, ``patient_id``,
    ``author``, ...): with a smaller unit than a user, that person is protected only through
    group privacy, and the report says so."""
    return [c for c in columns if _PERSONISH.search(str(c))]


def open_store(store_dir) -> UnitStore:
    """Open a built store (any process; the files are memory-mapped read-only)."""
    return UnitStore(store_dir)


def store_fingerprint(*, source_sha256: str, source: dict, encoding: str, tokenizer_sha256: str,
                      spec: UnitSpec, unit_fraction: float | None,
                      holdout: Holdout | None = None, part: str = "train",
                      layout: dict | None = None) -> str:
    payload: dict = {
        "format_version": FORMAT_VERSION,
        "source_sha256": source_sha256,
        "source": source,
        "encoding": encoding,
        "tokenizer_sha256": tokenizer_sha256,
        "spec": spec.to_dict(),
        "unit_fraction": unit_fraction,
    }
    if holdout is not None:  # (absent otherwise: stores built before held-out data keep their id)
        payload["holdout"] = {**holdout.to_dict(), "part": part}
    if layout is not None:  # a sharded build (llmdp.data.sharded): its chunking decides units
        payload["layout"] = layout
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def write_store(directory, units: UnitArrays, meta: dict) -> None:
    """Write ``units`` as a store into ``directory`` (which must not exist or be empty).

    ``meta`` must hold fingerprint, sequence_length, pad_id, eos_id, spec; counts and
    layout fields are filled in here. Used by :func:`build_store` and by benchmarks that
    make synthetic stores without a tokenizer.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    L = int(meta["sequence_length"])
    write_unit_files(directory, units, L, rows="rows.arrow", units_file="units.arrow")
    meta = dict(meta)
    meta.update({
        "format_version": FORMAT_VERSION,
        "num_units": units.num_units,
        "num_rows": units.num_rows,
        "rows_per_batch": rows_per_batch(L),
        "counts": {**units.counts, "num_units": units.num_units, "num_rows": units.num_rows,
                   "sequence_length": L},
    })
    with open(os.path.join(directory, "meta.json"), "w") as f:  # written last
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")


def rows_per_batch(sequence_length: int) -> int:
    """Rows per Arrow record batch of a store's rows file (about 64 MiB of int32 tokens)."""
    return max(1, _BATCH_TOKENS // int(sequence_length))


def write_unit_files(directory: str, units: UnitArrays, sequence_length: int, *, rows: str,
                     units_file: str, extra_unit_columns: dict | None = None) -> None:
    """Write ``units`` as a rows file and a units file (names ``rows``, ``units_file``) in
    ``directory``: one pair for a store built in one process, one per shard otherwise.
    ``extra_unit_columns``: more per-unit columns (name: (pyarrow type, values))."""
    per_batch = rows_per_batch(sequence_length)
    fields = [("input_ids", pa.int32(), units.tokens), ("target", pa.uint8(), units.target)]
    if units.segments is not None:
        fields.append(("segment_ids", pa.int32(), units.segments))
    schema = pa.schema([(name, pa.large_list(t)) for name, t, _ in fields])
    offs = units.row_offsets
    with pa.OSFile(os.path.join(directory, rows), "wb") as sink, \
            pa.ipc.new_file(sink, schema) as writer:
        for r0 in range(0, units.num_rows, per_batch):
            r1 = min(r0 + per_batch, units.num_rows)
            o = offs[r0 : r1 + 1]
            local = pa.array(o - o[0], type=pa.int64())
            arrays = [pa.LargeListArray.from_arrays(local, pa.array(vals[o[0] : o[-1]], type=t))
                      for _, t, vals in fields]
            writer.write_batch(pa.record_batch(arrays, schema=schema))
    columns = {
        "row_start": pa.array(units.row_start, type=pa.int64()),
        "row_count": pa.array(units.row_count, type=pa.int32()),
        "num_target_tokens": pa.array(units.unit_target_tokens(), type=pa.int64()),
        "max_row_length": pa.array(units.unit_max_row_length(), type=pa.int32()),
    }
    for name, (t, values) in (extra_unit_columns or {}).items():
        columns[name] = pa.array(values, type=t)
    table = pa.table(columns)
    with pa.OSFile(os.path.join(directory, units_file), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def build_store(
    cache_dir, *, tokenizer, spec: UnitSpec, data_path=None, dataset: str | None = None,
    data_format: str = "auto", split: str = "train", config_name: str | None = None,
    text_field: str = "text", messages_field: str | None = None, prompt_field: str | None = None,
    response_field: str | None = None, chat_template: str = "auto",
    unit_fraction: float | None = None, num_proc: int | None = None, progress: bool = True,
    source_sha256: str | None = None, text_split: str = "file", on_bad_record: str = "error",
    holdout: Holdout | None = None, part: str = "train",
) -> UnitStore:
    """Build (or reuse) the unit store for this data source, encoding, tokenizer and spec.

    Returns the store at ``<cache_dir>/<fingerprint>/``; it is rebuilt only when the
    fingerprint changes. Safe against concurrent builders: each writes its own temporary
    directory and the first rename wins. ``num_proc`` processes tokenize (None: one below
    100k records, else up to 8).

    ``text_split``: how plain-text files become records (see ``llmdp.data.sources``).
    ``on_bad_record``: ``"error"`` stops at the first malformed record with its file, line
    and field; ``"skip"`` leaves malformed records out and counts them (internal
    statistics ``records_skipped``, ``records_skipped_by_field``). ``unit_fraction``:
    keep each unit independently by a keyed hash of its own content (see
    ``llmdp.data.units.build_units``). ``holdout``: split the units into a training and an
    evaluation part (`llmdp.data.units.Holdout`), both written in one build; ``part``
    ("train" or "eval") is the one returned.
    """
    from llmdp.data.sources import load_records, source_fingerprint  # lazy: imports datasets

    if data_path is not None:
        data_path = os.path.abspath(os.fspath(data_path))
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"data.on_bad_record: {on_bad_record!r} is not one of {list(ON_BAD_RECORD)}")
    source = {"path": data_path, "dataset": dataset, "format": data_format, "split": split,
              "config_name": config_name, "text_split": text_split, "on_bad_record": on_bad_record}
    # `source_sha256`: the caller's `source_fingerprint` of these same arguments (hashing a
    # large corpus twice is not free).
    src_sha = source_sha256 or source_fingerprint(path=data_path, dataset=dataset, split=split,
                                                  config_name=config_name, format=data_format)
    encoder = RecordEncoder(tokenizer, text_field=text_field, messages_field=messages_field,
                            prompt_field=prompt_field, response_field=response_field,
                            chat_template=chat_template)
    tok_sha = tokenizer_fingerprint(tokenizer)
    if part not in ("train", "eval") or (part == "eval" and holdout is None):
        raise ValueError(f"part: {part!r}; expected 'train', or 'eval' with a holdout")
    # A separate evaluation source is a holdout of fraction 1: every unit is evaluated.
    parts = (("eval",) if holdout.fraction >= 1 else ("train", "eval")) if holdout is not None \
        else ("train",)
    if part not in parts:
        raise ValueError(f"part: {part!r} is not built with holdout {holdout}")
    fps = {p: store_fingerprint(source_sha256=src_sha, source=source,
                                encoding=encoder.fingerprint(), tokenizer_sha256=tok_sha,
                                spec=spec, unit_fraction=unit_fraction, holdout=holdout, part=p)
           for p in parts}
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    finals = {p: os.path.join(cache_dir, fp) for p, fp in fps.items()}
    if all(os.path.isfile(os.path.join(f, "meta.json")) for f in finals.values()):
        return open_store(finals[part])

    columns = dict(encoder.column_fields)
    if spec.kind == "user":
        columns["data.user_field"] = spec.user_field
    ds = load_records(path=data_path, dataset=dataset, format=data_format, split=split,
                      config_name=config_name, columns=columns, text_split=text_split)
    locate = record_location(path=data_path, dataset=dataset, format=data_format,
                             text_split=text_split, split=split)
    person_fields = person_like_fields(ds.column_names) if spec.kind != "user" else []
    ds, skipped = check_records(ds, encoder, spec, on_bad_record, locate)
    corpus = encode_records(ds, encoder, spec, num_proc=num_proc, progress=progress)
    units = build_units(corpus, spec, unit_fraction=unit_fraction)
    where = f"data.path={data_path!r}" if data_path else f"data.dataset={dataset!r}"
    if units.num_units == 0:
        raise ValueError(
            f"{where} yields no privacy units of kind {spec.kind!r}: no record has a target "
            f"token to train on (check data.text_field / data.messages_field / data.response_field)"
        )
    eos_id, pad_id = special_ids(tokenizer)
    units.counts = {**units.counts, "records_without_target": corpus.records_without_target(),
                    **skipped}
    built = dict(zip(("train", "eval"), split_units(units, holdout))) if holdout is not None \
        else {"train": units}
    for p in parts:
        if built[p].num_units == 0:
            raise ValueError(
                f"{where}: the {'evaluation' if p == 'eval' else 'training'} part of the split "
                f"(data.eval.fraction={holdout.fraction:g}) holds no privacy unit; "
                + ("raise data.eval.fraction" if p == "eval" else "lower data.eval.fraction"))
        meta = {
            "fingerprint": fps[p],
            "sequence_length": spec.sequence_length,
            "pad_id": pad_id,
            "eos_id": eos_id,
            "spec": spec.to_dict(),
            "unit_fraction": unit_fraction,
            "data": {**source, "sha256": src_sha, "encoding": encoder.describe()},
            "tokenizer_sha256": tok_sha,
        }
        if person_fields:  # field names of the records, not a count (the report's unit warning)
            meta["person_like_fields"] = person_fields
        if holdout is not None:
            meta["holdout"] = {**holdout.to_dict(), "part": p}
        _write_atomically(cache_dir, finals[p], built[p], meta)
        log.info("built unit store %s: %d %s units (%s)", finals[p], built[p].num_units, spec.kind, p)
    return open_store(finals[part])


def _write_atomically(cache_dir: str, final: str, units: UnitArrays, meta: dict) -> None:
    """Write a store into a temporary directory and rename it into place (the first of
    concurrent builders wins; readers never see a half-written store)."""
    if os.path.isfile(os.path.join(final, "meta.json")):
        return
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)[:12]}-", dir=cache_dir)
    try:
        os.chmod(tmp, folder_mode())  # mkdtemp makes it 0700; owner-only in a run (private_files)
        write_store(tmp, units, meta)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "meta.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process built it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def as_indices(unit_indices: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Unit indices as an int64 numpy vector (helper for samplers and tests)."""
    if hasattr(unit_indices, "detach"):  # a torch.Tensor
        unit_indices = unit_indices.detach().cpu().numpy()
    return np.asarray(unit_indices, dtype=np.int64).reshape(-1)
