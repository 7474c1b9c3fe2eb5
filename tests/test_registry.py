"""The backend registry: one table (``commlib.backends.REGISTRY``) from a name to what makes its communicator;
nothing above it branches on a backend's name, and a backend registered at run time runs.

A third-party backend here is the one a user would write: a creator with torch's signature that makes a commlib
``Backend`` from the job's store (the nccl backend's code over the CPU emulator, under another name). Two plain
processes that meet through ``env://`` make their default group with it, run collectives and send/recv on it, and
``get_backend()`` names it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ports import free_port

from commlib import backends

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import sys
import numpy as np
import commlib as dist

def emulated(store, rank, world_size, timeout):
    from commlib._rendezvous import StoreMeeting
    from commlib.backends import nccl_emulator as emu
    from commlib.backends.nccl import NcclBackend, unique_id

    meeting = StoreMeeting(store, rank)
    uid = unique_id(emu) if rank == 0 else b""
    uid = meeting.rendezvous(list(range(world_size)), timeout.total_seconds(), uid, what="unique id")
    return NcclBackend(emu, emu.cuda, np, emu.NcclCommunicator(world_size, uid, rank), True, meeting)

dist.Backend.register_backend("emulated", emulated)
dist.init_process_group("emulated")
r, n = dist.get_rank(), dist.get_world_size()
x = np.full(3, r + 1.0, np.float32)
dist.all_reduce(x)
out = np.zeros(2 * n, np.int64)
dist.all_gather_into_tensor(out, np.full(2, r, np.int64))
if r == 0:
    dist.send(np.arange(4, dtype=np.float32), 1)
else:
    got = np.zeros(4, np.float32)
    dist.recv(got, 0)
    assert got.tolist() == [0, 1, 2, 3], got
print("rank", r, dist.get_backend(), x.tolist(), out.tolist(), flush=True)
dist.destroy_process_group()
"""


def test_a_registered_backend_runs(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_"))}
        env |= {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env |= {"PYTHONPATH": str(ROOT), "COMMLIB_TIMEOUT": "30"}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank, out in enumerate(outs):
        assert f"rank {rank} emulated [3.0, 3.0, 3.0] [0, 0, 1, 1]" in out, out


def test_nothing_above_the_table_branches_on_a_backends_name() -> None:
    """A new backend is its module and one line in the table: the group layer, the public API and the torch adapter
    never compare with a backend's name."""
    names = set(backends.REGISTRY) | set(backends.ALIASES)
    hits = []
    for path in sorted((ROOT / "commlib").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] in ("backends", "bench") or rel.name == "_settings.py":
            continue  # the engines themselves; the benchmark names what it measures
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if isinstance(side, ast.Constant) and side.value in names:
                        hits.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert hits == []


def test_choosing_a_backend() -> None:
    assert backends.choose("GLOO").name == "mpi" and backends.choose("nccl").name == "nccl"
    assert backends.choose(None).name == ("nccl" if backends.REGISTRY["nccl"].unavailable() is None else "mpi")
    try:
        backends.choose("ucc")
    except ValueError as e:
        assert "backend must be one of 'mpi', 'nccl', 'gloo', 'cpu', 'auto', got 'ucc'" in str(e)
    else:
        raise AssertionError("no error")
    assert textwrap.dedent(backends.REGISTRY["nccl"].unavailable() or "").startswith(("backend 'nccl' cannot run", ""))
