"""OneFlow's pipeline parallelism: two stages on two placements, micro-batches.

    python -m commlib.launch --nproc_per_node 2 examples/globalview/pipeline.py

Stage 0 (the first half of the ranks) runs the first layers, stage 1 the rest; the activation
moves with ``h.to_global(placement=stage1, sbp=...)`` (send/recv forward, the reverse in
backward). Each micro-batch's backward adds to the gradients; one optimizer step per batch.
"""

import sys
from pathlib import Path

import torch

import commlib
import globalview as gv

sys.path.insert(0, str(Path(__file__).parent))
from _common import BATCH, DEVICE, STEPS, data, mlp, report, single_process_losses

S, p = gv.sbp, commlib.get_world_size()
half = max(1, p // 2)
stage0 = gv.placement(DEVICE, list(range(half)))
stage1 = gv.placement(DEVICE, list(range(half, p)) or list(range(half)))
model = mlp()
first, second = gv.nn.to_global(model[:2], stage0), gv.nn.to_global(model[2:], stage1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x_all, y_all = data()
single = single_process_losses()
MICRO = 2
for step in range(STEPS):
    optimizer.zero_grad()
    total = 0.0
    for m in range(MICRO):
        rows = slice(m * BATCH // MICRO, (m + 1) * BATCH // MICRO)
        x = gv.tensor(x_all[rows], placement=stage0, sbp=S.split(0))
        y = gv.tensor(y_all[rows], placement=stage1, sbp=S.split(0))
        h = first(x).to_global(placement=stage1, sbp=S.split(0))
        loss = torch.nn.functional.mse_loss(second(h), y, reduction="sum") / y_all.numel()
        loss.backward()
        total += loss.item()
    optimizer.step()
    report(step, total, single)
