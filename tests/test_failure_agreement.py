"""The survivors' agreement on who is out (commlib._diagnostics.agreement), without ranks: processes are threads
over an in-memory transport that, like the lifelines, tells every process of every death; a process "crashes" by
stopping after a given number of sends."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from commlib._diagnostics.agreement import Decision, Excluded, agree
from commlib.errors import CommTimeoutError


class Net:
    def __init__(self, ids: list[int]) -> None:
        self.inbox: dict[int, list[tuple[int, dict]]] = {i: [] for i in ids}
        self.dead: set[int] = set()
        self.cond = threading.Condition()

    def kill(self, i: int) -> None:
        with self.cond:
            self.dead.add(i)
            self.cond.notify_all()


class Crashed(Exception):
    pass


class T:
    """One process's transport; ``crash_after``: it dies after that many sends (None: never)."""

    def __init__(self, net: Net, me: int, crash_after: int | None = None, sees_late: float = 0.0) -> None:
        self.net, self.me, self.crash_after, self.sends = net, me, crash_after, 0
        self.sees_late = sees_late  # seconds before this process sees a death (deaths noticed at other times)
        self.start = time.monotonic()

    def send(self, peer_id: int, msg: dict[str, Any]) -> bool:
        with self.net.cond:
            if self.me in self.net.dead:
                raise Crashed
            if self.crash_after is not None and self.sends >= self.crash_after:
                self.net.dead.add(self.me)
                self.net.cond.notify_all()
                raise Crashed
            self.sends += 1
            if peer_id in self.net.dead:
                return False
            self.net.inbox[peer_id].append((self.me, dict(msg)))
            self.net.cond.notify_all()
            return True

    def failed(self) -> dict[int, Any]:
        if time.monotonic() - self.start < self.sees_late:
            return {}
        return {i: "died" for i in self.net.dead}

    def take(self, match, timeout: float):
        deadline = time.monotonic() + timeout
        with self.net.cond:
            seen = len(self.failed())
            while True:
                box = self.net.inbox[self.me]
                for i, (s, m) in enumerate(box):
                    if match(s, m):
                        del box[i]
                        return s, m
                left = deadline - time.monotonic()
                if left <= 0 or len(self.failed()) != seen:
                    return None
                self.net.cond.wait(min(left, 0.02))

    def put_back(self, sender: int, msg: dict[str, Any]) -> None:
        with self.net.cond:
            self.net.inbox[self.me].insert(0, (sender, msg))

    def discard(self, match) -> None:
        with self.net.cond:
            self.net.inbox[self.me] = [(s, m) for s, m in self.net.inbox[self.me] if not match(s, m)]


def run(ids: list[int], callers: dict[int, dict], timeout: float = 5.0) -> dict[int, Any]:
    """Run agree() on the ``callers`` (id -> {exclude, crash_after, sees_late}); id -> Decision or exception."""
    net = Net(ids)
    out: dict[int, Any] = {}

    def one(i: int, spec: dict) -> None:
        t = T(net, i, spec.get("crash_after"), spec.get("sees_late", 0.0))
        try:
            out[i] = agree(t, "g", ids, set(spec.get("exclude", ())), timeout, lambda kept: f"uid from {i}")
        except Crashed:
            out[i] = "crashed"
        except Exception as e:
            out[i] = e

    for i in spec_dead(callers):
        net.dead.add(i)
    threads = [threading.Thread(target=one, args=(i, s)) for i, s in callers.items() if not s.get("dead")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 5)
        assert not th.is_alive(), "agree() did not return within its timeout"
    return out


def spec_dead(callers: dict[int, dict]) -> list[int]:
    return [i for i, s in callers.items() if s.get("dead")]


def decisions(out: dict[int, Any]) -> set[tuple]:
    return {(tuple(d.out), tuple(d.kept), d.payload) for d in out.values() if isinstance(d, Decision)}


def test_a_dead_process_seen_by_all_is_out_and_the_lowest_kept_gives_the_payload() -> None:
    out = run([0, 1, 2, 3], {0: {}, 1: {}, 2: {"dead": True}, 3: {}})
    assert decisions(out) == {((2,), (0, 1, 3), "uid from 0")}


def test_deaths_noticed_at_different_times_become_one_decision() -> None:
    # process 3 has not seen the death of 2 yet when it starts: it still agrees on the union
    out = run([0, 1, 2, 3], {0: {}, 1: {}, 2: {"dead": True}, 3: {"sees_late": 0.5}})
    assert decisions(out) == {((2,), (0, 1, 3), "uid from 0")}


def test_the_dead_lowest_process_is_replaced_as_the_payload_giver() -> None:
    out = run([0, 1, 2, 3], {0: {"dead": True}, 1: {}, 2: {}, 3: {}})
    assert decisions(out) == {((0,), (1, 2, 3), "uid from 1")}


def test_ranks_to_exclude_of_one_survivor_exclude_a_live_process_that_does_not_call() -> None:
    out = run([0, 1, 2, 3], {0: {"exclude": [3]}, 1: {"exclude": [3]}, 2: {"exclude": [3]}})
    assert decisions(out) == {((3,), (0, 1, 2), "uid from 0")}


def test_an_excluded_process_that_calls_is_told_so() -> None:
    out = run([0, 1, 2], {0: {"exclude": [2]}, 1: {}, 2: {}})
    assert isinstance(out[2], Excluded) and out[2].by == [0]
    assert decisions(out) == {((2,), (0, 1), "uid from 0")}


@pytest.mark.parametrize("crash_after", [0, 1, 2, 3, 4, 5])
def test_a_process_that_dies_during_the_agreement_is_out_on_every_survivor(crash_after: int) -> None:
    # process 1 dies after `crash_after` messages of its own (mid-proposal, mid-confirmation): the survivors
    # agree again without it, all on the same decision
    out = run([0, 1, 2, 3], {0: {}, 1: {"crash_after": crash_after}, 2: {}, 3: {}})
    assert out[1] == "crashed"
    survivors = [out[i] for i in (0, 2, 3)]
    assert all(isinstance(d, Decision) for d in survivors), survivors
    assert decisions(out) == {((1,), (0, 2, 3), "uid from 0")}


def test_two_deaths_at_once_and_a_third_during_the_agreement() -> None:
    out = run(list(range(6)), {0: {"dead": True}, 1: {}, 2: {"dead": True}, 3: {"crash_after": 2}, 4: {}, 5: {}})
    assert decisions(out) == {((0, 2, 3), (1, 4, 5), "uid from 1")}


def test_a_member_that_never_calls_nor_dies_is_a_timeout_naming_it() -> None:
    out = run([0, 1, 2], {0: {}, 1: {}}, timeout=0.5)
    for i in (0, 1):
        assert isinstance(out[i], CommTimeoutError) and "[2]" in str(out[i]), out[i]
