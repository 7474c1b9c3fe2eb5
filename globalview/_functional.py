"""Neural-network operators on global tensors with torch parts (``globalview.nn.functional``).

Each picks a signature by cost like every operator (``_signatures``), boxes its inputs, and
runs the torch function on the local parts, so torch's autograd differentiates the local
work and the boxing functions differentiate the communication. The argument names are
``torch.nn.functional``'s, so torch modules' forward passes dispatch here unchanged; on local
torch tensors they are torch's own functions (the single-process result).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import commlib
from globalview import _ops, _random
from globalview import _signatures as sig
from globalview._apply import Op, label, run
from globalview._layout import block
from globalview._tensor import GlobalTensor
from globalview.sbp import broadcast

__all__ = [
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "mse_loss",
    "nll_loss",
    "relu",
    "softmax",
]

#: name -> the function that describes a call without running it (for ``globalview.explain``)
PREPARE = {"linear": lambda input, weight, bias=None: _linear_op(input, weight)}


def _polymorphic(torch_fn: Any) -> Any:
    """Local torch tensors go to ``torch_fn`` (the single-process result), global ones to the decorated operator.

    Where torch's signature can be read (its Python functions; not builtins such as ``linear``), it is
    the operator's public signature, and the operator gets torch's arguments by name: written once, by
    torch, so positions and defaults agree with torch's and a misspelt argument is torch's ``TypeError``.
    """
    try:
        torch_sig: inspect.Signature | None = inspect.signature(torch_fn)
    except ValueError:  # a builtin: the operator's own signature (torch's names) serves
        torch_sig = None

    def decorate(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not any(isinstance(a, GlobalTensor) for a in (*args, *kwargs.values())):
                return torch_fn(*args, **kwargs)
            if torch_sig is None:
                return fn(*args, **kwargs)
            return fn(**torch_sig.bind(*args, **kwargs).arguments)

        if torch_sig is not None:  # torch's names, positions and defaults (its annotations say torch.Tensor)
            plain = [p.replace(annotation=p.empty) for p in torch_sig.parameters.values()]
            call.__signature__ = torch_sig.replace(parameters=plain, return_annotation=torch_sig.empty)
        return call

    return decorate


def _apply_op(
    call: str, args: tuple, rule: Any, fn: Any, out_shape: tuple, dtype: Any = None, names: tuple = ()
) -> Any:
    return run(Op(call, tuple(args), rule, fn, tuple(out_shape), dtype, tuple(names)))


def _fail(call: str, message: str) -> ValueError:
    return ValueError(f"{label()}globalview.nn.functional.{call}: {message}")


def _linear_op(input: GlobalTensor, weight: GlobalTensor) -> Op:
    if weight.ndim != 2 or input.ndim < 1 or input.shape[-1] != weight.shape[1]:
        raise _fail("linear", f"input {input.shape} and weight {weight.shape} do not fit (weight is (out, in))")
    out_shape = (*input.shape[:-1], weight.shape[0])
    rule, names = sig.linear(input.ndim), ("input", "weight")
    return Op("linear", (input, weight), rule, F.linear, out_shape, input._dtype, names, flops=("linear",), chain=True)


@_polymorphic(F.linear)
def linear(input: GlobalTensor, weight: GlobalTensor, bias: Any = None) -> GlobalTensor:
    """``input @ weight.T + bias`` (torch's linear; weight is (out, in)). Column parallel: weight
    S(0) gives S(last); row parallel: input S(last) and weight S(1) give a partial sum; batch split
    and weight gathered (FSDP's plan, weights split(0) at a large batch): S(0) x B -> S(0). The plan
    is the cheapest (see ``globalview.explain``) or the one ``globalview.plan(prefer=...)`` pins."""
    out = run(_linear_op(input, weight))
    return out if bias is None else _ops.OPERATORS["add"](out, bias)


def _unary(call: str, x: GlobalTensor, fn: Any) -> GlobalTensor:
    rule = sig.elementwise([x.shape], x.shape, "none")
    return _apply_op(call, (x,), rule, fn, x.shape, x._dtype, ("input",))


@_polymorphic(F.relu)
def relu(input: GlobalTensor, inplace: bool = False) -> GlobalTensor:
    """max(x, 0), elementwise (a partial input is reduced first)."""
    return _unary("relu", input, F.relu)


@_polymorphic(F.gelu)
def gelu(input: GlobalTensor, approximate: str = "none") -> GlobalTensor:
    """GELU, elementwise."""
    return _unary("gelu", input, lambda a: F.gelu(a, approximate=approximate))


def _dim(call: str, x: GlobalTensor, dim: Any) -> int:
    if dim is None or not -x.ndim <= int(dim) < x.ndim:
        raise _fail(call, f"dim must be a dimension of the {x.ndim}-d input, got {dim!r}")
    return int(dim) % x.ndim


@_polymorphic(F.softmax)
def softmax(input: GlobalTensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> GlobalTensor:
    """Softmax along ``dim``: that dimension must be whole (a split of it is gathered first)."""
    d = _dim("softmax", input, dim)
    return _apply_op("softmax", (input,), sig.rowwise(input.ndim, (d,)), lambda a: F.softmax(a, d), input.shape)


@_polymorphic(F.log_softmax)
def log_softmax(input: GlobalTensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> GlobalTensor:
    """log(softmax(x)) along ``dim`` (whole, like softmax)."""
    d = _dim("log_softmax", input, dim)
    rule = sig.rowwise(input.ndim, (d,))
    return _apply_op("log_softmax", (input,), rule, lambda a: F.log_softmax(a, d), input.shape)


@_polymorphic(F.layer_norm)
def layer_norm(
    input: GlobalTensor, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> GlobalTensor:
    """Layer norm over the last ``len(normalized_shape)`` dimensions (whole), weight and bias broadcast."""
    shape = tuple(normalized_shape)
    k = len(shape)
    if tuple(input.shape[input.ndim - k :]) != shape:
        raise _fail("layer_norm", f"normalized_shape {shape} is not the end of the input's shape {input.shape}")
    params = [p for p in (weight, bias) if p is not None]
    has_w, has_b = weight is not None, bias is not None

    def fn(a: torch.Tensor, *wb: torch.Tensor) -> torch.Tensor:
        w = wb[0] if has_w else None
        b = wb[-1] if has_b else None
        return F.layer_norm(a, shape, w, b, eps)

    rule = sig.rowwise(input.ndim, tuple(range(input.ndim - k, input.ndim)), len(params))
    names = ("input", *(["weight"] if has_w else []), *(["bias"] if has_b else []))
    return _apply_op("layer_norm", (input, *params), rule, fn, input.shape, input._dtype, names)


@_polymorphic(F.embedding)
def embedding(input: GlobalTensor, weight: GlobalTensor, padding_idx: Any = None, **kw: Any) -> GlobalTensor:
    """``weight[input]``: ids split with weight broadcast, or weight's features split (S(1))."""
    if any(kw.get(k) for k in ("max_norm", "scale_grad_by_freq", "sparse")):
        raise _fail("embedding", "max_norm, scale_grad_by_freq and sparse are not supported on global tensors")
    out_shape = (*input.shape, weight.shape[1])
    rule = sig.embedding(input.ndim)

    def fn(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, w, padding_idx)

    return _apply_op("embedding", (input, weight), rule, fn, out_shape, weight._dtype, ("input", "weight"))


def dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """Dropout whose mask depends only on the default generator (:func:`globalview.manual_seed`) and
    each element's logical index: the same for every placement, sbp and world size, and for a
    local torch tensor (the single-process run)."""
    if not 0 <= p <= 1:
        raise _fail("dropout", f"p must be in [0, 1], got {p}")
    if not training or p == 0:
        return input
    key = _random.next_key()
    if isinstance(input, torch.Tensor):
        return input * _mask(key, input.shape, [(0, n) for n in input.shape], p, input)
    if any(s.is_partial for s in input.sbp):
        input = input.to_global(sbp=tuple(broadcast if s.is_partial else s for s in input.sbp))
    coords = input.placement.coords(commlib.get_rank())
    ranges = block(input.shape, input.placement.hierarchy, input.sbp, coords) if coords is not None else None

    def fn(a: torch.Tensor) -> torch.Tensor:
        return a * _mask(key, input.shape, ranges, p, a)

    return _unary("dropout", input, fn)


def _mask(key: int, shape: Sequence[int], ranges: Any, p: float, like: torch.Tensor) -> torch.Tensor:
    keep = _random.uniform(np, key, shape, ranges, np.float64) >= p
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return torch.from_numpy(keep * scale).to(dtype=like.dtype, device=like.device)


def _reduce(call: str, x: GlobalTensor, reduction: str) -> GlobalTensor:
    if reduction == "mean":
        return _ops.mean(x)
    if reduction == "sum":
        return _ops.sum(x)
    if reduction == "none":
        return x
    raise _fail(call, f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _unsupported(call: str, **options: Any) -> None:
    bad = {k: v for k, v in options.items() if v}
    if bad:
        raise _fail(call, f"not supported on global tensors: {bad}")


def _nll(
    call: str,
    input: GlobalTensor,
    target: GlobalTensor,
    weight: Any = None,
    size_average: Any = None,
    ignore_index: int = -100,
    reduce: Any = None,
    reduction: str = "mean",
    *,
    logits: bool = False,
) -> GlobalTensor:
    """Negative log likelihood of class indices ``target`` under log-probabilities ``input`` (..., C),
    or under ``log_softmax(input)`` with ``logits``: ``nll_loss``'s arguments, written once for it and
    for ``cross_entropy``, all checked before any collective runs."""
    _unsupported(call, weight=weight is not None, size_average=size_average, reduce=reduce)
    if tuple(input.shape[:-1]) != tuple(target.shape):
        raise _fail(call, f"target {target.shape} must be input {input.shape} without its class dimension")
    if reduction not in ("mean", "sum", "none"):
        raise _fail(call, f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits:
        input = log_softmax(input, -1)

    def fn(logp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        keep = t != ignore_index
        picked = -logp.gather(-1, torch.where(keep, t, 0).unsqueeze(-1)).squeeze(-1)
        return picked * keep

    rule = sig.pick(target.ndim)
    picked = _apply_op(call, (input, target), rule, fn, target.shape, input._dtype, ("input", "target"))
    if reduction != "mean":
        return _reduce(call, picked, reduction)
    # torch's mean is over the targets that are not ignored
    axes = tuple(range(target.ndim))
    count = _apply_op(
        call,
        (target,),
        sig.reduction(target.ndim, axes, False, "sum"),
        lambda t: (t != ignore_index).sum().to(picked.dtype),
        (),
        input._dtype,
        ("target",),
    )
    return _ops.OPERATORS["div"](_ops.sum(picked), count)


@_polymorphic(F.nll_loss)
def nll_loss(input: GlobalTensor, target: GlobalTensor, **options: Any) -> GlobalTensor:
    """Negative log likelihood of class indices ``target`` under log-probabilities ``input`` (..., C)."""
    return _nll("nll_loss", input, target, **options)


@_polymorphic(F.cross_entropy)
def cross_entropy(
    input: GlobalTensor, target: GlobalTensor, label_smoothing: float = 0.0, **options: Any
) -> GlobalTensor:
    """log_softmax over the class dimension (the last; inputs are (N, C) or (C,)), then :func:`nll_loss`
    with the same ``options`` (``ignore_index``, ``reduction``; torch's others are refused)."""
    _unsupported("cross_entropy", label_smoothing=label_smoothing)
    if input.ndim > 2:
        raise _fail("cross_entropy", f"input must be (N, C) or (C,), got {input.shape}: reshape to (-1, C)")
    return _nll("cross_entropy", input, target, **options, logits=True)


@_polymorphic(F.mse_loss)
def mse_loss(input: GlobalTensor, target: Any, size_average: Any = None, reduce: Any = None, **kw: Any) -> GlobalTensor:
    """Mean (or sum, ``reduction=``) of squared differences."""
    _unsupported("mse_loss", size_average=size_average, reduce=reduce, weight=kw.get("weight") is not None)
    diff = input - target
    return _reduce("mse_loss", diff * diff, kw.get("reduction", "mean"))
