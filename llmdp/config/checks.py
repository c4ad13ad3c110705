"""The checks of a recipe that involve two fields or two sections (:mod:`llmdp.config.schema`).

A single field's checks (type, choices, bounds, paths) are declared with the field, in the
schema's dataclasses; what only a combination of fields can get wrong is checked here: one
function per dataclass, which `llmdp.config.load.build` calls on each instance it builds
(after its fields), with the instance, its dotted prefix (for the messages) and the
directory relative paths resolve against. Each returns the instance, possibly completed
(e.g. ``model.tokenizer`` defaults to ``model.name_or_path``), or raises one
:class:`~llmdp.config.validate.ConfigError` naming the key to change. Which function checks which
dataclass is ``llmdp.config.schema._CHECKS``; the functions read attributes only, so nothing here
imports the schema.
"""

from __future__ import annotations

import dataclasses

from llmdp.config.choices import Accountant, Mechanism, Sampler, mechanism_problem
from llmdp.config.validate import ConfigError, check_exactly_one


def check_tiny(t, prefix: str, base_dir: str):
    """``model.tiny``, a `TinyModelConfig`: the heads divide the sizes."""
    if t.hidden_size % t.num_heads:
        raise ConfigError(
            f"{prefix}.hidden_size: {t.hidden_size} is not divisible by "
            f"{prefix}.num_heads ({t.num_heads})",
            key=f"{prefix}.hidden_size",
        )
    if t.num_heads % t.num_kv_heads:
        raise ConfigError(
            f"{prefix}.num_kv_heads: {t.num_kv_heads} does not divide "
            f"{prefix}.num_heads ({t.num_heads})",
            key=f"{prefix}.num_kv_heads",
        )
    return t


def check_logging(g, prefix: str, base_dir: str):
    """``logging``: the backend's package is installed (found, not imported: the run's
    rank 0 imports it); it is an optional extra."""
    import importlib.util

    # mlflow's SQLite store (llmdp.train.explog) needs SQLAlchemy and Alembic besides the client
    needs = {"tensorboard": ("tensorboard",),
             "mlflow": ("mlflow", "sqlalchemy", "alembic")}.get(g.backend, ())
    missing = [p for p in needs if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(
            f"{prefix}.backend: {g.backend!r} needs the Python package(s) "
            f"{', '.join(missing)}, not installed; install with `pip install 'llmdp[{g.backend}]'`, or remove "
            f"{prefix}.backend (metrics.jsonl is written either way)",
            key=f"{prefix}.backend",
        )
    return g


def check_model(m, prefix: str, base_dir: str):
    """``model``, a `ModelConfig`: what init needs; ``tokenizer`` defaults to the model."""
    if m.init == "pretrained" and m.name_or_path is None:
        raise ConfigError(
            f"{prefix}.name_or_path: required when {prefix}.init is 'pretrained' (a hub id "
            f"or a local model directory); or set {prefix}.init: tiny to build a small "
            f"model from {prefix}.tiny",
            key=f"{prefix}.name_or_path",
        )
    if m.init == "tiny" and m.tokenizer is None:
        raise ConfigError(
            f"{prefix}.tokenizer: required when {prefix}.init is 'tiny' (a model built "
            f"from a config has no tokenizer of its own); give a hub id or a local "
            f"tokenizer directory",
            key=f"{prefix}.tokenizer",
        )
    if m.base_tokenizer is not None and m.init != "pretrained":
        raise ConfigError(
            f"{prefix}.base_tokenizer: {m.base_tokenizer!r} adapts a pretrained model to "
            f"{prefix}.tokenizer, but {prefix}.init is {m.init!r} (a model built from a config "
            f"is sized to its tokenizer already); remove it",
            key=f"{prefix}.base_tokenizer",
        )
    if m.tokenizer is None:
        m = dataclasses.replace(m, tokenizer=m.name_or_path)
    return m


def _check_source(d, prefix: str) -> None:
    """The checks of a `SourceConfig`: a training and a tokenizer recipe's `data`."""
    if d.distinct_from and not d.distinct_reason:
        raise ConfigError(
            f"{prefix}.distinct_from needs {prefix}.distinct_reason: say why the data of "
            f"{', '.join(d.distinct_from)} is about other individuals (it is recorded in the new "
            f"dataset ledger)", key=f"{prefix}.distinct_reason")
    if d.distinct_reason and not d.distinct_from:
        raise ConfigError(f"{prefix}.distinct_reason is for {prefix}.distinct_from (the ledgers "
                          f"this data is declared distinct from): set both, or remove it",
                          key=f"{prefix}.distinct_reason")
    if (d.path is None) == (d.dataset is None):
        got = "both" if d.path is not None else "neither"
        raise ConfigError(
            f"{prefix}.path / {prefix}.dataset: give exactly one data source, got {got} "
            f"(path={d.path!r}, dataset={d.dataset!r}); path is a local file or folder, "
            f"dataset a Hub dataset name",
            key=f"{prefix}.path",
        )
    if (d.prompt_field is None) != (d.response_field is None):
        missing = "response_field" if d.response_field is None else "prompt_field"
        raise ConfigError(
            f"{prefix}.{missing}: instruction records need both {prefix}.prompt_field and "
            f"{prefix}.response_field (got prompt_field={d.prompt_field!r}, "
            f"response_field={d.response_field!r})",
            key=f"{prefix}.{missing}",
        )
    if d.unit == "user" and d.user_field is None:
        raise ConfigError(
            f"{prefix}.user_field: required with {prefix}.unit 'user': the record field that "
            f"identifies the user (e.g. user_field: user_id)",
            key=f"{prefix}.user_field",
        )
    if d.path is not None and "://" in d.path:
        mode = getattr(d, "preprocess", None)
        if mode not in ("ray", "auto") or d.synthetic is not None:
            why = ("a training recipe's data.preprocess: ray (or auto) reads it"
                   if mode is None else f"{prefix}.preprocess: {mode!r} reads local files")
            raise ConfigError(
                f"{prefix}.path: {d.path!r} is a URI; only the unit store built on Ray Data "
                f"reads files through pyarrow's filesystems, and {why}: set "
                f"{prefix}.preprocess: ray, or copy the corpus to local storage",
                key=f"{prefix}.path")
    if d.synthetic is not None and d.path is None:
        raise ConfigError(
            f"{prefix}.synthetic: needs {prefix}.path (where the synthetic corpus is written)",
            key=f"{prefix}.synthetic",
        )


def check_data(d, prefix: str, base_dir: str):
    """A training recipe's ``data``, a `DataConfig`: record shape, unit bound, source."""
    if d.messages_field is not None and d.prompt_field is not None:
        raise ConfigError(
            f"{prefix}.messages_field: {d.messages_field!r} and {prefix}.prompt_field "
            f"{d.prompt_field!r} both set; a record is either a chat (messages_field) or an "
            f"instruction pair (prompt_field + response_field)",
            key=f"{prefix}.messages_field",
        )
    if d.unit != "sequence" and d.max_rows_per_unit is None:
        raise ConfigError(
            f"{prefix}.max_rows_per_unit: required with {prefix}.unit {d.unit!r}: the contribution "
            f"bound, in rows of {prefix}.sequence_length tokens, of one {d.unit} (longer ones are "
            f"truncated), e.g. max_rows_per_unit: 4",
            key=f"{prefix}.max_rows_per_unit",
        )
    if d.unit == "document" and d.document_masking:
        raise ConfigError(
            f"{prefix}.document_masking: true has no effect with {prefix}.unit 'document' "
            f"(a document unit is never packed with another document); remove it",
            key=f"{prefix}.document_masking",
        )
    if d.max_units is not None:
        raise ConfigError(
            f"{prefix}.max_units: {d.max_units!r} is no longer supported: keeping the first "
            f"max_units units lets one added unit evict another, so the guarantee relative to "
            f"the corpus would be replace-one, not the add/remove-one it is accounted under. "
            f"For a quick run on part of the corpus set {prefix}.unit_fraction (e.g. 0.1: each "
            f"unit kept independently, by a keyed hash of its own content) and remove "
            f"{prefix}.max_units",
            key=f"{prefix}.max_units",
        )
    _check_source(d, prefix)
    # Whether Ray Data can build the corpus (data.preprocess: ray, or a URI) reads its file
    # list: `llmdp.data.chunks.check_preprocess`, when the run is planned.
    return d


def _check_rng_seed(p, prefix: str) -> None:
    """``rng`` and ``seed`` of a `PrivacyConfig` or a `TokenizerPrivacyConfig`."""
    if p.rng == "seeded" and p.seed is None:
        raise ConfigError(
            f"{prefix}.seed: required when {prefix}.rng is 'seeded'",
            key=f"{prefix}.seed",
        )
    if p.rng == "secure" and p.seed is not None:
        raise ConfigError(
            f"{prefix}.seed: {p.seed!r} is given but {prefix}.rng is 'secure', which draws "
            f"sampling and noise from fresh OS entropy; set {prefix}.seed: null, or set "
            f"{prefix}.rng: seeded for a reproducible run (whose report then carries no "
            f"guarantee against anyone who knows the seed)",
            key=f"{prefix}.seed",
        )


def check_privacy(p, prefix: str, base_dir: str):
    """``privacy``, a `PrivacyConfig`: one of ε / σ (unless dp is false), rng and seed,
    sampler and accountant."""
    if p.dp:
        check_exactly_one(
            {
                f"{prefix}.target_epsilon": p.target_epsilon,
                f"{prefix}.noise_multiplier": p.noise_multiplier,
            }
        )
    elif p.budget_epsilon is not None:
        raise ConfigError(
            f"{prefix}.budget_epsilon: {p.budget_epsilon:g} is set but {prefix}.dp is false: a "
            f"non-private baseline spends no budget and is recorded in no ledger; remove one",
            key=f"{prefix}.budget_epsilon",
        )
    elif p.sampler == Sampler.TRUNCATED_POISSON and p.max_batch_size is None:
        raise ConfigError(
            f"{prefix}.max_batch_size: required with {prefix}.sampler 'truncated-poisson' when "
            f"{prefix}.dp is false: the cap is otherwise chosen by its ε cost, which a "
            f"non-private baseline does not have; set it to the DP run's cap (its report's "
            f"max_batch_size)",
            key=f"{prefix}.max_batch_size",
        )
    _check_rng_seed(p, prefix)
    if p.max_batch_size is not None and p.sampler != Sampler.TRUNCATED_POISSON:
        raise ConfigError(
            f"{prefix}.max_batch_size: {p.max_batch_size} is only used with {prefix}.sampler "
            f"'truncated-poisson' (sampler is {p.sampler!r}); remove it or set "
            f"sampler: truncated-poisson",
            key=f"{prefix}.max_batch_size",
        )
    if p.sampler == Sampler.TRUNCATED_POISSON and p.accountant != Accountant.PLD:
        raise ConfigError(
            f"{prefix}.accountant: {p.accountant!r} cannot account {prefix}.sampler "
            f"'truncated-poisson' (dp-accounting supports the truncated event only in its PLD "
            f"accountant); set accountant: pld or sampler: poisson",
            key=f"{prefix}.accountant",
        )
    _check_mechanism(p, prefix)
    return p


def _check_mechanism(p, prefix: str) -> None:
    """A correlated mechanism only with a sampler its analysis covers (DESIGN, invariant `sampling-as-accounted`)."""
    problem = mechanism_problem(p.mechanism, p.sampler, bands=p.bands, cycle=p.cycle, dp=p.dp)
    if problem is not None:
        message, field = problem
        raise ConfigError(f"{prefix}.{field}: {message}", key=f"{prefix}.{field}")


def check_eval_data(e, prefix: str, base_dir: str):
    """``data.eval``, an `EvalDataConfig`: a held-out fraction or a declared source."""
    source = e.path is not None or e.dataset is not None
    if e.path is not None and e.dataset is not None:
        raise ConfigError(
            f"{prefix}.path / {prefix}.dataset: give one evaluation source, not both "
            f"(path={e.path!r}, dataset={e.dataset!r})", key=f"{prefix}.path")
    if (e.fraction is None) == (not source):
        got = "both" if source else "neither"
        raise ConfigError(
            f"{prefix}.fraction / {prefix}.path: held-out data is either a fraction of the "
            f"private corpus held out by privacy unit (e.g. {prefix}.fraction: 0.05) or a "
            f"separate source ({prefix}.path or {prefix}.dataset, with {prefix}.public); got {got}",
            key=f"{prefix}.fraction")
    if source and e.public is None:
        raise ConfigError(
            f"{prefix}.public: required with a separate evaluation source: true if the data is "
            f"public (its metrics are published as they are), false if it is private (about the "
            f"same individuals as data; metrics internal unless released with DP)",
            key=f"{prefix}.public")
    if e.dataset_id is not None and not (source and e.public is False):
        raise ConfigError(
            f"{prefix}.dataset_id: {e.dataset_id!r} names the dataset ledger of a separate private "
            f"evaluation source ({prefix}.path or {prefix}.dataset with {prefix}.public: false); "
            f"held-out units of the corpus are in data.dataset_id's ledger, and public data has "
            f"none: remove it", key=f"{prefix}.dataset_id")
    if e.fraction is not None and e.public is not None:
        raise ConfigError(
            f"{prefix}.public: {e.public!r} is only for a separate source; units held out of the "
            f"private corpus ({prefix}.fraction) are private; remove it", key=f"{prefix}.public")
    return e


def check_eval(e, prefix: str, base_dir: str):
    """``eval``, an `EvalConfig`: at most one of ε / σ; steps only with a DP evaluation."""
    if e.epsilon is not None and e.noise_multiplier is not None:
        check_exactly_one({f"{prefix}.epsilon": e.epsilon,
                           f"{prefix}.noise_multiplier": e.noise_multiplier})
    if e.steps and e.epsilon is None and e.noise_multiplier is None:
        raise ConfigError(
            f"{prefix}.steps: {list(e.steps)} asks for DP evaluations, but neither "
            f"{prefix}.epsilon nor {prefix}.noise_multiplier is set; set one (e.g. "
            f"{prefix}.epsilon: 0.5) or remove {prefix}.steps", key=f"{prefix}.steps")
    if len(set(e.steps)) != len(e.steps):
        raise ConfigError(f"{prefix}.steps: {list(e.steps)} repeats a step; list each once",
                          key=f"{prefix}.steps")
    if any(not p.strip() for p in e.prompts):
        raise ConfigError(f"{prefix}.prompts: an empty prompt; give non-empty strings",
                          key=f"{prefix}.prompts")
    return e


def check_sweep(s, prefix: str, base_dir: str):
    """``sweep``, a `SweepConfig`: grid entries are key=values; random needs its mean."""
    for i, g in enumerate(s.grid):
        key, eq, values = g.partition("=")
        if not eq or not key.strip() or not values.strip():
            raise ConfigError(
                f"{prefix}.grid[{i}]: {g!r} is not key=v1,v2,... (e.g. 'optim.lr=1e-3,3e-3')",
                key=f"{prefix}.grid")
    if s.trials == "random" and s.mean_trials is None:
        raise ConfigError(
            f"{prefix}.mean_trials: required with {prefix}.trials 'random' (the expected number "
            f"of trials, e.g. 4)", key=f"{prefix}.mean_trials")
    if s.trials == "grid" and s.mean_trials is not None:
        raise ConfigError(
            f"{prefix}.mean_trials: {s.mean_trials:g} is only used with {prefix}.trials "
            f"'random'; remove it or set trials: random", key=f"{prefix}.mean_trials")
    return s


def check_train(t, prefix: str, base_dir: str):
    """``train``, a `TrainConfig`: exactly one of steps / epochs."""
    check_exactly_one({f"{prefix}.steps": t.steps, f"{prefix}.epochs": t.epochs})
    return t


def check_output(o, prefix: str, base_dir: str):
    """``output``, an `OutputConfig`: a run name that stays inside ``output.dir``."""
    if o.name in (".", ".."):
        raise ConfigError(
            f"{prefix}.name: {o.name!r} is not a run name; it would point outside {prefix}.dir",
            key=f"{prefix}.name",
        )
    return o


def check_recipe(r, prefix: str, base_dir: str):
    """A `RecipeConfig`: the checks across sections (warmup, positions, rows per unit)."""
    if r.train.steps is not None and r.optim.warmup_steps >= r.train.steps:
        raise ConfigError(
            f"optim.warmup_steps: {r.optim.warmup_steps} must be less than train.steps "
            f"({r.train.steps}); lower optim.warmup_steps, or set optim.warmup_steps=0 and "
            f"optim.warmup_ratio (e.g. 0.2) so that warmup scales with train.steps",
            key="optim.warmup_steps",
        )
    if r.model.init == "tiny" and r.model.tiny.max_position_embeddings < r.data.sequence_length:
        raise ConfigError(
            f"model.tiny.max_position_embeddings: {r.model.tiny.max_position_embeddings} is "
            f"less than data.sequence_length ({r.data.sequence_length}); the model could "
            f"not embed positions that far",
            key="model.tiny.max_position_embeddings",
        )
    if r.optim.name == "dp-adambc" and r.privacy.dp and r.privacy.mechanism != Mechanism.DP_SGD:
        raise ConfigError(
            f"optim.name: dp-adambc removes DP-SGD's noise variance (σC/B)² from Adam's second "
            f"moment; privacy.mechanism: {r.privacy.mechanism} adds correlated noise whose "
            f"per-step variance is not that: use optim.name: adamw or sgd with "
            f"{r.privacy.mechanism}, or privacy.mechanism: dp-sgd with dp-adambc",
            key="optim.name")
    _check_eval_recipe(r)
    _check_public_recipe(r)
    _check_baseline_recipe(r)
    rows = 1 if r.data.unit == "sequence" else r.data.max_rows_per_unit
    if rows > r.train.physical_batch_size:
        raise ConfigError(
            f"train.physical_batch_size: {r.train.physical_batch_size} is less than "
            f"data.max_rows_per_unit ({rows}); a unit's rows are clipped together, so they must "
            f"fit in one micro-batch: raise physical_batch_size or lower max_rows_per_unit",
            key="train.physical_batch_size",
        )
    return r


def _check_public_recipe(r) -> None:
    """A run on data the recipe declares public (data.public: true) trains without DP, and
    says so twice: privacy.dp: false as well."""
    d = r.data
    if d.public_override_ledger and not d.public:
        raise ConfigError(
            "data.public_override_ledger: true is only for a source declared public "
            "(data.public: true); remove it", key="data.public_override_ledger")
    p = r.privacy
    if p.simulate_units is not None and not p.simulate:
        raise ConfigError(
            f"privacy.simulate_units: {p.simulate_units} is only for a simulated run "
            f"(privacy.simulate: true); remove it", key="privacy.simulate_units")
    if p.simulate:
        _check_simulated_recipe(r)
        return
    if d.public and p.dp:
        raise ConfigError(
            "data.public: true declares the training data public, and a run on public data "
            "trains without DP: set privacy.dp: false as well (no DP recipe turns non-private "
            "by one setting), or privacy.simulate: true to simulate a private run's DP noise on "
            "it (nothing spent), or remove data.public to train with DP", key="privacy.dp")


def _check_simulated_recipe(r) -> None:
    """privacy.simulate: true runs the DP mechanism on data declared public and records
    nothing: only with data.public: true and privacy.dp: true, never exported, no budget."""
    p = r.privacy
    if not r.data.public:
        raise ConfigError(
            "privacy.simulate: true simulates DP on data declared public and records nothing "
            "in any ledger; this recipe's data is not declared public (data.public), so its "
            "run must be a real DP run: remove privacy.simulate (or set data.public: true for "
            "a public proxy corpus)", key="privacy.simulate")
    if not p.dp:
        raise ConfigError(
            "privacy.simulate: true simulates the DP mechanism, but privacy.dp is false (no "
            "clipping, no noise): set privacy.dp: true, or remove privacy.simulate",
            key="privacy.simulate")
    if p.budget_epsilon is not None:
        raise ConfigError(
            f"privacy.budget_epsilon: {p.budget_epsilon:g} with privacy.simulate: true: a "
            f"simulated run spends nothing and opens no ledger; remove it",
            key="privacy.budget_epsilon")
    if r.output.push_to is not None:
        raise ConfigError(
            f"output.push_to: {r.output.push_to!r} with privacy.simulate: true: a simulated run "
            f"is for tuning on a public proxy, not a model to publish; remove output.push_to",
            key="output.push_to")


def _check_baseline_recipe(r) -> None:
    """A NON-PRIVATE baseline (privacy.dp: false) is for comparison only: never published,
    and it records nothing in any ledger. (A run on data declared public may be published.)"""
    if r.privacy.dp or r.data.public:
        return
    if r.output.push_to is not None:
        raise ConfigError(
            f"output.push_to: {r.output.push_to!r} with privacy.dp: false: a NON-PRIVATE "
            f"baseline (no clipping, no noise, no privacy guarantee) is for comparison only and "
            f"is never exported or published; remove output.push_to, or train with privacy.dp: "
            f"true", key="output.push_to")
    # eval.epsilon / eval.noise_multiplier are ignored, like privacy.target_epsilon: the
    # baseline releases nothing with DP (its held-out metrics are internal) and records
    # nothing in any ledger, so that the DP recipe runs as a baseline as it is.


def _check_eval_recipe(r) -> None:
    """What the evaluation needs from the other sections."""
    held = r.data.eval
    dp_eval = r.eval.epsilon is not None or r.eval.noise_multiplier is not None
    if r.train.eval_every and held is None:
        raise ConfigError(
            f"train.eval_every: {r.train.eval_every} needs held-out data: set data.eval.fraction "
            f"(e.g. 0.05) or a separate source (data.eval.path and data.eval.public), or set "
            f"train.eval_every: 0", key="train.eval_every")
    if dp_eval and held is None:
        raise ConfigError(
            "eval.epsilon / eval.noise_multiplier: a DP evaluation needs held-out data: set "
            "data.eval.fraction (e.g. 0.05) or data.eval.path with data.eval.public: false",
            key="eval.epsilon")
    if dp_eval and held is not None and held.public:
        raise ConfigError(
            "eval.epsilon / eval.noise_multiplier: data.eval is declared public, whose metrics "
            "are published as they are; no DP release is needed: remove them",
            key="eval.epsilon")
    if r.train.steps is not None:
        late = [s for s in r.eval.steps if s > r.train.steps]
        if late:
            raise ConfigError(
                f"eval.steps: {late} beyond train.steps ({r.train.steps}); list steps of the run "
                f"(the final DP evaluation happens anyway)", key="eval.steps")


def check_tokenizer_data(d, prefix: str, base_dir: str):
    """A tokenizer recipe's ``data``, a `TokenizerDataConfig`."""
    _check_source(d, prefix)
    if d.unit != "user" and d.user_field is not None:
        raise ConfigError(
            f"{prefix}.user_field: {d.user_field!r} is only used with {prefix}.unit 'user' "
            f"(unit is {d.unit!r}); remove it or set unit: user",
            key=f"{prefix}.user_field",
        )
    return d


def check_tokenizer_privacy(p, prefix: str, base_dir: str):
    """A tokenizer recipe's ``privacy``, a `TokenizerPrivacyConfig`."""
    if p.dp and p.target_epsilon is None:
        raise ConfigError(
            f"{prefix}.target_epsilon: required when {prefix}.dp is true: the epsilon of this "
            f"tokenizer release (noise and threshold are calibrated to it), e.g. "
            f"target_epsilon: 1.0",
            key=f"{prefix}.target_epsilon",
        )
    if not p.dp and p.target_epsilon is not None:
        raise ConfigError(
            f"{prefix}.target_epsilon: {p.target_epsilon!r} is given but {prefix}.dp is false "
            f"(exact counts, no guarantee); remove one of them",
            key=f"{prefix}.target_epsilon",
        )
    _check_rng_seed(p, prefix)
    return p
