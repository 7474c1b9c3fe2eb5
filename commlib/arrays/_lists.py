"""Lists of arrays that lie back to back in one buffer: a collective reads or writes them where they are."""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib.arrays._intake import address

__all__ = ["packed", "unpack"]

_PACKED_FROM = 64 << 10  # bytes


def packed(parts: list[Any]) -> Any | None:
    """One flat view over ``parts`` when they lie back to back, in order, in one numpy buffer; else None.

    A list such as ``[x[0:n], x[n:2n], ...]`` then needs no staging buffer and no copy: the
    collective reads or writes it where it is.
    """
    first = parts[0] if parts else None
    if type(first) is not np.ndarray or first.nbytes * len(parts) < _PACKED_FROM:
        return None  # small lists: staging costs less than finding out
    got = _span(parts)
    if got is None:
        return None
    root, base, size, start, at = got
    count = (at - start) // first.itemsize
    if 0 <= base <= start and at <= base + size:  # a view of the root: ~0.4 us, as_strided ~2 us
        flat = np.ndarray((count,), first.dtype, buffer=root, offset=start - base)
        if not first.flags.writeable:
            flat.flags.writeable = False
        return flat
    flat = first.reshape(-1)
    return np.lib.stride_tricks.as_strided(flat, (count,), (first.itemsize,), writeable=flat.flags.writeable)


def _span(parts: list[Any]) -> tuple[np.ndarray, int, int, int, int] | None:
    """(root array, its address or -1, its bytes, start, end) of back-to-back parts of one dtype in one root's
    memory, else None."""
    first = parts[0]
    owner, at = _owner(first), address(first)
    start = at
    for a in parts:
        if type(a) is not np.ndarray or not a.flags.c_contiguous or a.dtype != first.dtype or address(a) != at:
            return None
        if _owner(a) is not owner:
            return None
        at += a.nbytes
    root = first
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root, (address(root) if root.flags.c_contiguous else -1), root.nbytes, start, at


def _owner(a: np.ndarray) -> Any:
    """The object that owns ``a``'s memory (the end of its chain of bases)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base if a.base is not None else a


def unpack(flat: Any, outs: list[Any]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (each its own size and shape)."""
    start = 0
    for a in outs:
        a[...] = flat[start : start + a.size].reshape(a.shape)
        start += a.size
