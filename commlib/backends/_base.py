"""The narrow waist: what a backend provides, the completion handles, and the polling wait.

A backend moves bytes between the ranks of one communicator with NCCL's
semantics. Buffers are contiguous arrays of a dtype in ``commlib._arrays.DTYPES``
(host numpy arrays for ``mpi``; device arrays for ``nccl``); counts are taken
from ``.size``. Every operation returns a :class:`Handle` at once; nothing
blocks without a deadline.

Primitives (each returns a Handle)::

    all_reduce(sendbuf, recvbuf, op)        sendbuf may be recvbuf (in place)
    broadcast(buf, root)                    in place
    reduce(sendbuf, recvbuf, op, root)      recvbuf is written on root only
    all_gather(sendbuf, recvbuf)            sendbuf None: in place (my chunk of recvbuf holds my input)
    reduce_scatter(sendbuf, recvbuf, op)    sendbuf has size * recvbuf.size elements
    send(buf, peer, tag) / recv(buf, peer, tag)   peer is a rank of this communicator; recv peer None: any
    barrier()

Plus ``group_start()`` / ``group_end()`` around p2p calls (NCCL's group
semantics: the calls in between may be posted in any order without deadlock),
``split(ranks, timeout)`` (collective over this communicator; returns the
sub-backend, or None on ranks outside ``ranks``), ``abort()``, ``rank``, ``size``,
``name``. A backend may also provide native ``all_to_all``, ``gather`` and
``scatter``; otherwise commlib composes them from send/recv (``commlib._composed``);
and ``all_reduce_wait(buf, op, timeout) -> bool``, a fused in-place all_reduce
plus wait for the blocking call, where a handle object would cost latency.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["DONE", "AllOf", "Chained", "Done", "Handle", "poll"]

_SPIN = 32  # polls between clock reads: a clock read costs about as much as a poll
_YIELD_AFTER = 0.0005  # seconds of pure spinning before yielding the core (ranks may outnumber cores)
_SLEEP_AFTER = 0.05  # seconds before backing off to short sleeps (long waits must not burn a core)
_WATCH_AFTER, _WATCH_EVERY = 0.25, 0.5  # when and how often a long wait calls the watchdog

#: Called as ``watchdog(seconds_waited)`` by long waits (commlib's job monitor sets it): it may
#: publish progress and raise ``CommError`` when another rank has reported a failure.
watchdog: Callable[[float], None] | None = None


class Handle(Protocol):
    """Completion of one backend operation."""

    def test(self) -> bool:
        """Return True once the operation (and its completion step) is done; never blocks."""

    def wait(self, timeout: float) -> bool:
        """Block until done (True) or until ``timeout`` seconds have passed (False)."""


def poll(test: Callable[[], bool], timeout: float) -> bool:
    """Call ``test`` until it returns True (then True) or ``timeout`` seconds pass (then False).

    Spins first (the latency of small messages is a few microseconds), then
    yields the core, then sleeps briefly, so a long wait neither adds latency to
    fast operations nor starves a peer rank sharing the core. Past 0.25 s it
    also calls :data:`watchdog`, then every half second.
    """
    start, watch_at = None, _WATCH_AFTER
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
        if waited > _SLEEP_AFTER:
            time.sleep(0.0002)
            if waited > watch_at and watchdog is not None:
                watch_at = waited + _WATCH_EVERY
                watchdog(waited)
        elif waited > _YIELD_AFTER:
            os.sched_yield()


class Done:
    """A handle for work that finished when it was issued (e.g. a size-1 group)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
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
