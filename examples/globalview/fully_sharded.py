"""Fully sharded data parallelism (ZeRO-3, FSDP) with global tensors: every parameter split(0).

    python -m commlib.launch --nproc_per_node 2 examples/globalview/fully_sharded.py

Each rank holds 1/p of every weight (and so of its gradient and optimizer state); the batch is
split(0). Each Linear then moves whichever costs fewer bytes: at this small batch the activations
(the batch is gathered, the output stays split by column); under ``gv.plan(prefer="move_weights")``
the weights, as FSDP does (gathered for the layer and released, gathered again in backward,
gradients reduce-scattered). Two models train side by side, the cheapest plans and the pinned
ones; each step prints both losses next to the single-process run's, then ``gv.explain`` shows the
first layer's candidates and why one won.
"""

import sys
from pathlib import Path

import torch

import commlib
import globalview as gv

sys.path.insert(0, str(Path(__file__).parent))
from _common import DEVICE, STEPS, data, mlp, single_process_losses

placement = gv.placement(DEVICE, list(range(commlib.get_world_size())))
single = single_process_losses()
x, y = (gv.tensor(t, placement=placement, sbp=gv.sbp.split(0)) for t in data())
models = {}
for prefer in (None, "move_weights"):
    model = mlp()
    gv.nn.to_global(model, placement, {name: gv.sbp.split(0) for name, _ in model.named_parameters()})
    models[prefer] = (model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(STEPS):
    losses = []
    for prefer, (model, optimizer) in models.items():
        with gv.plan(prefer=prefer):
            loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"step {step} loss {losses[0]:.12f} single {single[step]:.12f} pinned {losses[1]:.12f}", flush=True)
weight = gv.nn.state_dict(models[None][0])["0.weight"].requires_grad_()  # as a parameter: it needs a gradient
for prefer in models:
    choice = gv.explain("linear", x, weight, prefer=prefer)
    if commlib.get_rank() == 0:
        print(f"prefer={prefer!r}: {choice}", flush=True)
