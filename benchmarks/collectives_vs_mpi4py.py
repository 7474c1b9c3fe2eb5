"""Every commlib collective against the matching raw mpi4py call on the same buffers, 2 ranks, one run.

    python benchmarks/collectives_vs_mpi4py.py                    # 8 B, 1 MiB, 16 MiB; every collective
    python benchmarks/collectives_vs_mpi4py.py --sizes 8 1M --collectives broadcast all_to_all_uneven
    python benchmarks/collectives_vs_mpi4py.py --smoke            # CI: 8 B and 1 MiB, one round of 2 calls

Pairs (commlib call / raw mpi4py call, float32 buffers, in place where commlib is):

    all_reduce              all_reduce(x)                         Allreduce(IN_PLACE, x)
    all_reduce_oop          all_reduce(x)                         Allreduce(x, y): mpi4py's other spelling
    broadcast               broadcast(x, src=0)                   Bcast(x, 0)
    reduce                  reduce(x, dst=0)                      Reduce(IN_PLACE or x, x, root=0)
    all_gather              all_gather_into_tensor(out, x)        Allgather(x, out)
    reduce_scatter          reduce_scatter_tensor(out, x)         Reduce_scatter_block(x, out)
    all_to_all              all_to_all_single(out, x)             Alltoall(x, out)
    all_to_all_uneven       all_to_all_single(out, x, splits)     Alltoallv(x, out) with the same splits
    gather                  gather(x, list, dst=0)                Gather(x, out, 0)
    scatter                 scatter(x, list, src=0)               Scatter(buf, x, 0)
    barrier                 barrier()                             Barrier()
    send_recv               send/recv ping-pong                   Send/Recv ping-pong

Sizes are the whole buffer of nccl-tests (all_gather: the output; reduce_scatter, all_to_all,
scatter: the input). Uneven all-to-all: each rank sends a third of its rows to one rank and
two thirds to the other. barrier moves no data: it runs once, in the row of the smallest size
(its bytes column says "-"). Every size runs both methods in alternating rounds of about 5 ms of
calls (as many calls as mpi4py's make in 5 ms, timed after the warm-up: every rank runs the same
number); a cell is the median over rounds of the slower rank's time per call. A benchmark, not a
test: it prints the table and the ratios and never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

COLLECTIVES = (
    "all_reduce",
    "all_reduce_oop",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_uneven",
    "gather",
    "scatter",
    "barrier",
    "send_recv",
)
TARGETS = (
    "targets: commlib/mpi4py <= 1.3x at 8 B, <= 1.05x at 1 MiB and 16 MiB; all_reduce <= 1.0x of mpi4py's faster "
    "spelling (in place or out of place: the all_reduce_oop row) at 1 MiB and 16 MiB"
)


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else int(text)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=_bytes, default=[8, 1 << 20, 16 << 20])
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    # 41: a 16 MiB row has 5-8 calls a round; over 21 rounds its median moved 5-10% from run to run on a shared
    # machine (every 16 MiB collective missed 1.05x in some run, none in most); over 41 it keeps within ~1%
    p.add_argument("--repeats", type=int, default=41, help="rounds per method and size (median reported)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: 8 B and 1 MiB, one round of 2 calls per method after 2 "
        "warm-up calls (replaces --sizes and --repeats); the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.repeats = [8, 1 << 20], 1
    return args


ROUND_S = 0.005  # seconds per round: short rounds of fast calls (1 MiB in ~25 us) are at the mercy of the machine


def _iters(nbytes: int, smoke: bool) -> int:
    """Calls in a first round: about 5 ms at 2 GB/s, at least 1, at most 1000 (--smoke: 2)."""
    return 2 if smoke else max(1, min(1000, int(ROUND_S * 2e9 / max(nbytes, 64))))


def _calibrated(fn: Callable, iters: int, comm: Any, MPI: Any) -> int:
    """Calls per round that take about :data:`ROUND_S` (timed on ``fn``; every rank takes the same number)."""
    per_call = comm.allreduce(_round(fn, iters, comm), op=MPI.MAX)
    return max(1, min(20000, round(ROUND_S / max(per_call, 1e-9))))


def _pair(name: str, nbytes: int, comm: Any, MPI: Any, dist: Any, np: Any) -> tuple[Callable, Callable]:
    """(commlib call, mpi4py call) for collective ``name`` on buffers of ``nbytes`` (float32)."""
    n, me = comm.Get_size(), comm.Get_rank()
    count = max(nbytes // 4, n) // n * n
    x = np.zeros(count, np.float32)
    if name == "all_reduce":
        return lambda: dist.all_reduce(x), lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM)
    if name == "all_reduce_oop":  # the same commlib call against mpi4py's out-of-place spelling
        y = np.zeros_like(x)
        return lambda: dist.all_reduce(x), lambda: comm.Allreduce(x, y, MPI.SUM)
    if name == "broadcast":
        return lambda: dist.broadcast(x, src=0), lambda: comm.Bcast(x, 0)
    if name == "reduce":
        send = MPI.IN_PLACE if me == 0 else x
        return lambda: dist.reduce(x, dst=0), lambda: comm.Reduce(send, x if me == 0 else None, MPI.SUM, 0)
    if name == "all_gather":
        part = np.zeros(count // n, np.float32)
        return lambda: dist.all_gather_into_tensor(x, part), lambda: comm.Allgather(part, x)
    if name == "reduce_scatter":
        part = np.zeros(count // n, np.float32)
        return lambda: dist.reduce_scatter_tensor(part, x), lambda: comm.Reduce_scatter_block(x, part, MPI.SUM)
    if name in ("all_to_all", "all_to_all_uneven"):
        return _all_to_all(name == "all_to_all_uneven", x, comm, MPI, dist, np)
    if name in ("gather", "scatter"):
        return _rooted(name, x, comm, dist, np)
    if name == "barrier":
        return dist.barrier, comm.Barrier
    return _ping_pong(x, comm, dist)


def _all_to_all(uneven: bool, x: Any, comm: Any, MPI: Any, dist: Any, np: Any) -> tuple[Callable, Callable]:
    n, me, count = comm.Get_size(), comm.Get_rank(), x.size
    out = np.zeros(count, np.float32)
    if not uneven:
        return lambda: dist.all_to_all_single(out, x), lambda: comm.Alltoall(x, out)
    # rank r sends a third (rounded) to rank r, the rest spread over the others; what p sends r, r receives
    third = count // 3

    def sends(r: int) -> list[int]:
        rest = count - third
        split = [rest // (n - 1) + (1 if q < rest % (n - 1) else 0) for q in range(n - 1)] if n > 1 else []
        return [third if p == r else split.pop(0) for p in range(n)] if n > 1 else [count]

    scounts, rcounts = sends(me), [sends(p)[me] for p in range(n)]
    sdis, rdis = np.cumsum([0, *scounts[:-1]]).tolist(), np.cumsum([0, *rcounts[:-1]]).tolist()
    out = np.zeros(sum(rcounts), np.float32)
    spec_s, spec_r = [x, (scounts, sdis), MPI.FLOAT], [out, (rcounts, rdis), MPI.FLOAT]
    return lambda: dist.all_to_all_single(out, x, rcounts, scounts), lambda: comm.Alltoallv(spec_s, spec_r)


def _rooted(name: str, x: Any, comm: Any, dist: Any, np: Any) -> tuple[Callable, Callable]:
    n, me = comm.Get_size(), comm.Get_rank()
    part = np.zeros(x.size // n, np.float32)
    parts = [x[i * part.size : (i + 1) * part.size] for i in range(n)] if me == 0 else None
    if name == "gather":
        return lambda: dist.gather(part, parts, dst=0), lambda: comm.Gather(part, x if me == 0 else None, 0)
    return lambda: dist.scatter(part, parts, src=0), lambda: comm.Scatter(x if me == 0 else None, part, 0)


def _ping_pong(x: Any, comm: Any, dist: Any) -> tuple[Callable, Callable]:
    me = comm.Get_rank()
    peer = 1 - me

    def ours() -> None:
        if me == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)

    def theirs() -> None:
        if me == 0:
            comm.Send(x, peer)
            comm.Recv(x, peer)
        else:
            comm.Recv(x, peer)
            comm.Send(x, peer)

    return ours, theirs


def _round(fn: Callable, iters: int, comm: Any) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _measure(name: str, nbytes: int, args: argparse.Namespace, comm: Any, MPI: Any, dist: Any, np: Any) -> dict:
    ours, theirs = _pair(name, nbytes, comm, MPI, dist, np)
    iters = _iters(nbytes, args.smoke)
    for fn in (ours, theirs):  # warm up: first calls pay for connections, page faults, persistent setup
        _round(fn, max(2, iters // 5), comm)
    if not args.smoke:  # rounds of about 5 ms of the raw call, whatever the machine's speed
        iters = _calibrated(theirs, iters, comm, MPI)
    times: dict[str, list[float]] = {"commlib": [], "mpi4py": []}
    rounds = args.repeats if iters > 1 else 2 * args.repeats
    for r in range(rounds):
        order = [("commlib", ours), ("mpi4py", theirs)]
        for label, fn in order[r % 2 :] + order[: r % 2]:
            times[label].append(comm.allreduce(_round(fn, iters, comm), op=MPI.MAX))
    us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {"collective": name, "bytes": nbytes, **{f"{k}_us": v for k, v in us.items()}}


def main() -> None:
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        raise SystemExit(subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env))
    import numpy as np
    from mpi4py import MPI

    import commlib as dist

    comm = MPI.COMM_WORLD
    dist.init_process_group("mpi")
    rows = []
    if comm.Get_rank() == 0:
        print("# commlib vs raw mpi4py, 2 ranks, float32, median per-call time of the slower rank (us)")
        print(f"{'collective':>20} {'bytes':>10} {'mpi4py':>10} {'commlib':>10} {'ratio':>8}")
    for name in args.collectives:
        for nbytes in sorted(args.sizes)[:1] if name == "barrier" else args.sizes:  # a barrier has no size
            row = _measure(name, nbytes, args, comm, MPI, dist, np)
            rows.append(row)
            if comm.Get_rank() == 0:
                ratio = row["commlib_us"] / row["mpi4py_us"]
                size = "-" if name == "barrier" else nbytes
                print(
                    f"{name:>20} {size:>10} {row['mpi4py_us']:>10.2f} {row['commlib_us']:>10.2f} {ratio:>7.3f}x",
                    flush=True,
                )
    if comm.Get_rank() == 0:
        print(f"# {TARGETS}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "mpi": MPI.Get_library_version().splitlines()[0]}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
