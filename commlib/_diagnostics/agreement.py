"""The survivors' agreement on who is out: which processes failed or are excluded, the same on every survivor.

Each survivor knows of the deaths its lifelines saw, and the ranks its caller asked to exclude; they may differ
(two deaths noticed at different calls, a death noticed by one survivor just before the agreement began). The
agreement makes them one decision, without MPI's fault tolerance (ULFM) and without the job's store (whose host
may be among the dead). It runs over the lifelines (:mod:`commlib._diagnostics.lifelines`), which tell every
process of every death, so a survivor never waits for the dead:

1. *propose*: every survivor sends the others what it knows (its excluded ids, the failed ones it saw) and waits
   for the proposal of every member it does not know to be out (failed, or excluded by a proposal it read);
2. *confirm*: each takes the union of all proposals as its decision and sends it to the members it keeps; the
   agreement holds when every kept member confirms the same decision.

A death or a different decision seen during either step starts a new *attempt* (a survivor that sees a later
attempt's message joins it), so the agreement ends once the deaths stop, with one decision every survivor
confirmed. A process that dies right after the last confirmation is the next failure, seen by the next call.
The lowest kept id adds a payload to its confirmation (a new communicator's unique id): every survivor gets it.

:func:`agree` takes a transport (``send``, ``take``, ``failed``: the lifelines, or an in-memory stand-in in the
tests) and is otherwise pure: no ranks needed to test it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from commlib.errors import CommTimeoutError

__all__ = ["Decision", "Excluded", "Transport", "agree"]


class Transport(Protocol):
    me: int

    def send(self, peer_id: int, msg: dict[str, Any]) -> bool: ...

    def take(self, match: Callable[[int, dict[str, Any]], bool], timeout: float) -> tuple[int, dict] | None: ...

    def failed(self) -> dict[int, Any]: ...

    def put_back(self, sender: int, msg: dict[str, Any]) -> None: ...

    def discard(self, match: Callable[[int, dict[str, Any]], bool]) -> None: ...


class Decision(NamedTuple):
    """What every survivor agreed: the ids that are out (failed or excluded), the ones kept (sorted), the
    attempt that agreed, the lowest kept id's payload, and the ids among ``out`` that failed (not only
    excluded)."""

    out: list[int]
    kept: list[int]
    attempt: int
    payload: Any
    failed: list[int]


class Excluded(Exception):
    """This process is among the excluded (a survivor's ``ranks_to_exclude`` named it)."""

    def __init__(self, by: list[int]) -> None:
        super().__init__(by)
        self.by = by


class _Restart(Exception):
    def __init__(self, attempt: int) -> None:
        self.attempt = attempt


def agree(
    t: Transport,
    key: str,
    members: list[int],
    exclude: set[int],
    timeout: float,
    payload: Callable[[list[int]], Any] | None = None,
) -> Decision:
    """Agree with the other ``members`` (ids) on which are out; ``exclude``: the ids this process asks to leave
    out. ``payload(kept)`` is called on the lowest kept id. Raises :class:`Excluded` on a process that is out,
    ``CommTimeoutError`` when a member neither answers nor fails within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:

        def stale(_: int, m: dict[str, Any], a: int = attempt) -> bool:
            return bool(m.get("t") == "agree" and m.get("k") == key and m.get("a", -1) < a)

        t.discard(stale)
        try:
            return _attempt(t, key, members, exclude, attempt, deadline, payload)
        except _Restart as r:
            attempt = r.attempt


def _attempt(
    t: Transport,
    key: str,
    members: list[int],
    exclude: set[int],
    attempt: int,
    deadline: float,
    payload: Callable[[list[int]], Any] | None,
) -> Decision:
    me, everyone = t.me, set(members)

    def failed() -> set[int]:
        return set(t.failed()) & everyone

    def take(phase: int, senders: set[int]) -> tuple[int, dict] | None:
        def match(sender: int, msg: dict[str, Any]) -> bool:
            return msg.get("t") == "agree" and msg.get("k") == key and sender in senders and (
                msg.get("a", -1) > attempt or (msg.get("a") == attempt and msg.get("p") == phase)
            )  # fmt: skip

        left = deadline - time.monotonic()
        if left <= 0:
            return None
        got = t.take(match, min(left, 0.25))
        if got is not None and got[1]["a"] > attempt:
            t.put_back(*got)  # a later attempt began: join it (its message is read there)
            raise _Restart(got[1]["a"])
        return got

    # 1. propose
    out_failed = failed()
    proposals: dict[int, tuple[set[int], set[int]]] = {me: (set(exclude), out_failed)}
    mine = {"t": "agree", "k": key, "a": attempt, "p": 1, "E": sorted(exclude), "F": sorted(out_failed)}
    sent: set[int] = set()
    while True:
        out_failed |= failed()
        excluded = set().union(*(e for e, _ in proposals.values()))
        for m in everyone - out_failed - sent - {me}:  # the excluded too: they learn it from this
            t.send(m, mine)
            sent.add(m)
        if me in excluded:
            raise Excluded(sorted(p for p, (e, _) in proposals.items() if me in e))
        need = everyone - out_failed - excluded - set(proposals)
        if not need:
            break
        got = take(1, everyone)
        if got is None:
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"the survivors' agreement: no answer from {sorted(need)} within the timeout (they neither "
                    "called it nor failed)"
                )
            continue
        sender, msg = got
        proposals[sender] = (set(msg["E"]), set(msg["F"]))
    out, dead = set(out_failed), set(out_failed)
    for e, f in proposals.values():
        out |= e | f
        dead |= f
    kept = sorted(everyone - out)
    if me in out:
        raise Excluded(sorted(p for p, (e, _) in proposals.items() if me in e))
    # 2. confirm
    extra = payload(kept) if payload is not None and me == kept[0] else None
    confirm = {"t": "agree", "k": key, "a": attempt, "p": 2, "D": sorted(out), "F": sorted(dead), "x": extra}
    for m in kept:
        if m != me:
            t.send(m, confirm)
    confirmed: dict[int, dict] = {me: confirm}
    while len(confirmed) < len(kept):
        if failed() & set(kept):
            raise _Restart(attempt + 1)  # a kept member died meanwhile: agree again without it
        got = take(2, set(kept) - set(confirmed))
        if got is None:
            if time.monotonic() >= deadline:
                silent = sorted(set(kept) - set(confirmed))
                raise CommTimeoutError(f"the survivors' agreement: {silent} did not confirm within the timeout")
            continue
        confirmed[got[0]] = got[1]
    if any(c["D"] != sorted(out) or c["F"] != sorted(dead) for c in confirmed.values()) or failed() & set(kept):
        raise _Restart(attempt + 1)
    return Decision(sorted(out), kept, attempt, confirmed[kept[0]]["x"], sorted(dead))
