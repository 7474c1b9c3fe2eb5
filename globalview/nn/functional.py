"""``globalview.nn.functional``: torch.nn.functional's operators on global tensors (see ``_functional``)."""

from __future__ import annotations

from globalview._functional import (
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    linear,
    log_softmax,
    mse_loss,
    nll_loss,
    relu,
    softmax,
)

__all__ = [
    "cross_entropy",
    "dropout",
    "embedding",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "mse_loss",
    "nll_loss",
    "relu",
    "softmax",
]
