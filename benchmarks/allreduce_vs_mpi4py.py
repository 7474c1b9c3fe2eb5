"""commlib all_reduce against raw mpi4py Allreduce and torch.distributed (gloo), 2 ranks, one run.

    python benchmarks/allreduce_vs_mpi4py.py            # starts its own 2 ranks under mpiexec
    python benchmarks/allreduce_vs_mpi4py.py --max-bytes 1048576 --repeats 3
    python benchmarks/allreduce_vs_mpi4py.py --smoke    # CI: 8 B and 1 MiB, one round of 2 calls (seconds)

All three reduce the same float32 buffer in place (torch sees it through
torch.from_numpy). For each size every method runs ``repeats`` rounds of
``iters`` calls, in rotating order; the table shows the median round's time per
call (the slower of the two ranks) and the ratios. This is a benchmark, not a
test: it prints numbers and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TARGETS = "targets: commlib/mpi4py <= 1.6x at 8 B and <= 1.05x at >= 1 MiB; gloo/commlib >= 20x at 8 B"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--repeats", type=int, default=21, help="rounds per method and size (median reported)")
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed (gloo)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: 8 B and 1 MiB only, one round of 2 calls per method, "
        "2 warm-up calls (replaces --min-bytes, --max-bytes and --repeats); the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.min_bytes, args.max_bytes, args.repeats = 8, 1 << 20, 1
    return args


def _sizes(args: argparse.Namespace) -> list[int]:
    """The sizes of the table: doubling from --min-bytes to --max-bytes (--smoke: the two ends only)."""
    if args.smoke:
        return [args.min_bytes, args.max_bytes]
    sizes, nbytes = [], args.min_bytes
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= 2
    return sizes


def _iters(nbytes: int, smoke: bool) -> int:
    """Calls per round: about 5 ms of work at 2 GB/s, at least 1, at most 1000 (--smoke: 2).

    Short rounds, many of them, in rotating order: on a shared machine noise comes
    in bursts, and the median of many short interleaved rounds shrugs them off.
    """
    return 2 if smoke else max(1, min(1000, int(0.005 * 2e9 / max(nbytes, 64))))


def _round(fn, iters: int, barrier) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main() -> None:
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        # torch's rendezvous: a MASTER_ADDR/MASTER_PORT already set wins (two runs at once, a test's free port)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", **os.environ, "OMP_NUM_THREADS": "1"}
        code = subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env)
        raise SystemExit(code)

    import numpy as np
    from mpi4py import MPI

    import commlib as dist

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    dist.init_process_group("mpi")
    methods = {}
    buf = np.zeros(args.max_bytes // 4, np.float32)
    use_torch = not args.no_torch
    if use_torch:
        import torch
        import torch.distributed as tdist

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(comm.Get_size()))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        tdist.init_process_group("gloo")
        torch.set_num_threads(1)
    _warm_up(comm, dist, tdist if use_torch else None, torch if use_torch else None, 2 if args.smoke else 2000)
    rows = []
    for nbytes in _sizes(args):
        x = buf[: nbytes // 4]
        methods = {
            "mpi4py": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
            "commlib": lambda x=x: dist.all_reduce(x),
        }
        if use_torch:
            t = torch.from_numpy(x)
            methods["gloo"] = lambda t=t: tdist.all_reduce(t)
        iters = _iters(nbytes, args.smoke)
        times = {name: [] for name in methods}
        for fn in methods.values():  # warm-up
            _round(fn, max(1, iters // 10), comm.Barrier)
        # Large sizes: one call per round, so the methods alternate call by call, and more rounds.
        repeats = args.repeats if iters > 1 else 2 * args.repeats
        for r in range(repeats):
            names = list(methods)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                local = _round(methods[name], iters, comm.Barrier)
                times[name].append(comm.allreduce(local, op=MPI.MAX))
        row = {"bytes": nbytes, **{f"{k}_us": statistics.median(v) * 1e6 for k, v in times.items()}}
        row.update({f"{k}_min_us": min(v) * 1e6 for k, v in times.items()})
        rows.append(row)
        if rank == 0:
            _print_row(row, first=len(rows) == 1)
    if rank == 0:
        _summary(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "mpi": MPI.Get_library_version().splitlines()[0]}, f, indent=1)
    if use_torch:
        tdist.destroy_process_group()
    dist.destroy_process_group()


def _warm_up(comm, dist, tdist, torch, calls: int) -> None:
    """First calls pay for connection setup and page faults: keep them out of the first row (gloo: calls / 10)."""
    import numpy as np

    x = np.zeros(1024, np.float32)
    for _ in range(calls):
        comm.Allreduce(MPI_IN_PLACE(), x)
        dist.all_reduce(x)
    if tdist is not None:
        t = torch.from_numpy(x)
        for _ in range(max(1, calls // 10)):
            tdist.all_reduce(t)
    comm.Barrier()


def MPI_IN_PLACE():
    from mpi4py import MPI

    return MPI.IN_PLACE


def _print_row(row: dict, first: bool) -> None:
    gloo = "gloo_us" in row
    if first:
        print("# commlib all_reduce vs raw mpi4py Allreduce" + (" vs torch.distributed gloo" if gloo else ""))
        print("# 2 ranks, float32 SUM in place, median per-call time of the slower rank (us)")
        head = f"{'bytes':>10} {'mpi4py':>10} {'commlib':>10}" + (f" {'gloo':>10}" if gloo else "")
        print(head + f" {'commlib/mpi4py':>15}" + (f" {'gloo/commlib':>13}" if gloo else ""))
    line = f"{row['bytes']:>10} {row['mpi4py_us']:>10.2f} {row['commlib_us']:>10.2f}"
    if gloo:
        line += f" {row['gloo_us']:>10.2f}"
    line += f" {row['commlib_us'] / row['mpi4py_us']:>14.3f}x"
    if gloo:
        line += f" {row['gloo_us'] / row['commlib_us']:>12.1f}x"
    print(line, flush=True)


def _summary(rows: list[dict]) -> None:
    small = rows[0]
    big = [r for r in rows if r["bytes"] >= 1 << 20]
    print("#", TARGETS)
    print(f"# at {small['bytes']} B: commlib/mpi4py = {small['commlib_us'] / small['mpi4py_us']:.2f}x", end="")
    if "gloo_us" in small:
        print(f", gloo/commlib = {small['gloo_us'] / small['commlib_us']:.1f}x", end="")
    print()
    if big:
        worst = max(r["commlib_us"] / r["mpi4py_us"] for r in big)
        print(f"# at >= 1 MiB: worst commlib/mpi4py = {worst:.3f}x over {len(big)} sizes")


if __name__ == "__main__":
    main()
