"""GPT-2: learned position embeddings, pre-LayerNorm blocks, fused QKV, tied LM head.

Hugging Face stores GPT-2's dense layers as ``Conv1D`` weights (in, out). The fused
``c_attn`` kernel is laid out (hidden, 3, heads, head_dim) and its bias (3, heads,
head_dim), so the automatic rules split whole heads (the size-3 axis divides no even
model axis); ``c_proj`` of the attention is (heads, head_dim, hidden).
"""

from __future__ import annotations

from flax import nnx

from redray.models import layers
from redray.models.decoder import CausalLM
from redray.models.hub import HFConfig, conv1d, linear, plain
from redray.sharding.tracing import constrain_rows

# Checkpoints saved from the base model (no LM head class) name tensors without it.
BASE_PREFIX = "transformer."
# Causal-mask buffers that old checkpoints saved with the weights.
IGNORED = (r"\.attn\.bias$", r"\.attn\.masked_bias$")


def _inner(c) -> int:
    return getattr(c, "n_inner", None) or 4 * c.hidden_size


class Attention(nnx.Module):
    def __init__(self, c, layer_idx: int, *, rngs, dtype):
        heads, d = layers.attention_heads(c)
        dense = dict(dtype=dtype, rngs=rngs)
        self.c_attn = nnx.LinearGeneral(c.hidden_size, (3, heads, d), **dense)
        self.c_proj = nnx.LinearGeneral((heads, d), c.hidden_size, axis=(-2, -1), **dense)
        self.attn_dropout = nnx.Dropout(c.attn_pdrop or 0.0, rngs=rngs)
        self.resid_dropout = nnx.Dropout(c.resid_pdrop or 0.0, rngs=rngs)
        scale = d ** -0.5 if getattr(c, "scale_attn_weights", True) else 1.0
        if getattr(c, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.scale = scale

    def __call__(self, x, mask, cache, cache_index, train):
        qkv = self.c_attn(x)
        out, new_cache = layers.self_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask,
                                               self.scale, cache, cache_index,
                                               self.attn_dropout, train)
        return self.resid_dropout(self.c_proj(out), deterministic=not train), new_cache


class MLP(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        dense = dict(dtype=dtype, rngs=rngs)
        self.c_fc = nnx.Linear(c.hidden_size, _inner(c), **dense)
        self.c_proj = nnx.Linear(_inner(c), c.hidden_size, **dense)
        self.act = layers.activation(c.activation_function)
        self.dropout = nnx.Dropout(c.resid_pdrop or 0.0, rngs=rngs)

    def __call__(self, x, train):
        h = self.act(constrain_rows(self.c_fc(x), whole=False))
        return self.dropout(self.c_proj(h), deterministic=not train)


class Block(nnx.Module):
    def __init__(self, c, layer_idx: int, *, rngs, dtype):
        norm = dict(epsilon=c.layer_norm_epsilon, dtype=dtype, rngs=rngs)
        self.ln_1 = nnx.LayerNorm(c.hidden_size, **norm)
        self.attn = Attention(c, layer_idx, rngs=rngs, dtype=dtype)
        self.ln_2 = nnx.LayerNorm(c.hidden_size, **norm)
        self.mlp = MLP(c, rngs=rngs, dtype=dtype)

    def __call__(self, x, mask, cache, cache_index, train):
        attn, new_cache = self.attn(self.ln_1(x), mask, cache, cache_index, train)
        x = x + attn
        return x + self.mlp(self.ln_2(x), train), new_cache


class Model(CausalLM):
    """A GPT-2 causal LM built from a ``transformers`` config (called as ``CausalLM`` says)."""

    TOKENS, BLOCKS, FINAL_NORM = "wte", "h", "ln_f"
    TIED_BY_DEFAULT = True

    def layers_differ(self, c) -> str | None:
        if getattr(c, "scale_attn_by_inverse_layer_idx", False):
            return ("this config scales attention by the layer's index "
                    "(scale_attn_by_inverse_layer_idx)")
        return None

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        if getattr(c, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True (an encoder-decoder "
                             "component) is not supported: only the causal LM is")
        embed = dict(dtype=dtype, rngs=rngs)
        self.wte = layers.Embed(c.vocab_size, c.hidden_size, **embed)
        self.wpe = layers.Embed(c.max_position_embeddings, c.hidden_size, **embed)
        self.drop = nnx.Dropout(c.embd_pdrop or 0.0, rngs=rngs)
        if scan and self.layers_differ(c):
            raise ValueError(f"scan=True stacks identical layers, but {self.layers_differ(c)}: "
                             "build it with scan=False (or leave scan out)")
        index = iter(range(c.num_hidden_layers))
        self.h = layers.make_blocks(lambda r: Block(c, 0 if scan else next(index), rngs=r,
                                                    dtype=dtype),
                                    c.num_hidden_layers, rngs, scan)
        self.ln_f = nnx.LayerNorm(c.hidden_size, epsilon=c.layer_norm_epsilon, dtype=dtype,
                                  rngs=rngs)

    def key_value_heads(self) -> tuple[int, int]:
        return layers.attention_heads(self.config)

    def embed(self, input_ids, positions, train: bool):
        x = self.wte(input_ids) + self.wpe(positions)
        return self.drop(x, deterministic=not train)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = config.hf if isinstance(config, HFConfig) else config
    rows = [plain("transformer.wte.weight", "wte/embedding"),
            plain("transformer.wpe.weight", "wpe/embedding"),
            plain("transformer.ln_f.weight", "ln_f/scale"),
            plain("transformer.ln_f.bias", "ln_f/bias")]
    if not getattr(c, "tie_word_embeddings", True):
        rows.append(linear("lm_head.weight", "lm_head/kernel"))
    for i in range(c.num_hidden_layers):
        hf, me = f"transformer.h.{i}", f"h/{i}"
        for norm in ("ln_1", "ln_2"):
            rows += [plain(f"{hf}.{norm}.weight", f"{me}/{norm}/scale"),
                     plain(f"{hf}.{norm}.bias", f"{me}/{norm}/bias")]
        rows += [conv1d(f"{hf}.attn.c_attn.weight", f"{me}/attn/c_attn/kernel"),
                 plain(f"{hf}.attn.c_attn.bias", f"{me}/attn/c_attn/bias", flat=True),
                 conv1d(f"{hf}.attn.c_proj.weight", f"{me}/attn/c_proj/kernel", in_dims=2),
                 plain(f"{hf}.attn.c_proj.bias", f"{me}/attn/c_proj/bias"),
                 conv1d(f"{hf}.mlp.c_fc.weight", f"{me}/mlp/c_fc/kernel"),
                 plain(f"{hf}.mlp.c_fc.bias", f"{me}/mlp/c_fc/bias"),
                 conv1d(f"{hf}.mlp.c_proj.weight", f"{me}/mlp/c_proj/kernel"),
                 plain(f"{hf}.mlp.c_proj.bias", f"{me}/mlp/c_proj/bias")]
    return rows
