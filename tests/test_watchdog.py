"""The watchdog's clock (redray.engine.watchdog), in one process with real threads."""

import threading
import time

import pytest

from redray.engine import watchdog
from redray.engine.watchdog import Watchdog


def test_the_clock_runs_from_the_start_and_fires_once_when_stuck():
    stalls = []
    fired = threading.Event()
    dog = Watchdog(0.3, lambda stall: (stalls.append(stall), fired.set())).start()
    try:
        for what in ("a batch of 8 examples from example 0", "the start-up phase 'compile'",
                     "a training step", "a training step", "a training step"):
            watchdog.progress(what)  # steady progress, before training and during it
            time.sleep(0.1)
        assert not fired.is_set()
        assert fired.wait(3)  # then nothing for longer than the timeout
        time.sleep(0.5)
    finally:
        dog.stop()
    assert len(stalls) == 1
    stall = stalls[0]
    assert stall.last == "a training step" and 0.3 < stall.seconds < 2
    assert "test_watchdog.py" in stall.threads  # where the training thread waits
    watchdog.progress("after stop")  # a stopped watchdog hears nothing
    assert dog not in watchdog._running


def test_a_host_that_never_gets_going_is_caught_at_its_start():
    """No progress at all after the start (a first batch that never comes): the clock
    started with the watchdog, so it fires."""
    fired = threading.Event()
    stalls = []
    dog = Watchdog(0.3, lambda stall: (stalls.append(stall), fired.set())).start()
    try:
        assert fired.wait(3)
    finally:
        dog.stop()
    assert stalls[0].last == "the start"


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="positive seconds"):
        Watchdog(0, print)
