"""``python -m commlib.launch``: start one worker per rank on this machine (OneFlow's launcher flags).

    python -m commlib.launch --nproc_per_node 2 train.py --lr 0.1
    python -m commlib.launch --nproc_per_node 2 -m commlib.demo

Workers are started under the MPICH wheel's ``mpiexec`` (so the mpi backend
works) with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR and MASTER_PORT set for each; output lines are prefixed with the
rank, or written per rank under ``--logdir``. The launcher exits with the job's
exit code; Ctrl-C or SIGTERM stops every worker, and when one worker fails the
others are stopped and the failed rank is named.

The package: ``_cli`` (flags, the mpiexec command line, one attempt of the job), ``_bootstrap``
(what each worker runs first), ``_mpiexec`` (finding mpiexec, controlling hydra's processes).

Several nodes: run the launcher on each with ``--nnodes N --node_rank i
--master_addr <node 0's address> --master_port P``; node 0's launcher serves a
rendezvous store there and the nodes' ranks join into one job. Set the same
``COMMLIB_STORE_TOKEN`` on every node to make the store refuse strangers.
"""

from __future__ import annotations

from commlib.launch._cli import build_command, main, parse_args

__all__ = ["build_command", "main", "parse_args"]
