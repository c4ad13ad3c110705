"""Where a model came from (issue 32, item 2): a provenance file beside every model llmdp
writes, and what a run that starts from such a model must say and compose.

``llmdp_provenance.json`` is written into a run's ``model/`` folder when the run saves its
final model (`write_provenance`), and into an export (`publishable`, no local paths). It
names the run, whether it was DP, the data it was trained on (the declared-public source,
or the private dataset's ledger id), the plan, its releases (as an export publishes them)
and its ancestry.

A run whose ``model.name_or_path`` is a local folder reads it (`starting_model`):

* a declared-public run: named, with its source, in the report and card; nothing composed;
* a DP run whose releases are in *this* dataset's ledger (the same private data): its
  releases (and the earlier ones it composed) are prior releases of this run, so they
  count towards this run's ε, target and the dataset's budget, and their noise tails are
  folded into δ (`DPPlan.prior_noise`) (`composed_releases`);
* a DP run on other data: named; its guarantee is its own, this run's covers only its
  fine-tuning data;
* a DP run whose data cannot be matched with this run's (an export has no dataset id; its
  releases are in a ledger database this run does not use): refused unless the recipe
  declares ``model.start_data``: ``same`` composes the releases its provenance records,
  ``independent`` is named as the recipe's declaration;
* a NON-PRIVATE baseline on private data: a DP run from it is refused (what it learned
  without DP would be published under a DP label);

Provenance is transitive (DESIGN, invariant `only-dp-outputs-leave`): each record carries its ``ancestry`` (every
ancestor's record, nearest first; `lineage`), so the checks above apply to the whole chain,
exports included: a DP run, or an export, of a model with a NON-PRIVATE baseline anywhere in
its chain is refused (`taint`); every DP ancestor on this data is composed, each once; the
report names every ancestor.
* a folder without the file, or a Hub id: "external checkpoint: provenance not known to
  llmdp".
"""

from __future__ import annotations

import json
import os
from typing import Any

from llmdp.config.choices import Mechanism

PROVENANCE = "llmdp_provenance.json"
VERSION = 2  # 2: the run's own releases and its ancestry (issue 49)
EXTERNAL = "external checkpoint: provenance not known to llmdp"
SOURCE = "starting-model"  # prior releases of a starting checkpoint carry this "source"


def write_provenance(spec, folder: str) -> None:
    """The provenance of the model ``spec`` (a `RunSpec`) trained, into ``folder``."""
    from llmdp.config.schema import to_dict
    from llmdp.record.baseline import public_banner

    cfg = spec.cfg
    data = to_dict(cfg)["data"]
    info: dict[str, Any] = {
        "llmdp_provenance": VERSION,
        "run_id": spec.run_id,
        "dp": bool(spec.dp),
        "declared_public": public_banner(data, bool(cfg.privacy.simulate)) if cfg.data.public else None,
        "public_source": (cfg.data.dataset or cfg.data.path) if cfg.data.public else None,
        "dataset_id": None if spec.dataset_ledger is None else spec.dataset_ledger["dataset_id"],
        "ledger_location": None if spec.dataset_ledger is None else spec.dataset_ledger["location"],
        "plan": spec.plan.to_dict(),
        "prior_releases": [dict(r) for r in spec.prior_releases],
        "starting_model": summary(getattr(spec, "starting_model", None)),
        # the run's own releases (publishable records): what a run declaring that it starts
        # on the same data (model.start_data: same) composes where no ledger has them
        "releases": _own_releases(spec) if spec.dp else [],
        # every ancestor's record, nearest first: what a descendant checks and composes
        "ancestry": list((getattr(spec, "starting_model", None) or {}).get("ancestry") or []),
    }
    info["kind"] = kind_of(info)
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
    out["ancestry"] = [publishable(a, scrub) for a in info.get("ancestry") or []]
    return scrub(out)


def _own_releases(spec) -> list[dict]:
    """The release records of the run's ledger, net of voids, as an export publishes them."""
    from llmdp.privacy.ledger import Ledger, net_records
    from llmdp.record.publish import publishable_ledger

    path = os.path.join(spec.run_dir, "ledger.jsonl")
    recs = net_records(Ledger(path).records()) if os.path.exists(path) else []
    return [r for r in publishable_ledger(recs) if r.get("count")]


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
    out = {k: start.get(k) for k in ("name", "shown", "kind", "run_id", "public_source",
                                     "description", "composed", "epsilon_alone", "composed_runs")}
    out["ancestry"] = [{"run_id": a.get("run_id"), "kind": kind_of(a),
                        "public_source": shown(a.get("public_source")), "shown": a.get("shown")}
                       for a in start.get("ancestry") or []]
    return out


def kind_of(info: dict) -> str:
    """public (declared-public data), dp, non-private (a baseline on data not declared public),
    or what an ancestry entry says it is (external)."""
    if info.get("kind"):
        return info["kind"]
    if info.get("declared_public"):
        return "public"
    return "dp" if info.get("dp") else "non-private"


def lineage(info: dict) -> list[dict]:
    """The chain of the model whose provenance is ``info``: its own record (without its
    ancestry), then its ancestors', nearest first (issue 49: provenance is transitive). A
    record written before ancestries were kept gives its starting model's summary."""
    own = {k: v for k, v in info.items() if k not in ("ancestry", "starting_model")}
    own["kind"] = kind_of(info)
    if "ancestry" in info:
        older = [dict(a) for a in info.get("ancestry") or []]
    else:
        older = [dict(info["starting_model"])] if info.get("starting_model") else []
    return [own, *older]


def taint(chain: list[dict]) -> dict | None:
    """The nearest NON-PRIVATE baseline of ``chain`` (a `lineage`), or None: what it learned
    without DP is in every descendant."""
    return next((a for a in chain if kind_of(a) == "non-private"), None)


def _entry(a: dict, composed: set, own: bool = False) -> str:
    """How the report names one ancestor."""
    what = {"public": f"on data its recipe declared public ({shown(a.get('public_source'))})",
            "non-private": "a NON-PRIVATE baseline (trained without DP on data not declared public)",
            "dp": "DP on this data, composed" if a.get("run_id") in composed else "DP on other data",
            }.get(kind_of(a))
    if what is None:
        return f"an external checkpoint ({a.get('shown')}: provenance not known to llmdp)"
    if own and kind_of(a) == "public":
        return f"llmdp run {a.get('run_id')} {what}; no guarantee is made about that data"
    return f"llmdp run {a.get('run_id')}" + (f": {what}" if own else f" ({what})")


def starting_model(model_cfg, data_cfg, *, dp: bool, ledger_opt: str | None) -> dict | None:
    """The starting model of a run (``model`` and ``data`` of its recipe): None for a model
    from random weights (``init: tiny``), else a dict with ``name``, ``kind`` (public, dp,
    non-private, external), ``description`` (the sentence the report prints, naming every
    ancestor), ``ancestry`` (its `lineage`, written into this run's provenance),
    ``composed`` and, when composed, ``prior_releases`` and ``prior_noise``."""
    from llmdp.config.validate import ConfigError

    name = model_cfg.name_or_path
    if model_cfg.init != "pretrained" or name is None:
        return None
    folder = os.fspath(name)
    info = read_provenance(folder) if os.path.isdir(folder) else None
    if info is None:
        return {"name": folder, "shown": shown(folder), "kind": "external", "description": EXTERNAL,
                "composed": False,
                "ancestry": [{"kind": "external", "run_id": None, "shown": shown(folder)}]}
    chain = lineage(info)
    start = {"name": folder, "shown": shown(folder), "run_id": info.get("run_id"), "composed": False,
             "public_source": shown(info.get("public_source")), "kind": chain[0]["kind"],
             "ancestry": chain}
    bad = taint(chain)
    if bad is not None and dp:
        how = "is the model of" if bad is chain[0] else "descends from"
        raise ConfigError(
            f"model.name_or_path: {folder} {how} llmdp run {bad.get('run_id')}, a NON-PRIVATE "
            f"baseline trained without DP on data not declared public: a DP run from it would "
            f"publish what it learned without DP under a DP label. Start from a DP run's model, "
            f"a declared-public run's (data.public: true) with no baseline in its chain, or a "
            f"pretrained model", key="model.name_or_path")
    parts, declared = [], None
    if dp and any(kind_of(a) == "dp" for a in chain):
        from llmdp.data.sources import dataset_identity  # lazy: llmdp.data.sources imports datasets

        mine = dataset_identity(data_cfg)["dataset_id"]
        covered: set = set()
        for a in chain:
            if kind_of(a) != "dp" or a.get("run_id") in covered:
                continue  # a nearer composed ancestor composed it already
            same, releases, declared_here = _same_data(a, mine, model_cfg, ledger_opt, folder)
            declared = declared or declared_here
            if same:
                parts.append((a, releases))
                covered |= {r.get("run_id") for r in a.get("prior_releases") or []}
    composed = {a.get("run_id") for a, _ in parts}
    if chain[0]["kind"] == "dp" and not parts:
        own = (f"llmdp DP run {start['run_id']} on other data" if dp else
               f"llmdp DP run {start['run_id']}")
    else:
        own = _entry(chain[0], composed, own=True)
    note = "" if declared is None else f" (declared by the recipe (model.start_data: {declared}))"
    older = "; it descends from " + ", then ".join(_entry(a, composed) for a in chain[1:]) \
        if len(chain) > 1 else ""
    if not parts:
        return {**start, "description": own + note + older}
    out = {**start, **composed_releases(parts, mine)}
    out["description"] = (out["description"] + note + older if parts[0][0] is chain[0] else
                          own + note + older + ". " + out["description"])
    return out


def _same_data(a: dict, mine: str, model_cfg, ledger_opt: str | None, folder: str):
    """(same, releases, declared) of a DP ancestor ``a``: matched by its run id in the ledger
    database this run uses, or by the dataset id its provenance records; else what the
    recipe declares (``model.start_data``), refused when it declares nothing."""
    from llmdp.config.validate import ConfigError

    declared = getattr(model_cfg, "start_data", None)
    releases, ledger = _releases_of(a["run_id"], ledger_opt)
    if ledger is not None or a.get("dataset_id") == mine:
        same = ledger == mine if ledger is not None else True
        if same and ledger is None:
            raise ConfigError(
                f"model.name_or_path: {folder} holds a model trained with DP on this dataset "
                f"({mine!r}, llmdp run {a['run_id']}), but the ledger database of this run "
                f"(privacy.ledger: {ledger_opt!r}) has no record of that run, so its releases "
                f"cannot be composed; set privacy.ledger to the database that holds them "
                f"({a.get('ledger_location')})", key="privacy.ledger")
        if declared is not None and same != (declared == "same"):
            raise ConfigError(
                f"model.start_data: {declared!r}, but the ledger shows that llmdp run "
                f"{a['run_id']} (in the chain of {folder}) was trained on "
                f"{'this' if same else 'another'} dataset; remove model.start_data (the ledger "
                f"decides when it knows)", key="model.start_data")
        return same, releases, None
    if declared is None:
        raise ConfigError(
            f"model.start_data: not set, but {folder} holds a model trained with DP by llmdp run "
            f"{a['run_id']} on data that cannot be matched with this run's (its release records "
            f"are not in the ledger database privacy.ledger names, and its provenance names no "
            f"dataset of it: an export, or another ledger database). Set model.start_data: same "
            f"if it was trained on this run's data (its releases, recorded in its provenance, "
            f"are composed into this run's guarantee), or model.start_data: independent if its "
            f"data shares no individuals with this run's (the report says that the recipe "
            f"declared it)", key="model.start_data")
    if declared == "independent":
        return False, [], declared
    if a.get("releases") is None:
        raise ConfigError(
            f"model.start_data: same, but the provenance of llmdp run {a['run_id']} (in the chain "
            f"of {folder}) was written by an earlier llmdp and does not record its releases; "
            f"set privacy.ledger to the ledger database that holds them", key="model.start_data")
    return True, [dict(r, from_provenance=True) for r in a["releases"]], declared


def _releases_of(run_id: str, ledger_opt: str | None) -> tuple[list[dict], str | None]:
    """The release records of run ``run_id`` (net of voids) and the ledger that holds them
    in the database ``privacy.ledger`` names, or ([], None)."""
    from llmdp.privacy.ledger import LedgerDB, is_url, net_records, resolve_location

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


def composed_releases(parts: list[tuple[dict, list[dict]]], ledger: str) -> dict:
    """The releases of the starting chain's DP runs on this data (``parts``: (provenance
    record, its release records), nearest first) as this run's prior releases
    (``prior_releases``' shape, ``source`` = SOURCE) with the earlier releases each composed
    itself, each once, and the noise tails of all of them (``prior_noise``: each run's plan
    at its recorded counts)."""
    from llmdp.privacy.accounting import event_from_json
    from llmdp.privacy.ledger import EVAL_MECHANISM, is_step_release, step_count
    from llmdp.privacy.noise import noise_tail
    from llmdp.privacy.plan import DPPlan
    from llmdp.record.rundir import check_read_back

    def read_plan(info: dict) -> DPPlan:  # its derived fields derived again, as plan.json's
        return check_read_back(DPPlan.from_dict(info["plan"]),
                               f"the plan of starting run {info.get('run_id')} ({PROVENANCE})")

    prior, noise, seen = [], [], set()
    for info, releases in parts:
        plan = read_plan(info)
        # declared the same data (model.start_data: same): its releases are not in this
        # run's ledger; launch copies them there (copy_declared_releases)
        declared = any(r.get("from_provenance") for r in releases)
        evals = sum(int(r["count"]) for r in releases
                    if (r.get("meta") or {}).get("mechanism") == EVAL_MECHANISM)
        tail = plan.noise_tail(steps=step_count(releases), eval_releases=evals)
        noise += [] if tail is None else [(w, c, k, z) for w, c, k, z, _ in tail.parts]
        for r in _as_prior(info, releases, ledger, event_from_json, is_step_release):
            key = r.get("release_id") or r.get("run_id")
            if key not in seen:
                seen.add(key)
                prior.append({**r, "copy_to_ledger": True} if declared else r)
    plan = read_plan(parts[0][0])
    tail = noise_tail(noise) if noise else None
    from llmdp.privacy.accounting import epsilon_with_threshold, release_entries

    entries, d_thr = release_entries(prior)
    at = plan.delta if tail is None else tail.accountant_delta(plan.delta)
    eps = epsilon_with_threshold(entries, at, d_thr, plan.accountant) if at > d_thr else float("inf")
    runs = ", ".join(str(info["run_id"]) for info, _ in parts)
    return {"composed": True, "prior_releases": prior, "prior_noise": noise, "epsilon_alone": eps,
            "composed_runs": [info["run_id"] for info, _ in parts],
            "description": f"llmdp DP run {runs} on this data (ε = {eps:.4f} at "
                           f"δ = {plan.delta:.3g} alone): {'its' if len(parts) == 1 else 'their'} "
                           f"releases are composed into this run's guarantee"}


def _as_prior(info: dict, releases: list[dict], ledger: str, event_from_json, is_step_release):
    """A starting DP run's releases in ``prior_releases``' shape, after those it composed."""
    prior = [dict(r) for r in info.get("prior_releases") or []]
    for r in releases:
        event_from_json(r["event"])  # readable, or the ledger's error surfaces here
        mech = (r.get("meta") or {}).get("mechanism") or (Mechanism.DP_SGD.value if is_step_release(r) else "dp")
        prior.append({"source": SOURCE, "run_id": r.get("run_id"), "event": r["event"],
                      "count": int(r["count"]), "extra": r.get("extra"),
                      "mechanism": f"{mech} (starting checkpoint, run {info['run_id']})",
                      "release_id": f"{r.get('run_id')}:{r.get('first_step')}:{r.get('attempt')}",
                      "unit": ((r.get("meta") or {}).get("unit") or {}).get("kind"),
                      "rng": (r.get("meta") or {}).get("rng"),
                      "ledger": {"dataset_id": ledger}})
    return prior


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


def copy_declared_releases(prior: list[dict], ledger: dict, meta: dict, log=print) -> int:
    """The releases of a starting chain declared the same data (``model.start_data: same``;
    they sit in another ledger database, or only in the start's provenance) appended to this
    run's dataset ledger (``ledger``: `open_dataset_ledger`'s), each once (by release id), so
    that the dataset's budget and every later run on it count them, not only this run's
    report (DESIGN, invariant `ledger-not-bypassed`). Returns how many were appended."""
    from llmdp.privacy.ledger import LedgerDB

    todo = [r for r in prior if r.get("copy_to_ledger")]
    if not todo or ledger is None:
        return 0
    db = LedgerDB(ledger["location"])
    try:
        with db.transaction(ledger["dataset_id"]) as tx:
            have = {(r.get("meta") or {}).get("imported_release") for r in tx.records}
            new = [r for r in todo if r["release_id"] not in have]
            for r in new:
                tx.append({"kind": "release", "event": r["event"], "count": int(r["count"]),
                           "first_step": 0, "run_id": r.get("run_id"), "attempt": "imported",
                           "meta": {**meta, "mechanism": r["mechanism"],
                                    "imported_release": r["release_id"],
                                    "declared": "model.start_data: same"},
                           "extra": r.get("extra")})
    finally:
        db.close()
    if new:
        log(f"{len(new)} release record(s) of the starting model (model.start_data: same) copied "
            f"into the dataset ledger {ledger['dataset_id']!r}")
    return len(new)
