"""The OneFlow seed examples, ported to globalview, run through the launcher as a user runs them
(on the mpi backend with "cpu" placements, and on the NCCL emulator with "cuda" placements)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "globalview"


def _launch(script: str, nproc: int, backend: str) -> dict[int, list[str]]:
    env = {**os.environ, **BACKENDS[backend]}
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", str(nproc), str(EXAMPLES / script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    by_rank: dict[int, list[str]] = {r: [] for r in range(nproc)}
    for line in proc.stdout.splitlines():
        m = re.match(r"\[(\d+)\] ?(.*)", line)
        if m:
            by_rank[int(m.group(1))].append(m.group(2))
    return by_rank


def _section(lines: list[str], title: str) -> list[str]:
    start = lines.index(f"== {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("== ")), len(lines))
    return lines[start:end]


def _matrix(lines: list[str]) -> np.ndarray:
    text = " ".join(lines).replace("[", " ").replace("]", " ")
    return np.array([float(v) for v in text.split()])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_global_tensor_basics(backend: str) -> None:
    out = _launch("global_tensor_basics.py", 2, backend)
    for rank in (0, 1):
        lines = out[rank]
        created = _section(lines, "creating a global tensor")
        i = created.index("Global data of global tensor:")
        local, whole = _matrix(created[1:i]).reshape(2, 5), _matrix(created[i + 1 :]).reshape(4, 5)
        np.testing.assert_array_equal(local, whole[2 * rank : 2 * rank + 2])  # each rank holds its half
        assert _section(lines, "local to global") == ["True", "False", "(4, 5)", "True", "True"]
        assert _section(lines, "global to local") == ["(2, 5)"]
        assert _section(lines, "split to broadcast") == ["(4, 5)", "(2, 5)", "(4, 5)", "(4, 5)"]
        mm = _section(lines, "matmul")
        assert mm[:3] == ["True", "(4, 8)", "(globalview.sbp.split(dim=0),)"]
        assert _matrix(mm[3:]).size == 2 * 8  # the local (2, 8) slice of y
    # the two ranks' whole tensors are the same logical tensor
    assert _section(out[0], "creating a global tensor")[3:] == _section(out[1], "creating a global tensor")[3:]


@pytest.mark.parametrize(("backend", "nproc"), [("mpi", 2), ("mpi", 4), ("nccl", 4)])
def test_oneflow_distributed_page(backend: str, nproc: int) -> None:
    out = _launch("oneflow_distributed.py", nproc, backend)
    device = "cuda" if backend == "nccl" else "cpu"
    for rank in range(nproc):
        lines = out[rank]
        assert _section(lines, "construct") == ["(4, 5)"]
        assert _section(lines, "local to global") == ["(4, 5)"]
        boxing = _section(lines, "automatic boxing")
        assert boxing[0] == "(4, 4) (globalview.sbp.split(dim=0),)"
        if rank == 0:
            assert any("all_to_all" in line for line in boxing[1:])  # explain names the one collective
        if nproc >= 4:
            moved = _section(lines, "redistribute")[0]
            assert moved.startswith(f"globalview.placement(type='{device}', ranks=[2, 3]) (globalview.sbp.broadcast,)")
            assert moved.endswith("[1. 2.]" if rank in (2, 3) else "[]")
        assert _section(lines, "to_local")[0] == "True"
