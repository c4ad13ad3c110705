"""Where the training records come from: local files, a saved ``datasets`` folder, or the Hub.

``load_records`` is the entry point; it returns a ``datasets.Dataset`` of records (rows),
whatever their shape (plain text, chat messages, prompt/response pairs; see
``llmdp.data.formats`` for how records become tokens). Exactly one of:

- ``data.path``: a local file or a directory of files of one format, read with the packaged
  ``datasets`` builders (offline). Formats: JSON lines / JSON (``json``), Parquet
  (``parquet``), plain text (``text``, one row per line, column ``text``), CSV (``csv``).
  ``format="auto"`` picks by extension; a directory is read in sorted file order. Local
  files form one split, ``train``. A plain-text file is ONE record (one document) unless
  ``data.text_split`` says otherwise (``line``: one record per non-blank line;
  ``paragraph``: one per block of lines separated by blank lines): the record is what a
  ``document`` unit protects, so it is never cut silently.
- Unreadable input (an empty file, a line that is not JSON, bytes that are not UTF-8)
  stops with one message naming the file and the line (the local file readers, and
  ``record_location`` turning a record index into ``file:line`` for the callers' messages
  about single records, are :mod:`llmdp.data.files`).
- ``data.path`` pointing at a directory written by ``Dataset.save_to_disk`` (it holds
  ``state.json`` and ``dataset_info.json``) or ``DatasetDict.save_to_disk`` (it holds
  ``dataset_dict.json``; ``data.split`` picks the split). Detected automatically.
- ``data.dataset``: a Hub dataset name, loaded with
  ``datasets.load_dataset(name, data.config_name, split=data.split)``. This needs the
  network the first time (or the ``datasets`` cache); offline, the error says how to
  prepare a local copy (``save_to_disk`` once, then ``data.path``).

Error messages name the recipe fields (``data.path``, ``data.dataset``, ``data.format``,
``data.split``, ``data.config_name`` and the column fields) so the user knows what to change.

``source_fingerprint`` is a sha256 that changes when the records change; the unit store
keys its cache on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence

import datasets

from llmdp._fs import sha256_file
from llmdp.config.validate import ConfigError
from llmdp.data.files import (
    _BUILDERS,
    _SAVED_DICT_FILE,
    _check_text_split,
    _check_utf8,
    _diagnose_json,
    _no_records,
    _read_text_files,
    check_not_blank,
    data_files,
    resolve_format,
    saved_dataset_kind,
)

LOCAL_SPLIT = "train"  # the one split local files form


def load_texts(path, format: str = "auto", text_field: str = "text",
               text_split: str = "file") -> datasets.Dataset:
    """The ``train`` split of local file(s) as a ``datasets.Dataset`` holding ``text_field``."""
    return load_records(path=path, format=format, columns={"data.text_field": text_field},
                        text_split=text_split)


# ----------------------------------------------------------------------------- local files


@contextlib.contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load_local(path: str, files: list[str], builder: str, text_split: str) -> datasets.Dataset:
    where = f"data.path={path!r}"
    if builder == "text":
        texts, _ = _read_text_files(files, text_split, where)
        if not texts:
            raise _no_records(where, files)
        return datasets.Dataset.from_dict({"text": texts})
    for f in files if builder in ("json", "csv") else ():
        _check_utf8(f)
    if builder in ("json", "csv"):
        check_not_blank(files, where)
    try:
        # datasets logs each failed parse attempt with its traceback; the message below
        # says what is wrong (file and line), so its log is silenced for this call.
        with _quiet_logger("datasets"):
            ds = datasets.load_dataset(builder, data_files={LOCAL_SPLIT: files}, split=LOCAL_SPLIT)
    except Exception as exc:
        if builder == "json":
            raise _diagnose_json(files, where, exc) from None
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"{where}: the {builder} files could not be read "
                          f"({type(exc).__name__}{': ' + why if why else ''})",
                          key="data.path") from None
    if len(ds) == 0:
        raise _no_records(where, files)
    return ds


# ----------------------------------------------------------------------------- records


def _check_source(path, dataset) -> None:
    if (path is None) == (dataset is None):
        given = "both" if path is not None else "neither"
        raise ValueError(
            f"set exactly one of data.path (local files or a save_to_disk folder) and "
            f"data.dataset (a Hub dataset name); {given} given"
            + (f" (data.path={os.fspath(path)!r}, data.dataset={dataset!r})" if path is not None else "")
        )


def _check_columns(ds: datasets.Dataset, columns, where: str) -> None:
    """``columns``: the columns the caller needs, as names or {recipe field: column name}."""
    if not columns:
        return
    if isinstance(columns, str):
        columns = [columns]
    items = columns.items() if isinstance(columns, Mapping) else ((None, c) for c in columns)
    missing = [(field, col) for field, col in items if col not in ds.column_names]
    if not missing:
        return
    what = "; ".join(
        f"{field}={col!r} is not a column of {where}" if field else
        f"column {col!r} is not in {where}"
        for field, col in missing
    )
    raise ValueError(f"{what}; available columns: {ds.column_names}")


def _saved_split_dir(path: str, split: str | None) -> str:
    """The folder of ``split`` in a saved DatasetDict (error lists the available splits)."""
    with open(os.path.join(path, _SAVED_DICT_FILE)) as f:
        splits = list(json.load(f).get("splits", []))
    if split not in splits:
        raise ValueError(
            f"data.split={split!r} is not a split of the saved DatasetDict data.path={path!r}; "
            f"available splits: {splits}"
        )
    return os.path.join(path, split)


def _check_single_split(path: str, split: str | None, what: str, own_split: str | None = None):
    """Sources with one table accept data.split=train (the default) or their own split name."""
    if split in (None, LOCAL_SPLIT) or (own_split is not None and split == own_split):
        return
    raise ValueError(
        f"data.split={split!r} does not apply to data.path={path!r}: {what} holds a single "
        f"table{f' (split {own_split!r})' if own_split else ''}; leave data.split={LOCAL_SPLIT!r}, "
        "or point data.path at a DatasetDict saved with save_to_disk to pick a split"
    )


def _check_no_format(format: str | None, where: str) -> None:
    if format not in (None, "", "auto"):
        raise ValueError(
            f"data.format={format!r} does not apply to {where}; leave data.format='auto'"
        )


def _load_saved(path: str, kind: str, split: str | None) -> datasets.Dataset:
    if kind == "dataset_dict":
        return datasets.load_from_disk(_saved_split_dir(path, split))
    ds = datasets.load_from_disk(path)
    _check_single_split(path, split, "a saved Dataset folder", ds.split and str(ds.split))
    return ds


def _offline_flags() -> bool:
    import huggingface_hub.constants as hub_constants

    return bool(datasets.config.HF_HUB_OFFLINE or getattr(datasets.config, "HF_DATASETS_OFFLINE",
                                                          False) or hub_constants.HF_HUB_OFFLINE)


def _is_connection_error(exc: BaseException) -> bool:
    from llmdp.base.hf import is_connection_error

    return is_connection_error(exc)


def _hub_name(dataset, config_name, split) -> str:
    s = f"data.dataset={dataset!r}"
    if config_name is not None:
        s += f" (data.config_name={config_name!r})"
    return s + f", data.split={split!r}"


def _load_hub(dataset: str, config_name: str | None, split: str | None) -> datasets.Dataset:
    if not isinstance(dataset, str) or not dataset:
        raise ValueError(f"data.dataset must be a Hub dataset name like 'org/name', got {dataset!r}")
    if not isinstance(split, str) or not split:
        raise ValueError(f"data.split must name one split of data.dataset={dataset!r}, got {split!r}")
    try:
        ds = datasets.load_dataset(dataset, config_name, split=split)
    except Exception as exc:
        if _is_connection_error(exc):
            why = ("offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if _offline_flags()
                   else "the Hugging Face Hub could not be reached")
            raise ValueError(
                f"data.dataset={dataset!r} could not be reached offline: {why}, and it is not in "
                f"the local datasets cache ({type(exc).__name__}: {exc}). To fix: on a machine with "
                f"network, run once `datasets.load_dataset({dataset!r}, {config_name!r}, "
                f"split={split!r}).save_to_disk(DIR)`, copy DIR here, and set data.path=DIR "
                "instead of data.dataset (or unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE if this "
                "machine has network)"
            ) from exc
        if isinstance(exc, datasets.exceptions.DatasetNotFoundError):
            raise ValueError(
                f"data.dataset={dataset!r} was not found on the Hub (check the name; a private or "
                f"gated dataset needs `hf auth login`): {exc}"
            ) from exc
        if isinstance(exc, ValueError):  # unknown split, missing/unknown config name, ...
            raise ValueError(f"{_hub_name(dataset, config_name, split)}: {exc}") from exc
        raise
    if not isinstance(ds, datasets.Dataset):  # e.g. an IterableDataset from a custom script
        raise ValueError(
            f"{_hub_name(dataset, config_name, split)} did not load as a datasets.Dataset "
            f"(got {type(ds).__name__})"
        )
    return ds


def load_records(
    *, path=None, dataset: str | None = None, format: str = "auto", split: str | None = "train",
    config_name: str | None = None, columns: Sequence[str] | Mapping[str, str] | None = None,
    text_split: str = "file",
) -> datasets.Dataset:
    """The records of ``data.path`` or ``data.dataset`` as a ``datasets.Dataset`` (all columns).

    ``columns``: the columns the caller needs, either a list of names or a mapping
    ``{recipe field: column}`` (e.g. ``{"data.text_field": "body"}``), which makes the
    error name the field. A missing one raises ``ValueError`` listing the available columns.
    ``split`` picks the split of a saved DatasetDict or of a Hub dataset; local files and a
    saved single Dataset form one table, so they accept only ``split="train"`` (or the saved
    Dataset's own split name). ``config_name`` is for Hub datasets only.
    ``text_split`` (plain-text files only): ``file`` (one record per file), ``line`` or
    ``paragraph``.
    """
    _check_source(path, dataset)
    _check_text_split(text_split)
    if dataset is not None:
        _check_no_format(format, f"data.dataset={dataset!r} (a Hub dataset)")
        ds = _load_hub(dataset, config_name, split)
        where = _hub_name(dataset, config_name, split)
    else:
        path = os.path.abspath(os.fspath(path))
        if config_name is not None:
            raise ValueError(
                f"data.config_name={config_name!r} applies to Hub datasets (data.dataset) only, "
                f"not to data.path={path!r}"
            )
        kind = saved_dataset_kind(path)
        if kind is not None:
            _check_no_format(format, f"data.path={path!r} (a folder written by save_to_disk)")
            ds = _load_saved(path, kind, split)
            where = f"data.path={path!r}" + (f" (split {split!r})" if kind == "dataset_dict" else "")
        else:
            files = data_files(path)
            builder = resolve_format(path, format)
            _check_single_split(path, split, "local data files")
            ds = _load_local(path, files, builder, text_split)
            where = f"data.path={path!r}"
    _check_columns(ds, columns, where)
    return ds


# ----------------------------------------------------------------------------- fingerprints


def fingerprint_file(path) -> str:
    """sha256 (hex) of the file's bytes, streamed.

    For a directory: sha256 over (relative name, file sha256) of each of its data files,
    so renaming, adding or editing any file changes it.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return sha256_file(path)
    h = hashlib.sha256(b"llmdp-dir-v1\0")
    for f in data_files(path):
        h.update(os.path.relpath(f, path).encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def _saved_arrow_files(table_dir: str) -> list[str]:
    """The Arrow data files of one saved Dataset folder, in their table order."""
    with open(os.path.join(table_dir, "state.json")) as f:
        state = json.load(f)
    names = [d["filename"] for d in state.get("_data_files", [])]
    if not names:  # should not happen; hash whatever Arrow files are there
        names = sorted(n for n in os.listdir(table_dir) if n.endswith(".arrow"))
    return [os.path.join(table_dir, n) for n in names]


def _fingerprint_saved(path: str, kind: str, split: str | None) -> str:
    if kind == "dataset_dict":
        table_dir = _saved_split_dir(path, split)
        h = hashlib.sha256(b"llmdp-saved-dict-v1\0" + str(split).encode() + b"\0")
    else:
        table_dir = path
        h = hashlib.sha256(b"llmdp-saved-v1\0")  # one table: the split name does not matter
    for f in _saved_arrow_files(table_dir):
        h.update(os.path.basename(f).encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def source_fingerprint(
    *, path=None, dataset: str | None = None, split: str | None = "train",
    config_name: str | None = None, format: str = "auto",
) -> str:
    """sha256 (hex) of the records a ``load_records`` call with these arguments reads.

    - local files: :func:`fingerprint_file` (bytes of the file, or of every data file of a
      directory with their relative names); ``format`` is checked, not hashed.
    - a saved Dataset folder: its Arrow data files; a saved DatasetDict: the chosen split's
      Arrow data files and the split name.
    - a Hub dataset: loads it (from the ``datasets`` cache when possible) and hashes its
      ``_fingerprint`` with the name, config and split.
    """
    _check_source(path, dataset)
    if dataset is not None:
        _check_no_format(format, f"data.dataset={dataset!r} (a Hub dataset)")
        ds = _load_hub(dataset, config_name, split)
        payload = {"dataset": dataset, "config_name": config_name, "split": split,
                   "fingerprint": ds._fingerprint}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    if isinstance(path, str) and "://" in path:  # a pyarrow filesystem (Ray Data builds)
        from llmdp.data.chunks import fingerprint_uri  # lazy: only for URIs

        return fingerprint_uri(path)
    path = os.path.abspath(os.fspath(path))
    kind = saved_dataset_kind(path)
    if kind is not None:
        _check_no_format(format, f"data.path={path!r} (a folder written by save_to_disk)")
        if kind == "dataset":
            with open(os.path.join(path, "state.json")) as f:
                own = json.load(f).get("_split")
            _check_single_split(path, split, "a saved Dataset folder", own)
        return _fingerprint_saved(path, kind, split)
    resolve_format(path, format)  # the same errors load_records would raise
    _check_single_split(path, split, "local data files")
    return fingerprint_file(path)


# ----------------------------------------------------------------------------- description


def describe_records(data_cfg: Mapping) -> str:
    """What one record of the corpus is, for the privacy report (``data_cfg``: the recipe's
    ``data`` section as a dict): how text files are split into records, what happens to
    malformed records, and the unit selection (``unit_fraction``). Public configuration only."""
    parts = []
    path, fmt = data_cfg.get("path"), data_cfg.get("format") or "auto"
    builder = None
    if path is not None:
        try:
            builder = resolve_format(path, fmt)
        except (OSError, ValueError):
            builder = _BUILDERS.get(fmt)
    if builder == "text":
        split = data_cfg.get("text_split") or "file"
        parts.append({"file": "one record per text file (data.text_split=file)",
                      "line": "one record per non-blank line of the text files (data.text_split=line)",
                      "paragraph": "one record per paragraph (block of lines between blank lines) of "
                                   "the text files (data.text_split=paragraph)"}[split])
    elif builder == "json":
        parts.append("one record per JSON object (line of a JSON-lines file)")
    else:
        parts.append("one record per row of the dataset")
    policy = data_cfg.get("on_bad_record") or "error"
    parts.append("malformed records stop the run (data.on_bad_record=error)" if policy == "error"
                 else "malformed records are left out and counted (data.on_bad_record=skip; the "
                      "count is internal)")
    frac = data_cfg.get("unit_fraction")
    if frac is not None:
        parts.append(f"each unit kept independently iff a keyed hash of its own content is below "
                     f"data.unit_fraction={frac:g} (adding or removing a unit never changes which "
                     f"others are kept: the relation stays add/remove-one relative to the corpus)")
    return "; ".join(parts)


def describe_encoding(encoding: dict | None) -> str | None:
    """How records become training tokens, for the privacy report: the record format, the
    chat template that rendered chats (whose, and its sha256) and what is trained on (for
    chat and instruction records: only the assistant replies). ``encoding``: the unit
    store's ``RecordEncoder.describe()`` (None for a run of an earlier llmdp: None).
    Public configuration only (a template is configuration, not data)."""
    if not isinstance(encoding, dict) or not encoding.get("mode"):
        return None
    cols = ", ".join(f"{k}={v!r}" for k, v in (encoding.get("columns") or {}).items())
    if encoding["mode"] == "text":
        return f"plain text records ({cols}): every token, and the closing EOS, is a training target"
    sha = (encoding.get("template_sha256") or "")[:12]
    template = {
        "tokenizer": f"the tokenizer's own chat template (sha256 {sha}…)",
        "recipe": f"the recipe's data.chat_template (sha256 {sha}…)",
    }.get(encoding.get("chat_template"),
          f"no chat template: the plain format {encoding.get('plain_format') or 'System/User/Assistant'}")
    what = "chat records" if encoding["mode"] == "chat" else "instruction records (a user prompt and an assistant response)"
    return (f"{what} ({cols}) rendered with {template}; only the assistant replies (with their "
            f"end-of-turn marker) are training targets: system, user and tool turns and the "
            f"template's own text are context, never trained on")


def dataset_identity(d) -> dict:
    """The ledger identity of a recipe's ``data`` (a training or tokenizer recipe):
    ``{"dataset_id", "source", "name", "declared"}``. ``data.dataset_id`` when declared
    (verbatim); else derived from the source, never from its bytes, one id whatever its
    spelling (`llmdp.data.ids`): ``path:<real path>`` of local data (the same file
    from any working directory, edited or not, through a symlink or a ``file://`` URI, is
    one dataset), ``hub:<name>[/<config>]`` of a Hub dataset (lower-cased: Hub ids are
    case-insensitive), ``uri:<normalized URI>`` of other filesystems; data llmdp generates
    (``data.synthetic``) is named by its generator spec. ``name``: the file or dataset
    name, for "looks like" messages."""
    from llmdp.data.ids import hub_id, path_id, uri_id

    if d.path is not None and "://" in d.path:  # a URI: the dataset is named by it
        source = uri_id(d.path)
        name = source.rstrip("/").rsplit("/", 1)[-1]
    elif d.path is not None:
        source = path_id(d.path)
        name = os.path.basename(source.rstrip(os.sep))
    else:
        source, name = hub_id(d.dataset, d.config_name), d.dataset
    synthetic = getattr(d, "synthetic", None)
    if d.dataset_id is None and synthetic is not None:
        # Generated by llmdp (pinned generator): the same spec is the same invented people
        # in every checkout, so every clone's demo shares one ledger.
        gen = f"synthetic:{synthetic.kind}:n={synthetic.num_documents}:seed={synthetic.seed}"
        return {"dataset_id": gen, "source": source, "name": name, "declared": True}
    return {"dataset_id": d.dataset_id or source, "source": source, "name": name,
            "declared": d.dataset_id is not None}
