"""A small MLP classifier trained data-parallel, each rank reading its shard through DistributedSampler.

    python -m commlib.launch --nproc_per_node 2 examples/ddp_mlp.py
    python -m commlib.launch --nproc_per_node 2 examples/ddp_mlp.py --epochs 10 --sync-bn

The data is synthetic (points in 8 dimensions, labelled by which of 4 random centres they are
nearest to), the same on every rank; DistributedSampler gives each rank a different part of it
every epoch. Gradients are averaged by ddp.DistributedDataParallel; the loss and accuracy printed
are over all ranks' samples (summed with commlib.all_reduce).
"""

from __future__ import annotations

import argparse

import torch

import commlib
import ddp


def make_data(n: int = 2048, dims: int = 8, classes: int = 4) -> torch.utils.data.TensorDataset:
    """The same points on every rank (fixed seed), labelled by their nearest centre."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, dims, generator=g) * 2
    x = torch.randn(n, dims, generator=g) * 1.5
    labels = torch.cdist(x, centres).argmin(dim=1)
    return torch.utils.data.TensorDataset(x, labels)


def make_model(dims: int = 8, classes: int = 4, sync_bn: bool = False) -> torch.nn.Module:
    """An MLP with one BatchNorm layer (a SyncBatchNorm with ``sync_bn``)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(dims, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, classes),
    )
    return ddp.SyncBatchNorm.convert_sync_batchnorm(model) if sync_bn else model


def run_epoch(model: torch.nn.Module, loader, optimizer) -> tuple[float, float]:
    """Train one epoch; return (mean loss, accuracy) over every rank's samples."""
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y in loader:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
    commlib.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def main() -> None:
    """Parse the flags, then train on this rank's shard of the data."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--sync-bn", action="store_true", help="batch statistics over all ranks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(commlib.get_rank())  # different on purpose: DDP starts every rank from rank 0's
    dataset = make_data()
    sampler = ddp.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = ddp.DistributedDataParallel(make_model(sync_bn=args.sync_bn))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss, accuracy = run_epoch(model, loader, optimizer)
        if commlib.get_rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f}, accuracy {accuracy:.3f}")
    checksum = sum(float(p.detach().sum()) for p in model.parameters())
    print(f"rank {commlib.get_rank()}: {len(sampler)} samples per epoch, parameter checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
