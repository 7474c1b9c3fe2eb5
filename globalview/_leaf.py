"""Leaf gradients, OneFlow's rule: a leaf's accumulated gradient is converted to the leaf's own layout.

In the local autograd graph a gradient has the dual layout of its tensor (``_plan.dual``): a
broadcast parameter fed a split batch collects a partial sum. Two hooks per leaf keep
``.grad`` in the leaf's layout between backward passes, so torch optimizers can step the
local parts and gradients accumulate correctly over several backward passes (micro-batches):

- before accumulation (a tensor hook), an existing ``.grad`` goes back to the dual layout
  (along a broadcast axis: kept on the first rank, zeroed on the others, no communication);
- after accumulation (a post-accumulate-grad hook), ``.grad`` goes to the leaf's layout.

For broadcast axes that conversion is a sum over the axis's ranks (P -> B). Leaves laid out
only as split/broadcast hand their gradients to :class:`commlib.buckets.Reducer` (the one ddp
uses): flat buckets, each bucket's all-reduce started the moment its last gradient is ready,
overlapped with the rest of backward; one callback at the end of backward waits for them and
writes ``.grad``. Leaves with a partial layout are converted one by one by their boxing plan.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Variable

import commlib
from commlib.buckets import Reducer
from globalview import _groups
from globalview._autograd import run_plans
from globalview._placement import array_module
from globalview._placement import placement as Placement
from globalview._plan import dual, plan
from globalview.sbp import SbpParallel

__all__ = ["Leaf", "LeafGrads", "watch"]


@dataclass(frozen=True)
class Leaf:
    """One leaf: its name (for messages), its torch local part, and its global layout."""

    name: str
    param: torch.Tensor
    shape: tuple[int, ...]
    dtype: Any
    placement: Placement
    sbp: tuple[SbpParallel, ...]

    def bucket_key(self) -> tuple | None:
        """(placement, broadcast axes) when the bucketed reducer converts this leaf's gradient, else None.

        Not for a leaf split(0) along a mesh axis: operators that need it whole get it from the module's
        ``_weights.Gathers``, which sums its broadcast axes itself (two reducers would write one ``.grad``)."""
        if any(s.is_partial for s in self.sbp) or any(
            s.is_split and s.dim == 0 and self.placement.hierarchy[a] > 1 for a, s in enumerate(self.sbp)
        ):
            return None
        axes = tuple(a for a, s in enumerate(self.sbp) if s.is_broadcast and self.placement.hierarchy[a] > 1)
        return (self.placement, axes) if axes else None


class LeafGrads:
    """The gradient hooks of a set of leaves (a module's parameters, or one global tensor)."""

    def __init__(self, leaves: Sequence[Leaf], *, bucket: bool = True, bucket_cap_mb: float | None = None) -> None:
        self.me = commlib.get_rank()
        self.leaves = list(leaves)
        self.reducers: dict[tuple, tuple[Reducer, list[int], tuple[int, ...]]] = {}
        self._armed: set[tuple] = set()
        keys = [leaf.bucket_key() if bucket else None for leaf in self.leaves]
        for key in dict.fromkeys(k for k in keys if k is not None):
            self._make_reducer(key, [i for i, k in enumerate(keys) if k == key], bucket_cap_mb)
        self._where = {i: key for key, (_, members, _) in self.reducers.items() for i in members}
        self._slot = {i: j for _, members, _ in self.reducers.values() for j, i in enumerate(members)}
        for i, leaf in enumerate(self.leaves):
            leaf.param.register_hook(functools.partial(self._before, i))
            leaf.param.register_post_accumulate_grad_hook(functools.partial(self._after, i))

    def _make_reducer(self, key: tuple, members: list[int], cap: float | None) -> None:
        pl, axes = key
        group, ranks = _groups.sub_mesh_group(pl, axes, self.me)  # every rank makes every group
        if self.me not in ranks:
            return
        params = [self.leaves[i].param for i in members]
        names = [self.leaves[i].name for i in members]

        def comm(index: int, buffer: torch.Tensor) -> Any:
            """Sum one bucket of partial gradients over the broadcast axes (P -> B)."""
            _groups.note("all_reduce", ranks, buffer.numel() * buffer.element_size())
            return commlib.all_reduce(buffer, group=group, async_op=True)

        # in_place: a large gradient is summed where it is, in ``.grad`` (no copy into a bucket and back),
        # as ddp.DistributedDataParallel does
        reducer = Reducer(params, names=names, group=group, bucket_cap_mb=cap, comm=comm, in_place=True)
        self.reducers[key] = (reducer, members, ranks)

    def _convert(self, i: int, src: tuple, dst: tuple) -> None:
        leaf = self.leaves[i]
        p = _plan(leaf.shape, leaf.dtype, leaf.placement, src, dst)
        if all(step.kind == "relabel" for step in p.steps):  # nothing to do (a placement of one rank)
            return
        grad = leaf.param.grad
        if grad is None:
            return
        new = run_plans((p,), grad, self.me, array_module(leaf.placement.type, "globalview"))
        with torch.no_grad():
            grad.copy_(new)

    def _before(self, i: int, incoming: torch.Tensor) -> torch.Tensor:
        """Tensor hook: put an existing ``.grad`` back in the dual layout before torch adds to it."""
        leaf = self.leaves[i]
        if leaf.param.grad is not None and self.me in leaf.placement:
            with _groups.phase("backward"):
                self._convert(i, leaf.sbp, dual(leaf.sbp))
        return incoming

    def _after(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate hook: ``.grad`` to the leaf's layout (bucketed for split/broadcast leaves)."""
        leaf = self.leaves[i]
        if self.me not in leaf.placement:
            return
        key = self._where.get(i)
        with _groups.phase("backward"):
            if key is None:
                self._convert(i, dual(leaf.sbp), leaf.sbp)
                return
            if key not in self._armed:
                self._armed.add(key)
                Variable._execution_engine.queue_callback(functools.partial(self._finalize, key))
            self.reducers[key][0].ready(self._slot[i], param.grad)

    def _finalize(self, key: tuple) -> None:
        """End of backward: wait for the bucket all-reduces, write the sums into ``.grad``."""
        self._armed.discard(key)
        reducer, members, _ = self.reducers[key]
        with _groups.phase("backward"):
            views = reducer.finalize()
        with torch.no_grad():
            for i, view in zip(members, views, strict=True):
                grad = self.leaves[i].param.grad
                if grad is not None and view is not grad:  # else summed in place
                    grad.copy_(view)


@functools.lru_cache(maxsize=1024)
def _plan(shape: tuple[int, ...], dtype: Any, pl: Placement, src: tuple, dst: tuple) -> Any:
    """The leaf gradient's conversion plan (pure, so each leaf's is made once)."""
    return plan(shape, dtype, (pl, src), (pl, dst))


def watch(t: Any, name: str = "tensor") -> None:
    """Give global tensor ``t`` (a leaf with torch parts) the leaf-gradient hooks, once."""
    local = t._local
    if getattr(local, "_gv_grads", None) is not None:
        return
    leaf = Leaf(name, local, t.shape, t._dtype, t.placement, t.sbp)
    local._gv_grads = LeafGrads([leaf], bucket=False)
