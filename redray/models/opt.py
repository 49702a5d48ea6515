"""OPT: learned positions (offset 2), pre- or post-LayerNorm blocks, ReLU MLP.

Q, K and V share one kernel (hidden, heads, 3, head_dim) (``layers.qkv_projection``) and
``out_proj`` is (heads, head_dim, hidden), so the automatic rules split whole heads and
the attention costs tensor parallelism one all-reduce each way. Configs whose
``word_embed_proj_dim`` differs from ``hidden_size`` (opt-350m) embed in the smaller
width and go through ``project_in`` / ``project_out`` around the decoder; the LM head
is tied to the embedding unless the config says otherwise.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redray.models import layers
from redray.models.decoder import CausalLM
from redray.models.hub import HFConfig, linear, plain, qkv
from redray.sharding.tracing import constrain_rows

# Checkpoints saved from the base model (no LM head class) name tensors without it.
BASE_PREFIX = "model."
# OPT's learned position table has 2 extra rows in front (a fairseq padding legacy).
POSITION_OFFSET = 2


def _projected(c) -> bool:
    return c.word_embed_proj_dim != c.hidden_size


def _final_norm(c) -> bool:
    return bool(c.do_layer_norm_before) and not getattr(c, "_remove_final_layer_norm", False)


def _layer_norm(c, *, rngs, dtype):
    affine = bool(getattr(c, "layer_norm_elementwise_affine", True))
    return nnx.LayerNorm(c.hidden_size, epsilon=1e-5, use_scale=affine, use_bias=affine,
                         dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        heads, d = layers.attention_heads(c)
        hidden = c.hidden_size
        dense = dict(use_bias=bool(c.enable_bias), dtype=dtype, rngs=rngs)
        self.qkv_proj = layers.qkv_projection(hidden, heads, heads, d, **dense)
        self.out_proj = nnx.LinearGeneral((heads, d), hidden, axis=(-2, -1), **dense)
        self.dropout = nnx.Dropout(c.attention_dropout or 0.0, rngs=rngs)
        self.scale = d ** -0.5

    def __call__(self, x, mask, cache, cache_index, train):
        # OPT scales the queries, not the scores (the same up to rounding).
        q, k, v = layers.split_qkv(self.qkv_proj(x))
        q = q * jnp.asarray(self.scale, x.dtype)
        out, new_cache = layers.self_attention(q, k, v, mask, 1.0, cache, cache_index,
                                               self.dropout, train)
        return self.out_proj(out), new_cache


class Block(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        dense = dict(use_bias=bool(c.enable_bias), dtype=dtype, rngs=rngs)
        self.pre_norm = bool(c.do_layer_norm_before)
        self.self_attn_layer_norm = _layer_norm(c, rngs=rngs, dtype=dtype)
        self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        self.final_layer_norm = _layer_norm(c, rngs=rngs, dtype=dtype)
        self.fc1 = nnx.Linear(c.hidden_size, c.ffn_dim, **dense)
        self.fc2 = nnx.Linear(c.ffn_dim, c.hidden_size, **dense)
        self.act = layers.activation(c.activation_function)
        self.dropout = nnx.Dropout(c.dropout or 0.0, rngs=rngs)

    def __call__(self, x, mask, cache, cache_index, train):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        h, new_cache = self.self_attn(h, mask, cache, cache_index, train)
        x = x + self.dropout(h, deterministic=not train)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        h = self.fc2(self.act(constrain_rows(self.fc1(h), whole=False)))
        x = x + self.dropout(h, deterministic=not train)
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x, new_cache


class Model(CausalLM):
    """An OPT causal LM built from a ``transformers`` config (called as ``CausalLM`` says)."""

    TOKENS, BLOCKS, FINAL_NORM = "embed_tokens", "layers", "final_layer_norm"
    TIED_BY_DEFAULT = True

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        embed = dict(dtype=dtype, rngs=rngs)
        self.embed_tokens = layers.Embed(c.vocab_size, c.word_embed_proj_dim, **embed,
                                         padding_idx=layers.padding_row(c))
        self.embed_positions = layers.Embed(c.max_position_embeddings + POSITION_OFFSET,
                                         c.hidden_size, **embed)
        if _projected(c):
            proj = dict(use_bias=False, dtype=dtype, rngs=rngs)
            self.project_in = nnx.Linear(c.word_embed_proj_dim, c.hidden_size, **proj)
            self.project_out = nnx.Linear(c.hidden_size, c.word_embed_proj_dim, **proj)
        self.layers = layers.make_blocks(lambda r: Block(c, rngs=r, dtype=dtype),
                                         c.num_hidden_layers, rngs, scan)
        if _final_norm(c):
            self.final_layer_norm = _layer_norm(c, rngs=rngs, dtype=dtype)

    def key_value_heads(self) -> tuple[int, int]:
        return layers.attention_heads(self.config)

    def embed(self, input_ids, positions, train: bool):
        x = self.embed_tokens(input_ids)
        if _projected(self.config):
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def logits(self, x):
        """The LM head on final hidden states, projected back to the embedding's width
        first where the config embeds in a smaller one."""
        return super().logits(self.project_out(x) if _projected(self.config) else x)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = config.hf if isinstance(config, HFConfig) else config
    bias = bool(c.enable_bias)
    heads, _ = layers.attention_heads(c)
    affine = bool(getattr(c, "layer_norm_elementwise_affine", True))
    dec = "model.decoder"

    def norm(hf, me):
        if not affine:
            return []
        return [plain(f"{hf}.weight", f"{me}/scale"), plain(f"{hf}.bias", f"{me}/bias")]

    rows = [plain(f"{dec}.embed_tokens.weight", "embed_tokens/embedding"),
            plain(f"{dec}.embed_positions.weight", "embed_positions/embedding")]
    if _projected(c):
        rows += [linear(f"{dec}.project_in.weight", "project_in/kernel"),
                 linear(f"{dec}.project_out.weight", "project_out/kernel")]
    if _final_norm(c):
        rows += norm(f"{dec}.final_layer_norm", "final_layer_norm")
    if not getattr(c, "tie_word_embeddings", True):
        rows.append(linear("lm_head.weight", "lm_head/kernel"))
    for i in range(c.num_hidden_layers):
        hf, me = f"{dec}.layers.{i}", f"layers/{i}"
        rows += norm(f"{hf}.self_attn_layer_norm", f"{me}/self_attn_layer_norm")
        rows += norm(f"{hf}.final_layer_norm", f"{me}/final_layer_norm")
        rows += qkv(tuple(f"{hf}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")),
                    f"{me}/self_attn/qkv_proj", heads, heads, bias=bias)
        rows.append(linear(f"{hf}.self_attn.out_proj.weight", f"{me}/self_attn/out_proj/kernel",
                           in_dims=2))
        for name in ("fc1", "fc2"):
            rows.append(linear(f"{hf}.{name}.weight", f"{me}/{name}/kernel"))
        if bias:
            rows += [plain(f"{hf}.self_attn.out_proj.bias", f"{me}/self_attn/out_proj/bias"),
                     plain(f"{hf}.fc1.bias", f"{me}/fc1/bias"),
                     plain(f"{hf}.fc2.bias", f"{me}/fc2/bias")]
    return rows
