"""Each collective as nccl-tests runs it, through commlib's public API: the call, its inputs, its expected output.

Out-of-place uses a send and a receive buffer; in-place uses one buffer with
nccl-tests' offsets (all_gather: the input is the rank's chunk of the output;
reduce_scatter and scatter: the output is the rank's chunk of the input). The
torch.distributed API has no out-of-place all_reduce, broadcast or reduce: out
of place, those copy the input into the output buffer and run in place on it,
which is what a torch user does to keep the input (the copy is timed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import commlib as dist
from commlib import ReduceOp
from commlib.bench import _data
from commlib.bench._specs import Layout

__all__ = ["Case", "checked", "expected", "fill", "make_call", "output_region"]


@dataclass(frozen=True, slots=True)
class Case:
    """One measurement: which collective, on what, from where, in or out of place, by which rank."""

    name: str
    dtype: np.dtype
    op: ReduceOp | None
    root: int  # -1 where the collective has none
    rank: int
    nranks: int
    lay: Layout
    in_place: bool


def _views(case: Case, send: Any, recv: Any, shift: int) -> tuple[Any, Any]:
    """Typed (input, output) arrays at byte ``shift`` of the byte buffers, per nccl-tests' pointers."""
    size, lay, r = case.dtype.itemsize, case.lay, case.rank
    if case.in_place:
        send, s0, r0 = recv, shift + lay.send_offset * r * size, shift + lay.recv_offset * r * size
    else:
        s0 = r0 = shift
    inp = send[s0 : s0 + lay.send_count * size].view(case.dtype)
    out = recv[r0 : r0 + lay.recv_count * size].view(case.dtype)
    if case.in_place and s0 == r0 and inp.size == out.size:
        inp = out  # the same array object: calls that take one tensor see exactly one
    return inp, out


def _chunks(a: Any, n: int) -> list[Any]:
    k = a.size // n
    return [a[i * k : (i + 1) * k] for i in range(n)]


def _copy_then(first: Callable[[], object] | None, then: Callable[[], object]) -> Callable[[], object]:
    if first is None:
        return then
    return lambda: (first(), then())


def make_call(case: Case, send: Any, recv: Any, shift: int, xp: Any = np) -> Callable[[], object]:
    """A zero-argument function that runs the collective once on the buffers at byte ``shift``."""
    inp, out = _views(case, send, recv, shift)
    name, n, r, root, op = case.name, case.nranks, case.rank, case.root, case.op
    copy = None if inp is out else (lambda: xp.copyto(out, inp))
    if name == "all_reduce":
        return _copy_then(copy, lambda: dist.all_reduce(out, op))
    if name == "reduce":
        return _copy_then(copy, lambda: dist.reduce(out, root, op))
    if name == "broadcast":
        return _copy_then(copy if r == root else None, lambda: dist.broadcast(out, root))
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, inp)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, inp, op)
    if name == "all_to_all":
        return lambda: dist.all_to_all_single(out, inp)
    if name == "gather":
        parts = _chunks(out, n) if r == root else None
        return lambda: dist.gather(inp, parts, root)
    if name == "scatter":
        parts = _chunks(inp, n) if r == root else None
        return lambda: dist.scatter(out, parts, root)
    return _sendrecv(inp, out, r, n, xp)


def _sendrecv(inp: Any, out: Any, r: int, n: int, xp: Any) -> Callable[[], object]:
    """The ring step of nccl-tests' sendrecv: send to rank+1 and receive from rank-1, together."""
    if n == 1:  # commlib refuses to send to oneself; NCCL's self-send is a copy
        return lambda: xp.copyto(out, inp)
    ops = [dist.P2POp(dist.isend, inp, (r + 1) % n), dist.P2POp(dist.irecv, out, (r - 1) % n)]

    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return run


def checked(case: Case) -> bool:
    """Whether this measurement's output is checked: not sendrecv in place (input and output are one
    buffer, which nccl-tests does not check either)."""
    return not (case.name == "sendrecv" and case.in_place)


def _input(case: Case, seed: int) -> np.ndarray:
    """This rank's input elements (host), in the global element numbering ``expected`` uses."""
    lay, r = case.lay, case.rank
    start = r * lay.send_count if case.name in ("all_gather", "gather") else 0
    return _data.inputs(case.op, case.dtype, seed, r, case.nranks, start, lay.send_count)


def fill(case: Case, send: Any, recv: Any, seed: int, xp: Any = np) -> None:
    """Zero the output side and write this rank's inputs where the call at shift 0 reads them."""
    size, lay = case.dtype.itemsize, case.lay
    recv[: lay.size_bytes(size)] = 0
    inp, _ = _views(case, send, recv, 0)
    inp[...] = xp.asarray(_input(case, seed))


def output_region(case: Case, recv: Any) -> Any:
    """The elements the check reads: the output at shift 0."""
    return _views(case, recv, recv, 0)[1]  # the output never depends on the send buffer


def _reducing(case: Case) -> ReduceOp:
    if case.op is None:
        raise ValueError(f"commlib.bench: {case.name} reduces, but its case has no op")
    return case.op


def expected(case: Case, seed: int) -> np.ndarray:
    """What ``output_region`` must hold after the call, computed locally from every rank's known inputs."""
    name, lay, n, r, root, dt = case.name, case.lay, case.nranks, case.rank, case.root, case.dtype
    k = lay.param_count
    if name == "all_reduce" or (name == "reduce" and r == root):
        return _data.reduced(_reducing(case), dt, seed, n, 0, lay.recv_count)
    if name == "reduce":  # a non-root's output buffer holds its own input (copied there, or in place)
        return _input(case, seed)
    if name == "broadcast":
        return _data.inputs(None, dt, seed, root, n, 0, lay.recv_count)
    if name == "reduce_scatter":
        return _data.reduced(_reducing(case), dt, seed, n, r * k, k)
    if name == "all_gather" or (name == "gather" and r == root):
        return np.concatenate([_data.inputs(None, dt, seed, q, n, q * k, k) for q in range(n)])
    if name == "gather":  # nccl-tests: a non-root's buffer keeps what it had (zeros, and in place its input)
        want = np.zeros(lay.recv_count, dt)
        if case.in_place:
            want[r * k : (r + 1) * k] = _input(case, seed)
        return want
    if name == "all_to_all":
        return np.concatenate([_data.inputs(None, dt, seed, q, n, r * k, k) for q in range(n)])
    if name == "scatter":
        return _data.inputs(None, dt, seed, root, n, r * k, k)
    return _data.inputs(None, dt, seed, (r - 1) % n, n, 0, lay.recv_count)  # sendrecv
