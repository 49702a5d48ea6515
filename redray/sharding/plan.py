"""The plan a step runs on, as one frozen value (``Plan``): the axis sizes and rules
(``Parallelism``), the batch's cut (``BatchGeometry``), the pipeline's schedule,
repeats and micro-batches, the remat policy the planner chose, and how attention crosses
a context axis. A Trainer builds one (from the user's sizes, or the planner's pick) and
hands it whole to its ``ModelRuntime``; nothing writes a part of it afterwards: a new
plan is a new value (``dataclasses.replace``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from redray.sharding.parallelism import STAGE, BatchGeometry, Parallelism, describe_shape

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a step runs on the devices.

    Attributes:
      parallelism: the axis sizes and the user's rules (built: with its mesh); None: no
        plan (the model runs as on one device).
      geometry: the batch's cut (global batch, examples per device per pass,
        accumulation, this process's rows); None for a model that only runs forward.
      micro_rows: the rows of one pipeline micro-batch over all devices, on a plan with
        stages (``of`` derives it from the geometry); None: a pass's rows are one.
      pipeline_schedule: on a stage axis, "gpipe" or "1f1b".
      stage_repeats: on a stage axis, the circular pipeline's repeats.
      remat: the remat policy the planner chose (None: the model's own).
      context_method: how one layer's attention crosses a context axis,
        ``fn(batch, tokens, ways, heads, kv_heads, head_dim, itemsize)`` -> "ring" or
        "all_gather" (``redray.planning.context_chooser``, on the run's hardware); None:
        the preset of this process's kind of device.
    """

    parallelism: Parallelism | None = None
    geometry: BatchGeometry | None = None
    micro_rows: int | None = None
    pipeline_schedule: str = "gpipe"
    stage_repeats: int = 1
    remat: str | None = None
    context_method: Callable | None = dataclasses.field(default=None, compare=False,
                                                         repr=False)

    def __post_init__(self):
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r}: use one of "
                             f"{', '.join(map(repr, PIPELINE_SCHEDULES))}")
        repeats = self.stage_repeats
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"stage_repeats must be a positive int, got {repeats!r}")
        if repeats > 1 and self.parallelism is not None and self.parallelism.size(STAGE) <= 1:
            raise ValueError(f"stage_repeats={repeats} needs pipeline stages: give "
                             "stage_axis > 1 too (or leave stage_repeats at 1)")

    @classmethod
    def of(cls, parallelism: Parallelism, geometry: BatchGeometry, **rest) -> "Plan":
        """A training step's plan: ``parallelism`` and ``geometry``, the pipeline's
        micro-batches (on a stage axis) from the geometry."""
        staged = parallelism.size(STAGE) > 1
        return cls(parallelism, geometry, geometry.micro_rows if staged else None, **rest)

    def __call__(self, *args, **kwargs):
        raise TypeError("a Plan is a value, not a method: Trainer.plan is the plan the "
                        "Trainer runs (print trainer.plan.describe()); the table of what each "
                        "device holds is trainer.placement()")

    @property
    def mesh(self):
        return None if self.parallelism is None else self.parallelism.mesh

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size (the mesh's; built or abstract)."""
        return self.parallelism.shape

    def brief(self) -> str:
        """The planner's words for a plan it weighed: ``data=2 x fsdp=4, micro 4, remat
        dots`` (then ``1f1b`` where it pipelines so, ``circular x 4`` with circular
        repeats): its axes, the examples per device per pass, the remat policy."""
        order = ", 1f1b" if self.pipeline_schedule == "1f1b" else ""
        if self.stage_repeats > 1:
            order += f", circular x {self.stage_repeats}"
        return (f"{describe_shape(self.parallelism.shape)}, micro "
                f"{self.geometry.micro_batch_size}, remat {self.remat}{order}")

    def describe(self) -> str:
        """The plan in one line, as the console prints it and MLflow tags it
        (``redray.plan``): ``data=2 x fsdp=1 x model=2, batch 64 = 8 per device x 4
        accumulation steps``, then the pipeline's schedule and repeats on a stage axis
        and the planner's remat policy."""
        if self.parallelism is None:
            return "one device (no plan)"
        parts = [describe_shape(self.parallelism.shape)]
        g = self.geometry
        if g is not None:
            passes = ("pipelined micro-batches" if self.parallelism.size(STAGE) > 1
                      else "accumulation steps")
            parts.append(f"batch {g.batch_size} = {g.micro_batch_size} per device x "
                         f"{g.accumulation} {passes}")
        if self.parallelism.size(STAGE) > 1:
            parts.append(self.pipeline_schedule + (f" x {self.stage_repeats} repeats"
                                                   if self.stage_repeats > 1 else ""))
        if self.remat is not None:
            parts.append(f"remat {self.remat}")
        return ", ".join(parts)
