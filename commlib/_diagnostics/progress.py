"""Where each rank waits, published through the job's store on slow paths only, and read back by the others.

A wait that has lasted (``backends.base.poll``'s slow path) publishes the call it waits in (from
``_diagnostics.waits``): its number, name and description, and the sends and receives this rank has posted
on the group, by peer (a peer blocked in a send or receive reads them: ``verdicts.unmatched``). One key per
group rank and group, of the current world; the value is JSON. Nothing is written on the hot path.
"""

from __future__ import annotations

import json
from typing import Any

from commlib._diagnostics import jobstore
from commlib._diagnostics.verdicts import Progress
from commlib._diagnostics.waits import Waiting
from commlib.backends._call import describe

__all__ = ["new_world", "publish", "read", "words"]

_PREFIX = "commlib/mon/progress"
_COUNTS_MAX = 256  # peers a rank lists its posted sends and receives for (a huge group: no early verdict)


class _State:
    def __init__(self) -> None:
        self.worlds = 0  # worlds made by this process: the keys of an earlier one are never read
        self.published: dict[str, str] = {}  # key -> the value this rank last wrote there


_state = _State()


def new_world(number: int | None = None) -> int:
    """A new world: its keys are its own (``number``: the one the others counted to, for a newcomer). Returns
    the world's number."""
    _state.worlds = _state.worlds + 1 if number is None else number
    _state.published.clear()
    return _state.worlds


def _key(g: Any, group_rank: int) -> str:
    return f"{_PREFIX}/{_state.worlds}/{g.name}/{group_rank}"


def words(w: Waiting) -> str:
    """The call ``w`` waits in, in words: a collective's description, or ``recv from rank 1``."""
    if w.seq == 0:
        g = w.group
        way = "to" if w.call in ("send", "isend") or (w.desc is not None and w.desc.kind == "send") else "from"
        peer = "any rank" if w.peer < 0 else f"rank {g.ranks[w.peer]}"
        if w.call in ("send", "recv"):
            return f"{w.call} {way} {peer}"
        return f"the wait for an {w.call} {way} {peer}"  # a Work's: isend, irecv, one of a batch
    return describe(w.desc, w.seq) if w.desc is not None else f"{w.call} #{w.seq}"


def publish(w: Waiting) -> None:
    """Tell the others that this rank waits in ``w`` (once per call, again when its posted sends and receives
    changed)."""
    g = w.group
    record: dict[str, Any] = {"seq": w.seq, "call": w.call, "what": words(w)}
    if not g.tagged and g.size <= _COUNTS_MAX:  # messages of other tags may overtake: counts would say less
        record["sent"] = {str(p): n for p, n in enumerate(g.sent) if n}
        record["received"] = {str(p): n for p, n in enumerate(g.received) if n}
        record["any"] = g.any_received
    digests = g.backend.digests() if g.backend is not None else None
    if digests is not None:  # a backend whose check compares running digests: ours, for the others to compare
        record["digests"] = digests.summary()
    key, value = _key(g, g.rank), json.dumps(record, sort_keys=True)
    if _state.published.get(key) != value:
        _state.published[key] = value
        jobstore.request("set", key, value)


def read(g: Any, group_rank: int) -> Progress | None:
    """Where group rank ``group_rank`` of ``g`` last said it waits (None: it never did, or no store)."""
    text = jobstore.read(_key(g, group_rank))
    if text is None:
        return None
    try:
        r = json.loads(text)
        sent = {int(p): int(n) for p, n in r["sent"].items()} if "sent" in r else None
        received = {int(p): int(n) for p, n in r["received"].items()} if "received" in r else None
        return Progress(
            int(r["seq"]), str(r["call"]), r.get("what"), sent, received, int(r.get("any", 0)), r.get("digests")
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
