"""Train through a failure: a rank dies, the others go on without it, a replacement joins and catches up.

    python -m commlib.launch --nproc_per_node 4 --on-failure replace examples/train_through_failure.py

Every rank trains the same MLP with ``ddp.DistributedDataParallel``. At step ``--kill-at`` rank ``--kill-rank``
SIGKILLs itself. The survivors' next collective raises ``commlib.RankFailedError`` naming it; they shrink the
default group (``commlib.shrink_group``), make their states one (``ddp.broadcast_state`` from the new rank 0:
a survivor may have finished the step the others lost) and go on: each step's global batch (the same
samples whatever the number of ranks) is shared by one rank fewer. From step
``--admit-from`` on, while they are fewer than at the start, they call ``commlib.grow_group()`` before each
step: a process started with ``COMMLIB_JOIN=1`` (``--on-failure replace`` starts one at the failure;
``--spares 1`` starts one with the job, warm and waiting; so can you, by hand, with MASTER_ADDR and
MASTER_PORT set to the job's store: the launcher's ``--master_addr`` and ``--master_port``) is taken in,
receives the state with ``ddp.broadcast_state`` and trains with them to the end. Under ``--on-failure
replace`` (``commlib.setting("COMMLIB_ON_FAILURE")``) the first ``grow_group`` waits for the replacements,
which may still be starting (``--wait-for-replacement`` asks for that wait elsewhere).

    python -m commlib.launch --nproc_per_node 4 --on-failure replace --spares 1 examples/train_through_failure.py

The recovery, in the loop below, is a handful of lines::

    try:
        train_one_step()
    except commlib.RankFailedError as e:
        commlib.shrink_group(e.failed_ranks)
        step = ddp.broadcast_state(model, optimizer, extra=step)

``--recover restart`` is the classic way, for comparison (``torchrun --max-restarts``): rank 0 saves a snapshot
every ``--snapshot-every`` steps, a death ends the job, the launcher restarts every worker, which resume from
the snapshot (``benchmarks/recovery.py`` times both).

Each rank prints ``RESULT {json}`` at the end: its rank and the world size, the final loss on a fixed validation
set, a checksum of its weights (every rank's is the same), the run's seconds and its training loop's, the
recoveries it went through.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import commlib
import ddp

IN, HIDDEN, OUT = 32, 256, 8
GLOBAL_BATCH = 192  # samples per step, shared by the ranks there are (4, 3 after a death, 4 again): an even split


def batch(seed: int, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part (of ``world``) of step ``step``'s global batch: a fixed linear target with noise.
    The global batch does not depend on how many ranks share it, so training goes on as before a death."""
    x, y = _samples(seed, seed * 1_000_003 + step * 1009, GLOBAL_BATCH)
    part = GLOBAL_BATCH // world
    return x[rank * part : (rank + 1) * part], y[rank * part : (rank + 1) * part]


def _samples(seed: int, stream: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(stream)
    x = torch.randn(n, IN, generator=g)
    return x, x @ _teacher(seed) + 0.1 * torch.randn(n, OUT, generator=g)


def _teacher(seed: int) -> torch.Tensor:
    return torch.randn(IN, OUT, generator=torch.Generator().manual_seed(seed))


def validation_loss(model: nn.Module, seed: int) -> float:
    x, y = _samples(seed, -1 - seed, 64)  # inputs no rank trains on
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def checksum(model: nn.Module) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def load(snapshot: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    if not snapshot.exists():
        return 0
    state = torch.load(snapshot, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save(snapshot: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    partial = snapshot.with_suffix(".partial")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
    os.replace(partial, snapshot)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=50, help="the step at which --kill-rank SIGKILLs itself (-1: never)")
    p.add_argument("--kill-rank", type=int, default=2)
    p.add_argument("--admit-from", type=int, default=100, help="from this step on, take newcomers in (grow_group)")
    p.add_argument(
        "--wait-for-replacement",
        action="store_true",
        help="at --admit-from, wait for processes that replace the dead (up to 120 s) before taking them in; the "
        "default under commlib.launch --on-failure replace (its replacement may still be starting), else only "
        "those already waiting are taken in",
    )
    p.add_argument("--recover", choices=("shrink", "restart"), default="shrink")
    p.add_argument("--snapshot", type=Path, default=None, help="--recover restart: the snapshot file")
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.02)
    args = p.parse_args()
    torch.set_num_threads(1)
    start = time.monotonic()
    # the model first: a process that joins later (a spare waits in init_process_group) is then ready at once
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    commlib.init_process_group()
    joined = bool(commlib.setting("COMMLIB_JOIN"))
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not joined
    step, events, size = 0, [], commlib.get_world_size()
    if args.recover == "restart" and args.snapshot is not None:
        step = load(args.snapshot, net, optimizer)
        if step:
            events.append({"what": "resumed", "step": step})
    model = ddp.DistributedDataParallel(net, init_sync=not joined)
    if joined:  # a newcomer: the members took it in (grow_group) and now send their state
        step = ddp.broadcast_state(model, optimizer, extra=step)
        events.append({"what": "joined", "step": step, "t": time.monotonic() - start})
    # a replacement is coming when the launcher replaces the dead: wait for it once, at --admit-from
    wait = args.wait_for_replacement or commlib.setting("COMMLIB_ON_FAILURE") == "replace"
    loop = time.monotonic()
    while step < args.steps:
        try:
            if args.recover == "shrink" and step >= args.admit_from and commlib.get_world_size() < size:
                before, missing = commlib.group.WORLD, size - commlib.get_world_size()
                waiting = missing if wait else 0
                wait = False  # once: a replacement that never comes (--max_replacements) is not waited for again
                if commlib.grow_group(wait_for=waiting, at_most=missing, timeout=120) is not before:
                    step = ddp.broadcast_state(model, optimizer, extra=step)
                    events.append({"what": "grew", "size": commlib.get_world_size(), "step": step})
            if first_life and not events and step == args.kill_at and commlib.get_rank() == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(args.seed, step, commlib.get_rank(), commlib.get_world_size())
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
            if args.recover == "restart" and args.snapshot is not None and step % args.snapshot_every == 0:
                if commlib.get_rank() == 0:
                    save(args.snapshot, net, optimizer, step)
                commlib.barrier()  # the snapshot is on disk before anyone goes on
        except commlib.RankFailedError as e:
            if args.recover != "shrink":
                raise
            noticed = time.monotonic()
            commlib.shrink_group(e.failed_ranks)
            step = ddp.broadcast_state(model, optimizer, extra=step)  # every survivor from the new rank 0's state
            seconds = round(time.monotonic() - noticed, 3)
            now = commlib.get_world_size()
            events.append({"what": "shrank", "failed": e.failed_ranks, "size": now, "step": step, "seconds": seconds})
    result = {
        "rank": commlib.get_rank(), "world_size": commlib.get_world_size(), "loss": validation_loss(net, args.seed),
        "checksum": checksum(net), "seconds": round(time.monotonic() - start, 3), "events": events,
        "train_seconds": round(time.monotonic() - loop, 3),  # this process's steps (a newcomer's: from its join)
    }  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    commlib.destroy_process_group()


if __name__ == "__main__":
    main()
