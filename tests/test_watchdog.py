"""The watchdog's clock (redray.engine.watchdog), in one process with real threads."""

import threading
import time

import pytest

from redray.engine import watchdog
from redray.engine.watchdog import Watchdog


def test_the_clock_starts_at_the_first_training_step_and_fires_once_when_stuck():
    stalls = []
    fired = threading.Event()
    dog = Watchdog(0.3, lambda stall: (stalls.append(stall), fired.set())).start()
    try:
        watchdog.progress("a batch of 8 examples from example 0")  # not training: unarmed
        assert not fired.wait(0.8)  # compiling, restoring: not timed
        for _ in range(6):  # steady progress keeps it quiet
            watchdog.progress("a training step", training=True)
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


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="positive seconds"):
        Watchdog(0, print)
