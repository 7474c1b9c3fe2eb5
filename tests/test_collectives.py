"""Every collective x world sizes 1-4 x dtypes x ops x in/out of place x sub-groups, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from reference import ALL_DTYPES, BACKENDS, group_layouts, make, ops_for, reduce, same

from commlib.testing import run, world_sizes

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)


def _all_reduce(dist, g, ranks, me):
    checks = 0
    for d, dtype in enumerate(ALL_DTYPES):
        for o, op in enumerate(ops_for(dtype, dist.get_backend())):
            ins = [make(rk, 7, dtype, salt=d * 10 + o).reshape(7, 1) for rk in ranks]
            x = ins[ranks.index(me)].copy()
            assert dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=g) is None
            same(x, reduce(ins, op), f"all_reduce {dtype} {op}")
            checks += 1
    for size in (0, 1, 100_003):  # empty, scalar-like, and larger than any eager-message limit
        ins = [make(rk, size, np.dtype(np.float64), salt=size) for rk in ranks]
        x = ins[ranks.index(me)].copy()
        dist.all_reduce(x, group=g)
        same(x, reduce(ins, "SUM"), f"all_reduce size {size}")
        checks += 1
    return checks


def _broadcast(dist, g, ranks, me):
    checks = 0
    for d, dtype in enumerate(ALL_DTYPES):
        for root in ranks:
            x = make(me, 5, dtype, salt=d)
            if d % 2:
                dist.broadcast(x, src=root, group=g)
            else:
                dist.broadcast(x, group=g, group_src=ranks.index(root))
            same(x, make(root, 5, dtype, salt=d), f"broadcast {dtype} from {root}")
            checks += 1
    return checks


def _reduce(dist, g, ranks, me):
    checks = 0
    for d, dtype in enumerate(ALL_DTYPES):
        for o, op in enumerate(ops_for(dtype, dist.get_backend())):
            root = ranks[(d + o) % len(ranks)]
            ins = [make(rk, 6, dtype, salt=d * 10 + o) for rk in ranks]
            x = ins[ranks.index(me)].copy()
            dist.reduce(x, dst=root, op=getattr(dist.ReduceOp, op), group=g)
            same(x, reduce(ins, op) if me == root else ins[ranks.index(me)], f"reduce {dtype} {op} to {root}")
            checks += 1
    return checks


def _all_gather_into_tensor(dist, g, ranks, me):
    checks, n, i = 0, len(ranks), ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        ins = [make(rk, 4, dtype, salt=d) for rk in ranks]
        want = np.concatenate(ins)
        out = np.zeros(n * 4, dtype)
        dist.all_gather_into_tensor(out, ins[i], group=g)
        same(out, want, f"all_gather_into_tensor {dtype} out of place")
        stacked = np.zeros((n, 4), dtype)  # torch also accepts a stacked output
        dist.all_gather_into_tensor(stacked, ins[i], group=g)
        same(stacked.reshape(-1), want, f"all_gather_into_tensor {dtype} stacked")
        inplace = np.zeros(n * 4, dtype)
        inplace[i * 4 : (i + 1) * 4] = ins[i]
        dist.all_gather_into_tensor(inplace, inplace[i * 4 : (i + 1) * 4], group=g)
        same(inplace, want, f"all_gather_into_tensor {dtype} in place")
        checks += 3
    return checks


def _all_gather(dist, g, ranks, me):
    checks = 0
    for d, dtype in enumerate(ALL_DTYPES):
        ins = [make(rk, 6, dtype, salt=d).reshape(2, 3) for rk in ranks]
        outs = [np.zeros((2, 3), dtype) for _ in ranks]
        dist.all_gather(outs, ins[ranks.index(me)], group=g)
        for got, want in zip(outs, ins, strict=True):
            same(got, want, f"all_gather {dtype}")
        checks += 1
    return checks


def _reduce_scatter_tensor(dist, g, ranks, me):
    checks, n, i = 0, len(ranks), ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        for o, op in enumerate(ops_for(dtype, dist.get_backend())):
            ins = [make(rk, 3 * n, dtype, salt=d * 10 + o) for rk in ranks]
            want = reduce(ins, op)[i * 3 : (i + 1) * 3]
            out = np.zeros(3, dtype)
            dist.reduce_scatter_tensor(out, ins[i], op=getattr(dist.ReduceOp, op), group=g)
            same(out, want, f"reduce_scatter_tensor {dtype} {op}")
            buf = ins[i].copy()  # in place: the output is this rank's chunk of the input
            dist.reduce_scatter_tensor(buf[i * 3 : (i + 1) * 3], buf, op=getattr(dist.ReduceOp, op), group=g)
            same(buf[i * 3 : (i + 1) * 3], want, f"reduce_scatter_tensor {dtype} {op} in place")
            checks += 2
    return checks


def _reduce_scatter(dist, g, ranks, me):
    checks, n, i = 0, len(ranks), ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        for op in ops_for(dtype, dist.get_backend())[:2]:
            ins = [make(rk, 2 * n, dtype, salt=d).reshape(n, 2) for rk in ranks]
            out = np.zeros(2, dtype)
            dist.reduce_scatter(out, list(ins[i]), op=getattr(dist.ReduceOp, op), group=g)
            same(out, reduce(ins, op)[i], f"reduce_scatter {dtype} {op}")
            checks += 1
    return checks


def _all_to_all_single(dist, g, ranks, me):
    checks, n, i = 0, len(ranks), ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        ins = [make(rk, 2 * n * 3, dtype, salt=d).reshape(2 * n, 3) for rk in ranks]
        out = np.zeros((2 * n, 3), dtype)
        dist.all_to_all_single(out, ins[i], group=g)
        same(out, np.concatenate([a[2 * i : 2 * i + 2] for a in ins]), f"all_to_all_single {dtype} even")
        # uneven: rank a sends (a + b) % 3 rows to rank b
        sends = [[(a + b) % 3 for b in range(n)] for a in range(n)]
        uneven_in = [make(rk, sum(sends[a]) * 2, dtype, salt=d + 1).reshape(-1, 2) for a, rk in enumerate(ranks)]
        recv_sizes = [sends[a][i] for a in range(n)]
        out = np.zeros((sum(recv_sizes), 2), dtype)
        dist.all_to_all_single(out, uneven_in[i], recv_sizes, sends[i], group=g)
        starts = [[sum(sends[a][:b]) for b in range(n)] for a in range(n)]
        want = np.concatenate([uneven_in[a][starts[a][i] : starts[a][i] + sends[a][i]] for a in range(n)])
        same(out, want, f"all_to_all_single {dtype} uneven")
        checks += 2
    return checks


def _all_to_all(dist, g, ranks, me):
    checks, n, i = 0, len(ranks), ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        # rank a sends a tensor of a + b + 1 elements to rank b
        ins = [[make(rk, a + b + 1, dtype, salt=d * 7 + b) for b in range(n)] for a, rk in enumerate(ranks)]
        outs = [np.zeros(a + i + 1, dtype) for a in range(n)]
        dist.all_to_all(outs, ins[i], group=g)
        for a in range(n):
            same(outs[a], ins[a][i], f"all_to_all {dtype} from {ranks[a]}")
        checks += 1
    return checks


def _gather(dist, g, ranks, me):
    checks, i = 0, ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        root = ranks[d % len(ranks)]
        ins = [make(rk, 3, dtype, salt=d) for rk in ranks]
        outs = [np.zeros(3, dtype) for _ in ranks] if me == root else None
        dist.gather(ins[i], outs, dst=root, group=g)
        if me == root:
            for got, want in zip(outs, ins, strict=True):
                same(got, want, f"gather {dtype} to {root}")
        checks += 1
    return checks


def _scatter(dist, g, ranks, me):
    checks, i = 0, ranks.index(me)
    for d, dtype in enumerate(ALL_DTYPES):
        root = ranks[-1 - d % len(ranks)]
        chunks = [make(root, 4, dtype, salt=d * 10 + k) for k in range(len(ranks))]
        out = np.zeros(4, dtype)
        dist.scatter(out, chunks if me == root else None, src=root, group=g)
        same(out, chunks[i], f"scatter {dtype} from {root}")
        checks += 1
    return checks


SCENARIOS = {
    f.__name__[1:]: f
    for f in [
        _all_reduce,
        _broadcast,
        _reduce,
        _all_gather_into_tensor,
        _all_gather,
        _reduce_scatter_tensor,
        _reduce_scatter,
        _all_to_all_single,
        _all_to_all,
        _gather,
        _scatter,
    ]
}


def scenario_on_every_group(name: str, backend: str = "mpi") -> int:
    """Run scenario ``name`` on the world and on the sub-groups this rank belongs to."""
    import commlib as dist

    n, me = dist.get_world_size(), dist.get_rank()
    assert dist.get_backend() == backend, (dist.get_backend(), backend)
    layouts = group_layouts(n)
    groups = {k: None if k == "world" else dist.new_group(v) for k, v in layouts.items()}
    checks = sum(SCENARIOS[name](dist, groups[k], ranks, me) for k, ranks in layouts.items() if me in ranks)
    dist.destroy_process_group()
    return checks


@pytest.mark.parametrize("n", world_sizes)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_collective_matches_numpy(backend: str, name: str, n: int) -> None:
    checks = run(scenario_on_every_group, n, name, backend, timeout=120, env=BACKENDS[backend])
    assert all(c > 0 for c in checks), checks


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("name", ["all_to_all_single", "all_to_all", "gather", "scatter"])
def test_send_recv_compositions_match_numpy(name: str, n: int) -> None:
    """The send/recv compositions (what backends without native calls use) give the same results."""
    checks = run(scenario_on_every_group, n, name, timeout=120, env={"COMMLIB_MPI_COMPOSED": "1"})
    assert all(c > 0 for c in checks), checks
