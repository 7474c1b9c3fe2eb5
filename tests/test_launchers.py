"""Any launcher: torchrun (standalone and multi-node), torch.multiprocessing.spawn with tcp:// and file://, and plain
processes with env:// variables start commlib jobs on both backends, with the same answers as under mpiexec; a
rank that never comes is named within the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port
from reference_runs import clean_env, torch_eval_under_mpiexec

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_distributed_eval.py"
EMULATOR = {"COMMLIB_NCCL_EMULATOR": "1"}


def _run(cmd: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=clean_env(env))


def _answers(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = ("world size", "accuracy", "best score", "positive predictions", "per-rank correct", "first scores")
    return [line for line in (x.split("] ", 1)[-1] for x in proc.stdout.splitlines()) if line.startswith(keys)]


@pytest.fixture(scope="module")
def under_mpiexec(once_per_run) -> dict[int, list[str]]:
    """The example's answers on 3 and 4 ranks under mpiexec: what every other launcher must print."""
    runs = {n: _answers(torch_eval_under_mpiexec(once_per_run, n)) for n in (3, 4)}
    assert runs[3][0] == "world size 3" and len(runs[3]) == 6, runs
    return runs


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_torchrun_standalone(backend: str, under_mpiexec: dict[int, list[str]]) -> None:
    """mpi: the processes torchrun starts are joined into one MPI world; nccl: the unique id goes through torchrun's
    store, no MPI at all."""
    cmd = _torchrun("--standalone", "--nproc_per_node", "3", str(EXAMPLE))
    assert _answers(_run(cmd, EMULATOR if backend == "nccl" else {})) == under_mpiexec[3]


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_mp_spawn(scheme: str, tmp_path: Path, under_mpiexec: dict[int, list[str]]) -> None:
    init = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    assert _answers(_run([sys.executable, str(EXAMPLE), "--spawn", "3", init])) == under_mpiexec[3]
    assert not (tmp_path / "rendezvous").exists()  # the file store is removed once every rank has left


def test_mp_spawn_on_the_nccl_emulator(under_mpiexec: dict[int, list[str]]) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    assert _answers(_run([sys.executable, str(EXAMPLE), "--spawn", "3", init], EMULATOR)) == under_mpiexec[3]


def test_torchrun_two_nodes_through_a_rendezvous_endpoint(under_mpiexec: dict[int, list[str]]) -> None:
    """Two torchrun agents (two "nodes" on one host) of 2 workers each, meeting at --rdzv_endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))} | {"OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(_torchrun(*args, "--rdzv_id", "two-nodes", str(EXAMPLE)), cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]  # fmt: skip
    outs = [node.communicate(timeout=180) for node in nodes]
    for node, (_, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, err[-3000:]
    answers = [line for out, _ in outs for line in _answers(subprocess.CompletedProcess([], 0, out, ""))]
    assert answers == under_mpiexec[4]  # rank 0 (on one of the nodes) prints


PLAIN = """
import numpy as np, commlib as dist
dist.init_process_group()
x = np.full(3, dist.get_rank() + 1.0)
dist.all_reduce(x)
g = dist.new_group([1, 0])
y = np.array([float(dist.get_rank())])
dist.broadcast(y, src=1, group=g)
print("rank", dist.get_rank(), "of", dist.get_world_size(), x.tolist(), y.tolist(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_plain_processes_meet_through_env_variables(backend: str, tmp_path: Path) -> None:
    """No launcher at all: two processes given RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT by hand."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))}
    base |= {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    base |= EMULATOR if backend == "nccl" else {}
    procs = [
        subprocess.Popen([sys.executable, str(script)], env={**base, "RANK": str(r)}, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-3000:]
        assert f"rank {r} of 2 [3.0, 3.0, 3.0] [1.0]" in out, out


def test_a_rank_that_never_comes_is_named_within_the_timeout() -> None:
    """WORLD_SIZE=2 but only rank 0 starts: it says who it waited for, where, and what to do, in about 3 s."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    start = time.monotonic()
    proc = _run([sys.executable, "-c", "import commlib as d; d.init_process_group(timeout=3)"], env, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("commlib.errors.CommTimeoutError: init_process_group: rank 0 of 2 (RANK and WORLD_SIZE):")
    assert "not every rank reached the rendezvous store it serves at 127.0.0.1:" in last and "within 3 s" in last
    assert took < 30, took  # generous for a loaded machine: the point is "not a hang"


def test_a_rank_whose_store_nobody_serves_is_named() -> None:
    """Rank 1 with no rank 0 serving the store: it names the address it tried, in about 3 s."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = _run([sys.executable, "-c", "import commlib as d; d.init_process_group(timeout=3)"], env, timeout=60)
    last = proc.stderr.strip().splitlines()[-1]
    assert "rank 1 of 2 (RANK and WORLD_SIZE): could not reach the rendezvous store at 127.0.0.1:" in last, last
    assert "is rank 0 running, with the same address?" in last


DIES_WHILE_JOINING = """
import os, sys
import commlib.backends._mpi_world as w

def dies(local, node, nnodes, rank, store, timeout, unit="node"):
    # reaches the store as every rank does, then dies: before connecting, or connected but before greeting
    store.set(f"commlib/join/{node}/0", b"1")
    store.wait([f"commlib/join/{k}/0" for k in range(nnodes)], timeout)
    if sys.argv[1] == "connected":  # on its turn, as commlib's joiner does
        store.wait([f"commlib/join/turn/{node}"], timeout)
        local.comm.Connect(store.get("commlib/join/port").decode(), root=0)
    os._exit(0)

w.join_nodes = dies  # this process is the fault; the others run commlib unchanged
import commlib
commlib.init_process_group("mpi", timeout=4)
"""


@pytest.mark.parametrize("when", ["before connecting", "connected"])
def test_a_rank_that_dies_while_the_mpi_processes_join_is_a_timeout(when: str, tmp_path: Path) -> None:
    """Three plain processes on the mpi backend; rank 2 reaches the store, then dies before its MPI connect (or
    right after it): ranks 0 and 1 end with CommTimeoutError within the timeout instead of waiting in MPI for good."""
    dying = tmp_path / "dying.py"
    dying.write_text(DIES_WHILE_JOINING)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_"))}
    base |= {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    survivor = [sys.executable, "-c", "import commlib; commlib.init_process_group('mpi', timeout=4)"]
    start = time.monotonic()
    procs = [
        subprocess.Popen(survivor if r < 2 else [sys.executable, str(dying), when.split()[0]],
                         env={**base, "RANK": str(r)}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in range(3)
    ]  # fmt: skip
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - start
    for r in (0, 1):
        assert procs[r].returncode != 0, errs[r][-2000:]
        last = errs[r].strip().splitlines()[-1]
        assert last.startswith(f"commlib.errors.CommTimeoutError: init_process_group: rank {r} "), errs[r][-2000:]
        assert "joining the MPI processes: " in last, last
    # ranks 0 and 1 (joined already) wait for rank 2 together, and name it
    said = "rank 2 did not connect within" if when == "before connecting" else "rank 2 connected but did not greet"
    assert all(said in e for e in errs[:2]), errs
    assert took < 30, took  # generous for a loaded machine: the point is "not a hang"


def test_commlib_launch_refuses_a_missing_script_and_its_help_says_the_defaults() -> None:
    proc = _run([sys.executable, "-m", "commlib.launch", "--nproc_per_node", "2", "no_such_script.py"], timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip().endswith(
        "error: no_such_script.py: no such file or folder (a module runs with -m, a program with --no_python)"
    ), proc.stderr
    shown = " ".join(_run([sys.executable, "-m", "commlib.launch", "--help"], timeout=60).stdout.split())
    for text in ("(default: 1)", "(default: 127.0.0.1)", "(default: 29500)", "cpu (one per CPU core)", "LOCAL_RANK"):
        assert text in shown, (text, shown)
