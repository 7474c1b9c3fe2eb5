"""Framed messages between two ranks of one emulated communicator over one TCP connection.

Every message is a 32-byte header ``(communicator id, kind, tag, sequence,
length)`` and a payload, handed to the communicator's mailbox as it arrives.
Sends never wait for the peer's operation, because the peer always drains the
socket: that is what makes any send/recv order inside a group deadlock-free.

Who reads is a role (a lock), taken one frame at a time by the link's receiver
thread, or for as long as it likes by a thread that waits for an operation
(``pump``). A host waiting for a small operation reads its reply itself: a
hand-off from the receiver thread would cost a wake-up and a GIL transfer in
each process, which on a small machine was most of the latency. While such
waiters read, the receiver thread rests, so that it is not woken by their
frames; it drains the socket again ``_REST`` after the last of them, or at
once when a thread blocks in ``Mailbox.wait`` for this peer (``wanted``).

How a connection ends tells what happened to the peer. After a goodbye
(``BYE``: it destroyed its communicator) or an abort notice (``ABORTED``,
carrying why: it aborted, or its communicator broke), the peer is gone, and
only the operations that need it fail, as with NCCL. An end of the stream
without either (EOF, a reset) means that the peer's process died (or the
network failed): ``on_lost`` breaks the communicator at once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._errors import NcclError
from ._mailbox import Key, Mailbox, gone_error
from ._reader import HEADER, Reader

_UNSENT: tuple[Any, int] | None  # (ioctl, TIOCOUTQ): ask a socket how many bytes the peer has not acknowledged
try:
    from fcntl import ioctl
    from termios import TIOCOUTQ  # == SIOCOUTQ on Linux

    _UNSENT = (ioctl, TIOCOUTQ)
except ImportError:  # no such query here: every operation goes through its stream's worker
    _UNSENT = None


__all__ = ["ABORTED", "BYE", "COLL", "P2P", "Link"]

# Message kinds: an operation's data, a goodbye (destroy), a notice that the sender cut the link (why, in UTF-8).
COLL, P2P, BYE, ABORTED = 1, 2, 3, 4
_NOTICE_MAX = 4096  # bytes of an abort notice's reason, at most
_SMALL = 1 << 16  # payloads up to this are sent with their header in one write
_LINGER = 10.0  # seconds a destroyed link waits for the peer's goodbye before cutting it
_REST = 0.01  # seconds the receiver thread leaves the socket to waiters after the last one read
_SLICE = 0.02  # longest sleep of a waiting reader between looks at whether it should stop
_CLOSED = "connection closed (process died?)"  # EOF or a reset without a goodbye: what a killed process leaves


#: The GIL switch interval while an emulated communicator is open (seconds; CPython's default: 5 ms). A reader
#: thread moving a large message retakes the GIL after each socket read; a stream or host thread waiting for
#: it is only let in after the interval, which made 5-8 ms calls of a few hundred microseconds' work.
_SWITCH = 0.0005


class _Ended(Exception):
    """The connection is over (EOF, an error, or a protocol violation); ``why`` says how, for the mailbox.

    ``remote``: the far side ended it (died, or cut it), so every other rank sees it end too; else this
    side found the peer's frames wrong, and the other ranks have to be told.
    """

    def __init__(self, why: str, remote: bool = True) -> None:
        super().__init__(why)
        self.why, self.remote = why, remote


class Link:
    """The TCP connection to one peer: framed sends under a lock, reads under the read role."""

    def __init__(
        self, sock: socket.socket, peer: int, comm_id: int, mailbox: Mailbox, on_lost: Callable[[int, str, bool], None]
    ) -> None:
        self.peer = peer
        self._on_lost = on_lost  # told (peer, why, remote) once if the connection ends without a goodbye
        self._farewell = False  # the peer said goodbye or sent an abort notice: the end of its stream is expected
        self._lost_told = False
        self._sock = sock
        self._comm_id = comm_id
        self._mailbox = mailbox
        self._send_lock = threading.Lock()
        # A queue this long means the peer is not reading (stopped, hung): a further frame might block.
        self._backlog = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
        self._queued = 0  # bounds the bytes the peer has not acknowledged: last measured + sent since
        self._reader = Reader(sock)
        self._rx = threading.Lock()  # the read role
        # poll(), not select(): no limit on descriptor numbers. One poller per side: the receiver
        # thread may poll while a waiter does (waiters take turns: they hold the read role).
        self._rx_poll, self._waiter_poll = select.poll(), select.poll()
        for poller in (self._rx_poll, self._waiter_poll):
            poller.register(sock, select.POLLIN)
        self._rest = threading.Condition()  # the receiver thread rests here
        self._read_at = -_REST  # when a waiter last held the read role
        self._wanted = 0  # threads blocked in Mailbox.wait on this peer, or units read by receivers: no rest
        self._ended: str | None = None  # how the connection ended, once it did
        self._linger: threading.Timer | None = None
        if sys.getswitchinterval() > _SWITCH:
            sys.setswitchinterval(_SWITCH)
        self._thread = threading.Thread(target=self._receive_loop, name=f"nccl-emulator-rx-{peer}", daemon=True)

    def start(self) -> None:
        """Start the receiver thread (once the communicator is ready to hear that the peer is lost)."""
        self._thread.start()

    # --- sending ---
    def send(self, key: Key, data: memoryview) -> None:
        """Send one message (blocks only until the kernel took it); NcclError if the peer is unreachable."""
        kind, seq, tag = key
        nbytes = len(data)
        header = HEADER.pack(self._comm_id, kind, tag, seq, nbytes)
        try:
            with self._send_lock:
                self._queued += HEADER.size + nbytes
                if nbytes <= _SMALL:
                    self._sock.sendall(header + data)
                else:
                    self._sock.sendall(header)
                    self._sock.sendall(data)
        except OSError as exc:
            if self._mailbox.error is not None:
                raise self._mailbox.failure() from exc
            raise gone_error(self.peer, self._mailbox.gone(self.peer) or _lost(exc)) from exc

    def can_send_now(self) -> bool:
        """Whether a small frame would go out at once: no send in progress, and the peer keeps up.

        The kernel's queue only shrinks as the peer reads, so the kernel is asked (a syscall)
        only once the bytes sent since it was last asked could have made the queue long.
        """
        if self._send_lock.locked():
            return False
        if self._queued < self._backlog:
            return True
        if _UNSENT is None:
            return False
        query, request = _UNSENT
        with self._send_lock:
            try:
                self._queued = struct.unpack("i", query(self._sock.fileno(), request, b"\0\0\0\0"))[0]
            except (OSError, ValueError):  # closed (fileno -1: ValueError), or no answer: take the worker's path
                return False
        return self._queued < self._backlog

    # --- reading ---
    def pump(self, stop: Callable[[], bool], until: float | None) -> bool:
        """Read and deliver frames in this thread until ``stop()`` or ``until`` (monotonic).

        Returns False at once if another thread holds the read role (it delivers the frames).
        """
        if not self._rx.acquire(blocking=False):
            return False
        try:
            self._read_at = time.monotonic()
            while not stop() and self._ended is None:
                if not self._reader.has_header() and not self._await_data(stop, until):
                    break
                self._handle_frame()
            # Never leave a whole header in the buffer: the receiver thread waits for the socket, not for it.
            while self._reader.has_header() and self._ended is None:
                self._handle_frame()
        except _Ended as end:
            self._end(end)
        finally:
            self._read_at = time.monotonic()
            self._rx.release()
        return True

    def want(self, delta: int) -> None:
        """Count a thread (+1) or operation that needs the receiver thread reading, or one that no longer does (-1)."""
        with self._rest:
            self._wanted += delta
            if delta > 0:
                self._rest.notify()

    @contextlib.contextmanager
    def wanted(self) -> Iterator[None]:
        """Keep the receiver thread reading while the caller blocks for a message from this peer."""
        self.want(1)
        try:
            yield
        finally:
            self.want(-1)

    def _await_data(self, stop: Callable[[], bool], until: float | None) -> bool:
        """Wait until the socket has data; False at ``until`` or ``stop()``.

        It sleeps in poll() rather than spinning: a spinning thread holds the GIL, and measured
        no faster here, since sending a frame wakes the peer on the sender's CPU anyway.
        """
        try:
            while not self._reader.fill_nowait():
                now = time.monotonic()
                if (until is not None and now >= until) or stop():
                    return False
                # In slices: stop() may turn true without a byte arriving.
                self._waiter_poll.poll(1000 * (_SLICE if until is None else min(_SLICE, until - now)))
        except EOFError:
            raise _Ended(_CLOSED) from None
        except (OSError, ValueError) as exc:  # ValueError: the socket was closed
            raise _Ended(_lost(exc)) from None
        return True

    def _handle_frame(self) -> None:
        """Read one whole frame (read role held) and hand it to the mailbox; _Ended when the connection is over."""
        try:
            comm_id, kind, tag, seq, nbytes = self._reader.header()
            if comm_id != self._comm_id:
                raise _Ended(f"sent a frame of another communicator ({comm_id:#x}): protocol error", remote=False)
            if kind == BYE:
                self._farewell = True
                self._mailbox.peer_gone(self.peer, "destroyed its communicator")
                self._answer_goodbye()
                return
            if kind == ABORTED:
                if nbytes > _NOTICE_MAX:
                    raise _Ended(f"sent an abort notice of {nbytes} bytes: protocol error", remote=False)
                notice = bytearray(nbytes)
                self._reader.read_into(memoryview(notice))
                self._farewell = True
                raise _Ended(notice.decode(errors="replace"))
            key = (kind, seq, tag)
            target = self._mailbox.take_posted(self.peer, key, nbytes)
            if target is not None:
                self._reader.read_into(target)
                self._mailbox.complete(self.peer, key)
            else:
                buf = np.empty(nbytes, np.uint8)  # unlike bytearray(n), not zero-filled first
                self._reader.read_into(memoryview(buf))  # type: ignore[arg-type]  # arrays are buffers
                self._mailbox.store_early(self.peer, key, buf)
        except EOFError:
            raise _Ended(_CLOSED) from None
        except OSError as exc:
            raise _Ended(_lost(exc)) from None
        except NcclError as exc:  # a size mismatch: the mailbox is failed already
            raise _Ended(f"sent a message this rank did not expect ({exc.detail})", remote=False) from None

    def _end(self, end: _Ended) -> None:
        """The connection is over: tell the communicator if the peer is lost, then the mailbox (first reason
        wins), and make the receiver thread close it."""
        with self._rest:
            if self._ended is None:
                self._ended = end.why
            tell = not (self._farewell or self._lost_told)
            self._lost_told = True
            self._rest.notify()
        if tell:  # first, so that the communicator's error is what every pending operation fails with
            self._on_lost(self.peer, self._ended, end.remote)
        self._mailbox.peer_gone(self.peer, self._ended)
        self.cut()  # after a protocol error the socket is still open: the peer must see it end

    def _receive_loop(self) -> None:
        try:
            while self._ended is None:
                if not self._reader.has_header():  # frames already buffered are delivered at once
                    self._rest_while_waiters_read()
                    if not self._reader.has_header():
                        self._rx_poll.poll()
                if not self._rx.acquire(blocking=False):  # a waiter is reading: rest until it is done
                    self._read_at = time.monotonic()
                    continue
                try:  # a waiter may have taken the data meanwhile: never block in recv holding the role
                    if self._reader.has_header() or self._reader.fill_nowait():
                        self._handle_frame()
                except EOFError:
                    raise _Ended(_CLOSED) from None
                finally:
                    self._rx.release()
        except _Ended as end:
            self._end(end)
        except OSError as exc:
            self._end(_Ended(_lost(exc)))
        finally:
            with self._rx:  # a waiter may be blocked in poll on it: close only once it is out
                self._sock.close()
            if self._linger is not None:
                self._linger.cancel()

    def _rest_while_waiters_read(self) -> None:
        with self._rest:
            while self._wanted == 0 and self._ended is None:
                remaining = self._read_at + _REST - time.monotonic()
                if remaining <= 0:
                    return
                self._rest.wait(remaining)

    # --- closing ---
    def goodbye(self) -> None:
        """Graceful close: tell the peer, stop writing, and let the receiver thread close after its goodbye."""
        try:
            with self._send_lock:
                self._sock.sendall(HEADER.pack(self._comm_id, BYE, 0, 0, 0))
                self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.cut()
            return
        self._linger = threading.Timer(_LINGER, self.cut)  # a peer that never answers must not pin the socket
        self._linger.daemon = True
        self._linger.start()

    def cut(self, notice: str | None = None, until: float = 0.0) -> None:
        """Abortive close: wakes every reader and sender at once; the receiver thread closes the socket.

        ``notice`` (how the peer should describe this rank, e.g. "aborted its communicator") is sent
        first if the frame being sent is done by ``until`` (monotonic) and the socket takes it at once:
        else the peer sees the connection close as if this process had died.
        """
        if notice is not None and self._send_lock.acquire(timeout=max(until - time.monotonic(), 0.0)):
            try:
                payload = notice.encode()[:_NOTICE_MAX]
                frame = HEADER.pack(self._comm_id, ABORTED, 0, 0, len(payload)) + payload
                with contextlib.suppress(OSError):  # a partial notice reads as a closed connection: fine
                    self._sock.send(frame, socket.MSG_DONTWAIT)
            finally:
                self._send_lock.release()
        with contextlib.suppress(OSError):  # already shut down or closed
            self._sock.shutdown(socket.SHUT_RDWR)

    def _answer_goodbye(self) -> None:
        with contextlib.suppress(OSError), self._send_lock:
            self._sock.shutdown(socket.SHUT_WR)


def _lost(exc: BaseException) -> str:
    """How a connection that raised ``exc`` ended, in the words of ``gone_error``."""
    if isinstance(exc, ConnectionResetError | BrokenPipeError):  # a killed process with unread data resets
        return _CLOSED
    return f"connection error ({exc})"
