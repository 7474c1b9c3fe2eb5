"""World formation of the NCCL emulator: unique ids, the bootstrap root, and the all-to-all TCP mesh.

Like NCCL, ``get_unique_id()`` starts a bootstrap root in the calling process
and packs its address into the 128-byte id; every rank registers with the root
(its rank and the address of its own data listener), receives the address
table once all ranks are in, and then connects to its peers directly. The id
also carries a random secret so that a stray id (or a stray process) is
refused, and the root hands out a random 64-bit communicator id that every
frame and every peer hello carries.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence

from commlib._settings import current
from commlib._sockets import recv_exact

from ._errors import INVALID_ARGUMENT, INVALID_USAGE, SYSTEM_ERROR, NcclError

__all__ = [
    "ID_BYTES",
    "Endpoint",
    "Listener",
    "bootstrap",
    "connect_mesh",
    "decode_id",
    "new_unique_id",
    "open_listener",
]

ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_MAGIC = b"cNE1"  # "commlib NCCL emulator", format 1
_ID = struct.Struct("<4s4sH16s")  # magic, root IPv4, root port, secret; zero padded to 128 bytes
_REGISTER = struct.Struct("<4s16sii4sH")  # magic, secret, nranks, rank, listener IPv4, listener port
_ENDPOINT = struct.Struct("<4sH")  # one address-table entry
_TABLE_HEAD = struct.Struct("<BQ")  # status, communicator id
_HELLO = struct.Struct("<4sQi")  # magic, communicator id, rank: the first bytes on every mesh connection
_LOOPBACK = "127.0.0.1"
_RETRY_DELAY = 0.02  # between connection attempts to a listener that is not up yet
_PARKED_MAX = 64  # connections a listener keeps for communicators it does not accept for yet

# Root replies (the status byte before the table).
_OK, _BAD_SECRET, _BAD_SIZE, _BAD_RANK, _TIMED_OUT = 0, 1, 2, 3, 4
_REFUSALS = {
    _BAD_SECRET: (INVALID_ARGUMENT, "the bootstrap root refused the id: wrong secret (an id of another world?)"),
    _BAD_SIZE: (INVALID_USAGE, "the bootstrap root refused this rank: other ranks passed a different ndev"),
    _BAD_RANK: (INVALID_USAGE, "the bootstrap root refused this rank: another process registered the same rank"),
}

Endpoint = tuple[str, int]  # (IPv4, port)


def _is_local_address(ip: str) -> bool:
    """Whether ``ip`` belongs to an interface of this host (bindable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def _resolve(host: str, variable: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise NcclError(SYSTEM_ERROR, f"{variable}={host!r} does not resolve to an IPv4 address: {exc}") from exc


def root_address() -> str:
    """The IPv4 address the bootstrap root advertises (see ``nccl_emulator.get_unique_id``)."""
    explicit = current("COMMLIB_NCCL_EMULATOR_ADDR").strip()
    if explicit:
        return _resolve(explicit, "COMMLIB_NCCL_EMULATOR_ADDR")
    master = os.environ.get("MASTER_ADDR", "").strip()
    if master:
        ip = _resolve(master, "MASTER_ADDR")
        if _is_local_address(ip):  # MASTER_ADDR may name another host when the id is made elsewhere
            return ip
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return _LOOPBACK
    return ip if not ipaddress.ip_address(ip).is_loopback and _is_local_address(ip) else _LOOPBACK


def _listening_socket() -> socket.socket:
    """A listening TCP socket on all interfaces and an ephemeral port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    return sock


class Listener:
    """A communicator's data listener: ``connect_mesh`` accepts its peers there, and the communicator keeps
    it open for commShrink.

    A connection that says hello for another communicator is parked for it, not dropped: a rank that starts
    a commShrink first may dial while this one still accepts for an earlier attempt (or for another child).
    """

    def __init__(self) -> None:
        self.sock = _listening_socket()
        self.port: int = self.sock.getsockname()[1]
        self._lock = threading.Lock()  # close() may come from another thread (abort)
        self._parked: dict[int, dict[int, socket.socket]] = {}  # communicator id -> rank -> connection
        self._closed = False

    def accept(self, timeout: float) -> socket.socket:
        """The next connection (TimeoutError after ``timeout`` seconds; OSError once closed)."""
        self.sock.settimeout(timeout)
        return self.sock.accept()[0]

    def park(self, comm_id: int, rank: int, conn: socket.socket) -> None:
        """Keep ``conn``, which said hello as ``rank`` of communicator ``comm_id``, for a later connect_mesh."""
        with self._lock:
            parked = sum(len(v) for v in self._parked.values())
            if self._closed or parked >= _PARKED_MAX or rank in self._parked.get(comm_id, {}):
                conn.close()  # a stray, or too many: the dialer times out or fails on the closed connection
                return
            self._parked.setdefault(comm_id, {})[rank] = conn

    def take(self, comm_id: int) -> dict[int, socket.socket]:
        """The connections parked for communicator ``comm_id`` (rank -> connection), no longer parked."""
        with self._lock:
            return self._parked.pop(comm_id, {})

    def close(self) -> None:
        """Stop listening and close the parked connections."""
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, {}
        self.sock.close()
        for conns in parked.values():
            for conn in conns.values():
                conn.close()


def open_listener() -> Listener:
    """A communicator's data listener (see ``Listener``)."""
    return Listener()


def new_unique_id(timeout: float) -> bytes:
    """Start a bootstrap root thread for one world; return the 128-byte id naming it."""
    ip = root_address()
    listener = _listening_socket()
    secret = secrets.token_bytes(16)
    args = (listener, secret, timeout)
    threading.Thread(target=_serve_root, args=args, name="nccl-emulator-root", daemon=True).start()
    packed = _ID.pack(_MAGIC, socket.inet_aton(ip), listener.getsockname()[1], secret)
    return packed.ljust(ID_BYTES, b"\0")


def decode_id(comm_id: object) -> tuple[Endpoint, bytes]:
    """(root address, secret) from an id: bytes, or a sequence of 128 ints (cupy < 14 used signed chars)."""
    if isinstance(comm_id, bytes | bytearray | memoryview):
        raw = bytes(comm_id)
    elif isinstance(comm_id, Sequence) and all(isinstance(v, int) for v in comm_id):
        raw = bytes(v & 0xFF for v in comm_id)
    else:
        raise NcclError(INVALID_ARGUMENT, f"commId must be the bytes from get_unique_id(), got {type(comm_id)}")
    if len(raw) != ID_BYTES or raw[:4] != _MAGIC:
        raise NcclError(INVALID_ARGUMENT, "commId is not a unique id made by the NCCL emulator's get_unique_id()")
    _, ip, port, secret = _ID.unpack_from(raw)
    return (socket.inet_ntoa(ip), port), secret


def _serve_root(listener: socket.socket, secret: bytes, timeout: float) -> None:
    """Collect the registrations of one world, send everybody the address table, and exit."""
    deadline = time.monotonic() + timeout
    members: dict[int, tuple[socket.socket, Endpoint]] = {}
    nranks = None
    try:
        while nranks is None or len(members) < nranks:
            remaining = deadline - time.monotonic()
            listener.settimeout(max(remaining, 0.001))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                _tell_all(members, _TABLE_HEAD.pack(_TIMED_OUT, len(members)))  # the id field: how many came
                return
            nranks = _admit(conn, secret, nranks, members)
        table = b"".join(_ENDPOINT.pack(socket.inet_aton(ip), port) for _, (_, (ip, port)) in sorted(members.items()))
        _tell_all(members, _TABLE_HEAD.pack(_OK, secrets.randbits(64)) + table)
    finally:
        listener.close()
        for conn, _ in members.values():
            conn.close()


def _tell_all(members: dict[int, tuple[socket.socket, Endpoint]], message: bytes) -> None:
    for conn, _ in members.values():
        with contextlib.suppress(OSError):  # that rank died; the others find out when they talk to it
            conn.sendall(message)


def _admit(conn: socket.socket, secret: bytes, nranks: int | None, members: dict) -> int | None:
    """Read one registration; keep the connection if it is valid, else refuse it. Returns the world size."""
    conn.settimeout(10.0)  # a registration is a few bytes; do not let a stray client stall the root
    try:
        magic, their_secret, size, rank, ip, port = _REGISTER.unpack(recv_exact(conn, _REGISTER.size))
    except (OSError, struct.error):
        conn.close()
        return nranks
    refusal = None
    if magic != _MAGIC or not secrets.compare_digest(their_secret, secret):
        refusal = _BAD_SECRET
    elif nranks is not None and size != nranks:
        refusal = _BAD_SIZE
    elif rank in members or not 0 <= rank < size:
        refusal = _BAD_RANK
    if refusal is not None:
        with contextlib.suppress(OSError):
            conn.sendall(_TABLE_HEAD.pack(refusal, 0))
        conn.close()
        return nranks
    conn.settimeout(None)
    members[rank] = (conn, (socket.inet_ntoa(ip), port))
    return size


def _connect(address: Endpoint, deadline: float, what: str) -> socket.socket:
    """Connect to ``address``, retrying while it refuses (not listening yet) until ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NcclError(SYSTEM_ERROR, f"timed out connecting to {what} at {address[0]}:{address[1]}")
        try:
            return socket.create_connection(address, timeout=remaining)
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(_RETRY_DELAY)
        except TimeoutError:
            continue
        except OSError as exc:
            raise NcclError(SYSTEM_ERROR, f"cannot connect to {what} at {address[0]}:{address[1]}: {exc}") from exc


def bootstrap(comm_id: object, nranks: int, rank: int, listen_port: int, timeout: float) -> tuple[int, list, str]:
    """Register with the root; return (communicator id, address table by rank, this rank's advertised IP)."""
    root, secret = decode_id(comm_id)
    deadline = time.monotonic() + timeout
    sock = _connect(root, deadline, "the bootstrap root (was the id made by a process that has exited?)")
    try:
        my_ip = sock.getsockname()[0]  # the local address that reaches the root reaches the peers too
        sock.sendall(_REGISTER.pack(_MAGIC, secret, nranks, rank, socket.inet_aton(my_ip), listen_port))
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            status, new_id = _TABLE_HEAD.unpack(recv_exact(sock, _TABLE_HEAD.size))
            if status == _TIMED_OUT:
                raise TimeoutError(f"only {new_id} of {nranks} ranks joined")
            if status != _OK:
                raise NcclError(*_REFUSALS.get(status, (SYSTEM_ERROR, f"the bootstrap root refused: {status}")))
            raw = recv_exact(sock, nranks * _ENDPOINT.size)
        except TimeoutError as exc:
            why = f"timed out after {timeout:g} s waiting for all {nranks} ranks to join"
            detail = str(exc) if str(exc) not in ("", "timed out") else ""  # the root's count, if it sent one
            raise NcclError(SYSTEM_ERROR, f"{why}: {detail}" if detail else why) from None
        except OSError as exc:
            raise NcclError(SYSTEM_ERROR, f"lost the bootstrap root before all ranks joined: {exc}") from exc
    finally:
        sock.close()
    table = [(socket.inet_ntoa(ip), port) for ip, port in _ENDPOINT.iter_unpack(raw)]
    return new_id, table, my_ip


def connect_mesh(
    comm_id: int, rank: int, table: list[Endpoint], listener: Listener, deadline: float
) -> dict[int, socket.socket]:
    """Connect every pair of ranks once: dial the lower ranks, accept the higher ones on ``listener`` (left open:
    the communicator keeps it for commShrink)."""
    peers: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):  # dialing never waits for the peer: the kernel's backlog completes it
            sock = _connect(table[peer], deadline, f"rank {peer}")
            sock.sendall(_HELLO.pack(_MAGIC, comm_id, rank))
            peers[peer] = sock
        for peer, conn in listener.take(comm_id).items():  # they dialed while this rank accepted for another
            if rank < peer < len(table) and peer not in peers:
                peers[peer] = conn
            else:
                conn.close()
        while len(peers) < len(table) - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(len(table))) - set(peers) - {rank})
                raise NcclError(SYSTEM_ERROR, f"timed out waiting for ranks {missing} to connect")
            try:
                conn = listener.accept(remaining)
            except TimeoutError:
                continue
            _accept_peer(conn, comm_id, rank, len(table), peers, deadline, listener)
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    for sock in peers.values():
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages must not wait for acks
    return peers


def _accept_peer(
    conn: socket.socket,
    comm_id: int,
    rank: int,
    size: int,
    peers: dict[int, socket.socket],
    deadline: float,
    listener: Listener,
) -> None:
    """Keep ``conn`` if it says hello as a higher rank of this communicator, park it if it says hello for
    another one; drop it otherwise."""
    conn.settimeout(min(max(deadline - time.monotonic(), 0.001), 10.0))  # a silent stray must not stall us
    try:
        magic, their_id, peer = _HELLO.unpack(recv_exact(conn, _HELLO.size))
    except (OSError, struct.error):
        conn.close()
        return
    if magic != _MAGIC:
        conn.close()
    elif their_id != comm_id:
        listener.park(their_id, peer, conn)
    elif not rank < peer < size or peer in peers:
        conn.close()
    else:
        peers[peer] = conn
