"""Operators on global tensors: each describes a call as an :class:`~globalview._apply.Op`, then runs it.

``PREPARE`` maps each operator's name to the function that describes a call without running it
(what ``globalview.explain`` prices); ``OPERATORS`` maps it to the operator. Every operator is
collective (every rank calls it); ranks outside the placement compute nothing.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import commlib
from commlib.arrays import numpy_dtype
from globalview import _signatures as sig
from globalview._apply import Op, run, tensors
from globalview._boxing import identity
from globalview._layout import block_shape, split_range
from globalview._tensor import GlobalTensor

__all__ = ["OPERATORS", "PREPARE"]


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


def _elementwise(call: str, fn: Callable[..., Any], args: Sequence[Any], partial: str) -> Op:
    ts = tensors(call, args)
    if len(ts) < len(args) and partial in ("all",):
        partial = "none"  # x + 2 is not (x_0 + 2) + (x_1 + 2)
    if partial == "first" and not isinstance(args[0], GlobalTensor):
        partial = "none"  # 2 / x
    try:
        out_shape = tuple(np.broadcast_shapes(*(_shape_of(a) for a in args)))
    except ValueError:
        shapes = " and ".join(str(_shape_of(a)) for a in args)
        raise ValueError(f"globalview.{call}: shapes {shapes} do not broadcast") from None
    rule = sig.elementwise([t.shape for t in ts], out_shape, partial)
    return Op(call, tuple(args), rule, fn, out_shape)


def _binary_op(name: str) -> Callable[[Any, Any], Op]:
    fn, partial = _BINARY[name]
    return lambda x, y: _elementwise(name, fn, (x, y), partial)


def _unary_op(name: str) -> Callable[[GlobalTensor], Op]:
    return lambda x: _elementwise(name, getattr(x._xp, name), (x,), "none")


def _running(name: str, describe: Callable[..., Op], doc: str) -> Callable[..., GlobalTensor]:
    def op(*args: Any) -> GlobalTensor:
        return run(describe(*args))

    op.__name__, op.__qualname__, op.__doc__ = name, name, doc
    return op


def _neg_op(x: GlobalTensor) -> Op:
    return _elementwise("neg", operator.neg, (x,), "one")


def neg(x: GlobalTensor) -> GlobalTensor:
    """``-x``: partial sums stay partial."""
    return run(_neg_op(x))


def _where_op(condition: GlobalTensor, x: Any, y: Any) -> Op:
    xp = condition._xp if isinstance(condition, GlobalTensor) else np
    return _elementwise("where", xp.where, (condition, x, y), "none")


def where(condition: GlobalTensor, x: Any, y: Any) -> GlobalTensor:
    """``x`` where ``condition`` else ``y``, elementwise with broadcasting."""
    return run(_where_op(condition, x, y))


# -- matmul ----------------------------------------------------------------------------------


def _matmul_op(a: GlobalTensor, b: GlobalTensor) -> Op:
    tensors("matmul", (a, b))
    if a.ndim < 2 or a.ndim != b.ndim:
        raise ValueError(f"globalview.matmul: needs two tensors of the same rank >= 2, got {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"globalview.matmul: shapes {a.shape} and {b.shape} do not multiply")
    out_shape = (*a.shape[:-1], b.shape[-1])
    return Op("matmul", (a, b), sig.matmul(a.ndim), a._xp.matmul, out_shape, flops=("matmul",), chain=True)


def matmul(a: GlobalTensor, b: GlobalTensor) -> GlobalTensor:
    """``a @ b`` for 2-D (or batched, equal-rank) tensors.

    S(0) x B -> S(0), B x S(1) -> S(1), S(1) x S(0) -> P, P x B and B x P -> P, B x B -> B
    (batch dimensions: S(d) x S(d) -> S(d)); other inputs are boxed by the cheapest plan."""
    return run(_matmul_op(a, b))


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


def _reduce(call: str, x: GlobalTensor, axis: Any, keepdims: bool) -> Op:
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
    return Op(call, (x,), sig.reduction(x.ndim, axes, keepdims, kind, partial), fn, out_shape)


def sum(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Sum over ``axis``: over a split dimension the result is partial_sum (no communication)."""
    return run(_reduce("sum", x, axis, keepdims))


def mean(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Mean over ``axis`` (partial_sum over a split dimension)."""
    return run(_reduce("mean", x, axis, keepdims))


def max(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Max over ``axis``: over a split dimension the result is partial_max."""
    return run(_reduce("max", x, axis, keepdims))


def min(x: GlobalTensor, axis: Any = None, keepdims: bool = False) -> GlobalTensor:
    """Min over ``axis``: over a split dimension the result is partial_min."""
    return run(_reduce("min", x, axis, keepdims))


# -- structure -------------------------------------------------------------------------------


def _transpose_op(x: GlobalTensor, axes: Sequence[int] | None = None) -> Op:
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(int(a) % builtins.max(x.ndim, 1) for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"globalview.transpose: axes {axes!r} are not a permutation of {x.ndim} dimensions")
    out_shape = tuple(x.shape[a] for a in perm)
    rule = sig.structural(("transpose", perm), x.ndim, lambda d, p: perm.index(d))
    return Op("transpose", (x,), rule, lambda a: x._xp.ascontiguousarray(x._xp.transpose(a, perm)), out_shape)


def transpose(x: GlobalTensor, axes: Sequence[int] | None = None) -> GlobalTensor:
    """Permute dimensions (reverse them by default); S(d) follows its dimension, no communication."""
    return run(_transpose_op(x, axes))


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


def nested(sbp: Sequence[Any]) -> bool:
    """Whether two mesh axes split the same dimension (each rank's piece is a piece of a piece)."""
    dims = [s.dim for s in sbp if s.is_split]
    return len(dims) != len(set(dims))


def reshape_rule(old: tuple[int, ...], new: tuple[int, ...], is_nested: bool) -> sig.Rule:
    """reshape's signatures from ``old`` to ``new``: a split survives where each piece stays one piece
    (none when the input's layout is nested)."""
    return sig.structural(
        ("reshape", old, new, is_nested), len(old), lambda d, p: None if is_nested else _reshape_map(old, new, d, p)
    )


def _reshape_op(x: GlobalTensor, *shape: Any) -> Op:
    new = _resolve_shape(x, shape)
    rule = reshape_rule(x.shape, new, nested(x.sbp))
    pl = x.placement

    def after(local: Any, choice: Any) -> Any:
        """Each rank's piece of the new layout has exactly its old elements, in order."""
        return local.reshape(block_shape(new, pl.hierarchy, choice.output, pl.coords(commlib.get_rank())))

    return Op("reshape", (x,), rule, lambda a: a, new, after=after)


def reshape(x: GlobalTensor, *shape: Any) -> GlobalTensor:
    """A new shape for the same elements. A split survives when each rank's piece stays one piece
    (e.g. S(0) of (4, 6) -> S(0) of (24,)); otherwise the input is boxed first."""
    return run(_reshape_op(x, *shape))


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


def _getitem_op(x: GlobalTensor, index: Any) -> Op:
    full, whole = _index_plan(x.shape, index)
    out_shape = np.broadcast_to(np.empty((), np.int8), x.shape)[full].shape
    # a whole-dimension slice is taken as ':' locally (the local size is smaller than the logical one)
    local_index = tuple(slice(None) if isinstance(it, slice) and d_whole else it for it, d_whole in _marks(full, whole))
    rule = sig.structural(("getitem", tuple(sorted(whole.items()))), x.ndim, lambda d, p: whole.get(d))
    return Op("getitem", (x,), rule, lambda a: x._xp.ascontiguousarray(a[local_index]), out_shape)


def getitem(x: GlobalTensor, index: Any) -> GlobalTensor:
    """Basic indexing. A split dimension indexed by ``:`` stays split; indexing into a split
    dimension boxes it first (the cheapest way: usually to another split)."""
    return run(_getitem_op(x, index))


def _marks(full: tuple, whole: dict[int, int]):
    d = 0
    for it in full:
        if it is None:
            yield it, False
            continue
        yield it, d in whole
        d += 1


_BINARY_DOC = "Elementwise ``{}`` with numpy broadcasting; the output sbp follows the inputs'."
_UNARY_DOC = "Elementwise ``{}``: S and B stay as they are; partial inputs are boxed first."

#: name -> the function that describes a call (an Op) without running it
PREPARE: dict[str, Callable[..., Op]] = {name: _binary_op(name) for name in _BINARY}
PREPARE.update({name: _unary_op(name) for name in _UNARY})
PREPARE.update(
    neg=_neg_op,
    where=_where_op,
    matmul=_matmul_op,
    sum=lambda x, axis=None, keepdims=False: _reduce("sum", x, axis, keepdims),
    mean=lambda x, axis=None, keepdims=False: _reduce("mean", x, axis, keepdims),
    max=lambda x, axis=None, keepdims=False: _reduce("max", x, axis, keepdims),
    min=lambda x, axis=None, keepdims=False: _reduce("min", x, axis, keepdims),
    transpose=_transpose_op,
    reshape=_reshape_op,
    getitem=_getitem_op,
)

#: name -> the operator
OPERATORS: dict[str, Callable[..., Any]] = {n: _running(n, PREPARE[n], _BINARY_DOC.format(n)) for n in _BINARY}
OPERATORS.update({n: _running(n, PREPARE[n], _UNARY_DOC.format(n)) for n in _UNARY})
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
