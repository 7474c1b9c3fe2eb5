"""Stores commlib did not make (torch's ``TCPStore``, ``FileStore``, ``PrefixStore``), used through commlib's Store API.

torch's stores have the same methods; they differ in what timeouts they take (timedelta only)
and what they raise (``torch.distributed.DistStoreError``, a RuntimeError). The adapter turns
both into commlib's conventions, so the rest of commlib never asks which store it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from commlib.errors import CommError, CommTimeoutError
from commlib.store._base import Store, as_seconds

__all__ = ["as_store"]

_T = TypeVar("_T")


def as_store(store: Any) -> Store:
    """``store`` itself when it is a commlib store; a commlib view of a torch store otherwise."""
    if isinstance(store, Store):
        return store
    for method in ("set", "get", "add", "wait", "check", "compare_set"):
        if not callable(getattr(store, method, None)):
            raise TypeError(f"store must be a commlib or torch.distributed Store, got {type(store).__qualname__}")
    return _Foreign(store)


class _Foreign(Store):
    """A torch store behind commlib's Store API."""

    def __init__(self, store: Any) -> None:
        timeout = getattr(store, "timeout", None)
        super().__init__(timeout if isinstance(timeout, timedelta) else 300.0)
        self._store = store

    def _call(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except RuntimeError as e:  # torch's DistStoreError and friends
            text = f"{type(self._store).__name__} {what}: {e}"
            raise (CommTimeoutError if "timeout" in str(e).lower() else CommError)(text) from None

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key``."""
        self._call("set", self._store.set, key, value)

    def get(self, key: str) -> bytes:
        """Get ``key``, waiting for it up to the store's timeout."""
        return bytes(self._call("get", self._store.get, key))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key``."""
        return int(self._call("add", self._store.add, key, amount))

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return its value."""
        return bytes(self._call("compare_set", self._store.compare_set, key, expected_value, desired_value))

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Wait until every key exists."""
        if timeout is None:
            self._call("wait", self._store.wait, list(keys))
        else:
            seconds = timedelta(seconds=as_seconds(timeout))
            self._call("wait", self._store.wait, list(keys), seconds)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists, now."""
        return bool(self._call("check", self._store.check, list(keys)))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``."""
        return bool(self._call("delete_key", self._store.delete_key, key))

    def num_keys(self) -> int:
        """The number of keys."""
        return int(self._call("num_keys", self._store.num_keys))

    def close(self) -> None:
        """Do nothing: the store belongs to whoever made it."""
