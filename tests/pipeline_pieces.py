"""A scanned decoder cut by hand the way a 1F1B step needs it (the embeddings, one
stage's layers, the tail), for tests/test_pipeline.py and benchmarks/pipeline.py."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from redray.models import build, layers
from redray.sharding.parallelism import layer_order
from redray.sharding.pipeline_schedules import one_f_one_b


@dataclasses.dataclass
class Pieces:
    """``params`` (the model's, an nnx State); ``reference(params)``: the sum of the
    micro-batches' next-token losses, unpipelined (differentiate it with JAX);
    ``one_f_one_b(params, mesh, repeats=1)``: (that sum, its gradient) by the 1F1B
    schedule over the mesh's ``stage`` axis (interleaved with ``repeats``)."""
    params: object
    reference: Callable
    one_f_one_b: Callable


def decoder_pieces(config, ids, micro: int, remat=False) -> Pieces:
    """``ids`` (rows, seq) cut into ``micro`` micro-batches of consecutive rows."""
    model = build(config, rngs=nnx.Rngs(0), scan=True, remat=remat)
    ids = ids.reshape(micro, ids.shape[0] // micro, ids.shape[1])
    inputs, labels = jnp.asarray(ids[:, :, :-1]), jnp.asarray(ids[:, :, 1:])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    name = model.BLOCKS
    block_graph, block_params, block_rest = nnx.split(getattr(model, name), nnx.Param, ...)
    block_tree = jax.tree.structure(block_params)

    def bound(p):  # the model on p, its other state (RNG counts) made in this trace
        return nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rest))

    def head(p, m_ids):
        """(the embeddings, the blocks' shared inputs: rotary tables, the mask)."""
        model = bound(p)
        mask, positions = layers.decoder_masks(m_ids, None, None, 0, window=model.window)
        shared, _ = model.block_inputs(positions, mask)
        return model.embed(m_ids, positions, True), shared

    def run_layers(block_leaves, h, shared):
        """The layers whose parameters are ``block_leaves`` (a list: plain arrays pass
        the schedule's transformations as they are)."""
        here = block_leaves[0].shape[0]  # RNG counts: no dropout here, any will do
        blocks = nnx.merge(block_graph, block_tree.unflatten(block_leaves),
                           jax.tree.map(lambda a: jnp.asarray(a)[:here], block_rest))
        return layers.run_blocks(blocks, h, shared, None, 0, True, remat)[0]

    def tail(p, h, m):
        model = bound(p)
        logits = model.logits(getattr(model, model.FINAL_NORM)(h)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels[m]).mean()

    def reference(p):
        total = 0.0
        for m in range(micro):
            x, shared = head(p, inputs[m])
            total += tail(p, run_layers(jax.tree.leaves(p[name]), x, shared), m)
        return total

    def pipelined(p, mesh, repeats=1):
        stages = mesh.shape["stage"]
        count = jax.tree.leaves(p[name])[0].shape[0]
        # with repeats the stages hold their chunks as a plan does (layer_order)
        order = layer_order(count, stages, repeats)
        lead = (stages,) if repeats == 1 else (stages, repeats)

        def heads(p):
            outs = [head(p, inputs[m]) for m in range(micro)]
            return jnp.stack([o[0] for o in outs]), [o[1] for o in outs]

        x_m, head_vjp, shared = jax.vjp(heads, p, has_aux=True)
        shared_m = jax.tree.map(lambda *a: jnp.stack(a), *shared)
        blocks = [a[order].reshape(*lead, count // (stages * repeats), *a.shape[1:])
                  for a in jax.tree.leaves(p[name])]
        # the tail's parameters: all but the stacked layers (held by their stages)
        others = nnx.State({k: v for k, v in p.items() if k != name})
        unused = jax.tree.map(lambda a: jnp.zeros((0,), a.dtype), p[name])  # the tail's
        loss, _, d_blocks, d_tail, d_x = one_f_one_b(
            lambda chunk, _, h, m, c: run_layers(chunk, h, jax.tree.map(lambda a: a[m], c)),
            lambda q, h, m, c: (tail(nnx.State({**q, name: unused}), h, m), {}),
            blocks, others, x_m, shared_m, mesh, repeats=repeats)
        (grads,) = head_vjp(d_x)
        back = np.argsort(order)  # the layers' own order again
        grads = nnx.State({k: (jax.tree.map(jnp.add, v, d_tail[k]) if k != name else
                               block_tree.unflatten([a + d.reshape(a.shape)[back] for a, d in zip(
                                   jax.tree.leaves(v), d_blocks)]))
                           for k, v in grads.items()})
        return loss, grads

    return Pieces(params, reference, pipelined)
