"""Reference runs of the examples that several test modules compare against, each started once per test run
(``once_per_run``, tests/conftest.py): not once per module and xdist worker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from commlib.launch._mpiexec import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]
TORCH_EVAL = ROOT / "examples" / "torch_distributed_eval.py"


def clean_env(env: dict | None = None) -> dict[str, str]:
    """This process's environment without an MPI launcher's variables, one thread per process, and ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    return full | {"OMP_NUM_THREADS": "1", **(env or {})}


def torch_eval_under_mpiexec(once_per_run: Callable[..., subprocess.CompletedProcess], n: int):
    """examples/torch_distributed_eval.py on ``n`` ranks under mpiexec: tests/test_launchers.py compares every
    launcher's answers with it, tests/test_examples.py torch's own (gloo, under torchrun)."""
    cmd = [find_mpiexec(), "-n", str(n), sys.executable, str(TORCH_EVAL)]
    return once_per_run(f"torch_distributed_eval-mpiexec-{n}", cmd, timeout=120, cwd=ROOT, env=clean_env())
