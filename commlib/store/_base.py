"""The :class:`Store` protocol shared by TCPStore, FileStore and PrefixStore, plus argument helpers."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import TypeVar

from commlib._timeouts import as_seconds as _as_seconds
from commlib.errors import CommError

__all__ = ["Store", "StoreProtocolError", "StoreTokenError", "as_bytes", "as_key", "as_keys", "as_seconds"]

DEFAULT_TIMEOUT = timedelta(seconds=300)
_S = TypeVar("_S", bound="Store")


class StoreTokenError(CommError):
    """The store server refused this client's token (missing or wrong)."""


class StoreProtocolError(CommError):
    """The peer sent bytes that are not a valid store frame."""


def as_seconds(timeout: timedelta | float) -> float:
    """``timeout`` (a timedelta or a number of seconds) as float seconds, zero allowed (commlib's one rule)."""
    return _as_seconds(timeout, "store", zero_ok=True)


def as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    """Return a store value as bytes; str is encoded as UTF-8 (as torch does)."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__}")


def as_key(key: str) -> bytes:
    """Return a store key (a str) as UTF-8 bytes."""
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__}")
    return key.encode()


def as_keys(keys: Sequence[str]) -> list[bytes]:
    """Return a list of store keys as UTF-8 bytes (a lone str is refused: it is not a list of keys)."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a list of str, not a single string")
    return [as_key(k) for k in keys]


class Store:
    """A key-value store shared by the ranks of a job (torch.distributed.Store's methods).

    Values are bytes (str values are UTF-8 encoded). ``get`` and ``wait`` block until the keys
    exist or the timeout passes, then raise :class:`~commlib.errors.CommTimeoutError`.
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        self._timeout_s = as_seconds(timeout)

    @property
    def timeout(self) -> timedelta:
        """The default timeout of ``get``/``wait`` (and of connecting, for TCPStore)."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the default timeout (a timedelta or seconds)."""
        self._timeout_s = as_seconds(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``, replacing any previous value, and wake its waiters."""
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the timeout for it to be set."""
        raise NotImplementedError

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing counts as 0) and return the sum."""
        raise NotImplementedError

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value now held.

        A missing key counts as holding ``b""``. As in torch, a missing key with a non-empty
        ``expected_value`` is left missing and ``expected_value`` is returned.
        """
        raise NotImplementedError

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key in ``keys`` exists, or raise CommTimeoutError naming the missing ones."""
        raise NotImplementedError

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key in ``keys`` exists, without waiting."""
        raise NotImplementedError

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        raise NotImplementedError

    def num_keys(self) -> int:
        """Return the number of keys in the store."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the store's connections and files (idempotent)."""

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
