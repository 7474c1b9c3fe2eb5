"""Process groups: their state (sequence numbers, pending work, broken), the one call pipeline, ``Work``, and the
one wait path.

Every call a public function has validated and described (a :class:`~commlib.backends._call.Call`) enters
:meth:`ProcessGroup.call`, which numbers it, records it in the flight recorder, checks it where
``COMMLIB_DEBUG=DETAIL`` asks and hands it to the backend: a blocking call on host memory runs the backend's
ready operation for its description inline (:meth:`ProcessGroup.run_ready`, which the public functions also
enter directly on their fast path), any other call is posted (``Backend.start``) and waited for. Every wait
goes through :meth:`ProcessGroup.complete`: it says where this rank waits (``_diagnostics.waits``, read by
the slow path), waits with a deadline, records the outcome, and on an error or a timeout fences the group off
and raises the error that explains it.
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
from commlib._diagnostics import devicewatch, verdicts
from commlib._diagnostics import flight as _flight
from commlib._diagnostics import waits as _waits
from commlib._timeouts import as_seconds
from commlib.arrays import host_array
from commlib.backends._call import Call
from commlib.backends.base import WATCH_FIRST, Backend, Chained, Handle, ReadyOp, watch_next
from commlib.errors import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    GroupBrokenError,
    RankFailedError,
    TransportError,
)

__all__ = ["ProcessGroup", "Work", "as_seconds"]


def _no_deaths(group: Any, wait: float, look: Any = None) -> CommError | None:
    return None


#: ``dead_members(group, wait, look)``: the ``RankFailedError`` of ``group`` when a member died, waiting up to
#: ``wait`` s for the lifelines to say so (an engine may see a death first); meanwhile ``look(group)`` every 50 ms
#: and its error, if it finds one (what else explains the engine's failure); None when neither did
#: (``commlib._recovery``)
dead_members: Callable[[Any, float, Any], CommError | None] = _no_deaths
_DEATH_GRACE = 0.5


def _digest_difference(group: Any) -> CommError | None:
    """The first call whose digest a peer published differs from this rank's (publishing this rank's), or None."""
    found = devicewatch.compare(group, 0.0)
    return found if isinstance(found, CollectiveMismatchError) else None


_ring = _flight.ring
_now, _starts, _ends, _slots = _flight.now, _ring.starts, _ring.ends, _ring.slots  # hot path: globals
_Waiting = _waits.Waiting


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
        # The backend's ready operations, by the key each public function builds from its arguments (the fast
        # path: see commlib._collectives); None when this group cannot use them.
        self.ready = backend.ready if backend is not None and self.host and not self.detail else None
        if backend is not None and not self.host and rank >= 0 and backend.digests() is not None:
            devicewatch.watch(self)  # the host never waits on the device path: a thread compares the digests

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} ranks={self.ranks} backend={self.backend_name}>"

    @property
    def backend_name(self) -> str:
        return self.backend.name if self.backend is not None else "none"

    # -- the call pipeline ---------------------------------------------------------------------------------
    def call(
        self,
        name: str,
        c: Call,
        inp: Any,
        out: Any,
        async_op: bool = False,
        finish: Callable[[], None] | None = None,
        key: Any = None,
    ) -> Work | None:
        """Number, record, check and run call ``c`` (the public call ``name``, its arguments validated) on the
        caller's arrays ``inp`` and ``out`` (see ``Backend.start``).

        ``finish`` runs once the call completed (copy out of a staging buffer). ``key``: where the public
        function looks the call's ready operation up (its fast path), so the backend lists the one it makes
        there. Returns the ``Work`` of an asynchronous call.
        """
        if self.detail:
            _debug.check(self, name, c)
        b: Any = self.backend
        if not async_op and self.host:
            if self.pending:
                self.drain(None, self.timeout)
            p = b.prepared(c, inp, out, key if self.ready is not None else None)
            if p is not None and p.label is None:  # the runs it completes at once, the backend records
                p.label = (_flight.GroupTag(self.name, tuple(self.ranks)), name, p.call)
            if p is not None and self.run_ready(name, p, inp, out):
                if finish is not None:
                    finish()
                return None
        seq = self.seq + 1
        try:
            handle = b.start(c, inp, out, seq)
        except CommError as e:
            self.seq = seq
            self.fail(name, seq, -1, e)
        self.seq = seq
        if finish is not None:
            handle = Chained(handle, finish)
        if async_op:
            handle.detach()
            work = Work(self, handle, name, seq, slot=_ring.start(self, name, c, seq), desc=c)
            self.pending.append(work)
            return work
        if not self.host and handle.defer():  # device work, as torch's NCCL: the caller's stream waits
            slot = next(_slots)
            _starts[slot] = (self, name, c, seq, t := _now())  # a flight.Record; enqueued is done for the host
            _ends[slot] = t
            return None
        self.complete(name, seq, _ring.start(self, name, c, seq), self.timeout, handle.wait, desc=c)
        return None

    def run_ready(self, name: str, p: ReadyOp, inp: Any, out: Any) -> bool:
        """Number, record and run a blocking call through a ready operation of the backend (``Backend.ready``)
        from ``inp`` into ``out``; False: the arrays are not the operation's (its ``go`` returned None):
        nothing happened, the caller takes the generic path.

        Each of ``inp`` and ``out`` is an array, a list of arrays (scatter's and gather's root lists, in rank
        order) or None (no input; no output on this rank).
        """
        seq = self.seq + 1
        done: bool | BaseException | None
        try:
            done = p.go(inp, out, seq)  # start, a few tests: most small calls end here
        except BaseException as e:
            done = e
        if done is None:
            return False
        self.seq = seq
        if done is True:  # recorded by the backend (the operation's label), with no duration
            return True
        slot = next(_slots)
        _starts[slot] = (self, name, p.call, seq, _now())  # a flight.Record
        self.ready_rest(name, p, out, seq, slot, done if isinstance(done, BaseException) else None)
        return True

    # -- sends and receives: not numbered (the peer's matching call is their check) ------------------------
    def start_p2p(self, name: str, c: Call, inp: Any, out: Any, later: bool = True) -> Handle:
        """Post send or receive ``c`` (counted already; ``later``: waited for later, by its Work); a failure
        fences the group."""
        try:
            handle = self.backend.start(c, inp, out, 0)  # type: ignore[union-attr]
        except CommError as e:
            self.fail(name, 0, -1, e)
        if later:
            handle.detach()
        return handle

    def run_p2p(self, name: str, p: ReadyOp, inp: Any, out: Any, counted: bool = False) -> bool:
        """A blocking send or receive through a ready operation (as :meth:`run_ready`, not numbered nor recorded),
        counted for the closing check unless ``counted``; False: the arrays are not its (nothing happened).
        (``commlib.send`` and ``recv`` inline it.)"""
        done: bool | BaseException | None
        try:
            done = p.go(inp, out, 0)
        except BaseException as e:
            done = e
        if done is None:
            return False
        if not counted:
            (self.sent if p.call.kind == "send" else self.received)[p.call.root] += 1
        if done is not True:
            self.p2p_rest(name, p, out, done, counted=True)
        return True

    def p2p_rest(self, name: str, p: ReadyOp, out: Any, done: Any, counted: bool = False) -> None:
        """:meth:`run_p2p` after a ``go()`` that did not complete (``done`` False: wait, finish) or raised
        (``done``: the exception); counted for the closing check unless ``counted``."""
        c = p.call
        counts = self.sent if c.kind == "send" else self.received
        if not counted:
            counts[c.root] += 1
        exc = done if isinstance(done, BaseException) else None
        self.ready_rest(name, p, out, 0, -1, exc, c.root, counts[c.root])

    def message(
        self, name: str, c: Call, inp: Any, out: Any, key: Any = None, finish: Callable[[], None] | None = None
    ) -> int:
        """A blocking send or receive ``c`` (counted already); returns the peer's group rank (of a receive from
        any rank: the sender's). ``key``: as :meth:`call`'s."""
        if self.host and c.root >= 0:
            p = self.backend.prepared(c, inp, out, key if self.ready is not None else None)  # type: ignore[union-attr]
            if p is not None and self.run_p2p(name, p, inp, out, counted=True):
                if finish is not None:
                    finish()
                return c.root
        handle = self.start_p2p(name, c, inp, out, later=False)
        if not self.host and finish is None and handle.defer():  # as torch's NCCL: the caller's stream waits
            return c.root
        index = (self.sent if c.kind == "send" else self.received)[c.root] if c.root >= 0 else 0
        self.complete(name, 0, -1, self.timeout, handle.wait, c, c.root, index)
        if finish is not None:
            finish()
        return c.root if c.root >= 0 else handle.source  # type: ignore[attr-defined]

    def ready_rest(
        self, name: str, p: ReadyOp, out: Any, seq: int, slot: int, exc: BaseException | None, peer: int = -1,
        index: int = 0,
    ) -> None:  # fmt: skip
        """:meth:`run_ready` after a ``go()`` that did not complete (``exc`` None: wait, finish) or raised ``exc``;
        a send or receive (not numbered: ``seq`` 0, ``slot`` -1; its ``peer`` and ``index``) too."""
        if exc is not None:
            self.fail(name, seq, slot, p.error(exc))
        self.complete(name, seq, slot, self.timeout, _finishing(p, out), desc=p.call, peer=peer, index=index)

    def complete(
        self,
        name: str,
        seq: int,
        slot: int,
        timeout: float,
        wait: Callable[[float], bool],
        desc: Call | None = None,
        peer: int = -1,
        index: int = 0,
    ) -> None:
        """The one wait: ``wait(timeout)``, this thread marked as waiting in call ``name`` #``seq`` (``desc``; a
        send's or receive's ``peer`` and ``index``) meanwhile; record the end in ``slot`` (none if < 0); on
        failure fence the group and raise."""
        before = _waits.enter(_Waiting(self, name, desc, seq, peer, index))
        try:
            try:
                done = wait(timeout)
            except BaseException as e:
                self.fail(name, seq, slot, e)
            if not done:
                self.timed_out(name, seq, slot, timeout)  # still waiting there: its error says what in
        finally:
            _waits.leave(before)
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
            self.complete(work.call, work.seq, work.slot, timeout, work.handle.wait, desc=work.desc)
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
        # published as the call after the last one: a peer still in that call is not in another call, and a peer's
        # slow path sees this rank's digests (where they differ, both end at once, not at the timeout)
        before = _waits.enter(_Waiting(self, call, None, self.seq + 1))
        try:
            rows = self.backend.close_check(self.seq, self.sent, self.received, timeout)
        except CommTimeoutError:
            self.fail_timeout(call, self.seq, timeout)
        except CommError as e:
            self.fail(call, self.seq, -1, e)
        except BaseException as e:  # whatever ended the check, the group cannot be trusted (nor closed) after it
            self.mark_broken(e)
            raise
        finally:
            _waits.leave(before)
        problems = verdicts.closing(self.rank, self.ranks, self.seq, rows, self.received, self.any_received)
        if problems:
            err = CollectiveMismatchError(
                f"{self.label}{call} on group {self.name!r} (ranks {_ranks(self.ranks)}): the ranks did not make the "
                f"same calls: {'; '.join(problems)}" + self.dumped("closing check")
            )
            self.mark_broken(err)
            raise err

    # -- failures ---------------------------------------------------------------------------------
    def fail(self, call: str, seq: int, slot: int, err: BaseException) -> NoReturn:
        """Record the failure of call #``seq``, fence the group off, and raise: a backend's error about a peer
        (its ``peer``: a group rank) worded with this call and that rank's global rank, an engine's error
        explained as ranks that disagree."""
        if slot >= 0:
            _ring.end(slot, self, seq, ok=False)
        device = self.backend is not None and self.backend.digests() is not None
        if type(err) is CommError and self.broken is None and device:  # did a peer fence the group off, saying why?
            notice = devicewatch.peer_gave_up(self)  # (NCCL tells no peer of an abort: the store does)
            if notice is not None:  # the digests' own difference if this rank sees one, else the peer's words
                err = devicewatch.compare(self, 0.0) or notice
        if type(err) is CommError and self.broken is None:  # the engine failed: did a member die (the lifelines)?
            # (or, meanwhile, do the digests the peers published differ from this rank's: then no need to wait)
            err = dead_members(self, _DEATH_GRACE, _digest_difference if device else None) or err
        if isinstance(err, RankFailedError) and self.broken is None:
            self.mark_failed(err)
        if isinstance(self.broken, RankFailedError):
            raise self.rank_failed(call, seq) from None
        if type(err) is CommError and self.backend is not None and self.backend.digests() is not None:
            err = devicewatch.compare(self) or err  # the engine failed (NCCL): do the ranks' calls differ? which?
        if isinstance(err, (CollectiveMismatchError, GroupBrokenError)) and err.peer is not None and not err.context:
            who = self.ranks[err.peer] if 0 <= err.peer < self.size else err.peer
            what = self.what(call, seq)
            out: CollectiveMismatchError | GroupBrokenError
            if isinstance(err, GroupBrokenError):  # a peer's group failed first: say which and why
                out = GroupBrokenError(verdicts.gave_up(what, who, err.reason or ""), peer=err.peer, reason=err.reason)
            else:
                text = verdicts.mismatch(what, who, err.theirs or "", err.mine or "")
                out = CollectiveMismatchError(
                    text + self.dumped(f"mismatch in {call} #{seq}"), peer=err.peer, theirs=err.theirs, mine=err.mine
                )
            out.context = what
            self.mark_broken(out)
            raise out from None
        if isinstance(err, TransportError):  # the engine failed inside the call: the ranks most likely disagree
            out = CollectiveMismatchError(
                verdicts.engine_failure(self.what(call, seq, self._bytes(slot, seq)), self.backend_name, err)
                + self.dumped(f"mismatch in {call} #{seq}")
            )
            self.mark_broken(out)
            raise out from err
        if type(err) is CommError:  # the engine's own words: say which call
            failed = CommError(f"{self.what(call, seq)} failed: {err}; the group is now unusable")
            self.mark_broken(failed)
            raise failed from err
        self.mark_broken(err)
        raise err

    def _bytes(self, slot: int, seq: int) -> str:
        """``, N bytes on this rank``: call #``seq``'s, where its record in ``slot`` says."""
        r = _ring.record(slot) if slot >= 0 else None
        if r is None or r.group is not self or r.seq != seq or r.desc is None or r.desc.dtype is None:
            return ""
        return f", {r.desc.nbytes()} bytes on this rank"

    def fail_timeout(self, call: str, seq: int, timeout: float) -> NoReturn:
        """Mark the group broken and raise the ``CommTimeoutError`` that says what was waited for."""
        from commlib._diagnostics import watchdog

        arrived, differ = watchdog.arrival(self, call, seq, timeout)
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

    def mark_broken(self, err: BaseException) -> None:
        """Fence the group off: every later call on it raises ``GroupBrokenError`` from ``err``."""
        if self.broken is None:
            self.broken, self.ready = err, None
            if self.backend is not None:
                if self.backend.digests() is not None:  # a device communicator tells no peer: the store does
                    devicewatch.gave_up(self, f"{type(err).__name__}: {err}")
                self.backend.abort(f"{type(err).__name__}: {err}")

    def mark_failed(self, err: RankFailedError) -> None:
        """A member died (``err``, from the lifelines' thread): fence the group off without telling anyone (the
        survivors know; the dead cannot hear), unblocking device work stuck on the dead (see ``Backend.abandon``)."""
        if self.broken is None:
            self.broken, self.ready = err, None
            if self.backend is not None:
                self.backend.abandon(str(err))

    def rank_failed(self, call: str, seq: int) -> RankFailedError:
        """The error of call ``call`` #``seq`` on a group a member of which died (``broken`` says who)."""
        b = self.broken
        assert isinstance(b, RankFailedError)
        what = self.what(call, seq)
        err = RankFailedError(f"{what}: {b.detail}", failed_ranks=b.failed_ranks, global_ranks=b.global_ranks)
        err.detail, err.context = b.detail, what
        return err

    def refuse(self, call: str) -> NoReturn:
        """Raise the error for a call on a group that cannot take it (broken, or not a member)."""
        if isinstance(self.broken, RankFailedError):
            raise self.rank_failed(call, 0) from None
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


def _finishing(p: ReadyOp, out: Any) -> Callable[[float], bool]:
    """A ready operation's wait for the run its ``go()`` left running, then its ``finish(out)``; the engine's
    errors as the operation says (``p.error``)."""

    def wait(timeout: float) -> bool:
        try:
            if not p.wait(timeout):
                return False
            p.finish(out)
        except BaseException as e:
            raise p.error(e) from None
        return True

    return wait


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

    __slots__ = ("call", "desc", "done", "group", "handle", "index", "ordered", "peer", "receive", "seq", "slot")

    #: seconds a wait for a Work lasts before its first :meth:`watch` (another loop's wait: torch's Work)
    FIRST_LOOK = WATCH_FIRST

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
        desc: Call | None = None,
    ) -> None:
        self.group = group
        self.handle = handle
        self.call = call
        self.desc = desc  # the call's description
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
            group.complete(self.call, 0, -1, seconds, self.handle.wait, self.desc, self.peer, self.index)
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

    def watch(self, waited: float) -> float:
        """The slow path of a wait for this Work that another loop drives (torch's Work, its progress thread):
        say where this rank waits, and raise as a wait of commlib's would (the group fenced off) when no call
        can complete or a peer failed. ``waited``: seconds waited so far (first: :attr:`FIRST_LOOK`); returns
        the seconds waited at which to watch next (as commlib's own waits do)."""
        from commlib.backends import base

        group = self.group
        if self.done or base.watchdog is None:
            return watch_next(waited)
        if group.broken is not None:
            group.refuse(self.call)
        try:
            base.watchdog(waited, _Waiting(group, self.call, self.desc, self.seq, self.peer, self.index))
        except BaseException as e:
            group.fail(self.call, self.seq, self.slot, e)
        return watch_next(waited)

    def source_rank(self) -> int:
        """For ``irecv(src=None)``: the global rank the message came from (waits first)."""
        if not self.receive:
            raise ValueError(f"{self.group.label}{self.call}: source_rank() is only defined for receives")
        self.wait()
        return self.group.ranks[self.handle.source]
