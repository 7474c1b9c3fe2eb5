"""The ddp examples, run as a user runs them: through the launcher on 2 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _launch(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "commlib.launch", "--nproc_per_node", "2", f"examples/{script}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT, env=dict(os.environ))


@pytest.mark.timeout(120)
def test_ddp_train_converges_to_2_3_on_both_ranks() -> None:
    proc = _launch("ddp_train.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        lines = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(f"[{rank}] ")]
        assert sum(line.startswith(f"{i}/500 loss:") for line in lines for i in range(50, 501, 50)) == 10
        text = "\n".join(lines)
        match = re.search(r"w:tensor\(\[\[([-\d.e+]+)\],\s*\[([-\d.e+]+)\]\]\)", text)
        assert match, text
        w = [float(v) for v in match.groups()]
        assert abs(w[0] - 2.0) < 1e-3 and abs(w[1] - 3.0) < 1e-3, w


@pytest.mark.timeout(120)
def test_ddp_mlp_learns_and_ranks_agree() -> None:
    proc = _launch("ddp_mlp.py", "--epochs", "3", "--sync-bn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = [float(a) for a in re.findall(r"\[0\] epoch \d/3: loss [\d.]+, accuracy ([\d.]+)", proc.stdout)]
    assert len(accuracy) == 3 and accuracy[-1] > 0.7, proc.stdout
    checksums = re.findall(r"rank (\d): 1024 samples per epoch, parameter checksum (\S+)", proc.stdout)
    assert sorted(r for r, _ in checksums) == ["0", "1"] and len({c for _, c in checksums}) == 1, proc.stdout
