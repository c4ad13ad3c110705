"""Every ledger database the user has written to, and what each records about some data.

One dataset has one ledger (DESIGN, invariant `ledger-not-bypassed`), but a recipe can name another database
(``privacy.ledger``) or run under another ``$LLMDP_HOME``, where that dataset has no ledger
yet. So every database llmdp writes to (`llmdp.privacy.ledger.database.LedgerDB`, on its first
connection for writing: runs, tokenizer releases, ``set-budget``) is listed, one location a
line, in the user's registry (`location.registry_path`: the user's data directory,
whatever ``$LLMDP_HOME`` is; a PostgreSQL URL without its password). `recorded` looks for a
source in each of them: a ledger of the same id (or an earlier spelling of it), of the same
content hash, or of an overlapping source (`llmdp.privacy.ledger.service._similar_ledgers`).

What this does not see: a database written by another user account, on another machine,
or under another ``XDG_DATA_HOME``; a database removed from the registry file or deleted;
a PostgreSQL server that cannot be reached (a warning names it); data that matches by
neither hash nor source (an edited copy, a copy inside a folder with other files).

Only internal: the registry holds database locations, never anything of the data.
"""

from __future__ import annotations

import json
import os

# The list itself lives below the database (`database` registers each one it writes to).
from llmdp.privacy.ledger.location import (  # noqa: F401 - re-exported
    describe_location,
    is_url,
    register,
    registered,
    same_location,
)

__all__ = ["register", "registered", "recorded", "marks_text", "same_location"]


def _marks(bodies) -> dict:
    out = {"budget": False, "releases": 0, "holds": 0, "dataset": False, "distinct_from": set()}
    for body in bodies:
        try:
            rec = json.loads(body)
        except ValueError:
            continue
        kind = rec.get("kind")
        if kind == "budget":
            out["budget"] = True
        elif kind == "release":
            out["releases"] += 1
        elif kind == "hold":
            out["holds"] += 1
        elif kind in ("dataset", "data_version"):
            out["dataset"] = True
            out["distinct_from"].update(rec.get("distinct_from") or ())
    return out


def marks_text(m: dict) -> str:
    """What a ledger records, for messages: ``1 DP release(s), a budget``."""
    parts = [f"{m['releases']} DP release(s)"] if m["releases"] else []
    parts += ["a budget"] if m["budget"] else []
    parts += [f"{m['holds']} budget hold(s)"] if m["holds"] and not m["releases"] else []
    return ", ".join(parts) or "a dataset record: a DP run was prepared on it"


def _in_db(db, ident: dict, sha256: str, members) -> list[dict]:
    from llmdp.data.ids import canonical_id
    from llmdp.privacy.ledger.service import _similar_ledgers

    mine = canonical_id(ident["dataset_id"])
    found = {ledger: "the same dataset id" for ledger in db.ledgers()
             if ledger == ident["dataset_id"] or canonical_id(ledger) == mine}
    for s in _similar_ledgers(db, ident["dataset_id"], sha256, ident["name"], members,
                              ident["source"]):
        if s["blocks"] and s["ledger"] not in found:
            found[s["ledger"]] = s["why"]
    out = []
    cur = db._connect().cursor()
    for ledger, why in found.items():
        db._exec(cur, "SELECT body FROM llmdp_records WHERE ledger = ?", (ledger,))
        m = _marks(body for (body,) in cur.fetchall())
        out.append({"ledger": ledger, "why": why, "location": db.location, "where": db.where,
                    **m})
    return out


def recorded(ident: dict, sha256: str, members, *, current: str | None = None,
             search_current: bool = True, log=print) -> list[dict]:
    """The ledgers that record this data (``ident``: `dataset_identity`; its content hash and
    local files): in the database ``current`` (unless ``search_current`` is False) and in
    every other database of the registry. Each: {"ledger", "why", "location", "where", "budget", "releases",
    "holds", "dataset", "distinct_from"}. Read without writing or creating anything; a
    database that cannot be read is named in a warning, not searched."""
    from llmdp.privacy.ledger.database import LedgerDB, LedgerError

    locations = [current] if current is not None and search_current else []
    locations += [x for x in registered() if current is None or not same_location(x, current)]
    out: list[dict] = []
    for loc in locations:
        if not is_url(loc) and not os.path.exists(loc):
            continue  # nothing was ever written there (or it was deleted: not seen)
        db = LedgerDB(loc, read_only=True)
        try:
            out += _in_db(db, ident, sha256, members)
        except LedgerError as e:
            log(f"warning: the ledger database {describe_location(loc)} (used by an earlier "
                f"run) could not be searched for this data's ledger: {e}")
        finally:
            db.close()
    return out
