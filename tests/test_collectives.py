"""Derived specs give Megatron-style communication: counted in the compiled HLO.

Parameters are placed with ``shardings(mesh, derive_specs(...))`` on a 4-way ``model``
mesh, the input is replicated, and the compiled (SPMD-partitioned) HLO is searched for
collectives. A column -> row pair must cost exactly one all-reduce and no all-gather.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from redray.sharding import derive_specs, flatten, make_mesh, shardings

B, T, D, H, F = 2, 8, 64, 4, 256

_COLLECTIVES = {
    "all-gather": re.compile(r" all-gather(-start)?\("),
    "all-reduce": re.compile(r" all-reduce(-start)?\("),
    "all-to-all": re.compile(r"all-to-all(-start)?\("),
    "collective-permute": re.compile(r"collective-permute(-start)?\("),
    "reduce-scatter": re.compile(r"reduce-scatter(-start)?\("),
}


def collectives(hlo: str) -> dict[str, list[str]]:
    """Lines of the compiled HLO holding each kind of collective."""
    found = {k: [] for k in _COLLECTIVES}
    for line in hlo.splitlines():
        for kind, rx in _COLLECTIVES.items():
            if rx.search(line):
                found[kind].append(line.strip())
    return found


def describe(found) -> str:
    out = []
    for kind, lines in found.items():
        out.append(f"{kind}: {len(lines)}")
        out.extend(f"    {l[:300]}" for l in lines)
    return "\n".join(out)


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
    report = describe(found)
    assert len(found["all-gather"]) == 0, report
    assert len(found["all-reduce"]) == 1, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert len(found[kind]) == 0, report


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
        split = lambda y: y.reshape(b, t, H, D // H)
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
    report = describe(found)
    assert len(found["all-gather"]) == 0, report
    # one after the attention output projection, one after the MLP's row layer
    assert len(found["all-reduce"]) == 2, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert len(found[kind]) == 0, report


def compile_train_step(model, x, mesh):
    """HLO of one SGD step (value_and_grad + update) with params placed by derived specs."""
    graphdef, state = nnx.split(model)
    loss = lambda st, a: jnp.mean(nnx.merge(graphdef, st)(a) ** 2)
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
    report = describe(found)
    assert len(found["all-gather"]) == 0, report
    assert len(found["all-reduce"]) == 1, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert len(found[kind]) == 0, report


def test_transformer_block_train_step_megatron_collectives():
    # Megatron's f/g pair per sublayer: forward all-reduce after o_proj and fc2, backward
    # all-reduce of the gradient reaching ln_2's output (from fc1) and ln_1's output
    # (from q/k/v; XLA:CPU emits the three partial gradients as one tuple all-reduce).
    found = collectives(compile_train_step(Block(nnx.Rngs(0)), jnp.ones((B, T, D)),
                                           make_mesh(model_axis=4)))
    report = describe(found)
    assert len(found["all-gather"]) == 0, report
    assert len(found["all-reduce"]) == 4, report
    for kind in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert len(found[kind]) == 0, report


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
    assert len(found["all-gather"]) >= 1, describe(found)
    assert len(found["all-reduce"]) == 0, describe(found)
