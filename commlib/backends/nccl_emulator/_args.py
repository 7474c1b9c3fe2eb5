"""Arguments of the NCCL emulator's calls, converted and checked as cupy's Cython wrappers and NCCL do."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import numpy as np

from ._errors import INVALID_ARGUMENT, NcclError
from ._ops import DTYPES, REDOPS, host_array
from ._streams import Stream, resolve_stream

__all__ = ["dtype_of", "exclusions", "host", "index", "reduction", "size_t", "stream_of"]


def index(value: object, name: str) -> int:
    """An integer argument, converted like Cython does (TypeError for non-integers)."""
    if type(value) is int:  # the common case, without a call
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]  # what __index__ accepts is the point of the call
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def size_t(value: object, name: str) -> int:
    """A non-negative integer argument (OverflowError below zero, as Cython's size_t)."""
    number = index(value, name)
    if number < 0:
        raise OverflowError(f"can't convert negative value to size_t ({name}={number})")
    return number


def dtype_of(datatype: object) -> np.dtype:
    """The numpy dtype of an NCCL datatype."""
    dtype = DTYPES.get(index(datatype, "datatype"))
    if dtype is None:
        raise NcclError(INVALID_ARGUMENT, f"datatype {datatype} is not an NCCL datatype")
    return dtype


def reduction(op: object) -> int:
    """An NCCL reduction op, checked."""
    code = index(op, "op")
    if code not in REDOPS:
        raise NcclError(INVALID_ARGUMENT, f"op {op} is not an NCCL reduction")
    return code


def stream_of(stream: object) -> Stream:
    """The emulated Stream an NCCL call's ``stream`` names."""
    try:
        return resolve_stream(index(stream, "stream"))
    except KeyError:
        raise NcclError(INVALID_ARGUMENT, f"stream {stream:#x} is not a live emulated stream") from None


def host(ptr: object, count: int, dtype: np.dtype, name: str) -> np.ndarray:
    """A numpy view of an operation's buffer at host address ``ptr`` (NULL only when empty)."""
    address = index(ptr, name)
    if address == 0 and count > 0:
        raise NcclError(INVALID_ARGUMENT, f"{name} is NULL")
    return host_array(address, count, dtype)


def exclusions(ranks: object, rank: int, size: int) -> list[int]:
    """commShrink's ``excludeRanks``: distinct ranks of the communicator, at least one, not the caller's (sorted)."""
    if not isinstance(ranks, Iterable) or isinstance(ranks, str | bytes):
        raise TypeError(f"excludeRanks must be a sequence of ranks, got {type(ranks).__name__}")
    exclude = sorted({index(r, "excludeRanks") for r in ranks})
    if not exclude:
        raise NcclError(INVALID_ARGUMENT, "excludeRanks must name at least one rank (NCCL: excludeRanksCount > 0)")
    outside = [r for r in exclude if not 0 <= r < size]
    if outside:
        raise NcclError(INVALID_ARGUMENT, f"excludeRanks {outside} are not ranks of a communicator of size {size}")
    if rank in exclude:
        raise NcclError(
            INVALID_ARGUMENT,
            f"rank {rank} is in excludeRanks {exclude}: only the ranks that stay call commShrink",
        )
    return exclude
