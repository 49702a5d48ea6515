"""Models written the way users and other libraries write them, for the communication cases.

None of them is laid out for redray: Linen modules with auto-named layers
(``Dense_0``...), separate Q, K and V projections, a GPT-J-style parallel-residual
block, GPT-2's contiguous q|k|v kernel, a 12-layer MLP, Google's own Gemma (the
``gemma`` package's Linen transformer) and penzai's LLaMA. Each returns a
``redray.LinenModel`` or an NNX factory plus its loss, so ``redray.Trainer`` trains it
as a user would.

The separate-Q/K/V LLaMA and the MLP live in benchmarks/_redco_models.py: redco's own
step (in its venv) compiles them too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import redray
from _lm import Sizes
from _redco_models import DenseStack, SeparateLM, attention as _attention  # noqa: F401


def _lm_loss(logits_of):
    def loss(model, batch, rng, train):
        ids = batch["ids"]
        logits = logits_of(model, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), ids[:, 1:]).mean()
    return loss


class _ParallelBlock(nn.Module):
    heads: int
    intermediate: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(d, use_bias=False)(h).reshape(b, t, self.heads, d // self.heads)
                   for _ in range(3))
        attn = nn.Dense(d, use_bias=False)(_attention(q, k, v).reshape(b, t, d))
        mlp = nn.Dense(d)(jax.nn.gelu(nn.Dense(self.intermediate)(h)))
        return x + attn + mlp


class _Gpt2Block(nn.Module):
    heads: int
    intermediate: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        qkv = nn.Dense(3 * d)(nn.LayerNorm()(x))
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads)
                   for a in jnp.split(qkv, 3, axis=-1))
        x = x + nn.Dense(d)(_attention(q, k, v).reshape(b, t, d))
        return x + nn.Dense(d)(jax.nn.gelu(nn.Dense(self.intermediate)(nn.LayerNorm()(x))))


class _Stack(nn.Module):
    """Embedding, ``s.layers`` blocks, a final LayerNorm and an LM head (tied or not)."""
    s: Sizes
    block: type
    tied: bool = False

    @nn.compact
    def __call__(self, ids):
        s = self.s
        wte = nn.Embed(s.vocab, s.hidden)
        x = wte(ids)
        for _ in range(s.layers):
            x = self.block(s.heads, s.intermediate)(x)
        x = nn.LayerNorm()(x)
        return wte.attend(x) if self.tied else nn.Dense(s.vocab)(x)


def ParallelLM(s: Sizes) -> nn.Module:
    """GPT-J's parallel residual block (attention and MLP read one normed input and are
    added), separate Q, K and V, biases on the MLP, auto-named."""
    return _Stack(s, _ParallelBlock)


def Gpt2LayoutLM(s: Sizes) -> nn.Module:
    """GPT-2's attention layout: one (hidden, 3 * hidden) kernel, q|k|v side by side,
    cut into thirds after the matmul; tied LM head."""
    return _Stack(s, _Gpt2Block, tied=True)


def linen_lm(module: nn.Module, s: Sizes):
    """(model, loss) of a Linen LM called as ``module(ids) -> logits``."""
    model = redray.LinenModel(module, jnp.zeros((1, s.seq), jnp.int32))
    return model, _lm_loss(lambda m, ids: m(ids))


def dense_stack(width: int = 512, classes: int = 16, inputs: int = 256, depth: int = 12):
    """(model, loss, examples maker) of ``DenseStack``: classification of ``inputs``-wide
    vectors."""
    model = redray.LinenModel(DenseStack(width, classes, depth), jnp.zeros((1, inputs)))

    def loss(model, batch, rng, train):
        return optax.softmax_cross_entropy_with_integer_labels(
            model(batch["x"]), batch["label"]).mean()

    def examples(n: int) -> list[dict]:
        rs = np.random.default_rng(0)
        return [{"x": rs.standard_normal(inputs).astype(np.float32),
                 "label": np.int32(rs.integers(classes))} for _ in range(n)]

    return model, loss, examples


def gemma_lm(s: Sizes):
    """(model, loss) of Google's Gemma (``gemma`` 2.0.8's Linen ``Transformer``), with as
    many key/value heads as query heads (Gemma 7B's layout: one per-head QKV einsum)."""
    from gemma import modules, transformer

    config = transformer.TransformerConfig(
        num_layers=s.layers, num_embed=s.vocab, embed_dim=s.hidden, hidden_dim=s.intermediate,
        num_heads=s.heads, head_dim=s.hidden // s.heads, num_kv_heads=s.heads,
        final_logit_softcap=None, use_post_attn_norm=False, use_post_ffw_norm=False,
        attention_types=[modules.AttentionType.GLOBAL] * s.layers, max_cache_length=None)
    module = transformer.Transformer(config)

    def call(model, ids):
        b, t = ids.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        return model(ids, positions, None, mask)[0]

    ids = jnp.zeros((1, s.seq), jnp.int32)
    model = redray.LinenModel(module, ids, jnp.zeros((1, s.seq), jnp.int32), None,
                              jnp.ones((1, s.seq, s.seq), bool))
    return model, _lm_loss(call)


def penzai_lm(s: Sizes):
    """(model factory, loss) of penzai's LLaMA (``penzai`` 0.2.5,
    ``llamalike_common``: separate query, key, value, gate and value-linear layers,
    named axes). Penzai models are pytrees of named arrays: this NNX module holds each
    parameter's array as an ``nnx.Param`` and rebinds them on every call, the few lines
    a penzai user writes to train with redray."""
    from flax import nnx
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as llamalike

    config = llamalike.LlamalikeTransformerConfig(
        num_kv_heads=s.heads, query_head_multiplier=1, embedding_dim=s.hidden,
        projection_dim=s.hidden // s.heads, mlp_hidden_dim=s.intermediate,
        num_decoder_blocks=s.layers, vocab_size=s.vocab, mlp_variant="swiglu",
        tie_embedder_and_logits=False)

    class Penzai(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            built = llamalike.build_llamalike_transformer(config, init_base_rng=rngs.params())
            self.unbound, values = pz.unbind_params(built, freeze=True)
            self.axes = nnx.static({v.label: v.value.named_axes for v in values})
            self.weights = nnx.Dict({v.label: nnx.Param(v.value.data_array) for v in values})

        def __call__(self, ids):
            params = [pz.ParameterValue(label=label, value=pz.nx.NamedArray(
                named_axes=axes, data_array=self.weights[label][...]))
                for label, axes in self.axes.items()]
            logits = pz.bind_variables(self.unbound, params)(pz.nx.wrap(ids).tag("batch", "seq"))
            return logits.unwrap("batch", "seq", "vocabulary")

    return Penzai, _lm_loss(lambda m, ids: m(ids))
