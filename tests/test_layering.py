"""The architecture, checked on the source: which package may import which (DESIGN.md).

Between packages: ddp -> commlib <- globalview; commlib imports neither, they never import each
other, and they use only commlib's public modules. Inside commlib, from the bottom up:

    arrays (the one intake)            imports nothing of commlib but ReduceOp
    backends (the narrow waist)        + arrays, errors, _environment (the launcher's variables)
    store, launch, _diagnostics        + backends' contract only where they hook into waits
    the group layer (_group, _world, _collectives, ...), groups, env    anything below
    bench, torch_backend, demo         the public API
    buckets (planner, reducer, trace)  the public API and arrays: shared by ddp and globalview

Only ``commlib/backends/`` and ``commlib/arrays/`` import cupy; only the mpi backend's modules import mpi4py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("commlib", "ddp", "globalview")
GROUP_LAYER = {
    "_group",
    "_world",
    "_rendezvous",
    "_recovery",
    "_collectives",
    "_composed",
    "_p2p",
    "_barrier",
    "_objects",
    "groups",
    "env",
}

# For each part of commlib: the parts of commlib it may import (besides itself).
ALLOWED = {
    "_ops": set(),
    "errors": set(),
    "_timeouts": set(),
    "_environment": set(),
    "_settings": set(),
    "arrays": {"_ops"},
    "_sockets": set(),
    "backends": {"_ops", "arrays", "errors", "_sockets", "_environment", "_settings"},
    "store": {"_timeouts", "errors", "_sockets"},
    "_diagnostics": {"arrays", "errors", "store", "backends", "_settings"},
    "launch": {"store", "_diagnostics", "backends", "_settings", "_sockets"},  # _sockets: a free port
    "testing": {"launch", "_settings"},
    **{
        name: {
            "_ops",
            "errors",
            "_timeouts",
            "_environment",
            "_settings",
            "arrays",
            "backends",
            "store",
            "_diagnostics",
        }
        | GROUP_LAYER
        for name in GROUP_LAYER
    },
    "bench": {"", "arrays", "errors", "groups", "launch"},  # "" is the public package itself
    "torch_backend": {"", "arrays", "errors", "groups"},
    "demo": {""},
    "buckets": {"", "arrays"},  # the bucket planner and reducer ddp and globalview both reuse
    "__init__": set(),  # the public API re-exports everything
}


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


def _part(path: Path) -> str:
    """The part of commlib a file belongs to: its sub-package, or its module name."""
    rel = path.relative_to(ROOT / "commlib")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _commlib_part(name: str) -> str:
    """The part of commlib an import names ("" for ``commlib`` itself)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("package", PACKAGES)
def test_package_has_sources(package: str) -> None:
    assert _files(package), f"{package} has no Python files"


def test_every_part_of_commlib_has_a_rule() -> None:
    parts = {_part(f) for f in _files("commlib")}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)


def test_commlib_parts_import_only_what_is_below_them() -> None:
    def rule(f: Path, name: str) -> bool:
        if _top(name) != "commlib":
            return False
        mine, theirs = _part(f), _commlib_part(name)
        return mine != "__init__" and theirs != mine and theirs not in ALLOWED[mine]

    assert _violations("commlib", rule) == []


def test_the_launcher_and_the_intake_never_start_mpi() -> None:
    """Importing mpi4py.MPI initialises MPI: the launcher and the intake must not (not even through backends.mpi)."""

    def rule(f: Path, name: str) -> bool:
        return _part(f) in ("launch", "arrays", "store") and name.startswith(("mpi4py", "commlib.backends.mpi"))

    assert _violations("commlib", rule) == []


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
    allowed = {
        ROOT / "commlib" / "backends" / name
        for name in ("mpi.py", "_mpi_waits.py", "_mpi_world.py", "_native.py", "_steps.py")
    }
    bad = [v for p in PACKAGES for v in _violations(p, lambda f, n: _top(n) == "mpi4py" and f not in allowed)]
    assert bad == []


def test_only_the_backends_and_the_array_intake_import_cupy() -> None:
    def rule(f: Path, name: str) -> bool:
        inside = f.is_relative_to(ROOT / "commlib" / "backends") or f.is_relative_to(ROOT / "commlib" / "arrays")
        return _top(name) == "cupy" and not inside

    assert [v for p in PACKAGES for v in _violations(p, rule)] == []


def test_the_rule_detects_a_violation(tmp_path: Path) -> None:
    """The checker itself works: a file that breaks the rule is reported."""
    bad = tmp_path / "x.py"
    bad.write_text("import ddp.reducer\nfrom globalview import sbp\n")
    assert _imports(bad) == ["ddp.reducer", "globalview"]
    assert "_group" not in ALLOWED["backends"] and "backends" not in ALLOWED["arrays"]


# -- the C sources: below the waist too ---------------------------------------------------------------------------

#: what a C file may not name: the group layer's objects, and the means of reading a Python object's slots by
#: offset (member descriptors, type version tags, dict pointers); the compiled part runs a backend's operation
#: on bytes and MPI requests, and gets everything else as arguments
_C_FORBIDDEN = (
    "ProcessGroup",
    "_State",
    "flight",
    "PyMemberDescr",
    "tp_version_tag",
    "_PyObject_GetDictPtr",
    "PyObject_GenericGetAttr",
    "tp_dictoffset",
    "PyMember_GetOne",
)


def _c_sources() -> list[Path]:
    return sorted((ROOT / "commlib").rglob("*.[ch]"))


def test_c_sources_live_below_the_waist() -> None:
    assert _c_sources(), "no C sources found"
    outside = [str(f.relative_to(ROOT)) for f in _c_sources() if not f.is_relative_to(ROOT / "commlib" / "backends")]
    assert outside == []


def test_c_sources_do_not_reach_into_python_objects() -> None:
    """No C file names the group layer or reads a Python object's slots by offset; attribute lookups on Python
    objects are limited to numpy's ``base`` (span's chain of views)."""
    import re

    bad = []
    for f in _c_sources():
        text = f.read_text()
        bad += [f"{f.name}: {word}" for word in _C_FORBIDDEN if word in text]
        for m in re.finditer(r"PyObject_GetAttr\w*\(\s*\w+\s*,\s*([^)]*)\)", text):
            if m.group(1).strip() != '"base"':
                bad.append(f"{f.name}: {m.group(0)}")
    assert bad == []


def test_the_c_rule_detects_a_violation() -> None:
    assert any(w in "PyMemberDescrObject *d" for w in _C_FORBIDDEN)
