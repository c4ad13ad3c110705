"""Data a recipe declares public (issue 32 item 1): ``data.public: true`` (with
``privacy.dp: false``) trains without DP, opens no dataset ledger, spends nothing and says
first, in its plan, report and card, that the data was declared public; a source llmdp has
treated as private (DP releases in a dataset ledger: its own, or one with the same content)
refuses the declaration unless ``data.public_override_ledger``, which notes it there."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from llmdp.config.schema import ConfigError, recipe_from_dict, to_dict
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.location import resolve_location
from llmdp.train.loop import LocalContext, train_loop_per_worker
from tests.helpers import simulate_steps
from tests.train.test_loop import make_recipe, prepared_config


def public_recipe(tmp_path, name="pub", data_path=None, **data):
    raw = to_dict(make_recipe(tmp_path))
    raw["privacy"] = {"dp": False, "ledger": str(tmp_path / "ledgers.sqlite")}
    raw["data"].update({"public": True, **data})
    if data_path is not None:
        raw["data"]["path"] = str(data_path)
    raw["output"]["name"] = name
    return recipe_from_dict(raw)


def dp_recipe(tmp_path, name="dp"):
    raw = to_dict(make_recipe(tmp_path))
    raw["privacy"]["ledger"] = str(tmp_path / "ledgers.sqlite")
    raw["output"]["name"] = name
    return recipe_from_dict(raw)


def records(location) -> dict[str, list[dict]]:
    db = LedgerDB(resolve_location(str(location)))
    try:
        return {ledger: db.records(ledger) for ledger in db.ledgers()}
    finally:
        db.close()


def test_public_needs_dp_false_too_and_the_override_needs_public(tmp_path):
    raw = to_dict(make_recipe(tmp_path))
    raw["data"]["public"] = True
    with pytest.raises(ConfigError, match=r"data.public: true .* set privacy.dp: false as well"):
        recipe_from_dict(raw)
    raw = to_dict(make_recipe(tmp_path))
    raw["data"]["public_override_ledger"] = True
    with pytest.raises(ConfigError, match=r"data.public_override_ledger: true is only for a source "
                                          r"declared public"):
        recipe_from_dict(raw)
    cfg = public_recipe(tmp_path)
    assert cfg.data.public and not cfg.privacy.dp
    assert recipe_from_dict(to_dict(cfg)) == cfg  # the declaration round-trips


def test_a_public_run_records_nothing_and_says_first_that_the_data_was_declared_public(tmp_path):
    from llmdp.report.build import write_report

    cfg = public_recipe(tmp_path)
    spec = prepared_config(cfg)
    assert spec.dp is False and spec.ledger is None and spec.dataset_ledger is None
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
    rep = write_report(spec.run_dir)
    assert not os.path.exists(tmp_path / "ledgers.sqlite")  # no database, no ledger, nothing spent
    assert not os.path.exists(os.path.join(spec.run_dir, "ledger.jsonl"))
    first = (f"DECLARED PUBLIC DATA: the recipe declared its training data ({cfg.data.path}) public "
             "(data.public: true); trained without DP; llmdp makes no guarantee about this data, "
             "and the declaration is the user's responsibility")
    assert rep["declared_public"] is True and rep["banner"] == first and rep["epsilon"] is None
    info = json.load(open(os.path.join(spec.run_dir, "plan.json"), encoding="utf-8"))
    assert next(iter(info)) == "declared_public" and info["declared_public"] == first
    md = open(os.path.join(spec.run_dir, "privacy_report.md"), encoding="utf-8").read()
    assert md.splitlines()[0] == first and "declared public" in md and "cannot be exported" not in md


def test_data_treated_as_private_refuses_the_declaration_unless_overridden_and_noted(tmp_path):
    dp = prepared_config(dp_recipe(tmp_path))
    simulate_steps(dp, 2)  # two DP steps released on the notes
    before = records(tmp_path / "ledgers.sqlite")
    (ledger,) = before
    released = [r for r in before[ledger] if r["kind"] == "release"]
    assert sum(r["count"] for r in released) == 2

    with pytest.raises(ConfigError) as e:
        prepared_config(public_recipe(tmp_path))
    msg = str(e.value)
    assert msg.startswith("data.public: true, but ") and f"{ledger!r} (1 DP release(s))" in msg
    assert "data.public_override_ledger: true" in msg and "remove data.public" in msg
    # The same notes under another name: their content hash names the same ledger.
    copy = tmp_path / "copy" / "public-notes.jsonl"
    copy.parent.mkdir()
    shutil.copy(dp.cfg.data.path, copy)
    with pytest.raises(ConfigError, match=rf"{ledger!r} \(1 DP release\(s\)\)"):
        prepared_config(public_recipe(tmp_path, name="copy", data_path=copy))
    assert records(tmp_path / "ledgers.sqlite") == before  # refused: nothing written

    spec = prepared_config(public_recipe(tmp_path, public_override_ledger=True))
    assert spec.ledger is None
    prepared_config(public_recipe(tmp_path, public_override_ledger=True))  # a re-launch
    after = records(tmp_path / "ledgers.sqlite")
    notes = [r for r in after[ledger] if r["kind"] == "note"]
    assert len(notes) == 1 and notes[0]["run_dir"] == spec.run_dir
    assert "declared this data public" in notes[0]["note"]
    # the note is not a release: what the data spent is unchanged
    assert [r for r in after[ledger] if r["kind"] == "release"] == released
    assert set(after) == set(before)


def test_a_public_run_is_exported_with_the_declaration_first_and_no_guarantee(tmp_path):
    """Item 1: a declared-public run's model can be exported (a baseline's cannot): its card
    says first that the data was declared public, with no ε and no differential_privacy
    block; its report carries no internal statistics; a baseline is still refused."""
    from transformers import AutoModelForCausalLM

    from llmdp.hub.export import ExportError, export_run
    from llmdp.report.build import write_report

    cfg = public_recipe(tmp_path)
    spec = prepared_config(cfg)
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt")))
    rep = write_report(spec.run_dir)
    out = tmp_path / "export"
    res = export_run(spec.run_dir, out, log=lambda *a: None)
    assert res["verified"] and res["format"] == "full"
    card = (out / "README.md").read_text(encoding="utf-8")
    meta, body = card.split("\n---\n", 1)
    first = body.strip().splitlines()[0]
    assert first.startswith("DECLARED PUBLIC DATA: the recipe declared its training data (")
    assert first.endswith("the declaration is the user's responsibility")
    assert str(tmp_path) not in card  # the local path is not published
    assert "differential_privacy" not in meta and "declared-public-data" in meta
    from llmdp.hub.export import EXPORT_INFO

    info = json.load(open(out / EXPORT_INFO, encoding="utf-8"))
    assert info["declared_public"] == first and info["epsilon"] is None and info["verified"]
    pub = json.load(open(out / "privacy_report.json", encoding="utf-8"))
    assert pub["declared_public"] is True and "internal_metrics" not in pub
    assert "data_statistics" not in pub and rep["internal_metrics"]
    AutoModelForCausalLM.from_pretrained(out)  # loads as a starting checkpoint
    # the same run, not declared public: a NON-PRIVATE baseline, never exported
    raw = to_dict(cfg)
    raw["data"]["public"] = False
    raw["output"]["name"] = "base"
    base = prepared_config(recipe_from_dict(raw))
    train_loop_per_worker(base, LocalContext(checkpoint_dir=str(tmp_path / "ckpt2")))
    write_report(base.run_dir)
    with pytest.raises(ExportError, match="NON-PRIVATE baseline"):
        export_run(base.run_dir, tmp_path / "export2", log=lambda *a: None)


def _in_process(tmp_path):
    """A trial runner without Ray: the real run, its worker loop in this process."""
    from llmdp.report.build import write_report

    def run(cfg, log=print):
        spec = prepared_config(cfg)
        train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / f"ckpt-{spec.run_id}")))
        write_report(spec.run_dir)
        return spec.run_dir

    return run


def test_a_public_proxy_sweep_spends_nothing_and_its_best_point_feeds_a_private_run(tmp_path):
    """Item 4: a sweep of data declared public runs non-private trials, records nothing,
    selects by held-out loss and writes the selected point; a private recipe that takes it
    (train.hyperparameters_from) says in its report that they were chosen on public data at
    zero privacy cost. --write-best on private data is refused; a wrong file is named."""
    import yaml

    from llmdp.report.build import build_report
    from llmdp.tune.sweep import run_sweep

    raw = to_dict(public_recipe(tmp_path))
    raw["data"]["eval"] = {"fraction": 0.2}
    cfg = recipe_from_dict(raw)
    best = tmp_path / "tuned" / "best.yaml"
    lines = []
    state = run_sweep(cfg, ["optim.lr=0.001,0.05"], log=lines.append, run_trial=_in_process(tmp_path),
                      write_best=str(best))
    assert not os.path.exists(tmp_path / "ledgers.sqlite")  # nothing recorded, nothing spent
    assert state["epsilon"] == 0.0 and state["privacy"].startswith("none")
    assert lines[0].startswith("DECLARED PUBLIC DATA") and "nothing spent" in lines[1]
    losses = [t["held_out_loss"] for t in state["trials"]]
    assert all(isinstance(x, float) for x in losses) and losses[0] != losses[1]
    chosen = state["trials"][losses.index(min(losses))]
    assert state["selected"] == chosen
    doc = yaml.safe_load(best.read_text(encoding="utf-8"))
    assert doc["overrides"] == {"optim.lr": float(chosen["point"][0].split("=")[1])}
    assert doc["chosen_on"] == "public data" and doc["epsilon"] == 0.0
    sweep_md = (tmp_path / "runs" / "pub-sweep" / "sweep.md").read_text(encoding="utf-8")
    assert sweep_md.startswith("DECLARED PUBLIC DATA") and "no ε was spent" in sweep_md

    # A private recipe takes the selection.
    priv = to_dict(dp_recipe(tmp_path, name="tuned"))
    priv["train"]["hyperparameters_from"] = "tuned/best.yaml"
    priv["optim"]["lr"] = 0.5  # the recipe and the file disagree: neither silently wins
    with pytest.raises(ConfigError, match=r"optim.lr: 0.5 in the recipe, but train.hyperparameters_from "):
        recipe_from_dict(priv, base_dir=tmp_path)
    del priv["optim"]["lr"]
    tuned = recipe_from_dict(priv, base_dir=tmp_path)
    assert tuned.optim.lr == doc["overrides"]["optim.lr"]
    assert tuned.train.hyperparameters_from == str(best)
    spec = prepared_config(tuned)
    train_loop_per_worker(spec, LocalContext(checkpoint_dir=str(tmp_path / "ckpt-tuned")))
    rep = build_report(spec.run_dir)
    note = rep["hyperparameters"]["note"]
    assert note.startswith(f"hyper-parameters optim.lr={doc['overrides']['optim.lr']} were chosen by the "
                           f"sweep 'pub' on data declared public (<local>/notes.jsonl), at zero privacy cost")
    assert any(x.startswith("the choice of hyper-parameters other than optim.lr") for x in
               rep["data_accesses_not_covered"])

    with pytest.raises(ConfigError, match=r"--write-best .*only a sweep of data declared public"):
        run_sweep(dp_recipe(tmp_path, name="private"), ["optim.lr=0.001,0.05"], log=lambda *a: None,
                  run_trial=_in_process(tmp_path), write_best=str(best))
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim.lr: 0.1\n", encoding="utf-8")
    priv["train"]["hyperparameters_from"] = str(bad)
    with pytest.raises(ConfigError, match=rf"train.hyperparameters_from: {bad} is not a file `llmdp sweep"):
        recipe_from_dict(priv)


def test_a_public_sweep_launched_as_the_cli_does_keeps_its_ray_record_in_its_folder(tmp_path, monkeypatch):
    """`llmdp sweep` on a public recipe runs its trials on one local Ray, whose record goes
    in the sweep's folder: the folder exists before Ray starts (it did not, and the command
    failed at once); a refused sweep still makes no folder."""
    from llmdp.base import localray
    from llmdp.run import launch
    from llmdp.tune.sweep import run_sweep

    started = []

    def start(run_dir, cfgs, log, **kw):  # what the real one writes first
        with open(os.path.join(run_dir, "local_ray.json"), "w", encoding="utf-8") as f:
            f.write("{}")
        started.append(run_dir)

    monkeypatch.setattr(localray, "start_local_ray", start)
    monkeypatch.setattr(launch, "run", _in_process(tmp_path))  # the launcher's trials, in process
    raw = to_dict(public_recipe(tmp_path))
    raw["data"]["eval"] = {"fraction": 0.2}
    cfg = recipe_from_dict(raw)
    sweep_dir = tmp_path / "runs" / "pub-sweep"
    with pytest.raises(ConfigError, match=r"sweep.trials: random searches are for private data"):
        run_sweep(cfg, ["optim.lr=0.001,0.05"], trials="random", mean_trials=2, log=lambda *a: None)
    assert not sweep_dir.exists() and not started
    state = run_sweep(cfg, ["optim.lr=0.001,0.05"], log=lambda *a: None,
                      write_best=str(tmp_path / "best.yaml"))
    assert started == [str(sweep_dir)] and state["selected"] is not None
    assert (sweep_dir / "sweep.json").exists()


def test_a_public_sweep_never_selects_a_diverged_trial_and_warns_when_every_trial_got_worse():
    """A trial whose held-out loss is NaN (diverged) is never selected, even listed first (NaN
    compares false with everything, so a plain min kept it); a selection no better than its
    model before the first step is flagged: on the demo, SGD with momentum without clipping
    went 4.07 -> 5.68 at its best grid point and the sweep selected it silently."""
    from llmdp.tune.public import select

    def row(i, loss, before=4.0, status="complete"):
        return {"trial": i, "point": [f"optim.lr={i}"], "status": status, "held_out_loss": loss,
                "held_out_loss_before": before}

    nan = float("nan")
    best, warning = select([row(0, nan), row(1, 3.5), row(2, 3.2), row(3, 3.0, status="stopped")])
    assert best["trial"] == 2 and warning is None
    best, warning = select([row(0, nan), row(1, 5.68), row(2, float("inf")), row(3, 5.70)])
    assert best["trial"] == 1
    assert "ended at held-out loss 5.6800, no better than before its first step (4.0000)" in warning
    assert "optim.lr=1" in warning
    assert select([row(0, nan), row(1, None)]) == (None, None)
    assert select([row(0, 3.9, before=None)]) == (row(0, 3.9, before=None), None)
