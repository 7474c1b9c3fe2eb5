"""all_to_all, all_to_all_single, gather and scatter, with torch.distributed's signatures.

The backend carries each out (``Backend.all_to_all``, ``gather``, ``scatter``): natively where
its engine has the call (MPI), else through the base class's send/recv compositions (NCCL,
as in NCCL's own examples; ``COMMLIB_MPI_COMPOSED=1`` makes the mpi backend use them too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib._collectives import check_list, root_rank, unpack
from commlib._diagnostics.debug import check as check_call
from commlib._group import ProcessGroup, Work
from commlib._world import resolve
from commlib.arrays import same_kind
from commlib.backends.base import Chained

__all__ = ["all_to_all", "all_to_all_single", "gather", "scatter"]


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
    sizes = list(sizes)
    if len(sizes) != g.size or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in sizes):
        raise ValueError(f"{g.label}{call}: {arg} must be {g.size} non-negative ints, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{g.label}{call}: {arg} must sum to dim 0 ({rows}), got sum({sizes})={sum(sizes)}")
    return [int(s) * row for s in sizes]


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
    g = resolve(group, call)
    out = g.buffer(output, g, call, "output")
    inp = g.buffer(input, g, call, "input", writable=False)
    same_kind(out, inp, g, call, "output", "input")
    sc = _splits(g, call, "input_split_sizes", input_split_sizes, inp)
    rc = _splits(g, call, "output_split_sizes", output_split_sizes, out)
    if g.detail:  # split sizes may differ across ranks: only the dtype and the row shape must agree
        check_call(g, call, inp, shape=("*", *inp.shape[1:]))
    if g.xp.may_share_memory(out, inp):
        inp = inp.copy()
    return g.submit(g.backend.all_to_all(inp, sc, out, rc), call, async_op, inp.dtype, inp.size)


def all_to_all(
    output_tensor_list: list, input_tensor_list: list, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Send ``input_tensor_list[i]`` to rank i and receive rank i's tensor into ``output_tensor_list[i]``."""
    call = "all_to_all"
    g = resolve(group, call)
    if not isinstance(input_tensor_list, (list, tuple)) or not input_tensor_list:
        raise TypeError(
            f"{g.label}{call}: input_tensor_list must be a list of {g.size} tensors, got {input_tensor_list!r}"
        )
    first = g.buffer(input_tensor_list[0], g, call, "input_tensor_list[0]", writable=False)
    ref = "input_tensor_list[0]"
    ins = check_list(g, call, "input_tensor_list", input_tensor_list, first, writable=False, like_arg=ref)
    outs = check_list(g, call, "output_tensor_list", output_tensor_list, first, writable=True, like_arg=ref)
    if g.detail:
        check_call(g, call, first, shape=("*",))
    send = g.xp.concatenate([a.reshape(-1) for a in ins])
    recv = g.xp.empty(sum(a.size for a in outs), first.dtype)
    handle = g.backend.all_to_all(send, [a.size for a in ins], recv, [a.size for a in outs])
    return g.submit(Chained(handle, lambda: unpack(recv, outs)), call, async_op, send.dtype, send.size)


def _only_on_root(g: ProcessGroup, call: str, arg: str, value: Any, is_root: bool, role: str) -> None:
    if is_root and value is None:
        raise ValueError(f"{g.label}{call}: {arg} must be given on the {role} rank")
    if not is_root and value:
        raise ValueError(f"{g.label}{call}: {arg} must not be given on ranks other than the {role}")


def gather(
    tensor: Any,
    gather_list: list | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst`` (default global rank 0)."""
    call = "gather"
    g = resolve(group, call)
    inp = g.buffer(tensor, g, call, "tensor", writable=False)
    root = root_rank(g, call, dst, group_dst, "dst", default=0)
    _only_on_root(g, call, "gather_list", gather_list, g.rank == root, "destination")
    outs, flat = None, None
    if g.rank == root:
        outs = check_list(g, call, "gather_list", gather_list, inp, writable=True, count=inp.size)
        flat = g.xp.empty(g.size * inp.size, inp.dtype)
    if g.detail:
        check_call(g, call, inp, root=root)
    handle = g.backend.gather(inp, flat, root)
    if outs is not None:
        handle = Chained(handle, lambda: unpack(flat, outs))
    return g.submit(handle, call, async_op, inp.dtype, inp.size)


def scatter(
    tensor: Any,
    scatter_list: list | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Send ``scatter_list[i]`` from rank ``src`` (default global rank 0) into rank i's ``tensor``."""
    call = "scatter"
    g = resolve(group, call)
    out = g.buffer(tensor, g, call, "tensor")
    root = root_rank(g, call, src, group_src, "src", default=0)
    _only_on_root(g, call, "scatter_list", scatter_list, g.rank == root, "source")
    send = None
    if g.rank == root:
        ins = check_list(g, call, "scatter_list", scatter_list, out, writable=False, count=out.size)
        send = g.xp.concatenate([a.reshape(-1) for a in ins])
    if g.detail:
        check_call(g, call, out, root=root)
    handle = g.backend.scatter(send, out, root)
    return g.submit(handle, call, async_op, out.dtype, out.size)
