"""An exception on one rank after ``init_process_group(backend="commlib")`` prints its type, message and traceback
once, and the job ends non-zero within seconds, under torchrun, Lightning's launcher and commlib.launch, as under
gloo.

torch's ``init_process_group`` wraps the excepthook it finds (commlib's, which aborts the MPI job) in one that
buffers stderr and writes the buffer, each line prefixed with ``[rank1]:``, after the hook it wraps returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs import clean_env, run_job

pytest.importorskip("torch")

SCRIPT = """
import sys
import torch.distributed as dist

dist.init_process_group(backend=sys.argv[1])


def fail_here():
    raise ValueError(f"boom on rank {dist.get_rank()}")


if dist.get_rank() == 1:
    fail_here()
dist.barrier()
dist.destroy_process_group()
"""
DEADLINE = 90.0  # the whole job, startup included; a lost abort would leave rank 0 in barrier for its timeout


def _script(tmp_path: Path) -> str:
    path = tmp_path / "fail_on_rank_1.py"
    path.write_text(SCRIPT)
    return str(path)


def _told_once(stderr: str) -> None:
    """Rank 1's traceback reached stderr once: the header, the failing line, the type and message."""
    lines = [line.split("] ", 1)[-1] if line.startswith("[1] ") else line for line in stderr.splitlines()]
    assert lines.count("[rank1]: Traceback (most recent call last):") == 1, stderr[-4000:]
    assert lines.count("[rank1]: ValueError: boom on rank 1") == 1, stderr[-4000:]
    assert any(line.startswith("[rank1]:   File ") and line.endswith("in fail_here") for line in lines), stderr


@pytest.mark.parametrize("backend", ["commlib", "gloo"])
def test_torchrun_prints_the_failing_rank_s_traceback_once(backend: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", _script(tmp_path)]
    job = run_job([*cmd, backend], DEADLINE, clean_env(COMMLIB_TIMEOUT="60"))
    assert job.returncode != 0, job.tail()
    _told_once(job.stderr)
    if backend == "commlib":
        assert "[rank1]: commlib: uncaught ValueError on rank 1: aborting the job" in job.stderr, job.tail()


def test_commlib_launch_prints_the_traceback_and_names_the_rank(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", "2", _script(tmp_path), "commlib"]
    job = run_job(cmd, DEADLINE, clean_env(COMMLIB_TIMEOUT="60"))
    assert job.returncode != 0, job.tail()
    _told_once(job.stdout + job.stderr)
    assert "commlib.launch: rank 1 failed (exit code 1: ValueError: boom on rank 1)" in job.stderr, job.tail()
    # Rank 1's last flight record is its exception: no closing check ran after MPI_Abort (which returns under hydra).
    assert "  rank 1: no collective recorded (uncaught ValueError: boom on rank 1)" in job.stderr, job.tail()


ABORT_RETURNS = """
import atexit, fcntl, struct, sys, termios
from commlib._diagnostics import abort as commlib_abort

atexit.register(lambda: print("the exit handlers ran", flush=True))
print("x" * 20000, flush=True)  # more than the reader has read when the exception is raised


def abort():  # as MPICH's MPI_Abort under hydra: it returns (hydra kills the job a moment later)
    unread = struct.unpack("i", fcntl.ioctl(1, termios.FIONREAD, b"\\0" * 4))[0]
    sys.stderr.write(f"abort called, {unread} bytes of stdout unread\\n")
    sys.stderr.flush()


commlib_abort.install_excepthook(abort, 0, 1)
raise ValueError("boom")
"""


def test_the_job_ends_at_the_abort_once_its_output_was_read(tmp_path: Path) -> None:
    """The rank that raised aborts once its launcher has read its output (hydra drops what is still in the pipe
    when it handles an abort), and runs no Python after the abort, which may return."""
    import subprocess
    import time

    script = tmp_path / "abort_returns.py"
    script.write_text(ABORT_RETURNS)
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(0.5)  # a slow reader: the rank must wait for it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (out, err)
    assert "abort called, 0 bytes of stdout unread" in err, err
    assert err.count("ValueError: boom") == 1, err
    assert "the exit handlers ran" not in out, out


LIGHTNING_SCRIPT = """
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


def fail_here():
    raise ValueError("boom on rank 1")


class FailsOnRank1(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        if self.global_rank == 1 and i == 1:
            fail_here()
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=sys.argv[1]), max_epochs=1,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(FailsOnRank1(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
"""


def test_lightning_s_launcher_prints_the_traceback(tmp_path: Path) -> None:
    """Lightning starts rank 1 as a child of rank 0 (its own launcher); torch's hook wraps commlib's there too."""
    pytest.importorskip("pytorch_lightning")
    script = tmp_path / "lightning_fails_on_rank_1.py"
    script.write_text(LIGHTNING_SCRIPT)
    job = run_job([sys.executable, str(script), "commlib"], DEADLINE, clean_env(COMMLIB_TIMEOUT="60"), cwd=tmp_path)
    assert job.returncode != 0, job.tail()
    _told_once(job.stderr)
