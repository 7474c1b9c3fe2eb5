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
