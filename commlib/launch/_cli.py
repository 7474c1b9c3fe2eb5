"""The launcher's command line and its job: parse the flags, build the mpiexec command, run (under mpiexec, or as
plain workers for ``--on-failure continue``/``replace``) and restart."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from commlib._settings import value as setting
from commlib._sockets import free_port
from commlib.launch._mpiexec import die_with_parent, find_mpiexec
from commlib.launch._supervise import supervise

if TYPE_CHECKING:  # the store is imported only by the jobs that use one
    from commlib.store import TCPStore
    from commlib.store._server import StoreServer

__all__ = ["ON_FAILURE", "build_command", "main", "parse_args", "program", "rank_variables"]

ON_FAILURE = ("abort", "continue", "replace")  # --on-failure's choices
_MAX_REPLACEMENTS = 3


def _nproc(value: str) -> int:
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    if value == "gpu":
        from commlib.backends._cuda import device_count, nccl_unavailable_reason

        if (why := nccl_unavailable_reason()) is not None:
            raise argparse.ArgumentTypeError(f"gpu: {why}; give a number, or auto/cpu")
        return device_count()
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, auto, cpu or gpu, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {n}")
    return n


_EPILOG = """\
examples:
  python -m commlib.launch --nproc_per_node 2 train.py --epochs 3
  python -m commlib.launch --nproc_per_node 2 -m commlib.demo
  python -m commlib.launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --nproc_per_node 4 train.py  # on node 0
  python -m commlib.launch --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --nproc_per_node 4 train.py  # on node 1
  python -m commlib.launch --nproc_per_node 4 --on-failure replace --max_replacements 2 train.py
  python -m commlib.launch --nproc_per_node 4 --on-failure replace --spares 1 train.py

each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK (= GROUP_RANK), NNODES,
MASTER_ADDR and MASTER_PORT (torchrun's variables); init_process_group() reads them.

--on-failure: abort stops every worker when one fails and names the rank that failed first (exit code: its
own, or mpiexec's). continue and replace print one line per failure and go on; the job exits 0 when every
worker still running once one had finished exited 0, else with the first of those that failed (when no
worker finished: the first failure's code; 128 + N for signal N). A replacement runs the dead worker's
command with its environment plus COMMLIB_JOIN=1 and COMMLIB_REPLACES=<rank>, its lines prefixed with that
rank. --spares N starts N such processes with the job (COMMLIB_SPARE=<k>, lines prefixed [spare k]): warm,
they wait until a grow_group() takes them in, and a failure uses one before starting a replacement; a spare
the job never needed exits 0 when the job ends. These modes are commlib.launch's; under torchrun, torch's
agent restarts every worker (--max-restarts).
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's command line (OneFlow's flags, plus torchrun's --standalone)."""
    p = argparse.ArgumentParser(
        prog="python -m commlib.launch",
        description="Start one worker per rank on this machine (OneFlow's launcher flags).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    p.add_argument(
        "--nnodes", type=int, default=1, help="number of nodes; start the launcher once on each (default: %(default)s)"
    )
    p.add_argument("--node_rank", type=int, default=0, help="rank of this node, 0 .. nnodes-1 (default: %(default)s)")
    p.add_argument(
        "--nproc_per_node",
        type=_nproc,
        default=1,
        help="workers on this node: N, auto or cpu (one per CPU core), gpu (one per GPU) (default: %(default)s)",
    )
    p.add_argument("--master_addr", default="127.0.0.1", help="address of node 0, MASTER_ADDR (default: %(default)s)")
    p.add_argument(
        "--master_port", type=int, default=29500, help="free port on node 0, MASTER_PORT (default: %(default)s)"
    )
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module, like python -m")
    p.add_argument("--no_python", action="store_true", help="run the script as a program, without python")
    p.add_argument(
        "--redirect_stdout_and_stderr",
        action="store_true",
        help="write each worker's output to --logdir instead of the terminal",
    )
    p.add_argument(
        "--logdir",
        default=None,
        help="folder for per-rank output (default: ./log) and, when given, flight recorder dumps (<logdir>/flight)",
    )
    p.add_argument("--standalone", action="store_true", help="single-node job on localhost (torchrun's flag)")
    p.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="restart every worker up to N times after the job failed (with --on-failure continue or replace: "
        "when every worker failed, or one that outlived the failures did) (default: %(default)s)",
    )
    p.add_argument(
        "--on-failure",
        "--on_failure",
        dest="on_failure",
        choices=ON_FAILURE,
        default="abort",
        metavar="MODE",
        help="what a worker's failure does, one of abort, continue, replace: abort stops the job and names the "
        "rank that failed first; continue names it and the others run on; replace also starts a process that "
        "takes its rank over (same command and environment, plus COMMLIB_JOIN=1 and COMMLIB_REPLACES=<rank>). "
        "With continue and replace the workers are plain processes (no mpiexec) that meet through the store "
        "this launcher serves at --master_addr:--master_port (default: %(default)s)",
    )
    p.add_argument(
        "--max-replacements",
        "--max_replacements",
        dest="max_replacements",
        type=int,
        metavar="N",
        default=None,
        help=f"with --on-failure replace: replace each rank at most N times (default: {_MAX_REPLACEMENTS})",
    )
    p.add_argument(
        "--spares",
        type=int,
        metavar="N",
        default=0,
        help="with --on-failure continue or replace: start N more processes with the workers, each waiting (in "
        "init_process_group, COMMLIB_JOIN=1 and COMMLIB_SPARE=1) until the job's grow_group() takes it in; a "
        "failure under replace is covered by a waiting spare before a new process is started; spares never "
        "taken in exit 0 when the job ends (default: %(default)s)",
    )
    p.add_argument("training_script", help="the script (or module with -m, or program with --no_python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = p.parse_args(argv)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node_rank must be in [0, --nnodes={args.nnodes}), got {args.node_rank}")
    if args.max_restarts < 0:
        p.error(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.max_replacements is not None and args.on_failure != "replace":
        p.error(f"--max_replacements counts the replacements of --on-failure replace, not {args.on_failure}")
    if args.spares and args.on_failure == "abort":
        p.error("--spares waits for a failure the job survives: use --on-failure continue or replace")
    if args.spares < 0:
        p.error(f"--spares must be >= 0, got {args.spares}")
    if args.max_replacements is None:
        args.max_replacements = _MAX_REPLACEMENTS
    if args.max_replacements < 0:
        p.error(f"--max_replacements must be >= 0, got {args.max_replacements}")
    if args.max_restarts and args.nnodes != 1:
        p.error("--max_restarts restarts a single-node job; across nodes, restart the launchers together")
    if args.standalone and args.nnodes != 1:
        p.error("--standalone is a single-node job; drop --nnodes")
    if args.module and args.no_python:
        p.error("-m/--module and --no_python cannot be combined")
    if not (args.module or args.no_python or os.path.exists(args.training_script)):
        p.error(f"{args.training_script}: no such file or folder (a module runs with -m, a program with --no_python)")
    args.worker_port = args.master_port
    return args


def program(args: argparse.Namespace) -> list[str]:
    """The command every worker runs: the bootstrap and the script (or module), or the program itself."""
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    boot = [sys.executable, "-m", "commlib.launch._bootstrap"]
    if args.module:
        return [*boot, "-m", args.training_script, *args.training_script_args]
    return [*boot, args.training_script, *args.training_script_args]


def build_command(args: argparse.Namespace) -> list[str]:
    """The mpiexec command line: one MPMD segment per rank, each with its own environment."""
    cmd = [find_mpiexec()]
    if args.redirect_stdout_and_stderr:
        log = Path(args.logdir or "log").resolve()
        log.mkdir(parents=True, exist_ok=True)
        cmd += ["-outfile-pattern", str(log / "rank%r.stdout"), "-errfile-pattern", str(log / "rank%r.stderr")]
    else:
        cmd += ["-prepend-rank"]
    for rank in range(args.nproc_per_node):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1"]
        for name, value in rank_variables(args, rank).items():
            cmd += ["-env", name, value]
        cmd += program(args)
    return cmd


def rank_variables(args: argparse.Namespace, local_rank: int) -> dict[str, str]:
    """torchrun's variables for this node's worker ``local_rank``."""
    n, node = args.nproc_per_node, args.node_rank
    place = {
        "RANK": node * n + local_rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": n * args.nnodes,
        "LOCAL_WORLD_SIZE": n,
        "NODE_RANK": node,
        "GROUP_RANK": node,
        "NNODES": args.nnodes,
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": args.worker_port,  # --master_port, unless this launcher's store takes it (_worker_port)
    }
    return {name: str(value) for name, value in place.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job, restarting it up to ``--max_restarts`` times; return its exit code."""
    args = parse_args(argv)
    stopped: list[int] = []  # set by Ctrl-C / SIGTERM: no restart after that
    for attempt in range(args.max_restarts + 1):
        code = _attempt(args, stopped)
        if code == 0 or stopped or attempt == args.max_restarts:
            return code
        print(
            f"commlib.launch: restarting every worker ({attempt + 1} of {args.max_restarts} restarts)",
            file=sys.stderr,
            flush=True,
        )
    return code


def _attempt(args: argparse.Namespace, stopped: list[int]) -> int:
    """Run the workers once; return the job's exit code (128 + N when a worker was killed by signal N)."""
    started_ns = time.time_ns()
    with tempfile.TemporaryDirectory(prefix="commlib-launch-") as status:
        env = dict(os.environ, COMMLIB_LAUNCH_STATUS=status)
        if not env.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: N workers must not each start N-core thread pools
        env["COMMLIB_ON_FAILURE"] = args.on_failure  # for the workers (commlib.setting): is a replacement coming?
        args.worker_port = _worker_port(args)
        store = _serve_store(args, env)  # node 0 of several, or plain workers: the launcher serves the job's store
        monitor, flight = _monitor_env(args, env)
        try:
            if args.on_failure == "abort":
                code, failed = _under_mpiexec(args, env, Path(status), stopped)
            else:
                from commlib.launch._workers import run_workers

                code, failed = run_workers(args, env, Path(status), stopped)
        finally:
            if store is not None:
                store.close()
            if monitor is not None:
                monitor.stop()
    if failed:
        _print_flight_summary(flight, args, started_ns)
    elif code == 0:
        _forget_exit_dumps(flight, started_ns)
    return code


def _under_mpiexec(args: argparse.Namespace, env: dict[str, str], status: Path, stopped: list[int]) -> tuple[int, bool]:
    """Run the workers under mpiexec, stopping them all when one fails; return the exit code and whether a
    worker failed (then named)."""
    proc = subprocess.Popen(build_command(args), env=env, preexec_fn=die_with_parent())  # SIGTERM: hydra cleans up

    def forward(signum: int, _frame: object) -> None:
        stopped.append(signum)
        proc.send_signal(signal.SIGTERM)  # hydra stops every rank on SIGTERM

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    n = args.nproc_per_node
    code, failure = supervise(proc, status, range(args.node_rank * n, args.node_rank * n + n))
    if failure is None:
        return _status(code), False
    where = log_path(args, f"rank{failure.rank}.stderr")
    tie = failure.why.startswith("ranks [")
    who = "one of the " + failure.why.split(" were", 1)[0] if tie else f"rank {failure.rank}"
    said = f"commlib.launch: {who} failed ({failure.why}); log: {where}; the job was stopped"
    print(said, file=sys.stderr, flush=True)
    return failure.code or _status(code) or 1, True


def log_path(args: argparse.Namespace, name: str) -> str:
    """Where the output file ``name`` of a worker is (with --redirect_stdout_and_stderr), else "output above"."""
    return str(Path(args.logdir or "log") / name) if args.redirect_stdout_and_stderr else "output above"


def _forget_exit_dumps(folder: Path, since_ns: int) -> None:
    """After a job that succeeded, remove the flight records its ranks wrote on their way out (nothing to read)."""
    from commlib._diagnostics.flight import EXIT_REASON

    try:
        paths = list(folder.glob("rank*.json"))
    except OSError:  # gone already (another launcher of the same job on this host shares the folder)
        return
    for path in paths:
        try:
            if path.stat().st_mtime_ns >= since_ns and EXIT_REASON in path.read_text()[:4096]:
                path.unlink()
        except OSError:
            continue
    with contextlib.suppress(OSError):
        folder.rmdir()  # only if empty


def _status(code: int) -> int:
    """A process status as a shell exit code: 128 + N for death by signal N."""
    return 128 - code if code < 0 else code


def _monitor_env(args: argparse.Namespace, env: dict[str, str]) -> tuple[StoreServer | None, Path]:
    """Give the workers a job store that outlives any of them (timeouts name the missing ranks through it),
    a job id and the flight recorder's folder (``COMMLIB_FLIGHT_DIR`` if set); return the store server this
    launcher runs (if any) and that folder."""
    import secrets

    job = f"{os.getpid()}" if args.nnodes == 1 else f"{args.master_addr}-{args.master_port}"
    env["COMMLIB_JOB_ID"] = job
    if setting("COMMLIB_FLIGHT_DIR"):
        folder = Path(setting("COMMLIB_FLIGHT_DIR"))
    elif args.logdir is not None or args.redirect_stdout_and_stderr:
        folder = Path(args.logdir or "log").resolve() / "flight"
    else:
        folder = Path(tempfile.gettempdir()) / f"commlib-flight-{job}"
    env["COMMLIB_FLIGHT_DIR"] = str(folder)
    if args.nnodes > 1:  # node 0's launcher serves the rendezvous store: the monitor shares it
        env["COMMLIB_MONITOR_STORE"] = f"{args.master_addr}:{args.master_port}"
        env["COMMLIB_MONITOR_TOKEN"] = setting("COMMLIB_STORE_TOKEN")
        return None, folder
    from commlib.store._server import StoreServer
    from commlib.store._wire import Limits

    token = secrets.token_hex(16)
    try:
        server = StoreServer("127.0.0.1", 0, token.encode(), Limits(), None)
    except OSError:
        return None, folder  # the ranks serve one themselves
    env["COMMLIB_MONITOR_STORE"] = f"127.0.0.1:{server.port}"
    env["COMMLIB_MONITOR_TOKEN"] = token
    return server, folder


def _print_flight_summary(folder: Path, args: argparse.Namespace, since_ns: int) -> None:
    from commlib._diagnostics.flight import summarize

    fresh = [p for p in folder.glob("rank*.json") if p.stat().st_mtime_ns >= since_ns] if folder.is_dir() else []
    if not fresh:
        return
    n = args.nproc_per_node
    offset = args.node_rank * n
    text = summarize(folder, offset + n, since_ns)
    lines = [line for line in text.splitlines() if not line.startswith(tuple(f"  rank {r}:" for r in range(offset)))]
    print(f"commlib.launch: flight recorder ({folder}):\n" + "\n".join(lines), file=sys.stderr, flush=True)


def _serves_a_store(args: argparse.Namespace) -> bool:
    """Whether node 0's launcher serves the job's store at --master_port: several nodes, or plain workers."""
    return args.on_failure != "abort" or args.nnodes > 1


def _worker_port(args: argparse.Namespace) -> int:
    """The workers' MASTER_PORT: --master_port, unless the launcher's store takes it; then another port, for
    torch's init_process_group (backend="commlib") to serve its own store at from rank 0: the next one across
    nodes (every node must give the same; the one before for 65535), a free one on one node."""
    if not _serves_a_store(args):
        return args.master_port
    if args.nnodes == 1:
        return free_port()
    return args.master_port + 1 if args.master_port < 65535 else args.master_port - 1


def _serve_store(args: argparse.Namespace, env: dict[str, str]) -> TCPStore | None:
    """Serve the job's rendezvous store at --master_addr:--master_port where this launcher is the one to: on node 0
    of a multi-node job (the nodes meet through it), and on node 0 of plain workers (--on-failure continue or
    replace: the store outlives any worker, so rank 0 connects to it rather than serving it)."""
    plain = args.on_failure != "abort"
    token = setting("COMMLIB_STORE_TOKEN") or None
    if _serves_a_store(args):  # commlib's workers find the job's store here (their MASTER_PORT: _worker_port)
        env["COMMLIB_STORE_SERVED"] = f"{args.master_addr}:{args.master_port}"
    if plain:
        # after a peer's death MPI keeps the survivors' old communicator (its requests to the dead never end):
        # UCX lists them at exit as warnings ("was not returned to mpool"), which say nothing to a user
        env.setdefault("UCX_LOG_LEVEL", "error")
        if args.nnodes == 1 and token is None:
            import secrets

            token = env["COMMLIB_STORE_TOKEN"] = secrets.token_hex(16)  # the job's own: strangers are refused
    if args.node_rank != 0 or not _serves_a_store(args):
        return None
    from commlib.store import TCPStore

    try:
        return TCPStore(args.master_addr, args.master_port, is_master=True, wait_for_workers=False, token=token)
    except RuntimeError as e:  # CommError: the port is taken, or the address is not this host's
        raise SystemExit(
            f"commlib.launch: cannot serve the job's rendezvous store at {args.master_addr}:{args.master_port} "
            f"({e.__cause__ or e}); give a free port with --master_port"
        ) from None
