"""The automatic planner's prices, without processes: a sharded parameter's gather priced as the weights plan
runs it (not as boxing steps), a collective with and without a boxing step's overhead, the machine's
timings taken as the least of their runs (other jobs on a shared machine only ever add time), and the memory
a step really holds: the inputs' batches, an operator's forward transients, the allocator's overhead per tensor."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from globalview import _machine
from globalview._machine import Machine
from globalview._placement import placement
from globalview._price import BUCKET_BYTES, LONE_BYTES, Pricer
from globalview._trace import Tensor, Trace
from globalview.sbp import broadcast, partial_sum, split

STEP = 0.5  # a boxing step's overhead, seconds: large, so that pricing it where it does not run shows
GATHER = 1e-4  # the weights plan's overhead per gather


def _machine_for_test() -> Machine:
    line = [(1 << 12, 1e-5), (1 << 27, 1e-2)]
    comm = {f"{k}/2": line for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    return Machine("test", comm, step_overhead=STEP, gather_overhead=GATHER, bandwidth=1e10)


def _pricer() -> Pricer:
    return Pricer(Trace(placement("cpu", [0, 1]), [], {}, []), _machine_for_test(), 2)


def test_collective_adds_the_boxing_overhead_only_for_boxing() -> None:
    m = _machine_for_test()
    raw = m.collective("all_gather", 2, 1 << 20, boxing=False)
    assert 1e-5 < raw < 1e-2
    assert m.collective("all_gather", 2, 1 << 20) == pytest.approx(raw + STEP)
    assert m.collective("all_gather", 1, 1 << 20) == 0.0


@pytest.mark.parametrize("rows", [128, 2048])
def test_a_sharded_weight_is_priced_as_the_weights_plan_runs_it(rows: int) -> None:
    """Gathered in forward and again in backward (collective + the plan's overhead), its gradient reduce_scattered
    at a bucket's rate (copied into the bucket when small): no boxing step's overhead anywhere."""
    p, m = _pricer(), _machine_for_test()
    shape, dtype = (rows, 128), np.dtype(np.float32)
    whole = rows * 128 * 4
    # a weight (a parameter, needs a gradient, saved for another input's gradient), split(0) -> broadcast
    edge = p._edge((shape, dtype, True, True, True, True, False, False), (split(0),), (broadcast,))
    gather = m.collective("all_gather", 2, whole, boxing=False) + GATHER
    scatter = m.collective("reduce_scatter", 2, BUCKET_BYTES, boxing=False) * whole / BUCKET_BYTES
    scatter += 2 * whole / m.bandwidth if whole < LONE_BYTES else 0.0
    assert edge.time == pytest.approx(2 * gather + scatter)
    assert edge.time < STEP
    # the same gather of an activation is a boxing step (and its adjoint another)
    act = p._edge((shape, dtype, True, False, True, True, False, False), (split(0),), (broadcast,))
    assert act.time > 2 * STEP


def test_a_weight_not_needed_again_in_backward_is_gathered_once() -> None:
    """A first layer's weight (no other input needs a gradient) is not gathered again in backward."""
    p, m = _pricer(), _machine_for_test()
    shape, dtype = (128, 128), np.dtype(np.float32)
    edge = p._edge((shape, dtype, True, True, True, False, False, False), (split(0),), (broadcast,))
    gather = m.collective("all_gather", 2, 128 * 128 * 4, boxing=False) + GATHER
    assert gather < edge.time < 2 * gather


def test_the_optimizer_is_priced_at_the_rate_measured_for_the_parameters_size() -> None:
    """Per parameter plus bytes at the rate of that size: log-log between the measured sizes, the nearest beyond;
    unmeasured states: None (the pricer falls back to passes over memory)."""
    m = _machine_for_test()
    m.optimizer = {"2": (1e-5, ((1 << 20, 4e-10), (1 << 24, 1.6e-9)))}
    assert m.optimizer_step(2, 1 << 20) == pytest.approx(1e-5 + 4e-10 * (1 << 20))
    assert m.optimizer_step(2, 1 << 22) == pytest.approx(1e-5 + 8e-10 * (1 << 22))  # halfway in log size
    assert m.optimizer_step(2, 1 << 26) == pytest.approx(1e-5 + 1.6e-9 * (1 << 26))
    assert m.optimizer_step(2, 1 << 10) == pytest.approx(1e-5 + 4e-10 * (1 << 10))
    assert m.optimizer_step(0, 1 << 20) is None


def test_timings_are_the_least_of_their_runs() -> None:
    """A run slowed by another job (a rank descheduled mid-call) does not count: the least run is the machine's."""
    runs = iter([(9.0, 9.0), (3.0, 5.0), (7.0, 1.0), (4.0, 2.0)])
    assert _machine._least(lambda: next(runs), 3) == (3.0, 1.0)  # the first run is a warm-up


def test_the_inputs_are_held_as_batches_in_their_own_layout() -> None:
    """The caller holds the step's batch and the next one, split(0) as given, whatever the operators box them to;
    an operator that saves a forward input as it came adds nothing (the batch is counted once)."""
    x = Tensor((8, 16), np.dtype(np.float32), (split(0),), False)
    trace = Trace(placement("cpu", [0, 1]), [], {"input:0": x}, [])
    p = Pricer(trace, _machine_for_test(), 2)
    assert p.held() == 2 * 4 * 16 * 4  # two batches of this rank's 4 rows
    assert Pricer(trace, _machine_for_test(), 2, batches=1).held() == 4 * 16 * 4


def test_an_activation_boxed_in_forward_is_a_transient_with_its_source() -> None:
    """An input no operator keeps (a partial sum on its way to a reduce_scatter) and its boxed copy, when the
    operator does not save it, are alive together while the operator runs forward."""
    p = _pricer()
    shape, dtype = (1024, 128), np.dtype(np.float32)
    whole = 1024 * 128 * 4
    edge = p._edge((shape, dtype, True, False, False, False, False, True), (partial_sum,), (split(1),))
    assert edge.peak == whole + whole // 2 and edge.mem == 0.0
    kept = p._edge((shape, dtype, True, False, True, False, False, False), (partial_sum,), (split(1),))
    assert kept.peak == 0.0 and kept.mem == whole // 2  # saved: kept for backward, not a transient


def test_the_footprint_adds_the_allocators_overhead_per_tensor() -> None:
    """A tensor costs its bytes and the overhead measured at the largest size at or below them."""
    p = Pricer(
        Trace(placement("cpu", [0, 1]), [], {}, []), _machine_for_test(), 2, overheads=((1024, 600.0), (65536, 4096.0))
    )
    assert p.footprint(0) == 0.0
    assert p.footprint(512) == 512 + 600.0
    assert p.footprint(32768) == 32768 + 600.0
    assert p.footprint(1 << 20) == (1 << 20) + 4096.0
    assert _pricer().footprint(1 << 20) == 1 << 20  # nothing measured: the bytes


def test_overheads_are_measured_in_this_process() -> None:
    """Each measured size gets a non-negative overhead per tensor (read from the resident memory on Linux)."""
    from globalview._footprint import SIZES, overheads

    got = overheads()
    assert got == () or [n for n, _ in got] == [n for n, _ in SIZES]
    assert all(over >= 0 for _, over in got)


def test_a_pricer_and_its_caches_go_when_its_planning_is_done() -> None:
    """Its caches are its own: ``functools.cache`` on its methods kept every pricer, and its trace, for good."""
    p = _pricer()
    p._edge(((64, 64), np.dtype(np.float32), True, True, True, True, False, False), (split(0),), (broadcast,))
    assert p.local((64, 64), (split(0),)) == (32, 64)
    gone = weakref.ref(p)
    del p
    gc.collect()
    assert gone() is None
