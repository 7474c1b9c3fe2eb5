"""OneFlow's data parallelism with global tensors: the model broadcast, the batch split(0).

    python -m commlib.launch --nproc_per_node 2 examples/globalview/data_parallel.py

The broadcast weights' gradients come back partial (each rank saw part of the batch) and are
summed in buckets while backward runs: what DDP does, written as layouts.
"""

import sys
from pathlib import Path

import torch

import commlib
import globalview as gv

sys.path.insert(0, str(Path(__file__).parent))
from _common import DEVICE, STEPS, data, mlp, report, single_process_losses

placement = gv.placement(DEVICE, list(range(commlib.get_world_size())))
model = gv.nn.to_global(mlp(), placement, gv.sbp.broadcast)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = (gv.tensor(t, placement=placement, sbp=gv.sbp.split(0)) for t in data())
single = single_process_losses()
for step in range(STEPS):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    with gv.record() as calls:
        loss.backward()
    optimizer.step()
    report(step, loss.item(), single)
if commlib.get_rank() == 0:
    print(calls, flush=True)
