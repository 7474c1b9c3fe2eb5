"""An EMULATOR of ``cupy.cuda.nccl`` on host memory, for running commlib's nccl backend without a GPU.

It has the public surface of ``cupy.cuda.nccl`` (same constants, functions,
``NcclCommunicator`` methods and argument names) plus ``cuda``, the small part
of ``cupy.cuda`` the backend uses (streams, events, devices). "Device
pointers" are host addresses (e.g. ``numpy_array.ctypes.data``); streams are
host worker threads; data moves between ranks over TCP. ``EMULATED`` is True.

World formation works like NCCL's: ``get_unique_id()`` starts a bootstrap root
in the calling process; any launcher may carry the id to the other ranks, which
pass it to ``NcclCommunicator(ndev, commId, rank)``. Timeouts (initialisation,
and every operation from the moment it starts running) come from the environment
variable ``COMMLIB_NCCL_EMULATOR_TIMEOUT`` (seconds, default 300); a failed or
timed-out operation breaks its communicator and is reported by
``check_async_error()``, like an NCCL async error.

Failures. A rank whose process dies (its connections end without a goodbye)
breaks, within milliseconds, every communicator it belongs to on every other
rank: ``check_async_error()`` raises ``NCCL_ERROR_REMOTE_ERROR`` naming it
("rank 2 of this communicator: connection closed (process died?)"), even when
no operation is in flight; the operations pending on any stream fail at once,
so their events complete (the work is flushed, as after an NCCL abort), and
later calls raise. A rank that destroyed its communicator, or aborted it, or
whose communicator broke, only makes the operations that need it fail, naming
it and saying which (its connections carry a goodbye or a notice first).
``abort()`` may be called from any thread while operations are pending: it
ends them on every stream and returns within ~50 ms. ``commShrink(excludeRanks,
flags)`` models ncclCommShrink (NCCL 2.27+; cupy has no binding): the ranks
that stay, and only they, make a communicator of themselves, renumbered in
order, without a byte to or from an excluded rank (they may be dead), also
from a broken communicator; ``NCCL_SHRINK_ABORT`` first ends the parent's
pending operations. The child has connections of its own (each communicator
keeps its listener and every rank's address for that), so nothing of the
parent's aborted operations can reach it. A communicator among the survivors
can also be made with a fresh ``get_unique_id()``; the old one may be aborted,
destroyed (which does not wait on a dead rank) or left alone.

Not NCCL: no GPU, NVLink or InfiniBand, no CUDA graphs; calls on the null
stream (0) run synchronously in the caller; other streams do not synchronise
implicitly with the null stream (use events); a send never needs its matching
receive to be posted (NCCL may deadlock where the emulator does not);
float16/bfloat16 reductions accumulate in float32; a dead rank breaks even an
idle communicator at once, and a rank's abort is told to its peers (NCCL may
only find out when an operation needs that rank); ``initAll`` accepts any
device ids; creating a communicator blocks at once, even inside a group;
``Event.done`` and ``Stream.done`` may wait up to 1 ms for pending work before
they answer False (the emulated device needs the host's GIL to make progress);
opening a communicator lowers the process's GIL switch interval to 0.5 ms (its
reader threads would otherwise hold the other threads up to 5 ms a message).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from ._args import dtype_of, exclusions, host, index, reduction, size_t, stream_of
from ._comm import CommCore, shrink, split
from ._errors import INVALID_ARGUMENT, NcclError, check_status, op_timeout
from ._launch import group_end, group_start, submit
from ._ops import AllGather, AllReduce, Broadcast, Op, PointToPoint, Reduce, ReduceScatter
from ._streams import Stream, cuda
from ._wire import bootstrap, connect_mesh, new_unique_id, open_listener

__all__ = [
    "EMULATED",
    "NCCL_AVG",
    "NCCL_BFLOAT16",
    "NCCL_CHAR",
    "NCCL_DOUBLE",
    "NCCL_FLOAT",
    "NCCL_FLOAT16",
    "NCCL_FLOAT32",
    "NCCL_FLOAT64",
    "NCCL_HALF",
    "NCCL_INT",
    "NCCL_INT32",
    "NCCL_INT64",
    "NCCL_INT8",
    "NCCL_MAX",
    "NCCL_MIN",
    "NCCL_PROD",
    "NCCL_SHRINK_ABORT",
    "NCCL_SHRINK_DEFAULT",
    "NCCL_SUM",
    "NCCL_UINT32",
    "NCCL_UINT64",
    "NCCL_UINT8",
    "NcclCommunicator",
    "NcclConfig",
    "NcclError",
    "available",
    "check_status",
    "cuda",
    "get_build_version",
    "get_unique_id",
    "get_version",
    "groupEnd",
    "groupStart",
]

#: This module is an emulator, not NVIDIA's NCCL.
EMULATED = True
available = True

# ncclRedOp_t and ncclDataType_t, the values of cupy.cuda.nccl (cupy 14, NCCL 2.x).
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9

_SPLIT_NOCOLOR = -1  # NCCL_SPLIT_NOCOLOR in nccl.h (cupy does not export it)
# ncclCommShrink's flags (nccl.h, NCCL 2.27+; cupy has no commShrink): shrink as is, or first abort the
# parent's operations in flight.
NCCL_SHRINK_DEFAULT, NCCL_SHRINK_ABORT = 0x00, 0x01
_VERSION = 22105  # NCCL 2.21.5 in NCCL's encoding (major*10000 + minor*100 + patch): what the emulator mimics


def get_unique_id() -> bytes:
    """Start a bootstrap root in this process and return the 128-byte id naming it (cupy >= 14 returns bytes)."""
    return new_unique_id(op_timeout())


def get_version() -> int:
    """The NCCL EMULATOR's version: 22105, i.e. it mimics NCCL 2.21.5 (no real NCCL is involved)."""
    return _VERSION


def get_build_version() -> int:
    """The NCCL EMULATOR's build version (same as ``get_version()``)."""
    return _VERSION


def groupStart() -> None:
    """Start a group: NCCL calls of this thread are collected until the matching groupEnd()."""
    group_start()


def groupEnd() -> None:
    """End a group; the outermost groupEnd() launches the collected calls (sends/recvs in any order)."""
    group_end(op_timeout())


class NcclConfig:
    """Configuration for communicator creation; accepted and ignored by the emulator."""

    def __init__(self, split_share: int = 0) -> None:
        self.split_share = split_share


class NcclCommunicator:
    """An EMULATED NCCL communicator (cupy.cuda.nccl.NcclCommunicator's API) for host memory and TCP."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config: NcclConfig | None = None) -> None:
        self._core: CommCore | None = None
        self._device = cuda.runtime.getDevice()
        ndev, rank = index(ndev, "ndev"), index(rank, "rank")
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank} is not in a world of ndev={ndev}")
        timeout = op_timeout()
        listener = open_listener()
        try:
            comm_id, table, ip = bootstrap(commId, ndev, rank, listener.port, timeout)
            socks = connect_mesh(comm_id, rank, table, listener, time.monotonic() + timeout)
        except BaseException:
            listener.close()
            raise
        self._core = CommCore(rank, ndev, comm_id, socks, ip, listener, table)  # keeps the listener (commShrink)

    @classmethod
    def _wrap(cls, core: CommCore, device: int) -> NcclCommunicator:
        comm = cls.__new__(cls)
        comm._core, comm._device = core, device
        return comm

    def __repr__(self) -> str:
        core = self._core
        if core is None:
            return "<NcclCommunicator (NCCL EMULATOR, not initialised)>"
        return f"<NcclCommunicator (NCCL EMULATOR) rank {core.rank}/{core.size} id {core.comm_id:#018x} {core.state}>"

    # Bound as defaults: at interpreter exit module globals (sys, contextlib) may already be None.
    def __del__(self, _finalizing=sys.is_finalizing, _suppress=contextlib.suppress) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not _finalizing():  # at exit the process's sockets close anyway
            with _suppress(Exception):
                core.release()  # like cupy's __dealloc__ -> destroy, but never blocking the garbage collector

    @property
    def comm(self) -> int:
        """A non-zero handle while the communicator is usable, else 0 (cupy's ``ncclComm_t`` value)."""
        core = self._core
        return core.comm_id if core is not None and core.state == "open" else 0

    def _open(self) -> CommCore:
        core = self._core
        if core is None or core.state != "open":
            raise NcclError(INVALID_ARGUMENT, "the communicator was destroyed or aborted")
        return core

    def _usable(self) -> CommCore:
        core = self._open()
        core.check_usable()
        return core

    @staticmethod
    def initAll(devices: int | list[int]) -> list[NcclCommunicator]:
        """Create one communicator per entry of ``devices`` in this process (emulated devices, any ids)."""
        if isinstance(devices, int):
            devices = list(range(devices))
        elif not isinstance(devices, list):
            raise ValueError('"devices" should be an int or a list of int.')
        uid, errors = get_unique_id(), []
        comms: list[NcclCommunicator | None] = [None] * len(devices)

        def make(rank: int) -> None:
            try:
                comm = comms[rank] = NcclCommunicator(len(devices), uid, rank)
                comm._device = devices[rank]
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(len(devices))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return [c for c in comms if c is not None]

    def destroy(self) -> None:
        """Wait for the launched operations, then close the connections gracefully (idempotent)."""
        if self._core is not None:
            self._core.destroy(op_timeout())

    def abort(self) -> None:
        """Fail every operation in flight at once, close the connections, and return without waiting."""
        if self._core is not None:
            self._core.abort()

    def device_id(self) -> int:
        """The emulated device of this communicator (0 unless made by initAll)."""
        self._open()
        return self._device

    def rank_id(self) -> int:
        """This process's rank in the communicator."""
        return self._open().rank

    def size(self) -> int:
        """The number of ranks."""
        return self._open().size

    def check_async_error(self) -> None:
        """Raise the NcclError that broke the communicator (a failed or timed-out operation), if any."""
        error = self._open().async_error
        if error is not None:
            raise NcclError(error.status, error.detail)

    def _submit(self, op: Op, stream: Stream) -> None:
        submit(op, stream, op_timeout())

    def _root(self, core: CommCore, root: object, name: str = "root") -> int:
        value = index(root, name)
        if not 0 <= value < core.size:
            raise NcclError(INVALID_ARGUMENT, f"{name} {value} is not a rank of a communicator of size {core.size}")
        return value

    def _common(self, count: object, datatype: object, stream: object, name: str = "count") -> tuple:
        """Validate what every operation takes: (core, count, dtype, stream)."""
        core = self._usable()
        return core, size_t(count, name), dtype_of(datatype), stream_of(stream)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        """Enqueue ncclAllReduce on ``stream`` (in place when sendbuf == recvbuf)."""
        core, count, dtype, s = self._common(count, datatype, stream)
        redop = reduction(op)
        src, dst = host(sendbuf, count, dtype, "sendbuf"), host(recvbuf, count, dtype, "recvbuf")
        self._submit(AllReduce(core, core.next_collective(), src, dst, redop), s)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        """Enqueue ncclReduce on ``stream`` (recvbuf is written on ``root`` only)."""
        core, count, dtype, s = self._common(count, datatype, stream)
        redop, root = reduction(op), self._root(core, root)
        src = host(sendbuf, count, dtype, "sendbuf")
        dst = host(recvbuf, count, dtype, "recvbuf") if core.rank == root else src
        self._submit(Reduce(core, core.next_collective(), src, dst, redop, root), s)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        """Enqueue ncclBroadcast on ``stream`` (sendbuff is read on ``root`` only)."""
        core, count, dtype, s = self._common(count, datatype, stream)
        root = self._root(core, root)
        dst = host(recvbuff, count, dtype, "recvbuff")
        src = host(sendbuff, count, dtype, "sendbuff") if core.rank == root else dst
        self._submit(Broadcast(core, core.next_collective(), src, dst, root), s)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        """Enqueue ncclBcast (an in-place broadcast) on ``stream``."""
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int) -> None:
        """Enqueue ncclReduceScatter on ``stream`` (sendbuf holds size() * recvcount elements)."""
        core, count, dtype, s = self._common(recvcount, datatype, stream, "recvcount")
        redop = reduction(op)
        src, dst = host(sendbuf, count * core.size, dtype, "sendbuf"), host(recvbuf, count, dtype, "recvbuf")
        self._submit(ReduceScatter(core, core.next_collective(), src, dst, redop), s)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        """Enqueue ncclAllGather on ``stream`` (recvbuf holds size() * count elements)."""
        core, count, dtype, s = self._common(count, datatype, stream)
        src, dst = host(sendbuf, count, dtype, "sendbuf"), host(recvbuf, count * core.size, dtype, "recvbuf")
        self._submit(AllGather(core, core.next_collective(), src, dst), s)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """Enqueue ncclSend to ``peer`` on ``stream``."""
        core, count, dtype, s = self._common(count, datatype, stream)
        peer = self._root(core, peer, "peer")
        src = host(sendbuf, count, dtype, "sendbuf")
        self._submit(PointToPoint(core, core.next_p2p(peer, sending=True), src, peer, sending=True), s)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """Enqueue ncclRecv from ``peer`` on ``stream``."""
        core, count, dtype, s = self._common(count, datatype, stream)
        peer = self._root(core, peer, "peer")
        dst = host(recvbuf, count, dtype, "recvbuf")
        self._submit(PointToPoint(core, core.next_p2p(peer, sending=False), dst, peer, sending=False), s)

    def commSplit(self, color: int, key: int, config: NcclConfig | None = None) -> NcclCommunicator | None:
        """Split collectively: ranks of equal ``color`` form a communicator ordered by (key, rank); -1 gets None."""
        core = self._usable()
        color, key = index(color, "color"), index(key, "key")
        if color < _SPLIT_NOCOLOR:
            raise NcclError(INVALID_ARGUMENT, f"color must be >= 0 or NCCL_SPLIT_NOCOLOR (-1), got {color}")
        child = split(core, color, key, op_timeout())
        return None if child is None else NcclCommunicator._wrap(child, self._device)

    def commShrink(
        self, excludeRanks: list[int], flags: int = NCCL_SHRINK_DEFAULT, config: NcclConfig | None = None
    ) -> NcclCommunicator:
        """ncclCommShrink: a new communicator of the ranks not in ``excludeRanks``, renumbered in order.

        Called by every rank that stays, and by no excluded one (that one gets INVALID_ARGUMENT); it never
        talks to an excluded rank, so it works when this communicator is broken because one of them died.
        ``flags=NCCL_SHRINK_ABORT`` first ends this communicator's operations in flight (it stays broken).
        A rank that stays but never calls makes the others fail after the emulator's timeout. Like a split,
        the new communicator has connections of its own.
        """
        core = self._open()
        exclude = exclusions(excludeRanks, core.rank, core.size)
        flags = index(flags, "flags")
        if flags not in (NCCL_SHRINK_DEFAULT, NCCL_SHRINK_ABORT):
            raise NcclError(
                INVALID_ARGUMENT, f"flags must be NCCL_SHRINK_DEFAULT (0) or NCCL_SHRINK_ABORT (1), got {flags}"
            )
        child = shrink(core, exclude, flags == NCCL_SHRINK_ABORT, op_timeout())
        return NcclCommunicator._wrap(child, self._device)
