"""gpt-oss: LLaMA's decoder with attention sinks and biased, clamped experts.

What differs from Mixtral: every attention projection has a bias; each head has a
learned sink, a logit that joins its softmax as one more key and is dropped after
(``self_attn.sinks``, ``attention.attend``'s ``sinks``); layers alternate sliding-window
and full attention (``layer_types``); RoPE is YaRN-scaled (``rope_parameters``). The
router has a bias and picks the top k of its logits, weighed by their softmax; each
expert has biases on its gate/up and down projections and a clamped SwiGLU: gate
clamped from above at ``swiglu_limit``, up at +-``swiglu_limit``, then
``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` (``moe.MoE``'s ``clamp``).
Checkpoints store each layer's experts as one tensor with gate and up interleaved
along the last axis (``mlp.experts.gate_up_proj``: (experts, hidden, 2 x inner), gate
at the even places); here they are (experts, hidden, 2, inner). The released
checkpoints hold the experts in MXFP4 (``*_blocks`` / ``*_scales``), which the hub
dequantizes as it reads them (``redray/models/mxfp4.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redray.models import layers, llama, mixtral, moe, slices
from redray.models.hub import HFConfig, Tensor, linear, plain

BASE_PREFIX = llama.BASE_PREFIX
IGNORED = llama.IGNORED


class Attention(llama.Attention):
    """LLaMA's attention (biases on every projection) with a sink per head."""

    def __init__(self, c, *, rngs, dtype):
        super().__init__(c, rngs=rngs, dtype=dtype)
        self.sinks = nnx.Param(jnp.zeros((c.num_attention_heads,), jnp.float32))


def _experts(c, *, rngs, dtype) -> moe.MoE:
    return moe.MoE(c.hidden_size, c.intermediate_size, c.num_local_experts,
                   c.num_experts_per_tok, renormalize=True, float32_weights=False,
                   router_bias=True, expert_bias=True,
                   clamp=(float(c.swiglu_alpha), float(c.swiglu_limit)), dtype=dtype,
                   rngs=rngs)


class Model(mixtral.Model):
    """A gpt-oss causal LM built from a ``transformers`` config (called as ``CausalLM``
    says; ``aux=True`` adds the router's auxiliary outputs)."""

    @classmethod
    def layer_kinds(cls, c) -> tuple[str, ...]:
        return ("moe",) * c.num_hidden_layers

    def block(self, c, kind: str, *, rngs, dtype, choices):
        return llama.Block(c, rngs=rngs, dtype=dtype, choices=choices, attention=Attention,
                           mlp=_experts)

    def auxiliary(self, reports: dict) -> dict:
        return moe.summarize(reports, self.config.num_local_experts)


trace_inputs = layers.causal_lm_inputs


def _interleaved(hf: str, path: str) -> Tensor:
    """A tensor whose last axis holds gate and up in turn (gate at even places), as
    redray's (..., 2, inner)."""
    return Tensor(hf, path,
                  lambda w, shape: w.reshape(*w.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(shape),
                  lambda k: k.swapaxes(-1, -2).reshape(*k.shape[:-2], -1),
                  view=slices.interleaved_view)


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths: LLaMA's attention (every
    projection biased) with its sinks, the router with its bias, and the experts' four
    stacked tensors."""
    c = config.hf if isinstance(config, HFConfig) else config
    rows = [row for row in llama.weight_table(c) if "/mlp/" not in row.path]
    for i in range(c.num_hidden_layers):
        hf, me = f"model.layers.{i}", f"layers/{i}"
        experts = f"{hf}.mlp.experts"
        rows += [plain(f"{hf}.self_attn.sinks", f"{me}/self_attn/sinks"),
                 linear(f"{hf}.mlp.router.weight", f"{me}/mlp/router/kernel"),
                 plain(f"{hf}.mlp.router.bias", f"{me}/mlp/router/bias"),
                 _interleaved(f"{experts}.gate_up_proj", f"{me}/mlp/gate_up_proj"),
                 _interleaved(f"{experts}.gate_up_proj_bias", f"{me}/mlp/gate_up_bias"),
                 plain(f"{experts}.down_proj", f"{me}/mlp/down_proj"),
                 plain(f"{experts}.down_proj_bias", f"{me}/mlp/down_bias")]
    return rows
