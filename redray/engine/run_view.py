"""The run as a hook sees it: what it may read of the Trainer, and the few things it
may ask of it.

Every ``Hook`` event gets one ``RunView`` of its Trainer as its first argument. It
holds no state of its own and lets nothing be set: a hook reads where training stands
(``step``, ``position``, the budget, the learning rate, the checkpoints) and acts by
logging rows, evaluating, predicting and waiting for checkpoints. The state, the
program, the hooks and the plan's parts stay the Trainer's; the actions that change
the run (saving a checkpoint, rolling back) are handed to the two hooks of ``fit`` that
take them (``fit_hooks.Checkpoints``, ``nonfinite.NonFiniteGuard``) as functions.
"""

from __future__ import annotations

from types import MappingProxyType


def _shown(name: str, doc: str) -> property:
    """The Trainer's read-only ``name``, shown as it is."""
    return property(lambda self: getattr(self._trainer, name), doc=doc)


class RunView:
    """A Trainer's run, read-only (every hook event's first argument)."""

    __slots__ = ("_trainer",)

    def __init__(self, trainer):
        object.__setattr__(self, "_trainer", trainer)

    def __setattr__(self, name, value):
        raise AttributeError(f"a hook reads the run and writes nothing to it (it set "
                             f"{name!r}): keep what a hook needs on the hook itself, and "
                             "what must survive a resume in run_meta")

    # where training stands
    step = _shown("step", "Optimizer updates done so far (a resumed run counts from its "
                  "checkpoint).")
    position = _shown("position", "Where training stands in the data (epoch, batch, epoch "
                      "done).")
    budget = property(lambda self: self._trainer._budget.steps,
                      doc="The run's total steps, as the last ``fit`` asked (None before).")
    nonfinite_step = _shown("nonfinite_step", "The first step since the last check whose "
                            "loss or gradient norm was not finite (0: none); read from the "
                            "devices.")
    # what it trains with
    batch_size = _shown("batch_size", "Examples per optimizer update (the global batch).")
    learning_rate = _shown("learning_rate", "The schedule (or float) given as "
                           "``learning_rate=``.")
    tokens_per_example = property(
        lambda self: self._trainer._progress.tokens,
        doc="Tokens in one example (the width of the batch's first 2-D integer array), "
            "learned from fit's first batch; 0: the batch has no tokens.")
    plan = _shown("plan", "The plan the run trains on.")
    config = property(lambda self: MappingProxyType(self._trainer.config),
                      doc="The run's settings, as checkpoints store them (read-only).")

    @property
    def model(self):
        """The trained model as the user's object (the latest parameters)."""
        return self._trainer.model

    console = _shown("_console", "Where process 0's messages go (``say(text)``).")
    # its checkpoints
    checkpoint_config = _shown("checkpoint_config", "When and where checkpoints are saved "
                               "(None: never).")
    resumed_from = _shown("resumed_from", "The meta of the checkpoint this run resumed from "
                          "(read-only), or None.")
    saving_step = property(lambda self: self._trainer._checkpoints.saving,
                           doc="The step whose checkpoint is being written, if one is.")
    profile_trace = property(
        lambda self: None if self._trainer._profile is None else self._trainer._profile.trace,
        doc="The folder of this process's profiler trace once it is complete "
            "(``Trainer.of(profile=...)``), else None.")

    def wait_for_checkpoints(self) -> None:
        """Returns once every checkpoint started has been written."""
        self._trainer._checkpoints.wait()

    def newest_checkpoint(self) -> str | None:
        """The newest complete checkpoint's path (a save in flight waited for), this run's
        or the one it resumed from; None if there is none."""
        return self._trainer._checkpoints.newest()

    # what a hook may ask
    def record(self, row: dict) -> None:
        """Sends a row to every hook's ``on_log`` as it is (``log`` checks and converts)."""
        self._trainer.record(row)

    def log(self, metrics: dict) -> dict:
        """Logs metrics at the current step (``Trainer.log``)."""
        return self._trainer.log(metrics)

    def evaluate(self, examples) -> dict[str, float]:
        """Mean loss and metrics over ``examples`` (``Trainer.evaluate``)."""
        return self._trainer.evaluate(examples)

    def predictor(self, batch_size: int | None = None):
        """A Predictor on the latest parameters (``Trainer.predictor``)."""
        return self._trainer.predictor(batch_size)

    def describe(self) -> dict:
        """The run's shape (``Trainer.describe``)."""
        return self._trainer.describe()

    def placement(self, memory: bool = False, device_gib: float | None = None) -> str:
        """What each device holds (``Trainer.placement``)."""
        return self._trainer.placement(memory, device_gib)
