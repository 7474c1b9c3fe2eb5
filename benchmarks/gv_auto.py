"""Automatic plans against the hand-written ones: step time, predicted and measured, and memory per rank.

    python benchmarks/gv_auto.py                      # 2 ranks, the three models (starts its own ranks)
    python benchmarks/gv_auto.py --mesh 2x2           # 4 ranks on a 2 x 2 mesh (2-D plans)
    python benchmarks/gv_auto.py --models gpt --rounds 9
    python benchmarks/gv_auto.py --smoke              # tiny sizes, one round: seconds (CI runs it)

For each model of examples/globalview/_models.py (a wide MLP, a deep narrow MLP, a small GPT), in the same
processes: ``globalview.auto_parallel`` plans it (the planning time is shown); the auto plan's 20 training
steps are compared with single-process torch's (float32; the float64 check at rtol 1e-5 is in the tests);
then the automatic plan and every hand-written plan (data parallel, fully sharded, tensor parallel, and 2-D
on a 2-D mesh; laid out with ``globalview.nn.to_global``, operators choosing their plans at run time) train
in rotating order, ``--rounds`` rounds of ``--steps`` AdamW steps; the table shows the median per-step time
of the slower rank and the prediction. Then, every model's times taken, each plan's peak memory per rank:
the resident set's high water mark during training steps above what the process held before building the
model (the heap trimmed before and after two warm-up steps), measured in fresh processes (the saved plans
loaded) whose glibc mmap threshold is fixed at 16 KiB from their start, so freed tensors leave the resident
set at once and no free list the timing phase left in the heap is faulted in again), next to the
predicted one, and what globalview's buffer pool holds then (boxing buffers of 1 MiB or more, kept for
reuse). Last, a memory budget below data parallel's measured peak (``--budget`` of it; where no plan fits that,
halfway from there to the peak, at most three times): the plan auto_parallel chooses under it, its
peak and (after every peak, large buffers reused from the heap again) its time measured.
The machine (collective times, globalview's overheads, operator times) is measured afresh in each run, in
a file of the run's own: the first model's planning time includes that. ``GLOBALVIEW_CACHE=<file>`` uses and
keeps that file instead.
A benchmark, not a test: it never fails on times.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "globalview")]  # this tree's packages, and the models

TARGETS = "targets: automatic / fastest hand-written <= 1.1; predicted / measured time in [0.75, 1.25]"
BATCH = {"wide mlp": 32, "deep mlp": 512, "gpt": 8}  # samples per rank


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wide mlp,deep mlp,gpt", help="comma-separated: wide mlp, deep mlp, gpt")
    p.add_argument("--mesh", default="2", choices=["2", "2x2"], help="2 ranks, or 4 on a 2 x 2 mesh")
    p.add_argument("--rounds", type=int, default=7, help="rounds per plan (median reported)")
    p.add_argument("--steps", type=int, default=3, help="steps per round")
    p.add_argument("--budget", type=float, default=0.8, help="the memory budget, as a fraction of DP's peak")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round of one step (seconds)")
    p.add_argument("--phase", default="all", choices=["all", "time", "memory"], help=argparse.SUPPRESS)
    p.add_argument("--state", default="", help=argparse.SUPPRESS)  # where the time phase leaves its results
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    return args


def _rss(field: str = "VmRSS") -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) * 1024


def _trim() -> None:
    """Give the heap's free memory back to the system, so that what the next allocations take shows in the RSS."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _mmap_threshold(nbytes: int) -> None:
    """glibc: allocations of ``nbytes`` or more are their own memory maps, unmapped when freed (fixed threshold),
    and the heap's top is given back past twice that: the pair glibc's own sliding threshold settles on. Setting
    one alone fixes the other at its start value (128 KiB): the heap is then given back after nearly every step
    and faulted in again by the next, which made the budget rows 25-40% slower than the same plan timed before."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2 * nbytes)  # M_TRIM_THRESHOLD


def _reset_peak() -> None:
    """The high water mark of the resident set starts again from now (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class Bench:
    """One model at one size on one placement: its data, its plans, and the measurements."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        import _models
        import torch

        import commlib
        import globalview as gv

        self.name, self.args, self.torch, self.gv, self.commlib = name, args, torch, gv, commlib
        self.size = "smoke" if args.smoke else "bench"
        mesh = [[0, 1], [2, 3]] if args.mesh == "2x2" else [0, 1]
        self.pl = gv.placement("cpu", mesh)
        self.n, self.me = len(self.pl.flat), commlib.get_rank()
        self.make = lambda dtype=torch.float32: _models.make(name, self.size, dtype)
        rows = (4 if args.smoke else BATCH[name]) * self.n
        self.batches = [_models.batch(self.make(), rows, seed) for seed in range(20)]
        self.split = (gv.sbp.split(0),) * self.pl.ndim
        self.pool = {}

    def mine(self, t: Any) -> Any:
        """This rank's part of a whole batch (split(0) over every mesh axis: rank order)."""
        k = t.shape[0] // self.n
        return t[self.me * k : (self.me + 1) * k]

    def inputs(self, b: int) -> tuple:
        return tuple(self.gv.to_global(self.mine(t), self.pl, self.split) for t in self.batches[b])

    def plan(self, budget: float | None = None) -> tuple[Any, float]:
        """The automatic plan (and the seconds auto_parallel took on this rank)."""
        model = self.make()
        self.commlib.barrier()
        start = time.perf_counter()
        self.gv.auto_parallel(model, self.pl, tuple(self.mine(t) for t in self.batches[0]), budget)
        return self.gv.explain(model), time.perf_counter() - start

    def build(self, kind: str, plan: Any) -> Any:
        """A fresh model laid out by ``kind``: "automatic" (the plan applied again) or a hand-written plan."""
        model = self.make()
        if kind == "automatic" or kind.startswith("budget"):
            return plan.apply(model)
        layouts = plan.alternatives[kind]["layouts"]
        full = {n: layouts.get(n, (self.gv.sbp.broadcast,) * self.pl.ndim) for n, _ in model.named_parameters()}
        return self.gv.nn.to_global(model, self.pl, full)

    def stepper(self, model: Any) -> Any:
        optimizer = self.torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = [self.inputs(b) for b in range(2)]
        count = [0]

        def step() -> float:
            loss = model(*data[count[0] % 2])
            count[0] += 1
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return 0.0

        return step

    def check(self, plan: Any) -> float:
        """Largest relative difference of the auto plan's 20 losses (2 in a smoke run) from single-process torch's."""
        torch = self.torch
        ref, net = self.make(), plan.apply(self.make())
        o1, o2 = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(net.parameters(), lr=1e-3)
        worst = 0.0
        for b in range(2 if self.args.smoke else len(self.batches)):
            l1 = ref(*self.batches[b])
            o1.zero_grad(), l1.backward(), o1.step()
            l2 = net(*self.inputs(b))
            o2.zero_grad(), l2.backward(), o2.step()
            worst = max(worst, abs(l2.item() - l1.item()) / abs(l1.item()))
        return worst

    def times(self, models: dict[str, Any], cpu: dict[str, float] | None = None) -> dict[str, float]:
        """Median per-step seconds of each plan (the slower rank), plans in rotating order; ``cpu`` gets the
        median per-step CPU seconds of the busier rank (what other jobs on the machine do not stretch)."""
        import numpy as np

        steps = {k: self.stepper(m) for k, m in models.items()}
        for step in steps.values():
            for _ in range(1 if self.args.smoke else 2):  # warm-up: optimizer states, buckets, the gathers' order
                step()
        out: dict[str, list[float]] = {k: [] for k in steps}
        used: dict[str, list[float]] = {k: [] for k in steps}
        names = list(steps)
        for r in range(self.args.rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                self.commlib.barrier()
                start, busy = time.perf_counter(), time.process_time()
                for _ in range(self.args.steps):
                    steps[k]()
                slowest = np.array([time.perf_counter() - start, time.process_time() - busy]) / self.args.steps
                self.commlib.all_reduce(slowest, op=self.commlib.ReduceOp.MAX)
                out[k].append(float(slowest[0]))
                used[k].append(float(slowest[1]))
        if cpu is not None:
            cpu.update({k: statistics.median(v) for k, v in used.items()})
        return {k: statistics.median(v) for k, v in out.items()}

    pool: dict[str, int]

    def peak(self, kind: str, plan: Any) -> float:
        """Bytes per rank a plan's training steps hold at most, above what the process held before (the largest
        rank; the less of two measurements: the process's own first-time allocations settle over the first)."""
        return min(self._peak(kind, plan) for _ in range(1 if self.args.smoke else 2))

    def _peak(self, kind: str, plan: Any) -> float:
        import numpy as np

        from globalview._memory import held_bytes

        gc.collect()
        _trim()
        base = _rss()
        model = self.build(kind, plan)
        step = self.stepper(model)
        step(), step()
        gc.collect()
        _trim()  # what the warm-up steps freed on the heap is not the plan's
        _reset_peak()
        for _ in range(1 if self.args.smoke else 3):
            step()
        peak = np.array([float(_rss("VmHWM") - base)])
        self.pool[kind] = held_bytes()
        del model, step
        gc.collect()
        self.commlib.all_reduce(peak, op=self.commlib.ReduceOp.MAX)
        return float(peak[0])


def run_times(bench: Bench) -> dict[str, Any]:
    """Plan, check and time every plan of one model (collective)."""
    plan, planning = bench.plan()
    kinds = ["automatic", *plan.alternatives]
    out: dict[str, Any] = {"plan": plan, "planning": planning, "check": bench.check(plan), "kinds": kinds}
    out["cpu"] = {}
    out["measured"] = bench.times({k: bench.build(k, plan) for k in kinds}, out["cpu"])
    out["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())  # other jobs on the machine disturb the times
    out["predicted"] = {"automatic": plan.time} | {k: a["time"] for k, a in plan.alternatives.items()}
    return out


def run_memory(bench: Bench, out: dict[str, Any]) -> None:
    """Every plan's peak memory; then the plan under a budget below data parallel's peak (collective)."""
    plan = out["plan"]
    for _ in range(0 if bench.args.smoke else 2):  # the process's own first-time allocations, not a plan's
        bench._peak("data parallel", plan)
    out["memory"] = {k: bench.peak(k, plan) for k in out["kinds"]}
    out["pool"] = bench.pool
    out["predicted memory"] = {"automatic": plan.memory} | {k: a["memory"] for k, a in plan.alternatives.items()}
    dp = out["memory"]["data parallel"]
    fraction = bench.args.budget
    for _ in range(3):  # a fraction below the least memory any plan needs: halfway to data parallel's peak
        budget = fraction * dp
        try:
            tight, _ = bench.plan(budget)
            break
        except ValueError as e:
            out["budget"] = (budget, None, str(e))
            fraction = (1 + fraction) / 2
    else:
        return
    out["budget"] = (budget, tight, bench.peak("budget", tight), budget / dp)


def time_budget(bench: Bench, out: dict[str, Any]) -> None:
    """The budget plan's step time (collective; after every plan's memory: timing leaves the heap fragmented)."""
    if out["budget"][1] is not None:
        out["budget"] = (*out["budget"], bench.times({"budget": bench.build("budget", out["budget"][1])})["budget"])


def report(name: str, r: dict[str, Any], args: argparse.Namespace) -> None:
    mib = 1 << 20
    plan = r["plan"]
    print(f"\n## {name} ({args.mesh} ranks{', smoke' if args.smoke else ''}): {BATCH[name]} samples per rank")
    print(
        f"planning: {r['planning']:.2f} s (search {plan.stats['search seconds']:.2f} s); 20 steps vs torch: "
        f"largest relative loss difference {r['check']:.1e} (float32)"
    )
    print(
        f"{'plan':<18} {'ms/step':>9} {'predicted':>10} {'pred/meas':>10} {'vs fastest':>11} {'cpu ms':>8} "
        f"{'pred/cpu':>9} {'MiB/rank':>9} {'predicted':>10} {'pred/meas':>10} {'pool':>6}"
    )
    hand = {k: v for k, v in r["measured"].items() if k != "automatic"}
    fastest = min(hand.values())
    for k, t in r["measured"].items():
        p, m, pm, c = r["predicted"][k], r["memory"][k], r["predicted memory"][k], r["cpu"][k]
        print(
            f"{k:<18} {t * 1e3:>9.2f} {p * 1e3:>10.2f} {p / t:>10.2f} {t / fastest:>10.2f}x {c * 1e3:>8.2f} "
            f"{p / c:>9.2f} {m / mib:>9.1f} {pm / mib:>10.1f} {pm / max(m, 1):>10.2f} {r['pool'][k] / mib:>6.1f}"
        )
    budget = r["budget"]
    if budget[1] is None:
        print(f"budget {budget[0] / mib:.1f} MiB: {budget[2]}")
    else:
        b, tight, peak, fraction, t = budget
        print(
            f"budget {b / mib:.1f} MiB ({fraction:.0%} of data parallel's measured peak): chosen plan "
            f"{t * 1e3:.2f} ms/step (predicted {tight.time * 1e3:.2f}), peak {peak / mib:.1f} MiB (predicted "
            f"{tight.memory / mib:.1f}, measured/predicted {peak / tight.memory:.2f}), fits: {peak <= b}"
        )
    print(f"# {TARGETS}: automatic / fastest {r['measured']['automatic'] / fastest:.2f}; load average {r['load']}")
    print(plan)


def _launch(args: argparse.Namespace, phase: str, state: str) -> int:
    """Start the ranks for one phase (fresh processes: the memory phase's heap holds nothing of the timing's)."""
    from commlib.launch._mpiexec import find_mpiexec

    n = "4" if args.mesh == "2x2" else "2"
    # the machine measured afresh for the run (a file of its own, unless GLOBALVIEW_CACHE names one): a cached
    # measurement taken while other jobs loaded the machine put the predictions 2-3x off (seen here)
    cache = os.environ.get("GLOBALVIEW_CACHE") or str(Path(state) / "machine.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOBALVIEW_CACHE": cache}
    argv = [find_mpiexec(), "-n", n, sys.executable, *sys.argv, "--phase", phase, "--state", state]
    return subprocess.call(argv, env=env)


def main() -> None:
    """Start the ranks (when run directly): plan and time each model in one set of processes, then weigh each
    plan in fresh ones (glibc's mmap threshold fixed from their start: the memory each step measures is the
    arrays it holds, not what the timing phase left in the heap's free lists)."""
    args = _parse()
    if "PMI_RANK" not in os.environ:  # not started by mpiexec: start the ranks of ourselves, phase by phase
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gv_auto-") as state:
            raise SystemExit(_launch(args, "time", state) or _launch(args, "memory", state))
    if args.phase == "memory":
        _mmap_threshold(16 << 10)  # before anything large is allocated: freed tensors leave the resident set at once
    os.environ.update(RANK=os.environ["PMI_RANK"], WORLD_SIZE=os.environ["PMI_SIZE"])
    import torch

    import commlib

    torch.set_num_threads(1)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    benches = {name: Bench(name, args) for name in names}
    import torch._dynamo  # what torch.optim imports on first use: imported before the freeze

    gc.freeze()  # what is alive now is never garbage: gc.collect() in the measurements skips it (~0.2 s each)
    state = Path(args.state) if args.state else None
    if args.phase in ("time", "all"):
        results = {name: run_times(bench) for name, bench in benches.items()}
        if args.phase == "time":
            if commlib.get_rank() == 0:
                for name, r in results.items():
                    (state / f"{name}.json").write_text(json.dumps({**r, "plan": r["plan"].to_json()}))
            return
    else:
        from globalview import AutoPlan

        results = {name: json.loads((state / f"{name}.json").read_text()) for name in names}
        for r in results.values():
            r["plan"] = AutoPlan.from_json(r["plan"])
    if args.phase == "all":  # one set of processes: what timing left in the heap shows in the peaks
        _mmap_threshold(16 << 10)
    for name, bench in benches.items():
        run_memory(bench, results[name])
    _mmap_threshold(32 << 20)  # the budget plans' times: large buffers reused from the heap, as in the timing phase
    for name, bench in benches.items():
        time_budget(bench, results[name])
        if commlib.get_rank() == 0:
            report(name, results[name], args)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
