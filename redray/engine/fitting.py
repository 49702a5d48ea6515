"""The Trainer's loops. One call of ``Trainer.fit``: its checks, the hooks it runs
before the Trainer's own, and the loop over optimizer steps (``loop.training_steps``),
begun again where a rollback left the data. And ``evaluate``'s pass over examples.

Its hooks (``redray/engine/fit_hooks.py``, ``nonfinite.py``) come first, in this order:
the non-finite guard (a bad step is caught before its window is logged or a save
starts), the recorder of logged rows, the log window, the progress bar (process 0),
the evaluation after each epoch, and the checkpoints.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax

from redray import startup
from redray.engine.batches import each_batch
from redray.engine.fit_hooks import Checkpoints, Evaluation, LogWindow, Recorder
from redray.engine.hooks import Hook, Hooks, Progress
from redray.engine.loop import TrainingData, tokens_per_example, training_steps
from redray.engine.nonfinite import NonFiniteGuard, RolledBack
from redray.functions import COUNTS, WEIGHT
from redray.rngs import KeyStream, stream_key


def run_steps(per_epoch: int, epochs: int, max_steps: int | None) -> int:
    """The optimizer steps ``fit`` runs in all: ``epochs`` of ``per_epoch``, at most
    ``max_steps``."""
    return per_epoch * epochs if max_steps is None else min(max_steps, per_epoch * epochs)


def check_arguments(trainer, train: Sequence, eval_data, eval_metric) -> None:
    """``fit``'s arguments against the Trainer's, before anything is built."""
    if eval_metric is not None and (eval_data is None or trainer.functions.predict is None):
        raise ValueError("eval_metric needs eval_data and a predict function: pass "
                         "predict=... to Trainer and eval_data=... to fit")
    if len(train) < trainer.batch_size:
        raise ValueError(f"{len(train)} training examples are fewer than batch_size="
                         f"{trainer.batch_size}: lower batch_size or add data")
    ckpt = trainer.checkpoint_config
    if ckpt is not None and ckpt.best_metric and eval_data is None:
        raise ValueError(f"best_metric={ckpt.best_metric!r} needs eval_data: the best "
                         "checkpoint is chosen by the evaluation after each epoch")


class Fit:
    """The hooks and the loop of one ``fit`` call on ``trainer`` (initialized, its
    budget set) over ``data``: the Trainer hands it its hooks (``hooks.Hooks``), where
    its run stands (``hooks.Progress``, moved by the loop) and its step on a placed
    batch."""

    def __init__(self, trainer, hooks: Hooks, progress: Progress, step: Callable,
                 data: TrainingData, per_epoch: int, eval_data: Sequence | None,
                 eval_metric: Callable | None, shown: bool):
        self.trainer, self.data = trainer, data
        self.all_hooks, self.progress, self.step = hooks, progress, step
        run = hooks.run  # what hooks get
        self.recorder = Recorder()
        self.evaluation = None if eval_data is None else Evaluation(
            eval_data, eval_metric, run.console if shown else None)
        # the two hooks that change the run get the Trainer's actions as functions
        self.guard = NonFiniteGuard(trainer.on_nonfinite, trainer.log_every, per_epoch,
                                    roll_back=trainer.roll_back)
        config = trainer.checkpoint_config
        self.hooks: list[Hook] = [hook for hook in (
            self.guard, self.recorder, LogWindow(trainer.log_every),
            run.console.progress(run, run.budget) if shown else None,
            self.evaluation,
            None if config is None else Checkpoints(run, data.settings(),
                                                    save=trainer.save_checkpoint))
            if hook is not None]

    def run(self, epochs: int, max_steps: int | None, eval_at_start: bool) -> list[dict]:
        """Trains what is left of ``epochs`` (at most ``max_steps`` in all); returns the
        rows logged."""
        trainer, hooks, progress, begun = self.trainer, self.all_hooks, self.progress, time.time()
        hooks.during_fit, progress.tokens = self.hooks, 0
        try:
            first_epoch, _ = progress.position.resume_point()
            if (eval_at_start and self.evaluation is not None and first_epoch < epochs
                    and (max_steps is None or trainer.step < max_steps)):
                self.evaluation.run(hooks.run, trainer.step, first_epoch)
            while True:
                steps = training_steps(
                    self.data, epochs, max_steps, position=progress.position, done=trainer.step,
                    geometry=trainer.geometry, sharding=trainer.parallelism.batch_sharding(),
                    collate=trainer.functions.collate, step=self.step, depth=trainer.prefetch,
                    first_batch=self.learn_tokens)
                try:
                    for event in steps:
                        if getattr(event, "position", None) is not None:
                            progress.position = event.position
                        hooks.loop_event(event)
                    break
                except RolledBack:  # the state and position are the checkpoint's: go on
                    steps.close()
            hooks.send("fit_end")
        finally:
            hooks.during_fit = []
            startup.RECORDER.fill("steps", begun)
        return self.recorder.rows

    def learn_tokens(self, batch: dict) -> None:
        self.progress.tokens = tokens_per_example(batch)


def evaluate(trainer, examples: Sequence) -> dict[str, float]:
    """``Trainer.evaluate``'s loop on an initialized ``trainer``: each batch's metrics
    times its weight, summed, over the total weight, divided once (counts, ``COUNTS``,
    summed). Full batches run
    split over the devices; a final partial batch runs at its exact size (split if it
    divides, replicated otherwise), so no padding enters the mean."""
    program, rng = trainer.program.eval_step(), stream_key(trainer.seed, KeyStream.EVAL)
    state = trainer.state
    pending = each_batch(
        examples, trainer.eval_batch_size, trainer.parallelism, trainer.functions.collate,
        lambda batch, start: program(state.whole_params, state.extra, batch, rng),
        pad_last=False)
    totals: dict[str, float] = {}
    weight = 0.0
    for _, metrics in pending:
        metrics = jax.device_get(metrics)
        w = float(metrics.pop(WEIGHT))
        weight += w
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * (1.0 if k in COUNTS else w)
    return {k: v if k in COUNTS else v / weight for k, v in totals.items()}


def shown(trainer) -> bool:
    """Whether this process shows the run's summary and progress."""
    return trainer.progress and jax.process_index() == 0
