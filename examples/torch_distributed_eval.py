"""Distributed evaluation written against torch.distributed's functional API, run by commlib.

The only change from the torch.distributed version is the import line below.
Run it with any launcher:

    torchrun --standalone --nproc_per_node 3 examples/torch_distributed_eval.py
    python examples/torch_distributed_eval.py --spawn 3 tcp://127.0.0.1:29512   # torch.multiprocessing.spawn
    python examples/torch_distributed_eval.py --spawn 3 file:///tmp/eval-rendezvous
    python -m commlib.launch --nproc_per_node 3 examples/torch_distributed_eval.py
    mpiexec -n 3 python examples/torch_distributed_eval.py

(``COMMLIB_NCCL_EMULATOR=1`` runs the same on the nccl backend's CPU emulator.)

Each rank scores its shard of a synthetic data set with a tiny linear model whose
weights rank 0 broadcasts; the metrics are combined with all_reduce, the
predictions with all_gather, and per-rank summaries with gather_object.
"""

import sys

import torch

import commlib as dist  # was: import torch.distributed as dist

SAMPLES, FEATURES = 12, 4


def main(rank: int = -1, world_size: int = -1, init_method: str | None = None) -> None:
    # torch: gloo for CPU tensors; commlib: mpi, or nccl where chosen. A launcher's variables say who is
    # who; under torch.multiprocessing.spawn the arguments do.
    dist.init_process_group(init_method=init_method, rank=rank, world_size=world_size)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(rank)  # every rank starts with different weights ...
    weights = torch.randn(FEATURES)
    dist.broadcast(weights, src=0)  # ... until rank 0's are broadcast

    generator = torch.Generator().manual_seed(1234)  # the same data set on every rank
    features = torch.randn(SAMPLES * world, FEATURES, generator=generator)
    labels = (features.sum(dim=1) > 0).to(torch.float32)
    shard = slice(rank * SAMPLES, (rank + 1) * SAMPLES)

    scores = features[shard] @ weights
    predictions = (scores > 0).to(torch.float32)
    stats = torch.tensor([(predictions == labels[shard]).sum().item(), float(SAMPLES)])
    dist.all_reduce(stats)  # correct and total over every shard

    best = scores.max().reshape(1)
    dist.all_reduce(best, op=dist.ReduceOp.MAX)

    everything = torch.zeros(SAMPLES * world)
    dist.all_gather_into_tensor(everything, predictions)
    per_rank = [torch.zeros(SAMPLES) for _ in range(world)]
    dist.all_gather(per_rank, predictions)
    assert torch.equal(torch.cat(per_rank), everything)

    summaries = [None] * world if rank == 0 else None
    dist.gather_object({"rank": rank, "correct": int((predictions == labels[shard]).sum())}, summaries, dst=0)

    firsts = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    dist.gather(scores[:1].contiguous(), firsts, dst=0)

    dist.barrier()
    if rank == 0:
        print(f"world size {world}")
        print(f"accuracy {stats[0].item() / stats[1].item():.4f} ({int(stats[0])}/{int(stats[1])})")
        print(f"best score {best.item():.4f}")
        print(f"positive predictions {int(everything.sum())}")
        print(f"per-rank correct {[s['correct'] for s in summaries]}")
        print(f"first scores {[round(f.item(), 4) for f in firsts]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--spawn"]:  # --spawn N [init_method]: one process per rank, as the PyTorch guides do
        import torch.multiprocessing as mp

        n, init = int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "tcp://127.0.0.1:29512"
        mp.spawn(main, args=(n, init), nprocs=n)
    else:
        main()
