"""The measurement loop, as nccl-tests' TimeTest and BenchTime run it, on every rank of the job.

Per (collective, type, op, root): a barrier, ``-w`` warm-up calls at the largest
and at the smallest size, then for each size an out-of-place and an in-place
measurement. A measurement: one call, a barrier, ``-n`` timed calls back to back
(each on the next slice of the buffers, as nccl-tests moves its pointers), time
per call combined over ranks as ``-a`` says (nccl-tests' default: the mean), a
barrier, then ``-c`` checked calls on fresh known inputs.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import commlib as dist
from commlib.bench import _colls, _data
from commlib.bench._report import (
    Measure,
    Row,
    avg_busbw,
    device_line,
    footer,
    format_row,
    header_line,
    titles,
    write_csv,
    write_json,
    write_plot,
)
from commlib.bench._specs import COLLECTIVES, DATATYPES, OPS, bandwidths, layout, sweep

__all__ = ["Settings", "run"]

_AVERAGE: dict[int, Callable[[list[Any]], Any]] = {
    0: lambda v: v[0],
    1: lambda v: sum(v) / len(v),
    2: min,
    3: max,
}  # nccl-tests' -a 0/1/2/3


@dataclass(frozen=True)
class Settings:
    """What to run, as parsed from the command line."""

    collectives: tuple[str, ...]
    types: tuple[str, ...]
    ops: tuple[str, ...]
    root: int  # -1: every rank in turn
    minbytes: int
    maxbytes: int
    stepfactor: int
    stepbytes: int
    iters: int
    warmup: int
    check: int
    average: int
    backend: str
    progress: bool = False
    corrupt: int = 0  # debugging: the last rank flips this many output elements before each check
    outputs: dict[str, str] = field(default_factory=dict)  # "json"/"csv"/"plot" -> path


class _Progress:
    """One status line on stderr, redrawn in place; cleared before anything goes to stdout."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.done, self.shown = enabled, total, 0, False

    def step(self, text: str) -> None:
        """Show that the next measurement, ``text``, starts."""
        self.done += 1
        if self.enabled:
            sys.stderr.write(f"\r[{self.done}/{self.total}] {text}\x1b[K")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        """Erase the status line (before stdout gets a line, and at the end)."""
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


class _Job:
    """This rank's state for one run: settings, buffers, counters, and what rank 0 prints."""

    def __init__(self, s: Settings, rank: int, nranks: int, xp: Any, host: bool) -> None:
        self.s, self.rank, self.nranks, self.xp, self.host = s, rank, nranks, xp, host
        self.send = xp.zeros(s.maxbytes, np.uint8)
        self.recv = xp.zeros(s.maxbytes, np.uint8)
        self.sizes = sweep(s.minbytes, s.maxbytes, s.stepfactor, s.stepbytes)
        self.errors = 0  # this rank's measurements that found wrong values (nccl-tests' "out of bounds")
        self.rep = 0  # seed of the next check's inputs; every rank counts the same
        steps = len(self.sizes) * sum(len(_plan(s, c, nranks)) for c in s.collectives)
        self.progress = _Progress(s.progress and rank == 0, steps)

    def say(self, line: str) -> None:
        """Print a table line on rank 0."""
        if self.rank == 0:
            self.progress.clear()
            print(line, flush=True)

    def sync(self) -> None:
        """Wait for the device (nccl-tests' completeColl); host backends finish inside each call."""
        if not self.host:
            self.xp.cuda.get_current_stream().synchronize()

    def combine(self, value: Any, how: Callable[[list[Any]], Any]) -> Any:
        """``how`` over every rank's ``value`` (same answer on every rank)."""
        values: list[Any] = [None] * self.nranks
        dist.all_gather_object(values, value)
        return how(values)


def _plan(s: Settings, name: str, nranks: int) -> list[tuple[str, str, int]]:
    """(type, op name, root) for each warm-up-and-sweep of a collective, in nccl-tests' loop order."""
    coll = COLLECTIVES[name]
    ops = list(s.ops) if coll.reduces else ["none"]
    roots = ([s.root] if s.root >= 0 else list(range(nranks))) if coll.rooted else [-1]
    plan = []
    for t in s.types:
        for o in ops:
            plan += [(t, o, r) for r in roots]
    return plan


def _calls(job: _Job, case: _colls.Case, n: int) -> list[Callable[[], object]]:
    """The collective bound to the buffers at nccl-tests' rotating offsets, for ``n`` consecutive calls."""
    total = case.lay.size_bytes(case.dtype.itemsize)
    steps = job.s.maxbytes // total if total else 1
    distinct = [_colls.make_call(case, job.send, job.recv, total * i, job.xp) for i in range(max(1, min(n, steps)))]
    return [distinct[i % len(distinct)] for i in range(n)]


def _verify(job: _Job, case: _colls.Case, call: Callable[[], object]) -> int:
    """Run the call on fresh known inputs ``-c`` times; wrong elements summed over ranks (0 if all right)."""
    wrong = 0
    for _ in range(job.s.check):
        job.rep += 1
        _colls.fill(case, job.send, job.recv, job.rep, job.xp)
        call()
        job.sync()
        got = _colls.output_region(case, job.recv)
        got = got.get() if hasattr(got, "get") else got  # device -> host
        if job.s.corrupt and job.rank == job.nranks - 1:
            got = _data.corrupt(got, job.s.corrupt)
        mine = _data.count_wrong(got, _colls.expected(case, job.rep), _data.tolerance(case.op, case.dtype))
        job.errors += mine > 0
        wrong = job.combine(mine, sum)
        if wrong:
            break
    return wrong


def _bench_time(job: _Job, case: _colls.Case) -> Measure:
    """One measurement: time per call over ``-n`` calls, bandwidths, and the check."""
    calls = _calls(job, case, job.s.iters)
    if job.s.check:
        _colls.fill(case, job.send, job.recv, 99, job.xp)  # time on valid numbers, not on leftovers
    calls[0]()
    job.sync()
    dist.barrier()
    start = time.perf_counter()
    for call in calls:
        call()
    job.sync()
    seconds = job.combine((time.perf_counter() - start) / len(calls), _AVERAGE[job.s.average])
    algbw, busbw = bandwidths(case.name, case.lay.size_bytes(case.dtype.itemsize), seconds, job.nranks)
    dist.barrier()
    wrong = _verify(job, case, calls[0]) if job.s.check and _colls.checked(case) else None
    return Measure(seconds * 1e6, algbw, busbw, wrong)


def _time_test(job: _Job, name: str, tname: str, oname: str, root: int) -> list[Row]:
    """Warm up, then one row per size (nccl-tests' TimeTest)."""
    dtype, op, n = DATATYPES[tname], OPS.get(oname), job.nranks

    def case(nbytes: int, in_place: bool) -> _colls.Case:
        return _colls.Case(name, dtype, op, root, job.rank, n, layout(name, nbytes, dtype.itemsize, n), in_place)

    dist.barrier()
    job.send[...] = 0  # an earlier type's bytes read as this type could be NaNs or slow denormals
    job.recv[...] = 0
    for nbytes in (job.s.maxbytes, job.s.minbytes):
        for call in _calls(job, case(nbytes, False), job.s.warmup):
            call()
        job.sync()
    rows = []
    for nbytes in job.sizes:
        oop, ip = case(nbytes, False), case(nbytes, True)
        size, count = oop.lay.size_bytes(dtype.itemsize), oop.lay.param_count
        job.progress.step(f"{name} {tname} {oname}{f' root {root}' if root >= 0 else ''}: {size} B")
        row = Row(name, size, count, tname, oname, root, _bench_time(job, oop), _bench_time(job, ip))
        job.say(format_row(row))
        rows.append(row)
    return rows


def _devices(job: _Job, backend: str) -> list[str]:
    """The "# Using devices" lines, one per rank, in rank order."""
    local = dist.env.get_local_rank()
    name, bus = ("nccl-emulator" if job.host else "gpu", 0) if backend == "nccl" else ("cpu", 0)
    if not job.host:  # a real GPU: its index, PCI bus and name, as nccl-tests prints them
        dev = job.xp.cuda.Device().id
        props = job.xp.cuda.runtime.getDeviceProperties(dev)
        local, bus, name = dev, int(props["pciBusID"]), props["name"].decode()
    me = (job.rank, os.getpid(), socket.gethostname().split(".")[0], local, bus, name)
    return [device_line(*info) for info in job.combine(me, list)]


def _section(job: _Job, name: str) -> tuple[list[Row], dict[str, Any]]:
    """One collective's table: titles, rows, and its closing lines."""
    coll = COLLECTIVES[name]
    job.say(f"# Collective test: {name}  (busbw = algbw * {coll.factor} = {coll.bus_factor(job.nranks):g})")
    for line in titles():
        job.say(line)
    before, rows = job.errors, []
    for tname, oname, root in _plan(job.s, name, job.nranks):
        rows += _time_test(job, name, tname, oname, root)
    errors = job.combine(job.errors - before, sum)
    for line in footer(errors, avg_busbw(rows)):
        job.say(line)
    return rows, {"collective": name, "out_of_bounds": errors, "avg_busbw": avg_busbw(rows)}


def _write_outputs(s: Settings, rows: list[Row], sections: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """The ``--json``, ``--csv`` and ``--plot`` files (rank 0)."""
    if "json" in s.outputs:
        params = {k: v for k, v in vars(s).items() if k not in ("outputs", "progress", "corrupt")}
        header = header_line(s.minbytes, s.maxbytes, s.stepfactor, s.stepbytes, s.warmup, s.iters, s.check)
        meta = {"tool": "commlib.bench", "version": dist.__version__, **meta, "params": params, "header": header}
        write_json(s.outputs["json"], meta, rows, sections)
    if "csv" in s.outputs:
        write_csv(s.outputs["csv"], rows)
    if "plot" in s.outputs:
        title = f"commlib {meta['backend']} backend, {meta['nranks']} ranks: bus bandwidth"
        write_plot(s.outputs["plot"], rows, title)


def run(s: Settings) -> int:
    """Run the benchmark on this rank of an initialised job; rank 0 prints. Returns the exit code."""
    import commlib.groups

    xp = commlib.groups.array_module()  # numpy, or cupy under real NCCL
    job = _Job(s, dist.get_rank(), dist.get_world_size(), xp, xp is np)
    backend = dist.get_backend()
    job.say(header_line(s.minbytes, s.maxbytes, s.stepfactor, s.stepbytes, s.warmup, s.iters, s.check))
    job.say("#\n# Using devices")
    devices = _devices(job, backend)
    for line in devices:
        job.say(line)
    job.say("#")
    rows, sections = [], []
    for name in s.collectives:
        section_rows, summary = _section(job, name)
        rows += section_rows
        sections.append(summary)
    job.progress.clear()
    if job.rank == 0:
        _write_outputs(s, rows, sections, {"backend": backend, "nranks": job.nranks, "devices": devices})
    return 1 if any(sec["out_of_bounds"] for sec in sections) else 0
