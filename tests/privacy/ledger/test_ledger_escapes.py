"""A dataset's ledger cannot be escaped by a new name or another database (issue 49 items 3,
4, 5; DESIGN, invariant `ledger-not-bypassed`): a new ``data.dataset_id`` on data whose content matches a ledger with a
budget or releases is refused unless ``data.distinct_from`` says (recorded) that it is other
data; a run in another ledger database (``privacy.ledger``, ``LLMDP_HOME``) is checked
against every database the user's runs used (`llmdp.privacy.ledger.registry`); a public
declaration (``data.public``, ``data.eval.public``) is refused on data any of them records.
Every test goes through the launch's preparation (`llmdp.run.launch.prepare`).

Owns invariant `ledger-not-bypassed` (docs/DESIGN.md §3): its tests are here."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.location import resolve_location
from tests.helpers import simulate_steps, write_notes
from tests.train.test_loop import make_recipe, prepared_config


def recipe(tmp_path, *, ledger="db.sqlite", name="t", data=None, privacy=None, **data_fields):
    raw = to_dict(make_recipe(tmp_path))
    if ledger is not None:
        raw["privacy"]["ledger"] = str(tmp_path / ledger)
    raw["privacy"].update(privacy or {})
    raw["data"].update(data_fields)
    if data is not None:
        raw["data"]["path"] = str(data)
    raw["output"]["name"] = name
    return recipe_from_dict(raw)


def public(tmp_path, **kw):
    return recipe(tmp_path, privacy={"dp": False}, public=True, **kw)


def records(location) -> dict[str, list[dict]]:
    if not os.path.exists(location):
        return {}
    db = LedgerDB(resolve_location(str(location)), read_only=True)
    try:
        return {ledger: db.records(ledger) for ledger in db.ledgers()}
    finally:
        db.close()


def spent_run(tmp_path, **kw):
    """A budgeted DP run with two steps released; its dataset id."""
    spec = prepared_config(recipe(tmp_path, privacy={"budget_epsilon": 50.0}, **kw))
    simulate_steps(spec, 2)
    return spec, spec.ledger.service["dataset_id"]


# ------------------------------------------------------------------ item 3: a new name


def test_a_new_dataset_id_on_budgeted_data_is_refused_unless_declared_distinct(tmp_path):
    from llmdp.report.build import write_report

    first, old = spent_run(tmp_path)
    before = records(tmp_path / "db.sqlite")
    with pytest.raises(ConfigError) as e:
        prepared_config(recipe(tmp_path, name="v2", dataset_id="clinical-notes-v2",
                               privacy={"budget_epsilon": 50.0}))
    msg = str(e.value)
    assert msg.startswith("data.dataset_id: 'clinical-notes-v2' is a new dataset ledger, but")
    assert f"{old!r}" in msg and "the same content hash" in msg and "a budget" in msg
    assert f"data.dataset_id: {old}" in msg and f"data.distinct_from: [{old}]" in msg
    assert "data.distinct_reason" in msg and "Traceback" not in msg
    assert records(tmp_path / "db.sqlite") == before  # refused before anything was written
    assert not (tmp_path / "runs" / "v2").exists()

    with pytest.raises(ConfigError, match="data.distinct_from needs data.distinct_reason"):
        recipe(tmp_path, dataset_id="clinical-notes-v2", distinct_from=[old])
    spec = prepared_config(recipe(
        tmp_path, name="v2", dataset_id="clinical-notes-v2", distinct_from=[old],
        distinct_reason="the 2026 intake: other patients, the same template"))
    (ds,) = [r for r in records(tmp_path / "db.sqlite")["clinical-notes-v2"] if r["kind"] == "dataset"]
    assert ds["distinct_from"] == [old]
    assert ds["distinct_reason"] == "the 2026 intake: other patients, the same template"
    simulate_steps(spec, 1)
    rep = write_report(spec.run_dir)
    assert rep["dataset_ledger"]["distinct_from"] == {
        "ledgers": [old], "reason": "the 2026 intake: other patients, the same template"}
    md = open(os.path.join(spec.run_dir, "privacy_report.md"), encoding="utf-8").read()
    assert f"declared distinct from {old}" in md
    from llmdp.record.publish import publishable_report

    assert "distinct_from" not in json.dumps(publishable_report(rep))  # internal only


def test_a_new_dataset_id_on_data_with_an_empty_ledger_still_only_warns(tmp_path):
    prepared_config(recipe(tmp_path))  # a ledger with its dataset record only: nothing spent
    lines = []
    from llmdp.run.launch import prepare

    prepare(recipe(tmp_path, name="v2", dataset_id="copy-of-notes"), log=lines.append)
    assert any(x.startswith("warning: starting a new ledger") for x in lines)


def test_another_ledger_database_is_no_escape(tmp_path, monkeypatch):
    _, old = spent_run(tmp_path, ledger="a.sqlite")
    with pytest.raises(ConfigError) as e:
        prepared_config(recipe(tmp_path, ledger="b.sqlite", name="b"))
    msg = str(e.value)
    assert str(tmp_path / "a.sqlite") in msg and f"{old!r}" in msg
    assert f"privacy.ledger: {tmp_path / 'a.sqlite'}" in msg
    assert records(tmp_path / "b.sqlite") == {}
    # ... nor another name in another database
    with pytest.raises(ConfigError, match=rf"{old!r}"):
        prepared_config(recipe(tmp_path, ledger="b.sqlite", name="b", dataset_id="fresh"))
    assert records(tmp_path / "b.sqlite") == {}

    # ... nor another LLMDP_HOME (the default database)
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home1"))
    copy = tmp_path / "other" / "notes.jsonl"
    write_notes(copy, 30, seed=3)
    spec = prepared_config(recipe(tmp_path, ledger=None, data=copy, name="h1"))
    simulate_steps(spec, 2)
    monkeypatch.setenv("LLMDP_HOME", str(tmp_path / "home2"))
    with pytest.raises(ConfigError) as e:
        prepared_config(recipe(tmp_path, ledger=None, data=copy, name="h2"))
    assert str(tmp_path / "home1" / "ledger.sqlite") in str(e.value)
    assert not os.path.exists(tmp_path / "home2" / "ledger.sqlite")


# ------------------------------------------------------------------ item 5: data.public


def test_a_budget_alone_marks_data_private(tmp_path, capsys):
    from llmdp.cli import main

    notes = write_notes(tmp_path / "notes.jsonl", 30)
    ds = "path:" + os.path.realpath(notes)
    assert main(["privacy", "ledger", "set-budget", "--dataset", ds, "--ledger",
                 str(tmp_path / "db.sqlite"), "--epsilon", "1", "--delta", "1e-5",
                 "--unit", "document", "--create"]) == 0
    with pytest.raises(ConfigError) as e:
        prepared_config(public(tmp_path))
    msg = str(e.value)
    assert msg.startswith("data.public: true, but ") and f"{ds!r} (a budget" in msg
    assert str(tmp_path / "db.sqlite") in msg and "data.public_override_ledger: true" in msg


def test_releases_in_a_database_the_public_recipe_does_not_name_refuse_it(tmp_path):
    _, old = spent_run(tmp_path, ledger="a.sqlite")
    before = records(tmp_path / "a.sqlite")
    copy = tmp_path / "copy" / "public.jsonl"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "notes.jsonl", copy)
    for kw in ({"ledger": "b.sqlite"}, {"ledger": None}, {"ledger": "b.sqlite", "data": copy}):
        with pytest.raises(ConfigError) as e:
            prepared_config(public(tmp_path, name="pub", **kw))
        assert f"{old!r} (1 DP release(s)" in str(e.value)
        assert str(tmp_path / "a.sqlite") in str(e.value)
    assert records(tmp_path / "a.sqlite") == before and records(tmp_path / "b.sqlite") == {}


# ------------------------------------------------------------------ item 4: data.eval.public


def test_the_training_data_declared_a_public_eval_source_is_refused(tmp_path):
    notes = tmp_path / "notes.jsonl"
    copy = tmp_path / "copy" / "eval.jsonl"
    write_notes(notes, 30)
    copy.parent.mkdir()
    shutil.copy(notes, copy)
    for src, why in ((notes, "is the training data"), (copy, "the same content"),
                     (tmp_path, "overlaps the training data")):
        with pytest.raises(ConfigError) as e:
            prepared_config(recipe(tmp_path, eval={"path": str(src), "public": True}))
        msg = str(e.value)
        assert msg.startswith(f"data.eval.public: true, but data.eval.path {src}") and why in msg
        assert "data.eval.public: false" in msg
    assert records(tmp_path / "db.sqlite") == {}  # refused before the training ledger was opened


def test_a_public_eval_source_with_a_ledger_anywhere_is_refused(tmp_path):
    other = write_notes(tmp_path / "other" / "notes.jsonl", 30, seed=4)
    _, old = spent_run(tmp_path, ledger="a.sqlite", data=other, name="o")
    with pytest.raises(ConfigError) as e:
        prepared_config(recipe(tmp_path, ledger="b.sqlite",
                               eval={"path": str(other), "public": True}))
    msg = str(e.value)
    assert f"{old!r} (1 DP release(s)" in msg and str(tmp_path / "a.sqlite") in msg
    assert "data.eval.public: false" in msg
    assert records(tmp_path / "b.sqlite") == {}
    fine = write_notes(tmp_path / "pub" / "eval.jsonl", 12, seed=9)
    prepared_config(recipe(tmp_path, ledger="b.sqlite", eval={"path": fine, "public": True}))
