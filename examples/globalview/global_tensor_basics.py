"""OneFlow's "Global Tensor: Basic Operations", every example, on globalview.

    python -m commlib.launch --nproc_per_node 2 examples/globalview/global_tensor_basics.py

Placements use "cuda" when the nccl backend can run (a GPU, or the CPU emulator
with COMMLIB_NCCL_EMULATOR=1) and "cpu" otherwise, as the OneFlow guide suggests
for machines without two GPUs.
"""

import commlib
import globalview as gv

DEVICE = "cuda" if commlib.is_nccl_available() else "cpu"
rank = commlib.get_rank()


def section(title):
    commlib.barrier()
    print(f"== {title}", flush=True)


# Creating a global tensor: randn split along dim 0 over ranks 0 and 1.
section("creating a global tensor")
placement = gv.placement(type=DEVICE, ranks=[0, 1])
sbp = gv.sbp.split(dim=0)
x = gv.randn(4, 5, placement=placement, sbp=sbp)
print("Local data of global tensor:\n ", x.to_local())
print("Global data of global tensor:\n ", x.numpy())

# Converting a local tensor to a global tensor.
section("local to global")
x = gv.randn(2, 5)
print(gv.is_local(x))  # True
print(gv.is_global(x))  # False
placement = gv.placement(type=DEVICE, ranks=[0, 1])
sbp = gv.sbp.split(0)
x_global = gv.to_global(x, placement=placement, sbp=sbp)
print(x_global.shape)  # (4, 5)
print(gv.is_local(x))  # True
print(x_global.is_global)  # True

# Converting a global tensor to a local tensor.
section("global to local")
placement = gv.placement(type=DEVICE, ranks=[0, 1])
sbp = gv.sbp.split(0)
x = gv.randn(4, 5, placement=placement, sbp=sbp)
print(x.to_local().shape)  # (2, 5) on each rank

# Converting one global tensor to another: split -> broadcast (an all_gather).
section("split to broadcast")
x = gv.randn(2, 5)
placement = gv.placement(type=DEVICE, ranks=[0, 1])
sbp = gv.sbp.split(0)
x_global = gv.to_global(x, placement=placement, sbp=sbp)
print(x_global.shape)  # (4, 5)
print(x_global.to_local().shape)  # (2, 5): a slice
sbp_b = gv.sbp.broadcast
x_global_b = x_global.to_global(placement=placement, sbp=sbp_b)
print(x_global_b.shape)  # (4, 5)
print(x_global_b.to_local().shape)  # (4, 5): the whole tensor

# A global tensor in a computation: S(0) x B -> S(0), data parallelism.
section("matmul")
placement = gv.placement(type=DEVICE, ranks=[0, 1])
x = gv.randn(4, 5, placement=placement, sbp=gv.sbp.split(dim=0))
w = gv.randn(5, 8, placement=placement, sbp=gv.sbp.broadcast)
y = gv.matmul(x, w)
print(y.is_global)  # True
print(y.shape)  # (4, 8)
print(y.sbp)  # (split(dim=0),)
print(y.to_local())
