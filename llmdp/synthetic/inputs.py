"""What may steer the sampling: public files only.

Sampling from a DP model is post-processing only while nothing private enters it. Prompts
(``--prompts``) and labels (``--labels``) come from files the user declares public by
giving them (the card records the declaration); a file llmdp can tell is private is
refused (`check_public_file`): the recipe's training or private held-out source (the same
path, a path inside it, or a byte-identical copy of one of its files), or data any
ledger database of the registry records (its dataset id, content hash or an overlapping
source: `llmdp.privacy.ledger.registry.recorded`). Filtering or selecting records by
private data is not offered; ``--filter-with`` is refused (`refuse_filter`).
"""

from __future__ import annotations

import os

from llmdp.synthetic.source import GenerateError, ModelSource


def _files_of(path: str) -> list[str]:
    if os.path.isdir(path):
        from llmdp.data.files import data_files

        try:
            return [os.path.realpath(f) for f in data_files(path)]
        except (OSError, ValueError):
            return []
    return [os.path.realpath(path)] if os.path.isfile(path) else []


def private_use(path: str, source: ModelSource) -> str | None:
    """Why the file ``path`` is private data for ``source``'s model, or None."""
    from llmdp._fs import sha256_file

    real = os.path.realpath(path)
    sha = None
    for name, p in source.private_paths():
        rp = os.path.realpath(p)
        if real == rp or real.startswith(rp.rstrip(os.sep) + os.sep):
            return f"it is the recipe's private {name} ({p})"
        size = os.path.getsize(real)
        for f in _files_of(rp):
            if os.path.getsize(f) == size:
                sha = sha or sha256_file(real)
                if sha256_file(f) == sha:
                    return f"it is a byte-identical copy of {f}, a file of the recipe's private {name}"
    hits = _ledgers_recording(real, source)
    if hits:
        from llmdp.privacy.ledger import marks_text

        h = hits[0]
        return (f"the dataset ledger {h['ledger']!r} records this data ({h['why']}; "
                f"{marks_text(h)}): it was trained on, or set aside, as private data")
    return None


def _ledgers_recording(real: str, source: ModelSource) -> list[dict]:
    from llmdp._fs import sha256_file
    from llmdp.data.ids import local_members, path_id
    from llmdp.privacy.ledger import recorded, resolve_location

    ident = {"dataset_id": path_id(real), "source": path_id(real), "name": os.path.basename(real)}
    try:
        current = resolve_location(source.ledger_location())
    except Exception:  # noqa: BLE001 - an unreachable database is searched through the registry
        current = None
    return recorded(ident, sha256_file(real), local_members(ident["dataset_id"]),
                    current=current, log=lambda *a: None)


def check_public_file(path, flag: str, source: ModelSource) -> dict:
    """The public file ``path`` given with ``flag``, or `GenerateError` if it is missing or
    private. Returns what the card says of it."""
    from llmdp._fs import sha256_file
    from llmdp.record.provenance import shown

    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise GenerateError(f"{flag} {path}: no such file; give a public text file, one entry a line")
    why = private_use(path, source)
    if why is not None:
        raise GenerateError(
            f"{flag} {path}: {why}. Prompts or labels read from private data make the corpus "
            f"depend on that data beyond the DP model, so it would no longer be post-processing "
            f"and the model's guarantee would not hold for it. Give a file of public text "
            f"(written by hand, or from a source declared public)")
    return {"file": shown(path), "sha256": sha256_file(path),
            "declared": f"public, by the user ({flag}); llmdp checked that it is not the "
                        f"recipe's private data nor data a ledger records"}


def read_lines(path) -> list[str]:
    """The non-blank lines of a prompts or labels file (UTF-8), in order."""
    try:
        with open(path, encoding="utf-8") as f:
            out = [line.rstrip("\n").rstrip("\r") for line in f]
    except UnicodeDecodeError as e:
        raise GenerateError(f"{path}: not UTF-8 text ({e}); save it as UTF-8") from None
    out = [x for x in out if x.strip()]
    if not out:
        raise GenerateError(f"{path}: no non-blank line; give one prompt or label a line")
    return out


def refuse_filter(path, source: ModelSource) -> None:
    """``--filter-with``: always refused (no filter by data is offered)."""
    path = os.path.abspath(os.fspath(path))
    why = private_use(path, source) if os.path.isfile(path) else None
    what = (f"{why}: selecting or filtering records by private data makes which records are "
            f"published depend on that data without DP" if why else
            "llmdp generate filters nothing: a filter scored on data leaves the guarantee "
            "only if that data is public, which llmdp cannot check")
    raise GenerateError(
        f"--filter-with {path}: {what}, and the corpus would not be post-processing of the DP "
        f"model. Generate without a filter; a filter on public criteria only (length, format) "
        f"may be applied afterwards, and the card then no longer describes the filtered file")
