"""``globalview.auto_parallel``: a whole model's layouts and operator plans, chosen by an exact search.

One traced forward (every parameter broadcast, ``_trace``) gives the operators; the machine's measured
collectives and the operators timed at every local shape a plan can give them (``_machine``, ``_optime``)
price every choice (``_price``, ``_space``); the exact search (``_search``) picks every parameter's layout
and every operator's signature with the least predicted step time, within the memory budget. The plan
(``_autoplan.AutoPlan``) is made on rank 0, sent to every rank, and applied: the module is laid out as
planned and its forward runs the planned signatures. The hand-written plans (data parallel, fully sharded,
tensor parallel, and 2-D on a 2-D mesh) are priced beside it, as globalview's operators would run them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import commlib
from globalview._apply import label
from globalview._autoplan import AutoPlan, fmt
from globalview._footprint import overheads, per_operator
from globalview._machine import fit
from globalview._optime import time_all
from globalview._placement import placement as Placement
from globalview._price import Pricer
from globalview._search import least_memory, solve
from globalview._space import Space
from globalview._tensor import GlobalTensor
from globalview._tensor import to_global as _to_global
from globalview._trace import Trace, trace
from globalview.sbp import SbpParallel, broadcast, split

__all__ = ["auto_parallel", "standard_layouts"]

Layout = tuple[SbpParallel, ...]
MIB = 1 << 20
SEARCH_SECONDS = 20.0  # under a budget, the branch and bound stops here with its proven gap
#: the share of a memory budget a plan leaves free: one plan's measured peak differs by about 1% from one process
#: to another (where the heap's pages fall), and the search fills the room it is given to within 1%
HEADROOM = 0.02


def auto_parallel(
    module: torch.nn.Module,
    placement: Placement,
    sample_input: Any,
    memory_per_rank: float | None = None,
    *,
    optimizer_states: int = 2,
    plan: AutoPlan | None = None,
    max_nodes: int = 64,
) -> torch.nn.Module:
    """Make ``module`` global on ``placement`` with the plan of least predicted step time; returns it (collective).

    ``sample_input``: one forward's input as each rank has it (a torch tensor, each rank's part of a batch
    split over every mesh axis; a global tensor; or a tuple of them, the forward's positional arguments).
    ``memory_per_rank``: bytes each rank may hold for parameters, gradients, optimizer states (``optimizer_states``
    per element: 0 plain SGD, 1 momentum, 2 Adam), the forward's inputs (two batches: the step's and the next one)
    and activations; None: no limit. ``plan``: apply this
    :class:`AutoPlan` (from :meth:`AutoPlan.load`) without tracing or searching. ``globalview.explain(module)``
    returns the plan; its text shows it per layer next to the hand-written plans.

    Raises:
        TypeError, ValueError: bad arguments, a module that is global already, or a budget no plan fits.
    """
    call = f"{label()}globalview.auto_parallel"
    _check(call, module, placement, memory_per_rank, optimizer_states, plan)
    if plan is None:
        from globalview.nn import check_module

        check_module(module, placement, call)
        plan = _search(call, module, placement, _inputs(call, sample_input, placement), memory_per_rank,
                       optimizer_states, max_nodes)  # fmt: skip
    return plan.apply(module)


def _search(
    call: str, module: torch.nn.Module, pl: Placement, inputs: list, budget: Any, states: int, nodes: int
) -> AutoPlan:
    """Trace, measure and time (every rank), search (rank 0), and send the plan to every rank."""
    from globalview.nn import _entries, globalize, localize

    start = time.perf_counter()
    globalize(module, pl, {n: (broadcast,) * pl.ndim for n, _, _ in _entries(module)})
    traced = trace(module, pl, inputs)
    localize(module)
    largest = max(math.prod(t.shape) * t.dtype.itemsize for t in traced.leaves.values())
    largest = max([largest] + [math.prod(n.out_shape) * n.out_dtype.itemsize for n in traced.nodes])
    machine = fit(pl, largest)
    # this process's allocator and globalview's objects per operator, measured (as the machine, once)
    space = Space(Pricer(traced, machine, states, overheads=overheads(), per_operator=per_operator(pl)))
    time_all(machine, space.timing_requests())
    measured = time.perf_counter() - start
    box: list[Any] = [None]
    if commlib.get_rank() == 0:
        try:
            box[0] = _plan(space, _all_layouts(module, traced), budget, nodes)
        except ValueError as e:
            box[0] = f"{call}: {e}"
    commlib.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    chosen: AutoPlan = box[0]
    chosen.stats["trace and timing seconds"] = measured
    chosen.report += f"\n  planning: {measured:.2f} s tracing and timing, {chosen.stats['search seconds']:.2f} s search"
    return chosen


def _check(call: str, module: Any, placement: Any, budget: Any, states: Any, plan: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{call}: module must be a torch.nn.Module, got {type(module).__qualname__}")
    if not isinstance(placement, Placement):
        raise TypeError(f"{call}: placement must be a globalview.placement, got {placement!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise ValueError(f"{call}: memory_per_rank must be a positive number of bytes or None, got {budget!r}")
    if states not in (0, 1, 2):
        raise ValueError(f"{call}: optimizer_states must be 0, 1 or 2 (states per parameter element), got {states!r}")
    if plan is not None and not isinstance(plan, AutoPlan):
        raise TypeError(f"{call}: plan must be a globalview.AutoPlan (AutoPlan.load(path)), got {plan!r}")
    if plan is not None and plan.placement != placement:
        raise ValueError(f"{call}: the plan is for {plan.placement}, not {placement}")


def _inputs(call: str, sample: Any, pl: Placement) -> list[GlobalTensor]:
    """The forward's inputs as global tensors: torch tensors are each rank's part, split(0) on every mesh axis."""
    items = list(sample) if isinstance(sample, (tuple, list)) else [sample]
    out = []
    for i, x in enumerate(items):
        if isinstance(x, GlobalTensor):
            if x.placement != pl:
                raise ValueError(f"{call}: sample_input[{i}] is on {x.placement}, not on {pl}")
            out.append(x)
        elif isinstance(x, torch.Tensor):
            out.append(_to_global(x, pl, (split(0),) * pl.ndim))
        else:
            raise TypeError(
                f"{call}: sample_input must be a torch tensor, a global tensor, or a tuple of them; "
                f"item {i} is {type(x).__qualname__}"
            )
    return out


def _all_layouts(module: torch.nn.Module, traced: Trace) -> dict[str, Layout]:
    """Broadcast for everything the search does not decide (buffers, parameters the forward did not use)."""
    from globalview.nn import _entries

    b = (broadcast,) * traced.placement.ndim
    return {n: b for n, _, _ in _entries(module)}


def standard_layouts(traced: Trace) -> dict[str, dict[str, Layout]]:
    """The hand-written plans: data parallel, fully sharded, tensor parallel (Megatron's column then row
    Linear pairs), and on a 2-D mesh 2-D (data parallel along axis 0, tensor parallel along axis 1)."""
    pl = traced.placement
    params = {n: traced.leaves[f"param:{n}"].shape for n in traced.params()}
    b = (broadcast,) * pl.ndim
    out = {"data parallel": dict.fromkeys(params, b)}
    out["fully sharded"] = {
        n: tuple(split(0) if s and s[0] >= p else broadcast for p in pl.hierarchy) for n, s in params.items()
    }
    tp = _megatron(traced)
    if pl.ndim == 1:
        out["tensor parallel"] = {n: (tp.get(n, broadcast),) for n in params}
    else:
        out["2-D"] = {n: (broadcast,) * (pl.ndim - 1) + (tp.get(n, broadcast),) for n in params}
    return out


def _megatron(traced: Trace) -> dict[str, SbpParallel]:
    """Column parallel for a Linear fed by a tensor that no column-parallel Linear made; row parallel for the
    next one (its input is split by column); biases follow (column: split, row: broadcast)."""
    split_cols: set[str] = set()  # sources whose last dimension a column-parallel Linear split
    layout: dict[str, SbpParallel] = {}
    for node in traced.nodes:
        src = node.sources
        if node.call == "linear" and src[1].startswith("param:"):
            w = src[1].removeprefix("param:")
            row = src[0] in split_cols
            layout.setdefault(w, split(1) if row else split(0))
            if not row:
                split_cols.add(f"node:{node.index}")
            continue
        resets = node.call in ("layer_norm", "embedding", "linear")
        if not resets and any(s in split_cols for s in src):
            split_cols.add(f"node:{node.index}")
            if node.call == "add" and len(src) == 2 and src[1].startswith("param:"):  # a column Linear's bias
                layout.setdefault(src[1].removeprefix("param:"), split(0))
    return layout


def _plan(space: Space, layouts: dict[str, Layout], budget: float | None, max_nodes: int) -> AutoPlan:
    """Search (on rank 0), price the hand-written plans, and write the report."""
    start = time.perf_counter()
    factors = space.factors()
    domains = [len(d) for d in space.domains]
    held = space.pricer.held()  # the inputs and operators' objects: the same under every plan, not in the factors
    room = None if budget is None else budget * (1 - HEADROOM) - held
    fits = room is None or room > 0
    result = solve(domains, factors, room, caps_of(factors), max_nodes, max_seconds=SEARCH_SECONDS) if fits else None
    if result is None:
        least = least_memory(domains, factors, caps_of(factors))
        raise ValueError(
            f"no plan fits memory_per_rank={budget:,.0f} bytes: the least memory a plan needs is "
            f"{least + held:,.0f} bytes per rank (parameters, gradients, optimizer states, inputs, activations, "
            f"the largest gathered weight), and a plan leaves {HEADROOM:.0%} of the budget free"
        )
    searched = time.perf_counter() - start
    auto = space.decode(result)
    priced = space.price(auto)
    alternatives = {}
    for name, lay in standard_layouts(space.trace).items():
        b = space.price(space.greedy(lay))
        alternatives[name] = {"layouts": lay, "time": b.time, "memory": b.memory()}
    layouts = {**layouts, **auto.layouts}
    sigs = [(n.call, c.inputs, c.output) for n, c in zip(space.trace.nodes, auto.cands, strict=True)]
    stats = {"search seconds": searched, "nodes": result.nodes, "gap seconds": result.gap, "budget": budget}
    stats |= {"variables": len(domains), "factors": len(factors)}
    plan = AutoPlan(space.trace.placement, layouts, sigs, priced.time, priced.memory(), alternatives, "", stats)
    plan.report = _report(space, auto, priced, plan)
    return plan


def _report(space: Space, auto: Any, priced: Any, plan: AutoPlan) -> str:
    """Per layer: the parameters' layouts, the bytes each rank receives, predicted ms and MiB; then the totals."""
    tr = space.trace
    rows: dict[str, list[float]] = {}
    for node, t, moved, mem in zip(tr.nodes, priced.node_time, priced.node_moved, priced.node_mem, strict=True):
        row = rows.setdefault(node.module or "(root)", [0.0, 0.0, 0.0])
        row[0], row[1], row[2] = row[0] + moved, row[1] + t, row[2] + mem
    for name, t in priced.param_time.items():
        owner = name.rpartition(".")[0] or "(root)"
        row = rows.setdefault(owner if owner in rows else _first_user(tr, name), [0.0, 0.0, 0.0])
        row[1] += t
        row[2] += priced.param_mem[name] + priced.param_grad[name]
    budget = plan.stats.get("budget")
    gap = plan.stats["gap seconds"]
    lines = [
        f"globalview.auto_parallel on {tr.placement}: {len(tr.nodes)} operators, {len(auto.layouts)} parameters",
        f"  exact search over {plan.stats['variables']} layouts and {plan.stats['factors']} factors, "
        f"{plan.stats['nodes']} node(s){'' if gap == 0 else f', within {gap * 1e3:.3f} ms of the optimum'}; "
        f"memory budget: {'none' if budget is None else f'{budget / MIB:,.1f} MiB per rank'}",
        f"  {'layer':<24} {'parameters':<44} {'bytes/rank':>12} {'ms':>9} {'MiB':>9}",
    ]
    for layer, (moved, t, mem) in rows.items():
        mine = [(n.rpartition(".")[2], lay) for n, lay in auto.layouts.items() if n.rpartition(".")[0] == layer]
        params = ", ".join(f"{n} {fmt(lay)}" for n, lay in mine) or "-"
        lines.append(f"  {layer:<24} {params[:44]:<44} {moved:>12,.0f} {t * 1e3:>9.3f} {mem / MIB:>9.2f}")
    held = f"(inputs x{space.pricer.batches}, graph)"
    lines.append(f"  {held:<24} {'-':<44} {0:>12,.0f} {0:>9.3f} {priced.held / MIB:>9.2f}")
    lines.append(
        f"  {'automatic (predicted step, peak memory)':<69} {'':>12} {plan.time * 1e3:>9.3f} {plan.memory / MIB:>9.2f}"
    )
    for name, alt in plan.alternatives.items():
        lines.append(f"  {name:<69} {'':>12} {alt['time'] * 1e3:>9.3f} {alt['memory'] / MIB:>9.2f}")
    return "\n".join(lines)


def _first_user(tr: Trace, name: str) -> str:
    uses = tr.users.get(f"param:{name}", [])
    return tr.nodes[uses[0][0]].module or "(root)" if uses else "(root)"


def caps_of(factors: Sequence[Any]) -> list[float]:
    """The transient sizes the search tries as caps (0: nothing gathered, no optimizer temporaries)."""
    sizes = [x for f in factors for p in [*f.in_peak, f.peak] if p is not None for x in np.ravel(p)]
    return sorted({0.0} | {float(x) for x in sizes if x > 0 and math.isfinite(x)})
