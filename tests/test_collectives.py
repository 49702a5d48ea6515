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
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.models import layers
from redray.sharding import derive_specs, flatten, make_mesh, shardings
from redray.sharding.collectives import collectives, describe, summarize, total_bytes
from redray.sharding.reductions import fuse_reductions

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


def train_step(model, x, mesh, fuse=False):
    """One SGD step (value_and_grad + update) with params placed by derived specs, jitted,
    and the state; ``fuse``: the loss through ``fuse_reductions``, as the Trainer runs it."""
    graphdef, state = nnx.split(model)
    def loss(st, a):
        return jnp.mean(nnx.merge(graphdef, st)(a) ** 2)
    specs = derive_specs(state, mesh, loss, (x,))
    param_shardings = shardings(mesh, specs)
    rep = NamedSharding(mesh, P())
    if fuse:
        leaves, treedef = jax.tree.flatten(state)
        fused = fuse_reductions(lambda ls, a: loss(treedef.unflatten(ls), a), mesh,
                             treedef.flatten_up_to(specs))
        loss_fn = lambda st, a: fused(jax.tree.leaves(st), a)  # noqa: E731
    else:
        loss_fn = loss

    def step(st, a):
        value, grads = jax.value_and_grad(loss_fn)(st, a)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, st, grads)

    return jax.jit(step, in_shardings=(param_shardings, rep),
                   out_shardings=(rep, param_shardings)), state


def compile_train_step(model, x, mesh, fuse=False):
    """HLO of ``train_step``."""
    step, state = train_step(model, x, mesh, fuse)
    return step.lower(state, x).compile().as_text()


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


@pytest.mark.parametrize("block, fuse, activations",
                         [(Block, False, 6), (Block, True, 4), (FusedBlock, False, 4)])
def test_transformer_block_train_step_megatron_collectives(block, fuse, activations):
    # Megatron's f/g pair per sublayer: forward all-reduce after o_proj and fc2, backward
    # all-reduce of the gradient reaching ln_2's output (from fc1) and ln_1's output
    # (from Q, K and V). XLA:CPU reduces separate Q, K and V partial gradients each on
    # its own (three buffers in one tuple all-reduce), a fused kernel's as one, and so
    # does fuse_reductions (what the Trainer runs) with separate ones.
    found = collectives(compile_train_step(block(nnx.Rngs(0)), jnp.ones((B, T, D)),
                                           make_mesh(model_axis=4), fuse))
    report, n = describe(found), count(found)
    assert n["all-gather"] == 0, report
    assert n["all-reduce"] == 4, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert n[kind] == 0, report
    moved = [dims for c in found for _, dims in c.shapes]
    assert moved.count((B, T, D)) == activations == len(moved), report
    assert total_bytes(found) == activations * B * T * D * 4, report


def test_fused_fanouts_compute_the_same_step():
    # The fused step's loss and updated parameters are the plain step's (the partial
    # gradients are added in another order: float32 rounding only).
    x = jax.random.normal(jax.random.key(1), (B, T, D))
    mesh = make_mesh(model_axis=4)
    results = []
    for fuse in (False, True):
        step, state = train_step(Block(nnx.Rngs(0)), x, mesh, fuse)
        results.append(step(state, x))
    (v0, s0), (v1, s1) = results
    assert abs(float(v0) - float(v1)) <= 1e-6 * abs(float(v0))
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s0),
                                                      jax.tree.leaves(nnx.split(Block(
                                                          nnx.Rngs(0)))[1]))]
    assert all(changed)  # every parameter got a gradient


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


MLP_SIZES = communication.MLP_TINY


@pytest.mark.parametrize("case", ["llama", "gpt2", "gptj", "t5", "separate_qkv",
                                  "parallel_residual", "gemma", "penzai_llama"])
def test_train_step_reaches_the_ideal(case):
    """redray's real training step (Trainer, model_axis=4, Adam) moves exactly the
    ideal's activation all-reduces (benchmarks/communication.py's formula) and, counting
    every byte, at most 1.1x its bytes: redray's own models, and models written without
    redray (separate Q/K/V, a parallel residual block, Google's Gemma, penzai's LLaMA)."""
    trainer, data = communication.setup(case, SMALL)
    found = communication.step_collectives(trainer, data)
    ideal = communication.ideal(case, SMALL)
    report, n = describe(found), count(found)
    assert {k for k, v in n.items() if v} == {"all-reduce"}, report
    # an activation in any layout (penzai's named axes put the embedding first)
    moved = [sorted(d for d in dims if d != 1) for c in found for _, dims in c.shapes]
    activations = moved.count(sorted((SMALL.batch, SMALL.seq, SMALL.hidden)))
    assert activations == sum(ideal["activation_all_reduces"].values()), report
    assert total_bytes(found) <= 1.1 * ideal["bytes"], report
    assert trainer.runtime.costly_whole() == []


def test_auto_named_mlp_alternates_column_and_row():
    trainer, data = communication.setup("dense12", SMALL, MLP_SIZES)
    found = communication.step_collectives(trainer, data)
    report = describe(found)
    moved = [dims for c in found for _, dims in c.shapes]
    assert moved.count((MLP_SIZES.batch, MLP_SIZES.width)) == 10, report  # 5 forward + 5 backward
    assert moved.count((MLP_SIZES.batch, MLP_SIZES.classes)) == 1, report
    assert total_bytes(found) <= 1.1 * communication.ideal("dense12", SMALL, MLP_SIZES)["bytes"]
    specs = dict(zip(flatten(trainer.runtime.abstract[0])[0],
                     jax.tree.leaves(trainer.runtime.specs[0],
                                     is_leaf=lambda x: isinstance(x, P))))
    assert [specs[f"Dense_{i}/kernel"] for i in range(12)] == \
        [P(None, "model"), P("model")] * 6


def test_contiguous_qkv_kernel_is_left_whole_and_said():
    # GPT-2's layout: one (hidden, 3 * hidden) kernel cut into q|k|v. No split of it keeps
    # a head's q, k and v together, so it stays whole, with the projection after it, and
    # the Trainer says so at init, in placement(), with the fix.
    trainer, data = communication.setup("gpt2_layout", SMALL)
    with pytest.warns(UserWarning, match="not split over the model axis") as caught:
        trainer.init(data)
    text = str(caught[0].message)
    for layer in (0, 1):
        assert f"_Gpt2Block_{layer}/Dense_0/kernel (64, 192): its output is sliced" in text
        assert f"_Gpt2Block_{layer}/Dense_1/kernel (64, 64): it reads " \
            f"_Gpt2Block_{layer}/Dense_0/kernel" in text
    assert "lay the kernel out per head" in text
    plan = trainer.placement()
    assert "left whole over the model axis (4):" in plan and "lay the kernel out" in plan
    detail = communication.memory_detail(trainer)
    assert detail["param_bytes_over_ideal"] > 1.4  # what staying whole costs in memory
