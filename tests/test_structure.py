"""Structural checks of the llmdp package, read from its source with `ast` (no imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import llmdp

PACKAGE = Path(llmdp.__file__).resolve().parent

# Choice lists and small validators that must be defined in exactly one module.
SINGLE_DEFINITIONS = (
    "SAMPLERS",
    "RELATIONS",
    "STRATEGIES",
    "MIXED_PRECISION",
    "ACCOUNTANTS",
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


# A module longer than this says in its docstring why it is one file ("Why one file ...").
MAX_LINES = 510


def test_long_modules_say_why_they_are_one_file():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        n = text.count("\n")
        if n > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why one file" not in doc:
                long[path.relative_to(PACKAGE.parent).as_posix()] = n
    assert not long, f"modules over {MAX_LINES} lines without a 'Why one file' paragraph: {long}"
