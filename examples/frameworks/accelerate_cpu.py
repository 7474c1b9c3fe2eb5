"""Hugging Face Accelerate on commlib: create the process group before the ``Accelerator``.

Accelerate 1.15 picks its own CPU backend ("gloo", or "mpi" when torch was built with MPI) and refuses any
other name (``InitProcessGroupKwargs(backend="commlib")`` raises "Your assigned backend commlib is not
available, please use gloo"). It creates a group only when none exists, so a group made first is the one it
uses: its DDP wrapper, ``gather``, ``reduce`` and ``wait_for_everyone`` all run on commlib. It still names
the backend "gloo" (it decides the name before it looks at the group); the two assignments after the
``Accelerator`` make it report the truth. Accelerate reads that name only to print its state and, in
``gather``, to use ``all_gather_into_tensor`` (which commlib has) instead of a list ``all_gather``.

    torchrun --standalone --nproc_per_node 2 examples/frameworks/accelerate_cpu.py            # on commlib
    torchrun --standalone --nproc_per_node 2 examples/frameworks/accelerate_cpu.py --backend gloo

Rank 0 prints ``RESULT {json}``: what Accelerate reports, a checksum of the final weights (gloo's, bit for bit,
on 2 ranks), the accuracy gathered from every rank and the median training step time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_accelerator(backend: str) -> Accelerator:
    """An Accelerator on ``backend``'s process group ("gloo": the one Accelerate makes itself)."""
    if backend != "gloo":
        dist.init_process_group(backend=backend)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    accelerator = Accelerator(cpu=True)
    if backend != "gloo":
        PartialState().backend = accelerator.state.backend = dist.get_backend()  # what Accelerate reports
    return accelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="commlib", help="commlib (made before the Accelerator) or gloo")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    accelerator = make_accelerator(args.backend)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(320, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    train = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16, shuffle=True)
    test = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=16)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)

    seconds = []
    for _ in range(args.epochs):
        model.train()
        for xb, yb in train:
            start = time.perf_counter()
            optimizer.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(xb), yb))
            optimizer.step()
            seconds.append(time.perf_counter() - start)
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for xb, yb in test:
            predicted, labels = accelerator.gather_for_metrics((model(xb).argmax(dim=1), yb))
            correct += int((predicted == labels).sum())
            total += len(labels)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({
            "accelerate_backend": accelerator.state.backend,
            "torch_backend": dist.get_backend(),
            "distributed_type": str(accelerator.distributed_type),
            "processes": accelerator.num_processes,
            "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16],
            "accuracy": f"{correct}/{total}",
            "step_ms": 1000 * statistics.median(seconds[2:]),
        }), flush=True)  # fmt: skip
    accelerator.end_training()


if __name__ == "__main__":
    main()
