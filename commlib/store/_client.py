"""TCPStore (the client; it can also start the server) and PrefixStore."""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta

from commlib._sockets import recv_exact
from commlib.errors import CommError, CommTimeoutError
from commlib.store._base import (
    DEFAULT_TIMEOUT,
    Store,
    StoreProtocolError,
    StoreTokenError,
    as_bytes,
    as_key,
    as_keys,
    as_seconds,
)
from commlib.store._server import StoreServer
from commlib.store._wire import HEADER, MAX_TIMEOUT_MS, FrameError, Limits, Op, Status, encode, pack_int, unpack_int
from commlib.store._wire import parse_header as _parse_header
from commlib.store._wire import split_fields as _split_fields

__all__ = ["PrefixStore", "TCPStore"]

_ANSWER_GRACE = 5.0  # how long past a wait's own timeout the client waits for the server's TIMEOUT answer
_tenants: dict[tuple[str, int], tuple[StoreServer, int]] = {}  # multi_tenant servers and their user counts
_tenants_lock = threading.Lock()


def _acquire_server(
    host: str, port: int, token: bytes | None, limits: Limits, multi_tenant: bool, listen_fd: int | None
) -> StoreServer:
    if not multi_tenant:
        return StoreServer(host, port, token, limits, listen_fd)
    with _tenants_lock:
        server, users = _tenants.get((host, port), (None, 0))
        if server is None or not server.alive:
            server, users = StoreServer(host, port, token, limits, listen_fd), 0
        _tenants[(host, server.port)] = (server, users + 1)
        return server


def _release_server(host: str, server: StoreServer) -> None:
    """Stop ``server`` unless other multi_tenant masters in this process still use it."""
    with _tenants_lock:
        server_and_users = _tenants.get((host, server.port))
        if server_and_users is not None and server_and_users[0] is server:
            if server_and_users[1] > 1:
                _tenants[(host, server.port)] = (server, server_and_users[1] - 1)
                return
            del _tenants[(host, server.port)]
    server.stop()


class TCPStore(Store):
    """A store served over TCP by the ``is_master`` instance; every instance (master too) is a client.

    The master serves from a background thread (``port=0`` picks a free port; see :attr:`port`).
    Clients retry connecting until ``timeout``. With ``world_size`` and ``wait_for_workers`` the
    master's constructor waits until ``world_size`` instances have connected. ``token`` (ours, not
    torch's) must match the master's, else the client raises :class:`StoreTokenError`.
    ``master_listen_fd`` (keyword-only here) is served instead of binding a new socket; ``use_libuv``
    is accepted and ignored. Threads may share an instance: their calls take turns on its connection.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        token: bytes | str | None = None,
        *,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        max_key_size: int = 4096,
        max_value_size: int = 64 << 20,
    ) -> None:
        super().__init__(timeout)
        del use_libuv  # accepted for torch compatibility; there is one server implementation
        if not is_master and port == 0:
            raise ValueError("a TCPStore client needs the master's port, not 0")
        self._host = host_name
        self._limits = Limits(max_key=max_key_size, max_value=max_value_size)
        self._token = as_bytes(token) if token is not None else None
        self._lock = threading.Lock()  # one request at a time per connection; instances may be shared by threads
        self._sock: socket.socket | None = None
        self._server: StoreServer | None = None
        self._stop_server: weakref.finalize[[str, StoreServer], TCPStore] | None = None
        self._multi_tenant = multi_tenant
        self._closed = False
        self._port = self._start_server(port, master_listen_fd) if is_master else port
        try:
            self._request(Op.JOIN, [])
            if self._server is not None and world_size is not None and wait_for_workers:
                self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The host name clients connect to."""
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one actually bound when the master was given 0)."""
        return self._port

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` and wake anyone waiting for it."""
        self._request(Op.SET, [self._key(key), self._value(value)])

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the timeout for it to be set."""
        status, fields = self._waiting_request(Op.GET, [self._key(key)], self._timeout_s)
        if status is Status.TIMEOUT:
            raise CommTimeoutError(
                f"TCPStore {self._address}: get timed out after {self._timeout_s:g}s for key {key!r}"
            )
        return fields[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` and return the new value."""
        return unpack_int(self._request(Op.ADD, [self._key(key), pack_int(int(amount))])[0])

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Swap in ``desired_value`` if ``key`` holds ``expected_value``; return the value now held (torch rules)."""
        fields = [self._key(key), self._value(expected_value), self._value(desired_value)]
        return self._request(Op.CAS, fields)[0]

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists, or raise CommTimeoutError naming the missing keys."""
        seconds = self._timeout_s if timeout is None else as_seconds(timeout)
        status, missing = self._waiting_request(Op.WAIT, self._keys(keys), seconds)
        if status is Status.TIMEOUT:
            names = [m.decode(errors="replace") for m in missing]
            raise CommTimeoutError(f"TCPStore {self._address}: wait timed out after {seconds:g}s for keys {names}")

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key exists, without waiting."""
        return self._request(Op.CHECK, self._keys(keys))[0] == b"\x01"

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return self._request(Op.DELETE, [self._key(key)])[0] == b"\x01"

    def num_keys(self) -> int:
        """Return the number of keys set (internal bookkeeping such as worker counts is not a key)."""
        return unpack_int(self._request(Op.NUM_KEYS, [])[0])

    def close(self) -> None:
        """Close the connection and, on the master, stop the server (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._drop()
        if self._stop_server is not None:
            self._stop_server()

    # -- internals ----------------------------------------------------------------------------------------------

    @property
    def _address(self) -> str:
        return f"{self._host}:{self._port}"

    def _key(self, key: str) -> bytes:
        raw = as_key(key)
        if len(raw) > self._limits.max_key:
            raise ValueError(f"store key of {len(raw)} bytes exceeds the limit of {self._limits.max_key}")
        return raw

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        raws = as_keys(keys)
        if len(raws) > self._limits.max_keys:
            raise ValueError(f"at most {self._limits.max_keys} keys per call, got {len(raws)}")
        too_long = [k for k in raws if len(k) > self._limits.max_key]
        if too_long:
            raise ValueError(f"store key of {len(too_long[0])} bytes exceeds the limit of {self._limits.max_key}")
        return raws

    def _value(self, value: bytes | str) -> bytes:
        raw = as_bytes(value)
        if len(raw) > self._limits.max_value:
            raise ValueError(f"store value of {len(raw)} bytes exceeds the limit of {self._limits.max_value}")
        return raw

    def _start_server(self, port: int, listen_fd: int | None) -> int:
        args = (self._host, port, self._token, self._limits, self._multi_tenant, listen_fd)
        try:
            self._server = _acquire_server(*args)
        except OSError as exc:
            raise CommError(f"TCPStore master cannot listen on {self._host}:{port}: {exc}") from exc
        # Like torch, a master that is garbage-collected without close() still stops its server.
        self._stop_server = weakref.finalize(self, _release_server, self._host, self._server)
        return self._server.port

    def _wait_for_workers(self, world_size: int) -> None:
        assert self._server is not None
        joined = self._server.wait_for_joined(world_size, self._timeout_s)
        if joined < world_size:
            raise CommTimeoutError(
                f"TCPStore {self._address}: only {joined} of {world_size} workers joined within {self._timeout_s:g}s"
            )

    def _waiting_request(self, op: Op, fields: list[bytes], seconds: float) -> tuple[Status, list[bytes]]:
        timeout_ms = pack_int(min(int(seconds * 1000), MAX_TIMEOUT_MS))
        fields = [fields[0], timeout_ms] if op is Op.GET else [timeout_ms, *fields]
        return self._exchange(op, fields, seconds + _ANSWER_GRACE)

    def _request(self, op: Op, fields: list[bytes]) -> list[bytes]:
        status, reply = self._exchange(op, fields, self._timeout_s)
        if status is Status.ERROR:
            raise ValueError(f"TCPStore {self._address}: {reply[0].decode(errors='replace') if reply else op.name}")
        if status is not Status.OK:
            raise StoreProtocolError(f"TCPStore {self._address}: unexpected status {status} for {op.name}")
        return reply

    def _exchange(self, op: Op, fields: list[bytes], io_timeout: float) -> tuple[Status, list[bytes]]:
        """Send one request and read its answer; any failure drops the connection (the next call reconnects)."""
        if self._closed:
            raise CommError(f"TCPStore {self._address} is closed")
        with self._lock:
            sock = self._sock or self._connect()
            try:
                # 0 would make the socket non-blocking; past MAX_TIMEOUT_MS the OS timers overflow.
                sock.settimeout(min(max(io_timeout, 0.001), MAX_TIMEOUT_MS / 1000 + _ANSWER_GRACE))
                sock.sendall(encode(op, fields))
                return self._read_frame(sock)
            except TimeoutError:
                self._drop()
                raise CommTimeoutError(
                    f"TCPStore {self._address} did not answer {op.name} within {io_timeout:g}s"
                ) from None
            except (OSError, FrameError, StoreProtocolError) as exc:
                self._drop()
                raise CommError(f"TCPStore {self._address}: connection lost during {op.name}: {exc}") from exc

    def _read_frame(self, sock: socket.socket) -> tuple[Status, list[bytes]]:
        code, body_len = _parse_header(
            recv_exact(sock, HEADER.size, "store server closed the connection"), self._limits.max_body
        )
        fields = _split_fields(
            recv_exact(sock, body_len, "store server closed the connection"), self._limits.max_keys + 1
        )
        try:
            return Status(code), fields
        except ValueError:
            raise StoreProtocolError(f"unknown status code {code}") from None

    def _connect(self) -> socket.socket:
        """Connect (retrying until the timeout, as the server may start later) and do the token handshake."""
        deadline = time.monotonic() + self._timeout_s
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(0.05, min(remaining, 5.0)))
                break
            except OSError as exc:
                if remaining <= delay:
                    raise CommTimeoutError(
                        f"could not connect to TCPStore at {self._address} within {self._timeout_s:g}s: {exc}"
                    ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._handshake(sock, max(deadline - time.monotonic(), 1.0))
        return sock

    def _handshake(self, sock: socket.socket, seconds: float) -> None:
        try:
            sock.settimeout(seconds)
            sock.sendall(encode(Op.HELLO, [self._token or b""]))
            status, _ = self._read_frame(sock)
        except (OSError, FrameError, StoreProtocolError) as exc:
            self._drop()
            raise CommError(f"TCPStore {self._address}: handshake failed: {exc}") from exc
        if status is Status.REJECTED:
            self._drop()
            raise StoreTokenError(f"store token rejected by TCPStore {self._address}")
        if status is not Status.OK:
            self._drop()
            raise StoreProtocolError(f"TCPStore {self._address}: unexpected handshake status {status}")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class PrefixStore(Store):
    """Wraps a store so every key becomes ``prefix/key`` (num_keys and the timeout are the wrapped store's)."""

    def __init__(self, prefix: str, store: Store) -> None:
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The wrapped store's timeout."""
        return self._store.timeout

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the wrapped store's timeout."""
        self._store.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        as_keys(keys)  # the same type checks as the wrapped store's, before a str is split into characters
        return [self._k(k) for k in keys]

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``prefix/key``."""
        self._store.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        """Get ``prefix/key``, waiting for it."""
        return self._store.get(self._k(key))

    def add(self, key: str, amount: int) -> int:
        """Add to ``prefix/key``."""
        return self._store.add(self._k(key), amount)

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Compare-and-set ``prefix/key``."""
        return self._store.compare_set(self._k(key), expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Wait for ``prefix/key`` of every key."""
        self._store.wait(self._ks(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Check ``prefix/key`` of every key."""
        return self._store.check(self._ks(keys))

    def delete_key(self, key: str) -> bool:
        """Delete ``prefix/key``."""
        return self._store.delete_key(self._k(key))

    def num_keys(self) -> int:
        """Return the wrapped store's key count (all prefixes, as in torch)."""
        return self._store.num_keys()

    def close(self) -> None:
        """Do nothing: the wrapped store belongs to its creator."""
