"""The collectives on tensors, with torch.distributed's signatures (validation, then one backend call)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from commlib._diagnostics import flight as _flight
from commlib._diagnostics.debug import check as check_call
from commlib._group import ProcessGroup, Work
from commlib._ops import ReduceOp, as_reduce_op
from commlib._settings import value as setting
from commlib._world import _state as _world
from commlib._world import resolve
from commlib.arrays import DTYPES, address, op_error, same_kind, strided_view

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "in_place",
    "ran_ready",
    "root_rank",
    "check_list",
    "pair",
    "packed",
    "unpack",
]


_now, _starts, _ends, _slots = _flight.now, _flight.ring.starts, _flight.ring.ends, _flight.ring.slots
_ndarray = np.ndarray
_SUM = ReduceOp.SUM  # Enum class attribute access costs ~50 ns; the hot path reads a global


def _op(op: Any, dtype: np.dtype, g: ProcessGroup, call: str) -> ReduceOp:
    if type(op) is not ReduceOp:
        op = as_reduce_op(op, f"{g.label}{call}")
    if (op, dtype) in g.reductions:  # checked before on this group
        return op
    if why := op_error(op, dtype):
        raise TypeError(f"{g.label}{call}: {why}")
    if g.limits is not None and (why := g.limits(dtype, op)):
        raise TypeError(
            f"{g.label}{call}: op={op} on dtype {dtype} is not supported by the {g.backend_name} backend: {why}"
        )
    g.reductions.add((op, dtype))
    return op


def in_place(g: ProcessGroup, tensor: Any, call: str, writable: bool = True) -> tuple[Any, Any]:
    """The tensor of an in-place call (all_reduce, broadcast, reduce; send and recv) as the backend's array, and
    what to run once the call is done (None). A non-contiguous tensor, which torch's backends take too: a
    contiguous copy, and the copy back (``writable``); a call that fails leaves the tensor as it was."""
    try:
        return g.buffer(tensor, g, call, "tensor", writable), None
    except ValueError:
        view = strided_view(tensor, g.host, f"{g.label}{call}", "tensor")
        if view.flags.c_contiguous or view.dtype not in DTYPES or (writable and g.host and not view.flags.writeable):
            raise  # not about the layout: the intake's own error (device memory has no read-only flag)
    staged = g.xp.ascontiguousarray(view)
    return staged, (functools.partial(_copy_back, view, staged) if writable else None)


def _copy_back(view: Any, staged: Any) -> None:
    view[...] = staged


def root_rank(g: ProcessGroup, call: str, rank: Any, group_rank: Any, arg: str, default: int | None = None) -> int:
    """The group rank named by a global ``rank`` or by ``group_rank`` (torch's src/group_src pairs)."""
    if group_rank is not None:
        if rank is not None:
            raise ValueError(f"{g.label}{call}: give {arg} (a global rank) or group_{arg}, not both")
        return g.check_group_rank(group_rank, call, f"group_{arg}")
    if rank is None:
        if default is None:
            raise ValueError(f"{g.label}{call}: {arg} is required (the global rank); or pass group_{arg}")
        rank = default
    return g.group_rank(rank, call, arg)


def _is_chunk(part: np.ndarray, whole: np.ndarray, index: int) -> bool:
    return address(part) == address(whole) + index * part.nbytes and part.size * (index + 1) <= whole.size


def _check_count(g: ProcessGroup, call: str, arg: str, a: np.ndarray, n: int, each: int) -> None:
    if a.size != n * each:
        raise ValueError(f"{g.label}{call}: {arg} must have {n}*{each}={n * each} elements, got {a.size}")


def check_list(
    g: ProcessGroup,
    call: str,
    arg: str,
    items: Any,
    like: np.ndarray,
    writable: bool,
    count: int | None = None,
    like_arg: str = "tensor",
) -> list[np.ndarray]:
    """Validate a list of ``g.size`` arrays with ``like``'s dtype and size (``count`` elements if given)."""
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{g.label}{call}: {arg} must be a list of {g.size} tensors, got {type(items).__name__}")
    if len(items) != g.size:
        raise ValueError(f"{g.label}{call}: {arg} must hold one tensor per rank ({g.size}), got {len(items)}")
    out = []
    for i, item in enumerate(items):
        a = g.buffer(item, g, call, f"{arg}[{i}]", writable)
        same_kind(a, like, g, call, f"{arg}[{i}]", like_arg)
        if count is not None and a.size != count:
            raise ValueError(f"{g.label}{call}: {arg}[{i}] must have {count} elements like {like_arg}, got {a.size}")
        out.append(a)
    return out


def all_reduce(
    tensor: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` across the group; every rank gets the result in place."""
    g = _world.world if group is None else group
    # The common case (a numpy array, SUM, a size seen before) runs the backend's ready operation (its own lookup,
    # Backend.sums): this function's own overhead is most of a small call's latency.
    if (
        op is _SUM
        and not async_op
        and type(tensor) is _ndarray
        and type(g) is ProcessGroup
        and (sums := g.sums) is not None
        and not g.pending
        and (p := sums.get(tensor.nbytes)) is not None
        and g.run_ready("all_reduce", p, tensor, tensor)
    ):
        return None
    if g is None or type(g) is not ProcessGroup or g.broken is not None or g.backend is None:
        g, _ = resolve(group, "all_reduce")
    a, back = tensor, None
    if type(a) is not np.ndarray or not g.host or not (a.flags.carray and a.dtype in DTYPES):
        a, back = in_place(g, tensor, "all_reduce")
    # SUM is defined for every dtype on mpi: skip the op check on the hot path there
    if op is not _SUM or g.limits is not None:
        op = _op(op, a.dtype, g, "all_reduce")
    if g.detail:
        check_call(g, "all_reduce", a, op)
    if async_op or (fused := g.fused_all_reduce) is None or not g.host or back is not None:
        return g.issue("all_reduce", "all_reduce", (a, a, op), async_op, a.dtype, a.size, back)
    g.run("all_reduce", a.dtype, a.size, g.timeout, fused, a, a, op)  # issue(), inlined
    return None


def ran_ready(group: Any, call: str, table: str, key: tuple, inp: Any, out: Any, async_op: bool) -> bool:
    """Run a blocking call through the backend's ready operation of ``table`` for ``key`` (Backend.residents:
    by the arrays' byte counts and the call's root, peer or splits), if there is one and the arrays are its
    (:meth:`ProcessGroup.run_ready`); True: done; False: the generic path (nothing happened)."""
    g = _world.world if group is None else group
    return (
        not async_op
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready[table].get(key)) is not None
        and g.run_ready(call, p, inp, out)
    )


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``tensor`` from rank ``src`` to every rank of the group, in place."""
    g = _world.world if group is None else group
    if (
        type(tensor) is _ndarray
        and type(src) is int
        and group_src is None
        and not async_op
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready["broadcast"].get((tensor.nbytes, src))) is not None
        and g.run_ready("broadcast", p, tensor, tensor)
    ):
        return None
    g, _ = resolve(group, "broadcast")
    a, back = in_place(g, tensor, "broadcast")
    root = root_rank(g, "broadcast", src, group_src, "src")
    if g.detail:
        check_call(g, "broadcast", a, root=root)
    return g.issue("broadcast", "broadcast", (a, root), async_op, a.dtype, a.size, back)


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into rank ``dst``'s tensor (the others' are left unchanged)."""
    call = "reduce"
    if (
        op is _SUM
        and type(tensor) is _ndarray
        and type(dst) is int
        and group_dst is None
        and ran_ready(group, call, "reduce", (tensor.nbytes, dst), tensor, tensor, async_op)
    ):
        return None
    g, _ = resolve(group, call)
    a, back = in_place(g, tensor, call)
    op = _op(op, a.dtype, g, call)
    root = root_rank(g, call, dst, group_dst, "dst")
    if g.detail:
        check_call(g, call, a, op, root)
    return g.issue(call, "reduce", (a, a, op, root), async_op, a.dtype, a.size, back)


def pair(g: ProcessGroup, call: str, output: Any, out_arg: str, input: Any, in_arg: str) -> tuple[Any, Any]:
    """An (output, input) pair of buffers of the same dtype; the input may be read-only."""
    out = g.buffer(output, g, call, out_arg)
    inp = g.buffer(input, g, call, in_arg, writable=False)
    same_kind(out, inp, g, call, out_arg, in_arg)
    return out, inp


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Concatenate every rank's ``input_tensor`` (in rank order) into ``output_tensor`` on every rank."""
    call = "all_gather_into_tensor"
    if (
        type(input_tensor) is _ndarray
        and type(output_tensor) is _ndarray
        and ran_ready(group, call, "all_gather", (input_tensor.nbytes, output_tensor.nbytes), input_tensor,
                      output_tensor, async_op)
    ):  # fmt: skip
        return None
    g, _ = resolve(group, call)
    out, inp = pair(g, call, output_tensor, "output_tensor", input_tensor, "input_tensor")
    _check_count(g, call, "output_tensor", out, g.size, inp.size)
    if g.detail:
        check_call(g, call, inp)
    send: np.ndarray | None = inp
    if g.xp.may_share_memory(out, inp):
        send = None if _is_chunk(inp, out, g.rank) else inp.copy()
    return g.issue(call, "all_gather", (send, out), async_op, inp.dtype, inp.size)


def all_gather(
    tensor_list: list, tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
    call = "all_gather"
    g, _ = resolve(group, call)
    inp = g.buffer(tensor, g, call, "tensor", writable=False)
    outs = check_list(g, call, "tensor_list", tensor_list, inp, writable=True, count=inp.size)
    if g.detail:
        check_call(g, call, inp)
    flat = packed(outs)
    if flat is not None:  # written in place; an input inside it is this rank's chunk (or copied first)
        send = None if _is_chunk(inp, flat, g.rank) else inp.copy() if g.xp.may_share_memory(flat, inp) else inp
        return g.issue(call, "all_gather", (send, flat), async_op, inp.dtype, inp.size)
    flat = g.xp.empty(g.size * inp.size, inp.dtype)
    return g.issue(call, "all_gather", (inp, flat), async_op, inp.dtype, inp.size, lambda: unpack(flat, outs))


_PACKED_FROM = 64 << 10  # bytes


def _native_span() -> Any:
    """The C module's ``span`` (None: not built, or ``COMMLIB_NATIVE=0``)."""
    if not setting("COMMLIB_NATIVE"):
        return None
    try:
        return importlib.import_module("commlib.backends._ready").span  # a C module, no MPI; built or not
    except ImportError:
        return None


_span = _native_span()


def packed(parts: list[Any]) -> Any | None:
    """One flat view over ``parts`` when they lie back to back, in order, in one numpy buffer; else None.

    A list such as ``[x[0:n], x[n:2n], ...]`` then needs no staging buffer and no copy: the
    collective reads or writes it where it is.
    """
    first = parts[0] if parts else None
    if type(first) is not np.ndarray or first.nbytes * len(parts) < _PACKED_FROM:
        return None  # small lists: staging costs less than finding out
    got = _span(parts) if _span is not None and type(parts) is list else None
    if got is False:
        return None
    if got is None:  # no C module, or it cannot tell (e.g. bfloat16, which exports no buffer)
        got = _span_python(parts)
        if got is None:
            return None
    root, base, size, start, at = got
    count = (at - start) // first.itemsize
    if 0 <= base <= start and at <= base + size:  # a view of the root: ~0.4 us, as_strided ~2 us
        flat = np.ndarray((count,), first.dtype, buffer=root, offset=start - base)
        if not first.flags.writeable:
            flat.flags.writeable = False
        return flat
    flat = first.reshape(-1)
    return np.lib.stride_tricks.as_strided(flat, (count,), (first.itemsize,), writeable=flat.flags.writeable)


def _span_python(parts: list[Any]) -> tuple[np.ndarray, int, int, int, int] | None:
    """What the C module's ``span`` tells, in Python: (root array, its address or -1, its bytes, start, end)
    of back-to-back parts of one dtype in one root's memory, else None."""
    first = parts[0]
    owner, at = _owner(first), address(first)
    start = at
    for a in parts:
        if type(a) is not np.ndarray or not a.flags.c_contiguous or a.dtype != first.dtype or address(a) != at:
            return None
        if _owner(a) is not owner:
            return None
        at += a.nbytes
    root = first
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root, (address(root) if root.flags.c_contiguous else -1), root.nbytes, start, at


def _owner(a: np.ndarray) -> Any:
    """The object that owns ``a``'s memory (the end of its chain of bases)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base if a.base is not None else a


def unpack(flat: Any, outs: list[Any]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (each its own size and shape)."""
    start = 0
    for a in outs:
        a[...] = flat[start : start + a.size].reshape(a.shape)
        start += a.size


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input`` across the group and leave chunk ``rank`` of the result in ``output``."""
    call = "reduce_scatter_tensor"
    if (
        op is _SUM
        and type(input) is _ndarray
        and type(output) is _ndarray
        and ran_ready(group, call, "reduce_scatter", (input.nbytes, output.nbytes), input, output, async_op)
    ):
        return None
    g, _ = resolve(group, call)
    out, inp = pair(g, call, output, "output", input, "input")
    _check_count(g, call, "input", inp, g.size, out.size)
    op = _op(op, out.dtype, g, call)
    if g.detail:
        check_call(g, call, out, op)
    if g.xp.may_share_memory(out, inp):
        inp = inp.copy()  # MPI reduces in place only at offset 0; a copy keeps any aliasing correct
    return g.issue(call, "reduce_scatter", (inp, out, op), async_op, out.dtype, inp.size)


def reduce_scatter(
    output: Any, input_list: list, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input_list[i]`` across the group into rank i's ``output``."""
    call = "reduce_scatter"
    g, _ = resolve(group, call)
    out = g.buffer(output, g, call, "output")
    ins = check_list(g, call, "input_list", input_list, out, writable=False, count=out.size, like_arg="output")
    op = _op(op, out.dtype, g, call)
    if g.detail:
        check_call(g, call, out, op)
    send = packed(ins)
    if send is None:
        send = g.xp.concatenate([a.reshape(-1) for a in ins]) if ins else g.xp.empty(0, out.dtype)
    elif g.xp.may_share_memory(out, send):
        send = send.copy()  # as reduce_scatter_tensor: MPI reduces in place only at offset 0
    return g.issue(call, "reduce_scatter", (send, out, op), async_op, out.dtype, send.size)


def all_gather_single(
    output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """torch 2.13's new name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter_single(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """torch 2.13's new name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)
