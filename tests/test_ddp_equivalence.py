"""DistributedDataParallel trains exactly like one process on the concatenated batch (float64).

Each configuration trains for STEPS steps on 2 and 3 real ranks; the parameters must equal
single-process training on all ranks' samples together (rtol 1e-6), and a naive DDP (every
gradient all-reduced after backward) is a second oracle run on the same ranks.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

torch = pytest.importorskip("torch")

BATCH, STEPS, LR = 4, 6, 0.1
TINY = 16 / 2**20  # 16 bytes: one parameter per bucket

CONFIGS = {
    "default": {},
    "bucket_view": {"ddp": {"gradient_as_bucket_view": True}, "set_to_none": False},
    "bucket_view_none": {"ddp": {"gradient_as_bucket_view": True}},
    "no_sync": {"accumulate": True},
    "no_sync_bucket_view": {"accumulate": True, "ddp": {"gradient_as_bucket_view": True}, "set_to_none": False},
    "unused": {"extra": True, "ddp": {"find_unused_parameters": True}},
    "unused_bucket_view": {"extra": True, "ddp": {"find_unused_parameters": True, "gradient_as_bucket_view": True}},
    "static_graph": {"extra": True, "ddp": {"static_graph": True}},
    "many_buckets": {"ddp": {"bucket_cap_mb": TINY}},
    "many_buckets_no_sync": {"accumulate": True, "ddp": {"bucket_cap_mb": TINY}},
    "allreduce_hook": {"hook": "allreduce_hook"},
    "fp16": {"hook": "fp16_compress_hook"},
    "bf16": {"hook": "bf16_compress_hook"},
}
# (rtol, atol). Exact configurations differ only by summation order. Compression rounds each
# gradient (fp16: 11 bits, bf16: 8 bits of mantissa); on parameters of size ~0.3 after 6 steps the
# measured worst absolute errors are ~4e-5 (fp16) and ~4e-4 (bf16).
EXACT = (1e-6, 1e-12)
TOLERANCE = {"fp16": (1e-3, 1e-4), "bf16": (1e-2, 1e-3)}


class Net(torch.nn.Module):
    """A small MLP; ``extra`` adds a layer only some ranks use and one nobody uses."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 3)
        if extra:
            self.extra = torch.nn.Linear(8, 8)
            self.never = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc3(h)


def _data(world: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(world * BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(world * BATCH, 3, generator=g, dtype=torch.float64)


def _model(cfg: dict, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(cfg.get("extra", False)).double()


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, use_extra: bool) -> torch.Tensor:
    return ((model(x, use_extra=use_extra) - y) ** 2).mean()


def _sgd_step(module: torch.nn.Module, set_to_none: bool = True) -> None:
    """Plain SGD, then zero the gradients (torch.optim's first step costs a second of imports per rank)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    module.zero_grad(set_to_none=set_to_none)


def _train_ddp(cfg: dict, rank: int, world: int) -> dict:
    import ddp

    module = _model(cfg, seed=rank)  # different on every rank: DDP must start all from rank 0's
    model = ddp.DistributedDataParallel(module, **cfg.get("ddp", {}))
    if "hook" in cfg:
        model.register_comm_hook(None, getattr(ddp.comm_hooks, cfg["hook"]))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    micros = 2 if cfg.get("accumulate") else 1
    for step in range(STEPS):
        for micro in range(micros):
            x, y = _data(world, step, micro)
            quiet = model.no_sync() if micro < micros - 1 else contextlib.nullcontext()
            with quiet:
                _loss(model, x[mine], y[mine], use_extra=cfg.get("extra", False) and rank == 0).backward()
        grads_none = [p.grad is None for p in module.parameters()]
        _sgd_step(model, set_to_none=cfg.get("set_to_none", True))
    return {
        "params": [p.detach().numpy().copy() for p in module.parameters()],
        "grads_none": grads_none,
        "plan": str(model.reducer.plan),
    }


def _train_naive(rank: int, world: int) -> list[np.ndarray]:
    """The oracle on the same ranks: broadcast at start, all-reduce every gradient after backward."""
    import commlib

    module = _model({}, seed=rank)
    for p in module.parameters():
        commlib.broadcast(p.data, src=0)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(STEPS):
        x, y = _data(world, step, 0)
        _loss(module, x[mine], y[mine], use_extra=False).backward()
        for p in module.parameters():
            commlib.all_reduce(p.grad)
            p.grad /= world
        _sgd_step(module)
    return [p.detach().numpy().copy() for p in module.parameters()]


def _all_configs(names: list[str]) -> dict:
    import commlib

    torch.set_num_threads(1)
    rank, world = commlib.get_rank(), commlib.get_world_size()
    out = {name: _train_ddp(CONFIGS[name], rank, world) for name in names}
    out["naive"] = {"params": _train_naive(rank, world)}
    return out


def _single_process(cfg: dict, world: int) -> list[np.ndarray]:
    """Training on the concatenated batch in one process (rank r's samples use rank r's branch)."""
    module = _model(cfg, seed=0)
    micros = 2 if cfg.get("accumulate") else 1
    for step in range(STEPS):
        for micro in range(micros):
            x, y = _data(world, step, micro)
            parts = [slice(r * BATCH, (r + 1) * BATCH) for r in range(world)]
            outs = [module(x[s], use_extra=cfg.get("extra", False) and r == 0) for r, s in enumerate(parts)]
            ((torch.cat(outs) - y) ** 2).mean().backward()
        _sgd_step(module)
    return [p.detach().numpy().copy() for p in module.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_equals_single_process_training(world: int) -> None:
    results = run(_all_configs, world, list(CONFIGS), timeout=100)
    naive = results[0]["naive"]["params"]
    wanted = {name: _single_process(cfg, world) for name, cfg in CONFIGS.items()}
    for rank, by_name in enumerate(results):
        for p, p0 in zip(by_name["naive"]["params"], naive, strict=True):
            np.testing.assert_array_equal(p, p0)  # the oracle itself agrees across ranks
        for name, cfg in CONFIGS.items():
            want = wanted[name]
            got = by_name[name]["params"]
            rtol, atol = TOLERANCE.get(name, EXACT)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{name} rank {rank} param {i}")
            if not cfg.get("extra") and not cfg.get("accumulate") and name not in TOLERANCE:
                for g, n in zip(got, naive, strict=True):
                    np.testing.assert_allclose(g, n, *EXACT, err_msg=f"{name} vs naive")
            # Identical on every rank, bit for bit (every rank applies the same averaged gradients).
            for g, g0 in zip(got, results[0][name]["params"], strict=True):
                np.testing.assert_array_equal(g, g0)
    unused = results[0]["unused"]["grads_none"]
    assert unused == [False] * 8 + [True, True]  # 'never' was unused on every rank: its grad stays None
    many = {r["many_buckets"]["plan"] for r in results}
    assert len(many) == 1 and many.pop().count("#") == 6  # rank 0's rebuilt plan, one bucket per parameter
