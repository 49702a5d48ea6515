"""Gemma 2 and Gemma 3 (text): LLaMA's layout with Gemma's own choices.

What differs from LLaMA: token embeddings scaled by sqrt(hidden_size) (rounded to the
compute dtype, as Hugging Face does); RMSNorm scaling by (1 + w), computed in float32,
its weights starting at zero; four norms per block (before and after attention and the
MLP); a GELU-tanh gated MLP (``hidden_activation``); attention scaled by
``query_pre_attn_scalar ** -0.5``; the LM head tied to the embedding and its logits
soft-capped (``final_logit_softcapping``). Layers alternate sliding-window and global
attention (``layer_types``). Gemma 2 soft-caps the attention logits
(``attn_logit_softcapping``). Gemma 3 RMS-normalizes queries and keys per head before
RoPE (``q_norm``, ``k_norm``) and gives sliding layers their own rotary table
(``rope_parameters`` per layer type: local base 10000; the global one may be scaled).

What differs by layer (the window, the rotary table) reaches each block as a per-layer
input (``layers.run_blocks``'s ``per_layer``): Python values for a list of blocks, int32
arrays scanned with stacked blocks, so scanned layers need no two programs.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx

from redray.models import layers, llama
from redray.models.attention import soft_cap
from redray.models.decoder import CausalLM
from redray.models.hub import HFConfig, plain

# Checkpoints saved from the base model (no LM head class) name tensors without it.
BASE_PREFIX = "model."
LAYER_KINDS = ("sliding_attention", "full_attention")


def _layer_kinds(c) -> list[str]:
    """Each layer's kind (``layer_types``): "sliding_attention" or "full_attention"."""
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError(f"{c.model_type} config: use_bidirectional_attention=True (an "
                         "embedding model's encoder) is not supported: redray's Gemma is a "
                         "causal LM; set it to False")
    kinds = list(getattr(c, "layer_types", None) or ())
    if len(kinds) < c.num_hidden_layers:
        raise ValueError(f"{c.model_type} config: layer_types names {len(kinds)} layers for "
                         f"num_hidden_layers={c.num_hidden_layers}: give one of "
                         f"{', '.join(LAYER_KINDS)} per layer")
    kinds = kinds[:c.num_hidden_layers]
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"{c.model_type} config: layer_types {', '.join(map(repr, unknown))} "
                         f"not supported; each layer is one of {', '.join(LAYER_KINDS)}")
    return kinds


def _rope(c, kind: str) -> dict:
    """A layer kind's rotary parameters: Gemma 3 keeps one dict per kind, Gemma 2 one."""
    rope = getattr(c, "rope_parameters", None) or {}
    own = rope.get(kind)
    return own if isinstance(own, dict) else rope


def _attention(c) -> tuple[tuple, tuple]:
    """(the rotary tables, each layer's ``layers.LayerAttention``): a sliding layer's
    window, and one table per distinct rotary embedding."""
    kinds = _layer_kinds(c)
    freqs = [tuple(float(f) for f in layers.rope_inv_freq(
        _rope(c, kind), c.head_dim, getattr(c, "rope_theta", 1e4))) for kind in kinds]
    tables = tuple(dict.fromkeys(freqs))
    return tuple((f, 1.0) for f in tables), tuple(
        layers.LayerAttention(window=c.sliding_window if kind == "sliding_attention" else None,
                              rope=tables.index(f)) for kind, f in zip(kinds, freqs))


def _mlp_fields(c):
    """The fields LLaMA's gated MLP reads, from a Gemma config (which calls its
    activation ``hidden_activation``)."""
    return types.SimpleNamespace(hidden_size=c.hidden_size,
                                 intermediate_size=c.intermediate_size,
                                 hidden_act=c.hidden_activation, mlp_bias=False)


class RMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + scale)`` in float32, returned in ``x``'s
    dtype; ``scale`` starts at zero (the identity)."""

    def __init__(self, features: int, epsilon: float):
        self.scale = nnx.Param(jnp.zeros((features,), jnp.float32))
        self.epsilon = epsilon

    def __call__(self, x):
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), -1, keepdims=True) + self.epsilon)
        return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = bool(getattr(c, "attention_bias", False))
        dense = dict(use_bias=bias, dtype=dtype, rngs=rngs)
        self.qkv_proj = layers.qkv_projection(c.hidden_size, heads, kv, d, **dense)
        self.o_proj = nnx.LinearGeneral((heads, d), c.hidden_size, axis=(-2, -1), **dense)
        self.dropout = nnx.Dropout(getattr(c, "attention_dropout", 0.0) or 0.0, rngs=rngs)
        self.scale = float(c.query_pre_attn_scalar) ** -0.5
        # Gemma 3's config carries the field, but its attention does not apply it
        self.softcap = c.attn_logit_softcapping if c.model_type == "gemma2" else None
        self.q_norm, self.k_norm = ((RMSNorm(d, c.rms_norm_eps), RMSNorm(d, c.rms_norm_eps))
                                    if c.model_type == "gemma3_text" else (None, None))

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
        q, k, v = layers.split_rotated_qkv(self.qkv_proj(x), cos, sin, layers.rotate_half, norms)
        out, new_cache = layers.self_attention(q, k, v, mask, self.scale, cache, cache_index,
                                               self.dropout, train, softcap=self.softcap)
        return self.o_proj(out), new_cache


class Block(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        hidden, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = llama.MLP(_mlp_fields(c), rngs=rngs, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        # the windows a scanned layer's traced window can be (the fused kernels compile
        # one for each): the local layers' and the global ones'
        self.choices = layers.attention_choices(_attention(c)[1])

    def __call__(self, x, cos, sin, mask, window, chunk, rope, cache, cache_index, train):
        """``cos``, ``sin``: every rotary table stacked on axis 1, this layer's at
        ``rope``; ``window``: this layer's sliding window (``layers.layer_view``)."""
        cos, sin, mask = layers.layer_view(cos, sin, mask, window, chunk, rope, self.choices)
        attn, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache,
                                         cache_index, train)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp), new_cache


class Model(CausalLM):
    """A Gemma 2 or Gemma 3 (text) causal LM built from a ``transformers`` config
    (called as ``CausalLM`` says)."""

    TOKENS, BLOCKS, FINAL_NORM = "embed_tokens", "layers", "norm"
    TIED_BY_DEFAULT = True

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        self.embed_tokens = layers.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs,
                                         padding_idx=layers.padding_row(c))
        self.make_layers(c, lambda kind, r: Block(c, rngs=r, dtype=dtype), rngs, scan)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope_tables, self.layer_attention = _attention(c)
        self.final_softcap = getattr(c, "final_logit_softcapping", None)

    def key_value_heads(self) -> tuple[int, int]:
        return self.config.num_key_value_heads, self.config.head_dim

    def embed(self, input_ids, positions, train: bool):
        x = self.embed_tokens(input_ids)
        return x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)

    def logits(self, x):
        return soft_cap(super().logits(x), self.final_softcap)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths: LLaMA's, and the norms
    around the MLP and (Gemma 3) over queries and keys."""
    c = config.hf if isinstance(config, HFConfig) else config
    norms = ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if c.model_type == "gemma3_text":
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    rows = llama.weight_table(c)
    for i in range(c.num_hidden_layers):
        rows += [plain(f"model.layers.{i}.{n}.weight", f"layers/{i}/{n.replace('.', '/')}/scale")
                 for n in norms]
    return rows
