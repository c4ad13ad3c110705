"""Where a model came from (issue 32, item 2): a provenance file beside every model llmdp
writes, and what a run that starts from such a model must say and compose.

``llmdp_provenance.json`` is written into a run's ``model/`` folder when the run saves its
final model (`write_provenance`), and into an export (`publishable`, no local paths). It
names the run, whether it was DP, the data it was trained on (the declared-public source,
or the private dataset's ledger id) and the plan.

A run whose ``model.name_or_path`` is a local folder reads it (`starting_model`):

* a declared-public run: named, with its source, in the report and card; nothing composed;
* a DP run whose releases are in *this* dataset's ledger (the same private data): its
  releases (and the earlier ones it composed) are prior releases of this run, so they
  count towards this run's ε, target and the dataset's budget, and their noise tails are
  folded into δ (`DPPlan.prior_noise`) (`composed_releases`);
* a DP run on other data: named; its guarantee is its own, this run's covers only its
  fine-tuning data;
* a NON-PRIVATE baseline on private data: a DP run from it is refused (what it learned
  without DP would be published under a DP label);
* a folder without the file, or a Hub id: "external checkpoint: provenance not known to
  llmdp".
"""

from __future__ import annotations

import json
import os
from typing import Any

PROVENANCE = "llmdp_provenance.json"
VERSION = 1
EXTERNAL = "external checkpoint: provenance not known to llmdp"
SOURCE = "starting-model"  # prior releases of a starting checkpoint carry this "source"


def write_provenance(spec, folder: str) -> None:
    """The provenance of the model ``spec`` (a `RunSpec`) trained, into ``folder``."""
    from llmdp.config.schema import to_dict
    from llmdp.run.baseline import public_banner

    cfg = spec.cfg
    data = to_dict(cfg)["data"]
    info: dict[str, Any] = {
        "llmdp_provenance": VERSION,
        "run_id": spec.run_id,
        "dp": bool(spec.dp),
        "declared_public": public_banner(data) if cfg.data.public else None,
        "public_source": (cfg.data.dataset or cfg.data.path) if cfg.data.public else None,
        "dataset_id": None if spec.dataset_ledger is None else spec.dataset_ledger["dataset_id"],
        "ledger_location": None if spec.dataset_ledger is None else spec.dataset_ledger["location"],
        "plan": spec.plan.to_dict(),
        "prior_releases": [dict(r) for r in spec.prior_releases],
        "starting_model": summary(getattr(spec, "starting_model", None)),
    }
    with open(os.path.join(folder, PROVENANCE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


def publishable(info: dict, scrub) -> dict:
    """The provenance as an export carries it: no ledger location, no dataset id (a derived
    one is a path), no local path (``scrub`` for what is left)."""
    out = {k: v for k, v in info.items() if k not in ("ledger_location", "dataset_id")}
    src = info.get("public_source")
    if src is not None:
        out["public_source"] = shown(src)
        if out.get("declared_public"):
            out["declared_public"] = out["declared_public"].replace(str(src), shown(src))
    out["prior_releases"] = [{k: v for k, v in r.items() if k != "ledger"}
                             for r in info.get("prior_releases") or []]
    if out.get("starting_model"):
        out["starting_model"] = {k: v for k, v in out["starting_model"].items() if k != "name"}
    return scrub(out)


def read_provenance(folder: str) -> dict | None:
    path = os.path.join(folder, PROVENANCE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        from llmdp.config.validate import ConfigError

        raise ConfigError(f"model.name_or_path: {path} is unreadable ({e}); restore it from the "
                          f"run it came from, or remove it to start from the model as an external "
                          f"checkpoint", key="model.name_or_path") from e
    return info if isinstance(info, dict) and info.get("llmdp_provenance") else None


def shown(name) -> str | None:
    """A model or data name as reports and cards print it: a Hub id as is, a local path as
    ``<local>/<last component>`` (no machine path leaves in a report or a card)."""
    if name is None:
        return None
    name = os.fspath(name)
    hub_like = not os.path.isabs(name) and not name.startswith((".", "~")) and name.count("/") <= 1 \
        and not os.path.exists(name)
    return name if hub_like else "<local>/" + os.path.basename(name.rstrip(os.sep))


def summary(start: dict | None) -> dict | None:
    """What a report names of a starting model (None: trained from random weights)."""
    if start is None:
        return None
    return {k: start.get(k) for k in ("name", "shown", "kind", "run_id", "public_source",
                                      "description", "composed", "epsilon_alone")}


def starting_model(model_cfg, data_cfg, *, dp: bool, ledger_opt: str | None) -> dict | None:
    """The starting model of a run (``model`` and ``data`` of its recipe): None for a model
    from random weights (``init: tiny``), else a dict with ``name``, ``kind`` (public, dp,
    non-private, external), ``description`` (the sentence the report prints),
    ``composed`` and, when composed, ``prior_releases`` and ``prior_noise``."""
    name = model_cfg.name_or_path
    if model_cfg.init != "pretrained" or name is None:
        return None
    folder = os.fspath(name)
    info = read_provenance(folder) if os.path.isdir(folder) else None
    if info is None:
        return {"name": folder, "shown": shown(folder), "kind": "external", "description": EXTERNAL,
                "composed": False}
    start = {"name": folder, "shown": shown(folder), "run_id": info.get("run_id"), "composed": False,
             "public_source": shown(info.get("public_source"))}
    if info.get("declared_public"):
        return {**start, "kind": "public",
                "description": f"llmdp run {info['run_id']} on data its recipe declared public "
                               f"({start['public_source']}); no guarantee is made about that data"}
    if not info.get("dp"):
        start["kind"] = "non-private"
        start["description"] = (f"llmdp run {info['run_id']}: a NON-PRIVATE baseline (trained "
                                f"without DP on data not declared public)")
        if dp:
            from llmdp.config.validate import ConfigError

            raise ConfigError(
                f"model.name_or_path: {folder} is the model of llmdp run {info['run_id']}, a "
                f"NON-PRIVATE baseline trained without DP on data not declared public: a DP run "
                f"from it would publish what it learned without DP under a DP label. Start "
                f"from a DP run's model, a declared-public run's (data.public: true), or a "
                f"pretrained model", key="model.name_or_path")
        return start
    start["kind"] = "dp"
    releases, ledger = _releases_of(info["run_id"], ledger_opt)
    from llmdp.data.sources import dataset_identity  # lazy: llmdp.data.sources imports datasets

    mine = dataset_identity(data_cfg)["dataset_id"]
    same = ledger == mine if ledger is not None else info.get("dataset_id") == mine
    if same and ledger is None:
        from llmdp.config.validate import ConfigError

        raise ConfigError(
            f"model.name_or_path: {folder} was trained with DP on this dataset ({mine!r}, llmdp "
            f"run {info['run_id']}), but the ledger database of this run (privacy.ledger: "
            f"{ledger_opt!r}) has no record of that run, so its releases cannot be composed; set "
            f"privacy.ledger to the database that holds them ({info.get('ledger_location')})",
            key="privacy.ledger")
    if not same or not dp:
        start["description"] = (f"llmdp DP run {info['run_id']} on other data"
                                if not same else f"llmdp DP run {info['run_id']} on this data")
        return start
    return {**start, **composed_releases(info, releases, mine)}


def _releases_of(run_id: str, ledger_opt: str | None) -> tuple[list[dict], str | None]:
    """The release records of run ``run_id`` (net of voids) and the ledger that holds them
    in the database ``privacy.ledger`` names, or ([], None)."""
    from llmdp.privacy.ledger import net_records
    from llmdp.privacy.ledger_location import is_url, resolve_location
    from llmdp.privacy.ledgerdb import LedgerDB

    location = resolve_location(ledger_opt)
    if not is_url(location) and not os.path.exists(location):
        return [], None
    db = LedgerDB(location)
    try:
        for ledger in db.ledgers():
            recs = [r for r in db.records(ledger) if r.get("run_id") == run_id]
            if recs:
                return [r for r in net_records(recs) if r.get("kind") == "release"
                        and r.get("count")], ledger
    finally:
        db.close()
    return [], None


def composed_releases(info: dict, releases: list[dict], ledger: str) -> dict:
    """A starting DP run's releases as this run's prior releases (``prior_releases``' shape,
    ``source`` = SOURCE) with the earlier releases it composed itself, and the noise tails
    of all of them (``prior_noise``: the starting run's plan at its recorded counts)."""
    from llmdp.privacy.events import event_from_json
    from llmdp.privacy.ledger import EVAL_MECHANISM, is_step_release, step_count
    from llmdp.privacy.plan import DPPlan

    plan = DPPlan.from_dict(info["plan"])
    evals = sum(int(r["count"]) for r in releases
                if (r.get("meta") or {}).get("mechanism") == EVAL_MECHANISM)
    tail = plan.noise_tail(steps=step_count(releases), eval_releases=evals)
    noise = [] if tail is None else [(w, c, k, z) for w, c, k, z, _ in tail.parts]
    prior = [dict(r) for r in info.get("prior_releases") or []]
    for r in releases:
        event_from_json(r["event"])  # readable, or the ledger's error surfaces here
        mech = (r.get("meta") or {}).get("mechanism") or ("dp-sgd" if is_step_release(r) else "dp")
        prior.append({"source": SOURCE, "run_id": r.get("run_id"), "event": r["event"],
                      "count": int(r["count"]), "extra": r.get("extra"),
                      "mechanism": f"{mech} (starting checkpoint, run {info['run_id']})",
                      "release_id": f"{r.get('run_id')}:{r.get('first_step')}:{r.get('attempt')}",
                      "unit": ((r.get("meta") or {}).get("unit") or {}).get("kind"),
                      "rng": (r.get("meta") or {}).get("rng"),
                      "ledger": {"dataset_id": ledger}})
    from llmdp.privacy.accountant import epsilon_with_threshold
    from llmdp.privacy.prior import release_entries

    entries, d_thr = release_entries(prior)
    at = plan.delta if tail is None else tail.accountant_delta(plan.delta)
    eps = epsilon_with_threshold(entries, at, d_thr, plan.accountant) if at > d_thr else float("inf")
    return {"composed": True, "prior_releases": prior, "prior_noise": noise, "epsilon_alone": eps,
            "description": f"llmdp DP run {info['run_id']} on this data (ε = {eps:.4f} at "
                           f"δ = {plan.delta:.3g} alone): its releases are composed into this "
                           f"run's guarantee"}


def merge_priors(own: list[dict], start: dict | None) -> list[dict]:
    """This run's prior releases and a composed starting model's, each release once (a
    private tokenizer both used is composed once)."""
    if not start or not start.get("composed"):
        return list(own)
    seen = {r.get("release_id") or r.get("run_id") for r in own}
    out = list(own)
    for r in start["prior_releases"]:
        key = r.get("release_id") or r.get("run_id")
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def scope(start: dict | None) -> str:
    """What a DP run's guarantee covers, given its starting model (the report's line)."""
    if start is None:
        return ("The model was trained from random weights: the guarantee covers its training "
                "data, as the releases below record")
    if start.get("composed"):
        return (f"Starting model: {start['description']}. The guarantee covers this dataset "
                f"across both trainings (the starting run's releases are composed with this "
                f"run's); it says nothing about any other data the starting model saw")
    return (f"Starting model: {start.get('shown')} ({start['description']}). The guarantee "
            f"covers only this run's fine-tuning data, not what the starting model was "
            f"trained on")
