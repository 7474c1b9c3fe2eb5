"""Large gradients averaged where they are (``Reducer(in_place=True)``, what ``ddp.DistributedDataParallel`` uses):
no copy into a bucket and none back out, the same averages as the bucketed path, on real ranks."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.buckets.planner import MIB, ParamInfo, plan_buckets
from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

BIG = MIB  # float32 elements: 4 MiB, the smallest gradient that gets a bucket of its own


def f32(numel: int) -> ParamInfo:
    return ParamInfo(numel, 4, "float32")


def test_lone_buckets_for_large_parameters_numbered_by_completion() -> None:
    params = [f32(BIG), f32(10), f32(4 * BIG), f32(10), f32(BIG), f32(10)]  # an MLP: weight, bias, ...
    assert [b.params for b in plan_buckets(params).buckets] == [(5, 4), (3, 2, 1, 0)]  # torch's rule, unchanged
    plan = plan_buckets(params, lone_mb=4)
    # the walk is 5 4 3 2 1 0: the small ones share one bucket, complete at 1, so it goes after 2
    assert [b.params for b in plan.buckets] == [(4,), (2,), (5, 3, 1), (0,)]
    assert [b.nbytes for b in plan.buckets] == [4 * MIB, 16 * MIB, 120, 4 * MIB]
    just_under = plan_buckets([f32(BIG - 1), f32(10)], lone_mb=4)
    assert [b.params for b in just_under.buckets] == [(1, 0)]
    with pytest.raises(ValueError, match="lone_mb must be a positive number"):
        plan_buckets(params, lone_mb=0)


def reducer_job(custom: bool) -> list[str]:
    import commlib as dist
    from commlib.buckets import Reducer
    from commlib.buckets.reducer import average_all_reduce

    me, n = dist.get_rank(), dist.get_world_size()
    shapes = [(1024, 1024), (7,), (512, 4096), (3,)]  # 4 MiB, small, 8 MiB, small (float32)
    params = [np.zeros(s, np.float32) for s in shapes]
    comm = average_all_reduce() if custom else None
    reducer = Reducer(params, in_place=True, comm=comm, rebuild=False)
    lone = [b.params for b in reducer.plan.buckets if len(b.params) == 1]
    assert lone == [(2,), (0,)], reducer.plan
    out = []
    for step in range(3):
        grads = [np.random.default_rng(10 * step + me).normal(size=s).astype(np.float32) for s in shapes]
        expect = [
            np.mean([np.random.default_rng(10 * step + r).normal(size=s).astype(np.float32) for r in range(n)], axis=0)
            for s in shapes
        ]
        for i in (3, 2, 1, 0):
            reducer.ready(i, grads[i])
        got = reducer.finalize()
        assert got[0] is grads[0] and got[2] is grads[2]  # the large ones: averaged where they are
        assert got[1] is not grads[1] and got[3] is not grads[3]  # the small ones: through their bucket
        for g, e in zip(got, expect, strict=True):
            np.testing.assert_allclose(g, e, rtol=2e-6, atol=1e-6)
        out.append(f"step{step}")
    # a gradient that cannot stand in for its view (other dtype, not contiguous) goes through the bucket
    odd = np.asfortranarray(np.full((1024, 1024), float(me), np.float32))
    for i in (3, 2, 1):
        reducer.ready(i, np.ones(shapes[i], np.float32))
    reducer.ready(0, odd)
    got = reducer.finalize()
    assert got[0] is not odd and float(got[0][0, 0]) == pytest.approx((n - 1) / 2)
    out.append("fallback")
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("custom", [False, True], ids=["default-comm", "custom-comm"])
def test_reducer_in_place_averages_large_gradients_where_they_are(n: int, custom: bool) -> None:
    assert run(reducer_job, n, custom, timeout=120) == [["step0", "step1", "step2", "fallback"]] * n


def ddp_job() -> list[float]:
    import torch

    import commlib as dist
    import ddp

    me, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4))
    reference.load_state_dict(model.state_dict())
    net = ddp.DistributedDataParallel(model)
    assert any(b.params and len(b.params) == 1 and b.nbytes == 4 * 2**20 for b in net.reducer.plan.buckets)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * n, 1024, generator=g), torch.randn(4 * n, 4, generator=g)
        opt.zero_grad(set_to_none=step == 0)  # a fresh .grad, then one reused in place
        torch.nn.functional.mse_loss(net(x[4 * me : 4 * me + 4]), y[4 * me : 4 * me + 4]).backward()
        before = model[0].weight.grad
        opt.step()
        assert model[0].weight.grad is before  # the average was written into .grad itself,
        assert not net.reducer.views[0].any()  # never into the weight's bucket view
        ref_opt.zero_grad()
        sum(torch.nn.functional.mse_loss(reference(x[4 * r : 4 * r + 4]), y[4 * r : 4 * r + 4]) for r in range(n)).div(
            n
        ).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return [float(model[0].weight.sum())]


def test_torch_ddp_wrapper_averages_large_gradients_in_dot_grad() -> None:
    pytest.importorskip("torch")
    out = run(ddp_job, 2, timeout=180)
    assert out[0] == out[1]
