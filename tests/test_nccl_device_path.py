"""The nccl backend's device-memory code path (stream ordering, deferred waits), in one process.

No GPU here: the emulator's communicator and streams play the device, with numpy
buffers standing in for device memory and ``host=False`` selecting the code the
backend runs for cupy arrays. World size 1, so every collective is local.
"""

from __future__ import annotations

import numpy as np
import pytest

from commlib import all_gather_into_tensor, all_reduce, broadcast
from commlib._group import ProcessGroup
from commlib.arrays import device_array
from commlib.backends import nccl_emulator as emu
from commlib.backends._cuda import nccl_unavailable_reason
from commlib.backends.nccl import NcclBackend


@pytest.fixture
def device_group() -> ProcessGroup:
    comm = emu.NcclCommunicator(1, emu.get_unique_id(), 0)
    backend = NcclBackend(emu, emu.cuda, np, comm, host=False)
    group = ProcessGroup(backend, [0], 0, "device", 30.0, "[rank 0/1] ")
    group.buffer = lambda obj, ctx, call, arg, writable=True: obj  # numpy stands in for device arrays here
    yield group
    backend.close()


def test_blocking_calls_defer_to_the_callers_stream(device_group: ProcessGroup) -> None:
    x = np.arange(4, dtype=np.float32)
    all_reduce(x, group=device_group)
    broadcast(x, src=0, group=device_group)
    out = np.zeros(4, np.float32)
    all_gather_into_tensor(out, x, group=device_group)
    emu.cuda.get_current_stream().synchronize()
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_async_wait_without_timeout_defers_and_with_timeout_blocks(device_group: ProcessGroup) -> None:
    x = np.ones(8, np.float64)
    work = all_reduce(x, group=device_group, async_op=True)
    assert work.wait() is True  # the caller's stream now waits for it
    work2 = all_reduce(x, group=device_group, async_op=True)
    assert work2.wait(timeout=10) is True and work2.is_completed()
    assert x.tolist() == [1.0] * 8


def test_repr_names_the_communicator(device_group: ProcessGroup) -> None:
    assert "NcclBackend rank 0/1" in repr(device_group.backend)


def test_no_gpu_here_is_reported_with_the_reason() -> None:
    assert nccl_unavailable_reason() == "no NVIDIA GPU is visible on this machine (no /dev/nvidia* device)"


def test_host_arrays_are_refused_for_device_memory() -> None:
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match=r"x must be a GPU array for the nccl backend .* got numpy.ndarray"):
        device_array(np.ones(2), device_group_label(), "all_reduce", "x")


def device_group_label() -> object:
    return type("Ctx", (), {"label": "[rank 0/1] "})()
