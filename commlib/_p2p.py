"""Point-to-point: send, recv, isend, irecv, P2POp and batch_isend_irecv (torch.distributed's signatures)."""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib._collectives import in_place
from commlib._group import ProcessGroup, Work
from commlib._world import _state as _world
from commlib._world import label, resolve
from commlib.backends._call import Call
from commlib.backends.base import Backend, Chained

_ndarray = np.ndarray

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _peer(g: ProcessGroup, call: str, rank: Any, group_rank: Any, arg: str) -> int:
    if group_rank is not None:
        if rank is not None:
            raise ValueError(f"{g.label}{call}: give {arg} (a global rank) or group_{arg}, not both")
        peer = g.check_group_rank(group_rank, call, f"group_{arg}")
    elif rank is None:
        raise ValueError(f"{g.label}{call}: {arg} is required (the global rank of the peer); or pass group_{arg}")
    else:
        peer = g.group_rank(rank, call, arg)
    if peer == g.rank:
        raise ValueError(f"{g.label}{call}: {arg} must be another rank, got this rank ({g.ranks[peer]})")
    return peer


def _source(g: ProcessGroup, b: Backend, call: str, rank: Any, group_rank: Any) -> int | None:
    """The peer to receive from; None (any rank) when neither is given and the backend can."""
    if rank is None and group_rank is None:
        if b.any_source:
            return None
        raise ValueError(f"{g.label}{call}: the {g.backend_name} backend cannot receive from any source; pass src")
    return _peer(g, call, rank, group_rank, "src")


def _tag(g: ProcessGroup, b: Backend, call: str, tag: Any) -> int:
    limit = b.max_tag
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= limit:
        raise ValueError(f"{g.label}{call}: tag must be an int in [0, {limit}], got {tag!r}")
    if tag:
        g.tagged = True  # messages of different tags may overtake: the monitor's counts no longer tell a match
    return tag


def _send_args(
    tensor: Any, dst: Any, group: Any, tag: Any, group_dst: Any, call: str
) -> tuple[ProcessGroup, Call, Any]:
    """(group, the send's description, its array); the send counted for the group's closing check."""
    g, b = resolve(group, call)
    a, _ = in_place(g, tensor, call, writable=False)  # a non-contiguous tensor: a contiguous copy
    peer = _peer(g, call, dst, group_dst, "dst")
    c = Call("send", a.dtype, a.size, root=peer, tag=_tag(g, b, call, tag))
    g.sent[peer] += 1
    return g, c, a


def _recv_args(tensor: Any, src: Any, group: Any, tag: Any, group_src: Any, call: str) -> tuple:
    """(group, the receive's description, its array, what to run once received: a non-contiguous tensor's copy
    back); the receive counted for the group's closing check."""
    g, b = resolve(group, call)
    a, back = in_place(g, tensor, call)
    peer = _source(g, b, call, src, group_src)
    c = Call("recv", a.dtype, a.size, root=-1 if peer is None else peer, tag=_tag(g, b, call, tag))
    if peer is None:
        g.any_received += 1
    else:
        g.received[peer] += 1
    return g, c, a, back


def _index(g: ProcessGroup, c: Call) -> int:
    """Which of this rank's sends to (receives from) ``c``'s peer ``c`` is (1: the first; 0: from any rank)."""
    if c.root < 0:
        return 0
    return (g.sent if c.kind == "send" else g.received)[c.root]


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` unchanged until the Work completes."""
    g, c, a = _send_args(tensor, dst, group, tag, group_dst, "isend")
    return Work(g, g.start_p2p("isend", c, a, None), "isend", 0, False, peer=c.root, index=_index(g, c), desc=c)


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (None: any rank); returns a Work."""
    g, c, a, back = _recv_args(tensor, src, group, tag, group_src, "irecv")
    handle = g.start_p2p("irecv", c, None, a)
    return Work(
        g, handle if back is None else Chained(handle, back), "irecv", 0, False, receive=True, peer=c.root,
        index=_index(g, c), desc=c,
    )  # fmt: skip


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until the buffer may be reused."""
    g: Any = _world.world if group is None else group
    # The common case runs the backend's ready operation for (bytes, global peer, tag) at once (the key: see
    # ``commlib._collectives``); inlined, as all_reduce's: this function's overhead is most of a small send's.
    if (
        type(tensor) is _ndarray
        and type(dst) is int
        and type(tag) is int
        and group_dst is None
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready.get(("send", tensor.nbytes, dst, tag))) is not None
    ):
        try:  # ProcessGroup.run_p2p, inlined: a Python call is a tenth of a small send
            done: Any = p.go(tensor, None, 0)
        except BaseException as e:
            done = e
        if done is True:
            g.sent[p.call.root] += 1
            return
        if done is not None:
            g.p2p_rest("send", p, None, done)
            return
    g, c, a = _send_args(tensor, dst, group, tag, group_dst, "send")
    key = ("send", a.nbytes, dst, c.tag) if group_dst is None else None
    g.message("send", c, a, None, key)


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: any rank); returns the sender's global rank."""
    g: Any = _world.world if group is None else group
    if (  # as send's
        type(tensor) is _ndarray
        and type(src) is int
        and type(tag) is int
        and group_src is None
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None
        and not g.pending
        and (p := ready.get(("recv", tensor.nbytes, src, tag))) is not None
    ):
        try:
            done: Any = p.go(None, tensor, 0)
        except BaseException as e:
            done = e
        if done is True:
            g.received[p.call.root] += 1
            return src
        if done is not None:
            g.p2p_rest("recv", p, tensor, done)
            return src
    g, c, a, back = _recv_args(tensor, src, group, tag, group_src, "recv")
    key = ("recv", a.nbytes, src, c.tag) if group_src is None and back is None and c.root >= 0 else None
    return g.ranks[g.message("recv", c, None, a, key, back)]


class P2POp:
    """One isend or irecv for :func:`batch_isend_irecv` (torch.distributed.P2POp's arguments)."""

    __slots__ = ("group", "group_peer", "op", "peer", "tag", "tensor")

    def __init__(
        self,
        op: Any,
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op not in (isend, irecv):
            raise ValueError(f"{label()}P2POp: op must be commlib.isend or commlib.irecv, got {op!r}")
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = (
            op,
            tensor,
            peer,
            group,
            tag,
            group_peer,
        )

    def __repr__(self) -> str:
        peer = f"peer={self.peer}" if self.group_peer is None else f"group_peer={self.group_peer}"
        return f"P2POp({self.op.__name__}, {peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post a batch of sends and receives together (any order, no deadlock); returns one Work per op."""
    call = "batch_isend_irecv"
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"{label()}{call}: p2p_op_list must be a non-empty list of P2POp, got {p2p_op_list!r}")
    if not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise TypeError(f"{label()}{call}: every element of p2p_op_list must be a P2POp, got {p2p_op_list!r}")
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) != 1:
        raise ValueError(f"{label()}{call}: all P2POps of a batch must use the same group")
    g, b = resolve(p2p_op_list[0].group, call)
    # Validate every op before posting any, so a bad op leaves nothing half-sent.
    plan = []
    for i, p in enumerate(p2p_op_list):
        recv = p.op is irecv
        a = g.buffer(p.tensor, g, call, f"p2p_op_list[{i}].tensor", writable=recv)
        peer = _peer(g, call, p.peer, p.group_peer, "peer")
        plan.append((recv, a, peer, _tag(g, b, call, p.tag)))
    calls = [Call("recv" if recv else "send", a.dtype, a.size, root=peer, tag=tag) for recv, a, peer, tag in plan]
    indices = []
    for c in calls:
        counts = g.received if c.kind == "recv" else g.sent
        counts[c.root] += 1
        indices.append(counts[c.root])
    b.group_start()
    try:
        handles = [
            g.start_p2p(call, c, None if recv else a, a if recv else None)
            for c, (recv, a, _, _) in zip(calls, plan, strict=True)
        ]
    finally:
        b.group_end()
    return [
        Work(g, h, call, 0, False, receive=c.kind == "recv", peer=c.root, index=i, desc=c)
        for h, c, i in zip(handles, calls, indices, strict=True)
    ]
