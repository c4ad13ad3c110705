"""Local data files (``data.path``), read without ``datasets``: which files, which format,
and each record's ``file:line``.

`data_files` lists the files behind ``data.path`` (a file, or a directory's data files in
sorted order; a ``save_to_disk`` folder, `saved_dataset_kind`, is not one); `resolve_format`
picks the ``datasets`` builder by extension (or checks ``data.format``). The readers here
check what ``datasets`` would accept silently or report without a file: bytes that are not
UTF-8, a line that is not a JSON object, a field of two JSON types, a file without records,
each stopped with one message naming the file and the line. Plain-text files become records
here (``data.text_split``: ``file``, ``line`` or ``paragraph``), and `record_location`
turns a record index into ``file:line`` for messages about single records. Loading the
records into a ``datasets.Dataset`` is `llmdp.data.sources`.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
from collections.abc import Callable

from llmdp.config.validate import ConfigError

_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "text": "text", "csv": "csv"}
_EXTENSIONS = {
    ".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".pq": "parquet",
    ".txt": "text", ".text": "text", ".csv": "csv",
}
# Files ``save_to_disk`` writes: a Dataset folder holds the first two, a DatasetDict the third.
_SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
_SAVED_DICT_FILE = "dataset_dict.json"


def _ext(name: str) -> str:
    if name.endswith(".gz"):
        name = name[:-3]
    return os.path.splitext(name)[1].lower()


def saved_dataset_kind(path) -> str | None:
    """``"dataset"`` / ``"dataset_dict"`` for a ``save_to_disk`` folder, else None."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, _SAVED_DICT_FILE)):
        return "dataset_dict"
    if all(os.path.isfile(os.path.join(path, f)) for f in _SAVED_DATASET_FILES):
        return "dataset"
    return None


def data_files(path) -> list[str]:
    """The files behind ``data.path``: the file itself, or a directory's data files, sorted.

    In a directory, hidden files and files whose extension is not a known data format
    (README.md, .lock files) are skipped. A ``save_to_disk`` folder (or a directory holding
    one) is not a directory of data files: use :func:`load_records` for it.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            if saved_dataset_kind(root) is not None:
                raise ValueError(
                    f"data.path={path!r}: {root!r} is a folder written by datasets' save_to_disk, "
                    "not a directory of data files; point data.path at that folder itself "
                    "(load_records reads it)"
                )
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files.extend(os.path.join(root, n) for n in names
                         if not n.startswith(".") and _ext(n) in _EXTENSIONS)
        if not files:
            raise ValueError(
                f"data.path={path!r} is a directory with no data files "
                f"(extensions {sorted(_EXTENSIONS)})"
            )
        return sorted(files)
    raise ValueError(f"data.path={path!r} does not exist")


def resolve_format(path, format: str = "auto") -> str:
    """The ``datasets`` builder name for ``path`` ("json", "parquet", "text" or "csv")."""
    if format and format != "auto":
        try:
            return _BUILDERS[format]
        except KeyError:
            raise ValueError(
                f"data.format={format!r} is not supported; use one of "
                f"{sorted(set(_BUILDERS) | {'auto'})}"
            ) from None
    path = os.fspath(path)
    names = data_files(path) if os.path.isdir(path) else [path]
    found = {_EXTENSIONS.get(_ext(n)) for n in names}
    if None in found:
        raise ValueError(
            f"data.path={path!r}: cannot infer the format from the extension "
            f"{_ext(names[0])!r}; set data.format to one of {sorted(_BUILDERS)}"
        )
    if len(found) > 1:
        raise ValueError(
            f"data.path={path!r} mixes formats {sorted(found)}; keep one format per directory "
            "or set data.format"
        )
    return found.pop()


# ----------------------------------------------------------------------------- reading files

TEXT_SPLITS = ("file", "line", "paragraph")


def _check_text_split(text_split: str) -> None:
    if text_split not in TEXT_SPLITS:
        raise ConfigError(
            f"data.text_split: {text_split!r} is not one of {list(TEXT_SPLITS)} (file: one "
            "record per text file; line: one per non-blank line; paragraph: one per block of "
            "lines separated by a blank line)", key="data.text_split")


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decoded_lines(path: str):
    """(line number from 1, text without the newline) of a UTF-8 file; bytes that are not
    UTF-8 stop with the file, the line and the column."""
    with _open_binary(path) as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"data.path: {path}:{n}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at "
                    f"byte {e.start + 1} of that line); llmdp reads text as UTF-8: re-encode the "
                    f"file (e.g. `iconv -f latin1 -t utf-8`) or fix that line", key="data.path",
                ) from None
            if n == 1 and text.startswith("\ufeff"):
                text = text[1:]  # a UTF-8 byte-order mark is not content
            yield n, text.rstrip("\r\n")


def _check_utf8(path: str) -> None:
    """Stop with file:line at the first byte that is not UTF-8 (pyarrow's JSON and CSV
    readers accept such bytes into string columns and fail much later, with no file)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with _open_binary(path) as f:
            while chunk := f.read(1 << 22):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        for _ in _decoded_lines(path):  # raises with the line
            pass
        raise


def _text_records(path: str, text_split: str) -> list[tuple[int, str]]:
    """(first line number, text) of each record of one text file (see ``data.text_split``)."""
    lines = list(_decoded_lines(path))
    if text_split == "line":
        return [(n, t) for n, t in lines if t.strip()]
    if text_split == "file":
        text = "\n".join(t for _, t in lines).strip("\n")
        first = next((n for n, t in lines if t.strip()), 1)
        return [(first, text)] if text.strip() else []
    out, block, start = [], [], None
    for n, t in lines + [(0, "")]:  # paragraphs: blocks of non-blank lines
        if t.strip():
            if start is None:
                start = n
            block.append(t)
        elif block:
            out.append((start, "\n".join(block)))
            block, start = [], None
    return out


def _read_text_files(files: list[str], text_split: str,
                     where: str = "data.path") -> tuple[list[str], list[tuple[str, int]]]:
    """Every record of the text files; a file with none (empty, or blank lines only) stops
    with its name, in a folder as alone: a file that was meant to hold a document and does
    not is a mistake to fix, not something to skip silently."""
    texts, found = [], []
    for f in files:
        records = _text_records(f, text_split)
        if not records:
            raise _no_records(where, [f])
        for n, t in records:
            texts.append(t)
            found.append((f, n))
    return texts, found


def check_not_blank(files: list[str], where: str = "data.path") -> None:
    """Stop at the first file that is empty or holds only whitespace (JSON-lines, JSON and
    CSV files of a folder: ``datasets`` would read such a file as no rows, silently)."""
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 16):
                if chunk.strip():
                    break
            else:
                raise _no_records(where, [f])


def _json_lines_records(path: str):
    """(line number, record) of each non-blank line of a JSON-lines file; a line that is
    not a JSON object stops with the file and the line."""
    for n, text in _decoded_lines(path):
        if text.strip():
            yield n, json_line_record(text, f"{path}:{n}")


def json_line_record(text: str, where) -> dict:
    """One line of a JSON-lines file as its record; a line that is not a JSON object stops
    with ``where`` (``file:line``, or a function giving it: only a message needs it)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        where = where() if callable(where) else where
        raise ConfigError(
            f"data.path: {where}: not valid JSON ({e.msg}; column {e.colno}); each line "
            f"of a JSON-lines file is one JSON object: fix or remove that line",
            key="data.path",
        ) from None
    if not isinstance(rec, dict):
        where = where() if callable(where) else where
        raise ConfigError(
            f"data.path: {where}: a JSON {_json_type(rec)}, not an object; each line of a "
            f"JSON-lines file is one record {{\"field\": value, ...}}: fix or remove that line",
            key="data.path",
        )
    return rec


def _whole_json(path: str):
    """A ``.json`` file that is one JSON document (an array of records), else None (then
    it is read as JSON lines). A broken array stops with its line and column."""
    if _ext(path) != ".json":
        return None
    with _open_binary(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None  # _decoded_lines names the line
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip("\ufeff \t\r\n").startswith("["):
            raise ConfigError(
                f"data.path: {path}:{e.lineno}: not valid JSON ({e.msg}; column {e.colno}); the "
                f"file is one JSON array of records: fix it there", key="data.path") from None
        return None
    return doc if isinstance(doc, (list, dict)) else None


def _json_records(path: str) -> list[tuple[str, dict]]:
    """(location, record) of every record of a JSON / JSON-lines file, for messages."""
    doc = _whole_json(path)
    if isinstance(doc, list):
        return [(f"{path} (record {i} of the JSON array)", r) for i, r in enumerate(doc)]
    if isinstance(doc, dict):
        return [(f"{path}:1", doc)]
    return [(f"{path}:{n}", r) for n, r in _json_lines_records(path)]


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _no_records(where: str, files: list[str]) -> ConfigError:
    shown = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
    return ConfigError(
        f"{where}: no records: {shown} holds no data (empty, or blank lines only); point "
        f"data.path at the corpus, or fill the file", key="data.path")


def _diagnose_json(files: list[str], where: str, exc: BaseException) -> ConfigError:
    """Why ``datasets`` could not read these JSON files, as one message with file and line."""
    first_type: dict[str, tuple[str, str]] = {}
    count = 0
    for f in files:  # UTF-8 and JSON syntax errors raise from here, with file:line
        for loc, rec in _json_records(f):
            count += 1
            if not isinstance(rec, dict):
                return ConfigError(f"data.path: {loc}: a JSON {_json_type(rec)}, not an object "
                                   "{\"field\": value, ...}: fix or remove that record",
                                   key="data.path")
            for k, v in rec.items():
                t = _json_type(v)
                if t == "null":
                    continue
                seen = first_type.setdefault(k, (t, loc))
                if seen[0] != t:
                    return ConfigError(
                        f"data.path: {loc}: field {k!r} holds a JSON {t}, but a {seen[0]} at "
                        f"{seen[1]}; a field must have one type in every record: fix or remove "
                        f"that record", key="data.path")
    if count == 0:
        return _no_records(where, files)
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ConfigError(
        f"{where}: the JSON files could not be read ({type(exc).__name__}"
        f"{': ' + why if why else ''}); check that each line is one JSON object", key="data.path")


def record_location(path=None, dataset: str | None = None, format: str = "auto",
                    text_split: str = "file", split: str | None = "train") -> Callable[[int], str]:
    """A function from a record index (in ``load_records``' order) to where that record is:
    ``file:line`` for JSON-lines and text files, else ``record i of <source>``. It reads
    the files again when first called (only messages about single records need it)."""
    def fallback(i: int) -> str:
        src = (f"data.dataset={dataset!r} (split {split!r})" if dataset is not None
               else f"data.path={os.fspath(path)!r}")
        return f"record {i} of {src}"

    if dataset is not None or path is None:
        return fallback
    path = os.path.abspath(os.fspath(path))
    if saved_dataset_kind(path) is not None:
        return fallback
    cache: dict = {}

    def locate(i: int) -> str:
        if "where" not in cache:
            try:
                files = data_files(path)
                builder = resolve_format(path, format)
                if builder == "text":
                    cache["where"] = [f"{f}:{n}" for f, n in _read_text_files(files, text_split)[1]]
                elif builder == "json":
                    cache["where"] = [loc for f in files for loc, _ in _json_records(f)]
                else:
                    cache["where"] = None
            except (OSError, ValueError):
                cache["where"] = None
        where = cache["where"]
        if where is None or not 0 <= i < len(where):
            return fallback(i)
        return where[i]

    return locate
