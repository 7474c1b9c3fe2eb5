"""The array family of a global tensor's local parts: numpy, cupy or torch, behind one small interface.

Operators and conversions ask a tensor's :class:`Family` for what differs between the kinds of
local part (the namespace local operators run in, how a part is boxed, whether autograd is
involved), so none of them branches on the kind. numpy and cupy parts are :class:`ArrayFamily`;
torch parts are ``globalview._torchfamily.TORCH`` (imported only when torch parts are used, so
``import globalview`` does not import torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import commlib
from commlib.arrays import numpy_dtype
from globalview._boxing import empty_local, execute
from globalview._placement import array_module
from globalview._placement import placement as Placement
from globalview._plan import Plan

__all__ = ["ArrayFamily", "Family", "array_family", "placement_family"]


def _label() -> str:
    return f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] "


class Family:
    """What globalview needs of one kind of local part. Subclasses: :class:`ArrayFamily`, the torch family."""

    name = "array"
    xp: Any = np  # the numpy-like namespace local operators call (``xp.sum``, ``xp.matmul``...)
    differentiable = False  # autograd runs through the parts (torch)

    def dtype(self, np_dtype: np.dtype) -> Any:
        """The dtype users see for parts of numpy dtype ``np_dtype``."""
        return np_dtype

    def dtype_of(self, local: Any) -> np.dtype:
        """The numpy dtype of a local part."""
        return numpy_dtype(local.dtype)

    def boxing_xp(self, pl: Placement) -> Any:
        """The numpy/cupy module boxing moves parts on ``pl`` with."""
        return self.xp

    def as_array(self, local: Any) -> Any:
        """``local`` as the numpy/cupy array commlib moves (zero copy)."""
        return local

    def empty(self, pl: Placement, dtype: np.dtype) -> Any:
        """The local part of a rank outside a tensor's placement."""
        return empty_local(self.xp, dtype)

    def box(self, p: Plan, local: Any, me: int, grad_sbp: Any = None, release: bool = False) -> Any:
        """``local`` converted by plan ``p`` (differentiable for torch parts; ``release``: see the torch family)."""
        return execute(p, local, me, self.xp)

    def rebox(self, p: Plan, local: Any, me: int) -> Any:
        """``local`` boxed by ``p`` again (a released part, for backward)."""
        return execute(p, local, me, self.xp)

    def compute(self, fn: Any, args: Sequence[Any], released: Sequence[tuple[Any, Any]]) -> Any:
        """``fn(*args)`` on local parts; ``released`` lists (boxed part, fetch) autograd may drop and fetch again."""
        return fn(*args)

    def empty_result(self, inputs: Sequence[Any], like: Any) -> Any:
        """The empty part of a rank outside the placement (linked to ``inputs`` under autograd)."""
        return like

    def requires_grad(self, local: Any) -> bool:
        """Whether autograd tracks a part."""
        return False

    def is_leaf(self, local: Any) -> bool:
        """Whether a part is an autograd leaf (every numpy/cupy part is)."""
        return True

    def detach(self, local: Any) -> Any:
        """A part without autograd history."""
        return local

    def grad(self, local: Any) -> Any:
        """A leaf part's accumulated gradient, or None."""
        return None

    def grad_fn(self, local: Any) -> Any:
        """The autograd node that made a part, or None."""
        return None

    def requires_grad_(self, t: Any, requires_grad: bool) -> None:
        """Make global tensor ``t`` a leaf that collects gradients (torch parts only)."""
        raise TypeError(
            f"{_label()}GlobalTensor.requires_grad_: autograd needs torch local parts; make the tensor with a "
            f"torch dtype or from torch tensors"
        )

    def backward(self, t: Any, gradient: Any, retain_graph: Any, create_graph: bool) -> None:
        """``t.backward(...)`` (torch parts only)."""
        raise TypeError(
            f"{_label()}GlobalTensor.backward: autograd needs torch local parts; this tensor's parts are "
            f"{self.name} arrays"
        )

    def transpose_perm(self, ndim: int, axes: tuple) -> Any:
        """The permutation ``x.transpose(*axes)`` means: numpy's spelling (a permutation, or none: reversed)."""
        return axes[0] if len(axes) == 1 else (axes or None)

    def __repr__(self) -> str:
        return f"<globalview family {self.name}>"


class ArrayFamily(Family):
    """numpy or cupy local parts (``xp`` is the module)."""

    def __init__(self, xp: Any) -> None:
        self.xp, self.name = xp, xp.__name__


_FAMILIES: dict[int, ArrayFamily] = {}


def array_family(xp: Any) -> ArrayFamily:
    """The family of numpy or cupy module ``xp`` (one object per module)."""
    fam = _FAMILIES.get(id(xp))
    if fam is None:
        fam = _FAMILIES[id(xp)] = ArrayFamily(xp)
    return fam


def placement_family(pl: Placement, call: str) -> ArrayFamily:
    """The numpy/cupy family for placement ``pl`` (checked against the job's backend)."""
    return array_family(array_module(pl.type, call))
