"""DeepSeek-V3 (and R1, and Kimi-K2, whose ``kimi_k2`` configs are DeepSeek-V3's
architecture under another name): multi-head latent attention (MLA) in blocks whose
MLP is DeepSeek's mixture of experts after a dense prefix (``mixtral``'s, routed as
``moe.MoE(scoring="sigmoid")`` does: sigmoid scores, a correction bias for the choice
only, the ``topk_group`` best of ``n_group`` groups, ``routed_scaling_factor``; shared
experts added ungated; the first ``first_k_dense_replace`` layers dense).

Latent attention (arXiv 2405.04434, section 2.1): each head's query is
``q_nope`` (``qk_nope_head_dim``) and ``q_rot`` (``qk_rope_head_dim``), through a
low-rank path (``q_a_proj``, its norm, ``q_b_proj``) or a plain ``q_proj`` where
``q_lora_rank`` is null. Keys and values come from one compressed latent per token:
``kv_a_proj_with_mqa`` gives ``c`` (``kv_lora_rank``, normalized by
``kv_a_layernorm``) and a rotary key part ``k_rot`` shared by every head;
``kv_b_proj`` lifts ``c`` to each head's ``k_nope`` and value (``v_head_dim``). A
head's key is ``[k_nope, k_rot]``: query and key heads are wider (192 in the release)
than the values (128). The softmax scale is ``qk_head_dim ** -0.5`` times YaRN's
``mscale_all_dim`` factor squared; the rotary dims pair interleaved (``rope_interleave``).

Two forms compute the same attention:

- Without a cache (training, scoring) each head's keys and values are expanded, and the
  values padded with zeros to the key width so that every attention implementation
  (cuDNN's, splash, the blocks, the context axis's) takes them as it takes any
  attention's; the padding's output columns are dropped (as ``transformers`` pads for
  its flash attention). The heads split over the model axis as any attention's do.
- With a cache (decoding) the cache holds the latent: per token and layer one key of
  ``kv_lora_rank + qk_rope_head_dim`` values (``[c, k_rot]``) and the same as its value,
  the KV cache of one key/value head (``key_value_heads``) where a per-head cache holds
  ``heads x (qk_head_dim + v_head_dim)``. ``kv_b_proj``'s key part is absorbed into the
  queries (``q_nope`` mapped into the latent) and its value part applied to each head's
  output, so decoding is multi-query attention over the latent (the paper's appendix C):
  every cache layout (contiguous, paged) and the Sampler take it unchanged.

Checkpoints name tensors as ``transformers`` writes them; multi-token prediction layers
(``model.layers.<num_hidden_layers + i>``, ``num_nextn_predict_layers`` of them) are left
out with a console line (``left_out``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redray.models import layers, llama, lora, mixtral
from redray.models.hub import HFConfig, linear, plain

BASE_PREFIX = llama.BASE_PREFIX
IGNORED = llama.IGNORED
# the norms inside the latent path: ``transformers``' DeepseekV3RMSNorm's default epsilon,
# not the config's ``rms_norm_eps``
LATENT_EPS = 1e-6


def softmax_scale(c) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's factor of ``mscale_all_dim`` squared where the
    rotary embedding is scaled (``transformers``' ``yarn_apply_mscale``)."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= layers.yarn_mscale(layers._yarn_factor(rope, c.max_position_embeddings),
                              rope["mscale_all_dim"]) ** 2
    return scale


def _kernel(layer, dtype):
    """A linear layer's kernel in ``dtype``, a LoRA's update folded in."""
    kernel = layer.kernel() if isinstance(layer, lora.LoRA) else layer.kernel[...]
    return kernel.astype(dtype)


class Attention(nnx.Module):
    """Multi-head latent attention (see the module docstring), called as
    ``llama.Attention``."""

    def __init__(self, c, *, rngs, dtype):
        heads, hidden = c.num_attention_heads, c.hidden_size
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.latent, self.dtype = c.kv_lora_rank, dtype
        bias = bool(getattr(c, "attention_bias", False))
        dense = dict(dtype=dtype, rngs=rngs)
        norm = dict(epsilon=LATENT_EPS, **dense)
        width = self.nope + self.rope
        if c.q_lora_rank is None:
            self.q_proj = nnx.LinearGeneral(hidden, (heads, width), use_bias=False, **dense)
        else:
            self.q_a_proj = nnx.Linear(hidden, c.q_lora_rank, use_bias=bias, **dense)
            self.q_a_layernorm = nnx.RMSNorm(c.q_lora_rank, **norm)
            self.q_b_proj = nnx.LinearGeneral(c.q_lora_rank, (heads, width), use_bias=False,
                                              **dense)
        self.kv_a_proj_with_mqa = nnx.Linear(hidden, self.latent + self.rope, use_bias=bias,
                                             **dense)
        self.kv_a_layernorm = nnx.RMSNorm(self.latent, **norm)
        self.kv_b_proj = nnx.LinearGeneral(self.latent, (heads, self.nope + self.v_dim),
                                           use_bias=False, **dense)
        self.o_proj = nnx.LinearGeneral((heads, self.v_dim), hidden, axis=(-2, -1),
                                        use_bias=bias, **dense)
        self.dropout = nnx.Dropout(getattr(c, "attention_dropout", 0.0) or 0.0, rngs=rngs)
        self.scale = softmax_scale(c)
        self.interleaved = bool(getattr(c, "rope_interleave", True))

    def _rotate(self, x, cos, sin):
        rotate = layers.rotate_interleaved if self.interleaved else layers.rotate_half
        return rotate(x, cos, sin)

    def queries(self, x):
        """Each head's query (batch, seq, heads, qk_head_dim)."""
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        q = self.queries(x)
        q_nope, q_rot = q[..., :self.nope], self._rotate(q[..., self.nope:], cos, sin)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :self.latent])
        k_rot = self._rotate(compressed[..., None, self.latent:], cos, sin)  # one head
        if cache is None:
            out = self._expanded(q_nope, q_rot, latent, k_rot, mask, train)
        else:
            out, cache = self._absorbed(q_nope, q_rot, latent, k_rot, mask, cache,
                                        cache_index, train)
        return self.o_proj(out), cache

    def _expanded(self, q_nope, q_rot, latent, k_rot, mask, train):
        """Attention over every head's keys and values from the latent (no cache)."""
        kv = self.kv_b_proj(latent)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        heads = k_nope.shape[2]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(
            k_rot, (*k_rot.shape[:2], heads, self.rope)).astype(k_nope.dtype)], -1)
        q = jnp.concatenate([q_nope, q_rot.astype(q_nope.dtype)], -1)
        # the values as wide as the keys, for every implementation's single head size
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - self.v_dim)))
        out, _ = layers.self_attention(q, k, v, mask, self.scale, None, 0, self.dropout, train)
        return out[..., :self.v_dim]

    def _absorbed(self, q_nope, q_rot, latent, k_rot, mask, cache, cache_index, train):
        """Multi-query attention over the cached latent, ``kv_b_proj`` folded into the
        queries (its key part) and the output (its value part)."""
        lift = _kernel(self.kv_b_proj, q_nope.dtype)  # (latent, heads, nope + v)
        q = jnp.concatenate([jnp.einsum("bshn,lhn->bshl", q_nope, lift[..., :self.nope]),
                             q_rot.astype(q_nope.dtype)], -1)
        key = jnp.concatenate([latent[:, :, None], k_rot.astype(latent.dtype)], -1)
        out, cache = layers.self_attention(q, key, key, mask, self.scale, cache, cache_index,
                                           self.dropout, train)
        return jnp.einsum("bshl,lhv->bshv", out[..., :self.latent].astype(lift.dtype),
                          lift[..., self.nope:]), cache


class Model(mixtral.Model):
    """A DeepSeek-V3 causal LM built from a ``transformers`` config (called as
    ``CausalLM`` says; ``aux=True`` adds the router's auxiliary outputs): LLaMA's blocks
    with latent attention, dense MLPs in the first ``first_k_dense_replace`` layers and
    experts after them."""

    def block(self, c, kind: str, *, rngs, dtype, choices):
        return llama.Block(c, rngs=rngs, dtype=dtype, choices=choices, attention=Attention,
                           mlp=mixtral._moe if kind == "moe" else llama.MLP)

    def key_value_heads(self) -> tuple[int, int]:
        c = self.config.hf
        return 1, c.kv_lora_rank + c.qk_rope_head_dim


trace_inputs = layers.causal_lm_inputs


def left_out(config) -> tuple[str, tuple[str, ...]]:
    """(what, the prefixes) of the checkpoint's tensors a load leaves out: its
    multi-token prediction layers (``num_nextn_predict_layers`` after the model's own),
    which redray neither trains nor decodes with (an export writes none, and sets the
    field to 0)."""
    c = config.hf if isinstance(config, HFConfig) else config
    first, extra = c.num_hidden_layers, getattr(c, "num_nextn_predict_layers", 0) or 0
    return ("its multi-token prediction layers (num_nextn_predict_layers: redray trains "
            "and decodes the next token only)",
            tuple(f"model.layers.{i}." for i in range(first, first + extra)))


def attention_rows(c, i: int) -> list:
    """Layer ``i``'s latent attention, as ``transformers`` names it."""
    hf, me = f"model.layers.{i}.self_attn", f"layers/{i}/self_attn"
    bias = bool(getattr(c, "attention_bias", False))
    names = ["kv_a_proj_with_mqa", "o_proj"]
    if c.q_lora_rank is None:
        rows = [linear(f"{hf}.q_proj.weight", f"{me}/q_proj/kernel")]
    else:
        rows = [linear(f"{hf}.q_a_proj.weight", f"{me}/q_a_proj/kernel"),
                plain(f"{hf}.q_a_layernorm.weight", f"{me}/q_a_layernorm/scale"),
                linear(f"{hf}.q_b_proj.weight", f"{me}/q_b_proj/kernel")]
        names.append("q_a_proj")
    rows += [linear(f"{hf}.kv_a_proj_with_mqa.weight", f"{me}/kv_a_proj_with_mqa/kernel"),
             plain(f"{hf}.kv_a_layernorm.weight", f"{me}/kv_a_layernorm/scale"),
             linear(f"{hf}.kv_b_proj.weight", f"{me}/kv_b_proj/kernel"),
             linear(f"{hf}.o_proj.weight", f"{me}/o_proj/kernel", in_dims=2)]
    if bias:
        rows += [plain(f"{hf}.{n}.bias", f"{me}/{n}/bias") for n in names]
    return rows


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths: the mixture of experts'
    (``mixtral.weight_table``), its attention rows replaced by latent attention's."""
    c = config.hf if isinstance(config, HFConfig) else config
    rows = [row for row in mixtral.weight_table(c) if "/self_attn/" not in row.path]
    for i in range(c.num_hidden_layers):
        rows += attention_rows(c, i)
    return rows
