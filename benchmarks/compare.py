"""commlib against raw mpi4py, torch.distributed (gloo) and its own nccl backend (CPU emulator), 2 ranks, one run.

    python benchmarks/compare.py                       # 8 B .. 128 MiB, 4 collectives, 1 to 2 minutes
    python benchmarks/compare.py --max-bytes 1M --repeats 3 --collectives all_reduce
    python benchmarks/compare.py --no-torch --no-emulator --png ''
    python benchmarks/compare.py --smoke --png ''       # CI: 8 B and 1 MiB, one round of one call (seconds)

For all_reduce, all_gather, reduce_scatter, broadcast and all_to_all (equal and
uneven splits), each size is run by every method on the same float32 buffers
(torch sees them through torch.from_numpy): mpi4py's Allreduce(IN_PLACE) /
Allgather / Reduce_scatter_block / Bcast / Alltoall / Alltoallv, commlib's
all_reduce / all_gather_into_tensor / reduce_scatter_tensor / broadcast /
all_to_all_single with the mpi backend, and torch.distributed's same calls on
gloo (N/A where gloo lacks the call). Uneven: each rank keeps a third of its
buffer and sends the rest to the other rank. commlib's nccl backend on the NCCL emulator runs
in a second job (COMMLIB_NCCL_EMULATOR=1) on the same sizes. Sizes are
nccl-tests': the whole buffer (all_gather: the output; reduce_scatter: the input).

Each cell is the median over ``--repeats`` rounds of the per-call time of the
slower rank; a round is enough back-to-back calls for about 5 ms, and the
methods take turns round by round, so bursts of noise on a shared machine hit
them alike. It prints the table and the ratios and draws busbw (nccl-tests'
bus bandwidth) against size in a PNG when matplotlib is installed. This is a
benchmark, not a test: it never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "all_to_all_uneven")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}  # others: (n-1)/n
METHODS = ("mpi4py", "commlib", "gloo", "nccl-emu")
RATIOS = (("commlib", "mpi4py"), ("gloo", "commlib"), ("nccl-emu", "commlib"))
REPORT_AT = (8, 1 << 20, 64 << 20)
NRANKS = 2
ROUND_SECONDS = 0.005


def _bytes(text: str) -> int:
    """A size: 8, 64K, 1M, 1G (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else int(text)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=_bytes, default=8, help="smallest size (8); sizes double up to --max-bytes")
    p.add_argument("--max-bytes", type=_bytes, default=128 << 20, help="largest size, e.g. 1M (128M)")
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--repeats", type=int, default=21, help="rounds per method and size; the median is reported")
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed (gloo)")
    p.add_argument("--no-emulator", action="store_true", help="skip commlib's nccl backend on the emulator")
    p.add_argument("--png", default="compare.png", help="busbw plot ('' for none; needs matplotlib)")
    p.add_argument("--json", help="also write every cell to this file")
    p.add_argument("--child", choices=("host", "emulator"), help=argparse.SUPPRESS)  # one rank of a job
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--progress", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: 8 B and 1 MiB only, 2 warm-up calls, one round of one call "
        "per method and size (replaces --min-bytes, --max-bytes and --repeats); the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.min_bytes, args.max_bytes, args.repeats = 8, 1 << 20, 1
    return args


def _sizes(args: argparse.Namespace) -> list[int]:
    """Doubling from --min-bytes to --max-bytes (--smoke: the two ends only)."""
    if args.smoke:
        return [args.min_bytes, args.max_bytes]
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


# ----- inside a rank -----


def _buffers(name: str, nbytes: int, np: Any) -> tuple[Any, Any]:
    """(input, output) float32 arrays for nccl-tests' size ``nbytes`` (one array where in place)."""
    count = max(nbytes // 4, NRANKS) // NRANKS * NRANKS  # whole pieces per rank, as every method needs

    def zeros(n: int) -> Any:
        # Written, not calloc'ed: untouched zero pages would make the first reads artificially cheap.
        # Zeros also keep repeated in-place sums finite (ones would overflow to inf after ~128 calls).
        a = np.empty(n, np.float32)
        a.fill(0.0)
        return a

    if name == "all_gather":
        return zeros(count // NRANKS), zeros(count)
    if name == "reduce_scatter":
        return zeros(count), zeros(count // NRANKS)
    if name.startswith("all_to_all"):
        return zeros(count), zeros(count)
    x = zeros(count)
    return x, x


def _calls(name: str, inp: Any, out: Any, comm: Any, MPI: Any, dist: Any, tdist: Any, torch: Any) -> dict:
    """Each method's call on these buffers, as a zero-argument function (None where the method lacks it)."""
    calls: dict[str, Callable[[], Any] | None] = {}
    # uneven all-to-all (2 ranks): keep a third, send the rest; what the other rank sends is the same split
    keep = inp.size // 3
    splits = [keep, inp.size - keep] if dist.get_rank() == 0 else [inp.size - keep, keep]
    spec = (splits, [0, splits[0]])
    if comm is not None:
        calls["mpi4py"] = {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, out, MPI.SUM),
            "all_gather": lambda: comm.Allgather(inp, out),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(inp, out, MPI.SUM),
            "broadcast": lambda: comm.Bcast(out, 0),
            "all_to_all": lambda: comm.Alltoall(inp, out),
            "all_to_all_uneven": lambda: comm.Alltoallv([inp, spec, MPI.FLOAT], [out, spec, MPI.FLOAT]),
        }[name]
    calls["commlib"] = {
        "all_reduce": lambda: dist.all_reduce(out),
        "all_gather": lambda: dist.all_gather_into_tensor(out, inp),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, inp),
        "broadcast": lambda: dist.broadcast(out, 0),
        "all_to_all": lambda: dist.all_to_all_single(out, inp),
        "all_to_all_uneven": lambda: dist.all_to_all_single(out, inp, splits, splits),
    }[name]
    if tdist is not None:
        ti, to = torch.from_numpy(inp), torch.from_numpy(out)
        # torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones.
        gather = getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)
        scatter = getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)
        calls["gloo"] = {
            "all_reduce": lambda: tdist.all_reduce(to),
            "all_gather": lambda: gather(to, ti),
            "reduce_scatter": lambda: scatter(to, ti),
            "broadcast": lambda: tdist.broadcast(to, 0),
            "all_to_all": lambda: tdist.all_to_all_single(to, ti),
            "all_to_all_uneven": lambda: tdist.all_to_all_single(to, ti, splits, splits),
        }[name]
    return calls


def _per_call(fn: Callable[[], Any], iters: int, comm: Any, MPI: Any) -> float:
    """Seconds per call of the slower rank, over ``iters`` back-to-back calls after a barrier."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX)


def _usable(fn: Callable[[], Any], comm: Any) -> bool:
    """Whether every rank can make this call (gloo raises for calls it lacks); the call doubles as warm-up."""
    try:
        fn()
        ok = True
    except (RuntimeError, ValueError, NotImplementedError):
        ok = False
    return all(comm.allgather(ok))


def _calibrate(fn: Callable[[], Any], comm: Any, MPI: Any, round_seconds: float) -> int:
    """Calls per round: about ``round_seconds`` of work (1 to 1000 calls), from batches of growing size.

    A single call is a poor yardstick (a rank descheduled once makes it look slow), so
    calls are timed in batches of 1, 4, 16, ... until a batch takes a quarter round. The
    batches are the size's warm-up too. Every rank sees the same (slowest) times: same answer.
    """
    n = 1
    while True:
        seconds = _per_call(fn, n, comm, MPI) * n
        if seconds >= round_seconds / 4 or n >= 1000:
            return max(1, min(1000, round(round_seconds * n / max(seconds, 1e-9))))
        n *= 4


def _measure(calls: dict, args: argparse.Namespace, comm: Any, MPI: Any) -> dict[str, float | None]:
    """Median per-call microseconds of each method; the methods take turns round by round."""
    usable = {m: fn for m, fn in calls.items() if fn is not None and _usable(fn, comm)}
    round_seconds = 0.0 if args.smoke else ROUND_SECONDS  # 0: one batch of one call, then rounds of one call
    iters = {m: _calibrate(fn, comm, MPI, round_seconds) for m, fn in usable.items()}
    times: dict[str, list[float]] = {m: [] for m in usable}
    order = list(usable)
    for r in range(args.repeats):
        for m in order[r % len(order) :] + order[: r % len(order)]:
            times[m].append(_per_call(usable[m], iters[m], comm, MPI))
    return {m: statistics.median(times[m]) * 1e6 if m in times else None for m in calls}


def _warm_up(name: str, comm: Any, MPI: Any, dist: Any, tdist: Any, torch: Any, np: Any, kind: str, calls: int) -> None:
    """Connection setup and first-call costs, kept out of the first rows: ``calls`` calls of each method."""
    inp, out = _buffers(name, 4096, np)
    for fn in _calls(name, inp, out, comm if kind == "host" else None, MPI, dist, tdist, torch).values():
        if _usable(fn, comm):
            _per_call(fn, calls, comm, MPI)


def _gloo(comm: Any) -> tuple[Any, Any]:
    """torch.distributed on gloo in these same ranks (env:// on 127.0.0.1); (None, None) without torch."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None, None

    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")  # the parent picks a free one
    tdist.init_process_group("gloo", init_method="env://")
    torch.set_num_threads(1)
    return tdist, torch


def child(args: argparse.Namespace) -> None:
    """One rank: measure every collective and size; rank 0 writes the cells to ``--out``."""
    import numpy as np
    from mpi4py import MPI

    import commlib as dist

    comm = MPI.COMM_WORLD
    dist.init_process_group("nccl" if args.child == "emulator" else "mpi")
    tdist, torch = _gloo(comm) if args.child == "host" and not args.no_torch else (None, None)
    cells = []
    for name in args.collectives:
        _warm_up(name, comm, MPI, dist, tdist, torch, np, args.child, 2 if args.smoke else 200)
        for nbytes in _sizes(args):
            inp, out = _buffers(name, nbytes, np)
            calls = _calls(name, inp, out, comm if args.child == "host" else None, MPI, dist, tdist, torch)
            if args.child == "emulator":
                calls = {"nccl-emu": calls["commlib"]}
            for method, us in _measure(calls, args, comm, MPI).items():
                cells.append({"collective": name, "bytes": nbytes, "method": method, "us": us})
            if args.progress and comm.Get_rank() == 0:
                print(f"\r{args.child}: {name} {nbytes} B\x1b[K", end="", file=sys.stderr, flush=True)
    if comm.Get_rank() == 0:
        print("\r\x1b[K" if args.progress else "", end="", file=sys.stderr, flush=True)
        with open(args.out, "w") as f:
            json.dump(cells, f)
    if tdist is not None:
        tdist.destroy_process_group()
    dist.destroy_process_group()


# ----- the parent: two jobs, then the table and the plot -----


def _job(kind: str, argv: list[str], out: str) -> list[dict]:
    """Run one 2-rank job of this script and return its cells."""
    from commlib._sockets import free_port
    from commlib.launch._mpiexec import find_mpiexec

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}  # below the ephemeral range
    env["COMMLIB_NCCL_EMULATOR"] = "1" if kind == "emulator" else "0"
    cmd = [find_mpiexec(), "-n", str(NRANKS), sys.executable, __file__, *argv, "--child", kind, "--out", out]
    cmd += ["--progress"] if sys.stderr.isatty() else []  # the ranks see pipes: the parent decides
    subprocess.run(cmd, env=env, check=True, stdin=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def _table(cells: list[dict]) -> dict[str, dict[int, dict[str, float | None]]]:
    """collective -> bytes -> method -> us."""
    table: dict[str, dict[int, dict[str, float | None]]] = {}
    for c in cells:
        table.setdefault(c["collective"], {}).setdefault(c["bytes"], {})[c["method"]] = c["us"]
    return table


def _ratio(row: dict[str, float | None], a: str, b: str) -> float | None:
    return row[a] / row[b] if row.get(a) and row.get(b) else None


def _human(nbytes: int) -> str:
    """8 B, 64 KiB, 1 MiB: a size as people say it."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "N/A" if x is None else f"{x:{spec}}{suffix}"


def report(table: dict, methods: list[str]) -> None:
    """Print one block per collective: per-call times and the ratios."""
    ratios = [(a, b) for a, b in RATIOS if a in methods and b in methods]
    print("# commlib (mpi backend) vs raw mpi4py vs torch.distributed gloo, and commlib's nccl backend on the")
    print(f"# CPU emulator; {NRANKS} ranks, float32 (SUM), median per-call time of the slower rank (us)")
    for name, rows in table.items():
        print(f"## {name}")
        head = f"{'bytes':>10}" + "".join(f" {m:>10}" for m in methods)
        print(head + "".join(f" {a + '/' + b:>17}" for a, b in ratios))
        for nbytes, row in rows.items():
            line = f"{nbytes:>10}" + "".join(f" {_fmt(row.get(m), '10.2f'):>10}" for m in methods)
            print(line + "".join(f" {_fmt(_ratio(row, a, b), '16.3f', 'x'):>17}" for a, b in ratios))
    print("# ratios at " + ", ".join(_human(b) for b in REPORT_AT) + ":")
    for name, rows in table.items():
        for a, b in ratios:
            at = [_fmt(_ratio(rows[s], a, b), ".3f", "x") if s in rows else "-" for s in REPORT_AT]
            print(f"#   {name:<17} {a + '/' + b:<17} " + "  ".join(f"{v:>8}" for v in at))


def plot(table: dict, methods: list[str], path: str) -> None:
    """busbw against size, one panel per collective, one line per method."""
    try:
        import matplotlib
    except ImportError:
        print(f"# no plot: matplotlib is not installed (pip install matplotlib), so {path} was not written")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(table) + 2) // 3
    fig, axes = plt.subplots(rows, 3, figsize=(15, 3.6 * rows), squeeze=False)
    for ax, (name, rows) in zip(axes.flat, table.items(), strict=False):
        factor = BUS_FACTOR.get(name, lambda n: (n - 1) / n)(NRANKS)
        for m in methods:
            pts = [(b, b / (r[m] * 1e3) * factor) for b, r in rows.items() if r.get(m)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=m)
        ax.set(xscale="log", title=name, xlabel="size (bytes)", ylabel="busbw (GB/s)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{NRANKS} ranks on one machine, float32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# plot: {path}")


def main() -> None:
    """Run the host job and the emulator job, then print the table and draw the plot."""
    args = _parse()
    if args.child:
        return child(args)
    argv = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="commlib-compare-") as tmp:
        cells = _job("host", argv, os.path.join(tmp, "host.json"))
        if not args.no_emulator:
            cells += _job("emulator", argv, os.path.join(tmp, "emulator.json"))
    methods = [m for m in METHODS if any(c["method"] == m for c in cells)]
    if "gloo" not in methods and not args.no_torch:
        print("# no gloo column: torch is not installed (pip install torch)")
    table = _table(cells)
    report(table, methods)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nranks": NRANKS, "cells": cells}, f, indent=1)
    if args.png:
        plot(table, methods, args.png)


if __name__ == "__main__":
    main()
