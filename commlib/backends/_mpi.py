"""The mpi backend's small parts: AVG's division, MPI's errors as commlib's, a bounded wait on one request."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from commlib.backends.base import poll
from commlib.errors import TransportError

__all__ = ["Req", "average", "mpi_error", "settle"]

_FAST_POLLS = range(256)


def average(buf: np.ndarray, n: int) -> None:
    """buf /= n in place; complex numbers component by component (a real division, as NCCL's AVG)."""
    flat = buf.view(buf.real.dtype) if buf.dtype.kind == "c" else buf
    np.divide(flat, n, out=flat)


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
