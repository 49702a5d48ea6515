"""A profile of chosen training steps: JAX's profiler trace of those steps on every host.

``Trainer.of(profile=(first, last))`` (``redray.fit(..., profile=...)``, or the variable
``REDRAY_PROFILE=first:last``, which ``redray run --profile first:last`` sets) traces
the optimizer steps ``first`` to ``last`` (counted as the logged ``step``: 1 is the first
update). The trace starts once the step before ``first`` has finished on the devices and
stops once ``last`` has, so it holds those steps whole and nothing of the others; the
steps themselves are the same compiled program as unprofiled ones (the profiler only
records what runs). Every host writes its own trace, ``<folder>/host<i>``, in the
format TensorBoard's profile plugin and XProf read (``*.xplane.pb``); inside a redray
run the folder is the run's ``profile`` folder and host 0's trace is logged to MLflow
as the artifact folder ``profile``. docs/profiling.md shows how to read one.
"""

from __future__ import annotations

import os

from redray.engine.hooks import Hook

PROFILE_ENV = "REDRAY_PROFILE"
# Where a Trainer outside a redray run writes its traces (in the working directory).
DEFAULT_FOLDER = "redray_profile"


def profile_window(value, source: str = "profile") -> tuple[int, int] | None:
    """``(first, last)`` steps from ``value``: a pair of ints, ``"first:last"`` (or one
    step, ``"n"``), or None. A bad value raises ``ValueError`` naming ``source``."""
    if value is None or value == "":
        return None
    fix = (f"give the optimizer steps to trace as {source}=(first, last), e.g. (10, 12), "
           "with 1 <= first <= last (steps count from 1, as the logged step does)")
    if isinstance(value, str):
        parts = value.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{source}={value!r}: {fix}; as text, 'first:last'") from None
        if len(numbers) == 1:
            numbers *= 2
    elif isinstance(value, (tuple, list)):
        numbers = list(value)
    else:
        raise ValueError(f"{source}={value!r}: {fix}")
    if (len(numbers) != 2 or not all(isinstance(n, int) and not isinstance(n, bool)
                                      for n in numbers)
            or not 1 <= numbers[0] <= numbers[1]):
        raise ValueError(f"{source}={value!r}: {fix}")
    return numbers[0], numbers[1]


class Profile(Hook):
    """Traces the optimizer steps ``first`` to ``last`` with ``jax.profiler`` into
    ``folder/host<process>`` (every process traces its own devices).

    The steps a ``fit`` call does not reach are not traced: a run resumed past
    ``first`` traces what is left of the window, one that ends inside it stops at its
    end. ``trace``: the folder written once a trace is complete (None before)."""

    def __init__(self, first: int, last: int, folder: str, process: int, say=None):
        self.first, self.last = first, last
        self.parent = os.path.abspath(folder)
        self.folder = os.path.join(self.parent, f"host{process}")
        self.process = process
        self.say = say
        self.tracing = False
        self.trace: str | None = None
        self.traced: tuple[int, int] | None = None

    @classmethod
    def of(cls, profile, folder: str | None, adopted, say) -> "Profile | None":
        """A Trainer's profile: its own ``profile`` and ``profile_dir`` (see
        ``profile_window``), else its run's (``adopted``, a ``hooks.Adoption``), else
        ``REDRAY_PROFILE``; None: no profile. ``say`` shows process 0's message of
        where the trace is (even without progress)."""
        import jax

        window = (profile_window(profile) or adopted.profile
                  or profile_window(os.environ.get(PROFILE_ENV), PROFILE_ENV))
        if window is None:
            return None
        return cls(*window, folder or adopted.profile_dir or DEFAULT_FOLDER,
                   jax.process_index(), say)

    def _due(self, step: int) -> bool:
        """Whether step ``step + 1``, the next one, is to be traced and is not yet."""
        return not self.tracing and self.trace is None and self.first <= step + 1 <= self.last

    def _start(self, step: int) -> None:
        import jax

        os.makedirs(self.folder, exist_ok=True)
        jax.profiler.start_trace(self.folder)
        self.tracing = True
        self.traced = (step + 1, step + 1)

    def _stop(self, step: int) -> None:
        import jax

        jax.profiler.stop_trace()
        self.tracing = False
        self.trace = self.folder
        self.traced = (self.traced[0], step)
        if self.process == 0 and self.say is not None:
            first, last = self.traced
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            self.say(f"redray: profiled {steps} on every host: {self.parent} (open it with "
                     f"`xprof --logdir {self.parent}` or `tensorboard --logdir "
                     f"{self.parent}` with tensorboard-plugin-profile; docs/profiling.md)")

    def on_epoch_start(self, run, epoch: int, batch: int) -> None:
        if self._due(run.step):
            self._start(run.step)

    def on_step(self, run, info) -> None:
        import jax

        if self.tracing and info.step >= self.last:
            jax.block_until_ready(info.metrics)  # the last traced step, finished
            self._stop(info.step)
        elif self._due(info.step):
            jax.block_until_ready(info.metrics)  # nothing of this step in the trace
            self._start(info.step)

    def on_fit_end(self, run) -> None:
        if self.tracing:  # the budget ended inside the window
            self._stop(run.step)

    def close(self) -> None:
        """Stops a trace left open (fit ended by an error): the trace so far is kept."""
        if self.tracing:
            import jax

            try:
                jax.profiler.stop_trace()
            except Exception:  # noqa: BLE001 - the error that ended fit is the one to see
                pass
            self.tracing = False
