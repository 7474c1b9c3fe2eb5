"""Groups found by their ranks, for the layers above commlib (``globalview`` finds a placement's groups here).

:func:`subgroup` makes the group of a list of ranks once and hands the same group back after
that, until ``destroy_process_group()`` ends the default group: a later ``init_process_group()``
starts an empty cache, so nothing above commlib ever holds a group of a world that is gone.
"""

from __future__ import annotations

from types import ModuleType

from commlib._group import ProcessGroup
from commlib._world import resolve, subgroup

__all__ = ["array_module", "ordered_p2p", "subgroup"]


def array_module(group: ProcessGroup | None = None) -> ModuleType:
    """The array module of ``group``'s buffers: numpy for host memory (mpi, the NCCL emulator), cupy on GPUs."""
    return resolve(group, "commlib.groups.array_module")[0].xp


def ordered_p2p(group: ProcessGroup | None = None) -> bool:
    """Whether ``group``'s sends and receives run in the order each rank posts them (NCCL's stream): then a
    ring of sends posted one by one deadlocks, and the ops of a batch must be posted together."""
    return resolve(group, "commlib.groups.ordered_p2p")[1].ordered_p2p
