"""The mpi backend's world: ``MPI.COMM_WORLD``, per-node worlds joined into one, and the job's abort on failure."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from commlib.backends.mpi import MpiBackend

__all__ = ["before_abort", "join_nodes", "world"]

#: Called as ``hook(kind, value)`` by the uncaught-exception hook before MPI_Abort (commlib's job
#: monitor adds one that tells the other ranks who failed); errors in it are ignored.
before_abort: list[Callable[[type[BaseException], BaseException], None]] = []


def join_nodes(local: MpiBackend, node: int, nnodes: int, rank: int, store: Any, timeout: float) -> MpiBackend:
    """Join the MPI worlds of ``nnodes`` separately launched nodes into one communicator.

    Each node's ranks are one MPI world (one mpiexec per node, as ``commlib.launch``
    starts them). Node 0 opens an MPI port and publishes it in ``store``; the others
    connect to it one at a time and everything joined so far accepts the next
    (MPI_Comm_accept/connect, then Intercomm_merge). Every node first registers in
    the store and waits for all the others, so no accept waits for a node that never
    comes. Ranks are finally ordered by ``rank`` (their global RANK).
    """
    comm = local.comm
    store.set(f"commlib/join/{node}/{comm.Get_rank()}", b"1")
    store.wait([f"commlib/join/{k}/0" for k in range(nnodes)], timeout)
    if node == 0:
        port = MPI.Open_port() if comm.Get_rank() == 0 else ""
        if comm.Get_rank() == 0:
            store.set("commlib/join/port", port)
        merged, joined = comm, 1
    else:
        port = store.get("commlib/join/port").decode()
        merged = comm.Connect(port, root=0).Merge(high=True)
        joined = merged.bcast(None, root=0)
    while joined < nnodes:
        merged = merged.Accept(port, root=0).Merge(high=False)
        joined = merged.bcast(joined + 1, root=0)
    if node == 0 and comm.Get_rank() == 0:
        MPI.Close_port(port)
    return MpiBackend(merged.Split(0, rank))


def world() -> MpiBackend:
    """The backend over ``MPI.COMM_WORLD`` (MPI is initialised by importing mpi4py)."""
    backend = MpiBackend(MPI.COMM_WORLD)
    if backend.size > 1 and os.environ.get("COMMLIB_ABORT_ON_EXCEPTION", "1") != "0":
        _abort_on_uncaught_exception()
    return backend


def _abort_on_uncaught_exception() -> None:
    """An uncaught exception on one rank ends the whole job at once instead of leaving the others waiting.

    Without this the failed rank sits in MPI_Finalize (which waits for every rank)
    while the others wait in a collective until their timeout. ``MPI_Abort`` makes
    the launcher stop every rank; the traceback is printed first.
    """
    previous = sys.excepthook
    if getattr(previous, "_commlib", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt):
            return
        sys.stdout.flush()
        for before in before_abort:
            with contextlib.suppress(BaseException):  # the job must be aborted whatever happens
                before(kind, value)
        sys.stderr.write(f"commlib: uncaught {kind.__name__} on rank {MPI.COMM_WORLD.Get_rank()}: aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    hook._commlib = True  # type: ignore[attr-defined]
    sys.excepthook = hook
