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
from redray.models.hub import HFConfig, linear, plain, qkv

MODEL_TYPES = ("opt",)
# Checkpoints saved from the base model (no LM head class) name tensors without it.
BASE_PREFIX = "model."
# OPT's learned position table has 2 extra rows in front (a fairseq padding legacy).
POSITION_OFFSET = 2


def _dims(c) -> tuple[int, int]:
    heads = c.num_attention_heads
    if c.hidden_size % heads:
        raise ValueError(f"hidden_size {c.hidden_size} is not a multiple of "
                         f"num_attention_heads {heads}")
    return heads, c.hidden_size // heads


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
        heads, d = _dims(c)
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
        new_cache = None
        if cache is not None:
            k, v, new_cache = layers.update_cache(cache, k, v, cache_index)
        drop = (lambda p: self.dropout(p, deterministic=False)) if train else None
        out = layers.dot_attention(q, k, v, mask, 1.0, dropout=drop)
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
        h = self.fc2(self.act(self.fc1(h)))
        x = x + self.dropout(h, deterministic=not train)
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x, new_cache


class Model(nnx.Module):
    """An OPT causal LM built from a ``transformers`` config.

    Call as ``model(input_ids)`` for logits (batch, seq, vocab); with an attention mask
    over key slots for padding (positions count only real tokens); with ``segment_ids``
    for rows packed with several documents (attention stays inside a document,
    positions restart; see ``redray.data.pack``); with ``cache=model.init_cache(...)``
    and ``cache_index`` for incremental decoding, which returns (logits, cache); with
    ``hidden=True`` the final hidden states instead of logits (``model.logits(hidden)``
    applies the LM head: a loss can then project a part of the sequence at a time,
    ``next_token_loss``).
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, remat=False,
                 scan: bool = False):
        c = config.hf if isinstance(config, HFConfig) else config
        self.config = HFConfig(c)
        self.dtype = dtype
        self.remat = layers.remat_policy(remat)
        embed = dict(dtype=dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(c.vocab_size, c.word_embed_proj_dim, **embed)
        self.embed_positions = nnx.Embed(c.max_position_embeddings + POSITION_OFFSET,
                                         c.hidden_size, **embed)
        if _projected(c):
            proj = dict(use_bias=False, dtype=dtype, rngs=rngs)
            self.project_in = nnx.Linear(c.word_embed_proj_dim, c.hidden_size, **proj)
            self.project_out = nnx.Linear(c.hidden_size, c.word_embed_proj_dim, **proj)
        self.layers = layers.make_blocks(lambda r: Block(c, rngs=r, dtype=dtype),
                                         c.num_hidden_layers, rngs, scan)
        if _final_norm(c):
            self.final_layer_norm = _layer_norm(c, rngs=rngs, dtype=dtype)
        self.tied = bool(getattr(c, "tie_word_embeddings", True))
        if not self.tied:
            self.lm_head = nnx.Linear(c.word_embed_proj_dim, c.vocab_size, use_bias=False,
                                      dtype=dtype, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, *, cache=None, cache_index=0,
                 segment_ids=None, train: bool = False, hidden: bool = False):
        c = self.config
        mask, positions = layers.decoder_masks(input_ids, attention_mask, cache, cache_index,
                                               segment_ids=segment_ids)
        x = self.embed_tokens(input_ids)
        if _projected(c):
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        x, new_cache = layers.run_blocks(self.layers, x, (mask,), cache, cache_index, train,
                                        self.remat)
        if _final_norm(c):
            x = self.final_layer_norm(x)
        if hidden:
            return x
        logits = self.logits(x)
        return logits if cache is None else (logits, new_cache)

    def logits(self, x):
        """The LM head on final hidden states (``model(..., hidden=True)``)."""
        if _projected(self.config):
            x = self.project_out(x)
        return self.embed_tokens.attend(x) if self.tied else self.lm_head(x)

    def init_cache(self, batch: int, length: int, dtype=None):
        """An empty KV cache for ``batch`` sequences of up to ``length`` tokens."""
        heads, d = _dims(self.config)
        return layers.empty_cache(self.config.num_hidden_layers, batch, length, heads, d,
                                  dtype or self.dtype, layers.is_stacked(self.layers))


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = config.hf if isinstance(config, HFConfig) else config
    bias = bool(c.enable_bias)
    heads, _ = _dims(c)
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
