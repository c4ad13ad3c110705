"""Dataset ids: one ledger per dataset, whatever the spelling of its source.

A ledger is named by ``data.dataset_id`` when the recipe declares one (used verbatim), else
by an id derived from the source (`llmdp.data.sources.dataset_identity`), normalized here so
that every spelling of one source gives one id:

- ``path:<real path>`` for local data: relative, absolute, symlinked, ``.``/``..`` and
  trailing-slash spellings resolve to one real path (`os.path.realpath`); ``file:///x`` and
  ``file://localhost/x`` are the plain path ``/x`` (percent-decoded);
- ``hub:<name>[/<config>]`` for a Hub dataset, lower-cased: Hub repository ids are
  case-insensitive (``OrgName/Notes`` and ``orgname/notes`` are one repository). A config
  name differing only in case is taken for the same config too;
- ``uri:<scheme>://<host>/<path>`` for other filesystems (s3, gs, hdfs, ...): scheme and
  host lower-cased, empty, ``.`` and ``..`` segments resolved (``s3://b//x`` is
  ``s3://b/x``), no trailing slash.

Why merging spellings is safe: it can only put the releases of one dataset (or, at worst, of
two sources that look alike) into one ledger, so a budget counts *more* releases, never
fewer. Splitting one dataset over two ledgers is the failure that under-counts.

`canonical_id` maps an id as any llmdp version stored it to today's form: a ledger started
under an earlier spelling (``hub:OrgName/Notes``, ``uri:file:///x``, ``uri:S3://b//x``)
keeps its id and is found under it (`llmdp.privacy.ledger.service.open_dataset`), never replaced by
a fresh ledger.

Two sources that are not one id may still overlap: `overlap` says why (a local file that a
known folder reads, a folder holding a known file, two folders with a file in common; a URI
or Hub id inside another, e.g. a folder and a file in it, or two configurations of one Hub
dataset). Local files are compared as real paths (`local_members`).
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = ["path_id", "hub_id", "uri_id", "canonical_id", "local_members", "overlap"]


def path_id(path) -> str:
    """``path:<real path>`` of a local file or folder."""
    return "path:" + os.path.realpath(os.fspath(path))


def hub_id(name: str, config_name: str | None = None) -> str:
    """``hub:<name>[/<config>]``, lower-cased (Hub repository ids are case-insensitive)."""
    return ("hub:" + name + (f"/{config_name}" if config_name else "")).lower()


def _local_file_path(uri: str) -> str | None:
    """The local path of a ``file:`` URI naming this machine (None for any other URI)."""
    parts = urlsplit(uri)
    if parts.scheme.lower() != "file" or parts.netloc.lower() not in ("", "localhost"):
        return None
    return unquote(parts.path) or "/"


def normalize_uri(uri: str) -> str:
    """``uri`` with its scheme and host lower-cased and its path's empty, ``.`` and ``..``
    segments resolved, without a trailing slash."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" not in netloc:  # a bucket or host name: case-insensitive (user names are not)
        netloc = netloc.lower()
    segments: list[str] = []
    for seg in parts.path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    path = "/" + "/".join(segments) if segments else ""
    return urlunsplit((parts.scheme.lower(), netloc, path, parts.query, parts.fragment))


def uri_id(uri: str) -> str:
    """The id of a ``data.path`` URI: ``path:<real path>`` for a local ``file://`` URI (the
    plain path's id), else ``uri:<normalized URI>``."""
    local = _local_file_path(uri)
    if local is not None:
        return path_id(local)
    return "uri:" + normalize_uri(uri)


def canonical_id(dataset_id: str) -> str:
    """Today's form of a derived id as any llmdp version stored it (a declared id, or one
    already in today's form, is returned as is)."""
    if dataset_id.startswith("hub:"):
        return dataset_id.lower()
    if dataset_id.startswith("uri:"):
        return uri_id(dataset_id[len("uri:"):])
    return dataset_id


def local_members(dataset_id: str) -> frozenset[str]:
    """The real paths of the files a ``path:`` id's source reads as they are now: the file
    itself; a folder's data files (`llmdp.data.files.data_files`); every file of a
    ``save_to_disk`` folder. Empty for any other id; the path alone when it cannot be listed
    (gone, no data files)."""
    if not dataset_id.startswith("path:"):
        return frozenset()
    from llmdp.data.files import data_files, saved_dataset_kind  # lazy: only for local data

    path = dataset_id[len("path:"):]
    if os.path.isdir(path):
        try:
            if saved_dataset_kind(path) is not None:
                files = [os.path.join(root, n) for root, _, names in os.walk(path) for n in names]
            else:
                files = data_files(path)
        except (OSError, ValueError):
            files = []
        if files:
            return frozenset(os.path.realpath(f) for f in files)
    return frozenset({os.path.realpath(path)})


def _inside(a: str, b: str) -> bool:
    """Whether id ``a`` names something inside id ``b`` (``b`` + "/" is a prefix of ``a``)."""
    return a.startswith(b.rstrip("/") + "/")


def overlap(new_id: str, new_members: frozenset[str], other_id: str) -> str | None:
    """Why the data of ``new_id`` (reading the local files ``new_members``) overlaps the
    data of the ledger ``other_id`` (an id in today's form, `canonical_id`), or None.

    Local sources overlap when they read a common file (real paths, as the files are now);
    URI and Hub ids when one is inside the other (a folder and a file in it; a Hub dataset
    and one of its configurations). Declared ids have no structure: None."""
    if new_id == other_id:
        return None
    if new_id.startswith("path:") and other_id.startswith("path:"):
        other = other_id[len("path:"):]
        if other in new_members:
            return f"it reads the file {other}, the whole of that ledger's data"
        # A folder ledger can share files only when it holds one of ours or lies inside
        # our folder (files it reaches through symlinks elsewhere are not looked for).
        inside = other.rstrip("/") + "/"
        near = _inside(other_id, new_id) or any(m.startswith(inside) for m in new_members)
        if not near or not os.path.isdir(other):
            return None
        common = sorted(new_members & local_members(other_id))
        if common:
            more = f" and {len(common) - 1} other file(s)" if len(common) > 1 else ""
            return f"both read the file {common[0]}{more}"
        return None
    for prefix in ("uri:", "hub:"):
        if new_id.startswith(prefix) and other_id.startswith(prefix):
            if _inside(new_id, other_id):
                return f"{new_id[len(prefix):]} is inside {other_id[len(prefix):]}"
            if _inside(other_id, new_id):
                return f"{other_id[len(prefix):]} is inside {new_id[len(prefix):]}"
    return None
