"""Running digests of a rank's calls: how a backend whose engine carries no stamps (NCCL) checks every call.

Each call's description (:class:`~commlib.backends._call.Call`) is folded into a running 64-bit digest on the
host as the call is enqueued, never on the device: no copy, no synchronisation, no allocation. Every rank of a
group folds the same descriptions in the same order, so two ranks' digests after call #k are equal exactly
when (short of a 64-bit collision) they made the same calls up to #k. Sends and receives are not numbered:
the messages to and from each peer are folded apart, by their message's description, so a sender's digest of
its messages to rank p equals p's digest of what it received from the sender once both moved them.

The ranks compare digests off the device's path, where they meet anyway: the closing check
(``destroy_process_group`` and the program's end) and a wait's slow path (through the job's store). The last
:data:`Digests.RECENT` collectives are kept with the digest after each, so a difference is named: the first
call number whose digests differ, and both ranks' calls there (``commlib._diagnostics.verdicts.digests``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib.backends._call import DTYPE_BY_CODE, KINDS, OP_BY_CODE, Call, codes, describe, digest, message

__all__ = ["Digests", "difference"]

_MASK = (1 << 64) - 1
_MIX = 0x100000001B3  # FNV's 64-bit prime: each call's digest is folded into the running one
_FIELDS = 7  # a recent call as numbers: seq, digest after it, kind, dtype, op, root, count


def _fold(running: int, call: Call) -> int:
    return ((running ^ digest(call)) * _MIX) & _MASK


class Digests:
    """This rank's running digests of its calls on one communicator (see the module docstring)."""

    RECENT = 64

    __slots__ = ("calls", "last", "pending", "received", "recent", "sent", "seq")

    def __init__(self, size: int) -> None:
        self.calls, self.seq = 0, 0
        self.sent, self.received = [0] * size, [0] * size
        self.recent: collections.deque[tuple[int, int, Call]] = collections.deque(maxlen=self.RECENT)
        self.last: dict[tuple[str, int], Call] = {}  # ("send" or "recv", peer) -> its last message
        self.pending: list[tuple[int, Call]] = []  # (seq, call) noted, not folded yet (see collective)

    def collective(self, call: Call, seq: int) -> None:
        """Note collective #``seq``. It is folded with the next ones, :data:`RECENT` at a time, or when the
        digests are read (:meth:`fold`): every call of the device path comes here, and an append is a third
        of a fold's cost (0.9 us a call before)."""
        pending = self.pending
        pending.append((seq, call))
        if len(pending) >= self.RECENT:
            self.fold()

    def fold(self) -> None:
        """Fold the calls noted since the last fold into the running digest, in order."""
        pending = self.pending  # the same list throughout: the nccl backend appends to it directly
        if not pending:
            return
        calls, recent = self.calls, self.recent
        for seq, call in pending:
            calls = ((calls ^ digest(call)) * _MIX) & _MASK
            recent.append((seq, calls, call))
        self.calls, self.seq = calls, pending[-1][0]
        pending.clear()

    def message(self, call: Call) -> None:
        """Fold a send or a receive (its message's description, the same on both sides)."""
        into = self.sent if call.kind == "send" else self.received
        into[call.root] = _fold(into[call.root], message(call))
        self.last[call.kind, call.root] = call

    def summary(self) -> dict[str, Any]:
        """What the slow path publishes (JSON): the last call's number and digest, and the recent calls."""
        self.fold()
        return {"seq": self.seq, "calls": self.calls, "recent": [_numbers(r) for r in self.recent]}

    def record(self) -> np.ndarray:
        """What the closing check exchanges, as int64s: the collectives' digest; per rank, the digests of the
        messages to and from it and the last of each (dtype code and count); how many recent calls follow, and
        those (:data:`_FIELDS` numbers each)."""
        self.fold()
        n, k = len(self.sent), self.RECENT
        out = np.zeros(1 + 6 * n + 1 + k * _FIELDS, np.uint64)
        out[0] = self.calls
        out[1 : 1 + n], out[1 + n : 1 + 2 * n] = self.sent, self.received
        for p in range(n):
            for j, way in enumerate(("send", "recv")):
                last = self.last.get((way, p))
                if last is not None:
                    out[1 + (2 + 2 * j) * n + p] = codes(last)[1]
                    out[1 + (3 + 2 * j) * n + p] = last.count
        out[1 + 6 * n] = len(self.recent)
        for i, r in enumerate(self.recent):
            at = 2 + 6 * n + i * _FIELDS
            out[at : at + _FIELDS] = [v & _MASK for v in _numbers(r)]  # two's complement: root -1
        return out.view(np.int64)

    @staticmethod
    def read(row: np.ndarray, size: int) -> dict[str, Any]:
        """A rank's :meth:`record` as a :meth:`summary`, plus its messages' digests (``sent``, ``received``) and
        the last message each way (``last_sent``, ``last_received``: a message's description, or None)."""
        u, n = row.view(np.uint64), size
        count = int(u[1 + 6 * n])
        at = 2 + 6 * n
        recent = [[int(v) for v in row[at + i * _FIELDS : at + (i + 1) * _FIELDS]] for i in range(count)]
        for r in recent:
            r[1] &= _MASK  # the digest: unsigned (the other numbers signed)

        def last(j: int) -> list[Call | None]:
            dtypes, counts = (
                row[1 + (2 + 2 * j) * n : 1 + (3 + 2 * j) * n],
                row[1 + (3 + 2 * j) * n : 1 + (4 + 2 * j) * n],
            )
            return [
                Call("send", DTYPE_BY_CODE[int(d)], int(c)) if d else None for d, c in zip(dtypes, counts, strict=True)
            ]

        return {
            "seq": recent[-1][0] if recent else 0,
            "calls": int(u[0]),
            "recent": recent,
            "sent": [int(v) for v in u[1 : 1 + n]],
            "received": [int(v) for v in u[1 + n : 1 + 2 * n]],
            "last_sent": last(0),
            "last_received": last(1),
        }


def _numbers(r: tuple[int, int, Call]) -> list[int]:
    seq, after, call = r
    kind, dtype, op, root, count = codes(call)
    return [seq, after, kind, dtype, op, root, count]


def _recent_words(r: Sequence[int]) -> str:
    """A recent call of a digest summary (seq, digest, kind, dtype, op, root, count) in words."""
    seq, _, kind, dtype, op, root, count = r
    name = KINDS[kind - 1] if 0 < kind <= len(KINDS) else f"kind {kind}"
    return describe(Call(name, DTYPE_BY_CODE.get(dtype), count, OP_BY_CODE.get(op), root), seq)


def difference(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[int, str, str] | None:
    """Where two ranks' running digests of their collectives first differ, from their summaries
    (``Digests.summary``: the recent calls, each with the digest after it): (call number, this rank's call
    there, theirs) in words; None when they agree on every call both summaries hold (or share none)."""
    a = {r[0]: r for r in mine["recent"]}
    b = {r[0]: r for r in theirs["recent"]}
    common = sorted(set(a) & set(b))
    if not common or a[common[-1]][1] == b[common[-1]][1]:
        return None  # equal after the last call both know: equal before it too
    first = next(seq for seq in common if a[seq][1] != b[seq][1])
    if a[first][2:] != b[first][2:]:
        return first, _recent_words(a[first]), _recent_words(b[first])
    earlier = f"calls before call #{first} (they differ before the last {len(common)} calls both ranks keep)"
    return first, earlier, earlier
