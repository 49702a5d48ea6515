"""The gradient of a user's loss by the 1F1B pipeline schedule
(``Trainer.of(pipeline_schedule="1f1b")``).

GPipe runs inside the model's forward, so the user's loss is one function of the whole
batch. 1F1B needs each micro-batch's loss as soon as that micro-batch leaves the last
stage, so the loss is cut at the model's stacked layers (``tracing.BlocksCut``,
which ``layers.run_blocks`` obeys) into three pieces:

- the head: the loss traced on the whole batch up to the layers, whose input (the
  embeddings) and the layers' other inputs (masks, rotary tables) it records; its vjp
  takes the first stage's input gradients at the end;
- the stages: the layers' own scan on one stage's chunk of the stacked parameters;
- the tail: the loss traced on one micro-batch, the layers' output given, run by the
  last stage as each micro-batch leaves it.

``sharding.pipeline_schedules.one_f_one_b`` runs them. The micro-batches are cut as GPipe cuts them
(``pipeline_schedules.split_micro``: each keeps the batch's split over the data axes) and the loss
and its metrics are averaged over them, as gradient accumulation averages them (by
their ``WEIGHT`` where the loss gives one: ``steps.combine``).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx

from redray.engine.steps import combine, weighed
from redray.functions import split_loss_output
from redray.sharding.tracing import BlocksCut, cut_at_blocks
from redray.sharding.parallelism import (BATCH_AXES, CONTEXT, MODEL, STAGE, held_whole,
                                         in_held_order, layer_order, stacked_count)
from redray.sharding.pipeline_schedules import (Local, merge_micro, one_f_one_b, rows_flags,
                                                runs_on_own_rows, split_micro)


def _path_of(model, target) -> tuple:
    for path, node in nnx.iter_graph(model):
        if node is target:
            return tuple(path)
    raise ValueError("pipeline_schedule='1f1b': the stacked layers are not a submodule of "
                     "the model the loss was given")


def _key(entry):
    for name in ("key", "name", "idx"):
        if hasattr(entry, name):
            return getattr(entry, name)
    return entry


def _split_at(tree, path: tuple) -> tuple[list[bool], list, object]:
    """(whether each leaf lies under ``path``, the leaves, the treedef) of ``tree``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    under = [tuple(_key(k) for k in p[:len(path)]) == path for p, _ in flat]
    return under, [leaf for _, leaf in flat], treedef


def salted(tree, salt, m, *more):
    """``tree`` with every RNG key in it folded with ``salt`` and micro-batch ``m``: what
    the stages' and the tail's dropout draw from. A stage's backward computes again
    what its forward did not keep (a remat policy's recomputation); both see the same
    keys, so they draw the same masks, and other micro-batches and other steps
    (``salt``: from the step's RNG) other ones."""
    def fold(a):
        if not jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
            return a
        flat = a.reshape(-1)
        def fold_all(k):
            for data in (salt, m, *more):
                k = jax.random.fold_in(k, data)
            return k

        folded = jax.vmap(fold_all)(flat)
        return folded.reshape(a.shape)

    return jax.tree.map(fold, tree)


def _head(runtime, loss, params, extra, batch, rng):
    """The loss traced on the whole batch up to the stacked layers, with its vjp: (their
    input, the vjp, (the layers' other inputs, per-layer inputs, the model's new other
    state)), and the cut that found the layers (``found``, their ``path`` in the model)."""
    head_cut = BlocksCut()

    def head(p):
        def fn(model, b):
            with cut_at_blocks(head_cut):
                loss(model, b, rng, True)
            if head_cut.found is None:
                raise ValueError("pipeline_schedule='1f1b' needs a model with stacked "
                                 "layers (scan=True) that the loss runs")
            head_cut.path = _path_of(model, head_cut.found["blocks"])
            return head_cut.found["x"], (head_cut.found["args"], head_cut.found["per_layer"])

        (x, found), new_extra = runtime.apply(fn, p, extra, rng, batch)
        return x, (*found, new_extra)

    x, head_vjp, aux = jax.vjp(head, params, has_aux=True)
    return x, head_vjp, aux, head_cut


def _stage_fn(runtime, run, graphdef, param_tree, rest_tree, args_tree, flags, salt):
    """``one_f_one_b``'s ``stage_fn``: a chunk's layers (``run``: their own scan) on
    micro-batch ``m``'s activations, their other state salted for the micro-batch."""
    def stage_fn(chunk, own, h, m, consts):
        rest, per_layer, real = own
        # on a device's own rows (the batch axes manual: ``pipeline_schedules.Local``)
        # no rows are split, and its dropout draws its own masks (salted by its place)
        own_rows = set(BATCH_AXES) <= set(jax.sharding.get_abstract_mesh().manual_axes)
        place = (jax.lax.axis_index(BATCH_AXES),) if own_rows else ()
        blocks = nnx.merge(graphdef, param_tree.unflatten(chunk),
                           rest_tree.unflatten(salted(rest, salt, m, *place)))
        a = args_tree.unflatten([z[m] if f else z for z, f in zip(consts["args"], flags)])
        # traced as on the plan: the rows' split, and a sequence split over the
        # context axis runs its ring inside the stage (manual over context alone:
        # ``stage`` is manual here already)
        with runtime.tracing(**({"ways": 1} if own_rows else {})):
            return run(blocks, h, a, per_layer, real)

    return stage_fn


def _tail_fn(runtime, loss, treedef, leaves, under, salt, rng):
    """``one_f_one_b``'s ``tail_fn``: the user's loss on micro-batch ``m``, the layers'
    output ``h`` given, weighed as gradient accumulation weighs it."""
    def tail_fn(tail_params, h, m, consts):
        it = iter(tail_params)
        # the stacked layers' place filled with empty arrays: the tail never reads them
        whole = treedef.unflatten([jnp.zeros((0,), a.dtype) if u else next(it)
                                   for a, u in zip(leaves, under)])
        micro_batch = jax.tree.map(lambda a: a[m], consts["batch"])
        tail_cut = BlocksCut(output=h)

        def fn(model, b):
            with cut_at_blocks(tail_cut):
                return loss(model, b, jax.random.fold_in(rng, m), True)

        out, _ = runtime.apply(fn, whole, salted(consts["extra"], salt, m), rng,
                               micro_batch)
        # weighed by its WEIGHT, as gradient accumulation weighs it (steps.combine)
        return weighed(*split_loss_output(out))

    return tail_fn


def _slot(x, mesh):
    """How the schedule holds and passes a micro-batch's hidden states (``one_f_one_b``'s
    ``slot``), for ``x`` (rows, tokens, features); None (XLA's choice) otherwise."""
    if x.ndim != 3:
        return None
    # (rows, tokens, features): the rows over the batch axes, the tokens over the
    # context axis, the features over the model axis where it divides them (as
    # GPipe's slots: Megatron's sequence parallelism between the stages)
    model = mesh.shape.get(MODEL.name, 1)
    return P(BATCH_AXES, CONTEXT.name if mesh.shape.get(CONTEXT.name, 1) > 1 else None,
             MODEL.name if model > 1 and x.shape[-1] % model == 0 else None)


def _local(runtime, params, under: list[bool], repeats: int, consts: dict,
           flags: list[bool]) -> Local | None:
    """How the stages run their chunks on each device's own rows (``one_f_one_b``'s
    ``local``, ``pipeline_schedules.Local``) on a plan whose rows are split (data,
    FSDP): a stage's chunks gathered over FSDP once and their gradients reduced once a
    step, as Megatron-LM and torchtitan run an FSDP stage (``reshard_after_forward=
    False``), where XLA would gather and reduce them at every tick. None where
    ``pipeline_schedules.runs_on_own_rows`` says no."""
    mesh = runtime.parallelism.mesh
    if runtime.specs is None or not runs_on_own_rows(mesh.shape):
        return None
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
    specs = jax.tree.structure(params).flatten_up_to(runtime.specs[0])
    lead = (None,) * (1 if repeats == 1 else 2)  # a chunk's layers (and the repeats)
    gathered = tuple(P(*lead, *held_whole(s)) for s, u in zip(specs, under) if u)
    const_rows = {"args": list(flags),
                  "batch": jax.tree.map(lambda _: True, consts["batch"]),
                  "extra": jax.tree.map(lambda _: False, consts["extra"])}
    return Local(BATCH_AXES, ways, gathered, const_rows)


def _add_pipelined(grads, d_stages, d_tail, under: list[bool], held: int):
    """The head's gradients ``grads`` with the schedule's added: the stages' (back in the
    stacked layers' shape of ``held`` rows) where ``under``, the tail's elsewhere."""
    g_leaves = jax.tree.leaves(grads)
    d_stages, d_tail = iter(d_stages), iter(d_tail)
    summed = [g + (next(d_stages).reshape(held, *g.shape[1:]) if u else next(d_tail))
              for g, u in zip(g_leaves, under)]
    return jax.tree.structure(grads).unflatten(summed)


def one_f_one_b_gradients(runtime, loss: Callable) -> Callable:
    """A gradient function ``(params, frozen, extra, batch, rng) -> (loss, metrics, new
    extra, grads)`` (``steps.model_gradients``' signature) of the user's ``loss`` by the
    1F1B schedule over the plan's ``stage`` axis, on micro-batches of the runtime's
    ``micro_rows``. The model's other state (``extra``) comes back as the head's pass
    leaves it; the stages and the tail draw their dropout from its keys salted by the
    step and the micro-batch (``salted``)."""
    mesh = runtime.parallelism.mesh
    stages, repeats = mesh.shape[STAGE.name], runtime.stage_repeats
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)

    def gradients(params, frozen, extra, batch, rng):
        if frozen is not None:
            raise ValueError("pipeline_schedule='1f1b' trains every parameter: drop "
                             "trainable= or use pipeline_schedule='gpipe'")
        rows = jax.tree.leaves(batch)[0].shape[0]
        micro = rows // runtime.micro_rows
        x, head_vjp, (args, per_layer, new_extra), head_cut = _head(
            runtime, loss, params, extra, batch, rng)
        salt = jax.random.bits(jax.random.fold_in(rng, 1), dtype=jnp.uint32)
        found, path = head_cut.found, head_cut.path
        graphdef, block_params, block_rest = nnx.split(found["blocks"], nnx.Param, ...)
        param_tree, rest_tree = jax.tree.structure(block_params), jax.tree.structure(block_rest)
        under, leaves, treedef = _split_at(params, path)
        held = next(a for a, u in zip(leaves, under) if u).shape[0]
        layers = stacked_count(held, runtime.stacked_layers, stages, repeats)
        # the stacked parameters are held in layer_order (with repeats: stage s's
        # chunks r S + s in turn; pads where the chunks do not divide the layers), so a
        # stage's block is its chunks
        lead = (stages,) if repeats == 1 else (stages, repeats)
        by_stage = lambda a: a.reshape(*lead, held // (stages * repeats),  # noqa: E731
                                       *a.shape[1:])
        order = layer_order(layers, stages, repeats)
        pads = held > layers
        ordered = lambda a: in_held_order(a, layers, stages, repeats)  # noqa: E731
        stage_params = [by_stage(a) for a, u in zip(leaves, under) if u]
        tail_params = [a for a, u in zip(leaves, under) if not u]
        # each chunk's share of the layers' other state (RNG counts) and per-layer
        # inputs, which come in the layers' own order (as run_stages takes them; a
        # pad's: the last layer's), and which of its layers are real (None: all)
        rest_under, rest_leaves, _ = _split_at(extra, path)
        own = ([by_stage(ordered(a)) for a, u in zip(rest_leaves, rest_under) if u],
               jax.tree.map(lambda a: by_stage(ordered(a)), per_layer),
               by_stage(jnp.asarray(order < layers)) if pads else None)
        x_m = split_micro(x, micro, ways)
        flags = rows_flags(args, rows)
        args_leaves, args_tree = jax.tree.flatten(args)
        consts = {"args": [split_micro(a, micro, ways) if f else a
                           for a, f in zip(args_leaves, flags)],
                  "batch": jax.tree.map(lambda a: split_micro(a, micro, ways), batch),
                  "extra": extra}
        stage_fn = _stage_fn(runtime, found["run"], graphdef, param_tree, rest_tree, args_tree,
                             flags, salt)
        tail_fn = _tail_fn(runtime, loss, treedef, leaves, under, salt, rng)
        slot = _slot(x, mesh)
        local = _local(runtime, params, under, repeats, consts, flags)
        if slot is not None:
            x_m = jax.lax.with_sharding_constraint(x_m, NamedSharding(mesh, P(None, *slot)))
        # a sequence split over a context axis: the ring's exchanges span the stages
        total, metrics, d_stages, d_tail, d_x = one_f_one_b(
            stage_fn, tail_fn, stage_params, tail_params, x_m, consts, mesh, own, repeats,
            in_step=mesh.shape.get(CONTEXT.name, 1) > 1, slot=slot, local=local,
            recompute=runtime.stage_recompute)
        (grads,) = head_vjp(merge_micro(d_x, ways))
        value, metrics, grads = combine(total, metrics,
                                        _add_pipelined(grads, d_stages, d_tail, under, held),
                                        micro)
        return value, metrics, new_extra, grads

    return gradients
