"""Learning-rate schedules defined over the run's budget, which may grow when it resumes.

An optax schedule is a function of the optimizer's update count with the total number
of updates baked in. Resuming with a larger budget (``--steps 20``, then ``--steps 40``)
builds a different function, and at the resume step the learning rate jumps from the
end of the first schedule to the middle of the second: a sawtooth.

A ``Schedule`` leaves the total open; ``Trainer.fit`` gives it the run's budget (its
``max_steps``, or ``epochs`` times the steps per epoch). What a budget change means:

- The run's schedule is a list of segments kept in every checkpoint. The first is the
  shape (warmup, then decay to ``end``) over the first budget.
- When a resumed run's budget differs from its last segment's, at the resume step ``s``
  a new segment starts: the shape over the new budget, reached from the learning rate
  the run had at ``s`` linearly over the schedule's warmup length (at least one step).
  So the curve is continuous, and after that many steps it is exactly the one a single
  run with the new budget would have had from there on.
- The same budget again (a plain resume) adds nothing: the run continues its schedule
  exactly, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

DECAYS = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class Segment:
    """From ``start`` on, the shape over ``budget`` steps, reached from ``start_value``
    (None: the run's first segment, no blending)."""
    start: int
    budget: int
    start_value: float | None = None


class Schedule:
    """A learning rate that warms up, then decays over the run's budget of steps.

    Give the same object to the optimizer and to the Trainer (or ``redray.fit``)::

        lr = redray.Schedule(3e-3, warmup=0.1)          # cosine to 0 over the budget
        redray.fit(model, collate, loss, optax.adamw(lr), learning_rate=lr, ...)

    ``fit`` sets the budget; a resumed run with another budget continues smoothly (see
    ``redray/engine/schedule.py``); every checkpoint keeps the schedule's segments.

    Args:
      peak: the learning rate at the end of warmup.
      warmup: warmup length: steps (an int), or a fraction of the budget (a float < 1).
        The learning rate rises linearly from 0 to ``peak``.
      decay: ``"cosine"``, ``"linear"`` (both reach ``end`` at the budget's last step)
        or ``"constant"`` (``peak`` after warmup).
      end: the learning rate at the end of the budget.
      steps: a fixed budget, for a loop of ``Trainer.train_step`` calls without
        ``fit`` (``fit`` replaces it with its own).
    """

    def __init__(self, peak: float, warmup: int | float = 0, decay: str = "cosine",
                 end: float = 0.0, steps: int | None = None):
        if decay not in DECAYS:
            raise ValueError(f"decay={decay!r}: use one of {', '.join(map(repr, DECAYS))}")
        if isinstance(warmup, float) and not 0 <= warmup < 1:
            raise ValueError(f"warmup={warmup!r}: a fraction of the budget is in [0, 1); "
                             "give whole steps as an int")
        if isinstance(warmup, int) and warmup < 0:
            raise ValueError(f"warmup={warmup!r}: give a number of steps >= 0")
        self.peak, self.warmup, self.decay, self.end = float(peak), warmup, decay, float(end)
        self.segments: tuple[Segment, ...] = () if steps is None else (Segment(0, int(steps)),)

    # ------------------------------------------------------------ the shape
    def warmup_steps(self, budget: int) -> int:
        if isinstance(self.warmup, float):
            return int(round(self.warmup * budget))
        return self.warmup

    def shape(self, step, budget: int):
        """The learning rate at ``step`` of a single run with ``budget`` steps."""
        warm = self.warmup_steps(budget)
        step = jnp.asarray(step, jnp.float32)
        rising = self.peak * step / max(warm, 1)
        frac = jnp.clip((step - warm) / max(budget - warm, 1), 0.0, 1.0)
        if self.decay == "cosine":
            falling = self.end + (self.peak - self.end) * 0.5 * (1 + jnp.cos(math.pi * frac))
        elif self.decay == "linear":
            falling = self.peak + (self.end - self.peak) * frac
        else:
            falling = jnp.full_like(frac, self.peak)
        return jnp.where(step < warm, rising, falling)

    def __call__(self, count):
        """The learning rate at optimizer update ``count`` (what optax calls)."""
        if not self.segments:
            raise ValueError(
                f"{self!r} has no budget yet: Trainer.fit / redray.fit set it when the schedule "
                "is also given as learning_rate=... (give the same object to the optimizer "
                "and to learning_rate); for a loop of train_step calls give steps=...")
        count = jnp.asarray(count, jnp.float32)
        value = self.shape(count, self.segments[0].budget)
        for seg in self.segments[1:]:
            reach = max(self.warmup_steps(seg.budget), 1)
            blend = jnp.clip((count - seg.start) / reach, 0.0, 1.0)
            target = self.shape(count, seg.budget)
            value = jnp.where(count >= seg.start,
                              seg.start_value + (target - seg.start_value) * blend, value)
        return value

    # ------------------------------------------------------------ the budget
    def with_budget(self, budget: int, step: int,
                    saved: list | None = None) -> tuple[Segment, ...]:
        """The segments of a run at ``step`` whose budget is now ``budget``.

        Args:
          budget: the run's total steps as ``fit`` was asked now.
          step: the step training continues from.
          saved: the segments a checkpoint kept (``as_meta``), or None for a fresh run.
        """
        budget = max(int(budget), 1)
        segments = tuple(Segment(*s) for s in saved) if saved else ()
        if not segments:
            return (Segment(0, budget),)
        if segments[-1].budget == budget:
            return segments
        previous = type(self).__new__(type(self))
        previous.__dict__.update(self.__dict__, segments=segments)
        return segments + (Segment(int(step), budget, float(previous(step))),)

    def as_meta(self) -> list:
        """The segments, as JSON for a checkpoint's meta."""
        return [[s.start, s.budget, s.start_value] for s in self.segments]

    def __repr__(self) -> str:
        warm = f"{self.warmup:g} of the budget" if isinstance(self.warmup, float) else \
            f"{self.warmup} steps"
        text = (f"Schedule(peak={self.peak:g}, warmup={warm}, decay={self.decay}, "
                f"end={self.end:g})")
        if self.segments:
            text += f" over {self.segments[-1].budget} steps"
            for seg in self.segments[1:]:
                text += (f"; budget {seg.budget} from step {seg.start} "
                         f"(reached from {seg.start_value:.4g})")
        return text


def follow_budget(learning_rate, budget: int, step: int, before: int | None,
                  saved: list | None) -> tuple[bool, list | None]:
    """A run's learning rate given the run's ``budget`` at ``step``: a ``Schedule``
    takes the segments it continues with (from ``saved``, its segments as this run or
    its checkpoint kept them, when ``step`` > 0); a plain schedule function that cannot
    follow a budget changed from ``before`` gets a warning (on process 0).

    Returns:
      (whether the schedule's segments changed: a step that traced them in must be
      traced again, the segments as a checkpoint keeps them or None).
    """
    import warnings

    import jax

    if isinstance(learning_rate, Schedule):
        segments = learning_rate.with_budget(budget, step, saved if step > 0 else None)
        changed = segments != learning_rate.segments
        learning_rate.segments = segments
        return changed, learning_rate.as_meta()
    if callable(learning_rate) and step > 0 and before is not None and before != budget \
            and jax.process_index() == 0:
        warnings.warn(
            f"the run's budget changed from {before} to {budget} steps at step {step}, "
            "but learning_rate is a plain function built for one budget: its value at "
            f"step {step} may jump (a sawtooth). Use redray.Schedule(peak, warmup=...) for "
            "the optimizer and learning_rate: it continues smoothly when the budget grows",
            stacklevel=4)
    return False, None


def describe(learning_rate, budget: int | None = None) -> str | None:
    """A readable description of what a run's learning rate is (for MLflow params)."""
    if learning_rate is None:
        return None
    if isinstance(learning_rate, (int, float)):
        return f"{learning_rate:g}"
    if isinstance(learning_rate, Schedule):
        return repr(learning_rate)
    name = getattr(learning_rate, "__qualname__", type(learning_rate).__name__)
    module = getattr(learning_rate, "__module__", None)
    text = f"function {module + '.' if module else ''}{name}"
    if budget:
        try:
            points = sorted({0, budget // 4, budget // 2, 3 * budget // 4, budget})
            text += ": " + ", ".join(f"step {p}: {float(learning_rate(p)):.4g}" for p in points)
        except Exception:  # noqa: BLE001 - a description, never an error
            pass
    return text


class RunBudget:
    """A run's budget (its total optimizer steps, as the last ``fit`` asked) and the
    learning rate that follows it: ``segments`` are a ``Schedule``'s, as checkpoints
    keep them (None for a plain schedule or a float)."""

    def __init__(self, learning_rate):
        self.learning_rate = learning_rate
        self.steps: int | None = None
        self.segments: list | None = None

    def set(self, steps: int, step: int, resumed: dict | None) -> bool:
        """The run's budget is now ``steps``, at ``step``; ``resumed``: the meta of the
        checkpoint the run resumed from. Returns whether the learning rate changed (a
        step that traced it in must be traced again)."""
        resumed = resumed or {}
        before = self.steps if self.steps is not None else resumed.get("budget")
        self.steps = steps
        # "schedule": what checkpoints before 2026-12-06 named the segments
        saved = self.segments if self.segments is not None else \
            resumed.get("lr_segments", resumed.get("schedule"))
        changed, segments = follow_budget(self.learning_rate, steps, step, before, saved)
        if segments is not None:
            self.segments = segments
        return changed
