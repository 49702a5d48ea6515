"""Pipeline schedules' parts that know no model: micro-batches cut from the rows and put
back, and the 1F1B schedule, given a model cut into the stages' layers and the tail
(``redray/engine/one_f_one_b.py`` cuts a user's loss; ``redray/models/staged_layers.py`` runs
GPipe's schedule inside the model's forward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from redray.sharding.activations import loop_unroll
from redray.sharding.parallelism import STAGE


def rows_flags(tree, rows: int) -> list[bool]:
    """Which leaves of ``tree`` hold rows (a leading axis of ``rows``); an
    ``AttentionMask``'s query slots and window are not rows, whatever their length."""
    def holds_rows(path, x):
        name = getattr(path[-1], "name", None) if path else None
        return bool(getattr(x, "ndim", 0)) and x.shape[0] == rows \
            and name not in ("q_slots", "layer_window")

    return [holds_rows(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


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


def one_f_one_b_schedule(stages: int, micro: int) -> tuple[int, int]:
    """(ticks, ring slots) of ``one_f_one_b`` on ``S`` stages over ``M`` micro-batches.

    Stage ``s`` runs micro-batch ``m``'s forward at tick ``m + s`` and its backward at
    tick ``m + 2 (S - 1) - s`` (the last stage: both in one tick, the loss's gradient
    between them), so ``M + 2 (S - 1)`` ticks; stage ``s`` holds the input of a
    micro-batch from its forward to its backward, at most ``2 (S - 1 - s) + 1`` at once:
    a ring of ``2 S - 1`` slots, whatever ``M``."""
    return micro + 2 * (stages - 1), 2 * stages - 1


def one_f_one_b(stage_fn, tail_fn, stage_params, tail_params, x_m, consts, mesh,
                stage_consts=()):
    """One pipelined gradient step in the 1F1B order: each stage alternates one
    micro-batch's forward and an earlier one's backward, so a stage holds at most
    ``2 S - 1`` micro-batches' inputs (``one_f_one_b_schedule``), where GPipe keeps
    every tick's activations until its backward pass starts after the last forward.

    One SPMD program as GPipe's (``redray.models.staged_layers.run_stages``), but manual
    over ``stage`` (``shard_map``; the other mesh axes stay XLA's to partition inside a stage): at
    every tick a stage runs its forward and its backward only where it has one
    (``lax.cond``: a bubble computes nothing), then passes its output to the next stage
    and its input gradient to the previous one (two ``ppermute``). The backward
    recomputes the stage's forward from the input it kept (a stage's activations
    exist for one tick at a time; remat inside the stage's layers still applies to
    that recomputation). The last stage runs the loss's ``tail_fn`` on each micro-batch
    as it leaves and starts that micro-batch's backward in the same tick.

    Args:
      stage_fn: ``stage_fn(chunk, own, h, m, consts) -> h``: one stage's layers on
        micro-batch ``m``'s activations ``h``; ``chunk`` and ``own`` are this stage's
        parts of ``stage_params`` and ``stage_consts`` (their leading stage axis
        removed).
      tail_fn: ``tail_fn(tail_params, h, m, consts) -> (loss, metrics)``: micro-batch
        ``m``'s loss (a scalar) from the last stage's output, and a dict of scalars
        summed over the micro-batches as the loss is.
      stage_params: a pytree whose leaves have a leading axis of ``S`` (the stages),
        split over the ``stage`` mesh axis.
      tail_params: the tail's parameters (the same on every stage).
      x_m: (M, ...): every micro-batch's input to the first stage.
      consts: what both functions read (a micro-batch's labels, masks: they pick
        micro-batch ``m``'s part themselves); no gradient flows into them.
      mesh: the device mesh, with a ``stage`` axis of ``S``.
      stage_consts: like ``stage_params`` (a leading axis of ``S``), without gradients:
        each stage's share of what its layers read (their other state, per-layer
        inputs).

    Returns:
      (the micro-batches' losses summed, their metrics summed, the gradients of
      ``stage_params`` (their layout), of ``tail_params``, and of ``x_m``).
    """
    stages = mesh.shape[STAGE.name]
    micro = x_m.shape[0]
    if jax.tree.leaves(stage_params)[0].shape[0] != stages:
        raise ValueError(f"stage_params lead with {jax.tree.leaves(stage_params)[0].shape[0]} "
                         f"entries; the mesh has {stages} stages")
    ticks, slots = one_f_one_b_schedule(stages, micro)
    S = stages

    metrics_shape = jax.eval_shape(lambda *a: tail_fn(*a)[1], tail_params, x_m[0], 0, consts)
    no_metrics = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), metrics_shape)

    def local(chunk, own, tail_params, x_m, consts):
        chunk, own = jax.tree.map(lambda a: a[0], (chunk, own))
        s = jax.lax.axis_index(STAGE.name)
        zero_h = jnp.zeros_like(x_m[0])

        def run(p, h, m):
            return stage_fn(p, own, h, m, consts)

        def tick(carry, t):
            got, got_grad, ring, grads, tail_grads, x_grads, loss, metrics = carry
            # forward of micro-batch t - s, on the input that came from the previous
            # stage (the first stage: from x_m), kept in the ring for its backward
            m = t - s
            forward = (m >= 0) & (m < micro)
            m = jnp.clip(m, 0, micro - 1)
            h = jnp.where(s == 0, x_m[m], got)
            out = jax.lax.cond(forward, lambda: run(chunk, h, m), lambda: zero_h)
            ring = jax.lax.cond(forward, lambda: ring.at[m % slots].set(h), lambda: ring)

            def tail():  # the gradients added where they are kept: no zeros made
                (value, found), (d_tail, d_out) = jax.value_and_grad(
                    tail_fn, (0, 1), has_aux=True)(tail_params, out, m, consts)
                return (loss + value.astype(jnp.float32),
                        jax.tree.map(lambda a, b: a + jnp.asarray(b, jnp.float32), metrics,
                                     found),
                        jax.tree.map(jnp.add, tail_grads, d_tail), d_out)

            loss, metrics, tail_grads, d_out = jax.lax.cond(
                forward & (s == S - 1), tail, lambda: (loss, metrics, tail_grads, zero_h))
            # backward of micro-batch t - 2 (S - 1) + s: its output's gradient came from
            # the next stage (the last: from the tail, this tick)
            b = t - 2 * (S - 1) + s
            backward = (b >= 0) & (b < micro)
            b = jnp.clip(b, 0, micro - 1)
            d_h = jnp.where(s == S - 1, d_out, got_grad)

            def back():
                _, vjp = jax.vjp(lambda p, x: run(p, x, b), chunk, ring[b % slots])
                d_chunk, d_in = vjp(d_h)
                return jax.tree.map(jnp.add, grads, d_chunk), d_in

            grads, d_in = jax.lax.cond(backward, back, lambda: (grads, zero_h))
            x_grads = jax.lax.cond(backward & (s == 0), lambda: x_grads.at[b].set(d_in),
                                   lambda: x_grads)
            carry = (jax.lax.ppermute(out, STAGE.name, [(i, i + 1) for i in range(S - 1)]),
                     jax.lax.ppermute(d_in, STAGE.name, [(i + 1, i) for i in range(S - 1)]),
                     ring, grads, tail_grads, x_grads, loss, metrics)
            return carry, None

        carry = (zero_h, zero_h, jnp.zeros((slots, *zero_h.shape), zero_h.dtype),
                 jax.tree.map(jnp.zeros_like, chunk), jax.tree.map(jnp.zeros_like, tail_params),
                 jnp.zeros_like(x_m), jnp.zeros((), jnp.float32), no_metrics)
        (_, _, _, grads, tail_grads, x_grads, loss, metrics), _ = jax.lax.scan(
            tick, carry, jnp.arange(ticks), unroll=loop_unroll())
        # the loss and the tail's gradients live on the last stage, x_m's on the first
        return (jax.lax.psum((loss, metrics), STAGE.name),
                jax.tree.map(lambda a: a[None], grads), jax.lax.psum(tail_grads, STAGE.name),
                x_grads[None])

    staged, whole = P(STAGE.name), P()
    (loss, metrics), grads, tail_grads, x_grads = jax.shard_map(
        local, mesh=mesh, in_specs=(staged, staged, whole, whole, whole),
        out_specs=(whole, staged, whole, staged), axis_names={STAGE.name},
        check_vma=False)(stage_params, stage_consts, tail_params, x_m, consts)
    return loss, metrics, grads, tail_grads, x_grads[0]
