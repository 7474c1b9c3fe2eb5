"""Fault-tolerant training under ``torchrun --max-restarts`` on commlib: snapshot every epoch, resume from it.

The pattern of pytorch/examples' ``multigpu_torchrun.py``: rank 0 saves the model, the optimizer and the number
of epochs run after every epoch; a (re)started job loads the snapshot before it wraps the model in DDP and goes
on from there. ``--kill-after-epoch N`` makes rank 1 SIGKILL itself once, right after epoch N's snapshot is on
disk (a marker file next to the snapshot remembers it): torchrun stops the other worker, starts both again, and
they finish from the snapshot with the weights an uninterrupted run has.

    torchrun --standalone --nproc_per_node 2 --max-restarts 2 examples/frameworks/torchrun_restarts.py \\
        --snapshot /tmp/snapshot.pt --kill-after-epoch 1

Rank 0 prints ``RESULT {json}``: the restart count, the epoch it resumed from, a checksum of the final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def load(snapshot: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the model and the optimizer from ``snapshot`` if it exists; the number of epochs it holds."""
    if not snapshot.exists():
        return 0
    state = torch.load(snapshot, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epochs_run"])


def save(snapshot: Path, model: nn.Module, optimizer: torch.optim.Optimizer, epochs_run: int) -> None:
    """Write the snapshot whole or not at all (a worker killed mid-write leaves the previous one)."""
    partial = snapshot.with_suffix(".partial")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": epochs_run}, partial)
    os.replace(partial, snapshot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="commlib", help="torch.distributed backend: commlib or gloo")
    parser.add_argument("--snapshot", type=Path, required=True, help="the snapshot file (shared by the workers)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-after-epoch", type=int, default=-1, help="rank 1 SIGKILLs itself once after it")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(backend=args.backend)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank = dist.get_rank()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    resumed_from = load(args.snapshot, model, optimizer)
    ddp = DistributedDataParallel(model)

    seconds = []
    for epoch in range(resumed_from, args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(xb), yb).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            save(args.snapshot, model, optimizer, epoch + 1)
        dist.barrier()  # the snapshot is on disk before anyone goes on (or dies)
        marker = args.snapshot.with_suffix(".killed")
        if epoch == args.kill_after_epoch and rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rank == 0:
        print("RESULT " + json.dumps({
            "backend": dist.get_backend(),
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "resumed_from_epoch": resumed_from,
            "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16],
            "step_ms": 1000 * statistics.median(seconds[2:]),
        }), flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
