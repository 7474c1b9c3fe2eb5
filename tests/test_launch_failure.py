"""``commlib.launch --on-failure``: abort names the rank that died first, even when the launcher wakes after every
rank is gone; continue keeps the others running and exits 0 once they finish; replace starts a process that
takes the rank over (COMMLIB_JOIN=1, COMMLIB_REPLACES=<rank>, its output prefixed with the rank), at most
--max_replacements times; Ctrl-C, SIGTERM or the launcher's death leave no worker behind. Real launchers and
real processes; the workers are plain Python loops unless the test is about commlib's own rendezvous."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import ROOT, clean_env
from ports import free_port

# Each worker notes its pid (``<tag>.pid``, tag rank<r> or rank<r>.replaces<r>) once it runs, then waits for the
# file ``done`` (or, with a second argument, exits with that code at once); a third argument starts a child
# that would outlive it (the process-table checks then look for it too).
WORKER = """
import os, subprocess, sys, time
folder = sys.argv[1]
rank, join = os.environ.get("RANK"), os.environ.get("COMMLIB_JOIN", "-")
replaces = os.environ.get("COMMLIB_REPLACES", "")
tag = f"rank{rank}" + (f".replaces{replaces}" if replaces else "") if rank else "spare" + os.environ["COMMLIB_SPARE"]
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


def _launch(tmp_path: Path, n: int, flags: list[str], *args: str) -> _Launcher:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", str(n), "--master_port", str(free_port())]
    return _Launcher([*cmd, *flags, str(script), str(tmp_path), *args])


def _pid(tmp_path: Path, tag: str, launcher: _Launcher, timeout: float = 30) -> int:
    """The pid worker ``tag`` noted once it ran."""
    path, end = tmp_path / f"{tag}.pid", time.monotonic() + timeout
    while not path.exists():
        assert launcher.proc.poll() is None, "".join(launcher.err)
        assert time.monotonic() < end, f"{tag} did not start within {timeout} s"
        time.sleep(0.02)
    return int(path.read_text())


def _watching(launcher: _Launcher, n: int, timeout: float = 30) -> None:
    """Wait until the launcher holds ``n`` pidfds: it watches every worker's end (commlib.launch._supervise opens
    them as the workers note their pids; a launcher frozen before that finds the late ones dead by polling, after
    the others, and the order of the deaths is lost)."""
    end = time.monotonic() + timeout
    while True:
        held = 0
        with contextlib.suppress(OSError):  # the launcher's descriptors come and go while they are read
            for fd in os.listdir(f"/proc/{launcher.proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    held += os.readlink(f"/proc/{launcher.proc.pid}/fd/{fd}") == "anon_inode:[pidfd]"
        if held >= n:
            return
        assert launcher.proc.poll() is None, "".join(launcher.err)
        assert time.monotonic() < end, f"the launcher watched {held} of {n} workers after {timeout} s"
        time.sleep(0.01)


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
    _watching(launcher, 4)  # frozen before it watches them all, the launcher could not know the order of the ends
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


def test_continue_keeps_the_others_running(tmp_path: Path) -> None:
    """Rank 2 of 4 is SIGKILLed: the launcher says so in one line, the other three run on, finish, and the job
    exits 0; every line of theirs came through with its rank's prefix."""
    launcher = _launch(tmp_path, 4, ["--on-failure", "continue"])
    pids = [_pid(tmp_path, f"rank{r}", launcher) for r in range(4)]
    os.kill(pids[2], signal.SIGKILL)
    line = launcher.line("rank 2 failed")
    assert line.strip() == (
        "commlib.launch: rank 2 failed (killed by SIGKILL, signal 9); log: output above; "
        "the job continues with 3 of 4 workers"
    )
    _wait_ended(pids[2:3])
    assert not any(_ended(p) for p in pids[:2] + pids[3:])  # the others still run
    (tmp_path / "done").touch()
    out, err = launcher.finish()
    assert launcher.proc.returncode == 0, err
    assert sorted(out.splitlines()) == sorted(
        [f"[{r}] started rank{r} join=- replaces=- omp=1" for r in range(4)]
        + [f"[{r}] finished rank{r}" for r in (0, 1, 3)]
    ), out
    assert err.strip().splitlines()[-1] == "commlib.launch: the job completed despite the failure of rank 2", err


def test_continue_exits_non_zero_when_every_worker_fails(tmp_path: Path) -> None:
    """Every worker exits 3 at once: the job's exit code is the first failure's."""
    launcher = _launch(tmp_path, 2, ["--on-failure", "continue"], "3")
    _, err = launcher.finish()
    assert launcher.proc.returncode == 3, err
    assert "; the job continues with 1 of 2 workers" in err and "; no worker is left" in err, err
    assert "commlib.launch: every worker failed; the job exits 3, as the first failure did (rank " in err, err


LATE_FAILURE = """
import os, sys, time
folder, rank = sys.argv[1], os.environ["RANK"]
if rank == "0":
    open(f"{folder}/rank0.tmp", "w").write(str(os.getpid()))
    os.rename(f"{folder}/rank0.tmp", f"{folder}/rank0.pid")  # whole: never read empty
    sys.exit(0)
while not os.path.exists(f"{folder}/rank0.pid"):
    time.sleep(0.01)
pid = open(f"{folder}/rank0.pid").read()


def running() -> bool:  # rank 0 neither reaped nor a zombie (it can be reaped between two reads of /proc)
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


while running():
    time.sleep(0.01)
sys.exit(3)
"""


def test_continue_fails_when_a_worker_fails_after_another_finished(tmp_path: Path) -> None:
    """Rank 0 finishes, then rank 1 exits 3: the job was ending, so its failure is the job's (exit 3)."""
    script = tmp_path / "late.py"
    script.write_text(LATE_FAILURE)
    cmd = [sys.executable, "-m", "commlib.launch", "--on-failure", "continue", "--nproc_per_node", "2"]
    launcher = _Launcher([*cmd, "--master_port", str(free_port()), str(script), str(tmp_path)])
    _, err = launcher.finish()
    assert launcher.proc.returncode == 3, err
    said = "rank 1 failed (exit code 3: sys.exit(3)); log: output above; no worker is left: the job exits 3"
    assert err.strip().splitlines()[-1] == f"commlib.launch: {said}", err


def test_replace_starts_a_process_that_takes_the_rank_over(tmp_path: Path) -> None:
    """Rank 2 is SIGKILLed: its replacement gets COMMLIB_JOIN=1 and COMMLIB_REPLACES=2 and speaks as [2]; killed
    too, it is not replaced again (--max_replacements 1), and the job still completes."""
    marker = f"outlives-{tmp_path.name}"
    launcher = _launch(tmp_path, 4, ["--on-failure", "replace", "--max_replacements", "1"], "-", marker)
    pids = [_pid(tmp_path, f"rank{r}", launcher) for r in range(4)]
    os.kill(pids[2], signal.SIGKILL)
    started = launcher.line("rank 2 failed")
    assert started.strip().endswith("; starting replacement 1 of 1 for rank 2"), started
    replacement = _pid(tmp_path, "rank2.replaces2", launcher)
    os.kill(replacement, signal.SIGKILL)
    line = launcher.line("rank 2 (replacement 1) failed")
    assert line.strip() == (
        "commlib.launch: rank 2 (replacement 1) failed (killed by SIGKILL, signal 9); log: output above; "
        "not replaced: rank 2 was replaced 1 time already (--max_replacements 1); the job continues with 3 of 4 workers"
    )
    (tmp_path / "done").touch()
    out, err = launcher.finish()
    assert launcher.proc.returncode == 0, err
    assert "[2] started rank2.replaces2 join=1 replaces=2 omp=1" in out.splitlines(), out
    assert _left_behind(marker) == []  # what the dead workers started died with them


def test_a_failure_under_replace_is_covered_by_a_waiting_spare(tmp_path: Path) -> None:
    """--spares 1: a spare starts with the job (COMMLIB_JOIN=1, COMMLIB_SPARE=0, no RANK), speaks as [spare 0];
    rank 1's death is covered by it (no new process); a second death, with no spare left, starts a replacement."""
    launcher = _launch(tmp_path, 3, ["--on-failure", "replace", "--spares", "1"])
    pids = [_pid(tmp_path, f"rank{r}", launcher) for r in range(3)]
    _pid(tmp_path, "spare0", launcher)
    os.kill(pids[1], signal.SIGKILL)
    line = launcher.line("rank 1 failed")
    assert line.strip().endswith("; a spare takes its place when the job grows (1 spare(s) running)"), line
    os.kill(pids[2], signal.SIGKILL)
    line = launcher.line("rank 2 failed")
    assert line.strip().endswith("; starting replacement 1 of 3 for rank 2"), line
    _pid(tmp_path, "rank2.replaces2", launcher)
    (tmp_path / "done").touch()
    out, err = launcher.finish()
    assert launcher.proc.returncode == 0, err
    assert "[spare 0] started spare0 join=1 replaces=- omp=1" in out.splitlines(), out
    assert "replaces1" not in out, out


def test_replace_writes_a_replacement_s_output_to_a_file_of_its_own(tmp_path: Path) -> None:
    logdir = tmp_path / "logs"
    flags = ["--on-failure", "replace", "--redirect_stdout_and_stderr", "--logdir", str(logdir)]
    launcher = _launch(tmp_path, 2, flags)
    pids = [_pid(tmp_path, f"rank{r}", launcher) for r in range(2)]
    os.kill(pids[1], signal.SIGKILL)
    line = launcher.line("rank 1 failed")
    assert f"; log: {logdir / 'rank1.stderr'}; starting replacement 1 of 3 for rank 1" in line, line
    _pid(tmp_path, "rank1.replaces1", launcher)
    (tmp_path / "done").touch()
    _, err = launcher.finish()
    assert launcher.proc.returncode == 0, err
    assert (logdir / "rank1.replacement1.stdout").read_text().splitlines() == [
        "started rank1.replaces1 join=1 replaces=1 omp=1",
        "finished rank1.replaces1",
    ]
    assert (logdir / "rank0.stdout").read_text().splitlines()[-1] == "finished rank0"


@pytest.mark.parametrize(
    ("mode", "how"), [("continue", "SIGINT"), ("continue", "SIGTERM"), ("continue", "SIGKILL"), ("abort", "SIGKILL")]
)
def test_stopping_the_launcher_stops_every_worker(mode: str, how: str, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) or SIGTERM to the launcher in continue mode: every worker and what it started is stopped,
    exit code 128 + N. SIGKILL: the workers die with it (PR_SET_PDEATHSIG; under mpiexec, hydra stops them)."""
    marker = f"outlives-{tmp_path.name}"
    launcher = _launch(tmp_path, 3, ["--on-failure", mode], "-", *([marker] if how != "SIGKILL" else []))
    pids = [_pid(tmp_path, f"rank{r}", launcher) for r in range(3)]
    launcher.proc.send_signal(getattr(signal, how))
    _, err = launcher.finish(timeout=30)
    assert launcher.proc.returncode == (-9 if how == "SIGKILL" else 128 + getattr(signal, how)), err
    if how != "SIGKILL":
        assert f"commlib.launch: {how}: stopping every worker" in err, err
    _wait_ended(pids, timeout=10)
    assert _left_behind(str(tmp_path / "worker.py")) == []
    assert _left_behind(marker) == []


def test_flags_are_checked_and_explained() -> None:
    def launch(*flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "commlib.launch", *flags]
        return subprocess.run(cmd, cwd=ROOT, env=clean_env(), text=True, capture_output=True, timeout=60)

    shown = " ".join(launch("--help").stdout.split())
    for text in (
        "--on-failure MODE, --on_failure MODE what a worker's failure does, one of abort, continue, replace",
        "COMMLIB_REPLACES=<rank>",
        "(default: abort)",
        "(default: 3)",
    ):
        assert text in shown, (text, shown)
    wrong = launch("--max_replacements", "2", "--on-failure", "continue", "x.py")
    assert wrong.returncode == 2
    assert "error: --max_replacements counts the replacements of --on-failure replace, not continue" in wrong.stderr
    wrong = launch("--spares", "1", "x.py")
    assert wrong.returncode == 2
    assert "error: --spares waits for a failure the job survives: use --on-failure continue or replace" in wrong.stderr


COLLECTIVES = """
import numpy as np, commlib as dist
dist.init_process_group()
n, me = dist.get_world_size(), dist.get_rank()
x = np.full(3, me + 1.0)
for _ in range(3):
    dist.all_reduce(x)
print(f"rank {me} of {n}: {x.tolist()}", flush=True)
dist.destroy_process_group()
"""


def _nodes(script: Path, mode: str, nodes: int, per_node: int, port: int, timeout: float) -> list[tuple[str, str]]:
    """Run ``script`` on ``nodes`` launchers on this host (one job, --on-failure ``mode``); each launcher's
    stdout and stderr, once every one exited 0."""
    launchers = [
        _Launcher(
            [sys.executable, "-m", "commlib.launch", "--on-failure", mode, "--nnodes", str(nodes), "--node_rank",
             str(node), "--nproc_per_node", str(per_node), "--master_port", str(port), str(script)],
            COMMLIB_STORE_TOKEN="shared",
        )
        for node in range(nodes)
    ]  # fmt: skip
    outs = [launcher.finish(timeout=timeout) for launcher in launchers]
    for launcher, (_, err) in zip(launchers, outs, strict=True):
        assert launcher.proc.returncode == 0, err[-3000:]
    return outs


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 2), (1, 4), (2, 2)])
def test_commlib_workers_meet_through_the_launcher_s_store(nodes: int, per_node: int, tmp_path: Path) -> None:
    """Plain workers running commlib's collectives: each is its own MPI world until commlib joins them through
    the store the launcher (of node 0) serves; with two launchers on one host, each supervises its own."""
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    n = nodes * per_node
    outs = _nodes(script, "continue", nodes, per_node, free_port(), timeout=120)
    total = float(sum(range(1, n + 1)) * n**2)  # three all_reduces of rank + 1
    lines = sorted(line for out, _ in outs for line in out.splitlines())
    assert lines == sorted(f"[{r}] rank {r} of {n}: {[total] * 3}" for r in range(n)), outs
    assert _left_behind(str(script)) == []


TORCH_COLLECTIVES = """
import os
import torch, torch.distributed as tdist
tdist.init_process_group(backend="commlib")
n, me = tdist.get_world_size(), tdist.get_rank()
x = torch.full((3,), me + 1.0)
for _ in range(3):
    tdist.all_reduce(x)
print(f"rank {me} of {n}: {x.tolist()} MASTER_PORT {os.environ['MASTER_PORT']}", flush=True)
tdist.destroy_process_group()
"""


@pytest.mark.parametrize(("mode", "nodes"), [("continue", 1), ("continue", 2), ("abort", 2)])
def test_torch_s_init_beside_the_launcher_s_store(mode: str, nodes: int, tmp_path: Path) -> None:
    """torch's init_process_group(backend="commlib") serves torch's own store from rank 0 at MASTER_PORT: where
    the launcher serves the job's store (plain workers, several nodes), the workers' MASTER_PORT is another port
    (before: rank 0 failed with EADDRINUSE on the launcher's port)."""
    pytest.importorskip("torch")
    script = tmp_path / "torch_collectives.py"
    script.write_text(TORCH_COLLECTIVES)
    port, per_node = free_port(), 2
    n = nodes * per_node
    outs = _nodes(script, mode, nodes, per_node, port, timeout=180)
    total = float(sum(range(1, n + 1)) * n**2)
    lines = [line for out, _ in outs for line in out.splitlines() if " MASTER_PORT " in line]
    said = sorted(line.split("] ", 1)[1].split(" MASTER_PORT ")[0] for line in lines)  # hydra's prefix: local
    assert said == sorted(f"rank {r} of {n}: {[total] * 3}" for r in range(n)), outs
    ports = {int(line.split(" MASTER_PORT ")[1]) for line in lines}
    assert len(ports) == 1 and port not in ports, ports  # one port for every node, not the launcher's
