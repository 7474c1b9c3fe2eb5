"""The slow path of every wait: say where this rank waits, judge what the others say, fail fast on a failure.

``backends.base.poll`` calls :func:`watchdog` once a wait has lasted 0.05 s, then at 0.1, 0.2, 0.4, 0.8 s and
every half second from then on (``base.watch_next``); torch's
Work calls it from its own loop (``ProcessGroup`` waits and torch's alike). It reads where this thread waits
(``_diagnostics.waits``, entered by the group layer's one wait path), publishes it (``_diagnostics.progress``)
and, from 0.1 s on, reads where the others wait: when no call can ever complete (every rank in call #k but
their calls differ; a send or receive whose peer waits in a collective this rank has not reached), it raises
``CollectiveMismatchError`` now instead of at the timeout. A rank whose exception was uncaught reports it
through the store before its job ends (``_diagnostics.abort``): the others' waits end with
``GroupBrokenError`` naming it. A wait on a group a member of which died (the lifelines' thread marked it)
ends with ``RankFailedError`` naming the dead. :func:`arrival` tells a timeout's error who arrived.
"""

from __future__ import annotations

import time
from typing import Any

from commlib._diagnostics import devicewatch, jobstore, progress, verdicts
from commlib._diagnostics import flight as _flight
from commlib._diagnostics import waits as _waits
from commlib._settings import value as setting
from commlib.errors import CollectiveMismatchError, GroupBrokenError, RankFailedError

__all__ = ["FAILED", "REPORTED", "arrival", "setup", "watchdog"]

FAILED = "commlib/mon/failed"  # the first failure a rank reported (its words)
REPORTED = "commlib/mon/reported"  # how many ranks saw it
_GRACE = 1.0  # after a timeout, how long (at most a quarter of the timeout) late ranks get to publish
_JUDGE_AFTER = 0.1  # seconds a wait lasts before the others' progress is read to judge it (its 2nd look)


class _State:
    failure_raised = False  # this rank raised the reported failure once (later waits do not read it again)


_state = _State()


def setup(backend: Any, timeout: float, store: Any = None, attached: bool = False) -> None:
    """At world creation, on every rank: the job's store (:func:`jobstore.setup`; ``attached``: a newcomer found
    it already), and the slow path on."""
    from commlib.backends import base as _base

    # Off until this world's store is found: a wait of the setup (the store's address, broadcast) would run the
    # last world's slow path, whose read of a store not yet found gives the new one up for good.
    _base.watchdog = None
    _state.failure_raised = False
    progress.new_world()
    devicewatch.new_world()
    if attached:
        _flight.set_job(backend.rank, backend.size, setting("COMMLIB_JOB_ID") or "unknown")
    else:
        jobstore.setup(backend, timeout, store)
    _base.watchdog = watchdog  # a member's death is raised on the slow path, with a store or without


def watchdog(waited: float, waiting: _waits.Waiting | None = None) -> None:
    """The slow path of a wait that has lasted ``waited`` seconds (``waiting``: what it waits in; default: what
    this thread entered). May raise ``CollectiveMismatchError`` or ``GroupBrokenError``."""
    w = waiting or _waits.current()
    if w is not None and isinstance(w.group.broken, RankFailedError):  # a member died (the lifelines said so)
        raise w.group.rank_failed(w.call, w.seq)
    if jobstore.dead() is not None or _state.failure_raised:
        return
    if w is not None and w.group.rank >= 0:
        progress.publish(w)
        if waited >= _JUDGE_AFTER:
            _judge(w)
    failure = jobstore.read(FAILED)
    if failure is None:
        return
    _state.failure_raised = True
    where = ""
    if w is not None:
        number = f"call #{w.seq} " if w.seq else ""
        where = f"{w.group.label}{progress.words(w) if not w.seq else w.call} ({number}on group {w.group.name!r}): "
    err = GroupBrokenError(
        f"{where}{failure} (reported through the job's store after this rank had waited {waited:.1f} s); the group "
        "is now unusable"
    )
    err.commlib_peer_failure = True  # type: ignore[attr-defined]
    raise err


def _judge(w: _waits.Waiting) -> None:
    """Raise ``CollectiveMismatchError`` when what the others published says no call can complete, or (a
    backend that checks by digests) that their calls so far differ from this rank's."""
    g = w.group
    mine = g.backend.digests() if g.backend is not None else None
    if mine is not None:
        _compare_digests(w, mine.summary())
        notice = devicewatch.peer_gave_up(g)  # a device communicator's peer fenced it off (NCCL tells no one)
        if notice is not None:
            _compare_digests(w, mine.summary())  # its digests came before its notice: a difference, if any, first
            raise notice
    if w.seq == 0:  # a send or a receive: does its peer wait in a collective this rank has not reached?
        if w.peer < 0 or not w.nth or g.tagged:
            return
        kind = "send" if w.call in ("send", "isend") else "recv"
        why = verdicts.unmatched(kind, g.rank, g.seq, w.nth, progress.read(g, w.peer))
        if why is not None:
            raise CollectiveMismatchError(
                f"{g.what(progress.words(w), 0)}: the ranks are not making matching calls: rank {g.ranks[w.peer]} "
                f"{why}; the group is now unusable" + g.dumped(f"mismatch in {w.call}")
            )
        return
    mine = progress.words(w)
    others = {}
    for p in range(g.size):
        if p != g.rank:
            s = progress.read(g, p)
            if s is None or s.seq != w.seq or s.what is None:
                return  # a rank elsewhere (or silent): only the timeout can tell
            others[g.ranks[p]] = s.what
    if verdicts.differing_calls(mine, others):
        calls = "; ".join(
            [f"this rank (rank {g.ranks[g.rank]}): {mine}", *(f"rank {r}: {c}" for r, c in others.items())]
        )
        raise CollectiveMismatchError(
            f"{g.what(w.call, w.seq)}: the ranks are not making the same call: every rank waits in call #{w.seq}, but "
            f"their calls differ: {calls}; the group is now unusable",
            calls={g.ranks[g.rank]: mine, **others},
        )


def _compare_digests(w: _waits.Waiting, mine: dict) -> None:
    """The running digests every other rank published, against this rank's: the first call that differs."""
    g = w.group
    for p in range(g.size):
        s = progress.read(g, p) if p != g.rank else None
        if s is None or s.digests is None:
            continue
        found = verdicts.digests(mine, s.digests)
        if found is not None:  # worded by the group layer, as a stamp's mismatch is
            _, ours, theirs = found
            raise CollectiveMismatchError(theirs, peer=p, theirs=f"the digest of {theirs}", mine=ours)


def arrival(g: Any, call: str, seq: int, timeout: float) -> tuple[str, bool]:
    """Which ranks of ``g`` reached call #``seq`` and what they call there (from their published progress), as
    text for the error; and whether every rank arrived but their calls differ (a mismatched program)."""
    if g.rank < 0:
        return "", False
    if seq == 0:  # a send or a receive (not numbered): where the others are
        places = []
        for p in range(g.size):
            s = progress.read(g, p) if p != g.rank else None
            if s is not None:
                places.append(f"rank {g.ranks[p]} was last seen waiting in {s.what or s.words()}")
        return (f" ({'; '.join(places)})" if places else ""), False
    w = _waits.current()
    mine = progress.words(w) if w is not None and w.group is g and w.seq == seq else None
    if w is not None and w.group is g and w.seq == seq:
        progress.publish(w)
    deadline, seen = time.monotonic() + min(_GRACE, timeout / 4), None
    while jobstore.dead() is None:
        reading = {p: progress.read(g, p) for p in range(g.size) if p != g.rank}
        if jobstore.dead() is not None:  # the store went away mid-reading (e.g. its host rank exited)
            break
        seen = reading
        if all(s is not None and s.seq >= seq for s in seen.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if seen is None:
        return f"; which ranks arrived is unknown: {jobstore.dead()}", False
    return verdicts.arrival(g.rank, g.ranks, seq, call, mine, seen)
