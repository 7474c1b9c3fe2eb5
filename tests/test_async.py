"""Async handles: several outstanding operations complete in issue order; Work.wait's timeout."""

from __future__ import annotations

import time

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run, world_sizes

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)


def outstanding_job() -> list:
    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    xs = [np.full(1000, me + k, np.float64) for k in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    b = np.full(3, float(me))
    works.append(dist.broadcast(b, src=n - 1, async_op=True))
    out = np.zeros(n * 3, np.int64)
    works.append(dist.all_gather_into_tensor(out, np.full(3, me, np.int64), async_op=True))
    states = [w.is_completed() for w in works]  # may be anything yet; must not block
    assert all(isinstance(s, bool) for s in states)
    assert works[3].wait() is True  # completes works 0..3, in issue order
    done_after_3 = [w.is_completed() for w in works[:4]]
    works[-1].wait()
    total = sum(range(n))
    for k in range(6):
        assert (xs[k] == total + n * k).all(), (k, xs[k][:3])
    assert (out == np.repeat(np.arange(n), 3)).all(), out
    assert (b == n - 1).all(), b
    return done_after_3 + [w.is_completed() for w in works]


@pytest.mark.parametrize("n", world_sizes)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_outstanding_async_ops_complete_in_issue_order(backend: str, n: int) -> None:
    for flags in run(outstanding_job, n, timeout=60, env=BACKENDS[backend]):
        assert all(flags), flags


def wait_timeout_job() -> str:
    import commlib as dist

    x = np.ones(4)
    if dist.get_rank() == 0:
        work = dist.all_reduce(x, async_op=True)
        try:
            work.wait(timeout=0.5)
        except dist.CommTimeoutError as e:
            return str(e)
        return "no timeout"
    time.sleep(2.0)  # busy elsewhere while rank 0 waits (its all_reduce is found unmatched at the job's end)
    return "skipped"


def test_work_wait_timeout_raises_and_names_the_call() -> None:
    message = run(wait_timeout_job, 2, timeout=60)[0]
    assert "[rank 0/2] all_reduce (call #1 on group 'world', ranks [0, 1]) did not complete within 0.5 s" in message


def p2p_job() -> list:
    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    right, left = (me + 1) % n, (me - 1) % n
    got = np.zeros(5, np.int32)
    # a ring in both orders in one batch: must not deadlock whatever the posting order
    ops = [dist.P2POp(dist.irecv, got, left, tag=3), dist.P2POp(dist.isend, np.full(5, me, np.int32), right, tag=3)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert (got == left).all(), got
    # blocking send/recv with tags, and recv from any source reporting the sender
    result = [int(got[0])]
    any_source = dist.get_backend() != "nccl"  # NCCL receives only from a named peer
    if me == 0:
        for peer in range(1, n):
            buf = np.zeros(2, np.float64)
            sender = dist.recv(buf, tag=7) if any_source else dist.recv(buf, src=peer)
            assert (buf == sender).all()
            result.append(sender)
    else:
        dist.send(np.full(2, float(me)), dst=0, tag=7)
    # isend/irecv with group ranks on a sub-group that excludes rank 0
    # (rank 1 sends first, rank 2 receives first: NCCL runs one rank's p2p in issue order)
    if n >= 3:
        g = dist.new_group(list(range(1, n)))
        if me in (1, 2):
            peer, buf = 3 - me, np.zeros(3)
            send = lambda: dist.isend(np.full(3, float(me)), dst=peer, group=g)  # noqa: E731
            recv = lambda: dist.irecv(buf, group=g, group_src=g.ranks.index(peer))  # noqa: E731
            works = [send(), recv()] if me == 1 else [recv(), send()]
            for w in works:
                w.wait()
            assert (buf == peer).all(), buf
    return sorted(result[1:]) if me == 0 else result


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_point_to_point(backend: str, n: int) -> None:
    results = run(p2p_job, n, timeout=60, env=BACKENDS[backend])
    assert results[0] == list(range(1, n))


def objects_job() -> dict:
    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    out = {}
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": me, "payload": "x" * (100 * me)})
    out["all_gather_object"] = objs
    lst = [1, "two", {"three": 3}] if me == n - 1 else [None, None, None]
    dist.broadcast_object_list(lst, src=n - 1)
    out["broadcast_object_list"] = lst
    gathered = [None] * n if me == 0 else None
    dist.gather_object(("r", me, list(range(me))), gathered, dst=0)
    out["gather_object"] = gathered
    recv = [None]
    dist.scatter_object_list(recv, [f"for {r}" * (r + 1) for r in range(n)] if me == 0 else None, src=0)
    out["scatter_object_list"] = recv[0]
    return out


@pytest.mark.parametrize("n", world_sizes)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_object_collectives(backend: str, n: int) -> None:
    results = run(objects_job, n, timeout=60, env=BACKENDS[backend])
    for me, out in enumerate(results):
        assert out["all_gather_object"] == [{"rank": r, "payload": "x" * (100 * r)} for r in range(n)]
        assert out["broadcast_object_list"] == [1, "two", {"three": 3}]
        assert out["scatter_object_list"] == f"for {me}" * (me + 1)
    assert results[0]["gather_object"] == [("r", r, list(range(r))) for r in range(n)]


def groups_job() -> dict:
    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    g = dist.new_group([n - 1, 0], sort_ranks=False)  # group rank 0 is global rank n-1
    info = {"rank": dist.get_rank(g), "size": dist.get_world_size(g), "backend": dist.get_backend()}
    if me in (0, n - 1):
        info["global_of_0"] = dist.get_global_rank(g, 0)
        info["group_of_0"] = dist.get_group_rank(g, 0)
        x = np.array([float(me)])
        dist.broadcast(x, group=g, group_src=0)
        info["bcast"] = float(x[0])
    dist.monitored_barrier(timeout=10, wait_all_ranks=True)
    dist.barrier(timeout=10)
    return info


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_group_ranks_and_queries(backend: str, n: int) -> None:
    results = run(groups_job, n, timeout=60, env=BACKENDS[backend])
    want = {"rank": 1, "size": 2, "backend": backend, "global_of_0": n - 1, "group_of_0": 1, "bcast": n - 1}
    assert results[0] == want
    assert results[n - 1]["rank"] == 0
    if n == 3:
        assert results[1] == {"rank": -1, "size": -1, "backend": backend}


def torch_job() -> list:
    import torch

    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    checks = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
        t = torch.full((2, 3), me + 1, dtype=dtype)
        dist.all_reduce(t)
        checks.append(bool((t == n * (n + 1) // 2).all()))
    out = torch.zeros(n * 2, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((2,), me, dtype=torch.bfloat16))
    checks.append(out.tolist() == [float(r) for r in range(n) for _ in range(2)])
    t = torch.arange(4.0) * me
    dist.broadcast(t, src=n - 1)
    checks.append(t.tolist() == [float((n - 1) * k) for k in range(4)])
    strided = (torch.arange(16.0).reshape(4, 4) * (me + 1)).t()  # as torch's backends: reduced in place
    dist.all_reduce(strided)
    checks.append(strided.tolist() == (torch.arange(16.0).reshape(4, 4) * n * (n + 1) / 2).t().tolist())
    return checks


@pytest.mark.parametrize("n", [2, 3])
def test_torch_cpu_tensors_zero_copy(n: int) -> None:
    pytest.importorskip("torch")
    for checks in run(torch_job, n, timeout=90):
        assert checks and all(checks), checks


def grad_job() -> list:
    import torch

    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(me)  # every rank starts from other weights
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():  # torch scripts' way of making the replicas start alike
        for p in model.parameters():
            dist.broadcast(p, src=0)
    mine = [p.detach().clone() for p in model.parameters()]
    firsts = [None] * n
    dist.all_gather_object(firsts, [p.tolist() for p in mine])
    leaf = torch.full((4,), float(me + 1), requires_grad=True)
    dist.all_reduce(leaf)  # outside no_grad too, as torch.distributed takes it
    model(torch.ones(1, 3)).sum().backward()
    checks = {
        "parameters alike": all(f == firsts[0] for f in firsts),
        "still require grad": all(p.requires_grad for p in model.parameters()),
        "gradients flow": all(p.grad is not None for p in model.parameters()),
        "leaf summed": leaf.tolist() == [float(n * (n + 1) // 2)] * 4 and leaf.requires_grad,
    }
    for name, grad in (("conjugate view refused", False), ("conjugate view that requires grad refused", True)):
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.complex64, requires_grad=grad).conj())
            checks[name] = False
        except TypeError as e:
            checks[name] = f"[rank {me}/{n}] all_reduce: tensor: " in str(e) and "conjugate" in str(e)
    return [checks]


def test_tensors_that_require_grad_are_moved_as_torch_distributed_moves_them() -> None:
    pytest.importorskip("torch")
    for (checks,) in run(grad_job, 2, timeout=90):
        assert checks and all(checks.values()), checks
