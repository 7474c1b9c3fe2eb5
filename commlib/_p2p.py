"""Point-to-point: send, recv, isend, irecv, P2POp and batch_isend_irecv (torch.distributed's signatures)."""

from __future__ import annotations

from typing import Any

import numpy as np

from commlib._collectives import in_place
from commlib._diagnostics import monitor
from commlib._group import ProcessGroup, Work
from commlib._world import _state as _world
from commlib._world import label, resolve
from commlib.backends.base import Backend, Chained

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


def _ready(g: Any, call: str, tensor: Any, peer: Any, tag: Any, group_peer: Any) -> Any:
    """The backend's ready operation for a blocking send or recv of a numpy array to or from a peer given as a
    global rank, if it has one (its ``go`` then says whether the array is its); else None: the generic path."""
    if (
        type(tensor) is np.ndarray
        and type(peer) is int
        and type(tag) is int
        and group_peer is None
        and type(g) is ProcessGroup
        and (ready := g.ready) is not None  # the group's ready table (none while calls are pending)
        and not g.pending
    ):
        return ready[call].get((tensor.nbytes, peer, tag))
    return None


def _send_args(tensor: Any, dst: Any, group: Any, tag: Any, group_dst: Any, call: str) -> tuple:
    g, b = resolve(group, call)
    a, _ = in_place(g, tensor, call, writable=False)  # a non-contiguous tensor: a contiguous copy
    peer = _peer(g, call, dst, group_dst, "dst")
    args = (a, peer, _tag(g, b, call, tag))
    g.sent[peer] += 1  # counted for the group's closing check
    return g, b, args


def _recv_args(tensor: Any, src: Any, group: Any, tag: Any, group_src: Any, call: str) -> tuple:
    """(group, backend, the backend's arguments, what to run once received: a non-contiguous tensor's copy back)."""
    g, b = resolve(group, call)
    a, back = in_place(g, tensor, call)
    peer = _source(g, b, call, src, group_src)
    args = (a, peer, _tag(g, b, call, tag))
    _count_receive(g, peer)
    return g, b, args, back


def _count_receive(g: ProcessGroup, peer: int | None) -> None:
    """A receive, counted for the group's closing check (from any rank: counted apart)."""
    if peer is None:
        g.any_received += 1
    else:
        g.received[peer] += 1


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` unchanged until the Work completes."""
    g, b, args = _send_args(tensor, dst, group, tag, group_dst, "isend")
    peer = args[1]
    return Work(g, b.send(*args), "isend", 0, ordered=False, peer=peer, index=g.sent[peer])


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work:
    """Start receiving into ``tensor`` from global rank ``src`` (None: any rank); returns a Work."""
    g, b, args, back = _recv_args(tensor, src, group, tag, group_src, "irecv")
    handle = b.recv(*args)
    peer = -1 if args[1] is None else args[1]
    return Work(
        g, handle if back is None else Chained(handle, back), "irecv", 0, ordered=False, receive=True, peer=peer,
        index=g.received[peer] if peer >= 0 else 0,
    )  # fmt: skip


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until the buffer may be reused."""
    g: Any = _world.world if group is None else group
    if (p := _ready(g, "send", tensor, dst, tag, group_dst)) is not None:
        try:  # ProcessGroup.run_ready for a send (neither numbered nor recorded)
            done = p.go(tensor, None, 0)
        except BaseException as e:
            g.ready_rest("send", p, None, 0, -1, e)
        if done is not None:  # None: the array is not the operation's (another dtype): the generic path
            g.sent[dst] += 1  # counted for the group's closing check
            if not done:
                g.ready_rest("send", p, None, 0, -1, None)
            return
    g, b, args = _send_args(tensor, dst, group, tag, group_dst, "send")
    fused = g.fused.get("send") if g.host else None
    if fused is not None:
        g.complete("send", 0, -1, g.timeout, fused, *args)
    else:
        Work(g, b.send(*args), "send", 0, ordered=False).wait()


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: any rank); returns the sender's global rank."""
    g: Any = _world.world if group is None else group
    if (p := _ready(g, "recv", tensor, src, tag, group_src)) is not None:
        try:  # ProcessGroup.run_ready for a receive (neither numbered nor recorded)
            done = p.go(None, tensor, 0)
        except BaseException as e:
            g.ready_rest("recv", p, tensor, 0, -1, e)
        if done is not None:
            g.received[src] += 1  # an int: _ready checked
            if not done:
                g.ready_rest("recv", p, tensor, 0, -1, None)
            return src  # type: ignore[return-value]  # an int: _ready checked
    g, b, args, back = _recv_args(tensor, src, group, tag, group_src, "recv")
    peer = args[1]
    fused = g.fused.get("recv") if g.host and peer is not None else None
    if fused is not None:
        g.complete("recv", 0, -1, g.timeout, fused, *args)
        if back is not None:
            back()
        return g.ranks[peer]
    handle = b.recv(*args)
    work = Work(g, handle if back is None else Chained(handle, back), "recv", 0, ordered=False, receive=True)
    if peer is None:
        return work.source_rank()
    work.wait()
    return g.ranks[peer]


def _waiting(call: str, arg: str, way: str) -> Any:
    """For the job monitor (:data:`monitor.P2P_WAITS`): a blocking ``call``'s group and peer from its frame's
    locals, and the peer's group rank once the call has been counted (for the monitor's early verdict)."""

    def describe(f: dict[str, Any]) -> tuple[Any, str, str, tuple[str, int, int] | None] | None:
        g, peer = f.get("g"), f.get(arg)
        if not isinstance(g, ProcessGroup):
            return None
        group_peer = f.get(f"group_{arg}")
        if peer is None and group_peer is not None and 0 <= group_peer < g.size:
            peer = g.ranks[group_peer]
        elif peer is not None and group_peer is None:
            group_peer = g.ranks.index(peer) if peer in g.ranks else None
        text = f"{call} {way} {'any rank' if peer is None else f'rank {peer}'}"
        counted = "args" in f or "done" in f  # past _send_args/_recv_args, or the ready path's count
        if not counted or not isinstance(group_peer, int) or not 0 <= group_peer < g.size or group_peer == g.rank:
            return g, call, text, None
        index = (g.sent if call == "send" else g.received)[group_peer]  # a blocking call: the last one posted
        return g, call, text, (call, group_peer, index)

    return describe


def _waiting_work(f: dict[str, Any]) -> tuple[Any, str, str, tuple[str, int, int] | None] | None:
    """For the job monitor: the isend or irecv a ``Work.wait`` waits for (its group, peer and index)."""
    w = f.get("self")
    if not isinstance(w, Work) or w.ordered:
        return None
    g, peer = w.group, w.peer
    if peer < 0:
        return g, w.call, f"the wait for an {w.call}" + (" from any rank" if w.call == "irecv" else ""), None
    way = "to" if w.call == "isend" else "from"
    link = ("send" if w.call == "isend" else "recv", peer, w.index)
    return g, w.call, f"the wait for an {w.call} {way} rank {g.ranks[peer]}", link


monitor.P2P_WAITS[send.__code__] = _waiting("send", "dst", "to")
monitor.P2P_WAITS[recv.__code__] = _waiting("recv", "src", "from")
monitor.P2P_WAITS[Work.wait.__code__] = _waiting_work


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
    for recv, _, peer, _ in plan:
        (g.received if recv else g.sent)[peer] += 1
    b.group_start()
    try:
        handles = [(b.recv if recv else b.send)(a, peer, tag) for recv, a, peer, tag in plan]
    finally:
        b.group_end()
    return [Work(g, h, call, 0, ordered=False, receive=recv) for h, (recv, *_) in zip(handles, plan, strict=True)]
