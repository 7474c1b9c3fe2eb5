"""Waits that block in MPI (commlib.backends._mpi_waits.may_block): the C executor's wait for a large transfer
spins in MPI_Test without the GIL, then polls; it must still end at the group's timeout, stay off when ranks
outnumber cores (a rank spinning in MPI would starve the one sharing its core), and stay on for ranks bound to
a core each; counting the cores ends at its deadline when a rank is late."""

from __future__ import annotations

import os

import pytest

from commlib.testing import run

CORES = len(os.sched_getaffinity(0))


def timeout_job() -> str:
    import time

    import numpy as np

    import commlib as dist
    from commlib.backends._mpi_waits import may_block

    me = dist.get_rank()
    sub = dist.new_group([0, 1], timeout=1.0)
    x = np.ones(1 << 20, np.float32)  # 4 MiB: its wait blocks in MPI first
    if me == 0:  # rank 1 never makes this call
        t = time.monotonic()
        with pytest.raises(dist.CommTimeoutError, match="all_reduce"):
            dist.all_reduce(x, group=sub)
        took = time.monotonic() - t
        assert 0.9 < took < 3.0, took
        assert may_block()
    dist.barrier()
    return "ok"


@pytest.mark.skipif(CORES < 2, reason="blocking waits need a core per rank")
def test_a_large_collective_whose_peer_never_comes_times_out_on_time() -> None:
    assert run(timeout_job, 2, timeout=120) == ["ok", "ok"]


def oversubscribed_job() -> bool:
    import commlib as dist  # noqa: F401  (initialises MPI)
    from commlib.backends._mpi_waits import may_block

    return not may_block()


def test_no_blocking_waits_when_ranks_outnumber_cores() -> None:
    n = CORES + 1
    assert run(oversubscribed_job, n, timeout=120) == [True] * n


def pinned_job(where: str) -> bool:
    import os

    cores = sorted(os.sched_getaffinity(0))
    rank = int(os.environ["PMI_RANK"])
    # as mpiexec -bind-to core would (a core each), or every rank on one core; before MPI starts
    os.sched_setaffinity(0, {cores[rank % len(cores)] if where == "a core each" else cores[0]})
    import commlib as dist
    from commlib.backends._mpi_waits import may_block

    dist.init_process_group("mpi")
    return may_block()


@pytest.mark.skipif(CORES < 2, reason="needs two cores to give each rank its own")
@pytest.mark.parametrize("where, blocks", [("a core each", True), ("one core for all", False)])
def test_ranks_bound_to_a_core_each_block_in_mpi_and_ranks_sharing_one_do_not(where: str, blocks: bool) -> None:
    # bound ranks (mpiexec -bind-to core, srun --cpu-bind) see one core each: the node's ranks count theirs together
    assert run(pinned_job, 2, where, timeout=120) == [blocks, blocks]


def late_count_job() -> list:
    import time

    from mpi4py import MPI

    import commlib as dist
    from commlib.backends._mpi_waits import _unfinished, count_cores

    me = dist.get_rank()
    comm = MPI.COMM_WORLD.Dup()
    if me == 0:  # rank 1 comes late: the count gives up at its deadline, keeping its request and buffers
        t = time.monotonic()
        counted = count_cores(comm, 0.3)
        took = time.monotonic() - t
        kept = len(_unfinished)
        dist.barrier()
        return [counted, 0.25 < took < 2.0, kept]
    time.sleep(1.0)
    dist.barrier()
    return [count_cores(comm, 5.0)]


def test_counting_cores_ends_at_its_deadline_when_a_rank_is_late() -> None:
    assert run(late_count_job, 2, timeout=120) == [[False, True, 1], [True]]
