"""Two "nodes" on one machine: network namespaces joined by a veth pair, the launcher run in each
with --nnodes 2, and the job's collectives checked across them, small and large (root only; skipped
otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from netns import two_namespaces

JOB = """
import numpy as np, commlib as dist
n, me = dist.get_world_size(), dist.get_rank()
x = np.full(2, me + 1.0)
dist.all_reduce(x)
out = np.zeros(n, np.int64)
dist.all_gather_into_tensor(out, np.array([me * 10], np.int64))
g = dist.new_group([1, 2])  # one rank from each node
y = np.array([float(me)])
if me in (1, 2):
    dist.broadcast(y, src=2, group=g)
big = np.arange(300_000, dtype=np.float32) + me  # large calls: commlib's own point-to-point steps, across nodes
dist.all_reduce(big)
chunks = np.zeros(n * 50_000, np.float32)
dist.all_gather_into_tensor(chunks, np.full(50_000, me, np.float32))
mine = np.zeros(50_000, np.float32)
dist.reduce_scatter_tensor(mine, np.repeat(np.arange(n, dtype=np.float32), 50_000) + me)
large = np.array_equal(big, n * np.arange(300_000, dtype=np.float32) + sum(range(n)))
large = large and np.array_equal(chunks, np.repeat(np.arange(n, dtype=np.float32), 50_000))
large = large and np.array_equal(mine, np.full(50_000, n * me + sum(range(n)), np.float32))
print(f"node-job rank {me}/{n} node {dist.env.get_node_size()} sum {x[0]:g} gathered {out.tolist()} bcast {y[0]:g}"
      f" large {large}")
"""


@pytest.fixture
def two_nodes():
    with two_namespaces("cl", 7) as (a, b, _):
        yield a, b


def _run_two_nodes(script: Path, master: str, port: int, prefixes: list[list[str]], env: dict) -> list[str]:
    """Start the launcher for node 0 and node 1 (each behind its command prefix); return the job's lines."""
    procs = []
    for node, prefix in enumerate(prefixes):
        flags = ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2"]
        flags += ["--master_addr", master, "--master_port", str(port)]
        cmd = [*prefix, sys.executable, "-m", "commlib.launch", *flags, str(script)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return sorted(line.split("] ", 1)[1] for out, _ in outs for line in out.splitlines() if "node-job" in line)


def test_launcher_joins_two_nodes(two_nodes: tuple[str, str], tmp_path: Path) -> None:
    script = tmp_path / "node_job.py"
    script.write_text(JOB)
    env = {**os.environ, "COMMLIB_STORE_TOKEN": "shared-secret", "COMMLIB_TIMEOUT": "60"}
    lines = _run_two_nodes(script, "10.77.7.1", 29640, [["ip", "netns", "exec", ns] for ns in two_nodes], env)
    assert lines == [
        f"node-job rank {r}/4 node 2 sum 10 gathered [0, 10, 20, 30] bcast {2 if r in (1, 2) else r} large True"
        for r in range(4)
    ], lines


@pytest.mark.parametrize("init_method", ["env://", "file://{tmp}/rendezvous", "tcp://127.0.0.1:29653"])
def test_two_launchers_on_one_host_join(tmp_path: Path, init_method: str) -> None:
    """Two "nodes" on loopback (no root needed), rendezvous through each kind of init_method."""
    from commlib.store import TCPStore

    method = init_method.format(tmp=tmp_path)
    script = tmp_path / "node_job.py"
    script.write_text(f"import commlib as dist\ndist.init_process_group(init_method={method!r})\n" + JOB)
    # Someone must serve the store a tcp:// init_method names: here, the test.
    server = TCPStore("127.0.0.1", 29653, is_master=True, wait_for_workers=False) if "tcp" in method else None
    try:
        lines = _run_two_nodes(script, "127.0.0.1", 29652, [[], []], dict(os.environ))
    finally:
        if server is not None:
            server.close()
    assert len(lines) == 4 and all("sum 10 gathered [0, 10, 20, 30]" in line for line in lines), lines
