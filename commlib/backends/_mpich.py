"""What MPICH reads once, at ``MPI_Init``, set before any of commlib's modules imports mpi4py (which initialises
MPI): from :mod:`commlib.backends`, which Python runs before any of its modules. No mpi4py import here.

MPICH's blocking calls (``MPI_Comm_split``, ``MPI_Comm_accept``, ``MPI_Finalize``, ...) wait by spinning.
When a node's ranks outnumber the cores they may run on, a spinning rank holds a core its peer needs to take
the next step, and each step of the call costs a scheduler time slice: ``MPI_Comm_split`` on 4 ranks over 2
cores took 16-22 ms (0.02 ms on 2 ranks). With ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` MPICH sleeps briefly
(``nanosleep``) every so many polls of such a wait: the same split took 1-2 ms. commlib's own waits already
yield (``base.poll``) and spin only where every rank has a core (``_mpi_waits.may_block``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from commlib._environment import detect

__all__ = ["HEAVY_YIELD", "before_init", "oversubscribed"]

HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
_SPELLINGS = (HEAVY_YIELD, "MPICH_ENABLE_HEAVY_YIELD", "MPIR_PARAM_ENABLE_HEAVY_YIELD")  # MPICH reads all three


def oversubscribed(env: MutableMapping[str, str], cores: int) -> bool:
    """Whether this node's ranks, as the launcher's environment ``env`` counts them, outnumber ``cores``."""
    try:
        local = detect(env).local_world_size
    except ValueError:  # a malformed launcher variable: init_process_group reports it, not this
        return False
    return local > cores


def before_init(env: MutableMapping[str, str] | None = None) -> bool:
    """Make MPICH's blocking waits yield when this node's ranks outnumber this process's cores; a value the user
    set (under any of MPICH's spellings) wins. True: set here."""
    env = os.environ if env is None else env
    if any(name in env for name in _SPELLINGS):
        return False
    if not oversubscribed(env, len(os.sched_getaffinity(0))):
        return False
    env[HEAVY_YIELD] = "1"
    return True
