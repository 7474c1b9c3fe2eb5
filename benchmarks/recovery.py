"""What a rank's death costs: the survivors' detection, agreement and first good call; time lost in training.

    python benchmarks/recovery.py                  # 4 and 8 ranks, median of 5 runs; then the training runs
    python benchmarks/recovery.py --ranks 4 --runs 3 --no-training
    python benchmarks/recovery.py --smoke          # CI: 3 ranks once per API, then 30 steps on 3 ranks

Part 1, under ``python -m commlib.launch --on-failure continue``: N ranks run an all_reduce loop (1024 float32);
rank 2 is SIGKILLed from outside. Each survivor reports, in seconds after the kill: when its call raised
``RankFailedError`` naming the dead rank (detection), when ``shrink_group`` returned (agreement and the new
communicator), when the first all_reduce on the shrunk group was right (first good call); 20 more are checked.
Through commlib's API, and through torch's (``torch.distributed`` on ``backend="commlib"``: torch's
``init_process_group``, ``all_reduce`` and ``dist.shrink_group``, under the same launcher).
A row shows the median over the runs of the slowest survivor.

Part 2, ``examples/train_through_failure.py`` on 4 ranks, 200 steps: under ``commlib.launch --on-failure
replace`` (the replacement started at the failure; then ``--spares 1``, a warm spare started with the job),
uninterrupted, then with rank 2 killed at step 50 and its replacement taken in at step 100; under
``torchrun --max-restarts 2`` with a snapshot every 10 steps (rank 0 saves it), uninterrupted, then with the same
kill (torch's agent restarts every worker, which resume from the snapshot). Each run ``--repeats`` times, the
launchers in turn; time lost = the median wall time with the kill minus the median without (a job's start-up
alone varies by seconds on a shared 2-core machine); the final validation loss of both; whether every rank
ends with the same weights.
This is a benchmark, not a test: it prints numbers and never fails on them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_through_failure.py"

LOOP = """
import json, os, time
import numpy as np
import commlib as dist
def event(what, **kw):
    print("EVENT " + json.dumps({"what": what, "pid": os.getpid(), "t": time.time(), **kw}), flush=True)
dist.init_process_group(timeout=60)
for _ in range(5):
    dist.all_reduce(np.ones(1024, np.float32))
event("ready", rank=dist.get_rank())
try:
    while True:
        dist.all_reduce(np.ones(1024, np.float32))
except dist.RankFailedError as e:
    event("raised", failed=e.failed_ranks)
    dist.shrink_group(e.failed_ranks)
    event("shrunk")
    n = dist.get_world_size()
    right = 0
    for i in range(21):
        y = np.full(1024, dist.get_rank() + 1.0, np.float32)
        dist.all_reduce(y)
        right += bool((y == n * (n + 1) / 2).all())
        if i == 0 and right:
            event("first")
    event("done", right=right)
"""
# the same loop through torch's API on backend="commlib": torch's init_process_group (its own store, from rank 0,
# at the MASTER_PORT the launcher gives), torch's all_reduce, torch's dist.shrink_group
TORCH_LOOP = """
import datetime, json, os, time
import torch
import torch.distributed as tdist
import commlib as dist
def event(what, **kw):
    print("EVENT " + json.dumps({"what": what, "pid": os.getpid(), "t": time.time(), **kw}), flush=True)
tdist.init_process_group(backend="commlib", timeout=datetime.timedelta(seconds=60))
for _ in range(5):
    tdist.all_reduce(torch.ones(1024))
event("ready", rank=tdist.get_rank())
try:
    while True:
        tdist.all_reduce(torch.ones(1024))
except dist.RankFailedError as e:
    event("raised", failed=e.failed_ranks)
    tdist.shrink_group(e.failed_ranks)
    event("shrunk")
    n = tdist.get_world_size()
    right = 0
    for i in range(21):
        y = torch.full((1024,), tdist.get_rank() + 1.0)
        tdist.all_reduce(y)
        right += bool((y == n * (n + 1) / 2).all())
        if i == 0 and right:
            event("first")
    event("done", right=right)
tdist.destroy_process_group()
"""
_EVENT = re.compile(r"^\[(\d+)\] EVENT (.*)$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_"))}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _port() -> int:
    from commlib._sockets import free_port

    return free_port()  # below the ephemeral range: no outgoing connection takes it before the launcher listens


def one_kill(n: int, api: str = "commlib", victim: int = 2, timeout: float = 120.0) -> dict[str, float] | None:
    """One job of ``n`` ranks losing ``victim``, through ``api`` (commlib's or torch's): the slowest survivor's
    seconds after the kill, per step."""
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "loop.py"
        program.write_text(LOOP if api == "commlib" else TORCH_LOOP)
        cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", str(n), "--on-failure", "continue"]
        cmd += ["--master_port", str(_port()), str(program)]
        errors = open(Path(tmp) / "stderr", "w+")  # noqa: SIM115 (read back below, closed with the folder)
        proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=errors, text=True)
        events: dict[int, dict[str, dict]] = {}
        killed_at, deadline = None, time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _EVENT.match(line.strip())
            if m is not None:
                e = json.loads(m.group(2))
                events.setdefault(int(m.group(1)), {})[e["what"]] = e
            ready = [r for r in events if "ready" in events[r]]
            if killed_at is None and len(ready) == n:
                time.sleep(0.2)
                os.kill(events[victim]["ready"]["pid"], signal.SIGKILL)
                killed_at = time.time()
            if time.monotonic() > deadline:
                proc.kill()
                break
        proc.wait()
        errors.seek(0)
        said = [line for line in errors.read().splitlines() if "commlib" in line or "Error" in line][-6:]
        errors.close()
    survivors = [e for r, e in events.items() if r != victim]
    if killed_at is None or not all("done" in e and e["done"]["right"] == 21 for e in survivors):
        reached = {r: sorted(e) for r, e in sorted(events.items())}
        print(f"# {api}, {n} ranks: a run did not recover: {reached}; " + " | ".join(said), file=sys.stderr)
        return None
    return {step: max(e[step]["t"] - killed_at for e in survivors) for step in ("raised", "shrunk", "first")}


def _median(runs: list[dict[str, float]], step: str) -> float:
    return statistics.median(r[step] for r in runs)


def part1(ranks: list[int], runs: int, apis: list[str]) -> None:
    print(f"# a rank of N SIGKILLed in an all_reduce loop: seconds after the kill, slowest survivor, median of {runs}")
    print("# api commlib: commlib.all_reduce, commlib.shrink_group; torch: torch.distributed on backend='commlib'")
    print(f"{'api':>8} {'ranks':>6} {'detection':>10} {'agreement':>10} {'first good':>11}  runs")
    for api in apis:
        for n in ranks:
            done = [r for r in (one_kill(n, api) for _ in range(runs)) if r is not None]
            if not done:
                print(f"{api:>8} {n:>6}  (no run recovered)")
                continue
            cells = " ".join(f"{_median(done, s):>10.3f}" for s in ("raised", "shrunk"))
            print(f"{api:>8} {n:>6} {cells} {_median(done, 'first'):>11.3f}  {len(done)}/{runs}", flush=True)


def _results(out: str) -> list[dict]:
    """Every rank's ``RESULT {json}`` (torchrun's workers share one unprefixed stdout: lines may run together)."""
    decoder, found = json.JSONDecoder(), []
    for part in out.split("RESULT ")[1:]:
        with contextlib.suppress(ValueError):
            found.append(decoder.raw_decode(part)[0])
    return found


_LAUNCHERS = ("commlib", "spare", "torchrun")


def train(launcher: str, steps: int, kill_at: int, admit_from: int, ranks: int = 4) -> dict | None:
    """One run of the example: wall seconds, the final loss, whether every rank's weights agree."""
    args = ["--steps", str(steps), "--kill-at", str(kill_at), "--admit-from", str(admit_from)]
    with tempfile.TemporaryDirectory() as tmp:
        if launcher in ("commlib", "spare"):
            cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", str(ranks), "--on-failure", "replace"]
            cmd += ["--spares", "1"] if launcher == "spare" else []
            cmd += ["--master_port", str(_port()), str(EXAMPLE), *args]  # it waits for a replacement at admit_from
        else:
            torchrun = shutil.which("torchrun")
            if torchrun is None:
                return None
            cmd = [torchrun, "--nproc_per_node", str(ranks), "--max-restarts", "2", "--master_port", str(_port())]
            cmd += [str(EXAMPLE), *args, "--recover", "restart", "--snapshot", f"{tmp}/snapshot.pt"]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
        seconds = time.monotonic() - start
    results = _results(proc.stdout)
    if proc.returncode != 0 or not results:
        print(f"# {launcher} run failed (exit {proc.returncode}): {proc.stderr[-800:]}", file=sys.stderr)
        return None
    final = max(results, key=lambda r: r["world_size"])  # the last world's ranks
    last = [r for r in results if r["world_size"] == final["world_size"]]
    members = [r["train_seconds"] for r in last if not any(e["what"] == "joined" for e in r["events"])]
    loop = max(members) if members else float("nan")  # the slowest member's loop (newcomers start theirs late)
    return {"seconds": seconds, "loss": final["loss"], "same": len({r["checksum"] for r in last}) == 1, "loop": loop}


def part2(
    steps: int, kill_at: int, admit_from: int, launchers: tuple[str, ...] = _LAUNCHERS, repeats: int = 3, ranks: int = 4
) -> None:
    """Each launcher's run uninterrupted and with the kill, ``repeats`` times in turn (the launchers alternate,
    so that a slow spell of the machine falls on all of them): medians of the wall times."""
    print(
        f"# training, {ranks} ranks, {steps} steps: rank 2 killed at step {kill_at}; wall seconds, median of {repeats}"
    )
    print(f"{'run':<38} {'wall':>7} {'lost':>7} {'loss':>9}  same weights")
    names = {
        "commlib": "commlib shrink + replacement",
        "spare": "commlib shrink + warm spare",
        "torchrun": "torchrun restart (snapshots)",
    }
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(repeats):
        for launcher in launchers:
            for label, kill in (("uninterrupted", -1), ("killed", kill_at)):
                r = train(launcher, steps, kill, admit_from, ranks)
                if r is not None:
                    runs.setdefault((launcher, label), []).append(r)
    lost = {}
    for launcher in launchers:
        name = names[launcher]
        clean, hit = runs.get((launcher, "uninterrupted"), []), runs.get((launcher, "killed"), [])
        if not clean or not hit:
            print(f"{name:<38} (failed)")
            continue
        wall = {label: statistics.median(r["seconds"] for r in rs) for label, rs in (("u", clean), ("k", hit))}
        lost[launcher] = wall["k"] - wall["u"]
        for label, rs, w in (("uninterrupted", clean, wall["u"]), ("killed", hit, wall["k"])):
            extra = f"{lost[launcher]:>7.2f}" if label == "killed" else f"{'-':>7}"
            same = "yes" if all(r["same"] for r in rs) else "NO"
            print(f"{name + ', ' + label:<38} {w:>7.2f} {extra} {rs[-1]['loss']:>9.4f}  {same}", flush=True)
        if launcher != "torchrun":  # the same processes start either way: the training loop shows the loss alone
            loops = [statistics.median(r["loop"] for r in rs) for rs in (clean, hit)]
            lost[launcher + " loop"] = loops[1] - loops[0]
            print(
                f"# {name}: training loop {loops[0]:.2f} s uninterrupted, {loops[1]:.2f} s killed: "
                f"{loops[1] - loops[0]:.2f} s lost"
            )
        ratio = hit[-1]["loss"] / clean[-1]["loss"]
        print(
            f"# {name}: final loss killed/uninterrupted = {ratio:.3f}x; walls "
            + ", ".join(
                f"{label} " + " ".join(f"{r['seconds']:.2f}" for r in rs) for label, rs in (("u", clean), ("k", hit))
            )
        )
    for mine in ("commlib", "spare"):
        for how, key in (("wall", mine), ("training loop", mine + " loop")):
            if key in lost and "torchrun" in lost:
                said = f"{lost['torchrun'] / lost[key]:.1f}x" if lost[key] > 0 else "- (nothing lost beyond the noise)"
                print(f"# time lost: torchrun restart (wall) / {names[mine]} ({how}) = {said}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--api", nargs="+", choices=["commlib", "torch"], default=["commlib", "torch"], help="part 1")
    p.add_argument("--no-training", action="store_true", help="part 1 only")
    p.add_argument("--repeats", type=int, default=3, help="part 2: runs of each kind (medians)")
    p.add_argument(
        "--smoke", action="store_true", help="CI: 3 ranks once, 30 steps on 3 ranks (kill at 10, newcomers from 20)"
    )
    args = p.parse_args()
    if args.smoke:
        part1([3], 1, ["commlib", "torch"])
        part2(30, 10, 20, ("spare",), repeats=1, ranks=3)  # torchrun's restarts: the full run only
        return
    part1(args.ranks, args.runs, args.api)
    if not args.no_training:
        part2(args.steps, 50, 100, repeats=args.repeats)


if __name__ == "__main__":
    main()
