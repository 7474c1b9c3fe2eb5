"""torch functions on global tensors: ``__torch_function__`` maps them to globalview's operators.

A torch module made global (``globalview.nn.to_global``) keeps torch's forward code: when it
calls ``F.linear(x, self.weight, self.bias)`` with a global ``x``, torch hands the call to
``GlobalTensor.__torch_function__``; the module's parameters (torch tensors holding this rank's
part, tagged with their global layout) become global tensors, and globalview's operator runs.
A torch tensor without a global layout among global operands is refused, naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from globalview import _functional as nnf
from globalview import _ops
from globalview._apply import label
from globalview._tensor import GlobalTensor
from globalview._torchfamily import TORCH

__all__ = ["as_global", "torch_function"]

OPS = _ops.OPERATORS


def as_global(t: torch.Tensor) -> GlobalTensor | None:
    """The global tensor a tagged torch tensor (a global module's parameter or buffer) is part of."""
    layout = getattr(t, "_gv_layout", None)
    if layout is None:
        return None
    shape, dtype, pl, sbp = layout
    return GlobalTensor(t, shape, dtype, pl, sbp, TORCH)


def _swap(x: GlobalTensor, dim0: int, dim1: int) -> GlobalTensor:
    perm = list(range(x.ndim))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return _ops.transpose(x, perm)


def _reduction(fn: Callable) -> Callable:
    def call(x: GlobalTensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> GlobalTensor:
        return fn(x, dim, keepdim)

    return call


def _shape_args(shape: tuple) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape


@functools.cache
def _table() -> dict[Any, Callable[..., Any]]:
    T = torch.Tensor
    add = lambda a, b, *, alpha=1: OPS["add"](a, b if alpha == 1 else b * alpha)  # noqa: E731
    sub = lambda a, b, *, alpha=1: OPS["sub"](a, b if alpha == 1 else b * alpha)  # noqa: E731
    table: dict[Any, Callable[..., Any]] = {
        F.linear: nnf.linear,
        F.relu: nnf.relu,
        torch.relu: nnf.relu,
        T.relu: nnf.relu,
        F.gelu: nnf.gelu,
        F.softmax: nnf.softmax,
        torch.softmax: nnf.softmax,
        T.softmax: nnf.softmax,
        F.log_softmax: nnf.log_softmax,
        torch.log_softmax: nnf.log_softmax,
        T.log_softmax: nnf.log_softmax,
        F.layer_norm: nnf.layer_norm,
        F.embedding: nnf.embedding,
        F.dropout: nnf.dropout,
        F.cross_entropy: nnf.cross_entropy,
        F.nll_loss: nnf.nll_loss,
        F.mse_loss: nnf.mse_loss,
        torch.matmul: _ops.matmul,
        T.__matmul__: _ops.matmul,
        T.__rmatmul__: lambda a, b: _ops.matmul(b, a),
        torch.add: add,
        T.add: add,
        T.__add__: add,
        T.__radd__: lambda a, b: OPS["add"](b, a),
        torch.sub: sub,
        T.sub: sub,
        T.__sub__: sub,
        T.__rsub__: lambda a, b: OPS["sub"](b, a),
        torch.mul: OPS["mul"],
        T.mul: OPS["mul"],
        T.__mul__: OPS["mul"],
        T.__rmul__: lambda a, b: OPS["mul"](b, a),
        torch.div: OPS["div"],
        T.div: OPS["div"],
        T.__truediv__: OPS["div"],
        T.__rtruediv__: lambda a, b: OPS["div"](b, a),
        T.__neg__: _ops.neg,
        torch.sum: _reduction(_ops.sum),
        T.sum: _reduction(_ops.sum),
        torch.mean: _reduction(_ops.mean),
        T.mean: _reduction(_ops.mean),
        torch.transpose: _swap,
        T.transpose: _swap,
        torch.permute: lambda x, dims: _ops.transpose(x, dims),
        T.permute: lambda x, *dims: _ops.transpose(x, _shape_args(dims)),
        torch.reshape: lambda x, shape: _ops.reshape(x, shape),
        T.reshape: lambda x, *shape: _ops.reshape(x, _shape_args(shape)),
        T.view: lambda x, *shape: _ops.reshape(x, _shape_args(shape)),
    }
    for name in ("exp", "log", "sqrt", "abs", "tanh", "sin", "cos"):
        table[getattr(torch, name)] = OPS[name]
        table[getattr(T, name)] = OPS[name]
    return table


def _name(func: Any) -> str:
    module = getattr(func, "__module__", None) or "torch.Tensor"
    return f"{module}.{getattr(func, '__name__', func)}"


def _globalize(a: Any, func: Any, where: str) -> Any:
    if isinstance(a, torch.Tensor):
        g = as_global(a)
        if g is None:
            raise TypeError(
                f"{label()}globalview: {where} of {_name(func)} is a local torch tensor of shape "
                f"{tuple(a.shape)}, the others are global; make it global with globalview.to_global(t, placement, "
                "sbp), or make its module global with globalview.nn.to_global"
            )
        return g
    return a


def torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run torch function ``func`` on global tensors (and global modules' tagged parameters)."""
    fn = _table().get(func)
    if fn is None:
        raise TypeError(
            f"{label()}globalview: {_name(func)} is not supported on global tensors; supported: linear, "
            "matmul, relu, gelu, softmax, log_softmax, layer_norm, embedding, dropout, cross_entropy, nll_loss, "
            "mse_loss, + - * /, sum, mean, exp/log/sqrt/abs/tanh/sin/cos, transpose, permute, reshape, view"
        )
    args = tuple(_globalize(a, func, f"argument {i}") for i, a in enumerate(args))
    kwargs = {k: _globalize(v, func, f"argument {k!r}") for k, v in kwargs.items()}
    return fn(*args, **kwargs)
