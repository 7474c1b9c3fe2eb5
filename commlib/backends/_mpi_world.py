"""The mpi backend's world: ``MPI.COMM_WORLD``, per-node worlds joined into one, and the job's abort on failure."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from commlib.backends.mpi import MpiBackend
from commlib.errors import BackendUnavailableError, CommError, CommTimeoutError

__all__ = ["admit", "join_nodes", "join_running", "join_singletons", "launched", "world"]

_GREETING = 7  # the tag of the joiner's and the root's greetings (the intercommunicator carries nothing else)
#: seconds a joiner waits beyond what node 0 allows itself, so that node 0 always gives up first: a joiner
#: that gave up while node 0 still went on would leave it in an accept or a merge that never ends
_GRACE = 3.0


def join_nodes(
    local: MpiBackend, node: int, nnodes: int, rank: int, store: Any, timeout: float, unit: str = "node"
) -> MpiBackend:
    """Join the MPI worlds of ``nnodes`` separately launched nodes into one communicator.

    Each node's ranks are one MPI world (one mpiexec per node, as ``commlib.launch``
    starts them). Every node first registers in the store and waits for all the others,
    so no accept waits for a node that never comes. Node 0 opens an MPI port and
    publishes it in ``store``; then, node by node, everything joined so far accepts the
    next (MPI_Comm_accept/connect, then Intercomm_merge), node 0 telling it its turn
    through the store. A node that dies after reaching the store is a
    ``CommTimeoutError`` on every other rank, not a hang: the accept carries MPICH's
    ``timeout`` info key (what is left of node 0's ``timeout``), the joiner and node 0
    greet each other before the merge (which would wait for good on a dead peer), and a
    joiner waits :data:`_GRACE` seconds longer than node 0 at each step, so node 0 gives
    up first and tells the nodes still waiting for their turn. Ranks are finally ordered
    by ``rank`` (their global RANK). ``unit`` names a node in messages ("rank" for
    singletons).
    """
    deadline = time.monotonic() + timeout
    comm: MPI.Intracomm = local.comm
    store.set(f"commlib/join/{node}/{comm.Get_rank()}", b"1")
    try:
        store.wait([f"commlib/join/{k}/0" for k in range(nnodes)], timeout)
    except CommTimeoutError:
        missing = [k for k in range(nnodes) if not store.check([f"commlib/join/{k}/0"])]
        raise CommTimeoutError(
            _failed(f"{unit}s {missing} did not reach the job's store within {timeout:g} s (did they start? die?)")
        ) from None
    root = node == 0 and comm.Get_rank() == 0
    port = MPI.Open_port() if root else ""
    merged = comm
    try:
        if root:
            store.set("commlib/join/port", port)
        if node > 0:
            merged = _join(comm, node, store, timeout, unit)
        for k in range(node + 1, nnodes):
            merged = _accept(merged, comm, k, port, store, deadline, unit, root)
    except BaseException as e:
        if root:  # the nodes still waiting for their turn end now, with the reason
            why = str(e).removeprefix(_JOINING).removesuffix(_CANNOT)
            with contextlib.suppress(Exception):  # a store that fails too: they time out instead
                for k in range(node + 1, nnodes):
                    store.set(f"commlib/join/turn/{k}", b"-" + why.encode())
        if merged is not comm:
            merged.Free()
        raise
    finally:
        if root:
            MPI.Close_port(port)
    out = cast(MPI.Intracomm, merged.Split(0, rank))  # Split of an intracommunicator is one
    if merged is not comm:
        merged.Free()
    return MpiBackend(out)


def _join(comm: MPI.Intracomm, node: int, store: Any, timeout: float, unit: str) -> MPI.Intracomm:
    """Node ``node``'s side: wait for its turn, connect, greet, merge (its ranks last)."""
    try:
        store.wait([f"commlib/join/turn/{node}"], timeout)
    except CommTimeoutError:
        raise CommTimeoutError(_failed(f"{unit} 0 did not call this {unit} in within {timeout:g} s")) from None
    turn = store.get(f"commlib/join/turn/{node}")
    if turn.startswith(b"-"):
        raise CommTimeoutError(_failed(f"{unit} 0 stopped before this {unit}'s turn ({turn[1:].decode()})"))
    due = time.monotonic() + float(turn) + _GRACE  # node 0's accept gives up first
    port = store.get("commlib/join/port").decode()
    inter = _bounded(comm.Connect, port, due, f"could not connect to {unit} 0")
    _greet(comm, inter, node, due + _GRACE, f"{unit} 0 accepted this {unit} but did not answer")
    merged = inter.Merge(high=True)
    inter.Free()
    return merged


def _accept(
    merged: MPI.Intracomm, comm: MPI.Intracomm, k: int, port: str, store: Any, deadline: float, unit: str, root: bool
) -> MPI.Intracomm:
    """Everything joined so far (``merged``) accepts node ``k``: node 0 tells it its turn and the seconds it
    allows, accepts, greets, merges (the joined ranks first)."""
    seconds = max(1, math.ceil(deadline - time.monotonic()))  # MPICH's timeout: whole seconds, 0 is forever
    if root:
        store.set(f"commlib/join/turn/{k}", str(seconds).encode())
    inter = _bounded(merged.Accept, port, time.monotonic() + seconds, f"{unit} {k} did not connect")
    # a joiner late to the store may be accepted at the deadline: its greeting still gets a moment
    _greet(merged, inter, -1 - k, max(deadline, time.monotonic() + 2.0), f"{unit} {k} connected but did not greet")
    out = inter.Merge(high=False)
    inter.Free()
    if merged is not comm:
        merged.Free()
    return out


def _bounded(call: Any, port: str, due: float, what: str) -> MPI.Intercomm:
    """``call(port, info, root=0)``: a communicator's Accept or Connect (collective over it), given MPICH's
    ``timeout`` info key (whole seconds) up to ``due``. Every rank of the communicator fails alike (the root
    passes its error on): ``CommTimeoutError`` for MPICH's timeout (its class is MPI_ERR_PORT, "Invalid
    port"), else ``CommError`` with MPI's words (e.g. the port's owner is gone)."""
    seconds = max(1, math.ceil(due - time.monotonic()))
    info = MPI.Info.Create()
    info.Set("timeout", str(seconds))
    try:
        return cast(MPI.Intercomm, call(port, info, root=0))
    except MPI.Exception as e:
        if e.Get_error_class() == MPI.ERR_PORT:
            raise CommTimeoutError(_failed(f"{what} within {seconds} s")) from None
        raise CommError(_failed(f"{what}: {e.Get_error_string().strip()}")) from None
    finally:
        info.Free()


def _greet(comm: MPI.Intracomm, inter: MPI.Intercomm, node: int, due: float, what: str) -> None:
    """Before the merge, which would wait for good on a dead peer: the joiner's root sends its node number
    (``node``), the accepting root (``node``: -1 - the number it expects) checks it and sends it back; each
    waits up to ``due``, then tells its own ranks (always: an MPI error on the root is an outcome too)."""
    failure = _greeting(inter, node, due, what) if comm.Get_rank() == 0 else ""
    failure = comm.bcast(failure, root=0)
    if failure:
        inter.Free()
        raise CommTimeoutError(_failed(failure))


def _greeting(inter: MPI.Intercomm, node: int, due: float, what: str) -> str:
    """The root's greeting (see :func:`_greet`): "" or what went wrong."""
    want = node if node >= 0 else -1 - node
    buf = np.array([node], np.int64)
    try:
        for post in (inter.Isend, inter.Irecv) if node >= 0 else (inter.Irecv, inter.Isend):
            req = post(buf, 0, _GREETING)
            while not (done := req.Test()) and time.monotonic() < due:
                time.sleep(0.001)
            if not done:
                req.Cancel()
                req.Wait()
                return f"{what} (died?)"
            if int(buf[0]) != want:
                return f"{what}: {int(buf[0])} answered instead"
    except MPI.Exception as e:
        return f"{what}: {e.Get_error_string().strip()}"
    return ""


_JOINING, _CANNOT = "joining the MPI processes: ", "; the job cannot start (did a process die while it started?)"


def _failed(what: str) -> str:
    return f"{_JOINING}{what}{_CANNOT}"


def world() -> MpiBackend:
    """The backend over ``MPI.COMM_WORLD`` (MPI is initialised by importing mpi4py)."""
    return MpiBackend(MPI.COMM_WORLD)


def launched(info: Any, timeout: float, open_store: Callable[[], Any]) -> MpiBackend:
    """The MPI world of a job an MPI launcher started: ``MPI.COMM_WORLD``, or (``commlib.launch --nnodes N``:
    one MPI world per node) the nodes' worlds joined through the job's rendezvous store (``open_store()``,
    closed after). Refused (``BackendUnavailableError``) when MPI's world is not the job the environment
    describes."""
    backend = world()
    if backend.size < info.world_size and info.num_nodes > 1 and backend.size == info.local_world_size:
        store = open_store()
        try:
            backend = join_nodes(backend, info.node_rank, info.num_nodes, info.rank, store, timeout)
        except CommError as e:  # CommTimeoutError included: the same type, saying who
            raise type(e)(f"init_process_group: rank {info.rank} (from {info.source}): {e}") from None
        finally:
            store.close()
    if backend.size != info.world_size and info.world_size > 1:
        raise BackendUnavailableError(
            f"init_process_group: the environment ({info.source}) says this is rank {info.rank} of "
            f"{info.world_size}, but MPI's world has {backend.size} processes: start every rank with one launcher"
        )
    return backend


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


def admit(members: MpiBackend, newcomers: int, store: Any, timeout: float) -> MpiBackend:
    """The members' side of a group that grows (``commlib.grow_group``): ``members`` accept ``newcomers``
    processes, one after the other, through ``store`` (as :func:`join_nodes` joins nodes); they keep their
    ranks, the newcomers come after them."""
    return join_nodes(members, 0, 1 + newcomers, members.rank, store, timeout, unit="newcomer")


def join_running(store: Any, rank: int, nth: int, newcomers: int, timeout: float) -> MpiBackend:
    """A newcomer's side (the ``nth`` of ``newcomers``, to be rank ``rank``): connect to the running group's
    members through ``store`` when its turn comes (see :func:`admit`)."""
    return join_nodes(MpiBackend(MPI.COMM_SELF), 1 + nth, 1 + newcomers, rank, store, timeout, unit="newcomer")
