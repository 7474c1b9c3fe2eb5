"""DistributedDataParallel's contract beyond the numbers: errors, no_sync, join, buffers, state_dict."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

torch = pytest.importorskip("torch")

LR = 0.1


def _catch(fn, *args, **kwargs) -> str:
    """The message of the exception ``fn`` raises (``'no error'`` if none)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class TwoHeads(torch.nn.Module):
    """``b`` takes part only when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _errors() -> dict:
    import commlib
    import ddp

    torch.manual_seed(0)
    rank, out = commlib.get_rank(), {}
    x = torch.ones(2, 3)
    model = ddp.DistributedDataParallel(TwoHeads())
    out["unused"] = _catch(lambda: model(x, use_b=False).sum().backward())
    model(x).sum().backward()  # the error left the module usable
    model(x)
    out["no_backward"] = _catch(model, x)
    # no_sync is exception safe: the error propagates and the next backward syncs again.
    model.zero_grad()
    try:
        with model.no_sync():
            model(x * (rank + 1)).sum().backward()
            raise KeyError("inside no_sync")
    except KeyError:
        out["local"] = model.module.a.weight.grad.tolist()  # (rank + 1) * G: not averaged
    out["sync_after_error"] = model.require_backward_grad_sync
    model.zero_grad()
    model(x * (rank + 1)).sum().backward()
    out["synced"] = model.module.a.weight.grad.tolist()  # the average, 1.5 * G
    # Every rank must wrap the same model.
    width = 4 if rank == 0 else 5
    out["shape"] = _catch(ddp.DistributedDataParallel, torch.nn.Linear(3, width))
    extra = torch.nn.Sequential(torch.nn.Linear(2, 2), *([torch.nn.Linear(2, 2)] if rank == 1 else []))
    out["count"] = _catch(ddp.DistributedDataParallel, extra)
    renamed = (
        torch.nn.Sequential(torch.nn.Linear(2, 2)) if rank == 0 else torch.nn.ModuleDict({"fc": torch.nn.Linear(2, 2)})
    )
    out["names"] = _catch(ddp.DistributedDataParallel, renamed)
    # Argument errors.
    out["device_ids"] = _catch(ddp.DistributedDataParallel, torch.nn.Linear(2, 2), device_ids=[0])
    out["not_module"] = _catch(ddp.DistributedDataParallel, lambda x: x)
    out["frozen"] = _catch(ddp.DistributedDataParallel, torch.nn.Linear(2, 2).requires_grad_(False))
    out["hook_type"] = _catch(model.register_comm_hook, None, "allreduce")
    model.register_comm_hook(None, ddp.comm_hooks.allreduce_hook)
    out["hook_twice"] = _catch(model.register_comm_hook, None, ddp.comm_hooks.allreduce_hook)
    out["join_divide"] = _catch(lambda: model.join(divide_by_initial_world_size=False).__enter__())
    return out


@pytest.mark.timeout(120)
def test_errors_name_what_is_wrong() -> None:
    results = run(_errors, 2, timeout=60)
    for rank, r in enumerate(results):
        where = f"[rank {rank}/2] DistributedDataParallel"
        assert r["unused"].startswith(f"RuntimeError: {where}: parameters 'b.weight', 'b.bias' (indices [2, 3])")
        assert "received no gradient" in r["unused"] and "find_unused_parameters=True" in r["unused"]
        assert r["no_backward"].startswith(f"RuntimeError: {where}: no parameter received a gradient since")
        assert r["sync_after_error"] is True
        np.testing.assert_allclose(r["local"], (rank + 1) * np.array(results[0]["local"]), rtol=1e-6)
        np.testing.assert_allclose(r["synced"], 1.5 * np.array(results[0]["local"]), rtol=1e-6)
        assert r["shape"] == (
            f"ValueError: {where}: every rank must wrap the same model, but parameter 'weight' has shape (4, 3) "
            "dtype torch.float32 on ranks [0] but shape (5, 3) dtype torch.float32 on ranks [1]"
        )
        assert r["count"] == (
            f"ValueError: {where}: every rank must wrap the same model, but parameter '1.weight' has shape (2, 2) "
            "dtype torch.float32 on ranks [1] but is missing on ranks [0]"
        )
        assert r["names"] == (
            f"ValueError: {where}: every rank must wrap the same model, but parameter #0 (in registration "
            "order) is '0.weight' on ranks [0] but 'fc.weight' on ranks [1]"
        )
        assert r["device_ids"].startswith(f"ValueError: {where}: device_ids and output_device are for GPU modules")
        assert r["not_module"].startswith("TypeError: DistributedDataParallel: module must be a torch.nn.Module")
        assert r["frozen"].startswith(f"ValueError: {where}: module has no parameter that requires a gradient")
        assert r["hook_twice"] == (
            f"RuntimeError: {where}.register_comm_hook: a communication hook can be registered only once"
        )
        assert r["hook_type"] == f"TypeError: {where}.register_comm_hook: hook must be callable, got 'allreduce'"
        assert r["join_divide"].startswith(f"ValueError: {where}.join: only divide_by_initial_world_size=True")


class WithNorm(torch.nn.Module):
    """A linear layer and a BatchNorm (whose running statistics are buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2).double()
        self.norm = torch.nn.BatchNorm1d(2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def _batches(rank: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(count)]


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    (model(x) ** 2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    model.zero_grad()


def _join_and_buffers(counts: list[int]) -> dict:
    import commlib
    import ddp

    torch.set_num_threads(1)
    rank, out = commlib.get_rank(), {}
    torch.manual_seed(0)
    model = ddp.DistributedDataParallel(WithNorm())
    with model.join():
        for x in _batches(rank, counts[rank]):
            _step(model, x)
    out["join"] = [t.detach().numpy().copy() for t in model.module.state_dict().values()]
    # Buffers: the running statistics differ after training on different data, until a forward
    # broadcasts rank 0's (broadcast_buffers=True); without it they stay different.
    for broadcast in (True, False):
        torch.manual_seed(0)
        model = ddp.DistributedDataParallel(WithNorm(), broadcast_buffers=broadcast)
        for x in _batches(rank, 2):
            _step(model, x)
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.float64))
        out[f"buffers_{broadcast}"] = model.module.norm.running_mean.tolist()
    return out


def _join_reference(counts: list[int]) -> list[np.ndarray]:
    """One process: each step averages the gradients of the ranks that still have data, over all ranks."""
    torch.manual_seed(0)
    model = WithNorm()
    batches = [_batches(rank, n) for rank, n in enumerate(counts)]
    for step in range(max(counts)):
        for rank_batches in batches:
            if step < len(rank_batches):
                ((model(rank_batches[step]) ** 2).mean() / len(counts)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        model.zero_grad()
    return [p.detach().numpy() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("counts", [[2, 4], [0, 3]])
def test_join_trains_on_uneven_inputs(counts: list[int]) -> None:
    results = run(_join_and_buffers, 2, counts, timeout=60)
    want = _join_reference(counts)
    for r in results:
        state = r["join"]  # fc.weight, fc.bias, norm.weight, norm.bias, then the buffers
        for got, expected in zip(state[:4], want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
        for got, rank0 in zip(state, results[0]["join"], strict=True):
            np.testing.assert_array_equal(got, rank0)  # the last rank to train gave everyone its state
    assert results[0]["buffers_True"] == results[1]["buffers_True"]
    assert results[0]["buffers_False"] != results[1]["buffers_False"]


def _state_dicts() -> dict:
    import collections

    import ddp

    torch.manual_seed(0)
    model = ddp.DistributedDataParallel(WithNorm())
    keys = list(model.state_dict())
    bare = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(bare)
    zeroed = float(sum(v.abs().sum() for v in model.module.state_dict().values()))
    prefixed = collections.OrderedDict((f"module.{k}", torch.ones_like(v)) for k, v in bare.items())
    model.load_state_dict(prefixed)  # a torch DDP checkpoint
    ones = float(model.module.fc.weight.sum())
    parent = torch.nn.ModuleDict({"net": model})  # DDP inside another module
    nested_keys = list(parent.state_dict())
    parent.load_state_dict({k: torch.full_like(v, 2.0) for k, v in parent.state_dict().items()})
    return {
        "keys": keys,
        "zeroed": zeroed,
        "ones": ones,
        "nested": nested_keys,
        "twos": float(model.module.fc.bias.sum()),
    }


@pytest.mark.timeout(120)
def test_state_dict_has_no_module_prefix_and_loads_either_way() -> None:
    (r,) = run(_state_dicts, 1, timeout=60)
    assert r["keys"][:4] == ["fc.weight", "fc.bias", "norm.weight", "norm.bias"]
    assert r["nested"][:2] == ["net.fc.weight", "net.fc.bias"]
    assert r["zeroed"] == 0.0 and r["ones"] == 6.0 and r["twos"] == 4.0


def _traced_training(steps: int) -> list[str]:
    import ddp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 128) for _ in range(6)]
    model = ddp.DistributedDataParallel(
        torch.nn.Sequential(*layers), bucket_cap_mb=0.06
    )  # one 64.5 KiB layer per bucket
    x = torch.randn(32, 128)
    for _ in range(steps):
        model(x).square().mean().backward()
    return [str(model.reducer.plan)]


@pytest.mark.timeout(120)
def test_trace_shows_the_first_bucket_reduced_during_backward(tmp_path) -> None:
    import json

    path = tmp_path / "ddp.json"
    steps = 3
    (plan, *_), _ = run(_traced_training, 2, steps, timeout=60, env={"COMMLIB_DDP_TRACE": str(path)})
    assert plan.count("#") == 6  # one bucket per layer
    for rank in range(2):
        events = json.loads((tmp_path / f"ddp.rank{rank}.json").read_text())
        assert all(e["ph"] == "X" and e["pid"] == rank and {"ts", "dur", "tid"} <= e.keys() for e in events)
        backward = [e for e in events if e["name"] == "backward"]
        first = [e for e in events if e["name"] == "all_reduce bucket 0"]
        assert len(backward) == len(first) == steps
        assert len([e for e in events if e["name"].startswith("all_reduce bucket")]) == 6 * steps
        for b, a in zip(backward, first, strict=True):
            assert b["ts"] <= a["ts"] < b["ts"] + b["dur"], (b, a)  # issued while backward was running
