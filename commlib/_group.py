"""Process groups: their state (sequence numbers, pending work, broken), ``Work``, and the one wait path.

Every wait in commlib goes through :meth:`ProcessGroup.complete`: it waits with a deadline,
records the outcome in the flight recorder, and on an error or a timeout fences the group off
and raises the error that explains it. Blocking collectives enter through
:meth:`ProcessGroup.run` (which also records the start), asynchronous ones through
:meth:`ProcessGroup.submit` and later :meth:`Work.wait`.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from commlib._diagnostics import debug as _debug
from commlib._diagnostics import flight as _flight
from commlib._timeouts import as_seconds
from commlib.arrays import host_array
from commlib.backends._stamp import PeerGaveUp, StampMismatch
from commlib.backends.base import Backend, CallsDiffer, Chained, Handle
from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError, GroupBrokenError, TransportError

__all__ = ["ProcessGroup", "Work", "as_seconds"]

_ring = _flight.ring
_now, _starts, _ends, _slots = _flight.now, _ring.starts, _ring.ends, _ring.slots  # hot path: globals


def _host_intake(obj: object, ctx: Any, call: str, arg: str, writable: bool = True) -> np.ndarray:
    return host_array(obj, ctx, call, arg, writable)


class ProcessGroup:
    """A set of ranks that communicate together: the world, or what ``new_group`` returns."""

    __slots__ = (
        "any_received",
        "backend",
        "broken",
        "buffer",
        "detail",
        "fused",
        "fused_all_reduce",
        "host",
        "label",
        "limits",
        "name",
        "pending",
        "rank",
        "ranks",
        "ready",
        "received",
        "reductions",
        "sent",
        "seq",
        "size",
        "sums",
        "tagged",
        "timeout",
        "xp",
    )

    def __init__(
        self, backend: Backend | None, ranks: list[int], rank: int, name: str, timeout: float, label: str
    ) -> None:
        self.backend = backend  # None on ranks outside the group
        self.ranks = ranks  # global ranks, indexed by group rank
        self.rank = rank  # this process's rank in the group, -1 when not a member
        self.size = len(ranks)
        self.name = name
        self.timeout = timeout
        self.label = label  # "[rank 2/4] ": prefixes every message this group raises
        self.seq = 0  # collectives issued so far: their numbers, in messages, stamps and errors
        # point-to-point messages to and from each group rank (and received from any rank), for close()
        self.sent, self.received, self.any_received = [0] * self.size, [0] * self.size, 0
        self.tagged = False  # a send or receive with a tag other than 0 was posted: the counts say less (monitor)
        self.pending: collections.deque[Work] = collections.deque()
        self.broken: BaseException | None = None
        # What the backend declares, read once (the hot path reads attributes, not the backend).
        self.buffer = backend.array if backend is not None else _host_intake  # validates and converts
        self.xp = backend.xp if backend is not None else np
        self.host = backend.host if backend is not None else True
        # backend-specific (dtype, op) limits, read only for backends that have some
        overridden = backend is not None and type(backend).unsupported is not Backend.unsupported
        self.limits = backend.unsupported if backend is not None and overridden else None
        self.reductions: set[tuple[Any, Any]] = set()  # (op, dtype) pairs this group's checks accepted
        # COMMLIB_DEBUG=DETAIL: every collective first checks that all ranks make the same call (diagnostics.debug).
        self.detail = _debug.detail()
        self.fused = backend.fused() if backend is not None else {}  # blocking calls in one step, by kind
        self.fused_all_reduce = self.fused.get("all_reduce")
        # the backend's ready in-place SUM all_reduces (Backend.sums); None whenever the group cannot use them
        self.sums = backend.sums() if backend is not None and self.host and not self.detail else None
        # the same for broadcast, all_gather and reduce_scatter (Backend.residents), on groups whose ranks are
        # the global ranks 0..size-1 (a root given as a global rank is then the group's own)
        usable = self.sums is not None and ranks == list(range(self.size))
        self.ready = backend.residents() if backend is not None and usable else None

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} ranks={self.ranks} backend={self.backend_name}>"

    @property
    def backend_name(self) -> str:
        return self.backend.name if self.backend is not None else "none"

    # -- the one wait path ------------------------------------------------------------------------
    def issue(
        self,
        call: str,
        kind: str,
        args: tuple,
        async_op: bool,
        dtype: Any = None,
        count: int = 0,
        finish: Callable[[], None] | None = None,
    ) -> Work | None:
        """Carry out ``call`` as the backend's operation ``kind`` on ``args`` (validated already).

        Blocking calls on host memory that the backend runs in one step (``Backend.fused``) go
        through :meth:`run`; the others post the operation and hand its handle to :meth:`submit`.
        ``finish`` runs on completion (e.g. copying out of a staging buffer).
        """
        fused = self.fused.get(kind) if self.host and not async_op else None
        if fused is None:
            handle = getattr(self.backend, kind)(*args, self.seq + 1)  # numbered by submit()
            return self.submit(handle if finish is None else Chained(handle, finish), call, async_op, dtype, count)
        self.run(call, dtype, count, self.timeout, fused, *args)
        if finish is not None:
            finish()
        return None

    def submit(self, handle: Handle, call: str, async_op: bool, dtype: Any = None, count: int = 0) -> Work | None:
        """A collective has been posted: give the caller its ``Work`` (``async_op``), or complete it now."""
        if async_op:
            self.seq = seq = self.seq + 1
            work = Work(self, handle, call, seq, slot=_ring.start(self, call, dtype, count, seq))
            self.pending.append(work)
            return work
        if not self.host:  # device work, as torch's NCCL: the caller's stream waits, the host goes on
            if self.pending:
                self.drain(None, self.timeout)
            if handle.defer():
                self.seq = seq = self.seq + 1
                t = _now()  # enqueued is done, as far as the host is concerned
                slot = next(_slots)
                _starts[slot], _ends[slot] = (self, call, dtype, count, seq, t), t
                return None
        self.run(call, dtype, count, self.timeout, _waits(handle))
        return None

    def run(self, call: str, dtype: Any, count: int, timeout: float, wait: Callable[..., bool], *args: Any) -> None:
        """Number, record and complete a blocking collective: ``wait(*args, seq, timeout)`` posts and waits."""
        self.seq = seq = self.seq + 1
        slot = next(_slots)
        _starts[slot] = (self, call, dtype, count, seq, _now())
        if self.pending:
            self.drain(None, self.timeout)
        try:  # complete(), inlined: this is the latency of every blocking call
            if wait(*args, seq, timeout):
                _ends[slot] = _now()
                return
        except BaseException as e:
            self.fail(call, seq, slot, e)
        self.timed_out(call, seq, slot, timeout)

    def run_ready(self, call: str, p: Any, inp: Any, out: Any) -> bool:
        """Number, record and run a blocking call through a ready operation of the backend (a ``base.Resident``,
        from ``Backend.sums`` or ``residents``) from ``inp`` into ``out``; False: the arrays are not the
        operation's (its ``go`` returned None): nothing happened, the caller takes the generic path.

        Each of ``inp`` and ``out`` is an array, a list of arrays (scatter's and gather's root lists, in rank
        order) or None (no input; no output on this rank).
        """
        seq = self.seq + 1
        try:
            done = p.go(inp, out, seq)  # start, a few tests: most small calls end here
        except BaseException as e:
            done = e
        if done is None:
            return False
        self.seq = seq
        slot = next(_slots)
        # stamped once, as go() returned: a call done by then is recorded with no duration (its start is within
        # microseconds, or a large one's spin of at most 0.25 s, of that); one still running from there on
        _starts[slot] = (self, call, p.dtype, p.count, seq, t := _now())
        if done is True:
            _ends[slot] = t
            return True
        self.ready_rest(call, p, out, seq, slot, done if isinstance(done, BaseException) else None)
        return True

    def ready_rest(self, call: str, p: Any, out: Any, seq: int, slot: int, exc: BaseException | None) -> None:
        """:meth:`run_ready` after a ``go()`` that did not complete (``exc`` None: wait, finish) or raised ``exc``;
        a send or receive (not numbered: ``seq`` 0, ``slot`` -1) too."""
        done = True
        try:
            if exc is not None:
                raise exc
            done = p.wait(self.timeout)
            if done:
                p.finish(out)
        except BaseException as e:
            self.fail(call, seq, slot, p.error(e))
        if not done:
            self.timed_out(call, seq, slot, self.timeout)
        if slot >= 0:
            _ends[slot] = _now()

    def complete(self, call: str, seq: int, slot: int, timeout: float, wait: Callable[..., bool], *args: Any) -> None:
        """Wait (``wait(*args, timeout)``); record the end in ``slot`` (none if < 0); on failure fence and raise."""
        try:
            done = wait(*args, timeout)
        except BaseException as e:
            self.fail(call, seq, slot, e)
        if not done:
            self.timed_out(call, seq, slot, timeout)
        if slot >= 0:
            _ends[slot] = _now()

    def timed_out(self, call: str, seq: int, slot: int, timeout: float) -> NoReturn:
        """Record call #``seq`` as failed in ``slot`` (none if < 0), fence the group, raise its timeout error."""
        if slot >= 0:
            _ring.end(slot, self, seq, ok=False)
        self.fail_timeout(call, seq, timeout)

    def drain(self, upto: Work | None, timeout: float) -> None:
        """Complete pending collectives in issue order, up to and including ``upto`` (all when None)."""
        pending = self.pending
        while pending:
            work = pending[0]
            self.complete(work.call, work.seq, work.slot, timeout, work.handle.wait)
            work.done = True
            pending.popleft()
            if work is upto:
                return

    def test_upto(self, upto: Work, spin: float = 0.0) -> bool:
        """Complete, without blocking, the pending collectives that are done, in issue order.

        ``spin``: test each for up to that many seconds (MPI moves a transfer only while it is tested).
        """
        pending = self.pending
        while pending:
            work = pending[0]
            if not self.complete_if_done(work, spin):
                return False
            pending.popleft()
            if work is upto:
                return True
        return upto.done

    def complete_if_done(self, work: Work, spin: float = 0.0) -> bool:
        """Complete ``work`` if its handle tests done (recorded as :meth:`complete` does); tests up to ``spin`` s."""
        try:
            test = work.handle.test
            if not test():
                if not spin:
                    return False
                end = time.monotonic() + spin
                while not test():
                    if time.monotonic() > end:
                        return False
        except BaseException as e:
            self.fail(work.call, work.seq, work.slot, e)
        if work.slot >= 0:
            _ring.end(work.slot, self, work.seq)
        work.done = True
        return True

    # -- the end ----------------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """The group's closing check: every rank made as many collectives as this one, and every message a rank
        sent this one was received (``destroy_process_group()`` and the program's end run it on every group).

        Raises ``CollectiveMismatchError`` naming what differs (the group is then unusable), or the timeout's
        error when a rank never closes. A group that failed earlier, or that this rank is not in, is skipped.
        """
        if self.backend is None or self.rank < 0 or self.size == 1:
            return
        if self.broken is not None:
            with contextlib.suppress(Exception):  # best effort: the group failed already
                self.backend.close_failed(self.seq)
            return
        if self.pending:
            self.drain(None, timeout)
        call = "close (the group's closing check)"
        try:
            rows = self.backend.close_check(self.seq, self.sent, self.received, timeout)
        except TransportError as e:
            self.mark_broken(e)
            raise self.mismatch(call, self.seq, -1, e) from e
        except CommTimeoutError:
            self.fail_timeout(call, self.seq, timeout)
        problems = []
        for p, (calls, to_me, _) in enumerate(rows):
            if p == self.rank:
                continue
            who = f"rank {self.ranks[p]}"
            if calls != self.seq:
                problems.append(f"{who} made {calls} collective calls on the group, this rank {self.seq}")
            if not self.any_received and to_me != self.received[p]:
                problems.append(
                    f"{who} sent this rank {to_me} messages, of which this rank received {self.received[p]}"
                )
        if self.any_received:
            sent = sum(r[1] for p, r in enumerate(rows) if p != self.rank)
            got = sum(self.received) + self.any_received
            if sent != got:
                problems.append(f"the other ranks sent this rank {sent} messages, of which it received {got}")
        if problems:
            err = CollectiveMismatchError(
                f"{self.label}{call} on group {self.name!r} (ranks {_ranks(self.ranks)}): the ranks did not make the "
                f"same calls: {'; '.join(problems)}" + self.dumped("closing check")
            )
            self.mark_broken(err)
            raise err

    # -- failures ---------------------------------------------------------------------------------
    def fail(self, call: str, seq: int, slot: int, err: BaseException) -> None:
        """Record the failure of call #``seq``, fence the group off, and raise (an engine error explained)."""
        if slot >= 0:
            _ring.end(slot, self, seq, ok=False)
        if isinstance(err, PeerGaveUp):  # a peer's group failed first: say which and why
            peer = self.ranks[err.peer] if 0 <= err.peer < self.size else err.peer
            out = GroupBrokenError(
                f"{self.what(call, seq)}: rank {peer} gave up on the group ({err.reason}); the group is now unusable"
            )
            self.mark_broken(out)
            raise out from None
        self.mark_broken(err)
        if isinstance(err, TransportError):
            raise self.mismatch(call, seq, slot, err) from err
        raise err

    def fail_timeout(self, call: str, seq: int, timeout: float) -> NoReturn:
        """Mark the group broken and raise the ``CommTimeoutError`` that says what was waited for."""
        from commlib._diagnostics import monitor

        arrived, differ = monitor.arrival(self, call, seq, timeout)
        if differ:  # every rank is here, in another call: say so (not "a peer did not come")
            err: CommError = CollectiveMismatchError(
                f"{self.what(call, seq)} did not complete within {timeout:g} s: the ranks are not making the same "
                f"call{arrived}; the group is now unusable" + self.dumped(f"mismatch in {call} #{seq}")
            )
        else:
            err = CommTimeoutError(
                f"{self.what(call, seq)} did not complete within {timeout:g} s: a peer rank did not make the "
                f"matching call (it may have failed, be stuck, or be making a different call){arrived}; the group "
                "is now unusable" + self.dumped(f"timeout in {call} #{seq}")
            )
        self.mark_broken(err)
        raise err

    def what(self, call: str, seq: int, more: str = "") -> str:
        """``[rank r/n] call (call #seq on group 'name', ranks [...]more)``: how errors name a call."""
        number = f"call #{seq} " if seq else ""  # sends and receives are not numbered
        return f"{self.label}{call} ({number}on group {self.name!r}, ranks {_ranks(self.ranks)}{more})"

    def dumped(self, reason: str) -> str:
        """Dump the flight recorder for ``reason`` (on this group); the note that says where, for a message."""
        path = _flight.dump(f"{reason} on group {self.name!r}")
        return f" (flight recorder: {path})" if path else ""

    def mismatch(self, call: str, seq: int, slot: int, err: TransportError) -> CommError:
        """The error for an engine failure inside a call: a message of another call (``StampMismatch``: both
        calls named), or ranks that most likely disagree on the call."""
        if isinstance(err, StampMismatch):
            peer = self.ranks[err.peer] if 0 <= err.peer < self.size else err.peer
            text = (
                f"{self.what(call, seq)}: the ranks are not making the same call: rank {peer} sent {err.got}, "
                f"where this rank's call expects {err.wanted}; the group is now unusable"
            )
        elif isinstance(err, CallsDiffer):
            text = (
                f"{self.what(call, seq)}: the ranks are not making the same call: another rank's call differs from "
                f"this rank's {err.mine} (the {self.backend_name} backend compares fingerprints: it cannot say "
                "which rank, nor its call; COMMLIB_DEBUG=DETAIL lists every rank's); the group is now unusable"
            )
        else:
            entry = _starts[slot] if slot >= 0 else None
            nbytes = ""
            if entry is not None and entry[0] is self and entry[4] == seq and entry[2] is not None:
                nbytes = f", {entry[3] * np.dtype(entry[2]).itemsize} bytes on this rank"
            text = (
                f"{self.what(call, seq, nbytes)} failed inside {self.backend_name}: the ranks most likely disagree on "
                f"the size of this call, or made different numbers of calls before it ({err}); the group is now "
                "unusable"
            )
        out = CollectiveMismatchError(text + self.dumped(f"mismatch in {call} #{seq}"))
        self.broken, self.sums, self.ready = out, None, None
        return out

    def mark_broken(self, err: BaseException) -> None:
        """Fence the group off: every later call on it raises ``GroupBrokenError`` from ``err``."""
        if self.broken is None:
            self.broken, self.sums, self.ready = err, None, None
            if self.backend is not None:
                self.backend.abort(f"{type(err).__name__}: {err}")

    def refuse(self, call: str) -> NoReturn:
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

    # -- ranks --------------------------------------------------------------------------------------
    def _int_rank(self, value: object, where: str, arg: str) -> None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{self.label}{where}: {arg} must be an int rank, got {value!r}")

    def group_rank(self, global_rank: int, where: str, arg: str) -> int:
        """The group rank of ``global_rank``; ``ValueError`` when it is not in the group."""
        self._int_rank(global_rank, where, arg)
        try:
            return self.ranks.index(int(global_rank))
        except ValueError:
            raise ValueError(
                f"{self.label}{where}: {arg}={global_rank} is not a rank of group {self.name!r} "
                f"(ranks {_ranks(self.ranks)})"
            ) from None

    def check_group_rank(self, group_rank: int, where: str, arg: str) -> int:
        """``group_rank`` itself when it is a valid rank of this group."""
        self._int_rank(group_rank, where, arg)
        if not 0 <= group_rank < self.size:
            raise ValueError(f"{self.label}{where}: {arg}={group_rank} is out of range for a group of size {self.size}")
        return int(group_rank)


def _waits(handle: Handle) -> Callable[[int, float], bool]:
    """``handle.wait`` as :meth:`ProcessGroup.run` calls a wait: ``(seq, timeout)`` (the handle has its seq)."""
    return lambda seq, timeout: handle.wait(timeout)


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

    __slots__ = ("call", "done", "group", "handle", "index", "ordered", "peer", "receive", "seq", "slot")

    def __init__(
        self,
        group: ProcessGroup,
        handle: Any,
        call: str,
        seq: int,
        ordered: bool = True,
        slot: int = -1,
        receive: bool = False,
        peer: int = -1,
        index: int = 0,
    ) -> None:
        self.group = group
        self.handle = handle
        self.call = call
        self.seq = seq
        self.ordered = ordered
        self.slot = slot  # the flight recorder's slot of a collective (-1: point-to-point)
        self.receive = receive  # a receive's handle knows its sender (``source``)
        self.done = False
        self.peer = peer  # an isend's or irecv's peer (group rank; -1: any rank, or not point-to-point)
        self.index = index  # ... and which of this rank's sends to (receives from) it this one is (1: the first)

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
        if timeout is None and not group.host and self.handle.defer():
            return True
        seconds = group.timeout if timeout is None else as_seconds(timeout, f"{group.label}{self.call} Work.wait")
        if group.broken is not None:
            group.refuse(self.call)
        if self.ordered:
            group.drain(self, seconds)
        else:
            group.complete(self.call, self.seq, -1, seconds, self.handle.wait)
            self.done = True
        return True

    def is_completed(self) -> bool:
        """True once the operation is complete; never blocks."""
        if not self.done:
            self.done = self.group.test_upto(self) if self.ordered else self.group.complete_if_done(self)
        return self.done

    def progress(self, seconds: float) -> bool:
        """As :meth:`is_completed`, but test for up to ``seconds`` first (never raises a timeout).

        For a thread that drives asynchronous work: MPI moves a transfer only while it is
        tested, one shared-memory cell per test, so a thread that tests between naps moves it slowly.
        """
        if not self.done:
            group = self.group
            self.done = group.test_upto(self, seconds) if self.ordered else group.complete_if_done(self, seconds)
        return self.done

    def source_rank(self) -> int:
        """For ``irecv(src=None)``: the global rank the message came from (waits first)."""
        if not self.receive:
            raise ValueError(f"{self.group.label}{self.call}: source_rank() is only defined for receives")
        self.wait()
        return self.group.ranks[self.handle.source]
