"""Training-step time: commlib DDP vs torch DDP (gloo) vs one process, 2 ranks, ~25M-parameter MLP.

    python benchmarks/ddp_step.py                 # starts its own 2 ranks under mpiexec
    python benchmarks/ddp_step.py --batch 64 --repeats 7 --gradient-as-bucket-view
    python benchmarks/ddp_step.py --smoke         # CI: a tiny MLP, one round of one step (seconds)

Every rank trains three copies of the same MLP (1024 -> 4096 -> 4096 -> 1024, 25.2M float32
parameters, 96 MiB of gradients) on the same per-rank batch: wrapped in ``ddp.DistributedDataParallel``
(commlib, mpi backend), wrapped in ``torch.nn.parallel.DistributedDataParallel`` (gloo, initialised
in the same processes with env:// on 127.0.0.1), and bare (no communication: the compute floor).
A step is forward, MSE loss, backward, SGD step. "single + all_reduce" is the bound on a
machine with no core to spare (2 ranks on 2 cores): the bare step, then one commlib all-reduce of
a 96 MiB buffer, one after the other (both need the same cores, so they cannot overlap). Methods
run in rotating order, ``repeats`` rounds of ``steps`` steps each; the table shows the median
round's time per step of the slower rank.
This is a benchmark, not a test: it prints numbers and never fails on them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

TARGET = "target: commlib DDP / torch DDP <= 0.8"
SIZES = (1024, 4096, 4096, 1024)
SMOKE_SIZES = (16, 32, 32, 16)  # --smoke: the same layers, 2,128 parameters


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=2, help="steps per round")
    p.add_argument("--repeats", type=int, default=15, help="rounds per method (median reported)")
    p.add_argument("--gradient-as-bucket-view", action="store_true", help="for both DDPs")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"CI's check that the script still runs: MLP {'-'.join(map(str, SMOKE_SIZES))}, --batch 2 --steps 1 "
        "--repeats 1, a breakdown of one step; the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.batch, args.steps, args.repeats = 2, 1, 1
    args.sizes = SMOKE_SIZES if args.smoke else SIZES
    return args


def _mlp(torch: Any, sizes: tuple[int, ...] = SIZES) -> Any:
    """The benchmark's model (``torch`` is passed in: it is imported only inside the ranks)."""
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _stepper(torch: Any, model: Any, x: Any, y: Any) -> Callable[[], None]:
    """One training step of ``model`` on (x, y): forward, MSE loss, backward, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        """Forward, loss, backward, optimizer step."""
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    """Start the ranks (when run directly), then time the three methods and print the table."""
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        # torch's rendezvous: a MASTER_ADDR/MASTER_PORT already set wins (two runs at once, a test's free port)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", **os.environ, "OMP_NUM_THREADS": "1"}
        raise SystemExit(subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env))

    import torch
    import torch.distributed as tdist

    import commlib
    import ddp

    torch.set_num_threads(1)
    commlib.init_process_group("mpi")
    rank, world = commlib.get_rank(), commlib.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    tdist.init_process_group("gloo", init_method="env://")
    g = torch.Generator().manual_seed(rank)
    sizes = args.sizes
    x, y = torch.randn(args.batch, sizes[0], generator=g), torch.randn(args.batch, sizes[-1], generator=g)
    view = args.gradient_as_bucket_view
    single = _stepper(torch, _mlp(torch, sizes), x, y)
    params = sum(p.numel() for p in _mlp(torch, sizes).parameters())
    grads = torch.zeros(params)

    def bound() -> None:
        """The 2-core bound: a step without communication, then all-reduce every gradient once, not overlapped."""
        single()
        commlib.all_reduce(grads)

    methods = {
        "single process": single,
        "single + all_reduce": bound,
        "commlib DDP": _stepper(
            torch, ddp.DistributedDataParallel(_mlp(torch, sizes), gradient_as_bucket_view=view), x, y
        ),
        "torch DDP (gloo)": _stepper(
            torch, torch.nn.parallel.DistributedDataParallel(_mlp(torch, sizes), gradient_as_bucket_view=view), x, y
        ),
    }
    times = _measure(methods, args, commlib)
    parts = _breakdown(torch, ddp, commlib, x, y, view, sizes, steps=1 if args.smoke else 6)
    if rank == 0:
        _report(times, args, params)
        print(parts)
    tdist.destroy_process_group()
    commlib.destroy_process_group()


def _measure(methods: dict, args: argparse.Namespace, commlib: Any) -> dict[str, list[float]]:
    """Per-step seconds of each round (the slower rank's), methods in rotating order."""
    import numpy as np

    for step in methods.values():  # warm-up: first calls allocate, build buckets, connect
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            commlib.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                methods[name]()
            slowest = np.array([(time.perf_counter() - start) / args.steps])
            commlib.all_reduce(slowest, op=commlib.ReduceOp.MAX)
            times[name].append(float(slowest[0]))
    return times


def _breakdown(torch: Any, ddp: Any, commlib: Any, x: Any, y: Any, view: bool, sizes: tuple, steps: int) -> str:
    """Where commlib DDP's step goes (this rank, mean over ``steps``), from timers and the DDP's trace."""
    import tempfile

    from commlib.buckets.trace import COMM

    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        model = ddp.DistributedDataParallel(_mlp(torch, sizes), gradient_as_bucket_view=view, trace=trace)
        tracer = model._tracer  # its file: trace.rank<r>.json
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        timed = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for i in range(steps + 2):  # the first two are warm-up (allocation, the bucket rebuild)
            commlib.barrier()
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            t1 = time.perf_counter()
            optimizer.zero_grad()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            if i == 1:
                tracer.flush()
                skip = len(json.loads(tracer.path.read_text()))
            elif i > 1:
                for name, dt in zip(timed, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    timed[name] += dt / steps
        tracer.close()
        events = json.loads(tracer.path.read_text())[skip:]
    span = {name: sum(e["dur"] for e in events if e["name"] == name) / steps / 1e3 for name in ("backward", "finalize")}
    comm = [e for e in events if e["tid"] == COMM]
    in_flight = sum(e["dur"] for e in comm) / steps / 1e3
    backward = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "backward"]
    overlap = (
        sum(max(0.0, min(c["ts"] + c["dur"], b1) - max(c["ts"], b0)) for c in comm for b0, b1 in backward) / steps / 1e3
    )
    ms = {k: v * 1e3 for k, v in timed.items()}
    return (
        f"# commlib DDP breakdown (rank {commlib.get_rank()}, mean of {steps} steps, ms): forward {ms['forward']:.1f}, "
        f"backward {ms['backward']:.1f} (gradients and their hooks {span['backward']:.1f}, then finalize "
        f"{span['finalize']:.1f}: waiting for the last all-reduces, writing .grad), optimizer {ms['optimizer']:.1f}; "
        f"{len(comm) // steps} all-reduces per step in flight {in_flight:.1f} ms, {overlap:.1f} of them during backward"
    )


def _report(times: dict[str, list[float]], args: argparse.Namespace, params: int) -> None:
    median = {name: statistics.median(v) for name, v in times.items()}
    base, torch_ddp = median["single process"], median["torch DDP (gloo)"]
    count = f"{params / 1e6:.1f}M" if params >= 100_000 else f"{params:,}"
    print(f"# DDP training step, 2 ranks, MLP {' -> '.join(map(str, args.sizes))} ({count} float32 parameters)")
    print(f"# batch {args.batch} per rank, {args.repeats} rounds of {args.steps} steps, median per-step time")
    print(f"# of the slower rank; gradient_as_bucket_view={args.gradient_as_bucket_view}")
    print(f"{'method':<18} {'ms/step':>9} {'min':>9} {'vs single':>10} {'vs torch DDP':>13}")
    for name, value in median.items():
        low = min(times[name]) * 1e3
        print(f"{name:<18} {value * 1e3:>9.1f} {low:>9.1f} {value / base:>9.3f}x {value / torch_ddp:>12.3f}x")
    print(f"# {TARGET}: commlib DDP / torch DDP = {median['commlib DDP'] / torch_ddp:.3f}x")
    print(
        f"# bound (single + all_reduce) / torch DDP = {median['single + all_reduce'] / torch_ddp:.3f}x; "
        f"commlib DDP / bound = {median['commlib DDP'] / median['single + all_reduce']:.3f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": median, "rounds_s": times, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
