"""Command line: nccl-tests' flags and defaults, commlib's extras, and where the ranks come from."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commlib.bench._runner import Settings
from commlib.bench._specs import COLLECTIVES, DATATYPE_ALIASES, DATATYPES, OPS, parse_size, sweep

__all__ = ["build_parser", "main", "parse_args"]

_JOB_VARIABLES = ("PMI_RANK", "RANK", "OMPI_COMM_WORLD_RANK")  # set by mpiexec/srun, torchrun/commlib.launch, Open MPI
_DEFAULT_NPROC = 2
_EPILOG = """\
examples:
  python -m commlib.bench                                 all_reduce, 32 MiB float sum, 2 local ranks
  python -m commlib.bench all_gather -b 8 -e 128M -f 2    sweep 8 B .. 128 MiB, doubling
  python -m commlib.bench all --nproc 4 -b 1M -e 1M       every collective once, 4 ranks
  mpiexec -n 8 python -m commlib.bench -d all -o all      inside a job: uses the job's ranks

The table is nccl-tests' (sizes in bytes, time in us, GB = 1e9 bytes); see docs/bench.md.
"""


def _choice(kind: str, names: Sequence[str], aliases: dict[str, str] | None = None):
    """An argparse type accepting ``names``, their aliases, and ``all``; the message lists the valid names."""

    def convert(text: str) -> str:
        name = text.strip().lower()
        name = (aliases or {}).get(name, name)
        if name == "all" or name in names:
            return name
        raise argparse.ArgumentTypeError(f"unknown {kind} {text!r}; choose from {', '.join(names)} or all")

    convert.__name__ = kind  # argparse names the type in "invalid <type> value" messages
    return convert


def _collective(text: str) -> str:
    name = text.strip().lower().removesuffix("_perf")  # also take nccl-tests' binary names
    name = {"alltoall": "all_to_all", "allreduce": "all_reduce", "allgather": "all_gather"}.get(name, name)
    return _choice("collective", list(COLLECTIVES))(name)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(low: int):
    def convert(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return convert


def _root(text: str) -> int:
    return -1 if text.strip().lower() == "all" else _int_at_least(0)(text)


def _only_one(text: str) -> int:
    if text.strip().lower().removesuffix("_perf") in (*COLLECTIVES, "all", "alltoall"):
        raise argparse.ArgumentTypeError(f"-t is nccl-tests' thread count; name the collective alone: {text}")
    if _int_at_least(1)(text) != 1:
        raise argparse.ArgumentTypeError("commlib runs one rank per process: use --nproc (or your launcher) for more")
    return 1


def _output(text: str) -> str:
    if not Path(text).resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory of {text!r} does not exist")
    return text


def _plot_file(text: str) -> str:
    try:
        import matplotlib  # noqa: F401  (optional: only --plot needs it)
    except ImportError:
        raise argparse.ArgumentTypeError("needs matplotlib, which is not installed: pip install matplotlib") from None
    return _output(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (nccl-tests' short and long flag names, same defaults)."""
    p = argparse.ArgumentParser(
        prog="python -m commlib.bench",
        description="nccl-tests' performance table (time, algbw, busbw, #wrong) for commlib's collectives.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = ", ".join(COLLECTIVES)
    p.add_argument("collective", nargs="*", type=_collective, help=f"{names}, or all (default all_reduce)")
    p.add_argument(
        "--collective",
        dest="more",
        action="append",
        type=_collective,
        default=[],
        metavar="NAME",
        help="the same as the positional names (repeatable)",
    )
    _add_sweep_flags(p.add_argument_group("sizes and iterations (nccl-tests' flags and defaults)"))
    _add_operation_flags(p.add_argument_group("what each call does (nccl-tests' flags and defaults)"))
    _add_commlib_flags(p.add_argument_group("commlib"))
    return p


def _add_sweep_flags(g: Any) -> None:
    """Sizes, iterations, checks and timing (``g``: an argument group)."""
    g.add_argument("-b", "--minbytes", type=_size, default=32 << 20, help="smallest size, e.g. 8, 64K, 32M (32M)")
    g.add_argument("-e", "--maxbytes", type=_size, default=32 << 20, help="largest size (32M)")
    g.add_argument("-f", "--stepfactor", type=_int_at_least(0), default=1, help="multiply sizes by this (off)")
    g.add_argument("-i", "--stepbytes", type=_size, default=1 << 20, help="else add this many bytes (1M)")
    g.add_argument("-n", "--iters", type=_int_at_least(1), default=20, help="timed calls per measurement (20)")
    g.add_argument("-w", "--warmup_iters", type=_int_at_least(0), default=1, help="untimed warm-up calls (1)")
    g.add_argument("-c", "--check", type=_int_at_least(0), default=1, help="checked calls per measurement (1)")
    g.add_argument(
        "-a",
        "--average",
        type=int,
        choices=range(4),
        default=1,
        help="time over ranks: 0 rank 0's, 1 the mean, 2 the min, 3 the max (1)",
    )
    # nccl-tests' threads and GPUs per process: accepted, for scripts that pass them, but only as 1.
    g.add_argument("-t", "--nthreads", type=_only_one, default=1, help=argparse.SUPPRESS)
    g.add_argument("-g", "--ngpus", type=_only_one, default=1, help=argparse.SUPPRESS)


def _add_operation_flags(g: Any) -> None:
    """Datatype, reduction and root."""
    types = _choice("datatype", list(DATATYPES), DATATYPE_ALIASES)
    g.add_argument("-d", "--datatype", type=types, default="float", help=f"{', '.join(DATATYPES)}, or all (float)")
    g.add_argument("-o", "--op", type=_choice("op", list(OPS)), default="sum", help="sum, prod, max, min, avg, or all")
    g.add_argument("-r", "--root", type=_root, default=0, help="root rank of rooted collectives, or all (0)")


def _add_commlib_flags(g: Any) -> None:
    """Backend, ranks, output files, progress."""
    g.add_argument(
        "--backend",
        choices=("mpi", "nccl", "auto"),
        default="auto",
        help="auto: nccl with a GPU (or COMMLIB_NCCL_EMULATOR=1), else mpi",
    )
    g.add_argument(
        "--nproc",
        type=_int_at_least(1),
        default=None,
        help=f"ranks to start on this machine when not run inside a job ({_DEFAULT_NPROC})",
    )
    g.add_argument("--json", type=_output, metavar="FILE", help="also write every row to this JSON file")
    g.add_argument("--csv", type=_output, metavar="FILE", help="also write every row to this CSV file")
    g.add_argument("--plot", type=_plot_file, metavar="FILE.png", help="plot busbw against size (needs matplotlib)")
    g.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress line on stderr (auto: when stderr is a terminal)",
    )
    g.add_argument("--corrupt", type=_int_at_least(0), default=0, help=argparse.SUPPRESS)  # tests: fake wrong results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the flags; mistakes exit with argparse's usage message naming the flag."""
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.minbytes > ns.maxbytes:
        p.error(f"argument -b/--minbytes: {ns.minbytes} is larger than -e/--maxbytes {ns.maxbytes}")
    try:
        sweep(ns.minbytes, ns.maxbytes, ns.stepfactor, ns.stepbytes)
    except ValueError as e:
        p.error(f"argument -i/--stepbytes: {e}")
    if ns.nproc is not None and ns.root >= ns.nproc:
        p.error(f"argument -r/--root: {ns.root} is not a rank of {ns.nproc} (--nproc)")
    return ns


def _expand(ns: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(collectives, types, ops) with ``all`` expanded, in nccl-tests' order."""
    chosen = [*ns.collective, *ns.more] or ["all_reduce"]
    colls = list(COLLECTIVES) if "all" in chosen else list(dict.fromkeys(chosen))
    types = list(DATATYPES) if ns.datatype == "all" else [ns.datatype]
    ops = list(OPS) if ns.op == "all" else [ns.op]
    return tuple(colls), tuple(types), tuple(ops)


def _in_job() -> bool:
    return any(v in os.environ for v in _JOB_VARIABLES)


def _launch(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start ``--nproc`` ranks of this command under the MPICH wheel's mpiexec and wait for them."""
    from commlib.launch._mpiexec import die_with_parent, kill_group_or_process, mpiexec_command, process_tree

    n = ns.nproc or _DEFAULT_NPROC
    if ns.root >= n:
        build_parser().error(f"argument -r/--root: {ns.root} is not a rank of {n} (--nproc)")
    progress = "on" if ns.progress == "on" or (ns.progress == "auto" and sys.stderr.isatty()) else "off"
    # Ranks see pipes, not the terminal: decide here, and say it explicitly (a later flag wins).
    cmd = [sys.executable, "-m", "commlib.bench", *argv, "--nproc", str(n), "--progress", progress]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(
        mpiexec_command(n, cmd, prepend_rank=False), env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent()
    )
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the terminal sent SIGINT to mpiexec too; give it a moment, then leave nothing
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            for pid in [*process_tree(proc.pid), proc.pid]:
                kill_group_or_process(pid)
            proc.wait()
            return 128 + signal.SIGINT


def _settings(ns: argparse.Namespace) -> Settings:
    """The run's settings from the parsed flags."""
    colls, types, ops = _expand(ns)
    outputs = {k: getattr(ns, k) for k in ("json", "csv", "plot") if getattr(ns, k)}
    progress = ns.progress == "on" or (ns.progress == "auto" and sys.stderr.isatty())
    return Settings(
        collectives=colls,
        types=types,
        ops=ops,
        root=ns.root,
        minbytes=ns.minbytes,
        maxbytes=ns.maxbytes,
        stepfactor=ns.stepfactor,
        stepbytes=ns.stepbytes,
        iters=ns.iters,
        warmup=ns.warmup_iters,
        check=ns.check,
        average=ns.average,
        backend=ns.backend,
        progress=progress,
        corrupt=ns.corrupt,
        outputs=outputs,
    )


def _run_in_job(ns: argparse.Namespace) -> int:
    """Join the job's default group and run; rank 0 prints the table."""
    import commlib as dist
    from commlib.bench._runner import run
    from commlib.errors import BackendUnavailableError

    try:
        dist.init_process_group(backend=ns.backend)
    except BackendUnavailableError as e:  # every rank fails alike: one message is enough
        if os.environ.get("PMI_RANK", os.environ.get("RANK", "0")) == "0":
            print(f"commlib.bench: error: {e}", file=sys.stderr)
        return 2
    n = dist.get_world_size()
    problem = None
    if ns.nproc is not None and ns.nproc != n:
        problem = f"argument --nproc: {ns.nproc}, but this job has {n} ranks"
    elif ns.root >= n:
        problem = f"argument -r/--root: {ns.root} is not a rank of this {n}-rank job"
    if problem:  # every rank reaches the same verdict, so none waits for another
        if dist.get_rank() == 0:
            print(f"commlib.bench: error: {problem}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    try:
        return run(_settings(ns))
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m commlib.bench``: inside a launched job, use its ranks; otherwise start ``--nproc`` of them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    return _run_in_job(ns) if _in_job() else _launch(ns, argv)
