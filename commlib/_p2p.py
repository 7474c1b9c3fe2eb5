"""Point-to-point: send, recv, isend, irecv, P2POp and batch_isend_irecv (torch.distributed's signatures)."""

from __future__ import annotations

from typing import Any

from commlib._group import ProcessGroup, Work
from commlib._world import label, resolve

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _peer(g: ProcessGroup, call: str, rank: Any, group_rank: Any, arg: str, any_ok: bool = False) -> int | None:
    if group_rank is not None:
        if rank is not None:
            raise ValueError(f"{g.label}{call}: give {arg} (a global rank) or group_{arg}, not both")
        peer = g.check_group_rank(group_rank, call, f"group_{arg}")
    elif rank is None:
        if any_ok and g.backend.any_source:
            return None
        if any_ok:
            raise ValueError(f"{g.label}{call}: the {g.backend_name} backend cannot receive from any source; pass src")
        raise ValueError(f"{g.label}{call}: {arg} is required (the global rank of the peer); or pass group_{arg}")
    else:
        peer = g.group_rank(rank, call, arg)
    if peer == g.rank:
        raise ValueError(f"{g.label}{call}: {arg} must be another rank, got this rank ({g.ranks[peer]})")
    return peer


def _tag(g: ProcessGroup, call: str, tag: Any) -> int:
    limit = g.backend.max_tag
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= limit:
        raise ValueError(f"{g.label}{call}: tag must be an int in [0, {limit}], got {tag!r}")
    return tag


def _post_send(tensor: Any, dst: Any, group: Any, tag: Any, group_dst: Any, call: str) -> Work:
    g = resolve(group, call)
    a = g.buffer(tensor, g, call, "tensor", writable=False)
    peer = _peer(g, call, dst, group_dst, "dst")
    return Work(g, g.backend.send(a, peer, _tag(g, call, tag)), call, 0, ordered=False)


def _post_recv(tensor: Any, src: Any, group: Any, tag: Any, group_src: Any, call: str) -> Work:
    g = resolve(group, call)
    a = g.buffer(tensor, g, call, "tensor")
    peer = _peer(g, call, src, group_src, "src", any_ok=True)
    return Work(g, g.backend.recv(a, peer, _tag(g, call, tag)), call, 0, ordered=False, receive=True)


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` unchanged until the Work completes."""
    return _post_send(tensor, dst, group, tag, group_dst, "isend")


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (None: any rank); returns a Work."""
    return _post_recv(tensor, src, group, tag, group_src, "irecv")


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until the buffer may be reused."""
    _post_send(tensor, dst, group, tag, group_dst, "send").wait()


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: any rank); returns the sender's global rank."""
    work = _post_recv(tensor, src, group, tag, group_src, "recv")
    if src is None and group_src is None:
        return work.source_rank()
    work.wait()
    return src if src is not None else work.group.ranks[group_src]


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
    g = resolve(p2p_op_list[0].group, call)
    # Validate every op before posting any, so a bad op leaves nothing half-sent.
    plan = []
    for i, p in enumerate(p2p_op_list):
        recv = p.op is irecv
        a = g.buffer(p.tensor, g, call, f"p2p_op_list[{i}].tensor", writable=recv)
        peer = _peer(g, call, p.peer, p.group_peer, "peer")
        plan.append((recv, a, peer, _tag(g, call, p.tag)))
    b = g.backend
    b.group_start()
    try:
        handles = [(b.recv if recv else b.send)(a, peer, tag) for recv, a, peer, tag in plan]
    finally:
        b.group_end()
    return [Work(g, h, call, 0, ordered=False, receive=recv) for h, (recv, *_) in zip(handles, plan, strict=True)]
