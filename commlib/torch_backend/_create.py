"""torch's creator hook: map a new torch group onto a commlib group and check that the ranks agree."""

from __future__ import annotations

from typing import Any

import commlib
from commlib.torch_backend._process_group import CommlibProcessGroup
from commlib.torch_backend._work import LOCK

__all__ = ["create"]


def create(opts: Any, pg_options: Any = None) -> CommlibProcessGroup:
    """A ``CommlibProcessGroup`` for torch's ``_DistributedBackendOptions`` (store, ranks, timeout)."""
    timeout = opts.timeout.total_seconds()
    members = [int(r) for r in opts.global_ranks_in_group]
    rank, size = int(opts.group_rank), int(opts.group_size)
    with LOCK:
        group = _commlib_group(members, timeout, opts.store, rank, size)
        _check_ranks(group, members, rank, size)
    return CommlibProcessGroup(group, rank, size, timeout)


def _commlib_group(members: list[int], timeout: float, store: Any, rank: int, size: int) -> Any:
    """The commlib group for torch's group: the world (``None``) or a new group of ``members``.

    The world forms from the launcher's variables, or torch's rank, size and store (processes
    that no MPI launcher started meet through torch's store: ``mp.spawn`` with ``tcp://``).
    """
    if not members:  # torch's default group
        if not commlib.is_initialized():
            commlib.init_process_group(timeout=timeout, store=store, rank=rank, world_size=size)
            return None
        try:  # a world made by an earlier commlib call is adopted, with torch's timeout
            commlib.init_process_group(timeout=timeout)
            return None
        except RuntimeError:  # ... one set up by init_process_group stays as it is: torch gets a group of its own
            return commlib.new_group(timeout=timeout, group_desc="torch default group")
    if members == list(range(commlib.get_world_size())):
        return commlib.new_group(members, timeout=timeout, sort_ranks=False)  # every rank is here: collective
    # torch calls the creator on the member ranks only; commlib's local synchronization matches that.
    return commlib.new_group(members, timeout=timeout, use_local_synchronization=True, sort_ranks=False)


def _check_ranks(group: Any, members: list[int], rank: int, size: int) -> None:
    mine, total = commlib.get_rank(group), commlib.get_world_size(group)
    if (mine, total) != (rank, size):
        where = f"group of global ranks {members}" if members else "default group"
        raise ValueError(
            f"[rank {commlib.get_rank()}/{commlib.get_world_size()}] init_process_group(backend='commlib'): torch "
            f"made this process rank {rank} of {size} in its {where}, but the launcher made it rank {mine} of "
            f"{total}; set RANK and WORLD_SIZE from the launcher (commlib.launch, mpiexec: PMI_RANK/PMI_SIZE)"
        )
