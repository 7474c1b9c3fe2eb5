"""``CommlibProcessGroup``: a ``torch.distributed.ProcessGroup`` whose collectives run on a commlib group.

torch calls the methods its Python ``ProcessGroup`` trampoline can forward
(``allreduce``, ``broadcast``, ``allgather``, ``all_gather_single``,
``reduce_scatter``, ``reduce_scatter_single``, their ``*_coalesced`` forms,
``all_to_all_single``, ``barrier``, ``send``, ``recv``); each arrives with torch's
options object. A call with ``opts.asyncOp`` False (torch's blocking API) runs
commlib's blocking collective at once; otherwise the commlib Work goes to the
progress thread (``_work``). Tensors go to commlib as they are: commlib views
CPU tensors zero-copy through DLPack and validates them.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import commlib
from commlib import groups
from commlib.torch_backend._work import LOCK, TorchWork, completed, submit

__all__ = ["CommlibProcessGroup", "reduce_op"]

_OPS = {
    name: getattr(commlib.ReduceOp, name) for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
}


_BY_TYPE = {getattr(dist.ReduceOp.RedOpType, name): op for name, op in _OPS.items()}  # the hot path: one dict hit


def reduce_op(op: Any, where: str) -> commlib.ReduceOp:
    """commlib's ReduceOp for torch's ``ReduceOp`` / ``RedOpType``; PREMUL_SUM is refused."""
    kind = getattr(op, "op", op)  # a c10d ReduceOp carries its RedOpType in .op
    found = _BY_TYPE.get(kind)
    if found is not None:
        return found
    name = getattr(kind, "name", str(kind)).rsplit(".", 1)[-1].upper()
    if name in _OPS:
        return _OPS[name]
    raise ValueError(
        f"{where}: op={name} is not supported by the commlib backend (supported: {', '.join(_OPS)}); "
        "PREMUL_SUM: scale the tensor first and use SUM"
    )


def _seconds(timeout: Any) -> float:
    """A torch timeout (timedelta; zero or negative means unset) as seconds, 0.0 when unset."""
    if isinstance(timeout, datetime.timedelta):
        return max(timeout.total_seconds(), 0.0)
    return 0.0


class CommlibProcessGroup(dist.ProcessGroup):
    """torch's collectives, DDP, FSDP2 and DTensor over one commlib group (``None``: commlib's world)."""

    def __init__(self, group: Any, rank: int, size: int, timeout: float) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lists (store, rank, size); this takes two
        self._group = group
        self._timeout = timeout
        self._name = ""
        self._desc = ""
        self._label = f"[rank {rank}/{size}] "
        self._batch_p2p = groups.ordered_p2p(group)  # see _point_to_point
        self._queued: list[tuple[TorchWork, Any]] = []

    def __repr__(self) -> str:
        return f"<CommlibProcessGroup rank {self.rank()}/{self.size()} on {self._group or 'commlib world'}>"

    # -- identity (DeviceMesh and torch's registry need the name; camelCase: torch's C++ virtual names) --
    def getBackendName(self) -> str:
        """The backend's name, as registered with torch."""
        return "commlib"

    def getGroupName(self) -> str:
        """The name torch gave this group."""
        return self._name

    def setGroupName(self, name: str) -> None:
        """Record the name torch gives this group."""
        self._name = name

    def getGroupDesc(self) -> str:
        """The description torch gave this group."""
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        """Record the description torch gives this group."""
        self._desc = desc

    def abort(self) -> None:
        """Nothing to do: a commlib group that failed is already fenced off."""

    # -- shrinking (torch's dist.shrink_group; see commlib.torch_backend._shrink) ----------------------------
    @property
    def supports_shrinking(self) -> bool:
        """True: ``dist.shrink_group`` works on this group (``commlib.shrink_group`` underneath)."""
        return True

    def shrink(self, ranks: list[int], shrink_flags: int = 0, opts_override: Any = None) -> CommlibProcessGroup:
        """The group without ``ranks`` (group ranks) and without every rank a survivor knows to have died: a new
        group for torch (``commlib.shrink_group``); this one is destroyed (a later call on it raises)."""
        with LOCK:
            world = self._group is None  # this torch group is commlib's default group: so is the new one
            old = commlib.group.WORLD if world else self._group
            new = commlib.shrink_group(list(ranks), group=self._group)
            self._group = old  # destroyed by the shrink: a call through this torch group now says so
        rank, size = commlib.get_rank(new), commlib.get_world_size(new)
        made = CommlibProcessGroup(None if world else new, rank, size, self._timeout)
        made._desc = f"{self._desc or 'default'}:shrunk"
        return made

    # -- running a call ----------------------------------------------------------------------------
    def _issue(
        self,
        call: str,
        opts: Any,
        result: Any,
        start: Callable[[bool], Any],
        finish: Callable[[], None] | None = None,
    ) -> dist.Work:
        """Start a call (``start(async_op)`` returns commlib Work(s) or None) and wrap it in a torch Work."""
        if self._queued:  # point-to-point ops issued earlier go first
            self._post_queued()
        blocking = opts is not None and not opts.asyncOp
        own = _seconds(opts.timeout) if opts is not None else 0.0
        if blocking and (own == 0 or own == self._timeout):
            with LOCK:
                start(False)  # commlib's blocking call, bounded by the group's (torch's) timeout
                if finish is not None:
                    finish()
            return completed(result)
        with LOCK:
            started = start(True)
        works = [w for w in (started if isinstance(started, list) else [started]) if w is not None]
        work = TorchWork(works, result, call, own or self._timeout, finish)
        if opts is not None:  # a collective: those of one group complete in issue order (only the oldest is tested)
            work._queue = self
        if blocking:
            work.wait()
        else:
            submit(work)
        return work

    def _one(self, tensors: list, call: str) -> Any:
        if type(tensors) is list and len(tensors) == 1:
            return tensors[0]
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            raise ValueError(
                f"{self._label}{call}: the commlib backend takes one tensor per call "
                f"(one device per process), got {len(tensors) if isinstance(tensors, (list, tuple)) else tensors!r}"
            )
        return tensors[0]

    # -- collectives -------------------------------------------------------------------------------
    def allreduce(self, tensors: list, opts: Any) -> dist.Work:
        """``dist.all_reduce``: reduce ``tensors[0]`` in place across the group."""
        t, g = self._one(tensors, "all_reduce"), self._group
        op = _BY_TYPE.get(opts.reduceOp.op) or reduce_op(opts.reduceOp, f"{self._label}all_reduce")
        if not opts.asyncOp and opts.timeout.total_seconds() <= 0:  # the latency-critical blocking call, inline
            with LOCK:
                commlib.all_reduce(t, op, group=g)
            return completed(tensors)
        return self._issue("all_reduce", opts, tensors, lambda a: commlib.all_reduce(t, op, group=g, async_op=a))

    def allreduce_coalesced(self, tensors: list, opts: Any) -> dist.Work:
        """Coalesced all_reduce: one flat buffer per dtype, one commlib all_reduce each."""
        g = self._group
        op = reduce_op(opts.reduceOp, f"{self._label}all_reduce_coalesced")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        flats = [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in by_dtype.values()]

        def start(a: bool) -> list:
            return [commlib.all_reduce(flat, op, group=g, async_op=a) for flat, _ in flats]

        def finish() -> None:
            for flat, ts in flats:
                offset = 0
                for t in ts:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

        return self._issue("all_reduce_coalesced", opts, tensors, start, finish)

    def broadcast(self, tensors: list, opts: Any) -> dist.Work:
        """``dist.broadcast``: copy ``tensors[0]`` from group rank ``opts.rootRank``."""
        t, g, root = self._one(tensors, "broadcast"), self._group, opts.rootRank
        return self._issue(
            "broadcast", opts, tensors, lambda a: commlib.broadcast(t, group=g, async_op=a, group_src=root)
        )

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any) -> dist.Work:
        """``dist.all_gather``: every rank's tensor into ``output_tensors[0][rank]``."""
        t, g = self._one(input_tensors, "all_gather"), self._group
        outs = self._one(output_tensors, "all_gather")
        return self._issue(
            "all_gather", opts, output_tensors, lambda a: commlib.all_gather(outs, t, group=g, async_op=a)
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        """``dist.all_gather_into_tensor``: every rank's ``input`` concatenated into ``output``."""
        g = self._group
        return self._issue(
            "all_gather_into_tensor", opts, [output], lambda a: commlib.all_gather_into_tensor(output, input, g, a)
        )

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        """Coalesced all_gather_into_tensor: one commlib call per pair, completed together."""
        g = self._group
        self._pairs("all_gather_into_tensor_coalesced", outputs, inputs)

        def start(a: bool) -> list:
            return [commlib.all_gather_into_tensor(o, i, g, a) for o, i in zip(outputs, inputs, strict=True)]

        return self._issue("all_gather_into_tensor_coalesced", opts, outputs, start)

    def reduce_scatter(self, output_tensors: list, input_tensors: list, opts: Any) -> dist.Work:
        """``dist.reduce_scatter``: reduce ``input_tensors[0][i]`` into rank i's ``output_tensors[0]``."""
        out, ins, g = (
            self._one(output_tensors, "reduce_scatter"),
            self._one(input_tensors, "reduce_scatter"),
            self._group,
        )
        op = reduce_op(opts.reduceOp, f"{self._label}reduce_scatter")
        return self._issue("reduce_scatter", opts, output_tensors, lambda a: commlib.reduce_scatter(out, ins, op, g, a))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        """``dist.reduce_scatter_tensor``: reduce ``input``; chunk ``rank`` of the result into ``output``."""
        g = self._group
        op = reduce_op(opts.reduceOp, f"{self._label}reduce_scatter_tensor")
        return self._issue(
            "reduce_scatter_tensor", opts, [output], lambda a: commlib.reduce_scatter_tensor(output, input, op, g, a)
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        """Coalesced reduce_scatter_tensor: one commlib call per pair, completed together."""
        g = self._group
        self._pairs("reduce_scatter_tensor_coalesced", outputs, inputs)
        op = reduce_op(opts.reduceOp, f"{self._label}reduce_scatter_tensor_coalesced")

        def start(a: bool) -> list:
            return [commlib.reduce_scatter_tensor(o, i, op, g, a) for o, i in zip(outputs, inputs, strict=True)]

        return self._issue("reduce_scatter_tensor_coalesced", opts, outputs, start)

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list, input_split_sizes: list, opts: Any
    ) -> dist.Work:
        """``dist.all_to_all_single`` (uneven splits along dim 0)."""
        g, out_s, in_s = self._group, list(output_split_sizes), list(input_split_sizes)
        return self._issue(
            "all_to_all_single", opts, [output], lambda a: commlib.all_to_all_single(output, input, out_s, in_s, g, a)
        )

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier``: wait until every rank of the group has called it."""
        g = self._group
        return self._issue("barrier", opts, [], lambda a: commlib.barrier(group=g, async_op=a))

    # -- reached only from torch's Python API (torch's C++ trampoline cannot forward them) ------------
    def reduce(self, tensors: list, opts: Any) -> dist.Work:
        """``dist.reduce``: reduce ``tensors[0]`` into group rank ``opts.rootRank``."""
        t, g, root = self._one(tensors, "reduce"), self._group, opts.rootRank
        op = reduce_op(opts.reduceOp, f"{self._label}reduce")
        return self._issue("reduce", opts, tensors, lambda a: commlib.reduce(t, None, op, g, a, group_dst=root))

    def gather(self, output_tensors: list, input_tensors: list, opts: Any) -> dist.Work:
        """``dist.gather``: every rank's tensor into ``output_tensors[0]`` on group rank ``opts.rootRank``."""
        t, g, root = self._one(input_tensors, "gather"), self._group, opts.rootRank
        outs = self._one(output_tensors, "gather") if output_tensors else None
        return self._issue(
            "gather", opts, output_tensors, lambda a: commlib.gather(t, outs, None, g, a, group_dst=root)
        )

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any) -> dist.Work:
        """``dist.scatter``: ``input_tensors[0][i]`` from group rank ``opts.rootRank`` into rank i's tensor."""
        t, g, root = self._one(output_tensors, "scatter"), self._group, opts.rootRank
        ins = self._one(input_tensors, "scatter") if input_tensors else None
        return self._issue(
            "scatter", opts, output_tensors, lambda a: commlib.scatter(t, ins, None, g, a, group_src=root)
        )

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any) -> dist.Work:
        """``dist.all_to_all``: ``input_tensors[i]`` to rank i, rank i's into ``output_tensors[i]``."""
        g = self._group
        return self._issue(
            "all_to_all", opts, output_tensors, lambda a: commlib.all_to_all(output_tensors, input_tensors, g, a)
        )

    def recv_anysource(self, tensors: list, tag: int) -> dist.Work:
        """``dist.recv(src=None)``: receive from whichever rank sends first; the Work knows the source."""
        t, g = self._one(tensors, "recv"), self._group
        work: Any = self._issue("recv", None, tensors, lambda a: commlib.irecv(t, group=g, tag=tag))
        work._source = lambda w: w.source_rank() if g is None else commlib.get_group_rank(g, w.source_rank())
        return work

    # -- point-to-point ----------------------------------------------------------------------------
    def send(self, tensors: list, dst: int, tag: int) -> dist.Work:
        """``dist.send``/``isend`` to group rank ``dst``; completes inside ``wait()`` or on the progress thread."""
        return self._point_to_point("send", tensors, dst, tag)

    def recv(self, tensors: list, src: int, tag: int) -> dist.Work:
        """``dist.recv``/``irecv`` from group rank ``src``."""
        return self._point_to_point("recv", tensors, src, tag)

    def _point_to_point(self, call: str, tensors: list, peer: int, tag: int) -> dist.Work:
        t, g = self._one(tensors, call), self._group
        fn, key = (commlib.isend, "group_dst") if call == "send" else (commlib.irecv, "group_src")
        if not self._batch_p2p:
            return self._issue(call, None, tensors, lambda a: fn(t, group=g, tag=tag, **{key: peer}))
        # NCCL runs one rank's sends and receives in issue order, and torch hands over batch_isend_irecv's
        # ops one by one: a ring would deadlock. Queue them; the first wait() posts the queue as one batch.
        work = TorchWork([], tensors, call, self._timeout)
        work._before = self._post_queued
        self._queued.append((work, commlib.P2POp(fn, t, group=g, tag=tag, group_peer=peer)))
        return work

    def _post_queued(self) -> None:
        """Post the queued point-to-point ops as one ``commlib.batch_isend_irecv`` (nccl groups)."""
        with LOCK:
            queued, self._queued = self._queued, []
            if not queued:
                return
            try:
                works = commlib.batch_isend_irecv([op for _, op in queued])
            except Exception as e:  # nothing was posted: every queued op fails with the reason
                for work, _ in queued:
                    work._error = e
                raise
            for (work, _), posted in zip(queued, works, strict=True):
                work._works.append(posted)

    def _pairs(self, call: str, outputs: list, inputs: list) -> None:
        if len(outputs) != len(inputs):
            raise ValueError(
                f"{self._label}{call}: outputs and inputs must pair up, "
                f"got {len(outputs)} outputs and {len(inputs)} inputs"
            )
