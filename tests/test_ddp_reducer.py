"""ddp.Reducer without torch: a plain numpy training loop with hand-written gradients, on real ranks."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

BATCH, STEPS, LR = 4, 6, 0.1


def _data(world: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.normal(size=(world * BATCH, 3)), rng.normal(size=(world * BATCH, 2))


def _init() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=(3, 5)), rng.normal(size=5), rng.normal(size=(5, 2)), rng.normal(size=2)]


def _grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Hand-written backprop of mean((tanh(x W1 + b1) W2 + b2 - y)^2)."""
    w1, b1, w2, b2 = params
    h = np.tanh(x @ w1 + b1)
    d_out = 2 * (h @ w2 + b2 - y) / y.size
    d_pre = (d_out @ w2.T) * (1 - h**2)
    return [x.T @ d_pre, d_pre.sum(0), h.T @ d_out, d_out.sum(0)]


def _oracle(world: int) -> list[np.ndarray]:
    """Full-batch gradient descent in one process: what the ranks together must compute."""
    params = _init()
    for step in range(STEPS):
        x, y = _data(world, step)
        for p, g in zip(params, _grads(params, x, y), strict=True):
            p -= LR * g
    return params


def _numpy_loop(bucket_cap_mb: float) -> dict:
    import commlib
    from ddp import Reducer

    rank, world = commlib.get_rank(), commlib.get_world_size()
    params = _init()
    reducer = Reducer(params, names=["w1", "b1", "w2", "b2"], bucket_cap_mb=bucket_cap_mb, first_bucket_mb=None)
    first_plan = str(reducer.plan)
    for step in range(STEPS):
        x, y = _data(world, step)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        grads = _grads(params, x[mine], y[mine])
        for index in (3, 1, 2, 0):  # any order: the plan follows it from the second step on
            reducer.ready(index, grads[index])
        for p, g in zip(params, reducer.finalize(), strict=True):
            p -= LR * g
    return {"params": params, "first_plan": first_plan, "plan": str(reducer.plan)}


@pytest.mark.timeout(120)
def test_numpy_loop_matches_a_numpy_oracle() -> None:
    tiny = 40 / 2**20  # 40 bytes: one or two parameters per bucket
    results = run(_numpy_loop, 3, tiny, timeout=60)
    want = _oracle(3)
    for r in results:
        for got, expected in zip(r["params"], want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    # First reverse registration order (b2 + w2 reach 40 bytes), then the order gradients arrived in.
    first = "BucketPlan(#0 float64@cpu 96 B [3, 2]; #1 float64@cpu 40 B [1]; #2 float64@cpu 120 B [0])"
    rebuilt = "BucketPlan(#0 float64@cpu 56 B [3, 1]; #1 float64@cpu 80 B [2]; #2 float64@cpu 120 B [0])"
    assert [(r["first_plan"], r["plan"]) for r in results] == [(first, rebuilt)] * 3


class Exported:
    """A foreign array: only the DLPack protocol (as a JAX or CuPy host array would offer)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.shape = a.shape

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def _unused_and_errors() -> dict:
    import commlib
    from ddp import Reducer

    rank = commlib.get_rank()
    a, b, c = np.zeros(3), np.zeros(2), np.zeros(1)
    out: dict = {}
    # find_unused: c never gets a gradient, b only on rank 0.
    reducer = Reducer([a, b, c], names=["a", "b", "c"], find_unused=True, bucket_cap_mb=16 / 2**20)
    reducer.ready(0, np.full(3, rank + 1.0))
    if rank == 0:
        reducer.ready(1, np.full(2, 4.0))
    ga, gb, gc = reducer.finalize()
    out["unused"] = (ga.tolist(), gb.tolist(), gc.tolist(), reducer.globally_used)
    # Without find_unused, a missing gradient is an error naming the parameter, and the reducer recovers.
    strict = Reducer([a, b], names=["alpha", "beta"])
    strict.ready(1, np.ones(2))
    with pytest.raises(RuntimeError, match=r"Reducer.finalize: parameters 'alpha' \(indices \[0\]\) received no"):
        strict.finalize()
    strict.ready(0, np.ones(3))
    with pytest.raises(RuntimeError, match=r"parameter 'alpha' was marked ready twice in one iteration"):
        strict.ready(0, np.ones(3))
    strict.ready(1, np.full(2, rank))
    out["recovered"] = [g.tolist() for g in strict.finalize()]
    with pytest.raises(ValueError, match=r"ready: grad for 'beta' must have shape \(2,\), got \(3,\)"):
        strict.ready(1, np.ones(3))
    # Any DLPack exporter works: parameters and gradients are read through numpy views.
    foreign = Reducer([Exported(np.zeros(2, np.float32))])
    foreign.ready(0, Exported(np.full(2, rank + 1.0, np.float32)))
    out["dlpack"] = foreign.finalize()[0].tolist()
    with pytest.raises(TypeError, match=r"params\[0\] has dtype int64; gradients must be floating point"):
        Reducer([np.zeros(2, np.int64)])
    return out


@pytest.mark.timeout(120)
def test_unused_gradients_and_errors() -> None:
    results = run(_unused_and_errors, 2, timeout=60)
    for r in results:
        ga, gb, gc, used = r["unused"]
        assert ga == [1.5] * 3 and gb == [2.0, 2.0] and gc == [0.0]  # (4 + 0) / 2: zeros count
        assert used == [True, True, False]
        assert r["recovered"] == [[1.0] * 3, [0.5, 0.5]]
        assert r["dlpack"] == [1.5, 1.5]


def test_import_ddp_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, ddp; ddp.Reducer; ddp.DistributedSampler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def _average_comm_and_tracing(path: str) -> list:
    import json
    from pathlib import Path

    import commlib
    from ddp import Reducer, average_all_reduce

    rank = commlib.get_rank()
    reducer = Reducer([np.zeros(2), np.zeros(3)], comm=average_all_reduce(), trace=path, bucket_cap_mb=1e-5)
    for step in range(2):
        reducer.ready(1, np.full(3, rank + step))
        reducer.ready(0, np.full(2, 2.0 * rank))
        out = [g.tolist() for g in reducer.finalize()]
    reducer.tracer.close()
    events = json.loads(Path(f"{path[:-5]}.rank{rank}.json").read_text())
    return [out, sorted({e["name"] for e in events})]


@pytest.mark.timeout(120)
def test_custom_comm_and_trace_file(tmp_path) -> None:
    results = run(_average_comm_and_tracing, 2, str(tmp_path / "t.json"), timeout=60)
    for out, names in results:
        assert out == [[1.0, 1.0], [1.5, 1.5, 1.5]]
        assert names == ["all_reduce bucket 0", "all_reduce bucket 1", "finalize"]


def _adopted() -> dict:
    """A reducer made late (a newcomer after grow_group) takes a member's plan state: no rebuild of its own, the
    members' buckets, and the next iteration's calls match theirs."""
    import commlib
    from ddp import Reducer

    rank = commlib.get_rank()
    tiny = 40 / 2**20
    params = _init()
    member = Reducer(params, bucket_cap_mb=tiny, first_bucket_mb=None)
    for index in (3, 1, 2, 0):  # the first iteration rebuilds the plan in this order (a collective)
        member.ready(index, np.ones_like(params[index]))
    member.finalize()
    state = [member.plan_state() if rank == 0 else None]
    commlib.broadcast_object_list(state, group_src=0)  # what ddp.broadcast_state sends a newcomer
    late = Reducer(params, bucket_cap_mb=tiny, first_bucket_mb=None)
    before = (str(late.plan), late.plan_state()[1])
    late.adopt(state[0])
    for index in (0, 1, 2, 3):  # no rebuild now: another order leaves the plan as it is
        late.ready(index, np.full_like(params[index], rank + 1.0))
    grads = late.finalize()
    return {"before": before, "after": (str(late.plan), late.plan_state()[1]), "member": str(member.plan),
            "grads": [g.tolist() for g in grads]}  # fmt: skip


@pytest.mark.timeout(120)
def test_a_late_reducer_adopts_a_members_plan() -> None:
    results = run(_adopted, 2, timeout=60)
    rebuilt = "BucketPlan(#0 float64@cpu 56 B [3, 1]; #1 float64@cpu 80 B [2]; #2 float64@cpu 120 B [0])"
    for r in results:
        assert r["before"][1] is True and r["before"][0] != rebuilt  # a fresh reducer would rebuild
        assert r["after"] == (rebuilt, False) and r["member"] == rebuilt
        assert all(np.allclose(g, 1.5) for g in r["grads"])
