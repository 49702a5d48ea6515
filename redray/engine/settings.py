"""A Trainer's settings, one frozen dataclass per concern, and the flat keywords that
build them.

The Trainer takes the settings (``Trainer(..., plan=PlanSettings(...),
step=StepSettings(...))``); ``Trainer.of``, ``redray.fit`` and a Trainer made inside
``redray.run`` take the flat keywords too (``model_axis=2, log_every=1``), each of which
names one field of one of these (``FLAT``), and build the settings with ``from_flat``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """How a Trainer's plan is chosen or given (docs/parallelism.md).

    Attributes:
      plan: ``"auto"`` (the default when no axis size, mesh or plan is given): the
        planner chooses the axes and the micro-batch at ``init``, keeping what is given
        beside it. A ``redray.Plan``, its JSON (a checkpoint's ``meta["plan"]``,
        ``redray plan --json``'s output) or the path of a file of it: that plan as it
        is. A ``redray.Parallelism``: those axes and rules.
      axes: the mesh's axis sizes by keyword (``{"model_axis": 2}``: ints, or "auto"
        for the one that takes what the others leave); giving any fixes the plan
        (unless ``plan="auto"``).
      mesh: a mesh from ``redray.make_mesh``, in place of the axis sizes.
      rules: ordered (regex on the parameter path, PartitionSpec) overriding the
        automatic specs.
      micro_batch_size: examples per device in one micro-batch (gradient
        accumulation, or the pipeline's micro-batches). None: no accumulation; with
        stages, at least 4 micro-batches per stage.
      stage_repeats: circular pipeline repeats (with ``stage_axis`` > 1).
      pipeline_schedule: with stages, ``"gpipe"`` (None: the default) or ``"1f1b"``.
      hardware: what ``"auto"`` plans on: a ``Hardware``, a preset name (``"h100"``,
        ``"h100+ethernet"``...), or None: the devices probed.
      timing: whether ``"auto"`` times the model's pass on the live devices to cost
        the plans (None: unless ``fit`` is predicted to run under 30 s).
    """
    plan: Any = None
    axes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Any = None
    rules: tuple = ()
    micro_batch_size: int | None = None
    stage_repeats: int = 1
    pipeline_schedule: str | None = None
    hardware: Any = None
    timing: bool | None = None

    @classmethod
    def of(cls, value) -> "PlanSettings":
        """The settings of what ``Trainer(plan=...)`` was given: these settings, or
        what their ``plan`` takes (a plan, its JSON, a ``Parallelism``, "auto")."""
        return value if isinstance(value, cls) else cls(plan=value)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What each optimizer update does (docs/custom-loops.md).

    Attributes:
      compute_dtype: dtype of the forward and backward (e.g. ``jnp.bfloat16``);
        parameters and optimizer state stay float32. None: the parameters' dtype.
      trainable: a regex on parameter paths (as ``placement()`` shows them): only those
        are trained, hold optimizer state and are saved (e.g. LoRA's ``r"lora_"``).
      grad_fn: a custom gradient step, ``grad_fn(loss_fn, params, batch, rng) -> (loss,
        metrics, grads)`` with ``loss_fn(params, batch, rng) -> (loss, metrics)``; once
        per micro-batch, inside the jitted step. None: ``jax.value_and_grad``.
      on_nonfinite: what a NaN or infinite loss or gradient norm does (no such update
        is kept): ``"stop"`` (``redray.NonFiniteError``), ``"skip"`` the update, or
        ``"rollback"`` to the newest checkpoint, after the failing batch.
      learning_rate: the schedule (or float) given to the optimizer, logged; a
        ``redray.Schedule`` continues smoothly when a resumed run's budget grows.
    """
    compute_dtype: Any = None
    trainable: str | None = None
    grad_fn: Callable | None = None
    on_nonfinite: str = "stop"
    learning_rate: Any = None


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """How batches reach the devices.

    Attributes:
      eval_batch_size: examples per evaluation step (None: the training batch).
      prefetch: batches collated and placed ahead, in a background thread (0: none).
    """
    eval_batch_size: int | None = None
    prefetch: int = 2


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """What the run reports while it trains (docs/tracking.md, docs/profiling.md).

    Attributes:
      log_every: steps between metric fetches from the devices (no sync in between).
      progress: show the run's summary, progress and evaluations (on process 0).
      profile: ``(first, last)`` or ``"first:last"``: a JAX profiler trace of those
        optimizer steps on every host. None: ``REDRAY_PROFILE``, else none.
      profile_dir: where the trace goes (None: the run's ``profile`` folder, else
        ``./redray_profile``).
    """
    log_every: int = 10
    progress: bool = True
    profile: Any = None
    profile_dir: str | None = None


# The settings a Trainer takes, by its keyword.
GROUPS = {"plan": PlanSettings, "step": StepSettings, "data": DataSettings,
          "report": ReportSettings}
# Each flat keyword: (the Trainer's keyword, the field it sets).
FLAT = {"plan": ("plan", "plan"), "mesh": ("plan", "mesh"), "rules": ("plan", "rules"),
        "micro_batch_size": ("plan", "micro_batch_size"),
        "stage_repeats": ("plan", "stage_repeats"),
        "pipeline_schedule": ("plan", "pipeline_schedule"),
        "hardware": ("plan", "hardware"), "plan_timing": ("plan", "timing"),
        "compute_dtype": ("step", "compute_dtype"), "trainable": ("step", "trainable"),
        "grad_fn": ("step", "grad_fn"), "on_nonfinite": ("step", "on_nonfinite"),
        "learning_rate": ("step", "learning_rate"),
        "eval_batch_size": ("data", "eval_batch_size"), "prefetch": ("data", "prefetch"),
        "log_every": ("report", "log_every"), "progress": ("report", "progress"),
        "profile": ("report", "profile"), "profile_dir": ("report", "profile_dir")}
# The Trainer's own keywords beside the settings, passed as they are.
AS_THEY_ARE = ("checkpoint", "config", "hooks", "seed")


def flat_keywords() -> list[str]:
    """Every flat keyword: the settings' fields, the Trainer's own, the axis sizes."""
    from redray.sharding.parallelism import KEYWORDS

    return [*FLAT, *AS_THEY_ARE, *KEYWORDS]


def from_flat(flat: Mapping[str, Any], caller: str = "Trainer") -> dict:
    """The Trainer's keywords (``plan=PlanSettings(...)``, ...) of ``flat`` keywords:
    each field's keyword, the Trainer's own (``checkpoint``, ``config``, ``hooks``,
    ``seed``) and the axis sizes (``model_axis=2``). An unknown keyword is a
    ``TypeError`` naming it and what there is."""
    from redray.sharding.parallelism import KEYWORDS, Parallelism

    if "parallelism" in flat:
        raise TypeError(f"{caller} takes the plan as plan= (a redray.Plan, its JSON, a "
                        "redray.Parallelism or 'auto'), not parallelism=")
    unknown = sorted(set(flat) - set(FLAT) - set(AS_THEY_ARE) - set(KEYWORDS))
    if unknown:
        Parallelism.of(caller=caller, **{k: flat[k] for k in unknown})  # raises, naming them
    fields: dict[str, dict] = {name: {} for name in GROUPS}
    for key, value in flat.items():
        if key in FLAT:
            group, field = FLAT[key]
            fields[group][field] = value
    axes = {k: v for k, v in flat.items() if k in KEYWORDS}
    if axes:
        fields["plan"]["axes"] = axes
    out = {name: GROUPS[name](**values) for name, values in fields.items() if values}
    return {**out, **{k: flat[k] for k in AS_THEY_ARE if k in flat}}
