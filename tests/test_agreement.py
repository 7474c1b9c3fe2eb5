"""Ranks agree on their messages' pattern when a group is made: a rank running the C executor and one running the
Python one (COMMLIB_NATIVE=1 and 0: an install without a C compiler on one node) work together, slower, with one
warning naming the ranks; settings that shape messages (the inline size, the piece size) take every rank's
smallest; a rank of another protocol cannot join."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commlib.launch._mpiexec import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]

EVERY_COLLECTIVE = """
import json, sys, warnings
import numpy as np
warnings.simplefilter("always")
import commlib as dist
from commlib._world import _state
dist.init_process_group("mpi")
r, n = dist.get_rank(), dist.get_world_size()
wrong = []
def same(name, got, want):
    if not np.array_equal(got, want):
        wrong.append(name)
for nbytes in (8, 64 << 10, 4 << 20):
    k = nbytes // 4
    x = np.arange(k, dtype=np.float32) + r
    dist.all_reduce(x)
    same(f"all_reduce {nbytes}", x, n * np.arange(k, dtype=np.float32) + sum(range(n)))
    b = np.full(k, r, np.float32)
    dist.broadcast(b, src=1)
    same(f"broadcast {nbytes}", b, np.full(k, 1, np.float32))
    y = np.full(k, r + 1, np.float32)
    dist.reduce(y, dst=0)
    same(f"reduce {nbytes}", y, np.full(k, n * (n + 1) / 2 if r == 0 else r + 1, np.float32))
    out = np.zeros(n * k, np.float32)
    dist.all_gather_into_tensor(out, np.full(k, r, np.float32))
    same(f"all_gather {nbytes}", out, np.repeat(np.arange(n, dtype=np.float32), k))
    rs = np.zeros(k, np.float32)
    dist.reduce_scatter_tensor(rs, np.ones(n * k, np.float32))
    same(f"reduce_scatter {nbytes}", rs, np.full(k, n, np.float32))
    a2a = np.zeros(n * k, np.float32)
    dist.all_to_all_single(a2a, np.repeat(np.arange(n, dtype=np.float32) + 10 * r, k))
    same(f"all_to_all {nbytes}", a2a, np.repeat(10 * np.arange(n, dtype=np.float32) + r, k))
    parts = [np.zeros(k, np.float32) for _ in range(n)] if r == 0 else None
    dist.gather(np.full(k, r, np.float32), parts, dst=0)
    if r == 0:
        same(f"gather {nbytes}", np.concatenate(parts), np.repeat(np.arange(n, dtype=np.float32), k))
    got = np.zeros(k, np.float32)
    dist.scatter(got, [np.full(k, p, np.float32) for p in range(n)] if r == 0 else None, src=0)
    same(f"scatter {nbytes}", got, np.full(k, r, np.float32))
    dist.barrier()
    m = np.full(k, r, np.float32)
    if r == 0:
        dist.send(m, 1)
    elif r == 1:
        dist.recv(m, 0)
    same(f"send/recv {nbytes}", m, np.full(k, 0 if r < 2 else r, np.float32))
b = _state.world.backend
row = {"rank": r, "wrong": wrong, "native": b.agreed["native"], "mine": b.__class__.__module__, "small": b.small,
       "piece": b.piece}
sys.stdout.write(json.dumps(row) + "\\n")  # one write: print's two can interleave with the other rank's line
sys.stdout.flush()
dist.destroy_process_group()
"""


def _run(script: Path, envs: list[dict[str, str]]) -> subprocess.CompletedProcess:
    """One MPI job, rank p with ``envs[p]`` (mpiexec's colon-separated blocks)."""
    cmd = [find_mpiexec()]
    for i, env in enumerate(envs):
        if i:
            cmd.append(":")
        cmd += ["-n", "1"]
        for key, value in env.items():
            cmd += ["-env", key, value]
        cmd += [sys.executable, str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COMMLIB_TIMEOUT": "60"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _reports(out: str) -> dict[int, dict]:
    """Every rank's JSON row; mpiexec may still join two ranks' lines, so objects are read one after another."""
    rows, decoder = [], json.JSONDecoder()
    for line in out.splitlines():
        at = 0
        while line.startswith("{", at):
            row, at = decoder.raw_decode(line, at)
            rows.append(row)
    return {row["rank"]: row for row in rows}


def test_a_rank_without_the_c_executor_works_with_one_that_has_it(tmp_path: Path) -> None:
    script = tmp_path / "every_collective.py"
    script.write_text(EVERY_COLLECTIVE)
    done = _run(script, [{"COMMLIB_NATIVE": "1"}, {"COMMLIB_NATIVE": "0"}])
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(done.stdout)
    assert sorted(reports) == [0, 1], done.stdout
    for rank, row in reports.items():
        assert row["wrong"] == [], (rank, row)
        assert row["native"] is False, row  # the group knows not every rank runs C
    warning = [line for line in done.stderr.splitlines() if "the ranks of this group differ" in line]
    assert len(warning) == 1, done.stderr[-3000:]  # once, from group rank 0 of the world
    assert "the compiled executor: ranks [0]: true, ranks [1]: false" in warning[0], warning


def test_settings_that_shape_messages_take_every_ranks_smallest(tmp_path: Path) -> None:
    script = tmp_path / "every_collective.py"
    script.write_text(EVERY_COLLECTIVE)
    envs = [
        {"COMMLIB_MPI_PERSISTENT_MAX": "1024", "COMMLIB_MPI_PIECE_BYTES": str(4 << 20)},
        {"COMMLIB_MPI_PERSISTENT_MAX": "8192", "COMMLIB_MPI_PIECE_BYTES": str(1 << 20)},
    ]
    done = _run(script, envs)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = _reports(done.stdout)
    for rank, row in reports.items():
        assert row["wrong"] == [], (rank, row)
        assert (row["small"], row["piece"]) == (1024, 1 << 20), row
    assert "COMMLIB_MPI_PERSISTENT_MAX: ranks [0]: 1024, ranks [1]: 8192 (the group uses 1024)" in done.stderr


def test_ranks_of_another_protocol_cannot_make_a_group() -> None:
    from commlib.backends.mpi import _agree, pattern

    mine = pattern()
    other = {**mine, "protocol": mine["protocol"] + 1}
    with pytest.raises(Exception, match=r"different commlib protocols .* ranks \[0\]: \d+, ranks \[1\]: \d+"):
        _agree([mine, other])
    agreed, notes = _agree([mine, {**mine, "commlib": "9.9.9"}])
    assert agreed["small"] == mine["small"] and notes == [
        f'commlib\'s version: ranks [0]: "{mine["commlib"]}", ranks [1]: "9.9.9" (the same protocol: they work '
        "together)"
    ]
