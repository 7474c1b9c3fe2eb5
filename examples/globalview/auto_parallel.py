"""The whole model planned at once: ``gv.auto_parallel`` lays out a small GPT and chooses every operator's plan.

    python -m commlib.launch --nproc_per_node 2 examples/globalview/auto_parallel.py

From one traced forward (each rank passes its own batch), globalview times the operators at every local
shape a plan could give them, measures the collectives (once per machine, cached), and searches exactly for
the layouts and operator plans of least predicted step time. Each step prints the loss next to
single-process torch's on the whole batch; then ``gv.explain(model)`` shows the plan per layer next to the
hand-written plans, and the plan is saved and applied to a fresh model without searching again.
"""

import sys
import tempfile
from pathlib import Path

import torch

import commlib
import globalview as gv

sys.path.insert(0, str(Path(__file__).parent))
from _models import batch, make

torch.set_num_threads(1)
DTYPE, STEPS = torch.float64, 5
placement = gv.placement("cpu", list(range(commlib.get_world_size())))
n, me = len(placement.flat), commlib.get_rank()
single, model = make("gpt", "smoke", DTYPE), make("gpt", "smoke", DTYPE)
batches = [batch(single, 4 * n, seed, DTYPE) for seed in range(STEPS)]


def mine(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole batch: what a data loader gives each rank."""
    k = len(t) // n
    return t[me * k : (me + 1) * k]


gv.auto_parallel(model, placement, tuple(mine(t) for t in batches[0]))  # memory_per_rank=... to fit a budget
opt_single, opt = torch.optim.AdamW(single.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
for step, b in enumerate(batches):
    want = single(*b)
    opt_single.zero_grad(), want.backward(), opt_single.step()
    loss = model(*(mine(t) for t in b))  # each rank's own batch, as a data loader gives it
    opt.zero_grad(), loss.backward(), opt.step()
    print(f"step {step} loss {loss.item():.12f} single {want.item():.12f}", flush=True)

plan = gv.explain(model)
if me == 0:
    print(plan, flush=True)
with tempfile.TemporaryDirectory() as tmp:  # each rank its own copy here; in a job, one shared path
    path = Path(tmp) / "plan.json"
    plan.save(path)
    again = gv.auto_parallel(make("gpt", "smoke", DTYPE), placement, None, plan=gv.AutoPlan.load(path))
loss = again(*(mine(t) for t in batches[0]))
print(f"the saved plan, applied to a fresh model: loss {loss.item():.12f}", flush=True)
