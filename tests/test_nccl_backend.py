"""The nccl backend through the CPU emulator (COMMLIB_NCCL_EMULATOR=1): selection, limits, errors, timeouts.

The collective scenarios themselves run on both backends in test_collectives.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from reference import BACKENDS

from commlib.launch._mpiexec import find_mpiexec
from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

EMU = BACKENDS["nccl"]
ROOT = Path(__file__).resolve().parents[1]


def selection_job() -> tuple:
    import commlib as dist

    return dist.get_backend(), dist.is_nccl_available(), dist.get_world_size()


def test_emulator_is_chosen_by_auto_and_nccl() -> None:
    assert run(selection_job, 2, timeout=60, env=EMU) == [("nccl", True, 2)] * 2


def test_nccl_without_gpu_or_emulator_is_explained() -> None:
    code = "import commlib as dist; dist.init_process_group('nccl')"
    env = {k: v for k, v in os.environ.items() if k != "COMMLIB_NCCL_EMULATOR"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "backend 'nccl' cannot run: no NVIDIA GPU is visible" in proc.stderr, proc.stderr
    assert "backend='mpi'" in proc.stderr and "COMMLIB_NCCL_EMULATOR=1" in proc.stderr


def test_emulator_says_so_once_on_rank_0() -> None:
    code = "import numpy as np, commlib as dist; x = np.ones(2); dist.all_reduce(x); dist.all_reduce(x)"
    proc = subprocess.run(
        [find_mpiexec(), "-n", "3", sys.executable, "-c", code],
        env={**os.environ, **EMU},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("running on the NCCL emulator") == 1, proc.stderr


def limits_job() -> list[str]:
    import commlib as dist

    out = []
    for call in (
        lambda: dist.all_reduce(np.ones(2, np.int32), op=dist.ReduceOp.BXOR),
        lambda: dist.all_reduce(np.ones(2, np.int16)),
        lambda: dist.all_reduce(np.ones(2, np.complex64), op=dist.ReduceOp.PRODUCT),
        lambda: dist.recv(np.ones(2)),
    ):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    x = np.ones(3, np.int16)  # NCCL cannot reduce int16, but it can move it
    dist.broadcast(x, src=0)
    out.append(str(x.tolist()))
    return out


def test_what_nccl_lacks_is_refused_clearly() -> None:
    results = run(limits_job, 2, timeout=60, env=EMU)
    bxor, int16, cprod, recv_any, moved = results[1]
    assert bxor == (
        "[rank 1/2] all_reduce: op=ReduceOp.BXOR on dtype int32 is not supported by the nccl backend: "
        "NCCL has no bitwise reductions; use the mpi backend for them"
    )
    assert "on dtype int16 is not supported by the nccl backend: NCCL has no int16 type" in int16
    assert "NCCL reduces complex numbers only with SUM and AVG" in cprod
    assert recv_any == "[rank 1/2] recv: the nccl backend cannot receive from any source; pass src"
    assert moved == "[1, 1, 1]"


def timeout_job() -> tuple:
    import commlib as dist

    x = np.ones(4)
    dist.all_reduce(x)  # everyone is up
    if dist.get_rank() == 1:
        time.sleep(4)  # never joins the next all_reduce in time
        return ("skipped",)
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        return ("no error",)
    except dist.CommTimeoutError as e:
        waited, message = time.monotonic() - start, str(e)
    try:
        dist.all_reduce(x)
    except dist.GroupBrokenError as e:
        return message, waited, str(e)
    return message, waited, "no error"


def test_timeout_aborts_and_breaks_the_group() -> None:
    results = run(timeout_job, 3, timeout=90, env={**EMU, "COMMLIB_TIMEOUT": "1.5"})
    for rank in (0, 2):
        message, waited, later = results[rank]
        assert "all_reduce (call #2 on group 'world', ranks [0, 1, 2]) did not complete within 1.5 s" in message
        assert 1.5 <= waited < 6, waited
        assert "failed earlier and cannot be used" in later


def test_torch_style_example_runs_unchanged_on_the_emulator() -> None:
    pytest.importorskip("torch")
    example = ROOT / "examples" / "torch_distributed_eval.py"
    outputs = {}
    for backend, env in BACKENDS.items():
        proc = subprocess.run(
            [find_mpiexec(), "-n", "3", sys.executable, str(example)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[backend] = proc.stdout
    assert "accuracy" in outputs["nccl"] and outputs["nccl"] == outputs["mpi"]
