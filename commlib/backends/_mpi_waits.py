"""The mpi backend's own waits on MPI: a bounded wait on one request of its setting-up, and whether a rank may
block inside MPI.

MPI has no timed wait, so commlib tests requests in a loop. That costs throughput on large transfers: MPICH
moves a message only while it is progressed, and a Python loop of ``Test`` calls progresses it more slowly
than MPI's own ``Wait``. The C executor therefore spins on ``MPI_Test`` without the GIL while a large
transfer may be moving (``Steps.spin``, up to 0.25 s, then the usual polling with naps and the slow path):
as fast as ``MPI_Wait``, and still with a deadline. That needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default)
and a core for every rank on the node: a rank spinning in MPI does not yield, and would starve a rank sharing
its core. :func:`count_cores` (called collectively when the world is set up) counts the cores the node's
ranks may run on, together: ranks bound one to a core (``mpiexec -bind-to core``, ``srun --cpu-bind``)
qualify as much as unbound ones on enough cores; :func:`may_block` says whether a wait may spin.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import numpy as np
from mpi4py import MPI

from commlib._environment import detect
from commlib.backends.base import poll
from commlib.errors import TransportError

__all__ = ["count_cores", "may_block", "mpi_error", "settle"]

_FAST_POLLS = range(256)


def mpi_error(e: MPI.Exception) -> TransportError:
    return TransportError(f"MPI reported an error: {e.Get_error_string()}")


def settle(req: MPI.Request, timeout: float, abandoned: list) -> bool:
    """Wait for ``req`` with a deadline (a few tight tests, then :func:`poll`). A request that times out or is
    interrupted is put in ``abandoned``: MPI may still use what it references."""
    test = req.Test
    try:
        for _ in _FAST_POLLS:
            if test():
                return True
        if poll(test, timeout):
            return True
    except MPI.Exception as e:
        raise mpi_error(e) from None
    except BaseException:
        abandoned.append(req)
        raise
    abandoned.append(req)
    return False


_core_each: bool | None = None  # whether every rank on this node has a core of its own (count_cores)
_RECORD = 8 + 128  # count_cores' record per rank: its host's hash, a bit per CPU (1024)
_unfinished: list = []  # a count_cores that timed out: its request and buffers, kept for good


def count_cores(comm: MPI.Intracomm, timeout: float) -> bool:
    """Collective over ``comm`` (the world): whether the ranks on this node have a core each, counting the
    cores any of them may run on (each rank's affinity, shared among the ranks of its host). False: not
    every rank took part within ``timeout`` seconds (nothing is decided then)."""
    global _core_each
    mask = np.zeros(_RECORD, np.uint8)
    for cpu in os.sched_getaffinity(0):
        mask[8 + (cpu % (8 * (_RECORD - 8))) // 8] |= 1 << (cpu % 8)  # a CPU past the mask shares a bit: fewer
    host = hashlib.blake2b(MPI.Get_processor_name().encode(), digest_size=8).digest()
    mask[:8] = np.frombuffer(host, np.uint8)
    every = np.empty((comm.Get_size(), _RECORD), np.uint8)
    req = comm.Iallgather(mask, every)
    deadline = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            _unfinished.append((req, mask, every))  # MPI may still write into them
            return False
        time.sleep(0.0005)
    here = every[(every[:, :8] == mask[:8]).all(axis=1)]
    cores = int(np.unpackbits(np.bitwise_or.reduce(here[:, 8:], axis=0)).sum())
    _core_each = cores >= len(here)
    return True


def _may_block() -> bool:
    """Whether a thread may block (spin) in MPI: MPI_THREAD_MULTIPLE and a core for every rank of the node."""
    threads = MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
    core_each = _core_each
    if core_each is None:
        core_each = detect().local_world_size <= len(os.sched_getaffinity(0))
    return bool(threads and core_each)


@functools.cache
def may_block() -> bool:
    """Whether a thread may block (spin) in MPI: MPI_THREAD_MULTIPLE and a core for every rank of the node
    (decided once, after :func:`count_cores`)."""
    threads = MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
    core_each = _core_each
    if core_each is None:
        core_each = detect().local_world_size <= len(os.sched_getaffinity(0))
    return bool(threads and core_each)
