"""torch.distributed's behaviour where scripts rely on it: a call after ``destroy_process_group()`` raises (no
silent re-joining), ``get_backend()`` names what was asked for, ``Backend.register_backend`` / ``backend_list``,
``HashStore`` (checked against torch's own), ``DistStoreError`` / ``DistNetworkError``.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

import commlib
from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

AFTER_DESTROY = "the default process group was destroyed by destroy_process_group(); call init_process_group()"


def destroy_job() -> dict[str, str]:
    """Implicit join, destroy, every kind of call refused (ValueError, as torch's), init again, destroy again."""
    import commlib as dist

    problems: dict[str, str] = {}
    before = dist.is_initialized()
    dist.get_rank()  # a program's first call joins the job (documented; torch would raise here)
    if before or not dist.is_initialized():
        problems["implicit join"] = f"initialised before {before}, after {dist.is_initialized()}"
    sub = dist.new_group([0, 1])
    dist.destroy_process_group()
    calls = {
        "all_reduce": lambda: dist.all_reduce(np.ones(2)),
        "broadcast": lambda: dist.broadcast(np.ones(2), src=0),
        "barrier": dist.barrier,
        "get_rank": dist.get_rank,
        "get_world_size": dist.get_world_size,
        "get_backend": dist.get_backend,
        "new_group": lambda: dist.new_group([0, 1]),
        "all_gather_object": lambda: dist.all_gather_object([None, None], 1),
    }
    for call, fn in calls.items():
        try:
            fn()
            problems[call] = "no error after destroy_process_group()"
        except ValueError as e:
            if f"{call}: {AFTER_DESTROY}" not in str(e):
                problems[call] = f"unclear: {e}"
    try:
        dist.all_reduce(np.ones(2), group=sub)
        problems["old sub-group"] = "no error"
    except commlib.CommError as e:
        if "has been destroyed" not in str(e):
            problems["old sub-group"] = str(e)
    if dist.is_initialized():
        problems["is_initialized after destroy"] = "True"
    dist.init_process_group("gloo")
    x = np.ones(2)
    dist.all_reduce(x)
    if x.tolist() != [2.0, 2.0] or dist.get_backend() != "gloo" or dist.get_backend(dist.new_group([1, 0])) != "gloo":
        problems["init again as gloo"] = f"{x.tolist()}, backend {dist.get_backend()!r}"
    dist.destroy_process_group()
    for asked, reported in (("mpi", "mpi"), (None, "mpi"), ("auto", "mpi")):
        dist.init_process_group(asked)
        if dist.get_backend() != reported:
            problems[f"get_backend after {asked!r}"] = dist.get_backend()
        dist.destroy_process_group()
    try:
        dist.barrier()
        problems["barrier after the second destroy"] = "no error"
    except ValueError:
        pass
    return problems


def test_calls_after_destroy_raise_and_get_backend_names_what_was_asked() -> None:
    assert run(destroy_job, 2, timeout=60) == [{}, {}]


def test_backend_register_backend_as_torchs() -> None:
    """torch's names and refusals; a creator that makes no commlib backend (a torch ProcessGroup's, here None) is
    refused when the group is made, saying why (a registered backend that works: tests/test_registry.py)."""
    dist = pytest.importorskip("torch.distributed")
    from commlib import backends

    def creator(*args: Any) -> None:
        return None

    assert commlib.Backend.backend_list == ["gloo", "nccl", "mpi"]
    assert set(commlib.Backend.backend_list) <= set(dist.Backend.backend_list)
    try:
        commlib.Backend.register_backend("Fancy", creator, devices=["cpu"])
        commlib.Backend.register_backend("fancy", creator, extended_api=True, devices="cpu")  # again: no change
        assert commlib.Backend.FANCY == "fancy" and commlib.Backend("FANCY") == "fancy"  # type: ignore[attr-defined]
        assert commlib.Backend.backend_list == ["gloo", "nccl", "mpi", "fancy"]
        assert commlib.is_backend_available("fancy")
        spec = backends.find("FANCY")
        assert spec is not None and spec.name == "fancy"
        place = backends.Place(0, 1, 0, 5.0, meeting=None, store=commlib.HashStore())
        with pytest.raises(TypeError, match=re.escape("backend 'fancy''s creator returned NoneType, not a commlib")):
            spec.world(place)
    finally:
        backends.unregister("fancy")
        commlib.Backend.backend_list.remove("fancy")
        delattr(commlib.Backend, "FANCY")
    assert not commlib.is_backend_available("fancy")
    with pytest.raises(ValueError, match="'gloo' is one of commlib's own backends"):
        commlib.Backend.register_backend("gloo", creator)
    with pytest.raises(TypeError, match=re.escape("Backend.register_backend: func must be callable")):
        commlib.Backend.register_backend("other", None)
    with pytest.raises(TypeError, match=re.escape("Backend.register_backend: name must be a non-empty str, got 3")):
        commlib.Backend.register_backend(3, creator)  # type: ignore[arg-type]


def _store_story(store: Any) -> list[Any]:
    """The same calls on commlib's HashStore and torch's: every answer must agree."""
    out: list[Any] = []
    store.set("a", "1")
    store.set("b", b"x")
    out += [store.get("a"), store.get("b"), store.add("n", 3), store.add("n", -1), store.get("n")]
    out += [store.compare_set("b", "x", "y"), store.compare_set("b", "x", "z"), store.get("b")]
    out += [store.compare_set("missing", "", "new"), store.compare_set("absent", "old", "new")]
    out += [store.check(["a", "b"]), store.check(["a", "nope"]), store.num_keys()]
    out += [store.delete_key("a"), store.delete_key("a"), store.check(["a"]), store.num_keys()]
    threading.Timer(0.1, store.set, ("late", "v")).start()
    out.append(store.get("late"))  # set by another thread while get waits
    store.set_timeout(timedelta(seconds=0.2))
    for call in (lambda: store.get("never"), lambda: store.wait(["never"])):
        try:
            call()
            out.append("no timeout")
        except RuntimeError as e:  # torch: DistStoreError; commlib: CommTimeoutError; both DistError
            out.append(type(e).__name__ if type(e).__name__ == "DistStoreError" else "timeout")
    return out


def test_hash_store_answers_as_torchs() -> None:
    dist = pytest.importorskip("torch.distributed")
    theirs = _store_story(dist.HashStore())
    ours = _store_story(commlib.HashStore())
    assert ours[:-2] == theirs[:-2]
    assert theirs[-2:] == ["DistStoreError"] * 2 and ours[-2:] == ["timeout"] * 2


def test_dist_store_and_network_errors_catch_commlibs() -> None:
    store = commlib.HashStore()
    store.set_timeout(0.05)
    with pytest.raises(commlib.DistStoreError, match=r"HashStore.get: timed out after 0.05 s waiting for keys"):
        store.get("never")
    assert issubclass(commlib.CommTimeoutError, commlib.DistNetworkError)
    assert issubclass(commlib.DistStoreError, commlib.DistError) and issubclass(commlib.DistStoreError, RuntimeError)
    with pytest.raises(TypeError, match=re.escape("HashStore.add: amount must be an int, got 1.5")):
        store.add("n", 1.5)  # type: ignore[arg-type]


def test_a_single_process_world_on_a_hash_store() -> None:
    """torch's idiom for a one-process job: ``init_process_group(store=HashStore(), rank=0, world_size=1)``."""
    run_result = run(_hash_store_world, 1, timeout=60)
    assert run_result == [([3.0], "gloo", 1)]


def _hash_store_world() -> tuple[list[float], str, int]:
    import commlib as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = np.array([3.0])
    dist.all_reduce(x)
    out = (x.tolist(), dist.get_backend(), dist.get_world_size())
    dist.destroy_process_group()
    return out
