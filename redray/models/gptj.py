"""GPT-J: parallel attention and MLP blocks with partial, interleaved rotary embeddings.

Each block reads one LayerNorm output twice, x + attn(ln_1(x)) + mlp(ln_1(x)).
Q/K/V/out have no bias; fc_in/fc_out and the (untied) LM head do. Rotary embeddings
rotate the first ``rotary_dim`` dimensions of each head, pairing 2i with 2i+1.
Q, K and V share one kernel (hidden, heads, 3, head_dim) (``layers.qkv_projection``), so
the automatic rules split whole heads and their input gradients reach one all-reduce.
"""

from __future__ import annotations

from flax import nnx

from redray.models import layers
from redray.models.decoder import CausalLM
from redray.models.hub import HFConfig, linear, plain, qkv
from redray.sharding.tracing import constrain_rows

# Checkpoints saved from the base model (no LM head class) name tensors without it.
BASE_PREFIX = "transformer."
# Non-persistent buffers: the causal mask and the sinusoid table are rebuilt, not loaded.
IGNORED = (r"\.attn\.bias$", r"\.attn\.masked_bias$", r"\.attn\.embed_positions$")


def _dims(c) -> tuple[int, int, int]:
    """(heads, head_dim, rotary_dim)."""
    heads = c.num_attention_heads
    d = c.hidden_size // heads
    # rotary_dim None means the whole head is rotated.
    return heads, d, min(c.rotary_dim or d, d)


def _rate(c, name: str) -> float:
    return float(getattr(c, name, 0.0) or 0.0)


class Attention(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        heads, d, _ = _dims(c)
        hidden = c.hidden_size
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.qkv_proj = layers.qkv_projection(hidden, heads, heads, d, **dense)
        self.out_proj = nnx.LinearGeneral((heads, d), hidden, axis=(-2, -1), **dense)
        self.attn_dropout = nnx.Dropout(_rate(c, "attn_pdrop"), rngs=rngs)
        self.resid_dropout = nnx.Dropout(_rate(c, "resid_pdrop"), rngs=rngs)
        self.scale = d ** -0.5

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        q, k, v = layers.split_rotated_qkv(self.qkv_proj(x), cos, sin, layers.rotate_interleaved)
        out, new_cache = layers.self_attention(q, k, v, mask, self.scale, cache, cache_index,
                                               self.attn_dropout, train)
        return self.resid_dropout(self.out_proj(out), deterministic=not train), new_cache


class MLP(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        inner = getattr(c, "n_inner", None) or 4 * c.hidden_size
        dense = dict(dtype=dtype, rngs=rngs)
        self.fc_in = nnx.Linear(c.hidden_size, inner, **dense)
        self.fc_out = nnx.Linear(inner, c.hidden_size, **dense)
        self.act = layers.activation(c.activation_function)
        self.dropout = nnx.Dropout(_rate(c, "resid_pdrop"), rngs=rngs)

    def __call__(self, x, train):
        h = self.act(constrain_rows(self.fc_in(x), whole=False))
        return self.dropout(self.fc_out(h), deterministic=not train)


class Block(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        self.ln_1 = nnx.LayerNorm(c.hidden_size, epsilon=c.layer_norm_epsilon, dtype=dtype,
                                  rngs=rngs)
        self.attn = Attention(c, rngs=rngs, dtype=dtype)
        self.mlp = MLP(c, rngs=rngs, dtype=dtype)

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        h = self.ln_1(x)
        attn, new_cache = self.attn(h, cos, sin, mask, cache, cache_index, train)
        return x + attn + self.mlp(h, train), new_cache


class Model(CausalLM):
    """A GPT-J causal LM built from a ``transformers`` config (called as ``CausalLM`` says)."""

    TOKENS, BLOCKS, FINAL_NORM = "wte", "h", "ln_f"
    HEAD_BIAS = True

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        self.wte = layers.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(_rate(c, "embd_pdrop"), rngs=rngs)
        self.h = layers.make_blocks(lambda r: Block(c, rngs=r, dtype=dtype),
                                    c.num_hidden_layers, rngs, scan)
        self.ln_f = nnx.LayerNorm(c.hidden_size, epsilon=c.layer_norm_epsilon, dtype=dtype,
                                  rngs=rngs)
        _, _, rotary = _dims(c)
        self.inv_freq = tuple(float(f) for f in layers.rope_inv_freq(None, rotary))

    def key_value_heads(self) -> tuple[int, int]:
        heads, d, _ = _dims(self.config)
        return heads, d

    def embed(self, input_ids, positions, train: bool):
        return self.drop(self.wte(input_ids), deterministic=not train)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = config.hf if isinstance(config, HFConfig) else config
    heads, _, _ = _dims(c)
    rows = [plain("transformer.wte.weight", "wte/embedding"),
            plain("transformer.ln_f.weight", "ln_f/scale"),
            plain("transformer.ln_f.bias", "ln_f/bias")]
    if getattr(c, "tie_word_embeddings", False):
        rows.append(plain("lm_head.bias", "lm_head_bias"))
    else:
        rows += [linear("lm_head.weight", "lm_head/kernel"), plain("lm_head.bias", "lm_head/bias")]
    for i in range(c.num_hidden_layers):
        hf, me = f"transformer.h.{i}", f"h/{i}"
        rows += [plain(f"{hf}.ln_1.weight", f"{me}/ln_1/scale"),
                 plain(f"{hf}.ln_1.bias", f"{me}/ln_1/bias")]
        rows += qkv(tuple(f"{hf}.attn.{n}" for n in ("q_proj", "k_proj", "v_proj")),
                    f"{me}/attn/qkv_proj", heads, heads)
        rows.append(linear(f"{hf}.attn.out_proj.weight", f"{me}/attn/out_proj/kernel", in_dims=2))
        for name in ("fc_in", "fc_out"):
            rows += [linear(f"{hf}.mlp.{name}.weight", f"{me}/mlp/{name}/kernel"),
                     plain(f"{hf}.mlp.{name}.bias", f"{me}/mlp/{name}/bias")]
    return rows
