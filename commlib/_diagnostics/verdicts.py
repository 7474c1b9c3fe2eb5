"""Verdicts: what went wrong between ranks, in words, from what the checks saw. Pure functions of plain values.

Every check (a stamp on a message, the nccl backend's digests, ``COMMLIB_DEBUG=DETAIL``, the closing check,
the slow path's reading of where the others wait) hands what it saw here, and the group layer raises the
error these words describe: ``CollectiveMismatchError`` when the ranks are not making the same calls,
``GroupBrokenError`` when a peer gave up. They are tested without ranks (``tests/test_verdicts.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from commlib.backends._digests import difference as digests

__all__ = [
    "Progress",
    "arrival",
    "closing",
    "differing_calls",
    "digests",
    "engine_failure",
    "first_difference",
    "gave_up",
    "mismatch",
    "unmatched",
]


def mismatch(what: str, peer: int, theirs: str, mine: str) -> str:
    """A peer's message (or digest) of another call: ``what`` names this rank's call (``ProcessGroup.what``),
    ``peer`` the other rank (global), ``theirs`` and ``mine`` the two calls in words."""
    return (
        f"{what}: the ranks are not making the same call: rank {peer} sent {theirs}, where this rank's call "
        f"expects {mine}; the group is now unusable"
    )


def gave_up(what: str, peer: int, reason: str) -> str:
    """A peer (global rank ``peer``) gave up on the group, saying ``reason``."""
    return f"{what}: rank {peer} gave up on the group ({reason}); the group is now unusable"


def engine_failure(what: str, backend: str, err: BaseException) -> str:
    """The engine failed inside a call without saying whose message was wrong."""
    return (
        f"{what} failed inside {backend}: the ranks most likely disagree on the size of this call, or made "
        f"different numbers of calls before it ({err}); the group is now unusable"
    )


def closing(
    me: int,
    ranks: Sequence[int],
    calls: int,
    rows: Sequence[tuple[int, int, int]],
    received: Sequence[int],
    any_received: int,
) -> list[str]:
    """What the closing check found: group rank ``me`` (of global ``ranks``) made ``calls`` collectives and
    received ``received[p]`` messages from rank p (``any_received`` from any rank); ``rows[p]`` is what rank p
    said (its collectives, its messages to this rank, its receives from this rank). Empty: all agree."""
    problems = []
    for p, (theirs, to_me, _) in enumerate(rows):
        if p == me:
            continue
        who = f"rank {ranks[p]}"
        if theirs != calls:
            problems.append(f"{who} made {theirs} collective calls on the group, this rank {calls}")
        if not any_received and to_me != received[p]:
            problems.append(f"{who} sent this rank {to_me} messages, of which this rank received {received[p]}")
    if any_received:
        sent = sum(r[1] for p, r in enumerate(rows) if p != me)
        got = sum(received) + any_received
        if sent != got:
            problems.append(f"the other ranks sent this rank {sent} messages, of which it received {got}")
    return problems


def first_difference(
    mine: Sequence[tuple[int, str]], theirs: Sequence[tuple[int, str]]
) -> tuple[int, str | None, str | None] | None:
    """The first call number at which two ranks' calls differ, from their lists of (number, call in words),
    each in order: (number, this rank's call or None, theirs or None; None where a list has no such number).
    None: they agree on every number both lists have."""
    a, b = dict(mine), dict(theirs)
    for seq in sorted(set(a) & set(b)):
        if a[seq] != b[seq]:
            return seq, a[seq], b[seq]
    return None


def differing_calls(mine: str, others: dict[int, str]) -> bool:
    """Whether ranks that all wait in the same call number are making different calls (``others``: global rank
    -> its call in words)."""
    return any(w != mine for w in others.values())


class Progress:
    """Where a rank was last seen waiting, as it published it: its call number (0: a send or a receive), the
    call, the call in words (or None), its posted sends and receives by peer (group ranks), or None, and its
    backend's running digests (``Digests.summary``), or None."""

    __slots__ = ("any", "call", "digests", "received", "sent", "seq", "what")

    def __init__(
        self,
        seq: int,
        call: str,
        what: str | None = None,
        sent: dict[int, int] | None = None,
        received: dict[int, int] | None = None,
        any: int = 0,
        digests: dict | None = None,
    ) -> None:
        self.seq, self.call, self.what = seq, call, what
        self.sent, self.received, self.any = sent, received, any
        self.digests = digests

    def words(self) -> str:
        """``all_reduce #3``, or a send's or receive's own description."""
        return (self.what or self.call) if self.seq == 0 else f"{self.call} #{self.seq}"


def unmatched(kind: str, me: int, calls: int, needed: int, peer: Progress | None) -> str | None:
    """The early verdict on a blocking send (``kind`` "send") or receive ("recv") that has waited: this rank (group
    rank ``me``, after ``calls`` collectives) waits in its ``needed``-th send to (receive from) the peer, and
    the peer was last seen as ``peer``. When the peer waits in a collective this rank has not reached, having
    posted fewer receives from (sends to) this rank than ``needed``, neither call can ever complete: the
    words for that; else None (it may still match).

    Sound whatever the timing: the peer cannot leave a collective this rank has not made, and while it waits
    there it posts nothing; messages between two ranks meet their receives in order (MPI's and NCCL's rule).
    """
    if peer is None or peer.seq <= calls or peer.sent is None or peer.received is None:
        return None
    if kind == "send":
        posted = peer.received.get(me, 0) + peer.any
        theirs = f"posted {peer.received.get(me, 0)} receives from this rank" + (
            f" and {peer.any} from any rank" if peer.any else ""
        )
        mine = f"this is this rank's send #{needed} to it"
    else:
        posted = peer.sent.get(me, 0)
        theirs, mine = f"posted {posted} sends to this rank", f"this is this rank's receive #{needed} from it"
    if posted >= needed:
        return None
    return (
        f"waits in {peer.what or peer.words()}, which this rank has not reached (it made {calls} collective calls "
        f"on the group), and has {theirs} ({mine}): neither call can complete"
    )


def arrival(
    me: int, ranks: Sequence[int], seq: int, call: str, mine: str | None, seen: dict[int, Progress | None]
) -> tuple[str, bool]:
    """Who reached call #``seq`` (``call``, ``mine`` in words) of a group (global ``ranks``; this rank is group
    rank ``me``), from each other group rank's last published progress (``seen``), as text for a timeout's
    error; and whether every rank arrived but their calls differ (a mismatched program)."""
    arrived, missing, other, notes = [ranks[me]], [], {}, []
    for p, s in seen.items():
        rank = ranks[p]
        if s is None or s.seq < seq:
            missing.append(rank)
            notes.append(
                f"rank {rank} " + ("never reported waiting" if s is None else f"was last seen waiting in {s.words()}")
            )
        elif s.seq == seq and (s.call != call or (mine is not None and s.what is not None and s.what != mine)):
            other[rank] = s.what or s.words()  # the same call number, another call: a mismatched program
        else:
            arrived.append(rank)
            if s.seq > seq:
                notes.append(f"rank {rank} is in {s.call} #{s.seq}")
    me_text = f"this rank (rank {ranks[me]}): {mine or f'{call} #{seq}'}"
    if other and not missing:
        calls = "; ".join([me_text, *(f"rank {r}: {c}" for r, c in sorted(other.items()))])
        same = f" ({', '.join(f'rank {r}' for r in sorted(arrived) if r != ranks[me])} as this rank)"
        text = f"; every rank arrived at call #{seq}, but their calls differ: {calls}"
        return text + (same if len(arrived) > 1 else ""), True
    text = f"; arrived: ranks {sorted(arrived)}; not arrived: ranks {missing}"
    if other:
        text += f"; in a different call (mismatched program?): ranks {sorted(other)}"
        notes += [f"rank {r} is in {c}, {me_text}" for r, c in sorted(other.items())]
    elif not missing:
        text += f" (every rank arrived at this call{f': {mine}' if mine else ''})"
    return text + (f" ({'; '.join(notes)})" if notes else ""), False
