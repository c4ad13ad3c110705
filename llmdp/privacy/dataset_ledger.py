"""Opening a dataset's ledger for a run or a tokenizer release: the one place both find it.

The database is ``ledger_location.resolve_location(privacy.ledger)`` ($LLMDP_HOME/ledger.sqlite by
default); the dataset's identity is ``data.sources.dataset_identity`` (``data.dataset_id``,
never the data's bytes; a derived id normalized, `llmdp.privacy.dataset_ids`, and a ledger
started under an earlier spelling of it kept). Legacy per-dataset JSONL ledgers are imported
once. The head log the database's ledgers are anchored to (`llmdp.privacy.anchors`) is
resolved here, on the driver, and handed to the run's ledger service.
"""

from __future__ import annotations

import os

from llmdp._fs import cache_root
from llmdp.privacy.ledger_location import describe_location, resolve_location
from llmdp.privacy.ledgerdb import LedgerDB
from llmdp.privacy.service import open_dataset


def open_dataset_ledger(d, ledger_opt: str | None, sha256: str, log=print,
                        recipe_legacy: bool = True) -> dict:
    """Open (and start, if new) the dataset ledger of recipe ``data`` ``d``: its identity
    (`dataset_identity`), the database (`resolve_location`), and the legacy JSONL ledgers
    it replaces, imported once. Prints where it is. ``recipe_legacy``: a legacy JSONL
    ``privacy.ledger`` is this data's (False for another source of the recipe, e.g. a
    separate evaluation source: that file is the training data's ledger)."""
    from llmdp.data.sources import dataset_identity  # lazy: llmdp.data.sources imports datasets
    from llmdp.privacy.dataset_ids import local_members

    ident = dataset_identity(d)
    location = resolve_location(ledger_opt)
    legacy = [os.path.join(cache_root(), "ledgers", f"{sha256[:16]}.jsonl")]
    if recipe_legacy and ledger_opt is not None and ledger_opt.endswith(".jsonl"):
        legacy.append(ledger_opt)
    db = LedgerDB(location)
    try:
        opened = open_dataset(db, ident["dataset_id"], sha256=sha256, source=ident["source"],
                              name=ident["name"], log=log, legacy_jsonl=legacy,
                              declared=ident["declared"], members=local_members(ident["source"]))
    finally:
        db.close()
    ident = {**ident, "dataset_id": opened["dataset_id"]}  # an earlier spelling's ledger is kept
    shown = describe_location(location)
    log(f"ledger: dataset {ident['dataset_id']!r} in {shown}"
        + ("" if ident["declared"] else " (data.dataset_id derived from the source)"))
    if opened.get("new"):
        log(f"ledger: a NEW dataset ledger was started for {ident['dataset_id']!r}: nothing was "
            "released on this data before. If it is another copy or format of data that has a "
            "ledger (the same notes as .txt files, say), stop and set data.dataset_id to that "
            "ledger's id: `llmdp privacy ledger list` shows them")
    return {**ident, "location": location, "shown": shown, "head_log": db.heads.path}
