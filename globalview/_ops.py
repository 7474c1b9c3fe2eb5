"""Operators on global tensors: pick a signature by cost, box the inputs, compute locally.

Every operator is collective (every rank calls it, as with any global tensor code);
ranks outside the placement compute nothing and get an empty local part.
"""

from __future__ import annotations

import builtins
import contextvars
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import commlib
from commlib.arrays import numpy_dtype
from globalview import _signatures as sig
from globalview._boxing import empty_local, execute, identity
from globalview._layout import block_shape, split_range
from globalview._tensor import GlobalTensor

__all__ = ["OPERATORS", "apply", "explain_op"]

Scalar = (int, float, complex, bool, np.number, np.bool_)
_explaining = contextvars.ContextVar("globalview_explaining", default=False)


def _label() -> str:
    return f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] "


def _tensors(call: str, args: Sequence[Any], names: Sequence[str] | None = None) -> list[GlobalTensor]:
    """The global tensors among ``args``, checked (before any communication) to share a placement."""
    names = list(names or ()) + [f"operand {i}" for i in range(len(names or ()), len(args))]
    for a, name in zip(args, names, strict=False):
        if not isinstance(a, (GlobalTensor, *Scalar)):
            raise TypeError(
                f"{_label()}globalview.{call}: operands must be global tensors or Python/numpy scalars, {name} is "
                f"{type(a).__name__}; make a local array global with globalview.to_global(array, placement, sbp)"
            )
    tensors = [(a, n) for a, n in zip(args, names, strict=False) if isinstance(a, GlobalTensor)]
    first, first_name = tensors[0]
    for t, name in tensors[1:]:
        if t.placement != first.placement:
            raise ValueError(
                f"{_label()}globalview.{call}: inputs must share a placement, got {first.placement} for {first_name} "
                f"and {t.placement} for {name}; move one with .to_global(placement=...)"
            )
    return [t for t, _ in tensors]


def _decide(call: str, tensors: list[GlobalTensor], rule: sig.Rule) -> sig.Choice:
    return sig.choose(
        call,
        [t.shape for t in tensors],
        [t._dtype for t in tensors],
        tensors[0].placement,
        [t.sbp for t in tensors],
        rule,
    )


def _probe_dtype(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """The result dtype, from running ``fn`` on one-element stand-ins (ranks with no data)."""
    torch_parts = any(isinstance(a, GlobalTensor) and a.is_torch for a in args)
    stand = [
        (a._xp if torch_parts else np).ones((1,) * a.ndim, a._dtype) if isinstance(a, GlobalTensor) else a for a in args
    ]
    with np.errstate(all="ignore"):
        out = fn(*stand)
    return out.dtype if torch_parts else np.asarray(out).dtype


def _boxed_parts(tensors: list[GlobalTensor], choice: sig.Choice, me: int) -> list[Any]:
    """Each input's local part in the layout the signature needs (differentiable for torch parts)."""
    if tensors[0].is_torch:
        from globalview import _autograd as ag

        return [
            ag.box(p, t._local, me, t._box_xp()) if p.steps else t._local
            for t, p in zip(tensors, choice.boxing, strict=True)
        ]
    xp = tensors[0]._xp
    return [
        execute(p, t.to_local(), me, xp) if p.steps else t.to_local()
        for t, p in zip(tensors, choice.boxing, strict=True)
    ]


def apply(
    call: str,
    args: Sequence[Any],
    rule: sig.Rule,
    fn: Callable[..., Any],
    out_shape: tuple[int, ...],
    dtype: Any = None,
    names: Sequence[str] | None = None,
) -> GlobalTensor:
    """Run operator ``call``: ``fn`` maps the boxed local parts (and scalars) to the local result."""
    tensors = _tensors(call, args, names)
    choice = _decide(call, tensors, rule)
    if _explaining.get():
        raise _Explained(choice)
    first, me = tensors[0], commlib.get_rank()
    if len({t.is_torch for t in tensors}) > 1:
        raise TypeError(f"globalview.{call}: inputs mix torch and numpy/cupy local parts; use one kind")
    boxed = iter(_boxed_parts(tensors, choice, me))
    local_args = [next(boxed) if isinstance(a, GlobalTensor) else a for a in args]
    if me in first.placement:
        local = fn(*local_args)
        local = first._xp.asarray(local)
        out_dtype = local.dtype if dtype is None else dtype
    else:
        out_dtype = _probe_dtype(fn, args) if dtype is None else dtype
        local = empty_local(first._xp, numpy_dtype(out_dtype))
        if first.is_torch:
            from globalview import _autograd as ag

            local = ag.empty_result(local_args, local)
    return GlobalTensor(local, out_shape, out_dtype, first.placement, choice.output, first._xp)


# -- elementwise -----------------------------------------------------------------------------

_BINARY: dict[str, tuple[Callable[[Any, Any], Any], str]] = {
    "add": (operator.add, "all"),
    "sub": (operator.sub, "all"),
    "mul": (operator.mul, "one"),
    "div": (operator.truediv, "first"),
    "pow": (operator.pow, "none"),
    "eq": (operator.eq, "none"),
    "ne": (operator.ne, "none"),
    "lt": (operator.lt, "none"),
    "le": (operator.le, "none"),
    "gt": (operator.gt, "none"),
    "ge": (operator.ge, "none"),
}
_UNARY = ("exp", "log", "sqrt", "abs", "tanh", "sin", "cos")


def _shape_of(a: Any) -> tuple[int, ...]:
    return a.shape if isinstance(a, GlobalTensor) else ()


def _elementwise(call: str, fn: Callable[..., Any], args: Sequence[Any], partial: str) -> GlobalTensor | sig.Choice:
    tensors = _tensors(call, args)
    if len(tensors) < len(args) and partial in ("all",):
        partial = "none"  # x + 2 is not (x_0 + 2) + (x_1 + 2)
    if partial == "first" and not isinstance(args[0], GlobalTensor):
        partial = "none"  # 2 / x
    try:
        out_shape = tuple(np.broadcast_shapes(*(_shape_of(a) for a in args)))
    except ValueError:
        shapes = " and ".join(str(_shape_of(a)) for a in args)
        raise ValueError(f"globalview.{call}: shapes {shapes} do not broadcast") from None
    rule = sig.elementwise([t.shape for t in tensors], out_shape, partial)
    return apply(call, args, rule, fn, out_shape)


def binary(name: str) -> Callable[[Any, Any], GlobalTensor]:
    fn, partial = _BINARY[name]

    def op(x: Any, y: Any) -> GlobalTensor:
        return _elementwise(name, fn, (x, y), partial)

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}`` with numpy broadcasting; the output sbp follows the inputs'."
    return op


def unary(name: str) -> Callable[[Any], GlobalTensor]:
    def op(x: GlobalTensor) -> GlobalTensor:
        xp = x._xp
        return _elementwise(name, getattr(xp, name), (x,), "none")

    op.__name__ = name
    op.__doc__ = f"Elementwise ``{name}``: S and B stay as they are; partial inputs are boxed first."
    return op


def neg(x: GlobalTensor) -> GlobalTensor:
    """``-x``: partial sums stay partial."""
    return _elementwise("neg", operator.neg, (x,), "one")


def where(condition: GlobalTensor, x: Any, y: Any) -> GlobalTensor:
    """``x`` where ``condition`` else ``y``, elementwise with broadcasting."""
    xp = condition._xp if isinstance(condition, GlobalTensor) else np
    return _elementwise("where", xp.where, (condition, x, y), "none")


# -- matmul ----------------------------------------------------------------------------------


def matmul(a: GlobalTensor, b: GlobalTensor) -> GlobalTensor:
    """``a @ b`` for 2-D (or batched, equal-rank) tensors.

    S(0) x B -> S(0), B x S(1) -> S(1), S(1) x S(0) -> P, P x B and B x P -> P, B x B -> B
    (batch dimensions: S(d) x S(d) -> S(d)); other inputs are boxed by the cheapest plan."""
    _tensors("matmul", (a, b))
    if a.ndim < 2 or a.ndim != b.ndim:
        raise ValueError(f"globalview.matmul: needs two tensors of the same rank >= 2, got {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"globalview.matmul: shapes {a.shape} and {b.shape} do not multiply")
    out_shape = (*a.shape[:-1], b.shape[-1])
    return apply("matmul", (a, b), sig.matmul(a.ndim), a._xp.matmul, out_shape)


# -- reductions ------------------------------------------------------------------------------


def _axes(call: str, x: GlobalTensor, axis: Any) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not -x.ndim <= a < x.ndim:
            raise ValueError(f"globalview.{call}: axis {a!r} is out of range for a {x.ndim}-d tensor")
        out.append(int(a) % x.ndim)
    return tuple(sorted(set(out)))


def _reduce(call: str, x: GlobalTensor, axis: Any, keepdims: bool) -> GlobalTensor:
    axes = _axes(call, x, axis)
    out_shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape) if keepdims or d not in axes)
    count = math.prod(x.shape[d] for d in axes)
    kind = {"mean": "sum"}.get(call, call)
    xp = x._xp

    def fn(a: Any) -> Any:
        if call in ("sum", "mean"):
            s = xp.sum(a, axis=axes, keepdims=keepdims)
            return s / count if call == "mean" else s
        if a.size == 0:  # an uneven split left this rank no elements: the identity stands in
            shape = xp.sum(a, axis=axes, keepdims=keepdims).shape
            return xp.full(shape, identity(call, numpy_dtype(a.dtype)), a.dtype)
        return getattr(xp, call)(a, axis=axes, keepdims=keepdims)

    # max/min over a split dimension give partial max/min, which has no gradient: under autograd
    # the input is gathered first and the reduction runs on whole rows
    partial = not (call in ("max", "min") and x.requires_grad)
    return apply(call, (x,), sig.reduction(x.ndim, axes, keepdims, kind, partial), fn, out_shape)


def sum(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Sum over ``axis``: over a split dimension the result is partial_sum (no communication)."""
    return _reduce("sum", x, axis, keepdims)


def mean(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Mean over ``axis`` (partial_sum over a split dimension)."""
    return _reduce("mean", x, axis, keepdims)


def max(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Max over ``axis``: over a split dimension the result is partial_max."""
    return _reduce("max", x, axis, keepdims)


def min(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Min over ``axis``: over a split dimension the result is partial_min."""
    return _reduce("min", x, axis, keepdims)


# -- structure -------------------------------------------------------------------------------


def transpose(x: GlobalTensor, axes: Sequence[int] | None = None) -> GlobalTensor:
    """Permute dimensions (reverse them by default); S(d) follows its dimension, no communication."""
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(int(a) % builtins.max(x.ndim, 1) for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"globalview.transpose: axes {axes!r} are not a permutation of {x.ndim} dimensions")
    out_shape = tuple(x.shape[a] for a in perm)
    rule = sig.structural(x.ndim, lambda d, p: perm.index(d))
    return apply("transpose", (x,), rule, lambda a: x._xp.ascontiguousarray(x._xp.transpose(a, perm)), out_shape)


def _resolve_shape(x: GlobalTensor, shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    try:
        return np.broadcast_to(np.empty((), np.int8), x.shape).reshape(shape).shape
    except ValueError:
        raise ValueError(f"globalview.reshape: cannot reshape {x.shape} into {shape}") from None


def _reshape_map(old: tuple[int, ...], new: tuple[int, ...], d: int, p: int) -> int | None:
    """Where S(d) of ``old`` lands in ``new``, if every rank's piece stays one contiguous piece."""
    before = math.prod(old[:d])
    after = math.prod(old[d + 1 :])
    for e in range(len(new)):
        if math.prod(new[:e]) != before:
            continue
        tail = math.prod(new[e + 1 :])
        same = all(split_range(old[d], p, r)[0] * after == split_range(new[e], p, r)[0] * tail for r in range(p))
        if same and old[d] * after == new[e] * tail:
            return e
    return None


def reshape(x: GlobalTensor, *shape: Any) -> GlobalTensor:
    """A new shape for the same elements. A split survives when each rank's piece stays one piece
    (e.g. S(0) of (4, 6) -> S(0) of (24,)); otherwise the input is boxed first."""
    new = _resolve_shape(x, shape)
    split_dims = [s.dim for s in x.sbp if s.is_split]
    nested = len(split_dims) != len(set(split_dims))
    rule = sig.structural(x.ndim, lambda d, p: None if nested else _reshape_map(x.shape, new, d, p))
    out = apply("reshape", (x,), rule, lambda a: a, new)
    # the local reshape: each rank's piece of the new layout has exactly its old elements, in order
    me = commlib.get_rank()
    if me in x.placement:
        local = out._local.reshape(block_shape(new, x.placement.hierarchy, out.sbp, x.placement.coords(me)))
        out = GlobalTensor(local, new, out.dtype, out.placement, out.sbp, out._xp)
    return out


def _index_plan(shape: tuple[int, ...], index: Any) -> tuple[tuple, dict[int, int]]:
    """Normalise a basic index; map each input dimension kept whole to its output position."""
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if not (
            it is None or it is Ellipsis or (isinstance(it, (slice, int, np.integer)) and not isinstance(it, bool))
        ):
            raise TypeError(
                f"globalview: only basic indexing (ints, slices, ..., None) works on global tensors, got {it!r}; "
                f"use .numpy() for advanced indexing"
            )
    if builtins.sum(it is Ellipsis for it in items) > 1:
        raise IndexError("globalview: an index can only have a single ellipsis ('...')")
    used = builtins.sum(it is not None and it is not Ellipsis for it in items)
    if used > len(shape):
        raise IndexError(f"globalview: too many indices for a {len(shape)}-d tensor")
    full: list[Any] = []
    for it in items:
        if it is Ellipsis:
            full += [slice(None)] * (len(shape) - used)
        else:
            full.append(it)
    full += [slice(None)] * (len(shape) - builtins.sum(it is not None for it in full))
    whole, d, o = {}, 0, 0
    for it in full:
        if it is None:
            o += 1
            continue
        if isinstance(it, slice):
            if it.indices(shape[d]) == (0, shape[d], 1):
                whole[d] = o
            o += 1
        d += 1
    return tuple(full), whole


def getitem(x: GlobalTensor, index: Any) -> GlobalTensor:
    """Basic indexing. A split dimension indexed by ``:`` stays split; indexing into a split
    dimension boxes it first (the cheapest way: usually to another split)."""
    full, whole = _index_plan(x.shape, index)
    out_shape = np.broadcast_to(np.empty((), np.int8), x.shape)[full].shape
    # a whole-dimension slice is taken as ':' locally (the local size is smaller than the logical one)
    local_index = tuple(slice(None) if isinstance(it, slice) and d_whole else it for it, d_whole in _marks(full, whole))
    rule = sig.structural(x.ndim, lambda d, p: whole.get(d))
    return apply("getitem", (x,), rule, lambda a: x._xp.ascontiguousarray(a[local_index]), out_shape)


def _marks(full: tuple, whole: dict[int, int]):
    d = 0
    for it in full:
        if it is None:
            yield it, False
            continue
        yield it, d in whole
        d += 1


OPERATORS: dict[str, Callable[..., Any]] = {name: binary(name) for name in _BINARY}
OPERATORS.update({name: unary(name) for name in _UNARY})
OPERATORS.update(
    neg=neg,
    where=where,
    matmul=matmul,
    sum=sum,
    mean=mean,
    max=max,
    min=min,
    transpose=transpose,
    reshape=reshape,
    getitem=getitem,
)


def explain_op(name: str, *args: Any, **kwargs: Any) -> sig.Choice:
    """The signature operator ``name`` would use on ``args`` and the boxing it needs, without running it."""
    if name not in OPERATORS:
        raise ValueError(f"globalview.explain: unknown operator {name!r}; one of {', '.join(sorted(OPERATORS))}")
    token = _explaining.set(True)
    try:
        OPERATORS[name](*args, **kwargs)
    except _Explained as e:
        return e.choice
    finally:
        _explaining.reset(token)
    raise AssertionError("unreachable: every operator goes through apply()")


class _Explained(Exception):
    def __init__(self, choice: sig.Choice) -> None:
        super().__init__(str(choice))
        self.choice = choice
