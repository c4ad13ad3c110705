"""The privacy invariants are named where they are owned (issue 53, item 4).

docs/DESIGN.md §3 lists them, each with a stable name (``[`noise-once`]``). Code, tests and
documents cite them by that name, never by a number (numbers move when one is added); every
citation names an invariant that exists; and each invariant has one test module that owns
it (its docstring says so), listed here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"

#: The test module that owns each invariant.
OWNERS = {
    "one-sensitivity-boundary": "tests/train/test_replay.py",
    "noise-once": "tests/train/test_worker.py",
    "sampling-as-accounted": "tests/privacy/sampling/test_sampling.py",
    "unit-is-a-unit": "tests/data/test_units.py",
    "write-ahead-ledger": "tests/privacy/ledger/test_ledger.py",
    "no-silent-fallbacks": "tests/clipping/test_engine.py",
    "secrets-stay-secret": "tests/run/test_private_at_rest.py",
    "precision-never-widens": "tests/clipping/test_norm_bounds.py",
    "only-dp-outputs-leave": "tests/hub/test_export.py",
    "ledger-not-bypassed": "tests/privacy/ledger/test_ledger_escapes.py",
    "published-from-dp-only": "tests/report/test_publication.py",
}

CITED = re.compile(r"invariants? ((?:`[a-z0-9-]+`(?:, | and )?)+)")
NUMBERED = re.compile(r"DESIGN,? §3\.\d|\binvariants? \d")


def _invariants() -> list[str]:
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("## 3. Privacy invariants"):text.index("\n## 4.")]
    return re.findall(r"(?m)^\d+\. \*\*[^*]+\*\* \[`([a-z0-9-]+)`\]", section)


def _sources() -> list[Path]:
    files = [p for d in ("llmdp", "tests", "benchmarks", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md")]
    return sorted(files + [ROOT / "README.md", ROOT / "BENCHMARKS.md"])


def test_design_names_every_invariant_once():
    names = _invariants()
    assert len(names) >= 11 and len(set(names)) == len(names), names


def test_every_citation_names_an_invariant_and_none_is_by_number():
    names = set(_invariants())
    unknown, numbered = [], []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for m in CITED.finditer(text):
            unknown += [f"{path.relative_to(ROOT)}: {n}" for n in re.findall(r"`([a-z0-9-]+)`", m.group(1))
                        if n not in names]
        numbered += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in NUMBERED.finditer(text)]
    assert not unknown, f"citations of invariants DESIGN §3 does not name: {unknown}"
    assert not numbered, f"invariants cited by number (cite the name in DESIGN §3): {numbered}"


def test_each_invariant_has_its_owning_test_module():
    assert sorted(OWNERS) == sorted(_invariants())
    for name, module in OWNERS.items():
        doc = ast.get_docstring(ast.parse((ROOT / module).read_text(encoding="utf-8"))) or ""
        assert f"Owns invariant `{name}`" in doc, f"{module}'s docstring does not say it owns `{name}`"
