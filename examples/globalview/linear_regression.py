"""OneFlow's data-parallel linear regression (its DDP example), written with global tensors instead of DDP.

    python -m commlib.launch --nproc_per_node 2 examples/globalview/linear_regression.py

w is broadcast, each rank's two samples are its split(0) part of the batch; w converges to
[[2], [3]] on both ranks.
"""

import torch

import commlib
import globalview as gv

DEVICE = "cuda" if commlib.is_nccl_available() else "cpu"
train_x = [torch.tensor([[1.0, 2], [2, 3]]), torch.tensor([[4.0, 6], [3, 1]])]
train_y = [torch.tensor([[8.0], [13]]), torch.tensor([[26.0], [9]])]

rank = commlib.get_rank()
placement = gv.placement(DEVICE, [0, 1])
w = gv.zeros(2, 1, dtype=torch.float32, placement=placement, sbp=gv.sbp.broadcast, requires_grad=True)
optimizer = torch.optim.SGD([w.to_local()], lr=0.01)
x = gv.to_global(train_x[rank], placement, gv.sbp.split(0))
y = gv.to_global(train_y[rank], placement, gv.sbp.split(0))
for i in range(500):
    loss = torch.nn.functional.mse_loss(x @ w, y, reduction="sum")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if (i + 1) % 50 == 0:
        print(f"{i + 1}/500 loss:{loss.item()}", flush=True)
print(f"w:{w.numpy().tolist()}", flush=True)
