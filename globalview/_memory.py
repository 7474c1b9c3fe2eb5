"""A caching allocator for large host buffers: what cupy's memory pool does for device memory.

Every conversion makes new arrays (boxing never writes its input). Fresh large
host allocations are fresh pages, and the kernel zeroes each on first touch:
for a 64 MiB all_gather that costs about as much as the communication itself.
So the buffers globalview makes are carved from anonymous memory maps kept in
a pool: when the last array viewing one dies, its map goes back to the pool and
the next buffer of that size reuses the already-resident pages.

Only numpy buffers of at least ``MIN_BYTES`` are pooled; the pool keeps at most
``GLOBALVIEW_POOL_MB`` (default 1024) MiB of unused maps; 0 turns it off.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from typing import Any

import numpy as np

from commlib import setting

__all__ = ["empty", "held_bytes"]

MIN_BYTES = 1 << 20
_LIMIT = int(setting("GLOBALVIEW_POOL_MB") * (1 << 20))
_free: dict[int, list[mmap.mmap]] = {}
_lock = threading.Lock()
_held = [0]
_types: dict[int, type] = {}


def _give_back(self: Any) -> None:
    raw = self._raw
    with _lock:
        if _held[0] + len(raw) <= _LIMIT:
            _free.setdefault(len(raw), []).append(raw)
            _held[0] += len(raw)


def _owner_type(n: int) -> type:
    """A ctypes array type of ``n`` bytes whose instances return their memory when they die."""
    t = _types.get(n)
    if t is None:
        t = _types[n] = type(f"_PooledBuffer{n}", (ctypes.c_ubyte * n,), {"__del__": _give_back})
    return t


def empty(xp: Any, shape: Any, dtype: Any) -> Any:
    """``xp.empty(shape, dtype)``, from the pool for large numpy buffers."""
    dtype = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    n = int(math.prod(shape)) * dtype.itemsize  # not numpy's prod: 3 us, 25 with cold caches (each boxing step asks)
    if xp is not np or n < MIN_BYTES or _LIMIT <= 0:
        return xp.empty(shape, dtype)
    with _lock:
        maps = _free.get(n)
        raw = maps.pop() if maps else None
        if raw is not None:
            _held[0] -= n
    if raw is None:
        raw = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            raw.madvise(mmap.MADV_HUGEPAGE)  # as numpy does for its large arrays: fewer faults and TLB misses
    owner = _owner_type(n).from_buffer(raw)
    owner._raw = raw
    return np.frombuffer(owner, dtype).reshape(shape)


def held_bytes() -> int:
    """Bytes of unused memory the pool keeps."""
    return _held[0]
