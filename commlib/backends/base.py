"""The backend contract: everything a backend provides, in one class. Read this file to write a backend.

A backend moves bytes between the ranks of one communicator with NCCL's semantics. commlib's group layer
(``commlib._group`` and the public functions above it) validates every argument first and describes each call
once (:class:`commlib.backends._call.Call`), so a backend is only ever asked to run a call whose buffers are
contiguous arrays of its array module (:attr:`Backend.xp`), of a dtype in ``commlib.arrays.DTYPES``, produced
by :meth:`Backend.array`, of the sizes the description says; whose ranks (root, peer) are ranks of *this*
communicator, already range-checked; and whose reduce op :meth:`Backend.unsupported` and
``commlib.arrays.op_error`` accepted for the dtype.

How a call runs is the backend's to decide: :meth:`Backend.start` posts any call and returns a
:class:`Handle`; a host backend may also keep ready operations (:meth:`Backend.prepared`, a
:class:`ReadyOp` run again and again for calls of one description) that the group layer runs inline.

Completion: nothing blocks without a deadline. A handle keeps the buffers it reads or writes alive until it
has completed; the caller must not touch a receive buffer (nor change a send buffer) before then. A handle
whose operation failed raises ``commlib.CommError`` from ``test``/``wait``: ``CollectiveMismatchError``
(with ``peer``, ``theirs`` and ``mine``) for a peer's message of another call, ``GroupBrokenError`` (with
``peer`` and ``reason``) when a peer gave up on the group, ``TransportError`` for what the engine reported;
a wait that runs out of time returns False and leaves the operation running (the group layer then calls
:meth:`Backend.abort` and refuses the group from then on).

Errors: a backend raises ``CommError`` (or a subclass) for what went wrong between ranks and
``TypeError``/``ValueError`` only for what the group layer cannot know (e.g. NCCL cannot receive from any
source); it never prints, and never hangs.
"""

from __future__ import annotations

import abc
import hashlib
import os
import time
import zlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, Protocol

import numpy as np

from commlib._ops import ReduceOp
from commlib.arrays import host_array, to_host
from commlib.backends._call import Call
from commlib.backends._digests import Digests
from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError

__all__ = [
    "DONE",
    "SLOW_BYTES_PER_S",
    "WATCH_EVERY",
    "WATCH_FIRST",
    "AllOf",
    "Backend",
    "Chained",
    "Done",
    "Handle",
    "Meeting",
    "MeetingTimeout",
    "ReadyOp",
    "poll",
    "watch_next",
]

_SPIN = 32  # polls between clock reads: a clock read costs about as much as a poll
_YIELD_AFTER = 0.0005  # seconds of pure spinning before yielding the core (ranks may outnumber cores)
# Seconds before backing off to short sleeps: a wait this long is for a peer (the data's own time is ``busy``), and
# a rank that yields in a loop still takes the core that peer may need (ranks outnumbering cores, other jobs). It
# was 50 ms: a 115-test subset of the suite on 2 cores, A/B, 2 alternating runs, took 0.92x the CPU at 2 ms.
_SLEEP_AFTER = 0.002
WATCH_FIRST, WATCH_EVERY = 0.05, 0.5  # a long wait calls the watchdog first after this, then (see watch_next)


def watch_next(waited: float) -> float:
    """When a wait that has lasted ``waited`` s calls its watchdog next: at twice that, at most WATCH_EVERY later
    (0.05, 0.1, 0.2, 0.4, 0.8, 1.3, ... s: a mismatch is named within a few tenths of a second, and a wait
    that lasts reads the store at most twice a second)."""
    return waited + min(max(waited, WATCH_FIRST), WATCH_EVERY)


#: Called as ``watchdog(seconds_waited)`` by long waits (commlib's slow path, ``_diagnostics.watchdog``, sets it):
#: it may publish where this rank waits and raise ``CommError`` when no call can complete or another rank has
#: reported a failure.
watchdog: Callable[..., None] | None = None

#: Tags above :attr:`Backend.max_tag` that carry commlib's own point-to-point traffic (TAG_FAIL: a rank's
#: notice that it gave up on the group, see :meth:`Backend.abort`).
TAG_MEET, TAG_COMPOSED, TAG_FAIL = 1, 2, 3
RESERVED_TAGS = 3


class Meeting(Protocol):
    """What carries a meeting of ranks (:meth:`Backend.rendezvous`): a backend, or the job's store."""

    def rendezvous(self, ranks: list[int], timeout: float, payload: bytes = b"", what: str = "group setup") -> bytes:
        """Meet the other ``ranks``; return ``ranks[0]``'s ``payload``; :class:`MeetingTimeout` naming who is late."""


def setup_timeout(did: str, seconds: float) -> CommTimeoutError:
    """The error of a communicator's setting up that not every rank reached in time (the words a stalled
    shrink's watchdog prints too): "not every rank {did} within {seconds} s"."""
    return CommTimeoutError(not_every_rank(did, seconds))


def not_every_rank(did: str, seconds: float) -> str:
    return f"not every rank {did} within {seconds:g} s"


def ranks_checksum(ranks: list[int]) -> np.ndarray:
    """What every rank all-reduces (MAX) before it makes a group of ``ranks``: ``[crc, -crc]`` of the list."""
    crc = zlib.crc32(repr(ranks).encode())
    return np.array([crc, -crc], np.int64)


def check_same_ranks(ranks: list[int], extremes: Any) -> None:
    """After that all-reduce: ``CollectiveMismatchError`` on every rank when the ranks asked for different groups
    (the largest checksum is not the negated smallest)."""
    high, low = (int(v) for v in extremes)
    if high != -low:
        raise CollectiveMismatchError(
            f"the ranks asked for different groups (this rank: ranks={ranks}); every rank must pass the same ranks"
        )


class MeetingTimeout(CommTimeoutError):
    """:meth:`Backend.rendezvous` timed out; ``missing``: the ranks that never arrived (on ``ranks[0]`` only)."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = missing


class Handle(Protocol):
    """Completion of one backend operation. Receive handles also have ``source``: the sender's rank."""

    def test(self) -> bool:
        """Return True once the operation (and its completion step) is done; never blocks."""

    def wait(self, timeout: float) -> bool:
        """Block until done (True) or until ``timeout`` seconds have passed (False)."""

    def defer(self) -> bool:
        """Device work: make the caller's current stream wait for it, without blocking the host (True).

        False when the host must wait instead (host backends; work with a host-side completion step).
        """

    def detach(self) -> None:
        """The caller will wait for this operation later (an asynchronous call), right after posting it: keep
        what its completion needs (a device backend records an event of its own); host handles do nothing."""


class ReadyOp(Protocol):
    """A ready operation: one call's description run again and again, inline by the group layer
    (:meth:`commlib._group.ProcessGroup.run_ready`), for blocking calls on host memory.

    A call: :attr:`go` with the caller's input and output and the call's sequence number; if it returned
    False, :meth:`wait`, then (if that returned True) :meth:`finish`. An exception raised by any of them goes
    through :meth:`error` first.
    """

    #: the description of the calls it runs (what the group layer records)
    call: Call

    #: what the flight record says of each run :attr:`go` completes, with its sequence number and time: the
    #: group layer sets it (its group's name and ranks, the public call, :attr:`call`) when it first lists the
    #: operation; the backend keeps those records (the mpi backend's: ``_steps.executed``). None: no record.
    label: Any

    #: ``go(inp, out, seq) -> bool | None``: start one run on the caller's input and output (the previous run is
    #: complete), test it a few hundred times; True: complete, the result in ``out``; False: still running;
    #: None: these arrays are not the operation's (another dtype of the same byte count, not contiguous, not
    #: writable): nothing happened. Never blocks. ``inp`` (scatter's root) and ``out`` (gather's root) may be
    #: lists of arrays of one shape, in rank order. An attribute (the mpi backend's is a C method where it was
    #: built), called as a method.
    go: Callable[[Any, Any, int], bool | None]

    def wait(self, timeout: float) -> bool:
        """Block until the run :attr:`go` left running is complete (True) or ``timeout`` seconds pass (False:
        it is never started again)."""

    def finish(self, out: Any) -> None:
        """After a :meth:`wait` that returned True: complete the run into ``out``."""

    def error(self, exc: BaseException) -> BaseException:
        """The exception to raise for ``exc`` (raised by the backend's engine in a run)."""


#: A wait keeps testing without sleeps while its data may still be moving at this rate (MPI moves a
#: large transfer only while it is tested, one 16 KiB shared-memory cell per test).
SLOW_BYTES_PER_S = 100e6


def poll(
    test: Callable[[], bool], timeout: float, busy: float = 0.0, slow: Callable[[float], None] | None = None
) -> bool:
    """Call ``test`` until it returns True (then True) or ``timeout`` seconds pass (then False).

    Spins first (the latency of small messages is a few microseconds), then
    yields the core, then sleeps briefly, so a long wait neither adds latency to
    fast operations nor starves a peer rank sharing the core. ``busy``: seconds
    the data may take to move (see :data:`SLOW_BYTES_PER_S`); no sleeps before
    then. Past 0.05 s it also calls ``slow(waited)`` (the operation's own slow-path check, which may raise)
    and :data:`watchdog`, then again at the times :func:`watch_next` gives.
    """
    start, watch_at = None, WATCH_FIRST
    sleep_after = busy if busy > _SLEEP_AFTER else _SLEEP_AFTER
    while True:
        for _ in range(_SPIN):
            if test():
                return True
        now = time.monotonic()
        if start is None:
            start = now
            continue
        waited = now - start
        if waited > timeout:
            return test()
        if waited > sleep_after:
            time.sleep(0.0002)
        elif waited > _YIELD_AFTER:
            os.sched_yield()
        if waited > watch_at:
            watch_at = watch_next(waited)
            if slow is not None:
                slow(waited)
            if watchdog is not None:
                watchdog(waited)


class Done:
    """A handle for work that finished when it was issued (e.g. a size-1 group)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True

    def defer(self) -> bool:
        return True

    def detach(self) -> None:
        return None


DONE = Done()


class Chained:
    """A handle that runs ``finish()`` once, after ``inner`` completes (copy-out, rounding, averaging)."""

    __slots__ = ("finish", "inner")

    def __init__(self, inner: Handle, finish: Callable[[], None]) -> None:
        self.inner = inner
        self.finish: Callable[[], None] | None = finish

    def _done(self) -> bool:
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()
        return True

    def test(self) -> bool:
        return self.inner.test() and self._done()

    def wait(self, timeout: float) -> bool:
        return self.inner.wait(timeout) and self._done()

    def defer(self) -> bool:
        return False  # finish() runs on the host, after completion

    def detach(self) -> None:
        self.inner.detach()

    @property
    def source(self) -> int:
        """A receive's sender (the inner handle's)."""
        return self.inner.source  # type: ignore[attr-defined]


class AllOf:
    """A handle that completes when every one of ``handles`` has (composed operations, p2p batches)."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def test(self) -> bool:
        # Drop finished handles so each is tested (and its completion step run) once.
        self.handles = [h for h in self.handles if not h.test()]
        return not self.handles

    def wait(self, timeout: float) -> bool:
        return self.test() or poll(self.test, timeout)

    def defer(self) -> bool:
        return all([h.defer() for h in self.handles])  # every one asked: the stream waits for all that can

    def detach(self) -> None:
        for h in self.handles:
            h.detach()


def _frame(payload: bytes) -> np.ndarray:
    if len(payload) > 240:
        raise ValueError(f"rendezvous payload of {len(payload)} bytes; at most 240")
    out = np.zeros(256, np.uint8)
    out[0] = len(payload)
    out[1 : 1 + len(payload)] = np.frombuffer(payload, np.uint8)
    return out


def _unframe(buf: np.ndarray) -> bytes:
    return bytes(buf[1 : 1 + int(buf[0])])


def _offsets(counts: tuple[int, ...] | list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _parts(buf: Any, counts: list[int]) -> list[Any]:
    """``buf`` as one part per rank: the arrays of a list as they are, else consecutive views of ``counts``."""
    if isinstance(buf, list):
        return buf
    flat = buf.reshape(-1)
    return [flat[o : o + c] for o, c in zip(_offsets(counts), counts, strict=True)]


class Backend(abc.ABC):
    """One communicator of one engine. Subclass it, set the attributes, implement the abstract methods.

    Attributes every backend sets (class or instance):

    - ``name``: what ``commlib.get_backend()`` reports (``"mpi"``, ``"nccl"``).
    - ``rank``, ``size``: this process's rank in the communicator, and its size.
    - ``host``: True when buffers live in host memory (numpy); False for device memory, whose
      handles then implement ``defer()``.
    - ``xp``: the array module of the buffers (numpy, cupy).
    - ``max_tag``: the largest tag a user may pass to send/recv; the :data:`RESERVED_TAGS`
      above it carry commlib's own p2p traffic (rendezvous: group setup, monitored barrier; compositions).
    - ``any_source``: whether a receive takes ``call.root == -1`` (from any rank).
    - ``ready``: the ready operations the group layer runs inline (see :meth:`prepared`), by the key it gave;
      None: the backend has none.
    - ``ordered_p2p``, ``terminate``: see below.
    """

    name: ClassVar[str]
    rank: int
    size: int
    host: bool = True
    xp: ModuleType = np
    max_tag: int
    any_source: bool = True
    ready: dict[Any, ReadyOp] | None = None
    #: a rank's sends and receives run in the order they were posted (NCCL's stream): a ring of blocking sends
    #: deadlocks unless they are posted together (``batch_isend_irecv``); False: they may complete in any order
    ordered_p2p: bool = False
    #: ``terminate()`` ends every process of the job at once (MPI_Abort), for a rank whose exception was
    #: uncaught; None: the engine cannot, and the launcher ends the job when this process exits
    terminate: Callable[[], None] | None = None
    #: :meth:`close` tells the peers this rank is done, and must run for the default group too (at
    #: ``destroy_process_group`` and at the program's end): a communicator left open ends, when the process
    #: exits, as a death does (NCCL's links), failing a peer still finishing its last call; False: the engine
    #: ends it (MPI_Finalize)
    goodbye: ClassVar[bool] = False

    # -- arrays ---------------------------------------------------------------------------------
    def array(self, obj: object, ctx: Any, call: str, arg: str, writable: bool = True) -> Any:
        """``obj`` as this backend's array, sharing memory, or a ``TypeError``/``ValueError`` naming ``arg``.

        ``ctx.label`` prefixes messages (``"[rank 1/4] "``). The default takes host memory
        (``commlib.arrays.host_array``); device backends use ``commlib.arrays.device_array``.
        """
        return host_array(obj, ctx, call, arg, writable)

    def unsupported(self, dtype: np.dtype, op: ReduceOp) -> str | None:
        """Why this backend cannot reduce ``dtype`` with ``op`` (None when it can; the default)."""
        return None

    # -- calls ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self, call: Call, inp: Any, out: Any, seq: int) -> Handle:
        """Post ``call`` (number ``seq`` on the group; 0 for a send or receive) on the caller's arrays.

        What each kind reads and writes (``call.root`` is a group rank; a send's or receive's peer, -1: any):

        - all_reduce, broadcast, reduce: ``inp`` and ``out`` are the same array (in place); reduce leaves it
          unchanged off the root; AVG is the sum divided by ``size`` (integers: truncating toward zero).
        - all_gather: ``out`` holds every rank's ``inp`` in rank order; ``inp`` None: this rank's chunk of
          ``out`` holds it already (in place).
        - reduce_scatter: ``inp`` holds ``size`` chunks of ``out``'s size; chunk ``rank`` of the result goes to
          ``out``.
        - all_to_all: block p of ``inp`` to rank p, rank p's block into block p of ``out`` (``call.splits``: the
          blocks' element counts, sent and received; else ``call.count`` each).
        - gather: every rank's ``inp`` into chunk p of the root's ``out`` (None elsewhere); scatter the other
          way round. The root's may be a list of arrays, one per rank, in rank order.
        - barrier: no arrays. send: ``inp``; recv: ``out`` (its handle has ``source``, the sender's rank).

        ``seq`` is the same on every rank that makes the same call: a backend puts it (and the description) in
        its messages or its check, so that ranks making different calls end in an error, not in wrong data.
        """

    def prepared(self, call: Call, inp: Any, out: Any, key: Any) -> ReadyOp | None:
        """A ready operation for blocking calls described by ``call`` on arrays like ``inp`` and ``out``, or
        None (the group layer then uses :meth:`start`). ``key``: where to list it in :attr:`ready` (None: not
        at all), until the backend frees it. The default: None."""
        return None

    def digests(self) -> Digests | None:
        """The running digests of this rank's calls, for a backend whose check compares them off its engine's
        path (the nccl backend: see ``commlib.backends._digests``); the slow path publishes and compares them.
        None (the default): the backend checks each call itself (the mpi backend's stamps)."""
        return None

    def group_start(self) -> None:
        """Open a p2p group: the sends and receives until :meth:`group_end` may be posted in any order.

        The default does nothing: right for engines whose nonblocking p2p never deadlocks on order (MPI).
        """
        return None  # a documented no-op default, not a forgotten abstract method

    def group_end(self) -> None:
        """Close the p2p group opened by :meth:`group_start` (NCCL posts the whole group here)."""
        return None

    def _message(self, buf: Any, peer: int, receive: bool, tag: int = -1) -> Handle:
        """One send (receive) of ``buf`` to (from) ``peer``: commlib's own traffic, with a reserved tag."""
        kind = "recv" if receive else "send"
        call = Call(kind, buf.dtype, buf.size, root=peer, tag=self.max_tag + TAG_COMPOSED if tag < 0 else tag)
        return self.start(call, None if receive else buf, buf if receive else None, 0)

    def compose(self, call: Call, inp: Any, out: Any) -> Handle:
        """all_to_all, gather, scatter (or all_gather into a list) as sends and receives in one p2p group, for
        engines without them: this rank's own block copied, every other one sent or received straight from or
        into its place (a list's arrays, or consecutive blocks of one array)."""
        me, n, root, count = self.rank, self.size, call.root, call.count
        nothing: list[Any] = [None] * n
        if call.kind == "all_to_all":
            counts = call.splits or ((count,) * n, (count,) * n)
            sends, recvs = _parts(inp, list(counts[0])), _parts(out, list(counts[1]))
        elif call.kind == "all_gather":
            sends, recvs = [inp] * n, _parts(out, [count] * n)
        elif call.kind == "gather":
            sends = [inp if p in (root, me) else None for p in range(n)] if me != root else [*nothing]
            recvs = _parts(out, [count] * n) if me == root else [*nothing]
            sends[me] = inp
        else:  # scatter
            sends = _parts(inp, [count] * n) if me == root else [*nothing]
            recvs = [out if p in (root, me) else None for p in range(n)] if me != root else [*nothing]
            recvs[me] = out
        if sends[me] is not None and recvs[me] is not None:
            recvs[me].reshape(-1)[...] = sends[me].reshape(-1)
        handles = []
        self.group_start()
        try:
            for p in range(n):
                if p != me and sends[p] is not None:
                    handles.append(self._message(sends[p], p, receive=False))
                if p != me and recvs[p] is not None:
                    handles.append(self._message(recvs[p], p, receive=True))
        finally:
            self.group_end()
        return AllOf(handles)

    def close_check(self, seq: int, sent: list[int], received: list[int], timeout: float) -> list[tuple[int, int, int]]:
        """The group's last exchange (``destroy_process_group``, the program's end): this rank made ``seq``
        collectives, sent ``sent[p]`` messages to rank p and received ``received[p]`` from it. Returns, for
        every rank p, (its collectives, its messages sent to this rank, received from this rank) (this rank's
        own row: anything). The default all-gathers the counts."""
        n = self.size
        mine = self.xp.asarray(np.array([seq, *sent, *received], np.int64))
        everyone = self.xp.zeros(n * (1 + 2 * n), np.int64)
        if not self.start(Call("all_gather", mine.dtype, mine.size), mine, everyone, 0).wait(timeout):
            raise CommTimeoutError(f"not every rank ended its calls within {timeout:g} s")
        rows = to_host(everyone).reshape(n, 1 + 2 * n)
        me = self.rank
        return [(int(r[0]), int(r[1 + me]), int(r[1 + n + me])) for r in rows]

    def close_failed(self, seq: int) -> None:
        """The group failed on this rank (after ``seq`` collectives) and skips its closing check: a backend that
        can tells the others at once, so their checks end with an error instead of a timeout. Never blocks. The
        default does nothing (the others time out)."""
        return None

    # -- communicators ----------------------------------------------------------------------------
    def rendezvous(self, ranks: list[int], timeout: float, payload: bytes = b"", what: str = "group setup") -> bytes:
        """Meet the other ``ranks`` of this communicator (only they call it); return ``ranks[0]``'s ``payload``.

        Each member tells ``ranks[0]`` it has arrived, with a digest of ``what`` and ``ranks`` so
        two different meetings never mix; once all have, ``ranks[0]`` answers each with its
        ``payload`` (at most 240 bytes). Raises :class:`MeetingTimeout` saying who was missing.
        """
        digest = hashlib.blake2b(f"{what} {ranks}".encode(), digest_size=16).digest()
        leader, tag, xp = ranks[0], self.max_tag + TAG_MEET, self.xp
        if self.rank != leader:
            arrived = self._message(xp.asarray(np.frombuffer(digest, np.uint8)), leader, False, tag)
            answer = xp.zeros(256, np.uint8)
            if not self._message(answer, leader, True, tag).wait(timeout):
                raise MeetingTimeout(f"rank {leader} did not answer within {timeout:g} s ({what} of ranks {ranks})")
            arrived.wait(timeout)  # received, since it was answered: completed, its request freed (no MPI leak)
            return _unframe(to_host(answer))
        arrivals = {p: (self._message(buf := xp.zeros(16, np.uint8), p, True, tag), buf) for p in ranks[1:]}
        start = time.monotonic()
        poll(lambda: all(h.test() for h, _ in arrivals.values()), timeout)
        missing = [p for p, (h, _) in arrivals.items() if not h.test()]
        if missing:
            waited = time.monotonic() - start
            raise MeetingTimeout(
                f"ranks {missing} did not arrive within {waited:.3g} s ({what} of ranks {ranks})", missing
            )
        strangers = [p for p, (_, buf) in arrivals.items() if bytes(to_host(buf)) != digest]
        if strangers:
            raise CommError(f"ranks {strangers} were not in {what} of ranks {ranks} (a mismatched program?)")
        framed = xp.asarray(_frame(payload))
        answers = [self._message(framed, p, False, tag) for p in ranks[1:]]
        poll(lambda: all(h.test() for h in answers), timeout)
        return payload

    @abc.abstractmethod
    def split(self, ranks: list[int], timeout: float) -> Backend | None:
        """The sub-communicator of ``ranks`` (in that order); every rank of this one calls it.

        Returns None on ranks outside ``ranks``; raises ``CommTimeoutError`` when a rank does
        not call within ``timeout`` seconds.
        """

    @abc.abstractmethod
    def create_group(self, ranks: list[int], timeout: float) -> Backend:
        """The sub-communicator of ``ranks`` (in that order); only those ranks call it.

        torch's ``use_local_synchronization=True``. Raises ``CommTimeoutError`` when a member
        does not call within ``timeout`` seconds.
        """

    @abc.abstractmethod
    def abort(self, reason: str = "") -> None:
        """Fence the communicator off after a failure (``reason``: what failed, in words): unblock what waits on
        a dead peer, and tell the other ranks, as far as the engine can. Never blocks."""

    def abandon(self, reason: str = "") -> None:
        """A peer died (``reason``): fence the communicator off without telling anyone (every survivor learns of
        the death by itself; a message to the dead may never leave), unblocking what waits on the dead, from
        any thread; never free it afterwards (an engine may still use what it references). Never blocks.
        Default: :meth:`abort`."""
        self.abort(reason)

    def shrink_payload(self) -> Any:
        """What the survivors' lowest rank gives the others for :meth:`shrink` (a new communicator's unique
        id, as text): JSON-able. Default: None."""
        return None

    def shrink(self, keep: list[int], key: int, timeout: float, payload: Any, died: bool) -> Backend:
        """The communicator of ranks ``keep`` (in that order), made by them alone from this one whose other
        ranks died or were excluded (``commlib.shrink_group``, after the survivors agreed on ``keep``):
        ``key`` differs for each attempt, ``payload`` is :meth:`shrink_payload` of ``keep[0]``, ``died``: some
        of the others died (the same on every survivor). A backend that cannot raises ``NotImplementedError``
        (the default)."""
        raise NotImplementedError(f"backend {self.name!r} cannot shrink a communicator")

    def grow_payload(self) -> Any:
        """What the members' rank 0 gives every rank for :meth:`grow` and the newcomers' ``world(place)`` (a new
        communicator's unique id, as text): JSON-able. Default: None."""
        return None

    def grow(self, newcomers: int, store: Any, timeout: float, payload: Any) -> Backend:
        """The members' side of a growing world (``commlib.grow_group``): the communicator of this one's ranks
        followed by ``newcomers`` processes, which make theirs with the backend's ``world(place)`` (``place.join``
        set); ``store``: keys of this growth alone, for the two sides to meet; ``payload``: :meth:`grow_payload` of
        rank 0. A backend that cannot raises ``NotImplementedError`` (the default)."""
        raise NotImplementedError(f"backend {self.name!r} cannot grow a communicator")

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator (never the world's own)."""
