"""Uneven inputs: ranks that ran out of data shadow the others' collectives until every rank is done.

While inside ``DistributedDataParallel.join()``, every forward of a rank that still has data
starts with one small all-reduce (MAX) of ``[active, rank, syncs gradients, syncs buffers]``.
A rank that left its loop repeats the same all-reduce with zeros and learns whether anybody is
still training, whose buffers to take (the highest active rank), and whether that step's
backward all-reduces its gradients -- which it then matches with zero-filled buckets. When the
all-reduce says nobody is active, every rank takes the parameters and buffers of the last rank
that trained (torch's ``divide_by_initial_world_size=True``: averages always divide by the full
world size, the zeros count).
"""

from __future__ import annotations

from typing import Any

import torch

import commlib
from ddp._sync import broadcast_coalesced

__all__ = ["JoinState"]


class JoinState:
    """One ``join()`` block of one DDP module: the notify all-reduce and the shadow loop."""

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        self.last_active: int | None = None  # group rank whose state everyone adopts at the end

    def notify(self, active: bool, grad_sync: bool, buffer_sync: bool) -> tuple[bool, int, bool, bool]:
        """The per-step all-reduce; returns (anyone active, their highest rank, grad sync, buffer sync)."""
        ddp = self.ddp
        rank = commlib.get_rank(ddp.process_group)
        flags = [int(active), rank if active else -1, int(active and grad_sync), int(active and buffer_sync)]
        tensor = torch.tensor(flags, dtype=torch.int64, device=ddp.device)
        commlib.all_reduce(tensor, op=commlib.ReduceOp.MAX, group=ddp.process_group)
        anyone, source, grads, buffers = tensor.tolist()
        if anyone:
            self.last_active = source
        return bool(anyone), source, bool(grads), bool(buffers)

    def shadow_until_all_done(self) -> None:
        """Match the active ranks' collectives step by step, then adopt the last active rank's state."""
        ddp = self.ddp
        while True:
            anyone, source, grads, buffers = self.notify(False, False, False)
            if not anyone:
                break
            if buffers:
                broadcast_coalesced(ddp.module.buffers(), ddp.process_group, source)
            if grads:
                ddp.reducer.shadow()
        if self.last_active is not None:
            state = [*ddp.module.parameters(), *ddp.module.buffers()]
            broadcast_coalesced(state, ddp.process_group, self.last_active)
