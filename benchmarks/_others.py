"""Models written the way users and other libraries write them, for the communication cases.

None of them is laid out for redray: Linen modules with auto-named layers
(``Dense_0``...), separate Q, K and V projections, a GPT-J-style parallel-residual
block, GPT-2's contiguous q|k|v kernel, a 12-layer MLP, Google's own Gemma (the
``gemma`` package's Linen transformer), penzai's LLaMA, and two NNX mixture-of-experts
LMs a researcher writes by hand (experts stacked in einsum kernels, or a list of expert
MLPs) with the Megatron specs a user would write for them. Each returns a
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
from flax import nnx
from jax.sharding import PartitionSpec as P

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


# ----------------------------------------------------------------- user-written MoE LMs
EXPERTS, TOP_K = 4, 2


def _route(router: nnx.Linear, x, k: int = TOP_K):
    """Each token's expert weights: the softmax router probabilities of its top ``k``
    experts, renormalised over them; zero for the others."""
    probs = jax.nn.softmax(router(x), -1)
    _, chosen = jax.lax.top_k(probs, k)
    kept = probs * jax.nn.one_hot(chosen, probs.shape[-1], dtype=probs.dtype).sum(-2)
    return kept / kept.sum(-1, keepdims=True)


class StackedMoE(nnx.Module):
    """Every expert's SwiGLU MLP in three stacked kernels, (E, H, F), (E, H, F) and
    (E, F, H), run densely on every token through einsum and mixed by the router."""

    def __init__(self, hidden: int, inner: int, experts: int, rngs: nnx.Rngs):
        self.router = nnx.Linear(hidden, experts, use_bias=False, rngs=rngs)
        normal = jax.nn.initializers.normal
        self.w_gate = nnx.Param(normal(hidden ** -0.5)(rngs.params(), (experts, hidden, inner)))
        self.w_up = nnx.Param(normal(hidden ** -0.5)(rngs.params(), (experts, hidden, inner)))
        self.w_down = nnx.Param(normal(inner ** -0.5)(rngs.params(), (experts, inner, hidden)))

    def __call__(self, x):
        weights = _route(self.router, x)
        gate = jnp.einsum("bsh,ehf->bsef", x, self.w_gate[...])
        up = jnp.einsum("bsh,ehf->bsef", x, self.w_up[...])
        y = jnp.einsum("bsef,efh->bseh", jax.nn.silu(gate) * up, self.w_down[...])
        return jnp.einsum("bseh,bse->bsh", y, weights)


class Expert(nnx.Module):
    def __init__(self, hidden: int, inner: int, rngs: nnx.Rngs):
        self.gate = nnx.Linear(hidden, inner, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(hidden, inner, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(inner, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class ListMoE(nnx.Module):
    """The same mixture with its experts as a list of SwiGLU MLP modules."""

    def __init__(self, hidden: int, inner: int, experts: int, rngs: nnx.Rngs):
        self.router = nnx.Linear(hidden, experts, use_bias=False, rngs=rngs)
        self.experts = nnx.List([Expert(hidden, inner, rngs) for _ in range(experts)])

    def __call__(self, x):
        weights = _route(self.router, x)
        return sum(weights[..., e, None] * expert(x) for e, expert in enumerate(self.experts))


class _Attention(nnx.Module):
    def __init__(self, hidden: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.q, self.k, self.v, self.o = (
            nnx.Linear(hidden, hidden, use_bias=False, rngs=rngs) for _ in range(4))

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).reshape(b, t, self.heads, d // self.heads)
                   for p in (self.q, self.k, self.v))
        return self.o(_attention(q, k, v).reshape(b, t, d))


class _MoEBlock(nnx.Module):
    def __init__(self, s: Sizes, moe: type, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(s.hidden, rngs=rngs)
        self.attn = _Attention(s.hidden, s.heads, rngs)
        self.moe_norm = nnx.RMSNorm(s.hidden, rngs=rngs)
        self.moe = moe(s.hidden, s.intermediate, EXPERTS, rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class _MoELM(nnx.Module):
    """Embedding, ``s.layers`` pre-norm blocks (attention, then the mixture of experts
    ``moe``), a final RMSNorm and an untied LM head."""

    def __init__(self, s: Sizes, moe: type, rngs: nnx.Rngs):
        self.embed = nnx.Embed(s.vocab, s.hidden, rngs=rngs)
        self.blocks = nnx.List([_MoEBlock(s, moe, rngs) for _ in range(s.layers)])
        self.norm = nnx.RMSNorm(s.hidden, rngs=rngs)
        self.head = nnx.Linear(s.hidden, s.vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class StackedMoELM(_MoELM):
    """A decoder LM whose blocks' mixtures stack their experts (``StackedMoE``)."""

    def __init__(self, s: Sizes, rngs: nnx.Rngs):
        super().__init__(s, StackedMoE, rngs)


class ListMoELM(_MoELM):
    """A decoder LM whose blocks' mixtures hold a list of expert modules (``ListMoE``)."""

    def __init__(self, s: Sizes, rngs: nnx.Rngs):
        super().__init__(s, ListMoE, rngs)


MOE_LMS = {"stacked": StackedMoELM, "list": ListMoELM}

# The specs a Megatron user writes for each: q, k, v column and o row; each expert's gate
# and up split on its hidden size F, its down on its input F; the router whole; the
# embedding split on the vocabulary and the LM head column; norms whole.
_MEGATRON_COMMON = [(r"attn/(q|k|v)/kernel$", P(None, "model")),
                    (r"attn/o/kernel$", P("model", None)),
                    (r"moe/router/kernel$", P()),
                    (r"^embed/embedding$", P("model", None)),
                    (r"^head/kernel$", P(None, "model")),
                    (r"norm/scale$", P())]
MOE_MEGATRON_RULES = {
    "stacked": _MEGATRON_COMMON + [(r"moe/w_(gate|up)$", P(None, None, "model")),
                                   (r"moe/w_down$", P(None, "model", None))],
    "list": _MEGATRON_COMMON + [(r"moe/experts/\d+/(gate|up)/kernel$", P(None, "model")),
                                (r"moe/experts/\d+/down/kernel$", P("model", None))],
}


def moe_lm(kind: str, s: Sizes):
    """(model factory, loss) of the user-written MoE LM ``kind`` (``MOE_LMS``)."""
    lm = MOE_LMS[kind]
    return (lambda rngs: lm(s, rngs)), _lm_loss(lambda m, ids: m(ids))


def linear_attention_lm(s: Sizes):
    """(model factory, loss) of the linear-attention LM the tests write
    (``tests/tiny.py``'s ``LinearLM``: every name meaningless, a gated linear attention
    with per-head decays, short convolutions and a per-head norm, its state run by a
    ``lax.scan`` over tokens) at sizes ``s``."""
    from common import tests_module

    LinearLM = tests_module("tiny").LinearLM
    return (lambda rngs: LinearLM(rngs, s.vocab, s.hidden, s.heads, s.layers,
                                  s.intermediate)), _lm_loss(lambda m, ids: m(ids))
