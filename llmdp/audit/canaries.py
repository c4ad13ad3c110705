"""Canaries and the secret keyed coins that include them (issue 19, item 1).

An audit run trains the recipe on its private data plus the canaries whose coin came up
heads. Each canary is one privacy unit of the recipe's kind (one row of at most
``data.sequence_length`` tokens: a sequence unit, a one-row document, a one-document
user), appended to the private unit store as a shard of its own, so that it is exactly one
unit of the guarantee whatever the unit kind (a canary record in the corpus would be
packed into rows with its neighbours under sequence units).

Two kinds, half each by default:

    random   tokens drawn uniformly from the vocabulary (special tokens excluded): the
             strongest canaries for a black-box attack (nothing like them is in the data)
    record   the first tokens of a natural-looking synthetic record from the project's
             faker generator (``llmdp.data.synthetic``): what a real secret looks like

The coins. Canary i is included iff the low bit of HMAC-SHA256(key, "llmdp-audit/coin/"
‖ i) is 1: each coin is a fair, independent bit under the 32-byte secret key (drawn from
the OS's entropy for each audit), computed from the key and the index only, never from
the data or the canaries' content, and unpredictable without the key (HMAC is a PRF).
The canaries' content comes from other, domain-separated HMAC outputs of the same key,
so the whole audit can be reproduced by whoever holds the key, and by nobody else.

Secrets: the key, the canaries and their coins live in the audit run's ``audit/`` folder
(key file mode 0600), never in a report, an export or a ledger.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
from dataclasses import dataclass

import numpy as np

from llmdp.data.units import UnitArrays

KEY_BYTES = 32
KINDS = ("random", "record")

__all__ = ["KEY_BYTES", "Canaries", "augmented_store", "canary_units", "coins", "load_canaries",
           "make_canaries", "new_key", "read_key", "write_canaries", "write_key"]


def new_key() -> bytes:
    """A fresh 32-byte audit key from the OS's entropy."""
    return secrets.token_bytes(KEY_BYTES)


def _prf(key: bytes, label: bytes, i: int = 0) -> bytes:
    _check_key(key)
    return hmac.new(key, b"llmdp-audit/" + label + b"/" + int(i).to_bytes(8, "little"),
                    hashlib.sha256).digest()


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"an audit key is {KEY_BYTES} bytes, got "
                         f"{len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}")


def coins(key: bytes, m: int) -> np.ndarray:
    """The m keyed coins (bool): canary i is included iff coin i. Each is the low bit of
    HMAC-SHA256(key, "llmdp-audit/coin/" ‖ i): a function of the key and i alone."""
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
        raise ValueError(f"the number of canaries must be an integer >= 0, got {m!r}")
    return np.fromiter((_prf(key, b"coin", i)[0] & 1 for i in range(int(m))), dtype=bool, count=int(m))


def _seed(key: bytes, label: bytes) -> int:
    return int.from_bytes(_prf(key, label)[:8], "little")


@dataclass(frozen=True)
class Canaries:
    """m canaries: ``rows[i]`` the token ids of canary i (one row), ``kinds[i]`` "random" or
    "record", ``included[i]`` its coin. Secret: never published."""

    rows: tuple[np.ndarray, ...]
    kinds: tuple[str, ...]
    included: np.ndarray

    @property
    def m(self) -> int:
        return len(self.rows)

    def fingerprint(self) -> str:
        """sha256 of the canaries and their coins (names the augmented store; local only)."""
        h = hashlib.sha256()
        for row, kind, inc in zip(self.rows, self.kinds, self.included.tolist()):
            h.update(kind.encode() + bytes([inc]) + np.asarray(row, np.int32).tobytes() + b"|")
        return h.hexdigest()


def _special(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            ids.add(int(v))
    return ids


def make_canaries(key: bytes, m: int, tokenizer, sequence_length: int,
                  record_fraction: float = 0.5) -> Canaries:
    """m canaries of at most ``sequence_length`` tokens: the first ⌊m·record_fraction⌋ are
    synthetic records, the rest random tokens; every one gets its keyed coin."""
    if not 0.0 <= float(record_fraction) <= 1.0:
        raise ValueError(f"record_fraction must be in [0, 1], got {record_fraction!r}")
    if int(sequence_length) < 2:
        raise ValueError(f"sequence_length must be >= 2 for a canary, got {sequence_length!r}")
    m = int(m)
    n_rec = int(m * float(record_fraction))
    L = int(sequence_length)
    eos = tokenizer.eos_token_id
    rows: list[np.ndarray] = []
    if n_rec:
        from llmdp.data.synthetic import generate_clinical_notes  # faker: only when asked

        # Seeded from the key: another audit draws other records (faker's seed is an int).
        notes = generate_clinical_notes(n_rec, seed=_seed(key, b"records") % (2**31))
        for note in notes:
            ids = list(tokenizer(note["text"])["input_ids"]) + [int(eos)]
            rows.append(np.asarray(ids[:L], dtype=np.int32))
    special = _special(tokenizer)
    allowed = np.asarray([t for t in range(len(tokenizer)) if t not in special], dtype=np.int32)
    if allowed.size == 0 and m > n_rec:
        raise ValueError("the tokenizer has no non-special token to draw random canaries from")
    rng = np.random.Generator(np.random.PCG64(_seed(key, b"random-tokens")))
    for _ in range(m - n_rec):
        rows.append(allowed[rng.integers(0, allowed.size, size=L)])
    kinds = ("record",) * n_rec + ("random",) * (m - n_rec)
    return Canaries(rows=tuple(rows), kinds=kinds, included=coins(key, m))


def canary_units(rows, with_segments: bool = False) -> UnitArrays:
    """Canaries as units: one row each, every token a target (a text record's rule)."""
    lengths = np.asarray([len(r) for r in rows], dtype=np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([np.asarray(r, np.int32) for r in rows]) if len(rows) else np.empty(0, np.int32)
    return UnitArrays(
        tokens=tokens, target=np.ones(tokens.size, dtype=np.uint8), row_offsets=offsets,
        row_start=np.arange(lengths.size, dtype=np.int64), row_count=np.ones(lengths.size, np.int64),
        segments=np.zeros(tokens.size, dtype=np.int32) if with_segments else None,
        counts={"canaries": int(lengths.size)})


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or no hard links: a copy
        shutil.copyfile(src, dst)


def augmented_store(private, canaries: Canaries, folder: str, *, which: str = "included"):
    """A unit store of ``private``'s units followed by canaries as one more shard: the
    included ones (``which="included"``: the audit run's training data), or all m
    (``which="all"``, without the private units: what the scores are computed on).
    Written once into ``folder`` (atomic rename); returns the opened store."""
    from llmdp.data.store import FORMAT_VERSION, open_store, rows_per_batch, write_unit_files

    if which not in ("included", "all"):
        raise ValueError(f"which must be 'included' or 'all', got {which!r}")
    if os.path.isfile(os.path.join(folder, "meta.json")):
        return open_store(folder)
    pick = np.flatnonzero(canaries.included) if which == "included" else np.arange(canaries.m)
    units = canary_units([canaries.rows[i] for i in pick], with_segments=private.has_segments)
    L = private.sequence_length
    too_long = [i for i in pick if len(canaries.rows[i]) > L]
    if too_long:
        raise ValueError(f"canary {too_long[0]} has {len(canaries.rows[too_long[0]])} tokens, more "
                         f"than the store's sequence_length {L}")
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards = []
    if which == "included":
        old = private.meta.get("shards") or [{"rows": "rows.arrow", "units": "units.arrow",
                                              "num_units": private.num_units}]
        for j, shard in enumerate(old):
            entry = dict(shard)
            for part in ("rows", "units"):
                name = f"private-{j}-{os.path.basename(shard[part])}"
                _link_or_copy(os.path.join(private.path, shard[part]), os.path.join(tmp, name))
                entry[part] = name
            shards.append(entry)
    write_unit_files(tmp, units, L, rows="canaries.rows.arrow", units_file="canaries.units.arrow")
    shards.append({"rows": "canaries.rows.arrow", "units": "canaries.units.arrow",
                   "num_units": units.num_units})
    base = private.num_units if which == "included" else 0
    num_rows = (private.num_rows if which == "included" else 0) + units.num_rows
    meta = {k: v for k, v in private.meta.items() if k not in ("shards", "counts")}
    counts = dict(private.meta.get("counts", {})) if which == "included" else {}
    counts.update({"num_units": base + units.num_units, "num_rows": num_rows,
                   "audit_canaries_included": int(units.num_units)})
    meta.update({
        "format_version": FORMAT_VERSION, "num_units": base + units.num_units, "num_rows": num_rows,
        "rows_per_batch": rows_per_batch(L), "shards": shards, "counts": counts,
        "fingerprint": hashlib.sha256(
            f"{private.fingerprint}|{canaries.fingerprint()}|{which}".encode()).hexdigest(),
        "audit": {"canaries": which, "count": int(units.num_units)},
    })
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return open_store(folder)


# --------------------------------------------------------------------------- the secret files


def write_key(path: str, key: bytes) -> None:
    """The key as hex, readable by its owner only (0600), written atomically."""
    _check_key(key)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    os.replace(tmp, path)


def read_key(path: str) -> bytes:
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: not a hex audit key") from None
    _check_key(key)
    return key


def write_canaries(path: str, canaries: Canaries) -> None:
    """One JSON line per canary (index, kind, coin, token ids): the audit's secret record."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for i, (row, kind, inc) in enumerate(zip(canaries.rows, canaries.kinds, canaries.included)):
            f.write(json.dumps({"i": i, "kind": kind, "included": bool(inc),
                                "tokens": [int(t) for t in row]}) + "\n")
    os.replace(tmp, path)


def load_canaries(path: str) -> Canaries:
    rows, kinds, inc = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append(np.asarray(r["tokens"], dtype=np.int32))
                kinds.append(r["kind"])
                inc.append(bool(r["included"]))
    return Canaries(rows=tuple(rows), kinds=tuple(kinds), included=np.asarray(inc, dtype=bool))
