"""Lifelines: a TCP connection between every two processes of the job, watched by one thread, so that every
survivor learns of a death at once, the same way, whatever it is doing (in a collective, a send, between calls).

A process that dies (killed, crashed) has its connections closed by its kernel: its peers read the end of the
stream within milliseconds. A host or a link that goes away closes nothing: TCP keepalive (a probe after
:data:`IDLE` s of silence, the connection dropped when it is not answered within :data:`PROBE` s) ends it
within about two seconds. A process that is only stopped (SIGSTOP) keeps its connections, and its kernel
still answers the probes: it is never declared dead (the calls that wait for it time out as usual). A
process whose program ends says goodbye first: it has *left*, it did not die.

The thread also carries the small messages the survivors use to agree on who failed (``agreement``): frames
of JSON, never unpickled. The mesh is set up when a world is made, through the job's store (each process
publishes its address; the later one of every pair connects to the earlier), and a process that joins a
running job (``commlib.grow_group``) connects to every member the same way. Processes are named by their
*id*: the world rank they first had (a newcomer's is given when it is admitted); the group layer maps ids to
the ranks of the current world.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DIED", "LEFT", "Lifelines", "current", "start", "stop"]

IDLE = 1  # seconds of silence before the kernel probes a connection
PROBE = 1  # seconds a probe may go unanswered before the connection is dropped (host or link gone)
_MAX_FRAME = 1 << 20
_HEADER = struct.Struct("!I")
DIED, LEFT = "died", "left"


def _keepalive(sock: socket.socket) -> None:
    """Probe after IDLE s of silence, give up after one unanswered probe; unacknowledged data: the same. Not
    for a peer on this host: its death closes the connection (its kernel is ours), and on a machine loaded
    past its cores a late probe must not make a live process dead."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _same_host(sock):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", IDLE), ("TCP_KEEPINTVL", PROBE), ("TCP_KEEPCNT", 1)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (IDLE + PROBE) * 1000)


def _same_host(sock: socket.socket) -> bool:
    """Whether ``sock`` connects two processes of this host (False when that cannot be told)."""
    with contextlib.suppress(OSError, ValueError):
        peer, mine = sock.getpeername()[0], sock.getsockname()[0]
        return peer == mine or ipaddress.ip_address(peer).is_loopback
    return False


def _frame(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class _Peer:
    __slots__ = ("buf", "id", "lock", "sock")

    def __init__(self, sock: socket.socket, peer_id: int) -> None:
        self.sock, self.id, self.buf, self.lock = sock, peer_id, bytearray(), threading.Lock()


class Lifelines:
    """This process's end of the mesh: its listening socket, a connection to every other process, the thread.

    ``on_change(id, what, how)`` is called from the thread when process ``id`` died (``what`` is
    :data:`DIED`) or left (:data:`LEFT`); ``how`` says how it was seen, in words.
    """

    def __init__(self, me: int, job: str, on_change: Callable[[int, str, str], None] | None = None) -> None:
        self.me, self.job, self.on_change = me, job, on_change
        self.listener = socket.create_server(("0.0.0.0", 0))
        self.port = self.listener.getsockname()[1]
        self.peers: dict[int, _Peer] = {}
        self.ended: dict[int, tuple[str, str, float]] = {}  # id -> (DIED or LEFT, how, time.monotonic())
        self.inbox: list[tuple[int, dict[str, Any]]] = []  # the agreement's messages, in arrival order
        self.cond = threading.Condition()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.waking_r, self.waking_w = socket.socketpair()  # wakes the thread (a new peer, the end)
        self.selector.register(self.waking_r, selectors.EVENT_READ, "wake")
        self.pending: list[_Peer] = []  # connected by this process, for the thread to watch
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="commlib-lifelines", daemon=True)
        self.thread.start()

    # -- the mesh -------------------------------------------------------------------------------------------
    def connect(self, peer_id: int, address: str, timeout: float) -> None:
        """Connect to process ``peer_id`` at ``address`` (``host:port``) and greet it."""
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        _keepalive(sock)
        sock.sendall(_frame({"t": "hello", "id": self.me, "job": self.job}))
        sock.settimeout(None)
        peer = _Peer(sock, peer_id)
        with self.cond:
            self.peers[peer_id] = peer
            self.pending.append(peer)
        self.waking_w.send(b"p")

    def wait_for(self, ids: list[int], timeout: float) -> list[int]:
        """Wait until every process of ``ids`` is connected (or ended); the ones that are not, after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                missing = [i for i in ids if i != self.me and i not in self.peers and i not in self.ended]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self.cond.wait(min(left, 0.05))

    def alive(self, peer_id: int) -> bool:
        return peer_id == self.me or (peer_id in self.peers and peer_id not in self.ended)

    def open_here(self, ids: list[int]) -> bool:
        """Whether every process of ``ids`` (but this one) is a peer on this host whose connection is open with
        nothing unread: had it died, its kernel (ours) would have closed the connection already, so no death of
        theirs is still to be read."""
        for i in ids:
            if i == self.me:
                continue
            peer = self.peers.get(i)
            if peer is None or i in self.ended or not _same_host(peer.sock):
                return False
            try:
                peer.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                return False  # unread data (the thread's to read) or the end of the stream (b"")
            except BlockingIOError:
                continue
            except OSError:
                return False
        return True

    def failed(self) -> dict[int, tuple[str, str, float]]:
        """The processes that died or left so far: id -> (what, how, when)."""
        with self.cond:
            return dict(self.ended)

    # -- messages -------------------------------------------------------------------------------------------
    def send(self, peer_id: int, msg: dict[str, Any]) -> bool:
        """Send ``msg`` (JSON-able) to ``peer_id``; False when it is not reachable (ended, or the send failed)."""
        peer = self.peers.get(peer_id)
        if peer is None or peer_id in self.ended:
            return False
        try:
            with peer.lock:
                peer.sock.sendall(_frame(msg))
        except OSError as e:
            self._ended(peer, DIED, f"sending to it failed ({e.strerror or e})")
            return False
        return True

    def take(self, match: Callable[[int, dict[str, Any]], bool], timeout: float) -> tuple[int, dict] | None:
        """The first message ``match`` accepts (removed from the inbox), waiting up to ``timeout`` s; None if none
        came. Also wakes when a process ends (returns None then: the caller looks again)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            seen = len(self.ended)
            while True:
                for i, (sender, msg) in enumerate(self.inbox):
                    if match(sender, msg):
                        del self.inbox[i]
                        return sender, msg
                left = deadline - time.monotonic()
                if left <= 0 or len(self.ended) != seen:
                    return None
                self.cond.wait(left)

    def put_back(self, sender: int, msg: dict[str, Any]) -> None:
        """Return a message :meth:`take` gave, to the front of the inbox."""
        with self.cond:
            self.inbox.insert(0, (sender, msg))

    def discard(self, match: Callable[[int, dict[str, Any]], bool]) -> None:
        with self.cond:
            self.inbox = [(s, m) for s, m in self.inbox if not match(s, m)]

    # -- the end --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye to every peer and stop (the program ends, or the world is destroyed)."""
        if self.closed:
            return
        self.closed = True
        for peer_id in list(self.peers):
            self.send(peer_id, {"t": "bye"})
        with contextlib.suppress(OSError):
            self.waking_w.send(b"x")
        self.thread.join(timeout=1.0)
        for peer in list(self.peers.values()):
            with contextlib.suppress(OSError):
                peer.sock.close()
        with contextlib.suppress(OSError):
            self.listener.close()

    # -- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        greeting: dict[socket.socket, bytearray] = {}  # accepted connections that have not said hello yet
        while not self.closed:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        sock, _ = self.listener.accept()
                        _keepalive(sock)
                        greeting[sock] = bytearray()
                        self.selector.register(sock, selectors.EVENT_READ, "hello")
                elif key.data == "wake":
                    self._woken()
                elif key.data == "hello":
                    self._greeted(key.fileobj, greeting)  # type: ignore[arg-type]
                else:
                    self._readable(key.data)

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            self.waking_r.recv(4096)
        with self.cond:
            fresh, self.pending = self.pending, []
        for peer in fresh:
            self.selector.register(peer.sock, selectors.EVENT_READ, peer)

    def _greeted(self, sock: socket.socket, greeting: dict[socket.socket, bytearray]) -> None:
        buf = greeting[sock]
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        buf += data
        frames = self._frames(buf) if data else None
        if frames is None or (frames and (frames[0].get("t") != "hello" or frames[0].get("job") != self.job)):
            self.selector.unregister(sock)
            del greeting[sock]
            sock.close()  # a stranger, or a connection that ended before saying who it is
            return
        if not frames:
            return
        self.selector.unregister(sock)
        del greeting[sock]
        peer = _Peer(sock, int(frames[0]["id"]))
        peer.buf = buf
        with self.cond:
            self.peers[peer.id] = peer
            self.cond.notify_all()
        self.selector.register(sock, selectors.EVENT_READ, peer)
        self._deliver(peer, frames[1:])

    def _readable(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except OSError as e:
            self._ended(peer, DIED, _lost(e))
            return
        if not data:
            self._ended(peer, DIED, "its lifeline closed without a goodbye (its process ended: killed, or crashed)")
            return
        peer.buf += data
        frames = self._frames(peer.buf)
        if frames is None:
            self._ended(peer, DIED, "it sent a malformed message")
            return
        self._deliver(peer, frames)

    def _deliver(self, peer: _Peer, frames: list[dict[str, Any]]) -> None:
        for msg in frames:
            if msg.get("t") == "bye":
                self._ended(peer, LEFT, "it said goodbye (its program ended)")
                return
            with self.cond:
                self.inbox.append((peer.id, msg))
                self.cond.notify_all()

    @staticmethod
    def _frames(buf: bytearray) -> list[dict[str, Any]] | None:
        """The whole frames at the start of ``buf`` (removed from it); None for a malformed one."""
        out = []
        while len(buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf)
            if n > _MAX_FRAME:
                return None
            if len(buf) < _HEADER.size + n:
                break
            try:
                out.append(json.loads(bytes(buf[_HEADER.size : _HEADER.size + n])))
            except ValueError:
                return None
            del buf[: _HEADER.size + n]
        return out

    def _ended(self, peer: _Peer, what: str, how: str) -> None:
        with self.cond:
            if peer.id in self.ended or self.closed:
                return
            self.ended[peer.id] = (what, how, time.monotonic())
            self.cond.notify_all()
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()
        if self.on_change is not None:
            self.on_change(peer.id, what, how)


def _lost(e: OSError) -> str:
    if isinstance(e, TimeoutError) or getattr(e, "errno", None) == 110:
        return f"its host stopped answering for {IDLE + PROBE} s (host or link down)"
    return f"its connection failed ({e.strerror or e})"


_mesh: Lifelines | None = None


def current() -> Lifelines | None:
    """This process's lifelines, or None (no job store to set them up through, or turned off)."""
    return _mesh


def start(me: int, job: str, on_change: Callable[[int, str, str], None] | None = None) -> Lifelines:
    """This process's lifelines (made once; ``on_change`` replaced on a later call)."""
    global _mesh
    if _mesh is None or _mesh.closed:
        _mesh = Lifelines(me, job, on_change)
    else:
        _mesh.on_change = on_change
    return _mesh


def stop() -> None:
    """Say goodbye and stop (at the program's end)."""
    global _mesh
    if _mesh is not None:
        _mesh.close()
        _mesh = None
