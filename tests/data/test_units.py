"""Privacy units (sequence / document / user) against plain-Python references.

Owns invariant `unit-is-a-unit` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmdp.data.store import open_store, write_store
from llmdp.data.units import EncodedCorpus, UnitSpec, _ranges, build_units, select_units

EOS = 1


def corpus(num_records=60, num_users=7, seed=0, max_len=40, long_user=None, long_docs=0):
    """Random records (ids ending with EOS, random target flags), each with a user key."""
    rng = np.random.default_rng(seed)
    recs, users = [], []
    for _ in range(num_records):
        n = int(rng.integers(0, max_len))
        ids = np.append(rng.integers(2, 60, n), EOS).astype(np.int32)
        tgt = rng.random(n + 1) < 0.8
        recs.append((ids, tgt))
        users.append(f"user-{int(rng.integers(num_users))}")
    for _ in range(long_docs):
        n = int(rng.integers(5, max_len))
        recs.append((np.append(rng.integers(2, 60, n), EOS).astype(np.int32), np.ones(n + 1, bool)))
        users.append(long_user)
    return EncodedCorpus.from_records(recs, users), recs, users


def rows_of(units, u):
    """[(tokens, target, segments)] of unit u, as Python lists."""
    out = []
    for r in range(units.row_start[u], units.row_start[u] + units.row_count[u]):
        s, e = units.row_offsets[r], units.row_offsets[r + 1]
        seg = None if units.segments is None else units.segments[s:e].tolist()
        out.append((units.tokens[s:e].tolist(), units.target[s:e].astype(bool).tolist(), seg))
    return out


def cut(stream, L, max_rows=None):
    """Reference: rows of L (last shorter), at most max_rows, rows < 2 tokens dropped."""
    rows = [stream[i:i + L] for i in range(0, len(stream), L)]
    if max_rows is not None:
        rows = rows[:max_rows]
    return [r for r in rows if len(r) >= 2]


def has_target(rows):
    return any(any(t for t in r[1:]) for r in rows)  # a row's first token is never a target


def segments_of(docs_of_tokens):
    first = docs_of_tokens[0]
    # relative document index within the row: rank of the document among those in the row
    return [d - first for d in docs_of_tokens]


def test_ranges():
    assert _ranges([3, 10, 0, 20], [5, 10, 2, 23]).tolist() == [3, 4, 0, 1, 20, 21, 22]
    assert _ranges([], []).tolist() == []


@pytest.mark.parametrize("masking", [False, True])
def test_sequence_units_pack_the_stream(masking):
    c, recs, _ = corpus()
    L = 16
    units = build_units(c, UnitSpec("sequence", L, document_masking=masking))
    stream = [(int(t), bool(g), d) for d, (ids, tgt) in enumerate(recs) for t, g in zip(ids, tgt)]
    ref = [r for r in cut(stream, L) if has_target([[x[1] for x in r]])]
    assert units.num_units == len(ref) and units.num_rows == len(ref)
    for u, r in enumerate(ref):
        (tokens, target, seg), = rows_of(units, u)
        assert tokens == [x[0] for x in r] and target == [x[1] for x in r]
        if masking:
            assert seg == segments_of([x[2] for x in r])
        else:
            assert seg is None
    assert units.unit_target_tokens().tolist() == [sum(x[1] for x in r[1:]) for r in ref]


def test_document_units_truncate_never_split():
    c, recs, _ = corpus(max_len=90)
    L, R = 16, 3
    units = build_units(c, UnitSpec("document", L, max_rows_per_unit=R))
    ref = []
    for ids, tgt in recs:
        rows = cut(list(zip(ids.tolist(), tgt.tolist())), L, R)
        if rows and has_target([[g for _, g in r] for r in rows]):
            ref.append(rows)
    assert any(len(ids) > R * L for ids, _ in recs), "the corpus must hold documents over the cap"
    assert units.num_units == len(ref)  # one unit per document, however long
    for u, rows in enumerate(ref):
        got = rows_of(units, u)
        assert len(got) == len(rows) <= R
        for (tokens, target, _), r in zip(got, rows):
            assert tokens == [t for t, _ in r] and target == [g for _, g in r]
    long = [len(ids) for ids, _ in recs if len(ids) > R * L]
    assert units.counts["records_truncated"] == len(long)
    assert units.counts["tokens_truncated"] == sum(n - R * L for n in long)


def user_reference(recs, users, L, R, masking):
    """Per user: records in the keyed order, packed, cut, capped."""
    from llmdp.data.units import _rank

    out = {}
    for user in sorted(set(users)):
        mine = [i for i, u in enumerate(users) if u == user]
        order = sorted(range(len(mine)), key=lambda p: _rank(user, p))
        stream = [(int(t), bool(g), k) for k, p in enumerate(order)
                  for t, g in zip(*recs[mine[p]])][: R * L]
        rows = cut(stream, L)
        if rows and has_target([[x[1] for x in r] for r in rows]):
            out[user] = [([x[0] for x in r], [x[1] for x in r],
                          segments_of([x[2] for x in r]) if masking else None) for r in rows]
    return out


@pytest.mark.parametrize("masking", [False, True])
def test_user_units_match_the_reference(masking):
    c, recs, users = corpus(num_records=80, num_users=5, long_user="prolific", long_docs=100)
    L, R = 16, 4
    units = build_units(c, UnitSpec("user", L, max_rows_per_unit=R, user_field="user_id",
                                    document_masking=masking))
    ref = user_reference(recs, users, L, R, masking)
    assert units.num_units == len(ref)
    for u, user in enumerate(sorted(ref)):  # units are in sorted user-key order
        assert rows_of(units, u) == ref[user]


def test_a_user_with_100_documents_contributes_at_most_max_rows():
    c, recs, users = corpus(num_records=50, num_users=4, long_user="prolific", long_docs=100)
    L, R = 16, 3
    units = build_units(c, UnitSpec("user", L, max_rows_per_unit=R, user_field="u"))
    assert units.row_count.max() <= R
    assert units.counts["users_capped"] >= 1
    n_users = len(set(users))
    assert units.num_units == n_users
    prolific = sorted(set(users)).index("prolific")
    assert units.row_count[prolific] == R
    assert units.counts["records_dropped"] > 50  # most of the 100 documents are left out


def test_user_selection_does_not_depend_on_other_users():
    c, recs, users = corpus(num_records=120, num_users=6, seed=3)
    spec = UnitSpec("user", 16, max_rows_per_unit=2, user_field="u")
    full = build_units(c, spec)
    # Remove every record of one user (an add/remove-one-user neighbour), and shuffle the rest.
    gone = "user-2"
    rng = np.random.default_rng(1)
    keep = [i for i, u in enumerate(users) if u != gone]
    keep = [keep[i] for i in rng.permutation(len(keep))]
    # Keep each user's own records in source order (their relative order is their data).
    keep = sorted(keep, key=lambda i: (users[i], i))
    c2 = EncodedCorpus.from_records([recs[i] for i in keep], [users[i] for i in keep])
    nb = build_units(c2, spec)
    names = sorted(set(users))
    names2 = sorted(set(users) - {gone})
    assert nb.num_units == full.num_units - 1
    for u2, name in enumerate(names2):
        assert rows_of(nb, u2) == rows_of(full, names.index(name))


def test_user_units_need_a_key_for_every_record():
    c, recs, users = corpus(num_records=5)
    users[3] = None
    bad = EncodedCorpus.from_records(recs, users)
    with pytest.raises(ValueError, match="record 3 has no value for data.user_field='user_id'"):
        build_units(bad, UnitSpec("user", 16, max_rows_per_unit=2, user_field="user_id"))


def _unit_set(units):
    return {repr(rows_of(units, u)) for u in range(units.num_units)}


@pytest.mark.parametrize("kind", ["document", "user"])
def test_unit_fraction_selection_of_a_unit_depends_on_that_unit_alone(kind):
    """Issue 12 item 8d: adding one unit to the corpus never changes whether another unit
    is selected (so add/remove-one relative to the corpus still holds). The old
    `max_units` cap kept the first units: one added in front evicted the last one."""
    spec = (UnitSpec("document", 16, max_rows_per_unit=2) if kind == "document"
            else UnitSpec("user", 16, max_rows_per_unit=2, user_field="u"))
    c, recs, users = corpus(num_records=80, num_users=40)
    rng = np.random.default_rng(5)
    base = build_units(c, spec, unit_fraction=0.5)
    full = build_units(c, spec)
    assert 0 < base.num_units < full.num_units  # it does select
    assert base.counts["units_not_selected"] == full.num_units - base.num_units
    assert _unit_set(base) <= _unit_set(full)
    flipped = 0
    for trial in range(12):  # one new unit, at a random position, many times
        n = int(rng.integers(3, 30))
        new = (np.append(rng.integers(2, 60, n), EOS).astype(np.int32), np.ones(n + 1, bool))
        at = int(rng.integers(0, len(recs) + 1))
        c2 = EncodedCorpus.from_records(recs[:at] + [new] + recs[at:],
                                        users[:at] + [f"new-{trial}"] + users[at:])
        bigger = build_units(c2, spec, unit_fraction=0.5)
        extra = _unit_set(bigger) - _unit_set(base)
        # every unit selected before is selected after; at most the new unit is added
        assert _unit_set(base) <= _unit_set(bigger)
        assert len(extra) <= 1 and bigger.num_units - base.num_units == len(extra)
        flipped += len(extra)
    assert 0 < flipped < 12  # the new unit itself is sometimes kept, sometimes not


def test_unit_fraction_sequence_rows_are_kept_by_their_content():
    c, _, _ = corpus(num_records=60)
    spec = UnitSpec("sequence", 16)
    full, half = build_units(c, spec), build_units(c, spec, unit_fraction=0.5)
    assert 0.3 * full.num_units < half.num_units < 0.7 * full.num_units
    assert _unit_set(half) <= _unit_set(full)
    assert half.counts["num_units"] == half.num_units
    assert build_units(c, spec, unit_fraction=1.0).num_units == full.num_units
    with pytest.raises(ValueError, match="data.unit_fraction"):
        build_units(c, spec, unit_fraction=0)


def test_units_without_targets_are_dropped():
    recs = [(np.array([5, 6, 7, EOS], np.int32), np.zeros(4, bool)),  # a prompt-only record
            (np.array([5, 6, 7, EOS], np.int32), np.array([0, 0, 1, 1], bool))]
    c = EncodedCorpus.from_records(recs)
    units = build_units(c, UnitSpec("document", 8, max_rows_per_unit=1))
    assert units.num_units == 1 and units.counts["units_without_target_dropped"] == 1
    assert units.unit_target_tokens().tolist() == [2]


def test_select_units_keeps_rows_together():
    c, _, _ = corpus(max_len=70)
    units = build_units(c, UnitSpec("document", 16, max_rows_per_unit=3))
    pick = np.array([4, 0, 7])
    sub = select_units(units, pick)
    assert [rows_of(sub, i) for i in range(3)] == [rows_of(units, u) for u in pick]


def test_spec_errors_name_the_fields():
    with pytest.raises(ValueError, match="data.unit='row'"):
        UnitSpec("row")
    with pytest.raises(ValueError, match="data.max_rows_per_unit=2 with data.unit='sequence'"):
        UnitSpec("sequence", 16, max_rows_per_unit=2)
    with pytest.raises(ValueError, match="data.unit='user' needs data.user_field"):
        UnitSpec("user", 16, max_rows_per_unit=2)
    with pytest.raises(ValueError, match="data.document_masking=true has no effect"):
        UnitSpec("document", 16, max_rows_per_unit=2, document_masking=True)
    assert "at most 4 rows of 16 tokens" in UnitSpec("document", 16, max_rows_per_unit=4).describe()
    assert "'user_id'" in UnitSpec("user", 16, max_rows_per_unit=2, user_field="user_id").describe()


# ----------------------------------------------------------------------------- the store


def stored(tmp_path, units, spec, name="s"):
    d = tmp_path / name
    write_store(d, units, {"fingerprint": name, "sequence_length": spec.sequence_length,
                           "pad_id": 0, "eos_id": EOS, "spec": spec.to_dict()})
    return open_store(d)


@pytest.mark.parametrize("kind", ["sequence", "document", "user"])
def test_store_rows_round_trip(tmp_path, kind, monkeypatch):
    import llmdp.data.store as store_mod

    monkeypatch.setattr(store_mod, "_BATCH_TOKENS", 64)  # many record batches
    c, _, _ = corpus(num_records=90, num_users=11, max_len=50)
    spec = UnitSpec(kind, 16, max_rows_per_unit=1 if kind == "sequence" else 3,
                    user_field="u" if kind == "user" else None, document_masking=kind == "user")
    units = build_units(c, spec)
    s = stored(tmp_path, units, spec)
    assert s.meta["rows_per_batch"] == 4 and s.num_units == units.num_units
    idx = np.array([units.num_units - 1, 0, 2, 2, units.num_units // 2])
    for width in (None, "auto", 16):
        b = s.rows(idx, width=width)
        expect_rows = [r for u in idx for r in rows_of(units, u)]
        W = b["input_ids"].shape[1]
        assert W == (16 if width in (None, 16) else min(16, -(-max(len(t) for t, _, _ in expect_rows) // 8) * 8))
        assert b["row_units"].tolist() == [i for i, u in enumerate(idx) for _ in range(units.row_count[u])]
        ntt = units.unit_target_tokens()
        assert b["num_target_tokens"].tolist() == [int(ntt[u]) for u in idx for _ in range(units.row_count[u])]
        for r, (tokens, target, seg) in enumerate(expect_rows):
            n = len(tokens)
            assert b["input_ids"][r, :n].tolist() == tokens
            assert b["attention_mask"][r].tolist() == [1] * n + [0] * (W - n)
            assert (b["input_ids"][r, n:] == 0).all()
            assert b["labels"][r].tolist() == [t if g else -100 for t, g in zip(tokens, target)] + [-100] * (W - n)
            if seg is not None:
                assert b["segment_ids"][r].tolist() == seg + [-1] * (W - n)
        assert ("segment_ids" in b) == (kind == "user")
    with pytest.raises(ValueError, match="width"):
        s.rows([0], width=1)
    with pytest.raises(IndexError):
        s.rows([units.num_units])
    empty = s.rows([], width="auto")
    assert empty["input_ids"].shape == (0, 8)


def test_store_reads_only_the_requested_rows(tmp_path):
    """The rows file is memory-mapped: opening maps it, reading touches only what is asked."""
    c, _, _ = corpus(num_records=200)
    spec = UnitSpec("sequence", 16)
    s = stored(tmp_path, build_units(c, spec), spec)
    import pickle

    clone = pickle.loads(pickle.dumps(s))  # ships as a path
    assert clone.path == s.path
    assert torch.equal(clone.rows([3, 1])["input_ids"], s.rows([3, 1])["input_ids"])
    values = s._batches[0]["input_ids"][1]
    assert not values.flags.owndata and not values.flags.writeable  # a view of the mapped file


# ----------------------------------------------------------------------------- gradients


def test_user_rows_are_clipped_as_one_unit(tmp_path):
    """A user's rows, through the store, are one unit: engine == torch.func reference (float64)."""
    from llmdp.base.losses import row_losses
    from llmdp.clipping import GhostClipper
    from llmdp.clipping.reference import clipped_sum, per_unit_gradients_func
    from tests.helpers import tiny_llama

    c, _, _ = corpus(num_records=40, num_users=5, long_user="prolific", long_docs=30, max_len=30)
    for masking in (False, True):
        spec = UnitSpec("user", 12, max_rows_per_unit=3, user_field="u", document_masking=masking)
        units = build_units(c, spec)
        s = stored(tmp_path, units, spec, name=f"m{masking}")
        idx = np.arange(s.num_units)
        batch = s.rows(idx, width="auto")
        assert (batch["row_units"].bincount() > 1).any(), "multi-row units must be exercised"
        model = tiny_llama(dtype=torch.float64, exact=True)
        C = 1e-2  # below every unit's norm: every unit is clipped
        clipper = GhostClipper(model, C)
        for p in clipper.params:
            p.grad = torch.zeros_like(p)
        norms = clipper.backward(row_losses(model, batch), batch["row_units"])
        clipper.remove_hooks()

        embeddings = model.get_input_embeddings()

        def one_row(call, row, embeddings=embeddings):
            class M:
                def __call__(self, **kw):
                    return call(**kw)

                def get_input_embeddings(self):
                    return embeddings

            return row_losses(M(), row)[0]

        ref = per_unit_gradients_func(model, one_row, batch, batch["row_units"])
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        sums, ref_norms = clipped_sum([ref[n] for n in names], C)
        assert len(ref_norms) == s.num_units
        assert (ref_norms > C).all()
        torch.testing.assert_close(norms, ref_norms, rtol=1e-9, atol=0)
        for n, p, r in zip(names, clipper.params, sums):
            torch.testing.assert_close(p.grad, r, rtol=1e-8, atol=1e-14, msg=n)


def test_document_masking_makes_packed_documents_independent():
    """With segment ids, a packed row's logits equal each document run alone (float64),
    position ids restarting at 0 per document; without them, later documents see earlier ones."""
    from llmdp.base.losses import segment_attention
    from tests.helpers import tiny_llama

    model = tiny_llama(dtype=torch.float64, exact=True).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 60, (n,), generator=g) for n in (5, 1, 7)]
    row = torch.cat(docs + [torch.zeros(3, dtype=torch.long)])[None]  # 3 padding tokens
    seg = torch.tensor([[0] * 5 + [1] + [2] * 7 + [-1] * 3])
    mask, pos = segment_attention(seg, torch.float64)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    with torch.no_grad():
        packed = model(input_ids=row, attention_mask=mask, position_ids=pos).logits[0]
        plain = model(input_ids=row).logits[0]
        start = 0
        for d in docs:
            alone = model(input_ids=d[None]).logits[0]
            torch.testing.assert_close(packed[start:start + len(d)], alone, rtol=1e-10, atol=1e-12)
            start += len(d)
    assert (plain[5:13] - packed[5:13]).abs().max() > 1e-3  # masking changed something
