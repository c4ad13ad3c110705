"""The unit store built on Ray Data (``data.preprocess: ray``): corpora beyond one machine's RAM.

The in-process builder (`llmdp.data.store.build_store`) holds the encoded corpus in one
process. This one never does: the driver cuts the corpus into record-aligned chunks
(`llmdp.data.chunks.plan_chunks`, about ``(data.preprocess_memory_mb - TASK_FIXED_MB) /
EXPANSION`` bytes of text each) and Ray Data runs the chunks on the cluster's workers (an
actor pool of ``data.preprocess_workers``, one CPU each; a task takes a few chunks, one
after the other). Per chunk, a task reads it, finds malformed records
(``data.on_bad_record``), tokenizes, forms the units and writes them as one *shard* of the
store (a rows file and a units file, the in-process store's layout, one pair per shard);
the driver only merges counts and keeps one small entry per shard, then writes
``meta.json`` listing the shards. A task's memory is bounded by the chunk size, whatever
the corpus size; each task measures its peak RSS (returned in ``stats``).

Unit formation across shards:

``document``
    A chunk boundary is a record boundary: a document is never split, and the units are
    exactly the in-process builder's, in the same order.
``sequence``
    Rows are packed *within a shard*: each shard's token stream is cut into rows of
    ``sequence_length`` tokens, so each shard ends with one shorter row (the in-process
    builder has one such row for the whole corpus): up to (shards - 1) more rows shorter
    than ``sequence_length``, and no row spans two shards. The store's ``preprocess``
    metadata says so and the privacy report states it. With one shard the units are the
    in-process builder's.
``user``
    A user's records may sit in any chunk, so the build shuffles by user key: each chunk
    task writes its encoded records into one of P partitions by a hash of the user key
    (files under the temporary store directory), then one task per partition gathers all
    records of its users, orders them by source order, and forms the user units exactly
    as the in-process builder does (same per-user record order, same contribution bound).
    The units are the in-process builder's, in another order (by partition, then user).

``data.unit_fraction`` and the held-out split (``data.eval``) depend on each unit's own
content, so they are decided inside the shards; ``data.eval.max_units`` (the held-out
units with the smallest hashes) is settled by the driver from each shard's smallest
hashes: a shard's evaluation units are written in hash order and the store uses a prefix
of each. The store is addressed by a fingerprint that also covers the chunking, and is
reused like the in-process one; both parts are renamed into place only when complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import pickle
import shutil
import tempfile
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from llmdp._fs import folder_mode
from llmdp.config.validate import ConfigError
from llmdp.data.chunks import Chunk, is_uri, plan_chunks, read_chunk
from llmdp.data.encode import ON_BAD_RECORD, BadRecords, batch_problems
from llmdp.data.formats import RecordEncoder
from llmdp.data.holdout import Holdout, split_hash, split_units
from llmdp.data.store import (
    FORMAT_VERSION,
    UnitStore,
    open_store,
    rows_per_batch,
    store_fingerprint,
    write_unit_files,
)
from llmdp.data.units import (
    EncodedCorpus,
    UnitSpec,
    _ranges,
    _unit_content,
    _user_key,
    build_units,
    special_ids,
    tokenizer_fingerprint,
)

__all__ = ["EXPANSION", "build_sharded", "build_store_sharded", "chunk_bytes_for"]

log = logging.getLogger(__name__)

# Peak task memory per byte of chunk text (text, decoded records, token arrays, units and
# Arrow buffers at once), with a margin; measured by benchmarks/preprocess.py.
EXPANSION = 48
# Memory a task holds whatever its chunk (Ray Data's per-call buffers, the tokenizer's state).
TASK_FIXED_MB = 2.5
_ENCODE_BATCH = 1000


def chunk_bytes_for(memory_mb: float) -> int:
    """Bytes of text per chunk so that a task stays within ``memory_mb`` MiB of data."""
    return max(1 << 12, int((memory_mb - TASK_FIXED_MB) * (1 << 20) / EXPANSION))


@dataclass(frozen=True)
class _Job:
    """What every task needs (shipped once to each actor)."""

    encoder: RecordEncoder
    spec: UnitSpec
    unit_fraction: float | None
    holdout: Holdout | None
    on_bad_record: str
    text_split: str
    parts: tuple[str, ...]
    dirs: dict  # part -> the temporary store directory
    shuffle_dir: str | None = None
    partitions: int = 1
    chunk_bytes: int = 1 << 20

    @property
    def columns(self) -> list[str]:
        user = [self.spec.user_field] if self.spec.kind == "user" else []
        return list(dict.fromkeys(self.encoder.columns + user))


# ----------------------------------------------------------------------------- memory


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> int:
    """Reset this process's peak RSS (Linux: clear_refs 5) and return its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


# ----------------------------------------------------------------------------- tasks


def _records(job: _Job, chunk: Chunk) -> tuple[dict, dict]:
    """The chunk's well-formed records, and the counts of the malformed ones left out."""
    batch, locate = read_chunk(chunk, job.columns, job.text_split)
    user = job.spec.user_field if job.spec.kind == "user" else None
    found = BadRecords(job.on_bad_record, locate)
    found.add(batch_problems(batch, job.encoder, user))
    if found.bad:
        keep = [i for i in range(len(next(iter(batch.values()), []))) if i not in found.bad]
        batch = {c: [v[i] for i in keep] for c, v in batch.items()}
    return batch, found.counts()


def _encode(job: _Job, batch: dict, text_bytes: int = 1 << 18) -> EncodedCorpus:
    """Encode the records of ``batch``, a few at a time (about ``text_bytes`` of text per
    tokenizer call: the tokenizer's per-token Python objects stay small), into flat arrays."""
    n = len(next(iter(batch.values()), []))
    fields = job.encoder.columns
    ids, tgt, lens = [], [], [0]
    b = 0
    while b < n:
        e, size = b, 0
        while e < n and (e == b or (size < text_bytes and e - b < _ENCODE_BATCH)):
            size += sum(len(str(batch[c][e])) for c in fields)
            e += 1
        for i, t in job.encoder.encode_batch({c: v[b:e] for c, v in batch.items()}):
            ids.append(np.asarray(i, np.int32))
            tgt.append(np.asarray(t, np.uint8))
            lens.append(ids[-1].size)
        b = e
    users = None
    if job.spec.kind == "user":
        users = np.asarray(batch[job.spec.user_field], dtype=object)
    tokens = np.concatenate(ids) if ids else np.empty(0, np.int32)
    del ids
    return EncodedCorpus(tokens, np.concatenate(tgt) if tgt else np.empty(0, np.uint8),
                         np.cumsum(lens), users)


def _shard_files(index: int) -> dict:
    return {"rows": f"rows-{index:06d}.arrow", "units_file": f"units-{index:06d}.arrow"}


def _write_shard(job: _Job, index: int, corpus: EncodedCorpus, counts: dict) -> dict:
    """Units of ``corpus`` (one shard), split and written; what the driver needs to know."""
    counts = dict(counts)
    if corpus.num_records == 0:
        return {"index": index, "counts": counts, "parts": {}}
    units = build_units(corpus, job.spec, unit_fraction=job.unit_fraction)
    units.counts = {**units.counts, **counts}
    built = dict(zip(("train", "eval"), split_units(units, job.holdout))) \
        if job.holdout is not None else {"train": units}
    parts = {}
    base_counts = built[job.parts[0]].counts  # with the split's counts (units_held_out, ...)
    for p in job.parts:
        u = built[p]
        if u.num_units == 0:
            continue
        info = {"index": index, "num_units": u.num_units, "num_rows": u.num_rows,
                "num_tokens": int(u.tokens.size),
                "num_target_tokens": int(u.unit_target_tokens().sum())}
        if p == "eval" and job.holdout is not None and job.holdout.max_units is not None:
            # In hash order (split_units): the driver keeps a prefix of each shard.
            info["hash"] = [split_hash(_unit_content(u, k), job.holdout.key)
                            for k in range(u.num_units)]
            info["unit_rows"] = u.row_count.tolist()
            info["unit_tokens"] = np.diff(u.row_offsets[u.row_start.tolist() + [u.num_rows]]).tolist()
            info["unit_target_tokens"] = u.unit_target_tokens().tolist()
        write_unit_files(job.dirs[p], u, job.spec.sequence_length, **_shard_files(index))
        parts[p] = info
    return {"index": index, "counts": base_counts, "parts": parts}


class _Task:
    """A Ray Data actor: one call per chunk (or, for user units' second stage, per partition).
    The job (with the tokenizer) is read from a file the driver wrote in the temporary store
    directory, on storage every node reads (as the store itself)."""

    def __init__(self, job_file: str, tasks_file: str):
        # One CPU per task: the tokenizer's own thread pool would only add memory.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # What this task writes takes the store folder's permissions (owner-only, or
        # group-readable: ``llmdp._fs.private_files`` on the driver), whatever its umask.
        os.umask(0o777 & ~os.stat(os.path.dirname(os.path.abspath(job_file))).st_mode)
        with open(job_file, "rb") as f:
            self.job: _Job = pickle.load(f)
        with open(tasks_file) as f:
            self.tasks: list[dict] = json.load(f)
        self._warm_up()

    def _warm_up(self) -> None:
        """Run every stage once on two made-up records, so that what a process loads once
        (modules, the tokenizer's caches) is in place before the first chunk: a task's
        memory is then the data it holds."""
        job = self.job
        with tempfile.TemporaryDirectory() as d:
            fake = _Job(job.encoder, job.spec, None, None, "skip", job.text_split, ("train",),
                        {"train": d})
            batch = {c: [None, None] for c in job.columns}
            for c in job.encoder.columns:
                batch[c] = ([[{"role": "user", "content": "a b"},
                              {"role": "assistant", "content": "c d"}]] * 2
                            if job.encoder.mode == "chat" else ["warm up a b c", "d e f"])
            if job.spec.kind == "user":
                batch[job.spec.user_field] = ["u", "v"]
            problems = batch_problems(batch, job.encoder, job.spec.user_field)
            if not problems:
                corpus = _encode(fake, batch)
                if corpus.tokens.size:
                    _write_shard(fake, 0, corpus, {})

    def __call__(self, row: dict) -> dict:
        """One task: its chunks (or partitions) one after the other, each freed before the
        next; the counts of all, and each shard's files."""
        base = _reset_peak()
        counts, shards = [], []
        try:
            for what in self.tasks[int(row["id"])]:
                out = self._run(what)
                counts.append(out["counts"])
                shards.append([out["index"], out["parts"]])
        except ConfigError as e:  # bad data: the user's message, returned as is (a raised
            # exception reaches the driver wrapped in Ray's, with a traceback)
            return {"counts": "{}", "shards": "[]", "rss_base": base, "rss_peak": base,
                    "error": str(e), "error_key": e.key or ""}
        return {"counts": json.dumps(_merge_counts(counts)), "shards": json.dumps(shards),
                "rss_base": base, "rss_peak": max(_status("VmHWM"), base), "error": "",
                "error_key": ""}

    def _run(self, what: dict) -> dict:
        if what["stage"] == "partition":
            return _partition_users(self.job, what["partition"])
        chunk = Chunk(**what["chunk"])
        batch, counts = _records(self.job, chunk)
        corpus = _encode(self.job, batch, max(1 << 14, self.job.chunk_bytes // 16))
        del batch
        counts["records_without_target"] = corpus.records_without_target()
        if self.job.spec.kind == "user":
            return _scatter_users(self.job, chunk.index, corpus, counts)
        return _write_shard(self.job, chunk.index, corpus, counts)


def _partition_of(key: str, partitions: int) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % partitions


_SHUFFLE_SCHEMA = pa.schema([("user", pa.string()), ("order", pa.int64()),
                             ("tokens", pa.large_list(pa.int32())),
                             ("target", pa.large_list(pa.uint8()))])


def _scatter_users(job: _Job, index: int, corpus: EncodedCorpus, counts: dict) -> dict:
    """User units, stage 1: this chunk's encoded records, into partitions by user key."""
    keys = [_user_key(u, job.spec.user_field, i) for i, u in enumerate(corpus.users)]
    part = np.fromiter((_partition_of(k, job.partitions) for k in keys), np.int64, len(keys))
    lens = np.diff(corpus.offsets)
    for p in np.unique(part):
        sel = np.flatnonzero(part == p)
        starts, ends = corpus.offsets[sel], corpus.offsets[sel + 1]
        flat = _ranges(starts, ends)
        offs = pa.array(np.concatenate([[0], np.cumsum(lens[sel])]), pa.int64())
        table = pa.Table.from_arrays([
            pa.array([keys[i] for i in sel], pa.string()),
            pa.array((index << 32) + sel, pa.int64()),
            pa.LargeListArray.from_arrays(offs, pa.array(corpus.tokens[flat], pa.int32())),
            pa.LargeListArray.from_arrays(offs, pa.array(corpus.target[flat], pa.uint8())),
        ], schema=_SHUFFLE_SCHEMA)
        path = os.path.join(job.shuffle_dir, f"p{int(p):06d}-c{index:06d}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, _SHUFFLE_SCHEMA) as w:
            w.write_table(table)
    return {"index": index, "counts": counts, "parts": {}}


def _partition_users(job: _Job, p: int) -> dict:
    """User units, stage 2: every record of this partition's users, in source order within
    each user, formed into units like the in-process builder."""
    files = sorted(glob.glob(os.path.join(job.shuffle_dir, f"p{p:06d}-c*.arrow")))
    tables = [pa.ipc.open_file(pa.memory_map(f, "r")).read_all() for f in files]
    if not tables:
        return {"index": p, "counts": {}, "parts": {}}
    table = pa.concat_tables(tables).sort_by([("user", "ascending"), ("order", "ascending")])
    tok = table.column("tokens").combine_chunks()
    tgt = table.column("target").combine_chunks()
    offsets = tok.offsets.to_numpy()
    corpus = EncodedCorpus(tok.flatten().to_numpy(), tgt.flatten().to_numpy(), offsets - offsets[0],
                           np.asarray(table.column("user").to_pylist(), dtype=object))
    del tables, table, tok, tgt
    out = _write_shard(job, p, corpus, {})
    for f in files:
        os.remove(f)
    return out


# ----------------------------------------------------------------------------- driver


def _merge_counts(all_counts: list[dict]) -> dict:
    out: dict = {}
    for c in all_counts:
        for k, v in c.items():
            if isinstance(v, dict):
                d = out.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out[k] = v
    return out


# Chunks per task: Ray Data's cost (time, and the driver's bookkeeping) is per task; a task
# holds one chunk at a time, so its memory does not grow with this.
CHUNKS_PER_TASK = 8


def _run(job_file: str, items: list[dict], workers: int, log_fn, what: str) -> tuple[dict, list, dict]:
    """Run ``items`` (chunks or partitions) on Ray Data, an actor pool of ``workers``, a
    few items per task. Returns (the merged counts, [(item index, shard files)] in order,
    and the tasks' memory) as they stream in: the driver keeps no task's output."""
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    per = max(1, min(CHUNKS_PER_TASK, len(items) // max(1, 4 * workers)))
    tasks = [items[i:i + per] for i in range(0, len(items), per)]
    tasks_file = f"{job_file}.{what.replace(' ', '-')}.json"
    with open(tasks_file, "w") as f:
        json.dump(tasks, f)
    # One block per task: the task list goes to the workers as a file next to the job, and
    # Ray Data reads a range of task numbers (the driver puts no block of its own).
    ds = ray.data.range(len(tasks), override_num_blocks=max(1, len(tasks)))
    out = ds.map(_Task, fn_constructor_kwargs={"job_file": job_file, "tasks_file": tasks_file},
                 compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1)
    counts: dict = {}
    shards: list = []
    memory = {"task_peak_rss": 0, "task_peak_over_base": 0, "tasks": len(tasks)}
    done, step = 0, max(1, len(tasks) // 10)
    try:
        for row in out.iter_rows():
            if row["error"]:
                raise ConfigError(row["error"], key=row["error_key"] or None)
            counts = _merge_counts([counts, json.loads(row["counts"])])
            shards += json.loads(row["shards"])
            memory["task_peak_rss"] = max(memory["task_peak_rss"], row["rss_peak"])
            memory["task_peak_over_base"] = max(memory["task_peak_over_base"],
                                                row["rss_peak"] - row["rss_base"])
            done += 1
            if done % step == 0 or done == len(tasks):
                log_fn(f"  {what}: {done}/{len(tasks)} tasks")
    finally:
        os.remove(tasks_file)
    shards.sort(key=lambda s: s[0])
    return counts, shards, memory


def _ensure_ray(workers: int, workdir: str, log_fn):
    """A local Ray for the build when none is running, watched like the training's
    (`llmdp.base.localray`: none of its processes outlives a killed driver); the caller stops
    it. None when Ray runs already (or the driver joined a cluster)."""
    import ray

    from llmdp.base import localray as _localray

    if ray.is_initialized():
        return None
    _localray.quiet_ray_notices()
    local = _localray.start(workdir, log=log_fn, num_cpus=max(workers, 1), include_dashboard=False,
                            logging_level="WARNING", log_to_driver=False, configure_logging=True)
    return local or True


def _person_fields(data_path, data_format: str) -> list[str]:
    """The record fields that look like they name a person (`store.person_like_fields`), read
    from the first record of the first file (JSON lines, CSV header, Parquet schema)."""
    import csv
    import io

    from llmdp.data.chunks import list_files, open_file
    from llmdp.data.store import person_like_fields

    try:
        first = list_files(data_path)[0]
        name = first
        if name.endswith(".gz"):
            return []  # compressed: not read here (no warning)
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            with open_file(first) as f:
                return person_like_fields(pq.read_schema(f).names)
        with open_file(first) as f:
            head = f.read(1 << 16)
        text = head.decode("utf-8", "replace").lstrip("\ufeff")
        if name.endswith(".csv"):
            return person_like_fields(next(csv.reader(io.StringIO(text)), []))
        if name.endswith((".jsonl", ".json")):
            line = next((x for x in text.splitlines() if x.strip()), "")
            rec = json.loads(line) if line.strip().startswith("{") else {}
            return person_like_fields(rec.keys()) if isinstance(rec, dict) else []
    except Exception:  # noqa: BLE001 - a warning's input only: no warning rather than a failure
        return []
    return []


def build_store_sharded(cache_dir, **kwargs) -> UnitStore:
    """Build (or reuse) the unit store of ``data_path`` on Ray Data and open it (arguments:
    :func:`build_sharded`)."""
    return open_store(build_sharded(cache_dir, **kwargs))


def build_sharded(
    cache_dir, *, tokenizer, spec: UnitSpec, data_path, data_format: str = "auto",
    text_field: str = "text", messages_field: str | None = None, prompt_field: str | None = None,
    response_field: str | None = None, chat_template: str = "auto",
    unit_fraction: float | None = None, source_sha256: str | None = None,
    text_split: str = "file", on_bad_record: str = "error", holdout: Holdout | None = None,
    part: str = "train", memory_mb: float = 1024, workers: int | None = None, log_fn=None,
    stats: dict | None = None,
) -> str:
    """Build (or reuse) the unit store of ``data_path`` on Ray Data (module docstring); its
    directory (the ``part`` asked for).

    Arguments as `llmdp.data.store.build_store`; ``memory_mb``: the data memory of one task
    (sets the chunk size); ``workers``: concurrent tasks (None: the cluster's CPUs).
    ``stats``, if given, receives the build's measurements (tasks, peak task RSS).
    """
    from llmdp.data.sources import source_fingerprint  # lazy: imports datasets

    log_fn = log_fn or log.info
    if not is_uri(data_path):
        data_path = os.path.abspath(os.fspath(data_path))
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"data.on_bad_record: {on_bad_record!r} is not one of {list(ON_BAD_RECORD)}")
    source = {"path": data_path, "dataset": None, "format": data_format, "split": "train",
              "config_name": None, "text_split": text_split, "on_bad_record": on_bad_record}
    src_sha = source_sha256 or source_fingerprint(path=data_path, format=data_format)
    encoder = RecordEncoder(tokenizer, text_field=text_field, messages_field=messages_field,
                            prompt_field=prompt_field, response_field=response_field,
                            chat_template=chat_template)
    tok_sha = tokenizer_fingerprint(tokenizer)
    parts = (("eval",) if holdout.fraction >= 1 else ("train", "eval")) if holdout is not None \
        else ("train",)
    if part not in parts:
        raise ValueError(f"part: {part!r} is not built with holdout {holdout}")
    cbytes = chunk_bytes_for(memory_mb)
    layout = {"builder": "ray", "chunk_bytes": cbytes}
    fps = {p: store_fingerprint(source_sha256=src_sha, source=source, encoding=encoder.fingerprint(),
                                tokenizer_sha256=tok_sha, spec=spec, unit_fraction=unit_fraction,
                                holdout=holdout, part=p, layout=layout)
           for p in parts}
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    finals = {p: os.path.join(cache_dir, fp) for p, fp in fps.items()}
    if all(os.path.isfile(os.path.join(f, "meta.json")) for f in finals.values()):
        return finals[part]

    chunks = plan_chunks(data_path, data_format, text_split, cbytes)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = {p: tempfile.mkdtemp(prefix=f".tmp-{fps[p][:12]}-", dir=cache_dir) for p in parts}
    started = None
    watch = tempfile.mkdtemp(prefix=".tmp-ray-", dir=cache_dir)  # the local Ray's record
    try:
        started = _ensure_ray(workers or os.cpu_count() or 1, watch, log_fn)
        import ray

        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        shuffle = os.path.join(tmp[parts[0]], "shuffle") if spec.kind == "user" else None
        if shuffle:
            os.makedirs(shuffle)
        job = _Job(encoder, spec, unit_fraction, holdout, on_bad_record, text_split, parts, tmp,
                   shuffle, max(1, len(chunks)), cbytes)
        job_file = os.path.join(tmp[parts[0]], "job.pkl")
        with open(job_file, "wb") as f:
            pickle.dump(job, f)
        log_fn(f"building the unit store on Ray Data: {len(chunks)} chunks of ~{cbytes >> 20} MiB, "
               f"{workers} workers")
        counts, shards, memory = _run(job_file, [{"stage": "chunk", "chunk": asdict(c)}
                                                 for c in chunks], workers, log_fn, "chunks")
        if spec.kind == "user":
            read = counts
            counts, shards, memory2 = _run(job_file, [{"stage": "partition", "partition": p}
                                                      for p in range(job.partitions)],
                                           workers, log_fn, "user partitions")
            shutil.rmtree(shuffle, ignore_errors=True)
            for k in ("records_skipped", "records_skipped_by_field", "records_without_target"):
                if k in read:
                    counts[k] = read[k]
            memory = {k: max(memory[k], memory2[k]) if k != "tasks" else memory[k] + memory2[k]
                      for k in memory}
        if stats is not None:
            stats.update({"chunks": len(chunks), "chunk_bytes": cbytes, "workers": workers,
                          **memory})
        _finish(finals, tmp, parts, shards, counts, holdout, spec, tokenizer, fps, source, src_sha,
                encoder, tok_sha, unit_fraction, data_path, layout, len(chunks))
    finally:
        if started:
            import ray

            ray.shutdown()
            if started is not True:
                started.stop()  # the watchdog ends what is left of this Ray
        for t in [*tmp.values(), watch]:
            shutil.rmtree(t, ignore_errors=True)
    return finals[part]


def _finish(finals, tmp, parts, results, counts, holdout, spec, tokenizer, fps, source, src_sha,
            encoder, tok_sha, unit_fraction, data_path, layout, n_chunks) -> None:
    where = f"data.path={data_path!r}"
    kept = counts.get("num_records", 0)
    if kept == 0 and counts.get("records_skipped", 0):
        raise ConfigError(
            f"data.on_bad_record: every record is malformed ({counts['records_skipped']} skipped; "
            f"by field: {counts.get('records_skipped_by_field')}); nothing is left to train on: "
            "fix the data or data.text_field / data.messages_field", key="data.on_bad_record")
    shards = {p: [] for p in parts}
    for _, by_part in results:
        for p, info in by_part.items():
            shards[p].append(info)
    if "eval" in parts and holdout.max_units is not None:
        _keep_smallest(shards["eval"], holdout.max_units)
    eos_id, pad_id = special_ids(tokenizer)
    total_units = sum(s["num_units"] for p in parts for s in shards[p])
    if total_units == 0:
        raise ValueError(
            f"{where} yields no privacy units of kind {spec.kind!r}: no record has a target "
            f"token to train on (check data.text_field / data.messages_field / data.response_field)")
    for p in parts:
        used = [s for s in shards[p] if s["num_units"] > 0]
        n_units = sum(s["num_units"] for s in used)
        if n_units == 0:
            raise ValueError(
                f"{where}: the {'evaluation' if p == 'eval' else 'training'} part of the split "
                f"(data.eval.fraction={holdout.fraction:g}) holds no privacy unit; "
                + ("raise data.eval.fraction" if p == "eval" else "lower data.eval.fraction"))
        file_rows = sum(s["file_rows"] if "file_rows" in s else s["num_rows"] for s in used)
        part_counts = {**counts, "num_units": n_units,
                       "num_rows": sum(s["num_rows"] for s in used),
                       "num_tokens": sum(s["num_tokens"] for s in used),
                       "num_target_tokens": sum(s["num_target_tokens"] for s in used),
                       "sequence_length": spec.sequence_length}
        if holdout is not None:
            part_counts["units_evaluated"] = sum(s["num_units"] for s in shards["eval"]) \
                if "eval" in shards else 0
        meta = {
            "fingerprint": fps[p], "sequence_length": spec.sequence_length, "pad_id": pad_id,
            "eos_id": eos_id, "spec": spec.to_dict(), "unit_fraction": unit_fraction,
            "data": {**source, "sha256": src_sha, "encoding": encoder.describe()},
            "tokenizer_sha256": tok_sha, "format_version": FORMAT_VERSION,
            "num_units": n_units, "num_rows": file_rows,
            "rows_per_batch": rows_per_batch(spec.sequence_length),
            "counts": part_counts,
            "shards": [{"rows": _shard_files(s["index"])["rows"],
                        "units": _shard_files(s["index"])["units_file"],
                        "num_units": s["num_units"]} for s in used],
            "preprocess": {**layout, "shards": len(used), "chunks": n_chunks},
        }
        person = [] if spec.kind == "user" else _person_fields(source["path"], source["format"])
        if person:  # as the in-process store records them (the report's unit warning)
            meta["person_like_fields"] = person
        if holdout is not None:
            meta["holdout"] = {**holdout.to_dict(), "part": p}
        with open(os.path.join(tmp[p], "meta.json"), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
        keep = {f for s in meta["shards"] for f in (s["rows"], s["units"])}
        for name in os.listdir(tmp[p]):  # files of empty shards are not part of the store
            if name == "job.pkl" or name.endswith(".arrow") and name not in keep:
                os.remove(os.path.join(tmp[p], name))
        os.chmod(tmp[p], folder_mode())  # owner-only in a run (llmdp._fs.private_files)
        try:
            os.rename(tmp[p], finals[p])
        except OSError:
            if not os.path.isfile(os.path.join(finals[p], "meta.json")):
                raise
        log.info("built unit store %s on Ray Data: %d %s units in %d shards (%s)", finals[p],
                 n_units, spec.kind, len(used), p)


def _keep_smallest(shards: list[dict], k: int) -> None:
    """``data.eval.max_units``: keep the k evaluation units with the smallest hashes over all
    shards (each shard holds its units in hash order: a prefix of each is kept)."""
    pooled = sorted((h, i, j) for i, s in enumerate(shards) for j, h in enumerate(s["hash"]))[:k]
    keep = [0] * len(shards)
    for _, i, _ in pooled:
        keep[i] += 1
    for s, n in zip(shards, keep):
        s["file_rows"] = s["num_rows"]
        s["num_units"] = n
        s["num_rows"] = int(sum(s["unit_rows"][:n]))
        s["num_tokens"] = int(sum(s["unit_tokens"][:n]))
        s["num_target_tokens"] = int(sum(s["unit_target_tokens"][:n]))
