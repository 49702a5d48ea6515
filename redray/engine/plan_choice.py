"""A Trainer's plan under ``plan="auto"``: chosen by the planner at ``init`` on
the model, the loss and the first batch, or kept from the checkpoint a run resumes on
the same devices; and what it was chosen on, for the console, MLflow and checkpoints.

The Trainer holds one ``PlanChoice`` when the user left the plan to redray (None when
they gave it) and asks it for a ``Plan`` value once; nothing here writes to the Trainer.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from redray import startup
from redray.checkpoint import latest_meta
from redray.engine.loop import tokens_per_example
from redray.planning.planner import Ranking, pins
from redray.sharding import Parallelism
from redray.sharding.plan import Plan, load


class PlanChoice:
    """What the user fixed of an "auto" plan, and the pick once made.

    Attributes:
      pinned: the plan's parameters the user gave (``planner.pins``).
      rules: the user's spec overrides, part of every plan.
      hardware: what to plan on (a preset name, a ``Hardware``), or None: probed.
      timing: ``plan_timing`` (None: timed unless the run is short).
      probe_cache: the folder the probe's numbers and the model's timings are kept in.
      planned_steps: ``fit``'s steps, for the planner to weigh its timing against.
      ranking: every plan weighed (after a choice; None when the plan was kept).
      meta: the chosen plan as checkpoints keep it (its key, sizes, micro-batch, remat,
        schedule, its one-line description).
    """

    def __init__(self, pinned: dict, rules: tuple, hardware, timing: bool | None, probe_cache):
        self.pinned, self.rules, self.hardware, self.timing = pinned, rules, hardware, timing
        self.probe_cache = probe_cache
        self.planned_steps: int | None = None
        self.ranking: Ranking | None = None
        self.meta: dict | None = None

    def key(self, batch_size: int) -> dict:
        """What a chosen plan holds for: the devices, the batch, what the user pinned and
        the hardware they named."""
        return {"devices": jax.device_count(), "processes": jax.process_count(),
                "batch_size": batch_size, "pinned": repr(self.pinned),
                "rules": repr(self.rules), "hardware": repr(self.hardware)}

    def kept(self, checkpoint_config, batch_size: int) -> Plan | None:
        """The plan of the checkpoint a run resumes, when it resumes on the devices that
        plan was chosen for: the planner's pick follows timings (the machine's load at
        init), and another plan rounds differently, so the resumed run would not continue
        exactly as it was going. On other devices (fewer hosts, an elastic regroup) it
        plans again: None."""
        config = checkpoint_config
        if config is None or not config.resume or config.directory is None:
            return None
        meta = latest_meta(config.directory) or {}
        choice = meta.get("plan_choice")
        if not choice or choice["key"] != self.key(batch_size):
            return None  # another run's devices or pins (or a checkpoint older than its key)
        return Plan.from_dict(meta["plan"])

    def choose(self, runtime, functions, optimizer, sample: dict, trainable, grad_fn,
               batch_size: int) -> tuple[Plan, dict]:
        """Runs the planner on this model, loss and batch: (its pick, the numbers of the
        hardware it planned on, which the model's own choices weigh too)."""
        from redray.engine.facts import RuntimeFacts
        from redray.planning import resolve_hardware
        from redray.planning.live import choose

        if self.hardware is None:
            with startup.phase("probe"):
                hardware = resolve_hardware(None, self.probe_cache)
        else:
            hardware = resolve_hardware(self.hardware)
        # the model's own choices (the context axis's attention) on the same hardware
        numbers = hardware.to_dict()
        traced = runtime.on(dataclasses.replace(runtime.plan, hardware=numbers))
        with startup.phase("planner"):
            facts = RuntimeFacts(traced, functions.loss, optimizer, sample, trainable,
                                 tokens_per_example(sample))
            facts.one_f_one_b = facts.one_f_one_b and grad_fn is None
            self.ranking = choose(facts, batch_size, hardware, self.pinned, self.rules,
                                  cache=self.probe_cache, steps=self.planned_steps,
                                  timed=self.timing)
        return self.ranking.best.plan, numbers

    def pick(self, runtime, functions, optimizer, sample: dict, trainable, grad_fn,
             batch_size: int, checkpoint_config) -> tuple[Plan, str]:
        """The plan of the checkpoint a run resumes on the same devices (``kept``), or the
        planner's pick on this model, loss and batch (``choose``): (the Plan, a line
        saying why, for the console)."""
        kept = self.kept(checkpoint_config, batch_size)
        if kept is not None:
            plan = self.plan(kept, batch_size, runtime.plan)
            return plan, (f"plan: {self.meta['chosen']}, kept from the checkpoint this run "
                          "resumes (the same devices)")
        best, hardware = self.choose(runtime, functions, optimizer, sample, trainable,
                                     grad_fn, batch_size)
        return self.plan(best, batch_size, runtime.plan, hardware), self.ranking.why()

    def plan(self, best: Plan, batch_size: int, asked: Plan, hardware=None) -> Plan:
        """The plan a Trainer runs of a pick (or a kept plan), a plan over an abstract
        mesh: built on the devices (this process's rows of the batch), the model's
        choices weighed on the hardware it was chosen on."""
        self.meta = {"key": self.key(batch_size), "chosen": best.brief()}
        return dataclasses.replace(
            best, context_attention=asked.context_attention,
            expert_exchange=asked.expert_exchange,
            hardware=hardware if hardware is not None else best.hardware).build()

    def facts(self) -> dict:
        """What the planner chose and on what: the predicted step, the hardware (MLflow's
        ``redray.plan.*`` tags)."""
        ranking = self.ranking
        best = ranking.best
        return {"chosen": best.plan.brief(), "why": ranking.why(),
                "predicted_step_s": best.cost.seconds,
                "predicted_tokens_per_s": best.tokens_per_s,
                "predicted_memory_bytes": best.memory["total"],
                "plans_weighed": len(ranking.ranked) + len(ranking.over),
                **ranking.hardware.describe(),
                **({} if ranking.timing is None else ranking.timing.describe())}


# ``redray run --plan FILE``: the plan every Trainer of the script runs on where its own
# plan would be chosen ("auto", given or by default), without editing the script. It
# holds the plan's JSON (the command read the file), so no host reads a file for it.
PLAN_ENV = "REDRAY_PLAN"


def env_plan(plan, beside: list[str]):
    """``plan``, or where it is "auto" (or None) and ``REDRAY_PLAN`` is set, the plan
    that holds; ``beside``: the plan's other settings given with it
    (``plan_parts_given``), refused then (the pinned plan holds them)."""
    pinned = os.environ.get(PLAN_ENV)
    if not pinned:
        return plan
    if not (plan is None or (isinstance(plan, str) and plan == "auto")):
        # the same plan (redray.fit hands its hosts the pinned plan as plan=) or a refusal
        if isinstance(plan, Parallelism) or load(plan) != load(pinned):
            raise ValueError(f"{PLAN_ENV} (redray run --plan) gives the whole plan, but the "
                             "script gives another as plan=: drop one of them")
        return plan
    if beside:
        raise ValueError(f"{PLAN_ENV} (redray run --plan) gives the whole plan, but the script "
                         f"also gives {', '.join(beside)}: drop them from the script, or run "
                         "it without --plan")
    return pinned


def plan_parts_given(mesh=None, rules=(), micro_batch_size=None, pipeline_schedule=None,
                     stage_repeats: int = 1, **axes) -> list[str]:
    """The names of the parts of a plan given (a mesh, rules, a micro-batch, a pipeline's
    schedule or repeats, axis sizes: None is not given), as a Trainer's settings or
    ``redray.fit``'s keywords hold them: what a whole plan given beside them refuses."""
    given = {"mesh": mesh is not None, "rules": bool(rules),
             "micro_batch_size": micro_batch_size is not None,
             "pipeline_schedule": pipeline_schedule is not None,
             "stage_repeats": stage_repeats != 1,
             **{k: v is not None for k, v in axes.items()}}
    return [k for k, v in given.items() if v]


def asked_plan(settings, batch_size: int, grad_fn, trainable
               ) -> tuple[Plan, PlanChoice | None]:
    """A Trainer's ``PlanSettings`` (``redray.engine.settings``) as (the plan asked for,
    the planner's choice to make at ``init`` under "auto", else None: the plan is given
    whole). Its ``plan``: "auto", a ``Plan`` or what ``redray.sharding.plan.load`` reads
    (its JSON, a file of it, ``redray plan --json``'s output), a ``Parallelism``, or
    None: "auto" where no mesh and no axis size is given either."""
    plan, mesh, rules = settings.plan, settings.mesh, settings.rules
    micro_batch_size, pipeline_schedule = settings.micro_batch_size, settings.pipeline_schedule
    stage_repeats, plan_timing = settings.stage_repeats, settings.timing
    if plan_timing not in (None, True, False):
        raise ValueError(f"plan_timing={plan_timing!r}: use None (timed unless the run is "
                         "short), True or False")
    if pipeline_schedule == "1f1b" and (grad_fn or trainable):
        given = "grad_fn" if grad_fn else "trainable"
        raise ValueError(f"pipeline_schedule='1f1b' does not take {given} yet: use "
                         "pipeline_schedule='gpipe' (the default)")
    axes = {k: v for k, v in settings.axes.items() if v is not None}  # None: not given
    beside = plan_parts_given(mesh, rules, micro_batch_size, pipeline_schedule, stage_repeats,
                              **axes)
    plan = env_plan(plan, beside)
    if plan is None and mesh is None and not axes:
        plan = "auto"  # nothing of the plan given: the planner chooses it
    schedule = pipeline_schedule or "gpipe"
    if plan is None or isinstance(plan, Parallelism):
        built = Parallelism.resolve(plan, mesh, rules, axes, "Trainer", keyword="plan")
        return Plan.of(built, built.geometry(batch_size, micro_batch_size),
                       pipeline_schedule=schedule, stage_repeats=stage_repeats), None
    if not (isinstance(plan, str) and plan == "auto"):
        return given_plan(load(plan), batch_size, beside), None
    if mesh is not None:
        raise ValueError("give either plan='auto' or a mesh, not both: the planner builds "
                         "the mesh")
    Parallelism.of(caller="Trainer", **axes)  # an unknown keyword fails as such
    choice = PlanChoice(pins(micro_batch_size=micro_batch_size,
                             pipeline_schedule=pipeline_schedule,
                             stage_repeats=stage_repeats, **axes),
                        tuple(rules or ()), settings.hardware, timing=plan_timing,
                        probe_cache=None)
    # what the user fixed of the plan; the rest is chosen at init
    return Plan(pipeline_schedule=schedule, stage_repeats=stage_repeats), choice


def given_plan(plan: Plan, batch_size: int, beside: list[str]) -> Plan:
    """A whole plan given as ``plan=`` (written out, or a ``Plan``), built on the
    devices; ``beside``: the plan's other arguments also given (an error: the plan holds
    them)."""
    if beside:
        raise ValueError(f"give either plan= or {', '.join(beside)}, not both: the plan "
                         "holds its axes, rules, micro-batch and pipeline")
    if plan.parallelism is None:
        raise ValueError("plan= names no axes (a plan of one device): give the plan a run "
                         "wrote, or leave plan='auto'")
    if plan.parallelism.mesh is not None and plan.parallelism.devices != jax.device_count():
        raise ValueError(f"plan= is a plan for {plan.parallelism.devices} devices, but this run "
                         f"has {jax.device_count()}: plan for them (`redray plan ... --devices "
                         f"{jax.device_count()}`), or leave plan='auto'")
    g = plan.geometry
    if g is not None and g.batch_size != batch_size:
        raise ValueError(f"plan= is a plan for batch_size={g.batch_size}, but batch_size="
                         f"{batch_size}: give batch_size={g.batch_size}, or plan the new batch "
                         "(`redray plan ... --batch-size`)")
    if g is None:  # a plan of the axes alone: no accumulation (stages: their default)
        built = plan.parallelism.build()
        return dataclasses.replace(Plan.of(built, built.geometry(batch_size)),
                                   pipeline_schedule=plan.pipeline_schedule,
                                   stage_repeats=plan.stage_repeats, remat=plan.remat,
                                   context_attention=plan.context_attention,
                                   expert_exchange=plan.expert_exchange,
                                   hardware=plan.hardware)
    return plan.build()
