"""Recipes: typed, validated, frozen configuration for one llmdp run.

A recipe is a YAML file with the sections ``model, data, privacy, optim, train, scaling,
output``. :func:`load_recipe` reads it, applies ``key.sub=value`` overrides (the value is
read as YAML, so ``privacy.target_epsilon=4``, ``model.lora=null`` and
``optim.betas=[0.9,0.95]`` all work), and returns a frozen :class:`RecipeConfig` in which
every default is filled in and every path is absolute.

Validation stops at the first problem and raises one :class:`ConfigError` whose message
names the full dotted key, the value, and what was expected (type, range, choices), with
a "did you mean" for mistyped keys. The checks themselves live in :mod:`llmdp.config.validate`;
the generic loading (a mapping -> a dataclass) in :mod:`llmdp.config.load`, YAML files
and overrides in :mod:`llmdp.config.yamlio`.

The schema is declared once, in the dataclasses below: each field's type drives type
checking and its ``metadata`` (``choices``, bounds, ``path``; declared with ``_f``)
drives the value checks, so a new field needs one line here and nothing else. Checks
that involve two fields or two sections are the ``check_*`` functions of
:mod:`llmdp.config.checks`, one per dataclass (``_CHECKS`` below says which).

Privacy settings (``privacy``) are kept apart from performance settings (``train``,
``scaling``): ``train.seed`` seeds model initialization and dropout only; sampling and
noise use fresh OS entropy unless ``privacy.rng: seeded`` (which the report labels).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmdp.config import checks as _checks
from llmdp.config import load as _load
from llmdp.config import yamlio as _yaml
from llmdp.config.best import apply_best
from llmdp.config.choices import MIXED_PRECISION, STRATEGIES, Accountant, Mechanism, Sampler
from llmdp.config.load import field_spec as _f
from llmdp.config.validate import ConfigError, fmt
from llmdp.config.yamlio import config_hash, dump_yaml, parse_override, to_dict

__all__ = [
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "EvalDataConfig",
    "SweepConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "PrivacyConfig",
    "RecipeConfig",
    "ScalingConfig",
    "SourceConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainConfig",
    "apply_overrides",
    "config_hash",
    "dump_yaml",
    "from_dict",
    "TokenizerRecipeConfig",
    "load_recipe",
    "load_tokenizer_recipe",
    "tokenizer_recipe_from_dict",
    "parse_override",
    "recipe_from_dict",
    "to_dict",
    "warmup_steps_for",
    "validate_recipe",
]


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class TinyModelConfig:
    """Architecture of a small model built from a config (``model.init: tiny``)."""

    # qwen3_moe, gpt_oss: mixtures of experts (4 experts of intermediate_size, top-2)
    family: str = _f("llama", choices=("llama", "gpt2", "gemma", "qwen2", "qwen3_moe", "gpt_oss"))
    hidden_size: int = _f(64, ge=8)  # divisible by num_heads
    num_layers: int = _f(2, ge=1)
    num_heads: int = _f(4, ge=1)
    num_kv_heads: int = _f(2, ge=1)  # divides num_heads
    intermediate_size: int = _f(256, ge=1)
    max_position_embeddings: int = _f(512, ge=1)  # >= data.sequence_length
    tie_word_embeddings: bool = False
    seed: int = _f(0, ge=0)  # initialization seed: public, not a privacy seed


@dataclass(frozen=True)
class LoraConfig:
    r: int = _f(8, ge=1)
    alpha: float = _f(16.0, gt=0)
    dropout: float = _f(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = _f(("q_proj", "v_proj"), nonempty=True)
    # 3-D parameters (a mixture of experts' fused weights) by name suffix, e.g.
    # ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]: peft's target_parameters.
    target_parameters: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    # Hub id or local directory. Required unless init == "tiny".
    name_or_path: str | None = _f(None, path="maybe")
    init: str = _f("pretrained", choices=("pretrained", "tiny"))
    tiny: TinyModelConfig = _f(factory=TinyModelConfig)
    # Path or hub id; defaults to name_or_path (filled in by the loader). Required for tiny.
    tokenizer: str | None = _f(None, path="maybe")
    # Adapt a pretrained model to `tokenizer` (e.g. a private llmdp tokenizer): the model's
    # own tokenizer (hub id or folder). The embeddings are resized to the new vocabulary and
    # each new token's rows start as the mean of the base rows of the base tokenizer's
    # pieces of the same string (a public computation). None: no adaptation.
    base_tokenizer: str | None = _f(None, path="maybe")
    # What an llmdp DP tokenizer (model.tokenizer) was trained on, relative to this run's
    # data. "same" (default, the safe side): its release is composed into the run's
    # guarantee, whatever file it was trained on (a file hash cannot tell whether two
    # sources share individuals). "independent": the user declares that the sources share
    # no individuals; the release is not composed and the report says so.
    tokenizer_data: str = _f("same", choices=("same", "independent"))
    # What an llmdp DP starting model (model.name_or_path, or a DP run in its chain) was
    # trained on, when its data cannot be matched with this run's (an export, or a ledger
    # database this run does not use; llmdp.record.provenance): "same" composes its releases,
    # recorded in its provenance, into this run's guarantee; "independent" declares that its
    # data shares no individuals with this run's (the report says so). None: refused then.
    start_data: str | None = _f(None, choices=("same", "independent"))
    dtype: str = _f("float32", choices=("float32", "bfloat16", "float64"))
    # A mapping in YAML; `lora: {}` means LoraConfig defaults; null means full fine-tuning.
    lora: LoraConfig | None = None
    gradient_checkpointing: bool = False


@dataclass(frozen=True)
class SyntheticDataConfig:
    kind: str = _f("clinical_notes", choices=("clinical_notes",))
    num_documents: int = _f(5000, ge=1)
    seed: int = _f(0, ge=0)


@dataclass(frozen=True)
class SourceConfig:
    """Where a corpus is and what its records are: the keys shared by a training recipe's
    and a tokenizer recipe's ``data`` (which extend it), checked by ``_check_source``."""

    # The source: exactly one of `path` (local files, a directory of them, or a folder
    # written by datasets' save_to_disk) and `dataset` (a Hub dataset name; needs network).
    path: str | None = _f(
        None, path="always",
        help="the corpus: a .jsonl, .json, .parquet, .csv or .txt file, a directory, "
             "a datasets save_to_disk folder, or (data.preprocess ray) a URI of a pyarrow "
             "filesystem: s3://, gs://, hdfs://, file://",
    )
    dataset: str | None = _f(None, nonempty=True)
    config_name: str | None = None
    split: str = _f("train", nonempty=True)
    format: str = _f("auto", choices=("auto", "jsonl", "json", "parquet", "csv", "text"))
    # The dataset's identity in the ledger: every release on data with this id is charged
    # to one budget, whatever the working directory and whatever edits the data sees (its
    # content hash is kept as a record). None: derived from the source (the local path,
    # or the Hub name). Declare a new id only for data about other individuals.
    dataset_id: str | None = _f(None, nonempty=True)
    # A new data.dataset_id whose data matches (content hash, overlapping source) a ledger
    # with a budget or releases is refused: one dataset, one budget. When the data really
    # is about other individuals, name those ledgers here and say why; both are recorded
    # in the new dataset's ledger and shown in the run's internal report.
    distinct_from: tuple[str, ...] = ()
    distinct_reason: str | None = _f(None, nonempty=True)
    # What a record is: plain text (`text_field`), a chat (`messages_field`: a list of
    # {role, content}) or an instruction pair (`prompt_field` + `response_field`). Chats and
    # instructions train on the response tokens only; a tokenizer reads every text of them.
    text_field: str = _f("text", nonempty=True)
    messages_field: str | None = _f(None, nonempty=True)
    prompt_field: str | None = _f(None, nonempty=True)
    response_field: str | None = _f(None, nonempty=True)
    # The privacy unit (what the guarantee protects): a document (one record) or a user
    # (the records of one `user_field` value). Training adds a packed sequence.
    unit: str = _f("document", choices=("document", "user"))
    user_field: str | None = _f(None, nonempty=True)  # user units: the field naming the user
    # When set, the demo corpus is generated at `path` if the file is missing.
    synthetic: SyntheticDataConfig | None = None


@dataclass(frozen=True)
class EvalDataConfig:
    """Held-out data (``data.eval``): a fraction of the private corpus held out by privacy
    unit, or a separate source declared public or private."""

    # Hold out each unit of the private corpus independently iff a keyed hash of its own
    # content (a user unit: its user key) is below this fraction: disjoint from the training
    # units, the same split at every launch, and adding or removing a unit never moves
    # another. Training's N, q and accounting cover the training units only.
    fraction: float | None = _f(None, gt=0, lt=1)
    split_key: str = _f("llmdp.eval_split.v1", nonempty=True)  # the split's hash key (public)
    # Or a separate source, read with data's record keys (text_field, messages_field, ...)
    # and cut into the same units: exactly one of path / dataset, and `public` declared.
    path: str | None = _f(None, path="always")
    dataset: str | None = _f(None, nonempty=True)
    config_name: str | None = None
    split: str = _f("train", nonempty=True)  # a Hub dataset's split, e.g. validation
    format: str = _f("auto", choices=("auto", "jsonl", "json", "parquet", "csv", "text"))
    # true: public data (its metrics are published as they are); false: private data about
    # the same individuals as `data` (metrics internal unless released with DP, composed
    # into this run's and its dataset's ledger).
    public: bool | None = None
    # Evaluate on the held-out units with the smallest split hashes, at most this many
    # (quicker evaluations; the selection depends on each unit's own content). None: all.
    max_units: int | None = _f(None, ge=1)
    # A separate private source is a dataset of its own, with its own ledger (its DP
    # evaluations are recorded there too, and checked against its budget): its identity
    # there, as data.dataset_id for the training data. None: derived from the source.
    dataset_id: str | None = _f(None, nonempty=True)


@dataclass(frozen=True)
class DataConfig(SourceConfig):
    """The training corpus: a source (:class:`SourceConfig`) and how it becomes rows."""

    # Plain-text files (.txt): `file` = each file is ONE record (one document: what a
    # document unit protects); `line` = one record per non-blank line; `paragraph` = one per
    # block of lines separated by a blank line. The report states it.
    text_split: str = _f("file", choices=("file", "line", "paragraph"))
    # A malformed record (missing / non-string / empty text, a chat role that is not a known
    # one, ...): `error` stops at the first, naming its file, line and field; `skip` leaves
    # such records out and counts them (internal data statistics: records_skipped).
    on_bad_record: str = _f("error", choices=("error", "skip"))
    chat_template: str = _f("auto", choices=("auto", "none"))
    # The privacy unit: a packed sequence of `sequence_length` tokens, a document, or a user.
    unit: str = _f("sequence", choices=("sequence", "document", "user"))
    sequence_length: int = _f(128, ge=8, le=65536)
    # Used by the unit kinds they name (as is user_field), ignored by the others, so that
    # one recipe can describe its corpus once and switch `unit` on the command line:
    max_rows_per_unit: int | None = _f(None, ge=1)  # document/user contribution bound (a sequence is 1 row)
    document_masking: bool = False  # sequence/user: no attention across packed documents
    # For quick runs on part of the corpus: keep each unit independently iff a keyed hash
    # of its own content (a user unit: its user key) is below this fraction (key: a fixed
    # public string). Whether a unit is kept depends on that unit alone, so adding or
    # removing a unit never changes which others are kept, and the guarantee stays
    # add/remove-one relative to the whole corpus. None: every unit.
    unit_fraction: float | None = _f(None, gt=0, le=1)
    # Removed: a cap by count ("the first max_units") lets an added unit evict another
    # (replace-one, not the add/remove-one the run is accounted under). Use unit_fraction.
    max_units: int | None = None
    num_proc: int | None = _f(None, ge=1)  # tokenizer processes (None: by corpus size)
    # How the unit store is built: `local` in this process; `ray` on Ray Data, for corpora
    # beyond one machine's RAM (the cluster's workers read record-aligned chunks, tokenize
    # them and write the store in shards; the driver never holds the corpus; sequence rows
    # are packed within a shard); `auto`: ray for JSON-lines / Parquet / text files of at
    # least 1 GiB, else local.
    preprocess: str = _f("auto", choices=("auto", "local", "ray"))
    # preprocess ray: the memory, in MiB, one task may use for the data it holds (the text
    # per task is sized from it; each worker process also holds Ray, pyarrow and the
    # tokenizer, ~0.2 GiB), and how many tasks run at once (None: one per cluster CPU).
    preprocess_memory_mb: float = _f(1024.0, ge=3)
    preprocess_workers: int | None = _f(None, ge=1)
    eval: EvalDataConfig | None = None  # held-out data (None: no evaluation)
    # true: this recipe DECLARES its training source public (the declaration is the user's
    # responsibility; llmdp cannot check it). The run trains without DP (privacy.dp: false
    # is required as well: no DP recipe turns non-private by one setting), opens no dataset
    # ledger and spends nothing; its plan, report and model card say so first; its model
    # may be exported and used as a starting checkpoint. A source whose dataset ledger
    # records DP releases was treated as private: refused, unless public_override_ledger
    # (a note of the declaration is then recorded in that ledger).
    public: bool = False
    public_override_ledger: bool = False


@dataclass(frozen=True)
class PrivacyConfig:
    # false: a NON-PRIVATE baseline of the same recipe (no clipping, no noise), for
    # comparison only: labelled as such everywhere, recorded in no ledger, never exported.
    # target_epsilon / noise_multiplier are then ignored.
    dp: bool = True
    # true (with data.public: true): a DP run *simulated* on data declared public, to tune
    # at zero ε (`llmdp sweep`, DP-fy guide §5.4). The mechanism runs as planned for the
    # private run — clipping at max_grad_norm, noise at the σ calibrated for target_epsilon
    # (and the DP evaluations the recipe plans) over `simulate_units` units, the sampler,
    # the mechanism — so each step's noise-to-signal σC/B is the private run's; but the data
    # is public: no ledger, nothing spent, no DP evaluation run (held-out loss without DP).
    simulate: bool = False
    # The private corpus's number of units N, for which σ is calibrated (the private run's
    # plan: `llmdp train PRIVATE.yaml --dry-run` prints it); None: this corpus's own N.
    # Each step still draws B = train.expected_batch_size units of this corpus on average.
    simulate_units: int | None = _f(None, ge=1)
    # Exactly one of target_epsilon / noise_multiplier.
    target_epsilon: float | None = _f(None, gt=0)
    noise_multiplier: float | None = _f(None, gt=0)
    delta: float | None = _f(None, gt=0, lt=1)  # None: the plan picks a default below 1/N
    max_grad_norm: float = _f(1.0, gt=0)
    accountant: Accountant = Accountant.PLD  # its values: llmdp.config.choices
    # "poisson": exact Poisson sampling; "truncated-poisson": Poisson capped at
    # max_batch_size units (bounded memory), accounted with the truncated event (pld only).
    sampler: Sampler = Sampler.POISSON
    max_batch_size: int | None = _f(None, ge=1)  # truncated-poisson cap; None: the plan picks it
    # "dp-sgd": independent noise each step. Correlated noise (DP-FTRL by matrix
    # factorization, `llmdp.privacy.mf.factorization`): "banded-mf" (C with `bands` diagonals; sampler
    # cyclic-poisson, amplified, or fixed-cycle) or "blt" (buffered linear Toeplitz, at most
    # `buffers` buffers; sampler fixed-cycle). Each needs a cyclic sampler.
    mechanism: Mechanism = Mechanism.DP_SGD
    bands: int | None = _f(None, ge=1)  # banded-mf: b (<= cycle with cyclic-poisson)
    # The cyclic samplers' number of groups (the minimum separation of a unit's steps).
    # None: cyclic-poisson uses `bands`; fixed-cycle uses round(N / train.expected_batch_size).
    cycle: int | None = _f(None, ge=1)
    buffers: int = _f(8, ge=1, le=16)  # blt: the most buffers the optimizer may use
    rng: str = _f("secure", choices=("secure", "seeded"))
    seed: int | None = _f(None, ge=0)  # required iff rng == "seeded"
    clipping: str = _f("ghost", choices=("ghost", "reference"))
    clipping_mode: str = _f("auto", choices=("auto", "book-keeping", "two-pass"))
    debug_check: bool = False  # compare the engine with the exact reference on the first step
    max_noise_multiplier: float = _f(100.0, gt=0)
    # The ledgers' database: every DP release on a dataset (runs, tokenizers) is recorded
    # and composed there, one hash-chained ledger per data.dataset_id. None: SQLite at
    # $LLMDP_HOME/ledger.sqlite; a path: that SQLite file; postgresql://user@host/db:
    # PostgreSQL (clusters). A .jsonl (an earlier llmdp's ledger) is imported once.
    ledger: str | None = _f(None, path="ledger")
    # Cap on the composed epsilon (at the plan's delta) of everything in the ledger.
    budget_epsilon: float | None = _f(None, gt=0)
    # Steps re-executed after a failure are released again and raise epsilon. false: the
    # run stops when one more step would take epsilon past target_epsilon (status stopped);
    # true: it finishes and the report's first line says epsilon exceeds the target.
    allow_exceed_target_on_failure: bool = False


@dataclass(frozen=True)
class OptimConfig:
    # dp-adambc: Adam with the DP noise's variance (σC/B)² removed from its second moment
    # (llmdp.train.optimizers; Tang et al. 2024), floored at adambc_floor; dp-sgd only.
    name: str = _f("adamw", choices=("adamw", "sgd", "dp-adambc"))
    lr: float = _f(1e-3, gt=0)
    weight_decay: float = _f(0.0, ge=0)
    betas: tuple[float, float] = _f((0.9, 0.999), items={"ge": 0, "lt": 1})
    eps: float = _f(1e-8, gt=0)
    momentum: float = _f(0.0, ge=0, lt=1)
    schedule: str = _f("cosine", choices=("constant", "cosine", "linear"))
    warmup_steps: int = _f(0, ge=0)  # < train.steps when steps is given; > 0 wins over warmup_ratio
    # Warmup as a fraction of the run's T steps (floor(ratio * T)), so that it scales with
    # train.steps / train.epochs; used when warmup_steps is 0 (as in transformers).
    warmup_ratio: float = _f(0.0, ge=0, lt=1)
    min_lr_ratio: float = _f(0.0, ge=0, le=1)
    adambc_floor: float = _f(1e-8, gt=0)  # dp-adambc's γ': the corrected second moment's floor


def warmup_steps_for(optim: Any, total_steps: int) -> int:
    """The warmup length of a run of ``total_steps`` steps: ``optim.warmup_steps`` if it is
    set (> 0), else ``floor(optim.warmup_ratio * total_steps)``, which is < total_steps.
    ``optim``: an OptimConfig or its dict (the worker's recipe)."""
    import math

    get = optim.get if isinstance(optim, dict) else (lambda k, d=None: getattr(optim, k, d))
    steps = int(get("warmup_steps", 0) or 0)
    if steps > 0:
        return steps
    ratio = float(get("warmup_ratio", 0.0) or 0.0)
    # 0.2 * 50 is 10.000000000000002 and 0.29 * 100 is 28.999999999999996: floor with a margin.
    return min(max(0, int(math.floor(ratio * total_steps + 1e-9))), max(0, total_steps - 1))


def lr_lambda(optim: Any, total_steps: int):
    """The learning-rate multiplier of each step: linear warmup, then constant / cosine /
    linear decay to ``min_lr_ratio`` (the worker's scheduler; a correlated mechanism's workload)."""
    import math

    warmup = warmup_steps_for(optim, total_steps)  # warmup_steps, or warmup_ratio * T
    floor = float(optim.min_lr_ratio)
    kind = optim.schedule

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return f


@dataclass(frozen=True)
class TrainConfig:
    expected_batch_size: int = _f(256, ge=1)  # B = q*N; checked against N by the plan
    # Exactly one of steps / epochs.
    steps: int | None = _f(None, ge=1)
    epochs: float | None = _f(None, gt=0)
    physical_batch_size: int = _f(32, ge=1)  # rows per micro-batch per worker
    checkpoint_every: int = _f(50, ge=1)
    seed: int = _f(0, ge=0)  # model init / dropout only; NOT a privacy seed
    # Evaluate on data.eval every this many steps (0: only before the first step and after
    # the last). Internal metrics on private held-out data; see the `eval` section for DP.
    eval_every: int = _f(0, ge=0)
    max_failures: int = _f(0, ge=0)  # worker failures Ray Train recovers from (resume from a checkpoint)
    length_bucketing: bool = True  # group rows of similar length; pad each micro-batch to its longest
    # Steps with a unit whose gradient is NaN/inf (that unit adds nothing) before the
    # operator is warned (console and metrics.jsonl, internal). The run never stops on it:
    # the count is a statistic of private data without DP (DESIGN, invariant `published-from-dp-only`).
    max_nonfinite_steps: int = _f(10, ge=0)
    # A file `llmdp sweep ... --write-best FILE` wrote on data declared public: its
    # overrides are applied when the recipe is read (llmdp.config.best), and the report says
    # the hyper-parameters were chosen on public data at zero privacy cost.
    hyperparameters_from: str | None = _f(None, path="always")


@dataclass(frozen=True)
class ScalingConfig:
    num_workers: int = _f(1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = _f(1.0, gt=0)
    # "replicated": every worker holds the whole model, one all-reduce of the clipped sum
    # per logical step; "fsdp": FSDP2 fully_shard over the workers (parameters, gradients
    # and optimizer state sharded; the clipped sum is reduce-scattered, each shard gets
    # its slice of one N(0, sigma^2 C^2 I)).
    strategy: str = _f("replicated", choices=STRATEGIES)
    # Compute in bf16 (autocast) over float32 master weights; "none": the model's dtype.
    mixed_precision: str = _f("none", choices=MIXED_PRECISION)


@dataclass(frozen=True)
class EvalConfig:
    """What is released about the model's quality (``eval``): DP evaluation on private
    held-out data, and generations from public prompts."""

    # DP evaluation (after the last step, and after each of `steps`): per-unit loss and
    # token accuracy clipped to [0, loss_bound] and [0, 1], summed with one Gaussian noise
    # multiplier for the aggregates released together (loss, accuracy, and the count when
    # noised). Exactly one of epsilon (all DP eval releases together, at privacy.delta; a
    # part of privacy.target_epsilon: training's sigma is calibrated for the rest) and
    # noise_multiplier, or neither (no DP evaluation).
    epsilon: float | None = _f(None, gt=0)
    noise_multiplier: float | None = _f(None, gt=0)
    steps: tuple[int, ...] = _f((), items={"ge": 1})  # also release a DP eval after these steps
    loss_bound: float | None = _f(None, gt=0)  # None: ln(vocabulary size), a uniform predictor's loss
    # "noised": the number of evaluated units is a noised aggregate too (nothing released
    # without DP); "public": it is published as is, like N (the report lists it as not covered).
    count: str = _f("noised", choices=("noised", "public"))
    # Release DP evaluations even when their expected noise std exceeds NOISY_EVAL_FRACTION
    # (llmdp.evaluation.dp) of the metric's range: such a release says next to nothing.
    allow_noisy: bool = False
    # Public prompts: greedy and sampled continuations of the final model (post-processing
    # of a DP model) in the report and the model card.
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = _f(32, ge=1, le=4096)
    temperature: float = _f(0.8, gt=0)  # the sampled continuation
    top_p: float = _f(0.95, gt=0, le=1)


@dataclass(frozen=True)
class SweepConfig:
    """Accounted hyper-parameter tuning (``llmdp sweep``): every trial is a DP run recorded
    in the dataset's ledger, and the selection reads only DP evaluation metrics."""

    # "key=v1,v2,..." per swept key (the values read as YAML), e.g. "optim.lr=1e-3,3e-3".
    grid: tuple[str, ...] = ()
    # "grid": every combination, once (cost: the composition of all trials, PLD).
    # "random": Papernot-Steinke: a random number of trials K (mean `mean_trials`), each a
    # uniformly random grid point; the best one's cost is RepeatAndSelectDpEvent (RDP).
    trials: str = _f("grid", choices=("grid", "random"))
    mean_trials: float | None = _f(None, gt=0)
    distribution: str = _f("poisson", choices=("poisson", "geometric"))  # of K (random)


_RUN_NAME = r"[A-Za-z0-9._-]+"


@dataclass(frozen=True)
class OutputConfig:
    dir: str = _f("runs", path="always")
    name: str | None = _f(None, pattern=_RUN_NAME)  # default: the recipe file's stem
    # After a successful run, export it (`llmdp export`) to <run dir>/export and publish it
    # to this Hub repo (ORG/NAME). None: no export.
    push_to: str | None = _f(None, pattern=r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
    private: bool = False  # the Hub repo's visibility when push_to creates it
    merge: bool = False  # LoRA: publish merged full weights instead of the adapter
    license: str | None = _f(None, nonempty=True)  # the card's license (default: other)
    base_model: str | None = _f(None, nonempty=True)  # the base's Hub id when model.name_or_path is local
    # Everything the run derives from private data (run folder, checkpoints, unit stores, the
    # ledger) is owner-only (0600/0700); true: group-readable too (0640/0750), never world
    group_readable: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    # A local experiment log beside metrics.jsonl (in the run directory): tensorboard or
    # mlflow (a local SQLite store, mlruns/mlflow.db), optional extras
    # (`pip install 'llmdp[tensorboard]'`, `'llmdp[mlflow]'`).
    # DP releases under dp/, metrics computed on private data without DP under internal/
    # (llmdp.train.explog). None: metrics.jsonl only.
    backend: str | None = _f(None, choices=("tensorboard", "mlflow"))


@dataclass(frozen=True)
class RecipeConfig:
    model: ModelConfig
    data: DataConfig
    privacy: PrivacyConfig
    optim: OptimConfig
    train: TrainConfig
    scaling: ScalingConfig
    output: OutputConfig
    eval: EvalConfig = _f(factory=EvalConfig)
    sweep: SweepConfig | None = None
    logging: LoggingConfig = _f(factory=LoggingConfig)

    @property
    def run_dir(self) -> str:
        if self.output.name is None:
            raise ConfigError(
                "output.name: not set; set it in the recipe, or load the recipe from a "
                "file with load_recipe (which names the run after the file)",
                key="output.name",
            )
        return os.path.join(self.output.dir, self.output.name)


# ---------------------------------------------------------------- tokenizer recipes
# `llmdp tokenizer train tokenizers/<name>.yaml`: a SentencePiece tokenizer trained on the
# private corpus with DP (llmdp.tokenizer.private), recorded in the dataset's ledger.


@dataclass(frozen=True)
class TokenizerDataConfig(SourceConfig):
    """The private corpus, read like `data` of a training recipe (the same source keys).
    The tokenizer's privacy unit is a document (one record) or a user (all records of one
    `user_field` value); a training run that uses the tokenizer must use the same unit to
    compose with it."""


@dataclass(frozen=True)
class TokenizerPrivacyConfig:
    # false: count words exactly (a NON-private tokenizer, for baselines only: a training
    # recipe that claims a guarantee refuses it).
    dp: bool = True
    target_epsilon: float | None = _f(None, gt=0)  # epsilon of this release alone
    delta: float | None = _f(None, gt=0, lt=1)  # None: a power of ten below 1/(10 N)
    # K: distinct words one unit contributes at most (each counted once).
    max_words_per_unit: int = _f(128, ge=1)
    # Share of delta spent on the threshold (words held by a single unit); rest: Gaussian.
    delta_threshold_fraction: float = _f(0.5, gt=0, lt=1)
    accountant: Accountant = Accountant.PLD  # its values: llmdp.config.choices
    rng: str = _f("secure", choices=("secure", "seeded"))
    seed: int | None = _f(None, ge=0)  # required iff rng == "seeded"
    ledger: str | None = _f(None, path="ledger")  # the ledgers' database (default as for training)
    budget_epsilon: float | None = _f(None, gt=0)


@dataclass(frozen=True)
class TokenizerModelConfig:
    model_type: str = _f("bpe", choices=("bpe", "unigram"))
    vocab_size: int = _f(8000, ge=300)  # a soft limit: fewer released words give fewer pieces
    byte_fallback: bool = True  # every byte is a piece: no <unk> on any text
    character_coverage: float = _f(1.0, gt=0, le=1)


@dataclass(frozen=True)
class TokenizerOutputConfig:
    dir: str = _f("runs/tokenizers", path="always")
    name: str | None = _f(None, pattern=r"[A-Za-z0-9._-]+")  # default: the recipe file's stem


@dataclass(frozen=True)
class TokenizerRecipeConfig:
    data: TokenizerDataConfig
    privacy: TokenizerPrivacyConfig
    tokenizer: TokenizerModelConfig
    output: TokenizerOutputConfig

    @property
    def out_dir(self) -> str:
        return os.path.join(self.output.dir, self.output.name)


# ------------------------------------------------------------------ cross-field checks
# llmdp.config.checks: run on each instance of these types as it is built.

_CHECKS = {
    TinyModelConfig: _checks.check_tiny,
    ModelConfig: _checks.check_model,
    DataConfig: _checks.check_data,
    EvalDataConfig: _checks.check_eval_data,
    EvalConfig: _checks.check_eval,
    SweepConfig: _checks.check_sweep,
    PrivacyConfig: _checks.check_privacy,
    TrainConfig: _checks.check_train,
    OutputConfig: _checks.check_output,
    LoggingConfig: _checks.check_logging,
    RecipeConfig: _checks.check_recipe,
    TokenizerDataConfig: _checks.check_tokenizer_data,
    TokenizerPrivacyConfig: _checks.check_tokenizer_privacy,
}


# ------------------------------------------------------------------------ public API
# The generic loading (types, field checks, paths) is llmdp.config.load; YAML files and
# overrides are llmdp.config.yamlio.

_SECTIONS = [f.name for f in dataclasses.fields(RecipeConfig)]


def recipe_from_dict(
    d: Mapping[str, Any],
    *,
    base_dir: str | os.PathLike | None = None,
    default_name: str | None = None,
) -> RecipeConfig:
    """Validate a recipe given as a mapping (as read from YAML).

    Relative paths are resolved against ``base_dir`` (default: the current directory).
    ``default_name`` becomes ``output.name`` when the recipe leaves it null.
    """
    if isinstance(d, Mapping):
        d = apply_best(dict(d), os.fspath(base_dir or os.getcwd()), RecipeConfig)
    cfg = _load.build(RecipeConfig, d, what="recipe", base_dir=base_dir, checks=_CHECKS)
    if cfg.output.name is None and default_name is not None:
        if not re.fullmatch(_RUN_NAME, default_name) or default_name in (".", ".."):
            raise ConfigError(
                f"output.name: {default_name!r} (from the recipe file name) does not match "
                f"{_RUN_NAME}; set output.name in the recipe or as an override",
                key="output.name",
            )
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=default_name))
    return cfg


def from_dict(d: Mapping[str, Any], *, base_dir: str | os.PathLike | None = None) -> RecipeConfig:
    """Inverse of :func:`to_dict`: ``from_dict(to_dict(c)) == c``."""
    return recipe_from_dict(d, base_dir=base_dir)


def validate_recipe(cfg: RecipeConfig) -> RecipeConfig:
    """Re-run every check on a config built in code (e.g. with dataclasses.replace)."""
    return recipe_from_dict(to_dict(cfg))


def apply_overrides(d: Mapping[str, Any] | None, overrides: Sequence[str],
                    root: type | None = None) -> dict[str, Any]:
    """A copy of the raw recipe ``d`` with each ``key.sub=value`` override set, in order.

    Setting a key inside an absent or null section creates it (``model.lora.r=4`` turns
    LoRA on with r=4 and the other LoRA defaults). ``root``: the recipe's type
    (default :class:`RecipeConfig`; :class:`TokenizerRecipeConfig` for a tokenizer recipe).
    """
    return _yaml.apply_overrides(d, overrides, root or RecipeConfig)


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Read, override and validate a recipe file.

    Relative paths in the recipe are resolved against the current working directory;
    ``output.name`` defaults to the file's stem (``recipes/tiny.yaml`` -> ``tiny``).
    """
    _, full, raw = _yaml.read_recipe_file(path, "recipe")
    if raw is None:
        raise ConfigError(f"{full}: the recipe is empty; expected the sections {_SECTIONS}")
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{full}: the top level must be a mapping with the sections {_SECTIONS}; "
            f"got {type(raw).__name__} {fmt(raw)}"
        )
    raw = apply_overrides(raw, overrides)
    return recipe_from_dict(raw, base_dir=os.getcwd(), default_name=_yaml.file_stem(full))


def tokenizer_recipe_from_dict(
    d: Mapping[str, Any],
    *,
    base_dir: str | os.PathLike | None = None,
    default_name: str | None = None,
) -> TokenizerRecipeConfig:
    """Validate a tokenizer recipe (sections data, privacy, tokenizer, output)."""
    cfg = _load.build(TokenizerRecipeConfig, d, what="tokenizer recipe", base_dir=base_dir,
                      checks=_CHECKS)
    if cfg.output.name is None:
        if default_name is None or not re.fullmatch(_RUN_NAME, default_name) or default_name in (".", ".."):
            raise ConfigError(
                f"output.name: not set and {default_name!r} (from the recipe file name) is not "
                f"a valid name ({_RUN_NAME}); set output.name",
                key="output.name",
            )
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=default_name))
    return cfg


def load_tokenizer_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TokenizerRecipeConfig:
    """Read, override and validate a tokenizer recipe file (`tokenizers/<name>.yaml`).
    Relative paths resolve against the current directory; ``output.name`` defaults to the
    file's stem."""
    sections = [f.name for f in dataclasses.fields(TokenizerRecipeConfig)]
    given, full, raw = _yaml.read_recipe_file(path, "tokenizer recipe")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{full}: expected a mapping with the sections {sections}")
    if "model" in raw or "train" in raw:
        raise ConfigError(
            f"{full}: this is a training recipe (it has a model/train section); run it with "
            f"`llmdp train {given}`. A tokenizer recipe has the sections {sections}"
        )
    raw = apply_overrides(raw, overrides, root=TokenizerRecipeConfig)
    return tokenizer_recipe_from_dict(raw, base_dir=os.getcwd(), default_name=_yaml.file_stem(full))
