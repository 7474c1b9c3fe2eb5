"""ddp: data-parallel training on commlib collectives.

- :mod:`ddp.planner` -- pure bucket planning (which gradient goes in which flat buffer);
- :class:`Reducer` -- averages gradients in flat buckets, each bucket's all-reduce started as
  soon as its last gradient is ready (numpy, cupy, torch or DLPack arrays);
  both live in :mod:`commlib.buckets` (globalview reuses them) and are re-exported here;
- :class:`DistributedDataParallel` -- torch's DDP on that reducer, driven by gradient hooks;
- :class:`DistributedSampler`, :class:`SyncBatchNorm`, :mod:`ddp.comm_hooks`;
- :func:`broadcast_state` -- a newcomer gets the members' training state (``commlib.grow_group``).

torch is optional: ``DistributedDataParallel`` and ``SyncBatchNorm`` import it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from commlib.buckets import Bucket, BucketPlan, ParamInfo, Reducer, average_all_reduce, complete_order, plan_buckets
from ddp import comm_hooks
from ddp.sampler import DistributedSampler

__all__ = [
    "Bucket",
    "BucketPlan",
    "DistributedDataParallel",
    "DistributedSampler",
    "ParamInfo",
    "Reducer",
    "SyncBatchNorm",
    "average_all_reduce",
    "broadcast_state",
    "comm_hooks",
    "complete_order",
    "plan_buckets",
]

# Names whose modules import torch: loaded on first access, so `import ddp` works without torch.
_LAZY = {
    "DistributedDataParallel": "ddp.parallel",
    "SyncBatchNorm": "ddp.sync_batchnorm",
    "broadcast_state": "ddp._sync",
}


def __getattr__(name: str) -> Any:
    """Import the torch-backed classes on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddp' has no attribute {name!r}")
