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
from redray.planning.planner import Candidate, Ranking
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

    def kept(self, checkpoint_config, batch_size: int) -> Candidate | None:
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
        return Candidate(tuple(map(tuple, saved["sizes"])), saved["micro_batch_size"],
                         saved["remat"], saved["schedule"])

    def choose(self, runtime, functions, optimizer, sample: dict, trainable, grad_fn,
               batch_size: int) -> tuple[Candidate, object]:
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
        traced = runtime.unplanned()
        traced.use(dataclasses.replace(runtime.plan, context_method=context))
        with startup.phase("planner"):
            facts = RuntimeFacts(traced, functions.loss, optimizer, sample, trainable,
                                 tokens_per_example(sample))
            facts.one_f_one_b = facts.one_f_one_b and grad_fn is None
            self.ranking = choose(facts, batch_size, hardware, self.pinned, self.rules,
                                  cache=self.probe_cache, steps=self.planned_steps,
                                  timed=self.timing)
        return self.ranking.best.candidate, context

    def plan(self, best: Candidate, batch_size: int, asked: Plan, context=None) -> Plan:
        """The Plan value of a pick (or a kept plan): its axes built on the devices, the
        batch cut by its micro-batch, the user's circular repeats kept."""
        built = Parallelism.of(rules=self.rules, **dict(best.sizes)).build()
        self.meta = {"key": self.key(batch_size), "sizes": list(best.sizes),
                     "micro_batch_size": best.micro_batch_size, "remat": best.remat,
                     "schedule": best.pipeline_schedule, "chosen": best.describe()}
        return Plan.of(built, built.geometry(batch_size, best.micro_batch_size),
                       pipeline_schedule=best.pipeline_schedule,
                       stage_repeats=asked.stage_repeats, remat=best.remat,
                       context_method=context or asked.context_method)

    def facts(self) -> dict:
        """What the planner chose and on what: the predicted step, the hardware (MLflow's
        ``redray.plan.*`` tags)."""
        ranking = self.ranking
        best = ranking.best
        return {"chosen": best.candidate.describe(), "why": ranking.why(),
                "predicted_step_s": best.cost.seconds,
                "predicted_tokens_per_s": best.tokens_per_s,
                "predicted_memory_bytes": best.memory["total"],
                "plans_weighed": len(ranking.ranked) + len(ranking.over),
                **ranking.hardware.describe(),
                **({} if ranking.timing is None else ranking.timing.describe())}
