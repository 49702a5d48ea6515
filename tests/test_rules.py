"""Exact tensor-parallel specs derived from the real dataflow of common Flax blocks.

Every block is a small but real Flax module (NNX, and Linen for the auto-named MLP)
whose parameter tree and forward dataflow mirror the Hugging Face architecture it is
named after. Each test writes out the expected PartitionSpec of *every* parameter,
following the rules in ``redray/sharding/rules.py``:

* column (output dim split) for a layer fed by nothing split; row (input dim split)
  for a layer fed only by column layers;
* attention: Q/K/V column along heads, output projection row;
* lookups (embeddings) split along the vocabulary (indexed) dim; one added to a larger
  lookup (positions) stays whole; one added to head-split scores splits its heads;
* a dimension the layer's output is sliced along (the Q/K/V axis of a fused kernel) is
  never split;
* column layer at the end of the graph with out < in (classifier head): replicated;
* biases / scales on a column layer's output split with it, everything else replicated;
* first divisible dim in the parameter's own order, else replicated;
* ``fsdp``: largest remaining divisible dim; user rules win.

Specs drop trailing Nones: P(None, 'model') is a column kernel, P('model') a row one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

from redray.sharding import derive_specs, flatten, format_placement, make_mesh, placement

B, T = 2, 8          # batch, sequence
D, H = 64, 4         # hidden, heads
HD = D // H          # head dim
V = 128              # vocab
F = 256              # MLP width

COL = P(None, "model")   # 2-D kernel split on its output dim
ROW = P("model")         # 2-D kernel split on its input dim / a split vector
REP = P()


# --------------------------------------------------------------------------- helpers

def spec_dict(tree, specs) -> dict[str, P]:
    paths, _, _ = flatten(tree)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(paths) == len(leaves)
    return dict(zip(paths, leaves))


def nnx_specs(model, *args, mesh=None, rules=()):
    """derive_specs for an NNX module whose __call__ takes ``args``; path -> spec."""
    mesh = mesh if mesh is not None else make_mesh(model_axis=4)
    graphdef, state = nnx.split(model)

    def fn(st, *a):
        out = nnx.merge(graphdef, st)(*a)
        return sum(jnp.sum(o) for o in jax.tree.leaves(out))

    specs = derive_specs(state, mesh, fn, args, rules=rules)
    return spec_dict(state, specs), state, specs


def linen_specs(module, *args, mesh=None, rules=()):
    mesh = mesh if mesh is not None else make_mesh(model_axis=4)
    params = module.init(jax.random.key(0), *args)["params"]
    def fn(p, *a):
        return module.apply({"params": p}, *a).sum()
    specs = derive_specs(params, mesh, fn, args, rules=rules)
    return spec_dict(params, specs), params, specs


def assert_specs(got: dict[str, P], expected: dict[str, P]):
    """Exact match of every parameter's spec, with a readable diff on failure."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = {p: (got[p], expected[p]) for p in expected if p in got and got[p] != expected[p]}
    lines = []
    if missing:
        lines.append(f"expected paths the model lacks: {missing}")
    if extra:
        lines.append(f"model paths without an expectation: {extra}")
    for p, (g, e) in sorted(wrong.items()):
        lines.append(f"  {p}: got {g}, expected {e}")
    assert not lines, "spec mismatch:\n" + "\n".join(lines)


def tokens(n=T, vocab=V):
    return jnp.arange(B * n, dtype=jnp.int32).reshape(B, n) % vocab


def causal(scores):
    n = scores.shape[-1]
    mask = jnp.tril(jnp.ones((n, n), bool))
    return jnp.where(mask, scores, jnp.finfo(scores.dtype).min)


def mha(q, k, v, mask=True, bias=None):
    """q,k,v: (B, T, H, HD) -> (B, T, H*HD)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if mask:
        s = causal(s)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return o.reshape(o.shape[0], o.shape[1], -1)


def heads(x):
    return x.reshape(x.shape[0], x.shape[1], H, -1)


# --------------------------------------------------------------------------- 1. GPT-2

class GPT2Attention(nnx.Module):
    def __init__(self, fused: str, rngs):
        if fused == "einsum":
            self.c_attn = nnx.Einsum("btd,dshk->btshk", (D, 3, H, HD), (3, H, HD), rngs=rngs)
        else:
            self.c_attn = nnx.LinearGeneral(D, (3, H, HD), rngs=rngs)
        self.c_proj = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        qkv = self.c_attn(x)                               # (B, T, 3, H, HD)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return self.c_proj(mha(q, k, v))


class GPT2MLP(nnx.Module):
    def __init__(self, rngs):
        self.c_fc = nnx.Linear(D, F, rngs=rngs)
        self.c_proj = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class GPT2Block(nnx.Module):
    def __init__(self, fused, rngs):
        self.ln_1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = GPT2Attention(fused, rngs)
        self.ln_2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = GPT2MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    def __init__(self, fused="einsum", n_layer=2, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.wte = nnx.Embed(V, D, rngs=rngs)
        self.wpe = nnx.Embed(64, D, rngs=rngs)            # 64 positions
        self.h = nnx.List([GPT2Block(fused, rngs) for _ in range(n_layer)])
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, ids):
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))            # tied LM head


@pytest.mark.parametrize("fused", ["einsum", "linear_general"])
def test_gpt2(fused):
    got, _, _ = nnx_specs(GPT2(fused), tokens())
    expected = {
        "wte/embedding": P("model"),        # vocab rows (lookup, and the tied head's output)
        "wpe/embedding": REP,               # added to wte's rows: whole (one all-reduce)
        "ln_f/scale": REP, "ln_f/bias": REP,
    }
    for i in range(2):
        expected.update({
            f"h/{i}/ln_1/scale": REP, f"h/{i}/ln_1/bias": REP,
            # fused (hidden, 3, heads, head_dim): the qkv dim (3) does not divide, heads does
            f"h/{i}/attn/c_attn/kernel": P(None, None, "model"),
            f"h/{i}/attn/c_attn/bias": P(None, "model"),          # (3, heads, head_dim)
            f"h/{i}/attn/c_proj/kernel": ROW,
            f"h/{i}/attn/c_proj/bias": REP,
            f"h/{i}/ln_2/scale": REP, f"h/{i}/ln_2/bias": REP,
            f"h/{i}/mlp/c_fc/kernel": COL,
            f"h/{i}/mlp/c_fc/bias": ROW,
            f"h/{i}/mlp/c_proj/kernel": ROW,
            f"h/{i}/mlp/c_proj/bias": REP,
        })
    assert_specs(got, expected)


class FusedBlock(nnx.Module):
    """Fused Q/K/V (hidden, 3, heads, head_dim) and gated MLP (hidden, 2, 48) kernels
    whose part axes a model axis of 3 or 2 divides: the rules must split heads and the
    MLP width instead."""

    def __init__(self, heads, rngs):
        self.heads = heads
        self.qkv = nnx.LinearGeneral(D, (3, heads, 8), use_bias=False, rngs=rngs)
        self.o = nnx.LinearGeneral((heads, 8), D, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.gate_up = nnx.LinearGeneral(D, (2, 48), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(48, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(causal(s)), v))
        gate_up = self.gate_up(x)
        return x + self.down(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1])


@pytest.mark.parametrize("model_axis", [2, 3])
def test_fused_kernels_split_heads_not_their_parts(model_axis):
    mesh = make_mesh(model_axis=model_axis, devices=jax.devices()[:model_axis])
    got, _, _ = nnx_specs(FusedBlock(6, nnx.Rngs(0)), jnp.ones((B, T, D)), mesh=mesh)
    assert_specs(got, {"qkv/kernel": P(None, None, "model"), "o/kernel": ROW,
                       "gate_up/kernel": P(None, None, "model"), "down/kernel": ROW})


def test_fused_kernel_replicated_when_only_its_parts_divide():
    # 4 heads of 8 over a model axis of 3: only the Q/K/V axis divides, and splitting it
    # would put a head's Q, K and V on different devices; whole is the honest answer
    got, _, _ = nnx_specs(FusedBlock(4, nnx.Rngs(0)), jnp.ones((B, T, D)),
                          mesh=make_mesh(model_axis=3, devices=jax.devices()[:3]))
    assert got["qkv/kernel"] == REP, got


# --------------------------------------------------------------------------- 2. LLaMA

def rotary(x):
    """Rotary position embedding on (B, T, H, HD); parameter-free."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (jnp.arange(half) / half))
    ang = jnp.arange(x.shape[1])[:, None] * freqs[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class LlamaAttention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        q = rotary(heads(self.q_proj(x)))
        k = rotary(heads(self.k_proj(x)))
        v = heads(self.v_proj(x))
        return self.o_proj(mha(q, k, v))


class LlamaMLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(F, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
    def __init__(self, rngs):
        self.input_layernorm = nnx.RMSNorm(D, rngs=rngs)
        self.self_attn = LlamaAttention(rngs)
        self.post_attention_layernorm = nnx.RMSNorm(D, rngs=rngs)
        self.mlp = LlamaMLP(rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nnx.Module):
    def __init__(self, n_layer=2, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed_tokens = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([LlamaLayer(rngs) for _ in range(n_layer)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)   # untied

    def __call__(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def llama_expected(col=COL, row=ROW, vec=REP, embed=P("model"), head=COL):
    expected = {"embed_tokens/embedding": embed, "norm/scale": vec, "lm_head/kernel": head}
    for i in range(2):
        p = f"layers/{i}"
        expected.update({
            f"{p}/input_layernorm/scale": vec,
            f"{p}/self_attn/q_proj/kernel": col,
            f"{p}/self_attn/k_proj/kernel": col,
            f"{p}/self_attn/v_proj/kernel": col,
            f"{p}/self_attn/o_proj/kernel": row,
            f"{p}/post_attention_layernorm/scale": vec,
            f"{p}/mlp/gate_proj/kernel": col,
            f"{p}/mlp/up_proj/kernel": col,
            f"{p}/mlp/down_proj/kernel": row,
        })
    return expected


def test_llama():
    got, _, _ = nnx_specs(Llama(), tokens())
    # lm_head (64, 128): a column layer at the end, but its output (vocab) is larger than
    # its input, so it is not a "classifier head": column along the vocabulary.
    assert_specs(got, llama_expected())


# ------------------------------------------------------------- linear attention

@pytest.mark.parametrize("form", ["scan", "parallel"])
def test_a_linear_attention_splits_by_heads_with_its_decays_norms_and_convolutions(form):
    """A linear attention has no softmax(q.k): its heads are found by where its values
    run. q, k, v, the decay's and the gate's projections are column layers; the output
    projection row; each per-head or per-channel parameter (the decay's rate ``s1``
    through ``-exp``, the norm's (heads, head dim) scale, each (width, dim) convolution
    kernel) splits with the heads it meets, however deep in the layer."""
    from tiny import LinearLM

    got, _, _ = nnx_specs(LinearLM(nnx.Rngs(0), V, D, H, layers=1, mlp=F, form=form),
                          tokens())
    expected = {"e/embedding": ROW, "n1/0/scale": REP, "n2/0/scale": REP, "n/scale": REP,
                "f1/0/kernel": COL, "f1/0/bias": ROW, "f2/0/kernel": ROW, "f2/0/bias": REP,
                "h/kernel": COL, "m/0/p4/bias": ROW, "m/0/p6/kernel": ROW,
                "m/0/s1": ROW, "m/0/s2": ROW}
    expected.update({f"m/0/p{i}/kernel": COL for i in (1, 2, 3, 4, 5)})
    expected.update({f"m/0/w{i}": COL for i in (1, 2, 3)})
    assert_specs(got, expected)
    # two heads on a model axis of 4: the heads' parameters cannot follow (2 % 4), the
    # projections (64 wide) still split
    got, _, _ = nnx_specs(LinearLM(nnx.Rngs(0), V, D, 2, layers=1, mlp=F, form=form),
                          tokens())
    assert got["m/0/s1"] == REP and got["m/0/s2"] == REP and got["m/0/w1"] == COL


# --------------------------------------------------------------------------- 3. OPT

class OPTAttention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(D, D, rngs=rngs)
        self.k_proj = nnx.Linear(D, D, rngs=rngs)
        self.v_proj = nnx.Linear(D, D, rngs=rngs)
        self.out_proj = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        q = heads(self.q_proj(x) * HD ** -0.5)
        return self.out_proj(mha(q, heads(self.k_proj(x)), heads(self.v_proj(x))))


class OPTLayer(nnx.Module):
    def __init__(self, rngs):
        self.self_attn_layer_norm = nnx.LayerNorm(D, rngs=rngs)
        self.self_attn = OPTAttention(rngs)
        self.final_layer_norm = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, F, rngs=rngs)
        self.fc2 = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(jax.nn.relu(self.fc1(self.final_layer_norm(x))))


class OPT(nnx.Module):
    def __init__(self, n_layer=2, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed_tokens = nnx.Embed(V, D, rngs=rngs)
        self.embed_positions = nnx.Embed(64 + 2, D, rngs=rngs)   # OPT's offset of 2: 66 rows
        self.layers = nnx.List([OPTLayer(rngs) for _ in range(n_layer)])
        self.final_layer_norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, ids):
        x = self.embed_tokens(ids) + self.embed_positions(jnp.arange(ids.shape[1]) + 2)
        for layer in self.layers:
            x = layer(x)
        return self.embed_tokens.attend(self.final_layer_norm(x))   # tied head


def test_opt():
    got, _, _ = nnx_specs(OPT(), tokens())
    expected = {
        "embed_tokens/embedding": P("model"),
        "embed_positions/embedding": REP,       # 66 rows do not divide by 4: replicated
        "final_layer_norm/scale": REP, "final_layer_norm/bias": REP,
    }
    for i in range(2):
        p = f"layers/{i}"
        expected.update({
            f"{p}/self_attn_layer_norm/scale": REP, f"{p}/self_attn_layer_norm/bias": REP,
            f"{p}/self_attn/q_proj/kernel": COL, f"{p}/self_attn/q_proj/bias": ROW,
            f"{p}/self_attn/k_proj/kernel": COL, f"{p}/self_attn/k_proj/bias": ROW,
            f"{p}/self_attn/v_proj/kernel": COL, f"{p}/self_attn/v_proj/bias": ROW,
            f"{p}/self_attn/out_proj/kernel": ROW, f"{p}/self_attn/out_proj/bias": REP,
            f"{p}/final_layer_norm/scale": REP, f"{p}/final_layer_norm/bias": REP,
            f"{p}/fc1/kernel": COL, f"{p}/fc1/bias": ROW,
            f"{p}/fc2/kernel": ROW, f"{p}/fc2/bias": REP,
        })
    assert_specs(got, expected)


# --------------------------------------------------------------------------- 4. GPT-J

class GPTJAttention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.out_proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        q = rotary(heads(self.q_proj(x)))
        k = rotary(heads(self.k_proj(x)))
        return self.out_proj(mha(q, k, heads(self.v_proj(x))))


class GPTJMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc_in = nnx.Linear(D, F, rngs=rngs)
        self.fc_out = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class GPTJBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln_1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = GPTJAttention(rngs)
        self.mlp = GPTJMLP(rngs)

    def __call__(self, x):
        h = self.ln_1(x)                          # attention and MLP read the same h
        return x + self.attn(h) + self.mlp(h)


class GPTJ(nnx.Module):
    def __init__(self, n_layer=2, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.wte = nnx.Embed(V, D, rngs=rngs)
        self.h = nnx.List([GPTJBlock(rngs) for _ in range(n_layer)])
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, rngs=rngs)       # with bias

    def __call__(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def test_gptj():
    got, _, _ = nnx_specs(GPTJ(), tokens())
    expected = {
        "wte/embedding": P("model"),
        "ln_f/scale": REP, "ln_f/bias": REP,
        "lm_head/kernel": COL, "lm_head/bias": ROW,      # vocab split, bias with it
    }
    for i in range(2):
        p = f"h/{i}"
        expected.update({
            f"{p}/ln_1/scale": REP, f"{p}/ln_1/bias": REP,
            f"{p}/attn/q_proj/kernel": COL,
            f"{p}/attn/k_proj/kernel": COL,
            f"{p}/attn/v_proj/kernel": COL,
            f"{p}/attn/out_proj/kernel": ROW,
            f"{p}/mlp/fc_in/kernel": COL, f"{p}/mlp/fc_in/bias": ROW,
            f"{p}/mlp/fc_out/kernel": ROW, f"{p}/mlp/fc_out/bias": REP,
        })
    assert_specs(got, expected)


# --------------------------------------------------------------------------- 5. T5

N_BUCKETS = 32


def relative_buckets(q_len, k_len, bidirectional, num_buckets=N_BUCKETS, max_distance=128):
    """T5's relative position buckets (integer arithmetic only)."""
    rel = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
    buckets = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).astype(jnp.int32) * num_buckets
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    large = max_exact + (jnp.log(jnp.maximum(rel, 1) / max_exact)
                         / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(rel < max_exact, rel, large)


class T5Attention(nnx.Module):
    def __init__(self, rngs, has_relative_bias=False, bidirectional=True):
        self.q = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.bidirectional = bidirectional
        if has_relative_bias:
            self.relative_attention_bias = nnx.Embed(N_BUCKETS, H, rngs=rngs)

    def __call__(self, x, kv=None, causal_mask=False):
        kv = x if kv is None else kv
        bias = None
        if hasattr(self, "relative_attention_bias"):
            buckets = relative_buckets(x.shape[1], kv.shape[1], self.bidirectional)
            bias = self.relative_attention_bias(buckets).transpose(2, 0, 1)[None]  # (1,H,q,k)
        q, k, v = heads(self.q(x)), heads(self.k(kv)), heads(self.v(kv))
        return self.o(mha(q, k, v, mask=causal_mask, bias=bias))


class T5FF(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(F, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.wo(jax.nn.relu(self.wi(x)))


class T5EncoderBlock(nnx.Module):
    def __init__(self, rngs):
        self.SelfAttention = T5Attention(rngs, has_relative_bias=True, bidirectional=True)
        self.layer_norm_0 = nnx.RMSNorm(D, rngs=rngs)
        self.DenseReluDense = T5FF(rngs)
        self.layer_norm_1 = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, x):
        x = x + self.SelfAttention(self.layer_norm_0(x))
        return x + self.DenseReluDense(self.layer_norm_1(x))


class T5DecoderBlock(nnx.Module):
    def __init__(self, rngs):
        self.SelfAttention = T5Attention(rngs, has_relative_bias=True, bidirectional=False)
        self.layer_norm_0 = nnx.RMSNorm(D, rngs=rngs)
        self.EncDecAttention = T5Attention(rngs)
        self.layer_norm_1 = nnx.RMSNorm(D, rngs=rngs)
        self.DenseReluDense = T5FF(rngs)
        self.layer_norm_2 = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, x, enc):
        x = x + self.SelfAttention(self.layer_norm_0(x), causal_mask=True)
        x = x + self.EncDecAttention(self.layer_norm_1(x), kv=enc)    # k, v read the encoder
        return x + self.DenseReluDense(self.layer_norm_2(x))


class T5(nnx.Module):
    def __init__(self, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.shared = nnx.Embed(V, D, rngs=rngs)
        self.encoder = T5EncoderBlock(rngs)
        self.encoder_final_layer_norm = nnx.RMSNorm(D, rngs=rngs)
        self.decoder = T5DecoderBlock(rngs)
        self.decoder_final_layer_norm = nnx.RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, enc_ids, dec_ids):
        enc = self.encoder_final_layer_norm(self.encoder(self.shared(enc_ids)))
        x = self.decoder(self.shared(dec_ids), enc)
        return self.lm_head(self.decoder_final_layer_norm(x))


def t5_expected():
    expected = {
        "shared/embedding": P("model"),
        "encoder_final_layer_norm/scale": REP,
        "decoder_final_layer_norm/scale": REP,
        "lm_head/kernel": COL,
    }
    attn = {"q/kernel": COL, "k/kernel": COL, "v/kernel": COL, "o/kernel": ROW}
    for blk, norms, attns in (("encoder", 2, ("SelfAttention",)),
                              ("decoder", 3, ("SelfAttention", "EncDecAttention"))):
        for a in attns:
            expected.update({f"{blk}/{a}/{k}": s for k, s in attn.items()})
        # (32 buckets, 4 heads) table indexed by bucket, added to head-split scores: it
        # splits its heads, so adding it is local (a bucket split would be partial sums)
        expected[f"{blk}/SelfAttention/relative_attention_bias/embedding"] = P(None, "model")
        expected.update({f"{blk}/layer_norm_{j}/scale": REP for j in range(norms)})
        expected[f"{blk}/DenseReluDense/wi/kernel"] = COL
        expected[f"{blk}/DenseReluDense/wo/kernel"] = ROW
    return expected


def test_t5():
    got, _, _ = nnx_specs(T5(), tokens(), tokens(T // 2))
    assert_specs(got, t5_expected())


# --------------------------------------------------------------------------- 6. Dense_0..Dense_N

class LinenChain(nn.Module):
    n: int = 12

    @nn.compact
    def __call__(self, x):
        for i in range(self.n):          # auto-named Dense_0, Dense_1, ..., Dense_{n-1}
            x = nn.Dense(D)(x)
            if i < self.n - 1:
                x = nn.relu(x)
        return x


@pytest.mark.parametrize("n", [12, 11])
def test_linen_dense_chain_numeric_order(n):
    # redco (redco/deployers/partition_utils.py, get_sharding_rules) iterates
    # `sorted(valid_mp_dims.keys())` -- alphabetical: Dense_0, Dense_1, Dense_10,
    # Dense_11, Dense_2, ..., Dense_9 -- and alternates column/row along that order.
    # With exactly 12 layers that order happens to keep every layer's parity (Dense_10
    # lands on an even slot, Dense_11 on an odd one) so it gets the same answer by luck;
    # with 11 layers it goes Dense_0 col, Dense_1 row, Dense_10 col, Dense_2 *row*,
    # Dense_3 *col*, ... i.e. wrong from Dense_2 on. The dataflow order must be numeric
    # in both cases.
    got, _, _ = linen_specs(LinenChain(n), jnp.ones((B, D)))
    expected = {}
    for i in range(n):
        column = i % 2 == 0
        expected[f"Dense_{i}/kernel"] = COL if column else ROW
        expected[f"Dense_{i}/bias"] = ROW if column else REP
    assert_specs(got, expected)


# --------------------------------------------------------------------------- 7. MLP with a head

class MLPHead(nnx.Module):
    def __init__(self, rngs):
        self.fc_in = nnx.Linear(256, 512, rngs=rngs)
        self.fc_mid = nnx.Linear(512, 512, rngs=rngs)
        self.fc_out = nnx.Linear(512, 16, rngs=rngs)

    def __call__(self, x):
        return self.fc_out(jax.nn.relu(self.fc_mid(jax.nn.relu(self.fc_in(x)))))


def test_mlp_with_classifier_head():
    got, _, _ = nnx_specs(MLPHead(nnx.Rngs(0)), jnp.ones((B, 256)))
    assert_specs(got, {
        "fc_in/kernel": COL, "fc_in/bias": ROW,
        "fc_mid/kernel": ROW, "fc_mid/bias": REP,
        # fed by a row layer -> a column candidate, but it ends the graph and shrinks
        # 512 -> 16: a classifier head, replicated.
        "fc_out/kernel": REP, "fc_out/bias": REP,
    })


class LinenMLPHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512, name="fc_in")(x))
        x = nn.relu(nn.Dense(512, name="fc_mid")(x))
        return nn.Dense(16, name="fc_out")(x)


def test_linen_mlp_with_classifier_head():
    got, _, _ = linen_specs(LinenMLPHead(), jnp.ones((B, 256)))
    assert_specs(got, {
        "fc_in/kernel": COL, "fc_in/bias": ROW,
        "fc_mid/kernel": ROW, "fc_mid/bias": REP,
        "fc_out/kernel": REP, "fc_out/bias": REP,
    })


# --------------------------------------------------------------------------- 8. CNN

class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(4 * 4 * 64, 128, rngs=rngs)
        self.dense2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):                                  # (B, 8, 8, 1)
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))        # (B, 4, 4, 64)
        x = x.reshape(x.shape[0], -1)
        return self.dense2(jax.nn.relu(self.dense1(x)))


def test_cnn():
    got, _, _ = nnx_specs(CNN(nnx.Rngs(0)), jnp.ones((B, 8, 8, 1)))
    assert_specs(got, {
        "conv1/kernel": P(None, None, None, "model"),   # HWIO: out channels
        "conv1/bias": P("model"),
        "conv2/kernel": P(None, None, "model"),         # in channels
        "conv2/bias": REP,
        "dense1/kernel": COL, "dense1/bias": ROW,
        # dense2 (128 -> 10) is fed only by the column layer dense1, so Rule 1 makes it
        # *row* parallel (one all-reduce of the (B, 10) logits). The docstring's
        # "classifier head stays replicated" clause is for a *column* layer at the end
        # of the graph (see fc_out in test_mlp_with_classifier_head), which dense2 is not.
        "dense2/kernel": ROW, "dense2/bias": REP,
    })


# --------------------------------------------------------------------------- fsdp / combined

def test_fsdp_only_largest_divisible_dim():
    mesh = make_mesh(fsdp_axis=4)                 # model 1: no trace, fsdp only
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1,
                                "model": 1}
    got, _, _ = nnx_specs(Llama(), tokens(), mesh=mesh)
    f = P("fsdp")
    # vectors (norm scales, biases) stay whole: a gather each would cost more than they hold
    assert_specs(got, llama_expected(col=P(None, "fsdp"), row=f, vec=REP, embed=f,
                                     head=P(None, "fsdp")) | {
        # square kernels: the first of the tied largest dims
        **{f"layers/{i}/self_attn/{n}/kernel": f
           for i in range(2) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
    })
    got, _, _ = nnx_specs(OPT(), tokens(), mesh=mesh)
    assert got["embed_positions/embedding"] == P(None, "fsdp")   # 66 rows: the 64 dim
    assert got["layers/0/fc1/kernel"] == P(None, "fsdp")          # (64, 256)
    assert got["layers/0/fc2/bias"] == REP


def test_model_and_fsdp_combined_llama():
    mesh = make_mesh(model_axis=2, fsdp_axis=2)
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1,
                                "model": 2}
    got, _, _ = nnx_specs(Llama(), tokens(), mesh=mesh)
    expected = {
        "embed_tokens/embedding": P("model", "fsdp"),
        "norm/scale": REP,
        "lm_head/kernel": P("fsdp", "model"),
    }
    for i in range(2):
        p = f"layers/{i}"
        expected.update({
            f"{p}/input_layernorm/scale": REP,
            f"{p}/self_attn/q_proj/kernel": P("fsdp", "model"),
            f"{p}/self_attn/k_proj/kernel": P("fsdp", "model"),
            f"{p}/self_attn/v_proj/kernel": P("fsdp", "model"),
            f"{p}/self_attn/o_proj/kernel": P("model", "fsdp"),
            f"{p}/post_attention_layernorm/scale": REP,
            f"{p}/mlp/gate_proj/kernel": P("fsdp", "model"),
            f"{p}/mlp/up_proj/kernel": P("fsdp", "model"),
            f"{p}/mlp/down_proj/kernel": P("model", "fsdp"),
        })
    assert_specs(got, expected)


def test_data_axis_does_not_split_parameters():
    mesh = make_mesh(data_axis=2, model_axis=2)
    got, _, _ = nnx_specs(MLPHead(nnx.Rngs(0)), jnp.ones((B, 256)), mesh=mesh)
    assert_specs(got, {
        "fc_in/kernel": COL, "fc_in/bias": ROW,
        "fc_mid/kernel": ROW, "fc_mid/bias": REP,
        "fc_out/kernel": REP, "fc_out/bias": REP,
    })


# --------------------------------------------------------------------------- user rules

def test_user_rule_overrides_one_parameter():
    rules = [(r"^lm_head/kernel$", P("model", None)),
             (r"layers/1/mlp/down_proj", P())]
    got, _, _ = nnx_specs(Llama(), tokens(), rules=rules)
    expected = llama_expected()
    expected["lm_head/kernel"] = P("model", None)        # kept exactly as the user wrote it
    expected["layers/1/mlp/down_proj/kernel"] = REP
    assert_specs(got, expected)


def test_user_rules_first_match_wins_and_none_means_replicated():
    rules = [(r"q_proj/kernel", None), (r"proj/kernel", P("model"))]
    got, _, _ = nnx_specs(Llama(), tokens(), rules=rules)
    expected = llama_expected()
    for i in range(2):
        for n in ("self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
                  "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj"):
            expected[f"layers/{i}/{n}/kernel"] = P("model")
        expected[f"layers/{i}/self_attn/q_proj/kernel"] = REP
    assert_specs(got, expected)


def test_user_rule_matching_nothing_warns():
    with pytest.warns(UserWarning, match="matched no parameter"):
        nnx_specs(MLPHead(nnx.Rngs(0)), jnp.ones((B, 256)), rules=[(r"no_such_layer", P())])


def test_bad_user_rule_unknown_axis():
    with pytest.raises(ValueError) as e:
        nnx_specs(Llama(), tokens(), rules=[(r"q_proj/kernel$", P(None, "tensor"))])
    msg = str(e.value)
    assert "q_proj/kernel$" in msg and "'tensor'" in msg and "model" in msg


def test_bad_user_rule_non_dividing_split():
    with pytest.raises(ValueError) as e:
        nnx_specs(OPT(), tokens(), rules=[(r"embed_positions", P("model"))])
    msg = str(e.value)
    assert "embed_positions/embedding" in msg and "66" in msg and "does not divide" in msg


def test_bad_user_rule_too_many_entries():
    with pytest.raises(ValueError, match="norm/scale"):
        nnx_specs(Llama(), tokens(), rules=[(r"^norm/scale$", P("model", None))])


@pytest.mark.parametrize("rule", [("only_a_regex",), (r"x", P(), "extra"), (3, P())])
def test_malformed_rule(rule):
    with pytest.raises(ValueError, match="rule #0"):
        nnx_specs(MLPHead(nnx.Rngs(0)), jnp.ones((B, 256)), rules=[rule])


def test_invalid_regex():
    with pytest.raises(ValueError, match="not a valid regex"):
        nnx_specs(MLPHead(nnx.Rngs(0)), jnp.ones((B, 256)), rules=[(r"fc_(in", P())])


# --------------------------------------------------------------------------- non-dividing dims

class Odd(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, 66, rngs=rngs)
        self.fc2 = nnx.Linear(66, V, rngs=rngs)
        self.fc3 = nnx.Linear(V, D, rngs=rngs)

    def __call__(self, x):
        return self.fc3(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(x)))))


def test_non_dividing_dim_falls_back_to_replication():
    got, _, _ = nnx_specs(Odd(nnx.Rngs(0)), jnp.ones((B, D)))
    assert_specs(got, {
        "fc1/kernel": REP, "fc1/bias": REP,      # 66 outputs: no split, no error
        "fc2/kernel": COL, "fc2/bias": ROW,      # its input is unsplit: column again
        "fc3/kernel": ROW, "fc3/bias": REP,
    })


class Llama66(nnx.Module):
    """A LLaMA layer with hidden 66 (6 heads of 11): no kernel dim divides by 4."""

    def __init__(self, rngs):
        d = 66
        self.embed_tokens = nnx.Embed(V, d, rngs=rngs)
        self.q_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.up_proj = nnx.Linear(d, 66, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(66, d, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed_tokens(ids)
        h = self.norm(x)
        def sh(t):
            return t.reshape(t.shape[0], t.shape[1], 6, 11)
        x = x + self.o_proj(mha(sh(self.q_proj(h)), sh(self.k_proj(h)), sh(self.v_proj(h))))
        return x + self.down_proj(jax.nn.silu(self.up_proj(x)))


def test_hidden_66_replicates_without_error():
    got, _, _ = nnx_specs(Llama66(nnx.Rngs(0)), tokens())
    assert_specs(got, {
        "embed_tokens/embedding": P("model"),     # 128 vocab rows still divide
        "q_proj/kernel": REP, "k_proj/kernel": REP, "v_proj/kernel": REP,
        "o_proj/kernel": REP, "norm/scale": REP,
        "up_proj/kernel": REP, "down_proj/kernel": REP,
    })


# --------------------------------------------------------------------------- mesh errors

def test_make_mesh_model_axis_not_dividing():
    with pytest.raises(ValueError, match="does not divide"):
        make_mesh(model_axis=3)


def test_make_mesh_product_not_dividing():
    with pytest.raises(ValueError, match="does not divide"):
        make_mesh(model_axis=4, fsdp_axis=2)


@pytest.mark.parametrize("kwargs", [dict(model_axis=0), dict(fsdp_axis=-2),
                                    dict(model_axis=True), dict(model_axis=2.0)])
def test_make_mesh_invalid_size(kwargs):
    with pytest.raises(ValueError, match="not a valid axis size"):
        make_mesh(**kwargs)


def test_make_mesh_two_auto_axes():
    with pytest.raises(ValueError, match="only one axis may be 'auto'"):
        make_mesh(data_axis="auto", model_axis="auto")


def test_make_mesh_not_covering_all_devices():
    with pytest.raises(ValueError, match="make one axis 'auto'"):
        make_mesh(data_axis=1, model_axis=2)


def test_make_mesh_shapes():
    assert dict(make_mesh(model_axis=4).shape) == {"stage": 1, "data": 1, "fsdp": 1,
                                                   "expert": 1, "context": 1, "model": 4}
    assert dict(make_mesh().shape) == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1,
                                       "context": 1, "model": 1}
    assert dict(make_mesh(data_axis=1, fsdp_axis="auto", model_axis=2).shape) == {
        "stage": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1, "model": 2}
    # model-parallel peers are neighbours in device order
    mesh = make_mesh(data_axis=2, model_axis=2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.reshape(2, 2).tolist() == [[0, 1], [2, 3]]


# --------------------------------------------------------------------------- plan

def test_plan_bytes_per_device():
    mesh = make_mesh(model_axis=4)
    _, state, specs = nnx_specs(MLPHead(nnx.Rngs(0)), jnp.ones((B, 256)), mesh=mesh)
    rows = {r.path: r for r in placement(state, specs, mesh)}
    assert rows["fc_in/kernel"].bytes_per_device == 256 * 512 * 4 // 4
    assert rows["fc_in/bias"].bytes_per_device == 512 * 4 // 4
    assert rows["fc_out/kernel"].bytes_per_device == 512 * 16 * 4
    text = format_placement(list(rows.values()), mesh)
    assert "fc_mid/kernel" in text and "model=4" in text


# --------------------------------------------------------------------------- residual stream

class ProjectedResidual(nnx.Module):
    """OPT-350m's shape: a projection writes the residual stream that blocks add to."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, 32, rngs=rngs)
        self.proj_in = nnx.Linear(32, D, use_bias=False, rngs=rngs)
        self.fc1 = nnx.Linear(D, F, rngs=rngs)
        self.fc2 = nnx.Linear(F, D, rngs=rngs)
        self.fc1b = nnx.Linear(D, F, rngs=rngs)
        self.fc2b = nnx.Linear(F, D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.proj_in(self.embed(ids))
        x = x + self.fc2(jax.nn.relu(self.fc1(x)))
        x = x + self.fc2b(jax.nn.relu(self.fc1b(x)))
        return self.head(x)


def test_a_layer_writing_the_residual_stream_stays_replicated():
    # proj_in's output reaches fc1 and, around fc1/fc2 through the residual add, fc1b
    # and the head: splitting it would leave the whole stream split and flip every
    # block's roles. It stays replicated; the blocks pair up as usual.
    got, _, _ = nnx_specs(ProjectedResidual(nnx.Rngs(0)), tokens())
    assert_specs(got, {
        "embed/embedding": P("model"), "proj_in/kernel": REP,
        "fc1/kernel": COL, "fc1/bias": ROW, "fc2/kernel": ROW, "fc2/bias": REP,
        "fc1b/kernel": COL, "fc1b/bias": ROW, "fc2b/kernel": ROW, "fc2b/bias": REP,
        "head/kernel": COL,
    })


def test_hybrid_mesh_keeps_the_model_axis_inside_a_host():
    from redray.sharding.parallelism import hybrid_shapes

    # (stage, data, fsdp, expert, context, model); 4 hosts x 8 GPUs, model 8: data across hosts,
    # model inside
    assert hybrid_shapes((1, 4, 1, 1, 1, 8), 4, 8) == ((1, 4, 1, 1, 1, 1), (1, 1, 1, 1, 1, 8))
    # model 4, fsdp 8 of 32 devices: fsdp 2 inside each host, 4 across
    assert hybrid_shapes((1, 1, 8, 1, 1, 4), 4, 8) == ((1, 1, 4, 1, 1, 1), (1, 1, 2, 1, 1, 4))
    # data 2 x fsdp 2 x model 2 on 2 hosts of 4: one data replica per host
    assert hybrid_shapes((1, 2, 2, 1, 1, 2), 2, 4) == ((1, 2, 1, 1, 1, 1), (1, 1, 2, 1, 1, 2))
    assert hybrid_shapes((1, 1, 1, 1, 1, 16), 2, 8) is None  # model needs 2 hosts
    # expert 4 x model 2 stays inside a host; fsdp goes across
    assert hybrid_shapes((1, 1, 2, 4, 1, 2), 2, 8) == ((1, 1, 2, 1, 1, 1), (1, 1, 1, 4, 1, 2))
    # stage 2 x data 2 x model 2 on 2 hosts of 4: the stages across, data inside
    assert hybrid_shapes((2, 2, 1, 1, 1, 2), 2, 4) == ((2, 1, 1, 1, 1, 1), (1, 2, 1, 1, 1, 2))
    assert hybrid_shapes((1, 1, 1, 8, 1, 2), 2, 8) is None  # experts need 2 hosts
    # a context axis inside a host as far as it fits (before fsdp), across beyond it
    assert hybrid_shapes((1, 1, 2, 1, 4, 1), 2, 4) == ((1, 1, 2, 1, 1, 1), (1, 1, 1, 1, 4, 1))
    assert hybrid_shapes((1, 1, 1, 1, 16, 8), 16, 8) == ((1, 1, 1, 1, 16, 1),
                                                         (1, 1, 1, 1, 1, 8))
    with pytest.raises(ValueError, match="a mesh shape of 5 sizes: give one per axis"):
        hybrid_shapes((1, 4, 1, 1, 8), 4, 8)  # written before the context axis


# ------------------------------------------------------------- mixtures of experts

E = 4  # experts


def _top2(probs):
    top = jax.lax.top_k(probs, 2)[0][..., -1:]
    kept = jnp.where(probs >= top, probs, 0.0)
    return kept / kept.sum(-1, keepdims=True)


class StackedMoE(nnx.Module):
    """A user's MoE MLP: experts stacked in (experts, d, f) kernels, every expert run on
    every token through einsum, combined with the top-2 router weights."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)
        self.w_gate = nnx.Param(init(rngs.params(), (E, D, F)))
        self.w_up = nnx.Param(init(rngs.params(), (E, D, F)))
        self.w_down = nnx.Param(init(rngs.params(), (E, F, D)))

    def __call__(self, x):
        weights = _top2(jax.nn.softmax(self.router(x), -1))
        gate = jnp.einsum("bsd,edf->bsef", x, self.w_gate[...])
        up = jnp.einsum("bsd,edf->bsef", x, self.w_up[...])
        y = jnp.einsum("bsef,efd->bsed", jax.nn.silu(gate) * up, self.w_down[...])
        return x + jnp.einsum("bsed,bse->bsd", y, weights)


class Expert(nnx.Module):
    def __init__(self, rngs):
        self.gate = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(F, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class ListMoE(nnx.Module):
    """A user's MoE MLP as a list of expert modules."""

    def __init__(self, rngs):
        self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)
        self.experts = nnx.List([Expert(rngs) for _ in range(E)])

    def __call__(self, x):
        weights = _top2(jax.nn.softmax(self.router(x), -1))
        return x + sum(weights[..., e, None] * expert(x) for e, expert in enumerate(self.experts))


def test_stacked_experts_are_split_inside_each_expert_and_the_router_stays_whole():
    got, _, _ = nnx_specs(StackedMoE(nnx.Rngs(0)), jnp.ones((B, T, D)))
    assert_specs(got, {"router/kernel": REP, "w_gate": P(None, None, "model"),
                       "w_up": P(None, None, "model"), "w_down": P(None, "model")})


def test_a_list_of_experts_is_split_like_mlps():
    got, _, _ = nnx_specs(ListMoE(nnx.Rngs(0)), jnp.ones((B, T, D)))
    expected = {"router/kernel": REP}
    for e in range(E):
        expected.update({f"experts/{e}/gate/kernel": COL, f"experts/{e}/up/kernel": COL,
                         f"experts/{e}/down/kernel": ROW})
    assert_specs(got, expected)


def test_an_expert_axis_splits_the_stacked_experts_and_nothing_else():
    mesh = make_mesh(expert_axis=2, model_axis=2)
    got, _, _ = nnx_specs(StackedMoE(nnx.Rngs(0)), jnp.ones((B, T, D)), mesh=mesh)
    assert_specs(got, {"router/kernel": REP, "w_gate": P("expert", None, "model"),
                       "w_up": P("expert", None, "model"), "w_down": P("expert", "model")})


class TwoStackedMoE(nnx.Module):
    """Two user MoE blocks and an LM head: the last router reaches only the head."""

    def __init__(self, rngs):
        self.blocks = nnx.List([StackedMoE(rngs) for _ in range(2)])
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_every_router_stays_whole_the_last_one_too():
    got, _, _ = nnx_specs(TwoStackedMoE(nnx.Rngs(0)), jnp.ones((B, T, D)))
    expected = {"head/kernel": COL}
    for b in range(2):
        expected.update({f"blocks/{b}/router/kernel": REP,
                         f"blocks/{b}/w_gate": P(None, None, "model"),
                         f"blocks/{b}/w_up": P(None, None, "model"),
                         f"blocks/{b}/w_down": P(None, "model")})
    assert_specs(got, expected)
