"""FSDP2's schedule for sharded parameters: gathers prefetched, gathered weights freed, gradients bucketed.

A parameter laid out ``split(0)`` along a mesh axis that an operator needs whole along that axis (the
weights plan: ``linear``'s ``S(0) x B -> S(0)`` with its weight ``split(0)``) is gathered along the
axis. A global module's :class:`Gathers` runs those gathers as torch's FSDP2 does:

- forward: the first step records the order of the gathers; from the next one on, when an operator
  takes its gathered parameter the next gather in that order is started (asynchronous), so it moves
  while this operator computes;
- the gathered parameter is freed after its operator: autograd keeps a handle, and backward gathers
  it again when it needs it, prefetched the same way (in the order the first backward asked);
- its gradient (a partial sum along the axis, the whole block) goes into a bucket laid out rank by
  rank (a large one is reduced where it is); the moment a bucket's last gradient arrives its
  reduce_scatter starts, overlapped with the rest of backward. The end of backward waits for them,
  sums broadcast mesh axes with all_reduce (a 2-D layout) and adds each shard to the parameter's ``.grad``.

Every rank runs the same program, so every rank records the same order and issues the same collectives
in the same order. A step that asks for another order (another forward) is served on demand and recorded again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Variable

import commlib
from commlib.arrays import as_array
from globalview import _groups
from globalview._layout import block_shape, split_sizes, without
from globalview._plan import Plan

__all__ = ["Gathers", "gathered_axis"]

BUCKET_MB = 25.0  # reduce_scatter buckets (the whole gradients' bytes), as ddp's all-reduce buckets
LONE_MB = 4.0  # an evenly split gradient this large is reduced where it is (no copy into a bucket)
IN_FLIGHT = 2  # reduce_scatters pending at once (FSDP2 keeps one): each holds its whole gradients


def gathered_axis(p: Plan) -> int | None:
    """The mesh axis ``p`` gathers dimension 0 along, when it does only that (``S(0) -> B`` on one axis)."""
    moves = [s for s in p.steps if s.kind != "relabel"]
    if len(moves) != 1 or moves[0].kind != "all_gather" or p.src[0] != p.dst[0]:
        return None
    s = moves[0]
    return s.axis if s.src[s.axis].is_split and s.src[s.axis].dim == 0 else None


@dataclass
class _Flight:
    """One gather on its way: the output buffer, the pieces' rows, the handle."""

    work: Any
    out: torch.Tensor
    sizes: list[int]


@dataclass(frozen=True)
class _Line:
    """Where one leaf's shard sits on one mesh axis: the group, its ranks, the rows of every piece."""

    group: Any
    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    coord: int
    rest: tuple[int, ...]

    @property
    def width(self) -> int:
        """Elements of the largest piece (every piece is padded to it)."""
        return max(self.sizes) * math.prod(self.rest)


class _Order:
    """The order one pass (forward, or backward) asks for gathers: recorded once, then prefetched one ahead."""

    def __init__(self, start: Callable[[Any], _Flight]) -> None:
        self.start, self.order, self.cursor, self.pending = start, [], 0, {}
        self.recording = True

    def begin(self) -> None:
        """A new pass: drain what the last one prefetched and did not use, replay the recorded order."""
        self.drain()
        self.cursor = 0
        self.recording = not self.order

    def drain(self) -> None:
        for flight in self.pending.values():
            _wait(flight)
        self.pending.clear()

    def take(self, key: Any) -> _Flight:
        """The gather of ``key`` (prefetched or started now); starts the next one in the recorded order."""
        pos, self.cursor = self.cursor, self.cursor + 1
        if not self.recording and pos < len(self.order) and self.order[pos] == key:
            flight = self.pending.pop(pos, None) or self.start(key)
            if pos + 1 < len(self.order) and pos + 1 not in self.pending:
                self.pending[pos + 1] = self.start(self.order[pos + 1])
            return flight
        if not self.recording:  # another order than recorded: serve on demand, record it again
            self.drain()
            self.order, self.recording = self.order[:pos], True
        self.order.append(key)
        return self.start(key)


def _wait(flight: _Flight) -> None:
    if flight.work is not None:
        flight.work.wait()
        flight.work = None


class Gathers:
    """The gathers and reduce_scatters of a global module's sharded parameters (see the module docstring)."""

    def __init__(self, leaves: Sequence[Any], me: int) -> None:
        self.me, self.leaves = me, list(leaves)
        self.index = {id(leaf.param): i for i, leaf in enumerate(self.leaves)}
        self.lines: dict[tuple[int, int], _Line] = {}
        self.sums: dict[int, tuple[Any, tuple[int, ...]]] = {}  # leaf -> group over its broadcast axes
        for i, leaf in enumerate(self.leaves):  # groups are made collectively, here (never mid-backward)
            for axis, s in enumerate(leaf.sbp):
                if s.is_split and s.dim == 0 and leaf.placement.hierarchy[axis] > 1:
                    self.lines[(i, axis)] = self._line(leaf, axis)
            axes = tuple(a for a, s in enumerate(leaf.sbp) if s.is_broadcast and leaf.placement.hierarchy[a] > 1)
            if axes:
                self.sums[i] = _groups.sub_mesh_group(leaf.placement, axes, me)
        self.forward = _Order(self._start)
        self.backward = _Order(self._start)
        self.buckets = _Buckets(self)
        self._in_backward = False

    def _line(self, leaf: Any, axis: int) -> _Line:
        pl = leaf.placement
        group = _groups.line_group(pl, axis, self.me)
        coords = pl.coords(self.me)
        if coords is None:
            return _Line(group, (), (), 0, ())
        t = block_shape(leaf.shape, pl.hierarchy, without(leaf.sbp, axis), coords)
        sizes = tuple(split_sizes(t[0], pl.hierarchy[axis]))
        return _Line(group, pl.line(coords, axis), sizes, coords[axis], tuple(t[1:]))

    # -- what an operator asks for ------------------------------------------------------------
    def takes(self, param: Any, p: Plan) -> tuple[int, int] | None:
        """(leaf, axis) when ``param``'s gather by plan ``p`` runs here; None: the generic boxing runs it."""
        i = self.index.get(id(param))
        if i is None or self.me not in self.leaves[i].placement:
            return None
        axis = gathered_axis(p)
        return (i, axis) if (i, axis) in self.lines and p.src[1] == self.leaves[i].sbp else None

    def begin_forward(self) -> None:
        """The module's forward starts (a pre-hook): replay the recorded order of gathers."""
        self.forward.begin()

    def gather(self, key: tuple[int, int]) -> torch.Tensor:
        """The gathered part of leaf ``key[0]`` along axis ``key[1]``, in forward; its gradient goes to a bucket."""
        flight = self.forward.take(key)
        param = self.leaves[key[0]].param

        def make() -> torch.Tensor:
            return self._finish(key, flight)

        if torch.is_grad_enabled() and param.requires_grad:
            return _Unshard.apply(param, make, self, key)
        return make()

    def regather(self, key: tuple[int, int]) -> torch.Tensor:
        """The gathered part again, in backward (prefetched in the order the first backward asked)."""
        self._enter_backward()
        with _groups.phase("backward"):
            return self._finish(key, self.backward.take(key))

    # -- gathers ---------------------------------------------------------------------------------
    def _start(self, key: tuple[int, int]) -> _Flight:
        line, param = self.lines[key], self.leaves[key[0]].param.detach()
        m = max(line.sizes)
        send = param if line.sizes[line.coord] == m else _padded(param, m)
        out = torch.empty((len(line.sizes) * m, *line.rest), dtype=param.dtype, device=param.device)
        work = commlib.all_gather_into_tensor(as_array(out), as_array(send), group=line.group, async_op=True)
        _groups.note("all_gather", line.ranks, out.numel() * out.element_size())
        return _Flight(work, out, list(line.sizes))

    def _finish(self, key: tuple[int, int], flight: _Flight) -> torch.Tensor:
        _wait(flight)
        m, sizes, out = max(flight.sizes), flight.sizes, flight.out
        if all(s == m for s in sizes):
            return out
        return torch.cat([out[r * m : r * m + s] for r, s in enumerate(sizes)])

    # -- backward --------------------------------------------------------------------------------
    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self.backward.begin()
            Variable._execution_engine.queue_callback(self._end_backward)

    def reduce(self, key: tuple[int, int], grad: torch.Tensor) -> None:
        """A gathered parameter's gradient (partial along the axis): into its bucket."""
        self._enter_backward()
        with _groups.phase("backward"):
            self.buckets.add(key, grad)

    def _end_backward(self) -> None:
        """End of backward: the buckets' reductions waited for and written to ``.grad``; unused prefetches drained."""
        with _groups.phase("backward"):
            self.buckets.finish()
            self.backward.drain()
        self._in_backward = False


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


class _Unshard(torch.autograd.Function):
    """shard -> its gathered part (made by ``make``); backward hands the gradient to the buckets."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, make: Callable[[], torch.Tensor], owner: Gathers, key: Any) -> Any:
        ctx.owner, ctx.key = owner, key
        return make()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.owner.reduce(ctx.key, grad)
        return None, None, None, None


class _Buckets:
    """Gradients of gathered parameters, reduce_scattered in buckets in the order backward makes them."""

    def __init__(self, owner: Gathers) -> None:
        self.owner = owner
        self.plan: list[list[Any]] | None = None  # buckets of keys, from the first backward's order
        self.arrived: list[Any] = []
        self.waiting: dict[int, dict[Any, torch.Tensor]] = {}  # bucket -> the gradients it has
        self.flights: list[list[Any]] = []  # [work (None once done), keys, out, arrived keys]

    def _bucket_of(self, key: Any) -> int | None:
        for b, keys in enumerate(self.plan or ()):
            if key in keys:
                return b
        return None

    def add(self, key: Any, grad: torch.Tensor) -> None:
        self.arrived.append(key)
        b = None if self.plan is None else self._bucket_of(key)
        if b is None or key in self.waiting.get(b, {}):
            self._issue([key], {key: grad})
            return
        have = self.waiting.setdefault(b, {})
        have[key] = grad
        if len(have) == len(self.plan[b]):
            self._issue(self.plan[b], self.waiting.pop(b))

    def _issue(self, keys: list[Any], grads: dict[Any, torch.Tensor]) -> None:
        """Start one reduce_scatter over the keys' line (lone: from the gradient itself)."""
        line = self.owner.lines[keys[0]]
        p = len(line.sizes)
        widths = [self.owner.lines[k].width for k in keys]
        first = next(iter(grads.values()))
        lone = len(keys) == 1 and keys[0] in grads and _even(line) and grads[keys[0]].is_contiguous()
        if lone:
            inp = grads[keys[0]]
        else:
            inp = torch.zeros((p, sum(widths)), dtype=first.dtype, device=first.device)
            off = 0
            for k, w in zip(keys, widths, strict=True):
                if k in grads:
                    _scatter_rows(inp[:, off : off + w], grads[k], self.owner.lines[k])
                off += w
        out = torch.empty(inp.numel() // p, dtype=inp.dtype, device=inp.device)
        work = commlib.reduce_scatter_tensor(as_array(out), as_array(inp.reshape(-1)), group=line.group, async_op=True)
        _groups.note("reduce_scatter", line.ranks, inp.numel() * inp.element_size())
        self.flights.append([work, keys, out, set(grads)])
        self._limit()

    def _limit(self) -> None:
        """At most ``IN_FLIGHT`` reduce_scatters pending (each holds a whole gradient): wait for the oldest."""
        pending = [f for f in self.flights if f[0] is not None]
        for f in pending[: max(0, len(pending) - IN_FLIGHT)]:
            f[0].wait()
            f[0] = None

    def finish(self) -> None:
        """Issue what is incomplete (zeros for the missing), wait in issue order, sum broadcast axes, write .grad."""
        for b in sorted(self.waiting):
            self._issue(self.plan[b], self.waiting[b])
        self.waiting.clear()
        sums = []
        for f in self.flights:
            if f[0] is not None:
                f[0].wait()
                f[0] = None
            sums += self._sum_broadcast(f[1], f[2])
        for work in sums:
            work.wait()
        for _, keys, out, present in self.flights:
            self._write(keys, out, present)
        if self.plan is None and self.arrived:
            self.plan = _plan_buckets(self.arrived, self.owner)
        self.flights, self.arrived = [], []

    def _sum_broadcast(self, keys: list[Any], out: torch.Tensor) -> list[Any]:
        """All-reduce the reduced shards over the leaves' broadcast mesh axes (a 2-D layout's data parallel axis)."""
        group = self.owner.sums.get(keys[0][0])
        if group is None:
            return []
        work = commlib.all_reduce(as_array(out), group=group[0], async_op=True)
        _groups.note("all_reduce", group[1], out.numel() * out.element_size())
        return [work] if work is not None else []

    def _write(self, keys: list[Any], out: torch.Tensor, present: set[Any]) -> None:
        """Each arrived key's shard (a view of the bucket's output) into its parameter's ``.grad``."""
        off = 0
        for k in keys:
            line, param = self.owner.lines[k], self.owner.leaves[k[0]].param
            rows = line.sizes[line.coord]
            shard = out[off : off + rows * math.prod(line.rest)].view(rows, *line.rest)
            off += line.width
            if k not in present:
                continue
            with torch.no_grad():
                if param.grad is None:
                    param.grad = shard
                else:
                    param.grad.add_(shard)


def _even(line: _Line) -> bool:
    return len(set(line.sizes)) == 1


def _scatter_rows(dst: torch.Tensor, grad: torch.Tensor, line: _Line) -> None:
    """Rank r's rows of ``grad`` into row r of ``dst`` (padded pieces)."""
    lo = 0
    width = math.prod(line.rest)
    for r, rows in enumerate(line.sizes):
        dst[r, : rows * width] = grad[lo : lo + rows].reshape(-1)
        lo += rows


def _plan_buckets(order: list[Any], owner: Gathers) -> list[list[Any]]:
    """Consecutive arrivals on one line and dtype, up to ``BUCKET_MB``; a large even gradient alone."""
    buckets: list[list[Any]] = []
    size, cap, lone = 0, BUCKET_MB * (1 << 20), LONE_MB * (1 << 20)
    seen: set[Any] = set()
    for key in order:
        if key in seen:  # a parameter used twice: its second gradient goes alone
            continue
        seen.add(key)
        line, leaf = owner.lines[key], owner.leaves[key[0]]
        nbytes = line.width * len(line.sizes) * leaf.param.element_size()
        same = buckets and _compatible(buckets[-1][-1], key, owner)
        if nbytes >= lone and _even(line):
            buckets.append([key])
            size = cap  # nothing joins a lone bucket
        elif same and size + nbytes <= cap:
            buckets[-1].append(key)
            size += nbytes
        else:
            buckets.append([key])
            size = nbytes
    return buckets


def _compatible(a: Any, b: Any, owner: Gathers) -> bool:
    la, lb = owner.lines[a], owner.lines[b]
    pa, pb = owner.leaves[a[0]], owner.leaves[b[0]]
    return (
        la.ranks == lb.ranks
        and pa.param.dtype == pb.param.dtype
        and owner.sums.get(a[0], (None, ()))[1] == owner.sums.get(b[0], (None, ()))[1]
    )
