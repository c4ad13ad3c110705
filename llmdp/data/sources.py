"""Load the training text from local files with ``datasets.load_dataset`` (offline).

Formats: JSON lines / JSON (``json``), Parquet (``parquet``), plain text (``text``, one row
per line, column ``text``), CSV (``csv``). ``format="auto"`` picks by extension. Error
messages name the recipe fields (``data.path``, ``data.format``, ``data.text_field``) so
the user knows what to change.
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


def resolve_format(path: str, format: str = "auto") -> str:
    """The ``datasets`` builder name for ``path`` ("json", "parquet", "text" or "csv")."""
    if format and format != "auto":
        try:
            return _BUILDERS[format]
        except KeyError:
            raise ValueError(
                f"data.format={format!r} is not supported; use one of "
                f"{sorted(set(_BUILDERS) | {'auto'})}"
            ) from None
    name = os.fspath(path)
    if name.endswith(".gz"):
        name = name[:-3]
    ext = os.path.splitext(name)[1].lower()
    try:
        return _EXTENSIONS[ext]
    except KeyError:
        raise ValueError(
            f"data.path={os.fspath(path)!r}: cannot infer the format from the extension {ext!r}; "
            f"set data.format to one of {sorted(_BUILDERS)}"
        ) from None


def load_texts(path, format: str = "auto", text_field: str = "text") -> datasets.Dataset:
    """The ``train`` split of a local file as a ``datasets.Dataset`` holding ``text_field``.

    Only local files are read: a missing file is an error, never a Hub lookup.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise ValueError(f"data.path={path!r} does not exist or is not a file")
    builder = resolve_format(path, format)
    ds = datasets.load_dataset(builder, data_files={"train": path}, split="train")
    if text_field not in ds.column_names:
        raise ValueError(
            f"data.text_field={text_field!r} is not a column of data.path={path!r}; "
            f"available columns: {ds.column_names}"
        )
    return ds


def fingerprint_file(path, chunk_size: int = 1 << 20) -> str:
    """sha256 (hex) of the file's bytes, streamed."""
    h = hashlib.sha256()
    with open(os.fspath(path), "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()
