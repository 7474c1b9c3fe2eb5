"""HashStore: torch's in-process store (a dict behind a lock), for one process and its threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from commlib.errors import CommTimeoutError
from commlib.store._base import DEFAULT_TIMEOUT, Store, as_bytes, as_key, as_keys, as_seconds

__all__ = ["HashStore"]


class HashStore(Store):
    """A store in this process's memory, shared by its threads (torch's ``HashStore``: a single-process world's
    ``init_process_group(store=HashStore(), rank=0, world_size=1)``, tests)."""

    def __init__(self) -> None:
        super().__init__(DEFAULT_TIMEOUT)
        self._table: dict[bytes, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` and wake its waiters."""
        record = (as_key(key), as_bytes(value))
        with self._changed:
            self._table[record[0]] = record[1]
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the timeout for another thread to set it."""
        raw = as_key(key)
        with self._changed:
            self._wait_for([raw], self._timeout_s, "get")
            return self._table[raw]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal integer at ``key`` (missing: 0) and return the sum."""
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"HashStore.add: amount must be an int, got {amount!r}")
        raw = as_key(key)
        with self._changed:
            current = self._table.get(raw, b"0")
            try:
                total = int(current) + amount
            except ValueError:
                raise ValueError(f"HashStore.add: key {key!r} holds {current!r}, not an integer") from None
            self._table[raw] = str(total).encode()
            self._changed.notify_all()
            return total

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (a missing key holds ``b""``); return
        the value held now (a missing key with another ``expected_value`` stays missing: that is returned)."""
        raw, expected, desired = as_key(key), as_bytes(expected_value), as_bytes(desired_value)
        with self._changed:
            current = self._table.get(raw)
            if current is None and expected:
                return expected
            if (current or b"") == expected:
                self._table[raw] = desired
                self._changed.notify_all()
                return desired
            return current or b""

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists, or raise CommTimeoutError naming the missing ones."""
        raws = as_keys(keys)
        seconds = self._timeout_s if timeout is None else as_seconds(timeout)
        with self._changed:
            self._wait_for(raws, seconds, "wait")

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists, without waiting."""
        raws = as_keys(keys)
        with self._changed:
            return all(k in self._table for k in raws)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        raw = as_key(key)
        with self._changed:
            return self._table.pop(raw, None) is not None

    def num_keys(self) -> int:
        """The number of keys."""
        with self._changed:
            return len(self._table)

    def _wait_for(self, raws: list[bytes], seconds: float, call: str) -> None:
        """Under the lock: until every key exists, at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while missing := [k.decode(errors="replace") for k in raws if k not in self._table]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(f"HashStore.{call}: timed out after {seconds:g} s waiting for keys {missing}")
            self._changed.wait(left)
