"""Training-step time: globalview data, tensor and fully sharded parallel vs commlib DDP and torch FSDP2, 2 ranks.

    python benchmarks/gv_train.py                 # starts its own 2 ranks under mpiexec
    python benchmarks/gv_train.py --batch 64 --repeats 9
    python benchmarks/gv_train.py --fsdp-batch 32 --fsdp-batch 2560   # fully sharded rows at these batches
    python benchmarks/gv_train.py --fsdp-only     # only the fully sharded rows
    python benchmarks/gv_train.py --smoke         # tiny sizes, one round (seconds)

The MLP of benchmarks/ddp_step.py (1024 -> 4096 -> 4096 -> 1024, 25.2M float32 parameters), the
same per-rank batch, trained four ways in the same processes: bare (no communication: the
compute floor), ``ddp.DistributedDataParallel``, globalview data parallel (every weight
broadcast, the batch split(0): the gradients are summed in buckets during backward, the same
reducer ddp uses), and globalview tensor parallel (column-parallel first and last layers,
row-parallel middle one; the batch broadcast). A step is forward, MSE loss, backward, SGD step.
Methods run in rotating order, ``repeats`` rounds of ``steps`` steps; the table shows the
median round's per-step time of the slower rank. A benchmark, not a test: it never fails on times.

Fully sharded (every parameter ``split(0)``: each rank holds half of the weights) is timed against
torch's FSDP2 (``fully_shard`` on each Linear and the root) on torch.distributed backend "commlib",
in the same processes, at each ``--fsdp-batch``, next to the floor: the whole model trained on the rank's batch
with no communication at all. At a small batch globalview moves the activations (each rank computes its half
of the weights on every rank's samples: less work than the floor's, with a small batch); at a large one the
weights, as ``globalview.explain`` prices them (then both compute every layer on the rank's own samples: the
floor is what neither can beat), with FSDP2's schedule
(``globalview._weights``): each Linear's gather prefetched while the one before computes, the gathered
weight freed after use and gathered again (prefetched) in backward, the gradients reduce-scattered in
buckets as backward makes them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET = "target: globalview data parallel / ddp <= 1.05"
FSDP_TARGET = "targets: globalview fully sharded / torch FSDP2 <= 0.85 at batch 2560, <= 0.3 at batch 32"
SIZES = (1024, 4096, 4096, 1024)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's commlib and globalview, not an installed copy


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=2, help="steps per round")
    p.add_argument("--repeats", type=int, default=11, help="rounds per method (median reported)")
    p.add_argument(
        "--fsdp-batch",
        type=int,
        action="append",
        default=None,
        help="samples per rank for the fully sharded rows (repeatable; default 32 and 2560)",
    )
    p.add_argument("--fsdp-repeats", type=int, default=5, help="rounds per fully sharded method (one step each)")
    p.add_argument("--fsdp-only", action="store_true", help="only the fully sharded rows")
    p.add_argument("--smoke", action="store_true", help="a tiny MLP, one round of one step (seconds)")
    args = p.parse_args()
    args.fsdp_batch = [32, 2560] if args.fsdp_batch is None else [b for b in args.fsdp_batch if b > 0]
    if args.smoke:
        global SIZES
        SIZES = (16, 64, 64, 16)
        args.batch, args.steps, args.repeats, args.fsdp_batch, args.fsdp_repeats = 4, 1, 1, [4, 64], 1
    return args


def _mlp(torch: Any) -> Any:
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _stepper(torch: Any, model: Any, x: Any, y: Any) -> Callable[[], None]:
    """One training step: forward, MSE loss, backward, SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        """Forward, loss, backward, optimizer step."""
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def _methods(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    import torch

    import commlib
    import ddp
    import globalview as gv

    rank, world = commlib.get_rank(), commlib.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, SIZES[0], generator=g), torch.randn(args.batch, SIZES[-1], generator=g)
    S, pl = gv.sbp, gv.placement("cpu", list(range(world)))
    xd, yd = gv.to_global(x, pl, S.split(0)), gv.to_global(y, pl, S.split(0))  # each rank's batch is its part
    xb, yb = xd.to_global(sbp=S.broadcast), yd.to_global(sbp=S.broadcast)  # tensor parallel: the whole batch
    tp = {"0.weight": S.split(0), "0.bias": S.split(0), "2.weight": S.split(1), "4.weight": S.split(0)}
    return {
        "single process": _stepper(torch, _mlp(torch), x, y),
        "commlib DDP": _stepper(torch, ddp.DistributedDataParallel(_mlp(torch)), x, y),
        "gv data parallel": _stepper(torch, gv.nn.to_global(_mlp(torch), pl), xd, yd),
        "gv tensor parallel": _stepper(torch, gv.nn.to_global(_mlp(torch), pl, tp | {"4.bias": S.split(0)}), xb, yb),
    }


def _sharded(torch: Any, batch: int) -> dict[str, Callable[[], None]]:
    """globalview fully sharded and torch FSDP2 (on backend "commlib") at ``batch`` samples per rank."""
    from torch.distributed.fsdp import fully_shard

    import commlib
    import globalview as gv

    rank, world = commlib.get_rank(), commlib.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, SIZES[0], generator=g), torch.randn(batch, SIZES[-1], generator=g)
    S, pl = gv.sbp, gv.placement("cpu", list(range(world)))
    xd, yd = gv.to_global(x, pl, S.split(0)), gv.to_global(y, pl, S.split(0))
    sharded = _mlp(torch)
    gv.nn.to_global(sharded, pl, {name: S.split(0) for name, _ in sharded.named_parameters()})
    fsdp = _mlp(torch)
    for module in [m for m in fsdp if isinstance(m, torch.nn.Linear)] + [fsdp]:
        fully_shard(module)
    return {
        f"gv fully sharded b{batch}": _stepper(torch, sharded, xd, yd),
        f"torch FSDP2 b{batch}": _stepper(torch, fsdp, x, y),
        f"no communication b{batch}": _stepper(torch, _mlp(torch), x, y),  # the whole model, this rank's batch
    }


def main() -> None:
    """Start the ranks (when run directly), then time the methods and print the table."""
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29547"}
        raise SystemExit(subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env))
    os.environ.update(RANK=os.environ["PMI_RANK"], WORLD_SIZE=os.environ["PMI_SIZE"])
    import torch
    import torch.distributed as dist

    import commlib
    from commlib import torch_backend

    torch.set_num_threads(1)
    torch_backend.register()  # in case commlib was imported first and its entry point is not installed
    dist.init_process_group("commlib")  # commlib's world (mpi) and torch's group over it, for FSDP2
    times = {} if args.fsdp_only else _measure(_methods(args), args.repeats, args.steps, commlib)
    sharded = {}
    for batch in args.fsdp_batch:
        sharded[batch] = _measure(_sharded(torch, batch), args.fsdp_repeats, 1, commlib)
    if commlib.get_rank() == 0:
        if times:
            _report(times, args)
        _report_sharded(sharded, args)
    dist.destroy_process_group()


def _measure(methods: dict, repeats: int, steps: int, commlib: Any) -> dict[str, list[float]]:
    """Per-step seconds of each round (the slower rank's), methods in rotating order."""
    import numpy as np

    for step in methods.values():  # warm-up: allocations, bucket plans, groups
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            commlib.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                methods[name]()
            slowest = np.array([(time.perf_counter() - start) / steps])
            commlib.all_reduce(slowest, op=commlib.ReduceOp.MAX)
            times[name].append(float(slowest[0]))
    return times


def _report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    median = {name: statistics.median(v) for name, v in times.items()}
    base, ddp_step = median["single process"], median["commlib DDP"]
    count = sum(a * b + b for a, b in itertools.pairwise(SIZES)) / 1e6
    print(f"# training step, 2 ranks, MLP {' -> '.join(map(str, SIZES))} ({count:.1f}M float32 parameters)")
    print(f"# batch {args.batch} per rank, {args.repeats} rounds of {args.steps} steps, median per-step time")
    print(f"{'method':<20} {'ms/step':>9} {'min':>9} {'vs single':>10} {'vs ddp':>8}")
    for name, value in median.items():
        low = min(times[name]) * 1e3
        print(f"{name:<20} {value * 1e3:>9.1f} {low:>9.1f} {value / base:>9.3f}x {value / ddp_step:>7.3f}x")
    print(f"# {TARGET}: {median['gv data parallel'] / ddp_step:.3f}x")


def _report_sharded(sharded: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> None:
    if not sharded:
        return
    print(
        f"\n# fully sharded (every parameter split(0)) vs torch FSDP2 on backend 'commlib', {args.fsdp_repeats} rounds"
    )
    print(
        f"{'batch/rank':<11} {'gv ms':>9} {'FSDP2 ms':>9} {'gv/FSDP2':>9} {'floor ms':>9} "
        f"{'gv/floor':>9} {'FSDP2/floor':>11}   gv's plan per Linear"
    )
    for batch, times in sharded.items():
        gv_ms, fsdp_ms, floor_ms = (
            statistics.median(times[f"{name} b{batch}"]) * 1e3
            for name in ("gv fully sharded", "torch FSDP2", "no communication")
        )
        print(
            f"{batch:<11} {gv_ms:>9.1f} {fsdp_ms:>9.1f} {gv_ms / fsdp_ms:>8.3f}x {floor_ms:>9.1f} "
            f"{gv_ms / floor_ms:>8.3f}x {fsdp_ms / floor_ms:>10.3f}x   {_plans(batch)}"
        )
    print(f"# {FSDP_TARGET}")
    print("# floor: the whole model trained on this rank's batch with no communication, in the same processes")


def _plans(batch: int) -> str:
    """What globalview.explain says each Linear of the fully sharded model moves at ``batch`` per rank (rank 0)."""
    import torch

    import commlib
    import globalview as gv

    pl, S = gv.placement("cpu", list(range(commlib.get_world_size()))), gv.sbp
    x = gv.zeros(batch * pl.hierarchy[0], SIZES[0], dtype=torch.float32, placement=pl, sbp=S.split(0))
    moves = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        w = gv.zeros(b, a, dtype=torch.float32, placement=pl, sbp=S.split(0), requires_grad=True)
        choice = gv.explain("linear", x if i == 0 else x.detach().requires_grad_() * 1.0, w)  # an activation
        moves.append(choice.chosen.moves)
        x = gv.zeros(x.shape[0], b, dtype=torch.float32, placement=pl, sbp=choice.output)
    return ", ".join(moves)


if __name__ == "__main__":
    main()
