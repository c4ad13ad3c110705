"""The layers of llmdp (issue 53): one ordered list of its top-level units, bottom to top, and
no unit importing a unit of its own layer or one above it. Every import counts, a lazy one
(inside a function) too: read from the source with `ast`, nothing is imported.

``from llmdp import x`` counts as unit ``x``; ``llmdp.x.y`` as unit ``x``. The same list is
docs/DESIGN.md §1's ("Layers"), checked here to be equal."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import llmdp
from tests.helpers import import_cycles

PACKAGE = Path(llmdp.__file__).resolve().parent
DESIGN = PACKAGE.parent / "docs" / "DESIGN.md"

# Bottom to top. A unit is a top-level package or module of llmdp/ (``__init__.py`` is the
# package's API: it may name any unit, lazily, and is not a layer of its own).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__version__", "_fs", "_triton", "base"),
    ("config",),
    ("data",),
    ("privacy",),
    ("clipping",),
    ("tokenizer", "evaluation", "audit"),
    ("record",),
    ("train",),
    ("report",),
    ("hub",),
    ("run",),
    ("tune", "synthetic"),
    ("cli",),
)


def _unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(tree: ast.AST):
    """(line, unit imported) for every import of an llmdp unit in ``tree``, lazy ones too."""
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "llmdp":
                modules = [f"llmdp.{a.name}" for a in node.names]
            elif node.module.startswith("llmdp."):
                modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names if a.name.startswith("llmdp.")]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"line {node.lineno}: a relative import; llmdp imports absolutely")
        for m in modules:
            yield node.lineno, m.split(".")[1]


def _edges() -> dict[str, dict[str, list[str]]]:
    """unit -> unit it imports -> the ``file:line`` of each such import."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        src = _unit_of(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, dst in _imports(tree):
            if dst != src:
                edges[src][dst].append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}")
    return edges


def _units() -> set[str]:
    """llmdp/'s packages and modules, and ``__version__`` (a constant of ``llmdp/__init__.py``,
    which imports nothing at import time); any other name of the package API is no unit."""
    units = {"__version__"} | {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    return units


def test_every_unit_has_exactly_one_layer():
    listed = [u for layer in LAYERS for u in layer]
    assert len(listed) == len(set(listed)), f"a unit named twice in LAYERS: {listed}"
    assert set(listed) == _units(), (
        f"LAYERS and llmdp/ differ: not placed {sorted(_units() - set(listed))}, "
        f"gone {sorted(set(listed) - _units())}")


def test_no_unit_imports_its_own_layer_or_one_above():
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    wrong = []
    for src, dsts in sorted(_edges().items()):
        for dst, where in sorted(dsts.items()):
            if level.get(dst, len(LAYERS)) >= level.get(src, -1):
                wrong += [f"{w}: {src} (layer {level.get(src)}) imports {dst} (layer "
                          f"{level.get(dst)})" for w in where]
    assert not wrong, "imports of the same or a higher layer:\n" + "\n".join(wrong)


def test_no_import_cycle_between_units():
    cycles = import_cycles(_edges())
    assert not cycles, f"units that import each other (lazily included): {cycles}"


def test_designs_layer_list_is_the_codes():
    """docs/DESIGN.md §1 lists the layers under "### Layers", one numbered line each, bottom
    first: ``N. `unit`, `unit` — what they are``."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("### Layers"):text.index("## 2. Layout")]
    rows = re.findall(r"^(\d+)\. (.+?) — ", section, flags=re.M)
    assert [int(n) for n, _ in rows] == list(range(len(rows))), f"DESIGN's layers are not numbered 0..: {rows}"
    design = [tuple(re.findall(r"`([\w.]+)`", units)) for _, units in rows]
    assert design == [tuple(layer) for layer in LAYERS], (
        f"docs/DESIGN.md §1's layers {design} are not tests/test_layers.py's {list(LAYERS)}")
