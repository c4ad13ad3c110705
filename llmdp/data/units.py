"""Privacy units: what one unit of the DP guarantee is, and how encoded records become units.

The unit of privacy fixes what the guarantee means (the DP-fy guide, §5.1). Three kinds:

``sequence``
    Every record is encoded (token ids + a per-token "is a training target" flag, ending
    with EOS), all records are concatenated into one token stream and the stream is cut
    into rows of exactly ``sequence_length`` tokens. Each row is one unit. The guarantee
    protects any one row, which may span the end of one document and the start of the
    next; it does *not* protect a whole document or user spanning several rows. With
    ``document_masking`` attention does not cross document boundaries inside a row and
    positions restart at each document.
``document``
    One record is one unit of at most ``max_rows_per_unit`` rows of ``sequence_length``
    tokens. A longer document is truncated (its tail is dropped and counted), never split
    into several units; documents are never packed together.
``user``
    Records are grouped by ``user_field``; a user's records, in a pseudo-random order
    that depends only on that user's key and records, are packed into one stream (EOS
    between records) of which the first ``max_rows_per_unit`` rows are kept. That is the
    contribution bound: a user's rows are a function of that user's own records only, so
    adding or removing a user changes exactly one unit. The unit is the user.

``unit_fraction`` (``data.unit_fraction``, for quick runs on part of a corpus) keeps each
unit independently iff a keyed hash of the unit's own content (its tokens; for a user unit
its user key) falls below the fraction; the key is a fixed public string. Whether a unit
is kept therefore depends on that unit alone: adding or removing one unit never changes
which other units are kept, so add/remove-one relative to the whole corpus remains the
relation the guarantee is accounted under. (A cap by count, "the first k", or even "the k
smallest hashes", would let an added unit evict another: replace-one, not add/remove.)

For every kind, a unit's loss is the mean over all its target tokens and its gradient the
sum over its rows (the ``row_units`` contract of the clipping engine); a row of fewer than
2 tokens has nothing to predict and is dropped, as is a unit with no target token.

Everything here is numpy over flat arrays: an :class:`EncodedCorpus` in, :class:`UnitArrays`
out (variable-length rows, no padding stored). The store (store.py) writes them to disk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

SUPPORTED_KINDS = ("sequence", "document", "user")
# The key of the unit-selection hash: public and fixed (never derived from the data).
SELECTION_KEY = b"llmdp.unit_fraction.v1"


@dataclass(frozen=True)
class UnitSpec:
    """What one privacy unit is (see the module docstring)."""

    kind: str = "sequence"
    sequence_length: int = 128
    max_rows_per_unit: int = 1
    document_masking: bool = False
    user_field: str | None = None

    def __post_init__(self):
        if self.kind not in SUPPORTED_KINDS:
            raise ValueError(
                f"data.unit={self.kind!r} is not a privacy unit kind; use one of {list(SUPPORTED_KINDS)}"
            )
        if isinstance(self.sequence_length, bool) or not isinstance(self.sequence_length, int) \
                or self.sequence_length < 2:
            raise ValueError(
                f"data.sequence_length must be an int >= 2 (one input and one target token), "
                f"got {self.sequence_length!r}"
            )
        r = self.max_rows_per_unit
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"data.max_rows_per_unit must be an int >= 1, got {r!r}")
        if self.kind == "sequence" and r != 1:
            raise ValueError(
                f"data.max_rows_per_unit={r} with data.unit='sequence': a sequence unit is one row; "
                "use data.unit='document' or 'user' for multi-row units, or set max_rows_per_unit: 1"
            )
        if self.kind == "user" and not self.user_field:
            raise ValueError(
                "data.unit='user' needs data.user_field: the record field that identifies the user "
                "(e.g. user_field: user_id)"
            )
        if self.kind != "user" and self.user_field is not None:
            raise ValueError(
                f"data.user_field={self.user_field!r} is only used with data.unit='user' "
                f"(got data.unit={self.kind!r}); remove it or set data.unit: user"
            )
        if self.kind == "document" and self.document_masking:
            raise ValueError(
                "data.document_masking=true has no effect with data.unit='document' (a document "
                "unit is never packed with another document); remove it"
            )

    @property
    def max_tokens_per_unit(self) -> int:
        return self.max_rows_per_unit * self.sequence_length

    def describe(self) -> str:
        L, R = self.sequence_length, self.max_rows_per_unit
        if self.kind == "sequence":
            how = ("attention masked at document boundaries" if self.document_masking
                   else "packed across document boundaries")
            return f"a sequence of {L} tokens ({how})"
        rows = f"at most {R} row{'s' if R > 1 else ''} of {L} tokens"
        if self.kind == "document":
            return f"a document ({rows}; longer documents are truncated, never split)"
        return (f"a user: all records sharing {self.user_field!r} ({rows} per user; "
                "records beyond the bound are dropped)")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "sequence_length": self.sequence_length,
                "max_rows_per_unit": self.max_rows_per_unit,
                "document_masking": self.document_masking, "user_field": self.user_field}


def special_ids(tokenizer) -> tuple[int, int]:
    """(eos_id, pad_id) of a Hugging Face tokenizer; pad falls back to EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no EOS token; llmdp needs one "
            "to end every record"
        )
    pad = tokenizer.pad_token_id
    return int(eos), int(eos if pad is None else pad)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids: the serialized tokenizer / vocab, EOS and pad ids."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Padding / truncation are call-time settings transformers toggles on the backend;
        # they do not change how text is tokenized here.
        state.pop("padding", None)
        state.pop("truncation", None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        sp = getattr(tokenizer, "sp_model", None)
        if sp is not None and hasattr(sp, "serialized_model_proto"):
            h.update(sp.serialized_model_proto())
    eos, pad = special_ids(tokenizer)
    h.update(json.dumps({"eos": eos, "pad": pad}).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- encoded corpus


@dataclass
class EncodedCorpus:
    """All records, encoded: ``tokens`` int32 and ``target`` uint8 (1 = a training target)
    flat over records, record ``d`` spanning ``offsets[d]:offsets[d+1]`` (each record ends
    with EOS); ``users`` the user key of each record (user units only)."""

    tokens: np.ndarray
    target: np.ndarray
    offsets: np.ndarray
    users: np.ndarray | None = None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int32).reshape(-1)
        self.target = np.asarray(self.target, dtype=np.uint8).reshape(-1)
        self.offsets = np.asarray(self.offsets, dtype=np.int64).reshape(-1)
        if self.tokens.shape != self.target.shape:
            raise ValueError("EncodedCorpus: tokens and target differ in length")
        if self.offsets.size < 1 or self.offsets[0] != 0 or self.offsets[-1] != self.tokens.size \
                or np.any(np.diff(self.offsets) < 0):
            raise ValueError("EncodedCorpus: offsets must rise from 0 to len(tokens)")
        if self.users is not None and len(self.users) != self.num_records:
            raise ValueError("EncodedCorpus: one user key per record is needed")

    @property
    def num_records(self) -> int:
        return int(self.offsets.size - 1)

    def records_without_target(self) -> int:
        """Records with no training target token (internal statistics)."""
        if self.num_records == 0:
            return 0
        starts = self.offsets[:-1]
        ne = self.offsets[1:] > starts
        per = np.zeros(self.num_records, np.int64)
        if ne.any():  # records abut: one reduceat over the non-empty ones
            per[ne] = np.add.reduceat(self.target, starts[ne], dtype=np.int64)
        return int((per == 0).sum())

    @staticmethod
    def from_records(records: Iterable[tuple[np.ndarray, np.ndarray]], users=None) -> EncodedCorpus:
        ids, tgt, lens = [], [], [0]
        for i, t in records:
            ids.append(np.asarray(i, dtype=np.int32))
            tgt.append(np.asarray(t, dtype=np.uint8))
            lens.append(len(ids[-1]))
        def cat(xs, dt):
            return np.concatenate(xs) if xs else np.empty(0, dt)

        return EncodedCorpus(cat(ids, np.int32), cat(tgt, np.uint8), np.cumsum(lens),
                             None if users is None else np.asarray(users, dtype=object))


# --------------------------------------------------------------------------- unit arrays


@dataclass
class UnitArrays:
    """Units as variable-length rows (no padding stored).

    Row ``r`` is ``tokens[row_offsets[r]:row_offsets[r+1]]`` (``target`` and, with document
    masking, ``segments`` alike: the document index of each token, counted from 0 within
    the row). Unit ``u`` is rows ``row_start[u] : row_start[u] + row_count[u]``.
    ``counts`` are computed on private data (the report marks them internal).
    """

    tokens: np.ndarray
    target: np.ndarray
    row_offsets: np.ndarray
    row_start: np.ndarray
    row_count: np.ndarray
    segments: np.ndarray | None = None
    counts: dict = field(default_factory=dict)

    @property
    def num_units(self) -> int:
        return int(self.row_start.size)

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets.size - 1)

    def row_lengths(self) -> np.ndarray:
        return np.diff(self.row_offsets).astype(np.int32)

    def unit_target_tokens(self) -> np.ndarray:
        """Target tokens per unit after the shift (a row's first token is never a target)."""
        s, e = self.row_offsets[:-1], self.row_offsets[1:]
        per_row = np.zeros(s.size, dtype=np.int64)
        ne = e > s
        if ne.any():
            # Rows abut (row_offsets is cumulative): a reduceat over the non-empty rows'
            # starts sums each row; minus its first token. No per-token int64 temporary.
            first = s[ne]
            per_row[ne] = np.add.reduceat(self.target, first, dtype=np.int64) - self.target[first]
        return _sum_by_unit(per_row, self.row_start, self.row_count)

    def unit_max_row_length(self) -> np.ndarray:
        lens = self.row_lengths()
        if self.num_units == 0:
            return np.empty(0, np.int32)
        return np.maximum.reduceat(lens, self.row_start).astype(np.int32)


def _sum_by_unit(per_row: np.ndarray, row_start: np.ndarray, row_count: np.ndarray) -> np.ndarray:
    cs = np.concatenate([[0], np.cumsum(per_row, dtype=np.int64)])
    return cs[row_start + row_count] - cs[row_start]


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair, vectorized (int64)."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(ends, dtype=np.int64) - starts
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, np.int64)
    # int32 where every index fits: half the memory of the largest temporary of unit building
    dt = np.int32 if int(np.max(np.asarray(ends, dtype=np.int64))) < 2**31 else np.int64
    keep = lens > 0
    starts, lens = starts[keep], lens[keep]
    first = np.concatenate([[0], np.cumsum(lens)[:-1]])
    out = np.ones(total, dtype=dt)
    out[first] = starts - np.concatenate([[0], starts[:-1] + lens[:-1] - 1])
    out[0] = starts[0]
    return np.cumsum(out, out=out)  # in place: one index per element, not two


def _rows_from_streams(stream_start, stream_len, L: int, max_rows: int | None):
    """Cut each stream ``[start, start+len)`` of the flat token space into rows of ``L``
    (the last one shorter), keep at most ``max_rows`` per stream and drop rows < 2 tokens.
    Returns (row begin, row end, stream index of each row), rows in stream order."""
    stream_start = np.asarray(stream_start, np.int64)
    stream_len = np.asarray(stream_len, np.int64)
    n_rows = -(-stream_len // L)
    if max_rows is not None:
        n_rows = np.minimum(n_rows, max_rows)
    owner = np.repeat(np.arange(stream_len.size), n_rows)
    first_row = np.concatenate([[0], np.cumsum(n_rows)[:-1]])
    k = np.arange(owner.size, dtype=np.int64) - np.repeat(first_row, n_rows)
    begin = stream_start[owner] + k * L
    end = np.minimum(begin + L, stream_start[owner] + stream_len[owner])
    keep = end - begin >= 2
    return begin[keep], end[keep], owner[keep]


def _finish(corpus_tokens, corpus_target, doc_of_token, begin, end, owner, masking: bool,
            counts: dict) -> UnitArrays:
    """Materialize rows (``begin/end`` index ``corpus_tokens``), group them by ``owner``
    (sorted) into units and drop units without a target token."""
    lens = end - begin
    offsets = np.concatenate([[0], np.cumsum(lens)])
    src = _ranges(begin, end)
    tokens = corpus_tokens[src]
    target = corpus_target[src]
    segments = None
    if masking:
        doc = doc_of_token[src]
        segments = (doc - np.repeat(doc[offsets[:-1]], lens)).astype(np.int32)
    uniq, row_start, row_count = np.unique(owner, return_index=True, return_counts=True)
    units = UnitArrays(tokens, target, offsets.astype(np.int64), row_start.astype(np.int64),
                       row_count.astype(np.int32), segments, counts)
    ntt = units.unit_target_tokens()
    if np.any(ntt == 0):
        units = select_units(units, np.flatnonzero(ntt > 0))
    units.counts = counts
    counts["units_without_target_dropped"] = int((ntt == 0).sum())
    counts["num_units"] = units.num_units
    counts["num_rows"] = units.num_rows
    counts["num_tokens"] = int(units.tokens.size)
    counts["num_target_tokens"] = int(units.unit_target_tokens().sum())
    return units


def select_units(units: UnitArrays, keep: np.ndarray) -> UnitArrays:
    """A new UnitArrays holding only units ``keep`` (in that order)."""
    keep = np.asarray(keep, dtype=np.int64)
    rs, rc = units.row_start[keep], units.row_count[keep].astype(np.int64)
    rows = _ranges(rs, rs + rc)
    b, e = units.row_offsets[rows], units.row_offsets[rows + 1]
    flat = _ranges(b, e)
    lens = e - b
    seg = None if units.segments is None else units.segments[flat]
    return UnitArrays(units.tokens[flat], units.target[flat],
                      np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                      (np.cumsum(rc) - rc).astype(np.int64),  # (empty when keep is)
                      rc.astype(np.int32), seg, dict(units.counts))


def selection_hash(content: bytes) -> float:
    """A keyed hash of a unit's own content, uniform in [0, 1) (key: SELECTION_KEY)."""
    h = hashlib.blake2b(content, key=SELECTION_KEY, digest_size=8)
    return int.from_bytes(h.digest(), "big") / 2.0**64


def _check_fraction(unit_fraction) -> float | None:
    if unit_fraction is None:
        return None
    f = unit_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ValueError(f"data.unit_fraction must be in (0, 1] or null, got {unit_fraction!r}")
    return float(f)


def _unit_content(units: UnitArrays, u: int) -> bytes:
    """Unit ``u``'s own content: its row lengths, tokens and target flags."""
    r0, r1 = units.row_start[u], units.row_start[u] + units.row_count[u]
    a, b = units.row_offsets[r0], units.row_offsets[r1]
    lens = np.diff(units.row_offsets[r0:r1 + 1]).astype(np.int64)
    return lens.tobytes() + units.tokens[a:b].tobytes() + units.target[a:b].tobytes()


def _select_by_content(units: UnitArrays, fraction: float) -> UnitArrays:
    """Keep unit u iff selection_hash(its tokens and target flags) < fraction."""
    keep = [u for u in range(units.num_units) if selection_hash(_unit_content(units, u)) < fraction]
    return select_units(units, np.asarray(keep, dtype=np.int64))


def build_units(corpus: EncodedCorpus, spec: UnitSpec, *,
                unit_fraction: float | None = None) -> UnitArrays:
    """The privacy units of an encoded corpus (see the module docstring)."""
    fraction = _check_fraction(unit_fraction)
    units = _build_units(corpus, spec, fraction)
    if fraction is not None and spec.kind != "user":  # user units are selected by user key
        before = units.num_units
        counts = units.counts
        units = _select_by_content(units, fraction)
        counts.update({"units_not_selected": before - units.num_units, "num_units": units.num_units,
                       "num_rows": units.num_rows, "num_tokens": int(units.tokens.size),
                       "num_target_tokens": int(units.unit_target_tokens().sum())})
        units.counts = counts
    return units


def _build_units(corpus: EncodedCorpus, spec: UnitSpec, fraction: float | None) -> UnitArrays:
    L = spec.sequence_length
    D = corpus.num_records
    doc_len = np.diff(corpus.offsets)
    counts: dict = {"num_records": D, "kind": spec.kind}

    if spec.kind == "sequence":
        total = corpus.tokens.size
        begin, end, _ = _rows_from_streams([0], [total], L, None)
        owner = np.arange(begin.size)
        # the record of the last token used: the number of records with a token before it
        counts["records_used"] = int(np.searchsorted(corpus.offsets, end[-1] - 1, side="right")) \
            if begin.size else 0
        # (the record of each token is materialized only for document masking)
        doc_of_token = np.repeat(np.arange(D, dtype=np.int64), doc_len) \
            if spec.document_masking else None
        return _finish(corpus.tokens, corpus.target, doc_of_token, begin, end, owner,
                       spec.document_masking, counts)

    R = spec.max_rows_per_unit
    cap = R * L
    if spec.kind == "document":
        lens = doc_len[:D]
        begin, end, owner = _rows_from_streams(corpus.offsets[:D], lens, L, R)
        counts["records_truncated"] = int((lens > cap).sum())
        counts["tokens_truncated"] = int(np.maximum(lens - cap, 0).sum())
        counts["records_used"] = D
        return _finish(corpus.tokens, corpus.target, None, begin, end, owner, False, counts)

    # ---- user units
    if corpus.users is None:
        raise ValueError("user units need the user key of every record")
    keys = np.asarray([_user_key(u, spec.user_field, i) for i, u in enumerate(corpus.users)], dtype=object)
    uniq, user_of_doc = np.unique(keys.astype(str), return_inverse=True)
    user_of_doc = user_of_doc.reshape(-1)
    n_users = uniq.size
    # Per-user record order: position within the user's records (source order), then a
    # pseudo-random rank keyed by (user, position) -- a function of the user's own records.
    pos = _position_within_group(user_of_doc)
    rank = np.fromiter((_rank(uniq[u], p) for u, p in zip(user_of_doc, pos)), dtype=np.uint64,
                       count=D)
    order = np.lexsort((rank, user_of_doc))  # by user, then by the keyed rank
    olen = doc_len[order]
    ouser = user_of_doc[order]
    # Tokens of each record kept under the per-user cap R*L.
    ucs = np.cumsum(olen) - olen  # global cumulative before each record
    user_first = np.searchsorted(ouser, np.arange(n_users))
    before = ucs - ucs[user_first[ouser]]  # tokens of the same user before this record
    kept = np.clip(cap - before, 0, olen)
    user_tokens = np.bincount(ouser, weights=olen, minlength=n_users).astype(np.int64)
    user_kept = np.bincount(ouser, weights=kept, minlength=n_users).astype(np.int64)
    if fraction is not None:  # a user is kept by a keyed hash of its own key
        chosen = np.flatnonzero([selection_hash(str(k).encode()) < fraction for k in uniq])
        counts["units_not_selected"] = int(n_users - chosen.size)
        new_id = np.full(n_users, -1, dtype=np.int64)
        new_id[chosen] = np.arange(chosen.size)
        sel = new_id[ouser] >= 0
        order, olen, kept = order[sel], olen[sel], kept[sel]
        ouser = new_id[ouser[sel]]
        user_tokens, user_kept = user_tokens[chosen], user_kept[chosen]
        n_users = int(chosen.size)
    gather = _ranges(corpus.offsets[order], corpus.offsets[order] + kept)  # user streams, concatenated
    stream_start = np.concatenate([[0], np.cumsum(user_kept)[:-1]])
    begin, end, owner = _rows_from_streams(stream_start, user_kept, L, R)
    counts.update({
        "num_users": int(n_users),
        "users_capped": int((user_tokens > cap).sum()),
        "records_dropped": int(((kept == 0) & (olen > 0)).sum()),
        "records_truncated": int(((kept > 0) & (kept < olen)).sum()),
        "tokens_truncated": int((user_tokens - user_kept).sum()),
        "records_used": int((kept > 0).sum()),
    })
    # Segments with document masking: the position of each token's record in the user's order.
    doc_rank_of_token = np.repeat(np.arange(order.size, dtype=np.int64), kept) \
        if spec.document_masking else None
    tokens = corpus.tokens[gather]
    target = corpus.target[gather]
    return _finish(tokens, target, doc_rank_of_token, begin, end, owner, spec.document_masking, counts)


def _user_key(u, user_field, i: int) -> str:
    if u is None or (isinstance(u, float) and np.isnan(u)) or (isinstance(u, str) and not u):
        raise ValueError(
            f"record {i} has no value for data.user_field={user_field!r}: every record needs a user "
            "key with data.unit='user' (drop or fill such records)"
        )
    return u if isinstance(u, str) else json.dumps(u, sort_keys=True, default=str)


def _position_within_group(group: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... within each group, in source order."""
    order = np.argsort(group, kind="stable")
    g = group[order]
    start = np.concatenate([[0], np.flatnonzero(np.diff(g)) + 1])
    run = np.repeat(start, np.diff(np.concatenate([start, [g.size]])))
    pos = np.empty(group.size, dtype=np.int64)
    pos[order] = np.arange(group.size) - run
    return pos


def _rank(user: str, position: int) -> int:
    h = hashlib.blake2b(f"llmdp.user_order.v1\0{user}\0{position}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")
