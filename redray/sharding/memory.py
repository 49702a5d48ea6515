"""What a training step holds per device besides its state, by part: the counting
shared by ``redray plan`` (``redray/models/memory.py``, from a config, no devices) and
``Trainer.memory()`` (the user's own model and loss).

Activations are what JAX itself says the backward pass reads: the saved residuals of
the loss's linearization (``jax.ad_checkpoint``), traced on abstract values. Under
tensor parallelism a residual counts 1/model per device when its shape holds a size the
rules split over ``model`` (heads, intermediate size, vocabulary), found on a trace of
a one-row batch aligned with the real one; the residual stream's width is never such a
size (Megatron keeps it whole). Under context parallelism a residual whose shape holds
the sequence length counts 1/context: the axis splits every sequence's tokens, and the
ring keeps of the keys and values only the device's own (``redray/models/context.py``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from redray.sharding.parallelism import FSDP, MODEL, schedule
from redray.sharding.rules import axes_of

# FSDP: the layers whose parameters are gathered at once (the one computing and the
# next, prefetched).
GATHERED_LAYERS = 2

def saved_residuals(f, *args) -> list:
    """Shapes and dtypes of what the backward pass of ``f(*args)`` reads, besides the
    arguments themselves (parameters, the batch: counted apart)."""
    from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals reads

    return [aval for aval, source in saved_residuals(f, *args)
            if not source.startswith("from the argument")]


def split_residual_bytes(residuals, probes, split: set[int], model_axis: int,
                         lengths: frozenset = frozenset(), context: int = 1) -> int:
    """Bytes per device of ``residuals`` under tensor and context parallelism.

    A residual whose shape in ``probes`` (the same trace on a batch of one row, aligned
    by position) holds a size in ``split`` (and not in ``lengths``, the sequence lengths)
    counts 1/model_axis; one whose shape holds a size in ``lengths`` counts 1/context
    more (the context axis splits every sequence's tokens)."""
    if len(residuals) != len(probes):  # not the same program: count every one whole
        probes = [None] * len(residuals)
    total = 0
    for aval, probe in zip(residuals, probes):
        size = math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize
        dims = () if probe is None else probe.shape[1:]
        if model_axis > 1 and any(d in split and d not in lengths and d % model_axis == 0
                                  for d in dims):
            size //= model_axis
        if context > 1 and any(d in lengths for d in dims):
            size = -(-size // context)
        total += size
    return total


def split_sizes(param_rows, hidden: int | None = None) -> set[int]:
    """Sizes of the parameter dimensions the rules split over ``model``, without the
    residual stream's width (Megatron keeps it whole): ``hidden``, and the size of every
    vector parameter left whole over ``model`` (norm scales, output biases)."""
    sizes, whole = set(), set() if hidden is None else {hidden}
    for row in param_rows:
        axes = [a for e in row.spec for a in axes_of(e)]
        if len(row.shape) == 1 and MODEL.name not in axes:
            whole.add(row.shape[0])
        for dim, entry in zip(row.shape, row.spec):
            if MODEL.name in axes_of(entry):
                sizes.add(dim)
    return sizes - whole


def layer_gather_bytes(param_rows, fsdp: int) -> int:
    """Bytes of the largest layer's parameters on a device once gathered over fsdp. A
    layer is what shares a path up to its first numeric part (``layers/3/...``); under
    a first part without numbers whose parameters all lead with the same size
    (stacked, scanned layers) one slice of each; anything else is its own group."""
    numbered: dict = {}
    unnumbered: dict = {}
    for row in param_rows:
        axes = {a for e in row.spec for a in axes_of(e)}
        gathered = row.bytes_per_device * (fsdp if FSDP.name in axes else 1)
        parts = row.path.split("/")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is not None:
            key = "/".join(parts[:index + 1])
            numbered[key] = numbered.get(key, 0) + gathered
        else:
            unnumbered.setdefault(parts[0], []).append((row.shape, gathered))
    sizes = list(numbered.values())
    for rows in unnumbered.values():
        leads = {shape[0] if len(shape) >= 2 else None for shape, _ in rows}
        if len(rows) > 1 and len(leads) == 1 and None not in leads:
            (lead,) = leads
            sizes.append(sum(g for _, g in rows) // lead)
        else:
            sizes += [g for _, g in rows]
    return max(sizes, default=0)


def pipelined_parts(parts: dict, stages: int, micro_batches: int, act_bytes: int,
                    repeats: int = 1, order: str = "gpipe") -> dict:
    """A step's memory ``parts`` (for one micro-batch of one device, as the memory
    models count it) on ``stages`` pipeline stages over ``micro_batches`` micro-batches
    (``redray/models/pipeline.py``, GPipe or circular): each stage keeps what its
    ``L/(S R)`` layers save at every one of the ``P R + S - 1`` ticks
    (``parallelism.schedule``; the bubble's included: the schedule runs every stage at
    every tick) until the backward pass, and the head its ``M/S`` micro-batches' rows,
    so the saved activations are about ``(M + S - 1) / S`` times one micro-batch's
    without repeats (measured against XLA's compiled peak on CPU, LLaMA of 4 layers:
    0.85 at stage 2 x data 2, 0.96 at stage 4, against 0.90 without stages); the
    pipeline's buffers add the micro-batches' inputs and outputs (``2 M`` hidden states
    of ``act_bytes``) and the two slots in flight.

    ``order="1f1b"`` (the 1F1B schedule, ``redray/sharding/stages.py``): a stage recomputes one
    micro-batch's share of the layers at a time (``1/S`` of one micro-batch's saved
    activations), and keeps a ring of ``2 S - 1`` stage inputs beside the first
    stage's inputs and their gradients (``2 M``) and the two passes in flight, and
    its gradients are summed in the loop's carry before they meet the embeddings'
    (``pipeline_gradients``: one more copy of the gradients)."""
    if stages <= 1:
        return parts
    out = dict(parts)
    if order == "1f1b":
        out["activations"] = parts.get("activations", 0) / stages
        out["pipeline_buffers"] = (2 * micro_batches + 2 * stages + 1) * act_bytes
        out["pipeline_gradients"] = parts.get("gradients", 0)
        return out
    ticks = schedule(stages, micro_batches, repeats)[1]
    out["activations"] = parts.get("activations", 0) * ticks / (stages * repeats)
    out["pipeline_buffers"] = (2 * micro_batches + 2) * act_bytes
    return out


def totals(parts: dict, device_gib: float | None) -> dict:
    """``parts``, their ``total`` and, with ``device_gib``, ``device_bytes`` and ``fits``."""
    out = {"parts": {k: int(v) for k, v in parts.items()}, "total": int(sum(parts.values()))}
    if device_gib is not None:
        if isinstance(device_gib, bool) or not isinstance(device_gib, (int, float)) \
                or device_gib <= 0:
            raise ValueError(f"device_gib must be a positive number of GiB, got {device_gib!r}")
        out["device_bytes"] = int(device_gib * (1 << 30))
        out["fits"] = out["total"] <= out["device_bytes"]
    return out


def compiled_memory(stats) -> dict:
    """XLA's ``compiled.memory_analysis()`` per device: ``arguments``, ``temporaries``,
    ``outputs``, ``aliased`` and ``peak`` = arguments + temporaries + outputs - aliased
    (a donated state is updated in place)."""
    out = {"arguments": int(stats.argument_size_in_bytes),
           "temporaries": int(stats.temp_size_in_bytes),
           "outputs": int(stats.output_size_in_bytes),
           "aliased": int(stats.alias_size_in_bytes)}
    out["peak"] = out["arguments"] + out["temporaries"] + out["outputs"] - out["aliased"]
    return out


def size_text(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def part_lines(plan: dict, mesh: dict) -> list[str]:
    """The parts of a memory plan, the total and whether it fits, one per line."""
    lines = [f"  {PART_LABELS[name]:<26}{size_text(value):>14}"
             for name, value in plan["parts"].items() if value]
    lines.append(f"  {'total':<26}{size_text(plan['total']):>14}")
    if plan.get("offloaded_to_host"):
        lines.append(f"  (and {size_text(plan['offloaded_to_host'])} of activations in host "
                     "memory)")
    if "fits" in plan:
        device = size_text(plan["device_bytes"])
        share = max(plan["total"], plan.get("compiled", {}).get("peak", 0)) / plan["device_bytes"]
        if plan["fits"]:
            lines.append(f"fits on a device of {device}: yes ({share:.0%} of it)")
        else:
            lines.append(f"fits on a device of {device}: NO ({share:.0%} of it); try "
                         + "; ".join(advice(plan, mesh)))
    return lines


PART_LABELS = {
    "parameters": "parameters (float32)",
    "optimizer": "optimizer state",
    "gradients": "gradients",
    "compute_copies": "compute-dtype copies",
    "fsdp_gathered": f"fsdp gather ({GATHERED_LAYERS} layers)",
    "activations": "activations (saved)",
    "recompute": "recompute (1 layer)",
    "expert_exchange": "expert exchange slots",
    "pipeline_buffers": "pipeline buffers",
}


def advice(plan: dict, mesh: dict) -> list[str]:
    """What would make a step that does not fit, fit (largest part first)."""
    parts, step = plan["parts"], plan.get("step", {})
    out = []
    if parts["activations"] >= max(parts["parameters"], 1) and \
            step.get("remat", "none") in ("none", "dots"):
        out.append("remat='full' (keeps one input per layer)")
    if plan.get("per_device_batch", 1) > 1:
        out.append("a smaller micro_batch_size (gradient accumulation keeps the batch)")
    if parts["parameters"] + parts["optimizer"] + parts["gradients"] > plan["total"] / 3:
        out.append(f"a larger fsdp axis (now {mesh[FSDP.name]}) or model axis "
                   f"(now {mesh[MODEL.name]})")
    if not step.get("compute_dtype"):
        out.append("compute_dtype='bfloat16' (activations at half the bytes)")
    return out


def memory_text(plan: dict, mesh: dict) -> list[str]:
    """``Trainer.memory``'s result as lines: the parts, and XLA's compiled figures."""
    lines = [f"one training step, per device ({plan['per_device_batch']} rows of the "
             "micro-batch on each):", *part_lines(plan, mesh)]
    c = plan["compiled"]
    lines.append(f"XLA's compiled step on {c['platform']}: peak {size_text(c['peak'])} "
                 f"(arguments {size_text(c['arguments'])} + temporaries "
                 f"{size_text(c['temporaries'])} + outputs {size_text(c['outputs'])} - "
                 f"aliased {size_text(c['aliased'])})")
    return lines
