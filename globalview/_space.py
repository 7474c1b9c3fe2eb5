"""The plans of a traced forward: their variables and factors for the search, and the price of any one plan.

Variables are the layout of every parameter (``_price.param_layouts``) and of every operator's output (the
outputs its signatures give); forward inputs, buffers and constants keep their layout. Each operator is a
factor over its inputs' variables and its output's: one candidate per signature. Each parameter is a factor
of its own: its layout's state, gradient sum and optimizer step. :class:`Assignment` is one plan;
:meth:`Space.price` breaks its predicted time and memory down per operator and parameter, and
:meth:`Space.greedy` is the plan globalview's operators choose at run time for given parameter layouts
(each the fewest bytes, ``_cost.choose``): how the hand-written layouts run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from globalview import _cost
from globalview._price import Cand, Pricer, candidates, param_layouts, rule_of
from globalview._search import Factor, Result
from globalview.sbp import SbpParallel

__all__ = ["Assignment", "Breakdown", "Space"]

Layout = tuple[SbpParallel, ...]


@dataclass
class Assignment:
    """One plan: every parameter's layout and every operator's signature."""

    layouts: dict[str, Layout]
    cands: list[Cand]


@dataclass
class Breakdown:
    """A plan's predicted seconds and bytes per rank, per operator and per parameter, and in total."""

    node_time: list[float] = field(default_factory=list)  # compute + boxing
    node_comm: list[float] = field(default_factory=list)  # of which boxing
    node_moved: list[float] = field(default_factory=list)  # bytes each rank receives (forward + backward)
    node_mem: list[float] = field(default_factory=list)  # activations kept for backward
    peak: float = 0.0  # the largest transient in forward and backward (gathered weights, an operator's gradients)
    param_time: dict[str, float] = field(default_factory=dict)
    param_mem: dict[str, float] = field(default_factory=dict)  # the part, optimizer states, bucket copy
    param_grad: dict[str, float] = field(default_factory=dict)
    step_peak: float = 0.0  # the optimizer step's largest temporaries
    held: float = 0.0  # the forward's inputs the caller holds (two batches), the operators' own objects

    @property
    def time(self) -> float:
        """Predicted seconds per training step."""
        return sum(self.node_time) + sum(self.param_time.values())

    def memory(self) -> float:
        """Predicted peak bytes per rank: the parameters' state and gradients, the inputs held, the activations
        kept for backward, and the largest transient (what the search bounds: all of it counted as alive at once)."""
        state = sum(self.param_mem.values()) + sum(self.param_grad.values()) + self.held
        return state + sum(self.node_mem) + max(self.peak, self.step_peak)


class Space:
    """The variables, candidates and factors of a traced forward (see the module docstring)."""

    def __init__(self, pricer: Pricer, fixed: Mapping[str, Layout] | None = None) -> None:
        self.pricer, self.trace = pricer, pricer.trace
        hierarchy = self.trace.placement.hierarchy
        self.var: dict[str, int] = {}
        self.domains: list[list[Layout]] = []
        for src, leaf in self.trace.leaves.items():
            name = src.removeprefix("param:")
            if src.startswith("param:"):
                layouts = [tuple(fixed[name])] if fixed and name in fixed else param_layouts(leaf.shape, hierarchy)
            else:
                layouts = [leaf.layout]
            self._add(src, layouts)
        self.cands = [candidates(node, hierarchy) for node in self.trace.nodes]
        for node, cands in zip(self.trace.nodes, self.cands, strict=True):
            self._add(f"node:{node.index}", sorted({c.output for c in cands}, key=str))

    def _add(self, src: str, layouts: list[Layout]) -> None:
        self.var[src] = len(self.domains)
        self.domains.append(layouts)

    def params(self) -> list[str]:
        return self.trace.params()

    def timing_requests(self) -> dict[str, tuple[Any, tuple]]:
        """Every (operator, local shapes) a candidate needs timed."""
        out = {}
        for node, cands in zip(self.trace.nodes, self.cands, strict=True):
            for c in cands:
                out.setdefault(self.pricer.timing_key(node, c), (node, self.pricer.shapes(node, c)))
        return out

    # -- the search's factors ------------------------------------------------------------------
    def factors(self) -> list[Factor]:
        """One factor per operator (its signatures) and one per parameter (its layouts)."""
        out = [self._node_factor(node, cands) for node, cands in zip(self.trace.nodes, self.cands, strict=True)]
        for name in self.params():
            v = self.var[f"param:{name}"]
            priced = [self.pricer.param(name, lay) for lay in self.domains[v]]
            time = np.array([t for t, _, _ in priced])
            mem = np.array([m + g for _, m, g in priced])
            temp = np.array([self.pricer.step_temporaries(name, lay) for lay in self.domains[v]])
            out.append(Factor((), v, np.arange(len(priced)), time, mem, peak=temp))
        return out

    def _node_factor(self, node: Any, cands: list[Cand]) -> Factor:
        p = self.pricer
        ins = tuple(self.var[s] for s in node.sources)
        out_var = self.var[f"node:{node.index}"]
        outs = {lay: k for k, lay in enumerate(self.domains[out_var])}
        time = np.array([p.compute(node, c) for c in cands])
        mem = np.array([p.kept(node, c) for c in cands])
        transient = np.array([p.transient(node, c) for c in cands])
        forward = np.array([p.forward_out(node, c) for c in cands])[:, None]  # beside each input's forward peak
        in_time, in_mem, peaks = [], [], []
        for i, v in enumerate(ins):
            edges = [[p.edge(node.index, i, src, c.inputs[i]) for src in self.domains[v]] for c in cands]
            in_time.append(np.array([[e.time for e in row] for row in edges]))
            in_mem.append(np.array([[e.mem for e in row] for row in edges]))
            peaks.append(np.array([[e.peak for e in row] for row in edges]) + forward)
        in_time = self._admissible(node, cands, ins, in_time)
        unique = tuple(dict.fromkeys(ins))  # x * x: one variable for both inputs, their costs summed
        if len(unique) < len(ins):
            pos = [[i for i, v in enumerate(ins) if v == u] for u in unique]
            in_time = [sum(in_time[i] for i in ps) for ps in pos]
            in_mem = [sum(in_mem[i] for i in ps) for ps in pos]
            peaks = [np.max([peaks[i] for i in ps], axis=0) for ps in pos]
        out = np.array([outs[c.output] for c in cands])
        return Factor(unique, out_var, out, time, mem, in_time, in_mem, peaks, peak=transient)

    def _admissible(self, node: Any, cands: list[Cand], ins: tuple[int, ...], in_time: list) -> list:
        """reshape keeps no split of a nested input: those (input layout, signature) pairs cost INF."""
        if node.call != "reshape":
            return in_time
        from globalview._price import nested

        t = in_time[0].copy()
        for k, c in enumerate(cands):
            if any(s.is_split for s in c.inputs[0]):
                for j, src in enumerate(self.domains[ins[0]]):
                    if nested(src):
                        t[k, j] = np.inf
        return [t]

    def decode(self, result: Result) -> Assignment:
        """The plan a search result stands for."""
        layouts = {
            n: self.domains[self.var[f"param:{n}"]][result.values[self.var[f"param:{n}"]]] for n in self.params()
        }
        return Assignment(layouts, [cands[result.choices[k]] for k, cands in enumerate(self.cands)])

    # -- one plan ------------------------------------------------------------------------------
    def _current(self, a: Assignment, src: str) -> Layout:
        if src.startswith("param:"):
            return a.layouts[src.removeprefix("param:")]
        if src.startswith("node:"):
            return a.cands[int(src.removeprefix("node:"))].output
        return self.trace.leaves[src].layout

    def price(self, a: Assignment) -> Breakdown:
        """Seconds and bytes of plan ``a``, per operator and per parameter."""
        p, b = self.pricer, Breakdown(held=self.pricer.held())
        for node, cand in zip(self.trace.nodes, a.cands, strict=True):
            edges = [p.edge(node.index, i, self._current(a, s), cand.inputs[i]) for i, s in enumerate(node.sources)]
            comm = sum(e.time for e in edges)
            b.node_time.append(p.compute(node, cand) + comm)
            b.node_comm.append(comm)
            b.node_moved.append(sum(e.moved for e in edges))
            b.node_mem.append(p.kept(node, cand) + sum(e.mem for e in edges))
            forward = p.forward_out(node, cand)
            b.peak = max([b.peak, p.transient(node, cand)] + [e.peak + forward for e in edges])
        for name in self.params():
            b.param_time[name], b.param_mem[name], b.param_grad[name] = p.param(name, a.layouts[name])
            b.step_peak = max(b.step_peak, p.step_temporaries(name, a.layouts[name]))
        return b

    def greedy(self, layouts: Mapping[str, Layout]) -> Assignment:
        """The plan globalview's operators choose at run time (the fewest bytes each) for these parameter layouts."""
        a = Assignment({n: tuple(layouts[n]) for n in self.params()}, [])
        pl = self.trace.placement
        for node in self.trace.nodes:
            current = [self._current(a, s) for s in node.sources]
            choice = _cost.choose(
                node.call,
                node.shapes,
                node.dtypes,
                pl,
                current,
                rule_of(node, current[0]),
                grads=node.grads,
                weights=node.weights,
                params=node.params,
                flops=node.op.flops,
                chain=node.out_shape if node.op.chain else None,
            )
            a.cands.append(Cand(choice.chosen.inputs, choice.chosen.output))
        return a
