"""The NCCL emulator (commlib.backends.nccl_emulator): cupy.cuda.nccl parity, and its behaviour on real processes.

Multi-rank jobs run under ``commlib.testing.run`` (mpiexec); they use MPI only to
broadcast the unique id. One test starts plain subprocesses that exchange the id
through a file, to show the emulator needs no MPI at all.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from commlib.backends import nccl_emulator as nccl
from commlib.testing import run, world_sizes

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SUM, PROD, MAX, MIN, AVG = nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN, nccl.NCCL_AVG
# NCCL datatype -> numpy dtype, written out independently of the emulator's own table.
DTYPES = {
    nccl.NCCL_INT8: np.int8,
    nccl.NCCL_UINT8: np.uint8,
    nccl.NCCL_INT32: np.int32,
    nccl.NCCL_UINT32: np.uint32,
    nccl.NCCL_INT64: np.int64,
    nccl.NCCL_UINT64: np.uint64,
    nccl.NCCL_FLOAT16: np.float16,
    nccl.NCCL_FLOAT32: np.float32,
    nccl.NCCL_FLOAT64: np.float64,
    nccl.NCCL_BFLOAT16: ml_dtypes.bfloat16,
}
F32, F64, I32 = nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64, nccl.NCCL_INT32
REMOTE_ERROR, INVALID_ARGUMENT, INVALID_USAGE = 6, 4, 5


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _world(timeout: float | None = None):
    """(comm, rank, size): the unique id travels from rank 0 by MPI, the only use of MPI here."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    uid = world.bcast(nccl.get_unique_id() if world.rank == 0 else None, root=0)
    return nccl.NcclCommunicator(world.size, uid, world.rank), world.rank, world.size


# --- parity with cupy.cuda.nccl ---------------------------------------------------------------


def _params(doc: str | None) -> list[tuple[str, str | None]]:
    """(name, default) of each parameter in a Cython docstring's first line, e.g. ``f(self, int a, b=None)``."""
    line = (doc or "").strip().splitlines()[0]
    inside = line[line.index("(") + 1 : line.rindex(")")].strip()
    params = []
    for item in filter(None, (p.strip() for p in inside.split(","))):
        decl, _, default = item.partition("=")
        params.append((decl.split()[-1], default.strip() or None))
    return params


def _mine(fn) -> list[tuple[str, str | None]]:
    sig = inspect.signature(fn)
    return [(p.name, None if p.default is p.empty else repr(p.default)) for p in sig.parameters.values()]


@pytest.mark.timeout(120)
def test_constants_and_names_match_cupy() -> None:
    real = pytest.importorskip("cupy.cuda.nccl")
    names = [k for k in dir(real) if not k.startswith("_") and k != "annotations"]
    assert names and all(hasattr(nccl, k) for k in names), set(names) - set(dir(nccl))
    constants = {k: getattr(real, k) for k in names if k.startswith("NCCL_")}
    assert len(constants) >= 20
    assert {k: getattr(nccl, k) for k in constants} == constants
    assert nccl.available is True and nccl.EMULATED is True


@pytest.mark.timeout(120)
def test_signatures_match_cupy() -> None:
    real = pytest.importorskip("cupy.cuda.nccl")
    cls = real.NcclCommunicator
    methods = [k for k in dir(cls) if not k.startswith("_") and callable(getattr(cls, k))]
    assert {"allReduce", "reduceScatter", "commSplit", "check_async_error", "initAll"} <= set(methods)
    for name in methods:
        assert _mine(getattr(nccl.NcclCommunicator, name)) == _params(getattr(cls, name).__doc__), name
    assert _mine(nccl.NcclCommunicator.__init__)[1:] == _params(cls.__doc__)  # the class doc shows __init__
    for name in ("get_unique_id", "get_version", "get_build_version", "groupStart", "groupEnd", "check_status"):
        assert _mine(getattr(nccl, name)) == _params(getattr(real, name).__doc__), name
    assert _mine(nccl.NcclConfig) == _params(real.NcclConfig.__doc__)
    # NcclError(status): same required argument; the emulator adds an optional detail.
    assert _mine(nccl.NcclError.__init__)[:2] == _params(real.NcclError.__init__.__doc__)


@pytest.mark.timeout(120)
def test_cuda_signatures_match_cupy() -> None:
    real = pytest.importorskip("cupy.cuda")
    pytest.importorskip("cupy.cuda.nccl")
    ours = nccl.cuda
    for cls in ("Stream", "Event"):
        assert _mine(getattr(ours, cls)) == _mine(getattr(real, cls)), cls
    for cls, method in [("Stream", "record"), ("Stream", "wait_event"), ("Stream", "synchronize"), ("Stream", "use")]:
        assert _mine(getattr(getattr(ours, cls), method)) == _params(getattr(getattr(real, cls), method).__doc__)
    for method in ("record", "synchronize"):
        assert _mine(getattr(ours.Event, method)) == _params(getattr(real.Event, method).__doc__), method
    assert _mine(ours.get_current_stream) == _params(real.get_current_stream.__doc__)
    assert _mine(ours.Device) == _params(real.Device.__doc__)


@pytest.mark.timeout(120)
def test_unique_id_and_errors_look_like_cupy() -> None:
    real = pytest.importorskip("cupy.cuda.nccl")
    theirs, ours = real.get_unique_id(), nccl.get_unique_id()
    # cupy >= 14 returns 128 bytes (older cupy: a tuple of 128 signed chars, which the emulator accepts too).
    assert isinstance(ours, bytes) and len(ours) == len(theirs) == 128
    assert type(theirs) is bytes or all(v in range(-128, 128) for v in theirs)
    assert ours != nccl.get_unique_id()  # a new root and secret per call
    for status in range(7):
        assert str(nccl.NcclError(status)) == str(real.NcclError(status))
        assert nccl.NcclError(status).status == real.NcclError(status).status == status
    assert isinstance(nccl.NcclError(2), RuntimeError)
    with pytest.raises(nccl.NcclError) as info:
        nccl.check_status(6)
    assert info.value.status == 6 and "REMOTE_ERROR" in str(info.value)
    assert nccl.check_status(0) is None
    assert isinstance(nccl.get_version(), int) and "EMULATOR" in nccl.get_version.__doc__


# --- in-process checks (no peers needed) ------------------------------------------------------


@pytest.mark.timeout(120)
def test_wrong_secret_and_garbage_ids_are_refused() -> None:
    uid = nccl.get_unique_id()
    bad = bytearray(uid)
    bad[20] ^= 0xFF  # inside the secret
    start = time.monotonic()
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(1, bytes(bad), 0)
    assert info.value.status == INVALID_ARGUMENT and "wrong secret" in str(info.value)
    assert time.monotonic() - start < 5
    with pytest.raises(nccl.NcclError):
        nccl.NcclCommunicator(1, bytes(128), 0)
    comm = nccl.NcclCommunicator(1, tuple(v - 256 if v > 127 else v for v in uid), 0)  # the root still serves
    assert "EMULATOR" in repr(comm) and (comm.size(), comm.rank_id(), comm.device_id()) == (1, 0, 0)
    comm.destroy()


@pytest.mark.timeout(120)
def test_init_times_out_when_ranks_never_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMLIB_NCCL_EMULATOR_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(2, nccl.get_unique_id(), 0)
    assert "timed out" in str(info.value) and time.monotonic() - start < 3


@pytest.mark.timeout(120)
def test_init_all_in_one_process_with_groups() -> None:
    comms = nccl.NcclCommunicator.initAll(3)
    assert [c.rank_id() for c in comms] == [0, 1, 2] and [c.device_id() for c in comms] == [0, 1, 2]
    xs = [np.arange(100_000, dtype=np.float32) * (r + 1) for r in range(3)]  # > 256 KiB: two-phase all-reduce
    nccl.groupStart()
    for comm, x in zip(comms, xs, strict=True):
        comm.allReduce(ptr(x), ptr(x), x.size, F32, SUM, 0)
    nccl.groupEnd()
    for x in xs:
        np.testing.assert_array_equal(x, np.arange(100_000, dtype=np.float32) * 6)
    bufs = [np.zeros(4, np.float32), np.zeros(5, np.float32)]  # mismatched counts break both communicators
    nccl.groupStart()
    comms[0].allReduce(ptr(bufs[0]), ptr(bufs[0]), 4, F32, SUM, 0)
    comms[1].allReduce(ptr(bufs[1]), ptr(bufs[1]), 5, F32, SUM, 0)
    with pytest.raises(nccl.NcclError):
        nccl.groupEnd()
    with pytest.raises(nccl.NcclError):
        comms[0].check_async_error()
    for comm in comms:
        comm.abort()


@pytest.mark.timeout(120)
def test_every_connection_sends_small_frames_at_once() -> None:
    """TCP_NODELAY on dialled and accepted sockets: else Nagle holds a frame until the last one is acknowledged."""
    comms = nccl.NcclCommunicator.initAll(3)
    try:
        for comm in comms:
            socks = [link._sock for link in comm._core.links.values()]
            assert len(socks) == 2
            assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in socks), comm
    finally:
        for comm in comms:
            comm.destroy()


def _spin(comm, calls: int) -> None:
    """Small all-reduces on a stream, each waited for by a host loop that never blocks."""
    s, x = nccl.cuda.Stream(), np.ones(2, np.float32)
    for _ in range(calls):
        comm.allReduce(ptr(x), ptr(x), 2, F32, MAX, s.ptr)
        event = s.record()
        while not event.done:
            pass


@pytest.mark.timeout(120)
def test_a_host_spinning_on_done_does_not_starve_the_emulated_device() -> None:
    """The emulator's threads share the GIL with the host; a GPU runs on however the host polls."""
    comms = nccl.NcclCommunicator.initAll(2)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # a thread that never blocks keeps the GIL from the others this long
    try:
        start = time.monotonic()
        peer = threading.Thread(target=_spin, args=(comms[1], 20))
        peer.start()
        _spin(comms[0], 20)
        peer.join(60)
        elapsed = time.monotonic() - start
    finally:
        sys.setswitchinterval(interval)
        for comm in comms:
            comm.destroy()
    # Each call needs the device's threads at least once: 20 calls would take >= 1 s if spinning starved them.
    assert elapsed < 1.0 and not peer.is_alive()


@pytest.mark.timeout(120)
def test_invalid_calls_raise_at_once() -> None:
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x = np.zeros(4, np.float32)
    for args, status in [
        ((ptr(x), ptr(x), 4, 42, SUM, 0), INVALID_ARGUMENT),  # datatype
        ((ptr(x), ptr(x), 4, F32, 9, 0), INVALID_ARGUMENT),  # op
        ((0, ptr(x), 4, F32, SUM, 0), INVALID_ARGUMENT),  # NULL buffer
        ((ptr(x), ptr(x), 4, F32, SUM, 12345), INVALID_ARGUMENT),  # unknown stream
    ]:
        with pytest.raises(nccl.NcclError) as info:
            comm.allReduce(*args)
        assert info.value.status == status
    with pytest.raises(OverflowError):
        comm.allReduce(ptr(x), ptr(x), -1, F32, SUM, 0)
    with pytest.raises(nccl.NcclError):
        comm.bcast(ptr(x), 4, F32, 1, 0)  # root out of range
    with pytest.raises(nccl.NcclError):
        nccl.groupEnd()  # no group open
    comm.allReduce(0, 0, 0, F32, SUM, 0)  # count 0: nothing to do
    comm.destroy()
    comm.destroy()  # idempotent
    with pytest.raises(nccl.NcclError) as info:
        comm.allReduce(ptr(x), ptr(x), 4, F32, SUM, 0)
    assert info.value.status == INVALID_ARGUMENT
    with pytest.raises(nccl.NcclError):
        comm.check_async_error()


@pytest.mark.timeout(120)
def test_cuda_namespace() -> None:
    cuda = nccl.cuda
    assert cuda.runtime.getDeviceCount() == 1 and cuda.Device(0).id == 0
    cuda.Device(0).use()
    with pytest.raises(cuda.runtime.CUDARuntimeError):
        cuda.Device(1).use()
    null = cuda.get_current_stream()
    assert null.ptr == 0 and null is cuda.Stream.null
    assert cuda.Event().done  # never recorded: done, like cudaEventQuery
    ev = null.record()
    assert ev.done
    s = cuda.Stream(non_blocking=True)
    assert s.ptr != 0 and s.ptr != cuda.Stream().ptr
    with s:
        assert cuda.get_current_stream() is s
    assert cuda.get_current_stream() is null
    s.synchronize()


# --- multi-rank jobs --------------------------------------------------------------------------


def _inputs(dtype, count: int, rank: int) -> np.ndarray:
    """Small values, so that every reduction of up to 4 ranks is exact in every dtype."""
    i = np.arange(count)
    signed = np.dtype(dtype).kind != "u"
    return (((i + rank) % 5 - 2) if signed else ((i + rank) % 3 + 1)).astype(dtype)


def _expected(dtype, op: int, parts: list[np.ndarray]) -> np.ndarray:
    """NCCL's result, computed independently: float16/bfloat16 in float32, integer AVG truncated."""
    dtype = np.dtype(dtype)
    half = dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    wide = np.stack(parts).astype(np.float32 if half else dtype)
    if op in (SUM, AVG):
        acc = wide.sum(axis=0, dtype=wide.dtype)
    else:
        acc = {PROD: np.prod, MAX: np.max, MIN: np.min}[op](wide, axis=0)
    if op == AVG:
        acc = acc / wide.dtype.type(len(parts)) if half or dtype.kind == "f" else np.fix(acc / len(parts))
    return acc.astype(dtype)


def _check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=what)


def _reductions(comm, me: int, n: int, datatype: int, op: int, count: int) -> None:
    dtype = DTYPES[datatype]
    parts = [_inputs(dtype, count, r) for r in range(n)]
    want = _expected(dtype, op, parts)
    x, y = parts[me].copy(), np.zeros(count, dtype)
    comm.allReduce(ptr(x), ptr(y), count, datatype, op, 0)
    comm.allReduce(ptr(x), ptr(x), count, datatype, op, 0)  # in place
    _check(y, want, f"allReduce {dtype} op {op}")
    _check(x, want, f"in-place allReduce {dtype} op {op}")
    z = np.zeros(count, dtype)
    comm.reduce(ptr(parts[me]), ptr(z), count, datatype, op, n - 1, 0)
    _check(z, want if me == n - 1 else np.zeros(count, dtype), f"reduce {dtype} op {op}")
    big = [np.concatenate([_inputs(dtype, count, r * n + k) for k in range(n)]) for r in range(n)]
    mine = slice(me * count, (me + 1) * count)
    want_rs = _expected(dtype, op, [b[mine] for b in big])
    out, inplace = np.zeros(count, dtype), big[me].copy()
    comm.reduceScatter(ptr(big[me]), ptr(out), count, datatype, op, 0)
    comm.reduceScatter(ptr(inplace), ptr(inplace) + me * count * out.itemsize, count, datatype, op, 0)
    _check(out, want_rs, f"reduceScatter {dtype} op {op}")
    _check(inplace[mine], want_rs, f"in-place reduceScatter {dtype} op {op}")


def _moves(comm, me: int, n: int, datatype: int, count: int) -> None:
    dtype = DTYPES[datatype]
    parts = [_inputs(dtype, count, r + 1) for r in range(n)]
    root = n // 2
    x, y = parts[me].copy(), np.zeros(count, dtype)
    comm.broadcast(ptr(x), ptr(y), count, datatype, root, 0)
    comm.bcast(ptr(x), count, datatype, root, 0)
    _check(y, parts[root], f"broadcast {dtype}")
    _check(x, parts[root], f"bcast {dtype}")
    gathered, inplace = np.zeros(n * count, dtype), np.zeros(n * count, dtype)
    inplace[me * count : (me + 1) * count] = parts[me]
    comm.allGather(ptr(parts[me]), ptr(gathered), count, datatype, 0)
    comm.allGather(ptr(inplace) + me * count * x.itemsize, ptr(inplace), count, datatype, 0)
    _check(gathered, np.concatenate(parts), f"allGather {dtype}")
    _check(inplace, np.concatenate(parts), f"in-place allGather {dtype}")


def collectives_job() -> int:
    comm, me, n = _world()
    checked = 0
    for datatype in DTYPES:
        for op in (SUM, PROD, MAX, MIN, AVG):
            _reductions(comm, me, n, datatype, op, 7)
            checked += 1
        _moves(comm, me, n, datatype, 7)
    for datatype in (F32, nccl.NCCL_BFLOAT16, nccl.NCCL_INT64):  # > 256 KiB: reduce-scatter + all-gather
        for op in (SUM, AVG):
            _reductions(comm, me, n, datatype, op, 150_001)
            checked += 1
    comm.destroy()
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", world_sizes)
def test_collectives_all_dtypes_and_ops(n: int) -> None:
    assert run(collectives_job, n, timeout=100) == [len(DTYPES) * 5 + 6] * n


def p2p_job(order: str) -> bool:
    comm, me, n = _world()
    right, left = (me + 1) % n, (me - 1) % n
    for count in (3, 300_000):  # small, and large enough to fill the socket buffers
        out, got = np.full(count, me, np.int32), np.full(count, -1, np.int32)
        nccl.groupStart()
        if order == "send first":
            comm.send(ptr(out), count, I32, right, 0)
            comm.recv(ptr(got), count, I32, left, 0)
        else:
            comm.recv(ptr(got), count, I32, left, 0)
            comm.send(ptr(out), count, I32, right, 0)
        nccl.groupEnd()
        assert (got == left).all(), (count, got[:4])
    # Nested groups on a stream; several messages to one peer match in order.
    s = nccl.cuda.Stream()
    outs = [np.full(5, 10 * me + k, np.int64) for k in range(3)]
    gots = [np.zeros(5, np.int64) for _ in range(3)]
    nccl.groupStart()
    for k in range(3):
        nccl.groupStart()
        comm.recv(ptr(gots[k]), 5, nccl.NCCL_INT64, left, s.ptr)
        nccl.groupEnd()
        comm.send(ptr(outs[k]), 5, nccl.NCCL_INT64, right, s.ptr)
    assert (gots[0] == 0).all()  # nothing happens before the outermost groupEnd
    nccl.groupEnd()
    s.synchronize()
    assert [int(g[0]) for g in gots] == [10 * left + k for k in range(3)]
    comm.destroy()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", world_sizes)
@pytest.mark.parametrize("order", ["send first", "recv first"])
def test_p2p_ring_inside_a_group_never_deadlocks(n: int, order: str) -> None:
    assert run(p2p_job, n, order, timeout=60) == [True] * n


def streams_job() -> bool:
    comm, me, n = _world()
    cuda = nccl.cuda
    s, s2 = cuda.Stream(non_blocking=True), cuda.Stream()
    if me == 1:
        time.sleep(0.3)  # rank 0's operations cannot finish before this rank calls them
    a = np.ones(8)
    chain = [np.zeros(8) for _ in range(4)]  # each all-reduce reads the previous one's output
    src = a
    for buf in chain:
        comm.allReduce(ptr(src), ptr(buf), 8, F64, SUM, s.ptr)
        src = buf
    ev = s.record()
    if me == 0 and n > 1:
        assert not ev.done and not s.done
    ev.synchronize()
    assert ev.done and [float(b[0]) for b in chain] == [float(n ** (k + 1)) for k in range(4)]
    # s2 waits for an event of s; independent work on both streams at once.
    x, y, z = np.full(4, me, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
    comm.allReduce(ptr(x), ptr(y), 4, F32, SUM, s.ptr)
    s2.wait_event(s.record())
    comm.allReduce(ptr(y), ptr(z), 4, F32, SUM, s2.ptr)
    p, q = [np.full(1000, me + k, np.int64) for k in range(2)], [np.zeros(1000, np.int64) for _ in range(2)]
    comm.allReduce(ptr(p[0]), ptr(q[0]), 1000, nccl.NCCL_INT64, MAX, s.ptr)
    comm.allReduce(ptr(p[1]), ptr(q[1]), 1000, nccl.NCCL_INT64, MIN, s2.ptr)
    # The null stream waits for s2 on the host: z is readable right after.
    cuda.get_current_stream().wait_event(s2.record())
    assert (z == n * sum(range(n))).all(), z
    s.synchronize()
    assert (q[0] == n - 1).all() and (q[1] == 1).all()
    # The null stream is synchronous: the result is there when the call returns.
    w = np.full(3, me + 1, np.float16)
    comm.allReduce(ptr(w), ptr(w), 3, nccl.NCCL_FLOAT16, AVG, 0)
    assert (w == np.float16((n + 1) / 2)).all(), w
    assert (comm.rank_id(), comm.size(), comm.device_id()) == (me, n, 0)
    comm.destroy()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_streams_events_and_the_null_stream(n: int) -> None:
    assert run(streams_job, n, timeout=60) == [True] * n


def _mixed_op(comm, rng, me: int, n: int, stream) -> tuple:
    """Issue one random collective on ``stream``; return (buffer, expected contents, input to keep alive)."""
    count = int(rng.choice([1, 3, 1000, 5000, 100_000]))  # up to 16 KiB runs in place, larger on the worker
    kind, root = int(rng.integers(3)), int(rng.integers(n))
    if kind == 0:
        x = np.full(count, me + 1, np.int32)
        comm.allReduce(ptr(x), ptr(x), count, I32, SUM, stream.ptr)
        return x, np.full(count, n * (n + 1) // 2, np.int32), x
    if kind == 1:
        x = np.full(count, me, np.int32)
        comm.broadcast(ptr(x), ptr(x), count, I32, root, stream.ptr)
        return x, np.full(count, root, np.int32), x
    out, mine = np.zeros(n * count, np.int32), np.full(count, me, np.int32)
    comm.allGather(ptr(mine), ptr(out), count, I32, stream.ptr)
    return out, np.repeat(np.arange(n, dtype=np.int32), count), mine  # mine must outlive the operation


def mixed_traffic_job(rounds: int) -> int:
    comm, me, n = _world()
    rng = np.random.default_rng(7)  # the same sequence on every rank
    streams = [nccl.cuda.Stream(), nccl.cuda.Stream()]
    pending, checked = [], 0
    for _ in range(rounds):
        stream = streams[int(rng.integers(2))]
        issued = _mixed_op(comm, rng, me, n, stream)
        pending.append((stream.record(), *issued))
        if rng.integers(3) == 0:  # wait now and then, for everything issued so far, in a random order
            for k in rng.permutation(len(pending)):
                event, buf, want, _ = pending[k]
                event.synchronize()
                np.testing.assert_array_equal(buf, want)
                checked += 1
            pending = []
    for event, buf, want, _ in pending:
        event.synchronize()
        np.testing.assert_array_equal(buf, want)
        checked += 1
    comm.check_async_error()
    comm.destroy()
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_mixed_traffic_on_two_streams(n: int) -> None:
    """Small operations (read by their waiter) and large ones (on the worker) interleaved: none is lost."""
    assert run(mixed_traffic_job, n, 300, timeout=100) == [300] * n


def split_job() -> list:
    comm, me, n = _world()
    sub = comm.commSplit(me % 2, -me)  # even / odd, in reverse rank order
    members = sorted((r for r in range(n) if r % 2 == me % 2), reverse=True)
    assert (sub.rank_id(), sub.size()) == (members.index(me), len(members))
    # Parent and child at once on two streams: their frames must not mix.
    s1, s2 = nccl.cuda.Stream(), nccl.cuda.Stream()
    a, b = np.full(2, me, np.int32), np.full(2, me, np.int32)
    comm.allReduce(ptr(a), ptr(a), 2, I32, SUM, s1.ptr)
    sub.allReduce(ptr(b), ptr(b), 2, I32, SUM, s2.ptr)
    s1.synchronize()
    s2.synchronize()
    assert int(a[0]) == sum(range(n)) and int(b[0]) == sum(members)
    rest = comm.commSplit(-1 if me == 0 else 7, 0)  # NCCL_SPLIT_NOCOLOR
    sizes = [None if rest is None else rest.size()]
    if rest is not None:
        c = np.ones(1)
        rest.allReduce(ptr(c), ptr(c), 1, F64, SUM, 0)
        sizes.append(float(c[0]))
        rest.destroy()
    sub.destroy()
    comm.destroy()
    return sizes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_comm_split(n: int) -> None:
    assert run(split_job, n, timeout=60) == [[None]] + [[n - 1, float(n - 1)]] * (n - 1)


# --- failures ---------------------------------------------------------------------------------


def absent_peer_job() -> list:
    comm, me, n = _world()
    if me == n - 1:
        time.sleep(3)  # alive, but never makes the call
        return []
    s = nccl.cuda.Stream()
    x = np.ones(4)
    start = time.monotonic()
    comm.allReduce(ptr(x), ptr(x), 4, F64, SUM, s.ptr)
    s.synchronize()
    elapsed = time.monotonic() - start
    try:
        comm.check_async_error()
        return ["no error"]
    except nccl.NcclError as exc:
        status = exc.status
    start = time.monotonic()
    try:
        comm.allReduce(ptr(x), ptr(x), 4, F64, SUM, 0)  # the communicator is broken: fails fast
    except nccl.NcclError as exc:
        return [status, exc.status, elapsed, time.monotonic() - start]
    return ["later op worked"]


@pytest.mark.timeout(120)
def test_a_peer_that_never_arrives_times_out() -> None:
    results = run(absent_peer_job, 3, timeout=60, env={"COMMLIB_NCCL_EMULATOR_TIMEOUT": "1"})
    for status, later, elapsed, fast in results[:-1]:
        assert status == later == REMOTE_ERROR
        assert 0.9 < elapsed < 5 and fast < 0.5


def crashed_peer_job(on_stream: bool) -> list:
    comm, me, _ = _world()
    if me == 1:
        comm.abort()  # closes its sockets without a goodbye, like a crashed process
        time.sleep(2)
        return []
    x = np.ones(4)
    s = nccl.cuda.Stream() if on_stream else nccl.cuda.Stream.null
    start = time.monotonic()
    try:
        comm.allReduce(ptr(x), ptr(x), 4, F64, SUM, s.ptr)
        s.synchronize()
        comm.check_async_error()
    except nccl.NcclError as exc:
        return [exc.status, time.monotonic() - start]
    return ["no error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_stream", [False, True], ids=["null stream", "stream"])
def test_a_peer_that_drops_out_fails_the_operation_fast(on_stream: bool) -> None:
    results = run(crashed_peer_job, 3, on_stream, timeout=60, env={"COMMLIB_NCCL_EMULATOR_TIMEOUT": "60"})
    for rank in (0, 2):
        status, elapsed = results[rank]
        assert status == REMOTE_ERROR and elapsed < 5


def abort_job() -> list:
    comm, me, _ = _world()
    if me == 1:
        time.sleep(2.5)  # alive and silent until rank 0 is done
        return []
    s = nccl.cuda.Stream()
    x, y = np.ones(4), np.ones(4)
    comm.allReduce(ptr(x), ptr(x), 4, F64, SUM, s.ptr)  # stuck: rank 1 never calls
    blocked: list = []

    def blocking_call() -> None:
        try:
            comm.allReduce(ptr(y), ptr(y), 4, F64, SUM, 0)
        except nccl.NcclError as exc:
            blocked.append(exc.status)

    helper = threading.Thread(target=blocking_call)
    helper.start()
    time.sleep(0.3)
    start = time.monotonic()
    comm.abort()
    returned = time.monotonic() - start
    s.synchronize()
    helper.join(5)
    unblocked = time.monotonic() - start
    try:
        comm.allReduce(ptr(x), ptr(x), 4, F64, SUM, 0)
    except nccl.NcclError as exc:
        return [returned, unblocked, blocked, exc.status, repr(comm)]
    return ["op after abort worked"]


@pytest.mark.timeout(120)
def test_abort_unblocks_operations_in_flight() -> None:
    returned, unblocked, blocked, status, text = run(abort_job, 2, timeout=60)[0]
    assert returned < 0.5 and unblocked < 2.0 and len(blocked) == 1
    assert status == INVALID_ARGUMENT and "aborted" in text


# --- no MPI at all ----------------------------------------------------------------------------

SCRIPT = """
import json, os, sys, time
import numpy as np
from commlib.backends import nccl_emulator as nccl

rank, size, id_file, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if rank == 0:
    with open(id_file + ".tmp", "wb") as f:
        f.write(nccl.get_unique_id())
    os.replace(id_file + ".tmp", id_file)
while not os.path.exists(id_file):
    time.sleep(0.01)
with open(id_file, "rb") as f:
    comm = nccl.NcclCommunicator(size, f.read(), rank)
x = np.full(3, rank + 1.0)
comm.allReduce(x.ctypes.data, x.ctypes.data, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
if mode == "die" and rank == size - 1:
    os._exit(3)
try:
    comm.allReduce(x.ctypes.data, x.ctypes.data, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
    print(json.dumps(["ok", x.tolist()]))
except nccl.NcclError as exc:
    print(json.dumps(["error", exc.status]))
comm.destroy()
"""


def _spawn(tmp_path: Path, size: int, mode: str, **extra: str) -> list:
    script, id_file = tmp_path / "rank.py", tmp_path / "uid.bin"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COMMLIB_NCCL_EMULATOR_TIMEOUT": "20", **extra}
    argv = [sys.executable, str(script), "RANK", str(size), str(id_file), mode]
    procs = [
        subprocess.Popen([str(r) if a == "RANK" else a for a in argv], stdout=subprocess.PIPE, env=env)
        for r in range(size)
    ]
    outputs = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    return [json.loads(o) if o else p.returncode for o, p in zip(outputs, procs, strict=True)]


def _lan_address() -> str | None:
    """A non-loopback address of this host, if it has one (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip = probe.getsockname()[0]
    return None if ip.startswith("127.") else ip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("address", ["default", "lan"])
def test_plain_processes_exchanging_the_id_through_a_file(tmp_path: Path, address: str) -> None:
    extra = {}
    if address == "lan":  # the root advertises that address; the ranks advertise what reached it
        extra["COMMLIB_NCCL_EMULATOR_ADDR"] = _lan_address() or pytest.skip("no non-loopback IPv4 address")
    assert _spawn(tmp_path, 3, "ok", **extra) == [["ok", [18.0] * 3]] * 3  # (1 + 2 + 3) * 3


@pytest.mark.timeout(120)
def test_the_root_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from commlib.backends.nccl_emulator._wire import decode_id

    monkeypatch.delenv("COMMLIB_NCCL_EMULATOR_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert decode_id(nccl.get_unique_id())[0][0] == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.254")  # not an address of this host: ignored
    assert decode_id(nccl.get_unique_id())[0][0] in ("127.0.0.1", socket.gethostbyname(socket.gethostname()))
    monkeypatch.setenv("COMMLIB_NCCL_EMULATOR_ADDR", "10.1.2.3")  # explicit: taken as is
    (ip, port), secret = decode_id(nccl.get_unique_id())
    assert ip == "10.1.2.3" and port > 0 and len(secret) == 16


@pytest.mark.timeout(120)
def test_a_process_that_dies_fails_the_survivors(tmp_path: Path) -> None:
    assert _spawn(tmp_path, 3, "die") == [["error", REMOTE_ERROR]] * 2 + [3]
