"""Ray Train on commlib: the one switch is ``TorchTrainer(..., torch_config=TorchConfig(backend="commlib"))``.

Ray starts the 2 workers and calls ``init_process_group(backend="commlib")`` in each (through the store it
passes torch); ``ray.train.torch.prepare_model`` wraps the model in torch's DDP, whose gradient all-reduces
then run on commlib.

    python examples/frameworks/ray_train.py                          # commlib
    python examples/frameworks/ray_train.py --backend gloo commlib   # both, one Ray cluster

Prints ``RESULT {json}`` per backend: a checksum of the final weights (gloo's, bit for bit, on 2 workers) and the
median training step time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer


def train_loop(config: dict) -> None:
    """Each worker: 3 epochs of a tiny classifier on its half of the data; rank 0 reports weights and times."""
    import hashlib
    import statistics
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank, size = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seconds = []
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))[rank::size]
        for batch in order.split(16):
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    metrics = {
        "backend": dist.get_backend(),
        "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16],
        "steps": len(seconds),
        "step_ms": 1000 * statistics.median(seconds[2:]),
    }
    with tempfile.TemporaryDirectory() as folder:  # Ray keeps the metrics that come with a checkpoint
        checkpoint = None
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(folder, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", nargs="+", default=["commlib"], help="torch.distributed backends, in turn")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "ray_train_commlib"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers inherit it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    for backend in args.backend:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"epochs": args.epochs},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            torch_config=TorchConfig(backend=backend),
            run_config=RunConfig(name=backend, storage_path=args.storage),
        )
        print("RESULT " + json.dumps(trainer.fit().metrics), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
