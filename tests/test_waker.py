"""Blocking MPI waits with a deadline (commlib.backends._waker.blocker): a large wait spins in MPI_Test in C
without the GIL (commlib.backends._native.spin) or, without the C module, blocks inside MPI while a helper
thread wakes it when its time is up (Waker). Either must return at completion, return False at the deadline
with the request still pending (and still completable), survive late completions, refuse a second blocked
thread, and stay off when ranks outnumber cores (a rank spinning in MPI would starve the one sharing its
core), and stay on for ranks bound to a core each."""

from __future__ import annotations

import importlib.util
import os

import pytest

from commlib.testing import run

CORES = len(os.sched_getaffinity(0))


def waker_job(kind: str) -> list[str]:
    import threading
    import time

    import numpy as np
    from mpi4py import MPI

    import commlib as dist
    from commlib.backends._native import spin
    from commlib.backends._waker import Waker, blocker

    me = dist.get_rank()
    w = Waker() if kind == "Python waker" else None
    block = spin if w is None else w.wait
    chosen = blocker()  # what settle() uses: the C spin where built, else the process's own Waker
    assert block is not None and chosen is not None
    assert (chosen is spin) == (kind == "C spin"), (kind, chosen)
    comm = MPI.COMM_WORLD.Dup()
    seen = []
    buf = np.zeros(1 << 18, np.float32)  # 1 MiB
    if me == 0:
        # completes: rank 1 sends after 0.3 s
        req = comm.Irecv(buf, 1, 1)
        t = time.monotonic()
        assert block(req, 5.0) is True and 0.25 < time.monotonic() - t < 3.0
        assert buf[0] == 1.0 and (w is None or w.due == 0.0)
        seen.append("completed")
        # the deadline: rank 1 sends only when told; the request stays pending and completes later
        req = comm.Irecv(buf, 1, 2)
        t = time.monotonic()
        assert block(req, 0.2) is False
        assert 0.19 < time.monotonic() - t < 1.0 and not req.Test()
        comm.send(b"go", 1, 3)
        req.Wait()
        assert buf[0] == 2.0
        seen.append("deadline")
        # a second thread cannot block while one does; it is told to poll (None)
        req = comm.Irecv(buf, 1, 4)
        other: list = []
        th = threading.Thread(target=lambda: other.append(block(MPI.REQUEST_NULL, 1.0)))
        blocked = threading.Thread(target=lambda: other.append(block(req, 5.0)))
        blocked.start()
        time.sleep(0.1)
        th.start()
        th.join()
        comm.send(b"go", 1, 5)
        blocked.join()
        assert other == [None, True] and buf[0] == 3.0
        seen.append("one-thread")
        # many short waits that complete near their deadline: late wake-ups are absorbed
        for i in range(20):
            req = comm.Irecv(buf, 1, 6)
            done = block(req, 0.01)
            if not done:
                req.Wait()
            assert buf[0] == 10.0 + i
        seen.append("late-wakeups")
    else:
        time.sleep(0.3)
        comm.Send(np.ones_like(buf), 0, 1)
        comm.recv(source=0, tag=3)
        comm.Send(np.full_like(buf, 2.0), 0, 2)
        comm.recv(source=0, tag=5)
        comm.Send(np.full_like(buf, 3.0), 0, 4)
        for i in range(20):
            time.sleep(0.01 * (i % 3) / 2)
            comm.Send(np.full_like(buf, 10.0 + i), 0, 6)
    comm.Free()
    if w is not None:
        w.close()
    return seen


@pytest.mark.skipif(CORES < 2, reason="the waker needs a core per rank")
@pytest.mark.parametrize("kind", ["C spin", "Python waker"])
def test_a_blocking_wait_ends_at_completion_or_at_its_deadline(kind: str) -> None:
    if kind == "C spin" and importlib.util.find_spec("commlib.backends._ready") is None:
        pytest.skip("commlib.backends._ready is not built here (test_sums checks it is wherever a compiler is)")
    env = {"COMMLIB_NATIVE": "1" if kind == "C spin" else "0"}
    seen = run(waker_job, 2, kind, timeout=120, env=env)
    assert seen == [["completed", "deadline", "one-thread", "late-wakeups"], []]


def timeout_job() -> str:
    import time

    import numpy as np

    import commlib as dist
    from commlib.backends._waker import blocker

    me = dist.get_rank()
    sub = dist.new_group([0, 1], timeout=1.0)
    x = np.ones(1 << 20, np.float32)  # 4 MiB: its wait blocks in MPI first
    if me == 0:  # rank 1 never makes this call
        t = time.monotonic()
        with pytest.raises(dist.CommTimeoutError, match="all_reduce"):
            dist.all_reduce(x, group=sub)
        took = time.monotonic() - t
        assert 0.9 < took < 3.0, took
        assert blocker() is not None
    dist.barrier()
    return "ok"


@pytest.mark.skipif(CORES < 2, reason="the waker needs a core per rank")
def test_a_large_collective_whose_peer_never_comes_times_out_on_time() -> None:
    assert run(timeout_job, 2, timeout=120) == ["ok", "ok"]


def oversubscribed_job() -> bool:
    import commlib as dist  # noqa: F401  (initialises MPI)
    from commlib.backends._waker import blocker

    return blocker() is None


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
    from commlib.backends._waker import blocker

    dist.init_process_group("mpi")
    return blocker() is not None


@pytest.mark.skipif(CORES < 2, reason="needs two cores to give each rank its own")
@pytest.mark.parametrize("where, blocks", [("a core each", True), ("one core for all", False)])
def test_ranks_bound_to_a_core_each_block_in_mpi_and_ranks_sharing_one_do_not(where: str, blocks: bool) -> None:
    # bound ranks (mpiexec -bind-to core, srun --cpu-bind) see one core each: the node's ranks count theirs together
    assert run(pinned_job, 2, where, timeout=120) == [blocks, blocks]


def late_count_job() -> list:
    import time

    from mpi4py import MPI

    import commlib as dist
    from commlib.backends._waker import _unfinished, count_cores

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
