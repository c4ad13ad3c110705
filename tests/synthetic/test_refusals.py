"""What `llmdp generate` refuses, each with one message (file or flag, value, fix), exit code
2 and no traceback: prompts from a private source, a non-DP model, a NON-PRIVATE baseline in
the provenance chain, a seeded model whose report lacks the seed statement, a filter by
data. And what it accepts: an export of a DP run (the card states the export's report), a
seeded model whose report states it (the card repeats the statement)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from llmdp.cli import main
from llmdp.synthetic.generate import generate
from tests.synthetic._runs import make_run

QUIET = {"progress": False, "log": lambda *a: None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {"dp": make_run(base / "dp"), "seeded": make_run(base / "seeded", rng="seeded", name="seeded"),
            "baseline": make_run(base / "baseline", dp=False, name="baseline")}


def _refused(capsys, argv, *needles):
    capsys.readouterr()  # what came before (a run's loading bars)
    rc = main(["generate", *argv, "--no-progress", "--max-new-tokens", "16"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("llmdp: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def _private_data(run) -> str:
    with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
        import yaml

        return yaml.safe_load(f)["data"]["path"]


def test_prompts_read_from_the_private_training_data_are_refused(runs, tmp_path, capsys):
    data = _private_data(runs["dp"])
    out = tmp_path / "s.jsonl"
    _refused(capsys, [runs["dp"], "--num-records", "2", "--out", str(out), "--prompts", data],
             f"--prompts {data}", "the recipe's private data.path", "no longer be post-processing")
    # a byte-identical copy elsewhere, and labels, too
    copy = tmp_path / "public-looking.txt"
    shutil.copyfile(data, copy)
    _refused(capsys, [runs["dp"], "--num-records", "2", "--out", str(out), "--labels", str(copy)],
             f"--labels {copy}", "byte-identical copy", "data.path")
    assert not out.exists()
    # a public file is accepted (the control: the refusal is about the source, not the flag)
    public = tmp_path / "prompts.txt"
    public.write_text("Chief complaint:\n", encoding="utf-8")
    generate(runs["dp"], out=out, num_records=2, prompts=public, max_new_tokens=16, **QUIET)
    assert out.exists()


def test_a_path_inside_a_private_source_folder_is_refused(tmp_path, capsys):
    from tests.helpers import write_notes

    folder = tmp_path / "corpus"
    folder.mkdir()
    write_notes(folder / "notes.jsonl", 30)
    write_notes(folder / "more.jsonl", 10, seed=4)
    run = make_run(tmp_path, data=folder, name="folder")
    _refused(capsys, [run, "--num-records", "2", "--out", str(tmp_path / "s.jsonl"),
                      "--prompts", str(folder / "more.jsonl")],
             "the recipe's private data.path")


def test_prompts_a_ledger_records_as_private_are_refused(runs, tmp_path, capsys, monkeypatch):
    """A file llmdp's ledgers know as private data (another run's corpus), not this recipe's."""
    from tests.helpers import write_notes

    other = tmp_path / "other"
    other.mkdir()
    data = write_notes(other / "their_notes.jsonl", 30, seed=5)
    make_run(other, data=data, name="other")
    # the registry the other run wrote its ledger database in (make_run: <tmp>/registry)
    monkeypatch.setenv("XDG_DATA_HOME", str(other / "registry"))
    _refused(capsys, [runs["dp"], "--num-records", "2", "--out", str(tmp_path / "s.jsonl"),
                      "--prompts", data], "the dataset ledger", "records this data")


def test_a_non_private_baseline_is_refused(runs, tmp_path, capsys):
    _refused(capsys, [runs["baseline"], "--num-records", "2", "--out", str(tmp_path / "s.jsonl")],
             "privacy.dp is false", "NON-PRIVATE baseline", "privacy.dp: true")
    assert not (tmp_path / "s.jsonl").exists()


def test_a_non_private_baseline_in_the_provenance_chain_is_refused(runs, tmp_path, capsys):
    run = str(tmp_path / "tainted")
    shutil.copytree(runs["dp"], run)
    prov_path = os.path.join(run, "model", "llmdp_provenance.json")
    with open(prov_path, encoding="utf-8") as f:
        prov = json.load(f)
    # an ancestor two steps up: a baseline on private data (what a chain through an older
    # llmdp, or a hand-copied checkpoint, could carry)
    prov["ancestry"] = [{"run_id": "aaaaaaaaaaaa", "kind": "dp", "dp": True},
                        {"run_id": "bbbbbbbbbbbb", "kind": "non-private", "dp": False}]
    with open(prov_path, "w", encoding="utf-8") as f:
        json.dump(prov, f)
    _refused(capsys, [run, "--num-records", "2", "--out", str(tmp_path / "s.jsonl")],
             "llmdp_provenance.json", "descends from llmdp run bbbbbbbbbbbb", "NON-PRIVATE baseline")


def test_a_seeded_model_needs_the_seed_statement_in_its_report(runs, tmp_path, capsys):
    # with it (a report this llmdp wrote): generated, and the card repeats it
    out = tmp_path / "ok" / "s.jsonl"
    out.parent.mkdir()
    generate(runs["seeded"], out=out, num_records=2, max_new_tokens=16, **QUIET)
    card = json.load(open(out.parent / "synthetic_data_card.json"))
    assert "knows that seed" in card["seeded_model"]["statement"]
    assert "training: privacy.rng: seeded" in card["seeded_model"]["sources"]
    assert "knows that seed" in (out.parent / "synthetic_data_card.md").read_text()
    # without it (an older or edited report): refused, naming the file and the field
    run = str(tmp_path / "old-report")
    shutil.copytree(runs["seeded"], run)
    path = os.path.join(run, "privacy_report.json")
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    report["rng_warning"] = None
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f)
    _refused(capsys, [run, "--num-records", "2", "--out", str(tmp_path / "s.jsonl")],
             "privacy_report.json: rng_warning is None", "fixed seed", "llmdp privacy report")


def test_filtering_by_data_is_refused(runs, tmp_path, capsys):
    data = _private_data(runs["dp"])
    _refused(capsys, [runs["dp"], "--num-records", "2", "--out", str(tmp_path / "s.jsonl"),
                      "--filter-with", data], f"--filter-with {data}", "private data.path",
             "filtering records by private data")
    public = tmp_path / "public.txt"
    public.write_text("anything\n")
    _refused(capsys, [runs["dp"], "--num-records", "2", "--out", str(tmp_path / "s.jsonl"),
                      "--filter-with", str(public)], "llmdp generate filters nothing")
    assert not (tmp_path / "s.jsonl").exists()


def test_an_export_is_a_source_and_an_unverified_one_is_refused(runs, tmp_path, capsys):
    from llmdp.hub.export import export_run

    folder = tmp_path / "export"
    export_run(runs["dp"], folder, log=lambda *a: None)
    out = tmp_path / "e" / "s.jsonl"
    out.parent.mkdir()
    generate(str(folder), out=out, num_records=3, max_new_tokens=16, **QUIET)
    card = json.load(open(out.parent / "synthetic_data_card.json"))
    with open(folder / "privacy_report.json", encoding="utf-8") as f:
        report = json.load(f)
    assert card["guarantee"]["epsilon"] == report["epsilon"]
    assert card["guarantee"]["delta"] == report["delta"]
    assert card["model"]["source"] == "export" and set(json.loads(open(out).readline())) == {"text", "user_id"}
    # the same records as from the run itself (the same weights)
    out2 = tmp_path / "r" / "s.jsonl"
    out2.parent.mkdir()
    generate(runs["dp"], out=out2, num_records=3, max_new_tokens=16, **QUIET)
    assert out.read_bytes() == out2.read_bytes()
    # an export made with --allow-unverified
    info = json.load(open(folder / "llmdp_export.json"))
    info.update(verified=False, problems=["the run's status is 'incomplete', not complete"])
    json.dump(info, open(folder / "llmdp_export.json", "w"))
    _refused(capsys, [str(folder), "--num-records", "2", "--out", str(tmp_path / "x.jsonl")],
             "llmdp_export.json: verified is false", "incomplete")
    # an export whose report was edited
    info.update(verified=True, problems=[])
    json.dump(info, open(folder / "llmdp_export.json", "w"))
    report["epsilon"] = 0.01
    json.dump(report, open(folder / "privacy_report.json", "w"))
    _refused(capsys, [str(folder), "--num-records", "2", "--out", str(tmp_path / "x.jsonl")],
             "privacy_report.json: epsilon is 0.01 but llmdp_export.json says")


def test_an_unfinished_or_unverified_run_is_refused(runs, tmp_path, capsys):
    run = str(tmp_path / "edited")
    shutil.copytree(runs["dp"], run)
    path = os.path.join(run, "privacy_report.json")
    report = json.load(open(path))
    report["epsilon"] = report["epsilon"] / 2  # a report that claims less than the ledger
    json.dump(report, open(path, "w"))
    _refused(capsys, [run, "--num-records", "2", "--out", str(tmp_path / "s.jsonl")],
             "does not verify", "privacy_report.json says epsilon")
    shutil.rmtree(os.path.join(run, "model"))
    _refused(capsys, [run, "--num-records", "2", "--out", str(tmp_path / "s.jsonl")],
             "no final model (model/)")
    _refused(capsys, [str(tmp_path), "--num-records", "2", "--out", str(tmp_path / "s.jsonl")],
             "holds neither plan.json")
