"""The collective scenarios on real GPUs with cupy arrays (the `gpu` marker; skipped without devices).

Run them on a GPU machine with:  python -m pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import pytest

from commlib.testing import run

pytestmark = pytest.mark.gpu


def _device_count() -> int:
    from commlib.backends.nccl import nccl_unavailable_reason

    if nccl_unavailable_reason() is not None:
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def gpu_job() -> list[str]:
    import cupy

    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    assert dist.get_backend() == "nccl"
    bad = []
    x = cupy.full(1000, me + 1, cupy.float32)
    dist.all_reduce(x)
    if not bool((x == n * (n + 1) / 2).all()):
        bad.append("all_reduce")
    out = cupy.zeros(n * 4, cupy.int64)
    dist.all_gather_into_tensor(out, cupy.full(4, me, cupy.int64))
    if not bool((out.reshape(n, 4) == cupy.arange(n)[:, None]).all()):
        bad.append("all_gather_into_tensor")
    y = cupy.arange(8, dtype=cupy.float16) * me
    dist.broadcast(y, src=n - 1)
    if not bool((y == cupy.arange(8, dtype=cupy.float16) * (n - 1)).all()):
        bad.append("broadcast")
    z = cupy.zeros(2, cupy.float32)
    dist.reduce_scatter_tensor(z, cupy.ones(2 * n, cupy.float32))
    if not bool((z == n).all()):
        bad.append("reduce_scatter_tensor")
    w = dist.all_reduce(cupy.ones(4), async_op=True)
    w.wait(timeout=60)
    cupy.cuda.get_current_stream().synchronize()
    return bad


@pytest.mark.parametrize("n", [1, 2, 4])
def test_collectives_on_gpus(n: int) -> None:
    devices = _device_count()
    if devices < n:
        pytest.skip(f"needs {n} CUDA device(s) with cupy and NCCL; this machine has {devices}")
    assert run(gpu_job, n, timeout=300) == [[]] * n
