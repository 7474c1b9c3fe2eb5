"""The collective scenarios of test_collectives.py on real GPUs, with cupy arrays (marker `gpu`).

They skip, saying why, on machines without enough CUDA devices. Run them on a GPU machine with:

    python -m pip install -e ".[test,cuda12]" && python -m pytest -m gpu tests/test_gpu.py

The scenarios build numpy inputs and check against numpy; here every array argument is
moved to the GPU (cupy) before the call and copied back after it, so the collectives
themselves run on device memory through real NCCL. bfloat16 is left out: cupy has no
bfloat16 dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_collectives import SCENARIOS

from commlib.testing import run

pytestmark = pytest.mark.gpu


def _device_count() -> int:
    from commlib.backends._cuda import device_count

    return device_count()


class OnDevice:
    """commlib, with numpy arguments moved to the GPU for each call and the results copied back."""

    def __init__(self, dist: object) -> None:
        import cupy

        self._dist, self._cupy = dist, cupy

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._dist, name)
        if not callable(attr) or name.startswith(("get_", "new_", "ReduceOp")) or isinstance(attr, type):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            moved: list[tuple[np.ndarray, object]] = []
            result = attr(*[self._dev(a, moved) for a in args], **{k: self._dev(v, moved) for k, v in kwargs.items()})
            self._cupy.cuda.get_current_stream().synchronize()
            for host, device in reversed(moved):  # views of a buffer come back after the buffer itself
                if host.flags.writeable:
                    host[...] = self._cupy.asnumpy(device)
            return result

        return call

    def _dev(self, value: object, moved: list) -> object:
        if isinstance(value, np.ndarray):
            device = self._cupy.asarray(value)
            moved.append((value, device))
            return device
        if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
            return [self._dev(v, moved) for v in value]
        return value


def gpu_scenarios(names: list[str]) -> int:
    import reference

    import commlib as dist

    reference.ALL_DTYPES[:] = [d for d in reference.ALL_DTYPES if d != reference.BF16]
    n, me = dist.get_world_size(), dist.get_rank()
    assert dist.get_backend() == "nccl"
    device = OnDevice(dist)
    layouts = reference.group_layouts(n)
    groups = {k: None if k == "world" else dist.new_group(v) for k, v in layouts.items()}
    checks = 0
    for name in names:
        checks += sum(SCENARIOS[name](device, groups[k], r, me) for k, r in layouts.items() if me in r)
    return checks


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collective_scenarios_on_gpus(n: int) -> None:
    devices = _device_count()
    if devices < n:
        pytest.skip(f"needs {n} CUDA device(s) with cupy and NCCL; this machine has {devices}")
    assert all(c > 0 for c in run(gpu_scenarios, n, sorted(SCENARIOS), timeout=600))
