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
from datetime import timedelta
from typing import Any

from commlib._environment import LaunchInfo, detect, mpi_launched
from commlib._group import ProcessGroup
from commlib._settings import value as setting
from commlib.backends import Place, Spec, launched_world
from commlib.backends.base import Backend, MeetingTimeout
from commlib.errors import BackendUnavailableError, CommError, CommTimeoutError
from commlib.store import FileStore, PrefixStore, Store, TCPStore, as_store

__all__ = ["StoreMeeting", "make_world", "rendezvous_store"]

_worlds = itertools.count()  # worlds this process formed: keeps each one's keys apart in a shared store


def make_world(
    spec: Spec, timeout: float, world_size: int, rank: int, init_method: str, store: Any
) -> tuple[ProcessGroup, Store | None]:
    """The default group of backend ``spec``, and the store to close when the group is destroyed (if any).

    The ranks meet over the MPI world where an MPI launcher started them, else through the job's store; the
    backend's own ``world(place)`` makes its communicator from there (``commlib.backends``), and the job's
    diagnostics (the monitor store, the uncaught-exception hook) are set up on whatever connects the ranks.
    """
    info = place(world_size, rank)
    _skip_the_last_collection()
    why = spec.unavailable()  # fail early, before any communication, when the backend cannot run here
    if why is not None:
        raise BackendUnavailableError(f"init_process_group: {why}")
    if mpi_launched() or (info.world_size == 1 and store is None):
        mpi = launched_world(info, timeout, functools.partial(rendezvous_store, init_method, info, timeout))
        atexit.register(mpi.close)  # its operations freed before MPI finalizes (after the closing checks, made later)
        backend = spec.world(Place(info.rank, info.world_size, info.local_rank, timeout, mpi, None, mpi))
        diagnose(mpi, timeout, None, mpi.terminate)
        return _group(backend, timeout), None
    shared, owned = _job_store(store, init_method, info, timeout)
    meeting = StoreMeeting(shared, info.rank)
    try:
        backend = spec.world(Place(info.rank, info.world_size, info.local_rank, timeout, meeting, shared))
    except CommTimeoutError as e:
        if owned is not None:
            owned.close()
        raise CommTimeoutError(f"init_process_group: rank {info.rank} ({_who(info)}): {e}") from None
    except RuntimeError as e:
        if owned is not None:
            owned.close()
        if isinstance(e, CommError):
            raise
        raise BackendUnavailableError(f"init_process_group: rank {info.rank} ({_who(info)}): {e}") from None
    diagnose(backend, timeout, shared, backend.terminate)
    return _group(backend, timeout), owned


def diagnose(backend: Backend, timeout: float, store: Store | None, terminate: Any, attach: bool = False) -> None:
    """The job's diagnostics on ``backend`` (what connects every rank): the monitor store (``store``, the job's,
    or one world rank 0 serves; ``attach``: a newcomer found it already), the uncaught-exception hook (ending the
    job with ``terminate`` where the engine can), the flight recorder's signal."""
    from commlib._diagnostics import abort, flight, watchdog

    watchdog.setup(backend, timeout, store, attached=attach)
    if backend.size > 1:
        abort.install_excepthook(terminate, backend.rank, backend.size)
    flight.install_signal()


def joining_store(given: Any, init_method: str, timeout: float) -> Store:
    """A newcomer's view of the running job's store (``commlib.grow_group``): the store its ranks met through
    (``given``, or the one ``init_method`` names, as a client), under the prefix of their first world."""
    info = detect()
    base = as_store(given) if given is not None else rendezvous_store(init_method, info, timeout, serve=False)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"commlib/{run}/{attempt}/world0", base)


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


def _job_store(given: Any, init_method: str, info: LaunchInfo, timeout: float) -> tuple[Store, Store | None]:
    """The store every rank of this job shares (its keys under a prefix of their own for this world), and
    the store to close with the world: the one commlib opened, never one the caller gave."""
    owned: Store | None = None
    if given is not None:
        base = as_store(given)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and init_method == "env://":
        base = owned = _torchrun_store(info, timeout)
    else:
        # rank 0 serves the store, unless the launcher does (it outlives any rank: --on-failure continue/replace)
        base = owned = rendezvous_store(init_method, info, timeout, serve=not setting("COMMLIB_STORE_SERVED"))
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
    """The store named by ``init_method``: ``tcp://host:port``, ``file:///path``, or ``env://`` (MASTER_ADDR/PORT;
    under ``commlib.launch`` serving the job's store, the address it gives in ``COMMLIB_STORE_SERVED``).

    ``serve``: rank 0 serves a TCP store itself (else it is a client of one served elsewhere, e.g. by
    node 0's ``commlib.launch``).
    """
    token = setting("COMMLIB_STORE_TOKEN") or None
    if init_method.startswith("file://"):
        return FileStore(init_method[len("file://") :], info.world_size)
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"init_process_group: init_method must look like tcp://host:port, got {init_method!r}")
        address = (host.strip("[]"), int(port))
    elif served := setting("COMMLIB_STORE_SERVED"):  # commlib.launch's, beside MASTER_PORT
        host, _, port = served.rpartition(":")
        address, serve = (host.strip("[]"), int(port)), False
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
