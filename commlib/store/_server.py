"""The TCPStore server: one selector thread serving every client connection (protocol in commlib.store).

The thread never blocks on a client: sockets are non-blocking, a ``get``/``wait`` whose keys are
missing parks its connection (answered when a key arrives or its deadline passes), and a
connection that sends a malformed, oversized or unexpected frame is closed on its own.
"""

from __future__ import annotations

import contextlib
import heapq
import hmac
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from commlib.store._wire import (
    FIELD,
    HEADER,
    MAX_TIMEOUT_MS,
    MAX_TOKEN,
    FrameError,
    Limits,
    Op,
    Status,
    check_request,
    encode,
    pack_int,
    parse_header,
    split_fields,
    unpack_int,
)

__all__ = ["StoreServer"]

_log = logging.getLogger(__name__)
_CHUNK = 1 << 18
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_HELLO_BODY = FIELD.size + MAX_TOKEN  # before the handshake only a HELLO-sized body is accepted
_Reply = tuple[Status, list[bytes]] | None


class _Conn:
    """One client connection's buffers and state."""

    __slots__ = ("authed", "closed", "closing", "events", "inbuf", "outbuf", "sock", "waiter")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.authed = False
        self.closing = False  # close once outbuf is flushed (after a token rejection)
        self.closed = False
        self.waiter: _Waiter | None = None
        self.events = _READ


class _Waiter:
    """A parked get (``get_key`` set) or wait: the keys still missing and when to give up."""

    __slots__ = ("deadline", "get_key", "missing")

    def __init__(self, get_key: bytes | None, missing: set[bytes], deadline: float) -> None:
        self.get_key = get_key
        self.missing = missing
        self.deadline = deadline


def _listen(host: str, port: int, listen_fd: int | None) -> socket.socket:
    if listen_fd is not None:
        # dup so the caller keeps ownership of the descriptor it passed in.
        sock = socket.socket(fileno=os.dup(listen_fd))
        sock.listen(1024)
        return sock
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


class StoreServer:
    """The key-value table and the thread that serves it over TCP."""

    def __init__(self, host: str, port: int, token: bytes | None, limits: Limits, listen_fd: int | None = None) -> None:
        self._limits = limits
        self._token = token
        self._data: dict[bytes, bytes] = {}
        self._parked: dict[bytes, set[_Conn]] = {}
        self._deadlines: list[tuple[float, int, _Conn]] = []
        self._seq = itertools.count()
        self._resume: list[_Conn] = []
        self._conns: set[_Conn] = set()
        self._joined = 0
        self._joined_cv = threading.Condition()
        self._stopping = False
        self._inbuf_cap = HEADER.size + limits.max_body + _CHUNK
        self._handlers: dict[Op, Callable[[_Conn, list[bytes]], _Reply]] = {
            Op.SET: self._on_set,
            Op.GET: self._on_get,
            Op.ADD: self._on_add,
            Op.CAS: self._on_cas,
            Op.WAIT: self._on_wait,
            Op.CHECK: self._on_check,
            Op.DELETE: self._on_delete,
            Op.NUM_KEYS: self._on_num_keys,
            Op.JOIN: self._on_join,
        }
        self._listener = _listen(host, port, listen_fd)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, _READ, "accept")
        self._sel.register(self._wake_r, _READ, "wake")
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name=f"commlib-store-{self.port}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the serving thread is running."""
        return self._thread.is_alive()

    def wait_for_joined(self, count: int, timeout: float) -> int:
        """Block until ``count`` store instances have joined (or the timeout passes); return how many joined."""
        with self._joined_cv:
            self._joined_cv.wait_for(lambda: self._joined >= count, timeout)
            return self._joined

    def stop(self) -> None:
        """Stop serving, close every connection and wait for the thread (idempotent)."""
        self._stopping = True
        with contextlib.suppress(OSError):  # already stopped
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        self._wake_w.close()

    # -- event loop -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._poll_timeout()):
                    self._on_event(key.data, mask)
                self._expire(time.monotonic())
                while self._resume:
                    self._process(self._resume.pop())
        except Exception:  # a bug here must not hang clients silently: log it, then close everything
            _log.exception("store server on port %d crashed", self.port)
        finally:
            for conn in list(self._conns):
                self._close(conn)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()

    def _poll_timeout(self) -> float | None:
        if not self._deadlines:
            return None
        # Capped: poll() rejects timeouts past ~24 days, and a client may ask to wait for years.
        return min(max(0.0, self._deadlines[0][0] - time.monotonic()), 3600.0)

    def _on_event(self, data: object, mask: int) -> None:
        if data == "accept":
            self._accept()
        elif data == "wake":
            with contextlib.suppress(OSError):  # spurious wakeup
                self._wake_r.recv(4096)
        elif isinstance(data, _Conn) and not data.closed:
            try:
                if mask & _WRITE:
                    self._flush(data)
                if mask & _READ and not data.closed:
                    self._read(data)
            except Exception as exc:  # one bad connection must never take the server down
                _log.debug("closing store connection: %r", exc)
                self._close(data)
            self._process(data)

    def _accept(self) -> None:
        for _ in range(64):  # bounded, so a connect storm cannot starve established clients
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: keep serving the clients we have
                _log.warning("store accept failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.add(conn)
            self._sel.register(sock, _READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if not data or conn.closing:
            self._close(conn)
            return
        conn.inbuf += data
        if len(conn.inbuf) > self._inbuf_cap:  # only a client pipelining garbage gets here
            raise FrameError("input buffer limit exceeded")

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        del conn.outbuf[:sent]
        if conn.closing and not conn.outbuf:
            self._close(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle buffered requests one at a time while the connection is idle (not parked, output flushed)."""
        try:
            while not conn.closed and conn.waiter is None and not conn.outbuf and not conn.closing:
                frame = self._take_frame(conn)
                if frame is None:
                    break
                self._handle(conn, *frame)
            if not conn.closed:
                want = _READ | (_WRITE if conn.outbuf else 0)
                if want != conn.events:
                    self._sel.modify(conn.sock, want, conn)
                    conn.events = want
        except Exception as exc:
            _log.debug("closing store connection: %r", exc)
            self._close(conn)

    def _take_frame(self, conn: _Conn) -> tuple[Op, list[bytes]] | None:
        buf = conn.inbuf
        if len(buf) < HEADER.size:
            return None
        code, body_len = parse_header(bytes(buf[: HEADER.size]), self._limits.max_body if conn.authed else _HELLO_BODY)
        end = HEADER.size + body_len
        if len(buf) < end:
            return None
        body = bytes(buf[HEADER.size : end])
        del buf[:end]
        fields = split_fields(body, self._limits.max_keys + 3)
        return check_request(code, fields, self._limits), fields

    def _handle(self, conn: _Conn, op: Op, fields: list[bytes]) -> None:
        if not conn.authed:
            if op is not Op.HELLO:
                raise FrameError(f"expected HELLO, got {op.name}")
            reply: _Reply = self._on_hello(conn, fields[0])
        elif op is Op.HELLO:
            raise FrameError("repeated HELLO")
        else:
            reply = self._handlers[op](conn, fields)
        if reply is not None:
            self._reply(conn, *reply)

    def _reply(self, conn: _Conn, status: Status, fields: list[bytes]) -> None:
        conn.outbuf += encode(status, fields)
        try:
            self._flush(conn)
        except OSError:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.waiter is not None:
            self._unlink_waiter(conn, conn.waiter)
            conn.waiter = None
        with contextlib.suppress(KeyError, ValueError):  # never registered, or the selector is already closed
            self._sel.unregister(conn.sock)
        conn.sock.close()
        self._conns.discard(conn)

    # -- waiting ----------------------------------------------------------------------------------------------

    def _park(self, conn: _Conn, get_key: bytes | None, missing: list[bytes], timeout_ms: int) -> None:
        deadline = time.monotonic() + min(max(timeout_ms, 0), MAX_TIMEOUT_MS) / 1000
        conn.waiter = _Waiter(get_key, set(missing), deadline)
        for key in missing:
            self._parked.setdefault(key, set()).add(conn)
        if len(self._deadlines) > 1024 and len(self._deadlines) > 4 * len(self._conns):
            # Woken waiters leave stale heap entries; rebuild so a long-lived server does not accumulate them.
            self._deadlines = [(c.waiter.deadline, next(self._seq), c) for c in self._conns if c.waiter]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (deadline, next(self._seq), conn))

    def _unlink_waiter(self, conn: _Conn, waiter: _Waiter) -> None:
        for key in waiter.missing:
            conns = self._parked.get(key)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del self._parked[key]

    def _unpark(self, conn: _Conn, status: Status, fields: list[bytes]) -> None:
        conn.waiter = None
        self._reply(conn, status, fields)
        self._resume.append(conn)  # handle its buffered requests after the current one, not recursively

    def _wake(self, key: bytes) -> None:
        for conn in self._parked.pop(key, ()):
            waiter = conn.waiter
            if waiter is None or conn.closed:
                continue
            waiter.missing.discard(key)
            if not waiter.missing:
                value = [self._data[waiter.get_key]] if waiter.get_key is not None else []
                self._unpark(conn, Status.OK, value)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, conn = heapq.heappop(self._deadlines)
            waiter = conn.waiter
            if conn.closed or waiter is None or waiter.deadline > now:
                continue  # stale entry: already answered, or parked again later
            self._unlink_waiter(conn, waiter)
            self._unpark(conn, Status.TIMEOUT, sorted(waiter.missing))

    # -- request handlers -------------------------------------------------------------------------------------

    def _put(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake(key)

    def _on_hello(self, conn: _Conn, token: bytes) -> _Reply:
        if self._token is not None and not hmac.compare_digest(token, self._token):
            conn.closing = True
            return Status.REJECTED, []
        conn.authed = True
        return Status.OK, []

    def _on_set(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        self._put(fields[0], fields[1])
        return Status.OK, []

    def _on_get(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        key = fields[0]
        if key in self._data:
            return Status.OK, [self._data[key]]
        self._park(conn, key, [key], unpack_int(fields[1]))
        return None

    def _on_add(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        key, current = fields[0], self._data.get(fields[0], b"0")
        try:
            total = int(current) + unpack_int(fields[1])
            encoded = pack_int(total)
        except (ValueError, OverflowError) as exc:
            return Status.ERROR, [f"cannot add to key {key!r}: {exc}".encode()]
        self._put(key, str(total).encode())  # decimal ASCII, as torch stores counters
        return Status.OK, [encoded]

    def _on_cas(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        key, expected, desired = fields
        current = self._data.get(key)
        if current is None and expected:
            return Status.OK, [expected]  # torch's answer for a missing key with a non-empty expectation
        if (current or b"") == expected:
            self._put(key, desired)
            return Status.OK, [desired]
        return Status.OK, [current or b""]

    def _on_wait(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        missing = [key for key in fields[1:] if key not in self._data]
        if not missing:
            return Status.OK, []
        self._park(conn, None, missing, unpack_int(fields[0]))
        return None

    def _on_check(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        return Status.OK, [b"\x01" if all(key in self._data for key in fields) else b"\x00"]

    def _on_delete(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        return Status.OK, [b"\x01" if self._data.pop(fields[0], None) is not None else b"\x00"]

    def _on_num_keys(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        return Status.OK, [pack_int(len(self._data))]

    def _on_join(self, conn: _Conn, fields: list[bytes]) -> _Reply:
        with self._joined_cv:
            self._joined += 1
            self._joined_cv.notify_all()
            return Status.OK, [pack_int(self._joined)]
