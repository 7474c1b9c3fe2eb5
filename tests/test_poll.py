"""``commlib.backends.base.poll``: how a wait spends its time (spin, then sleep) and when it asks the watchdog.

MPI moves a large transfer only while it is tested, so a wait whose data may still be moving
(``busy`` seconds) must not sleep; a wait for a late peer sleeps after 50 ms so it does not burn
a core; either way the job's watchdog is asked from 50 ms on, then at about twice the time waited.
"""

from __future__ import annotations

import itertools
import time

import pytest

from commlib.backends import base


def _after(seconds: float):
    """A test that turns True ``seconds`` after it is made."""
    end = time.monotonic() + seconds
    return lambda: time.monotonic() > end


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The naps ``poll`` takes (recorded, and taken)."""
    taken: list[float] = []
    real = time.sleep

    def sleep(s: float) -> None:
        taken.append(s)
        real(s)

    monkeypatch.setattr(base.time, "sleep", sleep)
    return taken


def test_a_wait_for_a_late_peer_naps_after_50_ms(sleeps: list[float]) -> None:
    assert base.poll(_after(0.15), timeout=5.0)
    assert sleeps, "a 150 ms wait with nothing moving should nap"


def test_a_wait_whose_data_may_still_move_never_naps(sleeps: list[float]) -> None:
    assert base.poll(_after(0.15), timeout=5.0, busy=1.0)
    assert sleeps == []


def test_the_busy_time_ends_and_then_the_wait_naps(sleeps: list[float]) -> None:
    assert base.poll(_after(0.3), timeout=5.0, busy=0.1)
    assert sleeps


def test_a_timeout_is_reported_while_spinning_too(sleeps: list[float]) -> None:
    start = time.monotonic()
    assert base.poll(lambda: False, timeout=0.2, busy=10.0) is False
    assert 0.2 <= time.monotonic() - start < 2.0
    assert sleeps == []


@pytest.mark.parametrize("busy", [0.0, 5.0])
def test_the_watchdog_is_asked_from_50_ms_then_less_often_whether_napping_or_spinning(
    busy: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[float] = []
    monkeypatch.setattr(base, "watchdog", lambda waited: asked.append(waited))
    slow: list[float] = []  # the operation's own slow-path check (a peer's notice that it gave up), asked first
    assert base.poll(_after(1.0), timeout=5.0, busy=busy, slow=slow.append)
    assert asked and 0.05 <= asked[0] < 0.1, asked  # first asked at 0.05 s, then at about twice the time waited
    assert all(b - a >= min(a, base.WATCH_EVERY) for a, b in itertools.pairwise(asked)), asked
    assert 3 <= len(asked) <= 5, asked  # 0.05, 0.1, 0.2, 0.4, 0.8 (a loaded machine may skip some)
    assert slow == asked, (slow, asked)
