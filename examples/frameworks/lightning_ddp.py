"""PyTorch Lightning on commlib: the one switch is ``DDPStrategy(process_group_backend="commlib")``.

A tiny classifier on 2 CPU processes, with a validation loop that logs with ``sync_dist=True`` (Lightning then
averages each logged value with ``ReduceOp.AVG`` on every backend but gloo, and the int64 batch count behind
each mean too).

    python examples/frameworks/lightning_ddp.py --backend commlib            # Lightning's own launcher
    torchrun --standalone --nproc_per_node 2 examples/frameworks/lightning_ddp.py --backend commlib
    python examples/frameworks/lightning_ddp.py --backend gloo commlib       # both, in turn, in one job

Rank 0 prints ``RESULT {json}`` (one per backend): a checksum of the final weights (equal to gloo's, bit for
bit, on 2 ranks), the synced validation metrics and the median training step time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def data(n: int, seed: int) -> TensorDataset:
    """Points in 16-d labelled by which of 4 fixed directions they lean to most."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    directions = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ directions).argmax(dim=1))


class Classifier(pl.LightningModule):
    """A 16-32-4 MLP; validation logs its loss and correct answers per batch, averaged across ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch: tuple, _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple, _: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_correct", (logits.argmax(dim=1) == y).sum().float(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class StepTimer(pl.Callback):
    """Wall time of each training step (forward, backward, the gradient all-reduce, the optimizer)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *_: object) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_: object) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def fit(backend: str, epochs: int) -> None:
    """Train on ``backend``'s process group; rank 0 prints ``RESULT {json}``."""
    torch.manual_seed(0)
    model, timer = Classifier(), StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend=backend),
        max_epochs=epochs,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    train = DataLoader(data(256, 1), batch_size=16)  # Lightning adds a DistributedSampler: 8 steps per epoch
    trainer.fit(model, train, DataLoader(data(64, 2), batch_size=16))
    if trainer.global_rank == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        print("RESULT " + json.dumps({
            "backend": torch.distributed.get_backend(),
            "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16],
            "val_loss": trainer.callback_metrics["val_loss"].item(),
            "val_correct": trainer.callback_metrics["val_correct"].item(),
            "steps": len(timer.seconds),
            "step_ms": 1000 * statistics.median(timer.seconds[2:]),
        }), flush=True)  # fmt: skip
    torch.distributed.destroy_process_group()  # Lightning leaves the group to the script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", nargs="+", default=["commlib"], help="torch.distributed backends, in turn")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for backend in args.backend:  # the same processes train again, from the same seed, on the next backend
        fit(backend, args.epochs)


if __name__ == "__main__":
    main()
