"""The public API: every exported name resolves, and shared names keep torch.distributed's signatures."""

from __future__ import annotations

import inspect

import pytest

import commlib

# Read from torch 2.13.0+cpu with inspect.signature, annotations dropped (shared/reference/).
# ruff: noqa: E501
TORCH_SIGNATURES = """
init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, group_name='', pg_options=None, device_id=None)
destroy_process_group(group=None)
is_initialized()
is_available()
is_mpi_available()
is_nccl_available()
get_rank(group=None)
get_world_size(group=None)
get_backend(group=None)
new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None, device_id=None, sort_ranks=True)
get_global_rank(group, group_rank)
get_group_rank(group, global_rank)
all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False)
broadcast(tensor, src=None, group=None, async_op=False, group_src=None)
reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None)
all_gather(tensor_list, tensor, group=None, async_op=False)
all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False)
reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False)
reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False)
all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False)
all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False)
gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None)
scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None)
send(tensor, dst=None, group=None, tag=0, group_dst=None)
recv(tensor, src=None, group=None, tag=0, group_src=None)
isend(tensor, dst=None, group=None, tag=0, group_dst=None)
irecv(tensor, src=None, group=None, tag=0, group_src=None)
batch_isend_irecv(p2p_op_list)
barrier(group=None, async_op=False, device_ids=None, timeout=None)
monitored_barrier(group=None, timeout=None, wait_all_ranks=False)
broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None)
all_gather_object(object_list, obj, group=None)
gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None)
scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None, group_src=None)
P2POp(op, tensor, peer=None, group=None, tag=0, group_peer=None)
all_gather_single(output_tensor, input_tensor, group=None, async_op=False)
reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False)
get_process_group_ranks(group)
"""
EXPECTED = {line.split("(")[0]: line for line in TORCH_SIGNATURES.strip().splitlines()}


def _render(name: str, obj: object) -> str:
    params = []
    for p in inspect.signature(obj).parameters.values():
        if p.name.startswith("_"):  # torch's private extras (e.g. init_process_group's _ranks)
            continue
        params.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return f"{name}({', '.join(params)})"


def test_every_exported_name_resolves() -> None:
    missing = [name for name in commlib.__all__ if not hasattr(commlib, name)]
    assert missing == []
    assert len(set(commlib.__all__)) == len(commlib.__all__)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_signature_matches_torch_distributed(name: str) -> None:
    assert name in commlib.__all__
    assert _render(name, getattr(commlib, name)) == EXPECTED[name]


def test_reduce_op_members() -> None:
    assert [op.name for op in commlib.ReduceOp] == ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]


def test_work_contract() -> None:
    assert list(inspect.signature(commlib.Work.wait).parameters) == ["self", "timeout"]
    assert callable(commlib.Work.is_completed)


def test_oneflow_env_names() -> None:
    for name in ("get_world_size", "get_rank", "get_local_rank", "get_node_size"):
        assert callable(getattr(commlib.env, name))


def test_every_public_callable_has_a_docstring() -> None:
    undocumented = [n for n in commlib.__all__ if callable(getattr(commlib, n)) and not getattr(commlib, n).__doc__]
    assert undocumented == []


def test_signatures_match_installed_torch_when_present() -> None:
    """When torch is installed, compare against it live too (guards the recorded table above)."""
    dist = pytest.importorskip("torch.distributed")
    for name, line in EXPECTED.items():
        if name == "P2POp":
            continue
        theirs = _render(name, getattr(dist, name)).replace("<RedOpType.SUM: 0>", "ReduceOp.SUM")
        assert theirs == line, (theirs, line)
