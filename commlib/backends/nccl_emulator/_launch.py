"""How the NCCL emulator launches operations: on streams, in groups, and in place.

Between ``groupStart()`` and ``groupEnd()`` (nesting counted per thread)
operations are only collected; the outermost ``groupEnd()`` launches them
together as one unit: all are posted, then all completed (see ``_ops``). A unit
normally runs on its stream's worker thread. A small unit on an idle stream
runs in place instead: the caller posts it (its frames fit the socket buffers,
so the sends do not block), and whichever thread fills its last receive
completes it and advances the stream: usually the host waiting for it, which
reads the reply itself (``drive``), else a link's receiver thread. That saves
the hand-offs to and from the worker and the receiver thread (each a futex wake
plus a GIL transfer, tens of microseconds), which were most of a small
collective's latency. Order, results, errors and deadlines are the same on both
paths; the worker only guards the deadline of a unit run in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, cast

from ._errors import INTERNAL_ERROR, INVALID_USAGE, REMOTE_ERROR, NcclError
from ._mailbox import Mailbox
from ._ops import Channel, Op
from ._streams import Stream


class Core(Channel, Protocol):
    """What launching needs from an operation's communicator, beyond what the operation itself needs."""

    mailbox: Mailbox

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def check_runnable(self) -> None: ...
    def fail(self, error: NcclError) -> None: ...
    def can_send_now(self) -> bool: ...
    def want(self, peers: set[int], delta: int) -> None: ...
    def pump(self, peer: int, stop: Callable[[], bool], until: float | None) -> bool: ...


def _core(op: Op) -> Core:
    """The communicator ``op`` runs on (a ``CommCore``, which is all of ``Core``)."""
    return cast(Core, op.comm)


__all__ = ["execute", "group_end", "group_start", "submit"]

_group = threading.local()


def _group_ops() -> list[tuple[Op, Stream]]:
    if not hasattr(_group, "ops"):
        _group.depth, _group.ops = 0, []
    return _group.ops


def group_start() -> None:
    """Start collecting operations (nesting is counted per thread)."""
    _group_ops()
    _group.depth += 1


def group_end(timeout: float) -> None:
    """Close one group level; the outermost launches everything collected."""
    ops = _group_ops()
    if _group.depth == 0:
        raise NcclError(INVALID_USAGE, "groupEnd() without a matching groupStart()")
    _group.depth -= 1
    if _group.depth == 0 and ops:
        _group.ops = []
        _launch(ops, timeout)


def submit(op: Op, stream: Stream, timeout: float) -> None:
    """Launch ``op`` on ``stream`` now, or at the outermost groupEnd() if a group is open."""
    ops = _group_ops()
    if _group.depth > 0:
        ops.append((op, stream))
    else:
        _launch([(op, stream)], timeout)


def _launch(items: list[tuple[Op, Stream]], timeout: float) -> None:
    """Run the operations as one unit on the first one's stream; the other streams join it before and after."""
    lead = items[0][1]
    others = [s for s in dict.fromkeys(stream for _, stream in items) if s is not lead] if len(items) > 1 else []
    ops = [op for op, _ in items]
    for op in ops:
        _core(op).begin()
    if not others and lead.ptr != 0 and _InPlace.start(ops, lead, timeout):
        return
    for stream in others:
        lead.wait_event(stream.record())
    if lead.ptr == 0:
        error = execute(ops, timeout)
        if error is not None:
            raise error
    else:
        lead.enqueue(lambda: execute(ops, timeout))
    done = lead.record()
    for stream in others:
        stream.wait_event(done)


def execute(ops: list[Op], timeout: float) -> NcclError | None:
    """Post every operation, then complete them; return the first error (each is stored on its communicator)."""
    deadline = time.monotonic() + timeout
    errors: list[NcclError] = []
    try:
        posted = [op for op in ops if _guarded(op, op.post, errors)]
        helpers = []
        for op in posted:
            step = lambda op=op: _guarded(op, lambda: op.finish(deadline), errors)  # noqa: E731
            if op.multi_phase and len(ops) > 1:  # it sends while completing: must not wait behind the others
                helpers.append(threading.Thread(target=step, name="nccl-emulator-group", daemon=True))
                helpers[-1].start()
            else:
                step()
        for helper in helpers:
            helper.join()
    finally:
        for op in ops:
            _core(op).end()
    return errors[0] if errors else None


def _guarded(op: Op, step, errors: list[NcclError]) -> bool:
    """Run one step of ``op``; on failure break its communicator and record the error."""
    try:
        _core(op).check_runnable()
        step()
        return True
    except Exception as exc:
        error = _as_nccl_error(exc)
        op.abandon()
        _core(op).fail(error)
        errors.append(error)
        return False


def _as_nccl_error(exc: Exception) -> NcclError:
    return exc if isinstance(exc, NcclError) else NcclError(INTERNAL_ERROR, f"emulator bug: {exc!r}")


class _InPlace:
    """A unit run in place: posted by the caller, completed by the thread that fills its last receive.

    Its communicator's mailbox tells it exactly once: ``ready()`` (every receive is
    filled), or ``failed(error)`` (one never will be: the communicator broke, a peer
    left, or ``expire()`` found the deadline passed).
    """

    def __init__(self, ops: list[Op], stream: Stream, deadline: float) -> None:
        self.ops, self.stream, self.deadline = ops, stream, deadline
        self.comm = _core(ops[0])
        self.expired = False  # read by the mailbox when it is told to watch
        self.expiring = False  # set by the stream's worker
        self._posting = True
        self._told = False
        self._peer: int | None = None  # the one peer all replies come from, if there is one
        self._wanted: set[int] = set()  # else the peers whose receiver threads must read for it

    @classmethod
    def start(cls, ops: list[Op], stream: Stream, timeout: float) -> bool:
        """Run ``ops`` in place if they are small, of one communicator, and ``stream`` is idle (else False)."""
        comm = _core(ops[0])
        for op in ops:
            if op.comm is not comm or not op.eager:
                return False
        if not comm.can_send_now():
            return False
        unit = cls(ops, stream, time.monotonic() + timeout)
        if not stream.start_in_place(unit):
            return False
        try:
            for op in ops:
                comm.check_runnable()
                op.post()
        except Exception as exc:
            unit.failed(_as_nccl_error(exc))
            return True
        finally:
            unit._posting = False
        slots = [slot for op in ops for slot in op.awaited()]
        peers = {peer for peer, _ in slots}
        if len(peers) == 1:
            unit._peer = peers.pop()
        else:  # a waiting host reads one link only: the receiver threads read the others at once
            unit._wanted = peers
            comm.want(peers, 1)
        comm.mailbox.watch(unit, slots)
        return True

    def drive(self, until: float | None) -> bool:
        """Read the replies in this thread (a host waiting for the unit) until it is told, or ``until``.

        False if that cannot be done here: it is told already, its replies come from several
        peers, or another thread reads them (then that thread delivers them).
        """
        if self._told or self._peer is None:
            return False
        return self.comm.pump(self._peer, lambda: self._told, until)

    def ready(self) -> None:
        """Every receive is filled: complete the operations (nothing blocks now) and advance the stream."""
        self._told = True
        try:
            for op in self.ops:
                op.received()
                self.comm.check_runnable()
                op.finish(self.deadline)
        except Exception as exc:
            self.failed(_as_nccl_error(exc))
            return
        self._end()

    def failed(self, error: NcclError) -> None:
        """Break the communicator with ``error`` (the first error wins), as a failed step on the worker does."""
        self._told = True
        for op in self.ops:
            op.abandon()
        self.comm.fail(error)
        self._end()

    def expire(self) -> None:
        """The deadline passed (called on the stream's worker): fail the unit unless it is done."""
        self.expired = True
        error = self.comm.mailbox.unwatch(self)
        if error is not None:
            self.failed(error)
        elif self._posting:  # a send is stuck (the peer stopped reading): cutting the links makes it fail
            self.comm.fail(NcclError(REMOTE_ERROR, "timed out sending: a peer does not read (stopped?)"))

    def _end(self) -> None:
        if self._wanted:
            self.comm.want(self._wanted, -1)
        for _ in self.ops:  # one end() per begin()
            self.comm.end()
        self.stream.finish_in_place()
