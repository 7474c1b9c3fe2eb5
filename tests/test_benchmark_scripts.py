"""The benchmark scripts still run (tiny sizes, one round): they are how speed is measured, so they must not rot.

Nothing here looks at a time: only that each script finishes and prints every row it promises.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_compare_has_a_row_per_collective() -> None:
    pytest.importorskip("torch")
    out = _run("benchmarks/compare.py", "--max-bytes", "64", "--repeats", "1", "--png", "")
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "all_to_all_uneven"):
        assert f"## {name}\n" in out, out
    assert "nccl-emu/commlib" in out and "gloo/commlib" in out, out


def test_collectives_vs_mpi4py_has_a_row_per_collective() -> None:
    out = _run("benchmarks/collectives_vs_mpi4py.py", "--sizes", "8", "65536", "--repeats", "1")
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    names = {r[0] for r in rows[1:]}
    assert {"all_reduce", "broadcast", "all_to_all_uneven", "gather", "scatter", "barrier", "send_recv"} <= names, out
    assert [r[1] for r in rows[1:] if r[0] == "barrier"] == ["-"], out  # once: a barrier has no size
    assert all(r[-1].endswith("x") for r in rows[1:]), out
