"""No import cycles inside llmdp/ (issue 16): every `import` / `from ... import` of an llmdp
module, at module level or inside a function (a lazy import hides a cycle, it does not
remove it), is an edge; the graph must have no cycle. A package whose ``__init__.py`` looks
its names up lazily (a ``_NAMES`` table: module -> names) imports the modules of its table,
and ``from package import name`` imports the module that defines ``name``. Standard library
`ast` only.

llmdp/privacy/ is cut into sub-packages (rng, noise, sampling, accounting, mf, ledger): code
outside a sub-package imports it through its entry point (``from llmdp.privacy.ledger import
Ledger``), never one of its modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import import_cycles

ROOT = Path(__file__).resolve().parents[1] / "llmdp"
PRIVACY = ROOT / "privacy"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _lazy_table(path: Path) -> dict[str, str]:
    """name -> defining module (dotted, absolute) of a package ``__init__.py``'s ``_NAMES``
    table (module -> names, looked up on first use); empty if it has none."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_NAMES" for t in node.targets):
            package = ".".join(path.relative_to(ROOT.parent).parent.parts)
            return {name: f"{package}.{module}"
                    for module, names in ast.literal_eval(node.value).items() for name in names}
    return {}


def _imports(m: str, p: Path, mods: dict[str, Path]):
    """(line, imported module) of every import in module `m` (file `p`), lazy ones included:
    ``import a.b`` and ``from a.b import c`` import ``a.b``; ``from a import b`` imports the
    module ``a.b`` when there is one."""
    pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
    for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (node.lineno, sub, None) if sub in mods else (node.lineno, base, a.name)


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    tables = {m: _lazy_table(p) for m, p in mods.items() if p.name == "__init__.py"}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        edges[m].update(h for h in tables.get(m, {}).values() if h in mods and h != m)
        for _, target, name in _imports(m, p, mods):
            # `from pkg import name` of a lazy table: the module that defines the name
            t = tables.get(target, {}).get(name, target)
            r = resolve(t) if t.startswith("llmdp") else None
            if r is not None and r != m:
                edges[m].add(r)
    return edges


def test_the_detector_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(edges) == [["a", "b", "c"]]


def test_no_import_cycles_inside_llmdp():
    mods = _modules()
    assert "llmdp.clipping.engine" in mods and "llmdp.train.loop" in mods
    edges = _edges(mods)
    assert "llmdp.train.parallel" in edges["llmdp.train.loop"]  # lazy and module-level imports both count
    cycles = import_cycles(edges)
    detail = "; ".join(" <-> ".join(c) for c in cycles)
    assert not cycles, f"import cycles inside llmdp/: {detail}"


def test_a_lazy_entry_point_is_an_edge_to_the_module_it_names():
    mods = _modules()
    edges = _edges(mods)
    # `from llmdp.privacy.ledger import Ledger` (hub/export.py): the module that defines it
    assert "llmdp.privacy.ledger.records" in edges["llmdp.hub.export"]
    # the package's __init__ imports (on first use) every module of its table
    assert "llmdp.privacy.ledger.service" in edges["llmdp.privacy.ledger"]


def _privacy_subpackages() -> list[str]:
    return sorted(p.parent.name for p in PRIVACY.glob("*/__init__.py"))


def _imports_past_a_privacy_entry_point() -> list[str]:
    """Every import, in a module of llmdp/ outside ``llmdp/privacy/<sub>/``, of a module inside
    ``<sub>`` (``from llmdp.privacy.<sub>.<module> import x``, ``import llmdp.privacy.<sub>.<module>``,
    ``from llmdp.privacy.<sub> import <module>``), at module level or lazy, and every
    ``importlib.import_module`` of such a path."""
    mods = _modules()
    subs = {f"llmdp.privacy.{s}" for s in _privacy_subpackages()}
    bad = []
    for m, p in sorted(mods.items()):
        targets = [(line, t) for line, t, _ in _imports(m, p, mods)]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                targets.append((node.lineno, node.args[0].value))
        for line, t in targets:
            sub = ".".join(t.split(".")[:3])
            if sub in subs and t != sub and not (m == sub or m.startswith(sub + ".")):
                bad.append(f"{p.relative_to(ROOT.parent).as_posix()}:{line}: {t}")
    return bad


def test_code_outside_a_privacy_subpackage_imports_only_its_entry_point():
    assert set(_privacy_subpackages()) >= {"rng", "noise", "sampling", "accounting", "mf", "ledger"}
    bad = _imports_past_a_privacy_entry_point()
    assert not bad, ("import the sub-package, not its modules (`from llmdp.privacy.ledger import "
                     "Ledger`; add the name to its __init__'s _NAMES): " + "; ".join(bad))


def test_the_privacy_entry_points_name_real_definitions_and_import_nothing():
    for sub in _privacy_subpackages():
        table = _lazy_table(PRIVACY / sub / "__init__.py")
        assert table, f"llmdp/privacy/{sub}/__init__.py has no _NAMES table"
        modules = {p.stem for p in (PRIVACY / sub).glob("*.py")}
        clash = sorted(set(table) & modules)
        # a submodule, once imported, is an attribute of its package and would hide the name
        assert not clash, f"llmdp.privacy.{sub} names {clash}, which are its modules too"
    # a fresh interpreter: each entry point imports nothing until a name is asked, and then
    # the defining module (not a copy cached in the package: a patch of the module is seen)
    code = f"""
import importlib, sys
subs = {_privacy_subpackages()!r}
for s in subs:
    importlib.import_module("llmdp.privacy." + s)
loaded = sorted(m for m in sys.modules if m.startswith("llmdp.privacy."))
assert loaded == sorted("llmdp.privacy." + s for s in subs), loaded
assert "torch" not in sys.modules
for s in subs:
    pkg = sys.modules["llmdp.privacy." + s]
    for name, home in pkg._HOMES.items():
        module = importlib.import_module(f"llmdp.privacy.{{s}}.{{home}}")
        assert getattr(pkg, name) is getattr(module, name), (s, name)
        assert name not in vars(pkg), (s, name)
    assert sorted(pkg.__all__) == sorted(n for n in pkg._HOMES if not n.startswith("_"))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
