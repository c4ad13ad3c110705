"""`llmdp privacy ledger list|verify|repair|import`: exit 0 when what was checked is intact
(or was repaired), 2 with the message on stderr when a ledger is damaged or an argument is
wrong; a repair of a dataset ledger needs --acknowledge-loss, and every repair is recorded."""

from __future__ import annotations

import json
import sqlite3

import pytest

from llmdp.cli import main
from llmdp.privacy.accounting.events import dpsgd_step_event, event_to_json
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.records import Ledger
from llmdp.privacy.ledger.service import BudgetError, LedgerService

EVJ = event_to_json(dpsgd_step_event(0.01, 1.0))
DS = "ds-1"
META = {"unit": {"kind": "sequence", "sequence_length": 24}}


def _service(tmp_path, run_id="run") -> LedgerService:
    return LedgerService(
        location=str(tmp_path / "ledger.sqlite"), dataset_id=DS,
        run_ledger=str(tmp_path / run_id / "ledger.jsonl"), run_id=run_id, meta=META, block_size=2,
        total_steps=10, event_json=EVJ, delta=1e-5, accountant="rdp")


@pytest.fixture
def run_dir(tmp_path):
    """A run directory (plan.json naming its dataset ledger) whose ledger.jsonl a
    LedgerService wrote: 5 records of 2 steps."""
    svc = _service(tmp_path)
    svc.start_attempt()
    for step in range(10):
        svc.ensure(step)
    svc.db.close()
    run = tmp_path / "run"
    (run / "plan.json").write_text(json.dumps({
        "run_id": "run", "dataset_ledger": {"location": str(tmp_path / "ledger.sqlite"),
                                            "dataset_id": DS}}))
    return run


def db(tmp_path) -> str:
    return str(tmp_path / "ledger.sqlite")


def ledger(args, capsys) -> tuple[int, str, str]:
    rc = main(["privacy", "ledger", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def sql(tmp_path, query, params=()):
    con = sqlite3.connect(db(tmp_path))
    try:
        rows = con.execute(query, params).fetchall()
        con.commit()
        return rows
    finally:
        con.close()


def edit_record_3(tmp_path):
    body = sql(tmp_path, "SELECT body FROM llmdp_records WHERE ledger = ? AND seq = 3", (DS,))[0][0]
    sql(tmp_path, "UPDATE llmdp_records SET body = ? WHERE ledger = ? AND seq = 3",
        (body.replace('"count":2', '"count":1'), DS))


def state(tmp_path):
    return (sql(tmp_path, "SELECT ledger, seq, body, hash FROM llmdp_records ORDER BY ledger, seq"),
            sql(tmp_path, "SELECT * FROM llmdp_heads ORDER BY ledger"))


# ------------------------------------------------------------------ dataset ledgers

def test_list_and_verify(tmp_path, run_dir, capsys):
    LedgerDB(db(tmp_path)).append("other", {"kind": "note"})
    rc, out, err = ledger(["list", "--ledger", db(tmp_path)], capsys)
    assert rc == 0 and err == ""
    assert out.splitlines() == [
        f"ledgers in {db(tmp_path)}: 2",
        f"  {DS}: intact, 5 record(s), 5 release record(s) (10 training step(s)) by 1 run(s), no budget",
        "  other: intact, 1 record(s), 0 release record(s) (0 training step(s)) by 0 run(s), no budget"]
    rc, out, err = ledger(["verify", "--ledger", db(tmp_path)], capsys)
    assert rc == 0 and err == "" and len(out.splitlines()) == 3
    assert out.splitlines()[-1].startswith("checked against the head log ")
    rc, out, err = ledger(["verify", "--dataset", DS, "--ledger", db(tmp_path)], capsys)
    assert (rc, err) == (0, "") and out.startswith(f"{DS}: intact, 5 record(s)")
    # Damaged: verify fails with the message on stderr; list says which one is damaged.
    edit_record_3(tmp_path)
    for args in (["verify"], ["verify", "--dataset", DS]):
        rc, out, err = ledger([*args, "--ledger", db(tmp_path)], capsys)
        assert rc == 2
        assert err.startswith(f"llmdp: error: the dataset ledger {DS!r} in {db(tmp_path)} is "
                              f"damaged: record 3: its content no longer matches its hash")
        assert (f"llmdp privacy ledger repair --ledger {db(tmp_path)} --dataset {DS} "
                "--acknowledge-loss") in err
    rc, out, err = ledger(["list", "--ledger", db(tmp_path)], capsys)
    assert rc == 0
    assert f"  {DS}: DAMAGED (record 3: its content no longer matches its hash" in out
    assert "  other: intact" in out


def test_verify_refuses_unknown_ledgers_and_databases(tmp_path, run_dir, capsys):
    rc, _, err = ledger(["verify", "--dataset", "nope", "--ledger", db(tmp_path)], capsys)
    assert rc == 2 and "--dataset 'nope': no such ledger" in err
    missing = str(tmp_path / "missing.sqlite")
    rc, _, err = ledger(["verify", "--ledger", missing], capsys)
    assert rc == 2 and f"the ledger database {missing} does not exist" in err
    assert not (tmp_path / "missing.sqlite").exists()  # verify never creates one


def test_repair_needs_acknowledge_loss(tmp_path, run_dir, capsys):
    rc, out, _ = ledger(["repair", "--dataset", DS, "--ledger", db(tmp_path)], capsys)
    assert rc == 0 and out.strip() == f"{DS}: intact; nothing to repair"
    edit_record_3(tmp_path)
    before = state(tmp_path)
    rc, out, err = ledger(["repair", "--dataset", DS, "--ledger", db(tmp_path)], capsys)
    assert rc == 2 and out == ""
    assert "is damaged: record 3" in err and f"--dataset {DS} --acknowledge-loss" in err
    assert state(tmp_path) == before  # nothing written
    rc, out, err = ledger(["repair", "--dataset", DS, "--acknowledge-loss", "--reason",
                           "disk error", "--ledger", db(tmp_path)], capsys)
    assert (rc, err) == (0, "")
    assert out.strip() == (f"{DS}: repaired by record 6: 1 damaged record(s) excused and no longer "
                           f"counted (acknowledged loss, recorded)")
    rec = LedgerDB(db(tmp_path)).records(DS)[-1]
    assert rec["kind"] == "repair" and rec["seq"] == 6 and rec["reason"] == "disk error"
    assert [d["seq"] for d in rec["excused"] if "fingerprint" in d] == [3]
    rc, out, err = ledger(["verify", "--dataset", DS, "--ledger", db(tmp_path)], capsys)
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == (f"{DS}: intact, 5 record(s), 4 release record(s) (8 training "
                                   f"step(s)) by 1 run(s), 1 damaged record(s) excused by repairs, "
                                   f"no budget")


def test_repair_needs_a_run_dir_or_a_dataset(tmp_path, capsys):
    rc, _, err = ledger(["repair", "--ledger", db(tmp_path)], capsys)
    assert rc == 2 and "give a RUN_DIR" in err and "--dataset ID" in err


def test_import(tmp_path, capsys):
    legacy = tmp_path / "legacy.jsonl"
    lines = [{"kind": "release", "event": EVJ, "count": c, "first_step": s, "run_id": "old",
              "attempt": "0", "meta": META} for s, c in ((0, 4), (4, 4))]
    legacy.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["import", str(legacy), "--dataset", DS, "--ledger", db(tmp_path)]
    rc, out, err = ledger(args, capsys)
    assert (rc, err) == (0, "") and out.strip() == f"imported 2 release record(s) from {legacy} into {DS!r}"
    rc, out, err = ledger(args, capsys)
    assert (rc, err) == (0, "") and out.strip() == f"{legacy}: imported before; nothing to do"
    assert [r["kind"] for r in LedgerDB(db(tmp_path)).records(DS)] == ["import", "release", "release"]
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(legacy.read_bytes()[:-10])
    rc, out, err = ledger(["import", str(torn), "--dataset", "torn", "--ledger", db(tmp_path)], capsys)
    assert rc == 2 and f"llmdp: error: {torn}: the last line (line 2:" in err
    assert LedgerDB(db(tmp_path)).records("torn") == []


# ------------------------------------------------------------------ a run's ledger.jsonl

def _torn(path):
    path.write_bytes(path.read_bytes()[:-5])


def _last_line_deleted(path):
    path.write_bytes(b"".join(x + b"\n" for x in path.read_bytes().split(b"\n")[:-2]))


def _edited(path):
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"count":2', b'"count":1')
    path.write_bytes(b"\n".join(lines))


@pytest.mark.parametrize("damage, said", [
    (_torn, "the last line (line 5:"),
    (_last_line_deleted, "lacks 1 of this run's record(s)"),
    (_edited, "line 2 (dataset record 2) was edited"),
])
def test_a_run_ledger_is_verified_and_rewritten_from_the_dataset_ledger(tmp_path, run_dir, capsys,
                                                                       damage, said):
    path = run_dir / "ledger.jsonl"
    rc, out, err = ledger(["verify", str(run_dir)], capsys)
    assert (rc, err) == (0, "") and out.startswith(f"{path}: intact")
    rc, out, _ = ledger(["repair", str(run_dir)], capsys)
    assert rc == 0 and out.strip() == f"{path}: intact; nothing to repair"
    good = Ledger(path).records()
    damage(path)
    damaged = path.read_bytes()
    rc, out, err = ledger(["verify", str(run_dir)], capsys)
    assert rc == 2 and err.startswith(f"llmdp: error: {path}") and said in err
    assert f"llmdp privacy ledger repair {run_dir}" in err
    rc, out, err = ledger(["repair", str(run_dir)], capsys)
    assert (rc, err) == (0, "")
    kept = list(run_dir.glob("ledger.jsonl.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == damaged  # kept beside it
    assert out.strip() == (f"{path}: rewritten from the dataset ledger {DS!r} (6 record(s), the "
                           f"repair included); the damaged file is {kept[0]}")
    records = LedgerDB(db(tmp_path)).records(DS)
    rep = records[-1]
    assert rep["kind"] == "repair" and rep["run_id"] == "run" and rep["target"] == "run ledger"
    assert said in rep["problems"][0]
    assert Ledger(path).records() == good + [rep]
    rc, out, err = ledger(["verify", str(run_dir)], capsys)
    assert (rc, err) == (0, "") and out.startswith(f"{path}: intact")
    # The run goes on: its next records link to the repair.
    svc = _service(tmp_path)
    svc.start_attempt()
    svc.ensure(8)
    assert Ledger(path).records()[-1]["run_prev"] == rep["hash"]
    assert ledger(["verify", str(run_dir)], capsys)[0] == 0


def test_a_run_ledger_is_not_rewritten_from_a_damaged_dataset_ledger(tmp_path, run_dir, capsys):
    _torn(run_dir / "ledger.jsonl")
    torn = (run_dir / "ledger.jsonl").read_bytes()
    edit_record_3(tmp_path)
    before = state(tmp_path)
    for cmd in ("verify", "repair"):
        rc, out, err = ledger([cmd, str(run_dir)], capsys)
        assert rc == 2 and f"the dataset ledger {DS!r}" in err and "is damaged: record 3" in err
    assert state(tmp_path) == before
    assert (run_dir / "ledger.jsonl").read_bytes() == torn
    assert not list(run_dir.glob("ledger.jsonl.damaged-*"))


def test_a_directory_without_plan_is_no_run(tmp_path, capsys):
    rc, _, err = ledger(["verify", str(tmp_path)], capsys)
    assert rc == 2 and "not a run directory (no plan.json)" in err


def test_a_run_ledger_is_rewritten_after_a_repair_of_its_dataset_ledger(tmp_path, run_dir, capsys):
    """The dataset ledger lost one of the run's records (repaired with --acknowledge-loss):
    the run's file no longer matches it; rewritten, it lacks that record and verifies."""
    edit_record_3(tmp_path)
    rc, _, _ = ledger(["repair", "--dataset", DS, "--acknowledge-loss", "--ledger", db(tmp_path)],
                      capsys)
    assert rc == 0
    rc, _, err = ledger(["verify", str(run_dir)], capsys)
    assert rc == 2 and "line 3 (record 3) is not in the dataset ledger" in err
    rc, out, err = ledger(["repair", str(run_dir)], capsys)
    assert (rc, err) == (0, "")
    path = run_dir / "ledger.jsonl"
    lines = Ledger(path).records()
    assert [r["seq"] for r in lines] == [1, 2, 4, 5, 7]
    assert lines[-1]["run_links_excused"] == [{"after": lines[1]["hash"], "link": lines[2]["run_prev"]}]
    rc, out, err = ledger(["verify", str(run_dir)], capsys)
    assert (rc, err) == (0, "") and out.startswith(f"{path}: intact")
    # The excuse is for that link only: deleting another line is detected.
    raw = path.read_bytes().split(b"\n")
    del raw[1]
    path.write_bytes(b"\n".join(raw))
    rc, _, err = ledger(["verify", str(run_dir)], capsys)
    assert rc == 2 and "line 2 (dataset record 4): it does not link to the line before it" in err


# ------------------------------------------------------------------ set-budget (issue 29 item 2)

SEQ24 = "a sequence of 24 tokens (packed across document boundaries)"


def rdp_spent(steps: int, delta: float = 1e-5) -> float:
    """ε of ``steps`` releases of the fixture's event, by dp-accounting directly."""
    import dp_accounting

    from llmdp.privacy.accounting.accountant import RDP_ORDERS

    acc = dp_accounting.rdp.RdpAccountant(
        orders=list(RDP_ORDERS), neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), steps)
    return float(acc.get_epsilon(delta))


def set_budget(tmp_path, capsys, *args):
    return ledger(["set-budget", "--dataset", DS, "--ledger", db(tmp_path), *args], capsys)


def test_set_budget_sets_raises_lowers_and_records(tmp_path, run_dir, capsys):
    """The budget is a record of the dataset's ledger (ε, δ, accountant, unit; who, when, why,
    old -> new); the unit is taken from the ledger's releases; a budget below what is spent is
    refused; a run with no budget is then checked against it."""
    spent = rdp_spent(10)
    rc, out, err = set_budget(tmp_path, capsys, "--epsilon", "3", "--delta", "1e-5",
                              "--accountant", "rdp", "--reason", "approved by the board")
    assert (rc, err) == (0, "")
    assert out.startswith(f"{DS}: budget ε = 3 at δ = 1e-05 (rdp) for the privacy unit {SEQ24!r} "
                          f"(was: none); ε spent {spent:.4f}"), out
    rec = LedgerDB(db(tmp_path)).records(DS)[-1]
    assert (rec["kind"], rec["epsilon"], rec["delta"], rec["accountant"], rec["unit_key"]) == \
        ("budget", 3.0, 1e-5, "rdp", SEQ24)
    assert rec["previous"] is None and rec["reason"] == "approved by the board"
    assert "@" in rec["by"] and rec["time"] and rec["run_id"] is None
    # The same budget again: nothing recorded.
    n = len(LedgerDB(db(tmp_path)).records(DS))
    rc, out, _ = set_budget(tmp_path, capsys, "--epsilon", "3")
    assert rc == 0 and "already" in out and len(LedgerDB(db(tmp_path)).records(DS)) == n
    # Below what is spent: refused, one message, nothing written.
    before = state(tmp_path)
    rc, out, err = set_budget(tmp_path, capsys, "--epsilon", f"{spent * 0.99:.6f}")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"has spent ε = {spent:.4f} at δ = 1e-05 (rdp)" in err and "at least" in err, err
    assert state(tmp_path) == before
    # A smaller δ makes what is spent larger: also checked (the new δ's ε).
    rc, _, err = set_budget(tmp_path, capsys, "--epsilon", f"{spent * 1.01:.6f}", "--delta", "1e-12")
    assert rc == 2 and f"has spent ε = {rdp_spent(10, 1e-12):.4f} at δ = 1e-12" in err
    # Lowered (above what is spent) and raised: each a record naming the old one.
    for eps, old in (("1.5", 3.0), ("4", 1.5)):
        rc, out, _ = set_budget(tmp_path, capsys, "--epsilon", eps)
        assert rc == 0 and f"(was: ε = {old:g} at δ = 1e-05 (rdp)" in out
        rec = LedgerDB(db(tmp_path)).records(DS)[-1]
        assert rec["epsilon"] == float(eps) and rec["previous"]["epsilon"] == old
    rc, out, _ = ledger(["list", "--ledger", db(tmp_path)], capsys)
    assert f"budget ε = 4 at δ = 1e-05 (rdp) for the privacy unit {SEQ24!r}, ε spent {spent:.4f}" in out
    # A run without a budget on this dataset holds its steps of the dataset's budget.
    svc = _service(tmp_path, run_id="late")
    st = svc.hold(10)
    assert st["held"] == 10 and st["budget_epsilon"] == 4.0 and "sets no" in st["budget_label"]
    # A run whose recipe states another budget is refused, naming both and the command.
    other = LedgerService(
        location=db(tmp_path), dataset_id=DS, run_ledger=str(tmp_path / "o" / "ledger.jsonl"),
        run_id="o", meta=META, block_size=2, total_steps=10, event_json=EVJ, delta=1e-5,
        accountant="rdp", budget_epsilon=9.0)
    with pytest.raises(BudgetError) as e:
        other.hold(10)
    msg = str(e.value)
    assert "privacy.budget_epsilon=9 (at privacy.delta = 1e-05, privacy.accountant: rdp)" in msg
    assert "that is ε = 4 at δ = 1e-05 (rdp)" in msg and "differ in ε" in msg
    assert f"llmdp privacy ledger set-budget --dataset {DS} --epsilon 9" in msg


def test_set_budget_on_a_new_dataset_and_the_unit(tmp_path, run_dir, capsys):
    # A dataset with no ledger: refused unless --create (a typo does not start a ledger).
    rc, _, err = ledger(["set-budget", "--dataset", "fresh", "--epsilon", "2", "--delta", "1e-6",
                         "--unit", "user", "--user-field", "patient", "--ledger", db(tmp_path)], capsys)
    assert rc == 2 and "no such ledger" in err and "--create" in err
    rc, out, _ = ledger(["set-budget", "--dataset", "fresh", "--epsilon", "2", "--delta", "1e-6",
                         "--unit", "user", "--user-field", "patient", "--create",
                         "--ledger", db(tmp_path)], capsys)
    assert rc == 0 and "privacy unit \"user (records sharing 'patient')\"" in out
    (rec,) = LedgerDB(db(tmp_path)).records("fresh")
    assert rec["accountant"] == "pld" and rec["unit"] == {"kind": "user", "user_field": "patient"}
    # The unit of a ledger with releases for another unit cannot be the budget's.
    before = state(tmp_path)
    rc, _, err = set_budget(tmp_path, capsys, "--epsilon", "3", "--delta", "1e-5", "--unit",
                            "sequence", "--sequence-length", "23")
    assert rc == 2 and "holds releases for other privacy units than 'a sequence of 23 tokens" in err
    assert SEQ24 in err and state(tmp_path) == before


@pytest.mark.parametrize("args, said", [
    (["--epsilon", "2"], "--delta: required when the dataset has no budget yet"),
    (["--delta", "1e-5"], "give --epsilon E"),
    (["--epsilon", "abc", "--delta", "1e-5"], "--epsilon: 'abc' is not a number"),
    (["--epsilon", "-1", "--delta", "1e-5"], "--epsilon: -1 is not > 0"),
    (["--epsilon", "inf", "--delta", "1e-5"], "--epsilon: 'inf' is not a finite number"),
    (["--epsilon", "2", "--delta", "2"], "--delta: 2 is not in (0, 1)"),
    (["--epsilon", "2", "--delta", "1e-5", "--accountant", "gdp"], "--accountant: 'gdp' is not one of"),
    (["--epsilon", "2", "--delta", "1e-5", "--unit", "row"], "--unit: 'row' is not one of"),
    (["--epsilon", "2", "--delta", "1e-5", "--unit", "user"], "--unit user: give --user-field"),
    (["--epsilon", "2", "--delta", "1e-5", "--user-field", "u"], "give --unit too"),
    (["--epsilon", "2", "--delta", "1e-5", "--unit", "sequence", "--sequence-length", "x"],
     "--sequence-length: 'x' is not an integer"),
    (["--epsilon", "2", "--delta", "1e-5", "--unit", "document", "--sequence-length", "8"],
     "only with --unit sequence"),
])
def test_set_budget_bad_input_is_one_message(tmp_path, run_dir, capsys, args, said):
    before = state(tmp_path)
    rc, out, err = set_budget(tmp_path, capsys, *args)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith("llmdp: error: ") and err.count("\n") == 1, err
    assert said in err, err
    assert state(tmp_path) == before


def test_set_budget_needs_a_dataset(tmp_path, capsys):
    rc, _, err = ledger(["set-budget", "--epsilon", "2", "--ledger", db(tmp_path)], capsys)
    assert rc == 2 and err.startswith("llmdp: error: ") and "give --dataset ID" in err
    assert err.count("\n") == 1


def test_a_dp_evaluation_is_not_counted_as_a_step(tmp_path, capsys):
    """Issue 30 item 13: `ledger list` / `verify` counted a DP evaluation as a training step
    ("51 step(s)" for 50 steps and one evaluation)."""
    import dp_accounting

    from llmdp.privacy.accounting.events import event_to_json as ej

    svc = LedgerService(
        location=db(tmp_path), dataset_id=DS, run_ledger=str(tmp_path / "run" / "ledger.jsonl"),
        run_id="run", meta=META, block_size=2, total_steps=4, event_json=EVJ, delta=1e-5,
        accountant="rdp", eval_event_json=ej(dp_accounting.GaussianDpEvent(5.0)), eval_releases=1)
    svc.start_attempt()
    for step in range(4):
        svc.ensure(step)
    assert svc.release_eval(4) == (True, "")
    svc.db.close()
    rc, out, _ = ledger(["verify", "--dataset", DS, "--ledger", db(tmp_path)], capsys)
    assert rc == 0 and "(4 training step(s), 1 other release(s): DP evaluations, tokenizers)" in out, out


def test_list_shows_epsilon_per_unit_at_a_given_delta(tmp_path, run_dir, capsys):
    """Issue 30 item 7: `ledger list` showed no ε; with --delta it shows ε spent per privacy
    unit (dp-accounting called directly), and a bad --delta is one message."""
    import dp_accounting

    rc, out, err = ledger(["list", "--ledger", db(tmp_path), "--delta", "1e-5"], capsys)
    assert (rc, err) == (0, "")
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 10)
    want = acc.get_epsilon(1e-5)
    line = next(x for x in out.splitlines() if x.strip().startswith(DS))
    assert f"; ε spent {want:.4f} at δ = 1e-05 (pld) for the privacy unit " in line, line
    rc, out, err = ledger(["list", "--ledger", db(tmp_path), "--delta", "2"], capsys)
    assert rc == 2 and "--delta: 2 is not in (0, 1)" in err and err.count("\n") == 1


def test_list_shows_epsilon_without_delta_at_the_default_delta(tmp_path, capsys):
    """Issue 51 item 10: `ledger list` showed no ε for a ledger without a budget unless
    --delta was given; it shows ε at llmdp's default δ for the N the releases name (what a
    recipe without privacy.delta plans at), the same figure --delta gives at that δ."""
    svc = LedgerService(
        location=db(tmp_path), dataset_id=DS, run_ledger=str(tmp_path / "r" / "ledger.jsonl"),
        run_id="r", meta={**META, "dataset_size": 2000}, block_size=2, total_steps=4,
        event_json=EVJ, delta=1e-4, accountant="pld")
    svc.start_attempt()
    for step in range(4):
        svc.ensure(step)
    svc.db.close()
    rc, out, _ = ledger(["list", "--ledger", db(tmp_path)], capsys)
    assert rc == 0
    line = out.splitlines()[1]
    assert "ε spent " in line and "at δ = 1e-05 (pld)" in line
    assert "(llmdp's default δ for N = 2000; --delta D for another)" in line
    rc, with_delta, _ = ledger(["list", "--delta", "1e-5", "--ledger", db(tmp_path)], capsys)
    eps = line.split("ε spent ")[1].split()[0]
    assert f"ε spent {eps} at δ = 1e-05" in with_delta.splitlines()[1]
