"""A corpus cut into record-aligned chunks, each read on its own with bounded memory.

The distributed build (`llmdp.data.sharded`) never loads the corpus in one process: the
driver plans *chunks* (`plan_chunks`: byte ranges of JSON-lines and text files aligned to
record boundaries, groups of Parquet row groups, or a whole file where a file cannot be
cut: a ``.json`` array, a gzip file, a text file that is one record), and each task reads
one chunk (`read_chunk`) into a dict-of-columns batch, the shape `RecordEncoder` takes.

Records come out exactly as the in-process loader (`llmdp.data.sources.load_records`)
makes them, in the same order (files sorted, records in file order), so both builders form
the same units from the same records: JSON lines are parsed with ``json``; text files
follow ``data.text_split`` (a file, a non-blank line, or a block of non-blank lines is one
record; a UTF-8 byte-order mark at a file's start is dropped). Each record carries its
*order* (chunk index, record index within the chunk: the source order) and a *location*
(``file:line``, ``file (row k)``) for messages; line numbers are counted only when a
message needs one. Planning reads a few bytes around each cut, never the whole corpus.

Files are local (or on a filesystem mounted on every node: the tasks read them by path).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from llmdp._validate import ConfigError
from llmdp.data.files import (
    _ext,
    _json_type,
    data_files,
    json_line_record,
    resolve_format,
    saved_dataset_kind,
)

__all__ = ["Chunk", "plan_chunks", "read_chunk", "supported_source", "total_bytes"]

# Formats the distributed build reads (csv and datasets' save_to_disk folders stay in-process).
SHARDED_BUILDERS = ("json", "parquet", "text")
_SCAN = 1 << 16  # bytes read at a time when looking for a record boundary
Locate = Callable[[int], str]


@dataclass(frozen=True)
class Chunk:
    """Records ``[start, end)`` of ``file`` (bytes; Parquet: row groups). ``whole``: the
    file is read at once (start/end unused)."""

    index: int
    file: str
    builder: str
    start: int = 0
    end: int = 0
    whole: bool = False
    first_row: int = 0  # Parquet: the file's row number of the chunk's first record


def supported_source(path, data_format: str = "auto") -> str | None:
    """Why ``data.path`` cannot be built on Ray Data (None: it can)."""
    if path is None:
        return "data.dataset (a Hub dataset) is read in one process"
    if saved_dataset_kind(path) is not None:
        return "a datasets save_to_disk folder is read in one process"
    builder = resolve_format(path, data_format)
    if builder not in SHARDED_BUILDERS:
        return f"{builder} files are read in one process (Ray Data reads JSON lines, Parquet and text)"
    return None


def total_bytes(path) -> int:
    """Bytes of the corpus files behind ``data.path``."""
    return sum(os.path.getsize(f) for f in data_files(path))


def plan_chunks(path, data_format: str, text_split: str, chunk_bytes: int) -> list[Chunk]:
    """The chunks of the corpus at ``path``, about ``chunk_bytes`` each, in source order."""
    builder = resolve_format(path, data_format)
    if builder not in SHARDED_BUILDERS:
        raise ConfigError(f"data.path={os.fspath(path)!r}: {supported_source(path, data_format)}; "
                          "set data.preprocess: local", key="data.preprocess")
    chunk_bytes = max(1, int(chunk_bytes))
    out: list[Chunk] = []
    for f in data_files(path):
        if builder == "parquet":
            out.extend(_parquet_chunks(f, len(out), chunk_bytes))
            continue
        whole = f.endswith(".gz") or (builder == "text" and text_split == "file") or \
            (builder == "json" and _is_json_document(f))
        size = os.path.getsize(f)
        if whole or size <= chunk_bytes:
            out.append(Chunk(len(out), f, builder, 0, size, whole=whole))
            continue
        blank = builder == "text" and text_split == "paragraph"
        start = 0
        while start < size:
            end = size if start + chunk_bytes >= size else _boundary(f, start + chunk_bytes, blank)
            out.append(Chunk(len(out), f, builder, start, end))
            start = end
    return out


def _is_json_document(path: str) -> bool:
    """A ``.json`` file holding one JSON array or object (read whole), not JSON lines."""
    if _ext(path) != ".json":
        return False
    with open(path, "rb") as f:
        head = f.read(_SCAN).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        return True
    if not head.startswith(b"{"):
        return False
    with open(path, "rb") as f:  # one object over several lines is a document, not JSON lines
        first = f.readline().decode("utf-8", "replace").lstrip("\ufeff")
    try:
        json.loads(first)
        return False
    except json.JSONDecodeError:
        return True


def _boundary(path: str, at: int, blank_line: bool) -> int:
    """The first record boundary at or after byte ``at``: just after a newline (or, for
    paragraphs, just after a blank line)."""
    with open(path, "rb") as f:
        f.seek(max(0, at - 1))
        if f.read(1) == b"\n" and not blank_line:
            return at
        f.seek(at)
        f.readline()  # the rest of the line
        pos = f.tell()
        if not blank_line:
            return pos
        while True:  # a blank line ends a paragraph
            line = f.readline()
            if not line:
                return pos
            pos = f.tell()
            if not line.decode("utf-8", "replace").strip():
                return pos


def _parquet_chunks(path: str, first_index: int, chunk_bytes: int) -> list[Chunk]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    out, g0, size, row0, rows = [], 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        size += rg.total_byte_size
        rows += rg.num_rows
        if size >= chunk_bytes or g == meta.num_row_groups - 1:
            out.append(Chunk(first_index + len(out), path, "parquet", g0, g + 1, first_row=row0))
            g0, size, row0 = g + 1, 0, row0 + rows
            rows = 0
    return out or [Chunk(first_index, path, "parquet", 0, 0)]


# ----------------------------------------------------------------------------- reading


def read_chunk(chunk: Chunk, columns: list[str], text_split: str) -> tuple[dict[str, list], Locate]:
    """(``{column: values}`` of the chunk's records, in order; ``locate(i)``: where record
    i of the chunk is, for messages)."""
    if chunk.builder == "parquet":
        return _read_parquet(chunk, columns)
    lines, first_line = _lines(chunk)
    if chunk.builder == "json":
        if chunk.whole and _is_json_document(chunk.file):
            return _read_json_document(chunk, columns)
        recs, where = [], []
        for n, text in lines:
            if not text.strip():
                continue
            rec = json_line_record(text, lambda n=n: _at(chunk, first_line, n))
            recs.append(rec)
            where.append(n)
        return {c: [r.get(c) for r in recs] for c in columns}, _locations(chunk, first_line, where)
    texts, where = _text_records(lines, text_split)
    return {"text": texts}, _locations(chunk, first_line, where)


def _lines(chunk: Chunk) -> tuple[list[tuple[int, str]], object]:
    """(local line index from 0, text without its newline) of the chunk's bytes, and a
    function giving the file's line number of a local line index (counted on demand)."""
    if chunk.whole and chunk.file.endswith(".gz"):
        with gzip.open(chunk.file, "rb") as f:
            raw = f.read()
    else:
        with open(chunk.file, "rb") as f:
            f.seek(chunk.start)
            raw = f.read(chunk.end - chunk.start)
    lines_before = _LinesBefore(chunk)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        head = raw[: e.start]
        line = head.count(b"\n")
        col = e.start - (head.rfind(b"\n") + 1)
        raise ConfigError(
            f"data.path: {chunk.file}:{lines_before(line)}: not valid UTF-8 (byte "
            f"{raw[e.start:e.start + 1]!r} at byte {col + 1} of that line); llmdp reads text as "
            "UTF-8: re-encode the file (e.g. `iconv -f latin1 -t utf-8`) or fix that line",
            key="data.path") from None
    del raw
    if chunk.start == 0 and text.startswith("\ufeff"):
        text = text[1:]  # a UTF-8 byte-order mark is not content
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()  # the chunk ends with a newline
    return [(k, t.rstrip("\r\n")) for k, t in enumerate(parts)], lines_before


class _LinesBefore:
    """Local line index -> the file's line number (from 1); counts the newlines before the
    chunk once, when first asked (only messages need it)."""

    def __init__(self, chunk: Chunk):
        self.chunk, self.base = chunk, None

    def __call__(self, k: int) -> int:
        if self.base is None:
            self.base = 0
            if self.chunk.start and not self.chunk.whole:
                with open(self.chunk.file, "rb") as f:
                    left = self.chunk.start
                    while left > 0:
                        block = f.read(min(left, 1 << 22))
                        if not block:
                            break
                        self.base += block.count(b"\n")
                        left -= len(block)
        return self.base + k + 1


def _at(chunk: Chunk, first_line, k: int) -> str:
    return f"{chunk.file}:{first_line(k)}"


def _locations(chunk: Chunk, first_line, where: list[int]) -> Locate:
    return lambda i: f"{chunk.file}:{first_line(where[i])}"


def _text_records(lines: list[tuple[int, str]], text_split: str) -> tuple[list[str], list[int]]:
    """The records of a text chunk (as `llmdp.data.files._text_records` makes them)."""
    if text_split == "line":
        keep = [(n, t) for n, t in lines if t.strip()]
        return [t for _, t in keep], [n for n, _ in keep]
    if text_split == "file":
        text = "\n".join(t for _, t in lines).strip("\n")
        first = next((n for n, t in lines if t.strip()), 0)
        return ([text], [first]) if text.strip() else ([], [])
    texts, where, block, start = [], [], [], None
    for n, t in lines + [(-1, "")]:
        if t.strip():
            if start is None:
                start = n
            block.append(t)
        elif block:
            texts.append("\n".join(block))
            where.append(start)
            block, start = [], None
    return texts, where


def _read_json_document(chunk: Chunk, columns: list[str]) -> tuple[dict[str, list], Locate]:
    from llmdp.data.files import _json_records  # names the line of a broken array

    found = _json_records(chunk.file)
    recs = [r for _, r in found]
    for loc, r in found:
        if not isinstance(r, dict):
            raise ConfigError(f"data.path: {loc}: a JSON {_json_type(r)}, not an object "
                              "{\"field\": value, ...}: fix or remove that record", key="data.path")
    where = [loc for loc, _ in found]
    return {c: [r.get(c) for r in recs] for c in columns}, where.__getitem__


def _read_parquet(chunk: Chunk, columns: list[str]) -> tuple[dict[str, list], Locate]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(chunk.file)
    names = pf.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise ConfigError(f"data.path: {chunk.file}: no column {missing[0]!r} (columns: {names}); "
                          "check data.text_field / data.messages_field / data.user_field",
                          key="data.path")
    table = pf.read_row_groups(list(range(chunk.start, chunk.end)), columns=columns) \
        if chunk.end > chunk.start else pf.schema_arrow.empty_table().select(columns)
    batch = table.to_pydict()
    del table
    return batch, lambda i: f"{chunk.file} (row {chunk.first_row + i})"
