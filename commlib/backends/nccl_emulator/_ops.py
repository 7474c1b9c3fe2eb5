"""The NCCL operations of the emulator: datatypes, reductions, and one class per operation.

Every operation has two steps. ``post()`` announces all its receives and
performs all sends that need no received data; ``complete(deadline)`` waits for
the receives and finishes (reducing, and for the two-phase all-reduce, sending
the reduced chunk). A group posts all its operations before completing any, so
the order of sends and receives inside a group never matters. Reductions run
in rank order on every rank, so all ranks get bit-identical results; float16
and bfloat16 are accumulated in float32 and rounded once at the end.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import ml_dtypes
import numpy as np

from ._link import COLL, P2P
from ._mailbox import Key

__all__ = [
    "DTYPES",
    "REDOPS",
    "AllGather",
    "AllReduce",
    "Broadcast",
    "Op",
    "Reduce",
    "ReduceScatter",
    "PointToPoint",
    "host_array",
]

# ncclDataType_t -> numpy dtype (cupy's constants: int8, uint8, int32, uint32, int64, uint64, f16, f32, f64, bf16).
DTYPES = {
    0: np.dtype(np.int8),
    1: np.dtype(np.uint8),
    2: np.dtype(np.int32),
    3: np.dtype(np.uint32),
    4: np.dtype(np.int64),
    5: np.dtype(np.uint64),
    6: np.dtype(np.float16),
    7: np.dtype(np.float32),
    8: np.dtype(np.float64),
    9: np.dtype(ml_dtypes.bfloat16),
}
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
REDOPS = {SUM: np.add, PROD: np.multiply, MAX: np.maximum, MIN: np.minimum, AVG: np.add}
# Half-precision inputs are reduced in float32 and rounded once (NCCL reduces pairwise in the input type).
_ACCUMULATE = {np.dtype(np.float16): np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16): np.dtype(np.float32)}
# All-reduces up to this many bytes send everything to everybody (one round trip); larger ones
# reduce-scatter then all-gather (each rank sends and reduces 1/n of the data per phase).
_DIRECT_BYTES = 256 * 1024
# Scratch buffers this large are kept for reuse (see CommCore.scratch); smaller ones are cheap to allocate.
SCRATCH_MIN = 1 << 16
# Operations whose buffers are all this small may run in place (see ``_launch``): their frames fit
# an empty socket buffer, and completing them is cheap enough for a receiver thread.
_EAGER_BYTES = 16 * 1024


class Channel(Protocol):
    """What an operation needs from its communicator."""

    rank: int
    size: int

    def send(self, peer: int, key: Key, data: memoryview) -> None: ...
    def post(self, peer: int, key: Key, view: memoryview) -> None: ...
    def wait(self, peer: int, key: Key, deadline: float) -> None: ...
    def forget(self, peer: int, key: Key) -> None: ...
    def scratch(self, nbytes: int) -> np.ndarray: ...
    def recycle(self, buffers: list[np.ndarray]) -> None: ...


def host_array(ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
    """A numpy view of ``count`` elements of ``dtype`` at host address ``ptr`` (no copy)."""
    key = (ptr, count, dtype)
    view = _views.get(key)
    if view is None:
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return np.empty(0, dtype)
        view = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)  # type: ignore[call-overload]  # ctypes arrays are buffers
        if len(_views) >= _VIEWS_KEPT:
            _views.clear()
        _views[key] = view
    return view


# Recent views by (address, count, dtype): the same buffers come back call after call, and a view
# owns nothing, so an old one is as good as a new one (it only names the memory; the caller vouches for it).
_views: dict[tuple[int, int, np.dtype], np.ndarray] = {}
_VIEWS_KEPT = 64


def _bytes(arr: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (any dtype, bfloat16 included)."""
    return memoryview(arr.view(np.uint8))  # type: ignore[arg-type]  # arrays are buffers


def _chunk(count: int, n: int, j: int) -> slice:
    """Elements of chunk ``j`` when ``count`` elements are cut into ``n`` near-equal chunks."""
    base, extra = divmod(count, n)
    start = j * base + min(j, extra)
    return slice(start, start + base + (j < extra))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.size > 0 and a.ctypes.data == b.ctypes.data


def reduce_into(out: np.ndarray, parts: list[np.ndarray], op: int, nranks: int) -> None:
    """out = parts[0] op parts[1] op ... in that order (AVG: the sum divided by ``nranks``)."""
    ufunc = REDOPS[op]
    acc_dtype = _ACCUMULATE.get(out.dtype)
    # out may alias parts 0 or 1 only (two parts: nothing to check)
    fits_in_out = len(parts) == 2 or not any(np.may_share_memory(out, p) for p in parts[2:])
    if acc_dtype is None and op != AVG and len(parts) >= 2 and fits_in_out:
        ufunc(parts[0], parts[1], out=out)  # no temporary for the common case
        for part in parts[2:]:
            ufunc(out, part, out=out)
        return
    acc = parts[0].astype(acc_dtype or out.dtype)
    for part in parts[1:]:
        ufunc(acc, part, out=acc)
    if op == AVG:
        _divide(acc, nranks)
    out[...] = acc


def _divide(acc: np.ndarray, n: int) -> None:
    """acc /= n in place; integers truncate toward zero like C (NCCL's integer average)."""
    if acc.dtype.kind == "f":
        acc /= n
        return
    info = np.iinfo(acc.dtype)
    d = acc.dtype.type(n) if n <= info.max else (np.uint64(n) if info.min == 0 else np.int64(n))  # 128 int8 ranks
    quotient = acc // d
    if acc.dtype.kind == "i":
        quotient += ((acc % d) != 0) & (acc < 0)  # floor -> truncation for negative sums
    acc[...] = quotient


class Op:
    """One posted NCCL operation of one communicator."""

    multi_phase = False  # whether complete() sends too (then a group completes it on its own thread)
    eager = True  # whether it may run in place: small and single-phase (set from its buffers)

    def __init__(self, comm: Channel) -> None:
        self.comm = comm
        self._pending: dict[int, list[tuple[int, Key]]] = {}  # tag -> receives to wait for
        self._scratch: list[np.ndarray] = []

    def post(self) -> None:
        """Announce the receives and do the sends that need no received data."""

    def complete(self, deadline: float) -> None:
        """Wait for the receives and finish the operation."""
        self._wait(0, deadline)

    def finish(self, deadline: float) -> None:
        """complete(), then hand the scratch buffers back for reuse."""
        self.complete(deadline)
        if self._scratch:
            self.comm.recycle(self._scratch)
            self._scratch = []

    def awaited(self) -> list[tuple[int, Key]]:
        """The posted receives not yet waited for, as (peer, key)."""
        return [slot for slots in self._pending.values() for slot in slots]

    def received(self) -> None:
        """Every posted receive is filled (a mailbox watch said so): complete() has nothing to wait for."""
        self._pending.clear()

    def _sized(self, a: np.ndarray, b: np.ndarray | None = None) -> None:
        nbytes = a.nbytes if b is None else max(a.nbytes, b.nbytes)
        self.eager = nbytes <= _EAGER_BYTES and not self.multi_phase

    def abandon(self) -> None:
        """Withdraw the receives not yet waited for (the operation failed)."""
        for slots in self._pending.values():
            for peer, key in slots:
                self.comm.forget(peer, key)
        self._pending.clear()

    def _temp(self, like: np.ndarray) -> np.ndarray:
        """A scratch array shaped and typed like ``like`` (1-D)."""
        raw = self.comm.scratch(like.nbytes)
        if raw.nbytes >= SCRATCH_MIN:  # to be handed back by finish()
            self._scratch.append(raw)
        return raw.view(like.dtype)

    def _recv(self, peer: int, key: Key, arr: np.ndarray) -> None:
        if arr.size:  # empty messages are skipped by both sides alike
            self.comm.post(peer, key, _bytes(arr))
            self._pending.setdefault(key[2], []).append((peer, key))

    def _send(self, peer: int, key: Key, arr: np.ndarray) -> None:
        if arr.size:
            self.comm.send(peer, key, _bytes(arr))

    def _wait(self, tag: int, deadline: float) -> None:
        slots = self._pending.get(tag, [])
        while slots:
            peer, key = slots[0]
            self.comm.wait(peer, key, deadline)
            slots.pop(0)

    def _peers(self) -> list[int]:
        return [p for p in range(self.comm.size) if p != self.comm.rank]


class _Collective(Op):
    def __init__(self, comm: Channel, seq: int) -> None:
        super().__init__(comm)
        self.seq = seq

    def _key(self, tag: int = 0) -> Key:
        return (COLL, self.seq, tag)


class AllReduce(_Collective):
    """ncclAllReduce: direct exchange when small, else reduce-scatter + all-gather."""

    def __init__(self, comm: Channel, seq: int, src: np.ndarray, dst: np.ndarray, op: int) -> None:
        super().__init__(comm, seq)
        self.src, self.dst, self.op = src, dst, op
        self.multi_phase = src.nbytes > _DIRECT_BYTES and comm.size > 1
        self._sized(src, dst)
        self._parts: dict[int, np.ndarray] = {}

    def post(self) -> None:
        n, me = self.comm.size, self.comm.rank
        if not self.multi_phase:
            self._parts = {p: self._temp(self.src) for p in self._peers()}
            for p, part in self._parts.items():
                self._recv(p, self._key(), part)
            for p in self._parts:
                self._send(p, self._key(), self.src)
            return
        mine = _chunk(self.src.size, n, me)
        self._parts = {p: self._temp(self.src[mine]) for p in self._peers()}
        for p, part in self._parts.items():
            self._recv(p, self._key(), part)
        for p in self._peers():
            self._send(p, self._key(), self.src[_chunk(self.src.size, n, p)])
        # The peers' reduced chunks may land in dst right away: this rank's data for them is sent already.
        for p in self._peers():
            self._recv(p, self._key(1), self.dst[_chunk(self.src.size, n, p)])

    def complete(self, deadline: float) -> None:
        n, me = self.comm.size, self.comm.rank
        self._wait(0, deadline)
        mine = _chunk(self.src.size, n, me) if self.multi_phase else slice(None)
        parts = [self._parts[p] if p != me else self.src[mine] for p in range(n)]
        reduce_into(self.dst[mine], parts, self.op, n)
        if self.multi_phase:
            for p in self._peers():
                self._send(p, self._key(1), self.dst[mine])
            self._wait(1, deadline)


class Reduce(_Collective):
    """ncclReduce: every rank sends to the root, which reduces in rank order."""

    def __init__(self, comm: Channel, seq: int, src: np.ndarray, dst: np.ndarray, op: int, root: int) -> None:
        super().__init__(comm, seq)
        self.src, self.dst, self.op, self.root = src, dst, op, root
        self._sized(src, dst)
        self._parts: dict[int, np.ndarray] = {}

    def post(self) -> None:
        if self.comm.rank != self.root:
            self._send(self.root, self._key(), self.src)
            return
        self._parts = {p: self._temp(self.src) for p in self._peers()}
        for p, part in self._parts.items():
            self._recv(p, self._key(), part)

    def complete(self, deadline: float) -> None:
        if self.comm.rank == self.root:
            self._wait(0, deadline)
            parts = [self._parts.get(p, self.src) for p in range(self.comm.size)]
            reduce_into(self.dst, parts, self.op, self.comm.size)


class Broadcast(_Collective):
    """ncclBroadcast (ncclBcast when src is dst): the root sends to everybody.

    Above the eager size each receiver acknowledges (a byte), and the root completes once all have: NCCL's
    root cannot run ahead of its peers either (its buffers are credits), and a root streaming call after
    call into the receivers' reader threads starved their other threads of the GIL (5-8 ms calls)."""

    def __init__(self, comm: Channel, seq: int, src: np.ndarray, dst: np.ndarray, root: int) -> None:
        super().__init__(comm, seq)
        self.src, self.dst, self.root = src, dst, root
        self.multi_phase = max(src.nbytes, dst.nbytes) > _EAGER_BYTES and comm.size > 1
        self._sized(src, dst)

    def post(self) -> None:
        if self.comm.rank != self.root:
            self._recv(self.root, self._key(), self.dst)
            return
        for p in self._peers() if self.multi_phase else ():
            self._recv(p, self._key(1), np.empty(1, np.uint8))  # the posted view keeps it
        for p in self._peers():
            self._send(p, self._key(), self.src)
        if not _same_memory(self.src, self.dst):
            np.copyto(self.dst, self.src)

    def complete(self, deadline: float) -> None:
        self._wait(0, deadline)
        if self.multi_phase and self.comm.rank != self.root:
            self._send(self.root, self._key(1), _ACK)
        self._wait(1, deadline)


_ACK = np.ones(1, np.uint8)


class AllGather(_Collective):
    """ncclAllGather: every rank sends its block to everybody; in place when src is its own block of dst."""

    def __init__(self, comm: Channel, seq: int, src: np.ndarray, dst: np.ndarray) -> None:
        super().__init__(comm, seq)
        self.src, self.dst = src, dst
        self._sized(src, dst)

    def post(self) -> None:
        count = self.src.size
        for p in self._peers():
            self._recv(p, self._key(), self.dst[p * count : (p + 1) * count])
        for p in self._peers():
            self._send(p, self._key(), self.src)
        mine = self.dst[self.comm.rank * count : (self.comm.rank + 1) * count]
        if not _same_memory(self.src, mine):
            np.copyto(mine, self.src)


class ReduceScatter(_Collective):
    """ncclReduceScatter: block j of every rank goes to rank j, which reduces them in rank order."""

    def __init__(self, comm: Channel, seq: int, src: np.ndarray, dst: np.ndarray, op: int) -> None:
        super().__init__(comm, seq)
        self.src, self.dst, self.op = src, dst, op
        self._sized(src, dst)
        self._parts: dict[int, np.ndarray] = {}

    def _block(self, j: int) -> np.ndarray:
        count = self.dst.size
        return self.src[j * count : (j + 1) * count]

    def post(self) -> None:
        self._parts = {p: self._temp(self.dst) for p in self._peers()}
        for p, part in self._parts.items():
            self._recv(p, self._key(), part)
        for p in self._peers():
            self._send(p, self._key(), self._block(p))

    def complete(self, deadline: float) -> None:
        self._wait(0, deadline)
        me, n = self.comm.rank, self.comm.size
        parts = [self._parts[p] if p != me else self._block(me) for p in range(n)]
        reduce_into(self.dst, parts, self.op, n)


class PointToPoint(Op):
    """ncclSend (``sending``) or ncclRecv: the k-th send to a peer matches that peer's k-th receive from this rank."""

    def __init__(self, comm: Channel, seq: int, buf: np.ndarray, peer: int, sending: bool) -> None:
        super().__init__(comm)
        self.buf, self.peer, self.key, self.sending = buf, peer, (P2P, seq, 0), sending
        self._sized(buf)

    def post(self) -> None:
        (self._send if self.sending else self._recv)(self.peer, self.key, self.buf)
