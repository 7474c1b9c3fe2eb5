"""Recovery inside a running job: a rank dies, every survivor is told, the survivors agree and go on.

- When a world is made, its ranks connect their *lifelines* (``_diagnostics.lifelines``) through the job's
  store: a TCP connection between every two ranks, watched by one thread per process.
- A death (the end of a lifeline without a goodbye) fences off, at once and from that thread, every group the
  dead rank was in (``ProcessGroup.mark_failed``): a call waiting on such a group raises ``RankFailedError``
  on its slow path (within a second), a later call at its start; the error names the dead (``failed_ranks``).
- :func:`shrink_group` (torch's signature and semantics): the survivors agree on who is out
  (``_diagnostics.agreement``, over the lifelines: no store, no ULFM) and the backend makes their new
  communicator (``Backend.shrink``); shrinking the default group makes the result the new default group, its
  ranks renumbered, and ends every other group.
- :func:`grow_group`: the default group takes in the processes waiting to join it (started with
  ``COMMLIB_JOIN=1``: :func:`join`, from ``init_process_group``), which come after its ranks; they find the
  job through its store, as its ranks did.

A process is named on the lifelines by its *id*: its world rank when the job began; ``_state.ids`` maps the
current world's ranks to ids.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

import commlib._collectives as _collectives
import commlib._group as _group
import commlib._world as _world
from commlib._diagnostics import agreement, devicewatch, jobstore, lifelines, progress
from commlib._group import ProcessGroup
from commlib._settings import value as setting
from commlib._timeouts import as_seconds
from commlib.backends import Joining, Place, Spec
from commlib.backends.base import not_every_rank
from commlib.errors import CommError, CommTimeoutError, RankFailedError
from commlib.store import PrefixStore

__all__ = ["grow_group", "join", "shrink_group"]

_KEY = "commlib/life"  # the job store's keys of the lifelines' addresses
_GROW = "commlib/grow"  # the job store's keys of the processes waiting to join, and their answers
_ASK_GRACE = 5.0  # seconds between a newcomer's ticket and its question, beyond which it is passed over


class _State:
    def __init__(self) -> None:
        self.ids: list[int] = []  # the current world's ranks -> lifeline ids
        self.next_id = 0  # the id the next newcomer gets
        self.world_number = 0  # the job store's keys of this world's lifelines
        self.job = ""  # the lifelines' job name (a peer with another is a stranger)
        self.admitted = 0  # the join tickets taken in so far (grow_group)
        self.grown = 0  # how many times the world grew (each growth's keys apart)
        self.unasked: dict[int, float] = {}  # tickets taken without a question yet -> when first seen so
        self.worlds = itertools.count()  # worlds made by this process: each one's keys apart
        self.shrinks: dict[str, int] = {}  # group name -> how many times it was shrunk (the agreement's keys)
        self.why_not = "no world yet"  # why there are no lifelines (when there are none)


_state = _State()


# -- the lifelines of a new world -------------------------------------------------------------------------------
def watch(world: ProcessGroup) -> None:
    """At world creation, on every rank: connect the lifelines (through the job's store), and fence off the
    groups of any rank that dies from now on."""
    lifelines.stop()  # a new world: a new mesh (its keys and ids its own)
    _state.ids, _state.shrinks, _state.next_id = list(range(world.size)), {}, world.size
    _state.world_number = world_number = next(_state.worlds)
    _state.admitted = _state.grown = 0
    if world.size == 1:
        _state.why_not = "a world of one rank"
        return
    if not setting("COMMLIB_LIFELINES"):
        _state.why_not = "COMMLIB_LIFELINES=0"
        return
    if jobstore.dead() is not None:
        _state.why_not = f"no job store to connect them through ({jobstore.dead()})"
        return
    _state.job = f"{setting('COMMLIB_JOB_ID') or 'job'}/{world_number}"
    _connect(world.rank, list(range(world.rank)), list(range(world.size)), min(world.timeout, 60.0))


def _connect(me: int, earlier: list[int], everyone: list[int], timeout: float) -> None:
    """Start this process's lifelines as id ``me``, publish its address, connect to the ``earlier`` ids (each
    connects to the ones before it), and wait until every one of ``everyone`` is connected."""
    mesh = lifelines.start(me, _state.job, _changed)
    deadline = time.monotonic() + timeout
    prefix = f"{_KEY}/{_state.world_number}"
    jobstore.request("set", f"{prefix}/{me}", f"{jobstore.local_ip()}:{mesh.port}")
    if jobstore.dead() is not None:
        _give_up(mesh, f"the job store did not answer ({jobstore.dead()})")
        return
    for peer in earlier:
        address = _read(f"{prefix}/{peer}", deadline)
        try:
            if address is None:
                raise OSError("its address never came")
            mesh.connect(peer, address, max(0.1, deadline - time.monotonic()))
        except OSError as e:
            _give_up(mesh, f"process {peer} could not be reached ({e})")
            return
    missing = mesh.wait_for(everyone, max(0.0, deadline - time.monotonic()))
    if missing:
        _give_up(mesh, f"processes {missing} did not connect")
        return
    _state.why_not = ""


def _read(key: str, deadline: float) -> str | None:
    while time.monotonic() < deadline:
        value = jobstore.read(key)
        if value is not None:
            return value
        time.sleep(0.002)
    return None


def _give_up(mesh: lifelines.Lifelines, why: str) -> None:
    """No lifelines in this world (a rank could not be reached): deaths are seen as timeouts, as without them."""
    _state.why_not = why
    lifelines.stop()
    print(f"commlib: no lifelines between the ranks ({why}): a rank's death will be seen as a timeout", file=sys.stderr)


def stop() -> None:
    """The program ends, or the default group is destroyed: say goodbye (the others see this rank *left*); on
    the world's rank 0, which takes newcomers in, tell the ones still waiting that no one will."""
    world = _world._state.world
    if world is not None and world.rank == 0 and lifelines.current() is not None:
        jobstore.request("set", f"{_GROW}/closed", "1")
    lifelines.stop()


# -- a death ----------------------------------------------------------------------------------------------------
def _changed(peer_id: int, what: str, how: str) -> None:
    """The lifelines' thread: process ``peer_id`` died (or left). Fence off every group it was in."""
    if what != lifelines.DIED:
        return  # a rank that left ended its program after its closing checks: the groups are done with it
    mesh = lifelines.current()
    dead = set(mesh.failed()) if mesh is not None else {peer_id}
    ids, world = _state.ids, _world._state.world
    for g in list(_world._state.groups):
        if g.rank < 0 or g.backend is None:
            continue
        members = [ids[r] if r < len(ids) else -1 for r in g.ranks]
        if peer_id not in members:
            continue
        failed = [r for r, i in enumerate(members) if i in dead]
        who = ", ".join(f"rank {r} (global rank {g.ranks[r]})" for r in failed)
        detail = (
            f"{who} of group {g.name!r} died: {how}; the group cannot be used any more: the survivors can go on "
            f"without {'it' if len(failed) == 1 else 'them'} with commlib.shrink_group({failed}"
            + (")" if g is world else f", group={g.name!r})")
        )
        g.mark_failed(RankFailedError(detail, failed_ranks=failed, global_ranks=[g.ranks[r] for r in failed]))


_CALM = 0.02  # an engine's error: after this, members on this host whose lifelines are open are not dead


def _dead_members(g: ProcessGroup, wait: float, look: Any = None) -> CommError | None:
    """``g``'s RankFailedError once the lifelines say a member died, waiting up to ``wait`` s (an engine, such as
    NCCL, may report a dead peer before its lifeline's end is read); meanwhile, every 50 ms, ``look(g)``'s error
    if it finds one (ranks whose calls differ need no wait for a death). None at once (after :data:`_CALM` s)
    when every member is on this host with its lifeline open: none died."""
    mesh = lifelines.current()
    if mesh is None:
        return None
    ids = _state.ids
    members = [ids[r] if r < len(ids) else -1 for r in g.ranks]
    now = time.monotonic()
    deadline, look_at, calm_at = now + wait, now, now + _CALM
    while not isinstance(g.broken, RankFailedError):
        if look is not None and now >= look_at:
            found = look(g)
            if found is not None:
                return found
            look_at = now + 0.05
        if now >= deadline or (now >= calm_at and mesh.open_here(members)):
            return None
        time.sleep(0.005)
        now = time.monotonic()
    return g.broken


_group.dead_members = _dead_members


# -- shrink ---------------------------------------------------------------------------------------------------
def shrink_group(ranks_to_exclude: list[int], group: ProcessGroup | None = None) -> ProcessGroup:
    """The survivors' group: ``group`` (default: the default group) without ``ranks_to_exclude`` (its group
    ranks), called by the ranks that stay, alone (torch's ``shrink_group``).

    The survivors first agree on who is out: the ranks any of them asked to exclude, and every rank any of them
    knows to have died (a ``RankFailedError``'s ``failed_ranks``), whether or not this rank's list names it, so
    survivors that noticed different deaths still make one group. Shrinking the default group makes the result
    the new default group, its ranks renumbered in order, and destroys every other group (their ranks no longer
    mean the same); shrinking another group destroys that group. Raises ``RuntimeError`` on an excluded rank
    that calls it, ``CommTimeoutError`` when a survivor neither calls it nor dies within the group's timeout.
    """
    st = _world._state
    g = st.world if group is None else group
    call = "shrink_group"
    if g is None:
        raise ValueError(f"{call}: there is no default group to shrink (call init_process_group first)")
    if type(g) is not ProcessGroup:
        raise TypeError(f"{_world.label()}{call}: group must be a ProcessGroup or None, got {group!r}")
    label = g.label
    _check_exclusions(ranks_to_exclude, g, label)
    mesh = lifelines.current()
    if mesh is None:
        raise CommError(
            f"{label}{call}: this job has no lifelines ({_state.why_not}), so its ranks cannot agree on who failed"
        )
    backend = g.backend
    if backend is None:
        raise CommError(f"{label}{call}: group {g.name!r} has been destroyed")
    ids = [_state.ids[r] for r in g.ranks]
    count = _state.shrinks.get(g.name, 0)
    _state.shrinks[g.name] = count + 1
    exclude = {ids[r] for r in ranks_to_exclude}
    try:
        decision = agreement.agree(
            mesh, f"shrink {g.name} {count}", ids, exclude, g.timeout, lambda kept: backend.shrink_payload()
        )
    except agreement.Excluded as e:
        by = [ids.index(i) for i in e.by]
        raise RuntimeError(
            f"{label}{call}: this rank (rank {g.rank} of group {g.name!r}) is in ranks_to_exclude of ranks {by}: an "
            "excluded rank must not call shrink_group (it should end its process instead)"
        ) from None
    except CommTimeoutError as e:
        raise CommTimeoutError(f"{label}{call} on group {g.name!r}: {e}") from None
    keep = [r for r, i in enumerate(ids) if i in decision.kept]
    lost = [r for r, i in enumerate(ids) if i in decision.failed]
    if lost and (2 * len(keep) < len(ids) or (2 * len(keep) == len(ids) and 0 not in keep)):
        raise CommError(
            f"{label}{call} on group {g.name!r}: ranks {lost} are gone and only {keep} of its {len(ids)} ranks remain "
            "reachable; that may be a network partition, where the other side goes on too: the survivors go on only "
            "when they are more than half of the group, or half of it with its rank 0"
        )
    with _guard(mesh, decision.kept, f"{label}{call} on group {g.name!r}", g.timeout):
        new_backend = backend.shrink(keep, decision.attempt, g.timeout, decision.payload, bool(decision.failed))
    me = keep.index(g.rank)
    if g is st.world:  # the new default group; every other group ends
        _state.ids = [ids[r] for r in keep]
        progress.new_world()  # the new world's published keys are its own
        devicewatch.new_world()
        new = ProcessGroup(new_backend, list(range(len(keep))), me, g.name, g.timeout, f"[rank {me}/{len(keep)}] ")
        for old in st.groups:
            _end(old)
        st.world, st.groups, st.by_ranks, st.made = new, [new], {}, 0
        return new
    new = ProcessGroup(new_backend, [g.ranks[r] for r in keep], me, f"{g.name}-{count + 1}", g.timeout, label)
    _end(g)
    st.groups = [x for x in st.groups if x is not g] + [new]
    st.by_ranks = {r: x for r, x in st.by_ranks.items() if x is not g}
    return new


def _end(g: ProcessGroup) -> None:
    """A group shrink_group replaces: no closing check (its ranks are not all there), and its communicator is
    released only where every member lives (one a dead rank was in is kept for good: see Backend.abandon)."""
    if g.backend is not None and g.broken is None:
        with contextlib.suppress(Exception):
            g.backend.close()
    g.backend, g.ready = None, None


def _check_exclusions(ranks: Any, g: ProcessGroup, label: str) -> None:
    """torch's checks of ``ranks_to_exclude`` (a non-empty list of distinct group ranks, not all of them, not
    this rank's)."""
    call = "shrink_group"
    if not isinstance(ranks, list):
        raise TypeError(f"{label}{call}: ranks_to_exclude must be a list of group ranks, got {ranks!r}")
    if not ranks:
        raise ValueError(f"{label}{call}: ranks_to_exclude must not be empty (name the failed ranks)")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{label}{call}: ranks_to_exclude must hold ints, got {r!r} in {ranks}")
        if not 0 <= r < g.size:
            raise ValueError(f"{label}{call}: rank {r} in ranks_to_exclude is not in [0, {g.size}) (group {g.name!r})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{label}{call}: ranks_to_exclude has a rank twice: {ranks}")
    if len(ranks) >= g.size:
        raise ValueError(f"{label}{call}: ranks_to_exclude={ranks} excludes every rank of group {g.name!r}")
    if g.rank in ranks:
        raise RuntimeError(
            f"{label}{call}: this rank (rank {g.rank} of group {g.name!r}) is in ranks_to_exclude={ranks}: only the "
            "ranks that stay call shrink_group"
        )


@contextlib.contextmanager
def _guard(mesh: lifelines.Lifelines, kept: list[int], what: str, timeout: float) -> Any:
    """While the backend makes the survivors' communicator (a blocking call of the engine that no one can
    interrupt): should a kept rank die meanwhile, it would wait for good, so this process ends instead, saying
    why (exit status 1). The survivors confirmed each other alive just before: that window is milliseconds.
    Should the making outlast ``timeout`` (and the backend's own deadline, 2 s sooner) with every kept rank
    alive, the engine is stuck (see ``MpiBackend.shrink``): this process ends too, saying so."""
    done = threading.Event()
    due = time.monotonic() + timeout + 2.0

    def look() -> None:
        while not done.wait(0.05):
            dead = sorted(set(mesh.failed()) & set(kept))
            late = time.monotonic() > due
            if (dead or late) and not done.is_set():
                why = (
                    f"processes {dead} died while the survivors made their new communicator"
                    if dead
                    else not_every_rank("set up the communicator", timeout + 2.0)
                )
                print(
                    f"{what}: {why}, which the engine cannot cancel; this process ends (exit status 1)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=look, name="commlib-shrink-guard", daemon=True).start()
    try:
        yield
    finally:
        done.set()


# -- grow -----------------------------------------------------------------------------------------------------
def grow_group(
    group: ProcessGroup | None = None, timeout: Any = None, wait_for: int = 0, at_most: int | None = None
) -> ProcessGroup:
    """Take the processes waiting to join the job into the default group (collective over it); returns the
    default group: a new one, the newcomers ranked after its ranks, when any were waiting (every other group
    ends then, as after shrink_group), else the same one.

    ``wait_for=n``: wait until at least ``n`` processes are waiting to join (a replacement the launcher
    started: ``commlib.launch --on-failure replace``), at most ``timeout`` (the group's timeout by default;
    the wait ends a little before the group's own timeout), then take in those that came; ``0`` (the
    default) takes in only those already waiting, at the cost of one store read and two small broadcasts.
    ``at_most=n``: take in at most ``n`` (the first to ask); the others wait on (spares, ``--spares``)."""
    st = _world._state
    g = st.world
    call = "grow_group"
    if g is None:
        raise ValueError(f"{call}: there is no default group to grow (call init_process_group first)")
    if group is not None and group is not g:
        raise ValueError(f"{g.label}{call}: only the default group grows (newcomers join the job), got {group!r}")
    seconds = g.timeout if timeout is None else as_seconds(timeout, f"{g.label}{call}")
    if isinstance(wait_for, bool) or not isinstance(wait_for, int) or wait_for < 0:
        raise ValueError(f"{g.label}{call}: wait_for must be an int >= 0 (newcomers to wait for), got {wait_for!r}")
    if at_most is not None and (isinstance(at_most, bool) or not isinstance(at_most, int) or at_most < wait_for):
        raise ValueError(f"{g.label}{call}: at_most must be None or an int >= wait_for ({wait_for}), got {at_most!r}")
    backend = g.backend
    if g.broken is not None or backend is None:
        g.refuse(call)
    mesh = lifelines.current()
    # rank 0 decides who comes in (the tickets taken so far, in order, each with its question there)
    header = np.zeros(2, np.int64)
    text = b""
    if g.rank == 0 and mesh is not None:
        # the others wait in the broadcast below, which ends at the group's timeout: stop waiting before it
        deadline = time.monotonic() + min(seconds, 0.9 * g.timeout)
        while True:
            tickets = _waiting_tickets()
            if len(tickets) >= wait_for or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        tickets = tickets if at_most is None else tickets[:at_most]
        if tickets:
            text = json.dumps({"tickets": tickets, "payload": backend.grow_payload()}).encode()
        header[:] = (len(tickets), len(text))
    _collectives.broadcast(header, 0, group=g)
    if header[0] == 0:
        return g
    body = np.zeros(int(header[1]), np.uint8)
    if g.rank == 0:
        body[:] = np.frombuffer(text, np.uint8)
    _collectives.broadcast(body, 0, group=g)
    if mesh is None:
        raise CommError(f"{g.label}{call}: this job has no lifelines ({_state.why_not}): no process can join it")
    decision = json.loads(body.tobytes())
    tickets, payload = decision["tickets"], decision["payload"]
    k, n = len(tickets), g.size
    new_ids = list(range(_state.next_id, _state.next_id + k))
    ids = _state.ids + new_ids
    epoch = _state.grown  # taken even if this growth fails: its keys are never read again
    _state.admitted, _state.grown, _state.next_id = tickets[-1], epoch + 1, new_ids[-1] + 1
    number = progress.new_world()
    devicewatch.new_world(number)
    if g.rank == 0:
        for j, t in enumerate(tickets):
            answer = {
                "id": new_ids[j], "rank": n + j, "size": n + k, "nth": j, "newcomers": k, "ids": ids,
                "world": _state.world_number, "job": _state.job, "epoch": epoch, "progress": number,
                "timeout": g.timeout, "payload": payload,
            }  # fmt: skip
            jobstore.request("set", f"{_GROW}/answer/{t}", json.dumps(answer))
    store = PrefixStore(f"{_GROW}/{epoch}", _job_store(g, call))
    new_backend = backend.grow(k, store, seconds, payload)
    _state.ids = ids
    missing = mesh.wait_for(new_ids, seconds)
    if missing:
        raise CommTimeoutError(f"{g.label}{call}: newcomers {missing} joined MPI but not the lifelines")
    new = ProcessGroup(new_backend, list(range(n + k)), g.rank, g.name, g.timeout, f"[rank {g.rank}/{n + k}] ")
    for old in st.groups:
        old.backend, old.ready = None, None  # ended without a closing check (the communicator is kept for good)
    st.world, st.groups, st.by_ranks, st.made = new, [new], {}, 0
    return new


def _waiting_tickets() -> list[int]:
    """Rank 0: the tickets of the processes waiting to join, in order, each with its question there (a ticket
    whose question never came within ``_ASK_GRACE`` is passed over for good: it died)."""
    waiting = jobstore.request("add", f"{_GROW}/tickets", 0) or 0
    tickets = []
    for t in range(_state.admitted + 1, int(waiting) + 1):
        if jobstore.read(f"{_GROW}/ask/{t}") is not None:
            tickets.append(t)
        elif time.monotonic() - _state.unasked.setdefault(t, time.monotonic()) > _ASK_GRACE:
            _state.admitted = t
        else:
            break  # it took a ticket but has not asked yet: next time
    return tickets


def _job_store(g: ProcessGroup, call: str) -> Any:
    found = jobstore.store()
    if found is None:
        raise CommError(f"{g.label}{call}: the job's store is gone ({jobstore.dead()}): no process can join")
    return found


def join(spec: Spec, timeout: float, store: Any = None, init_method: str = "env://") -> ProcessGroup:
    """A process that joins a running job (``COMMLIB_JOIN=1``): take a ticket in the job's store, wait until its
    ranks take it in (their ``grow_group``), then make the grown world's communicator with them. Returns the
    default group (this process is ranked after the members)."""
    from commlib._rendezvous import diagnose, joining_store  # the group layer's world making

    shared = joining_store(store, init_method, timeout)
    if not jobstore.attach(shared):
        raise CommError(f"init_process_group (joining a running job): {jobstore.dead()}")
    ticket = jobstore.request("add", f"{_GROW}/tickets", 1)
    if ticket is None:
        raise CommError(f"init_process_group (joining a running job): the job's store: {jobstore.dead()}")
    jobstore.request("set", f"{_GROW}/ask/{ticket}", json.dumps({"pid": os.getpid()}))
    deadline = time.monotonic() + timeout
    raw = None
    while raw is None:
        raw = jobstore.read(f"{_GROW}/answer/{ticket}")
        if raw is None:
            if jobstore.read(f"{_GROW}/closed") is not None:
                if setting("COMMLIB_SPARE") != "":  # commlib.launch --spares: a spare the job never needed
                    print("commlib: this spare was not needed: the job ended", file=sys.stderr, flush=True)
                    raise SystemExit(0)
                raise CommError(
                    "init_process_group (joining a running job): the job's rank 0 ended its program before taking "
                    "this process in"
                )
            if time.monotonic() > deadline or jobstore.dead() is not None:
                raise CommTimeoutError(
                    f"init_process_group (joining a running job): no rank of the job took this process in within "
                    f"{timeout:g} s (its ranks take newcomers in when they call commlib.grow_group())"
                )
            time.sleep(0.01)
    a = json.loads(raw)
    rank, size = int(a["rank"]), int(a["size"])
    joining = Joining(int(a["nth"]), int(a["newcomers"]), a["payload"])
    grow_store = PrefixStore(f"{_GROW}/{a['epoch']}", jobstore.store())
    backend = spec.world(Place(rank, size, 0, timeout, None, grow_store, None, joining))
    diagnose(backend, timeout, shared, backend.terminate, attach=True)
    progress.new_world(int(a["progress"]))
    devicewatch.new_world(int(a["progress"]))
    _state.ids, _state.next_id, _state.shrinks = list(a["ids"]), max(a["ids"]) + 1, {}
    _state.world_number, _state.job, _state.grown = int(a["world"]), str(a["job"]), int(a["epoch"]) + 1
    me = int(a["id"])
    _connect(me, [i for i in a["ids"] if i < me], list(a["ids"]), min(timeout, 60.0))
    return ProcessGroup(backend, list(range(size)), rank, "world", timeout, f"[rank {rank}/{size}] ")
