"""all_to_all, all_to_all_single, gather and scatter: native where the backend has them, else send/recv.

The send/recv compositions are written once here, for every backend without a
native call (NCCL has none: these are grouped send/recv there, as in NCCL's
own examples). ``COMMLIB_MPI_COMPOSED=1`` makes the mpi backend use them too,
so CI exercises them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib._arrays import same_kind
from commlib._collectives import check_list, root_rank
from commlib._diagnostics.debug import check as check_call
from commlib._group import ProcessGroup, Work
from commlib._world import resolve
from commlib.backends._base import AllOf, Chained, Handle

__all__ = ["all_to_all", "all_to_all_single", "gather", "gather_handle", "scatter", "scatter_handle"]


def _offsets(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def composed_all_to_all(b: Any, send: np.ndarray, scounts: list[int], recv: np.ndarray, rcounts: list[int]) -> Handle:
    """Uneven all-to-all as one group of sends and receives."""
    so, ro, tag = _offsets(scounts), _offsets(rcounts), b.max_tag + 2
    sflat, rflat = send.reshape(-1), recv.reshape(-1)
    me = b.rank
    rflat[ro[me] : ro[me] + rcounts[me]] = sflat[so[me] : so[me] + scounts[me]]
    handles = []
    b.group_start()
    for peer in range(b.size):
        if peer != me:
            handles.append(b.send(sflat[so[peer] : so[peer] + scounts[peer]], peer, tag))
            handles.append(b.recv(rflat[ro[peer] : ro[peer] + rcounts[peer]], peer, tag))
    b.group_end()
    return AllOf(handles)


def composed_gather(b: Any, send: np.ndarray, recv: np.ndarray | None, root: int) -> Handle:
    """Every rank sends to ``root``, which receives into its chunks of ``recv``."""
    tag, k = b.max_tag + 2, send.size
    b.group_start()
    if b.rank == root:
        rflat = recv.reshape(-1)
        rflat[root * k : (root + 1) * k] = send.reshape(-1)
        handles = [b.recv(rflat[p * k : (p + 1) * k], p, tag) for p in range(b.size) if p != root]
    else:
        handles = [b.send(send, root, tag)]
    b.group_end()
    return AllOf(handles)


def composed_scatter(b: Any, send: np.ndarray | None, recv: np.ndarray, root: int) -> Handle:
    """``root`` sends chunk p of ``send`` to rank p."""
    tag, k = b.max_tag + 2, recv.size
    b.group_start()
    if b.rank == root:
        sflat = send.reshape(-1)
        recv.reshape(-1)[...] = sflat[root * k : (root + 1) * k]
        handles = [b.send(sflat[p * k : (p + 1) * k], p, tag) for p in range(b.size) if p != root]
    else:
        handles = [b.recv(recv, root, tag)]
    b.group_end()
    return AllOf(handles)


def _native(g: ProcessGroup, name: str) -> Any:
    b = g.backend
    return getattr(b, name) if getattr(b, "native_composites", False) and hasattr(b, name) else None


def gather_handle(g: ProcessGroup, send: np.ndarray, recv: np.ndarray | None, root: int) -> Handle:
    """Gather equal chunks into ``recv`` on ``root``: the backend's own call, or the composition."""
    native = _native(g, "gather")
    return native(send, recv, root) if native else composed_gather(g.backend, send, recv, root)


def scatter_handle(g: ProcessGroup, send: np.ndarray | None, recv: np.ndarray, root: int) -> Handle:
    """Scatter equal chunks of ``send`` from ``root``: the backend's own call, or the composition."""
    native = _native(g, "scatter")
    return native(send, recv, root) if native else composed_scatter(g.backend, send, recv, root)


def _all_to_all(g: ProcessGroup, send: np.ndarray, sc: list[int], recv: np.ndarray, rc: list[int]) -> Handle:
    native = _native(g, "all_to_all")
    return native(send, sc, recv, rc) if native else composed_all_to_all(g.backend, send, sc, recv, rc)


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
    out = g.array(output, g, call, "output")
    inp = g.array(input, g, call, "input", writable=False)
    same_kind(out, inp, g, call, "output", "input")
    sc = _splits(g, call, "input_split_sizes", input_split_sizes, inp)
    rc = _splits(g, call, "output_split_sizes", output_split_sizes, out)
    if g.detail:  # split sizes may differ across ranks: only the dtype and the row shape must agree
        check_call(g, call, inp, shape=("*", *inp.shape[1:]))
    if g.xp.may_share_memory(out, inp):
        inp = inp.copy()
    return g.run(_all_to_all(g, inp, sc, out, rc), call, async_op, inp.dtype, inp.size)


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
    first = g.array(input_tensor_list[0], g, call, "input_tensor_list[0]", writable=False)
    ref = "input_tensor_list[0]"
    ins = check_list(g, call, "input_tensor_list", input_tensor_list, first, writable=False, like_arg=ref)
    outs = check_list(g, call, "output_tensor_list", output_tensor_list, first, writable=True, like_arg=ref)
    if g.detail:
        check_call(g, call, first, shape=("*",))
    send = g.xp.concatenate([a.reshape(-1) for a in ins])
    recv = g.xp.empty(sum(a.size for a in outs), first.dtype)
    handle = _all_to_all(g, send, [a.size for a in ins], recv, [a.size for a in outs])
    return g.run(Chained(handle, lambda: _unpack(recv, outs)), call, async_op, send.dtype, send.size)


def _unpack(flat: np.ndarray, outs: list[np.ndarray]) -> None:
    start = 0
    for a in outs:
        a[...] = flat[start : start + a.size].reshape(a.shape)
        start += a.size


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
    inp = g.array(tensor, g, call, "tensor", writable=False)
    root = root_rank(g, call, dst, group_dst, "dst", default=0)
    _only_on_root(g, call, "gather_list", gather_list, g.rank == root, "destination")
    outs, flat = None, None
    if g.rank == root:
        outs = check_list(g, call, "gather_list", gather_list, inp, writable=True, count=inp.size)
        flat = g.xp.empty(g.size * inp.size, inp.dtype)
    if g.detail:
        check_call(g, call, inp, root=root)
    handle = gather_handle(g, inp, flat, root)
    if outs is not None:
        handle = Chained(handle, lambda: _unpack(flat, outs))
    return g.run(handle, call, async_op, inp.dtype, inp.size)


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
    out = g.array(tensor, g, call, "tensor")
    root = root_rank(g, call, src, group_src, "src", default=0)
    _only_on_root(g, call, "scatter_list", scatter_list, g.rank == root, "source")
    send = None
    if g.rank == root:
        ins = check_list(g, call, "scatter_list", scatter_list, out, writable=False, count=out.size)
        send = g.xp.concatenate([a.reshape(-1) for a in ins])
    if g.detail:
        check_call(g, call, out, root=root)
    handle = scatter_handle(g, send, out, root)
    return g.run(handle, call, async_op, out.dtype, out.size)
