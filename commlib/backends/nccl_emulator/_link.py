"""Framed messages between two ranks of one emulated communicator, and the mailbox they land in.

Every message is a 32-byte header ``(communicator id, kind, tag, sequence,
length)`` and a payload. One receiver thread per connection reads frames as
they come: a payload whose receive is already posted goes straight into the
destination buffer (no copy); an early one is kept until it is posted. Keys are
``(kind, sequence, tag)`` per peer, so operations of concurrent streams (or
several phases of one collective) never mix. Sends never wait for the peer's
operation, because the peer's receiver thread always drains the socket: that is
what makes any send/recv order inside a group deadlock-free.

Besides blocking waits, a receive can be watched: the thread that fills the
last watched receive of an operation (usually a receiver thread) is the one
that completes it, so a small operation needs no thread of its own (see
``_launch``).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Protocol

import numpy as np

try:
    from fcntl import ioctl
    from termios import TIOCOUTQ  # == SIOCOUTQ on Linux: bytes not yet acknowledged by the peer
except ImportError:  # no such query here: every operation goes through its stream's worker
    ioctl = TIOCOUTQ = None

from ._errors import INVALID_USAGE, REMOTE_ERROR, NcclError

__all__ = ["BYE", "COLL", "P2P", "Key", "Link", "Mailbox", "Watcher"]

# Message kinds.
COLL, P2P, BYE = 1, 2, 3
_HEADER = struct.Struct("<QB3xIQQ")  # communicator id, kind, tag, sequence, payload length: 32 bytes
_SMALL = 1 << 16  # payloads up to this are sent with their header in one write
_LINGER = 10.0  # seconds a destroyed link waits for the peer's goodbye before cutting it

Key = tuple[int, int, int]  # (kind, sequence, tag)
Slot = tuple[int, Key]  # (peer, key)


class Watcher(Protocol):
    """What waits for watched receives: told once, either ``ready()`` or ``failed(error)``."""

    expired: bool  # set (by its deadline guard) before it calls Mailbox.unwatch

    def ready(self) -> None: ...
    def failed(self, error: NcclError) -> None: ...


class Mailbox:
    """Posted receives, early arrivals and completions of one communicator, guarded by one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._posted: dict[tuple[int, Key], memoryview] = {}
        self._early: dict[tuple[int, Key], np.ndarray | bytearray] = {}
        self._done: set[tuple[int, Key]] = set()
        self._gone: dict[int, str] = {}  # peer -> why it can no longer send
        self._watched: dict[Slot, Watcher] = {}  # unfilled watched slot -> who waits for it
        self._watching: dict[Watcher, int] = {}  # watcher -> how many of its slots are unfilled
        self.error: NcclError | None = None  # set once: the communicator is broken or closed

    def post(self, peer: int, key: Key, view: memoryview) -> None:
        """Announce that the message ``key`` from ``peer`` goes into ``view`` (a flat byte view)."""
        slot = (peer, key)
        with self.cond:
            early = self._early.pop(slot, None)
            if early is None:
                self._posted[slot] = view
                return
            self._check_size(peer, key, len(view), len(early))
            view[:] = early
            watcher = self._fill(slot)
        if watcher is not None:
            watcher.ready()

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
        with self.cond:
            view = self._posted.pop((peer, key), None)
        if view is not None:
            self._check_size(peer, key, len(view), nbytes)
        return view

    def store_early(self, peer: int, key: Key, data: np.ndarray | bytearray) -> None:
        """Keep an early message; its receive may have been posted while it was being read."""
        slot = (peer, key)
        with self.cond:
            view = self._posted.pop(slot, None)
            if view is None:
                self._early[slot] = data
                return
            self._check_size(peer, key, len(view), len(data))
            view[:] = data
            watcher = self._fill(slot)
            self.cond.notify_all()
        if watcher is not None:
            watcher.ready()

    def complete(self, peer: int, key: Key) -> None:
        """Mark a posted receive as filled."""
        with self.cond:
            watcher = self._fill((peer, key))
            self.cond.notify_all()
        if watcher is not None:
            watcher.ready()

    def _fill(self, slot: Slot) -> Watcher | None:
        """Mark ``slot`` filled (lock held); return its watcher if that was the last slot it waited for."""
        self._done.add(slot)
        watcher = self._watched.pop(slot, None)
        if watcher is None:
            return None
        left = self._watching[watcher] - 1
        if left:
            self._watching[watcher] = left
            return None
        del self._watching[watcher]
        return watcher

    def watch(self, watcher: Watcher, slots: list[Slot]) -> None:
        """Tell ``watcher`` once every posted slot is filled, or that one never will be.

        Told in this thread if that is known now, else in the thread that fills the last
        slot or breaks the mailbox (never with the lock held, except inside ``fail()``).
        """
        with self.cond:
            unfilled = [slot for slot in slots if slot not in self._done]
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
        with self.cond:
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
                return NcclError(REMOTE_ERROR, f"rank {peer} {self._gone[peer]}")
        if expired:
            peer, key = unfilled[0]
            return NcclError(REMOTE_ERROR, f"timed out waiting for rank {peer} (message {key})")
        return None

    def wait(self, peer: int, key: Key, deadline: float) -> None:
        """Block until the posted receive ``key`` from ``peer`` is filled; NcclError on failure or timeout."""
        slot = (peer, key)
        with self.cond:
            while slot not in self._done:
                if self.error is not None:
                    raise self.failure()
                if peer in self._gone:
                    raise NcclError(REMOTE_ERROR, f"rank {peer} {self._gone[peer]}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NcclError(REMOTE_ERROR, f"timed out waiting for rank {peer} (message {key})")
                self.cond.wait(remaining)
            self._done.discard(slot)

    def forget(self, peer: int, key: Key) -> None:
        """Drop a posted receive that will not be waited for (its operation failed)."""
        with self.cond:
            self._posted.pop((peer, key), None)

    def peer_gone(self, peer: int, why: str) -> None:
        """Record that ``peer`` will send nothing more; its pending receives fail when waited for."""
        with self.cond:
            why = self._gone.setdefault(peer, why)
            hit = {w for (p, _), w in self._watched.items() if p == peer}
            self._drop(hit)
            for watcher in hit:
                del self._watching[watcher]
            self.cond.notify_all()
        for watcher in hit:
            watcher.failed(NcclError(REMOTE_ERROR, f"rank {peer} {why}"))

    def gone(self, peer: int) -> str | None:
        """Why ``peer`` can no longer send, or None."""
        with self.cond:
            return self._gone.get(peer)

    def failure(self) -> NcclError:
        """A fresh copy of the error that broke the mailbox (one instance must not be raised in many threads)."""
        error = self.error
        assert error is not None
        return NcclError(error.status, error.detail)

    def fail(self, error: NcclError) -> None:
        """Break the mailbox: every wait raises ``error`` from now on (the first error wins)."""
        with self.cond:
            if self.error is None:
                self.error = error
            hit = list(self._watching)
            self._watched.clear()
            self._watching.clear()
            self.cond.notify_all()
        for watcher in hit:  # with the lock still held if fail() came from a locked step (it is reentrant)
            watcher.failed(self.failure())

    def _check_size(self, peer: int, key: Key, expected: int, got: int) -> None:
        if expected != got:
            error = NcclError(
                INVALID_USAGE,
                f"rank {peer} sent {got} bytes where {expected} were expected (message {key}): "
                "the ranks called mismatched operations, counts or datatypes",
            )
            self.fail(error)
            raise error


class Link:
    """The TCP connection to one peer: framed sends under a lock, and a receiver thread feeding the mailbox."""

    def __init__(self, sock: socket.socket, peer: int, comm_id: int, mailbox: Mailbox) -> None:
        self.peer = peer
        self._sock = sock
        self._comm_id = comm_id
        self._mailbox = mailbox
        self._send_lock = threading.Lock()
        # A queue this long means the peer is not reading (stopped, hung): a further frame might block.
        self._backlog = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
        self._queued = 0  # bounds the bytes the peer has not acknowledged: last measured + sent since
        self._linger: threading.Timer | None = None
        self._thread = threading.Thread(target=self._receive_loop, name=f"nccl-emulator-rx-{peer}", daemon=True)
        self._thread.start()

    def send(self, key: Key, data: memoryview) -> None:
        """Send one message (blocks only until the kernel took it); NcclError if the peer is unreachable."""
        kind, seq, tag = key
        header = _HEADER.pack(self._comm_id, kind, tag, seq, len(data))
        try:
            with self._send_lock:
                self._queued += len(header) + len(data)
                if len(data) <= _SMALL:
                    self._sock.sendall(header + data)
                else:
                    self._sock.sendall(header)
                    self._sock.sendall(data)
        except OSError as exc:
            if self._mailbox.error is not None:
                raise self._mailbox.failure() from exc
            why = self._mailbox.gone(self.peer) or f"is unreachable ({exc})"
            raise NcclError(REMOTE_ERROR, f"sending to rank {self.peer}: rank {self.peer} {why}") from exc

    def can_send_now(self) -> bool:
        """Whether a small frame would go out at once: no send in progress, and the peer keeps up.

        The kernel's queue only shrinks as the peer reads, so the kernel is asked (a syscall)
        only once the bytes sent since it was last asked could have made the queue long.
        """
        if self._send_lock.locked():
            return False
        if self._queued < self._backlog:
            return True
        if ioctl is None:
            return False
        with self._send_lock:
            try:
                self._queued = struct.unpack("i", ioctl(self._sock.fileno(), TIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:  # closed, or a platform that does not answer: take the worker's path
                return False
        return self._queued < self._backlog

    def goodbye(self) -> None:
        """Graceful close: tell the peer, stop writing, and let the receiver thread close after its goodbye."""
        try:
            with self._send_lock:
                self._sock.sendall(_HEADER.pack(self._comm_id, BYE, 0, 0, 0))
                self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.cut()
            return
        self._linger = threading.Timer(_LINGER, self.cut)  # a peer that never answers must not pin the socket
        self._linger.daemon = True
        self._linger.start()

    def cut(self) -> None:
        """Abortive close: wakes the receiver thread and any sender at once; the receiver closes the socket."""
        with contextlib.suppress(OSError):  # already shut down or closed
            self._sock.shutdown(socket.SHUT_RDWR)

    def _receive_loop(self) -> None:
        why = "closed the connection without destroying its communicator (exited or aborted?)"
        try:
            while True:
                comm_id, kind, tag, seq, nbytes = _HEADER.unpack(self._read(_HEADER.size))
                if comm_id != self._comm_id:
                    why = f"sent a frame of another communicator ({comm_id:#x}): protocol error"
                    break
                if kind == BYE:
                    self._mailbox.peer_gone(self.peer, "destroyed its communicator")
                    self._answer_goodbye()
                    continue
                self._receive_payload((kind, seq, tag), nbytes)
        except (OSError, EOFError) as exc:
            if not isinstance(exc, EOFError):
                why = f"connection error: {exc}"
        except NcclError:
            pass  # a size mismatch: the mailbox is failed already
        finally:
            self._mailbox.peer_gone(self.peer, why)
            self._sock.close()
            if self._linger is not None:
                self._linger.cancel()

    def _answer_goodbye(self) -> None:
        with contextlib.suppress(OSError), self._send_lock:
            self._sock.shutdown(socket.SHUT_WR)

    def _receive_payload(self, key: Key, nbytes: int) -> None:
        target = self._mailbox.take_posted(self.peer, key, nbytes)
        if target is not None:
            self._read_into(target)
            self._mailbox.complete(self.peer, key)
        else:
            buf = np.empty(nbytes, np.uint8)  # unlike bytearray(n), not zero-filled first
            self._read_into(memoryview(buf))
            self._mailbox.store_early(self.peer, key, buf)

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return bytes(buf)

    def _read_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise EOFError
            got += k
