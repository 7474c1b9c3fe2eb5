"""Locate the MPICH wheel's ``mpiexec``, build hydra command lines, control hydra jobs, tell how a process ended.

Hydra facts the job-control helpers rely on: the proxy (hydra_pmi_proxy) and every
rank call setsid(), so none of them is in mpiexec's process group; killing that
group orphans them. Their pids are found through /proc instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import struct
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


_PF_EXITING = 0x4  # /proc/<pid>/stat's flags: the kernel is tearing the process down (set first thing in do_exit)


def pid_ending(pid: int) -> bool:
    """Whether ``pid`` is gone, a zombie, or on its way out (killed, or exiting, but not yet a zombie)."""
    fields = _stat_fields(pid)
    if fields is None:
        return os.path.isdir("/proc")
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


# struct pidfd_info (linux/pidfd.h): mask u64, cgroupid u64, 11 u32 ids, exit_code s32 at byte 60; 64 bytes
_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, struct pidfd_info)
_PIDFD_INFO_EXIT = 0x8


def exit_status(pidfd: int, pid: int) -> int | None:
    """How the process behind ``pidfd`` ended, as ``Popen.returncode`` says it (-N: killed by signal N), for a
    process this one is not the parent of; None while unknown.

    Linux 6.15+ keeps the status with the pidfd once the parent has reaped the process; before that, or on
    an older kernel, /proc shows it while the process is a zombie.
    """
    info = bytearray(64)
    struct.pack_into("=Q", info, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
        if struct.unpack_from("=Q", info, 0)[0] & _PIDFD_INFO_EXIT:
            return os.waitstatus_to_exitcode(struct.unpack_from("=i", info, 60)[0])
    except (OSError, ValueError):
        pass  # no PIDFD_GET_INFO here (older kernel)
    fields = _stat_fields(pid)
    if fields is not None and fields[0] == b"Z" and len(fields) > 49:  # field 52, exit_code (Linux 3.5+)
        return os.waitstatus_to_exitcode(int(fields[49]))
    return None


def describe_end(code: int) -> str:
    """A process's end (a returncode: -N for signal N) in words: "exit code 3", "killed by SIGKILL, signal 9"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}, signal {-code}"
    except ValueError:
        return f"killed by signal {-code}"


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


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen preexec_fn making Linux send the child ``signum`` when we die (SIGTERM: hydra then cleans up)."""
    # Covers deaths that skip any cleanup code: SIGKILL, os._exit. Linux sends the
    # signal when the *thread* that forked exits, so that thread must outlive the job.
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # not needed by the ranks, which import commlib.testing too

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signum)  # 1 == PR_SET_PDEATHSIG
