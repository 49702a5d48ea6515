"""Derived specs give Megatron-style communication: counted in the compiled HLO.

Parameters are placed with ``shardings(mesh, derive_specs(...))`` on a 4-way ``model``
mesh, the input is replicated, and the compiled (SPMD-partitioned) HLO is read by
``redray.sharding.collectives`` (the parser benchmarks/communication.py uses). A column
-> row pair must cost exactly one all-reduce and no all-gather; redray.models' real
training steps must move the Megatron-LM ideal's activations, no more.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.models import layers
from redray.sharding import derive_specs, flatten, make_mesh, shardings
from redray.sharding.collectives import collectives, describe, summarize, total_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import communication  # noqa: E402  (the benchmark's model sizes, loss and ideal formula)

B, T, D, H, F = 2, 8, 64, 4, 256


def count(found) -> dict[str, int]:
    """Collective instructions of each kind."""
    return {kind: s["count"] for kind, s in summarize(found).items()}


def spec_dict(model, specs) -> dict[str, P]:
    paths, _, _ = flatten(nnx.state(model))
    return dict(zip(paths, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))


def compile_forward(model, x, mesh):
    """(compiled HLO text, specs) of model(x) with params placed by derived specs."""
    graphdef, state = nnx.split(model)
    specs = derive_specs(state, mesh, lambda st, a: nnx.merge(graphdef, st)(a).sum(), (x,))
    rep = NamedSharding(mesh, P())

    def forward(st, a):
        return nnx.merge(graphdef, st)(a)

    compiled = jax.jit(forward, in_shardings=(shardings(mesh, specs), rep),
                       out_shardings=rep).lower(state, x).compile()
    return compiled.as_text(), specs


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, F, rngs=rngs)
        self.fc2 = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


def test_mlp_forward_one_all_reduce_no_all_gather():
    mesh = make_mesh(model_axis=4)
    model = MLP(nnx.Rngs(0))
    hlo, specs = compile_forward(model, jnp.ones((B, T, D)), mesh)
    # the placement the counts below rely on: column then row
    assert spec_dict(model, specs) == {
        "fc1/kernel": P(None, "model"), "fc1/bias": P("model"),
        "fc2/kernel": P("model"), "fc2/bias": P()}
    found = collectives(hlo)
    report, n = describe(found), count(found)
    assert n["all-gather"] == 0, report
    assert n["all-reduce"] == 1, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert n[kind] == 0, report


class Block(nnx.Module):
    """Pre-LN transformer block: attention (4 heads) + MLP, residuals, layernorms."""

    def __init__(self, rngs):
        self.ln_1 = nnx.LayerNorm(D, rngs=rngs)
        self.q_proj = nnx.Linear(D, D, rngs=rngs)
        self.k_proj = nnx.Linear(D, D, rngs=rngs)
        self.v_proj = nnx.Linear(D, D, rngs=rngs)
        self.o_proj = nnx.Linear(D, D, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, F, rngs=rngs)
        self.fc2 = nnx.Linear(F, D, rngs=rngs)

    def attention(self, x):
        b, t, _ = x.shape
        def split(y):
            return y.reshape(b, t, H, D // H)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // H)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return self.o_proj(o.reshape(b, t, D))

    def __call__(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln_2(x))))


def test_transformer_block_forward_two_all_reduces_no_all_gather():
    mesh = make_mesh(model_axis=4)
    block = Block(nnx.Rngs(0))
    hlo, specs = compile_forward(block, jnp.ones((B, T, D)), mesh)
    got = spec_dict(block, specs)
    for name in ("q_proj", "k_proj", "v_proj", "fc1"):
        assert got[f"{name}/kernel"] == P(None, "model"), got
        assert got[f"{name}/bias"] == P("model"), got
    for name in ("o_proj", "fc2"):
        assert got[f"{name}/kernel"] == P("model"), got
        assert got[f"{name}/bias"] == P(), got
    found = collectives(hlo)
    report, n = describe(found), count(found)
    assert n["all-gather"] == 0, report
    # one after the attention output projection, one after the MLP's row layer
    assert n["all-reduce"] == 2, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert n[kind] == 0, report


def compile_train_step(model, x, mesh):
    """HLO of one SGD step (value_and_grad + update) with params placed by derived specs."""
    graphdef, state = nnx.split(model)
    def loss(st, a):
        return jnp.mean(nnx.merge(graphdef, st)(a) ** 2)
    param_shardings = shardings(mesh, derive_specs(state, mesh, loss, (x,)))
    rep = NamedSharding(mesh, P())

    def step(st, a):
        value, grads = jax.value_and_grad(loss)(st, a)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, st, grads)

    return jax.jit(step, in_shardings=(param_shardings, rep),
                   out_shardings=(rep, param_shardings)).lower(state, x).compile().as_text()


def test_mlp_train_step_one_all_reduce():
    # Backward needs no extra collective: the input is not differentiated, and each
    # kernel's gradient comes out already sharded like the kernel.
    found = collectives(compile_train_step(MLP(nnx.Rngs(0)), jnp.ones((B, T, D)),
                                           make_mesh(model_axis=4)))
    report, n = describe(found), count(found)
    assert n["all-gather"] == 0, report
    assert n["all-reduce"] == 1, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert n[kind] == 0, report


class FusedBlock(Block):
    """``Block`` with Q, K and V in one kernel, as redray.models lay them out."""

    def __init__(self, rngs):
        super().__init__(rngs)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = layers.qkv_projection(D, H, H, D // H, rngs=rngs)

    def attention(self, x):
        b, t, _ = x.shape
        q, k, v = layers.split_qkv(self.qkv_proj(x))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // H)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return self.o_proj(o.reshape(b, t, D))


@pytest.mark.parametrize("block, activations", [(Block, 6), (FusedBlock, 4)])
def test_transformer_block_train_step_megatron_collectives(block, activations):
    # Megatron's f/g pair per sublayer: forward all-reduce after o_proj and fc2, backward
    # all-reduce of the gradient reaching ln_2's output (from fc1) and ln_1's output
    # (from Q, K and V). XLA:CPU reduces separate Q, K and V partial gradients each on
    # its own (three buffers in one tuple all-reduce), a fused kernel's as one.
    found = collectives(compile_train_step(block(nnx.Rngs(0)), jnp.ones((B, T, D)),
                                           make_mesh(model_axis=4)))
    report, n = describe(found), count(found)
    assert n["all-gather"] == 0, report
    assert n["all-reduce"] == 4, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert n[kind] == 0, report
    moved = [dims for c in found for _, dims in c.shapes]
    assert moved.count((B, T, D)) == activations == len(moved), report
    assert total_bytes(found) == activations * B * T * D * 4, report


def test_counter_sees_all_gathers_of_a_bad_placement():
    # Control for the counter: two column layers in a row force XLA to gather the
    # split activation (and the split output), and the counts above would catch it.
    mesh = make_mesh(model_axis=4)
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jnp.ones((B, T, D))
    specs = derive_specs(state, mesh, lambda st, a: nnx.merge(graphdef, st)(a).sum(), (x,),
                         rules=[(r"fc2/kernel", P(None, "model")), (r"fc2/bias", P("model"))])
    rep = NamedSharding(mesh, P())
    hlo = jax.jit(lambda st, a: nnx.merge(graphdef, st)(a),
                  in_shardings=(shardings(mesh, specs), rep),
                  out_shardings=rep).lower(state, x).compile().as_text()
    found = collectives(hlo)
    n = count(found)
    assert n["all-gather"] >= 1, describe(found)
    assert n["all-reduce"] == 0, describe(found)


# --------------------------------------------------------------------------- redray.models

SMALL = communication.Sizes(layers=2, hidden=64, heads=4, intermediate=128, vocab=128, batch=4,
                            seq=16)


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_model_train_step_reaches_the_megatron_ideal(family):
    """redray's real training step (Trainer, model_axis=4, Adam) of a redray.models model
    moves exactly the Megatron-LM ideal's activation all-reduces (the formula in
    benchmarks/communication.py) and, counting every byte, at most 1.1x its bytes."""
    trainer = communication.trainer_for(family, SMALL)
    found = communication.step_collectives(trainer, communication.examples(family, SMALL))
    ideal = communication.ideal(family, SMALL)
    report, n = describe(found), count(found)
    assert {k for k, v in n.items() if v} == {"all-reduce"}, report
    moved = [dims for c in found for _, dims in c.shapes]
    activations = moved.count((SMALL.batch, SMALL.seq, SMALL.hidden))
    assert activations == sum(ideal["activation_all_reduces"].values()), report
    assert total_bytes(found) <= 1.1 * ideal["bytes"], report
