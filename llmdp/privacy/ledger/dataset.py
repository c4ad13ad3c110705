"""Opening a dataset's ledger for a run or a tokenizer release: the one place both find it.

The database is ``location.resolve_location(privacy.ledger)`` ($LLMDP_HOME/ledger.sqlite by
default); the dataset's identity is ``data.sources.dataset_identity`` (``data.dataset_id``,
never the data's bytes; a derived id normalized, `llmdp.data.ids`, and a ledger
started under an earlier spelling of it kept). Legacy per-dataset JSONL ledgers are imported
once. The head log the database's ledgers are anchored to (`llmdp.privacy.ledger.anchors`) is
resolved here, on the driver, and handed to the run's ledger service.
"""

from __future__ import annotations

import os

from llmdp._fs import cache_root
from llmdp.privacy.ledger.database import LedgerDB
from llmdp.privacy.ledger.location import describe_location, is_url, resolve_location
from llmdp.privacy.ledger.service import open_dataset


def open_dataset_ledger(d, ledger_opt: str | None, sha256: str, log=print,
                        recipe_legacy: bool = True) -> dict:
    """Open (and start, if new) the dataset ledger of recipe ``data`` ``d``: its identity
    (`dataset_identity`), the database (`resolve_location`), and the legacy JSONL ledgers
    it replaces, imported once. Prints where it is. ``recipe_legacy``: a legacy JSONL
    ``privacy.ledger`` is this data's (False for another source of the recipe, e.g. a
    separate evaluation source: that file is the training data's ledger)."""
    from llmdp.data.ids import local_members
    from llmdp.data.sources import dataset_identity  # lazy: llmdp.data.sources imports datasets

    ident = dataset_identity(d)
    location = resolve_location(ledger_opt)
    members = local_members(ident["source"])
    distinct = _check_new_ledger(d, ident, sha256, members, location, log)
    legacy = [os.path.join(cache_root(), "ledgers", f"{sha256[:16]}.jsonl")]
    if recipe_legacy and ledger_opt is not None and ledger_opt.endswith(".jsonl"):
        legacy.append(ledger_opt)
    db = LedgerDB(location)
    try:
        opened = open_dataset(db, ident["dataset_id"], sha256=sha256, source=ident["source"],
                              name=ident["name"], log=log, legacy_jsonl=legacy,
                              declared=ident["declared"], members=members, distinct=distinct)
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


def _check_new_ledger(d, ident: dict, sha256: str, members, location: str, log) -> dict | None:
    """Before a dataset ledger is started: refused (`ConfigError`) when this data matches
    (the same id, content hash or an overlapping source: `registry.recorded`) a ledger
    with a budget, releases or holds in another database the user has written to, or, for a
    declared ``data.dataset_id``, in this one (a derived id's look-alikes here are refused by
    `service.open_dataset`): one dataset, one budget, whatever its name or database. A
    ledger named in ``data.distinct_from`` (or whose record names this id there) is other
    data. Returns the declaration to record in the new ledger (None without one)."""
    from llmdp.config.validate import ConfigError
    from llmdp.data.ids import canonical_id
    from llmdp.privacy.ledger.registry import marks_text, recorded, same_location

    names = tuple(getattr(d, "distinct_from", ()) or ())
    distinct = {"distinct_from": list(names),
                "distinct_reason": getattr(d, "distinct_reason", None)} if names else None
    mine = ident["dataset_id"]
    if is_url(location) or os.path.exists(location):
        db = LedgerDB(location, read_only=True)
        try:
            here = db.ledgers()
        finally:
            db.close()
        if mine in here or (not ident["declared"] and any(canonical_id(i) == mine for i in here)):
            return distinct  # its ledger is here already
    found = recorded(ident, sha256, members, current=location, search_current=ident["declared"],
                     log=log)
    blocking = [m for m in found if (m["budget"] or m["releases"] or m["holds"])
                and not (m["ledger"] != mine and (m["ledger"] in names or mine in m["distinct_from"]))]
    if not blocking:
        return distinct
    first = blocking[0]
    elsewhere = not same_location(first["location"], location)
    shown = "; ".join(f"{m['ledger']!r} in {m['where']} ({m['why']}; {marks_text(m)})"
                      for m in blocking)
    if elsewhere:
        same = (f"set privacy.ledger: {first['where']}"
                + ("" if first["ledger"] == mine else f" and data.dataset_id: {first['ledger']}")
                + " (the database that holds its releases), so that its budget counts this run")
    else:
        same = f"set data.dataset_id: {first['ledger']}, so that this run is charged to that ledger"
    others = list(dict.fromkeys(m["ledger"] for m in blocking))
    new_id = "" if mine not in others else "declare a new data.dataset_id with "
    head = (f"data.dataset_id: {mine!r} is a new dataset ledger, but" if ident["declared"] else
            f"this data's dataset ledger {mine!r} (derived from its source) would be new in "
            f"{describe_location(location)}, but")
    raise ConfigError(
        f"{head} its data matches the ledger(s) {shown}. One dataset must have one ledger, "
        f"whatever its name or database, or its budget does not count every release on it. If "
        f"they are the same individuals, {same}; if this data is about other individuals, "
        f"{new_id}data.distinct_from: [{', '.join(others)}] and data.distinct_reason: '<why>' "
        f"(both recorded in the new ledger and shown in the run's internal report)",
        key="privacy.ledger" if elsewhere else "data.dataset_id")


def _named(found: list[dict]) -> str:
    from llmdp.privacy.ledger.registry import marks_text

    return "; ".join(f"{m['ledger']!r} ({marks_text(m)}) in {m['where']}" for m in found)


def check_public_eval(ev, train, train_sha: str, ledger_opt: str | None, log=print) -> None:
    """A separate evaluation source declared public (``data.eval.public: true``: its exact
    metrics are published) gets the checks of declared-public training data: no ledger in
    any database the user has written to may record it (`registry.recorded`: by id,
    content hash or overlapping source); and, unless the training data is declared public
    too, it may not be the run's training data, have its content or overlap it. Refused
    with a `ConfigError` before anything is opened or recorded."""
    from llmdp.config.validate import ConfigError
    from llmdp.data.ids import canonical_id, local_members, overlap
    from llmdp.data.sources import dataset_identity, source_fingerprint
    from llmdp.privacy.ledger.registry import recorded

    if ev is None or ev.public is not True or (ev.path is None and ev.dataset is None):
        return
    ident = dataset_identity(ev)
    sha = source_fingerprint(path=ev.path, dataset=ev.dataset, split=ev.split,
                             config_name=ev.config_name, format=ev.format)
    members = local_members(ident["source"])
    src = f"data.eval.path {ev.path}" if ev.path is not None else f"data.eval.dataset {ev.dataset}"
    fix = ("Its metrics would be published exactly, a leak of private data: set "
           "data.eval.public: false (DP evaluations, recorded in its own ledger), hold out "
           "training units (data.eval.fraction), or evaluate on other, public data")
    if not train.public:
        t = dataset_identity(train)
        mine, theirs = canonical_id(ident["source"]), canonical_id(t["source"])
        why = ("is the training data" if mine == theirs else
               "has the same content as the training data (the same content hash)"
               if sha == train_sha else None)
        if why is None:
            why = overlap(mine, members, theirs) or overlap(theirs, local_members(t["source"]), mine)
            why = None if why is None else f"overlaps the training data ({why})"
        if why is not None:
            raise ConfigError(f"data.eval.public: true, but {src} {why}, which this run treats "
                              f"as private. {fix}", key="data.eval.public")
    found = recorded(ident, sha, members, current=resolve_location(ledger_opt), log=log)
    if found:
        raise ConfigError(f"data.eval.public: true, but {src} is recorded as private data in "
                          f"the dataset ledger(s) {_named(found)}. {fix}",
                          key="data.eval.public")


def check_declared_public(d, ledger_opt: str | None, sha256: str, *, run_dir: str,
                          log=print) -> list[str]:
    """A training source that the recipe declares public (``data.public: true``) must not be
    one llmdp has treated as private: a dataset ledger that records it (by its identity, the
    same content hash or an overlapping source; a dataset record, a budget, a hold or a
    release), in ``privacy.ledger``'s database or any other the user has written to
    (`registry.recorded`), refuses the declaration, with a `ConfigError` naming each
    and the override. With ``data.public_override_ledger: true`` the run goes on and a
    ``note`` of the declaration is recorded in each. No ledger and no database is created.
    Returns the ledgers noted."""
    from llmdp.config.validate import ConfigError
    from llmdp.data.ids import local_members
    from llmdp.data.sources import dataset_identity  # lazy: llmdp.data.sources imports datasets
    from llmdp.privacy.ledger.records import now
    from llmdp.privacy.ledger.registry import recorded

    ident = dataset_identity(d)
    location = resolve_location(ledger_opt)
    found = recorded(ident, sha256, local_members(ident["source"]), current=location, log=log)
    if not found:
        return []
    named = _named(found)
    if not d.public_override_ledger:
        raise ConfigError(
            f"data.public: true, but {d.path or d.dataset} is recorded as private data in the "
            f"dataset ledger(s) {named}. This data was treated as private (a budget set, or a "
            f"DP run prepared or released on it). If it really is public, set "
            f"data.public_override_ledger: true (a note of this declaration is then recorded "
            f"in that ledger); otherwise remove data.public and train with DP", key="data.public")
    for m in found:
        db = LedgerDB(m["location"])
        try:
            if any(r.get("kind") == "note" and r.get("run_dir") == os.path.abspath(run_dir)
                   for r in db.records(m["ledger"])):
                continue  # a re-launch of the run that noted it
            db.append(m["ledger"], {
                "kind": "note", "time": now(), "run_dir": os.path.abspath(run_dir),
                "note": "a recipe declared this data public (data.public: true, "
                        "data.public_override_ledger: true) and trained on it without DP; "
                        "nothing was charged", "source": ident["source"], "sha256": sha256})
        finally:
            db.close()
    log(f"data.public_override_ledger: the declaration that this data is public is noted "
        f"in its ledger(s) {named}")
    return [m["ledger"] for m in found]
