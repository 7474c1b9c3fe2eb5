"""The mpi backend's small parts: AVG's division (integers: NCCL's, truncating toward zero), MPI's errors as
commlib's, a bounded wait on one request."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from commlib.backends.base import poll
from commlib.errors import TransportError

__all__ = ["Req", "average", "mpi_error", "settle"]

_FAST_POLLS = range(256)


def average(buf: np.ndarray, n: int) -> None:
    """buf /= n in place, as NCCL's AVG: complex numbers component by component (a real division); integers
    divided exactly, truncating toward zero (C's division: -7 / 2 == -3), never through a float."""
    if buf.dtype.kind in "iu":
        _divide_integers(buf, n)
        return
    flat = buf.view(buf.real.dtype) if buf.dtype.kind == "c" else buf
    np.divide(flat, n, out=flat)


def _divide_integers(buf: np.ndarray, n: int) -> None:
    """buf //= n truncating toward zero, in place: the remainder (C's, the dividend's sign) is taken off first,
    so the floor division that follows is exact. A divisor the dtype cannot hold is a wider integer."""
    info = np.iinfo(buf.dtype)
    divisor = buf.dtype.type(n) if n <= info.max else (np.uint64(n) if info.min == 0 else np.int64(n))
    if info.min < 0:
        np.subtract(buf, np.fmod(buf, divisor), out=buf, casting="same_kind")
    np.floor_divide(buf, divisor, out=buf, casting="same_kind")


def mpi_error(e: MPI.Exception) -> TransportError:
    return TransportError(f"MPI reported an error: {e.Get_error_string()}")


def settle(req: MPI.Request, timeout: float, abandoned: list) -> bool:
    """Wait for ``req`` with a deadline (a few tight tests, then :func:`poll`). A request that times out or is
    interrupted is put in ``abandoned``: MPI may still use what it references."""
    test = req.Test
    try:
        for _ in _FAST_POLLS:
            if test():
                return True
        if poll(test, timeout):
            return True
    except MPI.Exception as e:
        raise mpi_error(e) from None
    except BaseException:
        abandoned.append(req)
        raise
    abandoned.append(req)
    return False


class Req:
    """A handle over one MPI request (the setup's nonblocking calls)."""

    __slots__ = ("keep", "req")

    def __init__(self, req: MPI.Request, keep: object = None) -> None:
        self.req = req
        self.keep = keep  # what MPI reads or writes until completion

    def test(self) -> bool:
        try:
            return self.req.Test()
        except MPI.Exception as e:
            raise mpi_error(e) from None

    def wait(self, timeout: float) -> bool:
        return settle(self.req, timeout, _abandoned)

    def defer(self) -> bool:
        return False  # host memory: the caller waits


_abandoned: list = []  # requests whose wait gave up (kept referenced for good)
