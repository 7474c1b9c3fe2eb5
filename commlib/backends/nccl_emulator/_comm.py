"""The communicator core of the NCCL emulator, ncclCommSplit and ncclCommShrink.

Operations get their sequence numbers from the core when they are called (so
they match across ranks in call order) and run later (see ``_launch``). A
failing operation breaks its communicator like an NCCL async error: the error
is stored, pending waits fail, the links are cut (with a notice saying why) so
that the peers' operations that need this rank fail fast too, and later calls
raise. A peer whose process died (its connection ends without a goodbye or a
notice) breaks the communicator the same way, at once, naming the peer; the
links to the others stay up, since each sees the death itself and must not
take this rank's reaction for its cause.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from ._errors import INVALID_ARGUMENT, INVALID_USAGE, NcclError
from ._launch import execute
from ._link import Link
from ._mailbox import Key, Mailbox, gone_error
from ._ops import SCRATCH_MIN, AllGather
from ._wire import Endpoint, Listener, connect_mesh, open_listener

__all__ = ["CommCore", "shrink", "split"]

_OPEN, _DESTROYED, _ABORTED = "open", "destroyed", "aborted"
_SPLIT_RECORD = struct.Struct("<qq4sH")  # color, key, IPv4, listener port
_SHRINK_RECORD = struct.Struct("<4sH")  # the child's listener: IPv4, port
# Large scratch buffers are reused: fresh pages cost a page fault each (about a third of a big all-reduce).
_SCRATCH_MIN = SCRATCH_MIN
_SCRATCH_CAP = 256 << 20  # bytes kept per communicator at most
_NOTICE_WAIT = 0.05  # seconds cutting the links may wait for frames being sent, to send the notices after them


class CommCore:
    """State of one emulated communicator: its links, mailbox, sequence counters and error."""

    def __init__(
        self,
        rank: int,
        size: int,
        comm_id: int,
        socks: dict[int, socket.socket],
        ip: str,
        listener: Listener,
        table: list[Endpoint] | None,
    ) -> None:
        self.rank, self.size, self.comm_id, self.ip = rank, size, comm_id, ip
        # The listener the mesh was made on stays open, and every rank's address is kept (``table``), so
        # that commShrink can connect the survivors to each other without any excluded (maybe dead) rank.
        self.listener, self.table = listener, table
        self.mailbox = Mailbox()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # destroy() waits here for the operations in flight
        self._coll_seq = itertools.count(1)  # next() is atomic: no lock on the hot path
        self._send_seq = [0] * size
        self._recv_seq = [0] * size
        self._inflight = 0
        self._close_when_idle = False
        self._scratch: dict[int, list[np.ndarray]] = {}
        self._scratch_bytes = 0
        self.state = _OPEN
        self.async_error: NcclError | None = None
        self.links = {peer: Link(sock, peer, comm_id, self.mailbox, self._lost) for peer, sock in socks.items()}
        for link in self.links.values():  # last: a receiver thread may report its peer lost (``_lost``) at once
            link.start()

    # --- what the operations use ---
    def send(self, peer: int, key: Key, data: memoryview) -> None:
        """Send a message (to oneself: straight into the mailbox)."""
        if peer == self.rank:
            self.mailbox.deliver_local(peer, key, data)
        else:
            self.links[peer].send(key, data)

    def post(self, peer: int, key: Key, view: memoryview) -> None:
        """Announce where the message ``key`` from ``peer`` goes."""
        self.mailbox.post(peer, key, view)

    def wait(self, peer: int, key: Key, deadline: float) -> None:
        """Block until a posted message arrived (the link's receiver thread reads it meanwhile)."""
        link = self.links.get(peer)
        if link is None:  # from oneself
            self.mailbox.wait(peer, key, deadline)
            return
        with link.wanted():
            self.mailbox.wait(peer, key, deadline)

    def want(self, peers: set[int], delta: int) -> None:
        """Keep the receiver threads of ``peers`` reading (+1), or no longer (-1), for an operation."""
        for peer in peers:
            link = self.links.get(peer)
            if link is not None:
                link.want(delta)

    def pump(self, peer: int, stop: Callable[[], bool], until: float | None) -> bool:
        """Read ``peer``'s messages in this thread until ``stop()`` or ``until``; False if another thread reads them."""
        link = self.links.get(peer)
        return link is not None and link.pump(stop, until)

    def forget(self, peer: int, key: Key) -> None:
        """Withdraw a posted receive."""
        self.mailbox.forget(peer, key)

    def can_send_now(self) -> bool:
        """Whether small frames to every peer would go out at once (what starting an operation in place needs)."""
        return all(link.can_send_now() for link in self.links.values())

    def scratch(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` for received data (reused when large)."""
        if nbytes < _SCRATCH_MIN:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            free = self._scratch.get(nbytes)
            if free:
                self._scratch_bytes -= nbytes
                return free.pop()
        return np.empty(nbytes, np.uint8)

    def recycle(self, buffers: list[np.ndarray]) -> None:
        """Give scratch buffers back after a successful operation (a failed one may still be written to)."""
        buffers = [buf for buf in buffers if buf.nbytes >= _SCRATCH_MIN]
        if not buffers:
            return
        with self._lock:
            for buf in buffers:
                if self._scratch_bytes + buf.nbytes > _SCRATCH_CAP:
                    continue  # past the cap, let them go (small ones were: they are cheap to allocate)
                free = self._scratch.setdefault(buf.nbytes, [])
                if len(free) < 4:
                    free.append(buf)
                    self._scratch_bytes += buf.nbytes

    # --- call time ---
    def check_usable(self) -> None:
        """Raise NcclError if the communicator was destroyed, aborted, or broken by an earlier failure."""
        if self.state != _OPEN:
            raise NcclError(INVALID_ARGUMENT, f"the communicator was {self.state}")
        if self.async_error is not None:
            raise NcclError(self.async_error.status, self.async_error.detail)

    def check_runnable(self) -> None:
        """Like check_usable, but a destroyed communicator still drains the operations launched before."""
        if self.state == _ABORTED:
            raise NcclError(INVALID_USAGE, "the communicator was aborted before the operation ran")
        if self.async_error is not None:
            raise NcclError(self.async_error.status, self.async_error.detail)

    def next_collective(self) -> int:
        """The sequence number of the next collective (call order)."""
        return next(self._coll_seq)

    def next_p2p(self, peer: int, sending: bool) -> int:
        """The sequence number of the next send to / receive from ``peer``."""
        with self._lock:
            counters = self._send_seq if sending else self._recv_seq
            counters[peer] += 1
            return counters[peer]

    # --- run time ---
    def begin(self) -> None:
        """An operation was launched (destroy waits for it)."""
        with self._lock:
            self._inflight += 1

    def end(self) -> None:
        """An operation finished (successfully or not)."""
        with self._lock:
            self._inflight -= 1
            idle = self._inflight == 0
            if idle and (self.state != _OPEN or self.async_error is not None):  # destroy() or quiesce() waits
                self._idle.notify_all()
        if idle and self._close_when_idle:
            self._say_goodbye()

    def fail(self, error: NcclError, cut: bool = True) -> None:
        """Store ``error`` as the async error (first one wins) and fail pending waits; if it is the first,
        and ``cut``, cut the links (with a notice saying why) so that the peers fail fast too."""
        with self._lock:
            first = self.async_error is None and self.state == _OPEN
            if first:
                self.async_error = error
        self.mailbox.fail(error)
        with self._lock:
            self._idle.notify_all()  # destroy() may be waiting for operations that can now only fail
        if first and cut:
            self._cut(f"broke its communicator: {error.detail or error}")

    def _lost(self, peer: int, why: str, remote: bool) -> None:
        """A link ended without a goodbye or a notice (see ``Link``): the communicator breaks at once, naming ``peer``.

        When the far side ended it (the peer's process died), every other rank sees that too, so the
        links stay up: a peer must not read this rank's reaction as the cause.
        """
        found = self.mailbox.error  # a mismatch found in the peer's frames breaks the mailbox first
        self.fail(self.mailbox.failure() if found is not None else gone_error(peer, why), cut=not remote)

    # --- life cycle ---
    def destroy(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for launched operations, then close the links gracefully.

        On a broken communicator the launched operations have failed or fail at once: no wait.
        """
        with self._lock:
            if self.state != _OPEN:
                return
            self.state = _DESTROYED
            self._idle.wait_for(lambda: self._inflight == 0 or self.mailbox.error is not None, timeout)
        self._say_goodbye()

    def release(self) -> None:
        """Destroy without blocking (garbage collection): close once the launched operations are done."""
        with self._lock:
            if self.state != _OPEN:
                return
            self.state = _DESTROYED
            self._close_when_idle = True
            idle = self._inflight == 0
        if idle:
            self._say_goodbye()

    def quiesce(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until no launched operation is in flight (on a broken communicator: soon)."""
        with self._lock:
            self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def abort(self) -> None:
        """Fail everything in flight at once and cut the links (telling the peers); never blocks."""
        with self._lock:
            if self.state == _ABORTED:
                return
            self.state = _ABORTED
        self.mailbox.fail(NcclError(INVALID_USAGE, "the communicator was aborted while the operation was in flight"))
        self.listener.close()
        self._cut("aborted its communicator")

    def _cut(self, notice: str) -> None:
        """Cut every link, telling each peer ``notice`` (so that it does not take this rank for dead)."""
        until = time.monotonic() + _NOTICE_WAIT
        for link in self.links.values():
            link.cut(notice, until)

    def _say_goodbye(self) -> None:
        self._close_when_idle = False
        self.mailbox.fail(NcclError(INVALID_ARGUMENT, "the communicator was destroyed"))
        self.listener.close()
        for link in self.links.values():
            link.goodbye()


# --- commSplit -------------------------------------------------------------------------------


def split(parent: CommCore, color: int, key: int, timeout: float) -> CommCore | None:
    """ncclCommSplit over the parent's own links: all-gather (color, key, address), then build the new mesh."""
    listener = open_listener() if color >= 0 else None
    try:
        port = listener.port if listener is not None else 0
        mine = np.frombuffer(_SPLIT_RECORD.pack(color, key, socket.inet_aton(parent.ip), port), np.uint8)
        everyone = np.empty(parent.size * mine.size, np.uint8)
        seq = parent.next_collective()
        parent.begin()
        error = execute([AllGather(parent, seq, mine, everyone)], timeout)
        if error is not None:
            raise error
        if listener is None:
            return None
        records = [_SPLIT_RECORD.unpack(bytes(r)) for r in everyone.reshape(parent.size, -1)]
        members = sorted((k, r) for r, (c, k, _, _) in enumerate(records) if c == color)
        table = [(socket.inet_ntoa(records[r][2]), records[r][3]) for _, r in members]
        new_rank = members.index((key, parent.rank))
        digest = hashlib.blake2b(struct.pack("<QQq", parent.comm_id, seq, color), digest_size=8).digest()
        comm_id = int.from_bytes(digest, "little")
        socks = connect_mesh(comm_id, new_rank, table, listener, time.monotonic() + timeout)
        child, listener = CommCore(new_rank, len(table), comm_id, socks, parent.ip, listener, table), None
        return child
    finally:
        if listener is not None:
            listener.close()


# --- commShrink ------------------------------------------------------------------------------


def shrink(parent: CommCore, exclude: list[int], abort_first: bool, timeout: float) -> CommCore:
    """ncclCommShrink among the ranks not in ``exclude`` (checked already), never contacting an excluded rank.

    The survivors dial each other's parent listeners: fresh connections, so that no byte of the parent's
    aborted operations can reach the child, and nothing of the parent's links (cut, or broken by a dead
    peer) is needed. The child's id comes from the parent's and ``exclude`` alone, so survivors that retry
    with another list after a failed attempt still meet (and ranks that pass different lists never do:
    they time out). Then they all-gather on the child its listeners' addresses, for its own commShrink.
    """
    deadline = time.monotonic() + timeout
    if abort_first:  # NCCL_SHRINK_ABORT: the parent's operations in flight end first (the parent stays broken)
        parent.fail(NcclError(INVALID_USAGE, "the operation was aborted by commShrink(flags=NCCL_SHRINK_ABORT)"))
        parent.quiesce(timeout)
    members = [r for r in range(parent.size) if r not in exclude]
    where = f"commShrink (its ranks 0..{len(members) - 1} are this communicator's ranks {members})"
    digest = hashlib.blake2b(struct.pack(f"<Q{len(exclude)}q", parent.comm_id, *exclude) + b"shrink", digest_size=8)
    comm_id = int.from_bytes(digest.digest(), "little")
    table = parent.table
    assert table is not None  # every finished communicator has its table
    try:
        new_table = [table[r] for r in members]
        socks = connect_mesh(comm_id, members.index(parent.rank), new_table, parent.listener, deadline)
    except NcclError as e:
        hint = " (does every rank that stays call commShrink, with the same excludeRanks?)"
        raise NcclError(e.status, f"{where}: {e.detail}{hint}") from None
    except OSError as e:  # the parent's listener was closed: it was aborted or destroyed meanwhile
        raise NcclError(INVALID_USAGE, f"{where}: the communicator was closed meanwhile ({e})") from None
    child = CommCore(members.index(parent.rank), len(members), comm_id, socks, parent.ip, open_listener(), None)
    try:
        child.table = _addresses(child, deadline, where)
    except BaseException:
        child.abort()
        raise
    return child


def _addresses(child: CommCore, deadline: float, where: str) -> list[Endpoint]:
    """All-gather the listener addresses of ``child``'s ranks (which also proves that every rank is there)."""
    mine = np.frombuffer(_SHRINK_RECORD.pack(socket.inet_aton(child.ip), child.listener.port), np.uint8)
    everyone = np.empty(child.size * mine.size, np.uint8)
    seq = child.next_collective()
    child.begin()
    error = execute([AllGather(child, seq, mine, everyone)], max(deadline - time.monotonic(), 0.001))
    if error is not None:
        raise NcclError(error.status, f"{where}: {error.detail} (does every rank that stays call commShrink?)")
    return [(socket.inet_ntoa(ip), port) for ip, port in _SHRINK_RECORD.iter_unpack(everyone.tobytes())]
