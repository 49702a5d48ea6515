"""OLMo 3: LLaMA's parts in a post-norm block, queries and keys normalized whole.

What differs from LLaMA: each block normalizes the outputs of attention and of the MLP
before adding them to the residual stream (``post_attention_layernorm``,
``post_feedforward_layernorm``; no norm on the block's input); queries and keys are
RMS-normalized over the whole projection, every head together (``q_norm`` over
heads x head_dim, ``k_norm`` over key/value heads x head_dim), before RoPE; layers
alternate sliding-window and full attention (``layer_types``: by default three sliding
layers, then a full one), each kind with rotary parameters of its own
(``rope_parameters`` per layer type: the long-context releases scale the full layers'
with YaRN). Each layer's window and rotary table reach it as scanned inputs
(``layers.LayerAttention``).
"""

from __future__ import annotations

from flax import nnx

from redray.models import layers, llama
from redray.models.hub import HFConfig, plain

LAYER_KINDS = ("sliding_attention", "full_attention")
BASE_PREFIX = llama.BASE_PREFIX
IGNORED = llama.IGNORED


def _attention(c) -> tuple[tuple, tuple]:
    """(one rotary table per layer kind, each layer's ``layers.LayerAttention``)."""
    kinds = list(c.layer_types)[:c.num_hidden_layers]
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"{c.model_type} config: layer_types {', '.join(map(repr, unknown))} "
                         f"not supported; each layer is one of {', '.join(LAYER_KINDS)}")
    _, _, d = llama._dims(c)
    tables, index = [], {}
    for kind in dict.fromkeys(kinds):
        rope = c.rope_parameters.get(kind, c.rope_parameters)
        # transformers reads YaRN's truncate from the top-level dict, which holds one
        # dict per layer kind here: always its default, True
        table = (tuple(float(f) for f in layers.rope_inv_freq(
            rope, d, max_positions=c.max_position_embeddings, truncate=True)),
            layers.rope_scale(rope, c.max_position_embeddings))
        index[kind] = len(tables)
        tables.append(table)
    return tuple(tables), tuple(
        layers.LayerAttention(window=c.sliding_window if kind == "sliding_attention" else None,
                              rope=index[kind]) for kind in kinds)


class Attention(llama.Attention):
    """LLaMA's attention with queries and keys RMS-normalized over the whole projection
    before RoPE."""

    def qk_norms(self, c, norm: dict) -> tuple:
        heads, kv, d = llama._dims(c)
        return nnx.RMSNorm(heads * d, **norm), nnx.RMSNorm(kv * d, **norm)

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        q, k, v = layers.split_qkv(self.qkv_proj(x))
        q = self.q_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
        k = self.k_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
        q, k = layers.rotate_half(q, cos, sin), layers.rotate_half(k, cos, sin)
        out, new_cache = layers.self_attention(q, k, v, mask, self.scale, cache, cache_index,
                                               self.dropout, train)
        return self.o_proj(out), new_cache


class Block(nnx.Module):
    """A post-norm block: attention and the MLP each normalized before the residual."""

    def __init__(self, c, *, rngs, dtype, choices):
        norm = dict(epsilon=c.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = nnx.RMSNorm(c.hidden_size, **norm)
        self.mlp = llama.MLP(c, rngs=rngs, dtype=dtype)
        self.post_feedforward_layernorm = nnx.RMSNorm(c.hidden_size, **norm)
        self.choices = choices

    def __call__(self, x, cos, sin, mask, *rest):
        """``rest``: (cache, cache_index, train), after this layer's window, chunk and
        rotary table where layers differ (``layers.layer_view``)."""
        *own, cache, cache_index, train = rest
        if own:
            cos, sin, mask = layers.layer_view(cos, sin, mask, *own, self.choices)
        attn, new_cache = self.self_attn(x, cos, sin, mask, cache, cache_index, train)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(x)), new_cache


class Model(llama.Model):
    """An OLMo 3 causal LM built from a ``transformers`` config (called as ``CausalLM``
    says)."""

    attention = staticmethod(_attention)

    def block(self, c, kind: str, *, rngs, dtype, choices):
        return Block(c, rngs=rngs, dtype=dtype, choices=choices)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths: LLaMA's without the norm
    before attention, with the norm after the MLP and the whole-projection q/k norms."""
    c = config.hf if isinstance(config, HFConfig) else config
    rows = [row for row in llama.weight_table(c) if "/input_layernorm/" not in row.path]
    for i in range(c.num_hidden_layers):
        hf, me = f"model.layers.{i}", f"layers/{i}"
        rows += [plain(f"{hf}.post_feedforward_layernorm.weight",
                       f"{me}/post_feedforward_layernorm/scale"),
                 plain(f"{hf}.self_attn.q_norm.weight", f"{me}/self_attn/q_norm/scale"),
                 plain(f"{hf}.self_attn.k_norm.weight", f"{me}/self_attn/k_norm/scale")]
    return rows
