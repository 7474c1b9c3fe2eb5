"""Pricing a traced forward under any layout: seconds and bytes per rank of each choice a plan makes.

A plan gives every parameter a layout and every operator a signature. Its predicted step time is the sum of

- each operator: its local forward and backward (timed at the local shapes the signature gives it,
  ``_optime``) and globalview's overhead per operator; the boxing of each input: forward, its adjoint in
  backward when the input needs a gradient, and a released parameter gathered again for backward. A
  sharded parameter gathered whole (``S(0) -> B`` on one axis) is priced as the weights plan runs it
  (``_weights``): its all_gather and the plan's measured overhead per gather, not a boxing step's, and its
  gradient's reduce_scatter as its share of a bucket's;
- each parameter: its gradient summed over its broadcast mesh axes (the bucketed all-reduce, copies in and
  out for the small ones) and the optimizer's pass over its local part.

Memory per rank: each parameter's part, its gradient and optimizer states (and, summed in buckets, the
bucket's copy); the forward's inputs, held by the caller for the whole step, ``batches`` of them at once (the
step's batch and the next one, as a training loop or a prefetching loader keeps it); the activations autograd
keeps (an operator's saved inputs as it got them, once per tensor, a forward input only when it saved a boxed
copy; its saved output); and the largest transient: a gathered weight's whole copies (it, the next one prefetched,
two gradients on their way to the reduce_scatter), an operator's gradients in backward, an operator's output in
forward beside its input when no operator keeps that (a partial sum on its way to a reduce_scatter) and its boxed
copy, Adam's temporaries. Each tensor counted costs its bytes and the allocator's overhead per tensor, as this
process measured it (``_footprint``: a large tensor is a memory map of whole pages, one more for its header).
Pure given the machine's and the allocator's measurements: no communication.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalview import _ops, _optime
from globalview._cost import _adjoint_bytes, _gathers, _no_gradient, _splits_into_partial
from globalview._cost import _plan as boxing_plan
from globalview._layout import block_shape
from globalview._machine import Machine
from globalview._plan import Plan, adjoint
from globalview._trace import Node, Trace
from globalview._weights import gathered_axis
from globalview.sbp import SbpParallel, broadcast, split

__all__ = ["OPT_PASSES", "Cand", "Pricer", "candidates", "param_layouts"]

Layout = tuple[SbpParallel, ...]
OPT_PASSES = {0: 3, 1: 6, 2: 12}  # memory passes of SGD, SGD with momentum, Adam over each element (read + write)
INPUT_BATCHES = 2  # forward inputs each rank holds at once: the step's batch and the next one
GATHERED = 4  # whole copies of a gathered weight alive at once: it, the next (prefetched), two gradients
BUCKET_BYTES = 25 << 20  # the reducers' buckets: reductions are priced at this size's rate
LONE_BYTES = 4 << 20  # a gradient this large is reduced where it is (no copies into a bucket and back)


@dataclass(frozen=True)
class Cand:
    """One signature of an operator: the layout each tensor input is boxed to, and the output's."""

    inputs: tuple[Layout, ...]
    output: Layout


@dataclass(frozen=True)
class Edge:
    """One input's boxing under one signature: seconds, kept bytes, transient bytes, bytes moved per rank."""

    time: float
    mem: float
    peak: float
    moved: float


def param_layouts(shape: tuple[int, ...], hierarchy: tuple[int, ...]) -> list[Layout]:
    """Every layout a parameter may take: per mesh axis broadcast or a split of a dimension it can fill."""
    per_axis = [[broadcast] + [split(d) for d in range(len(shape)) if shape[d] >= p] for p in hierarchy]
    return [tuple(c) for c in itertools.product(*per_axis)]


def nested(layout: Layout) -> bool:
    return _ops.nested(layout)


def rule_of(node: Node, current: Layout | None = None) -> Any:
    """The operator's signature rule (reshape's depends on its input's layout: none survives a nested split)."""
    if node.call == "reshape":
        return _ops.reshape_rule(node.shapes[0], node.out_shape, current is not None and nested(current))
    return node.op.rule


def candidates(node: Node, hierarchy: tuple[int, ...]) -> list[Cand]:
    """Every admissible signature of ``node`` on a mesh of ``hierarchy`` (per axis, combined)."""
    rule = rule_of(node)
    per_axis = [rule(tuple(lay[a] for lay in node.layouts), p) for a, p in enumerate(hierarchy)]
    out = []
    for combo in itertools.product(*per_axis):
        inputs = tuple(tuple(c[0][i] for c in combo) for i in range(len(node.layouts)))
        if _no_gradient(inputs, node.grads):
            continue
        if node.call == "reshape" and nested(inputs[0]) and any(s.is_split for s in inputs[0]):
            continue
        out.append(Cand(inputs, tuple(c[1] for c in combo)))
    return list(dict.fromkeys(out))


class Pricer:
    """Seconds and bytes of every choice on a trace, with a machine's measurements."""

    def __init__(
        self,
        trace: Trace,
        machine: Machine,
        optimizer_states: int,
        batches: int = INPUT_BATCHES,
        overheads: tuple[tuple[int, float], ...] = (),
        per_operator: float = 0.0,
    ) -> None:
        """``overheads``: (bytes, overhead per tensor) as this process's allocator measured them; ``per_operator``:
        the bytes each operator keeps until backward besides its tensors' data (both from ``_footprint``)."""
        self.trace, self.machine, self.states, self.batches = trace, machine, optimizer_states, batches
        self.overheads, self.per_operator = overheads, per_operator
        self.pl = trace.placement
        self.coords = self.pl.coords(self.pl.flat[0])
        self.ranks = len(self.pl.flat)
        self.owner = self._owners()
        # a search asks the same few questions all through (equal operators of equal blocks share): cached, per
        # pricer (functools.cache on the methods would keep every pricer, and its trace, for good)
        self.local = functools.cache(self._local)
        self.plan_time = functools.cache(self._plan_time)
        self._input = functools.cache(self._input_of)
        self._edge = functools.cache(self._edge_of)

    def _owners(self) -> dict[str, int]:
        """The node whose cost counts a tensor's saved storage: its producer if it saves it, else its first saver."""
        owner = {}
        for node in self.trace.nodes:
            if node.out_saved:
                owner[f"node:{node.index}"] = node.index
            for src, saved in zip(node.sources, node.saved, strict=True):
                if saved:
                    owner.setdefault(src, node.index)
        return owner

    # -- sizes -------------------------------------------------------------------------------
    def _local(self, shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
        """The first rank's part (the largest, under uneven splits)."""
        return block_shape(shape, self.pl.hierarchy, layout, self.coords)

    def footprint(self, nbytes: float) -> float:
        """Resident bytes of a tensor of ``nbytes``: its bytes and the allocator's overhead at the largest measured
        size at or below them (the smallest measured size's for smaller ones; none for an empty tensor)."""
        if nbytes <= 0 or not self.overheads:
            return float(nbytes)
        extra = self.overheads[0][1]
        for size, over in self.overheads:
            if size <= nbytes:
                extra = over
        return float(nbytes) + extra

    def nbytes(self, shape: tuple[int, ...], layout: Layout, dtype: Any) -> int:
        return math.prod(self.local(shape, layout)) * np.dtype(dtype).itemsize

    # -- boxing ------------------------------------------------------------------------------
    def _plan_time(self, p: Plan) -> float:
        """Seconds of one boxing plan on the slowest line: each collective at its per-rank buffer size."""
        total = 0.0
        for s in p.steps:
            if s.kind == "relabel":
                continue
            if not s.is_collective:
                total += self.machine.copy(self.nbytes(p.shape, s.dst, p.dtype))
                continue
            size = s.placement.hierarchy[s.axis]
            lines = len(s.placement.flat) // size
            per_line = s.nbytes / lines
            buffer = per_line / (2 * (size - 1)) if s.kind == "all_reduce" else per_line / (size - 1)
            total += self.machine.collective(s.kind, size, buffer)
        return total

    def weights_gather(self, shape: tuple[int, ...], dtype: Any, p: Plan) -> float:
        """Seconds of a sharded parameter's gather by the weights plan: the collective and the plan's own overhead
        (its calls go to commlib directly, prefetched: not a boxing step's)."""
        axis = gathered_axis(p)
        size = self.pl.hierarchy[axis]
        whole = self.nbytes(shape, p.dst[1], dtype)
        return self.machine.collective("all_gather", size, whole, boxing=False) + self.machine.gather_overhead

    def bucketed_scatter(self, shape: tuple[int, ...], dtype: Any, p: Plan) -> float:
        """Seconds of a gathered parameter's gradient reduce_scatter in the weights plan's buckets: its share of a
        bucket's collective (at a bucket's rate), and the copy into the bucket for the small ones."""
        size = self.pl.hierarchy[gathered_axis(p)]
        whole = self.nbytes(shape, p.dst[1], dtype)
        m = self.machine
        t = m.collective("reduce_scatter", size, BUCKET_BYTES, boxing=False) * whole / BUCKET_BYTES
        return t + (2 * whole / m.bandwidth if whole < LONE_BYTES else 0.0)

    def edge(self, index: int, i: int, src: Layout, dst: Layout) -> Edge:
        """Input ``i`` of node ``index`` boxed from ``src`` to ``dst``: forward, backward, kept and transient bytes."""
        return self._edge(self._input(index, i), src, dst)

    def _input_of(self, index: int, i: int) -> tuple:
        """What prices input ``i`` of node ``index``'s boxing, besides the two layouts."""
        node = self.trace.nodes[index]
        others = any(g for j, g in enumerate(node.grads) if j != i)
        source = node.sources[i]
        owns = self.owner.get(source) == index and not source.startswith("input:")  # inputs: see held()
        dies = source.startswith("node:") and source not in self.owner  # kept by no operator: freed after its use
        return (node.shapes[i], node.dtypes[i], node.grads[i], node.params[i], node.saved[i], others, owns, dies)

    def _edge_of(self, what: tuple, src: Layout, dst: Layout) -> Edge:
        shape, dtype, grad, param, saved, others, owns, dies = what
        if _splits_into_partial((src,), (dst,)):
            return Edge(math.inf, 0.0, 0.0, 0.0)
        p = boxing_plan(shape, dtype, self.pl, src, dst)
        weights = param and gathered_axis(p) is not None  # the weights plan runs it (_weights), not boxing
        gather = self.weights_gather(shape, dtype, p) if weights else self.plan_time(p)
        t, moved = gather, p.nbytes
        if grad and p.steps:
            t += self.bucketed_scatter(shape, dtype, p) if weights else sum(self.plan_time(q) for q in adjoint(p))
            moved += _adjoint_bytes(p)
        released = param and _gathers(p) and others
        mem = 0.0
        if released and saved:
            t, moved = t + gather, moved + p.nbytes
        elif saved and p.steps:
            mem = self.footprint(self.nbytes(shape, dst, dtype))
        elif saved and not param and owns:
            mem = self.footprint(self.nbytes(shape, src, dtype))
        if param and _gathers(p):
            peak = GATHERED * self.nbytes(shape, dst, dtype)
        else:  # while the operator runs forward: the input as it came, when no operator keeps it, and its boxed copy
            copied = any(s.kind != "relabel" for s in p.steps)
            peak = (self.nbytes(shape, src, dtype) if dies else 0.0) + (
                self.nbytes(shape, dst, dtype) if copied and not saved else 0.0
            )
        return Edge(t, mem, peak, moved / self.ranks)

    def held(self) -> float:
        """Bytes each rank holds through a step whatever the plan: ``batches`` batches of the forward's inputs (the
        caller keeps the step's batch, in its own layout, split(0), however the operators box it, and the next)
        and each operator's own objects kept until backward (``per_operator``)."""
        leaves = [t for src, t in self.trace.leaves.items() if src.startswith("input:")]
        inputs = self.batches * sum(self.footprint(self.nbytes(t.shape, t.layout, t.dtype)) for t in leaves)
        return inputs + self.per_operator * len(self.trace.nodes)

    # -- operators ---------------------------------------------------------------------------
    def shapes(self, node: Node, cand: Cand) -> tuple[tuple[int, ...], ...]:
        return tuple(self.local(s, lay) for s, lay in zip(node.shapes, cand.inputs, strict=True))

    def timing_key(self, node: Node, cand: Cand) -> str:
        return _optime.key(node, self.shapes(node, cand))

    def compute(self, node: Node, cand: Cand) -> float:
        """Seconds of the operator's local work and globalview's overhead, forward and backward."""
        fwd, bwd = self.machine.ops.get(self.timing_key(node, cand), (0.0, 0.0))
        over_f, over_b = self.machine.op_overhead
        grad = any(node.grads)
        return fwd + over_f + ((bwd + over_b) if grad else 0.0)

    def transient(self, node: Node, cand: Cand) -> float:
        """Bytes alive for a moment in the operator's backward (its output's gradient and its inputs'), or in its
        forward (its output, when no operator keeps it; each input's part is its edge's peak, see :meth:`edge`)."""
        forward = self.forward_out(node, cand)
        if not any(node.grads):
            return forward
        out = math.prod(self.local(node.out_shape, cand.output)) * node.out_dtype.itemsize
        inputs = zip(node.shapes, cand.inputs, node.dtypes, node.grads, strict=True)
        ins = sum(self.nbytes(s, lay, d) for s, lay, d, g in inputs if g)
        return float(max(out + ins, forward))

    def forward_out(self, node: Node, cand: Cand) -> float:
        """Bytes of the operator's output while it runs forward, beside its inputs (0 when kept: counted in kept)."""
        if node.out_saved:
            return 0.0
        return float(math.prod(self.local(node.out_shape, cand.output)) * node.out_dtype.itemsize)

    def kept(self, node: Node, cand: Cand) -> float:
        """Bytes the operator itself keeps for backward: its output (if saved) and its other saved tensors."""
        numel = math.prod(self.local(node.out_shape, cand.output))
        out = self.footprint(numel * node.out_dtype.itemsize) if node.out_saved else 0.0
        return out + node.extra_saved * numel

    # -- parameters --------------------------------------------------------------------------
    def reduced_axes(self, layout: Layout) -> tuple[int, ...]:
        """The mesh axes a parameter's gradient is summed over (broadcast ones with more than one rank)."""
        return tuple(a for a, s in enumerate(layout) if s.is_broadcast and self.pl.hierarchy[a] > 1)

    def bucketed(self, layout: Layout) -> bool:
        """Summed by the bucketed reducer (its buckets copy the gradient) rather than per parameter."""
        sharded = any(s.is_split and s.dim == 0 and self.pl.hierarchy[a] > 1 for a, s in enumerate(layout))
        return bool(self.reduced_axes(layout)) and not sharded

    def step_temporaries(self, name: str, layout: Layout) -> float:
        """Bytes the optimizer's step allocates for a moment for this parameter (Adam: two of its size)."""
        leaf = self.trace.leaves[f"param:{name}"]
        return 2.0 * self.nbytes(leaf.shape, layout, leaf.dtype) if leaf.grad and self.states == 2 else 0.0

    def param(self, name: str, layout: Layout) -> tuple[float, float, float]:
        """(seconds, persistent bytes, gradient bytes) of a parameter's state per step on each rank."""
        leaf = self.trace.leaves[f"param:{name}"]
        size = self.nbytes(leaf.shape, layout, leaf.dtype)
        if not leaf.grad:
            return 0.0, self.footprint(size), 0.0
        m = self.machine
        step = m.optimizer_step(self.states, size)
        t = m.param_overhead + (OPT_PASSES[self.states] * size / m.bandwidth if step is None else step)
        axes = self.reduced_axes(layout)
        if axes:
            group = math.prod(self.pl.hierarchy[a] for a in axes)
            t += m.collective("all_reduce", group, BUCKET_BYTES, boxing=False) * size / BUCKET_BYTES
            if size < LONE_BYTES:
                t += 2 * size / m.bandwidth
        tensor = self.footprint(size)  # the part, its gradient and each optimizer state: a tensor each
        persistent = tensor * (1 + self.states) + (size if self.bucketed(layout) else 0)  # buckets: few, large
        return t, persistent, tensor
