"""Object collectives: pickled Python objects moved as uint8 tensors.

Like torch.distributed's, these unpickle what peers of the same job send:
use them only among ranks you trust. (The rendezvous store, which faces the
network, never unpickles.)
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from commlib._collectives import root_rank
from commlib._group import ProcessGroup
from commlib._p2p import _peer, _source, recv, send
from commlib._world import resolve
from commlib.arrays import to_device, to_host
from commlib.backends._call import Call

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]

_U8, _I64 = np.dtype(np.uint8), np.dtype(np.int64)


def _dump(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), _U8)


def _load(a: np.ndarray) -> Any:
    return pickle.loads(a.tobytes())


def _padded(chunks: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros(len(chunks) * width, _U8)
    for i, c in enumerate(chunks):
        out[i * width : i * width + c.size] = c
    return out


def _check_list(g: ProcessGroup, call: str, arg: str, value: Any, size: int | None) -> list:
    """``value`` itself when it is a list (of ``size`` entries, if given)."""
    if not isinstance(value, list):
        raise TypeError(f"{g.label}{call}: {arg} must be a list, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise ValueError(f"{g.label}{call}: {arg} must have one entry per rank ({size}), got {len(value)}")
    return value


def _all_gather(g: ProcessGroup, call: str, mine: np.ndarray) -> np.ndarray:
    out = g.xp.empty(g.size * mine.size, mine.dtype)
    g.call(call, Call("all_gather", mine.dtype, mine.size), to_device(mine, g.xp), out)
    return to_host(out)


def _broadcast(g: ProcessGroup, call: str, buf: np.ndarray, root: int) -> np.ndarray:
    moved = to_device(buf, g.xp)
    g.call(call, Call("broadcast", buf.dtype, buf.size, None, root), moved, moved)
    return to_host(moved)


def all_gather_object(object_list: list, obj: Any, group: ProcessGroup | None = None) -> None:
    """Gather a picklable ``obj`` from every rank into ``object_list`` (length: group size) on every rank."""
    call = "all_gather_object"
    g, _ = resolve(group, call)
    _check_list(g, call, "object_list", object_list, g.size)
    data = _dump(obj)
    sizes = _all_gather(g, call, np.array([data.size], _I64))
    width = int(sizes.max())
    out = _all_gather(g, call, _padded([data], width))
    object_list[:] = [_load(out[i * width : i * width + int(n)]) for i, n in enumerate(sizes)]


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    """Gather a picklable ``obj`` from every rank into ``object_gather_list`` on rank ``dst`` (default 0)."""
    call = "gather_object"
    g, _ = resolve(group, call)
    root = root_rank(g, call, dst, group_dst, "dst", default=0)
    gather_list = _check_list(g, call, "object_gather_list", object_gather_list, g.size) if g.rank == root else []
    data = _dump(obj)
    sizes = _all_gather(g, call, np.array([data.size], _I64))
    width = int(sizes.max())
    out = g.xp.empty(g.size * width, _U8) if g.rank == root else None
    g.call(call, Call("gather", _U8, width, None, root), to_device(_padded([data], width), g.xp), out)
    if out is not None:
        out = to_host(out)
        gather_list[:] = [_load(out[i * width : i * width + int(n)]) for i, n in enumerate(sizes)]


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list``'s entries on every rank with rank ``src``'s (lists of equal length)."""
    call = "broadcast_object_list"
    g, _ = resolve(group, call)
    _check_list(g, call, "object_list", object_list, None)
    root = root_rank(g, call, src, group_src, "src")
    mine = g.rank == root
    chunks = [_dump(o) for o in object_list] if mine else []
    sizes = np.array([c.size for c in chunks], _I64) if mine else np.zeros(len(object_list), _I64)
    sizes = _broadcast(g, call, sizes, root)
    payload = np.concatenate(chunks) if mine and chunks else np.empty(int(sizes.sum()), _U8)
    payload = _broadcast(g, call, payload, root)
    if not mine:
        starts = np.concatenate([[0], np.cumsum(sizes)])
        object_list[:] = [_load(payload[starts[i] : starts[i + 1]]) for i in range(len(sizes))]


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: Sequence[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    """Send ``scatter_object_input_list[i]`` from rank ``src`` (default 0) into rank i's output list[0]."""
    out_list = scatter_object_output_list
    call = "scatter_object_list"
    g, _ = resolve(group, call)
    if not isinstance(out_list, list) or not out_list:
        raise ValueError(f"{g.label}{call}: scatter_object_output_list must be a non-empty list, got {out_list!r}")
    root = root_rank(g, call, src, group_src, "src", default=0)
    mine = g.rank == root
    ins = _check_list(g, call, "scatter_object_input_list", scatter_object_input_list, g.size) if mine else []
    chunks = [_dump(o) for o in ins]
    sizes = np.array([c.size for c in chunks], _I64) if mine else np.zeros(g.size, _I64)
    sizes = _broadcast(g, call, sizes, root)
    width = int(sizes.max())
    recv = g.xp.empty(width, _U8)
    g.call(
        call, Call("scatter", _U8, width, None, root), to_device(_padded(chunks, width), g.xp) if mine else None, recv
    )
    out_list[0] = _load(to_host(recv)[: int(sizes[g.rank])])


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the picklable objects of ``object_list`` to global rank ``dst`` (or ``group_dst``).

    The receiver's :func:`recv_object_list` needs a list of the same length. Two messages go out:
    the count and size, then the pickled list. ``device`` and ``use_batch`` are accepted for
    torch's signature: the group decides where the bytes travel (host memory on mpi, the device on nccl).
    """
    call = "send_object_list"
    g, _ = resolve(group, call)
    _check_list(g, call, "object_list", object_list, None)
    peer = g.ranks[_peer(g, call, dst, group_dst, "dst")]
    data = _dump(list(object_list))
    head = np.array([len(object_list), data.size], _I64)
    send(to_device(head, g.xp), peer, g)
    send(to_device(data, g.xp), peer, g)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Fill ``object_list`` with the objects :func:`send_object_list` sent from global rank ``src``.

    ``src=None`` (and no ``group_src``) takes them from whichever rank sends first. Returns the
    sender's global rank. A sender whose list has another length is an error here (``ValueError``,
    after its message has been received, so the two ranks stay in step), and ``object_list`` is
    left as it was.
    """
    call = "recv_object_list"
    g, b = resolve(group, call)
    _check_list(g, call, "object_list", object_list, None)
    peer = _source(g, b, call, src, group_src)
    head = g.xp.zeros(2, _I64)
    sender = recv(head, None if peer is None else g.ranks[peer], g)
    count, nbytes = (int(v) for v in to_host(head))
    data = g.xp.empty(nbytes, _U8)
    recv(data, sender, g)
    if count != len(object_list):
        raise ValueError(
            f"{g.label}{call}: object_list has {len(object_list)} entries, "
            f"but rank {sender} sent {count} objects (send_object_list)"
        )
    object_list[:] = _load(to_host(data))
    return sender
