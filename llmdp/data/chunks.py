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

``data.path`` is a local path (on storage every node sees: tasks read the files by path) or
a URI of any filesystem pyarrow supports (``s3://bucket/corpus/``, ``gs://...``,
``hdfs://...``, ``file:///...``): the files are then listed, read and fingerprinted through
``pyarrow.fs`` (`open_file`, `list_files`, `fingerprint_uri`), by the driver and the tasks.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from llmdp.config.validate import ConfigError
from llmdp.data.files import (
    _BUILDERS,
    _EXTENSIONS,
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


_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(path) -> bool:
    """Whether ``data.path`` names a file or folder by URI (a pyarrow filesystem)."""
    return isinstance(path, str) and bool(_URI.match(path))


def _fs(uri: str):
    import pyarrow.fs

    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors vary by filesystem
        raise ConfigError(f"data.path={uri!r}: pyarrow cannot open this filesystem ({e})",
                          key="data.path") from None


def list_files(path) -> list[str]:
    """The data files behind ``data.path`` (`llmdp.data.files.data_files`, or for a URI the
    file itself or a folder's data files, recursively, hidden ones and unknown extensions
    left out, sorted), as paths or URIs."""
    if not is_uri(path):
        return data_files(path)
    import pyarrow.fs

    fs, root = _fs(path)
    scheme = path.split("://", 1)[0]
    info = fs.get_file_info(root)
    if info.type == pyarrow.fs.FileType.NotFound:
        raise ConfigError(f"data.path={path!r} does not exist", key="data.path")
    if info.type == pyarrow.fs.FileType.File:
        return [path]
    found = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    files = sorted(f"{scheme}://{i.path}" for i in found
                   if i.type == pyarrow.fs.FileType.File and _ext(i.base_name) in _EXTENSIONS
                   and not any(part.startswith(".") for part in
                               i.path[len(root.rstrip("/")) + 1:].split("/")))
    if not files:
        raise ConfigError(f"data.path={path!r} is a folder with no data files (extensions "
                          f"{sorted(_EXTENSIONS)})", key="data.path")
    return files


def open_file(file: str):
    """A seekable binary file: a local one, or through its pyarrow filesystem."""
    if not is_uri(file):
        return open(file, "rb")
    fs, p = _fs(file)
    return fs.open_input_file(p)


def _size(file: str) -> int:
    if not is_uri(file):
        return os.path.getsize(file)
    fs, p = _fs(file)
    return int(fs.get_file_info(p).size)


def _format(path, data_format: str) -> str:
    if not is_uri(path):
        return resolve_format(path, data_format)
    if data_format and data_format != "auto":
        return resolve_format(path, data_format)
    found = {_EXTENSIONS.get(_ext(f)) for f in list_files(path)}
    if None in found or len(found) != 1:
        raise ConfigError(f"data.path={path!r}: cannot infer one format from the files' "
                          f"extensions; set data.format to one of {sorted(_BUILDERS)}",
                          key="data.format")
    return found.pop()


def fingerprint_uri(path: str) -> str:
    """sha256 (hex) of the bytes of every data file behind a URI, with their names relative
    to it (as `llmdp.data.sources.fingerprint_file` does for local files), read in blocks."""
    h = hashlib.sha256()
    base = path.rstrip("/")
    for f in list_files(path):
        h.update((f[len(base):].lstrip("/") or os.path.basename(f)).encode() + b"\0")
        with open_file(f) as src:
            while block := src.read(1 << 22):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def supported_source(path, data_format: str = "auto") -> str | None:
    """Why ``data.path`` cannot be built on Ray Data (None: it can)."""
    if path is None:
        return "data.dataset (a Hub dataset) is read in one process"
    if not is_uri(path) and saved_dataset_kind(path) is not None:
        return "a datasets save_to_disk folder is read in one process"
    builder = _format(path, data_format)
    if builder not in SHARDED_BUILDERS:
        return f"{builder} files are read in one process (Ray Data reads JSON lines, Parquet and text)"
    return None


def check_preprocess(d, prefix: str = "data") -> None:
    """A recipe's ``data`` (a `DataConfig`) whose corpus Ray Data cannot build although it
    must (``data.preprocess: ray``, or a URI ``data.path``): one `ConfigError` naming
    ``data.preprocess``. A recipe check that reads the corpus's file list, so the planning of
    a run makes it (`llmdp.run.planning.plan_run`, first), not the loading of the recipe."""
    if d.preprocess == "ray" or (d.path is not None and "://" in d.path):
        why = supported_source(d.path, d.format) if d.dataset is None else \
            "data.dataset (a Hub dataset) is read in one process"
        if why is not None:
            raise ConfigError(
                f"{prefix}.preprocess: 'ray' cannot build this corpus: {why}; set "
                f"{prefix}.preprocess: local (or auto)", key=f"{prefix}.preprocess")


def total_bytes(path) -> int:
    """Bytes of the corpus files behind ``data.path``."""
    return sum(_size(f) for f in list_files(path))


def plan_chunks(path, data_format: str, text_split: str, chunk_bytes: int) -> list[Chunk]:
    """The chunks of the corpus at ``path``, about ``chunk_bytes`` each, in source order."""
    builder = _format(path, data_format)
    if builder not in SHARDED_BUILDERS:
        raise ConfigError(f"data.path={os.fspath(path)!r}: {supported_source(path, data_format)}; "
                          "set data.preprocess: local", key="data.preprocess")
    chunk_bytes = max(1, int(chunk_bytes))
    out: list[Chunk] = []
    for f in list_files(path):
        if builder == "parquet":
            out.extend(_parquet_chunks(f, len(out), chunk_bytes))
            continue
        if not f.endswith(".gz") and not _has_content(f):
            raise ConfigError(f"data.path={os.fspath(path)!r}: no records: {f} holds no data (empty, "
                              "or blank lines only); point data.path at the corpus, or fill the "
                              "file", key="data.path")
        whole = f.endswith(".gz") or (builder == "text" and text_split == "file") or \
            (builder == "json" and _is_json_document(f))
        size = _size(f)
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


def _has_content(path: str) -> bool:
    """Whether the file holds anything but whitespace (read up to its first such byte)."""
    with open_file(path) as f:
        while block := f.read(_SCAN):
            if block.strip():
                return True
    return False


def _is_json_document(path: str) -> bool:
    """A ``.json`` file holding one JSON array or object (read whole), not JSON lines."""
    if _ext(path) != ".json":
        return False
    with open_file(path) as f:
        head = f.read(_SCAN).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        return True
    if not head.startswith(b"{"):
        return False
    with open_file(path) as f:  # one object over several lines is a document, not JSON lines
        first = _readline(f).decode("utf-8", "replace").lstrip("\ufeff")
    try:
        json.loads(first)
        return False
    except json.JSONDecodeError:
        return True


def _readline(f) -> bytes:
    """The rest of the current line, its newline included (pyarrow's files have no readline)."""
    start, out = f.tell(), b""
    while block := f.read(_SCAN):
        i = block.find(b"\n")
        if i >= 0:
            out += block[: i + 1]
            f.seek(start + len(out))
            return out
        out += block
    return out


def _boundary(path: str, at: int, blank_line: bool) -> int:
    """The first record boundary at or after byte ``at``: just after a newline (or, for
    paragraphs, just after a blank line)."""
    with open_file(path) as f:
        f.seek(max(0, at - 1))
        if f.read(1) == b"\n" and not blank_line:
            return at
        f.seek(at)
        _readline(f)  # the rest of the line
        pos = f.tell()
        if not blank_line:
            return pos
        while True:  # a blank line ends a paragraph
            line = _readline(f)
            if not line:
                return pos
            pos = f.tell()
            if not line.decode("utf-8", "replace").strip():
                return pos


def _parquet_chunks(path: str, first_index: int, chunk_bytes: int) -> list[Chunk]:
    import pyarrow.parquet as pq

    with open_file(path) as src:
        meta = pq.ParquetFile(src).metadata
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
        with open_file(chunk.file) as src, gzip.GzipFile(fileobj=src) as f:
            raw = f.read()
    else:
        with open_file(chunk.file) as f:
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
                with open_file(self.chunk.file) as f:
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

    if is_uri(chunk.file):
        with open_file(chunk.file) as f:
            text = f.read().decode("utf-8").lstrip("\ufeff")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.path: {chunk.file}:{e.lineno}: not valid JSON ({e.msg}; "
                              f"column {e.colno})", key="data.path") from None
        doc = doc if isinstance(doc, list) else [doc]
        found = [(f"{chunk.file} (record {i} of the JSON array)", r) for i, r in enumerate(doc)]
    else:
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

    with open_file(chunk.file) as src:
        pf = pq.ParquetFile(src)
        names = pf.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(f"data.path: {chunk.file}: no column {missing[0]!r} (columns: "
                              f"{names}); check data.text_field / data.messages_field / "
                              "data.user_field", key="data.path")
        table = pf.read_row_groups(list(range(chunk.start, chunk.end)), columns=columns) \
            if chunk.end > chunk.start else pf.schema_arrow.empty_table().select(columns)
    batch = table.to_pydict()
    del table
    return batch, lambda i: f"{chunk.file} (row {chunk.first_row + i})"
