"""Where a run's start goes: its phases timed on every process, one table for the run.

A phase is a span of wall-clock time (``time.time()``: spans taken on the driver and
on host 0 lie on one timeline). The driver times its own (imports, Ray, the data, the
run's actors, the worker group up to redray's code on host 0, the end); host 0 times
what its Trainer does (JAX's distributed runtime, the user's code, the hardware probe,
the planner, the step's build, restore or init, the first step's compile and run, the
other steps) and sends them back with its result. ``redray.fit``/``redray.run``
return them (``RunResult.startup``), log them to MLflow (``startup/<phase>_s``) and,
with ``REDRAY_VERBOSE=1``, print the table. Phases that never happened are absent; a
phase entered twice (two Trainers) adds up.

The engine records into this process's ``RECORDER`` (``phase``); a host's loop clears
it as it starts (``begin``) so a reused process starts from nothing. Its listeners
hear each phase as it is entered (``listen``): a host's watchdog counts it as progress
and the driver learns where a group that has not trained yet stands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

# Every phase, in the order a run passes them (the table's order).
PHASES = {
    "imports": "Ray and the driver's side of a run imported (the call's own imports)",
    "ray": "Ray started here, or joined",
    "sources": "the data sources put into Ray's object store (a stream: its pieces listed)",
    "actors": "the run's results and MLflow tracker actors created",
    "hosts": "the hosts placed and started, each importing the engine (none: kept hosts)",
    "distributed": "JAX's distributed runtime joined by every host (none: kept hosts)",
    "user_code": "the user's code unpickled, the Trainer made (the model traced abstractly)",
    "first_batch": "the first batch read and collated, whose shapes the plan is made for (a "
                   "stream: read through Ray Data)",
    "probe": "the devices' hardware probed (or read from the storage folder)",
    "planner": "the parallelism plan chosen (model timings, traces, ranking)",
    "build": "the loss checked and the parameters' specs derived",
    "restore": "the newest checkpoint restored",
    "init": "a fresh state made on its shards (parameters, optimizer)",
    "compile": "the training step traced and compiled, at its first call",
    "first_step": "the first step run",
    "steps": "the other steps, evaluations and checkpoints",
    "end": "the last step's end to the call's return (results, the tracker's end)",
}


@dataclasses.dataclass(frozen=True)
class Span:
    """One phase's time: ``name`` from ``start`` to ``end`` (``time.time()`` seconds)."""
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Recorder:
    """A process's spans, in the order they ended."""

    def __init__(self):
        self.spans: list[Span] = []
        self.listeners: list[Callable[[str], None]] = []

    def enter(self, name: str) -> None:
        """Phase ``name`` starts now: the listeners hear it."""
        for listener in list(self.listeners):
            listener(name)

    def add(self, name: str, start: float, end: float | None = None) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}; phases: {', '.join(PHASES)}")
        self.spans.append(Span(name, start, time.time() if end is None else end))

    def fill(self, name: str, since: float) -> None:
        """Records as ``name`` every stretch from ``since`` to now that no span recorded
        since then covers (the rest of a loop whose first step has spans of its own)."""
        now, at = time.time(), since
        for span in sorted((s for s in self.spans if s.end > since), key=lambda s: s.start):
            if span.start > at:
                self.add(name, at, span.start)
            at = max(at, span.end)
        if now > at:
            self.add(name, at, now)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Times the ``with`` block as phase ``name`` (recorded even if it raises)."""
        self.enter(name)
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start)


RECORDER = Recorder()


def phase(name: str):
    """Times a ``with`` block as phase ``name`` in this process's ``RECORDER``."""
    return RECORDER.phase(name)


def begin() -> None:
    """A host's run starts here: this process's spans and listeners so far are
    forgotten."""
    RECORDER.spans.clear()
    RECORDER.listeners.clear()


def listen(listener: Callable[[str], None]) -> None:
    """``listener(name)`` is called as each phase starts in this process (until
    ``begin``); ``"steps"`` once the first training step is done."""
    RECORDER.listeners.append(listener)


def seconds(spans: list[Span]) -> dict[str, float]:
    """Each phase's seconds (a phase entered twice adds up), in ``PHASES`` order."""
    out = {name: 0.0 for name in PHASES}
    for span in spans:
        out[span.name] += span.seconds
    return {name: value for name, value in out.items()
            if any(s.name == name for s in spans)}


def table(spans: list[Span], total: float, heading: str) -> str:
    """The phases, their seconds and shares of ``total`` (the call's wall time), and
    what no phase covers."""
    phases = seconds(spans)
    width = max(len(n) for n in (*phases, "unaccounted"))
    lines = [heading, f"  {'phase':<{width}}  seconds  share"]
    for name, value in phases.items():
        lines.append(f"  {name:<{width}}  {value:7.2f}  {value / total:5.0%}  {PHASES[name]}")
    rest = total - sum(phases.values())
    lines.append(f"  {'unaccounted':<{width}}  {rest:7.2f}  {rest / total:5.0%}")
    return "\n".join(lines)


def metrics(spans: list[Span], total: float) -> dict[str, float]:
    """MLflow's ``startup/<phase>_s`` and ``startup/total_s``."""
    out = {f"startup/{name}_s": value for name, value in seconds(spans).items()}
    out["startup/total_s"] = total
    return out
