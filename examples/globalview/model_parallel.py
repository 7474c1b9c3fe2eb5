"""OneFlow's model (tensor) parallelism: weights split, the batch broadcast.

    python -m commlib.launch --nproc_per_node 2 examples/globalview/model_parallel.py

Column-parallel layers split torch's (out, in) weight on dim 0 (their output features come out
split), row-parallel ones on dim 1 (their output is a partial sum, reduced when needed).
"""

import sys
from pathlib import Path

import torch

import commlib
import globalview as gv

sys.path.insert(0, str(Path(__file__).parent))
from _common import DEVICE, STEPS, data, mlp, report, single_process_losses

S = gv.sbp
placement = gv.placement(DEVICE, list(range(commlib.get_world_size())))
layout = {"0.weight": S.split(0), "0.bias": S.split(0), "2.weight": S.split(1), "4.weight": S.split(0)}
model = gv.nn.to_global(mlp(), placement, layout | {"4.bias": S.split(0)})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = (gv.tensor(t, placement=placement, sbp=S.broadcast) for t in data())
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
