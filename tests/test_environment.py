"""Launcher environment detection (pure: plain dicts in, LaunchInfo out)."""

from __future__ import annotations

import pytest

from commlib._environment import detect, expand_hostlist


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29500",
        "PMI_RANK": "0",
        "PMI_SIZE": "1",
    }
    info = detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes, info.master_addr, info.master_port) == (1, 2, "h0", 29500)
    assert info.source == "torchrun"  # explicit launcher variables win over MPI's


def test_mpich_hydra_variables() -> None:
    info = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (info.rank, info.world_size, info.local_rank, info.num_nodes, info.source) == (3, 4, 1, 2, "mpich")


def test_open_mpi_variables() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "OMPI_COMM_WORLD_NODE_RANK": "0",
    }
    info = detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.num_nodes, info.source) == (2, 6, 2, 2, "openmpi")


def test_slurm_variables_and_master_from_nodelist() -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    info = detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (6, 8, 2, 4)
    assert (info.node_rank, info.num_nodes, info.master_addr, info.source) == (1, 2, "gpu07", "slurm")


def test_single_process_default() -> None:
    info = detect({})
    assert (info.rank, info.world_size, info.local_rank, info.num_nodes, info.source) == (0, 1, 0, 1, "single")


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("n1,n2", ["n1", "n2"]),
        ("a[1-2]-ib,c", ["a1-ib", "a2-ib", "c"]),
        ("rack[1-2]n[0-1]", ["rack1n0", "rack1n1", "rack2n0", "rack2n1"]),
        ("node[9-11]", ["node9", "node10", "node11"]),
        ("", []),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="environment variable RANK must be an integer, got 'x'"):
        detect({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"rank 4 not in \[0, 2\)"):
        detect({"RANK": "4", "WORLD_SIZE": "2"})


def test_srun_task_with_pmi2_uses_slurm_local_ranks() -> None:
    env = {
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }
    info = detect(env)
    assert (info.rank, info.local_rank, info.local_world_size, info.node_rank, info.source) == (3, 1, 2, 1, "slurm")


def test_mpiexec_inside_a_slurm_allocation_trusts_pmi() -> None:
    env = {
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": "3",
        "MPI_LOCALNRANKS": "4",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    info = detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == (3, 4, 3, "mpich")


def test_compressed_nodelist_mixed_with_plain_hosts() -> None:
    assert expand_hostlist("gpu[01-04,07],cpu3") == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]


def test_mpich_yields_in_its_blocking_waits_only_where_ranks_outnumber_cores() -> None:
    """commlib.backends._mpich.before_init: MPIR_CVAR_ENABLE_HEAVY_YIELD=1 where the node's ranks outnumber this
    process's cores (hydra's MPI_LOCALNRANKS, torchrun's LOCAL_WORLD_SIZE), nothing otherwise; a user's own value,
    under any of MPICH's spellings, wins."""
    import os

    from commlib.backends._mpich import HEAVY_YIELD, before_init

    cores = len(os.sched_getaffinity(0))
    hydra = {"PMI_RANK": "0", "PMI_SIZE": str(cores + 1), "MPI_LOCALNRANKS": str(cores + 1)}
    env = dict(hydra)
    assert before_init(env) and env[HEAVY_YIELD] == "1"
    env = {"RANK": "0", "WORLD_SIZE": str(2 * cores + 2), "LOCAL_WORLD_SIZE": str(cores + 1)}
    assert before_init(env) and env[HEAVY_YIELD] == "1"
    for fits in ({**hydra, "MPI_LOCALNRANKS": str(cores)}, {}, {"RANK": "0", "WORLD_SIZE": "1"}):
        env = dict(fits)
        assert not before_init(env) and HEAVY_YIELD not in env, fits
    for spelling in (HEAVY_YIELD, "MPICH_ENABLE_HEAVY_YIELD"):
        env = {**hydra, spelling: "0"}
        assert not before_init(env) and env[spelling] == "0" and len(env) == len(hydra) + 1
    env = {**hydra, "MPI_LOCALNRANKS": "two"}  # malformed: init_process_group names it, this leaves it
    assert not before_init(env) and HEAVY_YIELD not in env


def test_importing_commlib_sets_the_heavy_yield_before_mpi_starts() -> None:
    """In a process hydra would start as one of more ranks than cores, importing commlib sets it (before mpi4py
    runs MPI_Init); in one that fits, it does not."""
    import os
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0))
    code = "import os, commlib, mpi4py.MPI; print(os.environ.get('MPIR_CVAR_ENABLE_HEAVY_YIELD'))"
    base = {k: v for k, v in os.environ.items() if "HEAVY_YIELD" not in k and not k.startswith(("PMI", "MPI_"))}
    for local, want in ((cores + 1, "1"), (1, "None")):
        env = {**base, "PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALNRANKS": str(local)}
        env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        out = subprocess.run([sys.executable, "-c", code], env={**env, "PMI_SIZE": str(local)}, capture_output=True)
        assert out.stdout.decode().split() == [want], out
