"""Backends: the engines under commlib's narrow waist (see ``_base`` for the protocol).

Only ``mpi`` imports mpi4py; only the nccl modules import cupy.
"""

import os

# MPI settings must exist before MPI starts (importing mpi4py.MPI initialises it), so they are
# made on ``import commlib``. MPICH's default algorithm for the nonblocking reduce-scatter is ~7x
# slower than its blocking one from ~1 MiB (MPICH 5 wheel, 2 ranks); the pairwise schedule
# matches the blocking call. A user's own setting wins.
os.environ.setdefault("MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM", "sched_pairwise")
