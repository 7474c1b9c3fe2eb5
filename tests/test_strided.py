"""Non-contiguous tensors in the in-place calls (all_reduce, broadcast, reduce, send, recv), as torch's backends
take them: a contiguous copy goes in, the result is copied back; a call that fails leaves the tensor as it was."""

from __future__ import annotations

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)


def strided_job() -> dict:
    import commlib as dist

    me, n = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    base = np.arange(24.0).reshape(4, 6)
    x = (base * (me + 1)).T  # a transposed view: strides (8, 48)
    dist.all_reduce(x)
    out["all_reduce"] = np.array_equal(x, (base * n * (n + 1) / 2).T)
    y = np.zeros((4, 12))[:, ::2]  # every other column
    y[...] = me
    dist.broadcast(y, src=n - 1)
    out["broadcast"] = bool((y == n - 1).all())
    z = np.full((6, 4), float(me + 1)).T
    dist.reduce(z, dst=0)
    out["reduce"] = bool((z == (n * (n + 1) / 2 if me == 0 else me + 1)).all())
    w = (base * (me + 1)).T
    work = dist.all_reduce(w, async_op=True)
    work.wait()
    out["all_reduce async"] = np.array_equal(w, (base * n * (n + 1) / 2).T)
    if me < 2:  # a round trip between ranks 0 and 1, both ends strided
        buf = np.zeros((3, 8))[:, ::2]
        buf[...] = me + 5
        if me == 0:
            dist.send(buf, dst=1)
            work = dist.irecv(buf, src=1)
            work.wait()
        else:
            got = np.zeros((3, 8))[:, ::2]
            dist.recv(got, src=0)
            dist.send(got * 2, dst=0)
            buf = got * 2
        out["send/recv"] = bool((buf == 10).all())
    # a call that fails (rank 1 never makes it): the strided tensor is as it was
    sub = dist.new_group([0, 1], timeout=1.0)
    if me == 0:
        v = (base + 1).T
        try:
            dist.all_reduce(v, group=sub)
            out["untouched"] = "no error"
        except dist.CommError:
            out["untouched"] = np.array_equal(v, (base + 1).T)
    dist.barrier()
    dist.destroy_process_group(sub)  # rank 0 made a call more on it: no closing check for it
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_in_place_calls_take_non_contiguous_tensors(backend: str) -> None:
    for rank, out in enumerate(run(strided_job, 3, timeout=120, env=BACKENDS[backend])):
        want = {"all_reduce": True, "broadcast": True, "reduce": True, "all_reduce async": True}
        if rank < 2:
            want["send/recv"] = True
        if rank == 0:
            want["untouched"] = True
        assert out == want, (rank, out)
