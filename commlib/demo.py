"""The demo job: run every collective once on every rank and print what each rank got.

Start it with ``python -m commlib.launch --nproc_per_node 2 -m commlib.demo``
(or ``mpiexec -n 2 python -m commlib.demo``). Rank 0 prints one line per
collective with every rank's result and whether it matches numpy's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import commlib as dist


def _steps(n: int, me: int) -> list[tuple[str, object, object]]:
    """(call, this rank's result, the expected result) for every collective."""
    out: list[tuple[str, object, object]] = []
    base = np.arange(3, dtype=np.float32) + me
    x = base.copy()
    dist.all_reduce(x)
    out.append(("all_reduce(SUM)", x, sum(np.arange(3, dtype=np.float32) + r for r in range(n))))
    x = np.array([me + 1.0])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    out.append(("all_reduce(MAX)", x, np.array([float(n)])))
    x = np.array([me], np.int64)
    dist.broadcast(x, src=n - 1)
    out.append((f"broadcast(src={n - 1})", x, np.array([n - 1])))
    x = np.array([me + 1], np.int64)
    dist.reduce(x, dst=0)
    out.append(("reduce(dst=0)", x, np.array([n * (n + 1) // 2 if me == 0 else me + 1])))
    whole = np.zeros(n, np.int32)
    dist.all_gather_into_tensor(whole, np.array([me * 10], np.int32))
    out.append(("all_gather_into_tensor", whole, np.arange(n, dtype=np.int32) * 10))
    parts = [np.zeros(1, np.int32) for _ in range(n)]
    dist.all_gather(parts, np.array([me], np.int32))
    out.append(("all_gather", np.concatenate(parts), np.arange(n, dtype=np.int32)))
    chunk = np.zeros(1, np.float64)
    dist.reduce_scatter_tensor(chunk, np.arange(n, dtype=np.float64))
    out.append(("reduce_scatter_tensor", chunk, np.array([float(me * n)])))
    recv = np.zeros(n, np.int64)
    dist.all_to_all_single(recv, np.arange(n, dtype=np.int64) + 100 * me)
    out.append(("all_to_all_single", recv, np.arange(n, dtype=np.int64) * 100 + me))
    gathered = [np.zeros(1, np.int64) for _ in range(n)] if me == 0 else None
    dist.gather(np.array([me * me], np.int64), gathered, dst=0)
    out.append(
        (
            "gather(dst=0)",
            np.concatenate(gathered) if gathered is not None else None,
            np.arange(n, dtype=np.int64) ** 2 if me == 0 else None,
        )
    )
    got = np.zeros(1, np.int64)
    dist.scatter(got, [np.array([10 * r], np.int64) for r in range(n)] if me == 0 else None, src=0)
    out.append(("scatter(src=0)", got, np.array([10 * me])))
    buf = np.zeros(1, np.int64)
    ops = (
        [dist.P2POp(dist.isend, np.array([me], np.int64), (me + 1) % n), dist.P2POp(dist.irecv, buf, (me - 1) % n)]
        if n > 1
        else []
    )
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    out.append(("send/recv ring", buf, np.array([(me - 1) % n if n > 1 else 0])))
    objs: list[object] = [None] * n
    dist.all_gather_object(objs, {"rank": me})
    out.append(("all_gather_object", objs, [{"rank": r} for r in range(n)]))
    works = [w for w in (dist.all_reduce(np.ones(2), async_op=True) for _ in range(3)) if w is not None]
    works[-1].wait()
    out.append(("3 x all_reduce(async_op=True)", [w.is_completed() for w in works], [True, True, True]))
    dist.barrier()
    out.append(("barrier", "passed", "passed"))
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def _show(v: object) -> str:
    return np.array2string(v, separator=",") if isinstance(v, np.ndarray) else repr(v)


def main() -> int:
    """Run the demo on this rank; rank 0 prints the table. Returns the process exit code."""
    n, me = dist.get_world_size(), dist.get_rank()
    steps = _steps(n, me)
    rows: list[Any] = [None] * n
    dist.all_gather_object(rows, [(call, _show(got), _equal(got, want)) for call, got, want in steps])
    bad = sum(not rows[r][i][2] for r in range(n) for i in range(len(steps)))
    if me == 0:
        print(f"commlib demo: {n} ranks, backend {dist.get_backend()}, {dist.env.get_node_size()} node(s)")
        for i, (call, *_) in enumerate(rows[0]):
            results = "  ".join(f"rank {r}: {rows[r][i][1]}" for r in range(n) if rows[r][i][1] != "None")
            ok = all(rows[r][i][2] for r in range(n))
            print(f"{'ok ' if ok else 'BAD'} {call:30s} {results}")
        print(f"{len(steps)} collectives on {n} ranks: " + ("all results correct" if not bad else f"{bad} WRONG"))
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
