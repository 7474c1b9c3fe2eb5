"""Where am I? Rank, world size, local rank and node count from the launcher's environment.

Sources, in order: torchrun / OneFlow / ``commlib.launch`` variables (RANK,
WORLD_SIZE, LOCAL_RANK, ...), MPICH/Hydra (PMI_RANK, PMI_SIZE,
MPI_LOCALRANKID, MPI_LOCALNRANKS), Open MPI (OMPI_COMM_WORLD_*), Slurm
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_JOB_NODELIST),
else a single process. Pure functions of a mapping, so tests pass plain dicts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchInfo", "detect", "expand_hostlist"]


@dataclass(frozen=True, slots=True)
class LaunchInfo:
    """What the launcher told this process about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun", "mpich", "openmpi", "slurm" or "single"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"launcher environment ({self.source}): rank {self.rank} not in [0, {self.world_size})")


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None
    return default


def _nodes(world: int, local_world: int) -> int:
    return max(1, -(-world // max(local_world, 1)))


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read this process's place in the job from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    master = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE", default=world)
        return LaunchInfo(
            rank,
            world,
            _int(env, "LOCAL_RANK", default=rank % local_world),
            local_world,
            _int(env, "NODE_RANK", "GROUP_RANK", default=rank // local_world),
            _int(env, "NNODES", default=_nodes(world, local_world)),
            master,
            port,
            "torchrun",
        )
    if _srun_task(env):
        return _slurm(env, master, port)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_world = _int(env, "MPI_LOCALNRANKS", default=world)
        local = _int(env, "MPI_LOCALRANKID", default=rank % local_world)
        return LaunchInfo(
            rank, world, local, local_world, rank // local_world, _nodes(world, local_world), master, port, "mpich"
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", default=world)
        return LaunchInfo(
            rank,
            world,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=rank % local_world),
            local_world,
            _int(env, "OMPI_COMM_WORLD_NODE_RANK", default=rank // local_world),
            _nodes(world, local_world),
            master,
            port,
            "openmpi",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm(env, master, port)
    return LaunchInfo(0, 1, 0, 1, 0, 1, master, port, "single")


def _srun_task(env: Mapping[str, str]) -> bool:
    """A task started by srun itself (not a rank of an mpiexec run inside a Slurm allocation)."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    # mpiexec inside an allocation leaves SLURM_PROCID=0 on every rank; PMI says who is who then.
    pmi = env.get("PMI_RANK"), env.get("PMI_SIZE")
    return pmi == (None, None) or pmi == (env["SLURM_PROCID"], env["SLURM_NTASKS"])


def _slurm(env: Mapping[str, str], master: str | None, port: int | None) -> LaunchInfo:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    nodes = _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
    per_node = env.get("SLURM_TASKS_PER_NODE", "")
    local_world = _int(env, "SLURM_NTASKS_PER_NODE", default=None)
    if local_world is None:
        m = re.match(r"(\d+)", per_node)
        local_world = int(m.group(1)) if m else _nodes(world, nodes)
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    return LaunchInfo(
        rank,
        world,
        _int(env, "SLURM_LOCALID", default=0),
        local_world,
        _int(env, "SLURM_NODEID", default=0),
        nodes,
        master or (hosts[0] if hosts else None),
        port,
        "slurm",
    )


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm host list such as ``"gpu[01-04,07],cpu5"`` into host names, in order."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", spec):
        hosts.extend(_expand_one(part.strip()))
    return [h for h in hosts if h]


def _expand_one(part: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if m is None:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    out: list[str] = []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        if hi:
            width = len(lo)
            names = [f"{head}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
        else:
            names = [f"{head}{lo}"]
        out.extend(n + t for n in names for t in _expand_one(tail))
    return out
