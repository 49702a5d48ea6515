"""Planning: which plan a run takes, and what it costs, before anything runs.

* ``hardware``: the devices' rates and memory (named presets, and the probed live
  hardware: ``probe``);
* ``cost``: what a plan's step communicates and how long it takes (``StepCost``);
* ``memory``: what a plan's step holds per device, by part (the one memory model);
* ``planner``: every plan of the six axes and the micro-batch, ranked (``rank``);
* ``from_config``: plans of a Hugging Face config without a device (``redray plan``);
* ``live``: the plan of a Trainer's own model on its live devices (the model's pass
  timed there).

Models and the sharding rules import nothing from here: the choices a model makes
(ring or all-gather across the context axis) come in with the plan.
"""

from __future__ import annotations

import functools


def resolve_hardware(hardware=None, cache: str | None = None):
    """The ``redray.planning.hardware.Hardware`` a run plans on: ``hardware`` itself, a
    preset's name (``"h100"``, ``"tpu-v5e"``, ``"cpu"``, ...), or None: this cluster's
    devices probed (kept in the folder ``cache`` where given)."""
    from redray.planning.hardware import Hardware, preset
    from redray.planning.probe import probe

    if hardware is None:
        return probe(cache)
    return hardware if isinstance(hardware, Hardware) else preset(hardware)


def context_chooser(hardware=None):
    """How a layer's attention crosses the context axis, for a plan on ``hardware`` (a
    ``Hardware``, its ``to_dict``, as a plan keeps it, or None: the preset of this
    process's kind of device): ``fn(batch, tokens, ways, heads, kv_heads, head_dim,
    itemsize)`` -> "ring" or "all_gather" (``redray.planning.cost.context_method``). A
    runtime passes it to the model's layers with its plan
    (``redray.sharding.tracing.context_choice``)."""
    from redray.planning.cost import context_method
    from redray.planning.hardware import Hardware

    if hardware is not None and not isinstance(hardware, Hardware):
        hardware = Hardware.from_dict(hardware)
    return functools.partial(context_method, hardware=hardware)
