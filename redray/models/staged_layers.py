"""Pipeline parallelism: a scanned model's layers split into stages over the ``stage``
mesh axis, micro-batches passed from stage to stage.

The schedule is GPipe's, or its circular form (``repeats``), written as one SPMD
program (every device runs the same code; XLA's partitioner gives each stage's devices
their part):

- The stacked layer parameters (``layers.make_blocks(..., scan=True)``: a leading
  layer axis of ``L``) are split over ``stage`` in consecutive blocks
  (``rules.StageParallel``), so ``reshape(S, R, L/(S R), ...)`` is free: stage ``s``
  holds its chunks of ``L/(S R)`` layers and runs one as a scan. Without repeats
  (``R = 1``) a stage's chunk is its ``L/S`` consecutive layers. With ``R`` repeats
  chunk ``c`` of the ``S R`` runs on stage ``c mod S``: a run holds its stacked
  parameters (and their optimizer state) in that order for good (``parallelism.layer_order``:
  no parameter moves between stages, ever); checkpoints and the model a user reads
  keep the layers' own order (``parallelism.reorder``, at those edges only).
- The rows are cut into ``M`` micro-batches (row ``r * M + m`` goes to micro-batch
  ``m``, as gradient accumulation cuts them: each keeps the batch's split over the
  data axes). A buffer of ``S`` micro-batches' activations, split over ``stage``,
  holds what each stage works on; at every tick each stage runs its chunk on its
  slot (``vmap`` over the stages, ``spmd_axis_name="stage"``), then the buffer is
  rotated by one stage (``jnp.roll`` on the stage-split axis: a collective-permute,
  the only traffic between stages), and stage 0 takes the next micro-batch, or, with
  repeats, the one the last stage just handed round for its next pass (the
  micro-batches go round in groups of ``S``; ``_item`` numbers the work).
- After ``P R + S - 1`` ticks (``parallelism.pipeline_ticks``: ``P = M``, or with repeats
  ``M`` rounded up to a multiple of ``S``) every micro-batch has left the last stage
  for the last time. The backward pass is the scan's transpose: the same schedule in
  reverse, each stage keeping the activations of every tick (or less, with remat
  inside the stages).

Per device, the layers' work is that of ``(P R + S - 1) / (M R)`` times a stage's
share (``S - 1`` ticks fill and drain the pipeline: the bubble, ``R`` times shorter
ticks with repeats, at the price of ``R`` times the passes between stages); the
embeddings, the final norm and the head run on every stage's devices (their rows split
over ``stage`` as well after the pipeline, so the head's work is not repeated).
``flops_ratio`` writes that down.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.sharding.tracing import loop_unroll, parameter_spec, stage_layout
from redray.sharding.parallelism import (BATCH_AXES, CONTEXT, MODEL, STAGE, held_layers,
                                         held_whole, in_held_order, layer_order,
                                         layer_positions, pipeline_ticks, stacked_count)
from redray.sharding.pipeline_schedules import merge_micro, rows_flags, split_micro


# what only moves or slices values: recomputed in a circular tick's backward pass
_MOVES = {"dynamic_slice", "squeeze", "reshape", "transpose", "convert_element_type", "copy",
          "broadcast_in_dim", "name", "slice", "gather"}


def _not_chunks(prim, *_, **__) -> bool:
    """The remat policy of a circular schedule's tick: everything saved for the backward
    pass but what only slices or moves values. A tick's chunk of parameters is such a
    slice (and so are the layers' slices of it), and would otherwise be kept once per
    tick: ``S R`` copies of the stage's parameters, more than its activations."""
    return prim.name not in _MOVES


def _constrain(x, mesh, spec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _map_rows(tree, flags: list[bool], fn):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([fn(x) if f else x for x, f in zip(leaves, flags)])


def flops_ratio(stages: int, micro: int, layer_share: float, repeats: int = 1) -> float:
    """The schedule's own formula: a pipelined step's FLOPs per device over an
    unpipelined step's on the devices of one stage, for a model whose stacked layers
    do ``layer_share`` of its work (the rest: embeddings, head, loss).

    Unpipelined, each of a stage's devices does all the work of its rows. Pipelined,
    it runs ``1/(S R)`` of the layers at each of ``P R + S - 1`` ticks
    (``parallelism.pipeline_ticks``: ``P`` micro-batch slots, ``M`` of them holding rows; the
    bubble runs too), and the head on ``1/S`` of the rows."""
    _, ticks = pipeline_ticks(stages, micro, repeats)
    layers = layer_share * ticks / (micro * repeats * stages)
    return layers + (1 - layer_share) / stages


def _item(j, stages: int, repeats: int):
    """(repeat, micro-batch) of work item ``j``: the items go in groups of ``S R``, each
    group ``S`` micro-batches, ``R`` times round (an item's previous repeat is ``S``
    items, so ``S`` ticks, earlier: what the last stage hands the first)."""
    within = j % (stages * repeats)
    return within // stages, (j // (stages * repeats)) * stages + within % stages


def _by_stage(a, mesh, lead: tuple[int, int, int], spec=None):
    """``a`` (layers, ...) as (S, R, k, ...) (``lead``), split over ``stage``: a
    parameter's other dimensions as its ``spec`` splits them but over fsdp; without a
    spec, whole."""
    # a parameter's other dimensions keep the plan's split over the model and expert
    # axes and are gathered over fsdp once, before the loop (inside it FSDP's gathers
    # would repeat at every tick)
    rest = [None] * (a.ndim - 1)
    if spec is not None:
        rest = [*held_whole(spec), *rest[len(spec) - 1:]]
    return _constrain(a.reshape(*lead, *a.shape[1:]), mesh, P(STAGE.name, None, None, *rest))


def _slot_axes(x, mesh) -> tuple[str | None, str | None, tuple]:
    """How a micro-batch's hidden states (rows, sequence, ...) of ``x`` are split after
    their rows: (the sequence's axis, the features' axis, the axes of the dimensions
    after the sequence)."""
    # the rows split over the batch axes, a sequence over the context axis where the
    # plan splits it (else kept whole at every tick, gathered and split again around
    # each stage's attention)
    seq = CONTEXT.name if mesh.shape.get(CONTEXT.name, 1) > 1 and x.ndim > 2 else None
    # and its features split over the model axis (Megatron's sequence parallelism
    # between the stages: a slot, the outputs and the passes 1/model of the hidden
    # states; each stage's layers gather them whole, inside the tensor-parallel group)
    model = mesh.shape.get(MODEL.name, 1)
    features = MODEL.name if model > 1 and x.ndim > 2 and x.shape[-1] % model == 0 else None
    inner = (None,) * (x.ndim - 3) + (features,) if x.ndim > 2 else ()
    return seq, features, inner


def _stage_step(graphdef, run_layers, repeats: int, pads: bool, row_axes):
    """Every stage's work at one tick, ``vmap``ped over ``stage``: ``(params, rest, own,
    real, h, args, rep) -> (h, rest)``, each stage's chunk ``rep`` run on its slot ``h``,
    its other state ``rest`` advanced."""
    def one_stage(p, r, own, real, h, a, rep):
        def pick(z):  # this tick's chunk
            if repeats == 1:  # the same at every tick: the scan's backward reads the parameters
                return z[0]
            return jax.lax.dynamic_index_in_dim(z, rep, 0, keepdims=False)

        block = nnx.merge(graphdef, *jax.tree.map(pick, (p, r)))
        h = run_layers(block, h, a, jax.tree.map(pick, own),
                       *(() if real is None else (pick(real),)))
        new = nnx.split(block, nnx.Param, ...)[2]
        return h, jax.tree.map(lambda z, n: z.at[rep].set(n), r, new)

    if repeats > 1:  # a tick's chunk is sliced again in the backward pass, not kept per tick
        one_stage = jax.checkpoint(one_stage, policy=_not_chunks)
    return jax.vmap(one_stage, in_axes=(0, 0, 0, 0 if pads else None, 0, row_axes, 0),
                    spmd_axis_name=STAGE.name)


def _file_output(outs, buffer, t, stages: int, micro: int, repeats: int, mesh, keep):
    """``outs`` (S, M + 1, ...) with the ``buffer`` of tick ``t`` filed: where it holds a
    micro-batch's output, in that micro-batch's place, else in the sink (place ``M``)."""
    # the rotation brought what the last stage finished (item ``t - S``) to slot 0:
    # where that was a micro-batch's last repeat, each stage files its slot in its
    # own block of ``outs`` (stage 0's is the output; no traffic), else in the sink
    done = t - stages
    rep, m = _item(jnp.maximum(done, 0), stages, repeats)
    last = (done >= 0) & (rep == repeats - 1) & (m < micro)
    return _constrain(outs.at[:, jnp.where(last, m, micro)].set(buffer), mesh, keep)


def run_stages(blocks, x, args: tuple, per_layer: tuple, train: bool, run_layers, mesh,
               stages: int, micro: int, repeats: int = 1):
    """The stacked ``blocks`` on ``x`` (rows, ...) as a pipeline of ``stages`` stages
    over ``micro`` micro-batches (``repeats`` times round the stages: a circular
    schedule, its parameters held in ``parallelism.layer_order``); returns the blocks' output
    (rows, ...), split over the batch axes and ``stage``.

    ``run_layers(block, x, args, per_layer)`` runs a stack of layers (one stage's) on
    one micro-batch and returns its output: ``layers.run_blocks``'s own scan, remat
    included. ``args`` are what every layer gets (rows split into micro-batches with
    ``x``), ``per_layer`` one entry per layer (split into stages with the parameters).
    The blocks' other state (dropout's RNG counts) advances once per tick."""
    graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
    held = jax.tree.leaves(params)[0].shape[0]  # the layers' rows, pads included
    layers = stacked_count(held, stage_layout()[2], stages, repeats)
    rows = x.shape[0]
    S, M, R = stages, micro, repeats
    padded, ticks = pipeline_ticks(S, M, R)
    order = layer_order(layers, S, R)
    if held_layers(layers, S, R) != held:  # the model's own arrays (an abstract check
        # before the plan holds them: engine/program.check_loss): held as the plan would
        params = jax.tree.map(lambda a: jnp.take(a, order, axis=0, mode="fill", fill_value=0),
                              params)
        held = len(order)
    pads = held > layers
    lead = (S, R, held // (S * R))  # a stage's R chunks of k layers
    params_s = jax.tree.map(lambda a: _by_stage(a, mesh, lead, parameter_spec(a)), params)
    # the other state and the per-layer inputs come in the layers' own order
    rest_s, own_s = jax.tree.map(
        lambda a: _by_stage(in_held_order(a, layers, S, R), mesh, lead), (rest, per_layer))
    # which of a chunk's layers are real (None: all are)
    real_s = _by_stage(jnp.asarray(order < layers), mesh, lead) if pads else None
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
    x_m = split_micro(x, M, ways)
    flags = rows_flags(args, rows)
    args_m = _map_rows(args, flags, lambda a: split_micro(a, M, ways))
    seq, features, inner = _slot_axes(x, mesh)
    slot = P(STAGE.name, BATCH_AXES, seq, *inner)
    x_m = _constrain(x_m, mesh, P(None, BATCH_AXES, seq, *inner))

    row_axes = jax.tree.structure(args).unflatten([0 if f else None for f in flags])
    stage_step = _stage_step(graphdef, run_layers, R, pads, row_axes)
    first = (jnp.arange(S) == 0).reshape(S, *(1,) * (x.ndim))

    def tick(carry, t):
        buffer, outs, r = carry
        outs = _file_output(outs, buffer, t, S, M, R, mesh, keep)
        # stage 0 takes the next micro-batch where its item starts a micro-batch's first
        # round; a later round's input is what the rotation brought
        rep0, m0 = _item(t, S, R)
        buffer = jnp.where(first & (rep0 == 0), x_m[jnp.minimum(m0, M - 1)][None], buffer)
        buffer = _constrain(buffer, mesh, slot)
        # the item each stage holds at this tick (a bubble's: a clipped one)
        rep, m = _item(jnp.clip(t - jnp.arange(S), 0, padded * R - 1), S, R)
        a = _map_rows(args_m, flags, lambda z: z[jnp.minimum(m, M - 1)])
        out, r = stage_step(params_s, r, own_s, real_s, buffer, a, rep)
        out = _constrain(out, mesh, slot)
        return (jnp.roll(out, 1, axis=0), outs, r), None

    keep = P(STAGE.name, None, BATCH_AXES, seq, *inner)
    buffer = _constrain(jnp.zeros((S, *x_m.shape[1:]), x.dtype), mesh, slot)
    # one block of M micro-batches per stage, and a sink for what is not an output
    outs = _constrain(jnp.zeros((S, M + 1, *x_m.shape[1:]), x.dtype), mesh, keep)
    (buffer, outs, rest_s), _ = jax.lax.scan(tick, (buffer, outs, rest_s),
                                             jnp.arange(ticks), unroll=loop_unroll())
    outs = _file_output(outs, buffer, ticks, S, M, R, mesh, keep)[:, :M]
    positions = layer_positions(layers, S, R)
    nnx.update(blocks, jax.tree.map(
        lambda a: a.reshape(held, *a.shape[3:])[positions if R > 1 or pads else slice(None)],
        rest_s))
    if M % S:  # the head runs on every stage's devices, on all the rows
        return merge_micro(outs[0], ways)
    out = merge_micro(_scatter_first(outs, mesh, S, seq, features), ways)
    return _constrain(out, mesh, P((*BATCH_AXES, STAGE.name), seq))


def _scatter_first(outs, mesh, stages: int, seq: str | None = None,
                   features: str | None = None):
    """(S, M, ...) split over ``stage``, whose first stage's block holds the output:
    that block's ``M / S`` micro-batches sent to each stage (``S - 1`` point-to-point
    transfers from stage 0), returned as (M, ...) split over ``stage`` on ``M`` (the
    head's rows split over the stages as over the batch axes); a sequence and the
    features split as ``run_stages``' slots (over ``seq`` and ``features``)."""
    micro = outs.shape[1]
    part = micro // stages

    def local(block):  # (1, M, rows, ...): this device's block
        chunks = block[0].reshape(stages, part, *block.shape[2:])
        here = jax.lax.axis_index(STAGE.name)
        mine = chunks[0]
        for s in range(1, stages):
            got = jax.lax.ppermute(chunks[s], STAGE.name, [(0, s)])
            mine = jnp.where(here == s, got, mine)
        return mine

    rows = (None,) * (outs.ndim - 3)  # a micro-batch's dimensions after its rows
    if seq is not None:  # the first the sequence's, split as run_stages' slots
        rows = (seq, *rows[1:])
    if features is not None:  # the last the features', split as the slots too
        rows = (*rows[:-1], features)
    return jax.shard_map(local, mesh=mesh, in_specs=P(STAGE.name, None, BATCH_AXES, *rows),
                         out_specs=P(STAGE.name, BATCH_AXES, *rows), check_vma=False)(outs)
