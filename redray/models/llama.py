"""LLaMA, and the configs that differ from it only by fields: Mistral, Qwen2, Qwen3,
SmolLM3.

Grouped-query attention, RoPE (default, linear, llama3 and YaRN scaling), RMSNorm, gated
MLP, optional biases (Qwen2: on q/k/v), an explicit ``head_dim``, queries and keys
RMS-normalized per head before RoPE (Qwen3: ``q_norm``, ``k_norm``), sliding windows
(Mistral: every layer; Qwen2/Qwen3/SmolLM3: the layers ``layer_types`` names), layers
without rotary embeddings (SmolLM3's NoPE layers, ``no_rope_layers``), tied or untied LM
head. Where layers differ in window or rotary embedding, each gets its own as a scanned
input (``layers.LayerAttention``). Q, K and
V share one kernel (hidden, kv_heads, group + 2, head_dim), gate and up one (hidden, 2,
intermediate) (``layers.qkv_projection``): the automatic rules split whole key/value
groups, and tensor parallelism costs one all-reduce per sublayer and direction.
"""

from __future__ import annotations

from flax import nnx

from redray.models import layers, moe
from redray.models.decoder import CausalLM
from redray.models.hub import HFConfig, gated, linear, plain, qkv
from redray.sharding.tracing import constrain_rows, tracing

# Checkpoints saved from the base model (no LM head class) name tensors without it.
BASE_PREFIX = "model."
IGNORED = (r"rotary_emb\.inv_freq$",)


def _dims(c):
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return heads, getattr(c, "num_key_value_heads", None) or heads, head_dim


def _biases(c) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o) for this config's model type (Qwen2-MoE, whose family
    reuses this attention, names its q/k/v switch ``qkv_bias``)."""
    if c.model_type in ("qwen2", "qwen2_moe"):
        return bool(getattr(c, "qkv_bias", True)), False
    if c.model_type == "glm4_moe":  # GLM-4.5: q/k/v only
        return bool(getattr(c, "attention_bias", False)), False
    bias = bool(getattr(c, "attention_bias", False))
    return bias, bias


def _qk_norm(c) -> bool:
    """Whether queries and keys are RMS-normalized over each head's features before
    RoPE (Qwen3, and Qwen3-MoE, whose family reuses this attention; GLM-4.5 with
    ``use_qk_norm``)."""
    if c.model_type == "glm4_moe":
        return bool(getattr(c, "use_qk_norm", False))
    return c.model_type in ("qwen3", "qwen3_moe")


def _windows(c) -> list:
    """Each layer's sliding window (None: none). Mistral, Mixtral and Qwen3-MoE window
    every layer where the config sets one; the others the layers ``layer_types`` calls
    sliding (SmolLM3: only with ``use_sliding_window``)."""
    n = c.num_hidden_layers
    if c.model_type in ("mistral", "mixtral", "qwen3_moe"):
        return [getattr(c, "sliding_window", None)] * n
    kinds = list(getattr(c, "layer_types", None) or ())[:n] or ["full_attention"] * n
    on = bool(getattr(c, "use_sliding_window", False)) if c.model_type == "smollm3" else True
    return [c.sliding_window if on and kind == "sliding_attention" else None for kind in kinds]


def _attention(c) -> tuple[tuple, tuple]:
    """(the rotary table, each layer's ``layers.LayerAttention``: its window, and no
    rotary embedding where SmolLM3's ``no_rope_layers`` says 0)."""
    heads, kv, d = _dims(c)
    rope = getattr(c, "rope_parameters", None) or {}
    rotary = int(d * rope.get("partial_rotary_factor", 1.0))
    table = (tuple(float(f) for f in layers.rope_inv_freq(
        rope, rotary, getattr(c, "rope_theta", 1e4), c.max_position_embeddings)),
        layers.rope_scale(rope, c.max_position_embeddings))
    uses = list(getattr(c, "no_rope_layers", None) or [1] * c.num_hidden_layers)
    return (table,), tuple(layers.LayerAttention(window=w, rope=0 if uses[i] else None)
                           for i, w in enumerate(_windows(c)))


class Attention(nnx.Module):
    # a learned logit per head that joins each query's softmax (gpt-oss's attention
    # sinks, a parameter of its subclass); None: none
    sinks = None

    def __init__(self, c, *, rngs, dtype):
        heads, kv, d = _dims(c)
        hidden = c.hidden_size
        qkv_bias, o_bias = _biases(c)
        dense = dict(dtype=dtype, rngs=rngs)
        self.qkv_proj = layers.qkv_projection(hidden, heads, kv, d, use_bias=qkv_bias, **dense)
        self.o_proj = nnx.LinearGeneral((heads, d), hidden, axis=(-2, -1), use_bias=o_bias, **dense)
        self.dropout = nnx.Dropout(getattr(c, "attention_dropout", 0.0) or 0.0, rngs=rngs)
        self.scale = d ** -0.5
        self.q_norm, self.k_norm = self.qk_norms(c, dict(epsilon=c.rms_norm_eps, dtype=dtype,
                                                         rngs=rngs))

    def qk_norms(self, c, norm: dict) -> tuple:
        """The query and key norms (``nnx.RMSNorm``'s arguments ``norm``): Qwen3's over
        each head's features, or (None, None)."""
        d = _dims(c)[2]
        return (nnx.RMSNorm(d, **norm), nnx.RMSNorm(d, **norm)) if _qk_norm(c) else (None, None)

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
        q, k, v = layers.split_rotated_qkv(self.qkv_proj(x), cos, sin, layers.rotate_half, norms)
        out, new_cache = layers.self_attention(
            q, k, v, mask, self.scale, cache, cache_index, self.dropout, train,
            sinks=None if self.sinks is None else self.sinks[...])
        return self.o_proj(out), new_cache


class MLP(nnx.Module):
    def __init__(self, c, *, rngs, dtype):
        bias = bool(getattr(c, "mlp_bias", False))
        dense = dict(use_bias=bias, dtype=dtype, rngs=rngs)
        self.gate_up_proj = layers.gated_projection(c.hidden_size, c.intermediate_size, **dense)
        self.down_proj = nnx.Linear(c.intermediate_size, c.hidden_size, **dense)
        self.act = layers.activation(c.hidden_act)

    def __call__(self, x):
        gate_up = constrain_rows(self.gate_up_proj(x), whole=False)
        return self.down_proj(self.act(gate_up[..., 0, :]) * gate_up[..., 1, :])


class Block(nnx.Module):
    """A pre-norm block: attention, then the MLP (or a mixture of experts, whose report
    it returns beside (x, layer_cache)).

    Args:
      c: the ``transformers`` config.
      choices: the windows and chunks a scanned layer may have (``layers.
        attention_choices``), where layers differ in their attention.
      attention, mlp: the classes (called as ``(c, rngs=, dtype=)``) of a family whose
        attention or MLP differs (gpt-oss's sinks; a ``moe.MoE``).
    """

    # the MLP's attribute: Hugging Face's name of it (Llama 4's "feed_forward")
    MLP_NAME = "mlp"

    def __init__(self, c, *, rngs, dtype, choices=((), ()), attention=Attention, mlp=MLP):
        norm = dict(epsilon=c.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.input_layernorm = nnx.RMSNorm(c.hidden_size, **norm)
        self.self_attn = attention(c, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = nnx.RMSNorm(c.hidden_size, **norm)
        setattr(self, self.MLP_NAME, mlp(c, rngs=rngs, dtype=dtype))
        self.choices = choices

    def __call__(self, x, cos, sin, mask, *rest):
        """``rest``: (cache, cache_index, train), after this layer's window, chunk and
        rotary table where layers differ (``layers.layer_view``)."""
        *own, cache, cache_index, train = rest
        if own:
            cos, sin, mask = layers.layer_view(cos, sin, mask, *own, self.choices)
        attn, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache,
                                         cache_index, train)
        x = x + attn
        out, *report = self.mlp_output(self.post_attention_layernorm(x), mask, cache, train)
        return (x + out, new_cache, *report)

    def mlp_output(self, h, mask, cache, train: bool = False) -> tuple:
        """(the MLP's output,), or a mixture of experts' (output, report); a training
        call's assignments are counted for its balancing (``moe.MoE``'s ``balance``)."""
        mlp = getattr(self, self.MLP_NAME)
        if not isinstance(mlp, moe.MoE):
            return (mlp(h),)
        # without a cache the mask's key slots are the tokens: padding counts nowhere
        return mlp(h, mask.kv_valid if cache is None else None,
                   count=train and cache is None and not tracing().uncounted)


class Model(CausalLM):
    """A LLaMA-family causal LM built from a ``transformers`` config (called as
    ``CausalLM`` says). A family built on it names its ``attention`` (rotary tables and
    each layer's ``layers.LayerAttention``) and its ``block``."""

    TOKENS, BLOCKS, FINAL_NORM = "embed_tokens", "layers", "norm"

    @staticmethod
    def attention(c) -> tuple[tuple, tuple]:
        """(the rotary tables, each layer's ``layers.LayerAttention``)."""
        return _attention(c)

    def block(self, c, kind: str, *, rngs, dtype, choices):
        """One layer of ``kind`` (``layer_kinds``)."""
        return Block(c, rngs=rngs, dtype=dtype, choices=choices)

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        self.embed_tokens = layers.Embed(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs,
                                         padding_idx=layers.padding_row(c))
        tables, kinds = self.attention(c)
        choices = layers.attention_choices(kinds)
        self.make_layers(c, lambda kind, r: self.block(c, kind, rngs=r, dtype=dtype,
                                                       choices=choices), rngs, scan)
        self.norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.set_attention(tables, kinds)

    def key_value_heads(self) -> tuple[int, int]:
        _, kv, d = _dims(self.config)
        return kv, d

    def embed(self, input_ids, positions, train: bool):
        return self.embed_tokens(input_ids)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = config.hf if isinstance(config, HFConfig) else config
    mlp_bias = bool(getattr(c, "mlp_bias", False))
    rows = head_rows(c)
    for i in range(c.num_hidden_layers):
        hf, me = f"model.layers.{i}", f"layers/{i}"
        rows += attention_rows(c, i)
        rows += gated((f"{hf}.mlp.gate_proj", f"{hf}.mlp.up_proj"), f"{me}/mlp/gate_up_proj",
                      bias=mlp_bias)
        rows.append(linear(f"{hf}.mlp.down_proj.weight", f"{me}/mlp/down_proj/kernel"))
        if mlp_bias:
            rows.append(plain(f"{hf}.mlp.down_proj.bias", f"{me}/mlp/down_proj/bias"))
    return rows


def head_rows(c) -> list:
    """The rows of the token embedding, the final norm and (untied) the LM head."""
    rows = [plain("model.embed_tokens.weight", "embed_tokens/embedding"),
            plain("model.norm.weight", "norm/scale")]
    if not getattr(c, "tie_word_embeddings", False):
        rows.append(linear("lm_head.weight", "lm_head/kernel"))
    return rows


def attention_rows(c, i: int) -> list:
    """The rows of layer ``i``'s two norms and its attention (Q, K and V in one kernel,
    the output, their biases, Qwen3's per-head norms)."""
    qkv_bias, o_bias = _biases(c)
    heads, kv, _ = _dims(c)
    hf, me = f"model.layers.{i}", f"layers/{i}"
    rows = [plain(f"{hf}.input_layernorm.weight", f"{me}/input_layernorm/scale"),
            plain(f"{hf}.post_attention_layernorm.weight",
                  f"{me}/post_attention_layernorm/scale")]
    rows += qkv(tuple(f"{hf}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")),
                f"{me}/self_attn/qkv_proj", heads, kv, bias=qkv_bias)
    if _qk_norm(c):
        rows += [plain(f"{hf}.self_attn.{n}.weight", f"{me}/self_attn/{n}/scale")
                 for n in ("q_norm", "k_norm")]
    rows.append(linear(f"{hf}.self_attn.o_proj.weight", f"{me}/self_attn/o_proj/kernel",
                       in_dims=2))
    if o_bias:
        rows.append(plain(f"{hf}.self_attn.o_proj.bias", f"{me}/self_attn/o_proj/bias"))
    return rows
