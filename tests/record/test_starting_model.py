"""A run that starts from a model llmdp wrote (issue 32 item 2, ``llmdp.record.provenance``):
the report and the card name the starting model and what it was trained on; a DP
checkpoint trained on the same private data is composed into the guarantee (ε equals
dp-accounting on both runs' events, at δ less both runs' noise tails); a NON-PRIVATE
baseline under a DP run is refused; a folder without provenance is an external checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import dp_accounting
import pytest

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.privacy.accounting.events import event_from_json
from llmdp.privacy.accounting.prior import composed_epsilon
from llmdp.privacy.noise.tail import noise_tail
from llmdp.record.provenance import EXTERNAL, PROVENANCE
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.helpers import use_noise_cap
from tests.run.test_public_data import public_recipe
from tests.train.test_loop import make_recipe, prepared_config


def _raw(tmp_path, name, start=None, **privacy):
    raw = to_dict(make_recipe(tmp_path))
    raw["privacy"]["ledger"] = str(tmp_path / "ledgers.sqlite")
    raw["privacy"].update(privacy)
    raw["output"]["name"] = name
    if start is not None:
        raw["model"] = {"init": "pretrained", "name_or_path": str(start)}
    return raw


def _train(cfg, tmp_path):
    from llmdp.report.build import write_report

    spec = prepared_config(cfg)
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / f"ckpt-{spec.run_id}")))
    return spec, write_report(spec.run_dir)


def _reference_epsilon(records, delta) -> float:
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for r in records:
        acc.compose(event_from_json(r["event"]), int(r["count"]))
    return acc.get_epsilon(delta)


def _ledger(run_dir):
    with open(os.path.join(run_dir, "ledger.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "release"]


def test_a_dp_checkpoint_on_the_same_data_is_composed_into_the_guarantee(tmp_path, monkeypatch):
    use_noise_cap(monkeypatch, 53)  # tails large enough to show in δ: both runs' must count
    first, rep1 = _train(recipe_from_dict(_raw(tmp_path, "first")), tmp_path)
    prov = json.load(open(os.path.join(first.run_dir, "model", PROVENANCE), encoding="utf-8"))
    assert prov["run_id"] == first.run_id and prov["dp"] and prov["declared_public"] is None
    second, rep = _train(recipe_from_dict(_raw(tmp_path, "second", first.run_dir + "/model")), tmp_path)

    start = rep["starting_model"]
    assert start["kind"] == "dp" and start["composed"] and start["run_id"] == first.run_id
    assert start["epsilon_alone"] == pytest.approx(rep1["epsilon"], rel=1e-9)
    both = _ledger(first.run_dir) + _ledger(second.run_dir)
    assert sum(r["count"] for r in both) == 12
    k, sigma, delta = second.plan.noise_coordinates, second.plan.noise_multiplier, second.plan.delta
    acc_delta = noise_tail([("a", 6, k, sigma), ("b", 6, k, sigma)]).accountant_delta(delta)
    alone_delta = noise_tail([("b", 6, k, sigma)]).accountant_delta(delta)
    assert acc_delta < alone_delta  # the starting run's tails are folded in too
    assert rep["delta_accountant"] == pytest.approx(acc_delta, rel=1e-12)
    assert rep["epsilon"] == pytest.approx(_reference_epsilon(both, acc_delta), rel=1e-9)
    assert rep["epsilon_training_only"] == pytest.approx(
        _reference_epsilon(_ledger(second.run_dir), acc_delta), rel=1e-9)
    assert rep["epsilon"] > rep["epsilon_training_only"] * 1.2  # both counted, not one
    assert any(f"llmdp run {first.run_id}" in x and "composed" in x for x in rep["data_accesses_covered"])
    assert "across both trainings" in rep["guarantee_scope"]
    assert {r["run_id"] for r in rep["ledger"]["releases"]} == {first.run_id, second.run_id}

    # With a target, σ is raised so that both runs together meet it (not this run alone).
    target = round(rep1["epsilon"] * 2, 1)
    third = prepared_config(recipe_from_dict(_raw(
        tmp_path, "third", first.run_dir + "/model", noise_multiplier=None, target_epsilon=target)))
    alone = prepared_config(recipe_from_dict(_raw(
        tmp_path, "alone", noise_multiplier=None, target_epsilon=target)))
    assert third.plan.prior_noise and not alone.plan.prior_noise
    assert third.plan.noise_multiplier > alone.plan.noise_multiplier
    assert target * (1 - 2e-3) <= third.epsilon_planned <= target
    # at the σ this run would have alone, both runs together would exceed the target
    at_alone = dataclasses.replace(third.plan, noise_multiplier=alone.plan.noise_multiplier)
    assert composed_epsilon(at_alone, third.prior_releases) > target * (1 + 1e-3)


def test_a_public_start_is_named_and_the_guarantee_covers_only_the_fine_tuning(tmp_path):
    from llmdp.hub.export import export_run

    pub_data = tmp_path / "public" / "notes.jsonl"
    pub_data.parent.mkdir()
    shutil.copy(make_recipe(tmp_path).data.path, pub_data)
    pub_data.write_text(pub_data.read_text(encoding="utf-8").replace("a", "o"), encoding="utf-8")
    pub, _ = _train(public_recipe(tmp_path, data_path=pub_data), tmp_path)
    prov = json.load(open(os.path.join(pub.run_dir, "model", PROVENANCE), encoding="utf-8"))
    assert prov["declared_public"].startswith("DECLARED PUBLIC DATA") and not prov["dp"]

    dp, rep = _train(recipe_from_dict(_raw(tmp_path, "dp", pub.run_dir + "/model")), tmp_path)
    start = rep["starting_model"]
    assert start["kind"] == "public" and not start["composed"] and start["run_id"] == pub.run_id
    assert "declared public" in start["description"] and "<local>/notes.jsonl" in start["description"]
    assert "covers only this run's fine-tuning data" in rep["guarantee_scope"]
    assert rep["epsilon"] == pytest.approx(_reference_epsilon(_ledger(dp.run_dir), rep["delta_accountant"]),
                                           rel=1e-9)
    md = open(os.path.join(dp.run_dir, "privacy_report.md"), encoding="utf-8").read()
    assert f"**Scope:** Starting model: <local>/model (llmdp run {pub.run_id}" in md

    out = tmp_path / "export"
    export_run(dp.run_dir, out, log=lambda *a: None, allow_unverified=True)  # no Ray checkpoints here
    card = (out / "README.md").read_text(encoding="utf-8")
    assert f"| Starting model | Starting model: <local>/model (llmdp run {pub.run_id} on data its " \
           f"recipe declared public" in card
    # issue 51 item 4: the card's first sentence names that start too, not random weights
    assert f"full weights, fine-tuned from `<local>/model` (llmdp run {pub.run_id})." in card
    assert "randomly initialized" not in card
    exported = json.load(open(out / PROVENANCE, encoding="utf-8"))
    assert exported["run_id"] == dp.run_id and exported["starting_model"]["run_id"] == pub.run_id
    # the chain travels with the export, without ledger locations or dataset ids (DESIGN, invariant `only-dp-outputs-leave`)
    assert [(a["run_id"], a["kind"]) for a in exported["ancestry"]] == [(pub.run_id, "public")]
    text = json.dumps(exported)
    assert '"dataset_id"' not in text and '"ledger_location"' not in text and exported["releases"]
    for path in out.iterdir():
        if path.suffix in (".json", ".md"):
            assert str(tmp_path) not in path.read_text(encoding="utf-8"), path
    # A run from the DP export (no ledger location in it): found by its run id in this data's
    # ledger, so composed.
    again = prepared_config(recipe_from_dict(_raw(tmp_path, "again", out)))
    assert again.starting_model["composed"] and again.starting_model["run_id"] == dp.run_id
    assert [(a["run_id"], a["kind"]) for a in again.starting_model["ancestry"]] == [
        (dp.run_id, "dp"), (pub.run_id, "public")]
    assert f"it descends from llmdp run {pub.run_id} (on data its recipe declared public" in \
        again.starting_model["description"]


def test_a_baseline_start_is_refused_under_dp_and_a_bare_folder_is_external(tmp_path):
    raw = _raw(tmp_path, "base")
    raw["privacy"] = {"dp": False}
    base, rep = _train(recipe_from_dict(raw), tmp_path)
    with pytest.raises(ConfigError) as e:
        prepared_config(recipe_from_dict(_raw(tmp_path, "dp", base.run_dir + "/model")))
    msg = str(e.value)
    assert msg.startswith(f"model.name_or_path: {base.run_dir}/model is the model of llmdp run "
                          f"{base.run_id}, a NON-PRIVATE baseline")
    assert "Start from a DP run's model" in msg
    assert not os.path.exists(os.path.join(tmp_path, "runs", "dp"))  # refused before anything

    bare = tmp_path / "bare"
    shutil.copytree(os.path.join(base.run_dir, "model"), bare)
    os.remove(bare / PROVENANCE)
    spec = prepared_config(recipe_from_dict(_raw(tmp_path, "ext", bare)))
    assert spec.starting_model["kind"] == "external" and spec.starting_model["description"] == EXTERNAL
    assert not spec.prior_releases
    info = json.load(open(os.path.join(spec.run_dir, "plan.json"), encoding="utf-8"))
    assert info["starting_model"]["description"] == EXTERNAL


def _public_data(tmp_path):
    pub_data = tmp_path / "public" / "notes.jsonl"
    pub_data.parent.mkdir()
    shutil.copy(make_recipe(tmp_path).data.path, pub_data)
    pub_data.write_text(pub_data.read_text(encoding="utf-8").replace("a", "o"), encoding="utf-8")
    return pub_data


def test_a_non_private_ancestor_taints_every_descendant_through_a_public_hop(tmp_path):
    """Issue 49 item 2: baseline on private X -> declared-public run from its model -> DP run
    on X from that: the DP launch is refused and the public run's export too, as the
    baseline's own; the public run's report names the baseline."""
    from llmdp.hub.export import ExportError, export_run

    raw = _raw(tmp_path, "base")
    raw["privacy"] = {"dp": False}
    base, _ = _train(recipe_from_dict(raw), tmp_path)
    pub_raw = to_dict(public_recipe(tmp_path, data_path=_public_data(tmp_path)))
    pub_raw["model"] = {"init": "pretrained", "name_or_path": base.run_dir + "/model"}
    pub, pub_rep = _train(recipe_from_dict(pub_raw), tmp_path)  # a public run may start from it
    assert base.run_id in pub_rep["starting_model"]["description"]
    assert "NON-PRIVATE" in pub_rep["starting_model"]["description"]
    prov = json.load(open(os.path.join(pub.run_dir, "model", PROVENANCE), encoding="utf-8"))
    assert [(a["run_id"], a["kind"]) for a in prov["ancestry"]] == [(base.run_id, "non-private")]

    with pytest.raises(ConfigError) as e:
        prepared_config(recipe_from_dict(_raw(tmp_path, "dp", pub.run_dir + "/model")))
    msg = str(e.value)
    assert msg.startswith(f"model.name_or_path: {pub.run_dir}/model descends from llmdp run "
                          f"{base.run_id}, a NON-PRIVATE baseline")
    assert "Start from a DP run's model" in msg
    assert not os.path.exists(os.path.join(tmp_path, "runs", "dp"))  # refused before anything

    with pytest.raises(ExportError) as e:
        export_run(pub.run_dir, tmp_path / "export", log=lambda *a: None, allow_unverified=True)
    assert f"descends from llmdp run {base.run_id}, a NON-PRIVATE baseline" in str(e.value)
    assert not os.path.exists(tmp_path / "export")


def test_a_dp_export_under_another_ledger_database_needs_the_start_data_declaration(tmp_path, monkeypatch):
    """Issue 49 item 7: an exported DP model (no dataset id) under a ledger database that has
    no record of its run cannot be matched with this run's data: refused until
    model.start_data says; `same` composes the releases its provenance records."""
    from llmdp.hub.export import export_run
    from llmdp.privacy.ledger.location import resolve_location

    use_noise_cap(monkeypatch, 53)
    first, rep1 = _train(recipe_from_dict(_raw(tmp_path, "first")), tmp_path)
    out = tmp_path / "export"
    export_run(first.run_dir, out, log=lambda *a: None, allow_unverified=True)  # no Ray checkpoints
    elsewhere = tmp_path / "elsewhere.sqlite"
    # as on another machine: the user's registry of ledger databases does not list the first
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "another-machine"))
    raw = _raw(tmp_path, "second", out)
    raw["privacy"]["ledger"] = str(elsewhere)
    with pytest.raises(ConfigError) as e:
        prepared_config(recipe_from_dict(raw))
    msg = str(e.value)
    assert msg.startswith("model.start_data: not set") and first.run_id in msg
    assert "model.start_data: same" in msg and "model.start_data: independent" in msg
    assert not os.path.exists(resolve_location(str(elsewhere)))  # nothing spent, no ledger
    assert not os.path.exists(os.path.join(tmp_path, "runs", "second"))

    raw["model"]["start_data"] = "same"
    second, rep = _train(recipe_from_dict(raw), tmp_path)
    start = rep["starting_model"]
    assert start["composed"] and start["run_id"] == first.run_id
    assert "model.start_data: same" in start["description"]
    assert start["epsilon_alone"] == pytest.approx(rep1["epsilon"], rel=1e-9)
    both = _ledger(first.run_dir) + _ledger(second.run_dir)
    k, sigma, delta = second.plan.noise_coordinates, second.plan.noise_multiplier, second.plan.delta
    acc_delta = noise_tail([("a", 6, k, sigma), ("b", 6, k, sigma)]).accountant_delta(delta)
    assert rep["delta_accountant"] == pytest.approx(acc_delta, rel=1e-12)
    assert rep["epsilon"] == pytest.approx(_reference_epsilon(both, acc_delta), rel=1e-9)
    assert rep["epsilon"] > rep["epsilon_training_only"] * 1.2
    # the declared releases are in this database's dataset ledger too (its budget and every
    # later run count them), once, however often a run from the start is prepared
    from llmdp.privacy.ledger.database import LedgerDB

    def releases_here():
        db = LedgerDB(resolve_location(str(elsewhere)))
        try:
            (ledger,) = db.ledgers()
            return [r for r in db.records(ledger) if r.get("kind") == "release"]
        finally:
            db.close()

    copied = [r for r in releases_here() if r["run_id"] == first.run_id]
    assert sum(r["count"] for r in copied) == sum(r["count"] for r in _ledger(first.run_dir)) == 6
    assert {r["event"] == _ledger(first.run_dir)[0]["event"] for r in copied} == {True}
    raw["output"]["name"] = "again"
    prepared_config(recipe_from_dict(raw))
    assert len([r for r in releases_here() if r["run_id"] == first.run_id]) == len(copied)

    # once recorded, the ledger knows the start's data: a contrary declaration is refused
    raw["model"]["start_data"] = "independent"
    raw["output"]["name"] = "third"
    with pytest.raises(ConfigError, match="the ledger shows that llmdp run"):
        prepared_config(recipe_from_dict(raw))


def test_a_start_declared_independent_is_named_as_declared(tmp_path, monkeypatch):
    """Issue 49 item 7: model.start_data: independent composes nothing and says who said so."""
    from llmdp.hub.export import export_run

    first, _ = _train(recipe_from_dict(_raw(tmp_path, "first")), tmp_path)
    out = tmp_path / "export"
    export_run(first.run_dir, out, log=lambda *a: None, allow_unverified=True)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "another-machine"))
    raw = _raw(tmp_path, "third", out)
    raw["privacy"]["ledger"] = str(tmp_path / "elsewhere.sqlite")
    raw["model"]["start_data"] = "independent"
    third = prepared_config(recipe_from_dict(raw))
    assert not third.starting_model["composed"] and not third.prior_releases
    assert "declared by the recipe (model.start_data: independent)" in third.starting_model["description"]


def test_a_starting_models_plan_is_derived_again_before_it_is_composed(tmp_path):
    """Issue 49: plan.json's read-back check holds for the plan a starting model's
    provenance carries too: a σ halved under its target (which would shrink the composed
    noise tails and hide the start's real ε) is refused before anything is spent."""
    first, rep1 = _train(recipe_from_dict(_raw(
        tmp_path, "first", noise_multiplier=None, target_epsilon=2.0)), tmp_path)
    path = os.path.join(first.run_dir, "model", PROVENANCE)
    prov = json.load(open(path, encoding="utf-8"))
    prov["plan"]["noise_multiplier"] /= 2
    with open(path, "w", encoding="utf-8") as f:
        json.dump(prov, f)
    with pytest.raises(Exception, match="edited or damaged") as e:
        prepared_config(recipe_from_dict(_raw(tmp_path, "second", first.run_dir + "/model")))
    assert f"starting run {first.run_id}" in str(e.value) and "noise_multiplier" in str(e.value)
    assert not os.path.exists(os.path.join(str(tmp_path), "runs", "second"))
