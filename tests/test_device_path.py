"""The nccl backend's device path (cupy arrays, torch CUDA tensors) enqueues and nothing else.

No GPU here: a stand-in device (``tests/devices.py``) counts every device allocation, host-device copy and host
synchronisation commlib makes, and in capture mode refuses them as CUDA graph capture does. Every collective and
send/recv of the public API, blocking and asynchronous, runs on a group of 2 ranks over an NCCL module whose
calls return at once (this process is rank 0): each must make 0 of each, and run under capture; the check that
the ranks made the same calls (the running digests) is host-side and counted here too. The emulator then plays
the device for real (streams as threads) for the ordering of blocking and asynchronous calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from devices import Device, DeviceArray

import commlib as dist
from commlib._group import ProcessGroup
from commlib.arrays import device_array
from commlib.backends import nccl_emulator as emu
from commlib.backends._cuda import nccl_unavailable_reason
from commlib.backends.nccl import NcclBackend

COUNTED = ("device allocation", "host-to-device copy", "device-to-host copy", "host synchronisation")


def _intake(obj: object, ctx: Any, call: str, arg: str, writable: bool = True) -> DeviceArray:
    """The device's arrays as they are (cupy's intake would take a cupy array as it is too)."""
    if not isinstance(obj, DeviceArray):
        raise TypeError(f"{call}: {arg} must be a device array here, got {type(obj).__name__}")
    return obj


def _group(dev: Device) -> ProcessGroup:
    backend = NcclBackend(dev.nccl, dev.cuda, dev.xp, dev.nccl.NcclCommunicator(2, bytes(128), 0), host=False)
    g = ProcessGroup(backend, [0, 1], 0, "device", 30.0, "[rank 0/2] ")
    g.buffer = _intake
    return g


def _scenarios(dev: Device, g: ProcessGroup) -> dict[str, Callable[[], Any]]:
    """Every call of the public API on the device path, its arrays made beforehand: name -> the call."""
    a = lambda n, v=1.0: dev.array(np.full(n, v, np.float32))  # noqa: E731
    x, out8, out4, pair = a(4), a(8), a(4), [a(4), a(4)]
    ins, outs = [a(2), a(3)], [a(2), a(1)]

    def wait(work: Any) -> None:
        work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(x, group=g),
        "all_reduce AVG": lambda: dist.all_reduce(x, dist.ReduceOp.AVG, group=g),
        "all_reduce MAX": lambda: dist.all_reduce(x, dist.ReduceOp.MAX, group=g),
        "broadcast from this rank": lambda: dist.broadcast(x, src=0, group=g),
        "broadcast from the other": lambda: dist.broadcast(x, src=1, group=g),
        "reduce to this rank": lambda: dist.reduce(x, dst=0, group=g),
        "reduce to the other": lambda: dist.reduce(x, dst=1, group=g),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out8, x, group=g),
        "all_gather (a list)": lambda: dist.all_gather(pair, x, group=g),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out4, out8, group=g),
        "reduce_scatter (a list)": lambda: dist.reduce_scatter(out4, pair, group=g),
        "all_to_all_single": lambda: dist.all_to_all_single(out8, a(8), group=g),
        "all_to_all_single uneven": lambda: dist.all_to_all_single(a(3), a(5), [2, 1], [2, 3], group=g),
        "all_to_all (lists)": lambda: dist.all_to_all(outs, [a(2), a(1)], group=g),
        "gather to this rank": lambda: dist.gather(x, pair, dst=0, group=g),
        "gather to the other": lambda: dist.gather(x, None, dst=1, group=g),
        "scatter from this rank": lambda: dist.scatter(x, pair, src=0, group=g),
        "scatter from the other": lambda: dist.scatter(x, None, src=1, group=g),
        "barrier": lambda: dist.barrier(group=g),
        "send": lambda: dist.send(x, dst=1, group=g),
        "recv": lambda: dist.recv(x, src=1, group=g),
        "isend, wait": lambda: wait(dist.isend(x, dst=1, group=g)),
        "irecv, wait": lambda: wait(dist.irecv(x, src=1, group=g)),
        "batch_isend_irecv, wait": lambda: [
            w.wait()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1, g), dist.P2POp(dist.irecv, ins[0], 1, g)])
        ],
        "all_reduce async, wait": lambda: wait(dist.all_reduce(x, group=g, async_op=True)),
        "all_gather_into_tensor async, wait": lambda: wait(dist.all_gather_into_tensor(out8, x, g, async_op=True)),
    }


_NAMES = sorted(_scenarios(Device(), _group(Device())))


@pytest.mark.parametrize("name", _NAMES)
def test_a_call_allocates_copies_and_synchronises_nothing(name: str) -> None:
    dev = Device()
    g = _group(dev)
    call = _scenarios(dev, g)[name]
    for _ in range(3):  # the first call, and the ones after it
        dev.counts.clear()
        call()
        assert {k: dev.counts[k] for k in COUNTED} == dict.fromkeys(COUNTED, 0), dict(dev.counts)
        nccl_calls = sum(n for k, n in dev.counts.items() if k.startswith("nccl "))
        assert nccl_calls >= 1, dict(dev.counts)  # it did reach NCCL
        events = dev.counts["event made"]
        assert events == (0 if "async" not in name and "isend" not in name and "irecv" not in name else events)
        assert events <= 2, dict(dev.counts)  # an asynchronous call: an event of its own per Work, at most


def test_every_call_runs_under_cuda_graph_capture() -> None:
    dev = Device()
    g = _group(dev)
    calls = _scenarios(dev, g)
    with dev.capture():
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                raise AssertionError(f"{name}: {e}") from e
    assert g.seq > 0 and g.broken is None


def test_the_check_still_sees_every_call_on_the_device_path() -> None:
    """The running digest moves with every collective (and each peer's messages with every send or receive), as
    the slow path and the closing check read it (collectives are folded in batches, and when read)."""
    dev = Device()
    g = _group(dev)
    digests = g.backend.digests()

    def now() -> tuple:
        return digests.summary()["calls"], tuple(digests.sent), tuple(digests.received)

    seen = set()
    for name, call in _scenarios(dev, g).items():
        before = now()
        call()
        after = now()
        assert after != before, name
        seen.add(after)
    assert len(seen) == len(_NAMES)


def test_capture_mode_refuses_what_capture_refuses() -> None:
    """The stand-in would catch them: a host copy, a query and an allocation are refused while capturing."""
    dev = Device()
    x = dev.array([1.0, 2.0])
    with dev.capture():
        for bad in (x.get, lambda: np.asarray(x), lambda: dev.xp.zeros(2), lambda: dev.cuda.Event().done):
            with pytest.raises(RuntimeError, match="not permitted while a stream is being captured"):
                bad()
    assert not isinstance(x, np.ndarray)


# -- the emulator plays the device (streams as threads), one rank --------------------------------------------------


@pytest.fixture
def emulated_device_group() -> Any:
    comm = emu.NcclCommunicator(1, emu.get_unique_id(), 0)
    backend = NcclBackend(emu, emu.cuda, np, comm, host=False)
    group = ProcessGroup(backend, [0], 0, "device", 30.0, "[rank 0/1] ")
    group.buffer = lambda obj, ctx, call, arg, writable=True: obj  # numpy stands in for device arrays here
    yield group
    backend.close()


def test_blocking_calls_defer_to_the_callers_stream(emulated_device_group: ProcessGroup) -> None:
    g = emulated_device_group
    x = np.arange(4, dtype=np.float32)
    dist.all_reduce(x, group=g)
    dist.broadcast(x, src=0, group=g)
    out = np.zeros(4, np.float32)
    dist.all_gather_into_tensor(out, x, group=g)
    emu.cuda.get_current_stream().synchronize()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_async_wait_without_timeout_defers_and_with_timeout_blocks(emulated_device_group: ProcessGroup) -> None:
    g = emulated_device_group
    x = np.ones(8, np.float64)
    work = dist.all_reduce(x, group=g, async_op=True)
    assert work.wait() is True  # the caller's stream now waits for it
    work2 = dist.all_reduce(x, group=g, async_op=True)
    assert work2.wait(timeout=10) is True and work2.is_completed()
    assert x.tolist() == [1.0] * 8


def test_repr_names_the_communicator(emulated_device_group: ProcessGroup) -> None:
    assert "NcclBackend rank 0/1" in repr(emulated_device_group.backend)


def test_no_gpu_here_is_reported_with_the_reason() -> None:
    assert nccl_unavailable_reason() == "no NVIDIA GPU is visible on this machine (no /dev/nvidia* device)"


def test_host_arrays_are_refused_for_device_memory() -> None:
    pytest.importorskip("cupy")
    ctx = type("Ctx", (), {"label": "[rank 0/1] "})()
    with pytest.raises(TypeError, match=r"x must be a GPU array for the nccl backend .* got numpy.ndarray"):
        device_array(np.ones(2), ctx, "all_reduce", "x")


# -- the device path's watchdog: a mismatched program ends although the host never waits --------------------------


def device_mismatch_job(case: str) -> tuple:
    """Two ranks on the device path (the emulator's streams as the GPU, ``host=False``): rank 1 calls another
    dtype of the same byte count (NCCL would run it, wrong) or another size (NCCL would hang); the host never
    waits in commlib. The watchdog thread finds the digests differ and aborts: the host's wait on its stream
    ends and its next call raises, naming both calls."""
    import time

    import numpy as np

    import commlib as dist
    from commlib._group import ProcessGroup
    from commlib.backends import nccl_emulator as emu
    from commlib.backends.nccl import NcclBackend, unique_id

    dist.init_process_group("mpi")  # the job's store and MPI world (to carry the unique id)
    r = dist.get_rank()
    uid = np.frombuffer(unique_id(emu), np.uint8).copy() if r == 0 else np.zeros(128, np.uint8)
    dist.broadcast(uid, src=0)
    backend = NcclBackend(emu, emu.cuda, np, emu.NcclCommunicator(2, uid.tobytes(), r), host=False)
    g = ProcessGroup(backend, [0, 1], r, "device", 60.0, f"[rank {r}/2] ")
    g.buffer = lambda obj, ctx, call, arg, writable=True: obj  # numpy stands in for device arrays here
    x = np.ones(4, np.float32) if r == 0 or case == "other size" else np.ones(2, np.float64)
    if case == "other size" and r == 1:
        x = np.ones(8, np.float32)
    start = time.monotonic()
    dist.all_reduce(x, group=g)  # enqueued: the host goes on
    emu.cuda.get_current_stream().synchronize()  # the host waits on the device, not in commlib (other size: hangs)
    time.sleep(4 * 0.5)  # the program goes on a while (the watchdog looks every half second)
    waited = time.monotonic() - start
    try:
        dist.all_reduce(x, group=g)
        outcome = (waited, "no error", "")
    except dist.GroupBrokenError as e:
        outcome = (waited, type(e.__cause__).__name__, str(e.__cause__))
    dist.barrier()  # on the world (mpi): both ranks are done with the device group
    return outcome


@pytest.mark.parametrize("case", ["same bytes", "other size"])
def test_the_device_watchdog_ends_a_mismatched_program(case: str) -> None:
    from commlib.testing import run

    env = {"COMMLIB_NCCL_EMULATOR_TIMEOUT": "60"}
    for rank, (waited, kind, message) in enumerate(run(device_mismatch_job, 2, case, timeout=120, env=env)):
        assert kind == "CollectiveMismatchError", (rank, kind, message)
        assert "all_reduce #1 (float32, 4 elements, SUM)" in message, message
        other = "float64, 2 elements" if case == "same bytes" else "float32, 8 elements"
        assert f"all_reduce #1 ({other}, SUM)" in message, message
        assert waited < 10, waited  # the watchdog's half-second looks, not the emulator's 60 s timeout
