"""Integer AVG as NCCL defines it: the sum, divided by the group's size, truncating toward zero (-7 / 2 == -3).

Every integer dtype, negative values, int64 values no float64 holds exactly, on 2, 3 and 4 ranks and a
sub-group (the divisor is the group's size), through every path of the mpi backend (persistent operation,
commlib's own steps, pieces, nonblocking) and the nccl backend's code on the emulator; torch's
``all_reduce(op=AVG)`` on ``backend="commlib"`` gives what commlib's API gives; bool AVG is still refused.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from reference import INTS, same

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

SIZES = {"persistent": 40, "own steps": 80 << 10, "pieces": 9 << 20}  # bytes; see commlib.backends.mpi
PIECES_DTYPES = (np.int8, np.int64)  # 9 MiB inputs of every rank on every rank: two dtypes are enough there
BACKENDS = {"mpi": {}, "nccl": {"COMMLIB_NCCL_EMULATOR": "1"}}
NCCL_HAS_NO = (np.int16, np.uint16)  # NCCL has no 16-bit integer type


def inputs(rank: int, n: int, dtype: np.dtype, count: int, salt: int) -> np.ndarray:
    """Rank ``rank``'s values: spread over the dtype's whole range, negative ones included, and small enough
    that ``n`` of them add up without overflow (|sum| <= the dtype's max)."""
    info = np.iinfo(dtype)
    low, high = (0 if info.min == 0 else -(info.max // n)), info.max // n
    rng = np.random.default_rng([rank, n, count, salt])
    edges = np.array([low, high, 0, 1, low + 1, high - 1], dtype)  # the extremes, and remainders of every sign
    return np.concatenate([edges, rng.integers(low, high, count, dtype=dtype, endpoint=True)])[:count]


def truncated_mean(arrays: list[np.ndarray], n: int) -> np.ndarray:
    """The oracle: the sum (exact: the inputs do not overflow), then the quotient rounded toward zero."""
    total = np.sum(np.stack(arrays), axis=0, dtype=arrays[0].dtype)
    if total.dtype.kind == "u":
        return total // total.dtype.type(n)
    return np.where(total < 0, -(-total // total.dtype.type(n)), total // total.dtype.type(n)).astype(total.dtype)


def avg_job(sizes: dict[str, int]) -> list[str]:
    """Every rank: AVG through all_reduce (blocking and not), reduce and reduce_scatter_tensor, on the world and,
    with 3 ranks or more, a group of all but rank 0; returns what was checked."""
    import commlib as dist

    me, n, avg = dist.get_rank(), dist.get_world_size(), dist.ReduceOp.AVG
    nccl = dist.get_backend() == "nccl"
    groups = {"world": (None, list(range(n)))}
    if n >= 3:
        groups["ranks 1.."] = (dist.new_group(list(range(1, n))), list(range(1, n)))
    checked = []
    for d, dtype in enumerate(np.dtype(t) for t in INTS):
        if nccl and dtype in NCCL_HAS_NO:
            with pytest.raises(
                TypeError, match=re.escape(f"all_reduce: op=ReduceOp.AVG on dtype {dtype} is not supported")
            ):
                dist.all_reduce(np.ones(3, dtype), op=avg)
            continue
        for where, nbytes in sizes.items():
            if where == "pieces" and dtype not in PIECES_DTYPES:
                continue
            for name, (g, ranks) in groups.items():
                if me not in ranks:
                    continue
                k, what = len(ranks), f"{dtype} {where} on {name}"
                count = max(nbytes // dtype.itemsize // k * k, k)
                ins = [inputs(r, k, dtype, count, d) for r in ranks]
                want, mine = truncated_mean(ins, k), ins[ranks.index(me)]
                x = mine.copy()
                assert dist.all_reduce(x, op=avg, group=g) is None
                same(x, want, f"all_reduce AVG {what}")
                if where == "pieces":  # only an in-place all_reduce runs as pieces
                    checked.append(what)
                    continue
                x = mine.copy()
                dist.all_reduce(x, op=avg, group=g, async_op=True).wait()
                same(x, want, f"all_reduce(async_op=True) AVG {what}")
                root = ranks[d % k]
                x = mine.copy()
                dist.reduce(x, dst=root, op=avg, group=g)
                same(x, want if me == root else mine, f"reduce AVG to {root} {what}")
                part = count // k
                out = np.zeros(part, dtype)
                dist.reduce_scatter_tensor(out, mine, op=avg, group=g)
                i = ranks.index(me)
                same(out, want[i * part : (i + 1) * part], f"reduce_scatter_tensor AVG {what}")
                checked.append(what)
    with pytest.raises(TypeError, match=re.escape("op=ReduceOp.AVG is not defined for dtype bool")):
        dist.all_reduce(np.ones(3, np.bool_), op=avg)
    dist.destroy_process_group()
    return checked


def test_the_oracle_rounds_toward_zero() -> None:
    """-7 / 2 == -3 (C's and NCCL's division), not -4 (Python's floor); 7 / 2 == 3."""
    got = truncated_mean([np.array([-3, 3, -1, 0], np.int8), np.array([-4, 4, -1, -1], np.int8)], 2)
    same(got, np.array([-3, 3, -1, 0], np.int8), "oracle")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_integer_avg(backend: str, n: int) -> None:
    sizes = SIZES if backend == "mpi" else {"small": 40}  # the emulator's paths do not depend on the size
    results = run(avg_job, n, sizes, timeout=240, env=BACKENDS[backend])
    dtypes = len(INTS) - (len(NCCL_HAS_NO) if backend == "nccl" else 0)
    per_group = dtypes * (len(sizes) - ("pieces" in sizes)) + len(PIECES_DTYPES) * ("pieces" in sizes)
    assert len(results[-1]) == per_group * (2 if n >= 3 else 1), results[-1]  # the last rank is in every group


def torch_avg_job(master: dict[str, str]) -> dict[str, str]:
    """torch's all_reduce(op=AVG) on backend="commlib" against commlib's own all_reduce and the oracle."""
    import torch
    import torch.distributed as tdist
    from test_torch_backend import init_torch

    import commlib

    init_torch(master)
    me, n, problems = tdist.get_rank(), tdist.get_world_size(), {}
    for d, dtype in enumerate([torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]):
        np_dtype = np.dtype(str(dtype).removeprefix("torch."))
        ins = [inputs(r, n, np_dtype, 9, d) for r in range(n)]
        t = torch.from_numpy(ins[me].copy())
        tdist.all_reduce(t, op=tdist.ReduceOp.AVG)
        theirs = ins[me].copy()
        commlib.all_reduce(theirs, op=commlib.ReduceOp.AVG)
        if not np.array_equal(t.numpy(), truncated_mean(ins, n)) or not np.array_equal(t.numpy(), theirs):
            problems[str(dtype)] = f"torch {t.tolist()}, commlib {theirs.tolist()}, want {truncated_mean(ins, n)}"
    count = torch.tensor(7 + me)  # Lightning's batch count: an int64 scalar, averaged
    tdist.all_reduce(count, op=tdist.ReduceOp.AVG)
    if count.item() != (sum(7 + r for r in range(n))) // n:
        problems["int64 scalar"] = f"got {count.item()}"
    try:
        tdist.all_reduce(torch.ones(2, dtype=torch.bool), op=tdist.ReduceOp.AVG)
        problems["bool"] = "AVG on bool was accepted"
    except TypeError as e:
        if f"[rank {me}/{n}] all_reduce: op=ReduceOp.AVG is not defined for dtype bool" not in str(e):
            problems["bool"] = f"unclear refusal: {e}"
    tdist.destroy_process_group()
    return problems


def test_torch_all_reduce_avg_on_integers() -> None:
    pytest.importorskip("torch")
    from test_torch_backend import free_port_env

    assert run(torch_avg_job, 3, free_port_env(), timeout=120) == [{}] * 3


def test_nccl_before_2_10_has_no_avg() -> None:
    """ncclAvg came with NCCL 2.10: an older library gets a clear refusal, not ncclInvalidArgument mid-call."""
    from commlib import ReduceOp
    from commlib.backends.nccl import NcclBackend

    backend = object.__new__(NcclBackend)  # only its version matters here: no communicator needed
    backend._version = 2804  # NCCL 2.8.4 (the code before 2.9: major*1000 + minor*100 + patch)
    why = "NCCL 2.8 has no AVG (ncclAvg needs NCCL 2.10 or newer); use SUM and divide"
    assert backend.unsupported(np.dtype(np.int32), ReduceOp.AVG) == why
    assert backend.unsupported(np.dtype(np.int32), ReduceOp.SUM) is None
    backend._version = 21003  # 2.10.3
    assert backend.unsupported(np.dtype(np.int32), ReduceOp.AVG) is None
