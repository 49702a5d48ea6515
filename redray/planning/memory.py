"""What a training step holds per device, by part: the one memory model, shared by
``redray plan`` (from a config, no devices: ``step_memory``), the planner, and
``Trainer.memory()`` (the user's own model and loss: ``redray/engine/facts.py``).

The state (parameters, optimizer moments) comes from the sharding plan. Beside it a
step holds:

* gradients: one per trained parameter, sharded like it, in its dtype;
* compute-dtype copies: with ``compute_dtype`` (bfloat16) the parameters are cast once
  per step and the copies live through the forward and backward passes;
* FSDP gather buffers: with an fsdp axis each layer's parameters are all-gathered
  before use; two layers are counted (the one computing and the next, prefetched);
* activations: the residuals the backward pass reads, traced by JAX itself
  (``jax.ad_checkpoint``'s saved residuals of the loss's linearization) on the
  per-device batch and sequence, under the remat policy;
* the recompute buffer: with a remat policy the backward pass re-runs one layer's
  forward, holding what that layer would have saved without remat.

Under tensor parallelism a residual counts 1/model per device when its shape holds a
size the rules split over ``model`` (heads, intermediate size, vocabulary), found on a
trace of a one-row batch aligned with the real one; the residual stream's width is
never such a size (Megatron keeps it whole). Under context parallelism a residual whose
shape holds the sequence length counts 1/context: the axis splits every sequence's
tokens, and the ring keeps of the keys and values only the device's own
(``redray/models/context.py``).

From a config, layers are traced at depth 1 and 2 and the difference extrapolated to
the model's depth (every layer is alike; where layers differ by a pattern, the depth
counts the pattern's periods after its first layers), so a plan of an 80-layer model
traces 2-layer ones. Checked against XLA's ``compiled.memory_analysis()`` of redray's real training
step at small sizes on CPU (``benchmarks/memory.py``, ``memory/plan_over_compiled``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from redray.models.layers import remat_policy
from redray.models.moe import ExpertLayers
from redray.planning.work import grouped_matmuls
from redray.sharding import AXES, Parallelism
from redray.sharding.tracing import blockwise_attention
from redray.sharding.parallelism import (GATHERING, held_layers, is_staged, pipeline_ticks,
                                         role_axes, role_size)
from redray.sharding.pipeline_schedules import one_f_one_b_table, runs_on_own_rows
from redray.sharding.rules import axes_of

# FSDP: the layers whose parameters are gathered at once (the one computing and the
# next, prefetched).
GATHERED_LAYERS = 2

def nbytes(shape, dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype``."""
    return math.prod(shape) * jnp.dtype(dtype).itemsize


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
        size = nbytes(aval.shape, aval.dtype)
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
    heads = set(role_axes("heads"))
    for row in param_rows:
        axes = {a for e in row.spec for a in axes_of(e)}
        if len(row.shape) == 1 and not heads & axes:
            whole.add(row.shape[0])
        for dim, entry in zip(row.shape, row.spec):
            if heads & set(axes_of(entry)):
                sizes.add(dim)
    return sizes - whole


def layer_gather_bytes(param_rows, fsdp: int) -> int:
    """Bytes of the largest layer's parameters on a device once gathered over fsdp. A
    layer is what shares a path up to its first numeric part (``layers/3/...``); under
    a first part without numbers whose parameters all lead with the same size
    (stacked, scanned layers; a stacked period's layers, ``layers/period/1/...``, are
    one row of it) one slice of each; anything else is its own group."""
    numbered: dict = {}
    unnumbered: dict = {}
    for row in param_rows:
        axes = {a for e in row.spec for a in axes_of(e)}
        gathered = row.bytes_per_device * (fsdp if set(GATHERING) & axes else 1)
        parts = row.path.split("/")
        index = next((i for i, part in enumerate(parts)
                      if part.isdigit() and (i == 0 or parts[i - 1] != "period")), None)
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


def chunk_share(stages: int, repeats: int = 1, layers: int = 0) -> float:
    """The share of a step's stacked layers that one chunk of ``S R`` runs: ``1/(S R)``,
    or where the chunks do not divide the ``layers`` (held padded,
    ``parallelism.layer_order``) ``ceil(L/(S R)) / L``: every chunk runs as many layer
    slots as the largest holds layers."""
    if not layers:
        return 1 / (stages * repeats)
    return held_layers(layers, stages, repeats) / (stages * repeats) / layers


def features_split(shape, hidden: int) -> int:
    """The ways pipeline stages split the hidden states they hold and pass over the
    model axis (``staged_layers.run_stages``, ``engine/one_f_one_b.py``: Megatron's
    sequence parallelism between the stages), where it divides their width."""
    model = role_size(shape, "heads")
    return model if model > 1 and hidden and hidden % model == 0 else 1


def pipelined_parts(parts: dict, stages: int, micro_batches: int, act_bytes: int,
                    repeats: int = 1, order: str = "gpipe", layers: int = 0,
                    split: int = 1, every_layer: bool = False,
                    recompute: bool = False) -> dict:
    """A step's memory ``parts`` (for one micro-batch of one device, as the memory
    models count it) on ``stages`` pipeline stages over ``micro_batches`` micro-batches
    (``redray/models/staged_layers.py``, GPipe or circular): each stage keeps what its
    ``L/(S R)`` layers (``chunk_share``: ``ceil(L/(S R))`` where the chunks do not
    divide the ``layers``) save at every one of the ``P R + S - 1`` ticks
    (``parallelism.pipeline_ticks``; the bubble's included: the schedule runs every stage at
    every tick) until the backward pass, and the head its ``M/S`` micro-batches' rows,
    so the saved activations are about ``(M + S - 1) / S`` times one micro-batch's
    without repeats (measured against XLA's compiled peak on CPU, LLaMA of 4 layers:
    0.85 at stage 2 x data 2, 0.96 at stage 4, against 0.90 without stages); the
    pipeline's buffers add the micro-batches' inputs and outputs (``2 M`` hidden states
    of ``act_bytes``) and the two slots in flight, ``1 / split`` of each where their
    features are split over the model axis (``features_split``).

    ``order="1f1b"`` (the 1F1B schedule, ``redray/sharding/pipeline_schedules.py``): a
    stage keeps a chunk's saved activations (``1/(S R)`` of one micro-batch's) from its
    forward to its backward, ``kept_slots`` of them at once (``2 S - 1`` on the first
    stage without repeats, where Megatron-LM's 1F1B keeps ``S``: redray's ticks each run a
    forward and a backward, so a micro-batch goes one stage a tick both ways; the
    chunk's input not among them: the ring holds it), and the schedule's slots of stage
    inputs and output gradients (``one_f_one_b_table``: ``2 S - 1`` and 1 without
    repeats) beside the first stage's inputs and their gradients (``2 M``) and the two
    passes in flight (``1 / split`` of each, as GPipe's), and
    its gradients are summed in the loop's carry before they meet the embeddings'
    (``pipeline_gradients``: one more copy of the gradients).

    With ``recompute`` (``Plan.stage_recompute``) a 1F1B stage keeps no chunk's
    activations: its backward recomputes one chunk's forward at a time (one chunk's
    share of one micro-batch's saved activations).

    ``every_layer``: ``parts``' expert exchange is every expert layer's (no remat), and
    is kept per layer as the activations are (a chunk's layers; GPipe's at every
    tick); else it is one layer's, as remat recomputes them."""
    if stages <= 1:
        return parts
    out = dict(parts)
    share = chunk_share(stages, repeats, layers)
    schedule = one_f_one_b_table(stages, micro_batches, repeats) if order == "1f1b" else None
    if every_layer and parts.get("expert_exchange"):
        # kept per layer as the activations are: a chunk's layers, in each chunk pass
        # 1F1B keeps at once (one recomputing), at each tick GPipe's
        out["expert_exchange"] = parts["expert_exchange"] * share * (
            (1 if recompute else schedule.kept_slots) if schedule
            else pipeline_ticks(stages, micro_batches, repeats)[1])
    if schedule:
        one = parts.get("activations", 0) * share
        # the chunk's input among them is the ring's (``pipeline_buffers``)
        out["activations"] = one if recompute else \
            max(one - act_bytes // split, 0) * schedule.kept_slots
        out["pipeline_buffers"] = (2 * micro_batches + schedule.slots + schedule.grad_slots
                                   + 2) * act_bytes // split
        out["pipeline_gradients"] = parts.get("gradients", 0)
        return out
    ticks = pipeline_ticks(stages, micro_batches, repeats)[1]
    out["activations"] = parts.get("activations", 0) * ticks * share
    out["pipeline_buffers"] = (2 * micro_batches + 2) * act_bytes // split
    return out


def step_parts(state: dict, rows, parallelism: Parallelism, per_device: int,
               accumulation: int, compute_itemsize: int, activations: int,
               recompute: int = 0, experts: Sequence[ExpertLayers] = (), tokens: int = 1,
               every_layer: bool = True, hidden: int = 0, schedule: str = "gpipe",
               repeats: int = 1, layers: int = 0, stage_recompute: bool = False) -> dict:
    """What one training step holds per device, by part: the one count behind
    ``Trainer.memory()``, the planner (``facts.memory``) and ``redray plan``
    (``step_memory``), each giving it what it knows of the state and the activations.

    Args:
      state: bytes per device of the state's parts: ``parameters`` (trained and
        frozen), ``optimizer``, ``gradients`` (one per trained parameter) and
        ``compute_copies`` (the parameters cast to the compute dtype).
      rows: the parameters' ``Placement`` rows on the plan (FSDP's gathered layers).
      parallelism: the plan (built or abstract).
      per_device: examples one device computes in one pass (a micro-batch).
      accumulation: micro-batches per step (a pipeline's, on a stage axis).
      compute_itemsize: bytes per activation element.
      activations, recompute: what the backward pass of one micro-batch keeps (traced),
        and the buffer a remat policy's recomputation holds.
      experts: the model's ``ExpertLayers``; their exchange on an expert axis.
      tokens: tokens per example one device computes (its share of a sequence split
        over a context axis).
      every_layer: every expert layer keeps its exchange (False: remat keeps one's).
      hidden: the width of the hidden states between layers (a pipeline's buffers).
      schedule, repeats: the pipeline's schedule ("gpipe" or "1f1b") and circular
        repeats, on a stage axis (``pipelined_parts``).
      layers: the model's stacked layers (0: a count the stages' chunks divide).
      stage_recompute: 1F1B's chunks recomputed in their backward (``Plan``).
    """
    parts = dict(state)
    fsdp = math.prod(parallelism.shape[a] for a in GATHERING)
    parts["fsdp_gathered"] = GATHERED_LAYERS * layer_gather_bytes(rows, fsdp) \
        * compute_itemsize // 4 if fsdp > 1 else 0
    # 1F1B on each device's own rows (pipeline_schedules.Local) holds a stage gathered
    local = schedule == "1f1b" and runs_on_own_rows(parallelism.shape)
    staged = 0
    if fsdp > 1 and parallelism.role_size("layers") > 1 and (schedule == "gpipe" or local):
        # GPipe's stages gather their stacked layers once, before the ticks, and sum
        # their gradients gathered until after them (staged_layers.run_stages): a
        # stage's whole share, in the compute dtype and as float32 gradients; 1F1B's
        # local stages the same, their gradients in its carry (``pipeline_gradients``)
        staged = sum(r.bytes_per_device * fsdp for r in rows if is_staged(r.spec)
                     and set(GATHERING) & {a for e in r.spec for a in axes_of(e)})
        parts["fsdp_gathered"] = staged * compute_itemsize // 4 + (
            staged if schedule == "gpipe" else 0)
    parts["activations"] = activations
    parts["recompute"] = recompute
    if parallelism.role_size("experts") > 1:
        parts["expert_exchange"] = expert_exchange_bytes(
            experts, parallelism.shape, per_device * tokens, compute_itemsize, every_layer)
    out = pipelined_parts(parts, parallelism.role_size("layers"), accumulation,
                          per_device * tokens * hidden * compute_itemsize, repeats, schedule,
                          layers, features_split(parallelism.shape, hidden), every_layer,
                          stage_recompute)
    if staged and schedule == "1f1b":  # the carry holds a stage's gradients gathered
        out["pipeline_gradients"] += staged - staged // fsdp
    return out


def hidden_width(shapes: Sequence[tuple], scanned: dict | None = None) -> int:
    """The width of the hidden states between layers, from the parameters' ``shapes``:
    a stacked layer's input norm's (``scanned``: the stacked parameters' indices, from
    the model's dataflow), else the smallest dimension of the largest matrix."""
    norms = [shapes[i][-1] for i, d in (scanned or {}).items() if len(shapes[i]) == 2]
    if norms:
        return min(norms)
    largest = max((s for s in shapes if len(s) >= 2), key=math.prod, default=(1,))
    return min(largest)


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
    "pipeline_gradients": "1F1B gradients' carry",
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
        out.append("a larger " + " or ".join(
            f"{a.name} axis (now {mesh[a.name]})" for a in AXES
            if a.gathers or "heads" in a.roles))
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


def expert_layers(model) -> list[ExpertLayers]:
    """The mixture-of-experts layers of an NNX ``model`` (its arrays concrete or
    abstract): every module of its graph with an ``expert_layers()`` method (redray's
    ``MoE``), layers stacked by ``scan`` counted in ``layers``."""
    from flax import nnx

    return [node.expert_layers() for _, node in nnx.iter_graph(model)
            if callable(getattr(type(node), "expert_layers", None))]


def context_states(model) -> tuple[int, int]:
    """(the layers of an NNX ``model`` that pass a state over a context axis in place of
    a ring, stacked ones each counted, and the float32 elements one sequence chunk
    passes in each): the modules of its graph with a ``context_state()`` method
    (redray's Gated DeltaNet); (0, 0) for a model without."""
    from flax import nnx

    found = [node.context_state() for _, node in nnx.iter_graph(model)
             if callable(getattr(type(node), "context_state", None))]
    return sum(n for n, _ in found), max((e for _, e in found), default=0)


def expert_exchange_bytes(layers: Sequence[ExpertLayers], shape: dict[str, int], tokens: int,
                          itemsize: int, every_layer: bool = True) -> int:
    """What expert parallelism's exchange keeps per device for the backward pass beyond
    what a dispatch of the device's own tokens keeps (the memory models trace that one),
    per layer, each row its hidden vector and its gate, up and gated outputs (3 x inner /
    model): with a capacity factor (the all-to-all), experts x slots rows in place of the
    tokens' tokens x top_k assignments (equal at a factor of 1); dropless (the gather),
    the expert group's ways x tokens x top_k assignments and its gathered tokens.

    Args:
      layers: the model's ``ExpertLayers``.
      shape: the mesh's axis sizes (nothing without an expert axis).
      tokens: tokens per device in a micro-batch.
      itemsize: bytes per activation element.
      every_layer: all layers keep theirs (no remat); False: one layer's at a time
        (remat recomputes each layer's in its backward pass).
    """
    ways = role_size(shape, "experts")
    if ways <= 1:
        return 0
    extra = 0
    for e in layers:
        if e.capacity_factor is None:  # the gather: the group's rows and its tokens
            rows, gathered = (ways - 1) * tokens * e.top_k, (ways - 1) * tokens * e.hidden
        else:
            rows, gathered = max(0, e.experts * e.slots(tokens) - tokens * e.top_k), 0
        per_layer = (rows * (e.hidden + 3 * e.inner // role_size(shape, "heads"))
                     + gathered) * itemsize
        extra += per_layer * (e.layers if every_layer else 1)
    return extra


def layer_depth(config) -> tuple[tuple[str, ...], list[int]]:
    """(the config fields that count a model's layers, its family's ``layer_fields``;
    its depth in each, in units that are alike: layers, or where a decoder's layers
    stack by a pattern, ``redray.models.layers.LayerPattern``, the period's repeats
    after the first layers)."""
    fields = _family(config).layer_fields
    pattern = _pattern(config, fields)
    if pattern is not None:
        return fields, [pattern.repeats]
    return fields, [getattr(config, f) for f in fields]


def _family(config):
    from redray.models.families import lookup

    return lookup(config.model_type)


def _pattern(config, fields):
    """The layer pattern of a one-stack decoder whose pattern repeats a period longer
    than a layer or starts late (its depth then counts periods), else None."""
    pattern = getattr(getattr(_family(config).code, "Model", None), "pattern", None)
    if pattern is None or len(fields) != 1:
        return None
    found = pattern(config)
    return found if (found.first, found.period) != (0, 1) else None


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The step a memory plan is for.

    Attributes:
      batch_size: examples per optimizer update over all devices (micro batch: the
        examples one forward/backward pass holds; ``batch_size`` unless accumulating).
      seq_len: tokens per example the model sees.
      remat: "none", "full", "dots" or "offload" (as the models' ``remat=``).
      compute_dtype: e.g. "bfloat16": the parameters are cast to it for the step and the
        model is built in it (``build(config, dtype=...)``, with ``Trainer(...,
        compute_dtype=...)``); None computes in the parameters' float32.
      loss_chunk: tokens whose logits exist at once (``next_token_loss(chunk=)``).
      micro_batch_size: examples per forward/backward pass (gradient accumulation);
        None: ``batch_size``.
      scan: the model's layers stacked and scanned (None: as ``build`` builds them by
        default); what the backward pass keeps of a scanned stack is not a list's.
      stage_repeats: the pipeline's circular repeats on a stage axis
        (``Trainer.of(stage_repeats=)``).
      pipeline_schedule: "gpipe" or "1f1b" (``Trainer.of(pipeline_schedule=)``).
      stage_recompute: 1F1B's chunks recomputed in their backward (``Plan``).
    """

    batch_size: int
    seq_len: int
    remat: str = "none"
    compute_dtype: str | None = None
    loss_chunk: int | None = None
    micro_batch_size: int | None = None
    scan: bool | None = None
    stage_repeats: int = 1
    pipeline_schedule: str = "gpipe"
    stage_recompute: bool = False

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "stage_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        remat_policy(self.remat)  # a clear error naming the policies
        if self.pipeline_schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"pipeline_schedule {self.pipeline_schedule!r}: use 'gpipe' or "
                             "'1f1b'")
        if self.compute_dtype is not None:
            try:
                jnp.dtype(self.compute_dtype)
            except TypeError:
                raise ValueError(f"compute_dtype {self.compute_dtype!r} is not a dtype: use "
                                 "e.g. 'bfloat16' or None") from None

    @property
    def micro(self) -> int:
        return self.micro_batch_size or self.batch_size


def _loss(model, inputs, chunk):
    from redray.models.losses import next_token_loss

    if "decoder_input_ids" in inputs:  # encoder-decoder: the decoder's tokens as targets
        logits = model(**inputs, train=True).astype(jnp.float32)
        targets = inputs["decoder_input_ids"]
        logz = jax.nn.logsumexp(logits, -1)
        return jnp.mean(logz - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])
    return next_token_loss(model, inputs["input_ids"], chunk=chunk, train=True)


def _abstract_loss(fam, config, batch: int, seq: int, policy: str, compute_dtype, chunk,
                   scan: bool | None = None):
    """(loss(params, extra, inputs), params, extra, inputs), all abstract: one loss
    evaluation of ``config``'s model (its layers stacked or not as ``scan`` says, see
    ``build``) on ``batch`` examples of ``seq`` tokens."""
    from flax import nnx

    from redray.rngs import rngs as fast_rngs

    # a model trained in a compute dtype is built in it too (redray's models compute in
    # their ``dtype``; bfloat16 parameters in a float32 model are cast back per matmul)
    abstract = nnx.eval_shape(lambda: fam.Model(config, rngs=fast_rngs(0), remat=policy,
                                                dtype=compute_dtype or jnp.float32,
                                                scan=scan))
    graphdef, params, extra = nnx.split(abstract, nnx.Param, ...)
    if compute_dtype is not None:  # the copies are counted apart
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute_dtype)
                              if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    inputs = fam.trace_inputs(config, batch, seq)
    if "decoder_input_ids" not in inputs:  # next_token_loss feeds seq tokens of seq + 1
        inputs = {"input_ids": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)}

    def loss(params, extra, inputs):
        return _loss(nnx.merge(graphdef, params, extra), inputs, chunk)

    return loss, params, extra, inputs


def _trace(fam, config, batch: int, seq: int, policy: str, compute_dtype, chunk,
           scan: bool | None) -> list:
    """Shapes and dtypes of the residuals of one loss evaluation (parameters excluded)."""
    return saved_residuals(*_abstract_loss(fam, config, batch, seq, policy, compute_dtype,
                                           chunk, scan))


def example_flops(fam, config, seq: int, compute_dtype=None, chunk=None,
                  grouped: bool = False) -> float:
    """FLOPs of one example's forward and backward pass (no remat), from XLA's cost
    analysis of the lowered gradient, at depth 1 and 2 and extrapolated to the model's
    depth (every layer is alike); ``grouped``: a mixture of experts' grouped matmuls
    counted as a GPU or TPU runs them (``redray.planning.work.grouped_matmuls``), not
    as XLA:CPU's dense fallback does."""
    fields, depth = layer_depth(config)

    def at(counts):
        # the layers as a list: XLA's cost analysis counts a loop's body once
        loss, params, extra, inputs = _abstract_loss(
            fam, _with_layers(config, fields, counts), 1, seq, "none", compute_dtype, chunk,
            scan=False)
        def fresh(params, extra, inputs):
            # dropout's key counts made in the trace that advances them (an abstract
            # state given from outside cannot be mutated inside the gradient's trace)
            return loss(params, jax.tree.map(_fresh_state, extra), inputs)

        with grouped_matmuls() if grouped else contextlib.nullcontext():
            lowered = jax.jit(jax.grad(fresh)).lower(params, extra, inputs)
        return float(lowered.cost_analysis()["flops"])

    base = at([1] * len(fields))
    deltas = [at([2 if j == i else 1 for j in range(len(fields))]) - base
              for i in range(len(fields))]
    return base + sum((n - 1) * d for n, d in zip(depth, deltas))


def _fresh_state(x):
    """A value of ``x``'s shape and dtype (an abstract array's), made where it is called."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.split(jax.random.key(0), x.shape) if x.shape else jax.random.key(0)
    return jnp.zeros(x.shape, x.dtype)


def _with_layers(config, fields, counts):
    """``config`` at ``counts`` units of depth in each field (``layer_depth``'s): a
    pattern's first layers and ``counts`` periods, or ``counts`` layers; a decoder's
    per-layer fields cut or continued with it (``CausalLM.at_depth``)."""
    pattern = _pattern(config, fields)
    at_depth = getattr(getattr(_family(config).code, "Model", None), "at_depth", None)
    if at_depth is not None and len(fields) == 1:
        (n,) = counts
        return at_depth(config, n if pattern is None else pattern.first + n * pattern.period)
    config = config.__class__.from_dict(config.to_dict())
    for field, n in zip(fields, counts):
        setattr(config, field, n)
    return config


def config_activation_bytes(fam, config, step: StepShape, per_device_batch: int, model_axis: int,
                     split_sizes: set[int], traces: dict | None = None,
                     context: int = 1, blockwise: bool = False) -> dict:
    """{"saved": residual bytes per device for the whole model, "recompute": one
    layer's rematerialized residuals (0 without remat), "per_layer": saved bytes of one
    layer, "host": residual bytes offloaded to host memory ("offload" policy)}.

    With ``traces`` (a dict kept between calls, the planner's) the traces are reused
    and a batch beyond 2 rows is extrapolated from 1 and 2 (every residual holds the
    batch, or nothing that grows with it: the count is linear in the rows)."""
    policy = remat_policy(step.remat)
    if traces is None:
        fields, depth = layer_depth(config)
    else:  # the same for every candidate: read once
        if "layer_depth" not in traces:
            traces["layer_depth"] = layer_depth(config)
        fields, depth = traces["layer_depth"]
    # offload keeps the matmul outputs in host memory: on the device it holds what
    # "full" holds; the host holds what "dots" adds to that.
    traced = ({"full", "dots"} if policy == "offload" else {policy}) | {"none"}

    def residuals(counts, batch: int, name: str) -> list:
        key = (tuple(counts), batch, name)
        if traces is None or key not in traces:
            # on a context axis every attention is blockwise (the ring's); on devices
            # with fused kernels (``blockwise``: a GPU or TPU planned from here) they
            # save what the blockwise kernel saves, not the (queries x keys) scores
            with blockwise_attention() if context > 1 or blockwise \
                    else contextlib.nullcontext():
                found = _trace(fam, _with_layers(config, fields, counts), batch, step.seq_len,
                               name, step.compute_dtype, step.loss_chunk, step.scan)
            if traces is None:
                return found
            traces[key] = found
        return traces[key]

    splits = (frozenset(split_sizes), model_axis, context)

    def measure(name):
        def at(counts):
            probe = residuals(counts, 1, name)

            def rows(batch: int) -> int:
                # the planner's candidates share a few splits: each counted once
                key = ("bytes", tuple(counts), batch, name, splits)
                if traces is not None and key in traces:
                    return traces[key]
                found = split_residual_bytes(residuals(counts, batch, name), probe, split_sizes,
                                             model_axis,
                                             frozenset({step.seq_len, step.seq_len + 1}), context)
                if traces is not None:
                    traces[key] = found
                return found

            if traces is None or per_device_batch <= 2:
                return rows(per_device_batch)
            one, two = rows(1), rows(2)
            return one + (per_device_batch - 1) * (two - one)

        base = at([1] * len(fields))
        deltas = [at([2 if j == i else 1 for j in range(len(fields))]) - base
                  for i in range(len(fields))]
        whole = base + sum((n - 1) * d for n, d in zip(depth, deltas))
        return whole, deltas

    results = {name: measure(name) for name in traced}
    device = "full" if policy == "offload" else policy
    saved, deltas = results[device]
    none_deltas = results["none"][1]
    recompute = 0 if policy == "none" else max(n - d for n, d in zip(none_deltas, deltas))
    host = results["dots"][0] - saved if policy == "offload" else 0
    return {"saved": int(saved), "recompute": int(max(recompute, 0)),
            "per_layer": int(max(deltas)), "host": int(max(host, 0))}


def step_memory(fam, config, param_rows, opt_bytes: int, parallelism: Parallelism,
                step: StepShape, device_gib: float | None = None,
                traces: dict | None = None, experts=(), blockwise: bool = False,
                layers: int | None = None) -> dict:
    """Bytes per device of one training step of ``config``'s model on ``parallelism``
    (built, or abstract) (see the module); ``experts``: its mixture-of-experts layers
    (``redray.models.moe.ExpertLayers``), whose exchange an expert axis adds; on a
    stage axis, what the pipeline's micro-batches hold (``pipelined_parts``).
    ``blockwise``: count attention as a fused kernel keeps it (planned for a GPU or TPU
    from another machine): the blockwise kernel's residuals. ``layers``: the model's
    stacked layers (None: read from the stage-split rows of ``param_rows``).

    Returns a JSON-ready dict: ``parts`` (name -> bytes per device: parameters,
    optimizer, gradients, compute_copies, fsdp_gathered, activations, recompute, and on
    an expert axis expert_exchange),
    ``total``, ``per_device_batch``, ``offloaded_to_host``, the ``step`` it is for and,
    with ``device_gib``, ``fits`` and ``device_bytes``.
    """
    geometry = parallelism.step_geometry(step.batch_size, step.micro)
    per_device = geometry.micro_batch_size
    params = sum(r.bytes_per_device for r in param_rows)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", 0)
    acts = config_activation_bytes(fam, config, step, per_device,
                            parallelism.role_size("heads"), split_sizes(param_rows, hidden),
                            traces, parallelism.role_size("sequence"),
                            blockwise)
    copies = 0
    item = jnp.dtype(step.compute_dtype).itemsize if step.compute_dtype else 4
    if step.compute_dtype and jnp.dtype(step.compute_dtype) != jnp.float32:
        copies = params * item // 4
    state = {"parameters": params, "optimizer": opt_bytes, "gradients": params,
             "compute_copies": copies}
    if layers is None:
        layers = max((r.shape[0] for r in param_rows if is_staged(r.spec)), default=0)
    parts = step_parts(state, param_rows, parallelism, per_device, geometry.accumulation,
                       item, acts["saved"], acts["recompute"], experts,
                       -(-step.seq_len // parallelism.role_size("sequence")),
                       step.remat in ("none", "dots"), hidden, step.pipeline_schedule,
                       step.stage_repeats, layers, step.stage_recompute)
    return {**totals(parts, device_gib), "per_device_batch": per_device,
            "activations_per_layer": acts["per_layer"], "offloaded_to_host": acts["host"],
            "step": dataclasses.asdict(step)}
