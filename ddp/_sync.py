"""Keeping torch modules identical across ranks: shape checks and coalesced broadcasts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

import commlib

__all__ = ["broadcast_coalesced", "check_devices", "verify_shapes"]


def verify_shapes(where: str, named: Sequence[tuple[str, torch.Tensor]], group: Any) -> None:
    """Raise ``ValueError`` naming the parameter and the ranks when ranks wrap different models."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named]
    everyone: list[Any] = [None] * commlib.get_world_size(group)
    commlib.all_gather_object(everyone, mine, group=group)
    for position in range(max(len(specs) for specs in everyone)):
        by_spec: dict[Any, list[int]] = {}
        for rank, specs in enumerate(everyone):
            spec = specs[position] if position < len(specs) else None
            by_spec.setdefault(spec, []).append(rank)
        if len(by_spec) > 1:
            raise ValueError(f"{where}: every rank must wrap the same model, but {_describe(position, by_spec)}")


def _describe(position: int, by_spec: dict[Any, list[int]]) -> str:
    names = {spec[0] for spec in by_spec if spec is not None}
    missing = by_spec.get(None)
    if len(names) == 1:
        present = [f"shape {spec[1]} dtype {spec[2]} on ranks {ranks}" for spec, ranks in by_spec.items() if spec]
        text = f"parameter {names.pop()!r} has " + " but ".join(present)
        return text + (f" but is missing on ranks {missing}" if missing else "")
    parts = [
        f"{spec[0]!r} on ranks {ranks}" if spec else f"missing on ranks {ranks}" for spec, ranks in by_spec.items()
    ]
    return f"parameter #{position} (in registration order) is " + " but ".join(parts)


def broadcast_coalesced(tensors: Iterable[torch.Tensor], group: Any, src: int = 0) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values: one broadcast per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            commlib.broadcast(flat, group=group, group_src=src)
            offset = 0
            for t in same:
                t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def check_devices(
    where: str, params: Sequence[torch.Tensor], device_ids: Any, output_device: Any, backend: str
) -> tuple[torch.device, list[int] | None]:
    """The module's one device, and device_ids as torch checks them (None for CPU modules)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"{where}: module parameters must all be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda" and backend != "nccl":
        raise ValueError(f"{where}: a module on {device} needs a process group with the nccl backend, got {backend!r}")
    if device.type == "cpu":
        if device_ids is not None or output_device is not None:
            raise ValueError(
                f"{where}: device_ids and output_device are for GPU modules; this module is on the CPU, "
                f"got device_ids={device_ids!r}, output_device={output_device!r} (pass None)"
            )
        return device, None
    if device_ids is None:
        return device, None
    ids = [torch.device(device.type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
    if len(ids) != 1 or ids[0] != device:
        raise ValueError(f"{where}: device_ids must be [the module's device {device}], got {device_ids!r}")
    return device, [ids[0].index]


def broadcast_state(
    module: torch.nn.Module, optimizer: Any = None, extra: Any = None, src: int = 0, group: Any = None
) -> Any:
    """Make this rank's training state rank ``src``'s: the module's parameters and buffers, the optimizer's
    state (its ``state_dict``), and ``extra`` (any picklable object: the step, the sampler's epoch, RNG states),
    which it returns. Collective over ``group`` (default: the default group): after ``commlib.grow_group``, the
    members and the newcomers call it, the newcomers with a freshly made module and optimizer of the same shape.
    A ``ddp.DistributedDataParallel`` may be given for its module."""
    inner = getattr(module, "module", module)
    if not isinstance(inner, torch.nn.Module):
        raise TypeError(f"broadcast_state: module must be a torch.nn.Module, got {type(module).__qualname__}")
    rank = commlib.get_rank(group)
    broadcast_coalesced([*inner.parameters(), *inner.buffers()], group, src)
    reducer = getattr(module, "reducer", None) if module is not inner else None  # a ddp.DistributedDataParallel's
    payload: list[Any] = [None, None, None]
    if rank == src:
        state = reducer.plan_state() if reducer is not None else None
        payload = [optimizer.state_dict() if optimizer is not None else None, extra, state]
    commlib.broadcast_object_list(payload, group_src=src, group=group)
    if optimizer is not None and rank != src:
        optimizer.load_state_dict(payload[0])
    if reducer is not None and payload[2] is not None and rank != src:
        reducer.adopt(payload[2])  # a newcomer's buckets as the members' (they rebuilt them long ago)
    return payload[1]
