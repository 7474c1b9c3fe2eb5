"""globalview: OneFlow-style global tensors on numpy/cupy arrays and torch tensors, over commlib.

A global tensor is one logical array that every rank holds: its ``placement`` says
which ranks keep data (a list or an nd mesh of ranks) and its ``sbp`` how
(``split(dim)``, ``broadcast``, ``partial_sum``/``partial_max``/``partial_min``).
Write single-device code over logical tensors; globalview inserts the
communication: ``x.to_global(placement, sbp)`` redistributes ("boxing") by the
cheapest plan, and operators infer their output's sbp from the inputs', boxing an
input first when no signature fits. :func:`explain` shows the plan and its bytes.

With torch local parts (a torch dtype, or ``to_global`` of torch tensors) everything is
differentiable: ``loss.backward()`` runs torch's autograd through the local operators and the
adjoint of every boxing step, and each leaf's gradient is laid out like the leaf (OneFlow's
rule). :mod:`globalview.nn` makes torch modules global (data, tensor, pipeline parallelism).

Every rank runs the same program (a global tensor's code is collective).
"""

from __future__ import annotations

from typing import Any

from globalview import sbp
from globalview._create import arange, full, ones, rand, randn, tensor, zeros
from globalview._groups import Call, record
from globalview._ops import (
    OPERATORS,
    explain_op,
    getitem,
    matmul,
    max,
    mean,
    min,
    neg,
    reshape,
    sum,
    transpose,
    where,
)
from globalview._placement import placement
from globalview._plan import Plan, Step, plan
from globalview._random import manual_seed
from globalview._signatures import Choice
from globalview._tensor import GlobalTensor, to_global
from globalview.sbp import SbpParallel

__all__ = [
    "Call",
    "Choice",
    "GlobalTensor",
    "Plan",
    "SbpParallel",
    "Step",
    "abs",
    "add",
    "arange",
    "cos",
    "div",
    "eq",
    "exp",
    "explain",
    "full",
    "ge",
    "gt",
    "is_global",
    "is_local",
    "le",
    "log",
    "lt",
    "manual_seed",
    "matmul",
    "max",
    "mean",
    "min",
    "mul",
    "ne",
    "neg",
    "ones",
    "placement",
    "pow",
    "rand",
    "randn",
    "record",
    "reshape",
    "sbp",
    "sin",
    "sqrt",
    "sub",
    "sum",
    "tanh",
    "tensor",
    "to_global",
    "transpose",
    "where",
    "zeros",
]

add, sub, mul, div, pow = (OPERATORS[n] for n in ("add", "sub", "mul", "div", "pow"))
eq, ne, lt, le, gt, ge = (OPERATORS[n] for n in ("eq", "ne", "lt", "le", "gt", "ge"))
exp, log, sqrt, abs, tanh, sin, cos = (OPERATORS[n] for n in ("exp", "log", "sqrt", "abs", "tanh", "sin", "cos"))


def __getattr__(name: str) -> Any:
    """``globalview.nn`` (it imports torch) is loaded on first use."""
    if name == "nn":
        import importlib

        return importlib.import_module("globalview.nn")
    raise AttributeError(f"module 'globalview' has no attribute {name!r}")


def _nnf() -> Any:
    from globalview import _functional  # imports torch: only for torch parts

    return _functional


def _unsqueezed(shape: tuple[int, ...], d: int) -> tuple[int, ...]:
    d = d % (len(shape) + 1)
    return (*shape[:d], 1, *shape[d:])


def is_local(x: Any) -> bool:
    """True for a local (numpy/cupy) array, False for a :class:`GlobalTensor`."""
    return not isinstance(x, GlobalTensor)


def is_global(x: Any) -> bool:
    """True for a :class:`GlobalTensor`, False for a local (numpy/cupy) array."""
    return isinstance(x, GlobalTensor)


def explain(what: Any, *args: Any, **kwargs: Any) -> Plan | Choice:
    """How globalview would do something, without doing it (no communication).

    ``explain(shape, dtype, src, dst)``, with ``src``/``dst`` each ``(placement, sbp)``:
    the boxing :class:`Plan` (its ``steps`` and the bytes each moves).
    ``explain("add", x, y)`` (any operator name and its arguments): the :class:`Choice`
    of signature, the boxing of each input and the candidates' costs.
    """
    if isinstance(what, str):
        return explain_op(what, *args, **kwargs)
    shape, dtype, src, dst = what, *args
    return plan(shape, dtype, _layout(src, len(shape), "src"), _layout(dst, len(shape), "dst"))


def _layout(pair: Any, ndim: int, arg: str) -> tuple:
    from globalview._layout import normalize_sbp

    if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], placement)):
        raise TypeError(f"globalview.explain: {arg} must be a (placement, sbp) pair, got {pair!r}")
    return pair[0], normalize_sbp(pair[1], pair[0].ndim, ndim, "globalview.explain")


def _method(fn):
    return lambda self, *a, **k: fn(self, *a, **k)


def _reflected(fn):
    return lambda self, other: fn(other, self)


# Tensor methods and operators (numpy's spelling), all collective like the functions they call.
def _transpose_method(x: GlobalTensor, axes: tuple) -> GlobalTensor:
    """numpy's ``transpose(*axes)`` (a permutation) for numpy parts; torch's ``transpose(dim0, dim1)``
    (a swap) for torch parts, so torch modules' code runs unchanged."""
    if x.is_torch and len(axes) == 2:
        perm = list(range(x.ndim))
        a, b = (int(d) % x.ndim for d in axes)
        perm[a], perm[b] = perm[b], perm[a]
        return transpose(x, perm)
    return transpose(x, axes[0] if len(axes) == 1 else (axes or None))


def _reduction_method(fn):
    """numpy's (axis, keepdims) and torch's (dim, keepdim) spellings."""

    def method(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
        return fn(self, axis if dim is None else dim, keepdims if keepdim is None else keepdim)

    return method


for _name, _fn in {
    "__add__": add,
    "__sub__": sub,
    "__mul__": mul,
    "__truediv__": div,
    "__pow__": pow,
    "__matmul__": matmul,
    "__eq__": eq,
    "__ne__": ne,
    "__lt__": lt,
    "__le__": le,
    "__gt__": gt,
    "__ge__": ge,
    "__getitem__": getitem,
    "__neg__": neg,
    "transpose": lambda x, *axes: _transpose_method(x, axes),
    "reshape": reshape,
    "view": reshape,
    "permute": lambda x, *dims: transpose(x, dims[0] if len(dims) == 1 and not isinstance(dims[0], int) else dims),
    "exp": exp,
    "log": log,
    "sqrt": sqrt,
    "abs": abs,
}.items():
    setattr(GlobalTensor, _name, _method(_fn))
for _name, _fn in {"__radd__": add, "__rsub__": sub, "__rmul__": mul, "__rtruediv__": div, "__rpow__": pow}.items():
    setattr(GlobalTensor, _name, _reflected(_fn))
for _name, _fn in {"sum": sum, "mean": mean, "max": max, "min": min}.items():
    setattr(GlobalTensor, _name, _reduction_method(_fn))
for _name, _fn in {
    "numel": lambda self: self.size,
    "dim": lambda self: self.ndim,
    "contiguous": lambda self: self,
    "unsqueeze": lambda self, d: reshape(self, _unsqueezed(self.shape, d)),
    "relu": lambda self: _nnf().relu(self),
    "softmax": lambda self, dim: _nnf().softmax(self, dim),
    "log_softmax": lambda self, dim: _nnf().log_softmax(self, dim),
    "T": property(lambda self: transpose(self)),
    "__abs__": _method(abs),
}.items():
    setattr(GlobalTensor, _name, _fn)
del _name, _fn
