"""A Trainer's plan under ``parallelism="auto"``: chosen by the planner at ``init`` on
the model, the loss and the first batch, or kept from the checkpoint a run resumes on
the same devices; and what it was chosen on, for the console, MLflow and checkpoints.

The Trainer holds one ``PlanChoice`` when the user left the plan to redray (None when
they gave it) and asks it for a ``Plan`` value once; nothing here writes to the Trainer.
"""

from __future__ import annotations

import dataclasses

import jax

from redray import startup
from redray.checkpoint import latest_meta
from redray.engine.loop import tokens_per_example
from redray.planning.planner import Ranking, grid_plan, pins
from redray.sharding import Parallelism
from redray.sharding.plan import Plan


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
                "hardware": repr(self.hardware)}

    def kept(self, checkpoint_config, batch_size: int) -> Plan | None:
        """The plan of the checkpoint a run resumes, when it resumes on the devices that
        plan was chosen for: the planner's pick follows timings (the machine's load at
        init), and another plan rounds differently, so the resumed run would not continue
        exactly as it was going. On other devices (fewer hosts, an elastic regroup) it
        plans again: None."""
        config = checkpoint_config
        if config is None or not config.resume or config.directory is None:
            return None
        saved = (latest_meta(config.directory) or {}).get("plan")
        if not saved or saved["key"] != self.key(batch_size):
            return None
        return grid_plan(dict(saved["sizes"]), saved["micro_batch_size"], saved["remat"],
                         batch_size, saved["schedule"], self.rules, saved.get("repeats", 1))

    def choose(self, runtime, functions, optimizer, sample: dict, trainable, grad_fn,
               batch_size: int) -> tuple[Plan, object]:
        """Runs the planner on this model, loss and batch: (its pick, how one layer's
        attention crosses a context axis on the hardware it planned on)."""
        from redray.engine.facts import RuntimeFacts
        from redray.planning import context_chooser, resolve_hardware
        from redray.planning.live import choose

        if self.hardware is None:
            with startup.phase("probe"):
                hardware = resolve_hardware(None, self.probe_cache)
        else:
            hardware = resolve_hardware(self.hardware)
        # the model's own choices (the context axis's attention) on the same hardware
        context = context_chooser(hardware)
        traced = runtime.on(dataclasses.replace(runtime.plan, context_method=context))
        with startup.phase("planner"):
            facts = RuntimeFacts(traced, functions.loss, optimizer, sample, trainable,
                                 tokens_per_example(sample))
            facts.one_f_one_b = facts.one_f_one_b and grad_fn is None
            self.ranking = choose(facts, batch_size, hardware, self.pinned, self.rules,
                                  cache=self.probe_cache, steps=self.planned_steps,
                                  timed=self.timing)
        return self.ranking.best.plan, context

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
        best, context = self.choose(runtime, functions, optimizer, sample, trainable, grad_fn,
                                    batch_size)
        return self.plan(best, batch_size, runtime.plan, context), self.ranking.why()

    def plan(self, best: Plan, batch_size: int, asked: Plan, context=None) -> Plan:
        """The plan a Trainer runs of a pick (or a kept plan), a plan over an abstract
        mesh: its axes built on the devices (this process's rows of the batch), its
        circular repeats (the user's, where given) and the model's choices kept."""
        built = best.parallelism.build()
        micro = best.geometry.micro_batch_size
        self.meta = {"key": self.key(batch_size), "sizes": list(built.sizes.items()),
                     "micro_batch_size": micro, "remat": best.remat,
                     "schedule": best.pipeline_schedule, "repeats": best.stage_repeats,
                     "chosen": best.brief()}
        return Plan.of(built, built.geometry(batch_size, micro),
                       pipeline_schedule=best.pipeline_schedule,
                       stage_repeats=best.stage_repeats, remat=best.remat,
                       context_method=context or asked.context_method)

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


def asked_plan(parallelism, mesh, rules, axes: dict, batch_size: int,
               micro_batch_size: int | None, pipeline_schedule: str | None,
               stage_repeats: int, hardware, plan_timing, grad_fn, trainable
               ) -> tuple[Plan, PlanChoice | None]:
    """The Trainer's arguments of the plan as (the plan asked for, the planner's choice
    to make at ``init`` under "auto", else None: the plan is given whole). Nothing of the
    plan given (no parallelism, mesh or axis size) means "auto"."""
    if plan_timing not in (None, True, False):
        raise ValueError(f"plan_timing={plan_timing!r}: use None (timed unless the run is "
                         "short), True or False")
    if pipeline_schedule == "1f1b" and (grad_fn or trainable):
        given = "grad_fn" if grad_fn else "trainable"
        raise ValueError(f"pipeline_schedule='1f1b' does not take {given} yet: use "
                         "pipeline_schedule='gpipe' (the default)")
    axes = {k: v for k, v in axes.items() if v is not None}  # None: not given
    if parallelism is None and mesh is None and not axes:
        parallelism = "auto"  # nothing of the plan given: the planner chooses it
    schedule = pipeline_schedule or "gpipe"
    if parallelism != "auto":
        built = Parallelism.resolve(parallelism, mesh, rules, axes, "Trainer")
        return Plan.of(built, built.geometry(batch_size, micro_batch_size),
                       pipeline_schedule=schedule, stage_repeats=stage_repeats), None
    if mesh is not None:
        raise ValueError("give either parallelism='auto' or a mesh, not both: the "
                         "planner builds the mesh")
    Parallelism.of(caller="Trainer", **axes)  # an unknown keyword fails as such
    choice = PlanChoice(pins(micro_batch_size=micro_batch_size,
                             pipeline_schedule=pipeline_schedule,
                             stage_repeats=stage_repeats, **axes),
                        tuple(rules or ()), hardware, timing=plan_timing, probe_cache=None)
    # what the user fixed of the plan; the rest is chosen at init
    return Plan(pipeline_schedule=schedule, stage_repeats=stage_repeats), choice
