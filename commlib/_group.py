"""Process groups, their state (sequence numbers, pending work, broken), and ``Work`` handles."""

from __future__ import annotations

import collections
import datetime
from typing import Any

import numpy as np

from commlib._arrays import host_array
from commlib._diagnostics import debug as _debug
from commlib._diagnostics import flight as _flight
from commlib.errors import CommError, CommTimeoutError, GroupBrokenError

__all__ = ["ProcessGroup", "Work", "as_seconds"]


def as_seconds(timeout: object, where: str) -> float:
    """A timeout given as ``datetime.timedelta`` or seconds, as positive float seconds."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{where}: timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{where}: timeout must be positive, got {seconds} s")
    return seconds


class ProcessGroup:
    """A set of ranks that communicate together: the world, or what ``new_group`` returns."""

    __slots__ = (
        "all_reduce_wait",
        "array",
        "backend",
        "broken",
        "check_reduction",
        "detail",
        "host",
        "label",
        "name",
        "pending",
        "rank",
        "ranks",
        "seq",
        "size",
        "timeout",
        "xp",
    )

    def __init__(self, backend: Any, ranks: list[int], rank: int, name: str, timeout: float, label: str) -> None:
        self.backend = backend  # None on ranks outside the group
        self.ranks = ranks  # global ranks, indexed by group rank
        self.rank = rank  # this process's rank in the group, -1 when not a member
        self.size = len(ranks)
        self.name = name
        self.timeout = timeout
        self.label = label  # "[rank 2/4] ": prefixes every message this group raises
        self.seq = 0  # collectives issued so far, for error messages
        self.pending: collections.deque[Work] = collections.deque()
        self.broken: BaseException | None = None
        # Optional backend fast path for a blocking in-place all_reduce (see backends/_base.py).
        self.all_reduce_wait = getattr(backend, "all_reduce_wait", None)
        # What arrays the backend takes: host numpy arrays (mpi, the nccl emulator) or device arrays.
        self.xp = getattr(backend, "xp", np)
        self.array = getattr(backend, "validate", host_array)
        self.host = getattr(backend, "host", True)
        self.check_reduction = getattr(backend, "check_reduction", None)  # backend-specific (dtype, op) limits
        # COMMLIB_DEBUG=DETAIL: every collective first checks that all ranks make the same call
        # (commlib._diagnostics.debug); the fused all_reduce path is then skipped, so its hot path has no check.
        self.detail = _debug.detail()
        if self.detail:
            self.all_reduce_wait = None

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} ranks={self.ranks} backend={self.backend_name}>"

    @property
    def backend_name(self) -> str:
        return self.backend.name if self.backend is not None else "none"

    def run(self, handle: Any, call: str, async_op: bool, dtype: Any = None, count: int = 0) -> Work | None:
        """Finish issuing a collective: return a Work, or wait for it with the group's timeout."""
        self.seq = seq = self.seq + 1
        slot = _ring.start(self, call, dtype, count, seq)
        if async_op:
            work = Work(self, handle, call, seq, slot=slot)
            self.pending.append(work)
            return work
        if self.pending:
            self.drain(None, self.timeout)
        if not self.host and hasattr(handle, "defer"):
            handle.defer()  # device work, as torch's NCCL: the caller's stream waits, the host goes on
            return None
        self.finish(handle, call, seq, slot, self.timeout)
        return None

    def finish(self, handle: Any, call: str, seq: int, slot: int, timeout: float) -> None:
        """Wait for ``handle``; record the outcome; on failure fence the group off and raise."""
        try:
            done = handle.wait(timeout)
        except CommError as e:
            _ring.end(slot, self, seq, ok=False)
            self.mark_broken(e)
            raise
        if not done:
            _ring.end(slot, self, seq, ok=False)
            self.fail_timeout(call, seq, timeout)
        _ring.end(slot, self, seq)

    def drain(self, upto: Work | None, timeout: float) -> None:
        """Complete pending collectives in issue order, up to and including ``upto`` (all when None)."""
        pending = self.pending
        while pending:
            work = pending[0]
            self.finish(work.handle, work.call, work.seq, work.slot, timeout)
            work.done = True
            pending.popleft()
            if work is upto:
                return

    def test_upto(self, upto: Work) -> bool:
        """Complete, without blocking, the pending collectives that are done, in issue order."""
        pending = self.pending
        while pending:
            work = pending[0]
            if not work.handle.test():
                return False
            _ring.end(work.slot, self, work.seq)
            work.done = True
            pending.popleft()
            if work is upto:
                return True
        return upto.done

    def fail_timeout(self, call: str, seq: int, timeout: float) -> None:
        """Mark the group broken and raise the ``CommTimeoutError`` that says what was waited for."""
        from commlib._diagnostics import monitor as _monitor

        arrived = _monitor.arrival(self, call, seq, timeout)
        dumped = _flight.dump(f"timeout in {call} #{seq} on group {self.name!r}")
        err = CommTimeoutError(
            f"{self.label}{call} (call #{seq} on group {self.name!r}, ranks {_ranks(self.ranks)}) did not complete "
            f"within {timeout:g} s: a peer rank did not make the matching call (it may have failed, be stuck, "
            f"or be making a different call){arrived}; the group is now unusable"
            + (f" (flight recorder: {dumped})" if dumped else "")
        )
        self.mark_broken(err)
        raise err

    def mark_broken(self, err: BaseException) -> None:
        """Fence the group off: every later call on it raises ``GroupBrokenError`` from ``err``."""
        if self.broken is None:
            self.broken = err
            if self.backend is not None:
                self.backend.abort()

    def refuse(self, call: str) -> None:
        """Raise the error for a call on a group that cannot take it (broken, or not a member)."""
        if self.broken is not None:
            raise GroupBrokenError(
                f"{self.label}{call}: group {self.name!r} failed earlier and cannot be used: {self.broken}"
            ) from self.broken
        if self.rank < 0:
            raise ValueError(
                f"{self.label}{call}: this rank is not a member of group {self.name!r} (ranks {_ranks(self.ranks)})"
            )
        raise CommError(f"{self.label}{call}: group {self.name!r} has been destroyed")

    def group_rank(self, global_rank: int, where: str, arg: str) -> int:
        """The group rank of ``global_rank``; ``ValueError`` when it is not in the group."""
        if isinstance(global_rank, (bool, np.bool_)) or not isinstance(global_rank, (int, np.integer)):
            raise TypeError(f"{self.label}{where}: {arg} must be an int rank, got {global_rank!r}")
        try:
            return self.ranks.index(int(global_rank))
        except ValueError:
            raise ValueError(
                f"{self.label}{where}: {arg}={global_rank} is not a rank of group {self.name!r} "
                f"(ranks {_ranks(self.ranks)})"
            ) from None

    def check_group_rank(self, group_rank: int, where: str, arg: str) -> int:
        """``group_rank`` itself when it is a valid rank of this group."""
        if isinstance(group_rank, (bool, np.bool_)) or not isinstance(group_rank, (int, np.integer)):
            raise TypeError(f"{self.label}{where}: {arg} must be an int rank, got {group_rank!r}")
        if not 0 <= group_rank < self.size:
            raise ValueError(f"{self.label}{where}: {arg}={group_rank} is out of range for a group of size {self.size}")
        return int(group_rank)


_ring = _flight.ring


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return str(ranks)


class Work:
    """The handle of an ``async_op=True`` call: ``wait()`` for it, or poll ``is_completed()``.

    Collectives on one group complete in issue order: waiting on a Work also
    completes every earlier collective Work of the same group. Point-to-point
    Work is not ordered with collectives (like gloo, unlike one NCCL stream).
    """

    __slots__ = ("call", "done", "group", "handle", "ordered", "seq", "slot")

    def __init__(
        self, group: ProcessGroup, handle: Any, call: str, seq: int, ordered: bool = True, slot: int = -1
    ) -> None:
        self.group = group
        self.handle = handle
        self.call = call
        self.seq = seq
        self.ordered = ordered
        self.slot = slot  # the flight recorder's slot of a collective
        self.done = False

    def __repr__(self) -> str:
        state = "completed" if self.done else "pending"
        return f"<Work {self.call} #{self.seq} {state}>"

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the operation is complete (True); raise ``CommTimeoutError`` after ``timeout``.

        On a device backend without ``timeout``, as torch's NCCL: the caller's current
        stream waits for the operation and the host does not block.
        """
        if self.done:
            return True
        group = self.group
        if timeout is None and not group.host and hasattr(self.handle, "defer"):
            self.handle.defer()
            return True
        seconds = group.timeout if timeout is None else as_seconds(timeout, f"{group.label}{self.call} Work.wait")
        if group.broken is not None:
            group.refuse(self.call)
        if self.ordered:
            group.drain(self, seconds)
        elif self.handle.wait(seconds):
            self.done = True
        else:
            group.fail_timeout(self.call, self.seq, seconds)
        return True

    def is_completed(self) -> bool:
        """True once the operation is complete; never blocks."""
        if not self.done:
            self.done = self.group.test_upto(self) if self.ordered else self.handle.test()
        return self.done

    def source_rank(self) -> int:
        """For ``irecv(src=None)``: the global rank the message came from (waits first)."""
        self.wait()
        source = getattr(self.handle, "source", None)
        if source is None:
            raise ValueError(f"{self.group.label}{self.call}: source_rank() is only defined for receives")
        return self.group.ranks[source]
