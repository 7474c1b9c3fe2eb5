"""Locate the MPICH wheel's ``mpiexec``, build hydra command lines, control hydra jobs.

Hydra facts the job-control helpers rely on: the proxy (hydra_pmi_proxy) and every
rank call setsid(), so none of them is in mpiexec's process group; killing that
group orphans them. Their pids are found through /proc instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["find_mpiexec", "mpiexec_command"]


def _candidate_dirs() -> list[Path]:
    """Directories that may hold the mpiexec of the running interpreter's MPICH wheel."""
    dirs: list[Path] = []
    scripts = sysconfig.get_path("scripts")
    if scripts:
        dirs.append(Path(scripts))
    # A venv created with --system-site-packages or an odd install scheme may put
    # the wheel's scripts next to the interpreter rather than in "scripts".
    dirs.append(Path(sys.executable).parent)
    unique: list[Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def find_mpiexec() -> str:
    """Return the path of mpiexec: the MPICH wheel's next to sys.executable, else PATH's."""
    dirs = _candidate_dirs()
    for directory in dirs:
        candidate = directory / "mpiexec"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("mpiexec")
    if found:
        return found
    searched = ", ".join(str(d) for d in dirs)
    raise FileNotFoundError(
        f"mpiexec not found: searched {searched} and PATH. "
        "Install the MPICH wheel into this environment with `pip install mpich`."
    )


def mpiexec_command(n: int, argv: Sequence[str], *, prepend_rank: bool = True) -> list[str]:
    """Build the hydra command line that runs ``argv`` on ``n`` ranks."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of ranks must be a positive int, got {n!r}")
    if isinstance(argv, str) or not argv:
        raise ValueError("argv must be a non-empty sequence of strings")
    cmd = [find_mpiexec()]
    if prepend_rank:
        # A global hydra option: it has to come before the local "-n".
        cmd.append("-prepend-rank")
    cmd += ["-n", str(n)]
    cmd += [str(a) for a in argv]
    return cmd


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat from the state on, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields follow the last ")".
    return stat[stat.rindex(b")") + 2 :].split()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which kill(pid, 0) still finds, does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    if fields is None:
        return not os.path.isdir("/proc")
    return fields[0] not in (b"Z", b"X")


def process_tree(root: int) -> dict[int, int]:
    """pid -> parent pid of every process below ``root`` (Linux /proc; else empty)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    parents = {int(e): int(f[1]) for e in entries if (f := _stat_fields(e)) is not None}
    tree: dict[int, int] = {}
    while True:  # one more generation per pass
        grown = {pid: ppid for pid, ppid in parents.items() if ppid == root or ppid in tree}
        if len(grown) == len(tree):
            return tree
        tree = grown


def send_signal(pid: int, signum: int) -> bool:
    """Send ``signum`` to ``pid``; False if it is gone."""
    try:
        os.kill(pid, signum)
    except OSError:
        return False
    return True


def kill_group_or_process(pid: int) -> None:
    """SIGKILL ``pid``'s process group if it leads one (proxy, ranks), else ``pid``."""
    try:
        # Session leaders take the children they started down with them.
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return
    except OSError:
        pass
    send_signal(pid, signal.SIGKILL)


def die_with_parent() -> Callable[[], None] | None:
    """A Popen preexec_fn making Linux SIGTERM the child when we die (hydra then cleans up)."""
    # Covers deaths that skip any cleanup code: SIGKILL, os._exit. Linux sends the
    # signal when the *thread* that forked exits, so that thread must outlive the job.
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # not needed by the ranks, which import commlib.testing too

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1 == PR_SET_PDEATHSIG
