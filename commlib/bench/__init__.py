"""``python -m commlib.bench``: nccl-tests' performance table for commlib's collectives.

    python -m commlib.bench                              # all_reduce, 32 MiB of float, 2 local ranks
    python -m commlib.bench all -b 8 -e 128M -f 2        # every collective, 8 B to 128 MiB
    mpiexec -n 4 python -m commlib.bench all_gather      # inside a job: the job's ranks

Flags, defaults, columns and bus-bandwidth factors are nccl-tests' (``-b -e -f
-i -n -w -c -d -o -r -a``); ``--json``, ``--csv`` and ``--plot`` also save the
rows. How to read the table: ``docs/bench.md``.
"""

from __future__ import annotations

from commlib.bench._cli import main

__all__ = ["main"]
