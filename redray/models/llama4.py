"""Llama 4 (text): chunked attention beside NoPE layers, and experts beside dense MLPs.

What differs from LLaMA, layer by layer (``no_rope_layers``: 1 for a rotary layer, 0 for
a NoPE one):

* a rotary layer rotates queries and keys in the interleaved-pair form (dimensions 2i
  and 2i+1, ``layers.rotate_interleaved``), then, with ``use_qk_norm``, normalizes each
  head's query and key by its root mean square (no weights); it attends inside chunks of
  ``attention_chunk_size`` tokens (``layer_types``: "chunked_attention");
* a NoPE layer has no rotary embedding and attends to every earlier token; with
  ``attn_temperature_tuning`` its queries are scaled by ``1 + attn_scale *
  log1p(floor((slot + 1) / floor_scale))``, the slot being the query's index in the
  sequence or the KV cache, as ``transformers`` computes it (a paged cache's rows have
  no padding: their positions);
* the MLP (``feed_forward``) of the layers ``moe_layers`` names is a mixture of experts
  with a shared expert: a router picks the top ``num_experts_per_tok`` (1) experts by
  logit, their sigmoid scales the token before the expert (``moe.MoE``'s
  ``sigmoid_inputs``), and a gated MLP every token runs through is added (``mixtral.
  SharedExpertMoE``, ungated); the other layers have a gated MLP of width
  ``intermediate_size_mlp``. Dense and MoE layers in turn stack as one period
  (``layers.LayerPattern``).

Checkpoints store each layer's experts as one tensor, gate then up along the last axis
(``feed_forward.experts.gate_up_proj``: (experts, hidden, 2 x inner)). The released
checkpoints are multimodal (``llama4``): the hub reads their language model
(``language_model.*``), leaves the vision tower out, and exports a text checkpoint
(``families.FAMILIES["llama4"]``).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx

from redray.models import layers, llama, mixtral, moe, paged, slices
from redray.models.hub import HFConfig, Tensor, gated, linear, plain

BASE_PREFIX = llama.BASE_PREFIX
IGNORED = llama.IGNORED


def _kinds(c) -> tuple[str, ...]:
    """Each layer's MLP: "moe" where ``moe_layers`` names it, else "dense"."""
    moe_layers = set(c.moe_layers or ())
    return tuple("moe" if i in moe_layers else "dense" for i in range(c.num_hidden_layers))


def _rotary(c) -> list[bool]:
    """Whether each layer rotates (``no_rope_layers``: 1) or is a NoPE layer (0)."""
    return [bool(r) for r in list(c.no_rope_layers)[:c.num_hidden_layers]]


def _attention(c) -> tuple[tuple, tuple]:
    """(the rotary table, each layer's ``layers.LayerAttention``: a rotary layer's chunk,
    a NoPE layer's want of a table)."""
    _, _, d = llama._dims(c)
    rope = getattr(c, "rope_parameters", None) or {}
    table = (tuple(float(f) for f in layers.rope_inv_freq(rope, d, 5e5,
                                                          c.max_position_embeddings)),
             layers.rope_scale(rope, c.max_position_embeddings))
    kinds = list(c.layer_types)[:c.num_hidden_layers]
    return (table,), tuple(
        layers.LayerAttention(chunk=c.attention_chunk_size if kind == "chunked_attention"
                              else None, rope=0 if rotary else None)
        for kind, rotary in zip(kinds, _rotary(c)))


def _l2_norm(x, eps: float):
    """Each vector over its last axis divided by its root mean square (float32)."""
    y = x.astype(jnp.float32)
    return (y * jax.lax.rsqrt(jnp.mean(jnp.square(y), -1, keepdims=True) + eps)).astype(x.dtype)


class Attention(llama.Attention):
    """LLaMA's attention, rotated in interleaved pairs, with the weightless q/k norm of
    rotary layers and the temperature scale of NoPE layers."""

    def __init__(self, c, *, rngs, dtype):
        super().__init__(c, rngs=rngs, dtype=dtype)
        self.qk_norm = c.rms_norm_eps if c.use_qk_norm else None

    def __call__(self, x, cos, sin, mask, temperature, rotary, cache, cache_index, train):
        """``temperature``: (rows or 1, tokens) scales of a NoPE layer's queries (None:
        no tuning); ``rotary``: whether this layer rotates (a bool, or a scanned
        layer's traced one); ``cos``/``sin``: its table (identity in a NoPE layer)."""
        q, k, v = layers.split_rotated_qkv(self.qkv_proj(x), cos, sin,
                                           layers.rotate_interleaved)
        if self.qk_norm is not None:
            q = jnp.where(rotary, _l2_norm(q, self.qk_norm), q)
            k = jnp.where(rotary, _l2_norm(k, self.qk_norm), k)
        if temperature is not None:
            tuned = (q * temperature[..., None, None].astype(q.dtype)).astype(q.dtype)
            q = jnp.where(rotary, q, tuned)
        out, new_cache = layers.self_attention(q, k, v, mask, self.scale, cache, cache_index,
                                               self.dropout, train)
        return self.o_proj(out), new_cache


def _experts(c, *, rngs, dtype) -> moe.MoE:
    return mixtral.SharedExpertMoE(
        c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
        shared=c.intermediate_size, act=c.hidden_act, gated=False, sigmoid_inputs=True,
        renormalize=False, float32_weights=False, dtype=dtype, rngs=rngs)


def _dense(c, *, rngs, dtype) -> llama.MLP:
    """A dense layer's gated MLP, ``intermediate_size_mlp`` wide."""
    fields = types.SimpleNamespace(hidden_size=c.hidden_size, hidden_act=c.hidden_act,
                                   intermediate_size=c.intermediate_size_mlp)
    return llama.MLP(fields, rngs=rngs, dtype=dtype)


class Block(llama.Block):
    """LLaMA's pre-norm block with Llama 4's attention, its MLP or experts (``kind``)
    under Hugging Face's name (``feed_forward``)."""

    MLP_NAME = "feed_forward"

    def __init__(self, c, kind: str, *, rngs, dtype, choices):
        super().__init__(c, rngs=rngs, dtype=dtype, choices=choices, attention=Attention,
                         mlp=_experts if kind == "moe" else _dense)
        self.nope = len(_attention(c)[0])  # the identity table's index (layers.layer_inputs)

    def __call__(self, x, cos, sin, mask, temperature, window, chunk, rope, cache,
                 cache_index, train):
        cos, sin, mask = layers.layer_view(cos, sin, mask, window, chunk, rope, self.choices)
        attn, new_cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, temperature,
                                         rope != self.nope, cache, cache_index, train)
        x = x + attn
        out, *report = self.mlp_output(self.post_attention_layernorm(x), mask, cache)
        return (x + out, new_cache, *report)


class Model(llama.Model):
    """A Llama 4 (text) causal LM built from a ``transformers`` config (called as
    ``CausalLM`` says; ``aux=True`` adds the router's auxiliary outputs where it has
    experts)."""

    REPORTS = True
    LAYER_INDEX_FIELDS = ("moe_layers",)
    attention = staticmethod(_attention)

    @classmethod
    def layer_kinds(cls, c) -> tuple[str, ...]:
        return _kinds(c)

    def block(self, c, kind: str, *, rngs, dtype, choices):
        return Block(c, kind, rngs=rngs, dtype=dtype, choices=choices)

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        super().build_parts(c, rngs=rngs, dtype=dtype, scan=scan)
        # every layer gets its own chunk and table, whatever the config
        self.rope_tables, self.layer_attention = _attention(c)
        self.temperature = (float(c.floor_scale), float(c.attn_scale)) \
            if c.attn_temperature_tuning else None

    def block_inputs(self, positions, mask, cache_index=0) -> tuple[tuple, tuple]:
        (cos, sin, mask), per_layer = super().block_inputs(positions, mask, cache_index)
        scales = None
        if self.temperature is not None:
            floor, strength = self.temperature
            slots = positions if paged.is_paged(cache_index) else mask.q_slots[None]
            scales = jnp.log1p(jnp.floor((slots.astype(jnp.float32) + 1.0) / floor)) \
                * strength + 1.0
        return (cos, sin, mask, scales), per_layer

    def auxiliary(self, reports: dict) -> dict:
        if reports is None:
            raise ValueError("aux=True: this llama4_text config has no mixture-of-experts "
                             "layer (moe_layers is empty)")
        return moe.summarize(reports, self.config.num_local_experts)


trace_inputs = layers.causal_lm_inputs


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths: LLaMA's attention, and each
    layer's dense MLP or experts with their shared expert (``feed_forward``)."""
    c = config.hf if isinstance(config, HFConfig) else config
    rows = llama.head_rows(c)
    for i, kind in enumerate(_kinds(c)):
        rows += llama.attention_rows(c, i)
        theirs, ours = f"model.layers.{i}.feed_forward", f"layers/{i}/feed_forward"
        if kind == "dense":
            rows += gated((f"{theirs}.gate_proj", f"{theirs}.up_proj"), f"{ours}/gate_up_proj")
            rows.append(linear(f"{theirs}.down_proj.weight", f"{ours}/down_proj/kernel"))
            continue
        shared = f"{theirs}.shared_expert"
        rows += [linear(f"{theirs}.router.weight", f"{ours}/router/kernel"),
                 Tensor(f"{theirs}.experts.gate_up_proj", f"{ours}/gate_up_proj",
                        lambda w, shape: w.reshape(shape),  # gate, then up
                        lambda k: k.reshape(*k.shape[:-2], -1), view=slices.reshape_view),
                 plain(f"{theirs}.experts.down_proj", f"{ours}/down_proj"),
                 linear(f"{shared}.down_proj.weight", f"{ours}/shared_expert/down_proj/kernel")]
        rows += gated((f"{shared}.gate_proj", f"{shared}.up_proj"),
                      f"{ours}/shared_expert/gate_up_proj")
    return rows
