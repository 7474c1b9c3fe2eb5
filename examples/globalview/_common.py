"""What the training examples share: the device, the model, the single-process run to compare with."""

import torch

import commlib

DEVICE = "cuda" if commlib.is_nccl_available() else "cpu"
SIZES = (8, 16, 16, 4)  # in -> hidden -> hidden -> out
BATCH, STEPS = 8, 5


def mlp():
    """The tutorials' MLP, the same initial weights on every rank (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]),
        torch.nn.ReLU(),
        torch.nn.Linear(SIZES[1], SIZES[2]),
        torch.nn.ReLU(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    ).double()


def data():
    """The whole batch (every rank makes the same one)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SIZES[0], generator=g, dtype=torch.float64), torch.randn(
        BATCH, SIZES[-1], generator=g, dtype=torch.float64
    )


def single_process_losses():
    """The losses of training the same model on the whole batch in one process."""
    model, (x, y) = mlp(), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def report(step, loss, single):
    """One line per step on every rank: the global loss next to the single-process one."""
    print(f"step {step} loss {loss:.12f} single {single[step]:.12f}", flush=True)
