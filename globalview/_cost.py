"""Plans by cost: every admissible signature of an operator, priced, and the choice among them.

Pure: given the inputs' shapes, dtypes and layouts (and which of them need a gradient), no
communication. A candidate is one signature (the layout each input is boxed to, and the output's)
with its boxing plans. Its price is the bytes each rank receives:

- forward: the boxing plans of the inputs;
- backward: for each input that needs a gradient, the plan's adjoint (the gradient boxed back:
  an all_gather's adjoint is a reduce_scatter of the same size); for a *released* weight (a
  parameter gathered for this operator and not kept for backward, as FSDP does) the gather
  once more in backward, when another input needs a gradient (the operator keeps the weight
  only to compute that gradient: a first layer, fed data, never gathers its weight again);
- then, for layers of a chain (linear, matmul) whose first input splits the batch: bringing the
  output back to that layout (the data parallel layout the next layer would otherwise pay to
  restore), forward and backward.

The cheapest candidate runs; ties keep the signature table's order (the inputs' current layout
first), today's choice. ``prefer`` pins a kind of plan: ``"move_weights"`` (box only weights:
FSDP's all-gather, then reduce-scatter of the gradients) or ``"move_activations"`` (box only the
other inputs); when no candidate is of that kind the cheapest runs, and the choice says so.
Compute is shown (floating-point operations per rank, for the operators that declare them) but not
priced against bytes: a candidate that repeats work on every rank (B x B) is visible, not penalised.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from globalview._layout import block_shape
from globalview._placement import placement as Placement
from globalview._plan import Plan, adjoint, plan
from globalview._signatures import Rule
from globalview.sbp import SbpParallel

__all__ = ["PREFER", "Candidate", "Choice", "choose"]

PREFER = ("move_weights", "move_activations")
Layout = tuple[SbpParallel, ...]


@dataclass(frozen=True)
class Candidate:
    """One admissible plan of an operator: the layouts it boxes the inputs to, the output's, and its price."""

    inputs: tuple[Layout, ...]
    output: Layout
    boxing: tuple[Plan, ...]
    forward: int  # bytes each rank receives in forward (the mean over the placement's ranks)
    backward: int  # bytes each rank receives in backward for these boxings
    moves: str  # "nothing", "weights", "activations" or "weights and activations"
    flops: int | None = None  # floating-point operations per rank, where the operator declares them
    then: int = 0  # bytes per rank to bring the output back to the first input's layout (chained operators)

    @property
    def nbytes(self) -> int:
        """Bytes per rank: forward, backward, and bringing the output back (``then``)."""
        return self.forward + self.backward + self.then

    def signature(self) -> str:
        """``"S(0) x B -> S(0)"``: the inputs' layouts and the output's."""
        return f"{' x '.join(_fmt(s) for s in self.inputs)} -> {_fmt(self.output)}"


@dataclass(frozen=True)
class Choice:
    """The signature an operator runs with, the boxing each input needs, and what the others cost.

    ``cost`` and ``considered`` are the forward bytes summed over ranks (as :class:`Plan`'s);
    ``candidates`` are priced per rank, forward and backward, and ``chosen`` is the one that runs."""

    op: str
    inputs: tuple[Layout, ...]  # required nd sbp of each tensor input
    output: Layout
    boxing: tuple[Plan, ...]  # one per tensor input (empty plan: no change)
    cost: int
    considered: tuple[tuple[tuple[Layout, ...], Layout, int], ...]
    candidates: tuple[Candidate, ...] = ()
    chosen: Candidate | None = None
    reason: str = ""
    released: tuple[bool, ...] = ()  # per input: a weight gathered for this operator, gathered again in backward

    def __str__(self) -> str:
        c = self.chosen
        head = f"{self.op}: signature {' x '.join(_fmt(s) for s in self.inputs)} -> {_fmt(self.output)}"
        if c is None or not c.nbytes:
            lines = [head + ", no communication"]
        else:
            lines = [head + f", moves {c.moves}: {_b(c.nbytes)} per rank ({_b(c.forward)} forward, "]
            lines[0] += f"{_b(c.backward)} backward" + (f", {_b(c.then)} to bring the output back)" if c.then else ")")
        for i, p in enumerate(self.boxing):
            if p.steps:
                again = (
                    " (released after use, gathered again in backward)" if self.released[i : i + 1] == (True,) else ""
                )
                lines.append(f"  input {i}{again}: {p}".replace("\n", "\n  "))
        then = any(k.then for k in self.candidates)
        lines.append(f"  candidates (bytes per rank: forward + backward{' + output back' if then else ''}):")
        for cand in sorted(self.candidates, key=lambda k: k.nbytes)[:8]:
            mark = "*" if cand == c else " "
            flops = "" if cand.flops is None else f", {cand.flops:,} flop"
            parts = [_b(cand.forward), _b(cand.backward)] + ([_b(cand.then)] if then else [])
            price = f"{' + '.join(parts)} = {_b(cand.nbytes)}{flops}"
            lines.append(f"   {mark} {cand.signature():<26} moves {cand.moves:<24} {price}")
        lines.append(f"  why: {self.reason}")
        return "\n".join(lines)


def _fmt(sbp: Sequence[SbpParallel]) -> str:
    return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"


def _b(n: int) -> str:
    return f"{n:,} B"


def choose(
    op: str,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype],
    pl: Placement,
    sbps: Sequence[Layout],
    rule: Rule,
    *,
    grads: Sequence[bool] = (),
    weights: Sequence[bool] = (),
    params: Sequence[bool] = (),
    prefer: str | None = None,
    flops: tuple | None = None,
    chain: tuple[int, ...] | None = None,
    pin: tuple | None = None,
) -> Choice:
    """The cheapest signature for tensor inputs of ``shapes``/``dtypes`` laid out as ``sbps``.

    ``grads``: which inputs need a gradient; ``weights``: which are weights (the rest are
    activations); ``params``: which are parameters (leaves whose gathered value may be released);
    ``prefer``: one of :data:`PREFER`, or None for the cheapest; ``flops``: ("linear",) or ("matmul",)
    to show the floating-point operations per rank of matmul-like operators; ``chain``: the output's
    shape, for operators whose output feeds the next of a chain (linear, matmul): when the first input's
    batch is split, each candidate is also priced at bringing its output back to that layout (so a
    layer that leaves its output in another layout pays for what the next layer will move); ``pin``: the
    signature to run, ((each input's layout), output layout), as an automatic plan chose it (a ValueError
    when it is not admissible). Cached: pure."""
    n = len(shapes)
    key = (
        op,
        tuple(tuple(int(d) for d in s) for s in shapes),
        tuple(np.dtype(d) for d in dtypes),
        pl,
        tuple(tuple(s) for s in sbps),
        rule,
        tuple(grads) or (False,) * n,
        tuple(weights) or (False,) * n,
        tuple(params) or (False,) * n,
        prefer,
        flops,
        None if chain is None else tuple(int(d) for d in chain),
        pin,
    )
    return _choose(*key)


@functools.lru_cache(maxsize=4096)
def _choose(op, shapes, dtypes, pl, sbps, rule, grads, weights, params, prefer, flops, chain, pin) -> Choice:
    per_axis = [rule(tuple(s[a] for s in sbps), pl.hierarchy[a]) for a in range(pl.ndim)]
    cands: list[Candidate] = []
    released: dict[tuple[Layout, ...], tuple[bool, ...]] = {}
    for combo in itertools.product(*per_axis):
        required = tuple(tuple(c[0][i] for c in combo) for i in range(len(sbps)))
        if _splits_into_partial(sbps, required) or _no_gradient(required, grads):
            continue
        output = tuple(c[1] for c in combo)
        plans = tuple(_plan(shapes[i], dtypes[i], pl, sbps[i], req) for i, req in enumerate(required))
        # a gathered parameter is kept by autograd only to compute another input's gradient
        rel = tuple(
            params[i] and _gathers(p) and any(g for j, g in enumerate(grads) if j != i) for i, p in enumerate(plans)
        )
        released[required] = rel
        cand = _price(required, output, plans, pl, grads, weights, rel, _flops(flops, shapes, pl, required))
        if chain is not None:
            cand = _chained(cand, chain, dtypes[0], pl, sbps[0], any(grads))
        cands.append(cand)
    best, reason = _pick(cands, prefer) if pin is None else _pinned(op, cands, pin, sbps)
    considered = tuple((c.inputs, c.output, sum(p.nbytes for p in c.boxing)) for c in cands)
    return Choice(
        op,
        best.inputs,
        best.output,
        best.boxing,
        sum(p.nbytes for p in best.boxing),
        considered,
        tuple(cands),
        best,
        reason,
        released[best.inputs],
    )


@functools.lru_cache(maxsize=4096)
def _plan(shape, dtype, pl: Placement, src: Layout, dst: Layout) -> Plan:
    return plan(shape, dtype, (pl, src), (pl, dst))


@functools.lru_cache(maxsize=4096)
def _adjoint_bytes(p: Plan) -> int:
    return sum(q.nbytes for q in adjoint(p))


def _gathers(p: Plan) -> bool:
    """A plan that only gathers (its result is the source's data, nothing reduced): it can run again."""
    return (
        bool(p.steps)
        and any(s.kind == "all_gather" for s in p.steps)
        and all(s.kind in ("all_gather", "slice", "relabel") for s in p.steps)
    )


def _price(required, output, plans, pl, grads, weights, released, flops) -> Candidate:
    size = len(pl.flat)
    fwd = sum(p.nbytes for p in plans)
    bwd = sum(_adjoint_bytes(p) for p, g in zip(plans, grads, strict=True) if g and p.steps)
    bwd += sum(p.nbytes for p, r in zip(plans, released, strict=True) if r)
    boxed_w = any(p.steps and w for p, w in zip(plans, weights, strict=True) if p.nbytes)
    boxed_a = any(p.steps and not w for p, w in zip(plans, weights, strict=True) if p.nbytes)
    moves = {(False, False): "nothing", (True, False): "weights", (False, True): "activations"}.get(
        (boxed_w, boxed_a), "weights and activations"
    )
    return Candidate(required, output, plans, -(-fwd // size), -(-bwd // size), moves, flops)


def _chained(cand: Candidate, out_shape: tuple[int, ...], dtype, pl: Placement, back: Layout, grad: bool) -> Candidate:
    """``cand`` priced also at bringing its output back to layout ``back`` (and its gradient, under autograd)
    on the mesh axes where ``back`` splits the batch (a dimension before the last: data parallel axes);
    on the others (tensor parallel) the output is meant for the next layer as it is."""
    target = tuple(
        b if b.is_split and b.dim < len(out_shape) - 1 else o for b, o in zip(back, cand.output, strict=True)
    )
    if target == cand.output:
        return cand
    p = _plan(out_shape, dtype, pl, cand.output, target)
    total = p.nbytes + (_adjoint_bytes(p) if grad else 0)
    return replace(cand, then=-(-total // len(pl.flat)))


def _pick(cands: list[Candidate], prefer: str | None) -> tuple[Candidate, str]:
    """The cheapest candidate (the first of equals: the table's order), or the cheapest of the preferred kind."""
    cheapest = min(cands, key=lambda c: c.nbytes)  # min keeps the first of equals
    if prefer is not None:
        kind = prefer.removeprefix("move_")
        pool = [c for c in cands if c.moves in (kind, "nothing")]
        if pool:
            best = min(pool, key=lambda c: c.nbytes)
            if best is cheapest:
                return best, f"prefer={prefer!r} pinned; it is also the cheapest"
            return best, (
                f"prefer={prefer!r} pinned: the cheapest plan that moves only {kind} "
                f"({_b(best.nbytes)} per rank; the cheapest of all, {cheapest.signature()}, {_b(cheapest.nbytes)})"
            )
        reason = f"prefer={prefer!r}: no plan moves only {kind}, so the cheapest runs; "
    else:
        reason = ""
    rivals = [c for c in cands if c is not cheapest and c.nbytes > cheapest.nbytes]
    ties = [c for c in cands if c is not cheapest and c.nbytes == cheapest.nbytes]
    if ties:
        return cheapest, reason + f"ties at {_b(cheapest.nbytes)} per rank go to the inputs' current layout first"
    if not rivals:
        return cheapest, reason + "the only admissible plan"
    runner = min(rivals, key=lambda c: c.nbytes)
    return cheapest, reason + (
        f"the cheapest: {_b(cheapest.nbytes)} per rank against {_b(runner.nbytes)} for the next, "
        f"{runner.signature()} (moves {runner.moves})"
    )


def _pinned(op: str, cands: list[Candidate], pin: tuple, current) -> tuple[Candidate, str]:
    """The candidate an automatic plan chose (its signature ``pin``), or a ValueError naming the admissible ones."""
    for c in cands:
        if (c.inputs, c.output) == pin:
            return c, "the automatic plan's choice (globalview.auto_parallel)"
    have = ", ".join(c.signature() for c in cands)
    want = f"{' x '.join(_fmt(s) for s in pin[0])} -> {_fmt(pin[1])}"
    raise ValueError(
        f"globalview.{op}: the automatic plan runs {want} here, which inputs laid out "
        f"{', '.join(_fmt(s) for s in current)} do not admit (admissible: {have}); the module's forward differs "
        "from the one planned: plan again with globalview.auto_parallel"
    )


def _no_gradient(required, grads) -> bool:
    """An input that needs a gradient cannot be boxed to partial max/min (they have none)."""
    return any(
        g and any(s.is_partial and s.reduce != "sum" for s in req) for req, g in zip(required, grads, strict=True)
    )


def _splits_into_partial(current, required) -> bool:
    """Boxing a split input into a partial one is never worth it: the local part grows to the
    whole block (mostly identity values) and the output is left partial, to be reduced later."""
    return any(
        s.is_split and r.is_partial
        for cur, req in zip(current, required, strict=True)
        for s, r in zip(cur, req, strict=True)
    )


def _flops(spec: tuple | None, shapes, pl: Placement, required) -> int | None:
    """Floating-point operations per rank (on the placement's first rank) of a matmul-like operator:
    ``spec`` = ("linear",) (x @ w.T) or ("matmul",) (a @ b), from the inputs' local blocks."""
    if spec is None:
        return None
    coords = pl.coords(pl.flat[0])
    a = block_shape(shapes[0], pl.hierarchy, required[0], coords)
    b = block_shape(shapes[1], pl.hierarchy, required[1], coords)
    rows = math.prod(a[:-1])
    cols = b[0] if spec[0] == "linear" else b[-1]
    return 2 * rows * cols * a[-1]
