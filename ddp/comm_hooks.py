"""Communication hooks for ``DistributedDataParallel.register_comm_hook`` (torch's built-in ones).

A hook is ``hook(state, bucket) -> future``: ``bucket`` is a :class:`GradBucket` (torch's
methods: ``index()``, ``buffer()``, ``gradients()``, ``parameters()``, ``is_last()``,
``set_buffer()``) and the future anything whose ``wait()`` returns a tensor shaped like
``bucket.buffer()`` holding the *averaged* gradients -- a :class:`HookFuture` over a commlib
``Work``, or a completed ``torch.futures.Future``. As in torch, the built-in hooks take the
process group (or None for the world) as ``state``. Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import commlib

__all__ = ["GradBucket", "HookFuture", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


class HookFuture:
    """A pending reduction: ``wait()`` finishes ``work`` and returns ``then(value)`` (or ``value``)."""

    def __init__(self, work: Any, value: Any, then: Callable[[Any], Any] | None = None) -> None:
        self._work = work
        self._value = value
        self._then = then

    def is_completed(self) -> bool:
        """True once the communication is done; never blocks."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> Any:
        """Block until done; return the averaged tensor."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._then is not None:
                self._value, self._then = self._then(self._value), None
        return self._value

    def then(self, fn: Callable[[Any], Any]) -> HookFuture:
        """A future whose value is ``fn`` applied to this one's value (runs at ``wait()``)."""
        first = self._then
        chained = fn if first is None else (lambda value: fn(first(value)))
        return HookFuture(self._work, self._value, chained)


class GradBucket:
    """One bucket handed to a communication hook: its flat buffer and the parameters in it."""

    def __init__(self, index: int, buffer: Any, params: list[Any], offsets: list[int], is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._params = params
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's position in issue order (0 is reduced first)."""
        return self._index

    def buffer(self) -> Any:
        """The flat tensor of the bucket's gradients (the hook may modify it in place)."""
        return self._buffer

    def gradients(self) -> list[Any]:
        """Each parameter's gradient, as a view into :meth:`buffer`."""
        return [self._buffer[o : o + p.numel()].view_as(p) for p, o in zip(self._params, self._offsets, strict=True)]

    def parameters(self) -> list[Any]:
        """The parameters whose gradients the bucket holds."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of the iteration."""
        return self._is_last

    def set_buffer(self, tensor: Any) -> None:
        """Overwrite the bucket's contents with ``tensor``."""
        self._buffer.copy_(tensor)


def allreduce_hook(process_group: Any, bucket: GradBucket) -> HookFuture:
    """Average with one all-reduce: divide by the world size, then sum (torch's default hook)."""
    buffer = bucket.buffer()
    buffer.div_(commlib.get_world_size(process_group))
    return HookFuture(commlib.all_reduce(buffer, group=process_group, async_op=True), buffer)


def _compress_hook(process_group: Any, bucket: GradBucket, dtype: Any) -> HookFuture:
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(commlib.get_world_size(process_group))
    work = commlib.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(reduced: Any) -> Any:
        """Cast the averaged low-precision tensor back into the bucket."""
        buffer.copy_(reduced)
        return buffer

    return HookFuture(work, compressed, decompress)


def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> HookFuture:
    """Send gradients as float16 (half the bytes), average, and cast back into the bucket."""
    import torch

    return _compress_hook(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> HookFuture:
    """Send gradients as bfloat16 (half the bytes, float32's range), average, and cast back."""
    import torch

    return _compress_hook(process_group, bucket, torch.bfloat16)
