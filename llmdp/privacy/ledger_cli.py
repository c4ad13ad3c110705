"""`llmdp privacy ledger list|verify|repair|import`: the dataset ledgers from the command line.

Exit status: 0 when everything checked is intact (or was repaired), 2 with one message when a
ledger is damaged or an argument is wrong (the CLI prints `LedgerError`/`ValueError`).
"""

from __future__ import annotations

import os
import time

from llmdp.privacy.budget import holder_alive, live_holds
from llmdp.privacy.ledger import LEDGER_FILENAME, LedgerError, append_line, is_step_release
from llmdp.privacy.ledger_location import resolve_location
from llmdp.privacy.ledgerdb import LedgerDB
from llmdp.privacy.service import run_ledger_problems
from llmdp.rundir import RunDir


def _db(location: str | None, read_only: bool):
    loc = resolve_location(location)
    return LedgerDB(loc, read_only=read_only)


def _run_info(run_dir: str) -> tuple[dict, str]:
    info = RunDir(run_dir).info  # NotARunDirectory (a ValueError) without plan.json
    d = info.get("dataset_ledger")
    if not isinstance(d, dict):
        raise ValueError(f"{run_dir}: a run of an earlier llmdp (its dataset ledger is the JSONL "
                         f"file {d}); import that file with `llmdp privacy ledger import`")
    return info, d["location"]


def _summary(ledger: str, st) -> str:
    recs = st.records
    rel = [r for r in recs if r["kind"] == "release"]
    runs = {r.get("run_id") for r in rel}
    holds = live_holds(recs)
    steps = sum(int(r["count"]) for r in rel if is_step_release(r))
    others = sum(int(r["count"]) for r in rel if not is_step_release(r))
    return (f"{ledger}: intact, {len(recs)} record(s), {len(rel)} release record(s) "
            f"({steps} training step(s)"
            + (f", {others} other release(s): DP evaluations, tokenizers" if others else "")
            + f") by {len(runs)} run(s)"
            + (f", {st.excused} damaged record(s) excused by repairs" if st.excused else "")
            + (f", live hold(s): {', '.join(holds)}" if holds else ""))


def verify_run(run_dir: str, location: str | None = None) -> list[str]:
    """Problems of a run's ledger.jsonl, checked on its own and against its dataset ledger
    (raises `LedgerError` if the dataset ledger itself is damaged)."""
    info, loc = _run_info(run_dir)
    return run_ledger_problems(os.path.join(run_dir, LEDGER_FILENAME), info.get("run_id"),
                               resolve_location(location or loc), info["dataset_ledger"]["dataset_id"])


def main(args) -> int:
    cmd = args.ledger_command
    if cmd == "list":
        db = _db(args.ledger, read_only=True)
        try:
            ids = db.ledgers()
            print(f"ledgers in {db.where}: {len(ids)}")
            for i in ids:
                try:
                    print("  " + _summary(i, db.read(i)))
                except LedgerError as e:
                    print(f"  {i}: DAMAGED ({str(e).split(' is damaged: ')[-1].split('. Nothing')[0]})")
        finally:
            db.close()
        return 0
    if cmd == "verify":
        if args.run_dir:
            problems = verify_run(args.run_dir, args.ledger)
            if problems:
                raise LedgerError("; ".join(problems))
            print(f"{os.path.join(args.run_dir, LEDGER_FILENAME)}: intact, and every record is in "
                  f"its dataset ledger, which holds no other record of this run")
            return 0
        db = _db(args.ledger, read_only=True)
        try:
            ids = [args.dataset] if args.dataset else db.ledgers()
            if args.dataset and args.dataset not in db.ledgers():
                raise ValueError(f"--dataset {args.dataset!r}: no such ledger in {db.where} "
                                 f"(`llmdp privacy ledger list` shows them)")
            damaged = []
            for i in ids:
                try:
                    print(_summary(i, db.read(i)))
                except LedgerError as e:
                    damaged.append(str(e))
            if damaged:
                raise LedgerError("\n".join(damaged))
            print(f"checked against the head log {db.heads.path} and the runs' ledger.jsonl "
                  f"files the records name")
        finally:
            db.close()
        return 0
    if cmd == "repair":
        if args.run_dir:
            return _repair_run(args.run_dir, args.ledger, args.reason)
        if not args.dataset:
            raise ValueError("llmdp privacy ledger repair: give a RUN_DIR (rewrite its "
                             "ledger.jsonl) or --dataset ID (a damaged dataset ledger)")
        db = _db(args.ledger, read_only=False)
        try:
            rec = db.repair(args.dataset, acknowledge_loss=args.acknowledge_loss, reason=args.reason)
        finally:
            db.close()
        if rec is None:
            print(f"{args.dataset}: intact; nothing to repair")
            return 0
        print(f"{args.dataset}: repaired by record {rec['seq']}: {rec['records_lost']} damaged "
              f"record(s) excused and no longer counted (acknowledged loss, recorded)")
        return 0
    if cmd == "end-hold":
        db = _db(args.ledger, read_only=False)
        try:
            with db.transaction(args.dataset, full=True) as tx:
                hold = live_holds(tx.records).get(args.run_id)
                if hold is None:
                    raise ValueError(f"{args.run_id!r} holds nothing in the dataset ledger "
                                     f"{args.dataset!r} (`llmdp privacy ledger verify --dataset "
                                     f"{args.dataset}` lists the live holds)")
                lock = hold["hold"].get("lock") or {}
                if lock.get("path") and os.path.exists(lock["path"]) and holder_alive(lock):
                    raise ValueError(f"run {args.run_id!r} is alive (its lock file {lock['path']} "
                                     f"is held by PID {lock.get('pid')} on {lock.get('host')}); "
                                     f"its hold ends when its launch ends")
                tx.append({"kind": "hold_end", "run_id": None, "hold_of": args.run_id,
                           "reason": f"ended by hand: {args.reason}".rstrip(": "), "by": _who()})
        finally:
            db.close()
        print(f"{args.dataset}: the hold of run {args.run_id} ended (recorded)")
        return 0
    if cmd == "import":
        db = _db(args.ledger, read_only=False)
        try:
            n = db.import_jsonl(args.dataset, args.file)
        finally:
            db.close()
        print(f"imported {n} release record(s) from {args.file} into {args.dataset!r}"
              if n else f"{args.file}: imported before; nothing to do")
        return 0
    raise ValueError(f"unknown ledger command {cmd!r}")


def _repair_run(run_dir: str, location: str | None, reason: str) -> int:
    """Rewrite a run's ledger.jsonl from its dataset ledger (which must be intact): the
    damaged file is kept beside it, and the repair is recorded in the dataset ledger."""
    problems = verify_run(run_dir, location)
    if not problems:
        print(f"{os.path.join(run_dir, LEDGER_FILENAME)}: intact; nothing to repair")
        return 0
    info, loc = _run_info(run_dir)
    ds, run_id = info["dataset_ledger"]["dataset_id"], info["run_id"]
    path = os.path.join(run_dir, LEDGER_FILENAME)
    db = _db(location or loc, read_only=False)
    try:
        with db.transaction(ds, full=True) as tx:
            # Links to this run's records that a repair of the dataset ledger excused (they
            # are no longer counted): the rewritten file lacks them, and says so.
            gaps, last = [], None
            for r in tx.records:
                if r.get("run_id") == run_id:
                    if r.get("run_prev") != last:
                        gaps.append({"after": last, "link": r.get("run_prev")})
                    last = r["hash"]
            tx.append({"kind": "repair", "run_id": run_id, "target": "run ledger",
                       "excused": [], "run_links_excused": gaps, "problems": problems[:5],
                       "reason": reason, "by": _who()})
            mine = [r for r in tx.records if r.get("run_id") == run_id]
            kept = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
            if os.path.exists(path):
                os.replace(path, kept)
            for r in mine:
                append_line(path, r)
    finally:
        db.close()
    print(f"{path}: rewritten from the dataset ledger {ds!r} ({len(mine)} record(s), the repair "
          f"included); the damaged file is {kept}")
    return 0


def _who() -> str:
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"
