"""The plan chosen for the user: every feasible way to split a step over the devices,
its memory per device and its predicted time, the fastest that fits.

A candidate is a ``Plan`` (``redray.sharding.plan``, the value a Trainer runs) over an
abstract mesh: a size for every mesh axis (their product the device count, an axis that
must stay inside a host no larger than a host), a micro-batch per device (hence the
accumulation), a remat policy and, with stages, a pipeline schedule. What the user pins
(an axis size, the micro-batch, remat) is kept; the rest is enumerated. For each
candidate the spec passes give every parameter its spec (from one dataflow trace shared
by all), the model's facts give its memory per device and FLOPs, and ``cost.py`` its
step time on the ``Hardware``. Candidates over the device memory less ``margin`` are
dropped; the rest are ranked by predicted seconds per step. No candidate is run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from redray.planning.cost import (LEVELS, DeviceWork, ModelTiming, Parameter, StepCost,
                                  context_traffic, expert_traffic, host_spans, stage_traffic,
                                  state_traffic, step_cost, tensor_traffic, whole_flops,
                                  work_seconds)
from redray.sharding.dataflow import Trace
from redray.planning.hardware import GB, Hardware
from redray.planning.memory import (chunk_share, features_split, hidden_width, part_lines,
                                    size_text)
from redray.planning.work import ModelWork, Work
from redray.sharding.parallelism import (ACROSS, AXES, INSIDE, OUTER, Parallelism,
                                         axis_defaults, held_layers, is_staged,
                                         network_shapes, pipeline_ticks, role_keywords,
                                         role_size)
from redray.sharding.pipeline_schedules import one_f_one_b_table, runs_on_own_rows
from redray.sharding.placement import Placement, placement
from redray.sharding.plan import Plan
from redray.sharding.rules import partition_specs

# What of a device's memory a plan may use: the rest absorbs what the memory model does
# not count (XLA's temporaries, fragmentation, the runtime's own buffers).
MARGIN = 0.1


class ModelFacts:
    """What the planner knows of a model, as one typed value: ``RuntimeFacts``
    (``redray/engine/facts.py``: a Trainer's own model and loss) and
    ``redray.planning.from_config.ConfigFacts`` (a Hugging Face config) set every field;
    the optional ones keep the defaults here.

    Attributes:
      paths, shapes, dtypes: the parameters'.
      trace: the model's dataflow, traced on ``trace_examples`` examples (None: none).
      tokens_per_example: tokens in one example the batch holds.
      compute_itemsize: bytes per activation element.
      remat_policies: the policies it can be built with.
      trained: which parameters are trained (None: all).
      timing: the model's pass timed on the live devices, or None.
      experts: its mixture-of-experts layers, empty for a dense model.
      one_f_one_b: whether its plans with stages may run the 1F1B schedule.
      kv_width, attention_layers: a token's key or value elements and the attention
        layers, for a context axis's ring (None: the hidden width and the stacked layers).
      kv_heads: the key/value heads those elements hold (0: unknown): a model axis that
        divides them leaves each device its share of the heads, and so of the ring's
        keys and values (``kv_split``).
      linear_layers, linear_state: the linear-attention layers (Gated DeltaNet), which
        pass a state over a context axis in place of a ring, and the float32 elements
        of one sequence chunk's state map (``cost.context_traffic``); 0: none.
      splits_sequences: whether its model splits a sequence over a context axis
        (redray's decoders), which the planner then tries beside the other axes where
        the batch has fewer sequences than devices, and wherever no plan fits whole
        sequences (``rank``).
    """

    paths: Sequence[str]
    shapes: Sequence[tuple[int, ...]]
    dtypes: Sequence
    trace: Trace | None
    trace_examples: int
    tokens_per_example: int
    compute_itemsize: int
    remat_policies: Sequence[str]
    trained: Sequence[bool] | None = None
    timing: ModelTiming | None = None
    experts: Sequence = ()
    one_f_one_b: bool = False
    kv_width: int | None = None
    kv_heads: int = 0
    attention_layers: int | None = None
    linear_layers: int = 0
    linear_state: int = 0
    splits_sequences: bool = False

    def flops(self, remat: str) -> float:
        """Matmul FLOPs of one example's forward and backward pass under ``remat``."""
        raise NotImplementedError

    @functools.cached_property
    def lookups(self) -> frozenset[int]:
        """The parameters the trace only looks up (input embeddings: no matmul reads
        them, as a tied head would)."""
        if self.trace is None:
            return frozenset()
        runs = self.trace.runs()
        dots = {p for p, use in runs if use.kind == "dot"}
        return frozenset(p for p, use in runs if use.kind == "gather" and p not in dots)

    def work(self) -> ModelWork | None:
        """One example's work by kind (``redray.planning.work``), or None where it is not
        counted (its FLOPs then cost at the matmul rate)."""
        return None

    def memory(self, parallelism: Parallelism, rows: list[Placement], per_device_batch: int,
               remat: str, accumulation: int = 1, schedule: str = "gpipe",
               repeats: int = 1, stage_recompute: bool = False) -> dict:
        """What a step holds per device (``parts``, ``total``): ``accumulation``
        micro-batches of ``per_device_batch`` examples a device, the pipeline's
        ``schedule``, circular ``repeats`` and 1F1B's ``stage_recompute`` on a stage
        axis (``redray.planning.memory.step_parts``)."""
        raise NotImplementedError


def grid_plan(sizes: dict, micro_batch_size: int, remat: str, batch_size: int,
              pipeline_schedule: str = "gpipe", rules=(), repeats: int = 1,
              context_attention: str = "auto", stage_recompute: bool = False) -> Plan:
    """A candidate: the plan of axis ``sizes`` (keyword -> size, every axis) over an
    abstract mesh of their devices, ``micro_batch_size`` examples per device per pass of
    the global ``batch_size``, ``remat``, ``pipeline_schedule`` and its circular
    ``repeats`` (1F1B's chunks recomputed with ``stage_recompute``),
    ``context_attention`` on a context axis."""
    parallelism = Parallelism.of(rules=rules, **sizes).abstract(math.prod(sizes.values()))
    return Plan.of(parallelism, parallelism.geometry(batch_size, micro_batch_size),
                   pipeline_schedule=pipeline_schedule, remat=remat, stage_repeats=repeats,
                   context_attention=context_attention, stage_recompute=stage_recompute)


@dataclasses.dataclass(frozen=True)
class Scored:
    """A candidate plan with its memory and predicted step."""
    plan: Plan
    memory: dict
    cost: StepCost
    fits: bool
    tokens_per_s: float
    mfu: float

    @property
    def accumulation(self) -> int:
        """The plan's passes per step (accumulation steps, or pipeline micro-batches)."""
        return self.plan.geometry.accumulation


@dataclasses.dataclass(frozen=True)
class Ranking:
    """Every candidate scored, the fitting ones fastest first.

    Attributes:
      ranked: the candidates that fit, fastest first.
      over: those over the budget, smallest memory first.
      budget: the bytes a plan may use on one device.
      hardware: what they were costed on.
      timing: the model's pass as timed on the live devices, if it was.
      untimed: on live devices, why the pass was not timed (the plans then costed on
        the hardware's rates), else None.
      hosts: the hosts the devices are in (in ``hardware.slices`` slices).
      left_out: the fastest plan that fits with more than the data axis across slices,
        where it is predicted faster than the pick (``crosses_slices_as_data``), else
        None.
      layers: the model's stacked layers (what stages split; 0: none).
    """
    ranked: list[Scored]
    over: list[Scored]
    budget: float
    hardware: Hardware
    timing: ModelTiming | None = None
    untimed: str | None = None
    hosts: int = 1
    left_out: Scored | None = None
    layers: int = 0

    @property
    def best(self) -> Scored:
        return self.ranked[0]

    def why(self) -> str:
        """One line: the pick, its predicted speed, and what made the runner-up lose."""
        best = self.best
        line = (f"plan: {best.plan.brief()} ({best.cost.seconds * 1e3:.1f} ms per "
                f"step predicted, {size_text(best.memory['total'])} of "
                f"{size_text(self.budget)} per device)")
        if len(self.ranked) > 1:
            second = self.ranked[1]
            loses = _loses_on(best.cost, second.cost, best.accumulation, second.accumulation)
            line += (f"; runner-up {second.plan.brief()}: "
                     f"{second.cost.seconds / best.cost.seconds:.3f}x the time ({loses})")
        if self.untimed:
            line += f"; costed on the hardware's rates, the model's pass not timed ({self.untimed})"
        if self.left_out is not None:
            line += (f"; {self.left_out.plan.brief()} is predicted "
                     f"{best.cost.seconds / self.left_out.cost.seconds:.3f}x faster but "
                     "crosses the slices with more than the data axis: left out, as "
                     "MaxText's defaults do (pin its axes to take it)")
        return line

    def explain(self, memory: bool = True) -> str:
        """The best plan's memory per device by part (with ``memory``), and what its step
        sends on each level of the network (``network_levels``), one per line."""
        best = self.best
        lines = [f"memory per device ({best.plan.brief()}):",
                 *part_lines(best.memory, best.plan.shape)] if memory else []
        lines.append("traffic per device per step, by level of the network (before the "
                     "compute hides any):")
        for row in network_levels(best.plan.shape, self.hosts, self.hardware, best.cost):
            axes = " x ".join(f"{a}={n}" for a, n in row["axes"].items()) or "no axis"
            lines.append(f"  {row['level']:<25} {axes:<20} {size_text(row['bytes']):>11} "
                         f"{row['seconds'] * 1e3:>9.1f} ms  ({row['link_gb_per_s']:g} GB/s "
                         "per device)")
        return "\n".join(lines)

    def table(self, rows: int = 10) -> str:
        """The ranked candidates, fastest first (their predicted step; compute, the
        tensor-parallel all-reduces and the gradient/FSDP traffic the compute does not
        hide), and how many did not fit."""
        out = [f"{'plan':<50} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'memory':>10} "
               f"{'compute':>9} {'tensor':>9} {'grads':>9}",
               f"{'':<50} {'':>9} {'':>11} {'':>6} {'':>10} {'ms':>9} {'ms':>9} "
               f"{'ms shown':>9}"]
        for s in self.ranked[:rows]:
            c = s.cost
            out.append(f"{s.plan.brief():<50} {c.seconds * 1e3:>9.1f} "
                       f"{s.tokens_per_s:>11,.0f} {s.mfu:>6.1%} "
                       f"{size_text(s.memory['total']):>10} {c.compute * 1e3:>9.1f} "
                       f"{c.tensor * 1e3:>9.1f} {c.exposed * 1e3:>9.1f}")
        more = len(self.ranked) - rows
        if more > 0:
            out.append(f"... {more} more that fit")
        if self.over:
            out.append(f"{len(self.over)} over the budget of {size_text(self.budget)} per "
                       f"device (smallest: {self.over[0].plan.brief()}, "
                       f"{size_text(self.over[0].memory['total'])})")
        return "\n".join(out)


def crosses_slices_as_data(shape: dict[str, int], hosts: int, slices: int) -> bool:
    """Whether only the axes that take what the others leave (the data axis) or come
    first across hosts (stages) cross the slices of a plan of ``shape``: MaxText's
    default (``dcn_data_parallelism``, every other DCN axis 1), which ``rank`` keeps
    wherever such a plan fits. The cost model prices FSDP's per-layer gathers across
    slices as hidden behind each layer's compute (about as many bytes as the data
    axis's reduction: each carries a device's shard once), which holds only while every
    transfer on the shared data-centre network arrives in time; a late one stalls each
    layer's forward and backward there, the data axis's reduction once a layer's
    backward."""
    if slices <= 1:
        return True
    sizes = [shape.get(a.name, 1) for a in AXES]
    split = network_shapes(sizes, slices, hosts, math.prod(sizes) // hosts)
    return split is not None and all(
        n == 1 or a.hosts in (ACROSS, OUTER) for a, n in zip(AXES, split[0]))


def network_levels(shape: dict[str, int], hosts: int, hardware: Hardware,
                   cost: StepCost) -> list[dict]:
    """Each level of the network the cluster has (``cost.LEVELS``: inside a host;
    between hosts, where there are several in a slice; across slices, where there are
    several): the axes whose groups cross it (axis name -> the ways it spans there),
    its link's bandwidth per device, and what a plan's step (``cost``) sends over it
    per device, in bytes and seconds before any overlap."""
    slices = hardware.slices(math.prod(shape.values()))
    spans = host_spans(shape, hosts, slices)
    links = (hardware.intra, hardware.inter, hardware.across_slices)
    levels = cost.levels or ((0.0, 0.0),) * len(LEVELS)
    present = (True, hosts > slices, slices > 1)
    return [{"level": name, "axes": {a: span[k] for a, span in spans.items() if span[k] > 1},
             "link_gb_per_s": link.bandwidth / GB, "bytes": sent, "seconds": sec}
            for k, (name, link, (sent, sec), shown)
            in enumerate(zip(LEVELS, links, levels, present)) if shown]


class NoPlanFits(ValueError):
    """No candidate fits the device memory; the message names the smallest and what to
    change."""


def _loses_on(best: StepCost, other: StepCost, best_micro_batches: int = 1,
              other_micro_batches: int = 1) -> str:
    parts = {"compute": other.compute - best.compute, "tensor-parallel traffic":
             other.tensor - best.tensor, "gradient and FSDP traffic":
             other.exposed - best.exposed, "micro-batch overhead": other.overhead - best.overhead,
             "optimizer update": other.update - best.update,
             "expert all-to-all traffic": other.experts - best.experts,
             "pipeline traffic": other.pipeline - best.pipeline}
    part = max(parts, key=parts.get)
    if parts[part] > 0:
        return f"more {part}: +{parts[part] * 1e3:.3g} ms"
    # a tie on the predicted step: the order's next keys decided (rank's sort)
    hidden = (other.gradients + other.tensor) - (best.gradients + best.tensor)
    if hidden > 0:
        return (f"as fast predicted, with more traffic for the compute to hide: "
                f"+{hidden * 1e3:.3g} ms")
    if other_micro_batches > best_micro_batches:
        return (f"as fast predicted, with no less traffic and {other_micro_batches} "
                f"micro-batches a step, not {best_micro_batches}")
    return "as fast predicted, with no less traffic and more memory"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_sizes(devices: int, hosts: int, pinned: dict, slices: int = 1) -> list[dict[str, int]]:
    """Every assignment of sizes (keyword -> size) to the axes whose product is
    ``devices``, an axis that stays inside a host no larger than a host and the mesh
    placeable on ``hosts`` hosts in ``slices`` slices; pinned sizes kept."""
    if devices % hosts:
        raise ValueError(f"{devices} devices do not split over {hosts} hosts evenly")
    if hosts % slices:
        raise ValueError(f"{hosts} hosts do not split over {slices} slices evenly")
    local = devices // hosts
    out = []

    def assign(k: int, left: int, sizes: dict):
        if k == len(AXES):
            if left == 1:
                out.append(dict(sizes))
            return
        axis = AXES[k]
        options = [pinned[axis.keyword]] if axis.keyword in pinned else _divisors(left)
        for size in options:
            if left % size or (axis.hosts == INSIDE and local % size):
                continue
            assign(k + 1, left // size, {**sizes, axis.keyword: size})

    assign(0, devices, {})
    return [s for s in out
            if network_shapes([s[a.keyword] for a in AXES], slices, hosts, local)]


def candidates(devices: int, hosts: int, batch_size: int, remat_policies: Sequence[str],
               pinned: dict | None = None, experts: int = 0,
               layers: int = 0, one_f_one_b: bool = False, rules=(),
               refused: dict | None = None, slices: int = 1) -> list[Plan]:
    """Every candidate of the grid (see the module docstring).

    Args:
      devices, hosts, slices: the cluster.
      batch_size: examples per step over all devices.
      remat_policies: the policies to consider.
      pinned: what the user fixed: axis keywords -> size, ``micro_batch_size`` (per
        device) or ``micro_rows`` (over all devices), ``remat``.
      experts: the experts of the model's mixture-of-experts layers (their greatest
        common divisor), 0 for a dense model: the expert axis takes the sizes that
        divide it (a dense model's only 1: it would be the data axis by another name).
      layers: the stacked (scanned) layers of the model, 0 where it has none: the stage
        axis takes the sizes up to them (where a size does not divide them the run holds
        them padded, ``parallelism.layer_order``), with at least as many micro-batches
        as stages (a model without stacked layers cannot be pipelined: only 1).
      one_f_one_b: the model can run the 1F1B schedule (one stack of layers, a Trainer
        that allows it): plans with stages are also tried with it, under every remat
        policy (a chunk's forward keeps what the policy saves until its backward).
      rules: the user's sharding rules, in every plan.
      refused: where given, why splits of the devices were left out: filled with
        "experts", "layers" (a stage count above the layers), "batch"
        (the smallest data-parallel size that did not divide the batch), "micro" (too
        few micro-batches for the stages, or a pinned micro-batch that does not divide
        a device's share), "splits" (how many splits of the devices there were).
    """
    refused = {} if refused is None else refused
    pinned = dict(pinned or {})
    # an axis splitting experts or layers takes 1 where the model has none; one splitting
    # sequences is the size given (1 unless pinned): ``rank`` asks for the sizes it tries
    for role, has in (("experts", experts), ("sequence", False), ("layers", layers)):
        if not has:
            for keyword in role_keywords(role):
                pinned.setdefault(keyword, 1)
    micro_pin = pinned.pop("micro_batch_size", None)
    rows_pin = pinned.pop("micro_rows", None)
    remat_pin = pinned.pop("remat", None)
    remats = [remat_pin] if remat_pin is not None else list(remat_policies)
    schedule_pin = pinned.pop("pipeline_schedule", None)
    schedules = [schedule_pin] if schedule_pin is not None else \
        ["gpipe", "1f1b"] if one_f_one_b else ["gpipe"]
    repeats_pin = pinned.pop("stage_repeats", None)
    recompute_pin = pinned.pop("stage_recompute", None)
    context = pinned.pop("context_attention", "auto")
    out = []
    splits = axis_sizes(devices, hosts, pinned, slices)
    refused["splits"] = refused.get("splits", 0) + len(splits)
    for sizes in splits:
        by_name = {a.name: sizes[a.keyword] for a in AXES}
        if experts and experts % role_size(by_name, "experts"):
            refused["experts"] = refused.get("experts", 0) + 1
            continue
        stages = role_size(by_name, "layers")
        if stages > 1 and stages > layers:  # each stage needs a layer (more: pads)
            refused.setdefault("layers", set()).add(stages)
            continue
        dp = math.prod(sizes[a.keyword] for a in AXES if a.splits_batch)
        if batch_size % dp:
            refused["batch"] = min(refused.get("batch", dp), dp)
            continue
        per_device = batch_size // dp
        if rows_pin is not None:
            if rows_pin % dp:
                refused["micro"] = refused.get("micro", 0) + 1
                continue
            micro_pin = rows_pin // dp
        micros = [micro_pin] if micro_pin is not None else _divisors(per_device)
        for micro in micros:
            if per_device % micro or (stages > 1 and per_device // micro < stages):
                refused["micro"] = refused.get("micro", 0) + 1
                continue
            for remat in remats:
                for schedule, again in _schedules(schedules, stages, remat, recompute_pin):
                    for repeats in _repeats(layers, stages, repeats_pin):
                        out.append(grid_plan(sizes, micro, remat, batch_size, schedule,
                                             rules, repeats, context, again))
    return out


def _schedules(schedules: list[str], stages: int, remat: str,
               pinned: bool | None) -> list[tuple]:
    """(schedule, ``stage_recompute``) pairs a plan of ``stages`` under ``remat`` may
    take (without stages only GPipe's, the plain step): 1F1B keeping its chunks'
    activations, and without remat inside the layers 1F1B recomputing each chunk (a
    remat policy inside a recomputed chunk would run its forward twice more);
    ``pinned``: only that choice."""
    out = []
    for schedule in schedules if stages > 1 else ["gpipe"]:
        for again in ((False, True) if schedule == "1f1b" and remat == "none" else (False,)):
            if pinned is None or again == pinned:
                out.append((schedule, again))
    return out


# The most circular repeats tried: each halves the bubble's share again, while the
# passes between stages grow with them.
MAX_REPEATS = 8


def _repeats(layers: int, stages: int, pinned: int | None) -> list[int]:
    """The circular repeats a plan with ``stages`` may take (GPipe's circular form, or
    interleaved 1F1B): a pinned count, else every count up to ``MAX_REPEATS`` whose
    chunks divide the layers (1 included), or, where the stages do not divide them,
    every count that leaves each chunk a layer (its chunks held padded,
    ``parallelism.layer_order``, which the cost counts)."""
    if pinned is not None:  # circular repeats need stages
        return [pinned] if pinned == 1 or (stages > 1 and layers >= stages * pinned) else []
    if stages <= 1:
        return [1]
    return [r for r in range(1, MAX_REPEATS + 1) if stages * r <= layers
            and (layers % (stages * r) == 0 or layers % stages)]


def score(facts: ModelFacts, candidate: Plan, batch_size: int, hosts: int,
          hardware: Hardware, budget: float, specs_cache: dict | None = None) -> Scored:
    """A candidate plan's memory per device and predicted step (``batch_size``: its
    geometry's global batch)."""
    parallelism, geometry = candidate.parallelism, candidate.geometry
    shape = parallelism.shape
    devices = math.prod(shape.values())
    micro_batch_size, remat = geometry.micro_batch_size, candidate.remat
    stages, micro_batches = role_size(shape, "layers"), geometry.accumulation
    repeats = candidate.stage_repeats
    rows, params = _held(facts, parallelism, repeats, {} if specs_cache is None else specs_cache)
    one_f_one_b = stages > 1 and candidate.pipeline_schedule == "1f1b"
    ticks = _ticks(stages, micro_batches, repeats, one_f_one_b)
    # a tick runs a chunk's layer slots, pads included (``chunk_share``)
    layers = stacked_layers(facts)
    bubble = ticks / (micro_batches * repeats) * (
        chunk_share(stages, repeats, layers) * stages * repeats if stages > 1 else 1.0)
    memory = facts.memory(parallelism, rows, micro_batch_size, remat,
                          micro_batches, candidate.pipeline_schedule, repeats,
                          candidate.stage_recompute)
    scanned = facts.trace.scanned if facts.trace is not None else {}
    hidden = hidden_width(facts.shapes, scanned)
    # 1F1B recomputing each chunk (``Plan.stage_recompute``) runs its forward again
    again = one_f_one_b and candidate.stage_recompute
    recompute = remat != "none" or again
    ways = role_size(shape, "sequence")  # a device computes 1/ways of a sequence's tokens
    tensor = [] if facts.trace is None else tensor_traffic(
        facts.trace, params, shape, micro_batch_size / facts.trace_examples / ways,
        facts.compute_itemsize, recompute, ticks / (stages * repeats))
    # GPipe's stages run the embeddings and the head once a step, on every row, and
    # gather their stacked layers once before the ticks (``state_traffic``)
    gpipe = stages > 1 and not one_f_one_b
    # 1F1B on each device's own rows gathers a stage once and reduces its gradients
    # once (``pipeline_schedules.Local``)
    local = one_f_one_b and runs_on_own_rows(shape)
    state = state_traffic(params, shape, facts.compute_itemsize, hardware, recompute,
                          ticks, repeats, gathered_once=gpipe or local, looped=stages == 1,
                          reduced_once=local)
    model = role_size(shape, "heads")
    flops, whole = _flops(facts, params, remat, batch_size, devices,
                          bubble if stages > 1 else 0.0, model, again)
    device_work = None
    counted = facts.work() if facts.timing is None else None
    if counted is not None:
        device_work = _device_work(counted, remat, batch_size / devices, model,
                                   bubble, whole, stages * repeats, again,
                                   hardware)
    trained = facts.trained or [True] * len(params)
    # each trained parameter's elements on one device
    held = [(p, math.prod(p.shape) / math.prod(shape[a] for a in p.axes()))
            for p, t in zip(params, trained) if t]
    elements = sum(n for _, n in held)
    local_tokens = -(-facts.tokens_per_example // ways)  # a device's share of a sequence
    # with stages a device's exchanges are its chunk's layers', at every tick
    experts = expert_traffic(facts.experts, shape, micro_batch_size * local_tokens,
                             facts.compute_itemsize, recompute, ticks, stages * repeats)
    total = sum(math.prod(p.shape) for p, t in zip(params, trained) if t)
    pipeline = stage_traffic(shape, micro_batch_size, local_tokens, hidden,
                             facts.compute_itemsize, micro_batches, repeats,
                             features_split(shape, hidden), gpipe)
    # with stages, a device's attention layers are its chunk's, run at every tick (without
    # stages ``ticks`` is the micro-batches)
    ring = context_traffic(shape, micro_batch_size, facts.tokens_per_example,
                           (facts.kv_width or hidden) // kv_split(facts, shape), hidden,
                           -(-(facts.attention_layers or layers or 1) // (stages * repeats)),
                           facts.compute_itemsize, micro_batches,
                           ticks * (1.5 if again else 1),  # a recomputed ring: half again
                           -(-facts.linear_layers // (stages * repeats)), facts.linear_state,
                           candidate.context_attention)
    update_bytes = UPDATE_ACCESSES * sum(n * p.itemsize for p, n in held)
    cost = step_cost(flops, tensor, state, ticks, shape, hosts, hardware,
                     facts.timing, elements, experts,
                     elements / total if total else 1.0, pipeline, ring, device_work,
                     update_bytes, bool(scanned))
    tokens = batch_size * facts.tokens_per_example / cost.seconds
    useful = facts.flops("none") * batch_size / devices  # remat's recompute is not useful
    return Scored(candidate, memory, cost, memory["total"] <= budget, tokens,
                  useful / cost.seconds / hardware.peak_flops)


def kv_split(facts: ModelFacts, shape: dict[str, int]) -> int:
    """The devices a token's keys and values are split over on a mesh of ``shape``: the
    model axis where it divides the key/value heads (the rules split whole key/value
    groups over it, each device running the ring on its own), else 1."""
    model = role_size(shape, "heads")
    return model if facts.kv_heads and facts.kv_heads % model == 0 else 1


def _held(facts: ModelFacts, parallelism: Parallelism, repeats: int,
          cache: dict) -> tuple[list[Placement], list[Parameter]]:
    """(every parameter's ``Placement`` row and its ``cost.Parameter``) on
    ``parallelism`` with ``repeats`` circular repeats of its stages, kept in ``cache``:
    a mesh's candidates (micro-batches, remat, schedules) share them, and placing
    thousands of parameters again for each took an eighth of a 2,048-device plan's time."""
    key = ("held", tuple(sorted(parallelism.shape.items())), repeats)
    if key not in cache:
        specs = _specs(facts, parallelism, cache)
        shapes = _held_shapes(facts, specs, role_size(parallelism.shape, "layers"), repeats)
        scanned = facts.trace.scanned if facts.trace is not None else {}
        params = [Parameter(tuple(s), _itemsize(d), tuple(spec), stacked=bool(scanned.get(i)),
                            lookup=i in facts.lookups)
                  for i, (s, d, spec) in enumerate(zip(shapes, facts.dtypes, specs))]
        cache[key] = _placement(facts, specs, parallelism, shapes), params
    return cache[key]


def _specs(facts: ModelFacts, parallelism: Parallelism, cache: dict) -> list:
    """Every parameter's spec on ``parallelism`` (kept in ``cache`` by the mesh's shape:
    the micro-batch, remat and schedule do not change them)."""
    shape = parallelism.shape
    key = tuple(sorted(shape.items()))
    if key not in cache:
        # the passes that read the dataflow: tensor, expert and stage splits
        traced = any(role_size(shape, r) > 1 for r in ("heads", "experts", "layers"))
        cache[key] = partition_specs(parallelism.spec_passes(), facts.paths, facts.shapes,
                                     facts.dtypes, shape, facts.trace if traced else None)
    return cache[key]


def _ticks(stages: int, micro_batches: int, repeats: int, one_f_one_b: bool) -> int:
    """The passes of a step: with stages the pipeline's ticks, ``M + S - 1`` (``P R + S
    - 1`` with circular repeats), each running a chunk of a stage's layers, or 1F1B's
    own table's length (``M R + S - 1`` where S divides M); else the micro-batches."""
    if one_f_one_b:
        return one_f_one_b_table(stages, micro_batches, repeats).passes
    return pipeline_ticks(stages, micro_batches, repeats)[1] if stages > 1 else micro_batches


def _flops(facts: ModelFacts, params: Sequence[Parameter], remat: str, batch_size: int,
           devices: int, bubble: float, model: int, again: bool = False) -> tuple[float, float]:
    """(one device's matmul FLOPs in a step, the part of them in matmuls the model axis
    leaves whole), the batch spread over the devices: with stages
    (``bubble``: 0 without) the layers run on ``M + S - 1`` slots, ``M`` of them real
    (1F1B's chunks keep their activations, or with ``again`` their backward runs their
    forward again); on a model axis of ``model`` devices the layers it leaves whole run
    whole on each of them."""
    flops = facts.flops(remat) * batch_size / devices
    rerun = ONE_F_ONE_B_RERUN if again else 0.0
    if bubble:
        share = layer_share(facts)
        flops *= share * (1 + facts.flops("none") * rerun / facts.flops(remat)) * bubble \
            + 1 - share
    whole = 0.0
    if model > 1 and facts.trace is not None:
        rerun += facts.flops(remat) / facts.flops("none")
        whole = (rerun * whole_flops(facts.trace, params, facts.trace_examples)
                 * batch_size * model / devices * (1 - 1 / model))
    return flops + whole, whole


def rank(facts: ModelFacts, devices: int, hosts: int, batch_size: int, hardware: Hardware,
         pinned: dict | None = None, rules=(), margin: float = MARGIN) -> Ranking:
    """Every candidate scored and ranked (see the module docstring).

    Raises:
      NoPlanFits: none fits ``hardware.device_memory`` less ``margin``.
      ValueError: pinned sizes no plan can take (they do not divide the devices).
    """
    budget = hardware.device_memory * (1 - margin)
    layers = facts.experts
    refused: dict = {}

    def grid_of(pins, refused=None) -> list[Plan]:
        return candidates(devices, hosts, batch_size, facts.remat_policies, pins,
                          math.gcd(*(e.experts for e in layers)) if layers else 0,
                          stacked_layers(facts), facts.one_f_one_b, rules, refused,
                          hardware.slices(devices))

    grid = grid_of(pinned, refused)
    pinned = dict(pinned or {})
    (sequence, *_) = role_keywords("sequence")
    may_split = facts.splits_sequences and sequence not in pinned
    top = 1  # the context sizes in the grid: every one that divides the devices up to it
    if may_split and (not grid or batch_size < devices):
        # no split of whole sequences takes the batch (every context size), or fewer
        # sequences than devices: the devices the batch leaves split the model, its
        # layers or each sequence, and the ring is weighed by its time beside tensor
        # parallelism and stages (context sizes up to what the batch leaves)
        top = devices if not grid else devices // batch_size
        for ways in (w for w in _divisors(devices) if 1 < w <= top):
            grid += grid_of({**pinned, sequence: ways}, refused)
    if not grid:
        raise ValueError(refusal(devices, hosts, batch_size, pinned, refused,
                                 stacked_layers(facts)))
    cache: dict = {}
    scored = [score(facts, c, batch_size, hosts, hardware, budget, cache) for c in grid]
    if not any(s.fits for s in scored) and may_split:
        # nothing fits: split sequences over a context axis (every size not yet tried; a
        # plan that fits whole sequences never pays the ring's transfers for nothing
        # where the batch takes every device)
        for ways in (w for w in _divisors(devices) if w > top):
            scored += [score(facts, c, batch_size, hosts, hardware, budget, cache)
                       for c in grid_of({**pinned, sequence: ways})]
    slices = hardware.slices(devices)
    kept = [s for s in scored if crosses_slices_as_data(s.plan.shape, hosts, slices)]
    left_out = None
    if kept != scored and any(s.fits for s in kept):
        fastest = min((s for s in scored if s.fits), key=lambda s: s.cost.seconds)
        if not crosses_slices_as_data(fastest.plan.shape, hosts, slices):
            left_out = fastest
        scored = kept
    # equal times (traffic the compute hides): the less traffic, then the fewer
    # micro-batches (a cost per micro-batch the model did not see), then the less memory
    fitting = sorted((s for s in scored if s.fits),
                     key=lambda s: (round(s.cost.seconds, 9), s.cost.gradients + s.cost.tensor,
                                    s.accumulation, s.memory["total"]))
    over = sorted((s for s in scored if not s.fits), key=lambda s: s.memory["total"])
    ranking = Ranking(fitting, over, budget, hardware, facts.timing, hosts=hosts,
                      left_out=left_out, layers=stacked_layers(facts))
    if not fitting:
        smallest = over[0]
        raise NoPlanFits(
            f"no plan fits {size_text(budget)} per device ({hardware.name}, "
            f"{margin:.0%} kept free): the smallest, {smallest.plan.brief()}, holds "
            f"{size_text(smallest.memory['total'])}. Use more devices, a smaller batch or "
            "sequence, compute_dtype='bfloat16', or unpin what you pinned")
    return ranking


def refusal(devices: int, hosts: int, batch_size: int, pinned: dict, refused: dict,
            layers: int) -> str:
    """Why no candidate plan exists, from what ``candidates`` refused, and what to change."""
    head = (f"no plan of {devices} devices on {hosts} host(s) takes a batch of {batch_size}"
            + (f" with {pinned} pinned" if pinned else ""))
    if not refused.get("splits"):
        return (f"{head}: the pinned axis sizes do not split the devices (each divides "
                f"the devices, and an axis kept inside a host the host's {devices // hosts})")
    why = []
    if "batch" in refused:
        smallest = refused["batch"]
        why.append(f"every split leaves a data-parallel size that does not divide the batch "
                   f"(the smallest, {smallest}, would take a batch that is a multiple of "
                   f"{smallest})")
    if "layers" in refused:
        why.append(f"each pipeline stage needs one of the model's {layers} stacked layers "
                   f"({sorted(refused['layers'])[:6]} stages are more: use at most {layers})"
                   if layers else "the model stacks no layers to pipeline (build it with "
                   "scan=True)")
    if refused.get("micro"):
        why.append("a pinned micro-batch does not divide a device's share of the batch, or "
                   "leaves fewer micro-batches than pipeline stages")
    if refused.get("experts"):
        why.append("an expert axis must divide the model's experts")
    return (f"{head}: {'; '.join(why)}. Use a larger batch (or fewer devices), or pin axis "
            "sizes that take it")


# What a recomputing 1F1B's backward adds to the layers' work, over a pass without
# remat: each chunk's forward once more (a forward is a third of forward and backward).
ONE_F_ONE_B_RERUN = 1 / 3
# Reads and writes of each trained parameter element in the optimizer's update, at its
# bytes: AdamW reads the parameter, its gradient twice (the global norm, the update)
# and both moments, and writes the parameter and both moments.
UPDATE_ACCESSES = 8


def _device_work(counted: ModelWork, remat: str, examples: float, model: int,
                 bubble: float, whole: float, stages: int, again: bool,
                 hardware: Hardware) -> DeviceWork:
    """One device's work in a step: ``examples`` (the batch over the devices) times an
    example's under ``remat``, the layers' stretched by the pipeline's ``bubble`` (with
    ``again`` their forward run once more: a recomputing 1F1B), the matmuls the model
    axis leaves whole (``whole`` FLOPs) added. Of the memory-bound work only the part
    over split widths (heads, the MLP's inner width: ``Work.split_memory``) divides
    over the model axis: the residual stream, the norms and the loss run whole on each
    device of a tensor-parallel group (there is no sequence parallelism)."""
    example = counted.under(remat)
    one = example.layer + (counted.forward.layer if again else Work())
    layer = one * (example.layers * examples * bubble)
    layer = dataclasses.replace(
        layer, memory=layer.split_memory + (layer.memory - layer.split_memory) * model,
        matmul=layer.matmul + whole)
    rest = example.rest * examples
    rest = dataclasses.replace(rest, memory=rest.memory * model)
    forward = work_seconds(counted.forward.layer, hardware) / work_seconds(one, hardware)
    return DeviceWork(layer, rest, forward, max(1, -(-example.layers // stages)))


def stacked_layers(facts: ModelFacts) -> int:
    """How many layers the model stacks on a leading axis and scans (what pipeline
    stages split), 0 where it stacks none."""
    if facts.trace is None:
        return 0
    counts = {facts.shapes[i][min(d)] for i, d in facts.trace.scanned.items() if d}
    return math.gcd(*counts) if counts else 0


def layer_share(facts: ModelFacts) -> float:
    """The share of a step's matmul FLOPs in the stacked layers, from the parameters:
    the stacked ones against them plus the largest other (the LM head, or the token
    embedding read backwards)."""
    scanned = facts.trace.scanned if facts.trace is not None else {}
    stacked = sum(math.prod(facts.shapes[i]) for i in scanned)
    others = [math.prod(s) for i, s in enumerate(facts.shapes) if i not in scanned and len(s) >= 2]
    head = max(others, default=0)
    return stacked / (stacked + head) if stacked else 0.0


def pins(**given) -> dict:
    """The plan parameters a user gave (axis keywords off their defaults, a micro-batch,
    a remat policy), for ``candidates``."""
    defaults = axis_defaults()
    out = {k: v for k, v in given.items() if k in defaults and v != defaults[k]
           and v != "auto"}
    for key in ("micro_batch_size", "micro_rows", "remat", "pipeline_schedule",
                "context_attention"):
        if given.get(key) is not None:
            out[key] = given[key]
    if given.get("stage_repeats", 1) != 1:
        out["stage_repeats"] = given["stage_repeats"]
    return out


def _itemsize(dtype) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def _held_shapes(facts: ModelFacts, specs, stages: int, repeats: int) -> list[tuple]:
    """The parameters' shapes as a plan holds them: a stage-split stack of layers
    padded to ``parallelism.held_layers`` rows."""
    if stages <= 1:
        return list(facts.shapes)
    return [(held_layers(s[0], stages, repeats), *s[1:]) if is_staged(spec) else s
            for s, spec in zip(facts.shapes, specs)]


def _placement(facts: ModelFacts, specs, parallelism: Parallelism,
               shapes) -> list[Placement]:
    import jax

    leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, facts.dtypes)]
    rows = placement(leaves, specs, parallelism.mesh)
    return [dataclasses.replace(r, path=p) for r, p in zip(rows, facts.paths)]
