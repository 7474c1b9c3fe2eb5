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

__all__ = ["LaunchInfo", "detect", "expand_hostlist", "mpi_launched"]


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


def _maybe(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` set in ``env``, as an int; None when none is."""
    for name in names:
        value = env.get(name)
        if value is not None and value != "":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None
    return None


def _opt(env: Mapping[str, str], *names: str, default: int) -> int:
    found = _maybe(env, *names)
    return default if found is None else found


def _req(env: Mapping[str, str], name: str) -> int:
    found = _maybe(env, name)
    if found is None:
        raise ValueError(f"environment variable {name} must be an integer, got {env.get(name)!r}")
    return found


def _nodes(world: int, local_world: int) -> int:
    return max(1, -(-world // max(local_world, 1)))


# Each launcher's variables: rank, world size, then the names (first set wins) of the local world size,
# local rank, node rank and number of nodes; what a launcher does not give is derived from the others.
_VARIABLES = {
    "torchrun": (
        "RANK",
        "WORLD_SIZE",
        ("LOCAL_WORLD_SIZE",),
        ("LOCAL_RANK",),
        ("NODE_RANK", "GROUP_RANK"),
        ("NNODES",),
    ),
    "mpich": ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALNRANKS",), ("MPI_LOCALRANKID",), (), ()),
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_NODE_RANK",),
        (),
    ),
}


def _launched_by(source: str, env: Mapping[str, str], master: str | None, port: int | None) -> LaunchInfo:
    rank_var, size_var, local_worlds, local_ranks, node_ranks, nodes = _VARIABLES[source]
    rank, world = _req(env, rank_var), _req(env, size_var)
    local_world = _opt(env, *local_worlds, default=world)
    return LaunchInfo(
        rank,
        world,
        _opt(env, *local_ranks, default=rank % local_world),
        local_world,
        _opt(env, *node_ranks, default=rank // local_world),
        _opt(env, *nodes, default=_nodes(world, local_world)),
        master,
        port,
        source,
    )


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read this process's place in the job from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    master = env.get("MASTER_ADDR")
    port = _maybe(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        return _launched_by("torchrun", env, master, port)
    if _srun_task(env):
        return _slurm(env, master, port)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _launched_by("mpich", env, master, port)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _launched_by("openmpi", env, master, port)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm(env, master, port)
    return LaunchInfo(0, 1, 0, 1, 0, 1, master, port, "single")


#: Variables an MPI launcher (hydra, srun --mpi=pmi2/pmix, Open MPI) gives its processes.
_MPI_LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def mpi_launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process (then MPI's world holds the job's ranks)."""
    env = os.environ if env is None else env
    return any(name in env for name in _MPI_LAUNCHER_VARIABLES)


def _srun_task(env: Mapping[str, str]) -> bool:
    """A task started by srun itself (not a rank of an mpiexec run inside a Slurm allocation)."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    # mpiexec inside an allocation leaves SLURM_PROCID=0 on every rank; PMI says who is who then.
    pmi = env.get("PMI_RANK"), env.get("PMI_SIZE")
    return pmi == (None, None) or pmi == (env["SLURM_PROCID"], env["SLURM_NTASKS"])


def _slurm(env: Mapping[str, str], master: str | None, port: int | None) -> LaunchInfo:
    rank, world = _req(env, "SLURM_PROCID"), _req(env, "SLURM_NTASKS")
    nodes = _opt(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
    per_node = env.get("SLURM_TASKS_PER_NODE", "")
    local_world = _maybe(env, "SLURM_NTASKS_PER_NODE")
    if local_world is None:
        m = re.match(r"(\d+)", per_node)
        local_world = int(m.group(1)) if m else _nodes(world, nodes)
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    return LaunchInfo(
        rank,
        world,
        _opt(env, "SLURM_LOCALID", default=0),
        local_world,
        _opt(env, "SLURM_NODEID", default=0),
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
