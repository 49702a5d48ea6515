"""fuse_reductions: column layers reading one input, one all-reduce for their gradients.

The model here is written without redray or Flax (plain arrays, layers stacked and
scanned, each block under ``jax.checkpoint`` and ``jax.jit``), so the rewrite is
checked inside every body it must reach; tests/test_collectives.py checks an NNX block
and redray's Trainer on redray's own models.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.sharding import derive_specs, make_mesh, shardings
from redray.sharding.collectives import collectives, describe
from redray.sharding.reductions import fuse_reductions, model_split_dims

sys.path.insert(0, os.path.dirname(__file__))

L, B, T, D, F = 3, 4, 8, 32, 64
H, KV, HD = 8, 4, 4  # query heads, grouped key/value heads (one per device), head size


def init(key):
    k = iter(jax.random.split(key, 8))
    def w(*shape):
        return jax.random.normal(next(k), (L, *shape)) / np.sqrt(shape[0])
    return {"wq": w(D, D), "wk": w(D, KV * HD), "wv": w(D, KV * HD), "wo": w(D, D),
            "w_gate": w(D, F), "w_up": w(D, F), "w_down": w(F, D), "scale": jnp.ones((L, D))}


def norm(v, p):
    return v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6) * p["scale"]


def attention(h, p):
    """Grouped-query attention with separate q, k, v projections, before its output one."""
    q = (h @ p["wq"]).reshape(B, T, H, HD)
    k = jnp.repeat((h @ p["wk"]).reshape(B, T, KV, HD), H // KV, axis=2)
    v = jnp.repeat((h @ p["wv"]).reshape(B, T, KV, HD), H // KV, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HD)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, D)


def gated_mlp(h, p):
    return (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def block(x, p):
    x = x + attention(norm(x, p), p) @ p["wo"]
    return x + gated_mlp(norm(x, p), p)


def parallel_block(x, p):
    # GPT-J's: attention and the MLP read one normed input; their outputs are added to
    # the residual together (the MLP's first, with a bias)
    h = norm(x, p)
    return x + ((gated_mlp(h, p) + p["scale"]) + attention(h, p) @ p["wo"])


def scanned(body, remat=True):
    def loss(params, x):
        def layer(carry, p):
            f = jax.checkpoint(body) if remat else body
            return jax.jit(f)(carry, p), None
        y, _ = jax.lax.scan(layer, x, params)
        return jnp.mean(y ** 2)
    return loss


loss = scanned(block)


def step_and_state(fuse: bool, mesh, loss=loss):
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    specs = derive_specs(params, mesh, loss, (x,))
    leaves, treedef = jax.tree.flatten(params)
    loss_fn = loss
    if fuse:
        fused = fuse_reductions(lambda ls, a: loss(treedef.unflatten(ls), a), mesh,
                             treedef.flatten_up_to(specs))
        loss_fn = lambda ps, a: fused(jax.tree.leaves(ps), a)  # noqa: E731

    def step(ps, a):
        value, grads = jax.value_and_grad(loss_fn)(ps, a)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, ps, grads)

    rep = NamedSharding(mesh, P())
    sh = shardings(mesh, specs)
    return jax.jit(step, in_shardings=(sh, rep), out_shardings=(rep, sh)), params, x, specs


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(model_axis=4)


def activation_all_reduces(step, params, x):
    found = collectives(step.lower(params, x).compile().as_text())
    moved = [dims for c in found if c.kind == "all-reduce" for _, dims in c.shapes]
    return moved.count((B, T, D)), describe(found)


def test_scanned_remat_jit_layers_one_all_reduce_per_fanout(mesh):
    step, params, x, specs = step_and_state(False, mesh)
    # the rules give Megatron's specs (columns split on the output, rows on the input)
    assert specs["wq"] == P(None, None, "model") and specs["wk"] == P(None, None, "model")
    assert specs["wo"] == P(None, "model") and specs["w_down"] == P(None, "model")
    # The scan body is written once: forward after wo and w_down, wo's again where
    # remat recomputes the block for the backward pass, then the input gradients of
    # the column layers: q, k, v and gate, up, one all-reduce each, or one per group.
    plain, report = activation_all_reduces(step, params, x)
    assert plain == 3 + 5, report
    fused, report = activation_all_reduces(*step_and_state(True, mesh)[:3])
    assert fused == 3 + 2, report


def test_parallel_block_one_all_reduce_forward_one_backward(mesh):
    parallel = scanned(parallel_block, remat=False)
    plain, report = activation_all_reduces(*step_and_state(False, mesh, parallel)[:3])
    # forward: attention output and MLP output apart; backward: q, k, v, gate, up apart
    assert plain == 2 + 5, report
    fused, report = activation_all_reduces(*step_and_state(True, mesh, parallel)[:3])
    assert fused == 1 + 1, report


# model 2 x fsdp 2: the shard_maps are manual over model only; fsdp stays automatic
@pytest.mark.parametrize("model, axes", [("sequential", {"model_axis": 4}),
                                         ("parallel", {"model_axis": 4}),
                                         ("parallel", {"fsdp_axis": 2, "model_axis": 2})])
def test_fused_step_equals_the_plain_one(model, axes):
    fn = loss if model == "sequential" else scanned(parallel_block)
    mesh = make_mesh(**axes)
    (v0, p0), (v1, p1) = [s(p, x) for s, p, x, _ in
                          (step_and_state(f, mesh, fn) for f in (False, True))]
    assert abs(float(v0) - float(v1)) <= 1e-6 * abs(float(v0))
    for name in p0:
        np.testing.assert_allclose(np.asarray(p1[name]), np.asarray(p0[name]),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    start = init(jax.random.key(0))
    assert all(not np.array_equal(p1[n], start[n]) for n in start)


def test_nothing_to_fuse_without_a_model_axis():
    fn = lambda ls, a: ls[0] @ a  # noqa: E731
    assert fuse_reductions(fn, make_mesh(), [P()]) is fn


def test_model_split_dims_reads_only_tensor_parallel_splits():
    assert model_split_dims([P(None, "model"), P("model"), P(("fsdp", "model")), P("fsdp"),
                             P()]) == [1, 0, None, None, None]
