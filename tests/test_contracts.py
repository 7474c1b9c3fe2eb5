"""One contract per concept, checked on real ranks: the dtype table every layer shares, groups that end with
their world, and the backend contract the group layer calls without probing."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from reference import ALL_DTYPES, BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)


def layers_job(backend: str) -> dict[str, dict[str, str]]:
    """Every dtype commlib moves, through commlib (numpy and torch), globalview and ddp: "ok" or the error."""
    import torch

    import commlib
    import ddp
    import globalview as gv
    from commlib import arrays

    me, n = commlib.get_rank(), commlib.get_world_size()
    placement = gv.placement("cuda" if backend == "nccl" else "cpu", list(range(n)))
    out: dict[str, dict[str, str]] = {}
    for d in arrays.DTYPES:
        x = (np.arange(2) + me + 1).astype(d)
        want = np.concatenate([(np.arange(2) + r + 1).astype(d) for r in range(n)])
        got: dict[str, str] = {}
        for layer, check in (
            ("commlib", lambda x=x: _gathered(commlib, x, n)),
            ("torch", lambda x=x: _gathered(commlib, arrays.from_array(x, like=torch.empty(0)), n)),
            ("globalview", lambda x=x: gv.to_global(x, placement=placement, sbp=gv.sbp.split(0)).numpy()),
        ):
            try:
                result = arrays.to_host(arrays.as_array(check()))
                got[layer] = "ok" if result.dtype == d and np.array_equal(result, want) else f"wrong: {result!r}"
            except Exception as e:
                got[layer] = f"{type(e).__name__}: {e}"
        got["ddp"] = _ddp(ddp, arrays, d, n)
        out[str(d)] = got
    return out


def _gathered(commlib, x, n):
    out = x.new_zeros(2 * n) if hasattr(x, "new_zeros") else np.zeros(2 * n, x.dtype)
    commlib.all_gather_into_tensor(out, x)
    return out


def _ddp(ddp, arrays, d: np.dtype, n: int) -> str:
    """Inexact dtypes are averaged like any gradient; the others are refused as gradients, by name."""
    try:
        reducer = ddp.Reducer([np.zeros(3, d)])
        reducer.ready(0, np.ones(3, d))
        (grad,) = reducer.finalize()
        return "ok" if np.array_equal(np.asarray(grad, np.float64), np.ones(3)) else f"wrong: {grad!r}"
    except TypeError as e:
        refused = arrays.kind(d) not in ("float", "complex") and "must be floating point" in str(e)
        return "refused as a gradient" if refused else f"TypeError: {e}"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_layer_takes_every_dtype_commlib_moves(backend: str) -> None:
    results = run(layers_job, 2, backend, timeout=120, env=BACKENDS[backend])
    for rank, table in enumerate(results):
        for dtype, layers in table.items():
            inexact = dtype.startswith(("float", "bfloat", "complex"))
            expected = {"commlib": "ok", "torch": "ok", "globalview": "ok", "ddp": "ok" if inexact else ""}
            expected["ddp"] = expected["ddp"] or "refused as a gradient"
            assert layers == expected, (backend, rank, dtype, layers)


def test_the_test_oracle_and_commlib_list_the_same_dtypes() -> None:
    from commlib import arrays

    assert list(arrays.DTYPES) == ALL_DTYPES


def test_torch_and_names_map_onto_the_table() -> None:
    torch = pytest.importorskip("torch")
    from commlib import arrays

    for d in arrays.DTYPES:
        assert arrays.numpy_dtype(arrays.torch_dtype(d)) == d
        assert arrays.numpy_dtype(str(d)) == d
    assert arrays.numpy_dtype(torch.bfloat16) == arrays.bfloat16
    with pytest.raises(TypeError, match=r"dtype torch.float8_e4m3fn is not one commlib moves; supported: int8"):
        arrays.numpy_dtype(torch.float8_e4m3fn)


def test_torch_round_trip_shares_memory_bfloat16_included() -> None:
    torch = pytest.importorskip("torch")
    from commlib import arrays

    for dtype in (torch.bfloat16, torch.float32, torch.uint16, torch.bool):
        t = torch.zeros(3, dtype=dtype)
        a = arrays.as_array(t)
        back = arrays.from_array(a, like=t)
        back[1] = 1
        assert t[1].item() == 1 and back.dtype == dtype and a.dtype == arrays.numpy_dtype(dtype)


def reinit_job(backend: str) -> list[list[float]]:
    """destroy_process_group, init again, and global tensors on a sub-placement still work (twice)."""
    import commlib
    import globalview as gv

    seen = []
    for _ in range(2):
        commlib.init_process_group(backend)
        placement = gv.placement("cuda" if backend == "nccl" else "cpu", [0, 1])  # a group of its own
        x = gv.to_global(np.full(2, commlib.get_rank() + 1.0), placement=placement, sbp=gv.sbp.split(0))
        seen.append(x.to_global(sbp=gv.sbp.broadcast).numpy().tolist())
        commlib.destroy_process_group()
    return seen


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_global_tensors_work_after_destroy_and_init_again(backend: str) -> None:
    """Was: CommError "group 'group1' has been destroyed" (globalview cached groups of the old world)."""
    results = run(reinit_job, 3, backend, timeout=120, env=BACKENDS[backend])
    assert results == [[[1.0, 1.0, 2.0, 2.0]] * 2] * 3


def subgroups_job() -> list:
    """commlib.groups.subgroup: one group per ranks tuple, the world for all ranks, forgotten with the world."""
    import commlib
    import commlib.groups

    commlib.init_process_group("mpi")
    a, b = commlib.groups.subgroup([1, 0]), commlib.groups.subgroup((1, 0))
    world = commlib.groups.subgroup(range(commlib.get_world_size()))
    x = np.ones(1)
    commlib.all_reduce(x, group=a)
    commlib.destroy_process_group()
    commlib.init_process_group("mpi")
    c = commlib.groups.subgroup([1, 0])
    out = [a is b, world is not None and world.name == "world", c is not a, c.backend is not None, float(x[0])]
    commlib.destroy_process_group()
    return out


def test_subgroups_are_made_once_per_world() -> None:
    assert run(subgroups_job, 2, timeout=60) == [[True, True, True, True, 2.0]] * 2


def test_backends_declare_the_contract_and_implement_every_abstract_method() -> None:
    from commlib.backends.base import Backend
    from commlib.backends.mpi import MpiBackend
    from commlib.backends.nccl import NcclBackend

    for cls in (MpiBackend, NcclBackend):
        assert issubclass(cls, Backend) and not inspect.isabstract(cls), cls
    documented = [name for name, f in vars(Backend).items() if callable(f) and not name.startswith("_")]
    assert all(getattr(Backend, name).__doc__ for name in documented), documented


def test_the_group_layer_never_probes_a_backend() -> None:
    """The contract is called, not discovered: no hasattr, no getattr with a fallback, anywhere in the group layer."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "commlib"
    layer = ["_group.py", "_world.py", "_collectives.py", "_composed.py", "_p2p.py", "_barrier.py", "_objects.py"]
    offenders = []
    for name in layer:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
                if probe:
                    offenders.append(f"{name}:{node.lineno}")
    assert offenders == []


def bfloat16_job(backend: str) -> list:
    """globalview.to_global of a bfloat16 array (commlib moves it; globalview had a table of its own)."""
    import ml_dtypes

    import commlib
    import globalview as gv

    me, n = commlib.get_rank(), commlib.get_world_size()
    placement = gv.placement("cuda" if backend == "nccl" else "cpu", list(range(n)))
    x = gv.to_global(np.full(2, me + 1, ml_dtypes.bfloat16), placement=placement, sbp=gv.sbp.split(0))
    return [str(x.dtype), x.to_global(sbp=gv.sbp.broadcast).numpy().astype(np.float32).tolist()]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_global_tensors_take_bfloat16(backend: str) -> None:
    """Was: TypeError "globalview.to_global: dtype bfloat16 is not supported"."""
    assert run(bfloat16_job, 2, backend, timeout=60, env=BACKENDS[backend]) == [["bfloat16", [1, 1, 2, 2]]] * 2
