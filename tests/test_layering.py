"""DESIGN.md's import rule, checked on the source: ddp -> commlib <- globalview, and nothing else.

commlib imports neither ddp nor globalview; ddp and globalview never import each other
and use only commlib's public API (no ``commlib._private`` modules); only
``commlib.backends.mpi`` imports mpi4py and only the nccl backend modules import cupy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("commlib", "ddp", "globalview")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _violations(package: str, rule) -> list[str]:
    return [f"{f.relative_to(ROOT)} imports {name}" for f in _files(package) for name in _imports(f) if rule(f, name)]


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_sources(package: str) -> None:
    assert _files(package), f"{package} has no Python files"


def test_commlib_imports_neither_ddp_nor_globalview() -> None:
    assert _violations("commlib", lambda f, n: _top(n) in ("ddp", "globalview")) == []


@pytest.mark.parametrize(("package", "other"), [("ddp", "globalview"), ("globalview", "ddp")])
def test_ddp_and_globalview_never_import_each_other(package: str, other: str) -> None:
    assert _violations(package, lambda f, n: _top(n) == other) == []


@pytest.mark.parametrize("package", ["ddp", "globalview"])
def test_upper_packages_use_only_commlib_public_api(package: str) -> None:
    private = lambda f, n: _top(n) == "commlib" and any(p.startswith("_") for p in n.split(".")[1:])  # noqa: E731
    assert _violations(package, private) == []


def test_only_the_mpi_backend_imports_mpi4py() -> None:
    allowed = {ROOT / "commlib" / "backends" / "mpi.py"}
    bad = [v for p in PACKAGES for v in _violations(p, lambda f, n: _top(n) == "mpi4py" and f not in allowed)]
    assert bad == []


def test_only_nccl_modules_import_cupy() -> None:
    def rule(f: Path, name: str) -> bool:
        return _top(name) == "cupy" and "nccl" not in f.name and f.parent.name != "backends"

    assert [v for p in PACKAGES for v in _violations(p, rule)] == []


def test_the_rule_detects_a_violation(tmp_path: Path) -> None:
    """The checker itself works: a file that breaks the rule is reported."""
    bad = tmp_path / "x.py"
    bad.write_text("import ddp.reducer\nfrom globalview import sbp\n")
    assert _imports(bad) == ["ddp.reducer", "globalview"]
