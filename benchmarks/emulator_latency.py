"""Per-call latency of the NCCL emulator: commlib's nccl backend on the CPU, 2 ranks, 1,000 calls each.

    python benchmarks/emulator_latency.py                  # starts its own 2 ranks under mpiexec
    python benchmarks/emulator_latency.py --iters 5000 --sizes 8 65536 1048576
    python benchmarks/emulator_latency.py --smoke          # CI: 5 calls per row after 1 warm-up call (seconds)

Sets ``COMMLIB_NCCL_EMULATOR=1`` and puts this checkout first on ``PYTHONPATH``
(so it measures this tree's emulator, whatever is installed). For each
collective and size it times every one of ``iters`` consecutive blocking calls
(all_reduce in place, broadcast from rank 0, all_gather_into_tensor; the size
is each rank's input, float32); a call's time is the slower rank's. It prints
the median, p99 and max per call (us) and how many calls took over 5 ms.
Targets: median <= 100 us at 8 B and no call over 5 ms. This is a benchmark,
not a test: it prints numbers and never fails on them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STALL_NS = 5_000_000  # a call slower than 5 ms counts as a stall


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=1000, help="consecutive calls per collective and size")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 1 << 20], help="bytes per rank's input")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls before each row")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: --iters 5 --warmup 1 --sizes 8 1048576; the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.iters, args.warmup, args.sizes = 5, 1, [8, 1 << 20]
    return args


def _relaunch() -> None:
    """Not started by mpiexec: start 2 ranks of this script on the emulator, with this checkout first."""
    from commlib.launch._mpiexec import find_mpiexec

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "COMMLIB_NCCL_EMULATOR": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    raise SystemExit(subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env))


def _calls(dist, nbytes: int) -> dict:
    """name -> a blocking call of that collective on ``nbytes`` per rank."""
    import numpy as np

    count = max(1, nbytes // 4)
    x = np.zeros(count, np.float32)  # zeros: repeated in-place sums never overflow
    b = np.ones(count, np.float32)
    g_in = np.ones(count, np.float32)
    g_out = np.empty(count * dist.get_world_size(), np.float32)
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(b, src=0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(g_out, g_in),
    }


def _time(fn, iters: int, warmup: int):
    """Nanoseconds of each of ``iters`` consecutive calls, after ``warmup`` untimed ones."""
    import numpy as np

    for _ in range(warmup):
        fn()
    out = np.empty(iters, np.int64)
    clock = time.perf_counter_ns
    for i in range(iters):
        start = clock()
        fn()
        out[i] = clock() - start
    return out


def _row(name: str, nbytes: int, per_rank: list) -> str:
    import numpy as np

    ns = np.max(np.stack(per_rank), axis=0)  # each call as long as its slower rank
    us = ns / 1e3
    median, p99, worst = np.median(us), np.percentile(us, 99), us.max()
    stalls = int((ns > STALL_NS).sum())
    return f"{name:<24} {nbytes:>9} {median:>10.1f} {p99:>10.1f} {worst:>10.1f} {stalls:>8}"


def main() -> None:
    args = _parse()
    if "PMI_RANK" not in os.environ:
        _relaunch()
    import commlib as dist

    dist.init_process_group("nccl")
    if dist.get_rank() == 0:
        print(f"# NCCL emulator latency, {dist.get_world_size()} ranks, {args.iters} consecutive calls per row")
        print("# per call: the slower rank's time; bytes: each rank's input (float32)")
        print(f"{'collective':<24} {'bytes':>9} {'median_us':>10} {'p99_us':>10} {'max_us':>10} {'>5ms':>8}")
    for nbytes in args.sizes:
        for name, fn in _calls(dist, nbytes).items():
            dist.barrier()
            mine = _time(fn, args.iters, args.warmup)
            everyone = _gather(dist, mine)
            if dist.get_rank() == 0:
                print(_row(name, nbytes, everyone), flush=True)
    dist.destroy_process_group()


def _gather(dist, mine) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


if __name__ == "__main__":
    main()
