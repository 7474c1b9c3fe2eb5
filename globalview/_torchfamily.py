"""The torch family: torch tensors as local parts, differentiable (imported only when torch parts are used).

Local operators run on the tensors (``_torchns`` is their numpy-like namespace), so torch records
them; boxing runs through ``_autograd``'s functions, whose backward is the plan's adjoint. A boxed
parameter may be *released* (FSDP's resharding): autograd does not keep the gathered weight for
backward but re-runs the conversion from the parameter's own part when backward needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import commlib
from commlib.arrays import as_array, numpy_dtype, torch_dtype
from globalview import _autograd, _groups, _leaf, _torchns
from globalview._family import Family
from globalview._placement import array_module
from globalview._placement import placement as Placement
from globalview._plan import Plan

__all__ = ["TORCH", "TorchFamily"]


class TorchFamily(Family):
    """torch tensors as local parts: autograd works, and the user sees torch dtypes."""

    name = "torch"
    xp = _torchns
    differentiable = True

    def dtype(self, np_dtype: np.dtype) -> Any:
        return torch_dtype(np_dtype)

    def dtype_of(self, local: Any) -> np.dtype:
        return numpy_dtype(local.dtype)

    def boxing_xp(self, pl: Placement) -> Any:
        return array_module(pl.type, "globalview")

    def as_array(self, local: Any) -> Any:
        return as_array(local.detach().contiguous())

    def empty(self, pl: Placement, dtype: np.dtype) -> Any:
        device = _torchns.device_for(pl.type, array_module(pl.type, "globalview"))
        return torch.empty((0,), dtype=torch_dtype(dtype), device=device)

    def box(self, p: Plan, local: Any, me: int, grad_sbp: Any = None, release: bool = False) -> Any:
        return _autograd.box(p, local, me, self.boxing_xp(p.src[0]), grad_sbp)

    def rebox(self, p: Plan, local: Any, me: int) -> torch.Tensor:
        """``local`` boxed by ``p`` again, in backward, outside autograd (a released part)."""
        with _groups.phase("backward"):
            return _autograd.run_plans((p,), local.detach(), me, self.boxing_xp(p.src[0]))

    def compute(self, fn: Any, args: Sequence[Any], released: Sequence[tuple[Any, Any]]) -> Any:
        """``fn(*args)``; the boxed parts in ``released`` (part, fetch) are not kept by autograd: backward
        calls ``fetch()`` for them (one more all_gather, FSDP's trade of communication for memory)."""
        if not released or not torch.is_grad_enabled():
            return fn(*args)
        sources = {_storage(t): fetch for t, fetch in released}

        def pack(t: torch.Tensor) -> Any:
            fetch = sources.get(_storage(t))  # the gathered part, or a view of it (linear saves weight.t())
            if fetch is None:
                return t
            return _Regather(fetch, (tuple(t.size()), t.stride(), t.storage_offset()))

        def unpack(saved: Any) -> torch.Tensor:
            return saved() if isinstance(saved, _Regather) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return fn(*args)

    def empty_result(self, inputs: Sequence[Any], like: Any) -> Any:
        return _autograd.empty_result(list(inputs), like)

    def requires_grad(self, local: Any) -> bool:
        return bool(local.requires_grad)

    def is_leaf(self, local: Any) -> bool:
        return bool(local.is_leaf)

    def detach(self, local: Any) -> Any:
        return local.detach()

    def grad(self, local: Any) -> Any:
        return local.grad

    def grad_fn(self, local: Any) -> Any:
        return local.grad_fn

    def from_local(self, local: torch.Tensor, src: torch.Tensor, make: Any, xp: Any) -> torch.Tensor:
        """The part of torch tensor ``local`` made global by ``make()`` (the cast of its ``xp`` view
        ``src``), differentiable when ``local`` requires grad."""

        def cast() -> tuple:
            part, *rest = make()
            return (_autograd.to_torch(part, src), *rest)

        return _autograd.from_local(local, cast, commlib.get_rank(), xp)

    def requires_grad_(self, t: Any, requires_grad: bool) -> None:
        t._local.requires_grad_(requires_grad)
        if requires_grad:
            _leaf.watch(t)

    def backward(self, t: Any, gradient: Any, retain_graph: Any, create_graph: bool) -> None:
        _autograd.run_backward(t, gradient, retain_graph, create_graph)

    def transpose_perm(self, ndim: int, axes: tuple) -> Any:
        """torch's spelling: ``transpose(dim0, dim1)`` swaps two dimensions (numpy's otherwise)."""
        if len(axes) != 2:
            return super().transpose_perm(ndim, axes)
        perm = list(range(ndim))
        a, b = (int(d) % ndim for d in axes)
        perm[a], perm[b] = perm[b], perm[a]
        return perm


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else -1


class _Regather:
    """What autograd keeps of a released part: how to get it again, and the saved view of it."""

    __slots__ = ("fetch", "view")

    def __init__(self, fetch: Any, view: tuple) -> None:
        self.fetch, self.view = fetch, view

    def __call__(self) -> torch.Tensor:
        return self.fetch().as_strided(*self.view)


TORCH = TorchFamily()
