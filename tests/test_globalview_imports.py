"""globalview's modules import each other without a cycle, late imports (inside functions) included.

Every ``import``/``from ... import`` anywhere in a module counts (at the top, in a function, under
``TYPE_CHECKING``), as does ``importlib.import_module("globalview....")`` with a literal name;
``from globalview import x`` is an edge to ``globalview.x`` when that is a module, else to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "globalview"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _literal_import_module(node: ast.AST) -> bool:
    """``importlib.import_module("a.literal.name")``."""
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The globalview modules ``name`` imports (anywhere in its source)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in modules else base)
        elif _literal_import_module(node):
            targets = [node.args[0].value]
        found |= {t for t in targets if t in modules and t != name}
    return found


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_import_graph_of_globalview_has_no_cycle() -> None:
    g = graph()
    assert len(g) > 10 and any(g.values()), "the graph was not read"
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_package_only_imports_down() -> None:
    """No module imports the package itself (``globalview/__init__``): it is the top."""
    g = graph()
    up = sorted(n for n, deps in g.items() if PACKAGE in deps and n != PACKAGE and not n.startswith("globalview.nn"))
    assert up == [], f"modules that import the package: {up}"


def test_the_checker_finds_a_cycle_and_late_imports(tmp_path: Path) -> None:
    """The checker itself works: a late import that closes a loop is reported."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from globalview import _tensor\n    import globalview._ops\n")
    modules = {"globalview._tensor": src, "globalview._ops": src, "globalview.m": src}
    assert _edges("globalview.m", src, modules) == {"globalview._tensor", "globalview._ops"}
