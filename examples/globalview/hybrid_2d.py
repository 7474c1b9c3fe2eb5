"""OneFlow's 2-D (hybrid) parallelism on a 2 x 2 mesh: data parallel along axis 0, tensor parallel along axis 1.

    python -m commlib.launch --nproc_per_node 4 examples/globalview/hybrid_2d.py

The batch is (S(0), B): split over the mesh's rows, whole within a row. Weights are
(B, S(0)) (column parallel within a row) and (B, S(1)) (row parallel), the rest (B, B).
"""

import sys
from pathlib import Path

import torch

import globalview as gv

sys.path.insert(0, str(Path(__file__).parent))
from _common import DEVICE, STEPS, data, mlp, report, single_process_losses

S = gv.sbp
mesh = gv.placement(DEVICE, ranks=[[0, 1], [2, 3]])
B = S.broadcast
model = mlp()
layout = {name: (B, B) for name, _ in model.named_parameters()}
layout |= {"0.weight": (B, S.split(0)), "0.bias": (B, S.split(0)), "2.weight": (B, S.split(1))}
model = gv.nn.to_global(model, mesh, layout)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = (gv.tensor(t, placement=mesh, sbp=(S.split(0), B)) for t in data())
single = single_process_losses()
for step in range(STEPS):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    report(step, loss.item(), single)
