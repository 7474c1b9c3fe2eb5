"""all_to_all, all_to_all_single, gather and scatter, with torch.distributed's signatures.

The backend carries each out: in messages of its own where its engine can (MPI's plans), else as the base
class's grouped sends and receives (``Backend.compose``: NCCL, as in NCCL's own examples;
``COMMLIB_MPI_COMPOSED=1`` makes the mpi backend use them too). Fast-path keys: see ``commlib._collectives``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib._collectives import check_list, pair, ran_ready, root_rank
from commlib._group import ProcessGroup, Work
from commlib._world import _state as _world
from commlib._world import resolve
from commlib.arrays import packed, unpack
from commlib.backends._call import Call

__all__ = ["all_to_all", "all_to_all_single", "gather", "scatter"]


_INT = {int}
_ndarray = np.ndarray


def _int_list(sizes: Any) -> bool:
    """A non-empty list of ints (not bools), checked at C speed."""
    return type(sizes) is list and set(map(type, sizes)) == _INT


def _splits(g: ProcessGroup, call: str, arg: str, sizes: Any, a: np.ndarray) -> list[int]:
    rows = a.shape[0] if a.ndim else 1
    row = a.size // rows if rows else 0
    if sizes is None or len(sizes) == 0:
        if rows % g.size:
            raise ValueError(
                f"{g.label}{call}: dim 0 of {arg.split('_')[0]} ({rows}) must divide evenly by the "
                f"group size {g.size} when no split sizes are given"
            )
        return [rows // g.size * row] * g.size
    # the common case, checked at C speed (the genexpr below costs ~2 us); anything else is explained below
    if len(sizes) == g.size and _int_list(sizes) and min(sizes) >= 0 and sum(sizes) == rows:
        return [s * row for s in sizes]
    sizes = list(sizes)
    if len(sizes) != g.size or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in sizes):
        raise ValueError(f"{g.label}{call}: {arg} must be {g.size} non-negative ints, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{g.label}{call}: {arg} must sum to dim 0 ({rows}), got sum({sizes})={sum(sizes)}")
    return [int(s) * row for s in sizes]


def _own_block(g: ProcessGroup, call: str, sends: list[int], recvs: list[int], send_arg: str, recv_arg: str) -> None:
    """What a rank sends itself is what it receives from itself: the same number of elements."""
    r = g.rank
    if sends[r] != recvs[r]:
        raise ValueError(
            f"{g.label}{call}: {send_arg}[{r}] and {recv_arg}[{r}] (this rank's block to itself) must be the same "
            f"size, got {sends[r]} and {recvs[r]} elements"
        )


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0 and send split i to rank i; receive rank i's split into ``output``."""
    call = "all_to_all_single"
    g = _world.world if group is None else group
    if (
        type(input) is _ndarray
        and type(output) is _ndarray
        and not async_op
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
    ):
        if output_split_sizes is None and input_split_sizes is None:
            p = ready.get(("all_to_all", input.nbytes, output.nbytes))
        elif type(input_split_sizes) is list and type(output_split_sizes) is list:
            key = ("all_to_all", input.nbytes, output.nbytes, tuple(input_split_sizes), tuple(output_split_sizes))
            p = ready.get(key)
            if p is not None and not (
                _INT.issuperset(map(type, input_split_sizes)) and _INT.issuperset(map(type, output_split_sizes))
            ):  # as the generic path takes them: ints (not bools, not floats)
                p = None
        else:
            p = None
        if p is not None and g.run_ready(call, p, input, output):
            return None
    g, _ = resolve(group, call)
    out, inp = pair(g, call, output, "output", input, "input")
    sc = _splits(g, call, "input_split_sizes", input_split_sizes, inp)
    rc = _splits(g, call, "output_split_sizes", output_split_sizes, out)
    _own_block(g, call, sc, rc, "input_split_sizes", "output_split_sizes")
    if g.xp.may_share_memory(out, inp):
        inp = inp.copy()
    fast: Any = ("all_to_all", inp.nbytes, out.nbytes)  # its key in the ready table
    if input_split_sizes is not None or output_split_sizes is not None:
        sizes = (input_split_sizes, output_split_sizes)
        plain = all(type(x) is list and _INT.issuperset(map(type, x)) for x in sizes)
        fast = (*fast, tuple(input_split_sizes or ()), tuple(output_split_sizes or ())) if plain else None
    return g.call(call, _exchange(inp.dtype, sc, rc), inp, out, async_op, None, fast)


def _exchange(dtype: Any, sc: list[int], rc: list[int]) -> Call:
    """The description of an all_to_all of ``sc`` elements to each rank and ``rc`` from each: even blocks, or
    the splits (each rank's own: its messages' sizes are checked, not the splits)."""
    k = sc[0] if sc else 0
    if sc.count(k) == len(sc) and rc.count(k) == len(rc):  # even blocks (count(): C speed)
        return Call("all_to_all", dtype, k)
    return Call("all_to_all", dtype, 0, splits=(tuple(sc), tuple(rc)))


def all_to_all(
    output_tensor_list: list, input_tensor_list: list, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Send ``input_tensor_list[i]`` to rank i and receive rank i's tensor into ``output_tensor_list[i]``."""
    call = "all_to_all"
    g, _ = resolve(group, call)
    if not isinstance(input_tensor_list, (list, tuple)) or not input_tensor_list:
        raise TypeError(
            f"{g.label}{call}: input_tensor_list must be a list of {g.size} tensors, got {input_tensor_list!r}"
        )
    first = g.buffer(input_tensor_list[0], g, call, "input_tensor_list[0]", writable=False)
    ref = "input_tensor_list[0]"
    ins = check_list(g, call, "input_tensor_list", input_tensor_list, first, writable=False, like_arg=ref)
    outs = check_list(g, call, "output_tensor_list", output_tensor_list, first, writable=True, like_arg=ref)
    counts = ([a.size for a in ins], [a.size for a in outs])
    _own_block(g, call, *counts, "input_tensor_list", "output_tensor_list")
    if not g.host:  # device memory: straight from and into each tensor (no staging buffer)
        return g.call(call, _exchange(first.dtype, *counts), ins, outs, async_op)
    send = packed(ins)
    if send is None:
        send = g.xp.concatenate([a.reshape(-1) for a in ins])
    recv, finish = packed(outs), None
    if recv is None or g.xp.may_share_memory(recv, send):
        recv = staging = g.xp.empty(sum(a.size for a in outs), first.dtype)
        finish = lambda: unpack(staging, outs)  # noqa: E731
    return g.call(call, _exchange(send.dtype, *counts), send, recv, async_op, finish)


def _plain(g: ProcessGroup, root: int, items: Any, like: np.ndarray, writes: bool) -> bool:
    """Whether gather's or scatter's list is what the ready path takes (else the generic path checks and says
    why): None off the root; on it a list of ``g.size`` numpy arrays of ``like``'s dtype and shape, writable
    for gather."""
    if g.rank != root:
        return items is None
    if type(items) is not list or len(items) != g.size:
        return False
    dtype, shape = like.dtype, like.shape
    for a in items:
        if type(a) is not np.ndarray or a.dtype is not dtype or a.shape != shape:
            return False
        if writes and not a.flags.writeable:
            return False
    return True


def _rooted(
    call: str, group: ProcessGroup | None, tensor: Any, rank: Any, group_rank: Any, arg: str, items: Any, items_arg: str
) -> tuple[ProcessGroup, Any, int, list[Any] | None]:
    """gather's and scatter's arguments: the group, this rank's tensor, the root, and the root's list (None elsewhere).

    The list holds the root's tensors (written by gather, read by scatter), one per rank like the tensor.
    """
    g, _ = resolve(group, call)
    writes = call == "gather"  # gather writes the root's list and reads the tensor; scatter the other way round
    a = g.buffer(tensor, g, call, "tensor", writable=not writes)
    root = root_rank(g, call, rank, group_rank, arg, default=0)
    role = "destination" if writes else "source"
    if g.rank == root and items is None:
        raise ValueError(f"{g.label}{call}: {items_arg} must be given on the {role} rank")
    if g.rank != root and items:
        raise ValueError(f"{g.label}{call}: {items_arg} must not be given on ranks other than the {role}")
    parts = None
    if g.rank == root:  # a list of numpy arrays like the tensor needs no more checks (~1.5 us less per call)
        plain = type(a) is np.ndarray and _plain(g, root, items, a, writes)
        parts = items if plain else check_list(g, call, items_arg, items, a, writable=writes, count=a.size)
    return g, a, root, parts


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (default global rank 0)."""
    root = 0 if dst is None else dst
    key = (tensor.nbytes, root) if type(tensor) is _ndarray and type(root) is int and group_dst is None else None
    if key is not None and ran_ready(group, "gather", ("gather", *key), tensor, gather_list, async_op):
        return None  # the root's list filled in rank order (another list is not the operation's: generic path)
    g, inp, root, outs = _rooted("gather", group, tensor, dst, group_dst, "dst", gather_list, "gather_list")
    if not g.host:  # device memory: straight into the root's tensors (no staging buffer)
        return g.call("gather", Call("gather", inp.dtype, inp.size, None, root), inp, outs, async_op)
    flat, finish = (packed(outs) if outs is not None else None), None
    if outs is not None and (flat is None or g.xp.may_share_memory(flat, inp)):
        flat = staging = g.xp.empty(g.size * inp.size, inp.dtype)
        finish = lambda: unpack(staging, outs)  # noqa: E731
    ready = ("gather", *key) if key is not None and (outs is None or type(outs) is list) else None
    return g.call("gather", Call("gather", inp.dtype, inp.size, None, root), inp, flat, async_op, finish, ready)


def scatter(
    tensor: Any,
    scatter_list: Sequence[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Send ``scatter_list[i]`` from rank ``src`` (default global rank 0) into rank i's ``tensor``."""
    root = 0 if src is None else src
    key = (tensor.nbytes, root) if type(tensor) is _ndarray and type(root) is int and group_src is None else None
    if key is not None and ran_ready(group, "scatter", ("scatter", *key), scatter_list, tensor, async_op):
        return None  # the root's list read in rank order (another list is not the operation's: generic path)
    g, out, root, ins = _rooted("scatter", group, tensor, src, group_src, "src", scatter_list, "scatter_list")
    if not g.host:  # device memory: straight from the root's tensors (no staging buffer)
        return g.call("scatter", Call("scatter", out.dtype, out.size, None, root), ins, out, async_op)
    send = None if ins is None else packed(ins)
    if ins is not None and (send is None or g.xp.may_share_memory(send, out)):
        send = g.xp.concatenate([a.reshape(-1) for a in ins])
    ready = ("scatter", *key) if key is not None else None
    return g.call("scatter", Call("scatter", out.dtype, out.size, None, root), send, out, async_op, None, ready)
