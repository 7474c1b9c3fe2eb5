"""The machine the automatic planner prices plans on: collectives measured, operators timed, cached.

:func:`fit` measures, collectively on every rank of a placement, how long commlib's collectives take
(all_gather, reduce_scatter, all_reduce, all_to_all) over groups of each size the placement's mesh lines and
sub-meshes form, at sizes from 4 KiB, 8 times apart, up to the model's largest tensor (128 MiB at most; a
larger model later completes the table), and what globalview itself adds per operator, per boxing step, per
gather of the weights plan and per parameter (Python, autograd hooks), memory bandwidth and the optimizer's
step. :meth:`Machine.collective` interpolates the measured times (log-log between sizes, in proportion beyond
the largest). Every rank measures at once (as a training step runs), and the slowest rank's times are kept:
the step waits for it. Each measurement is the least of several runs (``_least``): other jobs on a shared
machine only ever add time, and the plan is priced for the machine, not for their load. Computation is timed
in this process's CPU seconds when torch runs one thread (:func:`clock`): other jobs on a shared machine
stretch wall-clock times, not those.

The results are cached in a JSON file (``GLOBALVIEW_CACHE``, default ``~/.cache/globalview/machine.json``),
keyed by the host, the world and torch's thread count; operator timings (``_optime``) go in the same file.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import commlib
from globalview import _groups
from globalview._placement import placement as Placement

__all__ = ["KINDS", "Machine", "cache_path", "fit"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 21, 1 << 24, 1 << 27)  # bytes of each rank's buffer (x8 apart)
REPEATS = 5
VERSION = 4  # of the measurements' method: a cache of another version is measured again


def cache_path() -> Path:
    """Where measurements are kept: ``$GLOBALVIEW_CACHE`` or ``~/.cache/globalview/machine.json``."""
    return Path(commlib.setting("GLOBALVIEW_CACHE") or Path.home() / ".cache" / "globalview" / "machine.json")


@dataclass
class Machine:
    """Measured seconds: collectives by (kind, group size), globalview's own overheads, memory bandwidth."""

    key: str
    comm: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # "kind/p" -> [(bytes, seconds)]
    op_overhead: tuple[float, float] = (0.0, 0.0)  # per operator: forward, backward
    step_overhead: float = 0.0  # per boxing step, beside its collective
    param_overhead: float = 0.0  # per parameter and step: globalview's gradient hooks
    gather_overhead: float = 0.0  # per gather of the weights plan (_weights: prefetched, no boxing machinery)
    bandwidth: float = 1e10  # bytes per second of a memory-bound pass (read + write)
    # states -> (s per parameter, ((bytes of a parameter, s per byte), ...)): see _optimizer
    optimizer: dict[str, tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=dict)
    ops: dict[str, tuple[float, float]] = field(default_factory=dict)  # timed operators (see _optime)

    def collective(self, kind: str, p: int, nbytes: float, boxing: bool = True) -> float:
        """Seconds of one ``kind`` collective over ``p`` ranks, each rank's buffer ``nbytes`` (see the docstring);
        ``boxing``: with globalview's overhead per boxing step (not for the weights plan's and buckets' calls)."""
        if p <= 1 or nbytes <= 0:
            return 0.0
        extra = self.step_overhead if boxing else 0.0
        points = self.comm.get(f"{kind}/{p}") or self.comm.get(f"{kind}/2") or [(1, 0.0)]
        if nbytes >= points[-1][0]:
            return points[-1][1] * nbytes / points[-1][0] + extra
        sizes, secs = _logs(tuple(points))
        return math.exp(float(np.interp(math.log(max(nbytes, 1)), sizes, secs))) + extra

    def optimizer_step(self, states: int, nbytes: float) -> float | None:
        """Seconds of the optimizer's step (``states`` states per element) over one parameter of ``nbytes``: per
        parameter, and per byte at the rate measured for parameters of that size (log-log between the sizes
        measured, the nearest beyond them); None: not measured."""
        got = self.optimizer.get(str(states))
        if got is None:
            return None
        per_param, rates = got
        sizes, per_byte = _logs(rates)
        rate = math.exp(float(np.interp(math.log(max(nbytes, 1)), sizes, per_byte)))
        return per_param + rate * nbytes

    def copy(self, nbytes: float) -> float:
        """Seconds to read and write ``nbytes`` once (a local boxing step: slice, zero, fill)."""
        return nbytes / self.bandwidth + (self.step_overhead if nbytes else 0.0)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "key"}


@functools.lru_cache(maxsize=64)
def _logs(points: tuple) -> tuple[np.ndarray, np.ndarray]:
    return np.log([b for b, _ in points]), np.log([max(s, 1e-15) for _, s in points])  # s: seconds, or per byte


def clock() -> float:
    """This process's CPU seconds when torch computes on one thread (other jobs on the machine do not stretch
    them, as they stretch a wall clock); with more threads, the wall clock (CPU seconds would add them up)."""
    import torch

    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _fingerprint(pl: Placement) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    world = commlib.get_world_size()
    threads = torch.get_num_threads()
    return f"{platform.node()}|{cpu}|world {world}|mesh {pl.hierarchy}|threads {threads}|v{VERSION}"


def _load(key: str) -> dict[str, Any] | None:
    try:
        return json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError):
        return None


def save(machine: Machine) -> None:
    """Write ``machine`` into the cache file (rank 0 only; other entries kept)."""
    if commlib.get_rank() != 0:
        return
    path = cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        data = {}
    data[machine.key] = machine.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # jobs on one machine share the file: a name each
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def fit(pl: Placement, largest: int = SIZES[-1], refresh: bool = False) -> Machine:
    """The machine as this placement sees it, collectives measured up to the first size of at least ``largest``
    bytes (a model's largest tensor): from the cache, completed or measured now (collective: every rank calls it)."""
    key = _fingerprint(pl)
    box: list[Any] = [None if refresh else _load(key)]
    commlib.broadcast_object_list(box, src=0)  # every rank prices with rank 0's numbers
    sizes = [n for n in SIZES if n < largest] + [next((n for n in SIZES if n >= largest), SIZES[-1])]
    if box[0] is None:
        machine = Machine(key, _measure_comm(pl, sizes))
        machine.bandwidth = _slowest(_bandwidth())
        machine.op_overhead, machine.step_overhead, machine.param_overhead = _overheads(pl, machine)
        machine.gather_overhead = _gather_overhead(pl, machine)
        machine.optimizer = {str(k): _optimizer(k) for k in (0, 1, 2)}
        save(machine)
        return machine
    data = box[0]
    comm = {k: [tuple(x) for x in v] for k, v in data.pop("comm").items()}
    ops = {k: tuple(v) for k, v in data.pop("ops", {}).items()}
    data["op_overhead"] = tuple(data["op_overhead"])
    data["optimizer"] = {k: (v[0], tuple(tuple(x) for x in v[1])) for k, v in data.get("optimizer", {}).items()}
    machine = Machine(key, comm, ops=ops, **data)
    have = max((b for points in comm.values() for b, _ in points), default=0)
    if sizes[-1] > have:  # a larger model than measured for: the larger sizes now
        more = _measure_comm(pl, [n for n in sizes if n > have])
        machine.comm = {k: comm.get(k, []) + more[k] for k in more}
        save(machine)
    return machine


def _slowest(value: float, op: Any = None) -> float:
    """The value of the slowest rank (the largest time; for a bandwidth, the smallest)."""
    a = np.array([value], np.float64)
    commlib.all_reduce(a, op=op or commlib.ReduceOp.MIN)
    return float(a[0])


def _groups_by_size(pl: Placement) -> dict[int, Any]:
    """One group of this rank per size among the mesh's lines and its whole mesh (made on every rank)."""
    me, out = commlib.get_rank(), {}
    for axis in range(pl.ndim):
        group = _groups.line_group(pl, axis, me)
        out.setdefault(pl.hierarchy[axis], group)
    if pl.ndim > 1:
        out.setdefault(len(pl.flat), _groups.sub_mesh_group(pl, tuple(range(pl.ndim)), me)[0])
    return {p: g for p, g in out.items() if p > 1}


def _measure_comm(pl: Placement, sizes: list[int]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for p, group in sorted(_groups_by_size(pl).items()):
        for kind in KINDS:
            out[f"{kind}/{p}"] = [(n, _time_collective(kind, p, n, group)) for n in sizes]
    return out


def _time_collective(kind: str, p: int, nbytes: int, group: Any) -> float:
    """Seconds of one collective with ``nbytes`` per rank's buffer, slowest rank: the least of several runs after
    two warm-up calls, on :func:`clock` (CPU seconds, as operators are timed: a waiting rank spins, so on an idle
    machine they are the wall clock). On a shared machine a rank descheduled mid-call stretches the wall clock by
    time slices (4 ms) that are not the collective's: a median of wall-clock runs priced a 4 KiB all_gather at
    8 ms and a 16 MiB one at 5x its CPU seconds, so hand-written plans came out 3-18x over their step times."""
    n = max(p, nbytes // 4 // p * p)
    whole, piece = np.ones(n, np.float32), np.ones(n // p, np.float32)
    out = np.empty(n, np.float32)
    run: dict[str, Callable[[], Any]] = {
        "all_gather": lambda: commlib.all_gather_into_tensor(out, piece, group=group),
        "reduce_scatter": lambda: commlib.reduce_scatter_tensor(piece, whole, group=group),
        "all_reduce": lambda: commlib.all_reduce(whole, group=group),
        "all_to_all": lambda: commlib.all_to_all_single(out, whole, group=group),
    }
    times = []
    for _ in range((REPEATS if nbytes >= 1 << 24 else 3 * REPEATS) + 2):
        commlib.barrier(group=group)
        start = clock()
        run[kind]()
        times.append(clock() - start)
    return _slowest(min(times[2:]), commlib.ReduceOp.MAX)


def _cache_bytes() -> int:
    """Bytes of this CPU's largest cache (Linux's sysfs), 32 MiB where it does not say."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=32 << 20)


def _scratch() -> np.ndarray:
    """What :func:`_evict` writes: as many bytes as the largest cache (at most 256 MiB)."""
    return np.zeros(min(_cache_bytes(), 256 << 20) // 4, np.float32)


def _evict(scratch: np.ndarray) -> None:
    """Caches as a training step's computation leaves them between two collectives: each rank writes as many
    bytes as the largest cache (which the ranks of a node share), about 1 ms. On this project's machine (32 MiB
    L3, 2 ranks) a tiny conversion then took 134 us against 32 in a loop of them, and 90-230 us inside the GPT's
    steps; twice the cache each took 215 us, half of it 49 us."""
    scratch += 1.0


def _bandwidth() -> float:
    """Bytes per second of ``a += b`` on 16 MiB float32 tensors (read two, write one)."""
    import torch

    a, b = torch.ones(1 << 22), torch.ones(1 << 22)
    times = []
    for _ in range(6):
        start = clock()
        a.add_(b)
        times.append(clock() - start)
    return 3 * a.numel() * 4 / float(np.median(times[1:]))


def _overheads(pl: Placement, machine: Machine) -> tuple[tuple[float, float], float, float]:
    """globalview's own seconds per operator (forward, backward), per boxing step, and per parameter."""
    op = _op_overhead(pl)
    return op, _step_overhead(pl, machine), _param_overhead(pl, op)


def _relus(x: Any, chain: int) -> Callable[[], tuple[float, float]]:
    """A chain of ``chain`` relus from ``x`` (global or local), forward then backward: the two times."""
    import torch

    def run() -> tuple[float, float]:
        start = clock()
        y = x
        for _ in range(chain):
            y = torch.nn.functional.relu(y)  # through __torch_function__, as a module's forward calls it
        mid = clock()
        (y.to_local() if hasattr(y, "to_local") else y).sum().backward()
        return mid - start, clock() - mid

    return run


def _op_overhead(pl: Placement) -> tuple[float, float]:
    """Per operator: forward beside torch's own (which operator timings count); backward, each operator's node
    beyond a backward() call's own cost (operator timings count their kernels and one call, a step pays it once)."""
    import torch

    from globalview._create import zeros
    from globalview.sbp import split

    chain = 16
    x = zeros(2 * len(pl.flat), 2, dtype=torch.float32, placement=pl, sbp=(split(0),) * pl.ndim).requires_grad_()
    fwd, bwd = _least(_relus(x, chain), 15)
    local, _ = _least(_relus(torch.zeros(2, 2, requires_grad=True), chain), 7)
    fwd, bwd = max(0.0, fwd - local) / chain, max(0.0, bwd - engine()) / chain
    return _slowest(fwd, commlib.ReduceOp.MAX), _slowest(bwd, commlib.ReduceOp.MAX)


def _step_overhead(pl: Placement, machine: Machine) -> float:
    """Per boxing step, beside its collective: a tiny conversion to broadcast, less the measured collectives, each
    conversion after :func:`_evict` (untimed). Inside a training step an operator's computation comes between two
    conversions and leaves globalview's own code and objects out of the caches: the GPT's tensor-parallel steps
    paid 90-250 us per boxing step where conversions timed in a loop priced 35 (and were 0.7x their step time)."""
    import torch

    from globalview._create import zeros
    from globalview.sbp import broadcast, split

    x = zeros(2 * len(pl.flat), 2, dtype=torch.float32, placement=pl, sbp=(split(0),) * pl.ndim)
    b = (broadcast,) * pl.ndim
    scratch = _scratch()

    def boxing() -> tuple[float, float]:
        _evict(scratch)
        commlib.barrier()
        start = clock()
        x.to_global(sbp=b)
        return clock() - start, 0.0

    raw = sum(machine.collective("all_gather", pl.hierarchy[a], 16) for a in range(pl.ndim))
    step = max(0.0, _typical(boxing, 21)[0] - raw) / max(1, pl.ndim)
    return _slowest(step, commlib.ReduceOp.MAX)


def _param_overhead(pl: Placement, op_overhead: tuple[float, float]) -> float:
    """Seconds per parameter per step of globalview's gradient hooks and reductions: a stack of tiny Linear
    layers, broadcast (data parallel), trained forward and backward, beside the same stack, local."""
    import torch

    from globalview.nn import to_global
    from globalview.sbp import split

    layers = 16

    def stack() -> Any:
        return torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(layers)))

    def timer(model: Any, x: Any) -> Callable[[], tuple[float, float]]:
        def step() -> tuple[float, float]:
            start = clock()
            model(x).sum().backward()
            return clock() - start, 0.0

        return step

    from globalview._tensor import to_global as make_global

    x = torch.zeros(2, 2)
    local = _least(timer(stack(), x), 15)[0]
    model = to_global(stack(), pl)
    glob = _least(timer(model, make_global(x, pl, (split(0),) * pl.ndim)), 15)[0]
    ops = 2 * layers + 1  # linear and its bias's add per layer, the sum
    rest = glob - local - ops * (op_overhead[0] + op_overhead[1])
    return _slowest(max(0.0, rest) / (2 * layers), commlib.ReduceOp.MAX)


def _gather_overhead(pl: Placement, machine: Machine) -> float:
    """Seconds per gather of the weights plan beside its collective: a stack of tiny Linear layers fully sharded
    (each weight gathered in forward and again in backward, each bias in forward; gradients bucketed) beside the
    same stack data parallel, less the gathers' measured collectives. Between two layers, forward and backward,
    the caches are left as a layer's computation leaves them (:func:`_evict`, its time not counted), as for
    :func:`_step_overhead`."""
    import torch

    from globalview._tensor import to_global as make_global
    from globalview.nn import to_global
    from globalview.sbp import broadcast, split

    layers, width = 8, 2 * len(pl.flat)
    x = make_global(torch.zeros(2, width), pl, (split(0),) * pl.ndim)
    scratch, spent = _scratch(), [0.0]

    def evict() -> None:
        start = clock()
        _evict(scratch)
        spent[0] += clock() - start

    class Evicting(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: Any) -> Any:
            evict()
            return t.view_as(t)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            evict()
            return g

    class Gap(torch.nn.Module):  # a layer's computation between two layers: caches evicted, forward and backward
        def forward(self, t: Any) -> Any:
            return t._like(Evicting.apply(t._local))

    def timer(sbp: Any) -> Callable[[], tuple[float, float]]:
        stack = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), Gap())]
        model = to_global(torch.nn.Sequential(*stack), pl, sbp)

        def step() -> tuple[float, float]:
            spent[0] = 0.0
            commlib.barrier()
            start = clock()
            model(x).sum().backward()
            return clock() - start - spent[0], 0.0

        return step

    sharded, replicated = timer((split(0),) * pl.ndim), timer((broadcast,) * pl.ndim)

    def difference() -> tuple[float, float]:  # the two stacks in turn: what drifts between runs drifts in both
        return sharded()[0] - replicated()[0], 0.0

    gathers = 3 * layers - 1  # weights in forward and again in backward (not the first: its input needs none), biases
    raw = sum(machine.collective("all_gather", p, 4.0 * width * width, boxing=False) for p in pl.hierarchy)
    return _slowest(max(0.0, _typical(difference, 11)[0] / gathers - raw), commlib.ReduceOp.MAX)


OPT_SIZES = (1 << 20, 1 << 22, 1 << 23, 1 << 24)  # bytes of the parameters the optimizer's per-byte rate is timed at


def _optimizer(states: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(seconds per parameter, ((bytes, seconds per byte), ...)) of a torch optimizer's step with ``states`` states
    per element (0: SGD, 1: SGD with momentum, 2: AdamW): many tiny tensors, then tensors of each of
    :data:`OPT_SIZES` (8 MiB of them at least). The rate per byte depends on a parameter's size: AdamW took 0.4 ns
    a byte over 4 MiB parameters and 1.4 over one of 16 MiB (whose states and gradient no longer fit the 32 MiB
    cache), so a plan that halves the parameters more than halves the step (the wide MLP's tensor-parallel
    step was priced 1.3x its time at one rate)."""
    import torch

    def make(sizes: list[int]) -> Any:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        for p in params:
            p.grad = torch.ones_like(p)
        if states == 2:
            return torch.optim.AdamW(params, lr=1e-3, foreach=False)
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if states else 0.0, foreach=False)

    def timer(opt: Any) -> Callable[[], tuple[float, float]]:
        def step() -> tuple[float, float]:
            start = clock()
            opt.step()
            return clock() - start, 0.0

        return step

    per_param = _slowest(_least(timer(make([4] * 64)), 7)[0] / 64, commlib.ReduceOp.MAX)
    rates = []
    for size in OPT_SIZES:
        count = max(1, (8 << 20) // size)
        spent = _least(timer(make([size // 4] * count)), 3)[0]
        rates.append((size, _slowest(max(1e-13, spent / count - per_param) / size, commlib.ReduceOp.MAX)))
    return per_param, tuple(rates)


def engine() -> float:
    """Seconds a ``backward()`` call over one tiny operator costs (a step pays the call once, not per operator)."""
    import torch

    x = torch.zeros(1, requires_grad=True)

    def once() -> tuple[float, float]:
        y = x * 1.0
        start = clock()
        y.backward()
        return clock() - start, 0.0

    return _least(once, 15)[0]


def _runs(fn: Callable[[], tuple[float, float]], n: int) -> np.ndarray:
    """``n`` runs of ``fn`` after one warm-up: an ``(n, 2)`` array."""
    fn()
    return np.array([fn() for _ in range(n)], np.float64)


def _typical(fn: Callable[[], tuple[float, float]], n: int) -> tuple[float, float]:
    """The median of ``n`` runs of ``fn`` (after one warm-up), per component: for what is timed with the caches
    evicted (:func:`_evict`), whose runs differ by what stayed in the caches, not by other jobs' time slices (CPU
    seconds do not count those): the least of 11 runs put a boxing step's overhead at 114-188 us over three
    measurements of the same machine, the median of 21 at 129-175 over eight."""
    fwd, bwd = np.median(_runs(fn, n), axis=0)
    return float(fwd), float(bwd)


def _least(fn: Callable[[], tuple[float, float]], n: int) -> tuple[float, float]:
    """The least of ``n`` runs of ``fn`` (after one warm-up), per component: the machine's cost. On a shared
    machine a run during which a rank was descheduled waits out its peer's time slice, spinning; a median of a
    few runs kept that (a boxing step's overhead measured at 0.7 ms, its cost on an idle machine 0.1 ms)."""
    fwd, bwd = _runs(fn, n).min(axis=0)
    return float(fwd), float(bwd)
