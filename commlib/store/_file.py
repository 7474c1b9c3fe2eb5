"""FileStore: the Store methods over an append-only record file shared by processes on one host.

Every change appends one record ``kind (1 byte) | key length (4) | value length (4) | key | value``
(big-endian) while holding an exclusive ``fcntl.flock``; readers take a shared lock and replay the
records they have not seen yet into a per-instance table. Appending under the lock means no reader
ever sees half a record, and replaying in file order gives every process the same history.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

from commlib.errors import CommError, CommTimeoutError
from commlib.store._base import DEFAULT_TIMEOUT, Store, as_bytes, as_key, as_keys, as_seconds

__all__ = ["FileStore"]

_RECORD = struct.Struct("!BII")
_SET, _DELETE, _USERS, _FINISHED = 1, 2, 3, 4  # _USERS/_FINISHED carry an 8-byte delta, never user-visible
_DELTA = struct.Struct("!q")


class FileStore(Store):
    """A store kept in ``file_name``, shared by every process that opens the same path on this host.

    As in torch, the file is removed when ``world_size`` (>= 0) instances have closed and none
    remains open; with ``world_size=-1`` it is left in place.
    """

    def __init__(self, file_name: str | os.PathLike[str], world_size: int = -1) -> None:
        super().__init__(DEFAULT_TIMEOUT)
        self._path = os.fspath(file_name)
        self._world_size = world_size
        self._thread_lock = threading.Lock()  # flock is per open file, so threads sharing it need their own lock
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._closed = False
        self._offset = 0
        self._table: dict[bytes, bytes] = {}
        self._counters = {_USERS: 0, _FINISHED: 0}
        try:
            with self._locked(exclusive=True):
                self._append(_USERS, b"", _DELTA.pack(1))
        except BaseException:  # e.g. the path holds something that is not a store file
            os.close(self._fd)
            raise

    @property
    def path(self) -> str:
        """The path of the shared file."""
        return self._path

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``."""
        record = (as_key(key), as_bytes(value))
        with self._locked(exclusive=True):
            self._append(_SET, *record)

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, polling the file until it appears or the timeout passes."""
        raw = as_key(key)
        self._poll([raw], self._timeout_s, "get")
        with self._locked(exclusive=False):
            value = self._table.get(raw)
        if value is None:  # deleted between the poll and the read: treat it as never having arrived
            raise CommTimeoutError(f"FileStore {self._path}: key {key!r} was deleted while get() waited for it")
        return value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` and return the result."""
        raw = as_key(key)
        with self._locked(exclusive=True):
            current = self._table.get(raw, b"0")
            try:
                total = int(current) + int(amount)
            except ValueError as exc:
                raise ValueError(f"cannot add to key {key!r}: {exc}") from None
            self._append(_SET, raw, str(total).encode())
        return total

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Swap in ``desired_value`` if ``key`` holds ``expected_value``; return the value now held (torch rules)."""
        raw, expected, desired = as_key(key), as_bytes(expected_value), as_bytes(desired_value)
        with self._locked(exclusive=True):
            current = self._table.get(raw)
            if current is None and expected:
                return expected
            if (current or b"") == expected:
                self._append(_SET, raw, desired)
                return desired
            return current or b""

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists, or raise CommTimeoutError naming the missing keys."""
        seconds = self._timeout_s if timeout is None else as_seconds(timeout)
        self._poll(as_keys(keys), seconds, "wait")

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key exists."""
        raws = as_keys(keys)
        with self._locked(exclusive=False):
            return all(raw in self._table for raw in raws)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        raw = as_key(key)
        with self._locked(exclusive=True):
            if raw not in self._table:
                return False
            self._append(_DELETE, raw, b"")
            return True

    def num_keys(self) -> int:
        """Return the number of keys (internal reference counts are not keys)."""
        with self._locked(exclusive=False):
            return len(self._table)

    def close(self) -> None:
        """Drop this instance's reference; the last of ``world_size`` closers removes the file."""
        if self._closed:
            return
        with self._locked(exclusive=True):
            self._append(_FINISHED, b"", _DELTA.pack(1))
            self._append(_USERS, b"", _DELTA.pack(-1))
            done = self._counters[_USERS] == 0 and 0 <= self._world_size <= self._counters[_FINISHED]
            if done:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path)
            self._closed = True  # under the lock, so no other thread starts an operation on a closing fd
        os.close(self._fd)

    # -- internals ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the thread lock and the file lock, with the table caught up to the end of the file."""
        with self._thread_lock:
            if self._closed:
                raise CommError(f"FileStore {self._path} is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._replay()
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _append(self, kind: int, key: bytes, value: bytes) -> None:
        record = _RECORD.pack(kind, len(key), len(value)) + key + value
        view = memoryview(record)
        while view:  # O_APPEND + the exclusive lock: the whole record lands at the end, uninterleaved
            written = os.write(self._fd, view)
            view = view[written:]
        self._replay()

    def _replay(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < self._offset:  # the file was truncated or replaced under us: start over
            self._offset, self._table = 0, {}
            self._counters = {_USERS: 0, _FINISHED: 0}
        if size == self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while len(data) - pos >= _RECORD.size:
            kind, key_len, value_len = _RECORD.unpack_from(data, pos)
            end = pos + _RECORD.size + key_len + value_len
            if end > len(data):
                break  # a record cut short (a writer crashed mid-append): wait for nothing past it
            key = data[pos + _RECORD.size : pos + _RECORD.size + key_len]
            self._apply(kind, key, data[pos + _RECORD.size + key_len : end])
            pos = end
        self._offset += pos

    def _apply(self, kind: int, key: bytes, value: bytes) -> None:
        if kind == _SET:
            self._table[key] = value
        elif kind == _DELETE:
            self._table.pop(key, None)
        elif kind in self._counters:
            self._counters[kind] += _DELTA.unpack(value)[0]
        else:
            raise CommError(f"FileStore {self._path} holds an unknown record kind {kind}: not a commlib store file")

    def _poll(self, keys: list[bytes], seconds: float, what: str) -> None:
        """Re-read the file with backoff until every key exists; files give no wakeups to wait on."""
        deadline = time.monotonic() + seconds
        delay = 0.001
        while True:
            with self._locked(exclusive=False):
                missing = [k.decode(errors="replace") for k in keys if k not in self._table]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"FileStore {self._path}: {what} timed out after {seconds:g}s for keys {missing}"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)
