"""Run a whole job (torchrun, a framework's own launcher, commlib.launch) as a test would: a deadline, and on
timeout every process the job started killed (launchers start workers in sessions of their own)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from commlib.launch._mpiexec import process_tree, send_signal

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Finished:
    """How a job ended: its exit status, output and wall time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def tail(self, chars: int = 4000) -> str:
        """The end of both streams, for an assertion message."""
        head = f"exit {self.returncode} after {self.seconds:.1f} s"
        return f"{head}\n--- stdout\n{self.stdout[-chars:]}\n--- stderr\n{self.stderr[-chars:]}"


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without an MPI launcher's variables (the job is started by its own launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_"))}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


def run_job(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Finished:
    """Run ``cmd`` to its end; past ``timeout`` seconds kill it and everything below it, then fail."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} did not finish within {timeout} s (killed)\n{err[-4000:]}") from None
    except BaseException:
        _kill_tree(proc.pid)
        proc.communicate()
        raise
    return Finished(proc.returncode, out, err, time.monotonic() - start)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s session and every process below it (some call setsid: hydra's, MPICH singletons')."""
    below = process_tree(pid)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        send_signal(child, signal.SIGKILL)
