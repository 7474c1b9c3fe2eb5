"""Every collective above the persistent size runs as point-to-point steps of commlib's own
(``commlib.backends._direct.OWN``; ``_direct.c``): every dtype and reduction (SUM in C, the others through
MPI_Reduce_local, AVG divided after), pieces that do not divide evenly, reduce leaving the other ranks'
arrays alone, sub-groups, a rank that calls asynchronously while another blocks (both must take the same
steps), and ranks that disagree on the size (an error on every rank, not a hang). ``COMMLIB_MPI_OWN_STEPS=0``
(MPI's own calls) must give the same results."""

from __future__ import annotations

import numpy as np
import pytest
from test_sums import _c_runner_built

from commlib.testing import run

K = 20_001  # elements: above 64 KiB for every dtype below, and no multiple of 2 or 3 (uneven pieces)


def own_steps_job(mismatch: bool) -> dict:
    """scenario -> problem, on every rank."""
    import commlib as dist
    from commlib.errors import CollectiveMismatchError

    me, n = dist.get_rank(), dist.get_world_size()
    problems: dict = {}

    def same(name: str, got: np.ndarray, want: np.ndarray) -> None:
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            problems[name] = f"got {got.reshape(-1)[:4]}... want {want.reshape(-1)[:4]}..."

    def ramp(r: int, dtype: type, size: int = K) -> np.ndarray:
        values = (np.arange(size) % 7 + 3 * r + 1).astype(np.int64)
        return (values + 1j * values).astype(dtype) if np.dtype(dtype).kind == "c" else values.astype(dtype)

    dtypes = (np.float32, np.float64, np.complex64, np.int8, np.uint16, np.int32, np.uint64)
    for dtype in dtypes:
        every = [ramp(r, dtype) for r in range(n)]
        for op, want in (
            (dist.ReduceOp.SUM, sum(every[1:], every[0].copy())),
            (dist.ReduceOp.MAX, np.maximum.reduce(every) if dtype is not np.complex64 else None),
            (dist.ReduceOp.PRODUCT, np.multiply.reduce(every)),
        ):
            if want is None:
                continue
            for call in range(2):  # the first call makes the Direct, the second finds it
                x = ramp(me, dtype)
                dist.all_reduce(x, op=op)
                same(f"all_reduce {np.dtype(dtype)} {op} #{call}", x, want.astype(dtype))
                x = ramp(me, dtype)
                dist.reduce(x, dst=call % n, op=op)  # off the root the array is left alone
                same(
                    f"reduce {np.dtype(dtype)} {op} #{call}",
                    x,
                    want.astype(dtype) if me == call % n else ramp(me, dtype),
                )
                out = np.zeros(K, dtype)
                dist.reduce_scatter_tensor(out, np.concatenate([ramp(me + k, dtype) for k in range(n)]), op=op)
                chunks = [
                    np.concatenate([ramp(r + k, dtype) for k in range(n)])[me * K : (me + 1) * K] for r in range(n)
                ]
                whole = {"SUM": np.add, "MAX": np.maximum, "PRODUCT": np.multiply}[op.name].reduce(chunks)
                same(f"reduce_scatter {np.dtype(dtype)} {op} #{call}", out, whole.astype(dtype))
        out = np.zeros(n * K, dtype)
        dist.all_gather_into_tensor(out, ramp(me, dtype))
        same(f"all_gather {np.dtype(dtype)}", out, np.concatenate(every))
        parts = [np.zeros(K, dtype) for _ in range(n)] if me == n - 1 else None
        dist.gather(ramp(me, dtype), parts, dst=n - 1)
        if parts is not None:
            same(f"gather {np.dtype(dtype)}", np.concatenate(parts), np.concatenate(every))
    mean = sum(ramp(r, np.float64) for r in range(n)) / n
    x = ramp(me, np.float64)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    same("all_reduce AVG", x, mean)
    x = ramp(me, np.float64)
    dist.reduce(x, dst=0, op=dist.ReduceOp.AVG)
    same("reduce AVG", x, mean if me == 0 else ramp(me, np.float64))
    out = np.zeros(K // n, np.float64)
    dist.reduce_scatter_tensor(out, ramp(me, np.float64, K // n * n), op=dist.ReduceOp.AVG)
    same(
        "reduce_scatter AVG",
        out,
        (sum(ramp(r, np.float64, K // n * n) for r in range(n)) / n)[me * (K // n) :][: K // n],
    )

    # an uneven all_to_all: rank i sends (j + 1) * (i + 1) * 2000 elements to rank j (none to itself on rank
    # 1: an empty block); blocking twice (the second through the front door), then async on rank 0 only
    rows = lambda i, j: 0 if i == j == 1 else (j + 1) * (i + 1) * 2000  # noqa: E731
    sends, recvs = [rows(me, j) for j in range(n)], [rows(i, me) for i in range(n)]
    blocks = np.concatenate([np.full(sends[j], 10 * me + j, np.int64) for j in range(n)])
    want = np.concatenate([np.full(recvs[i], 10 * i + me, np.int64) for i in range(n)])
    for call in ("blocking #0", "blocking #1", "async on rank 0"):
        got = np.full(sum(recvs), -1, np.int64)
        work = dist.all_to_all_single(got, blocks, recvs, sends, async_op=call.startswith("async") and me == 0)
        if work is not None:
            work.wait()
        same(f"all_to_all uneven {call}", got, want)

    # one rank asynchronous, the others blocking: the same steps on every rank
    for mode in ("async on rank 0", "async on the others"):
        wait = (me == 0) == (mode == "async on rank 0")
        x = ramp(me, np.float32)
        work = dist.all_reduce(x, async_op=wait)
        if wait:
            work.wait()
        same(f"all_reduce {mode}", x, sum(ramp(r, np.float32) for r in range(n)))
        out = np.zeros(n * K, np.float32)
        out[me * K : (me + 1) * K] = ramp(me, np.float32)
        work = dist.all_gather_into_tensor(out, out[me * K : (me + 1) * K], async_op=wait)
        if wait:
            work.wait()
        same(f"all_gather in place {mode}", out, np.concatenate([ramp(r, np.float32) for r in range(n)]))
        x = ramp(me, np.float32)
        work = dist.reduce(x, dst=n - 1, async_op=wait)
        if wait:
            work.wait()
        same(f"reduce {mode}", x, sum(ramp(r, np.float32) for r in range(n)) if me == n - 1 else ramp(me, np.float32))
        out = np.zeros(K, np.float32)
        work = dist.reduce_scatter_tensor(out, ramp(me, np.float32, n * K), async_op=wait)
        if wait:
            work.wait()
        same(f"reduce_scatter {mode}", out, sum(ramp(r, np.float32, n * K) for r in range(n))[me * K : (me + 1) * K])
        x = ramp(me, np.float32)
        work = dist.broadcast(x, src=n - 1, async_op=wait)
        if wait:
            work.wait()
        same(f"broadcast {mode}", x, ramp(n - 1, np.float32))
        x = np.zeros(K, np.float32)
        work = dist.scatter(x, [ramp(r, np.float32) for r in range(n)] if me == 0 else None, src=0, async_op=wait)
        if wait:
            work.wait()
        same(f"scatter {mode}", x, ramp(me, np.float32))
        blocks, got = np.concatenate([ramp(10 * me + k, np.float32) for k in range(n)]), np.zeros(n * K, np.float32)
        work = dist.all_to_all_single(got, blocks, async_op=wait)
        if wait:
            work.wait()
        same(f"all_to_all {mode}", got, np.concatenate([ramp(10 * k + me, np.float32) for k in range(n)]))
        parts = [np.zeros(K, np.float32) for _ in range(n)] if me == 0 else None
        work = dist.gather(ramp(me, np.float32), parts, dst=0, async_op=wait)
        if wait:
            work.wait()
        if parts is not None:
            same(f"gather {mode}", np.concatenate(parts), np.concatenate([ramp(r, np.float32) for r in range(n)]))

    # a sub-group of the first and last rank
    ends = sorted({0, n - 1})
    sub = dist.new_group(ends)
    if me in ends:
        x = ramp(me, np.int32)
        dist.all_reduce(x, group=sub)
        same("all_reduce on a sub-group", x, sum(ramp(r, np.int32) for r in ends))

    # ranks that disagree on the size: an error naming the call on every rank, well within the timeout
    g = dist.new_group(list(range(n)), timeout=20.0)
    try:
        if not mismatch:
            raise CollectiveMismatchError("disagree on the size in all_reduce: not tried")
        dist.all_reduce(ramp(me, np.float32, K + 3 * me), group=g)
        problems["mismatch"] = "no error"
    except CollectiveMismatchError as e:
        if "all_reduce" not in str(e) or "disagree on the size" not in str(e):
            problems["mismatch"] = str(e)
    except dist.CommTimeoutError as e:
        problems["mismatch"] = f"a timeout, not a size error: {e}"
    dist.barrier()
    dist.destroy_process_group()
    return problems


@pytest.mark.parametrize(
    "n, own", [(2, "1"), (3, "1"), (3, "0")], ids=["2-ranks-own", "3-ranks-own", "3-ranks-mpi-calls"]
)
def test_own_steps_match_every_rank_and_mpi(n: int, own: str) -> None:
    if not _c_runner_built():
        pytest.skip("commlib.backends._ready was not built (no C compiler when commlib was installed)")
    env = {"COMMLIB_MPI_OWN_STEPS": own}
    # MPI's own calls do not check a received size: a mismatch may pass, or time out
    for rank, problems in enumerate(run(own_steps_job, n, own == "1", timeout=180, env=env)):
        assert problems == {}, f"rank {rank}: {problems}"
