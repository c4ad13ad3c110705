"""Recipe loading, overrides, round trips, and one specific message per malformed recipe."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import textwrap

import pytest
import yaml

from llmdp.config import validate as v
from llmdp.config.schema import (
    ConfigError,
    DataConfig,
    EvalDataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    PrivacyConfig,
    RecipeConfig,
    ScalingConfig,
    SyntheticDataConfig,
    TinyModelConfig,
    TrainConfig,
    apply_overrides,
    config_hash,
    dump_yaml,
    from_dict,
    load_recipe,
    parse_override,
    recipe_from_dict,
    to_dict,
    validate_recipe,
)

FULL_RECIPE = """\
# A complete recipe: every section, most keys.
model:
  init: tiny
  tokenizer: ./tok
  tiny:
    family: qwen2
    hidden_size: 32
    num_layers: 1
    num_heads: 4
    num_kv_heads: 2
    intermediate_size: 64
    max_position_embeddings: 256
    tie_word_embeddings: true
    seed: 3
  dtype: float64
  lora:
    r: 4
    alpha: 8
    dropout: 0.1
    target_modules: [q_proj, k_proj, v_proj]
  gradient_checkpointing: false
data:
  path: data/notes.jsonl
  format: jsonl
  text_field: note
  unit: sequence
  sequence_length: 64
  synthetic:
    kind: clinical_notes
    num_documents: 200
    seed: 1
  unit_fraction: 0.5
  eval:
    fraction: 0.1
privacy:
  target_epsilon: 8
  delta: 1.0e-6
  max_grad_norm: 0.5
  accountant: rdp
  sampler: poisson
  rng: secure
  clipping: reference
  max_noise_multiplier: 50
optim:
  name: adamw
  lr: 5e-4
  weight_decay: 0.01
  betas: [0.9, 0.95]
  eps: 1e-6
  momentum: 0
  schedule: linear
  warmup_steps: 2
  min_lr_ratio: 0.1
train:
  expected_batch_size: 64
  steps: 20
  physical_batch_size: 8
  checkpoint_every: 10
  seed: 7
  eval_every: 5
scaling:
  num_workers: 2
  use_gpu: false
  cpus_per_worker: 0.5
output:
  dir: out
"""


def minimal() -> dict:
    """The smallest valid recipe, as a dict; tests edit a copy."""
    return {
        "model": {"init": "tiny", "tokenizer": "./tok"},
        "data": {"path": "corpus.jsonl"},
        "privacy": {"noise_multiplier": 1.0},
        "train": {"steps": 10},
    }


def write(tmp_path, text: str, name: str = "recipe.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ----------------------------------------------------------------------- valid recipes


def test_full_recipe_loads(in_tmp):
    path = write(in_tmp, FULL_RECIPE, "full-demo.yaml")
    cfg = load_recipe(path)
    t = in_tmp.resolve()

    assert cfg.model == ModelConfig(
        name_or_path=None,
        init="tiny",
        tiny=TinyModelConfig("qwen2", 32, 1, 4, 2, 64, 256, True, 3),
        tokenizer=str(t / "tok"),
        dtype="float64",
        lora=LoraConfig(r=4, alpha=8.0, dropout=0.1, target_modules=("q_proj", "k_proj", "v_proj")),
        gradient_checkpointing=False,
    )
    assert cfg.data == DataConfig(
        path=str(t / "data" / "notes.jsonl"),
        format="jsonl",
        text_field="note",
        unit="sequence",
        sequence_length=64,
        synthetic=SyntheticDataConfig("clinical_notes", 200, 1),
        eval=EvalDataConfig(fraction=0.1),
        unit_fraction=0.5,
    )
    assert cfg.privacy == PrivacyConfig(
        target_epsilon=8.0,
        delta=1e-6,
        max_grad_norm=0.5,
        accountant="rdp",
        clipping="reference",
        max_noise_multiplier=50.0,
    )
    # `5e-4` and `1e-6` are strings to PyYAML (YAML 1.1 needs a dot); they are accepted.
    assert cfg.optim == OptimConfig(
        name="adamw",
        lr=5e-4,
        weight_decay=0.01,
        betas=(0.9, 0.95),
        eps=1e-6,
        momentum=0.0,
        schedule="linear",
        warmup_steps=2,
        min_lr_ratio=0.1,
    )
    assert cfg.train == TrainConfig(64, 20, None, 8, 10, 7, 5)
    assert cfg.scaling == ScalingConfig(num_workers=2, use_gpu=False, cpus_per_worker=0.5)
    assert cfg.output == OutputConfig(dir=str(t / "out"), name="full-demo")
    assert cfg.run_dir == str(t / "out" / "full-demo")
    # Types are the declared ones, not what YAML happened to produce.
    assert type(cfg.privacy.target_epsilon) is float
    assert type(cfg.model.lora.alpha) is float
    assert type(cfg.optim.momentum) is float
    assert isinstance(cfg.optim.betas, tuple)


def test_defaults_apply(in_tmp):
    cfg = recipe_from_dict(minimal())
    assert cfg.model.tiny == TinyModelConfig()
    assert cfg.model.lora is None
    assert cfg.model.dtype == "float32"
    assert cfg.data.sequence_length == 128 and cfg.data.synthetic is None
    assert cfg.privacy.accountant == "pld" and cfg.privacy.rng == "secure"
    assert cfg.privacy.delta is None and cfg.privacy.seed is None
    assert cfg.optim == OptimConfig()
    assert dataclasses.replace(cfg.train, steps=None) == TrainConfig()
    assert cfg.scaling == ScalingConfig()
    # The default output dir is a relative path like any other: resolved against cwd.
    assert cfg.output.dir == str(in_tmp.resolve() / "runs")
    assert cfg.output.name is None
    with pytest.raises(ConfigError, match=r"output\.name: not set"):
        _ = cfg.run_dir


def test_empty_sections_mean_defaults(in_tmp):
    path = write(
        in_tmp,
        """\
        model: {init: tiny, tokenizer: ./tok}
        data: {path: c.jsonl}
        privacy: {noise_multiplier: 1}
        train: {epochs: 1}
        scaling:
        optim:
        """,
    )
    cfg = load_recipe(path)
    assert cfg.scaling == ScalingConfig() and cfg.optim == OptimConfig()
    assert cfg.train.epochs == 1.0 and cfg.train.steps is None


def test_lora_empty_mapping_means_defaults(in_tmp):
    d = minimal()
    d["model"]["lora"] = {}
    assert recipe_from_dict(d).model.lora == LoraConfig()


def test_pretrained_hub_id_kept_and_tokenizer_defaults_to_model(in_tmp):
    d = minimal()
    d["model"] = {"name_or_path": "meta-llama/Llama-3.2-1B"}
    cfg = recipe_from_dict(d)
    assert cfg.model.name_or_path == "meta-llama/Llama-3.2-1B"
    assert cfg.model.tokenizer == "meta-llama/Llama-3.2-1B"


def test_model_path_resolved_when_it_exists_locally(in_tmp):
    (in_tmp / "my-model").mkdir()
    d = minimal()
    d["model"] = {"name_or_path": "my-model", "tokenizer": "~/tok"}
    cfg = recipe_from_dict(d)
    assert cfg.model.name_or_path == str(in_tmp.resolve() / "my-model")
    assert cfg.model.tokenizer == os.path.join(os.path.expanduser("~"), "tok")


def test_relative_paths_become_absolute_against_cwd(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    path = write(
        recipe_dir,
        """\
        model: {init: tiny, tokenizer: ../tok}
        data: {path: corpus/train.jsonl}
        privacy: {noise_multiplier: 1}
        train: {steps: 5}
        output: {dir: ./runs}
        """,
    )
    monkeypatch.chdir(work)
    cfg = load_recipe(path)
    # Against the cwd at load time, not against the recipe's folder.
    assert cfg.data.path == str(work.resolve() / "corpus" / "train.jsonl")
    assert cfg.model.tokenizer == str(tmp_path.resolve() / "tok")
    assert cfg.output.dir == str(work.resolve() / "runs")
    assert os.path.isabs(cfg.run_dir)
    # An explicit base_dir wins over the cwd.
    cfg2 = recipe_from_dict(minimal(), base_dir=recipe_dir)
    assert cfg2.data.path == str(recipe_dir / "corpus.jsonl")


def test_home_expanded_in_data_path(in_tmp):
    d = minimal()
    d["data"]["path"] = "~/corpus.jsonl"
    assert recipe_from_dict(d).data.path == os.path.join(os.path.expanduser("~"), "corpus.jsonl")


def test_overrides_nested_lists_null(in_tmp):
    path = write(in_tmp, FULL_RECIPE)
    cfg = load_recipe(
        path,
        [
            "privacy.target_epsilon=4",
            "model.lora=null",
            "optim.betas=[0.8,0.9]",
            "optim.lr=1e-3",
            "model.tiny.num_layers=3",
            "output.name=exp_1",
            "train.steps=30",
        ],
    )
    assert cfg.privacy.target_epsilon == 4.0 and type(cfg.privacy.target_epsilon) is float
    assert cfg.model.lora is None
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.optim.lr == 1e-3
    assert cfg.model.tiny.num_layers == 3
    assert cfg.output.name == "exp_1"
    assert cfg.train.steps == 30


def test_override_switches_privacy_mode_and_creates_sections(in_tmp):
    d = minimal()
    raw = apply_overrides(
        d,
        ["privacy.noise_multiplier=null", "privacy.target_epsilon=2", "model.lora.r=16"],
    )
    assert d == minimal(), "apply_overrides must not modify its input"
    cfg = recipe_from_dict(raw)
    assert cfg.privacy.noise_multiplier is None and cfg.privacy.target_epsilon == 2.0
    assert cfg.model.lora == LoraConfig(r=16)  # setting a LoRA key turns LoRA on


def test_later_override_wins(in_tmp):
    cfg = recipe_from_dict(apply_overrides(minimal(), ["train.steps=3", "train.steps=4"]))
    assert cfg.train.steps == 4


def test_parse_override():
    assert parse_override("a.b=c") == (("a", "b"), "c")
    assert parse_override("privacy.delta=1e-5") == (("privacy", "delta"), "1e-5")
    assert parse_override("optim.betas=[0.9, 0.95]") == (("optim", "betas"), [0.9, 0.95])
    assert parse_override("model.lora={r: 2}") == (("model", "lora"), {"r": 2})
    assert parse_override("output.name=a=b") == (("output", "name"), "a=b")
    assert parse_override(" train.steps = 5") == (("train", "steps"), 5)


def test_round_trip_to_dict_from_dict(in_tmp):
    cfg = load_recipe(write(in_tmp, FULL_RECIPE))
    d = to_dict(cfg)
    assert d["optim"]["betas"] == [0.9, 0.95]
    assert d["model"]["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    # Plain data only: YAML's safe dumper accepts it.
    yaml.safe_dump(d)
    assert recipe_from_dict(d) == cfg
    assert from_dict(copy.deepcopy(d)) == cfg
    assert validate_recipe(cfg) == cfg
    # Also from a config with defaults everywhere.
    c2 = recipe_from_dict(minimal())
    assert from_dict(to_dict(c2)) == c2


def test_dump_yaml_then_load_is_equal(in_tmp, monkeypatch):
    cfg = load_recipe(write(in_tmp, FULL_RECIPE), ["model.lora=null"])
    out = in_tmp / "run" / "config.yaml"
    dump_yaml(cfg, out)
    text = out.read_text()
    assert config_hash(cfg) in text
    # Resolved: loading from elsewhere changes nothing (paths are already absolute).
    elsewhere = in_tmp / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = load_recipe(out)
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)


def test_config_hash_stable_and_sensitive(in_tmp):
    a = recipe_from_dict(minimal())
    b = recipe_from_dict(minimal())
    h = config_hash(a)
    assert len(h) == 64 and int(h, 16) >= 0
    assert config_hash(b) == h
    # Key order in the input does not matter.
    reordered = dict(reversed(list(minimal().items())))
    assert config_hash(recipe_from_dict(reordered)) == h
    c = recipe_from_dict(apply_overrides(minimal(), ["privacy.max_grad_norm=0.5"]))
    assert config_hash(c) != h
    # An int and the equal float are the same config.
    d = recipe_from_dict(apply_overrides(minimal(), ["privacy.noise_multiplier=1"]))
    assert config_hash(d) == h


def test_configs_are_frozen_and_hashable(in_tmp):
    cfg = recipe_from_dict(minimal())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 5  # type: ignore[misc]
    assert hash(cfg) == hash(recipe_from_dict(minimal()))
    assert isinstance(cfg, RecipeConfig)


def test_integral_float_accepted_for_int(in_tmp):
    d = minimal()
    d["data"]["synthetic"] = {"num_documents": 1000.0}
    cfg = recipe_from_dict(d)
    assert cfg.data.synthetic.num_documents == 1000
    assert type(cfg.data.synthetic.num_documents) is int


def test_seeded_rng_with_seed(in_tmp):
    d = minimal()
    d["privacy"].update(rng="seeded", seed=42)
    assert recipe_from_dict(d).privacy.seed == 42


def test_duplicate_yaml_key_is_an_error(in_tmp):
    path = write(
        in_tmp,
        """\
        privacy:
          noise_multiplier: 1.0
        data: {path: c.jsonl}
        privacy:
          target_epsilon: 3
        """,
    )
    with pytest.raises(
        ConfigError, match=r"line 4.*duplicate key 'privacy' \(first defined at line 1\)"
    ):
        load_recipe(path)


def test_config_error_pickles_with_key():
    err = ConfigError("privacy.delta: bad", key="privacy.delta")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, ConfigError) and isinstance(back, ValueError)
    assert str(back) == "privacy.delta: bad" and back.key == "privacy.delta"


# ---------------------------------------------------------------------- helper messages


def test_validate_helper_messages():
    with pytest.raises(ConfigError) as e:
        v.check_choice("privacy.accountant", "pdl", ["pld", "rdp"])
    assert str(e.value).startswith("privacy.accountant: 'pdl' is not one of ['pld', 'rdp']")
    assert e.value.key == "privacy.accountant"

    with pytest.raises(ConfigError) as e:
        v.check_range("train.expected_batch_size", 0, 1)
    assert str(e.value) == "train.expected_batch_size: 0 is out of range; expected an integer >= 1"

    with pytest.raises(ConfigError) as e:
        v.check_range("x.p", 1.5, 0, 1, True, False)
    assert str(e.value) == "x.p: 1.5 is out of range; expected a number in [0, 1)"

    keys = ["privacy", "privacy.noise_multiplier", "privacy.delta", "optim", "optim.lr"]
    assert v.suggest("privacy.noise_multipler", keys) == "privacy.noise_multiplier"
    assert v.suggest("train.lr", keys) == "optim.lr"
    assert v.suggest("privacy.zzz", keys) is None
    assert str(v.unknown_key_error("privacy.noise_multipler", keys)) == (
        "privacy.noise_multipler: unknown key; did you mean 'privacy.noise_multiplier'?"
    )
    assert "expected one of ['noise_multiplier', 'delta']" in str(
        v.unknown_key_error("privacy.zzz", keys)
    )

    assert v.check_type("a.b", 3, float) == 3.0
    assert v.check_type("a.b", "1e-3", float) == 1e-3
    assert v.check_type("a.b", 2.0, int) == 2
    assert v.check_type("a.b", None, int, nullable=True) is None
    with pytest.raises(
        ConfigError, match=r"a\.b: True has the wrong type \(bool\); expected an integer"
    ):
        v.check_type("a.b", True, int)
    with pytest.raises(
        ConfigError, match=r"a\.b: 2\.5 has the wrong type \(float\); expected an integer"
    ):
        v.check_type("a.b", 2.5, int)
    with pytest.raises(ConfigError, match=r"a\.b: 'nan' is not a finite number"):
        v.check_type("a.b", "nan", float)
    assert v.check_exactly_one({"a": None, "b": 1}) == "b"


# ------------------------------------------------------------- malformed recipes (dicts)


def _edit(path: str, value):
    """minimal() with the dotted key set to value (a sentinel DELETE removes it)."""
    d = minimal()
    *parents, last = path.split(".")
    node = d
    for k in parents:
        node = node.setdefault(k, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return d


DELETE = object()

BAD = [
    # (id, dotted key, value, substrings the message must contain)
    (
        "unknown-section",
        "evaluations",
        {"x": 1},
        [
            "evaluations: unknown key; expected one of ['model', 'data', 'privacy', 'optim', "
            "'train', 'scaling', 'output', 'eval', 'sweep', 'logging']"
        ],
    ),
    ("typo-top-level", "Privacy", {}, ["Privacy: unknown key; did you mean 'privacy'?"]),
    (
        "typo-key",
        "privacy.noise_multipler",
        1.0,
        ["privacy.noise_multipler: unknown key; did you mean 'privacy.noise_multiplier'?"],
    ),
    ("key-in-wrong-section", "train.lr", 0.1, ["train.lr: unknown key; did you mean 'optim.lr'?"]),
    (
        "string-for-int",
        "train.steps",
        "ten",
        ["train.steps: 'ten' has the wrong type (str); expected an integer or null"],
    ),
    (
        "bool-for-int",
        "train.physical_batch_size",
        True,
        [
            "train.physical_batch_size: True has the wrong type (bool); expected an integer",
            "booleans",
        ],
    ),
    (
        "bool-for-float",
        "optim.lr",
        False,
        ["optim.lr: False has the wrong type (bool); expected a number"],
    ),
    ("fractional-for-int", "train.steps", 2.5, ["train.steps: 2.5 has the wrong type (float)"]),
    (
        "exp-string-for-int",
        "train.steps",
        "1e3",
        ["train.steps: '1e3' has the wrong type (str)", "write it as 1000"],
    ),
    (
        "non-number-string",
        "optim.lr",
        "fast",
        ["optim.lr: 'fast' has the wrong type (str); expected a number"],
    ),
    ("nan", "optim.lr", ".nan", ["optim.lr: '.nan' has the wrong type"]),
    (
        "negative-lr",
        "optim.lr",
        -0.001,
        ["optim.lr: -0.001 is out of range; expected a number > 0"],
    ),
    (
        "delta-one",
        "privacy.delta",
        1.0,
        ["privacy.delta: 1.0 is out of range; expected a number in (0, 1)"],
    ),
    ("delta-zero", "privacy.delta", 0, ["privacy.delta: 0.0 is out of range", "(0, 1)"]),
    (
        "seq-len-4",
        "data.sequence_length",
        4,
        ["data.sequence_length: 4 is out of range; expected an integer in [8, 65536]"],
    ),
    (
        "beta-one",
        "optim.betas",
        [0.9, 1.0],
        ["optim.betas[1]: 1.0 is out of range; expected a number in [0, 1)"],
    ),
    (
        "betas-length",
        "optim.betas",
        [0.9],
        ["optim.betas: [0.9] has 1 items; expected a list of 2 numbers"],
    ),
    (
        "betas-scalar",
        "optim.betas",
        0.9,
        ["optim.betas: 0.9 has the wrong type (float); expected a list of 2 numbers"],
    ),
    (
        "bad-choice",
        "privacy.accountant",
        "pdl",
        ["privacy.accountant: 'pdl' is not one of ['pld', 'rdp']; did you mean 'pld'?"],
    ),
    (
        "choice-case",
        "model.dtype",
        "Float32",
        [
            "model.dtype: 'Float32' is not one of ['float32', 'bfloat16', 'float64']",
            "case-sensitive",
        ],
    ),
    (
        "both-eps-and-sigma",
        "privacy.target_epsilon",
        3,
        [
            "privacy.target_epsilon and privacy.noise_multiplier: set exactly one of them, not both",
            "privacy.target_epsilon=3.0",
            "privacy.noise_multiplier=1.0",
        ],
    ),
    (
        "neither-eps-nor-sigma",
        "privacy.noise_multiplier",
        DELETE,
        [
            "privacy.target_epsilon and privacy.noise_multiplier: set exactly one of them; neither is set"
        ],
    ),
    (
        "seeded-without-seed",
        "privacy.rng",
        "seeded",
        ["privacy.seed: required when privacy.rng is 'seeded'"],
    ),
    (
        "seed-with-secure",
        "privacy.seed",
        1,
        ["privacy.seed: 1 is given but privacy.rng is 'secure'", "set privacy.seed: null"],
    ),
    (
        "steps-and-epochs",
        "train.epochs",
        2,
        [
            "train.steps and train.epochs: set exactly one of them, not both",
            "train.steps=10",
            "train.epochs=2.0",
        ],
    ),
    ("missing-data-path", "data.path", DELETE,
     ["data.path / data.dataset: give exactly one data source, got neither"]),
    ("missing-data-section", "data", DELETE, ["data.path / data.dataset: give exactly one"]),
    ("path-and-dataset", "data.dataset", "org/notes",
     ["give exactly one data source, got both", "dataset='org/notes'"]),
    ("empty-data-path", "data.path", "", ["data.path: empty string"]),
    (
        "data-path-int",
        "data.path",
        3,
        ["data.path: 3 has the wrong type (int); expected a string", "quote it"],
    ),
    (
        "unit-user-without-bound",
        "data.unit",
        "user",
        ["data.max_rows_per_unit: required with data.unit 'user'", "e.g. max_rows_per_unit: 4"],
    ),
    (
        "unit-document-without-bound",
        "data.unit",
        "document",
        ["data.max_rows_per_unit: required with data.unit 'document'"],
    ),
    (
        "prompt-without-response",
        "data.prompt_field",
        "question",
        ["data.response_field: instruction records need both", "prompt_field='question'"],
    ),
    (
        "max-batch-size-with-poisson",
        "privacy.max_batch_size",
        300,
        ["privacy.max_batch_size: 300 is only used with privacy.sampler 'truncated-poisson'"],
    ),
    (
        "sampler-unknown",
        "privacy.sampler",
        "shuffle",
        ["privacy.sampler: 'shuffle' is not one of ['poisson', 'truncated-poisson', 'cyclic-poisson', 'fixed-cycle']"],
    ),
    (
        "unit-unknown",
        "data.unit",
        "row",
        ["data.unit: 'row' is not one of ['sequence', 'document', 'user']"],
    ),
    (
        "tiny-without-tokenizer",
        "model.tokenizer",
        DELETE,
        ["model.tokenizer: required when model.init is 'tiny'"],
    ),
    (
        "pretrained-without-name",
        "model.init",
        "pretrained",
        ["model.name_or_path: required when model.init is 'pretrained'"],
    ),
    (
        "hidden-not-divisible",
        "model.tiny",
        {"hidden_size": 66},
        ["model.tiny.hidden_size: 66 is not divisible by model.tiny.num_heads (4)"],
    ),
    (
        "kv-does-not-divide",
        "model.tiny",
        {"num_kv_heads": 3},
        ["model.tiny.num_kv_heads: 3 does not divide model.tiny.num_heads (4)"],
    ),
    (
        "hidden-too-small",
        "model.tiny",
        {"hidden_size": 4},
        ["model.tiny.hidden_size: 4 is out of range; expected an integer >= 8"],
    ),
    (
        "positions-shorter-than-sequence",
        "model.tiny",
        {"max_position_embeddings": 64},
        ["model.tiny.max_position_embeddings: 64 is less than data.sequence_length (128)"],
    ),
    ("lora-no-targets", "model.lora", {"target_modules": []}, ["model.lora.target_modules: empty"]),
    (
        "lora-target-string",
        "model.lora",
        {"target_modules": "q_proj"},
        [
            "model.lora.target_modules: 'q_proj' has the wrong type (str); expected a list of strings"
        ],
    ),
    (
        "lora-dropout-one",
        "model.lora",
        {"dropout": 1},
        ["model.lora.dropout: 1.0 is out of range; expected a number in [0, 1)"],
    ),
    (
        "lora-true",
        "model.lora",
        True,
        ["model.lora: True has the wrong type (bool); expected a mapping or null"],
    ),
    ("lora-unknown-key", "model.lora", {"rank": 4}, ["model.lora.rank: unknown key", "'r'"]),
    (
        "warmup-too-long",
        "optim.warmup_steps",
        10,
        ["optim.warmup_steps: 10 must be less than train.steps (10)"],
    ),
    (
        "physical-batch-zero",
        "train.physical_batch_size",
        0,
        ["train.physical_batch_size: 0 is out of range; expected an integer >= 1"],
    ),
    ("workers-zero", "scaling.num_workers", 0, ["scaling.num_workers: 0 is out of range"]),
    (
        "section-not-mapping",
        "scaling",
        4,
        ["scaling: 4 has the wrong type (int); expected a mapping"],
    ),
    (
        "null-for-bool",
        "scaling.use_gpu",
        None,
        ["scaling.use_gpu: null is not allowed; expected a boolean"],
    ),
    (
        "quoted-bool",
        "scaling.use_gpu",
        "true",
        ["scaling.use_gpu: 'true' has the wrong type (str)", "without quotes"],
    ),
    (
        "bad-run-name",
        "output.name",
        "my run",
        ["output.name: 'my run' does not match [A-Za-z0-9._-]+"],
    ),
    ("dotdot-run-name", "output.name", "..", ["output.name: '..' is not a run name"]),
    (
        "synthetic-kind",
        "data.synthetic",
        {"kind": "emails"},
        ["data.synthetic.kind: 'emails' is not one of ['clinical_notes']"],
    ),
]


@pytest.mark.parametrize(
    ("key", "value", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_malformed_recipe_message(in_tmp, key, value, expected):
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(_edit(key, value))
    message = str(e.value)
    assert "\n" not in message, "one error, one line"
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_error_key_attribute_names_the_field(in_tmp):
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(_edit("privacy.delta", 2))
    assert e.value.key == "privacy.delta"


def test_first_error_in_file_order_is_reported(in_tmp):
    d = minimal()
    d["optim"] = {"lr": -1, "eps": -1}
    with pytest.raises(ConfigError, match=r"^optim\.lr: "):
        recipe_from_dict(d)


# ------------------------------------------------------- malformed files and overrides


def test_missing_recipe_file(in_tmp):
    with pytest.raises(ConfigError, match=r"recipe file not found: 'nope\.yaml'"):
        load_recipe("nope.yaml")


def test_recipe_path_is_directory(in_tmp):
    with pytest.raises(ConfigError, match="is a directory"):
        load_recipe(in_tmp)


def test_yaml_syntax_error_names_line(in_tmp):
    path = write(
        in_tmp,
        """\
        model:
          init: tiny
        data:
          path: [unclosed
        privacy:
          noise_multiplier: 1
        """,
    )
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    message = str(e.value)
    assert str(path) in message and "YAML syntax error at line" in message
    assert "line 5" in message  # where the parser noticed the unclosed list


def test_yaml_bad_indentation_names_line(in_tmp):
    path = write(in_tmp, "model:\n  init: tiny\n tokenizer: x\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line 3"):
        load_recipe(path)


@pytest.mark.parametrize(
    ("text", "kind"),
    [("- model\n- data\n", "list"), ("just a string\n", "str"), ("42\n", "int")],
)
def test_top_level_not_a_mapping(in_tmp, text, kind):
    path = write(in_tmp, text)
    with pytest.raises(
        ConfigError, match=rf"top level must be a mapping with the sections .*got {kind}"
    ):
        load_recipe(path)


def test_top_level_not_a_mapping_from_dict():
    with pytest.raises(ConfigError, match=r"top level must be a mapping.*got list"):
        recipe_from_dict(["model"])  # type: ignore[arg-type]


def test_empty_recipe_file(in_tmp):
    path = write(in_tmp, "# nothing here\n")
    with pytest.raises(ConfigError, match="the recipe is empty"):
        load_recipe(path)


def test_run_name_from_file_stem_must_be_valid(in_tmp):
    path = write(in_tmp, yaml.safe_dump(minimal()), "my recipe.yaml")
    with pytest.raises(
        ConfigError, match=r"output\.name: 'my recipe' \(from the recipe file name\)"
    ):
        load_recipe(path)
    assert load_recipe(path, ["output.name=ok"]).output.name == "ok"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("privacy.target_epsilon", "no '='; expected key=value"),
        ("=4", "empty key"),
        ("privacy..delta=1", "malformed key 'privacy..delta'"),
        ("--privacy.delta=1", "malformed key '--privacy.delta'"),
        ("optim.betas=[0.9,", "is not valid YAML"),
    ],
)
def test_bad_override_syntax(override, expected):
    with pytest.raises(ConfigError) as e:
        parse_override(override)
    assert f"override {override!r}" in str(e.value)
    assert expected in str(e.value)


def test_unknown_key_in_override_gets_suggestion(in_tmp):
    path = write(in_tmp, yaml.safe_dump(minimal()))
    with pytest.raises(ConfigError) as e:
        load_recipe(path, ["privacy.noise_multipler=2"])
    assert str(e.value) == (
        "privacy.noise_multipler: unknown key in override 'privacy.noise_multipler=2'; "
        "did you mean 'privacy.noise_multiplier'?"
    )
    with pytest.raises(
        ConfigError, match=r"^optimizer: unknown key in override .*did you mean 'optim'"
    ):
        load_recipe(path, ["optimizer.lr=1"])


def test_training_and_tokenizer_data_share_one_source_section():
    from llmdp.config.schema import SourceConfig, TokenizerDataConfig

    shared = {f.name for f in dataclasses.fields(SourceConfig)}
    assert shared <= {f.name for f in dataclasses.fields(DataConfig)}
    assert shared == {f.name for f in dataclasses.fields(TokenizerDataConfig)}
    # Each keeps its own privacy units and default.
    assert DataConfig().unit == "sequence" and TokenizerDataConfig().unit == "document"


def test_removed_train_log_every_is_an_unknown_key(in_tmp):
    # train.log_every was never read; a recipe that still sets it gets the usual error.
    d = minimal()
    d["train"]["log_every"] = 10
    with pytest.raises(ConfigError, match=r"^train\.log_every: unknown key") as e:
        recipe_from_dict(d)
    assert e.value.key == "train.log_every"


def test_override_below_a_value_is_rejected(in_tmp):
    with pytest.raises(
        ConfigError, match=r"optim\.lr\.x: unknown key in override .*'optim\.lr' is a value"
    ):
        apply_overrides(minimal(), ["optim.lr.x=1"])


def test_override_into_non_mapping_is_rejected(in_tmp):
    d = minimal()
    d["scaling"] = 3
    with pytest.raises(
        ConfigError, match=r"scaling: 3 is not a mapping, so override 'scaling\.num_workers=2'"
    ):
        apply_overrides(d, ["scaling.num_workers=2"])


def test_override_values_are_validated(in_tmp):
    path = write(in_tmp, yaml.safe_dump(minimal()))
    with pytest.raises(
        ConfigError, match=r"privacy\.accountant: 'RDP' is not one of \['pld', 'rdp'\]"
    ):
        load_recipe(path, ["privacy.accountant=RDP"])
    with pytest.raises(ConfigError, match=r"train\.steps: True has the wrong type \(bool\)"):
        load_recipe(path, ["train.steps=yes"])


def test_unit_rows_must_fit_a_micro_batch():
    d = _edit("data.unit", "user")
    d["data"].update({"user_field": "user_id", "max_rows_per_unit": 16})
    d["train"]["physical_batch_size"] = 8
    with pytest.raises(ConfigError, match=r"train.physical_batch_size: 8 is less than data.max_rows_per_unit \(16\)"):
        recipe_from_dict(d)
    d["train"]["physical_batch_size"] = 16
    cfg = recipe_from_dict(d)
    assert (cfg.data.unit, cfg.data.user_field, cfg.data.max_rows_per_unit) == ("user", "user_id", 16)


def test_truncated_poisson_needs_the_pld_accountant():
    d = _edit("privacy.sampler", "truncated-poisson")
    d["privacy"]["accountant"] = "rdp"
    with pytest.raises(ConfigError, match="privacy.accountant: 'rdp' cannot account privacy.sampler "
                                          "'truncated-poisson'.*set accountant: pld"):
        recipe_from_dict(d)
    d["privacy"].update({"accountant": "pld", "max_batch_size": 300})
    assert recipe_from_dict(d).privacy.max_batch_size == 300


def test_unit_fields_describe_the_corpus_once():
    """max_rows_per_unit / user_field may sit in a sequence recipe, so that `data.unit=user`
    on the command line is enough; they bind only the unit kinds that use them."""
    d = minimal()
    d["data"].update({"user_field": "user_id", "max_rows_per_unit": 64})
    d["train"]["physical_batch_size"] = 8
    assert recipe_from_dict(d).data.unit == "sequence"  # 64 rows do not matter to sequence units
    d["data"]["unit"] = "user"
    with pytest.raises(ConfigError, match="physical_batch_size: 8 is less than data.max_rows_per_unit"):
        recipe_from_dict(d)


# ----------------------------------------------------------------- first contact (issue 12, 11a)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_train_commands() -> list[list[str]]:
    """Every `llmdp train ...` command line in the README's code blocks, as argv."""
    import re
    import shlex

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = re.sub(r"\\\n", " ", block)  # a command continued on the next line: one line
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if len(words) > 2 and words[0].endswith("llmdp") and words[1] == "train":
                commands.append([w for w in words[2:] if not w.startswith("--")])
    return commands


def test_readme_has_a_short_run_and_every_train_command_in_it_loads(monkeypatch):
    monkeypatch.chdir(REPO)
    commands = _readme_train_commands()
    assert any("train.steps=6" in c for c in commands), commands  # the quick first try
    for recipe, *overrides in commands:
        cfg = load_recipe(recipe, overrides)  # raises ConfigError on e.g. warmup >= steps
        assert cfg.train.steps is None or cfg.train.steps >= 1


@pytest.mark.parametrize("steps,warmup", [(6, 1), (12, 2), (50, 10), (300, 60)])
def test_the_demo_warmup_scales_with_train_steps(monkeypatch, steps, warmup):
    from llmdp.config.schema import warmup_steps_for
    from llmdp.train.loop import lr_lambda

    monkeypatch.chdir(REPO)
    cfg = load_recipe("recipes/tiny-cpu.yaml", [f"train.steps={steps}"])
    assert warmup_steps_for(cfg.optim, steps) == warmup
    f = lr_lambda(cfg.optim, steps)
    assert [f(s) for s in range(warmup)] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert f(warmup) == pytest.approx(1.0)  # the peak learning rate is reached before the end


@pytest.mark.parametrize("ratio,total,expected", [(0.0, 10, 0), (0.2, 50, 10), (0.29, 100, 29),
                                                  (0.7, 10, 7), (0.99, 3, 2), (0.5, 1, 0)])
def test_warmup_ratio_is_a_floor_below_the_run_length(ratio, total, expected):
    from llmdp.config.schema import warmup_steps_for

    assert warmup_steps_for({"warmup_steps": 0, "warmup_ratio": ratio}, total) == expected
    # An explicit warmup_steps wins over the ratio (as in transformers' TrainingArguments).
    assert warmup_steps_for({"warmup_steps": 3, "warmup_ratio": ratio}, total) == 3


def test_user_set_warmup_at_least_steps_names_both_keys_and_the_fix(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as e:
        load_recipe("recipes/tiny-cpu.yaml", ["train.steps=6", "optim.warmup_steps=6"])
    msg = str(e.value)
    assert "optim.warmup_steps: 6 must be less than train.steps (6)" in msg, msg
    assert "optim.warmup_ratio" in msg and "\n" not in msg, msg
    assert e.value.key == "optim.warmup_steps"


@pytest.mark.parametrize("value", [1, 1.5, -0.1])
def test_warmup_ratio_out_of_range(in_tmp, value):
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(_edit("optim.warmup_ratio", value))
    assert f"optim.warmup_ratio: {float(value)!r} is out of range" in str(e.value), str(e.value)


def test_readme_documents_the_cache_and_the_part_of_a_corpus(monkeypatch, tmp_path):
    from llmdp._fs import cache_root

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert "`data.unit_fraction: 0.1`" in text and "`data.max_units` (keep the first k units) was removed" in text
    assert "`LLMDP_CACHE`" in text and "`.cache/llmdp` under the current directory" in text
    for sub in ("`models/`", "`units/`", "`ledgers/`"):
        assert sub in text, sub
    # What the README says the code does: the default and the variable.
    monkeypatch.delenv("LLMDP_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert cache_root() == os.path.join(str(tmp_path), ".cache", "llmdp")
    monkeypatch.setenv("LLMDP_CACHE", str(tmp_path / "elsewhere"))
    assert cache_root() == str(tmp_path / "elsewhere")


@pytest.mark.slow  # generates and tokenizes the demo's 5,000 notes (~40 s on 2 cores)
def test_readme_demo_figures_match_the_data_preparation(tmp_path):
    """N, q, δ and σ that the README quotes for `make demo` are what the recipe produces
    (the data preparation of recipes/tiny-cpu.yaml, the same data and tokenizer, planned
    with recipes/demo-finetune.yaml's mechanism and optimizer, whose strategy and σ depend
    on them; no training: the fine-tuning recipe's starting model need not exist)."""
    import re

    from llmdp.run.launch import prepare

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    m = re.search(r"packs the 5,000 notes into N = ([\d,]+) training units of 128 tokens, samples "
                  r"B = 256 units per step \(q = ([\d.]+)\) for T = 50 steps, calibrates "
                  r"σ = ([\d.]+) for ε = 8 at δ = ([\de.-]+)", text)
    assert m, "the README's demo paragraph changed; update this test with it"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        demo = load_recipe("recipes/demo-finetune.yaml")
        p, o = demo.privacy, demo.optim
        like_demo = [f"privacy.mechanism={p.mechanism}", f"privacy.sampler={p.sampler}",
                     f"privacy.bands={'null' if p.bands is None else p.bands}",
                     f"optim.name={o.name}", f"optim.lr={o.lr}", f"optim.momentum={o.momentum}",
                     f"optim.schedule={o.schedule}", f"optim.warmup_ratio={o.warmup_ratio}"]
        cfg = load_recipe("recipes/tiny-cpu.yaml", [
            f"data.path={tmp_path / 'clinical_notes.jsonl'}", f"output.dir={tmp_path / 'runs'}",
            *like_demo])
    finally:
        os.chdir(cwd)
    plan = prepare(cfg, log=lambda *a: None).plan
    assert int(m.group(1).replace(",", "")) == plan.dataset_size
    # the demo's tuning proxy simulates the noise of a private run of exactly these units
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        tune = load_recipe("recipes/demo-tune.yaml")
    finally:
        os.chdir(cwd)
    assert tune.privacy.simulate and tune.privacy.simulate_units == plan.dataset_size
    assert (tune.privacy.target_epsilon, tune.privacy.mechanism, tune.train.expected_batch_size,
            tune.train.steps, tune.eval.epsilon) == (demo.privacy.target_epsilon,
                                                       demo.privacy.mechanism,
                                                       demo.train.expected_batch_size,
                                                       demo.train.steps, demo.eval.epsilon)
    # and the committed selection the demo takes (recipes/tuned/) was made at this σ
    from llmdp.config.best import read_best_file

    sim = read_best_file(demo.train.hyperparameters_from)["simulated_noise"]
    assert (sim["private_units"], f"{sim['noise_multiplier']:.6g}") == (
        plan.dataset_size, f"{plan.noise_multiplier:.6g}")
    assert m.group(2) == f"{plan.sampling_probability:.3g}"
    assert m.group(3) == f"{plan.noise_multiplier:.3g}"
    assert float(m.group(4)) == plan.delta
