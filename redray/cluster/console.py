"""The driver's console during a run: one progress line, the run's messages, no noise.

Host 0's Trainer says what a user needs (its mesh and sizes, a resume, each
evaluation) and reports every log window; both travel to the driver through the run's
results actor (``DriverConsole``), without the step ever waiting. The driver polls
them (``Watcher``) and shows them (``DriverView``): on a terminal the progress is one
live line (step against the run's budget, loss, steps/s, tokens/s, ETA), redrawn below
every message; elsewhere (a file, a pipe, a submitted job's log) one line per log window.

Everything else the processes of a run print still reaches the driver through Ray's
log stream (a ``print`` in ``collate``, a warning, an error), above the live line,
minus what is known to be noise to a user (``redray/processes/ray_local.py``'s ``NOISE``:
set-up chatter of Gloo, JAX, Ray, MLflow and transformers). Verbose
(``redray/verbosity.py``: ``--verbose``, ``REDRAY_VERBOSE=1``), everything is shown,
each host's own progress bar included, and no news is sent to the driver.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from redray.engine.console import Console, is_progress, progress_text
from redray.engine.hooks import Hook

POLL_S = 0.5


# ---- on host 0 ----------------------------------------------------------------------

class DriverConsole(Console):
    """Host 0's console inside a run: messages and progress go to the driver."""

    def __init__(self, results):
        self.results = results

    def say(self, text: str) -> None:
        self.results.tell.remote({"say": text})

    def progress(self, run, total: int) -> Hook:
        return ProgressToDriver(self.results, run.step, total)


class ProgressToDriver(Hook):
    """Sends the fit's budget, then every train window's row, to the driver."""

    def __init__(self, results, start: int, total: int):
        self.results = results
        results.tell.remote({"start": start, "total": total})

    def on_log(self, run, row: dict) -> None:
        if is_progress(row):
            self.results.tell.remote({"row": row})


# ---- on the driver ------------------------------------------------------------------

class DriverView:
    """Shows the hosts' news: messages as lines, progress as one live line on a
    terminal (``live``), else as a line per log window."""

    def __init__(self, stream=None, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.total: int | None = None
        self.line = ""  # the live line on screen ("" none)
        self.lock = threading.RLock()

    def show(self, event: dict) -> None:
        with self.lock:
            if "say" in event:
                self.write(event["say"])
            elif "start" in event:
                self.total = event["total"]
            elif "row" in event:
                text = progress_text(event["row"], self.total)
                if self.live:
                    self.line = text
                    self._draw()
                else:
                    self.write(text)

    def write(self, text: str) -> None:
        """A line above the live one."""
        with self.above():
            self.stream.write(text + "\n")

    @contextlib.contextmanager
    def above(self):
        """Whatever is printed inside goes above the live line (cleared, then redrawn)."""
        with self.lock:
            if self.live and self.line:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                self._draw()

    def _draw(self) -> None:
        if self.live and self.line:
            self.stream.write("\r\x1b[K" + self.line)
        self.stream.flush()

    def close(self) -> None:
        """Leaves the last progress line on screen, ended."""
        with self.lock:
            if self.live and self.line:
                self.stream.write("\n")
                self.stream.flush()
            self.line = ""


class Watcher:
    """Polls the results actor for host 0's news every ``POLL_S`` and shows it."""

    def __init__(self, results, view: DriverView):
        self.results, self.view = results, view
        self.seen = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="redray-console", daemon=True)

    def __enter__(self) -> "Watcher":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
        self.poll()  # the last news (host 0 sent it before its result)
        self.view.close()

    def _run(self) -> None:
        while not self.stop_event.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        import ray

        try:
            self.seen, news = ray.get(self.results.read.remote(self.seen), timeout=30)
        except Exception:  # noqa: BLE001 - the console never fails a run
            return
        for event in news:
            self.view.show(event)
