"""One table of settings (commlib/_settings.py), printed in docs/reliability.md; the settings that shape messages
are read there and nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from commlib import _settings

ROOT = Path(__file__).resolve().parents[1]
#: variables the launcher, the test helper and the job monitor pass to their own workers: not user settings
INTERNAL = {
    "COMMLIB_LAUNCH_STATUS",
    "COMMLIB_MONITOR_STORE",
    "COMMLIB_MONITOR_TOKEN",
    "COMMLIB_JOB_ID",
    "COMMLIB_TESTING_WORKER",
    "COMMLIB_ROOT",
    "COMMLIB_NCCL_EMULATOR_ADDR",
    "COMMLIB_NCCL_EMULATOR_TIMEOUT",
}


def _reads() -> dict[str, set[str]]:
    """Every COMMLIB_* variable the Python sources read, and where."""
    found: dict[str, set[str]] = {}
    for f in (ROOT / "commlib").rglob("*.py"):
        for m in re.finditer(r"environ(?:\.get\(|\[)\s*\"(COMMLIB_[A-Z0-9_]+)\"", f.read_text()):
            found.setdefault(m.group(1), set()).add(str(f.relative_to(ROOT)))
    for f in (ROOT / "ddp").rglob("*.py"):
        for m in re.finditer(r"\"(COMMLIB_[A-Z0-9_]+)\"", f.read_text()):
            found.setdefault(m.group(1), set()).add(str(f.relative_to(ROOT)))
    return found


def test_the_docs_print_the_table() -> None:
    assert _settings.markdown() in (ROOT / "docs" / "reliability.md").read_text()


def test_every_variable_read_is_in_the_table_or_internal() -> None:
    names = {s.name for s in _settings.TABLE}
    unknown = {k: v for k, v in _reads().items() if k not in names and k not in INTERNAL}
    assert unknown == {}


def test_settings_that_shape_messages_are_read_only_in_the_settings_module() -> None:
    shaping = {s.name for s in _settings.TABLE if s.shapes_messages}
    elsewhere = {k: v for k, v in _reads().items() if k in shaping}
    assert elsewhere == {}
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
