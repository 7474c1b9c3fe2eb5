"""The default group: initialisation (explicit or implicit), sub-groups, rank queries, teardown."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
from typing import Any

from commlib._environment import LaunchInfo, detect
from commlib._group import ProcessGroup
from commlib._rendezvous import make_world
from commlib._settings import current
from commlib._settings import value as setting
from commlib._timeouts import as_seconds
from commlib.backends import REPORTED, Spec, choose
from commlib.backends import base as _base
from commlib.backends.base import Backend
from commlib.errors import CollectiveMismatchError, CommTimeoutError

__all__ = [
    "GroupMember",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_initialized",
    "is_torchelastic_launched",
    "launch_info",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "resolve",
]

_INIT_SCHEMES = ("env://", "tcp://", "file://")


class _State:
    __slots__ = ("asked", "by_ranks", "destroyed", "groups", "implicit", "info", "made", "store", "world")

    def __init__(self) -> None:
        self.world: ProcessGroup | None = None
        self.implicit = False  # the world was created by the first API call, not by init_process_group
        self.groups: list[ProcessGroup] = []
        self.by_ranks: dict[tuple[int, ...], ProcessGroup] = {}  # subgroup()'s cache, cleared with the world
        self.store: Any = None  # the rendezvous store the world keeps using (served by rank 0 when it made it)
        self.info: LaunchInfo | None = None
        self.made = 0  # groups made by every rank since the default group was
        self.asked: str | None = None  # the name get_backend() says instead of the engine's ("gloo", a registered one)
        self.destroyed = False  # destroy_process_group() ended the default group: no implicit joining after it


_state = _State()


def launch_info() -> LaunchInfo:
    """This process's place in the job, as the launcher's environment describes it (cached)."""
    if _state.info is None:
        _state.info = detect()
    return _state.info


def _default_timeout(spec: Spec) -> float:
    seconds = current("COMMLIB_TIMEOUT")  # read when a default group is made (a program may set it before)
    return spec.timeout if seconds is None else seconds


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
    spec = choose(backend)
    if init_method is not None and not str(init_method).startswith(_INIT_SCHEMES):
        raise ValueError(
            f"init_process_group: init_method must start with env://, tcp:// or file://, got {init_method!r}"
        )
    seconds = _default_timeout(spec) if timeout is None else as_seconds(timeout, "init_process_group")
    world, owned = _state.world, None
    if world is None and setting("COMMLIB_JOIN"):  # a newcomer to a running job (commlib.grow_group)
        world = _join(spec, seconds, store, init_method or "env://")
        _check_at_exit()
    elif world is None:
        world, owned = make_world(spec, seconds, world_size, rank, init_method or "env://", store)
        _check_at_exit()
        _watch(world)
    try:
        _check_explicit(world, world_size, rank)  # before anything is recorded: a refused call changes nothing
    except ValueError:
        if owned is not None:
            owned.close()
        raise
    if _state.world is None:
        _state.store = owned
    world.timeout = seconds
    _state.world, _state.implicit, _state.destroyed = world, False, False
    # the name get_backend() reports as torch's does: "gloo" (run on the mpi engine), a registered backend's own
    given = backend.lower() if isinstance(backend, str) else None
    _state.asked = given if given in REPORTED else spec.name if spec.name != world.backend_name else None
    if world not in _state.groups:
        _state.groups.insert(0, world)


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


def resolve(group: ProcessGroup | None, call: str) -> tuple[ProcessGroup, Backend]:
    """The group a call runs on (``group``, or the default group, initialised on first use) and its backend.

    Raises what :meth:`ProcessGroup.refuse` says for a group that cannot take the call.
    """
    g = _state.world if group is None else group
    if g is None:
        g = _implicit_world(call)
    elif type(g) is not ProcessGroup:
        raise TypeError(
            f"{label()}{call}: group must be a ProcessGroup from commlib.new_group() or None, got {group!r}"
        )
    if g.broken is not None or g.backend is None:
        g.refuse(call)
    return g, g.backend


def _implicit_world(call: str = "") -> ProcessGroup:
    """The default group made by a program's first call; after destroy_process_group(), torch's ValueError."""
    if _state.destroyed:
        raise ValueError(
            f"{call or 'commlib'}: the default process group was destroyed by destroy_process_group(); call "
            "init_process_group() to make a new one (as in torch.distributed, a call after destroy_process_group() "
            "does not join the job again: only a program's first call does)"
        )
    spec = choose(None)
    _state.world, _state.store = make_world(spec, _default_timeout(spec), -1, -1, "env://", None)
    _check_at_exit()
    _watch(_state.world)
    _state.implicit, _state.groups = True, [_state.world]
    return _state.world


def is_initialized() -> bool:
    """True once the default group exists (explicitly or by a first API call)."""
    return _state.world is not None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Tear down ``group``, or every group including the default one when ``group`` is None.

    Tearing down the default group first runs every group's closing check (:meth:`ProcessGroup.close`: the
    ranks made the same number of collectives, and every message sent was received), as the program's end
    does; a check that fails raises ``CollectiveMismatchError`` once everything is torn down.
    """
    everything = group is None or group is _state.world
    error = _close_all() if everything else None
    targets = list(_state.groups) if group is None else [group]
    for g in targets:
        if g.backend is not None and g.broken is None and (g is not _state.world or g.backend.goodbye):
            g.backend.close()
        g.backend, g.ready = None, None
        if g in _state.groups:
            _state.groups.remove(g)
    _state.by_ranks = {r: g for r, g in _state.by_ranks.items() if g not in targets}
    if everything:
        _recovery_stop()
        _base.watchdog = None  # the slow path of a world that is gone (its store, its failures) reads nothing more
        store, _state.store = _state.store, None
        _state.destroyed = _state.destroyed or _state.world is not None
        _state.world, _state.implicit, _state.groups, _state.by_ranks, _state.asked = None, False, [], {}, None
        _state.made = 0
        if store is not None:
            store.close()
    if error is not None:
        raise error


def _watch(world: ProcessGroup) -> None:
    import commlib._recovery as _recovery  # the group layer above this module: it reads the groups kept here

    _recovery.watch(world)


def _join(spec: Spec, seconds: float, store: Any, init_method: str) -> ProcessGroup:
    import commlib._recovery as _recovery

    return _recovery.join(spec, seconds, store, init_method)


def _recovery_stop() -> None:
    import commlib._recovery as _recovery

    _recovery.stop()


def _close_all() -> BaseException | None:
    """Every live group's closing check, in creation order (the default group last); the first error."""
    first = None
    groups = [g for g in _state.groups if g is not _state.world] + [g for g in _state.groups if g is _state.world]
    for g in groups:
        try:
            g.close(g.timeout)
        except Exception as e:
            first = first or e
    return first


@functools.cache
def _check_at_exit() -> None:
    """Run the closing checks when the program ends (registered after mpi4py's own exit handler, so before MPI
    is finalized). A check that fails is reported as an uncaught exception would be (the job is aborted where
    commlib's hook is installed) and the process exits with status 1: never 0."""
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    from commlib._diagnostics import abort

    if _state.world is None or abort.raised_uncaught():  # an uncaught exception is the report: none on top
        return
    error = _close_all()
    if error is None:
        closed: set[int] = set()
        for g in _state.groups:  # communicators whose peers must read this rank's end as a goodbye, not a death
            if g.backend is not None and g.broken is None and g.backend.goodbye and id(g.backend) not in closed:
                closed.add(id(g.backend))
                with contextlib.suppress(Exception):
                    g.backend.close()
        _recovery_stop()  # a goodbye on the lifelines: the others see this rank left, not died
        return
    sys.stdout.flush()
    sys.excepthook(type(error), error, error.__traceback__)
    sys.stderr.flush()
    os._exit(1)


def subgroup(ranks: Any) -> ProcessGroup:
    """The group of ``ranks`` (global ranks, in that order): the default group for all ranks in order,
    else made by ``new_group(ranks, sort_ranks=False)`` on first use and cached.

    The first use is collective over the default group, as ``new_group`` is: every rank asks for
    the same ranks in the same order. ``destroy_process_group()`` clears the cache.
    """
    world, _ = resolve(None, "subgroup")
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
    world, engine = resolve(None, "new_group")
    members = _check_ranks(world, ranks)
    if sort_ranks:
        members = sorted(members)
    if backend is not None and choose(backend).name != world.backend_name:
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
    sub: Backend | None
    try:
        if use_local_synchronization:
            sub = engine.create_group(members, world.timeout)
        else:
            sub = engine.split(members, world.timeout)
    except CommTimeoutError as e:
        if not use_local_synchronization:  # a missing member leaves the world's collective half-done
            world.mark_broken(e)
        raise CommTimeoutError(f"{world.label}new_group: {e}") from None
    except CollectiveMismatchError as e:  # found by every rank alike, before any communicator was made
        raise CollectiveMismatchError(f"{world.label}new_group: {e}") from None
    name = group_desc or _group_name(members, use_local_synchronization)
    rank = members.index(world.rank) if sub is not None else -1
    g = ProcessGroup(sub, members, rank, name, seconds, world.label)
    _state.groups.append(g)
    return g


def _group_name(members: list[int], local: bool) -> str:
    """A name every member agrees on: the creation count (all ranks create every group), or, when only the
    members create it, its ranks and how many groups of the same ranks exist already."""
    if not local:  # the creation count since the default group was made (destroyed groups count: names stay unique)
        _state.made += 1
        return f"group{_state.made}"
    twins = sum(1 for g in _state.groups if g.ranks == members)
    return f"group{members}" + (f"#{twins}" if twins else "")


def _check_ranks(world: ProcessGroup, ranks: Any, call: str = "new_group") -> list[int]:
    if ranks is None:
        return list(range(world.size))
    if not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"{world.label}{call}: ranks must be a list of ints, got {ranks!r}")
    out = list(ranks)
    bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world.size]
    if bad:
        raise ValueError(f"{world.label}{call}: ranks must be in [0, {world.size}), got {bad} in {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"{world.label}{call}: ranks must not repeat, got {out}")
    if not out:
        raise ValueError(f"{world.label}{call}: ranks must not be empty")
    return out


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when it is not a member."""
    g = _state.world if group is None else group
    return (g or _implicit_world("get_rank")).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 when this process is not a member."""
    g = (_state.world if group is None else group) or _implicit_world("get_world_size")
    return g.size if g.rank >= 0 else -1


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend name of ``group`` as torch reports it: the name init_process_group was given (``"gloo"``,
    ``"mpi"``, ``"nccl"``), else the engine's (``"mpi"`` or ``"nccl"``); ``"gloo"`` runs on the mpi engine."""
    g = (_state.world if group is None else group) or _implicit_world("get_backend")
    return _state.asked or g.backend_name


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """Translate a rank of ``group`` into a global rank."""
    return group.ranks[group.check_group_rank(group_rank, "get_global_rank", "group_rank")]


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """Translate a global rank into its rank in ``group``; ``ValueError`` when it is not a member."""
    return group.group_rank(global_rank, "get_group_rank", "global_rank")


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (default: the world), in group-rank order."""
    g = (_state.world if group is None else group) or _implicit_world("get_process_group_ranks")
    return list(g.ranks)


class _WorldMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:  # torch's name
        """The default group; None before it exists (as torch's ``group.WORLD``)."""
        return _state.world


class group(metaclass=_WorldMeta):  # torch's name
    """torch's ``dist.group``: ``group.WORLD`` is the default group (None before it exists)."""


class _NonGroupMember:
    """torch's ``GroupMember.NON_GROUP_MEMBER``, compared with ``==``/``!=``: equal to a group this rank is not
    in. torch's :func:`new_group` returns that constant on such a rank; commlib's returns a group whose
    :func:`get_rank` is -1 (as torch's ``get_rank`` of a group one is not in), so ``group ==
    GroupMember.NON_GROUP_MEMBER`` reads the same under either (an ``is`` test cannot)."""

    __hash__ = object.__hash__  # for == and != only: a set or dict of groups does not find it

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, ProcessGroup):
            return other.rank < 0
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember(metaclass=_WorldMeta):
    """torch's ``dist.GroupMember``: ``GroupMember.WORLD`` is the default group (None before it exists);
    ``GroupMember.NON_GROUP_MEMBER`` equals (``==``) a group this rank is not in."""

    NON_GROUP_MEMBER = _NonGroupMember()


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Any = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Split ``group`` (default: the default group) into groups of ``group_size`` consecutive ranks, in its
    rank order; every rank of the default group calls it (each group is a :func:`new_group`).

    ``group_size=None``: one group per node (the launcher's ranks per node). Returns this rank's group and
    all of them, as torch's; on a rank outside ``group`` its group is None (torch's refuses such a rank).
    """
    world, _ = resolve(None, "new_subgroups")
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"{world.label}new_subgroups: group must be a group or None, got {group!r}")
    ranks = list(world.ranks if group is None else group.ranks)
    size = launch_info().local_world_size if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= len(ranks) or len(ranks) % size:
        raise ValueError(
            f"{world.label}new_subgroups: group_size must be a positive int that divides the "
            f"{'world' if group is None else 'group'} size ({len(ranks)}), got {group_size!r}"
            + (f" (ranks per node: {size})" if group_size is None else "")
        )
    lists = [ranks[first : first + size] for first in range(0, len(ranks), size)]
    return _enumerated(lists, timeout, backend, pg_options, group_desc)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: list[list[int]],
    timeout: Any = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """A group for each list of global ranks in ``ranks_per_subgroup_list``; no rank may be in two, a rank
    may be in none. Every rank of the default group calls it (each group is a :func:`new_group`); every
    list is checked before any group is made. Returns this rank's group (None if it is in none) and all
    of them, as torch's.
    """
    call = "new_subgroups_by_enumeration"
    world, _ = resolve(None, call)
    if not isinstance(ranks_per_subgroup_list, (list, tuple)) or not ranks_per_subgroup_list:
        raise ValueError(
            f"{world.label}{call}: ranks_per_subgroup_list must be a non-empty list of lists of ranks, "
            f"got {ranks_per_subgroup_list!r}"
        )
    lists = [_check_ranks(world, ranks, call) for ranks in ranks_per_subgroup_list]
    seen: dict[int, list[int]] = {}
    for ranks in lists:
        for r in ranks:
            if r in seen:
                raise ValueError(f"{world.label}{call}: rank {r} is in two subgroups, {seen[r]} and {ranks}")
            seen[r] = ranks
    return _enumerated(lists, timeout, backend, pg_options, group_desc)


def _enumerated(
    lists: list[list[int]], timeout: Any, backend: str | None, pg_options: Any, desc: str | None
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """A :func:`new_group` per list (named ``desc_i`` when ``desc`` is given); this rank's, and all."""
    groups = [
        new_group(ranks, timeout, backend, pg_options, group_desc=None if desc is None else f"{desc}_{i}")
        for i, ranks in enumerate(lists)
    ]
    return next((g for g in groups if g.rank >= 0), None), groups


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun), else the launcher's (mpiexec, srun).

    With neither, ``fallback_rank`` if given, else ``RuntimeError``, as torch's.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    info = launch_info()
    if info.source != "single":
        return info.local_rank
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "get_node_local_rank: LOCAL_RANK is not set and no launcher (torchrun, mpiexec, srun, "
        "python -m commlib.launch) started this process; pass fallback_rank= to run without one"
    )


def is_torchelastic_launched() -> bool:
    """True when torchrun (torch.distributed.elastic) started this process (``TORCHELASTIC_RUN_ID`` is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None
