"""The backend contract: everything a backend provides, in one class. Read this file to write a backend.

A backend moves bytes between the ranks of one communicator with NCCL's semantics. commlib's
group layer (``commlib._group`` and the collectives above it) validates every argument first,
so a backend method is only ever called with:

- buffers that are contiguous arrays of the backend's array module (:attr:`Backend.xp`), of a
  dtype in ``commlib.arrays.DTYPES``, produced by :meth:`Backend.array`; counts come from ``.size``;
- ranks (``root``, ``peer``) that are ranks of *this* communicator, already range-checked;
- a :class:`commlib.ReduceOp` that :meth:`Backend.unsupported` and ``commlib.arrays.op_error``
  have accepted for the dtype.

Completion: every operation returns a :class:`Handle` at once and nothing blocks without a
deadline. A handle keeps the buffers it reads or writes alive until it has completed; the
caller must not touch a receive buffer (nor change a send buffer) before then. A handle whose
operation failed raises ``commlib.CommError`` from ``test``/``wait``; a wait that runs out of
time returns False and leaves the operation running (the group layer then calls :meth:`abort`
and refuses the group from then on).

Errors: a backend raises ``CommError`` (or a subclass) for what went wrong between ranks and
``TypeError``/``ValueError`` only for what the group layer cannot know (e.g. NCCL cannot
receive from any source); it never prints, and never hangs.
"""

from __future__ import annotations

import abc
import hashlib
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, Protocol

import numpy as np

from commlib._ops import ReduceOp
from commlib.arrays import host_array, to_host
from commlib.errors import CommError, CommTimeoutError, TransportError

__all__ = [
    "DONE",
    "CallsDiffer",
    "SLOW_BYTES_PER_S",
    "AllOf",
    "Backend",
    "Chained",
    "Done",
    "Handle",
    "Meeting",
    "MeetingTimeout",
    "poll",
]

_SPIN = 32  # polls between clock reads: a clock read costs about as much as a poll
_YIELD_AFTER = 0.0005  # seconds of pure spinning before yielding the core (ranks may outnumber cores)
_SLEEP_AFTER = 0.05  # seconds before backing off to short sleeps (long waits must not burn a core)
_WATCH_AFTER, _WATCH_EVERY = 0.25, 0.5  # when and how often a long wait calls the watchdog

#: Called as ``watchdog(seconds_waited, what)`` by long waits (commlib's job monitor sets it; ``what``: the
#: waiting operation's own description, or None): it may publish progress and raise ``CommError`` when
#: another rank has reported a failure.
watchdog: Callable[[float, str | None], None] | None = None

#: Tags above :attr:`Backend.max_tag` that carry commlib's own point-to-point traffic (TAG_FAIL: a rank's
#: notice that it gave up on the group, see :meth:`Backend.abort`).
TAG_MEET, TAG_COMPOSED, TAG_FAIL = 1, 2, 3
RESERVED_TAGS = 3


class CallsDiffer(TransportError):
    """Another rank made another call than this one (``mine``: this rank's, in words); which call, the engine
    cannot say (NCCL reduces fingerprints; the mpi backend's stamps name the other call: ``StampMismatch``)."""

    def __init__(self, mine: str) -> None:
        self.mine = mine
        super().__init__(f"another rank made another call than this rank's {mine}")


class Meeting(Protocol):
    """What carries a meeting of ranks (:meth:`Backend.rendezvous`): a backend, or the job's store."""

    def rendezvous(self, ranks: list[int], timeout: float, payload: bytes = b"", what: str = "group setup") -> bytes:
        """Meet the other ``ranks``; return ``ranks[0]``'s ``payload``; :class:`MeetingTimeout` naming who is late."""


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


class Resident(Protocol):
    """A ready operation, run by the group layer inline (:meth:`Backend.sums`, :meth:`Backend.residents`).

    A call: :attr:`go` with the caller's input and output and the call's sequence number; if it returned
    False, :meth:`wait`, then (if that returned True) :meth:`finish`. An exception raised by any of them goes
    through :meth:`error` first.
    """

    #: the dtype and element count of the caller's arrays (for the flight recorder)
    dtype: Any
    count: int

    #: ``go(inp, out, seq) -> bool``: start one run on the caller's input and output (the previous run is
    #: complete), test it a few hundred times; True: complete, the result in ``out`` (None: no output on this
    #: rank); False: still running. Never blocks. ``inp`` (scatter's root) and ``out`` (gather's root) may be
    #: lists of arrays of one shape, in rank order. An attribute (the mpi backend's is a C method where it was
    #: built), called as a method.
    go: Callable[[Any, Any, int], bool]

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
    test: Callable[[], bool], timeout: float, busy: float = 0.0, slow: Callable[[float], str | None] | None = None
) -> bool:
    """Call ``test`` until it returns True (then True) or ``timeout`` seconds pass (then False).

    Spins first (the latency of small messages is a few microseconds), then
    yields the core, then sleeps briefly, so a long wait neither adds latency to
    fast operations nor starves a peer rank sharing the core. ``busy``: seconds
    the data may take to move (see :data:`SLOW_BYTES_PER_S`); no sleeps before
    then. Past 0.25 s it also calls ``slow(waited)`` (the operation's own slow-path check, which may raise,
    and returns its description) and :data:`watchdog`, then every half second.
    """
    start, watch_at = None, _WATCH_AFTER
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
            watch_at = waited + _WATCH_EVERY
            what = slow(waited) if slow is not None else None
            if watchdog is not None:
                watchdog(waited, what)


class Done:
    """A handle for work that finished when it was issued (e.g. a size-1 group)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True

    def defer(self) -> bool:
        return True


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


def _frame(payload: bytes) -> np.ndarray:
    if len(payload) > 240:
        raise ValueError(f"rendezvous payload of {len(payload)} bytes; at most 240")
    out = np.zeros(256, np.uint8)
    out[0] = len(payload)
    out[1 : 1 + len(payload)] = np.frombuffer(payload, np.uint8)
    return out


def _unframe(buf: np.ndarray) -> bytes:
    return bytes(buf[1 : 1 + int(buf[0])])


def _offsets(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


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
    - ``any_source``: whether :meth:`recv` takes ``peer=None`` (receive from any rank).
    """

    name: ClassVar[str]
    rank: int
    size: int
    host: bool = True
    xp: ModuleType = np
    max_tag: int
    any_source: bool = True

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

    # -- collectives ------------------------------------------------------------------------------
    @abc.abstractmethod
    def all_reduce(self, sendbuf: Any, recvbuf: Any, op: ReduceOp, seq: int) -> Handle:
        """Reduce ``sendbuf`` over all ranks into every rank's ``recvbuf``; ``sendbuf is recvbuf``: in place.

        ``seq`` (every collective takes it): the call's number on the group, the same on every rank that
        makes the same call; a backend puts it in its messages (with the call's kind, dtype, count, op and
        root) so that ranks making different calls end in an error, not in wrong data.
        """

    @abc.abstractmethod
    def broadcast(self, buf: Any, root: int, seq: int) -> Handle:
        """Copy ``root``'s ``buf`` into every rank's ``buf`` (in place)."""

    @abc.abstractmethod
    def reduce(self, sendbuf: Any, recvbuf: Any, op: ReduceOp, root: int, seq: int) -> Handle:
        """Reduce ``sendbuf`` over all ranks into ``root``'s ``recvbuf`` (others' recvbuf untouched)."""

    @abc.abstractmethod
    def all_gather(self, sendbuf: Any | None, recvbuf: Any, seq: int) -> Handle:
        """Concatenate every rank's ``sendbuf`` in rank order into ``recvbuf`` (``size`` times as long).

        ``sendbuf`` None: in place, this rank's chunk of ``recvbuf`` already holds its input.
        """

    @abc.abstractmethod
    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: ReduceOp, seq: int) -> Handle:
        """Reduce ``sendbuf`` (``size`` chunks of ``recvbuf.size``) and leave chunk ``rank`` in ``recvbuf``."""

    @abc.abstractmethod
    def barrier(self, seq: int) -> Handle:
        """Complete once every rank has called barrier."""

    def fused(self) -> dict[str, Callable[..., bool]]:
        """Functions that run an operation to completion in one call, by operation name (``"broadcast"``, ...).

        Each takes the operation's arguments (``seq`` included) plus ``timeout`` and returns True once done, False
        when ``timeout`` passed first (the operation may then still run). The group layer uses
        them for blocking calls on host memory, and only when nothing else of this communicator is
        in flight: a backend may fuse post and wait there (no handle object), or rerun a persistent
        operation it made for an earlier call with the same description (every rank makes the same
        calls in the same order, so such a cache decides alike on every rank). Operations left out
        are posted and waited on through their handles. The default: none.
        """
        return {}

    def sums(self) -> dict[int, Resident] | None:
        """Ready blocking in-place SUM all_reduces by byte count (see :class:`Resident`).

        The hottest call in data parallelism, given a lookup of its own: the group layer runs an entry
        itself (:meth:`commlib._group.ProcessGroup.run_ready`), and the result must be that of the
        ``"all_reduce"`` entry of :meth:`fused` called with ``(buf, buf, SUM, seq, timeout)``. An entry's
        ``go`` returns None for arrays that are not its (another dtype of the same byte count; an array that is
        not contiguous or not writable): the group layer then takes the generic path. The backend adds and
        removes entries as it makes and frees them (the group layer only reads the dict, and only under
        :meth:`fused`'s conditions). The default: None (no such lookup).
        """
        return None

    def residents(self) -> dict[str, dict[Any, Resident]] | None:
        """Ready blocking operations of other calls, run by the group layer as :meth:`sums`' are.

        ``"broadcast"`` by ``(bytes, root)``, ``"reduce"`` (SUM, in place) likewise, ``"gather"`` and ``"scatter"``
        by ``(bytes of a chunk, root)`` (the root's list: one array per rank, in rank order), ``"all_gather"``
        (not in place), ``"reduce_scatter"`` (SUM) and ``"all_to_all"`` (equal splits) by ``(input bytes, output
        bytes)``, ``"all_to_all_v"`` by the same and ``(input split sizes, output split sizes)`` (tuples of rows),
        ``"barrier"`` by ``()``, ``"send"`` and ``"recv"`` by ``(bytes, peer, tag)``; each must give the result of
        the matching :meth:`fused` entry. Same rules as :meth:`sums`; default: None.
        """
        return None

    # -- point to point -------------------------------------------------------------------------
    @abc.abstractmethod
    def send(self, buf: Any, peer: int, tag: int) -> Handle:
        """Send ``buf`` to ``peer``; completes when ``buf`` may be reused."""

    @abc.abstractmethod
    def recv(self, buf: Any, peer: int | None, tag: int) -> Handle:
        """Receive into ``buf`` from ``peer`` (None: any rank, if :attr:`any_source`); the handle has ``source``."""

    def group_start(self) -> None:
        """Open a p2p group: the sends and receives until :meth:`group_end` may be posted in any order.

        The default does nothing: right for engines whose nonblocking p2p never deadlocks on order (MPI).
        """
        return None  # a documented no-op default, not a forgotten abstract method

    def group_end(self) -> None:
        """Close the p2p group opened by :meth:`group_start` (NCCL posts the whole group here)."""
        return None

    # -- composed operations: send/recv by default; override with a native call when faster ------
    def all_to_all(
        self, sendbuf: Any, send_counts: list[int], recvbuf: Any, recv_counts: list[int], seq: int
    ) -> Handle:
        """Send ``send_counts[i]`` elements (in rank order) to rank i; receive ``recv_counts[i]`` from rank i."""
        so, ro, tag, me = _offsets(send_counts), _offsets(recv_counts), self.max_tag + TAG_COMPOSED, self.rank
        sflat, rflat = sendbuf.reshape(-1), recvbuf.reshape(-1)
        rflat[ro[me] : ro[me] + recv_counts[me]] = sflat[so[me] : so[me] + send_counts[me]]
        handles = []
        self.group_start()
        for peer in range(self.size):
            if peer != me:
                handles.append(self.send(sflat[so[peer] : so[peer] + send_counts[peer]], peer, tag))
                handles.append(self.recv(rflat[ro[peer] : ro[peer] + recv_counts[peer]], peer, tag))
        self.group_end()
        return AllOf(handles)

    def gather(self, sendbuf: Any, recvbuf: Any | None, root: int, seq: int) -> Handle:
        """Every rank's ``sendbuf`` into chunk ``rank`` of ``root``'s ``recvbuf`` (None elsewhere)."""
        tag, k = self.max_tag + TAG_COMPOSED, sendbuf.size
        self.group_start()
        if self.rank == root:
            assert recvbuf is not None  # the group layer gives the root its receive buffer
            rflat = recvbuf.reshape(-1)
            rflat[root * k : (root + 1) * k] = sendbuf.reshape(-1)
            handles = [self.recv(rflat[p * k : (p + 1) * k], p, tag) for p in range(self.size) if p != root]
        else:
            handles = [self.send(sendbuf, root, tag)]
        self.group_end()
        return AllOf(handles)

    def scatter(self, sendbuf: Any | None, recvbuf: Any, root: int, seq: int) -> Handle:
        """Chunk p of ``root``'s ``sendbuf`` (None elsewhere) into rank p's ``recvbuf``."""
        tag, k = self.max_tag + TAG_COMPOSED, recvbuf.size
        self.group_start()
        if self.rank == root:
            assert sendbuf is not None  # the group layer gives the root its send buffer
            sflat = sendbuf.reshape(-1)
            recvbuf.reshape(-1)[...] = sflat[root * k : (root + 1) * k]
            handles = [self.send(sflat[p * k : (p + 1) * k], p, tag) for p in range(self.size) if p != root]
        else:
            handles = [self.recv(recvbuf, root, tag)]
        self.group_end()
        return AllOf(handles)

    def close_check(self, seq: int, sent: list[int], received: list[int], timeout: float) -> list[tuple[int, int, int]]:
        """The group's last exchange (``destroy_process_group``, the program's end): this rank made ``seq``
        collectives, sent ``sent[p]`` messages to rank p and received ``received[p]`` from it. Returns, for
        every rank p, (its collectives, its messages sent to this rank, received from this rank) (this rank's
        own row: anything). The default all-gathers the counts with :meth:`all_gather`."""
        n = self.size
        mine = np.array([seq, *sent, *received], np.int64)
        everyone = self.xp.zeros(n * (1 + 2 * n), np.int64)
        if not self.all_gather(self.xp.asarray(mine), everyone, 0).wait(timeout):
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
            self.send(xp.asarray(np.frombuffer(digest, np.uint8)), leader, tag)
            answer = xp.zeros(256, np.uint8)
            if not self.recv(answer, leader, tag).wait(timeout):
                raise MeetingTimeout(f"rank {leader} did not answer within {timeout:g} s ({what} of ranks {ranks})")
            return _unframe(to_host(answer))
        arrivals = {p: (self.recv(buf := xp.zeros(16, np.uint8), p, tag), buf) for p in ranks[1:]}
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
        answers = [self.send(framed, p, tag) for p in ranks[1:]]
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

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator (never the world's own)."""
