"""The plan's choices (`llmdp.config.choices`) are the recipe validator's only list (issue
53): a field typed with one accepts exactly its values and its error lists them, and a
recipe's resolved copy holds the same strings as before the choices were enums
(``tests/fixtures/before_enums.json``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from llmdp.config import schema
from llmdp.config.choices import Accountant, Choice, Mechanism, Sampler
from llmdp.config.load import _hints, build
from llmdp.config.schema import (
    ConfigError,
    PrivacyConfig,
    config_hash,
    load_recipe,
    recipe_from_dict,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
BEFORE = json.loads((ROOT / "tests" / "fixtures" / "before_enums.json").read_text(encoding="utf-8"))


def _refused(privacy: dict) -> str:
    with pytest.raises(ConfigError) as e:
        recipe_from_dict({"data": {"path": "x.jsonl"}, "privacy": {"target_epsilon": 3, **privacy}})
    return str(e.value)


@pytest.mark.parametrize("field,kind,bad,close", [
    ("accountant", Accountant, "pdl", "pld"),
    ("sampler", Sampler, "Poisson", "poisson"),
    ("mechanism", Mechanism, "banded_mf", "banded-mf"),
])
def test_a_bad_choice_is_refused_listing_exactly_the_enums_values(field, kind, bad, close):
    values = [m.value for m in kind]
    message = _refused({field: bad})
    assert message.startswith(f"privacy.{field}: {bad!r} is not one of {values!r}; did you mean "
                              f"{close!r}?")


def test_a_choice_of_the_wrong_type_is_refused_as_a_string_field_was():
    assert _refused({"accountant": 3}) == ("privacy.accountant: 3 has the wrong type (int); "
                                          "expected a string (quote it to make it a string)")
    assert _refused({"sampler": ""}) == "privacy.sampler: empty string; expected a non-empty string"


def test_a_new_member_is_accepted_without_touching_the_validator(monkeypatch):
    """The validator reads the field's enum: a member added to it is a valid recipe value,
    and the list in the error has it."""
    grown = Choice("Accountant", [(m.name, m.value) for m in Accountant] + [("NEW", "new")])
    monkeypatch.setattr(schema, "Accountant", grown)
    _hints.cache_clear()  # the schema's types are read once per process
    try:
        cfg = load_recipe(ROOT / "recipes" / "tiny-cpu.yaml", ["privacy.accountant=new"])
        assert cfg.privacy.accountant is grown.NEW and to_dict(cfg.privacy)["accountant"] == "new"
        assert "['pld', 'rdp', 'new']" in _refused({"accountant": "pdl"})
    finally:
        monkeypatch.undo()
        _hints.cache_clear()
    assert "['pld', 'rdp']" in _refused({"accountant": "pdl"})


def test_a_recipe_reads_its_choices_as_members():
    cfg = load_recipe(ROOT / "recipes" / "tiny-cpu.yaml",
                      ["privacy.accountant=rdp", "privacy.mechanism=banded-mf", "privacy.bands=4",
                       "privacy.sampler=fixed-cycle"])
    p = cfg.privacy
    assert (p.accountant, p.sampler, p.mechanism) == (Accountant.RDP, Sampler.FIXED_CYCLE,
                                                      Mechanism.BANDED_MF)
    assert isinstance(p.accountant, Accountant) and isinstance(p.mechanism, Mechanism)


@pytest.mark.parametrize("name,raw", [
    ("privacy_section", {"target_epsilon": 3.0, "accountant": "rdp", "mechanism": "banded-mf",
                         "bands": 4, "sampler": "fixed-cycle"}),
    ("privacy_defaults", {}),
])
def test_the_resolved_section_is_written_as_before(name, raw):
    section = build(PrivacyConfig, raw, what="privacy")
    plain = to_dict(section)
    # fields added since the fixture was written (at their defaults), then the rest as before
    assert (plain.pop("simulate"), plain.pop("simulate_units")) == (False, None)
    assert json.dumps(plain) == BEFORE[name]
    assert all(type(plain[f]) is str for f in ("accountant", "sampler", "mechanism"))
    before = json.loads(BEFORE[name])
    assert yaml.safe_dump(plain, sort_keys=False) == yaml.safe_dump(before, sort_keys=False)
    # the hash: of the same text with the newer fields' defaults (a recipe's hash changes
    # when its section gains a field, as it did for every field added before)
    now = {**before, "simulate": False, "simulate_units": None}
    canonical = json.dumps(now, sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert config_hash(section) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def test_a_resolved_recipe_reads_back_equal(tmp_path):
    cfg = load_recipe(ROOT / "recipes" / "tiny-cpu.yaml", ["privacy.accountant=rdp"])
    schema.dump_yaml(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text(encoding="utf-8")
    assert "accountant: rdp\n" in text and "!!python" not in text
    again = load_recipe(tmp_path / "config.yaml")
    assert again.privacy == cfg.privacy and config_hash(again) == config_hash(cfg)
