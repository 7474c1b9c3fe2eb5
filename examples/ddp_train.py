"""Data-parallel linear regression: each rank fits y = x @ w on its own two samples.

    python -m commlib.launch --nproc_per_node 2 examples/ddp_train.py

Wrapping the model in ``ddp.DistributedDataParallel`` averages the gradients over the ranks
after every backward, so every rank takes the same step and w converges to [[2], [3]] on both
(the data: y = 2 * x0 + 3 * x1). Apart from that wrap and picking the rank's batch, this is a
single-process training script.
"""

from __future__ import annotations

import torch

import commlib
import ddp

# One batch per rank, both drawn from y = 2 * x0 + 3 * x1.
train_x = [
    torch.tensor([[1.0, 2.0], [2.0, 3.0]]),
    torch.tensor([[4.0, 6.0], [3.0, 1.0]]),
]
train_y = [
    torch.tensor([[8.0], [13.0]]),
    torch.tensor([[26.0], [9.0]]),
]


class Model(torch.nn.Module):
    """x @ w, starting from w = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.01
        self.iter_count = 500
        self.w = torch.nn.Parameter(torch.zeros(2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def main() -> None:
    torch.set_num_threads(1)
    rank = commlib.get_rank()
    m = ddp.DistributedDataParallel(Model())
    loss_fn = torch.nn.MSELoss(reduction="sum")
    optimizer = torch.optim.SGD(m.parameters(), m.module.lr)
    x, y = train_x[rank % len(train_x)], train_y[rank % len(train_y)]
    for i in range(m.module.iter_count):
        loss = loss_fn(m(x), y)
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{m.module.iter_count} loss:{loss.item():.6g}")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"\nw:{m.module.w.detach()}")


if __name__ == "__main__":
    main()
