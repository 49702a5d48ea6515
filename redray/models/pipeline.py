"""Pipeline parallelism: a scanned model's layers split into stages over the ``stage``
mesh axis, micro-batches passed from stage to stage.

The schedule is GPipe's, written as one SPMD program (every device runs the same
code; XLA's partitioner gives each stage's devices their part):

- The stacked layer parameters (``layers.make_blocks(..., scan=True)``: a leading
  layer axis of ``L``) are split over ``stage`` in consecutive blocks
  (``rules.StageParallel``), so ``reshape(S, L/S, ...)`` is free: stage ``s`` holds
  its ``L/S`` layers and runs them as one scan.
- The rows are cut into ``M`` micro-batches (row ``r * M + m`` goes to micro-batch
  ``m``, as gradient accumulation cuts them: each keeps the batch's split over the
  data axes). A buffer of ``S`` micro-batches' activations, split over ``stage``,
  holds what each stage works on; at every tick each stage runs its layers on its
  slot (``vmap`` over the stages, ``spmd_axis_name="stage"``), then the buffer is
  rotated by one stage (``jnp.roll`` on the stage-split axis: a collective-permute,
  the only traffic between stages), and stage 0 takes the next micro-batch.
- After ``M + S - 1`` ticks every micro-batch has left the last stage. The backward
  pass is the scan's transpose: the same schedule in reverse, each stage keeping the
  activations of its ``M`` micro-batches (or less, with remat inside the stages).

Per device, the layers' work is that of ``(M + S - 1) / M`` times a stage's share
(``S - 1`` ticks fill and drain the pipeline: the bubble); the embeddings, the final
norm and the head run on every stage's devices (their rows split over ``stage`` as
well after the pipeline, so the head's work is not repeated). ``flops_ratio`` writes
that down.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.sharding.activations import loop_unroll
from redray.sharding.parallelism import BATCH_AXES, STAGE


def _constrain(x, mesh, spec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _rows_flags(tree, rows: int) -> list[bool]:
    """Which leaves of ``tree`` hold rows (a leading axis of ``rows``); an
    ``AttentionMask``'s query slots and window are not rows, whatever their length."""
    def holds_rows(path, x):
        name = getattr(path[-1], "name", None) if path else None
        return bool(getattr(x, "ndim", 0)) and x.shape[0] == rows \
            and name not in ("q_slots", "layer_window")

    return [holds_rows(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _map_rows(tree, flags: list[bool], fn):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([fn(x) if f else x for x, f in zip(leaves, flags)])


def split_micro(x, micro: int, ways: int):
    """(rows, ...) -> (micro, rows / micro, ...), for rows split ``ways`` ways over the
    batch axes: each of those shards cut into ``micro`` consecutive parts, micro-batch
    ``m`` taking part ``m`` of every shard (so it keeps the batch's split: no data
    moves)."""
    rows = x.shape[0]
    parts = x.reshape(ways, micro, rows // (ways * micro), *x.shape[1:]).swapaxes(0, 1)
    return parts.reshape(micro, rows // micro, *x.shape[1:])


def merge_micro(x, ways: int):
    """``split_micro``'s inverse. Micro-batches split over ``stage`` (consecutive ones on
    a stage) become rows split over the batch axes and then ``stage``, with no data
    moved."""
    micro, part = x.shape[:2]
    rows = x.reshape(micro, ways, part // ways, *x.shape[2:]).swapaxes(0, 1)
    return rows.reshape(micro * part, *x.shape[2:])


def flops_ratio(stages: int, micro: int, layer_share: float) -> float:
    """The schedule's own formula: a pipelined step's FLOPs per device over an
    unpipelined step's on the devices of one stage, for a model whose stacked layers
    do ``layer_share`` of its work (the rest: embeddings, head, loss).

    Unpipelined, each of a stage's devices does all the work of its rows. Pipelined,
    it runs ``1/S`` of the layers on ``(M + S - 1)`` micro-batch slots where ``M`` hold
    rows (the bubble runs too), and the head on ``1/S`` of the rows."""
    layers = layer_share * (micro + stages - 1) / (micro * stages)
    return layers + (1 - layer_share) / stages


def check_stages(layers: int, stages: int) -> None:
    if layers % stages:
        divisors = [d for d in range(1, layers + 1) if layers % d == 0]
        raise ValueError(f"stage_axis={stages} does not divide the model's {layers} layers: "
                         f"use a stage axis among {divisors}")


def run_stages(blocks, x, args: tuple, per_layer: tuple, train: bool, run_layers, mesh,
               stages: int, micro: int):
    """The stacked ``blocks`` on ``x`` (rows, ...) as a pipeline of ``stages`` stages
    over ``micro`` micro-batches; returns the blocks' output (rows, ...), split over the
    batch axes and ``stage``.

    ``run_layers(block, x, args, per_layer)`` runs a stack of layers (one stage's) on
    one micro-batch and returns its output: ``layers.run_blocks``'s own scan, remat
    included. ``args`` are what every layer gets (rows split into micro-batches with
    ``x``), ``per_layer`` one entry per layer (split into stages with the parameters).
    The blocks' other state (dropout's RNG counts) advances once per tick."""
    graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
    layers = jax.tree.leaves(params)[0].shape[0]
    check_stages(layers, stages)
    rows = x.shape[0]
    S, M, k = stages, micro, layers // stages
    stage_split = P(STAGE.name)

    def by_stage(a):
        return _constrain(a.reshape(S, k, *a.shape[1:]), mesh, stage_split)

    params_s, rest_s, own_s = jax.tree.map(by_stage, (params, rest, per_layer))
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
    x_m = split_micro(x, M, ways)
    flags = _rows_flags(args, rows)
    args_m = _map_rows(args, flags, lambda a: split_micro(a, M, ways))
    slot = P(STAGE.name, BATCH_AXES)

    def one_stage(p, r, own, h, a):
        block = nnx.merge(graphdef, p, r)
        h = run_layers(block, h, a, own)
        return h, nnx.split(block, nnx.Param, ...)[2]

    row_axes = jax.tree.structure(args).unflatten([0 if f else None for f in flags])
    stage_step = jax.vmap(one_stage, in_axes=(0, 0, 0, 0, row_axes),
                          spmd_axis_name=STAGE.name)
    first = (jnp.arange(S) == 0).reshape(S, *(1,) * (x.ndim))

    def tick(carry, t):
        buffer, outs, r = carry
        # the rotation brought the micro-batch the last stage finished (``t - S``) to
        # slot 0: each stage files its slot in its own block of ``outs`` (stage 0's is
        # the output; no traffic), then stage 0 takes the next micro-batch
        outs = _constrain(outs.at[:, jnp.clip(t - S, 0, M - 1)].set(buffer), mesh, keep)
        buffer = jnp.where(first, x_m[jnp.minimum(t, M - 1)][None], buffer)
        buffer = _constrain(buffer, mesh, slot)
        # the micro-batch each stage holds at this tick (a bubble's: a clipped index)
        m = jnp.clip(t - jnp.arange(S), 0, M - 1)
        a = _map_rows(args_m, flags, lambda z: z[m])
        out, r = stage_step(params_s, r, own_s, buffer, a)
        out = _constrain(out, mesh, slot)
        return (jnp.roll(out, 1, axis=0), outs, r), None

    keep = P(STAGE.name, None, BATCH_AXES)
    buffer = _constrain(jnp.zeros((S, *x_m.shape[1:]), x.dtype), mesh, slot)
    outs = _constrain(jnp.zeros((S, *x_m.shape), x.dtype), mesh, keep)
    (buffer, outs, rest_s), _ = jax.lax.scan(tick, (buffer, outs, rest_s),
                                             jnp.arange(M + S - 1), unroll=loop_unroll())
    outs = _constrain(outs.at[:, M - 1].set(buffer), mesh, keep)
    nnx.update(blocks, jax.tree.map(lambda a: a.reshape(layers, *a.shape[2:]), rest_s))
    if M % S:  # the head runs on every stage's devices, on all the rows
        return merge_micro(outs[0], ways)
    out = merge_micro(_scatter_first(outs, mesh, S), ways)
    return _constrain(out, mesh, P((*BATCH_AXES, STAGE.name)))


def _scatter_first(outs, mesh, stages: int):
    """(S, M, ...) split over ``stage``, whose first stage's block holds the output:
    that block's ``M / S`` micro-batches sent to each stage (``S - 1`` point-to-point
    transfers from stage 0), returned as (M, ...) split over ``stage`` on ``M`` (the
    head's rows split over the stages as over the batch axes)."""
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

    rows = (None,) * (outs.ndim - 3)
    return jax.shard_map(local, mesh=mesh, in_specs=P(STAGE.name, None, BATCH_AXES, *rows),
                         out_specs=P(STAGE.name, BATCH_AXES, *rows), check_vma=False)(outs)
