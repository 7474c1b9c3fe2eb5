"""The "commlib" torch backend: registration, bad input, a missing peer, and the example under the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_torch_backend import free_port_env, init_torch

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path = ROOT, path: str = str(ROOT)) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def test_import_commlib_does_not_import_torch() -> None:
    proc = _python("import sys, commlib; assert 'torch' not in sys.modules, 'torch imported'")
    assert proc.returncode == 0, proc.stderr


def test_import_commlib_after_torch_registers_without_mpi() -> None:
    code = (
        "import sys, torch, commlib, torch.distributed as d\n"
        "assert 'COMMLIB' in d.Backend._plugins, d.Backend._plugins\n"
        "assert 'mpi4py' not in sys.modules and not commlib.is_initialized()\n"
        "assert 'commlib.torch_backend._process_group' not in sys.modules\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr


def test_entry_point_makes_import_torch_enough(tmp_path: Path) -> None:
    """pyproject's torch.backends entry point, installed as metadata: ``import torch`` alone registers."""
    tomllib = pytest.importorskip("tomllib")
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch.backends"]
    assert points == {"commlib": "commlib.torch_backend:autoload"}
    info = tmp_path / "commlib_entry_probe-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: commlib-entry-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ncommlib = commlib.torch_backend:autoload\n")
    code = (
        "import sys, torch\n"
        "assert 'COMMLIB' in torch.distributed.Backend._plugins, torch.distributed.Backend._plugins\n"
        "assert 'mpi4py' not in sys.modules\n"
    )
    proc = _python(code, cwd=tmp_path, path=os.pathsep.join([str(tmp_path), str(ROOT)]))
    assert proc.returncode == 0, proc.stderr


def _caught(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception as e:  # the error is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def errors_job(master: dict[str, str]) -> dict:
    """Bad input on every rank (refused before anything moves), then rank 1 never makes two calls."""
    import datetime

    import torch
    import torch.distributed as dist

    init_torch(master, timeout=3.0)
    r = dist.get_rank()
    out = {
        "wrong output size": _caught(lambda: dist.all_gather_into_tensor(torch.zeros(5), torch.zeros(3))),
        "wrong input size": _caught(lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.zeros(7))),
        "dtypes differ": _caught(
            lambda: dist.all_gather_into_tensor(torch.zeros(6), torch.zeros(3, dtype=torch.int32))
        ),
        "src outside the group": _caught(lambda: dist.broadcast(torch.zeros(2), src=5)),
        "dst outside the group": _caught(lambda: dist.send(torch.zeros(2), dst=7)),
        "PREMUL_SUM": _caught(lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))),
        "not contiguous": _caught(lambda: dist.all_gather_into_tensor(torch.zeros(4, 4).t(), torch.zeros(8))),
    }
    late = dist.new_group(timeout=datetime.timedelta(seconds=3))
    dist.barrier()  # every rank is past the bad-input calls: nothing is pending anywhere
    if r == 1:
        time.sleep(8)  # never arrives (alive; a rank that had ended its calls would be named at once instead)
        return out
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(3), group=late, async_op=True)  # its 3 s run while the next call waits
    out["blocking peer never arrives"] = _caught(lambda: dist.all_reduce(torch.ones(3)))
    out["async peer never arrives"] = _caught(work.wait)
    out["seconds"] = time.monotonic() - start
    return out


def test_bad_input_and_a_missing_peer_give_clear_errors() -> None:
    got = run(errors_job, 2, free_port_env(), timeout=90)[0]
    for name in ("wrong output size", "wrong input size", "dtypes differ", "not contiguous", "PREMUL_SUM"):
        assert got[name].startswith(("ValueError", "TypeError")), (name, got[name])
    assert (
        "[rank 0/2] all_gather_into_tensor: output_tensor must have 2*3=6 elements, got 5" in got["wrong output size"]
    )
    assert "[rank 0/2] reduce_scatter_tensor: input must have 2*2=4 elements, got 7" in got["wrong input size"]
    assert "must be contiguous" in got["not contiguous"], got["not contiguous"]
    assert "op=PREMUL_SUM is not supported by the commlib backend" in got["PREMUL_SUM"]
    assert (
        "ValueError: [rank 0/2] broadcast: group_src=5 is out of range for a group of size 2"
        in got["src outside the group"]
    )
    assert (
        "ValueError: [rank 0/2] isend: group_dst=7 is out of range for a group of size 2"
        in got["dst outside the group"]
    )
    for name in ("async peer never arrives", "blocking peer never arrives"):
        assert got[name].startswith("CommTimeoutError: [rank 0/2] all_reduce (call #"), (name, got[name])
        assert "did not complete within 3 s" in got[name] and "not arrived: ranks [1]" in got[name], got[name]


def test_example_torch_ddp_on_commlib_under_the_launcher() -> None:
    port = free_port_env()["MASTER_PORT"]
    example = ROOT / "examples" / "torch_ddp_commlib_backend.py"
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", "2", "--master_port", port, str(example)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}] backend commlib, 2 ranks: w = [2.0000, 3.0000]" in proc.stdout, proc.stdout[-2000:]


def test_the_backend_uses_only_commlibs_public_api() -> None:
    """commlib/torch_backend imports commlib's public names and its own modules, nothing private of commlib."""
    import ast

    bad = []
    for path in sorted((ROOT / "commlib" / "torch_backend").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "commlib" and parts[1:2] != ["torch_backend"] and any(p.startswith("_") for p in parts):
                    bad.append(f"{path.name} imports {name}")
                if parts[0] == "mpi4py":
                    bad.append(f"{path.name} imports {name}")
    assert bad == []


_UNMATCHED = """
import sys, time
import torch
import torch.distributed as dist
import commlib

way = sys.argv[1]
dist.init_process_group(backend="commlib")
rank = dist.get_rank()
t = torch.ones(1 << 20)  # 4 MiB: a send that needs its receive (a small one completes at once, buffered)
start = time.monotonic()
try:
    if rank == 0:
        (dist.send if way == "send" else dist.recv)(t, 1)  # the peer never posts the matching call
    else:
        dist.all_reduce(t)  # it waits in a collective rank 0 has not reached
    print(f"rank {rank} returned", flush=True)
except Exception as e:
    print(f"rank {rank} {type(e).__name__} after {time.monotonic() - start:.2f} s: {e}", flush=True)
"""


@pytest.mark.parametrize("way", ["send", "recv"])
def test_an_unmatched_send_or_recv_under_torchrun_ends_at_once(way: str, tmp_path: Path) -> None:
    """torch's own wait (TorchWork.wait) goes through commlib's slow path: the send (receive) whose peer waits in a
    collective this rank has not reached ends with CollectiveMismatchError within 2 s, on default settings (the
    timeout is 30 minutes), not at the timeout; the peer learns of it. (A small send completes at once, buffered,
    as MPI's: the program's closing check names it.)"""
    from jobs import clean_env, run_job

    script = tmp_path / "unmatched.py"
    script.write_text(_UNMATCHED)
    env = {k: v for k, v in clean_env(PYTHONPATH=str(ROOT)).items() if k != "COMMLIB_TIMEOUT"}  # default settings
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), way]
    done = run_job(cmd, timeout=120, env=env)
    text = done.stdout + done.stderr
    first = next((line for line in done.stdout.splitlines() if line.startswith("rank 0 ")), "")
    assert "CollectiveMismatchError" in first, done.tail()
    assert f"{way} to rank 1" in first or f"{way} from rank 1" in first, first
    seconds = float(first.split(" after ")[1].split(" s:")[0])
    assert seconds < 2.0, first
    assert "rank 1 GroupBrokenError" in text or "rank 1 CollectiveMismatchError" in text, done.tail()
