"""``commlib.launch --on-failure abort`` (the default) names the rank that died first, even when the launcher wakes
after every rank is gone. Real launchers and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import ROOT, clean_env

# Each worker notes its pid (``<tag>.pid``, tag rank<r> or rank<r>.replaces<r>) once it runs, then waits for the
# file ``done`` (or, with a second argument, exits with that code at once); a third argument starts a child
# that would outlive it (the process-table checks then look for it too).
WORKER = """
import os, subprocess, sys, time
folder = sys.argv[1]
rank, join, replaces = os.environ["RANK"], os.environ.get("COMMLIB_JOIN", "-"), os.environ.get("COMMLIB_REPLACES", "")
tag = f"rank{rank}" + (f".replaces{replaces}" if replaces else "")
print(f"started {tag} join={join} replaces={replaces or '-'} omp={os.environ['OMP_NUM_THREADS']}", flush=True)
if len(sys.argv) > 2 and sys.argv[2] != "-":
    sys.exit(int(sys.argv[2]))
if len(sys.argv) > 3:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[3]])
with open(f"{folder}/{tag}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(f"{folder}/{tag}.tmp", f"{folder}/{tag}.pid")
while not os.path.exists(f"{folder}/done"):
    time.sleep(0.02)
print(f"finished {tag}", flush=True)
"""


class _Launcher:
    """A launcher run by the test: its output read as it comes (lines), its end awaited with a deadline."""

    def __init__(self, cmd: list[str], **env: str) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=clean_env(**env), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=lambda s=stream, into=lines: into.extend(s), daemon=True)
            for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    def line(self, text: str, timeout: float = 30) -> str:
        """The first line of its stderr that holds ``text``, waited for."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if found := [line for line in list(self.err) if text in line]:
                return found[0].rstrip("\n")
            assert self.proc.poll() is None, "".join(self.err)
            time.sleep(0.02)
        raise AssertionError(f"no line with {text!r} within {timeout} s:\n{''.join(self.err)}")

    def finish(self, timeout: float = 60) -> tuple[str, str]:
        """Its stdout and stderr once it ended (killed, with its session, past ``timeout``)."""
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for reader in self.readers:
            reader.join(10)
        return "".join(self.out), "".join(self.err)


def _pid(tmp_path: Path, tag: str, launcher: _Launcher, timeout: float = 30) -> int:
    """The pid worker ``tag`` noted once it ran."""
    path, end = tmp_path / f"{tag}.pid", time.monotonic() + timeout
    while not path.exists():
        assert launcher.proc.poll() is None, "".join(launcher.err)
        assert time.monotonic() < end, f"{tag} did not start within {timeout} s"
        time.sleep(0.02)
    return int(path.read_text())


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait_ended(pids: list[int], timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not all(_ended(p) for p in pids):
        assert time.monotonic() < end, [p for p in pids if not _ended(p)]
        time.sleep(0.02)


def _left_behind(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``; killed, so that a failing test leaves none either."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and not _ended(int(entry)):
                found.append(int(entry))
    for pid in found:
        os.kill(pid, signal.SIGKILL)
    return found


@pytest.mark.parametrize("workers", ["plain", "commlib"])
def test_abort_names_the_rank_that_died_first(workers: str, tmp_path: Path) -> None:
    """4 ranks under mpiexec; rank 2 is SIGKILLed while the launcher is frozen (SIGSTOP), and the launcher wakes
    only when hydra has stopped every rank: it still names rank 2 alone, and how it ended."""
    script = tmp_path / "abort.py"
    script.write_text(_COMMLIB_LOOP if workers == "commlib" else WORKER)
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", "4", str(script), str(tmp_path)]
    launcher = _Launcher(cmd, COMMLIB_TIMEOUT="30")
    pids = [_pid(tmp_path, f"rank{r}", launcher) for r in range(4)]
    os.kill(launcher.proc.pid, signal.SIGSTOP)
    try:
        os.kill(pids[2], signal.SIGKILL)
        _wait_ended(pids)  # hydra stops the others (or their MPI does), the launcher sees nothing of it
    finally:
        os.kill(launcher.proc.pid, signal.SIGCONT)
    _, err = launcher.finish()
    said = [line for line in err.splitlines() if line.startswith("commlib.launch:")]
    assert said[0] == (
        "commlib.launch: rank 2 failed (killed by SIGKILL, signal 9, without exiting normally); "
        "log: output above; the job was stopped"
    ), err[-3000:]
    assert launcher.proc.returncode != 0
    assert _left_behind(str(script)) == []


_COMMLIB_LOOP = """
import os, sys, time
import numpy as np, commlib as dist
dist.init_process_group()
x, me, i = np.ones(256, np.float32), dist.get_rank(), 0
while True:
    dist.all_reduce(x)
    i += 1
    if i == 20:
        with open(f"{sys.argv[1]}/rank{me}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{sys.argv[1]}/rank{me}.tmp", f"{sys.argv[1]}/rank{me}.pid")
    time.sleep(0.002)
"""


class _Seen:
    """What ``_first_failure`` reads of the watched ends: the ranks seen ending, in the kernel's order."""

    def __init__(self, *batches: list[int]) -> None:
        self.batches = list(batches)


def _note(status: Path, rank: int, text: str, age: float, after: str = "") -> None:
    if after:
        (status / f"rank{rank}.after").write_text(after)
    (status / f"rank{rank}.exit").write_text(text)
    os.utime(status / f"rank{rank}.exit", ns=(time.time_ns() - int(age * 1e9),) * 2)


@pytest.mark.parametrize(
    ("notes", "seen", "named"),
    [
        # rank 2 killed; rank 1 raised on noticing (its note lists rank 2 as ending then): rank 2, killed
        ([(1, "1 CommError: peer gone", 0.1, "2")], [[2], [1]], (2, 0, "")),
        # rank 1 raised first; the others were stopped without a note afterwards: rank 1
        ([(1, "1 ValueError: boom", 3.0, "")], [[0], [2], [1]], (1, 1, "exit code 1: ValueError: boom")),
        # two notes written while no rank was ending: the earlier
        (
            [(0, "3 sys.exit(3)", 1.0, ""), (1, "1 ValueError: boom", 2.0, "")],
            [],
            (1, 1, "exit code 1: ValueError: boom"),
        ),
        # only a note written after rank 2 began to end, and rank 2's end not seen yet: wait for it ...
        ([(1, "1 CommError: peer gone", 0.1, "2")], [], None),
        # ... but not for ever
        (
            [(1, "1 CommError: peer gone", 5.0, "2")],
            [],
            (1, 1, "exit code 1: CommError: peer gone (after rank 2 began to end)"),
        ),
        # no notes: the first end the kernel reported
        ([], [[3], [0], [1], [2]], (3, 0, "")),
    ],
    ids=[
        "a note on noticing a killed rank names the killed rank",
        "a note before the others were stopped names its rank",
        "the earlier of two notes",
        "a note after another rank began to end waits for that end",
        "but not for ever",
        "no notes: the first end the kernel reported",
    ],
)
def test_the_first_failure_is_decided_from_notes_and_the_kernel_s_order(
    notes: list[tuple[int, str, float, str]], seen: list[list[int]], named: tuple[int, int, str] | None, tmp_path: Path
) -> None:
    from commlib.launch._supervise import Failure, _first_failure

    for rank, text, age, after in notes:
        _note(tmp_path, rank, text, age, after)
    found = _first_failure(tmp_path, range(4), _Seen(*seen))  # type: ignore[arg-type]
    assert found == (None if named is None else Failure(*named))
