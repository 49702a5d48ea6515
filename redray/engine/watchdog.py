"""A host that stops making progress: the watchdog's clock, its ticks, what it reports.

A host that is alive but stuck (a collate that never returns, a collective whose peer
never arrives) raises nothing: its training thread waits forever, often inside C++
where no Python exception can reach it. The ``Watchdog`` is a hook plus a daemon
thread: every event of the loop, and every evaluation or prediction batch
(``progress``), resets its clock; when the clock passes its timeout it hands a
``Stall`` (how long, the last progress, where this process's threads stand) to
``on_hang``, which decides what ends the process (the cluster layer reports it to the
driver and exits). The engine knows no Ray: ``on_hang`` is the caller's.

The clock starts with the watchdog (a host's job start), so a group that never gets
going (a first batch that never comes because Ray Data has no CPU, a peer lost while
the group starts) is caught too: every phase of the start (``redray.startup``: the
probe, the planner, the build, a restore, the compile) is progress, and the timeout
applies to each one alone. Compiling and restoring at real size take minutes, well
inside the default of 30; a single phase that legitimately takes longer needs a
larger timeout.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from typing import Callable

from redray.engine.hooks import EpochEnd, Hook, StepInfo

# Innermost frames shown per thread: where it waits, and the user code that called it.
STACK_FRAMES = 8


@dataclasses.dataclass(frozen=True)
class Stall:
    """What the watchdog saw when its timeout passed.

    Attributes:
      seconds: time since the last progress.
      last: the last progress, in words (e.g. "step 12 (epoch 1, batch 0)").
      threads: the innermost frames of the thread that trains and of redray's own
        threads (e.g. the collate thread), where this process waits.
    """
    seconds: float
    last: str
    threads: str


class Watchdog(Hook):
    """Calls ``on_hang(Stall)`` once when no progress happened for ``timeout`` seconds
    (from its own daemon thread), from ``start`` on.

    One per process: give the same instance to every Trainer (``add_hook``), ``start``
    it in the thread that trains, ``stop`` it when the work is done.
    """

    def __init__(self, timeout: float, on_hang: Callable[[Stall], None]):
        if not timeout > 0:
            raise ValueError(f"a watchdog timeout must be positive seconds, got {timeout!r}")
        self.timeout, self.on_hang = timeout, on_hang
        self._last = (time.monotonic(), "the start")  # one tuple: swapped atomically
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainer_thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        """Starts watching; the calling thread is the one whose stack a stall shows."""
        self._trainer_thread = threading.current_thread()
        self._last = (time.monotonic(), "the start")
        self._thread = threading.Thread(target=self._watch, daemon=True, name="redray-watchdog")
        _running.append(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (a no-op when not started)."""
        self._stop.set()
        if self in _running:
            _running.remove(self)

    def tick(self, what: str) -> None:
        """Progress happened (``what``, in words)."""
        self._last = (time.monotonic(), what)

    def _watch(self) -> None:
        # Checked a few times per timeout: a stall is seen at most a quarter late.
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            at, what = self._last
            idle = time.monotonic() - at
            if idle > self.timeout:
                self.on_hang(Stall(idle, what, self._stacks()))
                return

    def _stacks(self) -> str:
        frames = sys._current_frames()
        shown = []
        for thread in threading.enumerate():
            if thread is self._thread or (thread is not self._trainer_thread
                                          and not thread.name.startswith("redray-")):
                continue
            frame = frames.get(thread.ident)
            if frame is not None:
                stack = "".join(traceback.format_stack(frame)[-STACK_FRAMES:])
                shown.append(f"thread {thread.name!r}:\n{stack}")
        return "".join(shown)

    # Every event of the loop is progress.
    def on_init(self, run) -> None:
        self.tick("the set-up (init)")

    def on_epoch_start(self, run, epoch: int, batch: int) -> None:
        self.tick(f"the start of epoch {epoch} at batch {batch}")

    def on_step(self, run, info: StepInfo) -> None:
        self.tick(f"step {info.step} (epoch {info.position.epoch}, batch "
                  f"{info.position.batch})")

    def on_log(self, run, row: dict) -> None:
        self.tick(f"a logged row at step {row.get('step')}")

    def on_epoch_end(self, run, end: EpochEnd) -> None:
        self.tick(f"the end of epoch {end.epoch} at step {end.step}")

    def on_checkpoint(self, run, step: int, path: str, meta: dict) -> None:
        self.tick(f"the checkpoint of step {step}")

    def on_fit_end(self, run) -> None:
        self.tick("the end of fit")


_running: list[Watchdog] = []


def progress(what: str) -> None:
    """Tells this process's watchdogs that work moved on, from code that sends no hook
    event (a step of a custom loop, an evaluation or prediction batch, a phase of the
    start)."""
    for watchdog in _running:
        watchdog.tick(what)
