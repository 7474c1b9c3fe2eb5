"""The mailbox of one emulated communicator: where received messages meet the receives posted for them.

A message is identified per sending peer by its key ``(kind, sequence, tag)``,
so operations of concurrent streams (or several phases of one collective)
never mix. A payload whose receive is already posted goes straight into the
destination buffer (no copy); an early one is kept until its receive is posted.
A posted receive is either waited for (``wait``, blocking) or watched
(``watch``): then the thread that fills the last watched receive of an
operation (the host waiting for it, or a link's receiver thread) is the one
that completes it, so a small operation needs no thread of its own (see
``_launch``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import numpy as np

from ._errors import INVALID_USAGE, REMOTE_ERROR, NcclError

__all__ = ["Key", "Mailbox", "Slot", "Watcher", "gone_error"]

Key = tuple[int, int, int]  # (kind, sequence, tag)
Slot = tuple[int, Key]  # (peer, key)


def gone_error(peer: int, why: str) -> NcclError:
    """The error of an operation (or a communicator) that needs ``peer``, which can no longer send: ``why``."""
    return NcclError(REMOTE_ERROR, f"rank {peer} of this communicator: {why}")


class Watcher(Protocol):
    """What waits for watched receives: told once, either ``ready()`` or ``failed(error)``."""

    expired: bool  # set (by its deadline guard) before it calls Mailbox.unwatch

    def ready(self) -> None: ...
    def failed(self, error: NcclError) -> None: ...


class Mailbox:
    """Posted receives, early arrivals and completions of one communicator, guarded by one condition."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # reentrant: fail() is also called from inside locked steps
        self.cond = threading.Condition(self._lock)  # waited on by wait() only
        self._sleepers = 0  # threads in wait(): nobody to notify when none (notify_all costs a few calls)
        self._posted: dict[tuple[int, Key], memoryview] = {}
        self._early: dict[tuple[int, Key], np.ndarray | bytearray] = {}
        self._done: set[tuple[int, Key]] = set()
        self._gone: dict[int, str] = {}  # peer -> why it can no longer send
        self._watched: dict[Slot, Watcher] = {}  # unfilled watched slot -> who waits for it
        self._watching: dict[Watcher, int] = {}  # watcher -> how many of its slots are unfilled
        self.error: NcclError | None = None  # set once: the communicator is broken or closed

    def post(self, peer: int, key: Key, view: memoryview) -> None:
        """Announce that the message ``key`` from ``peer`` goes into ``view`` (a flat byte view)."""
        self._meet((peer, key), view, self._early, self._posted, receiving=True)

    def deliver_local(self, peer: int, key: Key, data: memoryview) -> None:
        """A message to oneself (send/recv with peer == rank): no socket involved."""
        target = self.take_posted(peer, key, len(data))
        if target is None:
            self.store_early(peer, key, bytearray(data))
        else:
            target[:] = data
            self.complete(peer, key)

    def take_posted(self, peer: int, key: Key, nbytes: int) -> memoryview | None:
        """The posted destination of an arriving message, or None if it is early."""
        with self._lock:
            view = self._posted.pop((peer, key), None)
        if view is not None:
            self._check_size(peer, key, len(view), nbytes)
        return view

    def store_early(self, peer: int, key: Key, data: np.ndarray | bytearray) -> None:
        """Keep an early message; its receive may have been posted while it was being read."""
        self._meet((peer, key), data, self._posted, self._early, receiving=False)

    def _meet(self, slot: Slot, mine: Any, theirs: dict, park: dict, receiving: bool) -> None:
        """A receive (``receiving``: ``mine`` is its view) or a message (``mine`` is its data) arrives at ``slot``:
        it waits in ``park`` until the other half comes, or meets the half waiting in ``theirs`` and fills."""
        with self._lock:
            other = theirs.pop(slot, None)
            if other is None:
                park[slot] = mine
                return
            view, data = (mine, other) if receiving else (other, mine)
            self._check_size(slot[0], slot[1], len(view), len(data))
            view[:] = data
            watcher = self._fill(slot)
            if not receiving:
                self._wake()
        if watcher is not None:
            watcher.ready()

    def complete(self, peer: int, key: Key) -> None:
        """Mark a posted receive as filled."""
        with self._lock:
            watcher = self._fill((peer, key))
            self._wake()
        if watcher is not None:
            watcher.ready()

    def _fill(self, slot: Slot) -> Watcher | None:
        """Mark ``slot`` filled (lock held); return its watcher if that was the last slot it waited for."""
        watcher = self._watched.pop(slot, None)
        if watcher is None:
            self._done.add(slot)  # for wait(); a watched slot is its watcher's business
            return None
        left = self._watching[watcher] - 1
        if left:
            self._watching[watcher] = left
            return None
        del self._watching[watcher]
        return watcher

    def watch(self, watcher: Watcher, slots: list[Slot]) -> None:
        """Tell ``watcher`` once every posted slot is filled (it need not wait() for them), or that one never will be.

        Told in this thread if that is known now, else in the thread that fills the last
        slot or breaks the mailbox (never with the lock held, except inside ``fail()``).
        """
        with self._lock:
            done = self._done
            unfilled = [slot for slot in slots if slot not in done]
            done.difference_update(slots)  # consumed here: the watcher never calls wait() for them
            error = self._hopeless(unfilled, watcher.expired)
            if error is None and unfilled:
                for slot in unfilled:
                    self._watched[slot] = watcher
                self._watching[watcher] = len(unfilled)
                return
        if error is None:
            watcher.ready()
        else:
            watcher.failed(error)

    def unwatch(self, watcher: Watcher) -> NcclError | None:
        """Stop watching ``watcher`` (its deadline passed): the error it now fails with, or None if it was told."""
        with self._lock:
            if self._watching.pop(watcher, None) is None:
                return None
            unfilled = self._drop({watcher})
            peer, key = unfilled[0]
        return NcclError(REMOTE_ERROR, f"timed out waiting for rank {peer} (message {key})")

    def _drop(self, watchers: set) -> list[Slot]:
        """Forget the watched slots of ``watchers`` (lock held); return them in watch order."""
        slots = [slot for slot, w in self._watched.items() if w in watchers]
        for slot in slots:
            del self._watched[slot]
        return slots

    def _hopeless(self, unfilled: list[Slot], expired: bool) -> NcclError | None:
        """Why one of the ``unfilled`` slots will never be filled (what wait() would raise), or None (lock held)."""
        if not unfilled:
            return None
        if self.error is not None:
            return self.failure()
        for peer, _ in unfilled:
            if peer in self._gone:
                return gone_error(peer, self._gone[peer])
        if expired:
            peer, key = unfilled[0]
            return NcclError(REMOTE_ERROR, f"timed out waiting for rank {peer} (message {key})")
        return None

    def wait(self, peer: int, key: Key, deadline: float) -> None:
        """Block until the posted receive ``key`` from ``peer`` is filled; NcclError on failure or timeout."""
        slot = (peer, key)
        with self._lock:
            while slot not in self._done:
                if self.error is not None:
                    raise self.failure()
                if peer in self._gone:
                    raise gone_error(peer, self._gone[peer])
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NcclError(REMOTE_ERROR, f"timed out waiting for rank {peer} (message {key})")
                self._sleepers += 1
                try:
                    self.cond.wait(min(remaining, threading.TIMEOUT_MAX))  # a huge timeout must not overflow
                finally:
                    self._sleepers -= 1
            self._done.discard(slot)

    def forget(self, peer: int, key: Key) -> None:
        """Drop a posted receive that will not be waited for (its operation failed)."""
        with self._lock:
            self._posted.pop((peer, key), None)

    def peer_gone(self, peer: int, why: str) -> None:
        """Record that ``peer`` will send nothing more; its pending receives fail when waited for."""
        with self._lock:
            why = self._gone.setdefault(peer, why)
            hit = {w for (p, _), w in self._watched.items() if p == peer}
            self._drop(hit)
            for watcher in hit:
                del self._watching[watcher]
            self._wake()
        for watcher in hit:
            watcher.failed(gone_error(peer, why))

    def gone(self, peer: int) -> str | None:
        """Why ``peer`` can no longer send, or None."""
        with self._lock:
            return self._gone.get(peer)

    def failure(self) -> NcclError:
        """A fresh copy of the error that broke the mailbox (one instance must not be raised in many threads)."""
        error = self.error
        assert error is not None
        return NcclError(error.status, error.detail)

    def fail(self, error: NcclError) -> None:
        """Break the mailbox: every wait raises ``error`` from now on (the first error wins)."""
        with self._lock:
            if self.error is None:
                self.error = error
            hit = list(self._watching)
            self._watched.clear()
            self._watching.clear()
            self._wake()
        for watcher in hit:  # with the lock still held if fail() came from a locked step (it is reentrant)
            watcher.failed(self.failure())

    def _wake(self) -> None:
        """Wake the threads in wait() (lock held)."""
        if self._sleepers:
            self.cond.notify_all()

    def _check_size(self, peer: int, key: Key, expected: int, got: int) -> None:
        if expected != got:
            error = NcclError(
                INVALID_USAGE,
                f"rank {peer} sent {got} bytes where {expected} were expected (message {key}): "
                "the ranks called mismatched operations, counts or datatypes",
            )
            self.fail(error)
            raise error
