"""A training step's time on a plan, predicted without running it: its matmul FLOPs at
the device's rate, each collective its specs imply at the bandwidth and latency of the
link its group spans, and a cost per micro-batch.

The collectives are read from the model's dataflow (``dataflow.trace``) and the plan's
specs, as XLA's SPMD partitioner inserts them for redray's step:

* tensor parallelism (a layer split over ``model``): a row layer's output and a split
  lookup's output are all-reduced in the forward pass, a group of column layers
  reading one activation all-reduces that activation's gradient once in the backward
  pass (``fuse_reductions``); with remat the forward's all-reduces run again;
* FSDP (a parameter split over ``fsdp``): a stacked layer's parameter is all-gathered
  in the compute dtype in each micro-batch's forward scan and again in its backward one
  (with remat, any parameter's forward gather runs again); one outside the layers' scan
  (the embedding, the head) once a step, before the accumulation's loop (the same
  gather in every micro-batch: XLA hoists it); its gradient reduce-scattered onto the
  sharded accumulator per micro-batch (all-reduced and sliced on XLA:CPU);
* data parallelism: a gradient is all-reduced over the batch axes that do not split
  its parameter in every micro-batch, inside the accumulation's loop (XLA's SPMD
  partitioner reduces each micro-batch's gradient where it is computed, a scanned
  layer's inside the layers' loop, where no pass moves it out); after a pipeline's
  ticks, once a step;
* expert parallelism (a mixture of experts' experts split over ``expert``): each
  layer's tokens go to their experts' devices and back by all-to-all, twice in the
  forward pass and twice in the backward (``expert_traffic``); on the critical path.
* pipeline stages (the stacked layers split over ``stage``): at each of the ``M + S -
  1`` ticks of the schedule a micro-batch's hidden states go to the next stage and, in
  the backward pass, their gradients back, point to point (``stage_traffic``); on the
  critical path. The layers' FLOPs and per-micro-batch costs stretch by the bubble,
  ``(M + S - 1) / M`` (``redray.models.staged_layers.flops_ratio``).

Read against XLA's compiled steps on 4 CPU devices (tests/test_planner.py, each
collective weighed by how often its loop runs): the bytes of a tensor-parallel, FSDP,
data-parallel step, one split over both ``fsdp`` and ``model``, and data-parallel steps
with accumulation, agree to within 1%, for models whose activations stay on the batch split
(``redray.sharding.tracing``: redray's models mark them; without the marks XLA
reshards a fsdp x model step's activations by replicating them). Layers the model
axis leaves whole run whole on every device of its group (``whole_flops``). A
collective over a group inside one host costs ring steps on the host's link; a group
that spans hosts runs hierarchically (within each host, then across hosts on the
``1/k`` of the bytes each of a host's ``k`` devices carries); on TPU multislice
(``Hardware.slice_devices``) a group that spans slices then crosses them on the data-centre
network on its ``1/(k h)`` share, ``h`` the hosts of its slice it spans
(``collective_levels``; the data axis is the first to cross slices:
``parallelism.network_shapes``).

Overlap (``exposed_seconds``, as XLA's latency-hiding scheduler can do it): tensor-parallel
all-reduces, expert all-to-alls and pipeline passes are on the critical path; a stacked
layer's FSDP gather hides behind the layer before it, its gradient's reduction behind
the next layer's backward, and only the first gather, the last reduction and what
exceeds a layer's compute count; a data-parallel reduction runs in each micro-batch's
backward, layer by layer like FSDP's, and counts whole only after a pipeline's ticks; on
XLA:CPU (``Hardware.overlap`` 0) nothing hides.

Compute: where the model's work was counted (``redray.planning.work``: a config's
model), its matmuls at ``Hardware.matmul_flops``, attention at the fused kernel's rate
(or every pair at the matmul rate without one), its memory-bound bytes and the
optimizer's update at ``Hardware.memory_bandwidth``, plus ``micro_batch_overhead`` per
micro-batch; else the step's FLOPs at the matmul rate; or, where the model's own pass
was timed on the live devices
(``ModelTiming``, what ``Trainer(plan="auto")`` measures), the FLOPs at the rate
that pass ran, its measured cost per micro-batch, and the update (optimizer, gradient
norm) at its measured cost per parameter element a device holds: a data-parallel
plan updates every parameter on every device, FSDP and tensor parallelism a share.
The timed cost per micro-batch is charged at the share of the parameters a device holds
too: it is the pass's per-parameter work (weight gradients written and summed, each
micro-batch again), which a plan that shards the parameters divides (measured on the
wide LLaMA of ``benchmarks/planner.py``, 2 hosts x 4 CPU devices: charged whole, a
fsdp 2 x model 4 plan at micro-batch 1 was predicted at 1.9x its measured step, and
the plans' rank correlation was 0.77; charged at the share held, 1.14x and 0.85). The
timed pass counts what a matmul rate misses (attention's softmax, norms, elementwise
ops, every kernel's launch: on XLA:CPU a micro-batch of one example costs as much as
an example's matmuls).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from redray.sharding.dataflow import Trace
from redray.planning.hardware import Hardware, for_backend
from redray.planning.work import Work
from redray.sharding.parallelism import (AXES, BATCH_AXES, GATHERING, network_shapes,
                                         pipeline_ticks, role_axes, role_size)
from redray.sharding.rules import axes_of


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One collective a step runs.

    Attributes:
      kind: "all-reduce", "all-gather", "reduce-scatter" or "all-to-all".
      bytes: the full buffer (an all-gather's gathered size) on one device.
      axes: the mesh axes of its group.
      times: how often a step runs it.
      what: what it carries, in words.
      critical: on the critical path (tensor parallelism), never hidden.
      phase: when it runs, for the overlap: "forward", "backward", "both" (half in
        each: a parameter gathered again for the backward pass) or "step" (once,
        after the backward pass and its accumulation loop).
      layer: it belongs to one of the stacked layers (run once per layer per pass,
        beside that layer's compute), not to the embedding, the head or the loss.
    """
    kind: str
    bytes: float
    axes: tuple[str, ...]
    times: int
    what: str
    critical: bool
    phase: str = "step"
    layer: bool = False


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A predicted step: its parts in seconds, and the collectives behind them.

    Attributes:
      compute: the matmuls at the device's sustained rate.
      tensor: tensor-parallel all-reduces (critical path).
      gradients: FSDP gathers and gradient reductions, before overlap.
      exposed: what of ``gradients`` the compute does not hide.
      overhead: the micro-batches' own cost.
      traffic: every collective.
      update: the optimizer's pass over the parameters a device holds (where timed).
      experts: expert parallelism's all-to-alls (critical path).
      pipeline: pipeline stages' point-to-point passes (critical path).
      context: the context axis's ring passes before overlap (hidden behind the
        compute together with ``gradients``: ``exposed`` counts what is not).
      attention: the part of ``compute`` in attention's fused kernels.
      memory: the part of ``compute`` in memory-bound kernels.
      levels: (bytes one device sends, seconds before overlap) of ``traffic`` on each
        level of the network (``LEVELS``: inside a host, between the hosts of a slice,
        across slices).
    """
    compute: float
    tensor: float
    gradients: float
    exposed: float
    overhead: float
    traffic: tuple[Traffic, ...]
    update: float = 0.0
    experts: float = 0.0
    pipeline: float = 0.0
    context: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    levels: tuple[tuple[float, float], ...] = ()

    @property
    def seconds(self) -> float:
        return (self.compute + self.tensor + self.exposed + self.overhead + self.update
                + self.experts + self.pipeline)

    def bytes(self, axes: Sequence[str] | None = None) -> float:
        """Bytes of every collective of a step (over ``axes``' groups only, if given)."""
        return sum(t.bytes * t.times for t in self.traffic
                   if axes is None or set(t.axes) & set(axes))


@dataclasses.dataclass(frozen=True)
class ModelTiming:
    """A model's forward and backward pass timed on the live devices (all at once, each
    on its own rows, no collectives) at two micro-batch sizes, as ``fixed + rows *
    per_example``.

    Attributes:
      fixed: seconds a micro-batch costs beside its rows (its kernels' launches, small
        ops whose cost does not grow with the rows).
      per_example: seconds each example adds.
      flops_per_example: the pass's FLOPs per example (XLA's cost analysis), which
        turns ``per_example`` into a rate.
      update_per_element: seconds the step's update (the gradient's norm, the
        optimizer, the non-finite guard's select) takes per trained parameter element a
        device holds, timed with the run's optimizer on every device at once.
    """
    fixed: float
    per_example: float
    flops_per_example: float
    update_per_element: float = 0.0

    @property
    def seconds_per_flop(self) -> float:
        return self.per_example / self.flops_per_example

    def describe(self) -> dict:
        return {"timed_micro_batch_ms": self.fixed * 1e3,
                "timed_example_ms": self.per_example * 1e3,
                "timed_tflops": 1 / self.seconds_per_flop / 1e12,
                "timed_update_ns_per_parameter": self.update_per_element * 1e9}


def _in_order(sizes: Sequence[int], room: int) -> tuple[tuple, tuple]:
    """(outside, inside) shares of ``sizes`` where the device order fills a block of
    ``room`` devices innermost axis first (a mesh no hybrid layout places)."""
    inside = []
    for size in reversed(sizes):
        k = math.gcd(size, room)
        inside.append(k)
        room //= k
    inside.reverse()
    return tuple(size // k for size, k in zip(sizes, inside)), tuple(inside)


def host_spans(shape: dict[str, int], hosts: int,
               slices: int = 1) -> dict[str, tuple[int, int, int]]:
    """axis name -> (devices inside a host, hosts it spans inside a slice, slices it
    spans) of a mesh of ``shape`` on ``hosts`` hosts in ``slices`` slices, laid out as
    ``Parallelism.build`` lays it out (``parallelism.network_shapes``)."""
    sizes = [shape.get(a.name, 1) for a in AXES]
    devices = math.prod(sizes)
    hosts, slices = max(hosts, 1), max(slices, 1)
    split = network_shapes(sizes, slices, hosts, devices // hosts)
    if split is None:  # the device order, innermost axis first into each slice and host
        across_slices, in_slice = _in_order(sizes, devices // slices)
        split = (across_slices, *_in_order(in_slice, devices // hosts))
    across_slices, across, inside = split
    return {a.name: (inside[i], across[i], across_slices[i]) for i, a in enumerate(AXES)}


# The levels of the network a collective may cross, innermost first (``Hardware``'s
# ``intra``, ``inter`` and ``across_slices`` links).
LEVELS = ("inside a host", "between hosts of a slice", "across slices")


def collective_levels(kind: str, nbytes: float, inside: int, across: int, slices: int,
                      hardware: Hardware) -> tuple[tuple[float, float], ...]:
    """(bytes one device sends, seconds) on each of ``LEVELS`` of one collective of
    ``nbytes`` over ``inside`` devices of a host times ``across`` hosts of a slice times
    ``slices`` slices: a ring within each host over the whole buffer, then across the
    hosts of a slice on this device's ``1/inside`` of it, then across slices on its
    ``1/(inside across)`` (hierarchical, as XLA reduces over ICI before DCN)."""
    links = (hardware.intra, hardware.inter, hardware.across_slices)
    if kind == "collective-permute":  # point to point: each device sends its buffer once
        level = 2 if slices > 1 else 1 if across > 1 else 0
        return tuple((nbytes, nbytes / links[k].bandwidth + links[k].latency) if k == level
                     else (0.0, 0.0) for k in range(3))
    if kind == "all-to-all":  # each device keeps 1/n of the buffer, sends the rest
        n = inside * across * slices
        # what goes to the host's other devices, the slice's other hosts, other slices,
        # with a step per peer device, host or slice
        sent = (nbytes * (inside - 1) / n, nbytes * (across - 1) / (across * slices),
                nbytes * (slices - 1) / slices)
        peers = (inside - 1, across - 1, slices - 1)
        return tuple((b, b / link.bandwidth + steps * link.latency) if steps > 0
                     else (0.0, 0.0) for b, steps, link in zip(sent, peers, links))
    passes = 2 if kind == "all-reduce" else 1  # reduce-scatter + all-gather
    out = []
    for n, size, link in ((inside, nbytes, links[0]), (across, nbytes / inside, links[1]),
                          (slices, nbytes / (inside * across), links[2])):
        if n <= 1:
            out.append((0.0, 0.0))
            continue
        sent = passes * (n - 1) / n * size
        out.append((sent, passes * ((n - 1) / n * size / link.bandwidth
                                    + (n - 1) * link.latency)))
    return tuple(out)


def collective_seconds(kind: str, nbytes: float, inside: int, across: int,
                       hardware: Hardware, slices: int = 1) -> float:
    """Seconds of one ring collective of ``nbytes`` over ``inside`` devices of a host
    times ``across`` hosts (of a slice) times ``slices`` slices (hierarchical when it
    spans hosts or slices: ``collective_levels``)."""
    return sum(sec for _, sec in collective_levels(kind, nbytes, inside, across, slices,
                                                   hardware))


def _group(t: "Traffic", spans: dict) -> tuple[int, int, int]:
    """(devices inside a host, hosts of a slice, slices) of ``t``'s group."""
    return (math.prod(spans[a][0] for a in t.axes), math.prod(spans[a][1] for a in t.axes),
            math.prod(spans[a][2] for a in t.axes))


def priced(traffic: Sequence[Traffic], spans: dict, hardware: Hardware) -> dict:
    """(kind, bytes, axes) -> ``collective_levels`` of one run, for every distinct
    collective of ``traffic``: a step's parameters repeat a few shapes, so each is
    priced once (``step_cost`` prices thousands of candidates' steps)."""
    out: dict = {}
    for t in traffic:
        key = (t.kind, t.bytes, t.axes)
        if key not in out:
            out[key] = collective_levels(t.kind, t.bytes, *_group(t, spans), hardware)
    return out


def traffic_seconds(t: Traffic, spans: dict, hardware: Hardware,
                    prices: dict | None = None) -> float:
    """Seconds of every run of ``t`` in a step (``prices``: from ``priced``)."""
    if prices is not None:
        return t.times * sum(sec for _, sec in prices[t.kind, t.bytes, t.axes])
    inside, across, slices = _group(t, spans)
    return t.times * collective_seconds(t.kind, t.bytes, inside, across, hardware, slices)


def traffic_levels(traffic: Sequence[Traffic], spans: dict, hardware: Hardware,
                   prices: dict | None = None) -> tuple[tuple[float, float], ...]:
    """(bytes one device sends, seconds) a step's ``traffic`` costs on each of
    ``LEVELS``, before any overlap with the compute (``prices``: from ``priced``)."""
    prices = priced(traffic, spans, hardware) if prices is None else prices
    totals = [[0.0, 0.0] for _ in LEVELS]
    for t in traffic:
        for total, (sent, sec) in zip(totals, prices[t.kind, t.bytes, t.axes]):
            total[0] += t.times * sent
            total[1] += t.times * sec
    return tuple((b, sec) for b, sec in totals)


@dataclasses.dataclass(frozen=True)
class Parameter:
    """A parameter as the cost model sees it: its shape, its spec's split per axis,
    bytes per element, whether it is trained, whether it stacks scanned layers
    (FSDP then gathers each layer's slice in the forward scan and again in the
    backward one: XLA keeps no gathered layer of a loop for the backward pass), and
    whether it is only looked up (an input embedding, no matmul's weight: before
    GPipe's stages, where every stage computes its gradient alike)."""
    shape: tuple[int, ...]
    itemsize: int
    spec: tuple
    trained: bool = True
    stacked: bool = False
    lookup: bool = False

    def split(self, axes: Sequence[str]) -> int | None:
        """Which dimension any of ``axes`` splits (the first), or None."""
        return next((d for d, e in enumerate(self.spec)
                     if any(a in axes_of(e) for a in axes)), None)

    def axes(self) -> set[str]:
        return {a for e in self.spec for a in axes_of(e)}


def tensor_traffic(trace: Trace, params: Sequence[Parameter], shape: dict[str, int],
                   rows_scale: float, act_itemsize: int, recompute: bool,
                   accumulation: int = 1) -> list[Traffic]:
    """The tensor-parallel all-reduces of a step (see the module docstring).

    Args:
      trace: the model's dataflow, traced on some number of examples.
      params: the parameters, indexed like the trace.
      shape: the mesh's axis sizes.
      rows_scale: a device's micro-batch over the examples the trace ran on.
      act_itemsize: bytes per activation element (the compute dtype).
      recompute: the forward runs again in the backward (remat): its all-reduces too.
      accumulation: micro-batches per step.
    """
    heads = role_axes("heads")
    if role_size(shape, "heads") <= 1:
        return []
    out: list[Traffic] = []
    columns: dict = {}
    for p, use in trace.runs():
        param = params[p]
        d = param.split(heads)
        if d is None or not use.rows:
            continue
        rows = use.rows * rows_scale  # one run's, on one device's micro-batch
        in_size = math.prod(param.shape[k] for k in use.in_dims)
        out_size = math.prod(param.shape[k] for k in use.out_dims)
        if d in use.in_dims:  # a row layer, or a lookup split over its entries' index
            out.append(Traffic("all-reduce", rows * out_size * act_itemsize, heads,
                               (2 if recompute else 1) * use.times * accumulation,
                               "tensor parallel: a row layer's (or split lookup's) output",
                               True))
        elif use.kind == "dot" and d in use.out_dims:
            # column layers reading one activation share one all-reduce of its gradient
            columns.setdefault((use.preds, use.rows, in_size, use.times), use.times)
    for (_, rows, in_size, times), _ in columns.items():
        out.append(Traffic("all-reduce", rows * rows_scale * in_size * act_itemsize,
                           heads, times * accumulation,
                           "tensor parallel: the gradient of column layers' input", True))
    return out


def expert_traffic(layers: Sequence, shape: dict[str, int], tokens: int, act_itemsize: int,
                   recompute: bool, accumulation: int = 1, chunks: int = 1,
                   exchange: str = "auto") -> list[Traffic]:
    """Expert parallelism's exchanges per mixture-of-experts layer and micro-batch (with
    remat the forward's twice), as the plan's ``expert_exchange`` runs them ("auto":
    the gather for dropless layers, the all-to-all with a capacity factor):

    - dropless layers, the gather (``redray.models.moe.gathered``): the expert group's
      tokens all-gathered and the outputs reduce-scattered back in the forward pass, the
      transposes in the backward (ways x tokens x hidden elements each); the choices and
      routing weights gathered beside the tokens, the weights' gradients scattered back;
    - layers with a capacity factor, the all-to-alls (``redray.models.moe.exchange``):
      the dispatch and the combine in the forward pass and their transposes in the
      backward, each of experts x slots x hidden elements.

    Args:
      layers: the model's ``redray.models.moe.ExpertLayers``.
      shape: the mesh's axis sizes.
      tokens: tokens per device in a micro-batch.
      act_itemsize: bytes per activation element.
      recompute: as for ``tensor_traffic``.
      accumulation: the passes through a device's layers in a step: micro-batches, or
        with pipeline stages the schedule's ticks (the bubble's included, as every
        stage runs at every tick).
      chunks: the chunks the stacked layers are cut into (stages x circular repeats):
        a pass runs one chunk's share of the expert layers (``ceil(L / chunks)``).
      exchange: the plan's ``expert_exchange``.
    """
    ways = role_size(shape, "experts")
    if ways <= 1:
        return []
    axes, out = role_axes("experts"), []
    for e in layers:
        times = -(-e.layers // chunks) * accumulation
        gather = exchange == "gather" or (exchange == "auto" and e.capacity_factor is None)
        if not gather:
            out.append(Traffic("all-to-all", e.experts * e.slots(tokens) * e.hidden *
                               act_itemsize, axes, times * (6 if recompute else 4),
                               "expert parallel: tokens sent to their experts and back", True))
            continue
        gathered = ways * tokens * e.hidden * act_itemsize
        passes = 3 if recompute else 2  # the forward's (twice with remat), the backward's
        choice = 1 if e.experts <= 127 else 2 if e.experts <= 32767 else 4
        out += [Traffic("all-gather", gathered, axes, times * passes,
                        "expert parallel: the group's tokens gathered (their outputs' "
                        "gradients, backward)", True),
                Traffic("reduce-scatter", gathered, axes, times * passes,
                        "expert parallel: the outputs scattered back (the tokens' "
                        "gradients, backward)", True),
                Traffic("all-gather", ways * tokens * e.top_k * choice, axes,
                        times * (passes - 1), "expert parallel: the tokens' choices", True),
                Traffic("all-gather", ways * tokens * e.top_k * 4, axes,
                        times * (passes - 1), "expert parallel: the routing weights", True),
                Traffic("reduce-scatter", ways * tokens * e.top_k * 4, axes, times,
                        "expert parallel: the routing weights' gradients", True)]
    return out


def stage_traffic(shape: dict[str, int], rows: int, tokens: int, hidden: int,
                  act_itemsize: int, micro_batches: int, repeats: int = 1,
                  split: int = 1, gpipe: bool = False) -> list[Traffic]:
    """Pipeline parallelism's traffic (``redray.models.staged_layers``), per step:

    - at each of the ``M + S - 1`` ticks (``P R + S - 1`` with circular repeats:
      ``parallelism.pipeline_ticks``), every stage's slot (one micro-batch's hidden states)
      to the next stage, and in the backward pass its gradient back: ``2 (M + S - 1)``
      point-to-point passes;
    - the first stage's input gradient (the embeddings run on every stage, their
      output is read on the first): an all-reduce over ``stage`` per tick;
    - the output, ``M / S`` micro-batches to each stage for the head (where ``S``
      divides ``M``), and their gradients back: the first stage sends ``(S - 1) / S``
      of ``M`` micro-batches (each other stage sends back ``M / S``);
    - with the slots' features split over the model axis (``split``: GPipe's stages on
      a plan with one, Megatron's sequence parallelism between the stages), each of
      those carries ``1 / split`` of the hidden states, and every stage gathers its
      slot whole at each tick (its gradient scattered back): an all-gather and a
      reduce-scatter over ``model`` per tick, inside the tensor-parallel group.

    ``gpipe``: as XLA compiles GPipe's ``run_stages`` (read in the compiled steps of
    ``tests/test_planner.py``): the rotation's backward (the transpose of a roll, a
    split and a pad) passes a slot twice per tick, so three passes a tick in all; the
    output's passes run forward and back; and the gradient of the first stage's
    block of outputs is summed over ``stage`` once (its ``M`` micro-batches).

    Args:
      shape: the mesh's axis sizes.
      rows: examples per device in a micro-batch; tokens: tokens per example.
      hidden: the hidden states' width; act_itemsize: bytes per element.
      micro_batches: ``M``; repeats: the circular repeats ``R``; split: the ways the
      slots' features are split over the model axis.
    """
    stages, staged = role_size(shape, "layers"), role_axes("layers")
    if stages <= 1:
        return []
    whole = rows * tokens * hidden * act_itemsize
    slot = whole / split
    ticks = pipeline_ticks(stages, micro_batches, repeats)[1]
    out = [Traffic("collective-permute", slot, staged, (3 if gpipe else 2) * ticks,
                   "pipeline: hidden states to the next stage, gradients back", True),
           Traffic("all-reduce", slot, staged, ticks,
                   "pipeline: the first stage's input gradient", True)]
    if micro_batches % stages == 0:
        out.append(Traffic("collective-permute", slot * micro_batches * (stages - 1) / stages,
                           staged, 2 if gpipe else 1, "pipeline: the output to each "
                           "stage's rows of the head, gradients back", True))
        if gpipe:
            out.append(Traffic("all-reduce", slot * micro_batches, staged, 1,
                               "pipeline: the first stage's outputs' gradient", True))
    if split > 1:
        out += [Traffic("all-gather", whole, role_axes("heads"), ticks,
                        "pipeline: a slot's features gathered for the stage's layers", True),
                Traffic("reduce-scatter", whole, role_axes("heads"), ticks,
                        "pipeline: their gradient scattered back", True)]
    return out


def context_traffic(shape: dict[str, int], rows: int, tokens: int, kv_width: int,
                    hidden: int, layers: float, act_itemsize: int,
                    micro_batches: int, passes: int | None = None,
                    linear_layers: float = 0, linear_state: int = 0,
                    method: str = "ring") -> list[Traffic]:
    """The context axis's ring (``redray/models/context.py``), per step: in each
    attention layer's forward ``C - 1`` passes of the device's keys and values (``rows x
    tokens / C x kv_width`` elements each), in its backward ``C - 1`` passes again and
    ``C`` of their float32 gradients (which travel with them and are sent home at the
    end); per micro-batch the hidden states put back in order after the zigzag layout
    and their gradients. Remat's recomputation sends nothing more: XLA merges its passes
    with the backward's (measured, ``benchmarks/context.py``). The all-gather moves the
    same keys and values (``C - 1`` blocks a device receives), so one count serves both.

    Args:
      shape: the mesh's axis sizes; rows: examples per device in a micro-batch;
      tokens: tokens per example (the whole sequence); kv_width: elements of a token's
      key or value (key/value heads x head dimension); hidden: the hidden states' width;
      layers: attention layers a device runs in a pass (with pipeline stages: a
      stage's chunk of them); micro_batches: per step; passes: the passes through
      ``layers`` per step (with stages the pipeline's ticks, bubble included: GPipe
      runs every stage at every tick), None: ``micro_batches``.
      linear_layers, linear_state: linear-attention layers a device runs in a pass, and
        the float32 elements one chunk of one sequence passes on in each (its state map
        and last convolution inputs, ``redray.models.gated_delta.across_context``):
        gathered from the ``2C`` chunks in the forward, their gradients reduce-scattered
        in the backward; nothing of the sequence moves.
      method: how attention crosses the axis (``Plan.context_attention``): "ring" (and
        "auto", which a fused kernel's blocks take as the ring), or "all_gather": in
        each attention layer's forward the keys and values gathered whole (one
        all-gather, ``C - 1`` blocks received, queries local: how the Llama 3 paper
        runs its context parallelism), in its backward their gradients reduce-scattered
        home; each overlaps the layer before (or after) as FSDP's gathers do.
    """
    ways, ring = role_size(shape, "sequence"), role_axes("sequence")
    if ways <= 1:
        return []
    local = rows * -(-tokens // ways)
    block = local * 2 * kv_width * act_itemsize
    grads = local * 2 * kv_width * 4
    runs = layers * (micro_batches if passes is None else passes)
    linear = []
    if linear_layers and linear_state:
        state = rows * 2 * ways * linear_state * 4
        times = linear_layers * (micro_batches if passes is None else passes)
        linear = [Traffic("all-gather", state, ring, times,
                          "context: each chunk's linear-attention state map", False,
                          "forward", True),
                  Traffic("reduce-scatter", state, ring, times,
                          "context: the state maps' gradients", False, "backward", True)]
    reorder = Traffic("collective-permute", local * hidden * act_itemsize, ring,
                      2 * micro_batches, "context: the hidden states out of the zigzag "
                      "layout, gradients back", False, "both")
    if method == "all_gather":
        return linear + [
            Traffic("all-gather", block * ways, ring, runs,
                    "context: keys and values gathered whole (forward)", False,
                    "forward", True),
            Traffic("reduce-scatter", block * ways, ring, runs,
                    "context: their gradients reduce-scattered home (backward)", False,
                    "backward", True), reorder]
    return linear + [Traffic("collective-permute", block, ring,
                    2 * (ways - 1) * runs,
                    "context: keys and values round the ring (forward, backward)", False,
                    "both", True),
            Traffic("collective-permute", grads, ring, ways * runs,
                    "context: the keys' and values' gradients, with them", False,
                    "backward", True), reorder]


def whole_flops(trace: Trace, params: Sequence[Parameter], examples: float) -> float:
    """Forward and backward FLOPs per example of the matmuls whose parameter the model
    axis leaves whole: every device of a tensor-parallel group runs them in full (the
    rest of the step's FLOPs divide over the group)."""
    total, heads = 0.0, role_axes("heads")
    for p, use in trace.runs():
        param = params[p]
        if use.kind != "dot" or param.split(heads) is not None:
            continue
        size = math.prod(param.shape[k] for k in (*use.in_dims, *use.out_dims))
        total += 3 * 2 * use.rows * size * use.times  # forward, and two in the backward
    return total / examples


def state_traffic(params: Sequence[Parameter], shape: dict[str, int], compute_itemsize: int,
                  hardware: Hardware, recompute: bool = False,
                  accumulation: int = 1, repeats: int = 1,
                  gathered_once: bool = False, looped: bool = False,
                  reduced_once: bool = False) -> list[Traffic]:
    """The FSDP gathers and gradient reductions of a step (see the module docstring).
    With pipeline stages the parameters the stages hold whole (embeddings, head) see
    rows split over ``stage`` too: their gradients are summed over it as well. With
    circular ``repeats`` a pass (``accumulation`` of them) runs one of a stage's
    ``repeats`` chunks of stacked layers: their traffic per pass is that chunk's.
    ``gathered_once``: GPipe's stages gather their stacked parameters over ``fsdp``
    once, before the ``accumulation`` ticks (``staged_layers.run_stages``; the
    compiled step of ``tests/test_planner.py`` holds one gather each): a stage's whole
    share once a step, on no layer's compute; their gradients are reduced (over
    ``fsdp`` and the data-parallel axes) at every tick, inside the ticks' loop, as the
    compiled step runs them; the embeddings and the head, which run once on every row,
    once.

    ``reduced_once`` (with ``gathered_once``): 1F1B on each device's own rows
    (``pipeline_schedules.Local``): a stage's stacked layers gathered once before the
    ticks, as GPipe's, and their gradients summed unreduced over the ticks and reduced
    (over ``fsdp`` and the data-parallel axes) once after them.

    ``looped``: the ``accumulation`` passes are the gradient accumulation's loop (no
    stages), as XLA compiles it (read in the compiled steps of
    ``tests/test_planner.py``, scanned layers and not): every gradient reduction,
    data-parallel ones included, runs inside the loop, on each micro-batch's gradient
    (the SPMD partitioner reduces a gradient where it is computed; a scanned stack's
    reductions sit in the layers' loop, nested in the accumulation's, where no pass
    moves them out), while a parameter gathered outside a layer scan is gathered once,
    before the loop (loop-invariant: the same gather every micro-batch)."""
    out = []
    # the gradients are summed over the axes splitting the batch, the axes splitting its
    # sequences, and (for what the stages hold whole) the stages
    staged = role_axes("layers")
    head_rows = (*role_axes("sequence"), *staged)
    for param in params:
        if not param.trained:
            continue
        axes = param.axes()
        gather = tuple(a for a in GATHERING if a in axes)  # FSDP's
        ways = math.prod(shape[a] for a in gather)
        others = math.prod(shape[a] for a in axes if a not in gather)
        elements = math.prod(param.shape) / others
        kind = "reduce-scatter" if hardware.reduce_scatter else "all-reduce"
        if ways > 1:
            out += _gathers(param, gather, elements, compute_itemsize, kind, recompute,
                            accumulation, repeats, gathered_once, looped, reduced_once)
        # the data-parallel reduction: in every micro-batch of an accumulation loop
        # (beside that micro-batch's backward), at every tick of GPipe's for a stage's
        # stacked layers (its embeddings and head run once, outside the ticks)
        each = looped or (gathered_once and param.stacked and not reduced_once)
        times, phase = (accumulation, "backward") if each else (1, "step")
        # a pass reduces its chunk of a stage's layers (circular repeats)
        share = elements * param.itemsize / (repeats if param.stacked and each else 1)
        if ways > 1:
            rest = tuple(a for a in (*BATCH_AXES, *head_rows) if a not in gather
                         and a not in axes and shape[a] > 1)
            if rest:
                out.append(Traffic("all-reduce", share / ways, rest, times,
                                   "data parallel: a gradient shard", False, phase,
                                   param.stacked))
            continue
        # GPipe sums an input embedding's gradient over the stages at every tick, as the
        # first stage's input gradient (``stage_traffic``): every stage then holds it
        rows_of = tuple(a for a in head_rows if not (gathered_once and param.lookup
                                                     and a in staged))
        group = tuple(a for a in (*BATCH_AXES, *rows_of) if a not in axes and shape[a] > 1)
        if group:
            out.append(Traffic("all-reduce", share, group, times,
                               "data parallel: a gradient", False, phase, param.stacked))
    return out


def _gathers(param: Parameter, gather: tuple[str, ...], elements: float,
             compute_itemsize: int, kind: str, recompute: bool, accumulation: int,
             repeats: int, gathered_once: bool, looped: bool,
             reduced_once: bool = False) -> list[Traffic]:
    """FSDP's collectives of one parameter split over the ``gather`` axes
    (``state_traffic``, whose arguments these are): its gathers, and its gradient's
    reduction onto the shards (``kind``: a reduce-scatter, or an all-reduce where the
    hardware has none); ``elements``: the gathered parameter's on one device."""
    if param.stacked and gathered_once and reduced_once:
        return [Traffic("all-gather", elements * compute_itemsize, gather, 1,
                        "FSDP: a stage's layers gathered before its ticks", False, "forward"),
                Traffic(kind, elements * param.itemsize, gather, 1,
                        "FSDP: a stage's gradients reduced once, after its ticks", False)]
    if param.stacked and gathered_once:
        return [Traffic("all-gather", elements * compute_itemsize, gather, 1,
                        "FSDP: a stage's layers gathered before its ticks", False, "forward"),
                Traffic(kind, elements * param.itemsize / repeats, gather, accumulation,
                        "FSDP: a tick's chunk's gradients reduced", False, "backward", True)]
    # gathered once, before an accumulation loop, outside a layer scan (hoisted)
    hoisted = looped and not param.stacked
    again = (recompute or param.stacked) and not hoisted
    chunk = repeats if param.stacked else 1
    # GPipe runs what is not stacked once a step, outside its ticks
    passes = 1 if gathered_once and not hoisted else accumulation
    return [Traffic("all-gather", elements * compute_itemsize / chunk, gather,
                    (2 if again else 1) * (1 if hoisted else passes),
                    "FSDP: a parameter gathered" + (
                        " before the micro-batches' loop" if hoisted else ""),
                    False, "both" if again else "forward", param.stacked),
            Traffic(kind, elements * param.itemsize / chunk, gather, passes,
                    "FSDP: a gradient reduced onto its shards", False, "backward",
                    param.stacked)]


@dataclasses.dataclass(frozen=True)
class DeviceWork:
    """What one device computes in a step (``redray.planning.work``), for the cost model.

    Attributes:
      layers: the stacked layers' work (every micro-batch, the pipeline's bubble
        included).
      rest: the embedding's, the head's and the loss's.
      forward: the share of ``layers``' time in their forward pass (what a layer's
        parameter gathers hide behind; the backward, rematerialization included, takes
        the rest).
      count: layers a device runs in one pass (a stage's share of them).
    """
    layers: Work
    rest: Work
    forward: float
    count: int


def work_parts(work: Work, hardware: Hardware) -> tuple[float, float, float]:
    """Seconds of ``work`` on one device, by rate: (the matmuls at the matmul rate, with
    attention's every pair where the device has no fused kernel; attention at the fused
    kernel's rate; the memory-bound kernels' bytes at the memory bandwidth, where it is
    known)."""
    fused = hardware.fused_attention
    matmul = (work.matmul + (0.0 if fused else work.dense_attention)) / hardware.matmul_flops
    attention = work.attention / hardware.attention_rate if fused else 0.0
    memory = work.memory / hardware.memory_bandwidth if hardware.memory_bandwidth else 0.0
    return matmul, attention, memory


def work_seconds(work: Work, hardware: Hardware) -> float:
    """Seconds of ``work`` on one device (``work_parts`` together)."""
    return sum(work_parts(work, hardware))


def exposed_seconds(traffic: Sequence[Traffic], spans: dict, hardware: Hardware,
                    layers_s: float, rest_s: float, forward: float, count: int,
                    ticks: int, stacked: bool, prices: dict | None = None) -> float:
    """What the compute does not hide of the FSDP, data-parallel and context traffic,
    layer by layer, as XLA's latency-hiding scheduler overlaps it:

    - in each of the ``ticks`` passes, a layer's parameters are gathered while the layer
      before computes its forward: only the first layer's gather, and what of each other
      exceeds a layer's forward, are exposed;
    - in the backward pass a layer's gradient is reduced (and its parameters gathered
      again) while the next layer computes its backward: the last reduction, and what
      of each other exceeds a layer's backward, are exposed;
    - a data-parallel gradient reduction runs layer by layer in the backward pass too
      (inside a scanned stack's loop: XLA's SPMD partitioner reduces each layer's
      gradient in the loop's body), in every micro-batch of an accumulation loop; once
      after a pipeline's ticks (phase "step"), where it is exposed;
    - the embedding's and the head's traffic hides behind their own compute.

    ``hardware.overlap`` scales the compute a layer's traffic may hide behind (0 on
    XLA:CPU: every collective runs in line). ``prices``: from ``priced``.
    """
    fwd = bwd = reduce = after = rest = 0.0
    for t in traffic:
        sec = traffic_seconds(t, spans, hardware, prices)
        if t.phase == "step" and ticks > 1:
            after += sec
        elif not t.layer and stacked:
            rest += sec
        elif t.phase == "forward":
            fwd += sec
        elif t.phase == "both":
            fwd, bwd = fwd + sec / 2, bwd + sec / 2
        else:  # a reduction in the backward pass (or, unscanned, a data-parallel one)
            bwd += sec
            reduce += sec
    ov, n = hardware.overlap, max(count, 1)
    if ov == 0:
        return fwd + bwd + after + rest
    per = ticks * n  # layer passes of a step
    c_f, c_b = ov * layers_s * forward / per, ov * layers_s * (1 - forward) / per
    a, b, r = fwd / per, bwd / per, reduce / per
    # the first backward layer's gather hides behind the head's backward
    layered = ticks * (a + r + (n - 1) * (max(0.0, a - c_f) + max(0.0, b - c_b)))
    return layered + after + max(0.0, rest - ov * rest_s)


def step_cost(flops: float, tensor: list[Traffic], state: list[Traffic], accumulation: int,
              shape: dict[str, int], hosts: int, hardware: Hardware,
              timing: ModelTiming | None = None, elements: float = 0.0,
              experts: Sequence[Traffic] = (), held: float = 1.0,
              stages: Sequence[Traffic] = (), context: Sequence[Traffic] = (),
              work: DeviceWork | None = None, update_bytes: float = 0.0,
              stacked: bool = False) -> StepCost:
    """The predicted step.

    Args:
      flops: one device's matmul FLOPs of the whole step (forward, backward, remat).
      tensor, state: the step's traffic (``tensor_traffic``, ``state_traffic``).
      accumulation: micro-batches per step (passes: a pipeline's ticks).
      shape: the mesh's axis sizes; hosts: how many hosts it spans.
      hardware: the devices and links (and the slices they are in:
        ``Hardware.slice_devices``).
      timing: the model's pass timed on these devices, if it was (its rate and cost
        per micro-batch replace the hardware's).
      elements: trained parameter elements one device holds (the update's share).
      experts: expert parallelism's all-to-alls (``expert_traffic``).
      held: the share of the trained parameters one device holds (``elements`` over
        all of them): the timed cost per micro-batch is charged at this share.
      stages: pipeline parallelism's traffic (``stage_traffic``).
      context: the context axis's ring (``context_traffic``).
      work: what the device computes, by kind (``redray.planning.work``): untimed, its
        time replaces ``flops`` at the matmul rate, and the FSDP, data-parallel and
        context traffic overlaps layer by layer (``exposed_seconds``); None: that
        traffic hides behind ``hardware.overlap`` of the whole compute.
      update_bytes: bytes the optimizer's update reads and writes on a device (untimed:
        at the memory bandwidth).
      stacked: the model's layers are stacked and scanned.
    """
    spans = host_spans(shape, hosts, hardware.slices(math.prod(shape.values())))
    attention = memory = 0.0
    if timing is None:
        per_micro = hardware.micro_batch_overhead
        if work is not None:
            parts = work_parts(work.layers + work.rest, hardware)
            compute, (_, attention, memory) = sum(parts), parts
        else:
            compute = flops / hardware.matmul_flops
        update = update_bytes / hardware.memory_bandwidth if hardware.memory_bandwidth else 0.0
    else:
        compute, per_micro = flops * timing.seconds_per_flop, timing.fixed * held
        update = elements * timing.update_per_element
    traffic = (*tensor, *state, *experts, *stages, *context)
    prices = priced(traffic, spans, hardware)
    tensor_s, state_s, context_s, experts_s, stages_s = (
        sum(traffic_seconds(t, spans, hardware, prices) for t in part)
        for part in (tensor, state, context, experts, stages))
    if work is not None:
        layers = work_seconds(work.layers, hardware)
        share = layers / (layers + work_seconds(work.rest, hardware) or 1.0)
        exposed = exposed_seconds((*state, *context), spans, hardware, compute * share,
                                  compute * (1 - share), work.forward, work.count,
                                  accumulation, stacked, prices)
    else:
        exposed = max(0.0, state_s + context_s - hardware.overlap * compute)
    return StepCost(compute, tensor_s, state_s, exposed, accumulation * per_micro, traffic,
                    update, experts_s, stages_s, context_s, attention, memory,
                    traffic_levels(traffic, spans, hardware, prices))


def context_method(batch: int, tokens: int, ways: int, heads: int, kv_heads: int, head_dim: int,
           itemsize: int, hardware: Hardware | None = None) -> str:
    """"ring" or "all_gather" for one layer's attention over ``tokens`` split ``ways``
    ways, whichever the cost model predicts faster (ties: "all_gather").

    Per device, with ``n = tokens / ways`` local queries, ``F(q, k)`` the FLOPs of ``q``
    queries over ``k`` keys (``4 q k heads head_dim`` per row: scores and values) and
    ``X`` the transfer of one device's keys and values (``2 n kv_heads head_dim``
    elements per row) over the link inside a host, latency included:

    * all-gather: ``F(n, tokens) / rate + (1 - overlap) (ways - 1) X``: every block
      computed; the gather is one collective that the scheduler may start during the
      layer before (the hardware's ``overlap``: 1 on GPU and TPU, 0 on XLA:CPU);
    * ring: ``F(n, n) / rate + (ways - 1) max(F(n, n / 2) / rate, X)``: the diagonal
      block, then steps of half a block each, every step waiting for its transfer.

    So the ring wins where each step's half block outlasts its transfer (long
    sequences), the gather where the transfers would be exposed (short local chunks).
    """
    hw = hardware or for_backend()
    n = tokens // ways
    flops = lambda q, k: 4.0 * batch * q * k * heads * head_dim  # noqa: E731
    transfer = 2.0 * batch * n * kv_heads * head_dim * itemsize / hw.intra.bandwidth \
        + hw.intra.latency
    gather = flops(n, tokens) / hw.matmul_flops + (1 - hw.overlap) * (ways - 1) * transfer
    ring = flops(n, n) / hw.matmul_flops \
        + (ways - 1) * max(flops(n, n / 2) / hw.matmul_flops, transfer)
    return "ring" if ring < gather else "all_gather"
