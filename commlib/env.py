"""OneFlow's ``oneflow.env`` names: where this process sits in the job.

``get_rank`` and ``get_world_size`` initialise the default group on first use,
as every commlib call does; ``get_local_rank`` and ``get_node_size`` read the
launcher's environment and never communicate.
"""

from __future__ import annotations

from commlib._world import get_rank, get_world_size, launch_info

__all__ = ["get_local_rank", "get_node_size", "get_rank", "get_world_size"]


def get_local_rank() -> int:
    """This process's rank among the processes on its node."""
    return launch_info().local_rank


def get_node_size() -> int:
    """The number of nodes (machines) in the job."""
    return launch_info().num_nodes
