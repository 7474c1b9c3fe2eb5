"""torch.distributed's own API on ``backend="commlib"``: every collective against numpy and gloo, on 1-4 ranks;
torch's DDP, FSDP2 and DTensor on 2 and 3 ranks (scenarios in torch_models.py).

Each job runs many scenarios and returns ``{scenario: problem}``; a test fails naming the
scenarios whose result was wrong. The same calls run on a gloo group of the same ranks, so
"equal to gloo" is checked too wherever gloo has the operation.
"""

from __future__ import annotations

import os

import pytest
from ports import free_port

from commlib.testing import run, world_sizes

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

pytest.importorskip("torch")


def free_port_env() -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT for torch's env:// rendezvous on a port nobody uses now (given to the job's function,
    which sets them: a job's own environment would need ranks of its own, see tests/conftest.py)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def init_torch(master: dict[str, str], timeout: float = 30.0) -> None:
    """In a rank: RANK/WORLD_SIZE from mpiexec's PMI variables, ``master`` (:func:`free_port_env`), then
    ``init_process_group("commlib")``."""
    import datetime

    os.environ.update(master)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = os.environ["PMI_RANK"], os.environ["PMI_SIZE"]
    import torch
    import torch.distributed as dist

    from commlib import torch_backend

    torch_backend.register()  # commlib.testing imported commlib before torch: registration is explicit here
    torch.set_num_threads(1)
    dist.init_process_group("commlib", timeout=datetime.timedelta(seconds=timeout))


def _scenarios(n: int, r: int) -> dict:
    """name -> (run(group) -> list, expected list, gloo has it); small integers: every result is exact."""
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    f = lambda *shape, dtype=torch.float64: torch.full(shape, float(r + 1), dtype=dtype)  # noqa: E731
    tri = n * (n + 1) // 2
    out: dict = {}

    def reduce_(op, dtype=torch.float64):  # type: ignore[no-untyped-def]
        def go(g):  # type: ignore[no-untyped-def]
            t = f(3, dtype=dtype)
            dist.all_reduce(t, op=op, group=g)
            return t.float().tolist()

        return go

    out["all_reduce SUM float64"] = (reduce_(R.SUM), [float(tri)] * 3, True)
    out["all_reduce MAX float32"] = (reduce_(R.MAX, torch.float32), [float(n)] * 3, True)
    out["all_reduce MIN int64"] = (reduce_(R.MIN, torch.int64), [1.0] * 3, True)
    out["all_reduce PRODUCT int32"] = (
        reduce_(R.PRODUCT, torch.int32),
        [float(torch.arange(1, n + 1).prod())] * 3,
        True,
    )
    out["all_reduce AVG float32"] = (reduce_(R.AVG, torch.float32), [tri / n] * 3, False)
    out["all_reduce SUM bfloat16"] = (reduce_(R.SUM, torch.bfloat16), [float(tri)] * 3, True)
    bx = 0
    for k in range(1, n + 1):
        bx ^= k
    out["all_reduce BXOR int32"] = (reduce_(R.BXOR, torch.int32), [float(bx)] * 3, True)

    def ar_async(g):  # type: ignore[no-untyped-def]
        t = f(4)
        work = dist.all_reduce(t, group=g, async_op=True)
        fut = work.get_future()
        work.wait()
        return [*t.tolist(), float(work.is_completed()), fut.value()[0].sum().item()]

    out["all_reduce async_op + future"] = (ar_async, [float(tri)] * 4 + [1.0, 4.0 * tri], True)

    def bcast(g):  # type: ignore[no-untyped-def]
        t = f(2)
        dist.broadcast(t, src=n - 1, group=g)
        return t.tolist()

    out["broadcast src=last"] = (bcast, [float(n)] * 2, True)

    def reduce_to_0(g):  # type: ignore[no-untyped-def]
        t = f(2)
        dist.reduce(t, dst=0, group=g)
        return t.tolist() if r == 0 else []  # elsewhere torch leaves the tensor undefined (gloo changes it)

    out["reduce dst=0"] = (reduce_to_0, [float(tri)] * 2 if r == 0 else [], True)

    def all_gather(g):  # type: ignore[no-untyped-def]
        outs = [torch.zeros(2) for _ in range(n)]
        dist.all_gather(outs, f(2, dtype=torch.float32), group=g)
        return torch.cat(outs).tolist()

    out["all_gather"] = (all_gather, [float(k + 1) for k in range(n) for _ in range(2)], True)

    def into_tensor(g):  # type: ignore[no-untyped-def]
        o = torch.zeros(n * 3)
        dist.all_gather_into_tensor(o, f(3, dtype=torch.float32), group=g)
        return o.tolist()

    out["all_gather_into_tensor"] = (into_tensor, [float(k + 1) for k in range(n) for _ in range(3)], True)

    def rs_list(g):  # type: ignore[no-untyped-def]
        o = torch.zeros(2)
        dist.reduce_scatter(o, [torch.full((2,), float(k * (r + 1))) for k in range(n)], group=g)
        return o.tolist()

    out["reduce_scatter"] = (rs_list, [float(r * tri)] * 2, True)

    def rs_tensor(g):  # type: ignore[no-untyped-def]
        o = torch.zeros(2, dtype=torch.int64)
        dist.reduce_scatter_tensor(o, torch.arange(2 * n) * (r + 1), group=g)
        return o.float().tolist()

    out["reduce_scatter_tensor"] = (rs_tensor, [float((2 * r + k) * tri) for k in range(2)], True)

    def a2a_single(g):  # type: ignore[no-untyped-def]
        sizes_in = [k + 1 for k in range(n)]  # k+1 rows to rank k
        sizes_out = [r + 1] * n
        inp = torch.cat([torch.full((k + 1, 2), float(10 * r + k)) for k in range(n)])
        o = torch.zeros(sum(sizes_out), 2)
        dist.all_to_all_single(o, inp, sizes_out, sizes_in, group=g)
        return o[:, 0].tolist()

    a2a_want = [float(10 * k + r) for k in range(n) for _ in range(r + 1)]
    out["all_to_all_single uneven"] = (a2a_single, a2a_want, True)

    def a2a_list(g):  # type: ignore[no-untyped-def]
        outs = [torch.zeros(1) for _ in range(n)]
        dist.all_to_all(outs, [torch.full((1,), float(10 * r + k)) for k in range(n)], group=g)
        return torch.cat(outs).tolist()

    out["all_to_all"] = (a2a_list, [float(10 * k + r) for k in range(n)], True)

    def gather(g):  # type: ignore[no-untyped-def]
        outs = [torch.zeros(1, dtype=torch.float64) for _ in range(n)] if r == 0 else None
        dist.gather(f(1), outs, dst=0, group=g)
        return torch.cat(outs).tolist() if outs else []

    out["gather dst=0"] = (gather, [float(k + 1) for k in range(n)] if r == 0 else [], True)

    def scatter(g):  # type: ignore[no-untyped-def]
        t = torch.zeros(2)
        dist.scatter(t, [torch.full((2,), float(k)) for k in range(n)] if r == 0 else None, src=0, group=g)
        return t.tolist()

    out["scatter src=0"] = (scatter, [float(r)] * 2, True)
    out["barrier"] = (lambda g: [dist.barrier(group=g)], [None], True)

    def objects(g):  # type: ignore[no-untyped-def]
        got = [None] * n
        dist.all_gather_object(got, {"r": r}, group=g)
        lst = [r, "x" * r]
        dist.broadcast_object_list(lst, src=0, group=g)
        gathered = [None] * n if r == 0 else None
        dist.gather_object(r * 2, gathered, dst=0, group=g)
        one = [None]
        dist.scatter_object_list(one, [k * 3 for k in range(n)] if r == 0 else None, src=0, group=g)
        return [got, lst, gathered, one]

    obj_want = [[{"r": k} for k in range(n)], [0, ""], [2 * k for k in range(n)] if r == 0 else None, [3 * r]]
    out["object collectives"] = (objects, obj_want, True)

    def functional(g):  # type: ignore[no-untyped-def]
        import torch.distributed._functional_collectives as fc

        g = g or dist.group.WORLD

        a, b = fc.all_reduce_coalesced([f(2), f(3)], "sum", g)
        c = fc.all_gather_into_tensor_coalesced([f(1), f(2)], g)
        d = fc.reduce_scatter_tensor_coalesced([torch.ones(n), torch.ones(2 * n)], "sum", [0, 0], g)
        return [x.tolist() for x in (a, b, *c, *d)]

    fun_want = [[float(tri)] * 2, [float(tri)] * 3, [float(k + 1) for k in range(n)]]
    fun_want += [[float(k + 1) for k in range(n) for _ in range(2)], [float(n)], [float(n)] * 2]
    out["functional *_coalesced"] = (functional, fun_want, False)
    if n > 1:
        out.update(_p2p(n, r))
    return out


def _p2p(n: int, r: int) -> dict:
    import torch
    import torch.distributed as dist

    right, left = (r + 1) % n, (r - 1) % n

    def ring(g):  # type: ignore[no-untyped-def]
        got = torch.zeros(3)
        ops = [
            dist.P2POp(dist.irecv, got, left, group=g),
            dist.P2POp(dist.isend, torch.full((3,), float(r)), right, group=g),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got.tolist()

    def send_recv(g):  # type: ignore[no-untyped-def]
        t = torch.full((2,), float(r))
        if r == 0:
            dist.send(t, 1, group=g, tag=5)
            return []
        if r == 1:
            sender = dist.recv(t, group=g, tag=5)  # from any source
            return [*t.tolist(), float(sender)]
        return []

    want = [0.0, 0.0, 0.0] if r == 1 else []
    return {
        "batch_isend_irecv ring": (ring, [float(left)] * 3, True),
        "send / recv(any source)": (send_recv, want, True),
    }


def collectives_job(master: dict[str, str], skip: tuple[str, ...] = (), models: bool = False) -> dict:
    import datetime

    import torch.distributed as dist

    init_torch(master)
    n, r = dist.get_world_size(), dist.get_rank()
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    problems = {}
    for name, (fn, want, with_gloo) in _scenarios(n, r).items():
        if name in skip:
            continue
        try:
            got = fn(None)
            theirs = fn(gloo) if with_gloo else got
        except Exception as e:  # reported by scenario name
            problems[name] = f"raised {type(e).__name__}: {e}"
            continue
        if got != want:
            problems[name] = f"got {got}, want {want}"
        elif theirs != got:
            problems[name] = f"commlib {got} != gloo {theirs}"
    if n > 1:
        problems.update(_subgroups(n, r))
    if models:
        from torch_models import model_problems

        problems.update(model_problems(n, r, gloo))
    dist.destroy_process_group()
    return problems


def _subgroups(n: int, r: int) -> dict:
    """torch sub-groups (created on their members only) and, on 4 ranks, DTensor on a 2-D mesh."""
    import torch
    import torch.distributed as dist

    problems = {}
    pair = dist.new_group([n - 1, 0])  # every rank calls it; torch creates it on ranks 0 and n-1 only
    if r in (0, n - 1):
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t, group=pair)
        if t.tolist() != [float(n + 1)] * 2:
            problems["new_group([n-1, 0]) all_reduce"] = f"got {t.tolist()}"
    if r >= 1:  # only the members call it
        rest = dist.new_group(list(range(1, n)), use_local_synchronization=True)
        t = torch.full((3,), float(r))
        dist.broadcast(t, group=rest, group_src=0)
        if t.tolist() != [1.0] * 3 or dist.get_rank(rest) != r - 1:
            problems["new_group(use_local_synchronization) broadcast"] = f"got {t.tolist()}"
    if n == 4:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2))
        a = torch.arange(24.0).reshape(8, 3)
        d = distribute_tensor(a, mesh, [Shard(0), Shard(1)]).redistribute(mesh, [Replicate(), Replicate()])
        if not torch.equal(d.to_local(), a):
            problems["DTensor 2-D mesh (S(0), S(1)) -> (R, R)"] = f"got {d.to_local().tolist()}"
    return problems


@pytest.mark.parametrize("n", world_sizes)
def test_torch_collectives_ddp_fsdp2_dtensor(n: int) -> None:
    """Every collective on n ranks; on 2 and 3 ranks also DDP, FSDP2 and DTensor (torch_models.py)."""
    results = run(collectives_job, n, free_port_env(), (), n in (2, 3), timeout=240)
    for rank, problems in enumerate(results):
        assert problems == {}, f"rank {rank}: {problems}"


# What NCCL itself refuses (commlib says so with a TypeError / ValueError naming the call).
NCCL_REFUSES = ("all_reduce BXOR int32", "send / recv(any source)")


def test_torch_collectives_on_the_nccl_backend_through_the_emulator() -> None:
    """The nccl backend's code path (CUDA tensors on a GPU) with CPU tensors on commlib's NCCL emulator."""
    env = {"COMMLIB_NCCL_EMULATOR": "1"}
    for rank, problems in enumerate(run(collectives_job, 2, free_port_env(), NCCL_REFUSES, timeout=120, env=env)):
        assert problems == {}, f"rank {rank}: {problems}"


def cuda_ddp_job(master: dict[str, str]) -> list:
    import torch

    torch.cuda.set_device(int(os.environ.get("MPI_LOCALRANKID", os.environ["PMI_RANK"])) % torch.cuda.device_count())
    init_torch(master)  # commlib picks nccl: a GPU is usable
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).cuda())
    model(torch.randn(3, 4, device="cuda")).sum().backward()
    t = torch.ones(4, device="cuda")
    torch.distributed.all_reduce(t)
    return t.tolist()


@pytest.mark.gpu
def test_torch_ddp_on_cuda_tensors_over_nccl() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU visible to torch")
    assert run(cuda_ddp_job, 2, free_port_env(), timeout=180) == [[2.0] * 4] * 2
