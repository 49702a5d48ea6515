"""What a Trainer reports of itself after ``init``: the run's shape (``describe``), the
console's start line, the memory one step holds per device, and the placement table.

Reads only: the Trainer's public names and its program, never its loop.
"""

from __future__ import annotations

import jax
import numpy as np

from redray.engine.loop import tokens_per_example
from redray.planning.memory import memory_text
from redray.sharding import placement


def describe(trainer, plan_facts: dict | None) -> dict:
    """``Trainer.describe``'s value: ``plan`` the plan written out (``Plan.to_dict``);
    ``plan_facts``: the planner's, under "auto" (``planner``)."""
    runtime, state, parallelism = trainer.runtime, trainer.state, trainer.parallelism
    rows = placement(runtime.held[0], runtime.specs[0], trainer.mesh)
    opt = sum(x.nbytes for x in jax.tree.leaves(state.opt_state)
              if hasattr(x, "nbytes")) // max(parallelism.devices, 1)
    attention = trainer.attention
    return {"hosts": jax.process_count(), "devices": parallelism.devices,
            "mesh": parallelism.shape,
            "parameters": int(sum(np.prod(r.shape) for r in rows)),
            "trainable_parameters": int(sum(np.prod(x.shape) for x in
                                            jax.tree.leaves(state.params))),
            "param_bytes_per_device": int(sum(r.bytes_per_device for r in rows)),
            "optimizer_bytes_per_device_approx": int(opt),
            "layout": trainer.plan.describe(),
            "batch_size": trainer.batch_size,
            "micro_batch_size": trainer.geometry.micro_batch_size,
            "accumulation_steps": trainer.geometry.accumulation,
            **({"stage_repeats": runtime.stage_repeats} if runtime.stage_repeats > 1 else {}),
            **({"attention": attention.describe()}
               if attention is not None and attention.why else {}),
            "plan": trainer.plan.to_dict(),
            **({} if plan_facts is None else {"planner": plan_facts})}


def summary(d: dict) -> str:
    """The console's start line, from ``describe``'s value."""
    trained = "" if d["trainable_parameters"] == d["parameters"] else \
        f" ({d['trainable_parameters']:,} trained)"
    return (f"redray: {d['hosts']} host(s), {d['devices']} devices; plan {d['layout']}; "
            f"{d['parameters']:,} parameters{trained}, {d['param_bytes_per_device']:,} "
            "parameter bytes per device")


def memory(trainer, device_gib: float | None) -> dict:
    """``Trainer.memory``'s value: the planner's count of one step's parts on this run's
    facts, beside what XLA compiled."""
    from redray.engine.facts import RuntimeFacts

    program = trainer.program
    batch = program.global_batch
    facts = RuntimeFacts(trainer.runtime.unplanned(), trainer.functions.loss,
                         trainer.optimizer, batch, trainer.trainable, tokens_per_example(batch))
    return program.memory(trainer.state, facts, device_gib)


def placement_text(trainer, memory: bool, device_gib: float | None) -> str:
    """``Trainer.placement``'s table, with the memory parts when asked."""
    text = trainer.runtime.placement_text()
    if memory or device_gib is not None:
        text += "\n\n" + "\n".join(memory_text(trainer.memory(device_gib),
                                                 trainer.parallelism.shape))
    return text
