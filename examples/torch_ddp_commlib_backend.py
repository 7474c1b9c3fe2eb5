"""torch's own DistributedDataParallel on ``backend="commlib"``: data-parallel linear regression.

    python -m commlib.launch --nproc_per_node 2 examples/torch_ddp_commlib_backend.py

A plain torch.distributed script but for ``backend="commlib"``. With commlib installed by pip,
``import torch`` registers the backend (an entry point); the ``register()`` call below is a no-op
then, and makes the script work from a bare checkout too. The launcher sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, so torch's env:// rendezvous works; torch's collectives and DDP's bucketed gradient
all-reduces then run on commlib's MPI groups. Each rank fits y = x @ w on its own two samples
(drawn from y = 2 * x0 + 3 * x1); DDP averages the gradients, so w converges to [[2], [3]] on
every rank.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commlib import torch_backend

torch_backend.register()  # no-op when commlib is pip-installed: `import torch` registered "commlib"

# One batch per rank, both drawn from y = 2 * x0 + 3 * x1.
TRAIN_X = [torch.tensor([[1.0, 2.0], [2.0, 3.0]]), torch.tensor([[4.0, 6.0], [3.0, 1.0]])]
TRAIN_Y = [torch.tensor([[8.0], [13.0]]), torch.tensor([[26.0], [9.0]])]


def main() -> None:
    """Train for 500 steps and print the loss every 100 steps and the final w."""
    torch.set_num_threads(1)
    dist.init_process_group(backend="commlib", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
    torch.nn.init.zeros_(model.module.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = TRAIN_X[rank % 2], TRAIN_Y[rank % 2]
    for step in range(500):
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients through commlib while backward runs
        optimizer.step()
        if (step + 1) % 100 == 0:
            print(f"step {step + 1} loss {loss.item():.6g}")
    w = model.module.weight.detach().reshape(-1)
    print(f"backend {dist.get_backend()}, {world} ranks: w = [{w[0]:.4f}, {w[1]:.4f}]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
