"""The plan a step runs on, as one frozen value (``Plan``): the axis sizes and rules
(``Parallelism``), the batch's cut (``BatchGeometry``), the pipeline's schedule,
repeats and micro-batches, the remat policy the planner chose, and how attention crosses
a context axis. A Trainer builds one (from the user's sizes, or the planner's pick) and
hands it whole to its ``ModelRuntime``; nothing writes a part of it afterwards: a new
plan is a new value (``dataclasses.replace``).

A plan writes itself out (``to_json``) and reads itself back (``from_json``, ``load``):
what ``redray plan --json`` prints, what every checkpoint's meta holds under ``plan``
and what ``plan=`` takes, so a run can pin the plan another one was given or chose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

from jax.sharding import PartitionSpec as P

from redray.sharding.parallelism import AXES, BatchGeometry, Parallelism, describe_shape

PIPELINE_SCHEDULES = ("gpipe", "1f1b")
CONTEXT_ATTENTION = ("auto", "ring", "all_gather")
EXPERT_EXCHANGES = ("auto", "all_to_all", "gather")
# What a written plan says it is (``Plan.to_dict``); a later form gets a new number.
FORMAT = "redray.plan/1"


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
      stage_recompute: with 1F1B, each chunk's backward recomputes its forward from the
        chunk's input, the least memory (one chunk's activations at a time), where by
        default a chunk keeps its activations from its forward to its backward (a
        third less of the layers' work).
      remat: the remat policy the planner chose (None: the model's own).
      context_attention: how one layer's attention crosses a context axis: "ring",
        "all_gather", or "auto": per layer, whichever the cost model predicts faster on
        ``hardware`` (``redray.planning.cost.context_method``).
      expert_exchange: how an expert axis sends tokens to their experts' devices
        (``redray/models/moe.py``): "all_to_all" (a fixed number of slots per device
        and expert), "gather" (each device gathers its expert group's tokens, runs its
        own experts on those routed to them and reduce-scatters the outputs back:
        nothing dropped, no slots), or "auto": "gather" for dropless layers,
        "all_to_all" for layers with a capacity factor.
      hardware: the numbers of the hardware the plan was chosen on (a
        ``redray.planning.hardware.Hardware`` as a dict: ``Hardware.to_dict``), what
        "auto" weighs on; None: the preset of this process's kind of device.
    """

    parallelism: Parallelism | None = None
    geometry: BatchGeometry | None = None
    micro_rows: int | None = None
    pipeline_schedule: str = "gpipe"
    stage_repeats: int = 1
    stage_recompute: bool = False
    remat: str | None = None
    context_attention: str = "auto"
    expert_exchange: str = "auto"
    hardware: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule={self.pipeline_schedule!r}: use one of "
                             f"{', '.join(map(repr, PIPELINE_SCHEDULES))}")
        if self.context_attention not in CONTEXT_ATTENTION:
            raise ValueError(f"context_attention={self.context_attention!r}: use one of "
                             f"{', '.join(map(repr, CONTEXT_ATTENTION))}")
        if self.expert_exchange not in EXPERT_EXCHANGES:
            raise ValueError(f"expert_exchange={self.expert_exchange!r}: use one of "
                             f"{', '.join(map(repr, EXPERT_EXCHANGES))}")
        if self.stage_recompute and self.pipeline_schedule != "1f1b":
            raise ValueError("stage_recompute=True is 1F1B's: give pipeline_schedule='1f1b' "
                             "(GPipe keeps every tick's activations; remat='full' trims them)")
        repeats = self.stage_repeats
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"stage_repeats must be a positive int, got {repeats!r}")
        if repeats > 1 and self.parallelism is not None \
                and self.parallelism.role_size("layers") <= 1:
            raise ValueError(f"stage_repeats={repeats} needs pipeline stages: give "
                             "stage_axis > 1 too (or leave stage_repeats at 1)")

    @classmethod
    def of(cls, parallelism: Parallelism, geometry: BatchGeometry, **rest) -> "Plan":
        """A training step's plan: ``parallelism`` and ``geometry``, the pipeline's
        micro-batches (on a stage axis) from the geometry."""
        staged = parallelism.role_size("layers") > 1
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
        if self.stage_recompute:
            order += " recomputing"
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
            passes = ("pipelined micro-batches" if self.parallelism.role_size("layers") > 1
                      else "accumulation steps")
            parts.append(f"batch {g.batch_size} = {g.micro_batch_size} per device x "
                         f"{g.accumulation} {passes}")
        if self.parallelism.role_size("layers") > 1:
            parts.append(self.pipeline_schedule + (f" x {self.stage_repeats} repeats"
                                                   if self.stage_repeats > 1 else "")
                         + (", each chunk recomputed" if self.stage_recompute else ""))
        if self.remat is not None:
            parts.append(f"remat {self.remat}")
        return ", ".join(parts)

    # ------------------------------------------------------------ on devices
    def build(self, devices: Sequence | None = None) -> "Plan":
        """This plan on ``devices`` (default: every host's): its axes built into a mesh,
        its batch geometry recut for this process's rows (a plan read back from JSON, or
        the planner's pick over an abstract mesh, becomes one a Trainer runs)."""
        if self.parallelism is None:
            return self
        return self._on(self.parallelism.build(devices))

    def abstract(self, n_devices: int) -> "Plan":
        """This plan over ``n_devices`` that do not exist (an abstract mesh)."""
        if self.parallelism is None:
            return self
        return self._on(self.parallelism.abstract(n_devices))

    def _on(self, parallelism: Parallelism) -> "Plan":
        g = self.geometry
        geometry = None if g is None else parallelism.geometry(g.batch_size,
                                                               g.micro_batch_size)
        return dataclasses.replace(self, parallelism=parallelism, geometry=geometry)

    # ------------------------------------------------------------ written out
    def to_dict(self) -> dict:
        """The plan as JSON-ready values: its axes by name (every axis's size where the
        plan is built or abstract; those given, "auto" among them, where it is not),
        the user's rules, the batch and micro-batch, the pipeline's schedule, repeats
        and micro-batch rows, the remat policy, how attention crosses a context axis and
        the hardware numbers it weighs on. ``from_dict`` reads it back."""
        par, g = self.parallelism, self.geometry
        if par is None:
            axes, rules = None, []
        elif par.mesh is None:
            axes = {a.name: par.sizes[a.keyword] for a in AXES if a.keyword in par.sizes}
            rules = par.rules
        else:
            axes, rules = dict(par.shape), par.rules
        return {"format": FORMAT, "axes": axes,
                "rules": [[pattern, spec_to_json(spec)] for pattern, spec in rules],
                "batch_size": None if g is None else g.batch_size,
                "micro_batch_size": None if g is None else g.micro_batch_size,
                "micro_rows": self.micro_rows,
                "pipeline_schedule": self.pipeline_schedule,
                "stage_repeats": self.stage_repeats,
                "stage_recompute": self.stage_recompute, "remat": self.remat,
                "context_attention": self.context_attention,
                "expert_exchange": self.expert_exchange,
                "hardware": None if self.hardware is None else dict(self.hardware),
                "describe": self.describe() if par is None or par.mesh is not None else
                describe_shape(axes)}

    def to_json(self, indent: int | None = None) -> str:
        """``to_dict`` as JSON text (``Plan.from_json`` reads it back)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        """The plan ``to_dict`` wrote: over an abstract mesh where every axis has a size
        (``build`` puts it on devices), else with its axes as given."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise ValueError(f"not a written redray plan (format {found!r}, expected "
                             f"{FORMAT!r}): give what Plan.to_json or `redray plan --json` "
                             "wrote")
        axes = d.get("axes")
        rest = dict(pipeline_schedule=d.get("pipeline_schedule", "gpipe"),
                    stage_repeats=d.get("stage_repeats", 1),
                    stage_recompute=bool(d.get("stage_recompute", False)), remat=d.get("remat"),
                    context_attention=d.get("context_attention", "auto"),
                    expert_exchange=d.get("expert_exchange", "auto"),
                    hardware=d.get("hardware"))
        if axes is None:
            return cls(**rest)
        names = {a.name: a for a in AXES}
        unknown = sorted(set(axes) - set(names))
        if unknown:
            raise ValueError(f"the plan names axes {unknown} that redray does not have: its "
                             f"axes are {', '.join(names)}")
        rules = tuple((pattern, spec_from_json(spec)) for pattern, spec in d.get("rules", ()))
        par = Parallelism.of(rules=rules, **{names[k].keyword: v for k, v in axes.items()})
        sizes = [axes.get(a.name, a.default) for a in AXES]
        if all(isinstance(s, int) for s in sizes):
            par = par.abstract(math.prod(sizes))
        geometry = None
        if d.get("batch_size") is not None:
            if par.mesh is None:
                raise ValueError("the plan gives a batch but not every axis's size: a written "
                                 "plan with a batch names every axis")
            geometry = par.geometry(d["batch_size"], d.get("micro_batch_size"))
        return cls(par, geometry, d.get("micro_rows"), **rest)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan ``to_json`` wrote."""
        return cls.from_dict(json.loads(text))


def load(value: "Plan | Mapping | str") -> Plan:
    """A ``Plan`` from what ``plan=`` takes: a ``Plan``; a dict (``Plan.to_dict``'s, or
    ``redray plan --json``'s output: the best plan of its ranking, or the plan of its
    placement); JSON text of either; or the path of a file holding it."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if not text.lstrip().startswith("{"):
            if not os.path.isfile(text):
                raise ValueError(f"plan={text!r} is neither 'auto', JSON, nor a file: give "
                                 "the file `redray plan ... --json` wrote, or its text")
            with open(text) as f:
                text = f.read()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the plan is not valid JSON ({e}): give what `redray plan "
                             "--json` or Plan.to_json wrote") from None
    if isinstance(value, Mapping) and "plans" in value:  # redray plan --json's ranking
        if not value["plans"]:
            raise ValueError("this `redray plan --json` output ranks no plan that fits: "
                             "nothing to run")
        value = value["plans"][0]
    if isinstance(value, Mapping) and isinstance(value.get("plan"), Mapping):
        value = value["plan"]  # a ranked plan's, or a placement's, entry
    return Plan.from_dict(value)


def spec_to_json(spec: P) -> list:
    """A PartitionSpec as JSON: each dimension's axis name, list of names, or None."""
    return [list(d) if isinstance(d, tuple) else d for d in spec]


def spec_from_json(dims: Sequence) -> P:
    """The PartitionSpec ``spec_to_json`` wrote."""
    return P(*(tuple(d) if isinstance(d, list) else d for d in dims))
