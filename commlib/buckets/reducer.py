"""A framework-agnostic gradient reducer: flat buckets, all-reduces overlapped with the backward pass.

The reducer owns one flat buffer per bucket (see :mod:`commlib.buckets.planner`) in the parameters' own
array family: numpy, cupy, torch, or numpy views of any other host DLPack exporter. Hand it
each gradient as soon as it exists with :meth:`Reducer.ready`: it is divided by the world
size on its way into the bucket (one pass over the memory, not a copy and then a division),
and the moment a bucket's last gradient arrives its asynchronous all-reduce
(``commlib.all_reduce(bucket, async_op=True)``, a sum of the scaled gradients) starts, in
bucket-index order on every rank: a complete bucket waits for the earlier ones to be issued,
so all ranks issue the same collectives in the same order. :meth:`Reducer.finalize` waits for
all of them and returns the averaged gradients (views into the buckets). The first
``finalize`` also rebuilds the plan from the order gradients actually arrived on rank 0
(broadcast with ``broadcast_object_list``, so every rank agrees).

A plain numpy training loop with hand-written gradients::

    import numpy as np
    import commlib
    from commlib.buckets import Reducer

    w, b = np.zeros((2, 1)), np.zeros(1)
    reducer = Reducer([w, b], names=["w", "b"])
    for step in range(100):
        x, y = my_batch(commlib.get_rank())
        err = x @ w + b - y
        reducer.ready(1, err.sum(0))  # as backward would: the last layer's gradient first
        reducer.ready(0, x.T @ err)
        gw, gb = reducer.finalize()  # averaged over the ranks
        w -= 0.01 * gw
        b -= 0.01 * gb

``ddp.DistributedDataParallel`` and ``globalview.nn`` drive the same reducer from torch's gradient hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import commlib
from commlib.buckets import _arrays
from commlib.buckets.planner import FIRST_BUCKET_MB, LONE_MB, BucketPlan, complete_order, plan_buckets
from commlib.buckets.trace import COMM, COMPUTE, Tracer, tracer_for

__all__ = ["Comm", "Reducer", "average_all_reduce"]

#: ``comm(bucket_index, flat_buffer) -> handle``: starts the reduction of a bucket of *unscaled*
#: gradients; ``handle.wait()`` finishes it and returns None/True (buffer averaged in place) or
#: an array holding the average.
Comm = Callable[[int, Any], Any]


def average_all_reduce(group: Any = None) -> Comm:
    """A :data:`Comm` that averages with one asynchronous in-place ``ReduceOp.AVG`` all-reduce."""

    def comm(index: int, buffer: Any) -> Any:
        """Start averaging bucket ``index`` in place."""
        return commlib.all_reduce(buffer, op=commlib.ReduceOp.AVG, group=group, async_op=True)

    return comm


class Reducer:
    """Averages gradients across the ranks of ``group`` in flat buckets, overlapping communication.

    Args:
        params: one array per parameter (numpy, cupy, torch, or DLPack), in registration order;
            only their shape, dtype and device are used, to size the buckets.
        names: names for error messages (default ``param0``, ``param1``, ...).
        group: the commlib process group (default: the world).
        bucket_cap_mb, first_bucket_mb: bucket caps (see :func:`commlib.buckets.planner.plan_buckets`).
        find_unused: parameters not marked ready by :meth:`finalize` contribute zeros (else an error).
        rebuild: rebuild the plan from rank 0's ready order at the first :meth:`finalize`.
        comm: starts one bucket's reduction and averages it (see :data:`Comm`); by default
            gradients are scaled by 1/world_size into the buckets and summed by ``all_reduce``.
        trace: a Chrome-trace file path (default ``$COMMLIB_DDP_TRACE``) or a :class:`Tracer`.
        in_place: a gradient of :data:`~commlib.buckets.planner.LONE_MB` MiB or more gets a bucket
            of its own and is averaged where it is: :meth:`ready` keeps the array it is given
            (no copy into a bucket), the all-reduce writes into it (``ReduceOp.AVG``, or ``comm``)
            and :meth:`finalize` returns that very array. For callers that own the gradient and
            want the average in it (``ddp.DistributedDataParallel`` sets it); off by default.
    """

    def __init__(
        self,
        params: Sequence[Any],
        *,
        names: Sequence[str] | None = None,
        group: Any = None,
        bucket_cap_mb: float | None = None,
        first_bucket_mb: float | None = FIRST_BUCKET_MB,
        find_unused: bool = False,
        rebuild: bool = True,
        comm: Comm | None = None,
        trace: str | os.PathLike[str] | Tracer | None = None,
        in_place: bool = False,
    ) -> None:
        self.group = group
        self.rank = commlib.get_rank(group)
        self.world_size = commlib.get_world_size(group)
        self._label = f"[rank {self.rank}/{self.world_size}] Reducer"
        self._world = commlib.group.WORLD if group is None else None  # the default group it averages over
        self._arrays = self._check_params(params)
        self.names = self._check_names(names, len(self._arrays))
        self._infos = [_arrays.describe(a, n) for a, n in zip(self._arrays, self.names, strict=True)]
        self._caps = (bucket_cap_mb, first_bucket_mb)
        self.in_place = bool(in_place)
        self._lone_mb = LONE_MB if self.in_place else None
        self._own: dict[int, Any] = {}  # bucket -> the gradient reduced in place this iteration (in_place)
        self.find_unused = bool(find_unused)
        self._rebuild_pending = bool(rebuild)
        self._comm: Comm = self._sum
        self._scale = 1.0
        self._order: list[int] = []  # parameters marked ready in the current iteration
        self.set_comm(comm)
        self.tracer = trace if isinstance(trace, Tracer) else tracer_for(trace, self.rank)
        self.globally_used = [True] * len(self._arrays)
        self._scratch: list[Any] | None = None
        self._install(plan_buckets(self._infos, *self._caps, lone_mb=self._lone_mb), keep=False)
        self._reset()

    def follow(self) -> None:
        """Average over the default group as it is now: after ``commlib.shrink_group`` (a rank died) or
        ``commlib.grow_group`` (newcomers joined), the next iteration divides by the new world size. The
        iteration under way is forgotten (its reductions ran on the group that ended). A reducer over the default
        group (``group=None``) calls it by itself at the first gradient after the change."""
        self.rank, self.world_size = commlib.get_rank(self.group), commlib.get_world_size(self.group)
        self._label = f"[rank {self.rank}/{self.world_size}] Reducer"
        self._world = commlib.group.WORLD if self.group is None else None
        if self._comm == self._sum:  # a bound method is made anew at each access: not `is`
            self._scale = 1.0 / self.world_size
        self._reset()

    def set_comm(self, comm: Comm | None) -> None:
        """Reduce buckets with ``comm`` from the next iteration on (None: the default scaled sum)."""
        if self._order:
            raise RuntimeError(f"{self._label}.set_comm: cannot change the communication during an iteration")
        if comm is not None and not callable(comm):
            raise TypeError(f"{self._label}.set_comm: comm must be callable or None, got {comm!r}")
        self._comm = self._sum if comm is None else comm
        self._scale = 1.0 / self.world_size if comm is None else 1.0

    def _sum(self, index: int, buffer: Any) -> Any:
        """The default reduction: the gradients in ``buffer`` are already divided by the world size
        (a gradient reduced in place is not: it is averaged by the all-reduce, piece by piece)."""
        if index in self._own:
            return commlib.all_reduce(buffer, op=commlib.ReduceOp.AVG, group=self.group, async_op=True)
        return commlib.all_reduce(buffer, group=self.group, async_op=True)

    # -- construction ------------------------------------------------------------------
    def _check_params(self, params: Sequence[Any]) -> list[Any]:
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) or not params:
            raise ValueError(f"{self._label}: params must be a non-empty sequence of arrays, got {params!r}")
        arrays = [_arrays.as_array(p, self._label, f"params[{i}]") for i, p in enumerate(params)]
        for i, a in enumerate(arrays):
            if not _arrays.is_inexact(a):
                raise TypeError(f"{self._label}: params[{i}] has dtype {a.dtype}; gradients must be floating point")
        return arrays

    def _check_names(self, names: Sequence[str] | None, n: int) -> list[str]:
        if names is None:
            return [f"param{i}" for i in range(n)]
        names = list(names)
        if len(names) != n or not all(isinstance(x, str) for x in names):
            raise ValueError(f"{self._label}: names must be {n} strings (one per parameter), got {names!r}")
        return names

    def _install(self, plan: BucketPlan, keep: bool) -> None:
        """Allocate the buckets of ``plan``; with ``keep``, carry the current gradients over."""
        old = self.views if keep else None
        self.plan = plan
        self.buffers = [_arrays.zeros_like(self._arrays[b.params[0]], b.numel) for b in plan.buckets]
        self.views: list[Any] = [None] * len(self._arrays)
        for b, buffer in zip(plan.buckets, self.buffers, strict=True):
            for p, offset in zip(b.params, b.offsets, strict=True):
                self.views[p] = _arrays.flat_view(buffer, offset, self._infos[p].numel, tuple(self._arrays[p].shape))
        if old is not None:
            for new, previous in zip(self.views, old, strict=True):
                _arrays.copy_into(new, previous)
        self._bucket_of = [plan.bucket_of(p) for p in range(len(self._arrays))]
        self._sizes = [len(b.params) for b in plan.buckets]
        lone = self.in_place and self._lone_mb is not None
        self._alone = [lone and len(b.params) == 1 and b.nbytes >= LONE_MB * (1 << 20) for b in plan.buckets]
        self._scratch = None

    def _reset(self) -> None:
        """Forget the current iteration: nothing ready, nothing issued."""
        self._is_ready = bytearray(len(self._arrays))
        self._used = bytearray(len(self._arrays))
        self._pending = list(self._sizes)
        self._next = 0  # the next bucket to issue
        self._own = {}
        self._flights: list[list[Any]] = []  # [name, handle, buffer, issue time, end time or None]
        self._seen = 0  # flights before this one were seen complete
        self._order = []

    # -- one iteration -------------------------------------------------------------------
    def ready(self, index: int, grad: Any = None, *, used: bool = True) -> None:
        """Parameter ``index``'s gradient is final: copy ``grad`` into its bucket (None: already there).

        Starts the all-reduce of every bucket that is now complete and whose predecessors have
        started. ``used=False`` marks a gradient this rank did not compute (see ``find_unused``);
        with ``grad=None`` it must already be in the bucket view ``views[index]`` (unscaled).
        """
        if self._world is not None and self._world is not commlib.group.WORLD:
            self.follow()
        self._check_index(index, "ready")
        view = self.views[index]
        if grad is None or grad is view:
            _arrays.scale(view, self._scale)
            self._mark(index, used)
            return
        grad = _arrays.as_array(grad, f"{self._label}.ready", "grad")
        if tuple(grad.shape) != tuple(view.shape):
            raise ValueError(
                f"{self._label}.ready: grad for {self.names[index]!r} must have shape "
                f"{tuple(view.shape)}, got {tuple(grad.shape)}"
            )
        bucket = self._bucket_of[index]
        if self._alone[bucket] and _arrays.like(grad, view):
            self._own[bucket] = grad  # reduced where it is (see in_place)
        else:
            _arrays.scale_into(view, grad, self._scale)
        self._mark(index, used)

    def _check_index(self, index: int, call: str) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self._arrays):
            raise ValueError(
                f"{self._label}.{call}: index must be a parameter index in range({len(self._arrays)}), got {index!r}"
            )
        if self._is_ready[index]:
            raise RuntimeError(
                f"{self._label}.{call}: parameter {self.names[index]!r} was marked ready twice in one iteration "
                "(is it used by two backward passes before finalize()?)"
            )

    def _mark(self, index: int, used: bool) -> None:
        self._is_ready[index] = 1
        self._used[index] = used
        self._order.append(index)
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0 and bucket == self._next:
            self._issue_ready()
        self._poll()

    def mark_unused(self, index: int) -> None:
        """Parameter ``index`` got no gradient on this rank: it contributes zeros."""
        if self._world is not None and self._world is not commlib.group.WORLD:
            self.follow()
        self._check_index(index, "mark_unused")
        _arrays.zero(self.views[index])
        self._mark(index, used=False)

    def pending(self) -> list[int]:
        """Indices of the parameters not marked ready in the current iteration."""
        return [i for i, r in enumerate(self._is_ready) if not r]

    def _issue_ready(self) -> None:
        """Issue complete buckets in index order, stopping at the first incomplete one."""
        while self._next < len(self.buffers) and self._pending[self._next] == 0:
            own = self._own.get(self._next)  # a gradient reduced in place, seen flat as a bucket is
            self._issue(self._next, self.buffers[self._next] if own is None else own.reshape(-1))
            self._next += 1

    def _issue(self, index: int, buffer: Any) -> None:
        start = Tracer.now() if self.tracer else 0.0
        handle = self._comm(index, buffer)
        self._flights.append([f"all_reduce bucket {index}", handle, buffer, start, None])

    def _poll(self) -> None:
        """Test the oldest unfinished all-reduces: drives MPI's progress and times their completion."""
        while self._seen < len(self._flights):
            flight = self._flights[self._seen]
            test = getattr(flight[1], "is_completed", None)
            if test is None or not test():
                return
            flight[4] = Tracer.now() if self.tracer else 0.0
            self._seen += 1

    def finalize(self) -> list[Any]:
        """Wait for every bucket, then return the averaged gradients (views into the buckets).

        Raises:
            RuntimeError: a parameter was not marked ready and ``find_unused`` is off (the
                reducer is reset first, so the next iteration can start cleanly).
        """
        start = Tracer.now() if self.tracer else 0.0
        missing = self.pending()
        if missing and not self.find_unused:
            self.abandon()
            names = ", ".join(repr(self.names[i]) for i in missing)
            raise RuntimeError(
                f"{self._label}.finalize: parameters {names} (indices {missing}) received no gradient in this "
                "iteration; mark every parameter ready on every rank, or pass find_unused=True to give "
                "unused parameters a zero contribution"
            )
        for i in missing:
            self.mark_unused(i)
        used_map = self._issue_used_map() if self.find_unused else None
        self._wait_all()
        if used_map is not None:
            self.globally_used = [float(v) > 0 for v in used_map.tolist()]
        order, flights = self._order, self._flights
        views = list(self.views)
        for bucket, grad in self._own.items():
            views[self.plan.buckets[bucket].params[0]] = grad
        self._reset()
        if self._rebuild_pending:
            self._rebuild(order)
        self._trace("finalize", start, flights)
        return views

    def _issue_used_map(self) -> Any:
        """All-reduce which parameters any rank used, after the buckets (same order everywhere)."""
        used_map = _arrays.zeros_like(self.buffers[0], len(self._arrays))
        for i, u in enumerate(self._used):
            if u:
                used_map[i] = 1
        start = Tracer.now() if self.tracer else 0.0
        work = commlib.all_reduce(used_map, group=self.group, async_op=True)
        self._flights.append(["all_reduce used-map", work, used_map, start, None])
        return used_map

    def _wait_all(self) -> None:
        """Wait for the issued reductions in issue order; copy hook results into their buckets."""
        for flight in self._flights:
            result = flight[1].wait()
            if result is not None and not isinstance(result, bool) and result is not flight[2]:
                _arrays.copy_into(flight[2], result)
            if flight[4] is None:
                flight[4] = Tracer.now() if self.tracer else 0.0
        self._seen = len(self._flights)

    def abandon(self) -> None:
        """Wait for whatever was issued (peers expect it), then forget the iteration."""
        try:
            for flight in self._flights:
                flight[1].wait()
        finally:
            self._reset()

    def _trace(self, name: str, start: float, flights: list[list[Any]]) -> None:
        if self.tracer is None:
            return
        self.tracer.span(name, COMPUTE, start, Tracer.now())
        for label, _, buffer, issued, done in flights:
            self.tracer.span(label, COMM, issued, done, bytes=int(buffer.nbytes))
        self.tracer.flush()

    # -- plan rebuild and shadow iterations ----------------------------------------------
    def _rebuild(self, order: list[int]) -> None:
        """Adopt rank 0's plan from the order gradients became ready in the first iteration."""
        self._rebuild_pending = False
        walk = complete_order(order, len(self._infos))
        plan = plan_buckets(self._infos, *self._caps, order=walk, lone_mb=self._lone_mb)
        box: list[Any] = [plan if order else None]  # a rank that only shadowed has no order to offer
        if self.world_size > 1:
            commlib.broadcast_object_list(box, group=self.group, group_src=0)
        if box[0] is None or box[0] == self.plan:
            return
        self._check_plan(box[0])
        self._install(box[0], keep=True)

    def plan_state(self) -> tuple[Any, bool]:
        """What a newcomer needs to make the calls this rank makes: the bucket plan, and whether the first
        iteration's rebuild is still to come (``ddp.broadcast_state`` sends it)."""
        return self.plan, self._rebuild_pending

    def adopt(self, state: tuple[Any, bool]) -> None:
        """Take another rank's :meth:`plan_state` (a newcomer after ``commlib.grow_group``): the same buckets and
        the same rebuild to come, so that the next iteration's calls match theirs."""
        plan, pending = state
        self._rebuild_pending = bool(pending)
        if plan != self.plan:
            self._check_plan(plan)
            self._install(plan, keep=True)

    def _check_plan(self, plan: Any) -> None:
        ok = isinstance(plan, BucketPlan) and len(plan.location) == len(self._infos)
        ok = ok and all(sum(self._infos[p].numel for p in b.params) == b.numel for b in plan.buckets)
        ok = ok and all((b.dtype, b.device) == self._infos[p].key for b in plan.buckets for p in b.params)
        if not ok:
            raise ValueError(f"{self._label}: rank 0's bucket plan does not fit this rank's parameters: {plan}")

    def shadow(self) -> None:
        """Take part in one iteration's collectives with zero gradients (a rank out of data, see join)."""
        if self._order or self._flights:
            raise RuntimeError(f"{self._label}.shadow: an iteration is in progress ({len(self._order)} ready)")
        start = Tracer.now() if self.tracer else 0.0
        if self._scratch is None:
            self._scratch = [_arrays.zeros_like(buffer, buffer.shape[0]) for buffer in self.buffers]
        for index, buffer in enumerate(self._scratch):
            _arrays.zero(buffer)  # a hook may have written into it last time
            self._issue(index, buffer)
        if self.find_unused:
            self._issue_used_map()
        self._wait_all()
        flights = self._flights
        self._reset()
        if self._rebuild_pending:
            self._rebuild([])
        self._trace("shadow", start, flights)
