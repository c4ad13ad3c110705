"""`llmdp tokenizer train tokenizers/<name>.yaml`: a private tokenizer, recorded in the ledger.

The job, top to bottom (`train_tokenizer`):

1. read the private corpus through the same sources as training (`load_records`) and
   form its privacy units: one per record (``data.unit: document``) or one per
   ``data.user_field`` value (``user``); a unit's words are those of every text of its
   records (`record_texts`);
2. calibrate the noise sigma and the threshold tau to (``privacy.target_epsilon``,
   ``privacy.delta``) for K = ``privacy.max_words_per_unit`` words per unit
   (`llmdp.tokenizer.private.calibrate_tokenizer_noise`), and check the dataset's budget;
3. **write-ahead**: append the release to the dataset's ledger (the one training runs on
   this data use: ``data.dataset_id`` in the ledgers' database, `llmdp.privacy.ledger.LedgerDB`) before
   any noisy count exists: a Gaussian event of multiplier sigma/sqrt(K) with the
   threshold's delta in the record's ``extra``;
4. DP word counts (fresh OS entropy), then SentencePiece on the released counts only
   (post-processing), written as a Hugging Face tokenizer folder whose
   ``llmdp_tokenizer.json`` carries the release (event, delta_threshold, unit, release id)
   and public configuration only (`PUBLIC_INFO`): the corpus's hash and exact counts and
   the dataset ledger's path stay beside it, in ``<folder>.llmdp-private.json``. A training
   run reads both to compose the release into its guarantee (`tokenizer_release`) or to
   refuse a tokenizer that has none.

``privacy.dp: false`` trains on exact counts of every word: a NON-private baseline (for
compression comparisons). Its folder says so, and a training recipe refuses it.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Mapping

from llmdp.config.schema import ConfigError, TokenizerRecipeConfig, config_hash, dump_yaml, to_dict
from llmdp.data.synthetic import ensure_clinical_notes
from llmdp.privacy.allowlist import allow_listed

__all__ = [
    "INFO_FILE",
    "record_texts",
    "corpus_units",
    "read_tokenizer_info",
    "train_tokenizer",
]

INFO_FILE = "llmdp_tokenizer.json"
RECIPE_FILE = "tokenizer_recipe.yaml"


def record_texts(record: Mapping, *, text_field: str = "text", messages_field: str | None = None,
                 prompt_field: str | None = None, response_field: str | None = None) -> list[str]:
    """Every text of one record: its `text_field`, the contents of its `messages_field`
    chat, or its prompt and response."""
    if messages_field is not None:
        out = []
        for m in record.get(messages_field) or []:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str):
                out.append(content)
            elif isinstance(content, list):  # multi-part content: its text parts
                out.extend(p.get("text", "") for p in content
                           if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        return out
    if prompt_field is not None:
        return [t for t in (record.get(prompt_field), record.get(response_field)) if isinstance(t, str)]
    t = record.get(text_field)
    return [t] if isinstance(t, str) else []


def _columns(d) -> dict[str, str]:
    if d.messages_field is not None:
        cols = {"data.messages_field": d.messages_field}
    elif d.prompt_field is not None:
        cols = {"data.prompt_field": d.prompt_field, "data.response_field": d.response_field}
    else:
        cols = {"data.text_field": d.text_field}
    if d.unit == "user":
        cols["data.user_field"] = d.user_field
    return cols


def corpus_units(cfg: TokenizerRecipeConfig) -> tuple[list[list[str]], dict]:
    """The words of every privacy unit of the recipe's corpus, and facts about it
    (source fingerprint, number of records and units)."""
    # lazy: datasets and torch; this module stays light (llmdp.report.build reads tokenizer info here)
    from llmdp.data.sources import load_records, source_fingerprint
    from llmdp.tokenizer.private import pre_tokenize

    d = cfg.data
    if d.synthetic is not None and not os.path.exists(d.path):
        ensure_clinical_notes(d.path, d.synthetic.num_documents, d.synthetic.seed)
    source = dict(path=d.path, dataset=d.dataset, split=d.split, config_name=d.config_name,
                  format=d.format)
    sha = source_fingerprint(**source)
    ds = load_records(**source, columns=_columns(d))
    fields = dict(text_field=d.text_field, messages_field=d.messages_field,
                  prompt_field=d.prompt_field, response_field=d.response_field)
    groups: dict = {}
    units: list[list[str]] = []
    for rec in ds:
        words = [w for t in record_texts(rec, **fields) for w in pre_tokenize(t)]
        if d.unit == "user":
            groups.setdefault(rec[d.user_field], []).extend(words)
        else:
            units.append(words)
    if d.unit == "user":
        units = list(groups.values())
    info = {"sha256": sha, "num_records": len(ds), "num_units": len(units),
            "unit": d.unit, "user_field": d.user_field,
            "source": {k: v for k, v in source.items() if v is not None}}
    return units, info


def read_tokenizer_info(path) -> dict | None:
    """The ``llmdp_tokenizer.json`` of a tokenizer folder; None when the folder has none
    (a tokenizer not made by llmdp) or is not a local folder."""
    if path is None or not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, INFO_FILE), encoding="utf-8") as f:
            return _with_private_facts(json.load(f), path)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ConfigError(f"{os.path.join(path, INFO_FILE)}: not valid JSON ({e})") from None


# ----------------------------------------------------------------------------- what the folder holds
#
# DESIGN, invariant `only-dp-outputs-leave`: a private tokenizer's folder may be published; it holds the DP release and
# public configuration only (`PUBLIC_INFO`, an allow-list). Facts about the private corpus
# that are not DP (its hash, exact record and unit counts) and the dataset ledger's path
# (named by that hash) stay beside the folder, in ``<folder>.llmdp-private.json`` (never
# publish that file); `read_tokenizer_info` merges them back for a training run.

PUBLIC_INFO: dict = {
    "kind": True, "model_type": True, "vocab_size": True, "vocab_size_actual": True,
    "released_words": True, "dp": True, "trained_on_private_data": True, "warning": True,
    "recipe_hash": True, "recipe": True,
    "data": {"unit": True, "user_field": True, "source": True},
    "privacy": {k: True for k in (
        "epsilon", "delta", "accountant", "target_epsilon", "max_words_per_unit", "noise_std",
        "threshold", "delta_threshold", "noise_multiplier_gaussian", "event", "extra",
        "release_id", "run_id", "rng", "seed", "rng_warning", "adjacency", "mechanism")},
}


def publishable_tokenizer_info(info: dict) -> dict:
    """The part of a tokenizer's info that its folder may hold (`PUBLIC_INFO`)."""
    return allow_listed(info, PUBLIC_INFO)


def private_facts_path(folder: str) -> str:
    """The local file, beside a private tokenizer's folder, with what the folder must not hold."""
    folder = os.path.abspath(os.fspath(folder)).rstrip(os.sep)
    return folder + ".llmdp-private.json"


def _write_private_facts(info: dict, folder: str) -> None:
    path = private_facts_path(folder)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"release_id": info["privacy"]["release_id"], "data": info["data"],
                   "privacy": {"ledger": info["privacy"]["ledger"]}}, f, indent=2)
    os.replace(path + ".tmp", path)


def _with_private_facts(info: dict, folder: str) -> dict:
    rid = (info.get("privacy") or {}).get("release_id")
    if not rid:
        return info
    try:
        with open(private_facts_path(folder), encoding="utf-8") as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return info  # copied without it: the folder's public facts only
    if facts.get("release_id") != rid:
        return info  # another release's file
    return {**info, "data": {**facts.get("data", {}), **(info.get("data") or {})},
            "privacy": {**facts.get("privacy", {}), **info["privacy"]}}


def _check_out_dir(cfg: TokenizerRecipeConfig) -> dict | None:
    """The info of an identical finished tokenizer in the output folder (nothing to do),
    None if the folder is free; refuse a folder holding another recipe's tokenizer."""
    out = cfg.out_dir
    info = read_tokenizer_info(out)
    if info is None:
        if os.path.isdir(out) and os.listdir(out):
            raise ConfigError(
                f"output.name: {out} exists and is not an llmdp tokenizer folder; choose another "
                f"output.name or remove it",
                key="output.name",
            )
        return None
    if info.get("recipe_hash") == config_hash(cfg):
        return info
    raise ConfigError(
        f"output.name: {out} already holds a tokenizer of a different recipe (release "
        f"{(info.get('privacy') or {}).get('release_id')}); training another one is a new release "
        f"on the data: give it its own output.name (e.g. output.name={cfg.output.name}-2)",
        key="output.name",
    )


def train_tokenizer(cfg: TokenizerRecipeConfig, log=print) -> dict:
    """Run a tokenizer recipe end to end; returns the folder's ``llmdp_tokenizer.json``.
    What it derives from the private data (the unit cache, the ledger, the private facts
    beside the folder) is owner-only; the folder itself, a DP release meant to be shared,
    gets ordinary permissions."""
    from llmdp._fs import private_files, publish_tree

    with private_files():
        info = _train_tokenizer(cfg, log)
    if os.path.isdir(cfg.out_dir):
        publish_tree(cfg.out_dir)
    return info


def _train_tokenizer(cfg: TokenizerRecipeConfig, log=print) -> dict:
    # lazy: llmdp.privacy imports torch; this module stays light (llmdp.report.build imports it)
    import llmdp.privacy.ledger as ledgers
    from llmdp.privacy import accounting as acc
    from llmdp.privacy.plan import default_delta
    from llmdp.privacy.rng import secure_key, seeded_key
    from llmdp.tokenizer import private as tp

    done = _check_out_dir(cfg)
    if done is not None:
        log(f"tokenizer {cfg.out_dir} is already trained by this recipe (release "
            f"{(done.get('privacy') or {}).get('release_id')}); nothing to do")
        return done
    p, t = cfg.privacy, cfg.tokenizer
    log(f"reading the private corpus ({cfg.data.path or cfg.data.dataset})")
    units, data = corpus_units(cfg)
    n = data["num_units"]
    if n == 0:
        raise ConfigError("data: the corpus has no records", key="data.path")
    info: dict = {
        "kind": "private-sentencepiece" if p.dp else "non-private-sentencepiece",
        "dp": bool(p.dp),
        "trained_on_private_data": True,
        "data": data,
        "recipe_hash": config_hash(cfg),
        "recipe": to_dict(cfg),
    }
    if not p.dp:
        log("privacy.dp: false -> exact word counts: this tokenizer carries NO privacy "
            "guarantee and a training recipe that claims one will refuse it")
        counts = dict(Counter(w for words in units for w in words))
        info["warning"] = ("trained on exact word counts of private data without differential "
                           "privacy: its vocabulary may reveal rare words of the corpus")
    else:
        delta = p.delta if p.delta is not None else default_delta(n)
        if delta >= 1.0 / n:
            raise ConfigError(
                f"privacy.delta: {delta:g} is not below 1/N = {1.0 / n:.3g} for N = {n} units; "
                f"lower it (default: a power of ten below 1/(10 N))",
                key="privacy.delta",
            )
        k = p.max_words_per_unit
        sigma, tau, details = tp.calibrate_tokenizer_noise(
            p.target_epsilon, delta, k, delta_threshold_fraction=p.delta_threshold_fraction,
            accountant=p.accountant)
        event = tp.tokenizer_event(sigma, k)
        extra = tp.ledger_extra(sigma, tau, k)
        eps = acc.epsilon_with_threshold([(event, 1)], delta, extra["delta_threshold"], p.accountant)
        ledger = ledgers.open_dataset_ledger(cfg.data, p.ledger, data["sha256"], log=log)
        unit = {"kind": data["unit"], "user_field": data["user_field"]}
        release_id = uuid.uuid4().hex[:12]
        meta = {"mechanism": "private-tokenizer", "unit": unit, "dataset_fingerprint": data["sha256"],
                "dataset_size": n, "rng": p.rng, "tokenizer": cfg.out_dir}
        db = ledgers.LedgerDB(ledger["location"])
        try:
            # Check the budget and record the release in one transaction; write-ahead
            # (DESIGN, invariant `write-ahead-ledger`): the release is durable before any noisy count exists.
            with db.transaction(ledger["dataset_id"], full=True) as tx:
                # The dataset's budget (its ledger's), whatever this recipe says; the first
                # budgeted release records its recipe's (llmdp.privacy.ledger.budget).
                recipe = None if p.budget_epsilon is None else ledgers.DatasetBudget(
                    float(p.budget_epsilon), float(delta), p.accountant, unit)
                first, why = ledgers.check_release(
                    tx.records, {"unit": unit}, event, recipe=recipe, dataset_id=ledger["dataset_id"],
                    where=ledger["shown"], extra_threshold=extra["delta_threshold"],
                    what=f"this tokenizer (ε_tok = {eps:.4f})")
                if why is not None:
                    raise ledgers.BudgetError(why)
                if first is not None:
                    tx.append(ledgers.first_budget_record(first, f"tokenizer release {release_id} "
                                                         f"(privacy.budget_epsilon)"))
                rec = tx.append({"kind": "release", "event": acc.event_to_json(event), "count": 1,
                                 "first_step": 0, "run_id": f"tokenizer-{release_id}",
                                 "attempt": "1", "meta": meta, "extra": extra})
        finally:
            db.close()
        log(f"release {release_id} recorded in the dataset ledger {ledger['dataset_id']!r}: ε_tok = {eps:.4f} at "
            f"δ = {delta:.3g} (K = {k} words per {data['unit']}, noise std {sigma:.3f}, "
            f"threshold {tau:.2f})")
        # seeded: keyed by this release too (its run id and ledger attempt), so that two
        # releases with one seed never share their noise
        key = (seeded_key(p.seed, 0, "tokenizer", run=f"tokenizer-{release_id}", attempt="1")
               if p.rng == "seeded" else secure_key())
        counts = tp.dp_word_counts(units, max_words_per_unit=k, noise_multiplier=sigma,
                                   threshold=tau, key=key)
        del key
        info["privacy"] = {
            "epsilon": eps, "delta": delta, "accountant": p.accountant,
            "target_epsilon": p.target_epsilon, "max_words_per_unit": k,
            "noise_std": sigma, "threshold": tau, "delta_threshold": extra["delta_threshold"],
            "noise_multiplier_gaussian": details["noise_multiplier_gaussian"],
            "event": acc.event_to_json(event), "extra": extra, "release_id": release_id,
            "run_id": f"tokenizer-{release_id}",
            "ledger": {"location": ledger["shown"], "dataset_id": ledger["dataset_id"],
                       "seq": rec["seq"], "hash": rec["hash"]},
            "rng": p.rng, "seed": p.seed,
            "adjacency": f"add-or-remove one {data['unit']}"
                         + (f" (records sharing {data['user_field']!r})" if data["unit"] == "user" else ""),
            "mechanism": "each unit's distinct words (at most K, chosen by a keyed hash) counted "
                         "once; Gaussian noise on every count; words above the threshold kept; "
                         "SentencePiece trained on the noisy counts only",
        }
        if p.rng == "seeded":
            info["privacy"]["rng_warning"] = ("a fixed seed drew the noise: NO guarantee against "
                                              "anyone who knows that seed")
    if not counts:
        raise ConfigError(
            "privacy: no word passed the threshold, so there is nothing to train SentencePiece "
            "on; raise privacy.target_epsilon or lower privacy.max_words_per_unit, or use a "
            "larger corpus", key="privacy.target_epsilon")
    log(f"{len(counts)} words released; training SentencePiece ({t.model_type}, vocab {t.vocab_size})")
    info["released_words"] = len(counts)
    if p.dp:  # before the folder exists: a folder here always finds its facts
        _write_private_facts(info, cfg.out_dir)
    out = tp.train_sentencepiece_from_counts(
        counts, vocab_size=t.vocab_size, out_dir=cfg.out_dir, model_type=t.model_type,
        byte_fallback=t.byte_fallback, character_coverage=t.character_coverage,
        extra_meta=publishable_tokenizer_info(info))
    dump_yaml(cfg, os.path.join(out, RECIPE_FILE))
    with open(os.path.join(out, INFO_FILE), encoding="utf-8") as f:
        written = json.load(f)
    from transformers import AutoTokenizer

    written["vocab_size_actual"] = len(AutoTokenizer.from_pretrained(out))
    with open(os.path.join(out, INFO_FILE), "w", encoding="utf-8") as f:
        json.dump(publishable_tokenizer_info(written), f, indent=2, sort_keys=True)
        f.write("\n")
    log(f"tokenizer: {out} ({written['vocab_size_actual']} tokens)")
    return read_tokenizer_info(out)  # with the local facts, as a training run here sees it


# ----------------------------------------------------------------------------- use in training


def tokenizer_for_run(model_cfg, data_cfg, *, data_sha256: str, delta: float | None = None) -> dict:
    """What a training run's tokenizer means for its guarantee; refuses the combinations
    that would make the report wrong.

    Returns ``{"path", "kind", "compose", "release" (the ledger release to compose, or
    None), "summary" (for the report)}``. ``kind``:

    - "external": no ``llmdp_tokenizer.json`` (a pretrained model's tokenizer, say):
      assumed public, not fit on this private data;
    - "public": llmdp's public tokenizer (trained on a generated public corpus);
    - "private-dp": an llmdp DP tokenizer. By default (``model.tokenizer_data: same``) its
      release is composed into the run's guarantee, whatever file it was trained on: a
      different file hash says nothing about whether the two sources share individuals
      (another format, a cleaned copy, a superset). Composing requires the same privacy
      unit. ``model.tokenizer_data: independent`` is the user's declaration that the sources
      share no individuals: the release is not composed, and the summary says so (refused
      when the tokenizer was trained on this very source).

    ``rng`` (private-dp): the tokenizer release's RNG mode; "seeded" carries no guarantee
    against anyone who knows the seed, like a seeded run (`report.seeded_sources`).

    A tokenizer llmdp trained on private data *without* DP (``privacy.dp: false``) is
    refused: a recipe that claims a guarantee cannot use it.
    """
    path = model_cfg.tokenizer
    if path is not None and os.path.isabs(path) and not os.path.exists(path):
        if path == getattr(model_cfg, "name_or_path", None):  # model.tokenizer not set: the model's
            raise ConfigError(
                f"model.name_or_path: {path} does not exist (a local path, so it is not looked "
                f"up on the Hugging Face Hub); fix the path, or give a Hub id like org/name",
                key="model.name_or_path")
        raise ConfigError(
            f"model.tokenizer: {path} does not exist; if it is a private tokenizer, train it "
            f"first with `llmdp tokenizer train tokenizers/<name>.yaml` (its output.dir/name)",
            key="model.tokenizer",
        )
    info = read_tokenizer_info(path)
    out = {"path": path, "kind": "external", "compose": False, "release": None}
    if info is None:
        out["summary"] = ("not made by llmdp (e.g. the pretrained model's own); assumed public: "
                          "not fit on this private data")
        return out
    if info.get("trained_on_private_data") and not info.get("dp"):
        raise ConfigError(
            f"model.tokenizer: {path} was trained on private data WITHOUT differential privacy "
            f"(privacy.dp: false: {info.get('warning', 'exact word counts')}); a recipe that "
            f"claims a guarantee cannot use it. Train one with DP (llmdp tokenizer train "
            f"tokenizers/<name>.yaml, privacy.dp: true) or use a public tokenizer",
            key="model.tokenizer",
        )
    if not info.get("dp"):
        out.update(kind="public", summary="trained by llmdp on a generated public corpus "
                   f"({info.get('generator', 'public text')}); not fit on the private data")
        return out
    priv, tdata = info["privacy"], info["data"]
    out.update(kind="private-dp", info={k: info.get(k) for k in
                                       ("kind", "model_type", "released_words", "vocab_size_actual")})
    if model_cfg.init == "pretrained" and getattr(model_cfg, "base_tokenizer", None) is None:
        raise ConfigError(
            f"model.base_tokenizer: required to fine-tune the pretrained {model_cfg.name_or_path} "
            f"with the private tokenizer {path}: its vocabulary is not the model's. Set "
            f"model.base_tokenizer to the model's own tokenizer (usually the same as "
            f"model.name_or_path) and llmdp re-initializes the embeddings of the new tokens from "
            f"its pieces (a public computation)",
            key="model.base_tokenizer",
        )
    declared = getattr(model_cfg, "tokenizer_data", "same")
    same_source = tdata.get("sha256") == data_sha256
    alone = (f"release {priv['release_id']}: ε_tok = {priv['epsilon']:.4f} at δ = {priv['delta']:.3g}, "
             f"K = {priv['max_words_per_unit']} words per {tdata.get('unit')}")
    out.update(rng=priv.get("rng"), tokenizer_data=declared)
    if declared == "independent":
        if same_source:
            raise ConfigError(
                f"model.tokenizer_data: 'independent', but the private tokenizer {path} was trained "
                f"on this very data source (the same file contents): its release is on the same "
                f"individuals and must be composed. Remove model.tokenizer_data (default 'same')",
                key="model.tokenizer_data",
            )
        out.update(
            composition="not composed: declared independent by model.tokenizer_data",
            summary=(f"trained with DP by `llmdp tokenizer train` on another data source ({alone}); "
                     f"not composed: declared independent by model.tokenizer_data; if the two "
                     f"sources share individuals, the ε add up"))
        return out
    unit = data_cfg.unit
    if tdata.get("unit") != unit or (unit == "user" and tdata.get("user_field") != data_cfg.user_field):
        want = tdata.get("unit") + (f" with data.user_field={tdata.get('user_field')!r}"
                                    if tdata.get("unit") == "user" else "")
        raise ConfigError(
            f"data.unit: {unit!r}, but the private tokenizer {path} (model.tokenizer_data: same) "
            f"was trained on {'this data' if same_source else 'another source that may hold the same individuals'} with "
            f"{tdata.get('unit')!r} units: guarantees for different privacy units do not compose. "
            f"Train with data.unit={want}, or train a tokenizer with data.unit={unit!r}"
            + (" (a tokenizer cannot use sequence units: they are made of its own tokens)"
               if unit == "sequence" else "")
            + ("" if same_source else
               "; if the tokenizer's data source shares no individuals with this one, declare "
               "model.tokenizer_data: independent (its release is then not composed)"),
            key="data.unit",
        )
    d_thr = float(priv["delta_threshold"])
    if delta is not None and not d_thr < delta:
        raise ConfigError(
            f"privacy.delta: {delta:.3g} is not above the {d_thr:.3g} that the tokenizer's "
            f"threshold spends; raise privacy.delta (below 1/N) or retrain the tokenizer with a "
            f"smaller delta",
            key="privacy.delta",
        )
    out.update(
        compose=True,
        release={"event": priv["event"], "count": 1, "extra": priv["extra"],
                 "run_id": priv["run_id"], "release_id": priv["release_id"],
                 "ledger": priv["ledger"], "mechanism": "private-tokenizer",
                 "epsilon": priv["epsilon"], "delta": priv["delta"], "tokenizer": path,
                 "unit": tdata.get("unit"), "dataset_size": tdata.get("num_units"),
                 "rng": priv.get("rng")},
        composition="composed: " + ("trained on this data source" if same_source else
                                    "model.tokenizer_data: same (the default)"),
        summary=(f"trained with DP by `llmdp tokenizer train` ({alone}) on "
                 + ("this data source" if same_source else
                    "another data source, which may share individuals with this one")
                 + "; composed into this run's guarantee (model.tokenizer_data: same"
                 + ("" if same_source else ", the default; declare independent only if the two "
                    "sources share no individuals") + ")"),
    )
    return out


def ensure_release_recorded(release: dict, ledger: dict, meta: dict) -> bool:
    """Make sure the tokenizer's release is in the run's dataset ledger (``ledger``: from
    `llmdp.privacy.ledger.open_dataset_ledger`; it may not be the ledger the tokenizer wrote to:
    another dataset id, another database): append a copy when no record of its run id is
    there. True if a record was appended."""
    from llmdp.privacy.ledger import LedgerDB  # lazy: llmdp.privacy imports torch

    db = LedgerDB(ledger["location"])
    try:
        with db.transaction(ledger["dataset_id"]) as tx:
            if any(r.get("run_id") == release["run_id"] for r in tx.records):
                return False
            tx.append({"kind": "release", "event": release["event"], "count": 1, "first_step": 0,
                       "run_id": release["run_id"], "attempt": "imported",
                       "meta": {**meta, "mechanism": "private-tokenizer",
                                "imported_from": release.get("ledger")},
                       "extra": release["extra"]})
        return True
    finally:
        db.close()
