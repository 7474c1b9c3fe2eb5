"""``SyncBatchNorm``: batch normalisation with statistics over the whole (all-rank) batch.

Forward: each rank computes its per-channel mean, sum of squared deviations and count; one
``all_gather_into_tensor`` brings everyone's, combined with the parallel-variance formula
(exact, no sum-of-squares cancellation). Backward (a ``torch.autograd.Function``): the two
per-channel sums the input gradient needs (of dy and of dy * x_hat) are all-reduced, so the
input gradient equals that of BatchNorm on the concatenated batch. The weight and bias
gradients stay local sums, as in torch: DDP's gradient averaging combines them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import commlib

__all__ = ["SyncBatchNorm"]

_LOW = (torch.float16, torch.bfloat16)


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _global_stats(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, sum of squared deviations (M2) and count over every rank's batch, per channel."""
    channels, dims = x.shape[1], _reduce_dims(x)
    count = x.numel() // channels
    if count:
        mean = x.mean(dims)
        m2 = ((x - mean.view(_channel_shape(x))) ** 2).sum(dims)
    else:  # an empty local batch contributes nothing
        mean = m2 = x.new_zeros(channels)
    packed = torch.cat([mean, m2, x.new_tensor([float(count)])])
    world = commlib.get_world_size(group)
    gathered = x.new_empty(world * packed.numel())
    commlib.all_gather_into_tensor(gathered, packed, group=group)
    rows = gathered.view(world, -1)
    means, m2s, counts = rows[:, :channels], rows[:, channels : 2 * channels], rows[:, 2 * channels :]
    total = counts.sum()
    if not total > 0:
        raise ValueError(f"SyncBatchNorm: the batch is empty on every rank (input shape {tuple(x.shape)} here)")
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2, total


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with global statistics; the backward all-reduces the two sums dx needs."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: Any,
        bias: Any,
        running_mean: Any,
        running_var: Any,
        eps: float,
        momentum: float,
        group: Any,
    ) -> torch.Tensor:
        """Normalise ``x`` with the statistics of every rank's batch; update the running statistics."""
        xs = x.float() if x.dtype in _LOW else x  # statistics of 16-bit inputs in float32
        mean, m2, total = _global_stats(xs, group)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:  # the running variance is unbiased, as torch's
                unbiased = m2 / (total - 1) if total > 1 else var
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = _channel_shape(x)
        y = (xs - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.view(shape).to(y.dtype) + bias.view(shape).to(y.dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group, ctx.total = group, total
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        """Input gradient from the all-reduced sums of dy and dy * x_hat; local weight and bias gradients."""
        x, weight, mean, invstd = ctx.saved_tensors
        shape, dims = _channel_shape(x), _reduce_dims(x)
        xs = x.float() if x.dtype in _LOW else x
        dys = dy.to(xs.dtype)
        xhat = (xs - mean.view(shape)) * invstd.view(shape)
        sum_dy, sum_dy_xhat = dys.sum(dims), (dys * xhat).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            commlib.all_reduce(sums, group=ctx.group)
            all_dy, all_dy_xhat = sums.split(x.shape[1])
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            centred = dys - (all_dy / ctx.total).view(shape) - xhat * (all_dy_xhat / ctx.total).view(shape)
            grad_x = (centred * scale.view(shape)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over ``(N, C, ...)`` inputs whose training statistics span all ranks of ``process_group``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: input must be (N, {self.num_features}, ...), got shape {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input``; in training, with statistics of the batch across all ranks."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        running_mean = self.running_mean if keep else None
        running_var = self.running_var if keep else None
        if not use_batch or commlib.get_world_size(self.process_group) == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, use_batch, factor, self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.process_group
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """``module`` with every BatchNorm*d layer replaced by a SyncBatchNorm sharing its parameters and buffers."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
            )
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
