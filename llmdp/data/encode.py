"""From records to tokens: malformed records found first, then every record encoded.

`check_records` finds the records `RecordEncoder` would refuse (and a missing user key for
user units) before anything is encoded, and stops at the first or leaves them out
(``data.on_bad_record``); `encode_records` runs a `llmdp.data.formats.RecordEncoder` over
every record of a ``datasets.Dataset`` (in one process, or a ``datasets.map`` pool) into one
`llmdp.data.units.EncodedCorpus`, which `llmdp.data.store.build_store` packs into units.
"""

from __future__ import annotations

import os

import numpy as np

from llmdp.config.validate import ConfigError
from llmdp.data.units import EncodedCorpus, UnitSpec

__all__ = ["ON_BAD_RECORD", "BadRecords", "bad_record_error", "batch_problems", "check_records", "encode_records"]

ON_BAD_RECORD = ("error", "skip")
_TOKENIZE_BATCH = 1000
_PARALLEL_MIN_RECORDS = 100_000  # below this, one process tokenizes faster than a pool starts


def check_records(ds, encoder, spec: UnitSpec, on_bad_record: str, locate) -> tuple[object, dict]:
    """Find malformed records before anything is encoded (``RecordEncoder.record_problems``,
    and a missing user key for user units).

    ``on_bad_record="error"``: the first one stops with one message naming its location
    (``locate(i)``: file:line, or record i), the field and what is wrong. ``"skip"``: they
    are left out; returns (the remaining records, counts computed on private data, which
    the report lists as internal).
    """
    user = spec.user_field if spec.kind == "user" else None
    cols = [c for c in dict.fromkeys(encoder.columns + ([user] if user else [])) if c in ds.column_names]
    found = BadRecords(on_bad_record, locate)
    view = ds.select_columns(cols) if cols else ds
    base = 0
    for batch in view.iter(batch_size=_TOKENIZE_BATCH):
        found.add(batch_problems(batch, encoder, user), base)
        base += _batch_len(batch)
    bad, kinds, counts = found.bad, found.kinds, found.counts()
    if bad:
        keep = [i for i in range(len(ds)) if i not in bad]
        if not keep:
            raise ConfigError(
                f"data.on_bad_record: every record is malformed ({len(bad)} skipped, the first at "
                f"{locate(0)}: {bad[0]}; by field: {kinds}); nothing is left to train on: fix "
                f"the data or data.text_field / data.messages_field", key="data.on_bad_record")
        ds = ds.select(keep)
    return ds, counts


class BadRecords:
    """The malformed records met so far, by record index (``data.on_bad_record``: ``error``
    raises at the first, naming ``locate(i)``; ``skip`` collects them)."""

    def __init__(self, on_bad_record: str, locate):
        self.on_bad_record, self.locate = on_bad_record, locate
        self.bad: dict[int, str] = {}
        self.kinds: dict[str, int] = {}

    def add(self, problems, base: int = 0) -> None:
        """``problems`` of `batch_problems` for a batch whose first record is ``base``."""
        for k, field_name, why in problems:
            i = base + k
            if self.on_bad_record == "error":
                raise bad_record_error(self.locate(i), field_name, why)
            if i not in self.bad:
                self.bad[i] = why
                self.kinds[field_name] = self.kinds.get(field_name, 0) + 1

    def counts(self) -> dict:
        """Counts computed on private data (internal statistics)."""
        out: dict = {"records_skipped": len(self.bad)}
        if self.kinds:
            out["records_skipped_by_field"] = dict(self.kinds)
        return out


def batch_problems(batch, encoder, user: str | None) -> list[tuple[int, str, str]]:
    """``[(k, field, what is wrong)]`` of a dict-of-columns batch, sorted: what the encoder
    refuses, and a missing user key (``user``: the user field of user units, else None)."""
    problems = encoder.record_problems(batch)
    if user:
        problems += [(k, f"data.user_field={user!r}", "is missing or empty")
                     for k, u in enumerate(batch.get(user) or [None] * _batch_len(batch))
                     if _no_user(u)]
    return sorted(problems)


def _batch_len(batch) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def bad_record_error(location: str, field_name: str, why: str) -> ConfigError:
    """The message that stops a build at a malformed record (``data.on_bad_record: error``)."""
    return ConfigError(
        f"{location}: {field_name} {why}. Fix or remove that record, or set "
        f"data.on_bad_record=skip to leave malformed records out (they are counted "
        f"in the run's internal data statistics)", key="data.on_bad_record")


def _no_user(u) -> bool:
    return u is None or (isinstance(u, float) and u != u) or (isinstance(u, str) and not u)


def encode_records(ds, encoder, spec: UnitSpec, *, num_proc: int | None = None,
                   progress: bool = True) -> EncodedCorpus:
    """Encode every record of ``ds`` (a ``datasets.Dataset``) into an :class:`EncodedCorpus`.

    One process reads batches in order; with ``num_proc > 1`` a ``datasets.map`` pool
    tokenizes shards in parallel (its progress bar names the stage).
    """
    n = len(ds)
    if num_proc is None:
        num_proc = 1 if n < _PARALLEL_MIN_RECORDS else max(1, min(8, os.cpu_count() or 1))
    users = spec.user_field if spec.kind == "user" else None
    if num_proc > 1:
        return _encode_parallel(ds, encoder, users, num_proc)

    from tqdm.auto import tqdm

    ids_all, tgt_all, lens, keys = [], [], [], []
    bar = tqdm(total=n, desc="tokenizing", unit="rec", disable=not progress, leave=False)
    try:
        for batch in ds.iter(batch_size=_TOKENIZE_BATCH):
            out = encoder.encode_batch(batch)
            for ids, tgt in out:
                ids_all.append(np.asarray(ids, np.int32))
                tgt_all.append(np.asarray(tgt, np.uint8))
                lens.append(ids_all[-1].size)
            if users:
                keys.extend(batch[users])
            bar.update(len(out))
    finally:
        bar.close()
    return EncodedCorpus(_cat(ids_all, np.int32), _cat(tgt_all, np.uint8),
                         np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]),
                         np.asarray(keys, dtype=object) if users else None)


def _encode_parallel(ds, encoder, user_field: str | None, num_proc: int) -> EncodedCorpus:
    def encode(batch):
        out = encoder.encode_batch(batch)
        return {"_ids": [o[0].astype(np.int32) for o in out],
                "_target": [np.asarray(o[1], np.uint8) for o in out]}

    keep = [user_field] if user_field else []
    mapped = ds.map(encode, batched=True, batch_size=_TOKENIZE_BATCH, num_proc=num_proc,
                    remove_columns=[c for c in ds.column_names if c not in keep],
                    desc="tokenizing", new_fingerprint=f"llmdp-{encoder.fingerprint()[:16]}-{num_proc}")
    table = mapped.data.table if hasattr(mapped.data, "table") else mapped.data
    ids_col = table.column("_ids")
    tgt_col = table.column("_target")

    def flat(col):
        return np.concatenate([c.flatten().to_numpy() for c in col.chunks]) if col.num_chunks else np.empty(0)

    lens = np.concatenate([c.value_lengths().to_numpy() for c in ids_col.chunks]) \
        if ids_col.num_chunks else np.empty(0, np.int64)
    users = np.asarray(table.column(user_field).to_pylist(), dtype=object) if user_field else None
    return EncodedCorpus(flat(ids_col).astype(np.int32), flat(tgt_col).astype(np.uint8),
                         np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), users)


def _cat(xs: list, dtype) -> np.ndarray:
    return np.concatenate(xs) if xs else np.empty(0, dtype)
