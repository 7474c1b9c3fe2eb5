"""One table of settings (commlib/_settings.py), printed in docs/reliability.md: every ``COMMLIB_*`` and
``GLOBALVIEW_*`` environment variable is in it and read there alone; and no code of the three packages walks the
call stack to find its state (the wait path says where it waits)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from commlib import _settings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("commlib", "ddp", "globalview")
_NAME = re.compile(r"^(COMMLIB|GLOBALVIEW)_[A-Z0-9_]+$")


def _sources(exclude: str = "") -> list[Path]:
    return [f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py")) if str(f.relative_to(ROOT)) != exclude]


def _constants() -> set[str]:
    """Names the three packages bind to a setting's name (``ENV_VAR = "COMMLIB_DDP_TRACE"``): reading one of them
    is reading the setting."""
    names = set()
    for f in _sources():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            value = getattr(node, "value", None)
            text = value.value if isinstance(value, ast.Constant) else None
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(text, str) and _NAME.match(text):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _environment_reads(path: Path, constants: set[str]) -> list[str]:
    """Where ``path`` reads a ``COMMLIB_*``/``GLOBALVIEW_*`` variable from an environment: ``os.environ.get(X)``,
    ``os.environ[X]``, ``X in os.environ``, ``os.getenv(X)`` (any mapping's ``get``/subscript/``in`` with such a
    name), X a literal or a name bound to one."""

    def names_a_setting(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and bool(_NAME.match(node.value))
        return isinstance(node, ast.Name) and node.id in constants

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        arg = None
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("get", "getenv", "pop") and node.args:
            arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            arg = node.left
        if arg is not None and names_a_setting(arg):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_docs_print_the_table() -> None:
    assert _settings.markdown() in (ROOT / "docs" / "reliability.md").read_text()


def test_settings_are_read_in_the_settings_module_alone() -> None:
    constants = _constants()
    elsewhere = [hit for f in _sources("commlib/_settings.py") for hit in _environment_reads(f, constants)]
    assert elsewhere == []


def test_every_variable_set_for_a_child_is_in_the_table() -> None:
    names = {s.name for s in _settings.TABLE}
    written = set()
    for f in _sources():
        for m in re.finditer(
            r"\[\s*\"((?:COMMLIB|GLOBALVIEW)_[A-Z0-9_]+)\"\s*\]\s*=|[(,]\s*((?:COMMLIB|GLOBALVIEW)_[A-Z0-9_]+)=",
            f.read_text(),
        ):
            written.add(m.group(1) or m.group(2))
    assert written and written <= names, written - names


def test_the_rule_sees_a_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        'import os\nVAR = "COMMLIB_X"\nos.environ.get(VAR)\nos.environ["COMMLIB_Y"]\nos.getenv("COMMLIB_Z")\n'
        '"COMMLIB_W" in os.environ\nenv = {}\nenv["COMMLIB_V"] = "1"\nprint("set COMMLIB_U=1")\n'
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        hits = _environment_reads(bad, {"VAR"})
    finally:
        ROOT = saved
    assert [h.split(": ", 1)[1] for h in hits] == [
        "os.environ.get(VAR)",
        "os.environ['COMMLIB_Y']",
        "os.getenv('COMMLIB_Z')",
        "'COMMLIB_W' in os.environ",
    ]


def test_settings_that_shape_messages_are_the_mpi_backends() -> None:
    shaping = {s.name for s in _settings.TABLE if s.shapes_messages}
    assert shaping == {
        "COMMLIB_NATIVE",
        "COMMLIB_MPI_PERSISTENT_MAX",
        "COMMLIB_MPI_PIECE_BYTES",
        "COMMLIB_MPI_COMPOSED",
    }


def test_a_bad_value_names_the_variable() -> None:
    setting = next(s for s in _settings.TABLE if s.name == "COMMLIB_MPI_PIECE_BYTES")
    with pytest.raises(ValueError, match=r"COMMLIB_MPI_PIECE_BYTES='-4': must be a number of bytes >= 0"):
        setting.read({"COMMLIB_MPI_PIECE_BYTES": "-4"})
    assert setting.read({}) == 2 << 20


def test_the_public_reader_reads_now(monkeypatch: pytest.MonkeyPatch) -> None:
    import commlib

    monkeypatch.setenv("GLOBALVIEW_POOL_MB", "12.5")
    assert commlib.setting("GLOBALVIEW_POOL_MB") == 12.5
    with pytest.raises(KeyError):
        commlib.setting("COMMLIB_NO_SUCH_THING")


_STACK_WALKS = ("_getframe", "f_locals", "f_back", "currentframe", "inspect.stack", "getouterframes")


def test_no_code_walks_the_call_stack() -> None:
    """Where a rank waits is said by the one wait path (``_diagnostics.waits``), not found by reading frames."""
    hits = [
        f"{f.relative_to(ROOT)}: {word}"
        for f in _sources()
        for word in _STACK_WALKS
        if re.search(rf"\b{re.escape(word)}\b", f.read_text())
    ]
    assert hits == []
