"""Scenarios for torch's DDP, FSDP2 and DTensor on ``backend="commlib"`` (run by test_torch_backend.py's jobs).

Each returns ``{scenario: problem}``: equal to gloo, and to one process on the whole batch.
"""

from __future__ import annotations


def _mlp(dtype):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)


def _batch(rank: int, dtype):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 8, generator=g, dtype=dtype), torch.randn(6, 4, generator=g, dtype=dtype)


def _train(model, x, y, steps: int) -> list:  # type: ignore[no-untyped-def]
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in getattr(model, "module", model).parameters()]


def _close(xs: list, ys: list, rtol: float, atol: float) -> bool:
    import torch

    return all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(xs, ys, strict=True))


def _ddp(n: int, r: int, gloo) -> dict:  # type: ignore[no-untyped-def]
    """DDP modes, 6 steps in float64: commlib == gloo, and == one process on the concatenated batch."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    f64 = torch.float64
    whole = [torch.cat([_batch(k, f64)[i] for k in range(n)]) for i in (0, 1)]
    single = _train(_mlp(f64), *whole, steps=6)
    problems = {}
    for mode in ("DDP", "DDP fp16_compress_hook", "DDP gradient_as_bucket_view"):
        params = {}
        for name, pg in (("commlib", None), ("gloo", gloo)):
            # tiny buckets: several bucket all-reduces per backward, overlapping it
            model = DDP(_mlp(f64), process_group=pg, bucket_cap_mb=0.0005, gradient_as_bucket_view="view" in mode)
            if "fp16" in mode:
                model.register_comm_hook(pg, fp16_compress_hook)
            params[name] = _train(model, *_batch(r, f64), steps=6)
        # 3+ ranks: MPI and gloo may add the ranks' gradients in another order (float rounding); float16
        # sums: commlib adds in float32 and rounds once, gloo rounds after every addition
        tol = (1e-2, 1e-3) if "fp16" in mode else (1e-6, 1e-12)
        if not _close(params["commlib"], params["gloo"], *tol):
            problems[mode] = "parameters differ from gloo's"
        elif not _close(params["commlib"], single, *tol):
            problems[mode] = "parameters differ from single-process training on the whole batch"
    return problems


def _fsdp(r: int, gloo) -> dict:  # type: ignore[no-untyped-def]
    """FSDP2 fully_shard on each layer and the root, 3 steps, fp32 and bf16 mixed precision: equal to gloo."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def train(mesh, mp):  # type: ignore[no-untyped-def]
        model = _mlp(torch.float32)
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh, mp_policy=mp)
        _train(model, *_batch(r, torch.float32), steps=3)
        return [p.full_tensor() for p in model.parameters()]

    problems = {}
    meshes = {"commlib": init_device_mesh("cpu", (torch.distributed.get_world_size(),)), "gloo": None}
    meshes["gloo"] = DeviceMesh.from_group(gloo, "cpu")
    for label, mp in (("fp32", MixedPrecisionPolicy()), ("bf16", MixedPrecisionPolicy(torch.bfloat16, torch.float32))):
        ours, theirs = train(meshes["commlib"], mp), train(meshes["gloo"], mp)
        if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours, theirs, strict=True)):
            problems[f"FSDP2 {label}"] = "parameters differ from gloo's"
    return problems


def _dtensor(n: int, r: int) -> dict:
    """DTensor redistributions and a sharded matmul with backward: equal to the single-process result."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(1)
    a, b = torch.randn(4 * n + 1, 6), torch.randn(6, 5)  # 4n+1 rows: an uneven Shard(0)
    checks = {}
    checks["DTensor Shard(0) -> Replicate"] = lambda: torch.equal(
        distribute_tensor(a, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local(), a
    )
    partial = DTensor.from_local(torch.full((2 * n, 3), float(r + 1)), mesh, [Partial()])
    checks["DTensor Partial -> Shard(0)"] = lambda: torch.equal(
        partial.redistribute(mesh, [Shard(0)]).full_tensor(), torch.full((2 * n, 3), n * (n + 1) / 2)
    )
    checks["DTensor Shard(0) -> Shard(1)"] = lambda: torch.equal(
        distribute_tensor(a, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).full_tensor(), a
    )

    def matmul() -> bool:
        ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
        (ra @ rb).sum().backward()
        da = distribute_tensor(a, mesh, [Shard(0)]).requires_grad_()
        db = distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
        out = da @ db
        out.sum().backward()
        same = [(out.full_tensor(), a @ b), (da.grad.full_tensor(), ra.grad), (db.grad.full_tensor(), rb.grad)]
        return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in same)

    checks["DTensor sharded matmul + backward"] = matmul
    problems = {}
    for name, check in checks.items():
        try:
            if not check():
                problems[name] = "differs from the single-process result"
        except Exception as e:  # reported by scenario name
            problems[name] = f"raised {type(e).__name__}: {e}"
    return problems


def model_problems(n: int, r: int, gloo) -> dict:  # type: ignore[no-untyped-def]
    """DDP (3 modes), FSDP2 (fp32, bf16) and DTensor scenarios on the default (commlib) group."""
    return {**_ddp(n, r, gloo), **_fsdp(r, gloo), **_dtensor(n, r)}
