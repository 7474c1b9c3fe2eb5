"""Host-side overhead of one nccl-backend all_reduce call: everything but the NCCL call itself.

    python benchmarks/nccl_overhead.py                  # this checkout
    python benchmarks/nccl_overhead.py --at 696fd95     # this checkout against an older commit, same run
    python benchmarks/nccl_overhead.py --smoke          # CI: 100 calls per path, then --at HEAD, one run each

The nccl backend runs against a null NCCL module (every call returns at once)
and a null CUDA runtime (events complete at once), so what is timed is commlib's
own work per call: argument checks, dtype/op mapping, stream ordering, handle,
wait. Two paths: "emulated" (host arrays, the group waits on the host, as on the
CPU emulator) and "device" (the backend and its group made for device memory, as
on a GPU: the caller's stream waits, the host does not). Target: <= 5 us per
all_reduce. Single process; not a test.

``--at REV`` checks REV out into a temporary git worktree and runs this very
measurement (this file, which uses only what every version of the backend has)
against that checkout and this one in alternating subprocesses, then prints both
medians and their ratio: a figure comparable across commits on one machine.

``--smoke`` is CI's check that the script still runs: one round of 100 calls per path,
then the ``--at`` machinery (worktree, subprocesses, their JSON, the ratio line) against
HEAD, or against REV with ``--at REV``, with one such run per checkout. Its times mean nothing.
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
import types
from pathlib import Path

import numpy as np

import commlib as dist
from commlib._group import ProcessGroup
from commlib.backends.nccl import NcclBackend


def _null_nccl() -> types.SimpleNamespace:
    """A stand-in for cupy.cuda.nccl whose every call returns at once."""

    class NcclCommunicator:
        def __init__(self, ndev: int, commId: tuple, rank: int) -> None:
            self._rank, self._size = rank, ndev

        def rank_id(self) -> int:
            return self._rank

        def size(self) -> int:
            return self._size

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
            pass

        def check_async_error(self) -> None:
            pass

    names = {
        "NCCL_INT8": 0,
        "NCCL_UINT8": 1,
        "NCCL_INT32": 2,
        "NCCL_UINT32": 3,
        "NCCL_INT64": 4,
        "NCCL_UINT64": 5,
        "NCCL_FLOAT16": 6,
        "NCCL_FLOAT32": 7,
        "NCCL_FLOAT64": 8,
        "NCCL_BFLOAT16": 9,
        "NCCL_SUM": 0,
        "NCCL_PROD": 1,
        "NCCL_MAX": 2,
        "NCCL_MIN": 3,
        "NCCL_AVG": 4,
    }
    return types.SimpleNamespace(
        NcclCommunicator=NcclCommunicator,
        NcclError=RuntimeError,
        get_version=lambda: 22705,  # asked by the backend since 2026-11 (NCCL AVG needs 2.10)
        groupStart=lambda: None,
        groupEnd=lambda: None,
        **names,
    )


def _null_cuda() -> types.SimpleNamespace:
    """A stand-in for cupy.cuda whose streams and events are complete at once."""

    class Event:
        done = True

        def __init__(self, **kwargs: object) -> None:
            pass

        def record(self, stream: object = None) -> None:
            pass

    class Stream:
        ptr = 1

        def __init__(self, **kwargs: object) -> None:
            pass

        def wait_event(self, event: object) -> None:
            pass

    return types.SimpleNamespace(Stream=Stream, Event=Event, get_current_stream=lambda: Stream())


def measure(rounds: int = 15, calls: int = 20000) -> dict[str, float]:
    """Median microseconds per all_reduce on each path, for the commlib that ``import commlib`` finds."""
    nccl = _null_nccl()
    x = np.zeros(2, np.float32)
    out = {}
    for path, host in (("emulated", True), ("device", False)):
        backend = NcclBackend(nccl, _null_cuda(), np, nccl.NcclCommunicator(2, (), 0), host)
        group = ProcessGroup(backend, [0, 1], 0, "null", 60.0, "[rank 0/2] ")
        passthrough = lambda obj, *args, **kwargs: obj  # noqa: E731 - numpy plays device memory
        for name in ("buffer", "array"):  # the intake's name in this version, and in older ones
            if hasattr(group, name):
                setattr(group, name, passthrough)
        runs = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(x, group=group)
            runs.append((time.perf_counter() - start) / calls * 1e6)
        out[path] = statistics.median(runs)
    return out


def _at(rev: str, repeats: int, smoke: bool = False) -> None:
    """Run :func:`measure` on this checkout and on ``rev`` in alternating subprocesses; print medians and ratios."""
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="commlib-at-") as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(old), rev], check=True,
                       capture_output=True)  # fmt: skip
        try:
            results: dict[str, list[dict[str, float]]] = {"this checkout": [], rev: []}
            for _ in range(repeats):
                for label, tree in (("this checkout", here), (rev, old)):
                    env = {**os.environ, "PYTHONPATH": str(tree)}
                    argv = [sys.executable, __file__, "--measure", *(["--smoke"] if smoke else [])]
                    proc = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True)
                    if proc.returncode:  # say why: check=True would show only the command
                        raise SystemExit(f"the measurement of {label} ({tree}) failed:\n{proc.stderr}")
                    results[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)], capture_output=True)
    print(f"# nccl backend host overhead per all_reduce (us), median of {repeats} alternating runs each")
    for path in ("emulated", "device"):
        now = statistics.median(r[path] for r in results["this checkout"])
        then = statistics.median(r[path] for r in results[rev])
        print(f"{path:9s} path: this checkout {now:6.2f} us, {rev} {then:6.2f} us, ratio {now / then:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--at", metavar="REV", help="also measure commit REV (a git worktree), alternating runs")
    p.add_argument("--repeats", type=int, default=5, help="with --at: runs per checkout")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one run, JSON out (for --at)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI's check that the script still runs: one round of 100 calls per path, then --at HEAD (or --at REV) "
        "with one run per checkout; the times mean nothing",
    )
    args = p.parse_args()
    small = {"rounds": 1, "calls": 100} if args.smoke else {}
    if args.measure:
        print(json.dumps(measure(**(small or {"rounds": 9}))))
    elif args.at and not args.smoke:
        _at(args.at, args.repeats)
    else:
        for path, us in measure(**small).items():
            print(f"nccl backend host overhead per all_reduce, {path} path: median {us:.2f} us (target <= 5 us)")
        if args.smoke:
            _at(args.at or "HEAD", 1, smoke=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
