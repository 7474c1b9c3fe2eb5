"""The device path's watchdog: compares the ranks' running digests while the host does not wait.

On the device path (the nccl backend with cupy arrays or torch CUDA tensors) a blocking call only enqueues: the
host goes on, and never waits in commlib where the slow path could look. A mismatched program would then hang
inside the device (NCCL waiting for a peer's other call) while the host waits in CUDA, or run on with wrong
data (the same byte count in another dtype). So a thread of this process (as torch's NCCL watchdog) looks every
:data:`EVERY` seconds at each device group: it publishes the group's running digests through the job's store
when they moved, reads the other ranks', and where they differ (``commlib.backends._digests.difference``) it
fences the group off with ``CollectiveMismatchError`` naming both calls, aborting its communicator (which ends
the device work stuck on the mismatch); the host's next call on the group raises it. It touches no device,
allocates nothing on one and never synchronises: it reads host-side digests and the store. Without a job
store (``COMMLIB_MONITOR=0``) the closing check is the only comparison.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from commlib._diagnostics import jobstore, verdicts
from commlib.backends._digests import difference
from commlib.errors import CollectiveMismatchError, GroupBrokenError

__all__ = ["EVERY", "compare", "gave_up", "peer_gave_up", "watch"]

EVERY = 0.5  # seconds between two looks
_PREFIX = "commlib/mon/digests"
_GAVE_UP = "commlib/mon/gave-up"


class _State:
    def __init__(self) -> None:
        self.groups: list[Any] = []  # dropped once broken or destroyed
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.published: dict[str, str] = {}
        self.world = 0  # which world's keys (a new world's are its own)
        self.error: Exception | None = None  # the last error a look ran into


_state = _State()


def watch(group: Any) -> None:
    """Compare ``group``'s running digests with its peers' from now on (a group of a device backend)."""
    if jobstore.dead() is not None or group.rank < 0 or group.size == 1:
        return
    with _state.lock:
        _state.groups.append(group)
        if _state.thread is None or not _state.thread.is_alive():
            _state.thread = threading.Thread(target=_run, name="commlib-device-watchdog", daemon=True)
            _state.thread.start()


def new_world(number: int | None = None) -> int:
    """A new world: its keys are its own (``number``: the one the others counted to, for a newcomer); the groups
    of the last one are not watched any more. Returns the world's number."""
    with _state.lock:
        _state.world = _state.world + 1 if number is None else number
        _state.groups = []
        _state.published.clear()
        return _state.world


def _run() -> None:
    while True:
        time.sleep(EVERY)
        with _state.lock:
            _state.groups = groups = [g for g in _state.groups if g.broken is None and g.backend is not None]
        for g in groups:
            try:
                _look(g)
            except Exception as e:  # a watchdog that fails must not take the process down: kept for a look
                _state.error = e
        if jobstore.dead() is not None:
            return


def _key(g: Any, group_rank: int) -> str:
    return f"{_PREFIX}/{_state.world}/{g.name}/{group_rank}"


def gave_up(g: Any, reason: str) -> None:
    """This rank fenced ``g`` off for ``reason``: tell its peers through the job's store. On a device
    communicator nothing else would (NCCL tells no peer of an abort): they would wait for their timeout."""
    if jobstore.dead() is None and g.rank >= 0 and g.size > 1:
        jobstore.request("set", f"{_GAVE_UP}/{_state.world}/{g.name}/{g.rank}", reason[:4000])


def peer_gave_up(g: Any) -> GroupBrokenError | None:
    """The first peer of ``g`` that said it gave up on it (:func:`gave_up`), as the backend's raw error (its
    ``peer`` and ``reason``: the group layer words it), or None."""
    if jobstore.dead() is not None or g.rank < 0:
        return None
    for p in range(g.size):
        raw = jobstore.read(f"{_GAVE_UP}/{_state.world}/{g.name}/{p}") if p != g.rank else None
        if raw is not None:
            return GroupBrokenError(f"group rank {p} gave up on the group: {raw}", peer=p, reason=raw)
    return None


def _look(g: Any) -> None:
    """Publish ``g``'s digests where they moved; fence ``g`` off where a peer's differ from them, or where a
    peer gave up on it."""
    mine = g.backend.digests().summary()
    key, text = _key(g, g.rank), json.dumps(mine)
    if _state.published.get(key) != text:
        _state.published[key] = text
        jobstore.request("set", key, text)
    if _differs(g, mine):
        return
    notice = peer_gave_up(g)  # no difference seen, but a peer fenced the group off: say why
    if notice is None or g.broken is not None or _differs(g, mine):  # (its digests came before its notice)
        return
    what = g.what("its calls", 0)
    gone = GroupBrokenError(verdicts.gave_up(what, g.ranks[notice.peer], notice.reason or ""), peer=notice.peer)
    gone.context = what
    g.mark_broken(gone)


def _differs(g: Any, mine: dict) -> bool:
    """Fence ``g`` off with ``CollectiveMismatchError`` where a peer's published digests differ from ``mine``."""
    for p in range(g.size):
        if p == g.rank:
            continue
        raw = jobstore.read(_key(g, p))
        if raw is None:
            continue
        found = difference(mine, json.loads(raw))
        if found is not None and g.broken is None:
            seq, ours, theirs = found
            err = CollectiveMismatchError(
                f"{g.what(f'call #{seq}', 0)}: the ranks are not making the same calls (their running digests, "
                f"compared off the device's path): rank {g.ranks[p]} made {theirs}, where this rank made {ours}; "
                "the group's communicator was aborted and the group is now unusable"
                + g.dumped(f"mismatch in call #{seq}"),
                peer=p,
                theirs=theirs,
                mine=ours,
            )
            err.context = g.what(f"call #{seq}", 0)
            g.mark_broken(err)
            return True
    return False


def compare(g: Any, wait: float = 1.0) -> CollectiveMismatchError | GroupBrokenError | None:
    """``g``'s digests, published now, against every peer's, waiting up to ``wait`` s for each to have folded as
    many calls: the backend's raw error for the first call that differs (its ``peer``, ``theirs``, ``mine``; the
    group layer words it), a peer's notice that it gave up on the group, or None (they agree as far as they
    tell, or there is no store)."""
    if jobstore.dead() is not None or g.rank < 0:
        return None
    mine = g.backend.digests().summary()
    text = json.dumps(mine)
    _state.published[_key(g, g.rank)] = text
    jobstore.request("set", _key(g, g.rank), text)
    deadline, pending = time.monotonic() + wait, [p for p in range(g.size) if p != g.rank]
    while pending and jobstore.dead() is None:
        for p in list(pending):
            raw = jobstore.read(_key(g, p))
            theirs = json.loads(raw) if raw is not None else None
            if theirs is None or (theirs["seq"] < mine["seq"] and time.monotonic() < deadline):
                continue  # not there yet: it may still fold this call
            pending.remove(p)
            found = difference(mine, theirs)
            if found is not None:
                _, ours, other = found
                return CollectiveMismatchError(other, peer=p, theirs=f"the digest of {other}", mine=ours)
        notice = peer_gave_up(g) if pending else None  # a peer that fenced the group off may never fold more
        if notice is not None:
            return notice
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return None
