"""Hooks: what runs beside the training loop, and the position the loop stands at.

``Trainer.fit`` is a loop over optimizer steps; everything else it does (logging a
window of metrics, the progress bar, evaluation after each epoch, checkpoints) is a
``Hook`` that decides its own cadence from the events it receives. Code outside the
engine adds its own the same way, ``Trainer(hooks=[...])`` or ``trainer.add_hook``;
the cluster layer sends rows and checkpoints to MLflow so.

Every process runs the hooks that talk to other processes (a collective) on the same
events, so they are called equally often everywhere;
what only shows or sends (the progress, the evaluation's console line, the tracker's
rows) runs on process 0. Every event gets the run as the hook sees it, a
``redray.engine.run_view.RunView`` of the Trainer: read-only names (``step``,
``position``, ``learning_rate``, ``resumed_from``, ``saving_step``...) and the few
things a hook may ask (``record``, ``log``, ``evaluate``, ``predictor``,
``wait_for_checkpoints``...). It lets nothing be set, and redray's own hooks read
nothing else (``tests/test_architecture.py``). A hook keeps what it must in every
checkpoint through ``run_meta``.

A run that surrounds user code (``redray.run``) opens a ``trainer_scope``: every
Trainer made inside it asks the scope for its run's defaults (``Adoption``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Protocol


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands in the data.

    Attributes:
      epoch: the epoch being (or last) trained.
      batch: batches of that epoch done.
      epoch_done: whether the epoch's end (evaluation, its checkpoint) is done too.
    """
    epoch: int = 0
    batch: int = 0
    epoch_done: bool = False

    def resume_point(self) -> tuple[int, int]:
        """(epoch, batch) training continues from."""
        return (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.batch)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook learns after each optimizer step.

    Attributes:
      step: optimizer updates done, this one included.
      position: the position after this step.
      metrics: the step's metrics, still on the devices (fetching them waits for the step).
      last_of_epoch: this step ended its epoch's batches.
    """
    step: int
    position: Position
    metrics: dict
    last_of_epoch: bool


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """An epoch's last step is done.

    Attributes:
      epoch: the epoch.
      step: optimizer updates done.
      complete: every batch of the epoch trained (False: the step budget ended it).
      position: the position after a complete epoch (None when the budget cut it: the
        last step's position stands).
    """
    epoch: int
    step: int
    complete: bool
    position: Position | None = None


class Hook:
    """Runs beside training; override the events you need. Each gets ``run``, the run
    as a hook sees it (``redray.engine.run_view.RunView``: read-only)."""

    def on_restore(self, run, step: int, path: str, meta: dict) -> None:
        """The state was restored from the checkpoint of ``step`` in ``path`` (before
        ``on_init``); ``meta["run"]`` holds what hooks kept there (``run_meta``)."""

    def on_init(self, run) -> None:
        """The state exists (initialized or restored from a checkpoint)."""

    def on_epoch_start(self, run, epoch: int, batch: int) -> None:
        """``fit`` starts (or resumes) ``epoch`` at its batch ``batch``."""

    def on_step(self, run, info: StepInfo) -> None:
        """An optimizer step was dispatched (its results may still be computing)."""

    def on_log(self, run, row: dict) -> None:
        """A row was logged: a window of steps, an evaluation, or ``Trainer.log``."""

    def on_epoch_end(self, run, end: EpochEnd) -> None:
        """An epoch's steps are done."""

    def on_checkpoint(self, run, step: int, path: str, meta: dict) -> None:
        """A checkpoint is complete on every host."""

    def on_fit_end(self, run) -> None:
        """``fit`` trained what its budget asked for."""

    def run_meta(self, run) -> dict:
        """What this hook keeps in every checkpoint the Trainer saves (its meta's
        ``run``, beside the other hooks'), read back in ``on_restore``."""
        return {}


@dataclasses.dataclass
class Progress:
    """Where a Trainer's run stands, as its loop moves it (engine-internal: hooks read it
    through the run's view).

    Attributes:
      position: where training stands in the data.
      tokens: tokens in one example (the width of the batch's first 2-D integer array),
        learned from ``fit``'s first batch; 0: the batch has no tokens.
    """
    position: Position = Position()
    tokens: int = 0


class Hooks:
    """A Trainer's hooks and the events sent to them: the hooks of the ``fit`` call under
    way first (``during_fit``), then the Trainer's own (``own``). Every event gets
    ``run``, the view of the run hooks see."""

    def __init__(self, run):
        self.run = run
        self.own: list[Hook] = []
        self.during_fit: list[Hook] = []

    def add(self, hook: Hook) -> None:
        """Sends ``hook`` every event from now on."""
        if not isinstance(hook, Hook):
            raise TypeError(f"a hook must be a redray.Hook (subclass it and override the on_* "
                            f"methods you need), got {type(hook).__name__}")
        self.own.append(hook)

    def send(self, event: str, *args) -> None:
        """Calls ``on_<event>(run, *args)`` of every hook listening."""
        for hook in self.during_fit + self.own:
            getattr(hook, f"on_{event}")(self.run, *args)

    def loop_event(self, event) -> None:
        """Sends an event of ``loop.training_steps``: a ``StepInfo``, an ``EpochEnd``, or
        (epoch, batch) where an epoch starts."""
        if isinstance(event, StepInfo):
            self.send("step", event)
        elif isinstance(event, EpochEnd):
            self.send("epoch_end", event)
        else:
            self.send("epoch_start", *event)

    def run_meta(self, kept: dict) -> dict:
        """``kept`` (what a resumed checkpoint kept of the run) updated by every hook's
        ``run_meta``."""
        for hook in self.during_fit + self.own:
            kept.update(hook.run_meta(self.run))
        return kept


@dataclasses.dataclass
class Adoption:
    """What a surrounding run gives a Trainer made inside it.

    Attributes:
      checkpoint: a ``CheckpointConfig`` replacing the Trainer's default (None: keep).
      config: settings stored in every checkpoint, under the Trainer's own.
      hooks: hooks added to the Trainer.
      console: where the Trainer's messages and progress go (a
        ``redray.engine.console.Console``; None: this process's terminal).
      probe_cache: the folder keeping the cluster's probed hardware numbers, for a
        Trainer choosing its plan (None: probe each time).
      profile: the steps to trace, ``(first, last)``, for a Trainer given no
        ``profile`` of its own (``redray.engine.profile``); None: none.
      profile_dir: where a Trainer given no ``profile_dir`` writes its traces (None:
        ``./redray_profile``).
    """
    checkpoint: Any = None
    config: dict = dataclasses.field(default_factory=dict)
    hooks: list = dataclasses.field(default_factory=list)
    console: Any = None
    probe_cache: str | None = None
    profile: tuple[int, int] | None = None
    profile_dir: str | None = None


class Scope(Protocol):
    """A run surrounding user code (e.g. ``redray.run`` on one host)."""

    def adopt(self, trainer, default_checkpoint: bool) -> Adoption:
        """Called by every Trainer made inside the scope, at the end of its ``__init__``;
        ``default_checkpoint``: the Trainer was given no ``checkpoint``."""


_scopes: list[Scope] = []


@contextlib.contextmanager
def trainer_scope(scope: Scope) -> Iterator[Scope]:
    """Every Trainer made inside this block (in any thread) is adopted by ``scope``."""
    _scopes.append(scope)
    try:
        yield scope
    finally:
        _scopes.remove(scope)


def current_scope() -> Scope | None:
    """The innermost open ``trainer_scope``, or None."""
    return _scopes[-1] if _scopes else None
