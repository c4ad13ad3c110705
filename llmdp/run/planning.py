"""Planning a recipe: its data units (training and held-out), the model's facts, the DP
plan and the DP evaluations' plan, and the earlier releases the run composes with.
`plan_run` writes to the shared caches only (unit stores, model files), never to a run
directory or a ledger: `trainer.prepare` builds a run on it, `llmdp sweep` plans trials
with it."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from llmdp._fs import cache_root
from llmdp.config.schema import ConfigError, RecipeConfig, lr_lambda
from llmdp.data import chunks
from llmdp.data.holdout import Holdout
from llmdp.data.sources import source_fingerprint
from llmdp.data.store import UnitSpec, build_store
from llmdp.data.synthetic import ensure_clinical_notes
from llmdp.evaluation.dp import plan_dp_eval
from llmdp.privacy.accounting import calibrate_with_prior, event_to_json
from llmdp.privacy.ledger import check_public_eval
from llmdp.privacy.mechanism import mechanism_config
from llmdp.privacy.plan import check_noise_tail, default_delta, make_plan
from llmdp.record.provenance import merge_priors, starting_model
from llmdp.tokenizer.train import tokenizer_for_run
from llmdp.train.models import load_model

__all__ = ["Planned", "plan_run", "held_out_store", "unit_spec", "holdout_of", "encoding_args"]


@dataclass
class Planned:
    """What planning a recipe decides (`plan_run`), before anything is written to a run
    directory or a ledger: the units, the DP plan, the earlier releases it composes with."""

    cfg: RecipeConfig
    plan: Any  # DPPlan
    store: Any  # the training units (UnitStore)
    unit_spec: UnitSpec
    source_sha: str
    tok_use: dict
    prior_releases: list
    data_stats: dict
    eval_store: Any = None  # the held-out units (UnitStore), or None
    eval_plan: Any = None  # the DP evaluation's plan (llmdp.evaluation.dp.DpEvalPlan), or None
    starting_model: dict | None = None  # llmdp.record.provenance.starting_model (None: random init)
    memory: Any = None  # llmdp.train.memory.MemoryEstimate (plan_run(memory=True)), or None

    def entries(self) -> list:
        """(event, count) of every release the run will make if it completes: the earlier
        releases it builds on, its DP evaluations and its steps (what a sweep composes)."""
        from llmdp.privacy.accounting import release_entries

        prior, _ = release_entries(self.prior_releases)
        evals = self.eval_plan.entries() if self.eval_plan is not None else []
        return prior + evals + [(self.plan.step_event(), self.plan.ledger_steps)]


# data.preprocess auto: corpora of at least this many bytes are built on Ray Data.
AUTO_RAY_BYTES = 1 << 30


def store_builder(d, path, dataset, data_format: str, log=print):
    """The function that builds the unit store of this source: `build_store` in this
    process, or `llmdp.data.sharded.build_store_sharded` on Ray Data (``data.preprocess``;
    ``auto``: Ray Data for a supported local corpus of at least AUTO_RAY_BYTES)."""
    mode = d.preprocess
    if mode == "auto":
        big = dataset is None and chunks.supported_source(path, data_format) is None and \
            (chunks.is_uri(path) or chunks.total_bytes(path) >= AUTO_RAY_BYTES)
        mode = "ray" if big else "local"
    if mode == "local" or dataset is not None or chunks.supported_source(path, data_format):
        return build_store  # (a separate evaluation source Ray Data cannot read: in-process)
    from llmdp.data.sharded import build_store_sharded  # lazy: Ray Data only where used

    def build(cache_dir, *, dataset=None, split=None, config_name=None, num_proc=None, **kw):
        return build_store_sharded(cache_dir, memory_mb=d.preprocess_memory_mb,
                                   workers=d.preprocess_workers, log_fn=log, **kw)

    return build


def unit_spec(d) -> UnitSpec:
    """The privacy units of the recipe's data section ``d`` (``cfg.data``)."""
    return UnitSpec(kind=d.unit, sequence_length=d.sequence_length,
                    max_rows_per_unit=1 if d.unit == "sequence" else d.max_rows_per_unit,
                    document_masking=d.document_masking,
                    user_field=d.user_field if d.unit == "user" else None)


def holdout_of(d) -> Holdout | None:
    """The held-out split of the training source (``data.eval.fraction``), or None."""
    ev = d.eval
    return None if ev is None or ev.fraction is None else \
        Holdout(fraction=ev.fraction, key=ev.split_key, max_units=ev.max_units)


def encoding_args(d) -> dict:
    """How the recipe's records become tokens (the record fields, the chat template)."""
    return dict(text_field=d.text_field, messages_field=d.messages_field,
                prompt_field=d.prompt_field, response_field=d.response_field,
                chat_template=d.chat_template)


def _build_part(d, spec: UnitSpec, tokenizer, source_sha: str, log, part: str):
    """The training units (``part`` "train") or the held-out units ("eval": the split of the
    training source, or a separate evaluation source) in the shared unit cache."""
    units_dir = os.path.join(cache_root(), "units")
    source_args = dict(**encoding_args(d), num_proc=d.num_proc, on_bad_record=d.on_bad_record)
    holdout, ev = holdout_of(d), d.eval
    if part == "train" or holdout is not None:  # the split: both parts from one build
        return store_builder(d, d.path, d.dataset, d.format, log)(
            units_dir, tokenizer=tokenizer, spec=spec, data_path=d.path, dataset=d.dataset,
            data_format=d.format, split=d.split, config_name=d.config_name,
            unit_fraction=d.unit_fraction, source_sha256=source_sha, text_split=d.text_split,
            holdout=holdout, part=part, **source_args)
    # a separate source: every unit is evaluated (up to max_units)
    return store_builder(d, ev.path, ev.dataset, ev.format, log)(
        units_dir, tokenizer=tokenizer, spec=spec, data_path=ev.path, dataset=ev.dataset,
        data_format=ev.format, split=ev.split, config_name=ev.config_name,
        text_split=d.text_split, part="eval",
        holdout=Holdout(fraction=1.0, key=ev.split_key, max_units=ev.max_units), **source_args)


def held_out_store(cfg: RecipeConfig, tokenizer, part: str = "eval", log=print):
    """A planned run's held-out units (``part`` "eval") or training units ("train"), as the
    run built them (the same fingerprint: read from the shared cache, or built again), or
    None when the recipe holds nothing out. Private data: what is computed on them is
    internal unless it is privatized."""
    d = cfg.data
    if part == "eval" and d.eval is None:
        return None
    source_sha = source_fingerprint(path=d.path, dataset=d.dataset, split=d.split,
                                    config_name=d.config_name, format=d.format)
    return _build_part(d, unit_spec(d), tokenizer, source_sha, log, part)


def plan_run(cfg: RecipeConfig, log=print, augment=None, memory: bool = False) -> Planned:
    """Data units, model facts and the DP plan of ``cfg`` (shared caches only: nothing is
    written to the run directory or to a ledger). ``augment(store, tokenizer) -> store``
    (``llmdp audit``) returns the training store with the canaries its keyed coins
    included, as units of their own; N, q and σ are then planned for that store.
    ``memory``: also estimate the memory per worker (``llmdp.train.memory``; the dry run)."""
    chunks.check_preprocess(cfg.data)  # Ray Data can build the corpus, when it must
    cache = cache_root()
    os.makedirs(cache, exist_ok=True)
    if cfg.data.synthetic is not None and not os.path.exists(cfg.data.path):

        kind = "public (declared: data.public)" if cfg.data.public else "private"
        log(f"generating {cfg.data.synthetic.num_documents} synthetic {kind} documents -> {cfg.data.path}")
        ensure_clinical_notes(cfg.data.path, cfg.data.synthetic.num_documents, cfg.data.synthetic.seed)

    # What the tokenizer means for the guarantee, before anything is built with it: a
    # tokenizer fit on this data without DP is refused; a DP one on this data is composed.

    d = cfg.data
    source_sha = source_fingerprint(path=d.path, dataset=d.dataset, split=d.split,
                                    config_name=d.config_name, format=d.format)
    tok_use = tokenizer_for_run(cfg.model, d, data_sha256=source_sha, delta=cfg.privacy.delta)
    # A separate evaluation source declared public is not private data (nothing written).
    check_public_eval(d.eval, d, source_sha, cfg.privacy.ledger, log=log)
    # What the starting model means for the guarantee: a baseline's is refused, a DP run's on
    # this data is composed (its releases), any other is named (llmdp.record.provenance).
    start = starting_model(cfg.model, d, dp=cfg.privacy.dp, ledger_opt=cfg.privacy.ledger)

    if cfg.model.init == "tiny" and cfg.model.lora is not None:
        log("warning: model.lora on model.init: tiny trains adapters on a RANDOMLY initialised "
            "base model: useful to test the pipeline, not to fine-tune; set model.name_or_path "
            "to a pretrained model (model.init: pretrained)")
    model, tokenizer = load_model(cfg.model, cache_dir=os.path.join(cache, "models"))
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tok_use["vocab_adaptation"] = getattr(model, "llmdp_vocab_adaptation", None)
    tok_use["vocab_size"] = len(tokenizer)
    mem = None
    if memory:
        from llmdp.train.memory import estimate_memory

        mem = estimate_memory(model, cfg)  # moves the model to the meta device
    del model

    spec = unit_spec(d)
    store = _build_part(d, spec, tokenizer, source_sha, log, "train")
    _check_encoding(store, tokenizer, cfg.model)  # before anything is planned on it
    if augment is not None:
        store = augment(store, tokenizer)
    eval_store = None if d.eval is None else _build_part(d, spec, tokenizer, source_sha, log, "eval")
    N = store.num_units
    if cfg.train.expected_batch_size > N:

        raise ConfigError(
            f"train.expected_batch_size: {cfg.train.expected_batch_size} is more than the {N} "
            f"{spec.kind} units of the corpus (data.unit={spec.kind!r}); lower it below N "
            f"(a sampling probability q = B/N of at most 1)",
            key="train.expected_batch_size",
        )
    priv = cfg.privacy  # privacy.dp false: a NON-PRIVATE baseline; σ is not calibrated
    # privacy.simulate: σ is the private run's, planned for its N (simulate_units), below
    planned_n = priv.simulate_units or N  # (config/checks: only with privacy.simulate)
    if priv.dp and cfg.privacy.delta is None:
        _default_delta_or_refuse(planned_n, spec.kind, log)
    plan = make_plan(
        dataset_size=planned_n,
        expected_batch_size=cfg.train.expected_batch_size,
        max_grad_norm=cfg.privacy.max_grad_norm,
        steps=cfg.train.steps,
        epochs=cfg.train.epochs,
        delta=cfg.privacy.delta,
        target_epsilon=priv.target_epsilon if priv.dp else None,
        noise_multiplier=priv.noise_multiplier if priv.dp else None,
        accountant=cfg.privacy.accountant,
        max_noise_multiplier=cfg.privacy.max_noise_multiplier,
        sampler=cfg.privacy.sampler,
        max_batch_size=cfg.privacy.max_batch_size,
        dp=priv.dp,
        # the noise coordinates of a step: the generator's tails are folded into δ
        noise_coordinates=n_train if priv.dp else None,
        mechanism=_mechanism(cfg, cache),
    )
    prior_releases = [tok_use["release"]] if tok_use["compose"] and priv.dp else []
    if start is not None and start["composed"]:
        prior_releases = merge_priors(prior_releases, start)
        plan = dataclasses.replace(plan, prior_noise=tuple(start["prior_noise"]) or None)
    eval_plan = _dp_eval_plan(cfg, plan, len(tokenizer)) if eval_store is not None and priv.dp \
        else None
    if eval_plan is not None:  # their noise tails are folded into δ with the steps'
        plan = dataclasses.replace(plan, eval_noise=eval_plan.noise())
    if prior_releases or eval_plan is not None:
        # The model's guarantee covers the tokenizer and the DP evaluations too: sigma is
        # calibrated so that the composition (tokenizer release + DP evaluations + every
        # step) meets privacy.target_epsilon.
        planned_evals = [] if eval_plan is None else [
            {"event": event_to_json(eval_plan.event()), "count": eval_plan.releases}]
        plan = check_noise_tail(calibrate_with_prior(plan, prior_releases + planned_evals))
    if priv.simulate:  # the private run's σ, on this corpus; no DP evaluation runs
        plan, eval_plan, prior_releases = simulated_plan(plan, N, cfg, cache), None, []
    data_stats = dict(store.stats())
    data_stats.update({"parameters_total": n_params, "parameters_trainable": n_train})
    if eval_store is not None:
        data_stats["eval_units"] = eval_store.num_units
    if eval_plan is not None:
        _check_dp_eval_noise(cfg, eval_plan, eval_store.num_units, log)
    return Planned(cfg=cfg, plan=plan, store=store, unit_spec=spec, source_sha=source_sha,
                   tok_use=tok_use, prior_releases=prior_releases, data_stats=data_stats,
                   eval_store=eval_store, eval_plan=eval_plan, starting_model=start, memory=mem)


def simulated_plan(private, N: int, cfg: RecipeConfig, cache: str):
    """A simulated run's plan (``privacy.simulate``, a public proxy of a private run): the
    private run's plan ``private`` (σ calibrated for its N, ``privacy.simulate_units``, with
    its DP evaluations) with this corpus's N, so that each step draws B units of it on
    average (q = B/N) and adds the private run's noise: σ, C, B, T and the mechanism are
    the private run's, and so is the noise-to-signal ratio σC/B of every step. Its ε is
    not the private run's and is never reported (nothing is released: the data is public)."""
    return make_plan(
        dataset_size=N, expected_batch_size=cfg.train.expected_batch_size,
        max_grad_norm=private.max_grad_norm, steps=private.steps,
        delta=min(private.delta, default_delta(N)), noise_multiplier=private.noise_multiplier,
        accountant=private.accountant, sampler=private.sampler,
        max_batch_size=private.max_batch_size, noise_coordinates=private.noise_coordinates,
        mechanism=_mechanism(cfg, cache))


# A tokenizer that encodes more than this share of the data's tokens as its unknown token
# cannot represent the data: the model would learn (almost) nothing from it.
MAX_UNKNOWN_SHARE = 0.5
_ENCODING_SAMPLE = 1 << 22  # tokens read (spread over the store) to tell


def _check_encoding(store, tokenizer, model_cfg) -> None:
    """Refuse (before any ledger is opened) a tokenizer that cannot encode the data: its
    units hold no token but special ones, or mostly its unknown token."""
    import numpy as np

    own = model_cfg.tokenizer not in (None, model_cfg.name_or_path)
    key = "model.tokenizer" if own else "model.name_or_path"
    value = model_cfg.tokenizer if own else (model_cfg.name_or_path or model_cfg.tokenizer)
    tokens = store.token_sample(_ENCODING_SAMPLE)
    unk = tokenizer.unk_token_id
    special = np.asarray([i for i in tokenizer.all_special_ids if i != unk], dtype=np.int64)
    content = tokens[~np.isin(tokens, special)]
    unknown = int((content == unk).sum()) if unk is not None else 0
    if content.size and unknown <= MAX_UNKNOWN_SHARE * content.size:
        return
    what = ("no token but special ones (end of text, padding)" if not content.size else
            f"mostly its unknown token {tokenizer.unk_token!r} ({unknown / content.size:.0%} of "
            f"the tokens read)")
    fix = ("copy the model's own tokenizer files into that folder, or set model.tokenizer to "
           "the model's tokenizer" if key == "model.name_or_path" else
           "set model.tokenizer to a tokenizer made for this kind of text (the model's own)")
    raise ConfigError(
        f"{key}: the tokenizer of {value!r} encodes the data as {what}: the run would train on "
        f"(almost) nothing and still spend its ε. Fix: {fix}", key=key)


def _mechanism(cfg: RecipeConfig, cache: str):
    """make_plan's mechanism config (`llmdp.privacy.mechanism`): its fields read by name from
    ``privacy`` (bands, cycle, buffers). A correlated mechanism's strategy is optimized for the
    workload the optimizer runs: SGD with momentum β and the learning-rate schedule's
    multipliers (A[t, j] = Σ_{i=j..t} η_i β^(i−j)); for AdamW, whose update is a
    per-coordinate rescaling of the noisy gradients' moving averages, the prefix-sum workload
    (a post-processing of the same release: the guarantee is the same, the strategy is then
    optimal for SGD's cumulative sums, not proven optimal for Adam)."""
    sgd = cfg.optim.name == "sgd"

    def lrs(total: int) -> list[float]:
        f = lr_lambda(cfg.optim, total)
        return [float(f(t)) for t in range(total)]

    return mechanism_config(cfg.privacy.mechanism, cfg.privacy,
                            momentum=float(cfg.optim.momentum) if sgd else 0.0,
                            learning_rates=lrs if sgd else None,
                            strategy_cache=os.path.join(cache, "mf"))


# The smallest corpus for which llmdp picks δ itself (a power of ten below 1/(10 N): 1e-4 at
# N = 100). Below it a default δ would be 1e-3 or larger, a guarantee that allows one unit in
# a thousand to be published in the clear: the user must choose δ knowingly (privacy.delta).
MIN_UNITS_FOR_DEFAULT_DELTA = 100


def _default_delta_or_refuse(n: int, kind: str, log) -> None:
    from llmdp.privacy.plan import default_delta

    if n < MIN_UNITS_FOR_DEFAULT_DELTA:
        raise ConfigError(
            f"privacy.delta: not set, and the corpus has only N = {n} {kind} unit(s), fewer than "
            f"{MIN_UNITS_FOR_DEFAULT_DELTA}: llmdp picks δ itself only from N = "
            f"{MIN_UNITS_FOR_DEFAULT_DELTA} on (δ would be {default_delta(n):g} here, far too "
            f"weak to state by default). Add data, or set privacy.delta yourself, well below "
            f"1/N = {1 / n:.3g}", key="privacy.delta")
    log(f"privacy.delta not set: δ = {default_delta(n):g} (the largest power of ten below "
        f"1/(10 N) for N = {n} {kind} units); set privacy.delta to choose it")


def _check_dp_eval_noise(cfg: RecipeConfig, eval_plan, units: int, log) -> None:
    """State each DP metric's expected noise std (the operator's console: internal) and
    refuse a plan whose releases would be mostly noise, unless ``eval.allow_noisy``."""
    from llmdp.evaluation.dp import NOISY_EVAL_FRACTION

    sd = eval_plan.expected_std(units)
    noised = "" if "loss_range" not in sd else (
        f"; the count is noised: a release divides by the noised count, so the std it states is "
        f"loss ± {sd['loss_range'][0]:.3g} to ± {sd['loss_range'][1]:.3g}, accuracy ± "
        f"{sd['accuracy_range'][0]:.3g} to ± {sd['accuracy_range'][1]:.3g} (95% of releases)")
    log(f"DP evaluation: {eval_plan.releases} release(s), noise multiplier "
        f"{eval_plan.noise_multiplier:.3g}; expected std: loss ± {sd['loss']:.3g} (of [0, "
        f"{eval_plan.loss_bound:.3g}]), accuracy ± {sd['accuracy']:.3g} (of [0, 1]), "
        f"{sd['fraction_of_range']:.1%} of each range{noised}")
    if sd["fraction_of_range"] <= NOISY_EVAL_FRACTION or cfg.eval.allow_noisy:
        return
    need = math.ceil(eval_plan.noise_std / NOISY_EVAL_FRACTION)
    if eval_plan.count == "public":  # the count is published as is: it may be named
        why = (f"with {units} held-out unit(s) its std is ± {sd['loss']:.3g} on a loss in [0, "
               f"{eval_plan.loss_bound:.3g}] and ± {sd['accuracy']:.3g} on an accuracy in [0, 1] "
               f"({sd['fraction_of_range']:.0%} of each range; at most "
               f"{NOISY_EVAL_FRACTION:.0%} is allowed)")
    else:  # eval.count: noised keeps the count private: neither it nor a std made from it
        why = (f"its std (noise std {eval_plan.noise_std:.3g} divided by the held-out count, "
               f"which eval.count: noised keeps private and this message does not state) is "
               f"above {NOISY_EVAL_FRACTION:.0%} of each metric's range, which needs at least "
               f"{need} held-out units")
    raise ConfigError(
        f"eval: the DP evaluation would be mostly noise: {why}. Hold out at least {need} units "
        f"(data.eval.fraction, or a larger data.eval source), release fewer DP evaluations "
        f"(eval.steps), raise eval.epsilon, or set eval.allow_noisy: true to release it anyway",
        key="eval.epsilon")


def _dp_eval_plan(cfg: RecipeConfig, plan, vocab_size: int):
    """The DP evaluations' plan (``eval.epsilon`` / ``eval.noise_multiplier``), or None."""
    e = cfg.eval
    if e.epsilon is None and e.noise_multiplier is None:
        return None
    if e.epsilon is not None and plan.target_epsilon is not None and e.epsilon >= plan.target_epsilon:
        raise ConfigError(
            f"eval.epsilon: {e.epsilon:g} is not below privacy.target_epsilon "
            f"({plan.target_epsilon:g}), which covers the DP evaluations and the training "
            f"together; lower eval.epsilon (e.g. to a tenth of the target)", key="eval.epsilon")
    return plan_dp_eval(epsilon=e.epsilon, noise_multiplier=e.noise_multiplier, steps=e.steps,
                        total_steps=plan.steps, delta=plan.delta, accountant=plan.accountant,
                        loss_bound=e.loss_bound or math.log(max(2, vocab_size)), count=e.count)


def warn_open(cfg: RecipeConfig, log) -> None:
    """A run folder, unit cache or ledger that exists with wider permissions than llmdp
    gives them (an older version's, or changed by hand): said at launch, with the fix."""
    from llmdp._fs import fix_command, too_open
    from llmdp.privacy.ledger import is_url, llmdp_home, resolve_location

    group = cfg.output.group_readable
    where = [cfg.run_dir, os.path.join(cache_root(), "units")]
    ledger = resolve_location(cfg.privacy.ledger)
    if not is_url(ledger):
        where += [ledger, os.path.join(llmdp_home(), "heads")]
    found = [p for w in where for p in too_open(w, group)[:1]]
    if found:
        log(f"warning: private data readable by others: {', '.join(found)} (and maybe more "
            f"below). Fix: {fix_command([w for w in where if too_open(w, group)], group)}")
