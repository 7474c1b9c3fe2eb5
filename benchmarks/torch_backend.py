"""torch.distributed on ``backend="commlib"`` against ``backend="gloo"``, in one run on 2 ranks.

    python benchmarks/torch_backend.py                 # starts its own 2 ranks under mpiexec
    python benchmarks/torch_backend.py --rounds 15 --ddp-repeats 9

Part 1: ``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` through torch's API
at 8 B, 1 MiB and 16 MiB, on the default group (commlib) and on a gloo group of the same ranks;
rounds interleave the two (rotating order); each cell is the median over rounds of the slower
rank's time per call. Part 2: a training step of ``benchmarks/ddp_step.py``'s 25.2M-parameter MLP
under torch's ``DistributedDataParallel`` on commlib and on gloo, and under commlib's own
``ddp.DistributedDataParallel``. This is a benchmark, not a test: it prints numbers and never fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES = {"8 B": 8, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
CALLS = {"8 B": 200, "1 MiB": 20, "16 MiB": 4}  # calls per timed round
TARGETS = "targets: all_reduce commlib/gloo <= 0.2x at 8 B, <= 0.7x at 16 MiB; torch DDP step commlib/gloo <= 0.9x"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds per collective cell")
    p.add_argument("--ddp-repeats", type=int, default=7, help="rounds per DDP method (median reported)")
    p.add_argument("--ddp-steps", type=int, default=2, help="steps per DDP round")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per DDP step")
    p.add_argument("--skip-ddp", action="store_true", help="collectives only")
    return p.parse_args()


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
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        for label, nbytes in SIZES.items():
            calls = {
                "commlib": _collective(dist, torch, op, nbytes, None),
                "gloo": _collective(dist, torch, op, nbytes, gloo),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for fn in calls.values():  # warm-up
                for _ in range(3):
                    fn()
            names = list(calls)
            for r in range(args.rounds):
                for name in names[r % 2 :] + names[: r % 2]:
                    commlib.barrier()
                    start = time.perf_counter()
                    for _ in range(CALLS[label]):
                        calls[name]()
                    times[name].append(_slowest(commlib, (time.perf_counter() - start) / CALLS[label]) * 1e6)
            out[op, label] = {name: statistics.median(v) for name, v in times.items()}
    return out


def _ddp(args: argparse.Namespace, dist: Any, torch: Any, commlib: Any, gloo: Any) -> dict:
    """method -> median ms per step, methods in rotating order."""
    sys.path.insert(0, str(Path(__file__).parent))
    import ddp_step  # the same model, data and step as benchmarks/ddp_step.py

    import ddp

    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, ddp_step.SIZES[0], generator=g)
    y = torch.randn(args.batch, ddp_step.SIZES[-1], generator=g)
    tddp = torch.nn.parallel.DistributedDataParallel
    methods = {
        "torch DDP (commlib)": ddp_step._stepper(torch, tddp(ddp_step._mlp(torch)), x, y),
        "torch DDP (gloo)": ddp_step._stepper(torch, tddp(ddp_step._mlp(torch), process_group=gloo), x, y),
        "commlib ddp": ddp_step._stepper(torch, ddp.DistributedDataParallel(ddp_step._mlp(torch)), x, y),
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
        print(f"\n# DDP step, MLP 1024-4096-4096-1024 (25.2M params), batch {args.batch}/rank, ms/step (median)")
        base = steps["torch DDP (gloo)"]
        for name, ms in steps.items():
            print(f"{name:<22} {ms:>9.1f} {ms / base:>9.3f}x of torch DDP (gloo)")
    print(f"# {TARGETS}")


def main() -> None:
    """Start the ranks (when run directly), then measure and print."""
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start 2 ranks of ourselves
        from commlib.launch._mpiexec import find_mpiexec

        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29543"}
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
