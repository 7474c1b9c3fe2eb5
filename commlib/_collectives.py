"""The collectives on tensors, with torch.distributed's signatures: validate, describe the call once
(:class:`~commlib.backends._call.Call`), hand it to :meth:`ProcessGroup.call`.

The fast path: a blocking call on a numpy array whose description the group ran before runs the backend's
ready operation for it at once (:meth:`ProcessGroup.run_ready`), found in ``g.ready`` by a key each function
builds from its arguments alone, before any validation (the operation's ``go`` refuses arrays that are not
its: another dtype of the same byte count). The keys, written here and in ``_composed``, ``_barrier`` and
``_p2p``, and given to ``ProcessGroup.call`` on the generic path so the backend lists the operation it makes
under the same key (ranks given as global ranks)::

    all_reduce (SUM)            bytes
    broadcast                   ("broadcast", bytes, src)
    reduce (SUM)                ("reduce", bytes, dst)
    all_gather_into_tensor      ("all_gather", input bytes, output bytes)
    reduce_scatter_tensor (SUM) ("reduce_scatter", input bytes, output bytes)
    all_to_all_single           ("all_to_all", input bytes, output bytes[, input splits, output splits])
    gather, scatter             ("gather" / "scatter", bytes of a chunk, dst / src)
    barrier                     ("barrier",)
    send, recv                  ("send" / "recv", bytes, dst / src, tag)
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from commlib._group import ProcessGroup, Work
from commlib._ops import ReduceOp, as_reduce_op
from commlib._world import _state as _world
from commlib._world import resolve
from commlib.arrays import DTYPES, address, op_error, packed, same_kind, strided_view, unpack
from commlib.backends._call import Call

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
]


_ndarray = np.ndarray
_SUM = ReduceOp.SUM  # Enum class attribute access costs ~50 ns; the hot path reads a global
_new = tuple.__new__  # a Call from a tuple of all its fields: half the cost of its constructor


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
    # The common case (a numpy array, SUM, a size seen before) runs the backend's ready operation: this
    # function's own overhead is most of a small call's latency.
    if (
        op is _SUM
        and not async_op
        and type(tensor) is _ndarray
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready.get(tensor.nbytes)) is not None
        and g.run_ready("all_reduce", p, tensor, tensor)
    ):
        return None
    if g is None or type(g) is not ProcessGroup or g.broken is not None or g.backend is None:
        g, _ = resolve(group, "all_reduce")
    a, back = tensor, None
    if type(a) is not np.ndarray or not g.host or not (a.flags.carray and a.dtype in DTYPES):
        try:  # in_place(), inlined for the device path's sake (a cupy array or a torch CUDA tensor)
            a = g.buffer(tensor, g, "all_reduce", "tensor")
        except ValueError:
            a, back = in_place(g, tensor, "all_reduce")
    # SUM is defined for every dtype on mpi: skip the op check on the hot path there
    if op is not _SUM or g.limits is not None:
        op = _op(op, a.dtype, g, "all_reduce")
    c = _new(Call, ("all_reduce", a.dtype, a.size, op, -1, 0, None))
    return g.call("all_reduce", c, a, a, async_op, back, a.nbytes if op is _SUM and back is None else None)


def ran_ready(group: Any, call: str, key: Any, inp: Any, out: Any, async_op: bool) -> bool:
    """Run a blocking call through the backend's ready operation listed under ``key`` (see the module
    docstring), if there is one and the arrays are its (:meth:`ProcessGroup.run_ready`); True: done; False: the
    generic path (nothing happened)."""
    g = _world.world if group is None else group
    return (
        not async_op
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready.get(key)) is not None
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
        and (p := ready.get(("broadcast", tensor.nbytes, src))) is not None
        and g.run_ready("broadcast", p, tensor, tensor)
    ):
        return None
    g, _ = resolve(group, "broadcast")
    a, back = in_place(g, tensor, "broadcast")
    root = root_rank(g, "broadcast", src, group_src, "src")
    key = ("broadcast", a.nbytes, src) if group_src is None and back is None else None
    return g.call("broadcast", Call("broadcast", a.dtype, a.size, None, root), a, a, async_op, back, key)


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
        and ran_ready(group, call, ("reduce", tensor.nbytes, dst), tensor, tensor, async_op)
    ):
        return None
    g, _ = resolve(group, call)
    a, back = in_place(g, tensor, call)
    op = _op(op, a.dtype, g, call)
    root = root_rank(g, call, dst, group_dst, "dst")
    key = ("reduce", a.nbytes, dst) if op is _SUM and group_dst is None and back is None else None
    return g.call(call, Call("reduce", a.dtype, a.size, op, root), a, a, async_op, back, key)


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
        and ran_ready(group, call, ("all_gather", input_tensor.nbytes, output_tensor.nbytes), input_tensor,
                      output_tensor, async_op)
    ):  # fmt: skip
        return None
    g, _ = resolve(group, call)
    out, inp = pair(g, call, output_tensor, "output_tensor", input_tensor, "input_tensor")
    _check_count(g, call, "output_tensor", out, g.size, inp.size)
    send: Any = inp
    if g.xp.may_share_memory(out, inp):
        send = None if _is_chunk(inp, out, g.rank) else inp.copy()
    key = ("all_gather", inp.nbytes, out.nbytes) if send is inp else None
    return g.call(call, Call("all_gather", inp.dtype, inp.size), send, out, async_op, None, key)


def all_gather(
    tensor_list: list, tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]`` on every rank."""
    call = "all_gather"
    g, _ = resolve(group, call)
    inp = g.buffer(tensor, g, call, "tensor", writable=False)
    outs = check_list(g, call, "tensor_list", tensor_list, inp, writable=True, count=inp.size)
    c = Call("all_gather", inp.dtype, inp.size)
    if not g.host:  # device memory: straight into each tensor (no staging buffer, no copy out)
        return g.call(call, c, inp, outs, async_op)
    flat = packed(outs)
    if flat is not None:  # written in place; an input inside it is this rank's chunk (or copied first)
        send = None if _is_chunk(inp, flat, g.rank) else inp.copy() if g.xp.may_share_memory(flat, inp) else inp
        return g.call(call, c, send, flat, async_op)
    flat = g.xp.empty(g.size * inp.size, inp.dtype)
    return g.call(call, c, inp, flat, async_op, lambda: unpack(flat, outs))


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input`` across the group and leave chunk ``rank`` of the result in ``output``."""
    call = "reduce_scatter_tensor"
    if (
        op is _SUM
        and type(input) is _ndarray
        and type(output) is _ndarray
        and ran_ready(group, call, ("reduce_scatter", input.nbytes, output.nbytes), input, output, async_op)
    ):
        return None
    g, _ = resolve(group, call)
    out, inp = pair(g, call, output, "output", input, "input")
    _check_count(g, call, "input", inp, g.size, out.size)
    op = _op(op, out.dtype, g, call)
    if g.xp.may_share_memory(out, inp):
        inp = inp.copy()  # MPI reduces in place only at offset 0; a copy keeps any aliasing correct
    key = ("reduce_scatter", inp.nbytes, out.nbytes) if op is _SUM else None
    return g.call(call, Call("reduce_scatter", out.dtype, out.size, op), inp, out, async_op, None, key)


def reduce_scatter(
    output: Any, input_list: list, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input_list[i]`` across the group into rank i's ``output``."""
    call = "reduce_scatter"
    g, _ = resolve(group, call)
    out = g.buffer(output, g, call, "output")
    ins = check_list(g, call, "input_list", input_list, out, writable=False, count=out.size, like_arg="output")
    op = _op(op, out.dtype, g, call)
    if not g.host:  # device memory: straight from each tensor (no staging buffer)
        return g.call(call, Call("reduce_scatter", out.dtype, out.size, op), ins, out, async_op)
    send = packed(ins)
    if send is None:
        send = g.xp.concatenate([a.reshape(-1) for a in ins]) if ins else g.xp.empty(0, out.dtype)
    elif g.xp.may_share_memory(out, send):
        send = send.copy()  # as reduce_scatter_tensor: MPI reduces in place only at offset 0
    return g.call(call, Call("reduce_scatter", out.dtype, out.size, op), send, out, async_op)


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
