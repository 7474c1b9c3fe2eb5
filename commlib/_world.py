"""The default group: initialisation (explicit or implicit), sub-groups, rank queries, teardown."""

from __future__ import annotations

import os
from typing import Any

from commlib._environment import LaunchInfo, detect
from commlib._group import ProcessGroup
from commlib._timeouts import as_seconds
from commlib.errors import BackendUnavailableError, CommTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "launch_info",
    "new_group",
    "resolve",
]

#: torch's defaults: 10 minutes for nccl, 30 minutes for everything else (seconds).
DEFAULT_TIMEOUT = {"nccl": 600.0, "mpi": 1800.0}
_BACKEND_ALIASES = {"mpi": "mpi", "gloo": "mpi", "cpu": "mpi", "nccl": "nccl"}
_INIT_SCHEMES = ("env://", "tcp://", "file://")


class _State:
    def __init__(self) -> None:
        self.world: ProcessGroup | None = None
        self.implicit = False  # the world was created by the first API call, not by init_process_group
        self.groups: list[ProcessGroup] = []
        self.by_ranks: dict[tuple[int, ...], ProcessGroup] = {}  # subgroup()'s cache, cleared with the world
        self.info: LaunchInfo | None = None


_state = _State()


def launch_info() -> LaunchInfo:
    """This process's place in the job, as the launcher's environment describes it (cached)."""
    if _state.info is None:
        _state.info = detect()
    return _state.info


def emulated() -> bool:
    """True when ``COMMLIB_NCCL_EMULATOR`` selects the CPU emulator for the nccl backend."""
    return os.environ.get("COMMLIB_NCCL_EMULATOR", "") not in ("", "0")


def _choose_backend(backend: str | None) -> str:
    if backend is None or str(backend).lower() == "auto":
        from commlib.backends.nccl import nccl_unavailable_reason

        return "nccl" if emulated() or nccl_unavailable_reason() is None else "mpi"
    if not isinstance(backend, str) or backend.lower() not in _BACKEND_ALIASES:
        raise ValueError(f"init_process_group: backend must be one of 'mpi', 'gloo', 'nccl', 'auto', got {backend!r}")
    return _BACKEND_ALIASES[backend.lower()]


def _default_timeout(name: str) -> float:
    env = os.environ.get("COMMLIB_TIMEOUT")
    return as_seconds(float(env), "COMMLIB_TIMEOUT") if env else DEFAULT_TIMEOUT[name]


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Join the job's default group (torch.distributed's signature; every argument may be left out).

    Rank and world size come from the launcher (mpiexec, srun, commlib.launch,
    torchrun variables); explicit ``rank``/``world_size`` must agree with it.
    ``timeout`` (timedelta or seconds) bounds every blocking call on the group;
    the default is 30 minutes, or ``COMMLIB_TIMEOUT`` seconds when set.
    """
    if _state.world is not None and not _state.implicit:
        raise RuntimeError(
            "init_process_group: the default group is already initialised; call destroy_process_group() first"
        )
    name = _choose_backend(backend)
    if init_method is not None and not str(init_method).startswith(_INIT_SCHEMES):
        raise ValueError(
            f"init_process_group: init_method must start with env://, tcp:// or file://, got {init_method!r}"
        )
    seconds = _default_timeout(name) if timeout is None else as_seconds(timeout, "init_process_group")
    world = _state.world or _make_world(name, seconds, world_size, rank, init_method or "env://")
    _check_explicit(world, world_size, rank)  # before anything is recorded: a refused call changes nothing
    world.timeout = seconds
    _state.world, _state.implicit = world, False
    if world not in _state.groups:
        _state.groups.insert(0, world)


def _make_world(
    name: str, timeout: float, world_size: int = -1, rank: int = -1, init_method: str = "env://"
) -> ProcessGroup:
    from commlib.backends import mpi

    if name == "nccl":
        from commlib.backends import nccl

        nccl.load(emulated())  # fail early, before any communication, when NCCL cannot run here
    info = launch_info()
    backend = mpi.world()
    if backend.size < info.world_size and info.num_nodes > 1 and backend.size == info.local_world_size:
        backend = _join_nodes(backend, info, timeout, init_method)
    if backend.size == 1 and max(info.world_size, world_size) > 1:
        expected = max(info.world_size, world_size)
        raise BackendUnavailableError(
            f"init_process_group: the environment ({info.source}) says this is rank {info.rank} of {expected}, "
            "but MPI sees a single process: the mpi backend needs its ranks started by an MPI launcher, e.g. "
            f"`mpiexec -n {expected} python script.py` or "
            f"`python -m commlib.launch --nproc_per_node {expected} script.py`"
        )
    if name == "mpi":
        backend.separate_kinds(timeout)  # mismatched kinds of call wait (and time out) instead of pairing up
    _watch(backend, timeout)
    if name == "nccl":
        backend = _nccl_world(backend, info, timeout)
    return ProcessGroup(
        backend, list(range(backend.size)), backend.rank, "world", timeout, f"[rank {backend.rank}/{backend.size}] "
    )


def _watch(backend: Any, timeout: float) -> None:
    """Start the job monitor and the flight recorder's SIGUSR1 dump; report uncaught exceptions before MPI_Abort."""
    from commlib._diagnostics import flight as _flight
    from commlib._diagnostics import monitor as _monitor
    from commlib.backends import mpi

    _monitor.setup(backend, timeout)
    _flight.install_signal()
    if _monitor.report_uncaught not in mpi.before_abort:
        mpi.before_abort.append(_monitor.report_uncaught)


def rendezvous_store(init_method: str, info: LaunchInfo, timeout: float) -> Any:
    """The store named by ``init_method``: ``tcp://host:port``, ``file:///path``, or ``env://`` (MASTER_ADDR/PORT)."""
    from commlib.store import FileStore, TCPStore

    token = os.environ.get("COMMLIB_STORE_TOKEN")
    if init_method.startswith("file://"):
        return FileStore(init_method[len("file://") :], info.world_size)
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"init_process_group: init_method must look like tcp://host:port, got {init_method!r}")
        return TCPStore(host.strip("[]"), int(port), timeout=timeout, token=token)
    if not info.master_addr or not info.master_port:
        raise BackendUnavailableError(
            "init_process_group: joining nodes needs MASTER_ADDR and MASTER_PORT (env://), or init_method="
            "'tcp://host:port' or 'file:///shared/path'"
        )
    return TCPStore(info.master_addr, info.master_port, timeout=timeout, token=token)


def _join_nodes(local: Any, info: LaunchInfo, timeout: float, init_method: str) -> Any:
    """One MPI communicator out of the per-node MPI worlds (``commlib.launch --nnodes N``)."""
    from commlib.backends import mpi

    store = rendezvous_store(init_method, info, timeout)
    try:
        return mpi.join_nodes(local, info.node_rank, info.num_nodes, info.rank, store, timeout)
    finally:
        store.close()


def _nccl_world(host_world: Any, info: LaunchInfo, timeout: float) -> Any:
    """The NCCL communicator of the job; its unique id travels from rank 0 over the MPI world."""
    import sys

    from commlib.backends import nccl

    module, cuda, xp, host = nccl.load(emulated())
    if not host:  # one process per GPU, unless the caller already chose one
        cuda.Device(info.local_rank % cuda.runtime.getDeviceCount()).use()
    everyone = list(range(host_world.size))
    uid = nccl.unique_id(module) if host_world.rank == 0 else b""
    try:
        uid = host_world.rendezvous(everyone, timeout, uid, what="the NCCL world's unique id")
    except CommTimeoutError as e:
        raise CommTimeoutError(f"init_process_group: {e}") from None
    comm = module.NcclCommunicator(host_world.size, uid, host_world.rank)
    if host and host_world.rank == 0:
        print(
            "commlib: backend 'nccl' is running on the NCCL emulator (CPU, host memory; "
            "COMMLIB_NCCL_EMULATOR=1), not on GPUs",
            file=sys.stderr,
            flush=True,
        )
    return nccl.NcclBackend(module, cuda, xp, comm, host, host_world, everyone)


def _check_explicit(world: ProcessGroup, world_size: int, rank: int) -> None:
    if world_size not in (-1, None) and world_size != world.size:
        raise ValueError(f"init_process_group: world_size={world_size}, but the job has {world.size} ranks")
    if rank not in (-1, None) and rank != world.rank:
        raise ValueError(f"init_process_group: rank={rank}, but the launcher made this process rank {world.rank}")


def label() -> str:
    """The default group's message prefix ("[rank 2/4] ") for a caller's error, joining the job if needed
    (as the call would have); "" when there is no job to join."""
    if _state.world is None:
        try:
            _implicit_world()
        except Exception:  # the caller's own error is the one to report
            return ""
    return _state.world.label if _state.world is not None else ""


def resolve(group: ProcessGroup | None, call: str) -> ProcessGroup:
    """The group a call runs on: ``group``, or the default group (initialised on first use)."""
    g = _state.world if group is None else group
    if g is None:
        g = _implicit_world()
    elif type(g) is not ProcessGroup:
        raise TypeError(
            f"{label()}{call}: group must be a ProcessGroup from commlib.new_group() or None, got {group!r}"
        )
    if g.broken is not None or g.backend is None:
        g.refuse(call)
    return g


def _implicit_world() -> ProcessGroup:
    name = _choose_backend(None)
    _state.world = _make_world(name, _default_timeout(name))
    _state.implicit, _state.groups = True, [_state.world]
    return _state.world


def is_initialized() -> bool:
    """True once the default group exists (explicitly or by a first API call)."""
    return _state.world is not None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Tear down ``group``, or every group including the default one when ``group`` is None."""
    targets = list(_state.groups) if group is None else [group]
    for g in targets:
        if g.backend is not None and g.broken is None and g is not _state.world:
            g.backend.close()
        g.backend = g.fast_all_reduce = None
        if g in _state.groups:
            _state.groups.remove(g)
    _state.by_ranks = {r: g for r, g in _state.by_ranks.items() if g not in targets}
    if group is None or group is _state.world:
        _state.world, _state.implicit, _state.groups, _state.by_ranks = None, False, [], {}


def subgroup(ranks: Any) -> ProcessGroup:
    """The group of ``ranks`` (global ranks, in that order): the default group for all ranks in order,
    else made by ``new_group(ranks, sort_ranks=False)`` on first use and cached.

    The first use is collective over the default group, as ``new_group`` is: every rank asks for
    the same ranks in the same order. ``destroy_process_group()`` clears the cache.
    """
    world = resolve(None, "subgroup")
    key = tuple(_check_ranks(world, ranks))
    if key == tuple(range(world.size)):
        return world
    if key not in _state.by_ranks:
        _state.by_ranks[key] = new_group(list(key), sort_ranks=False)
    return _state.by_ranks[key]


def new_group(
    ranks: list[int] | None = None,
    timeout: Any = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup:
    """Create a sub-group of the default group; every rank must call it with the same ``ranks``.

    With ``use_local_synchronization=True`` (as torch's flag) only the members of ``ranks`` call it.
    """
    world = resolve(None, "new_group")
    members = _check_ranks(world, ranks)
    if sort_ranks:
        members = sorted(members)
    if backend is not None and _choose_backend(backend) != world.backend_name:
        raise ValueError(
            f"{world.label}new_group: backend={backend!r} differs from the default group's "
            f"{world.backend_name!r}; groups use the default group's backend"
        )
    seconds = world.timeout if timeout is None else as_seconds(timeout, f"{world.label}new_group")
    if use_local_synchronization and world.rank not in members:
        raise ValueError(
            f"{world.label}new_group: with use_local_synchronization=True only the members of ranks={members} "
            f"call new_group, and this rank ({world.rank}) is not one"
        )
    try:
        if use_local_synchronization:
            sub = world.backend.create_group(members, world.timeout)
        else:
            sub = world.backend.split(members, world.timeout)
    except CommTimeoutError as e:
        if not use_local_synchronization:  # a missing member leaves the world's collective half-done
            world.mark_broken(e)
        raise CommTimeoutError(f"{world.label}new_group: {e}") from None
    name = group_desc or _group_name(members, use_local_synchronization)
    rank = members.index(world.rank) if sub is not None else -1
    g = ProcessGroup(sub, members, rank, name, seconds, world.label)
    _state.groups.append(g)
    return g


def _group_name(members: list[int], local: bool) -> str:
    """A name every member agrees on: the creation count (all ranks create every group), or, when only the
    members create it, its ranks and how many groups of the same ranks exist already."""
    if not local:
        return f"group{len(_state.groups)}"
    twins = sum(1 for g in _state.groups if g.ranks == members)
    return f"group{members}" + (f"#{twins}" if twins else "")


def _check_ranks(world: ProcessGroup, ranks: Any) -> list[int]:
    if ranks is None:
        return list(range(world.size))
    if not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"{world.label}new_group: ranks must be a list of ints, got {ranks!r}")
    out = list(ranks)
    bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world.size]
    if bad:
        raise ValueError(f"{world.label}new_group: ranks must be in [0, {world.size}), got {bad} in {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"{world.label}new_group: ranks must not repeat, got {out}")
    if not out:
        raise ValueError(f"{world.label}new_group: ranks must not be empty")
    return out


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when it is not a member."""
    g = _state.world if group is None else group
    return (g or _implicit_world()).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 when this process is not a member."""
    g = (_state.world if group is None else group) or _implicit_world()
    return g.size if g.rank >= 0 else -1


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend name of ``group`` (``"mpi"`` or ``"nccl"``)."""
    g = (_state.world if group is None else group) or _implicit_world()
    return g.backend_name


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """Translate a rank of ``group`` into a global rank."""
    return group.ranks[group.check_group_rank(group_rank, "get_global_rank", "group_rank")]


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """Translate a global rank into its rank in ``group``; ``ValueError`` when it is not a member."""
    return group.group_rank(global_rank, "get_group_rank", "global_rank")


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (default: the world), in group-rank order."""
    g = (_state.world if group is None else group) or _implicit_world()
    return list(g.ranks)
