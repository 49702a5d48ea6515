"""The hooks every ``Trainer.fit`` call runs: metric windows, progress, evaluation, checkpoints.

Each decides its own cadence from the loop's events (``redray/engine/hooks.py``).
They run in the order ``fit`` lists them: at an epoch's end the last window is logged,
the progress shows it, the evaluation runs, and only then the epoch's checkpoint is saved
(it records the evaluation's metrics, for ``best_metric``).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from redray.engine.console import row_text
from redray.engine.hooks import EpochEnd, Hook, StepInfo
from redray.functions import COUNTS, WEIGHT


class Recorder(Hook):
    """Keeps the rows logged during one ``fit`` call (its return value)."""

    def __init__(self):
        self.rows: list[dict] = []

    def on_log(self, run, row: dict) -> None:
        self.rows.append(row)


class LogWindow(Hook):
    """Logs the mean metrics of every ``every`` steps and of an epoch's last ones (each
    step weighed by the loss's ``weight`` metric when it gives one).

    Metrics stay on the devices until a window is full, then the whole window is
    fetched at once: no host sync in between.
    """

    def __init__(self, every: int):
        self.every = every
        self.window: list = []
        self.start = time.perf_counter()

    def on_epoch_start(self, run, epoch: int, batch: int) -> None:
        self.window, self.start = [], time.perf_counter()

    def on_step(self, run, info: StepInfo) -> None:
        self.window.append(info.metrics)
        if len(self.window) == self.every or info.last_of_epoch:
            self._flush(run, info.step, info.position.epoch)

    def on_epoch_end(self, run, end: EpochEnd) -> None:
        if self.window:
            self._flush(run, end.step, end.epoch)

    def _flush(self, run, step: int, epoch: int) -> None:
        fetched = jax.device_get(self.window)
        # Timed once the window's results are here: its steps run asynchronously, up to
        # InFlight's limit behind the loop, so the loop's own time misses most of them.
        seconds = time.perf_counter() - self.start
        row = {"step": step, "epoch": epoch}
        weights = [float(m[WEIGHT]) for m in fetched] if WEIGHT in fetched[0] else None
        for k in fetched[0]:
            if weights is None or k in COUNTS:  # a count: its mean per step
                row[k] = float(np.mean([m[k] for m in fetched]))
            elif k != WEIGHT:  # each step by its weight, divided once
                row[k] = sum(float(m[k]) * w for m, w in zip(fetched, weights)) / sum(weights)
        if run.learning_rate is not None:
            lr = run.learning_rate
            row["learning_rate"] = float(lr(step - 1) if callable(lr) else lr)
        row["steps_per_s"] = len(self.window) / max(seconds, 1e-9)
        row["examples_per_s"] = row["steps_per_s"] * run.batch_size
        row["step_time_s"] = seconds / len(self.window)
        if run.tokens_per_example:
            row["tokens_per_s"] = row["examples_per_s"] * run.tokens_per_example
        memory = _device_memory()
        if memory is not None:
            row["device_memory_bytes"] = memory
        run.record(row)
        self.window, self.start = [], time.perf_counter()


class Evaluation(Hook):
    """Evaluates after every epoch (loss and metrics, and with ``metric`` the
    Predictor's outputs scored by it), logs the row and, given a ``console`` (host 0's),
    shows it there."""

    def __init__(self, data, metric=None, console=None):
        self.data, self.metric, self.console = data, metric, console

    def on_epoch_end(self, run, end: EpochEnd) -> None:
        self.run(run, end.step, end.epoch)

    def run(self, run, step: int, epoch: int) -> dict:
        from redray.engine.batches import all_examples

        row = {"step": step, "epoch": epoch,
               **{f"eval_{k}": v for k, v in run.evaluate(self.data).items()}}
        if self.metric is not None:
            predictions = run.predictor().predict(self.data)
            row.update({f"eval_{k}": float(v) for k, v in self.metric(
                all_examples(self.data), predictions).items()})
        run.record(row)
        if self.console is not None:
            self.console.say(row_text(row))
        return row


class Checkpoints(Hook):
    """Saves every ``save_every`` steps, at the end of every complete epoch (after its
    evaluation) and at the end of ``fit``; never twice at one step, and waits for the
    last save to complete before ``fit`` returns."""

    def __init__(self, run, data_settings: dict, save):
        self.config = run.checkpoint_config
        self.data_settings = data_settings
        self.save = save  # Trainer.save_checkpoint
        # a resumed run's step is saved already; a fresh one's start is not
        self.saved = run.step if run.resumed_from is not None else None
        self.last_eval: dict | None = None

    def on_log(self, run, row: dict) -> None:
        if "eval_loss" in row:
            self.last_eval = row

    def on_step(self, run, info: StepInfo) -> None:
        every = self.config.save_every
        # an epoch's last step is saved by the epoch's end, after its evaluation
        if every and info.step % every == 0 and not (self.config.every_epoch
                                                     and info.last_of_epoch):
            self._save(info.step)

    def on_epoch_end(self, run, end: EpochEnd) -> None:
        if end.complete and self.config.every_epoch:
            self._save(end.step, self._metrics(end.step) or {})

    def on_fit_end(self, run) -> None:
        step = run.step
        self._save(step, self._metrics(step))
        run.wait_for_checkpoints()

    def _save(self, step: int, metrics: dict | None = None) -> None:
        if self.saved == step:
            return
        self.save(self.data_settings, metrics)
        self.saved = step

    def _metrics(self, step: int) -> dict | None:
        """The evaluation row of ``step`` (what ``best_metric`` is read from), or None."""
        row = self.last_eval if self.last_eval and self.last_eval["step"] == step else None
        metric = self.config.best_metric
        if row is not None and metric and metric not in row:
            raise ValueError(f"best_metric={metric!r} is not among the evaluation's metrics "
                             f"{sorted(k for k in row if k.startswith('eval_'))}: use one of these")
        return row


def _device_memory() -> int | None:
    """Bytes in use on this process's first device, where the backend reports it."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has it
        return None
    return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None
