"""The ``nccl`` backend: NCCL through ``cupy.cuda.nccl`` (or its CPU emulator), one stream per group.

The NCCL module and the CUDA runtime namespace are parameters: on a GPU machine
they are ``cupy.cuda.nccl`` and ``cupy.cuda`` with cupy arrays; with
``COMMLIB_NCCL_EMULATOR=1`` they are ``commlib.backends.nccl_emulator`` and its
``cuda`` namespace with numpy arrays, so this same code runs in CI without a GPU.

Every call is enqueued on the group's stream after the caller's current stream (through an event), and
nothing else: no host-device copy, no host synchronisation, no allocation, so a call can be captured in a
CUDA graph. Its handle completes with one event the backend records after each call (the group's calls run
in issue order on its stream, so the latest record covers every earlier call). The check that every rank
made the same calls is host-side, off the device's path: each call's description is folded into a running
digest (collectives; each peer's messages apart), and the ranks compare digests where they meet anyway (the
closing check) or when a wait lasts (the slow path, through the job's store): ``commlib.backends._digests``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from commlib._ops import ReduceOp
from commlib.arrays import address, bfloat16, device_array, host_array, to_host
from commlib.backends._call import Call, describe
from commlib.backends._cuda import emulated, load, nccl_unavailable_reason, unavailable
from commlib.backends._digests import Digests, difference
from commlib.backends.base import (
    AllOf,
    Backend,
    Handle,
    Meeting,
    MeetingTimeout,
    check_same_ranks,
    poll,
    ranks_checksum,
    setup_timeout,
)
from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError

__all__ = ["NcclBackend", "check_reduction", "load", "nccl_unavailable_reason", "unavailable", "unique_id", "world"]

_RECENT = Digests.RECENT  # calls noted before a fold (see start)

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
_BOOL, _SPLIT_NOCOLOR = np.dtype(np.bool_), -1
_FLAG = Call("all_reduce", np.dtype(np.float32), 1, ReduceOp.SUM)  # what a barrier runs
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
    """Completion of enqueued work: the backend's event, recorded after it (or after later work of the group's
    stream, which runs after it); an event of its own once :meth:`detach` made one (an asynchronous call)."""

    __slots__ = ("backend", "caller", "event", "keep", "recorded")

    def __init__(self, backend: NcclBackend, keep: tuple, caller: Any) -> None:
        self.backend = backend
        self.keep = keep  # buffers that must outlive the operation
        self.caller = caller  # the stream the caller's work was on when it was enqueued (None on the emulator)
        self.recorded = False  # the backend's event covers this work (False while its NCCL group is open)
        self.event: Any = None

    def detach(self) -> None:
        """An asynchronous call: an event of its own, recorded now (right after its work)."""
        if self.recorded and self.event is None:
            self.event = self.backend.cuda.Event(disable_timing=True)
            self.event.record(self.backend.stream)

    def test(self) -> bool:
        if self.recorded and (self.event if self.event is not None else self.backend.done).done:
            self.backend.raise_async_error()  # work that ended because the communicator failed did not complete
            self.keep = ()
            return True
        self.backend.raise_async_error()
        return False

    def wait(self, timeout: float) -> bool:
        return self.test() or poll(self.test, timeout)

    def defer(self) -> bool:
        """Make the caller's current stream wait for this work, without blocking the host."""
        if not self.recorded:  # still inside an open NCCL group: nothing recorded to wait on yet
            return False
        event = self.event if self.event is not None else self.backend.done
        (self.caller or self.backend.caller_stream(self.keep)).wait_event(event)
        return True


def world(place: Any) -> NcclBackend:
    """The default group's communicator (``commlib.backends.Spec.world``): rank 0 makes the unique id, the
    ranks' meeting (the MPI world, or the job's store: no MPI needed) carries it, each rank joins with its own."""
    module, cuda, xp, host = load(emulated())
    if not host:  # one process per GPU, unless the caller already chose one
        cuda.Device(place.local_rank % cuda.runtime.getDeviceCount()).use()
    if place.join is not None:  # a newcomer to a running job (commlib.grow_group): rank 0's unique id
        comm = module.NcclCommunicator(place.size, bytes.fromhex(place.join.payload), place.rank)
        return NcclBackend(module, cuda, xp, comm, host, None, list(range(place.size)))
    everyone = list(range(place.size))
    uid = unique_id(module) if place.rank == 0 else b""
    uid = place.meeting.rendezvous(everyone, place.timeout, uid, what="the NCCL world's unique id")
    comm = module.NcclCommunicator(place.size, uid, place.rank)
    if host and place.rank == 0:
        print(
            "commlib: backend 'nccl' is running on the NCCL emulator (CPU, host memory; "
            "COMMLIB_NCCL_EMULATOR=1), not on GPUs",
            file=sys.stderr,
            flush=True,
        )
    return NcclBackend(module, cuda, xp, comm, host, place.meeting, everyone)


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
    goodbye = True  # ncclCommDestroy at the end (an emulated peer still in its last call reads it as a death)
    ordered_p2p = True  # one stream: a rank's sends and receives run in the order they were posted
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
        self._reductions: dict[tuple[Any, Any], tuple[Any, int, int]] = {}  # (dtype, op) -> (view, type, op)
        self._types = {d: getattr(nccl, n) for d, n in _TYPE_NAMES.items()}
        self._ops = {op: getattr(nccl, n) for op, n in _OP_NAMES.items()}
        self.done = cuda.Event(disable_timing=True)  # recorded after each call (see _EventHandle)
        self._depth = 0
        self._grouped: list[_EventHandle] = []
        self._aborted = False
        self._version = int(nccl.get_version())
        self.running = Digests(self.size)  # the check: every call folded, compared off the device's path
        self._noted = self.running.pending
        self._flag = xp.zeros(1, np.float32)  # barrier's all-reduce, allocated once
        self._launches: dict[str, Callable[[Call, Any, Any], tuple[Callable[..., None], tuple, tuple]]] = {
            "all_reduce": self._all_reduce,
            "reduce": self._reduce,
            "reduce_scatter": self._reduce_scatter,
            "broadcast": self._broadcast,
            "all_gather": self._all_gather,
            "barrier": self._barrier,
            "send": self._send,
            "recv": self._recv,
        }

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
                torch_kind = _TORCH_TYPES.get(type(a))
                if torch_kind or (torch_kind is None and _from_torch(type(a))):
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
        try:  # free unless raised (Python 3.11+)
            launch(*args, self.stream.ptr)
        except self.nccl.NcclError as e:  # the communicator failed (a peer's abort, a dead peer): the group's error
            raise CommError(f"NCCL reported an error: {e}") from None
        handle = _EventHandle(self, keep, caller)
        if self._depth:
            self._grouped.append(handle)
        else:
            self.done.record(self.stream)
            handle.recorded = True
        return handle

    def _move(self, a: Any) -> tuple[Any, int, int]:
        """(array as NCCL sees it, count, NCCL datatype) for moving ``a``'s bytes."""
        view = _MOVE_VIEW.get(a.dtype)
        if view is not None:
            a = a.view(view)
        return a, a.size, self._types[a.dtype]

    def _reduce_args(self, a: Any, op: Any) -> tuple[Any, int, int, int]:
        if a.dtype == _BOOL:
            op = _BOOL_OPS[op]
        a, count, dtype = self._move(a)
        return a, count, dtype, self._ops[op]

    def _reduction(self, dtype: Any, op: Any) -> tuple[Any, int, int]:
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

    # -- calls --------------------------------------------------------------------------
    def start(self, call: Call, inp: Any, out: Any, seq: int) -> Handle:
        """Fold ``call`` into the digests and enqueue it (see :meth:`Backend.start`); all_to_all, gather and
        scatter as grouped sends and receives (:meth:`Backend.compose`), as NCCL advises."""
        kind = call.kind
        if kind == "send" or kind == "recv":
            if call.root < 0:
                raise ValueError("recv: NCCL cannot receive from any source; pass src")
            self.running.message(call)
        else:  # Digests.collective, inlined: every call of the device path comes here
            noted = self._noted
            noted.append((seq, call))
            if len(noted) >= _RECENT:
                self.running.fold()
        launch = self._launches.get(kind)
        if launch is None or type(inp) is list or type(out) is list:  # composed; or lists of arrays, in place
            return (
                self._reduce_scatter_list(call, inp, out) if kind == "reduce_scatter" else self.compose(call, inp, out)
            )
        return self._enqueue(*launch(call, inp, out))

    def _reduce_scatter_list(self, call: Call, inputs: list[Any], out: Any) -> Handle:
        """reduce_scatter from a list of arrays, without a staging buffer: one reduce per rank, in one group."""
        handles: list[Handle] = []
        op = call.op
        self.group_start()
        try:
            for p, a in enumerate(inputs):
                s, count, dt, nop = self._reduce_args(a, op)
                r = self._move(out)[0] if p == self.rank else s
                handles.append(self._enqueue(self.comm.reduce, (address(s), address(r), count, dt, nop, p), (s, r)))
        finally:
            self.group_end()
        return AllOf(handles)

    def _all_reduce(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        view, dt, nop = self._reductions.get((call.dtype, call.op)) or self._reduction(call.dtype, call.op)
        s = inp if view is None else inp.view(view)
        r = s if inp is out else out if view is None else out.view(view)
        sptr = address(s)
        if r is s:  # in place: one buffer to keep, one to look at for the caller's stream
            return self.comm.allReduce, (sptr, sptr, s.size, dt, nop), (s,)
        return self.comm.allReduce, (sptr, address(r), s.size, dt, nop), (s, r)

    def _barrier(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        """NCCL has no barrier: an all_reduce of one element stands in for it (as torch does)."""
        return self._all_reduce(_FLAG, self._flag, self._flag)

    def _reduce(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        s, count, dt, nop = self._reduce_args(inp, call.op)
        r = self._move(out)[0]
        return self.comm.reduce, (address(s), address(r), count, dt, nop, call.root), (s, r)

    def _reduce_scatter(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        s, _, dt, nop = self._reduce_args(inp, call.op)
        r, count, _ = self._move(out)
        return self.comm.reduceScatter, (address(s), address(r), count, dt, nop), (s, r)

    def _broadcast(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        b, count, dt = self._move(out)
        return self.comm.bcast, (address(b), count, dt, call.root), (b,)

    def _all_gather(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        r, total, dt = self._move(out)
        count = total // self.size
        sptr = address(r) + self.rank * count * r.itemsize if inp is None else address(self._move(inp)[0])
        return self.comm.allGather, (sptr, address(r), count, dt), (inp, r)

    def _send(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        b, count, dt = self._move(inp)
        return self.comm.send, (address(b), count, dt, call.root), (b,)

    def _recv(self, call: Call, inp: Any, out: Any) -> tuple[Callable[..., None], tuple, tuple]:
        b, count, dt = self._move(out)
        return self.comm.recv, (address(b), count, dt, call.root), (b,)

    def group_start(self) -> None:
        """Open an NCCL group: the p2p calls until ``group_end`` are posted together."""
        self.nccl.groupStart()
        self._depth += 1

    def group_end(self) -> None:
        """Close the NCCL group; every handle issued inside it completes with the event recorded after it."""
        self._depth -= 1
        try:
            self.nccl.groupEnd()
        except self.nccl.NcclError as e:
            self._grouped = []
            raise CommError(f"NCCL reported an error: {e}") from None
        if self._depth == 0 and self._grouped:
            self.done.record(self.stream)
            for handle in self._grouped:
                handle.recorded = True
            self._grouped = []

    # -- the check ----------------------------------------------------------------------
    def digests(self) -> Digests:
        """The running digests of this rank's calls (see :meth:`Backend.digests`)."""
        return self.running

    def close_check(self, seq: int, sent: list[int], received: list[int], timeout: float) -> list[tuple[int, int, int]]:
        """The closing exchange (see :meth:`Backend.close_check`), with every rank's digests: ranks that made as
        many calls but other ones (another dtype, size, op, root; messages of another dtype) end in
        ``CollectiveMismatchError`` naming the first call that differs, on every rank that sees it."""
        n, me = self.size, self.rank
        mine = np.concatenate([np.array([seq, *sent, *received], np.int64), self.running.record()])
        everyone = self.xp.zeros(n * mine.size, np.int64)
        call = Call("all_gather", mine.dtype, mine.size)
        if not self._enqueue(*self._all_gather(call, self.xp.asarray(mine), everyone)).wait(timeout):
            raise CommTimeoutError(f"not every rank ended its calls within {timeout:g} s")
        table = to_host(everyone).reshape(n, mine.size)
        rows = [(int(r[0]), int(r[1 + me]), int(r[1 + n + me])) for r in table]
        ours = Digests.read(mine[1 + 2 * n :], n)
        for p, r in enumerate(table):
            if p == me or rows[p][0] != seq:
                continue  # a count that differs is the group's to say (verdicts.closing)
            theirs = Digests.read(r[1 + 2 * n :], n)
            if theirs["calls"] != ours["calls"]:
                found = difference(ours, theirs)
                _, mine_words, their_words = found or (seq, f"{seq} collective calls", f"{seq} other collective calls")
                raise CollectiveMismatchError(
                    their_words, peer=p, theirs=f"the digest of {their_words}", mine=mine_words
                )
            if rows[p][1] == received[p] and theirs["sent"][me] != ours["received"][p]:
                last_sent, got = theirs["last_sent"][me], ours["last_received"][p]
                their_words = f"messages to this rank (the last: {describe(last_sent) if last_sent else 'none'})"
                mine_words = f"messages like those it received (the last: {describe(got) if got else 'none'})"
                raise CollectiveMismatchError(their_words, peer=p, theirs=their_words, mine=mine_words)
            if rows[p][2] == sent[p] and theirs["received"][me] != ours["sent"][p]:  # the sender sees it too
                got, mine_sent = theirs["last_received"][me], ours["last_sent"][p]
                their_words = f"receives of other messages (the last: {describe(got) if got else 'none'})"
                mine_words = f"the messages it sent (the last: {describe(mine_sent) if mine_sent else 'none'})"
                raise CollectiveMismatchError(their_words, peer=p, theirs=their_words, mine=mine_words)
        return rows

    # -- communicators --------------------------------------------------------------
    def split(self, ranks: list[int], timeout: float) -> NcclBackend | None:
        """Sub-communicator of ``ranks`` through ``commSplit`` (collective over this communicator). First every
        rank checks that all asked for the same ``ranks`` (as the mpi backend does): else they all raise
        ``CollectiveMismatchError`` and no communicator is made (commSplit would group them by what each rank
        said, and each rank would believe its own ``ranks``)."""
        mine = self.xp.asarray(ranks_checksum(ranks))  # once per group made: not a call's path
        extremes = self.xp.zeros(2, np.int64)
        check = Call("all_reduce", np.dtype(np.int64), 2, ReduceOp.MAX)
        if not self._enqueue(*self._all_reduce(check, mine, extremes)).wait(timeout):
            raise setup_timeout("called new_group", timeout)
        check_same_ranks(ranks, to_host(extremes))
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

    # -- recovery (commlib.shrink_group, commlib.grow_group) -------------------------------------------------
    def shrink_payload(self) -> str:
        """A fresh unique id (hex): the survivors' communicator, when it cannot be shrunk from this one."""
        return unique_id(self.nccl).hex()

    def shrink(self, keep: list[int], key: int, timeout: float, payload: Any, died: bool) -> NcclBackend:
        """The survivors' communicator: ``ncclCommShrink`` of this one where the NCCL module has it and no rank
        died (a communicator a death aborted cannot be shrunk); else this one aborted and a new one from the
        lowest survivor's unique id (``payload``), made by the survivors alone."""
        shrink = getattr(self.comm, "commShrink", None)
        if shrink is not None and not died and not self._aborted:
            comm = shrink([r for r in range(self.size) if r not in keep], getattr(self.nccl, "NCCL_SHRINK_ABORT", 1))
        else:
            self.abort("shrink_group")
            comm = self.nccl.NcclCommunicator(len(keep), bytes.fromhex(payload), keep.index(self.rank))
        return self._sub(comm, keep)

    def grow_payload(self) -> str:
        """A fresh unique id (hex): the grown world's communicator."""
        return unique_id(self.nccl).hex()

    def grow(self, newcomers: int, store: Any, timeout: float, payload: Any) -> NcclBackend:
        """The members' side of a growing world: a new communicator of every member and newcomer from rank 0's
        unique id (``payload``); this one is kept as it is."""
        comm = self.nccl.NcclCommunicator(self.size + newcomers, bytes.fromhex(payload), self.rank)
        mapped = self.bootstrap_ranks + list(range(len(self.bootstrap_ranks), len(self.bootstrap_ranks) + newcomers))
        return NcclBackend(self.nccl, self.cuda, self.xp, comm, self.host, None, mapped)

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
