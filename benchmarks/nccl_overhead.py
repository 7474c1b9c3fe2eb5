"""Host-side overhead of one nccl-backend all_reduce call: everything but the NCCL call itself.

    python benchmarks/nccl_overhead.py

The nccl backend runs against a null NCCL module (every call returns at once)
and a null CUDA runtime (events complete at once), so what is timed is commlib's
own work per call: argument checks, dtype/op mapping, stream ordering, handle,
wait. Target: <= 5 us per all_reduce. Single process; not a test.
"""

from __future__ import annotations

import statistics
import sys
import time
import types

import numpy as np

import commlib as dist
from commlib._group import ProcessGroup
from commlib.backends.nccl import NcclBackend


def _null_nccl() -> types.SimpleNamespace:
    """A stand-in for cupy.cuda.nccl whose every call returns at once."""

    class NcclCommunicator:
        def __init__(self, ndev: int, commId: tuple, rank: int) -> None:
            self._rank, self._size = rank, ndev

        def rank_id(self) -> int:
            return self._rank

        def size(self) -> int:
            return self._size

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
            pass

        def check_async_error(self) -> None:
            pass

    names = {
        "NCCL_INT8": 0,
        "NCCL_UINT8": 1,
        "NCCL_INT32": 2,
        "NCCL_UINT32": 3,
        "NCCL_INT64": 4,
        "NCCL_UINT64": 5,
        "NCCL_FLOAT16": 6,
        "NCCL_FLOAT32": 7,
        "NCCL_FLOAT64": 8,
        "NCCL_BFLOAT16": 9,
        "NCCL_SUM": 0,
        "NCCL_PROD": 1,
        "NCCL_MAX": 2,
        "NCCL_MIN": 3,
        "NCCL_AVG": 4,
    }
    return types.SimpleNamespace(NcclCommunicator=NcclCommunicator, NcclError=RuntimeError, **names)


def _null_cuda() -> types.SimpleNamespace:
    """A stand-in for cupy.cuda whose streams and events are complete at once."""

    class Event:
        done = True

        def __init__(self, **kwargs: object) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

    class Stream:
        ptr = 1

        def __init__(self, **kwargs: object) -> None:
            pass

        def wait_event(self, event: object) -> None:
            pass

    return types.SimpleNamespace(Stream=Stream, Event=Event, get_current_stream=lambda: Stream())


def main() -> None:
    nccl = _null_nccl()
    x = np.zeros(2, np.float32)
    for label, host in (("as emulated (host arrays)", True), ("as on a GPU (stream ordering)", False)):
        backend = NcclBackend(nccl, _null_cuda(), np, nccl.NcclCommunicator(2, (), 0), host=host)
        group = ProcessGroup(backend, [0, 1], 0, "null", 60.0, "[rank 0/2] ")
        group.buffer = backend.array = lambda obj, ctx, call, arg, writable=True: obj  # numpy plays device memory
        runs = []
        for _ in range(15):
            start = time.perf_counter()
            for _ in range(20000):
                dist.all_reduce(x, group=group)
            runs.append((time.perf_counter() - start) / 20000 * 1e6)
        print(
            f"nccl backend host overhead per all_reduce, {label}: median {statistics.median(runs):.2f} us, "
            f"min {min(runs):.2f} us (target <= 5 us)"
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
