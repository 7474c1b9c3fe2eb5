"""A commlib job under a real (one-node) Slurm cluster: srun -n 2, and srun -n 3 -O (more tasks than CPUs).

The cluster comes from ../shared/tools/slurm-local (install, start), which .ci/run sets up; without it
these tests skip and say how to get one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLURM_CONF = Path(os.environ.get("SLURM_BASE", "/tmp/commlib-slurm")) / "etc" / "slurm.conf"
JOB = """
import numpy as np, commlib as dist
n, me = dist.get_world_size(), dist.get_rank()
x = np.full(3, me + 1.0)
dist.all_reduce(x)
out = np.zeros(n, np.int64)
dist.all_gather_into_tensor(out, np.array([me], np.int64))
print(f"slurm-job rank {me}/{n} local {dist.env.get_local_rank()} nodes {dist.env.get_node_size()} "
      f"sum {x[0]:g} gathered {out.tolist()} via {dist.get_backend()}")
"""


def _srun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_CONF": str(SLURM_CONF)}
    return subprocess.run(
        ["srun", "--mpi=pmi2", *args, sys.executable, "-c", JOB],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def slurm() -> None:
    if shutil.which("srun") is None or not SLURM_CONF.exists():
        pytest.skip(
            "no local Slurm cluster: run ../shared/tools/slurm-local install && ../shared/tools/slurm-local start"
        )
    probe = subprocess.run(
        ["sinfo", "-h", "-o", "%T"],
        env={**os.environ, "SLURM_CONF": str(SLURM_CONF)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0 or ("idle" not in probe.stdout and "mix" not in probe.stdout):
        pytest.skip(
            f"the local Slurm cluster is not up ({probe.stdout.strip()} {probe.stderr.strip()}); "
            "run ../shared/tools/slurm-local start"
        )


@pytest.mark.parametrize(("n", "extra"), [(2, ()), (3, ("-O",))])
def test_collectives_under_srun(slurm: None, n: int, extra: tuple[str, ...]) -> None:
    proc = _srun("-n", str(n), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("slurm-job"))
    total = n * (n + 1) / 2
    assert lines == [
        f"slurm-job rank {r}/{n} local {r} nodes 1 sum {total:g} gathered {list(range(n))} via mpi" for r in range(n)
    ], proc.stdout
