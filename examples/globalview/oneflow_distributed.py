"""OneFlow's oneflow.distributed page, every global tensor example, on globalview.

    python -m commlib.launch --nproc_per_node 2 examples/globalview/oneflow_distributed.py
    python -m commlib.launch --nproc_per_node 4 examples/globalview/oneflow_distributed.py

With 4 ranks it also moves a tensor from ranks [0, 1] to ranks [2, 3].
"""

import commlib
import globalview as gv

DEVICE = "cuda" if commlib.is_nccl_available() else "cpu"


def section(title):
    commlib.barrier()
    print(f"== {title}", flush=True)


# Construct a global tensor: placement + sbp.
section("construct")
placement = gv.placement(type=DEVICE, ranks=[0, 1])
sbp = gv.sbp.split(dim=0)
x = gv.randn(4, 5, placement=placement, sbp=sbp)
print(x.shape)  # (4, 5)

# Convert a local tensor to a global tensor: two (2, 5) parts make a (4, 5) tensor.
section("local to global")
x = gv.randn(2, 5)
placement = gv.placement(DEVICE, [0, 1])
sbp = gv.sbp.split(0)
x_global = gv.to_global(x, placement=placement, sbp=sbp)
print(x_global.shape)  # (4, 5)

# Redistribute: another placement, another sbp, or both.
if commlib.get_world_size() >= 4:
    section("redistribute")
    x = gv.tensor([1.0, 2.0], placement=gv.placement(DEVICE, ranks=[0, 1]), sbp=gv.sbp.split(0))
    y = x.to_global(placement=gv.placement(DEVICE, ranks=[2, 3]), sbp=gv.sbp.broadcast)
    print(y.placement, y.sbp, y.to_local())  # ranks 2 and 3 hold [1. 2.], ranks 0 and 1 nothing

# Operators box their inputs automatically: S(0) + S(1).
section("automatic boxing")
x = gv.randn(4, 4, placement=gv.placement(DEVICE, ranks=[0, 1]), sbp=gv.sbp.split(0))
y = gv.randn(4, 4, placement=gv.placement(DEVICE, ranks=[0, 1]), sbp=gv.sbp.split(1))
z = x + y
print(z.shape, z.sbp)
if commlib.get_rank() == 0:
    print(gv.explain("add", x, y))  # which input was boxed, how, and what it moved

# Get the local tensor from a global tensor.
section("to_local")
y = x.to_local()
print(gv.is_local(y))  # True
print(y)
