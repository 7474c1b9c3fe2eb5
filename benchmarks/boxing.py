"""globalview boxing against the raw commlib collective it should cost, 2 ranks, one run.

    python benchmarks/boxing.py                 # starts its own 2 ranks under mpiexec
    python benchmarks/boxing.py --mib 16 --repeats 5
    python benchmarks/boxing.py --smoke         # CI: 1 MiB, one round (seconds)

Each row converts one global float32 tensor of ``--mib`` MiB and times the same
bytes through the bare collective: S(0) -> B against ``all_gather_into_tensor``;
P -> B against a copy plus ``all_reduce`` (boxing never writes its input);
S(0) -> S(1) against a bare ``all_to_all_single`` (which does not re-arrange the
columns, so boxing does strictly more work there); P -> S(0) against
``reduce_scatter_tensor``; S(2) -> B of a (16, rows / 16, 1024) tensor (a tensor-parallel layer's
output) against ``all_gather_into_tensor`` of the same bytes (which leaves the pieces one after the
other: boxing also puts them side by side). Raw buffers are allocated once, outside the timing;
boxing allocates its results (from globalview's buffer pool). Methods alternate
round by round; the table shows the median round (slower rank) and boxing/raw.
A benchmark, not a test: it never fails on a number. Target: S(0) -> B <= 1.1x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="logical tensor size in MiB")
    p.add_argument("--repeats", type=int, default=31, help="rounds per method (median reported)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: --mib 1 --repeats 1; the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.mib, args.repeats = 1, 1
    return args


def _time(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        raise SystemExit(subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env))

    import commlib
    import globalview as gv

    S = gv.sbp
    n, me = commlib.get_world_size(), commlib.get_rank()
    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", list(range(n)))
    rows = args.mib * (1 << 20) // (4 * 1024)
    shape = (rows, 1024)
    x = gv.randn(*shape, placement=pl, sbp=S.split(0), seed=1)
    part = x.to_local()
    partial = x.to_global(sbp=S.partial_sum)  # a genuine partial would cost the same to reduce
    whole = np.empty(shape, np.float32)
    columns = gv.randn(16, rows // 16, 1024, placement=pl, sbp=S.split(2), seed=2)  # the same bytes, in 3-D
    scratch = np.empty(shape, np.float32)  # raw all_reduce works on a copy too: P -> B never writes its input
    cases = [
        ("S(0) -> B", lambda: x.to_global(sbp=S.broadcast), lambda: commlib.all_gather_into_tensor(whole, part)),
        (
            "P -> B",
            lambda: partial.to_global(sbp=S.broadcast),
            lambda: (np.copyto(scratch, partial.to_local()), commlib.all_reduce(scratch)),
        ),
        (
            "S(0) -> S(1)",
            lambda: x.to_global(sbp=S.split(1)),
            lambda: commlib.all_to_all_single(np.empty_like(part), part),
        ),
        (
            "P -> S(0)",
            lambda: partial.to_global(sbp=S.split(0)),
            lambda: commlib.reduce_scatter_tensor(np.empty_like(part), partial.to_local()),
        ),
        (  # a tensor-parallel layer's output: pieces along the last dimension of (batch, tokens, features)
            "S(2) -> B",
            lambda: columns.to_global(sbp=S.broadcast),
            lambda: commlib.all_gather_into_tensor(whole.reshape(-1), columns.to_local().reshape(-1)),
        ),
    ]
    barrier = commlib.barrier
    out = []
    for name, box, raw in cases:
        box(), raw()  # warm up (groups, page faults)
        times = {"boxing": [], "raw": []}
        for i in range(args.repeats):
            order = [("boxing", box), ("raw", raw)] if i % 2 == 0 else [("raw", raw), ("boxing", box)]
            for key, fn in order:
                t = np.array([_time(fn, barrier)])
                commlib.all_reduce(t, op=commlib.ReduceOp.MAX)
                times[key].append(float(t[0]))
        b, r = statistics.median(times["boxing"]), statistics.median(times["raw"])
        out.append((name, b, r))
    if me == 0:
        print(f"globalview boxing vs raw commlib, {n} ranks, backend {commlib.get_backend()}, {args.mib} MiB float32")
        print(f"{'conversion':<14}{'boxing ms':>12}{'raw ms':>12}{'boxing/raw':>12}")
        for name, b, r in out:
            print(f"{name:<14}{b * 1e3:>12.2f}{r * 1e3:>12.2f}{b / r:>11.3f}x")
        print("target: S(0) -> B <= 1.1x")


if __name__ == "__main__":
    main()
