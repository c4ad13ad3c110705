import collections
import datetime as dt
import json
import os
import re

import pytest

from llmdp.data.synthetic import (
    CONDITIONS,
    MEDICATIONS,
    ensure_clinical_notes,
    generate_clinical_notes,
    write_jsonl,
)

FIELDS = {"doc_id", "user_id", "author", "date", "text"}


@pytest.fixture(scope="module")
def notes():
    return generate_clinical_notes(5000, seed=0)


def test_5000_documents_with_all_fields(notes):
    assert len(notes) == 5000
    for rec in notes:
        assert set(rec) == FIELDS
        assert all(isinstance(rec[k], str) and rec[k] for k in FIELDS)
        dt.date.fromisoformat(rec["date"])
    assert len({r["doc_id"] for r in notes}) == 5000


def test_deterministic_per_seed():
    a = generate_clinical_notes(200, seed=7)
    assert a == generate_clinical_notes(200, seed=7)
    b = generate_clinical_notes(200, seed=8)
    assert [r["text"] for r in a] != [r["text"] for r in b]
    assert generate_clinical_notes(0, seed=0) == []


def test_users_are_varied_and_skewed(notes):
    per_user = collections.Counter(r["user_id"] for r in notes)
    mean = len(notes) / len(per_user)
    assert 5 <= mean <= 10, mean
    heavy = [u for u, c in per_user.items() if c >= 50]
    assert len(heavy) >= 2, per_user.most_common(5)
    singles = sum(1 for c in per_user.values() if c <= 2)
    assert singles >= len(per_user) // 10  # a long tail of light users too
    median = sorted(per_user.values())[len(per_user) // 2]
    assert median < mean  # skewed: the mean is pulled up by heavy users


def test_text_is_realistic(notes):
    date_re = re.compile(r"\b(\d{4}-\d{2}-\d{2}|\d{2}/\d{2}/\d{4}|[A-Z][a-z]+ \d{1,2}, \d{4})\b")
    name_re = re.compile(r"(Patient: [A-Z][\w'-]+, [A-Z][\w'-]+|Name: [A-Z][\w'-]+ [A-Z][\w'-]+)")
    conditions = [c.lower() for c in CONDITIONS]
    drugs = [d for d, _, _ in MEDICATIONS]
    lengths = []
    for rec in notes[:500]:
        text = rec["text"]
        lengths.append(len(text))
        assert name_re.search(text), text
        assert date_re.search(text), text
        assert "MRN: " in text
        low = text.lower()
        assert any(c in low for c in conditions), text
        assert "Assessment and plan:" in text
        assert rec["author"] in text
    assert 250 <= min(lengths) and max(lengths) <= 2000
    assert sum(lengths) / len(lengths) > 500
    # Medication lines with doses appear across the corpus.
    assert sum(any(d in r["text"] for d in drugs) for r in notes[:200]) > 150


def test_same_patient_same_identifiers(notes):
    mrn_re = re.compile(r"MRN: (\d+)")
    by_user = collections.defaultdict(set)
    for rec in notes[:1000]:
        by_user[rec["user_id"]].add(mrn_re.search(rec["text"]).group(1))
    assert all(len(m) == 1 for m in by_user.values())
    assert len({next(iter(m)) for m in by_user.values()}) == len(by_user)


def test_write_and_ensure(tmp_path):
    recs = generate_clinical_notes(30, seed=1)
    path = write_jsonl(recs, tmp_path / "a" / "notes.jsonl")
    with open(path) as f:
        assert [json.loads(line) for line in f] == recs
    target = tmp_path / "b" / "notes.jsonl"
    out = ensure_clinical_notes(target, 30, 1)
    assert out == str(target) and os.path.exists(out)
    with open(out) as f:
        assert [json.loads(line) for line in f] == recs
    before = os.stat(out).st_mtime_ns
    ensure_clinical_notes(target, 30, 1)  # exists: not regenerated
    assert os.stat(out).st_mtime_ns == before
    assert [p for p in os.listdir(tmp_path / "b") if p.startswith(".tmp")] == []


def test_the_notes_do_not_move_with_the_calendar(monkeypatch):
    """Faker's date_of_birth counts ages from the machine's current date: after a midnight
    the demo's notes, hence N and σ in the README, changed (14,251 → 14,209 units on a
    fresh clone the next day). The dates of birth now count from a fixed reference date."""
    import datetime as dt

    import faker.providers.date_time as fdt

    from llmdp.data.synthetic import generate_clinical_notes

    today = generate_clinical_notes(300, seed=0)

    class Later(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2031, 3, 1, 12, tzinfo=tz)

    monkeypatch.setattr(fdt, "datetime", Later)
    assert fdt.datetime.now().year == 2031  # the patch is what faker reads
    assert generate_clinical_notes(300, seed=0) == today
