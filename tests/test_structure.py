"""Structural checks of the llmdp package, read from its source with `ast` (no imports)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import llmdp

PACKAGE = Path(llmdp.__file__).resolve().parent

# Choice lists and small validators that must be defined in exactly one module.
SINGLE_DEFINITIONS = (
    "Accountant",
    "Sampler",
    "Mechanism",
    "Relation",
    "STRATEGIES",
    "MIXED_PRECISION",
    "_is_int",
    "_check_delta",
    "_check_steps",
    "_check_positive",
)


def _module_level_definitions(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level by def, class or assignment (not import)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
    return names


def test_shared_names_are_defined_in_exactly_one_module():
    where: dict[str, list[str]] = {name: [] for name in SINGLE_DEFINITIONS}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        defined = _module_level_definitions(tree)
        for name in SINGLE_DEFINITIONS:
            if name in defined:
                where[name].append(path.relative_to(PACKAGE.parent).as_posix())
    wrong = {name: mods for name, mods in where.items() if len(mods) != 1}
    assert not wrong, f"each name must be defined in exactly one module: {wrong}"


# Issue 31: one package per stage; the top level keeps the CLI, the package's API and two
# shared primitives (their place is argued in docs/DESIGN.md §2); the order of the packages
# is tests/test_layers.py's.
TOP_LEVEL = {"__init__.py", "cli.py", "_fs.py", "_triton.py"}
DESIGN = PACKAGE.parent / "docs" / "DESIGN.md"


def test_the_top_level_holds_only_the_cli_the_api_and_the_shared_primitives():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL, f"modules at llmdp/'s top level beyond {sorted(TOP_LEVEL)}: {sorted(top - TOP_LEVEL)}"
    assert len(TOP_LEVEL - {"__init__.py", "cli.py"}) <= 3


def _layout_blocks() -> dict[str, str]:
    """docs/DESIGN.md §2's layout: the text under each top-level entry of ``llmdp/`` (a
    package's block holds its modules and sub-packages)."""
    text = DESIGN.read_text(encoding="utf-8")
    layout = text[text.index("## 2. Layout"):text.index("## 3.")]
    layout = layout[layout.index("llmdp/\n"):]
    blocks: dict[str, list[str]] = {}
    current = None
    for line in layout.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):
            current = line.split()[0]
            blocks[current] = [line]
        elif line.startswith("   ") and current is not None:
            blocks[current].append(line)
        else:
            break  # the end of llmdp/ (recipes/, tests/, ...)
    return {k: "\n".join(v) for k, v in blocks.items()}


def test_every_module_appears_in_the_designs_layout():
    blocks = _layout_blocks()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            continue
        if len(rel.parts) == 1:
            found = rel.name in blocks
        else:
            block = blocks.get(rel.parts[0] + "/", "")
            found = re.search(rf"(?<![\w/]){re.escape(path.name)}\b", block) is not None
        if not found:
            missing.append(rel.as_posix())
    assert not missing, f"modules missing from docs/DESIGN.md §2's layout: {missing}"
    stale = [k for k in blocks if k.endswith(".py") and not (PACKAGE / k).exists()]
    stale += [k for k in blocks if k.endswith("/") and not (PACKAGE / k).is_dir()]
    assert not stale, f"docs/DESIGN.md §2 names what llmdp/ does not hold: {stale}"


# llmdp/privacy/ is cut by concept (docs/DESIGN.md §2): sub-packages rng, noise, sampling,
# accounting, mf and ledger, and plan.py, which composes them; not a flat folder of modules.
MAX_PRIVACY_ENTRIES = 10


def test_privacy_is_a_few_subpackages_not_a_flat_folder():
    entries = sorted(p.name for p in (PACKAGE / "privacy").iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_PRIVACY_ENTRIES, (
        f"llmdp/privacy/ holds {len(entries)} entries (at most {MAX_PRIVACY_ENTRIES}): {entries}; "
        "put a new module in the sub-package of its concept")
