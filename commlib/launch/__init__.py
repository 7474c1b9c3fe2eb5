"""``python -m commlib.launch``: start one worker per rank on this machine (OneFlow's launcher flags).

    python -m commlib.launch --nproc_per_node 2 train.py --lr 0.1
    python -m commlib.launch --nproc_per_node 2 -m commlib.demo

Workers are started with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR and MASTER_PORT set for each; output lines are prefixed with the
rank, or written per rank under ``--logdir``. The launcher exits with the job's
exit code; Ctrl-C or SIGTERM stops every worker.

What a worker's failure does is ``--on-failure``'s choice. ``abort`` (the default): the
workers run under the MPICH wheel's ``mpiexec`` (so the mpi backend works), the others are
stopped and the rank that failed first is named, with how it ended. ``continue``: the
failure is named and the others run on. ``replace``: as continue, and a new process takes
the rank over (the same command and environment plus ``COMMLIB_JOIN=1`` and
``COMMLIB_REPLACES=<rank>``: it joins the running job instead of starting one), at most
``--max_replacements`` times per rank. With continue and replace the workers are plain
processes (hydra would stop them all a moment after one dies) that meet through the
rendezvous store the launcher serves at --master_addr:--master_port (``COMMLIB_STORE_SERVED``); their
MASTER_PORT is then another, free port, for torch's ``init_process_group`` to serve its own store at.

The package: ``_cli`` (flags, the mpiexec command line, one attempt of the job), ``_supervise``
(a job under mpiexec: which rank failed first), ``_workers`` (plain workers: continue, replace),
``_bootstrap`` (what each worker runs first), ``_mpiexec`` (finding mpiexec, processes' ends, hydra's
processes).

Several nodes: run the launcher on each with ``--nnodes N --node_rank i
--master_addr <node 0's address> --master_port P``; node 0's launcher serves a
rendezvous store there and the nodes' ranks join into one job (their MASTER_PORT is P + 1, for torch's
store). Set the same
``COMMLIB_STORE_TOKEN`` on every node to make the store refuse strangers.
"""

from __future__ import annotations

from commlib.launch._cli import build_command, main, parse_args

__all__ = ["build_command", "main", "parse_args"]
