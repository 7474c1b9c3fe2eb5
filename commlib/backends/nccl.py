"""The ``nccl`` backend: NCCL through ``cupy.cuda.nccl`` (or its CPU emulator), one stream per group.

The NCCL module and the CUDA runtime namespace are parameters: on a GPU machine
they are ``cupy.cuda.nccl`` and ``cupy.cuda`` with cupy arrays; with
``COMMLIB_NCCL_EMULATOR=1`` they are ``commlib.backends.nccl_emulator`` and its
``cuda`` namespace with numpy arrays, so this same code runs in CI without a GPU.

Every operation is enqueued on the group's stream after the caller's current
stream (through an event), and its handle holds an event recorded after it.
Buffers are kept alive by the handle until the event has completed.
"""

from __future__ import annotations

import collections
import functools
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from commlib._ops import ReduceOp
from commlib.arrays import address, bfloat16, device_array, host_array
from commlib.backends._cuda import load, nccl_unavailable_reason
from commlib.backends.base import Backend, CallsDiffer, Handle, Meeting, MeetingTimeout, poll
from commlib.errors import CommError

__all__ = ["NcclBackend", "check_reduction", "load", "nccl_unavailable_reason", "unique_id"]

_TYPE_NAMES = {
    np.dtype(np.int8): "NCCL_INT8",
    np.dtype(np.uint8): "NCCL_UINT8",
    np.dtype(np.int32): "NCCL_INT32",
    np.dtype(np.uint32): "NCCL_UINT32",
    np.dtype(np.int64): "NCCL_INT64",
    np.dtype(np.uint64): "NCCL_UINT64",
    np.dtype(np.float16): "NCCL_FLOAT16",
    bfloat16: "NCCL_BFLOAT16",
    np.dtype(np.float32): "NCCL_FLOAT32",
    np.dtype(np.float64): "NCCL_FLOAT64",
}
# Dtypes NCCL has no type for are moved as the view that has one (same bytes).
_MOVE_VIEW = {
    np.dtype(np.bool_): np.dtype(np.uint8),
    np.dtype(np.int16): np.dtype(np.uint8),
    np.dtype(np.uint16): np.dtype(np.uint8),
    np.dtype(np.complex64): np.dtype(np.float32),
    np.dtype(np.complex128): np.dtype(np.float64),
}
_OP_NAMES = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.AVG: "NCCL_AVG",
}
# On bool (moved as uint8 0/1) torch's or/and are NCCL's max/min.
_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.BOR: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.MIN,
    ReduceOp.MIN: ReduceOp.MIN,
    ReduceOp.BAND: ReduceOp.MIN,
}
_BOOL, _SPLIT_NOCOLOR, _INT64 = np.dtype(np.bool_), -1, np.dtype(np.int64)
_AVG_SINCE = 21000  # ncclAvg (every type; integers: the sum divided, truncating toward zero) came with NCCL 2.10


def check_reduction(dtype: np.dtype, op: ReduceOp) -> str | None:
    """Why NCCL cannot reduce ``dtype`` with ``op`` (None when it can)."""
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dtype != _BOOL:
        return "NCCL has no bitwise reductions; use the mpi backend for them"
    if dtype == _BOOL:
        return None if op in _BOOL_OPS else "NCCL has no xor; use the mpi backend"
    if dtype.kind == "c":
        return None if op in (ReduceOp.SUM, ReduceOp.AVG) else "NCCL reduces complex numbers only with SUM and AVG"
    if dtype not in _TYPE_NAMES:
        return f"NCCL has no {dtype} type (it can only move it)"
    return None


_check_reduction = functools.lru_cache(maxsize=256)(check_reduction)  # a pure function of a few hashable values


_TORCH_TYPES: dict[type, bool] = {}


def _from_torch(kind: type) -> bool:
    """Whether arrays of type ``kind`` are torch tensors (remembered per type: a hot-path check)."""
    known = _TORCH_TYPES.get(kind)
    if known is None:
        known = _TORCH_TYPES[kind] = kind.__module__.startswith("torch")
    return known


class _EventHandle:
    """Completion of enqueued work: an event recorded on the group's stream after it."""

    __slots__ = ("backend", "caller", "check", "event", "keep")

    def __init__(self, backend: NcclBackend, event: Any, keep: tuple, caller: Any) -> None:
        self.backend = backend
        self.event = event  # None while the enclosing NCCL group has not ended
        self.keep = keep  # buffers that must outlive the operation
        self.caller = caller  # the stream the caller's work was on when it was enqueued (None on the emulator)
        self.check: tuple | None = None  # (fingerprints, this rank's, its call in words): see NcclBackend._checked

    def test(self) -> bool:
        if self.event is not None and self.event.done:
            self.backend.raise_async_error()  # work that ended because the communicator failed did not complete
            self.keep = ()
            if self.check is not None:
                check, self.check = self.check, None
                _verify(*check)
            return True
        self.backend.raise_async_error()
        return False

    def wait(self, timeout: float) -> bool:
        return self.test() or poll(self.test, timeout)

    def defer(self) -> bool:
        """Make the caller's current stream wait for this work, without blocking the host."""
        if self.event is None:  # still inside an open NCCL group: nothing recorded to wait on yet
            return False
        (self.caller or self.backend.caller_stream(self.keep)).wait_event(self.event)
        return True


def _fingerprint(kind: str, seq: int, dtype: Any, count: int, op: ReduceOp | None, root: int) -> tuple[int, str]:
    """A call's fingerprint (63 bits: its sequence number and a CRC of what must agree) and its words."""
    text = (
        f"{kind} #{seq} ({dtype}, {count} elements"
        + (f", {op.name}" if op else "")
        + (f", root {root})" if root >= 0 else ")")
    )
    return ((seq & 0x7FFFFFFF) << 32) | zlib.crc32(text.encode()), text


def _verify(fingerprints: Any, mine: int, text: str) -> None:
    """After a checked call: every rank's fingerprint was this rank's (the max and the min of all are)."""
    got = fingerprints.get() if hasattr(fingerprints, "get") else fingerprints
    if int(got[0]) != mine or -int(got[1]) != mine:
        raise CallsDiffer(text)


def unique_id(nccl: Any) -> bytes:
    """A fresh ncclUniqueId as 128 bytes (cupy returns bytes; older cupy, a tuple of ints)."""
    made = nccl.get_unique_id()
    return made if isinstance(made, bytes) else bytes(np.asarray(made).astype(np.uint8))


class NcclBackend(Backend):
    """Moves device (or, emulated, host) buffers between the ranks of one NCCL communicator.

    all_to_all, gather and scatter are the base class's grouped send/recv, as NCCL advises.
    ``bootstrap`` carries unique ids to new groups' members (:meth:`~Backend.rendezvous`: the MPI
    world the job was started in, or the job's store), and ``bootstrap_ranks[r]`` is its rank for
    this communicator's rank r.
    """

    name = "nccl"
    any_source = False  # NCCL receives only from a named peer
    max_tag = 2**31 - 3  # NCCL has no tags: accepted and ignored, as by torch's nccl backend

    def __init__(
        self,
        nccl: Any,
        cuda: Any,
        xp: Any,
        comm: Any,
        host: bool,
        bootstrap: Meeting | None = None,
        bootstrap_ranks: list[int] | None = None,
    ) -> None:
        self.nccl, self.cuda, self.xp, self.comm, self.host = nccl, cuda, xp, comm, host
        self.rank, self.size = comm.rank_id(), comm.size()
        self.bootstrap, self.bootstrap_ranks = bootstrap, bootstrap_ranks or list(range(self.size))
        self.stream = cuda.Stream(non_blocking=True)
        self._ready = cuda.Event(disable_timing=True)  # marks the caller's work, which ours must follow
        self._reductions: dict[tuple[Any, ReduceOp], tuple[Any, int, int]] = {}  # (dtype, op) -> (view, type, op)
        self._types = {d: getattr(nccl, n) for d, n in _TYPE_NAMES.items()}
        self._ops = {op: getattr(nccl, n) for op, n in _OP_NAMES.items()}
        self._depth = 0
        self._grouped: list[_EventHandle] = []
        self._unverified: collections.deque[_EventHandle] = collections.deque()  # device calls to check later
        self._aborted = False
        self._version = int(nccl.get_version())

    def __repr__(self) -> str:
        return f"<NcclBackend rank {self.rank}/{self.size} over {self.comm!r}>"

    def array(self, obj: object, ctx: Any, call: str, arg: str, writable: bool = True) -> Any:
        """Host arrays on the emulator, device arrays (cupy, torch CUDA) on GPUs."""
        return (host_array if self.host else device_array)(obj, ctx, call, arg, writable)

    def unsupported(self, dtype: np.dtype, op: ReduceOp) -> str | None:
        """What NCCL cannot reduce: bitwise ops, xor on bool, 16-bit integers, complex products; AVG before 2.10."""
        if op is ReduceOp.AVG and self._version < _AVG_SINCE:
            v = self._version  # NCCL's code: major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 before
            version = f"{v // 10000}.{v // 100 % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}"
            return f"NCCL {version} has no AVG (ncclAvg needs NCCL 2.10 or newer); use SUM and divide"
        return _check_reduction(dtype, op)

    # -- plumbing -----------------------------------------------------------------
    def caller_stream(self, keep: tuple = ()) -> Any:
        """The stream the caller's work is on: torch's current stream for torch tensors, else cupy's."""
        if not self.host:
            for a in keep:
                if _TORCH_TYPES.get(type(a)) or (type(a) not in _TORCH_TYPES and _from_torch(type(a))):
                    import torch

                    return self.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        return self.cuda.get_current_stream()

    def _enqueue(self, launch: Callable[..., None], args: tuple, keep: tuple) -> _EventHandle:
        """Enqueue ``launch(*args, stream)`` on the group's stream, after the caller's work."""
        caller = None
        if not self.host:  # host code is synchronous: emulated callers have nothing in flight to order after
            caller = self.caller_stream(keep)
            # One event serves every call: a stream waits on the record made before its wait_event, and
            # later records do not change that (CUDA's cudaStreamWaitEvent semantics).
            self._ready.record(caller)
            self.stream.wait_event(self._ready)
        launch(*args, self.stream.ptr)
        handle = _EventHandle(self, None, keep, caller)
        if self._depth:
            self._grouped.append(handle)
        else:
            handle.event = self._record()
        return handle

    def _record(self) -> Any:
        event = self.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return event

    def _move(self, a: Any) -> tuple[Any, int, int]:
        """(array as NCCL sees it, count, NCCL datatype) for moving ``a``'s bytes."""
        view = _MOVE_VIEW.get(a.dtype)
        if view is not None:
            a = a.view(view)
        return a, a.size, self._types[a.dtype]

    def _reduce_args(self, a: Any, op: ReduceOp) -> tuple[Any, int, int, int]:
        if a.dtype == _BOOL:
            op = _BOOL_OPS[op]
        a, count, dtype = self._move(a)
        return a, count, dtype, self._ops[op]

    def _reduction(self, dtype: Any, op: ReduceOp) -> tuple[Any, int, int]:
        """(the view NCCL reduces ``dtype`` as, or None; NCCL's datatype; NCCL's op), made once per pair."""
        view = _MOVE_VIEW.get(dtype)
        nop = self._ops[_BOOL_OPS[op] if dtype == _BOOL else op]
        plan = self._reductions[dtype, op] = (view, self._types[dtype if view is None else view], nop)
        return plan

    def raise_async_error(self) -> None:
        """Surface an error NCCL reported asynchronously (a dead peer, an abort) as ``CommError``."""
        try:
            self.comm.check_async_error()
        except self.nccl.NcclError as e:
            raise CommError(f"NCCL reported an error: {e}") from None

    # -- the check: every collective with its fingerprint ------------------------------------------
    def _checked(self, call: tuple, launch: Callable[..., None], args: tuple, keep: tuple) -> _EventHandle:
        """``launch(*args)`` and, in the same NCCL group, a MAX all-reduce of this call's fingerprint and its
        negation (``call``: kind, seq, dtype, count, op, root): every rank made the same call exactly when the
        result is the fingerprint and its negation again. NCCL cannot say what another rank called, only that
        the calls differ; the check runs when the host learns the work is done (a wait, a test: a call whose
        stream alone waits is checked once a later call finds it done)."""
        self._verify_done()
        mine, text = _fingerprint(*call)
        prints = self.xp.asarray(np.array([mine, -mine], np.int64))
        at = address(prints)
        self.group_start()
        try:
            self._enqueue(self.comm.allReduce, (at, at, 2, self._types[_INT64], self._ops[ReduceOp.MAX]), (prints,))
            handle = self._enqueue(launch, args, keep)
        finally:
            self.group_end()
        handle.check = (prints, mine, text)
        if not self.host:
            self._unverified.append(handle)
        return handle

    def _verify_done(self) -> None:
        """The checks of earlier device calls whose work is done, oldest first (never waits)."""
        pending = self._unverified
        while pending and (pending[0].check is None or (pending[0].event is not None and pending[0].event.done)):
            handle = pending.popleft()
            if handle.check is not None:
                check, handle.check = handle.check, None
                _verify(*check)

    # -- primitives ---------------------------------------------------------------
    def all_reduce(self, sendbuf: Any, recvbuf: Any, op: ReduceOp, seq: int, kind: str = "all_reduce") -> Handle:
        view, dt, nop = self._reductions.get((sendbuf.dtype, op)) or self._reduction(sendbuf.dtype, op)
        s = sendbuf if view is None else sendbuf.view(view)
        r = s if sendbuf is recvbuf else recvbuf if view is None else recvbuf.view(view)
        sptr = address(s)
        rptr = sptr if r is s else address(r)
        call = (kind, seq, sendbuf.dtype, sendbuf.size, op, -1)
        return self._checked(call, self.comm.allReduce, (sptr, rptr, s.size, dt, nop), (s, r))

    def reduce(self, sendbuf: Any, recvbuf: Any, op: ReduceOp, root: int, seq: int) -> Handle:
        s, count, dt, nop = self._reduce_args(sendbuf, op)
        r = self._move(recvbuf)[0]
        call = ("reduce", seq, sendbuf.dtype, sendbuf.size, op, root)
        return self._checked(call, self.comm.reduce, (address(s), address(r), count, dt, nop, root), (s, r))

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: ReduceOp, seq: int) -> Handle:
        s, _, dt, nop = self._reduce_args(sendbuf, op)
        r, count, _ = self._move(recvbuf)
        call = ("reduce_scatter", seq, recvbuf.dtype, recvbuf.size, op, -1)
        return self._checked(call, self.comm.reduceScatter, (address(s), address(r), count, dt, nop), (s, r))

    def broadcast(self, buf: Any, root: int, seq: int) -> Handle:
        b, count, dt = self._move(buf)
        call = ("broadcast", seq, buf.dtype, buf.size, None, root)
        return self._checked(call, self.comm.bcast, (address(b), count, dt, root), (b,))

    def all_gather(self, sendbuf: Any | None, recvbuf: Any, seq: int) -> Handle:
        r, total, dt = self._move(recvbuf)
        count = total // self.size
        sptr = address(r) + self.rank * count * r.itemsize if sendbuf is None else address(self._move(sendbuf)[0])
        call = ("all_gather", seq, recvbuf.dtype, recvbuf.size // self.size, None, -1)
        return self._checked(call, self.comm.allGather, (sptr, address(r), count, dt), (sendbuf, r))

    def send(self, buf: Any, peer: int, tag: int) -> Handle:
        b, count, dt = self._move(buf)
        return self._enqueue(self.comm.send, (address(b), count, dt, peer), (b,))

    def recv(self, buf: Any, peer: int | None, tag: int) -> Handle:
        if peer is None:
            raise ValueError("recv: NCCL cannot receive from any source; pass src")
        b, count, dt = self._move(buf)
        return self._enqueue(self.comm.recv, (address(b), count, dt, peer), (b,))

    def group_start(self) -> None:
        """Open an NCCL group: the p2p calls until ``group_end`` are posted together."""
        self.nccl.groupStart()
        self._depth += 1

    def group_end(self) -> None:
        """Close the NCCL group; every handle issued inside it completes with one event."""
        self._depth -= 1
        self.nccl.groupEnd()
        if self._depth == 0 and self._grouped:
            event = self._record()
            for handle in self._grouped:
                handle.event = event
            self._grouped = []

    def barrier(self, seq: int) -> Handle:
        """NCCL has no barrier: an all_reduce of one element stands in for it (as torch does)."""
        flag = self.xp.zeros(1, np.float32)
        return self.all_reduce(flag, flag, ReduceOp.SUM, seq, "barrier")

    # -- communicators --------------------------------------------------------------
    def split(self, ranks: list[int], timeout: float) -> NcclBackend | None:
        """Sub-communicator of ``ranks`` through ``commSplit`` (collective over this communicator)."""
        member = self.rank in ranks
        sub = self.comm.commSplit(0 if member else _SPLIT_NOCOLOR, ranks.index(self.rank) if member else 0)
        return self._sub(sub, ranks) if member else None

    def rendezvous(self, ranks: list[int], timeout: float, payload: bytes = b"", what: str = "group setup") -> bytes:
        """Meet through the bootstrap: NCCL runs a stream's receives in order, so it cannot say who is late."""
        if self.bootstrap is None:
            return super().rendezvous(ranks, timeout, payload, what)
        mapped = [self.bootstrap_ranks[r] for r in ranks]
        try:
            return self.bootstrap.rendezvous(mapped, timeout, payload, what)
        except MeetingTimeout as e:
            if e.missing is None:
                raise
            raise MeetingTimeout(str(e), [ranks[mapped.index(r)] for r in e.missing]) from None

    def create_group(self, ranks: list[int], timeout: float) -> NcclBackend:
        """Sub-communicator of ``ranks`` made by its members alone: a fresh unique id from ``ranks[0]``."""
        if self.bootstrap is None:
            raise CommError("new_group(use_local_synchronization=True): this NCCL communicator has no bootstrap")
        uid = unique_id(self.nccl) if self.rank == ranks[0] else b""
        uid = self.rendezvous(ranks, timeout, uid, what="an NCCL group's unique id")
        return self._sub(self.nccl.NcclCommunicator(len(ranks), uid, ranks.index(self.rank)), ranks)

    def _sub(self, comm: Any, ranks: list[int]) -> NcclBackend:
        mapped = [self.bootstrap_ranks[r] for r in ranks]
        return NcclBackend(self.nccl, self.cuda, self.xp, comm, self.host, self.bootstrap, mapped)

    def abort(self, reason: str = "") -> None:
        """Abort the communicator: unblocks work stuck on a dead peer (NCCL's ncclCommAbort)."""
        if not self._aborted:
            self._aborted = True
            self.comm.abort()

    def close(self) -> None:
        """Release the communicator."""
        if not self._aborted:
            self.comm.destroy()
