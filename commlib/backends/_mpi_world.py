"""The mpi backend's world: ``MPI.COMM_WORLD``, per-node worlds joined into one, and the job's abort on failure."""

from __future__ import annotations

from typing import Any, cast

from mpi4py import MPI

from commlib.backends.mpi import MpiBackend

__all__ = ["abort", "join_nodes", "join_singletons", "world"]


def join_nodes(local: MpiBackend, node: int, nnodes: int, rank: int, store: Any, timeout: float) -> MpiBackend:
    """Join the MPI worlds of ``nnodes`` separately launched nodes into one communicator.

    Each node's ranks are one MPI world (one mpiexec per node, as ``commlib.launch``
    starts them). Node 0 opens an MPI port and publishes it in ``store``; the others
    connect to it one at a time and everything joined so far accepts the next
    (MPI_Comm_accept/connect, then Intercomm_merge). Every node first registers in
    the store and waits for all the others, so no accept waits for a node that never
    comes. Ranks are finally ordered by ``rank`` (their global RANK).
    """
    comm: MPI.Intracomm = local.comm
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
    return MpiBackend(cast(MPI.Intracomm, merged.Split(0, rank)))  # Split of an intracommunicator is one


def world() -> MpiBackend:
    """The backend over ``MPI.COMM_WORLD`` (MPI is initialised by importing mpi4py)."""
    return MpiBackend(MPI.COMM_WORLD)


def abort(backend: MpiBackend) -> None:
    """End the whole job: MPI_Abort on ``backend``'s communicator (every process connected to it)."""
    backend.comm.Abort(1)


def join_singletons(store: Any, rank: int, size: int, timeout: float) -> MpiBackend:
    """Join ``size`` processes that no MPI launcher started (each its own MPI world) into one communicator.

    Through ``store``, as :func:`join_nodes` joins nodes: every process is a node of one rank.
    MPICH 5.0.x cannot connect such processes (pmodels/mpich#7805); commlib pins the 4.3.2 wheel,
    and a newer MPICH is refused here with what to do instead of failing inside MPI.
    """
    version = MPI.Get_library_version()
    if version.startswith("MPICH Version:") and version.split()[2].startswith("5."):
        raise RuntimeError(
            f"MPICH {version.split()[2]} cannot connect processes that no MPI launcher started "
            "(MPI_Comm_accept/connect between singletons fails, pmodels/mpich#7805): "
            "`pip install mpich==4.3.2`, or start the job with mpiexec or `python -m commlib.launch`"
        )
    return join_nodes(MpiBackend(MPI.COMM_SELF), rank, size, rank, store, timeout)
