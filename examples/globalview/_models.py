"""The three models the automatic plans are shown on (examples/globalview/auto_parallel.py, benchmarks/gv_auto.py).

Plain torch modules whose forward takes a batch and returns the loss (nanoGPT's style), so one traced
forward covers the whole step: a wide MLP (few large weights), a deep narrow MLP (many small ones) and a
small GPT (token and position embeddings, causal self-attention, layer norm, MLP, an LM head tied to the
token embedding). The same module runs single-process (local tensors) and global (global tensors).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``sizes[0] -> ... -> sizes[-1]`` Linear layers with ReLU between; forward(x, y) is the MSE loss."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


class Block(nn.Module):
    """A GPT block: x + attention(ln(x)), then x + mlp(ln(x)); attention is causal over ``heads`` heads."""

    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = (att + self.mask).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT language model; forward(ids, targets) is the next-token cross entropy."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab, d)
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2's: the tied head's logits start small
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, seq) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.wte.weight)  # the LM head, tied to the token embedding
        b, t, v = logits.shape
        return F.cross_entropy(logits.reshape(b * t, v), targets.reshape(b * t))


#: name -> (constructor, batch maker): small sizes for tests and the smoke run, real ones for the benchmark
SIZES = {
    "wide mlp": {"smoke": (32, 128, 128, 16), "bench": (512, 2048, 2048, 512)},
    "deep mlp": {"smoke": (16,) * 6, "bench": (128,) * 17},
    "gpt": {"smoke": (64, 16, 2, 2, 8), "bench": (1024, 128, 4, 4, 64)},
}


def make(name: str, size: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """Model ``name`` ("wide mlp", "deep mlp", "gpt") at ``size`` ("smoke" or "bench"), seeded."""
    torch.manual_seed(seed)
    args = SIZES[name][size]
    model = GPT(*args) if name == "gpt" else MLP(args)
    return model.to(dtype)


def batch(model: nn.Module, rows: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """``rows`` samples for ``model`` (the forward's arguments), from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, GPT):
        seq = model.pos.shape[0]
        ids = torch.randint(0, model.vocab, (rows, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    first, last = model.net[0], model.net[-1]
    x = torch.randn(rows, first.in_features, generator=g, dtype=dtype)
    return x, torch.randn(rows, last.out_features, generator=g, dtype=dtype)
