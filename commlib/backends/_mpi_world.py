"""The mpi backend's world: ``MPI.COMM_WORLD``, per-node worlds joined into one, and the job's abort on failure."""

from __future__ import annotations

import math
import time
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from commlib.backends.mpi import MpiBackend
from commlib.errors import CommTimeoutError

__all__ = ["abort", "join_nodes", "join_singletons", "world"]

_GREETING = 7  # the tag of the joiner's and the root's greetings (the intercommunicator carries nothing else)


def join_nodes(
    local: MpiBackend, node: int, nnodes: int, rank: int, store: Any, timeout: float, unit: str = "node"
) -> MpiBackend:
    """Join the MPI worlds of ``nnodes`` separately launched nodes into one communicator.

    Each node's ranks are one MPI world (one mpiexec per node, as ``commlib.launch``
    starts them). Node 0 opens an MPI port and publishes it in ``store``; the others
    connect to it and everything joined so far accepts the next (MPI_Comm_accept/connect,
    then Intercomm_merge). Every node first registers in the store and waits for all the
    others, so no accept waits for a node that never comes; a node that dies after that
    is a ``CommTimeoutError`` on every other rank within ``timeout`` (accept and connect
    carry MPICH's ``timeout`` info key, and a joiner and the root greet each other before
    the merge, which would wait for good on a dead peer). Ranks are finally ordered by
    ``rank`` (their global RANK). ``unit`` names a node in messages ("rank" for singletons).
    """
    deadline = time.monotonic() + timeout
    comm: MPI.Intracomm = local.comm
    store.set(f"commlib/join/{node}/{comm.Get_rank()}", b"1")
    store.wait([f"commlib/join/{k}/0" for k in range(nnodes)], timeout)
    if node == 0:
        port = MPI.Open_port() if comm.Get_rank() == 0 else ""
        if comm.Get_rank() == 0:
            store.set("commlib/join/port", port)
        merged, joined = comm, [0]  # the nodes joined so far, in the order they came
    else:
        port = store.get("commlib/join/port").decode()
        inter = _bounded(comm.Connect, port, deadline, f"could not connect to {unit} 0 within {timeout:g} s")
        _greet(comm, inter, node, deadline, f"{unit} 0 accepted but did not answer")
        merged = _merge(comm, inter, True)
        joined = merged.bcast(None, root=0)
    try:
        while len(joined) < nnodes:
            missing = sorted(set(range(nnodes)) - set(joined))
            waited = f"{_names(unit, missing)} did not connect within {timeout:g} s"
            inter = _bounded(merged.Accept, port, deadline, waited)
            joiner = _greet(merged, inter, -1, deadline, f"a {unit} connected but did not greet (died?)")
            merged = _merge(merged, inter, False, free=merged is not comm)
            joined = merged.bcast([*joined, joiner], root=0)
    finally:
        if node == 0 and comm.Get_rank() == 0:
            MPI.Close_port(port)
    out = cast(MPI.Intracomm, merged.Split(0, rank))  # Split of an intracommunicator is one
    if merged is not comm:
        merged.Free()
    return MpiBackend(out)


def _names(unit: str, nodes: list[int]) -> str:
    return f"{unit} {nodes[0]}" if len(nodes) == 1 else f"{unit}s {nodes}"


def _bounded(call: Any, port: str, deadline: float, what: str) -> MPI.Intercomm:
    """``call(port, info, root=0)``: a communicator's Accept or Connect (collective over it), given MPICH's
    ``timeout`` info key (whole seconds; 0 would be forever) set to what is left of the join's time; every
    rank of the communicator fails alike."""
    info = MPI.Info.Create()
    info.Set("timeout", str(max(1, math.ceil(deadline - time.monotonic()))))
    try:
        return cast(MPI.Intercomm, call(port, info, root=0))
    except MPI.Exception:  # MPICH says "Invalid port" when the time is up
        raise CommTimeoutError(_failed(what)) from None
    finally:
        info.Free()


def _greet(comm: MPI.Intracomm, inter: MPI.Intercomm, node: int, deadline: float, what: str) -> int:
    """Before the merge, which would wait for good on a dead peer: the joiner's root sends its node number
    (``node``; -1 on the accepting side), the accepting root sends it back; each waits up to ``deadline``,
    then tells its own ranks. The joiner's number, on every rank."""
    ok, buf = True, np.array([node], np.int64)
    if comm.Get_rank() == 0:
        steps = (inter.Isend, inter.Irecv) if node >= 0 else (inter.Irecv, inter.Isend)
        for post in steps:
            req = post(buf, 0, _GREETING)
            while not (done := req.Test()) and time.monotonic() < deadline:
                time.sleep(0.001)
            if not done:
                req.Cancel()
                req.Wait()
                ok = False
                break
    ok, number = comm.bcast((ok, int(buf[0])), root=0)
    if not ok:
        inter.Free()
        raise CommTimeoutError(_failed(what))
    return int(number)


def _merge(comm: MPI.Intracomm, inter: MPI.Intercomm, high: bool, free: bool = False) -> MPI.Intracomm:
    """The intracommunicator of ``inter``'s two groups (``comm``'s last if ``high``); ``inter`` freed, and
    ``comm`` too if ``free`` (a merge of an earlier step)."""
    merged = inter.Merge(high=high)
    inter.Free()
    if free:
        comm.Free()
    return merged


def _failed(what: str) -> str:
    return f"joining the MPI processes: {what}; the job cannot start (did a process die while it started?)"


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
    return join_nodes(MpiBackend(MPI.COMM_SELF), rank, size, rank, store, timeout, unit="rank")
