"""Load the training text from local files with ``datasets.load_dataset`` (offline).

Formats: JSON lines / JSON (``json``), Parquet (``parquet``), plain text (``text``, one row
per line, column ``text``), CSV (``csv``). ``format="auto"`` picks by extension.
``data.path`` is one file or a directory of files of one format (read in sorted order).
Error messages name the recipe fields (``data.path``, ``data.format``, ``data.text_field``)
so the user knows what to change. Nothing is ever looked up on the Hub.
"""

from __future__ import annotations

import hashlib
import os

import datasets

_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "text": "text", "csv": "csv"}
_EXTENSIONS = {
    ".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".pq": "parquet",
    ".txt": "text", ".text": "text", ".csv": "csv",
}


def _ext(name: str) -> str:
    if name.endswith(".gz"):
        name = name[:-3]
    return os.path.splitext(name)[1].lower()


def data_files(path) -> list[str]:
    """The files behind ``data.path``: the file itself, or a directory's data files, sorted.

    In a directory, hidden files and files whose extension is not a known data format
    (README.md, .lock files) are skipped.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
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


def load_texts(path, format: str = "auto", text_field: str = "text") -> datasets.Dataset:
    """The ``train`` split of local file(s) as a ``datasets.Dataset`` holding ``text_field``."""
    files = data_files(path)
    builder = resolve_format(path, format)
    ds = datasets.load_dataset(builder, data_files={"train": files}, split="train")
    if text_field not in ds.column_names:
        raise ValueError(
            f"data.text_field={text_field!r} is not a column of data.path="
            f"{os.path.abspath(os.fspath(path))!r}; available columns: {ds.column_names}"
        )
    return ds


def _sha256_file(path: str, chunk_size: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def fingerprint_file(path) -> str:
    """sha256 (hex) of the file's bytes, streamed.

    For a directory: sha256 over (relative name, file sha256) of each of its data files,
    so renaming, adding or editing any file changes it.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return _sha256_file(path)
    h = hashlib.sha256(b"llmdp-dir-v1\0")
    for f in data_files(path):
        h.update(os.path.relpath(f, path).encode() + b"\0" + _sha256_file(f).encode() + b"\n")
    return h.hexdigest()
