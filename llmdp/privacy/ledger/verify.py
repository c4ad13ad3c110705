"""Verifying one dataset ledger's hash chain, and the damage a repair would excuse.

Pure functions over a ledger's rows ``(seq, body, hash)`` and its head ``(seq, hash)`` as
the database (`llmdp.privacy.ledger.database`) returns them; nothing here reads or writes a
database. Tamper evidence: `verify_rows` checks every record's hash, every link of the
chain and the head (the last record's seq and hash, kept in a table of its own, so a
deleted last record is seen too). A damaged ledger raises `LedgerDamaged` (a
`LedgerError`) naming every damaged record; `_damage_list` is what a ``repair`` record
lists (each damaged record by a fingerprint of what was found, and each link to excuse),
so that exactly that damage is excused from then on, and nothing else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from llmdp.privacy.ledger.records import GENESIS, LedgerDamaged, canonical, check_record

__all__ = ["VerifiedLedger", "verify_rows", "DAMAGE_HINT"]


DAMAGE_HINT = (
    "Nothing that reads this ledger proceeds. Choices: restore the database from a backup; "
    "or `llmdp privacy ledger repair {ledger_arg}--acknowledge-loss` to go on without the "
    "damaged record(s): their releases are then no longer counted (the ε reported for this "
    "dataset may under-state what was spent), and the repair itself is recorded in the ledger.")


def _damage_fingerprint(row) -> str:
    if row is None:
        return "missing"
    return hashlib.sha256((str(row[1]) + "\0" + str(row[2])).encode("utf-8", "replace")).hexdigest()


@dataclass
class VerifiedLedger:
    """The verified records of one ledger (damage excused by repairs left out)."""

    ledger: str
    records: list[dict] = field(default_factory=list)  # in seq order, each with "hash"
    head_seq: int = 0
    head_hash: str = GENESIS
    excused: int = 0  # damaged records excused by repairs (their releases are not counted)

    def last_of_run(self, run_id: str) -> dict | None:
        for rec in reversed(self.records):
            if rec.get("run_id") == run_id:
                return rec
        return None


def verify_rows(ledger: str, rows: list[tuple], head: tuple | None, where: str,
                hint_arg: str = "") -> VerifiedLedger:
    """Check one ledger's rows ``(seq, body, hash)`` and its head ``(seq, hash)``.

    Returns the verified records; raises `LedgerError` naming every damaged record that no
    repair record excuses (an edited body, a hash that does not link, a missing seq, rows
    after the head, a head that is not the last record)."""
    by_seq = {int(r[0]): r for r in rows}
    parsed: dict[int, dict] = {}
    bad: dict[int, str] = {}
    for seq, row in by_seq.items():
        rec, why = _check_row(ledger, seq, row)
        if why is not None:
            bad[seq] = f"record {seq} {why}" if why.startswith("is ") else f"record {seq}: {why}"
        else:
            parsed[seq] = rec
    # Repairs (records that verify on their own) excuse exactly the damage they list.
    excused_rows: dict[int, str] = {}
    excused_links: dict[int, str] = {}
    for rec in parsed.values():
        if rec["kind"] == "repair":
            for d in rec.get("excused") or []:
                if d.get("link") is not None:
                    excused_links[int(d["seq"])] = d["link"]
                else:
                    excused_rows[int(d["seq"])] = d.get("fingerprint")
    head_seq, head_hash = (int(head[0]), head[1]) if head is not None else (0, GENESIS)
    last = max([head_seq, *by_seq.keys()], default=0)
    problems: list[str] = []
    out = VerifiedLedger(ledger=ledger, head_seq=head_seq, head_hash=head_hash)
    expected: str | None = GENESIS
    last_good: tuple[int, str] = (0, GENESIS)
    after_damage = False
    for seq in range(1, last + 1):
        row = by_seq.get(seq)
        rec = parsed.get(seq)
        if seq in excused_rows and excused_rows[seq] == _damage_fingerprint(row):
            out.excused += 1  # exactly the damage a repair acknowledged: not counted
            expected = None  # unknown: the next record's link must be excused too
            after_damage = False
            continue
        if seq in excused_rows:  # a repair excused something else than what is there now
            problems.append(bad.get(seq) or (f"record {seq} is missing (deleted)" if row is None else
                            f"record {seq} is not the damaged record a repair excused: it "
                            f"changed since (edited, or put back)"))
            expected = None
            after_damage = True
            continue
        if rec is not None and head_seq == seq and head_hash != rec["hash"] and seq == last:
            problems.append(f"record {seq}, the last, is not the record the ledger's head "
                            f"names (hash {head_hash[:12]}): it was edited")
            expected = None
            after_damage = True
            continue
        if rec is not None and (rec["prev"] == expected or excused_links.get(seq) == rec["prev"]):
            out.records.append(rec)
            expected = rec["hash"]
            last_good = (seq, rec["hash"])
            continue
        if row is None:
            problems.append(f"record {seq} is missing (deleted)")
        elif seq in bad:
            problems.append(bad[seq])
        elif expected is None and after_damage:
            pass  # its link cannot be checked past the damage named before it
        elif expected is None:
            problems.append(f"record {seq} follows a record a repair excused, but its link is "
                            f"not excused (inserted or edited since)")
        else:
            problems.append(f"record {seq} does not link to record {seq - 1} (one of the two "
                            f"was edited, or a record was deleted or inserted)")
        expected = None
        after_damage = True
    if not problems and (head_seq, head_hash) != last_good:
        if head_seq > last_good[0]:
            problems.append(f"the ledger's head says {head_seq} records but the last one is "
                            f"{last_good[0]}: the last record(s) were deleted")
        elif head is None and by_seq:
            problems.append("the ledger has records but no head (written by something else "
                            "than llmdp)")
        else:
            problems.append(f"the ledger's head (record {head_seq}, hash {head_hash[:12]}) is not "
                            f"its last record {last_good[0]}: a record was edited or inserted")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        if after_damage or len(problems) > 1:
            shown += " (records after a damaged one cannot be checked until it is repaired)"
        raise LedgerDamaged(f"the dataset ledger {ledger!r} in {where} is damaged: {shown}. "
                          + DAMAGE_HINT.format(ledger_arg=hint_arg))
    return out


def _damage_list(ledger: str, rows, head) -> list[dict]:
    """Every damaged record (by seq, with the fingerprint of what is there) and every link
    that must be excused, as a repair record lists them."""
    by_seq = {int(r[0]): r for r in rows}
    last = max([int(head[0]) if head else 0, *by_seq.keys()], default=0)
    # Records a repair excused (as `verify_rows`): damage, the same or changed since.
    excused_rows = {int(d["seq"]) for d in _excused(ledger, rows) if d.get("link") is None}
    out: list[dict] = []
    expected: str | None = GENESIS
    for seq in range(1, last + 1):
        row = by_seq.get(seq)
        rec = None if seq in excused_rows else _self_valid(ledger, seq, row)
        if rec is not None and head is not None and seq > int(head[0]):
            rec = None  # after the head: llmdp writes a record and the head together (inserted)
        if rec is not None and head is not None and int(head[0]) == seq == last and head[1] != rec["hash"]:
            rec = None  # the last record is not the one the head names: edited
        if rec is not None and rec["prev"] == expected:
            expected = rec["hash"]
            continue
        if rec is not None and expected is None:
            out.append({"seq": seq, "link": rec["prev"]})  # a good record after damage
            expected = rec["hash"]
            continue
        if rec is not None:  # a good record that does not link to the good one before it:
            # that one is not what this record linked to (edited, its hash recomputed; or this
            # record's link was edited, and then the next link breaks too): not counted either
            out.append({"seq": seq - 1, "fingerprint": _damage_fingerprint(by_seq.get(seq - 1))})
            out.append({"seq": seq, "link": rec["prev"]})
            expected = rec["hash"]
            continue
        out.append({"seq": seq, "fingerprint": _damage_fingerprint(row)})
        expected = None
    return out


def _excused(ledger: str, rows) -> list[dict]:
    """What the repair records among ``rows`` excuse already."""
    out: list[dict] = []
    for r in rows:
        rec = _self_valid(ledger, int(r[0]), r)
        if rec is not None and rec["kind"] == "repair":
            out += rec.get("excused") or []
    return out


def _check_row(ledger: str, seq: int, row) -> tuple[dict | None, str | None]:
    """(the record with its "hash", None) if the row ``(seq, body, hash)`` is a well-formed
    record of ``ledger`` at ``seq`` whose body matches its hash, else (None, why)."""
    body, h = row[1], row[2]
    try:
        rec = json.loads(body)
    except (TypeError, ValueError):
        return None, f"is not JSON (garbage; first bytes {str(body)[:40]!r})"
    why = check_record(rec)
    if why is None and canonical(rec) != body:
        why = "not in canonical form (edited)"
    if why is None and rec["seq"] != seq:
        why = f"its body says seq {rec['seq']} (moved or edited)"
    if why is None and rec["ledger"] != ledger:
        why = f"its body names ledger {rec['ledger']!r} (copied from another ledger)"
    if why is None and hashlib.sha256(body.encode("ascii")).hexdigest() != h:
        why = "its content no longer matches its hash (edited)"
    if why is not None:
        return None, why
    rec["hash"] = h
    return rec, None


def _self_valid(ledger: str, seq: int, row) -> dict | None:
    return None if row is None else _check_row(ledger, seq, row)[0]


def _last_good(ledger: str, rows, excuses) -> tuple[int, str]:
    bad = {d["seq"] for d in excuses if d.get("link") is None}
    best = (0, GENESIS)
    for r in sorted(rows, key=lambda r: int(r[0])):
        seq = int(r[0])
        if seq in bad:
            continue
        rec = _self_valid(ledger, seq, r)
        if rec is not None:
            best = (seq, rec["hash"])
    return best
