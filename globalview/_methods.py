"""GlobalTensor's operators and tensor methods, registered in one place (OneFlow's ``RegisterMethods``).

``METHODS`` is the whole table: Python's operators, numpy's spellings, torch's spellings (which
torch modules' forward code calls) and ``__torch_function__``. :func:`register` installs it on
:class:`~globalview._tensor.GlobalTensor`; ``import globalview`` calls it once. Every method is
collective, like the operator it calls. The torch-only ones import ``globalview._functional`` /
``_dispatch`` (and so torch) when first called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from globalview._ops import OPERATORS as OPS
from globalview._tensor import GlobalTensor

__all__ = ["METHODS", "register"]


def _functional() -> Any:
    from globalview import _functional  # imports torch: only for torch parts

    return _functional


def _torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
    """torch functions on global tensors (``F.linear(x, w)`` in a torch module's forward)."""
    from globalview._dispatch import torch_function

    return torch_function(func, args, kwargs or {})


def _tagged(a: Any) -> Any:
    """A global module's parameter or buffer (a torch tensor tagged with its layout) as its global tensor:
    ``x + self.pos`` in a module's forward works as ``self.pos + x`` does (through ``__torch_function__``)."""
    if getattr(a, "_gv_layout", None) is None:
        return a
    from globalview._dispatch import as_global  # imports torch: only when a tagged tensor is there

    return as_global(a)


def _op(name: str) -> Callable[..., Any]:
    return lambda self, *a, **k: OPS[name](self, *(_tagged(x) for x in a), **k)


def _reflected(name: str) -> Callable[[Any, Any], Any]:
    return lambda self, other: OPS[name](_tagged(other), self)


def _reduction(name: str) -> Callable[..., Any]:
    """numpy's (axis, keepdims) and torch's (dim, keepdim) spellings."""

    def method(self: GlobalTensor, axis: Any = None, keepdims: bool = False, *, dim: Any = None, keepdim: Any = None):
        return OPS[name](self, axis if dim is None else dim, keepdims if keepdim is None else keepdim)

    method.__name__ = name
    return method


def _transpose(self: GlobalTensor, *axes: Any) -> GlobalTensor:
    """numpy's ``transpose(*axes)`` (a permutation) for numpy parts; torch's ``transpose(dim0, dim1)``
    (a swap) for torch parts, so torch modules' code runs unchanged."""
    return OPS["transpose"](self, self._family.transpose_perm(self.ndim, axes))


def _permute(self: GlobalTensor, *dims: Any) -> GlobalTensor:
    return OPS["transpose"](self, dims[0] if len(dims) == 1 and not isinstance(dims[0], int) else dims)


def _unsqueeze(self: GlobalTensor, d: int) -> GlobalTensor:
    d = d % (self.ndim + 1)
    return OPS["reshape"](self, (*self.shape[:d], 1, *self.shape[d:]))


METHODS: dict[str, Any] = {
    **{f"__{n}__": _op(n) for n in ("add", "sub", "mul", "pow", "matmul", "eq", "ne", "lt", "le", "gt", "ge")},
    "__truediv__": _op("div"),
    **{f"__r{n}__": _reflected(n) for n in ("add", "sub", "mul", "pow")},
    "__rtruediv__": _reflected("div"),
    "__getitem__": _op("getitem"),
    "__neg__": _op("neg"),
    "__abs__": _op("abs"),
    **{n: _op(n) for n in ("exp", "log", "sqrt", "abs")},
    **{n: _reduction(n) for n in ("sum", "mean", "max", "min")},
    "transpose": _transpose,
    "permute": _permute,
    "reshape": _op("reshape"),
    "view": _op("reshape"),
    "T": property(lambda self: OPS["transpose"](self)),
    "numel": lambda self: self.size,
    "dim": lambda self: self.ndim,
    "contiguous": lambda self: self,
    "unsqueeze": _unsqueeze,
    "relu": lambda self: _functional().relu(self),
    "softmax": lambda self, dim: _functional().softmax(self, dim),
    "log_softmax": lambda self, dim: _functional().log_softmax(self, dim),
    "__torch_function__": classmethod(_torch_function),
}


def register() -> None:
    """Install :data:`METHODS` on GlobalTensor (idempotent)."""
    for name, fn in METHODS.items():
        setattr(GlobalTensor, name, fn)
