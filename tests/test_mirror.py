"""The tests mirror the package: a test of ``llmdp/<a>/<b>/…`` lives in ``tests/<a>/<b>/…``.

Every folder under ``tests/`` (but the fixtures' data and the caches) names a package or
sub-package of ``llmdp`` (or a top-level module: ``tests/cli/`` tests ``llmdp/cli.py``), and the only test modules at the top of ``tests/`` are those of
no one package: the whole path end to end, and the checks of the project itself (its
imports and structure, this layout, the benchmarks' scripts)."""

from __future__ import annotations

import re
from pathlib import Path

import llmdp

TESTS = Path(__file__).resolve().parent
PACKAGE = Path(llmdp.__file__).resolve().parent

#: Folders of tests/ that hold data or helpers, not tests of a package.
NOT_PACKAGES = {"fixtures", "__pycache__"}
#: Test modules at the top of tests/: of no one package.
PROJECT_LEVEL = {"test_e2e.py", "test_imports.py", "test_structure.py", "test_mirror.py",
                 "test_invariants.py", "test_layers.py",
                 "test_benchmarks.py", "test_helpers.py"}


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_dir()
                  and not NOT_PACKAGES.intersection(p.relative_to(root).parts))


def test_every_test_folder_names_a_package_of_llmdp():
    def names_one(rel: Path) -> bool:  # a package, or a top-level module (``llmdp/cli.py``)
        return ((PACKAGE / rel / "__init__.py").is_file()
                or (len(rel.parts) == 1 and (PACKAGE / f"{rel.parts[0]}.py").is_file()))

    stray = [f.relative_to(TESTS).as_posix() for f in _folders(TESTS)
             if not names_one(f.relative_to(TESTS))]
    assert not stray, (f"tests/ folders that name no package of llmdp: {stray}; a test of "
                       "llmdp/<a>/<b>/... lives in tests/<a>/<b>/...")


def test_only_tests_of_no_one_package_sit_at_the_top():
    top = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in PROJECT_LEVEL)
    assert not top, (f"test modules at the top of tests/: {top}; move each into the folder of "
                     "the package it tests (tests/<package>/...)")


def test_every_test_path_the_project_cites_exists():
    """A moved test module leaves no stale path behind (docs, code, scripts)."""
    root = TESTS.parent
    files = [p for d in ("llmdp", "docs", "benchmarks", "launch", "tests") for p in (root / d).rglob("*")
             if p.suffix in (".py", ".md", ".sh", ".yaml")]
    files += [root / n for n in ("README.md", "BENCHMARKS.md", "pyproject.toml", "Makefile")]
    stale = sorted({f"{f.relative_to(root)}: {m}" for f in files if f.is_file()
                    for m in re.findall(r"(?<![\w/.])tests/[\w/]+\.py", f.read_text(encoding="utf-8"))
                    if not (root / m).is_file()})
    assert not stale, f"cited test paths that do not exist: {stale}"
