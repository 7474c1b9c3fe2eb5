"""torch.distributed on ``backend="commlib"`` against ``backend="gloo"``, in one run on 2 ranks.

    python benchmarks/torch_backend.py                 # starts its own 2 ranks under mpiexec
    python benchmarks/torch_backend.py --rounds 15 --ddp-repeats 9
    python benchmarks/torch_backend.py --smoke         # CI: 8 B and 1 MiB, a tiny MLP, one round (seconds)

Part 1: ``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through torch's API
at 8 B, 1 MiB and 16 MiB, on the default group (commlib) and on a gloo group of the same ranks;
rounds interleave the two (rotating order); each cell is the median over rounds of the slower
rank's time per call. Part 2: a training step of ``benchmarks/ddp_step.py``'s 25.2M-parameter MLP
under torch's ``DistributedDataParallel`` on commlib and on gloo, and under commlib's own
``ddp.DistributedDataParallel``. This is a benchmark, not a test: it prints numbers and never fails.
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
from typing import Any

import ddp_step  # the same model, data and step as benchmarks/ddp_step.py (this script's folder is on sys.path)

SIZES = {"8 B": 8, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
CALLS = {"8 B": 200, "1 MiB": 20, "16 MiB": 4}  # calls per timed round
SMOKE_SIZES = {"8 B": 8, "1 MiB": 1 << 20}
SMOKE_CALLS = {"8 B": 2, "1 MiB": 2}
TARGETS = "targets: all_reduce commlib/gloo <= 0.2x at 8 B, <= 0.7x at 16 MiB; torch DDP step commlib/gloo <= 0.9x"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds per collective cell")
    p.add_argument("--ddp-repeats", type=int, default=7, help="rounds per DDP method (median reported)")
    p.add_argument("--ddp-steps", type=int, default=2, help="steps per DDP round")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per DDP step")
    p.add_argument("--skip-ddp", action="store_true", help="collectives only")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: 8 B and 1 MiB, one round of 2 calls after one warm-up call; "
        "ddp_step.py's --smoke MLP, --batch 2, one round of one step; the times mean nothing",
    )
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.ddp_repeats, args.ddp_steps, args.batch = 1, 1, 1, 2
    args.sizes = ddp_step.SMOKE_SIZES if args.smoke else ddp_step.SIZES
    return args


def _slowest(commlib: Any, seconds: float) -> float:
    import numpy as np

    t = np.array([seconds])
    commlib.all_reduce(t, op=commlib.ReduceOp.MAX)
    return float(t[0])


def _collective(dist: Any, torch: Any, op: str, nbytes: int, group: Any) -> Callable[[], None]:
    """One call of ``op`` on float32 buffers of ``nbytes`` per rank (the gathered/scattered side: world x)."""
    n, count = dist.get_world_size(), max(nbytes // 4, 1)
    x, big = torch.ones(count), torch.ones(count * n)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    # torch 2.13 renamed these (the old names warn, once per call site); both reach the same backend method
    if op == "all_gather_into_tensor":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(big, x, group=group)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(x, big, group=group)


def _collectives(args: argparse.Namespace, dist: Any, torch: Any, commlib: Any, gloo: Any) -> dict:
    """(op, size) -> {backend: median microseconds per call}."""
    out: dict = {}
    sizes, per_round = (SMOKE_SIZES, SMOKE_CALLS) if args.smoke else (SIZES, CALLS)
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        for label, nbytes in sizes.items():
            calls = {
                "commlib": _collective(dist, torch, op, nbytes, None),
                "gloo": _collective(dist, torch, op, nbytes, gloo),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for fn in calls.values():  # warm-up
                for _ in range(1 if args.smoke else 3):
                    fn()
            names = list(calls)
            for r in range(args.rounds):
                for name in names[r % 2 :] + names[: r % 2]:
                    commlib.barrier()
                    start = time.perf_counter()
                    for _ in range(per_round[label]):
                        calls[name]()
                    times[name].append(_slowest(commlib, (time.perf_counter() - start) / per_round[label]) * 1e6)
            out[op, label] = {name: statistics.median(v) for name, v in times.items()}
    return out


def _ddp(args: argparse.Namespace, dist: Any, torch: Any, commlib: Any, gloo: Any) -> dict:
    """method -> median ms per step, methods in rotating order."""
    import ddp

    sizes = args.sizes
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, sizes[0], generator=g)
    y = torch.randn(args.batch, sizes[-1], generator=g)
    tddp = torch.nn.parallel.DistributedDataParallel
    mlp, stepper = ddp_step._mlp, ddp_step._stepper
    methods = {
        "torch DDP (commlib)": stepper(torch, tddp(mlp(torch, sizes)), x, y),
        "torch DDP (gloo)": stepper(torch, tddp(mlp(torch, sizes), process_group=gloo), x, y),
        "commlib ddp": stepper(torch, ddp.DistributedDataParallel(mlp(torch, sizes)), x, y),
    }
    for step in methods.values():
        for _ in range(2):
            step()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.ddp_repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            commlib.barrier()
            start = time.perf_counter()
            for _ in range(args.ddp_steps):
                methods[name]()
            times[name].append(_slowest(commlib, (time.perf_counter() - start) / args.ddp_steps) * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _report(colls: dict, steps: dict | None, args: argparse.Namespace) -> None:
    print(f"# torch.distributed, 2 ranks, float32, median of {args.rounds} interleaved rounds (slower rank), us/call")
    print(f"{'collective':<24} {'size':>7} {'commlib':>10} {'gloo':>10} {'commlib/gloo':>13}")
    for (op, label), t in colls.items():
        ratio = t["commlib"] / t["gloo"]
        print(f"{op:<24} {label:>7} {t['commlib']:>10.1f} {t['gloo']:>10.1f} {ratio:>12.3f}x")
    if steps:
        params = sum(a * b + b for a, b in itertools.pairwise(args.sizes))
        count = f"{params / 1e6:.1f}M" if params >= 100_000 else f"{params:,}"
        mlp = "-".join(map(str, args.sizes))
        print(f"\n# DDP step, MLP {mlp} ({count} params), batch {args.batch}/rank, ms/step (median)")
        base = steps["torch DDP (gloo)"]
        for name, ms in steps.items():
            print(f"{name:<22} {ms:>9.1f} {ms / base:>9.3f}x of torch DDP (gloo)")
    print(f"# {TARGETS}")


def main() -> None:
    """Start the ranks (when run directly), then measure and print."""
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        # torch's rendezvous: a MASTER_ADDR/MASTER_PORT already set wins (two runs at once, a test's free port)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29543", **os.environ, "OMP_NUM_THREADS": "1"}
        raise SystemExit(subprocess.call([find_mpiexec(), "-n", "2", sys.executable, *sys.argv], env=env))
    os.environ.update(RANK=os.environ["PMI_RANK"], WORLD_SIZE=os.environ["PMI_SIZE"])
    import torch
    import torch.distributed as dist

    import commlib
    from commlib import torch_backend

    torch.set_num_threads(1)
    torch_backend.register()  # in case commlib was imported first and its entry point is not installed
    dist.init_process_group("commlib")
    gloo = dist.new_group(backend="gloo")
    colls = _collectives(args, dist, torch, commlib, gloo)
    steps = None if args.skip_ddp else _ddp(args, dist, torch, commlib, gloo)
    if dist.get_rank() == 0:
        _report(colls, steps, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
