"""Forming the default group: how the ranks of a job find each other, whatever started them.

- Started by an MPI launcher (``mpiexec``, ``srun --mpi=pmi2``, ``commlib.launch``): MPI's world is
  the job, or one node of it (``commlib.launch --nnodes N``: the nodes' worlds are joined through
  the rendezvous store).
- Started by anything else (``torchrun``, ``torch.multiprocessing.spawn``, plain processes with a
  ``tcp://``, ``file://`` or ``env://`` init): every process is its own MPI world. The rendezvous
  store carries what they need: for the mpi backend an MPI port to connect to (the processes are
  joined into one communicator), for the nccl backend the unique id (no MPI at all).

The store is the one ``init_process_group(store=...)`` names (commlib's or torch's), torchrun's
agent store, or one that rank 0 serves at the ``init_method``'s address.
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import itertools
import os
import sys
from datetime import timedelta
from typing import Any

from commlib._environment import LaunchInfo, detect, mpi_launched
from commlib._group import ProcessGroup
from commlib._settings import value as setting
from commlib.backends.base import Backend, MeetingTimeout
from commlib.errors import BackendUnavailableError, CommError, CommTimeoutError
from commlib.store import FileStore, PrefixStore, Store, TCPStore, as_store

__all__ = ["StoreMeeting", "emulated", "make_world", "rendezvous_store"]

_worlds = itertools.count()  # worlds this process formed: keeps each one's keys apart in a shared store


def emulated() -> bool:
    """True when ``COMMLIB_NCCL_EMULATOR`` selects the CPU emulator for the nccl backend."""
    return os.environ.get("COMMLIB_NCCL_EMULATOR", "") not in ("", "0")


def make_world(
    name: str, timeout: float, world_size: int, rank: int, init_method: str, store: Any
) -> tuple[ProcessGroup, Store | None]:
    """The default group of backend ``name``, and the store to close when the group is destroyed (if any)."""
    info = place(world_size, rank)
    _skip_the_last_collection()
    if name == "nccl":
        from commlib.backends import nccl

        nccl.load(emulated())  # fail early, before any communication, when NCCL cannot run here
    if mpi_launched() or (info.world_size == 1 and store is None):
        return _launched_world(name, info, timeout, init_method), None
    shared, owned = _job_store(store, init_method, info, timeout)
    try:
        backend = _joined_world(name, info, timeout, shared)
    except CommTimeoutError as e:
        if owned is not None:
            owned.close()
        raise CommTimeoutError(f"init_process_group: rank {info.rank} ({_who(info)}): {e}") from None
    return _group(backend, timeout), owned


@functools.cache
def _skip_the_last_collection() -> None:
    """At exit, freeze the heap so the interpreter's final garbage collection skips it.

    With torch loaded that collection takes ~1 s per process, and launchers wait for every rank to
    exit. Objects are still released by reference counting and module teardown, as at any exit;
    ``COMMLIB_EXIT_GC=1`` keeps the collection.
    """
    if not setting("COMMLIB_EXIT_GC"):
        atexit.register(gc.freeze)  # atexit runs last in, first out: this runs after handlers added later


def place(world_size: int, rank: int) -> LaunchInfo:
    """This process's place: from the launcher's variables, or from ``world_size``/``rank`` (mp.spawn)."""
    info = detect()
    if info.source != "single" or world_size in (-1, None, 1):
        return info
    if rank in (-1, None):
        raise ValueError(
            f"init_process_group: world_size={world_size} without rank, and no launcher variables "
            "(RANK/WORLD_SIZE, mpiexec, srun): pass rank=, or start the job with a launcher"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"init_process_group: rank={rank} is not in [0, world_size={world_size})")
    return LaunchInfo(rank, world_size, rank, world_size, 0, 1, info.master_addr, info.master_port, "arguments")


def _who(info: LaunchInfo) -> str:
    """Who said which rank this is, for messages."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "started by torchrun"
    said = {"arguments": "rank and world_size given to init_process_group", "torchrun": "RANK and WORLD_SIZE"}
    return said.get(info.source, f"from {info.source}")


def _group(backend: Backend, timeout: float) -> ProcessGroup:
    label = f"[rank {backend.rank}/{backend.size}] "
    return ProcessGroup(backend, list(range(backend.size)), backend.rank, "world", timeout, label)


def _launched_world(name: str, info: LaunchInfo, timeout: float, init_method: str) -> ProcessGroup:
    """MPI's world is the job (or one node of it): the mpi backend on it, or NCCL bootstrapped over it."""
    from commlib._diagnostics import monitor
    from commlib.backends import _mpi_world as mpi

    backend = mpi.world()
    if backend.size < info.world_size and info.num_nodes > 1 and backend.size == info.local_world_size:
        backend = _join_nodes(backend, info, timeout, init_method)
    if backend.size != info.world_size and info.world_size > 1:
        raise BackendUnavailableError(
            f"init_process_group: the environment ({info.source}) says this is rank {info.rank} of "
            f"{info.world_size}, but MPI's world has {backend.size} processes: start every rank with one launcher"
        )
    if name == "mpi":
        backend.prepare(timeout, world=True)  # the communicators of its own, the pattern its ranks agree on
    monitor.setup(backend, timeout)
    if backend.size > 1:
        monitor.install_excepthook(functools.partial(mpi.abort, backend))
    _flight_signal()
    if name == "nccl":
        return _group(_nccl_world(backend, info, timeout), timeout)
    return _group(backend, timeout)


def _joined_world(name: str, info: LaunchInfo, timeout: float, store: Store) -> Backend:
    """Processes no MPI launcher started: MPI processes joined through the store, or NCCL bootstrapped by it."""
    from commlib._diagnostics import monitor

    if name == "nccl":
        backend: Backend = _nccl_world(StoreMeeting(store, info.rank), info, timeout)
        monitor.setup(backend, timeout, store)
        monitor.install_excepthook(None)  # no MPI to abort with: the launcher (torchrun) ends the job
    else:
        from commlib.backends import _mpi_world as mpi

        try:
            joined = mpi.join_singletons(store, info.rank, info.world_size, timeout)
        except CommTimeoutError:
            raise
        except RuntimeError as e:
            raise BackendUnavailableError(f"init_process_group: rank {info.rank} ({_who(info)}): {e}") from None
        joined.prepare(timeout, world=True)
        monitor.setup(joined, timeout, store)
        monitor.install_excepthook(functools.partial(mpi.abort, joined))
        backend = joined
    _flight_signal()
    return backend


def _flight_signal() -> None:
    from commlib._diagnostics import flight

    flight.install_signal()


def _job_store(given: Any, init_method: str, info: LaunchInfo, timeout: float) -> tuple[Store, Store | None]:
    """The store every rank of this job shares (its keys under a prefix of their own for this world), and
    the store to close with the world: the one commlib opened, never one the caller gave."""
    owned: Store | None = None
    if given is not None:
        base = as_store(given)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and init_method == "env://":
        base = owned = _torchrun_store(info, timeout)
    else:
        base = owned = rendezvous_store(init_method, info, timeout, serve=True)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"commlib/{run}/{attempt}/world{next(_worlds)}", base), owned


def _torchrun_store(info: LaunchInfo, timeout: float) -> Store:
    """torchrun's agent store (torch's TCPStore at MASTER_ADDR:MASTER_PORT), as a client."""
    import torch.distributed as tdist

    addr, port = info.master_addr or "127.0.0.1", info.master_port or 29500
    try:
        return as_store(tdist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout)))
    except RuntimeError as e:
        raise CommError(f"init_process_group: rank {info.rank} (torchrun) cannot reach torchrun's store: {e}") from None


def rendezvous_store(init_method: str, info: LaunchInfo, timeout: float, serve: bool = False) -> Store:
    """The store named by ``init_method``: ``tcp://host:port``, ``file:///path``, or ``env://`` (MASTER_ADDR/PORT).

    ``serve``: rank 0 serves a TCP store itself (else it is a client of one served elsewhere, e.g. by
    node 0's ``commlib.launch``).
    """
    token = os.environ.get("COMMLIB_STORE_TOKEN")
    if init_method.startswith("file://"):
        return FileStore(init_method[len("file://") :], info.world_size)
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"init_process_group: init_method must look like tcp://host:port, got {init_method!r}")
        address = (host.strip("[]"), int(port))
    elif info.master_addr and info.master_port:
        address = (info.master_addr, info.master_port)
    else:
        raise BackendUnavailableError(
            f"init_process_group: rank {info.rank} of {info.world_size} ({_who(info)}) was not started by an MPI "
            "launcher, so its ranks meet through a store: set MASTER_ADDR and MASTER_PORT (env://), pass "
            "init_method='tcp://host:port' or 'file:///shared/path', or start the job with a launcher, e.g. "
            f"`torchrun --nproc_per_node {info.world_size} script.py` or "
            f"`mpiexec -n {info.world_size} python script.py`"
        )
    master, where = serve and info.rank == 0, f"{address[0]}:{address[1]}"
    me = f"init_process_group: rank {info.rank} of {info.world_size} ({_who(info)})"
    try:
        return TCPStore(*address, world_size=info.world_size, is_master=master, timeout=timeout, token=token)
    except CommError as e:  # nobody came, or nobody serves, or the port is taken
        if master and isinstance(e.__cause__, OSError):  # it could not listen (torch's own store there?)
            raise CommError(
                f"{me}: cannot serve the rendezvous store at {where} ({e.__cause__}); if torch.distributed "
                "already serves its store there, pass init_method='tcp://host:<another port>' (or store=)"
            ) from None
        if master:
            raise CommTimeoutError(
                f"{me}: not every rank reached the rendezvous store it serves at {where} within {timeout:g} s ({e}); "
                f"start all {info.world_size} ranks with the same store address, or raise the timeout"
            ) from None
        raise CommTimeoutError(
            f"{me}: could not reach the rendezvous store at {where} within {timeout:g} s ({e}); "
            "rank 0 serves it: is rank 0 running, with the same address?"
        ) from None


def _join_nodes(local: Any, info: LaunchInfo, timeout: float, init_method: str) -> Any:
    """One MPI communicator out of the per-node MPI worlds (``commlib.launch --nnodes N``)."""
    from commlib.backends import _mpi_world as mpi

    store = rendezvous_store(init_method, info, timeout)
    try:
        return mpi.join_nodes(local, info.node_rank, info.num_nodes, info.rank, store, timeout)
    except CommError as e:  # CommTimeoutError included: the same type, saying who
        raise type(e)(f"init_process_group: rank {info.rank} ({_who(info)}): {e}") from None
    finally:
        store.close()


def _nccl_world(meeting: Any, info: LaunchInfo, timeout: float) -> Backend:
    """The NCCL communicator of the job; ``meeting`` (MPI's world, or the store) carries rank 0's unique id."""
    from commlib.backends import nccl

    module, cuda, xp, host = nccl.load(emulated())
    if not host:  # one process per GPU, unless the caller already chose one
        cuda.Device(info.local_rank % cuda.runtime.getDeviceCount()).use()
    everyone = list(range(info.world_size))
    uid = nccl.unique_id(module) if info.rank == 0 else b""
    uid = meeting.rendezvous(everyone, timeout, uid, what="the NCCL world's unique id")
    comm = module.NcclCommunicator(info.world_size, uid, info.rank)
    if host and info.rank == 0:
        print(
            "commlib: backend 'nccl' is running on the NCCL emulator (CPU, host memory; "
            "COMMLIB_NCCL_EMULATOR=1), not on GPUs",
            file=sys.stderr,
            flush=True,
        )
    return nccl.NcclBackend(module, cuda, xp, comm, host, meeting, everyone)


class StoreMeeting:
    """:meth:`Backend.rendezvous` through a store: for communicators with no transport of their own to meet over.

    NCCL without MPI: new groups' unique ids and monitored barriers go through the job's store.
    Each meeting of the same ranks for the same purpose gets keys of its own (every member counts
    them alike, since every member takes part in each).
    """

    def __init__(self, store: Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.held: collections.Counter[str] = collections.Counter()

    def rendezvous(self, ranks: list[int], timeout: float, payload: bytes = b"", what: str = "group setup") -> bytes:
        """Meet the other ``ranks`` (global ranks); return ``ranks[0]``'s ``payload``."""
        topic = f"meet/{what}/{','.join(map(str, ranks))}"
        key = f"{topic}/{self.held[topic]}"
        self.held[topic] += 1
        self.store.set(f"{key}/arrived/{self.rank}", b"1")
        if self.rank != ranks[0]:
            try:
                self.store.wait([f"{key}/payload"], timeout)
            except CommTimeoutError:
                text = f"rank {ranks[0]} did not answer within {timeout:g} s ({what} of ranks {ranks})"
                raise MeetingTimeout(text) from None
            return self.store.get(f"{key}/payload")
        try:
            self.store.wait([f"{key}/arrived/{r}" for r in ranks], timeout)
        except CommTimeoutError:
            missing = [r for r in ranks if not self.store.check([f"{key}/arrived/{r}"])]
            text = f"ranks {missing} did not arrive within {timeout:g} s ({what} of ranks {ranks})"
            raise MeetingTimeout(text, missing) from None
        self.store.set(f"{key}/payload", payload)
        return payload
