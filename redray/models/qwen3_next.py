"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid decoders of linear and gated attention.

Each layer's token mixer is what ``layer_types`` says: a Gated DeltaNet linear attention
("linear_attention", three of every four layers in the released configs;
``redray/models/gated_delta.py``) or a gated full attention ("full_attention"): LLaMA's
grouped-query attention with queries and keys RMS-normalized per head, a rotary
embedding on the first ``partial_rotary_factor`` of each head's features, and the
output gated per feature by sigmoid of a second half of the query projection. Every
norm is zero-centred (``x / rms(x) * (1 + w)``, Gemma's) except the linear attention's
gated output norm. The MLP is dense (Qwen3.5) or a mixture of experts with a shared
expert weighed by sigmoid(``shared_expert_gate``(x)) (Qwen3-Next, whose
``mlp_only_layers`` and ``decoder_sparse_step`` may keep some layers dense, and
Qwen3.5-MoE). Layers stack by their pattern (``layers.LayerPattern``: one period of
linear and full layers, scanned).

Checkpoints differ in the linear attention's projections: Qwen3-Next groups them by key
head (``in_proj_qkvz``: each key head's query, key, values and output gates;
``in_proj_ba``), which is redray's layout; Qwen3.5 keeps them apart (``in_proj_qkv``
with the query, key and value channels of every head in turn, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), permuted by key head on load and back on export. The
convolution's channels (the [q | k | v] order in both) are permuted the same way. The
gated attention's query projection holds each head's query then its gate; here the
gates sit beside the queries of their key/value group in the one QKV kernel (hidden,
kv heads, 2 x group + 2, head dim). The vision-language checkpoints (``qwen3_5``,
``qwen3_5_moe``) are read as their language model (``families.FAMILIES``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redray.models import gated_delta, gemma, layers, llama, mixtral, moe, paged
from redray.models.hub import HFConfig, Tensor, fused, gated, linear, plain

BASE_PREFIX = llama.BASE_PREFIX
IGNORED = llama.IGNORED + (r"^mtp\.",)  # the multi-token-prediction head, not loaded


def _kinds(c) -> tuple[str, ...]:
    """Each layer's "mixer-mlp": mixer "linear" or "full" (``layer_types``), MLP "dense"
    or "moe" (as ``transformers`` builds them)."""
    mixers = ["linear" if kind == "linear_attention" else "full"
              for kind in list(c.layer_types)[:c.num_hidden_layers]]
    if c.model_type == "qwen3_5_text":
        mlps = ["dense"] * c.num_hidden_layers
    elif c.model_type == "qwen3_5_moe_text":
        mlps = ["moe"] * c.num_hidden_layers
    else:
        dense = set(c.mlp_only_layers or ())
        mlps = ["dense" if i in dense or not c.num_experts or (i + 1) % c.decoder_sparse_step
                else "moe" for i in range(c.num_hidden_layers)]
    return tuple(f"{m}-{p}" for m, p in zip(mixers, mlps))


def _check(c) -> None:
    """Refuses what no released config sets and this family does not implement."""
    if getattr(c, "attention_bias", False):
        raise ValueError(f"{c.model_type} config: attention_bias=True is not implemented (no "
                         "released Qwen3-Next or Qwen3.5 config sets it); set it to False")
    kinds = set(c.layer_types[:c.num_hidden_layers])
    if kinds - {"linear_attention", "full_attention"}:
        raise ValueError(f"{c.model_type} config: layer_types {sorted(kinds)}: each layer is "
                         "'linear_attention' or 'full_attention'")


def _linear_dims(c) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key dim, value dim) of the linear layers."""
    return (c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads,
            c.linear_key_head_dim, c.linear_value_head_dim)


class Attention(nnx.Module):
    """The gated full attention (see the module docstring)."""

    def __init__(self, c, *, rngs, dtype):
        heads, kv, d = llama._dims(c)
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.qkv_proj = nnx.LinearGeneral(c.hidden_size, (kv, 2 * (heads // kv) + 2, d), **dense)
        self.o_proj = nnx.LinearGeneral((heads, d), c.hidden_size, axis=(-2, -1), **dense)
        self.q_norm = gemma.RMSNorm(d, c.rms_norm_eps)
        self.k_norm = gemma.RMSNorm(d, c.rms_norm_eps)
        self.dropout = nnx.Dropout(getattr(c, "attention_dropout", 0.0) or 0.0, rngs=rngs)
        self.scale = d ** -0.5

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        y = self.qkv_proj(x)  # (b, t, kv, 2g + 2, d)
        g = (y.shape[-2] - 2) // 2
        heads = lambda a: a.reshape(*a.shape[:-3], -1, a.shape[-1])  # noqa: E731
        q, gate = heads(y[..., :g, :]), heads(y[..., g:2 * g, :])
        q = layers.rotate_half(self.q_norm(q), cos, sin)
        k = layers.rotate_half(self.k_norm(y[..., 2 * g, :]), cos, sin)
        out, new_cache = layers.self_attention(q, k, y[..., 2 * g + 1, :], mask, self.scale,
                                               cache, cache_index, self.dropout, train)
        return self.o_proj(out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
                           ), new_cache


def _linear_attention(c, *, rngs, dtype) -> gated_delta.GatedDeltaNet:
    key_heads, r, dk, dv = _linear_dims(c)
    return gated_delta.GatedDeltaNet(c.hidden_size, key_heads, key_heads * r, dk, dv,
                                     c.linear_conv_kernel_dim, c.rms_norm_eps, rngs=rngs,
                                     dtype=dtype, act=c.hidden_act)


def _moe(c, *, rngs, dtype) -> mixtral.SharedExpertMoE:
    renormalize = c.model_type == "qwen3_5_moe_text" or bool(getattr(c, "norm_topk_prob", True))
    return mixtral.SharedExpertMoE(
        c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
        shared=c.shared_expert_intermediate_size, act=c.hidden_act, renormalize=renormalize,
        float32_weights=False, dtype=dtype, rngs=rngs)


class Block(nnx.Module):
    """A pre-norm layer: its token mixer (``linear_attn`` or ``self_attn``), then its MLP
    (dense, or experts whose report it returns beside (x, layer_cache))."""

    MLP_NAME = "mlp"
    mlp_output = llama.Block.mlp_output

    def __init__(self, c, kind: str, *, rngs, dtype):
        mixer, mlp = kind.split("-")
        self.input_layernorm = gemma.RMSNorm(c.hidden_size, c.rms_norm_eps)
        if mixer == "linear":
            self.linear_attn = _linear_attention(c, rngs=rngs, dtype=dtype)
        else:
            self.self_attn = Attention(c, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = gemma.RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _moe(c, rngs=rngs, dtype=dtype) if mlp == "moe" else \
            llama.MLP(c, rngs=rngs, dtype=dtype)

    def __call__(self, x, cos, sin, mask, cache, cache_index, train):
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            out, new_cache = self.linear_attn(h, mask, cache, cache_index)
        else:
            out, new_cache = self.self_attn(h, cos, sin, mask, cache, cache_index, train)
        x = x + out
        out, *report = self.mlp_output(self.post_attention_layernorm(x), mask, cache)
        return (x + out, new_cache, *report)


class Model(mixtral.Model):
    """A Qwen3-Next or Qwen3.5 (dense or MoE) causal LM built from a ``transformers``
    config (called as ``CausalLM`` says; ``aux=True`` adds the routers' auxiliary
    outputs where layers have experts). Its cache holds, per layer, a full attention's
    keys and values or a linear attention's state (``init_cache``)."""

    # layers with a state in place of a KV cache: a paged cache holds it per row (slot)
    RECURRENT_LAYERS = True

    @classmethod
    def layer_kinds(cls, c) -> tuple[str, ...]:
        return _kinds(c)

    def block(self, c, kind: str, *, rngs, dtype, choices):
        return Block(c, kind, rngs=rngs, dtype=dtype)

    def build_parts(self, c, *, rngs: nnx.Rngs, dtype, scan: bool):
        _check(c)
        super().build_parts(c, rngs=rngs, dtype=dtype, scan=scan)
        self.norm = gemma.RMSNorm(c.hidden_size, c.rms_norm_eps)

    def init_cache(self, batch: int, length: int, dtype=None):
        """An empty cache for ``batch`` rows of up to ``length`` tokens: a full attention
        layer's {"k", "v"} (``layers.empty_cache``), a linear one's {"conv", "state"}
        (its convolution's last inputs and its delta-rule state, float32)."""
        kv_heads, head_dim = self.key_value_heads()
        return self._per_layer(batch, dtype, lambda dtype: layers.empty_cache(
            1, batch, length, kv_heads, head_dim, dtype)[0])

    def init_pages(self, pages: int, page_size: int = paged.PAGE_SIZE, dtype=None,
                   rows: int | None = None):
        """An empty paged cache: a full attention layer's pool of ``pages`` pages
        (``paged.empty_pool``), a linear one's {"conv", "state"} for each of ``rows``
        rows (a Sampler's slots: the row of a call is its slot; a prefill writes a
        slot's state whole, which resets it)."""
        if rows is None:
            raise ValueError(f"{self.config.model_type}: its linear-attention layers keep a "
                             "state per row beside the pages: give init_pages(..., rows=) "
                             "the rows (slots) the calls decode")
        kv_heads, head_dim = self.key_value_heads()
        return self._per_layer(rows, dtype, lambda dtype: paged.empty_pool(
            1, pages, kv_heads, head_dim, dtype, page_size)[0])

    def _per_layer(self, rows: int, dtype, attention) -> list[dict]:
        """A cache per layer: a linear one's empty state for ``rows`` rows, a full
        attention one's ``attention(dtype)``."""
        c, dtype = self.config.hf, dtype or self.dtype
        return [gated_delta.empty_state(rows, _linear_dims(c), c.linear_conv_kernel_dim, dtype)
                if kind.startswith("linear") else attention(dtype) for kind in _kinds(c)]


trace_inputs = layers.causal_lm_inputs


# ------------------------------------------------------------------ weights
def _q_gate(heads: int, kv: int, d: int) -> tuple:
    """(load, save) of a query projection holding each head's query then its gate
    (heads x 2d, hidden) as redray's part (hidden, kv, 2g, d): a group's queries, then
    their gates."""
    g = heads // kv

    def load(w, shape):
        return w.T.reshape(-1, kv, g, 2, d).swapaxes(2, 3).reshape(shape)

    def save(k):
        return k.reshape(-1, kv, 2, g, d).swapaxes(2, 3).reshape(k.shape[0], -1).T
    return load, save


def _by_key_head(a: np.ndarray, key_heads: int, dk: int) -> np.ndarray:
    """Channels [every query | every key | every value] (last axis) as (key heads, its
    query, key and values)."""
    lead, n = a.shape[:-1], key_heads * dk
    return np.concatenate([a[..., :n].reshape(*lead, key_heads, dk),
                           a[..., n:2 * n].reshape(*lead, key_heads, dk),
                           a[..., 2 * n:].reshape(*lead, key_heads, -1)], -1)


def _channels(a: np.ndarray, dk: int) -> np.ndarray:
    """``_by_key_head`` undone."""
    lead = a.shape[:-2]
    return np.concatenate([a[..., :dk].reshape(*lead, -1), a[..., dk:2 * dk].reshape(*lead, -1),
                           a[..., 2 * dk:].reshape(*lead, -1)], -1)


def linear_attention_rows(c, hf: str, me: str) -> list:
    """The rows of one Gated DeltaNet layer (``hf``: its Hugging Face prefix, ``me``:
    redray's path), in the checkpoint's layout (grouped by key head: Qwen3-Next;
    separate: Qwen3.5)."""
    key_heads, r, dk, dv = _linear_dims(c)
    rows = [Tensor(f"{hf}.conv1d.weight", f"{me}/conv",
                   lambda w, shape: _by_key_head(w[:, 0, :].T, key_heads, dk).reshape(shape),
                   lambda k: _channels(k, dk).T[:, None, :]),
            plain(f"{hf}.A_log", f"{me}/A_log", flat=True),
            plain(f"{hf}.dt_bias", f"{me}/dt_bias", flat=True),
            plain(f"{hf}.norm.weight", f"{me}/norm"),
            linear(f"{hf}.out_proj.weight", f"{me}/out_proj/kernel", in_dims=2)]
    if c.model_type == "qwen3_next":
        return rows + [linear(f"{hf}.in_proj_qkvz.weight", f"{me}/in_proj/kernel"),
                       linear(f"{hf}.in_proj_ba.weight", f"{me}/ba_proj/kernel")]
    qkv = Tensor(f"{hf}.in_proj_qkv.weight", f"{me}/in_proj/kernel",
                 lambda w, shape: _by_key_head(w.T, key_heads, dk).reshape(shape),
                 lambda k: _channels(k, dk).T)
    return rows + [
        fused(f"{me}/in_proj/kernel", 2, (2 * dk + r * dv, r * dv), qkv,
              linear(f"{hf}.in_proj_z.weight", f"{me}/in_proj/kernel")),
        fused(f"{me}/ba_proj/kernel", 2, (r, r),
              linear(f"{hf}.in_proj_b.weight", f"{me}/ba_proj/kernel"),
              linear(f"{hf}.in_proj_a.weight", f"{me}/ba_proj/kernel"))]


def attention_rows(c, hf: str, me: str) -> list:
    """The rows of one gated full attention: the query (with its gates), key and value
    projections in one kernel, the output, the per-head norms."""
    heads, kv, d = llama._dims(c)
    load, save = _q_gate(heads, kv, d)
    path = f"{me}/qkv_proj/kernel"
    query = Tensor(f"{hf}.q_proj.weight", path, load, save)
    return [fused(path, 2, (2 * (heads // kv), 1, 1), query,
                  linear(f"{hf}.k_proj.weight", path), linear(f"{hf}.v_proj.weight", path)),
            linear(f"{hf}.o_proj.weight", f"{me}/o_proj/kernel", in_dims=2),
            plain(f"{hf}.q_norm.weight", f"{me}/q_norm/scale"),
            plain(f"{hf}.k_norm.weight", f"{me}/k_norm/scale")]


def mlp_rows(c, hf: str, me: str, kind: str) -> list:
    """The rows of a dense MLP, or of the router, the stacked experts and the shared
    expert with its gate."""
    if kind == "dense":
        return gated((f"{hf}.gate_proj", f"{hf}.up_proj"), f"{me}/gate_up_proj") + \
            [linear(f"{hf}.down_proj.weight", f"{me}/down_proj/kernel")]
    each = f"{hf}.experts.{{j}}"
    rows = [linear(f"{hf}.gate.weight", f"{me}/router/kernel")]
    rows += moe.expert_rows(me, c.num_experts, (f"{each}.gate_proj.weight",
                                                f"{each}.up_proj.weight"),
                            f"{each}.down_proj.weight")
    theirs, ours = f"{hf}.shared_expert", f"{me}/shared_expert"
    rows += gated((f"{theirs}.gate_proj", f"{theirs}.up_proj"), f"{ours}/gate_up_proj")
    return rows + [linear(f"{theirs}.down_proj.weight", f"{ours}/down_proj/kernel"),
                   linear(f"{theirs}_gate.weight", f"{ours}_gate/kernel")]


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = config.hf if isinstance(config, HFConfig) else config
    rows = llama.head_rows(c)
    for i, kind in enumerate(_kinds(c)):
        hf, me = f"model.layers.{i}", f"layers/{i}"
        mixer, mlp = kind.split("-")
        rows += [plain(f"{hf}.input_layernorm.weight", f"{me}/input_layernorm/scale"),
                 plain(f"{hf}.post_attention_layernorm.weight",
                       f"{me}/post_attention_layernorm/scale")]
        rows += linear_attention_rows(c, f"{hf}.linear_attn", f"{me}/linear_attn") \
            if mixer == "linear" else attention_rows(c, f"{hf}.self_attn", f"{me}/self_attn")
        rows += mlp_rows(c, f"{hf}.mlp", f"{me}/mlp", mlp)
    return rows
