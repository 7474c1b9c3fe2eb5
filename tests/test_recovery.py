"""A rank dies and the job goes on: every survivor is told within 2 s, naming it; the survivors shrink the group
and compute right values on it; a newcomer joins and the group grows back; a rank that is only stopped is not
declared dead. Real processes joined through a store (as ``commlib.launch --on-failure continue`` starts them),
real SIGKILLs (tests/recovery_jobs.py)."""

from __future__ import annotations

import signal

import pytest
from recovery_jobs import Job, Kill, run, run_again_if_stalled
from reference import BACKENDS

# an all_reduce loop; the survivors of a death shrink the group and check 21 all_reduces on it
LOOP = """
dist.init_process_group(timeout=float(os.environ.get("T", "30")))
for _ in range(5):
    dist.all_reduce(np.ones(1024, np.float32))
event("ready")
try:
    while True:
        dist.all_reduce(np.ones(1024, np.float32))
except dist.RankFailedError as e:
    event("raised", failed=e.failed_ranks, error=str(e)[:400])
    dist.shrink_group(e.failed_ranks)
    n = dist.get_world_size()
    event("shrunk", now=dist.get_rank(), size=n)
    right = 0
    for i in range(21):
        y = np.full(1024, dist.get_rank() + 1.0, np.float32)
        dist.all_reduce(y)
        right += bool((y == n * (n + 1) / 2).all())
        if i == 0:
            event("first" if right else "first wrong")
    event("done", right=right)
except dist.CommTimeoutError as e:
    event("timed out", error=str(e)[:400])
"""


def _check_recovery(job: Job, victim: int, n: int) -> dict[str, list[float]]:
    """Every survivor raised naming ``victim`` within 2 s of the kill, its first all_reduce on the shrunk group was
    right within 3 s, and the 20 after it too; returns the survivors' times (s after the kill)."""
    assert not job.hung, job.report()
    (kill,) = job.kills
    survivors = job.survivors()
    assert len(survivors) == n - 1
    times: dict[str, list[float]] = {"raised": [], "shrunk": [], "first": []}
    for p in survivors:
        assert p.proc.returncode == 0, job.report()
        raised = p.first("raised")
        assert raised is not None and raised["failed"] == [victim], job.report()
        assert f"rank {victim} (global rank {victim})" in raised["error"] and "died" in raised["error"], raised
        for what in times:
            e = p.first(what)
            assert e is not None, job.report()
            times[what].append(e["t"] - kill.at)
        assert p.first("done")["right"] == 21, job.report()
    assert max(times["raised"]) < 2.0, times
    assert max(times["first"]) < 3.0, times
    return times


@pytest.mark.parametrize(("n", "backend"), [(4, "mpi"), (8, "mpi"), (4, "nccl")])
def test_every_survivor_is_told_within_2_s_and_the_shrunk_group_is_right(n: int, backend: str) -> None:
    job = run_again_if_stalled(n, LOOP, kills=[Kill([2], "ready", delay=0.3)], env=BACKENDS[backend], deadline=120)
    times = _check_recovery(job, 2, n)
    print(f"\n{n} ranks, {backend}: s after the kill: " + ", ".join(f"{k} {max(v):.2f}" for k, v in times.items()))


def test_the_death_of_the_rank_that_serves_the_store() -> None:
    # rank 0 serves the rendezvous store (plain env://): the survivors still agree (over their lifelines) and go on
    job = run_again_if_stalled(4, LOOP, kills=[Kill([0], "ready", when_rank=1, delay=0.3)], store="rank0")
    _check_recovery(job, 0, 4)


TORCH_LOOP = """
import datetime
import torch
import torch.distributed as tdist
tdist.init_process_group(backend="commlib", timeout=datetime.timedelta(seconds=30))
for _ in range(5):
    tdist.all_reduce(torch.ones(1024))
event("ready")
try:
    while True:
        tdist.all_reduce(torch.ones(1024))
except dist.RankFailedError as e:
    event("raised", failed=e.failed_ranks, error=str(e)[:400])
    pg = tdist.shrink_group(e.failed_ranks)
    n = tdist.get_world_size()
    event("shrunk", now=tdist.get_rank(), size=n, default=pg is tdist.group.WORLD)
    right = 0
    for i in range(21):
        y = torch.full((1024,), tdist.get_rank() + 1.0)
        tdist.all_reduce(y)
        right += bool((y == n * (n + 1) / 2).all())
        if i == 0:
            event("first" if right else "first wrong")
    event("done", right=right)
    tdist.destroy_process_group()
"""


def test_torch_shrink_group_on_the_commlib_backend() -> None:
    kills = [Kill([2], "ready", delay=0.3)]
    job = run_again_if_stalled(4, TORCH_LOOP, kills=kills, store="rank0", deadline=180)  # torch serves it
    _check_recovery(job, 2, 4)
    assert all(p.first("shrunk")["default"] for p in job.survivors())


TORCH_DDP = """
import datetime, gc
import torch
import torch.distributed as tdist
from torch import nn
torch.set_num_threads(1)
tdist.init_process_group(backend="commlib", timeout=datetime.timedelta(seconds=30))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x = torch.randn(32, 8, generator=torch.Generator().manual_seed(RANK))
y = x[:, :2] * 2.0

def step(model):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()

ddp = nn.parallel.DistributedDataParallel(net)
for _ in range(3):
    step(ddp)
event("ready")
failed = None
try:
    while True:
        step(ddp)
except RuntimeError as e:  # DDP's reducer reads the failed bucket's future in C++: torch raises its RuntimeError
    failed = str(e)[:600]
event("raised", error=failed)
del ddp
gc.collect()  # the old reducer's hooks leave the parameters with it
tdist.shrink_group([2])
ddp = nn.parallel.DistributedDataParallel(net)  # over the shrunk default group: rank 0's weights to the others
for _ in range(5):
    step(ddp)
w = torch.cat([p.detach().flatten() for p in net.parameters()])
lo, hi = w.clone(), w.clone()
tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
event("done", size=tdist.get_world_size(), same=bool(torch.equal(lo, hi)))
tdist.destroy_process_group()
"""


def test_torch_ddp_survivors_raise_naming_the_dead_rank_then_shrink_and_train() -> None:
    """torch's DDP on backend "commlib": a peer killed mid-training makes backward() raise on every survivor with
    commlib's message (before: the survivor died of a segmentation fault in DDP's reducer, which read a failed
    bucket's result as if it held tensors); the survivors shrink the group, wrap the model again and train on."""
    job = run_again_if_stalled(3, TORCH_DDP, kills=[Kill([2], "ready", delay=0.3)], store="rank0", deadline=180)
    assert not job.hung, job.report()
    survivors = job.survivors()
    assert len(survivors) == 2
    for p in survivors:
        assert p.proc.returncode == 0, job.report()  # a segmentation fault is -11
        error = p.first("raised")["error"]
        assert "RankFailedError" in error and "rank 2 (global rank 2)" in error and "died" in error, error
        assert p.first("done") == {**p.first("done"), "size": 2, "same": True}, job.report()


GROW = """
dist.init_process_group(timeout=30)
if RANK < 0:  # the newcomer: the members took it in
    event("joined", now=dist.get_rank(), size=dist.get_world_size())
    state = np.zeros(8, np.float32)
    dist.broadcast(state, 0)  # the members' state
else:
    state = np.arange(8, dtype=np.float32)
    for _ in range(5):
        dist.all_reduce(np.ones(4, np.float32))
    event("ready")
    try:
        while True:
            dist.all_reduce(np.ones(4, np.float32))
    except dist.RankFailedError as e:
        dist.shrink_group(e.failed_ranks)
        event("shrunk", size=dist.get_world_size())
    while dist.get_world_size() < 4:  # take newcomers in between steps, as a training loop would
        dist.all_reduce(np.ones(4, np.float32))
        dist.grow_group(at_most=4 - dist.get_world_size())  # the rank it lost: a second newcomer waits on
    dist.broadcast(state, 0)
n = dist.get_world_size()
right = 0
for _ in range(20):
    y = np.full(4, dist.get_rank() + 1.0, np.float32)
    dist.all_reduce(y)
    right += bool((y == n * (n + 1) / 2).all())
event("done", right=right, size=n, now=dist.get_rank(), state=state.tolist())
"""


@pytest.mark.parametrize("backend", ["mpi", "nccl"])
def test_a_newcomer_joins_the_shrunk_group_and_receives_its_state(backend: str) -> None:
    """Two spares wait (COMMLIB_SPARE, as commlib.launch --spares starts them); grow_group(at_most=1) takes one
    in; the other is sent home, exit 0, when the job's rank 0 ends."""
    env = BACKENDS[backend] | {"COMMLIB_SPARE": "0"}
    job = run_again_if_stalled(4, GROW, kills=[Kill([2], "ready", delay=0.3)], newcomers=["shrunk", "shrunk"], env=env)
    assert not job.hung, job.report()
    done = [p.first("done") for p in job.survivors() if p.first("joined") is not None or p.rank >= 0]
    assert all(d is not None for d in done), job.report()
    assert sorted(d["now"] for d in done) == [0, 1, 2, 3], job.report()
    assert all(d["size"] == 4 and d["right"] == 20 and d["state"] == list(range(8)) for d in done), done
    newcomers = [p for p in job.processes if p.rank < 0]
    assert [p.proc.returncode for p in newcomers] == [0, 0], job.report()
    taken = [p for p in newcomers if p.first("joined") is not None]
    assert len(taken) == 1 and taken[0].first("joined")["now"] == 3, job.report()  # type: ignore[index]
    home = next(p for p in newcomers if p is not taken[0])
    assert home.events == [] and "commlib: this spare was not needed: the job ended" in home.err, job.report()


def test_a_stopped_rank_is_not_declared_dead_before_the_timeout() -> None:
    # SIGSTOP: the process lives (its kernel still answers on its lifelines): the survivors' call times out
    stop = Kill([2], "ready", delay=0.3, signum=signal.SIGSTOP)
    kills = [stop, Kill([2], "timed out", delay=1.5, signum=signal.SIGKILL)]  # once every survivor timed out
    job = run(4, LOOP, kills=kills, env={"T": "4"})
    assert not job.hung, job.report()
    for p in job.survivors():
        if p.rank == 2:
            continue
        assert p.first("raised") is None, job.report()
        timed_out = p.first("timed out")
        assert timed_out is not None and timed_out["t"] - stop.at >= 3.5, job.report()
