"""Pieces every model family shares: rotary embeddings, attention with a KV cache, masks."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redray.models import context, paged, staged_layers
from redray.models.attention import AttentionMask, attend, dense_attention
from redray.sharding.tracing import (blocks_cut, constrain_rows, gathered_features,
                                         loop_unroll, pipeline_stages, stage_layout, traced)
from redray.sharding.parallelism import layer_positions, stacked_count

ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation(name: str) -> Callable:
    """The activation function a Hugging Face config names (``hidden_act``)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: "
                         f"{', '.join(sorted(ACTIVATIONS))}") from None


# ------------------------------------------------------------------ rotary embeddings
def rope_inv_freq(rope: dict | None, rotary_dim: int, default_theta: float = 10000.0,
                  max_positions: int | None = None, truncate: bool | None = None) -> np.ndarray:
    """Inverse frequencies of rotary embeddings, with the scaling a config asks for.

    Args:
      rope: a Hugging Face ``rope_parameters`` dict (``rope_type``, ``rope_theta``,
        ``factor`` ...), or None for the default with ``default_theta``.
      rotary_dim: number of rotated dimensions (even).
      max_positions: the config's ``max_position_embeddings`` (YaRN without a
        ``factor`` takes it over ``original_max_position_embeddings``).
      truncate: YaRN's correction range rounded to whole dimensions; None: the dict's
        ``truncate`` (default True). ``transformers`` reads it from the config's
        top-level ``rope_parameters``, so a config with parameters per layer type
        always truncates: its caller passes that.
    """
    rope = dict(rope or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", default_theta))
    inv = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32)
                          / rotary_dim)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor, low, high = (float(rope["factor"]), float(rope["low_freq_factor"]),
                             float(rope["high_freq_factor"]))
        old = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        with np.errstate(divide="ignore", invalid="ignore"):  # Llama 4: high == low, no band
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(rope, inv, rotary_dim, theta, max_positions,
                              rope.get("truncate", True) if truncate is None else truncate)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, "
                     "llama3, yarn")


def _yarn_factor(rope: dict, max_positions: int | None) -> float:
    factor = rope.get("factor")
    if factor is None:  # DeepSeek-V3's configs: the ratio of the two lengths
        factor = max_positions / rope["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq(rope: dict, inv: np.ndarray, dim: int, theta: float, max_positions,
                   truncate: bool) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as ``transformers``' ``_compute_yarn_parameters``: the
    fast-rotating dimensions kept, the slow ones interpolated by ``factor``, a linear
    ramp between the dimensions ``beta_fast`` and ``beta_slow`` rotations pick."""
    factor = _yarn_factor(rope, max_positions)
    fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)
    original = float(rope["original_max_position_embeddings"])

    def dimension(rotations: float) -> float:  # which dimension turns that many times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    kept = np.float32(1) - ramp
    periods = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32)
                                    / np.float32(dim))
    interpolated = np.float32(1) / (np.float32(factor) * periods)
    return (interpolated * (1 - kept) + inv * kept).astype(np.float32)


def rope_scale(rope: dict | None, max_positions: int | None = None) -> float:
    """What the rotary tables' cos and sin are multiplied by (``transformers``'
    ``attention_scaling``): YaRN's attention factor (given, or ``0.1 ln(factor) + 1``,
    DeepSeek's ratio of two such with ``mscale`` and ``mscale_all_dim``), else 1."""
    rope = dict(rope or {})
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = _yarn_factor(rope, max_positions)
    mscale, every = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and every:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, every))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor of a rotary ``factor``: ``0.1 mscale ln(factor) + 1``
    (1 where nothing is stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_angles(positions: jax.Array, inv_freq: np.ndarray,
                scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin of position x frequency, float32, shape positions.shape + (dim/2,),
    both times ``scale`` (``rope_scale``: YaRN's attention factor)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    if scale == 1.0:
        return jnp.cos(freqs), jnp.sin(freqs)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding pairing dimension i with i + d/2 (LLaMA, GPT-NeoX layout).

    x: (batch, seq, heads, head_dim); cos, sin: (batch, seq, rotary_dim/2). Dimensions
    past rotary_dim pass through unrotated.
    """
    rot = cos.shape[-1] * 2
    xr, rest = x[..., :rot], x[..., rot:]
    c = jnp.concatenate([cos, cos], -1)[:, :, None].astype(x.dtype)
    s = jnp.concatenate([sin, sin], -1)[:, :, None].astype(x.dtype)
    x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
    out = xr * c + jnp.concatenate([-x2, x1], -1) * s
    return jnp.concatenate([out, rest], -1) if rest.shape[-1] else out


def rotate_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding pairing dimensions 2i and 2i+1 (GPT-J layout)."""
    rot = cos.shape[-1] * 2
    xr, rest = x[..., :rot], x[..., rot:]
    c = jnp.repeat(cos, 2, -1)[:, :, None].astype(x.dtype)
    s = jnp.repeat(sin, 2, -1)[:, :, None].astype(x.dtype)
    pairs = xr.reshape(*xr.shape[:-1], rot // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(xr.shape)
    out = xr * c + rotated * s
    return jnp.concatenate([out, rest], -1) if rest.shape[-1] else out


# ------------------------------------------------------------------ layers that differ
# A scanned layer's window or chunk that is none: wider than any sequence.
EVERY_KEY = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's attention does that another's may not, with the same
    parameters (a ``CausalLM``'s ``layer_attention``, one per layer): its sliding
    ``window`` (Gemma, gpt-oss, OLMo 3), its ``chunk`` (Llama 4's chunked attention) and
    which rotary table it rotates with (``rope``: an index into the model's
    ``rope_tables``; None: no rotary embedding, a NoPE layer of SmolLM3 or Llama 4)."""
    window: int | None = None
    chunk: int | None = None
    rope: int | None = 0


def attention_choices(kinds) -> tuple[tuple, tuple]:
    """(the windows, the chunks) a scanned layer of ``kinds`` (``LayerAttention``s) may
    have, as the fused kernels need them static (``EVERY_KEY``: none); () where every
    layer has none."""
    def values(name):
        found = {getattr(k, name) for k in kinds}
        if found == {None}:
            return ()
        return tuple(sorted(EVERY_KEY if v is None else int(v) for v in found))
    return values("window"), values("chunk")


def layer_inputs(kinds, stacked: bool) -> tuple:
    """The per-layer inputs (``run_blocks``' ``per_layer``) of layers ``kinds``: each
    one's window, chunk and rotary table (an identity table, past the model's own, for
    NoPE layers): Python values for a list of blocks, int32 arrays (``EVERY_KEY`` where
    none) for stacked ones."""
    nope = 1 + max((k.rope for k in kinds if k.rope is not None), default=-1)
    windows = [k.window for k in kinds]
    chunks = [k.chunk for k in kinds]
    ropes = [nope if k.rope is None else k.rope for k in kinds]
    if not stacked:
        return windows, chunks, ropes
    as_array = lambda v: jnp.asarray([EVERY_KEY if x is None else x for x in v],  # noqa: E731
                                     jnp.int32)
    return as_array(windows), as_array(chunks), jnp.asarray(ropes, jnp.int32)


def rotary_tables(positions, tables, kinds) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every rotary table (``tables``: (inverse frequencies, scale)
    pairs) at ``positions``, stacked on axis 1 (rows, tables, ..., dim/2), and an
    identity table after them (cos 1, sin 0) where a layer of ``kinds`` has none."""
    found = [rope_angles(positions, inv, scale) for inv, scale in tables]
    if any(k.rope is None for k in kinds):
        cos = found[0][0] if found else jnp.zeros((*positions.shape, 1), jnp.float32)
        found.append((jnp.ones_like(cos), jnp.zeros_like(cos)))
    return tuple(jnp.stack(t, axis=1) for t in zip(*found))


def layer_view(cos, sin, mask, window, chunk, rope, choices: tuple):
    """One layer's (cos, sin, mask) from every layer's (``rotary_tables``; the mask as
    the model made it, holding the queries' positions where chunks count from them) and
    its own ``layer_inputs`` (Python values, or a scanned layer's int32 scalars);
    ``choices``: ``attention_choices``' pair."""
    windows, chunks = choices
    if windows:  # where no layer has a window, none: a traced "every key" would keep the
        mask = mask.windowed(window, windows)  # fused kernels off (their window is static)
    if chunks:
        mask = mask.chunked(chunk, mask.q_positions, chunks)
    return cos[:, rope], sin[:, rope], mask


# ------------------------------------------------------------------ masks and positions
def query_slots(length: int, cache_index) -> jax.Array:
    """Absolute slots of the queries: where they sit in the KV cache (or the sequence)."""
    return cache_index + jnp.arange(length)


def attention_mask_for(kv_valid: jax.Array, q_slots: jax.Array, causal: bool = True,
                       window: int | None = None, padded: bool = True) -> AttentionMask:
    """Which keys each query sees: valid key slots, causal, optionally a sliding window.

    Args:
      kv_valid: (batch, kv_len) 1 where a key slot holds a real token (0 for padding).
      q_slots: (q_len,) absolute slot of each query.
      padded: ``kv_valid`` may mark padding (False: every slot is real).
    """
    return AttentionMask(kv_valid.astype(bool), q_slots, causal=causal, window=window,
                         padded=padded)


def positions_for(kv_valid: jax.Array, q_slots: jax.Array) -> jax.Array:
    """Position ids of the queries: how many real tokens precede each (left padding aware)."""
    pos = jnp.cumsum(kv_valid.astype(jnp.int32), -1) - 1
    return jnp.maximum(jnp.take(pos, q_slots, axis=1), 0)


# ------------------------------------------------------------------ fused projections
# Tensor parallelism splits Q, K and V (and a gated MLP's gate and up) by their outputs,
# so each one's input gradient is a partial sum that must be all-reduced. Computed by
# one kernel, the partial sums add up inside one matmul and one all-reduce does; XLA
# does not add separately computed ones before reducing them. The part axis sits
# behind the head axis and is sliced after the matmul, so the automatic rules split
# heads and keep the parts of a head together.
def qkv_projection(hidden: int, heads: int, kv_heads: int, head_dim: int,
                   **linear) -> nnx.LinearGeneral:
    """Q, K and V in one kernel (hidden, kv_heads, heads // kv_heads + 2, head_dim).

    Key/value head j is stored with the query heads that read it (j * g ... j * g + g - 1
    for g = heads // kv_heads), then its key, then its value: a split over key/value
    heads keeps every group whole. Read the output with ``split_qkv``. ``linear``:
    ``nnx.LinearGeneral``'s other arguments (``use_bias``, ``dtype``, ``rngs`` ...).
    """
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads "
                         f"{kv_heads}")
    return nnx.LinearGeneral(hidden, (kv_heads, heads // kv_heads + 2, head_dim), **linear)


def split_qkv(y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q (..., heads, head_dim), k, v (..., kv_heads, head_dim)) of a ``qkv_projection``
    output (..., kv_heads, g + 2, head_dim)."""
    g = y.shape[-2] - 2
    q = y[..., :g, :]
    return q.reshape(*q.shape[:-3], -1, q.shape[-1]), y[..., g, :], y[..., g + 1, :]


def split_rotated_qkv(y: jax.Array, cos: jax.Array, sin: jax.Array, rotate: Callable,
                      norms: tuple[Callable, Callable] | None = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``split_qkv`` with rotary embeddings applied to the queries and keys; ``rotate``:
    ``rotate_half`` or ``rotate_interleaved``, the family's layout; ``norms``: (query
    norm, key norm) over each head's features, applied before rotating (Qwen3)."""
    q, k, v = split_qkv(y)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def gated_projection(hidden: int, intermediate: int, **linear) -> nnx.LinearGeneral:
    """A gated MLP's gate and up projections in one kernel (hidden, 2, intermediate);
    ``linear``: ``nnx.LinearGeneral``'s other arguments."""
    return nnx.LinearGeneral(hidden, (2, intermediate), **linear)


# ------------------------------------------------------------------ attention
def attention_heads(config) -> tuple[int, int]:
    """(heads, head_dim) of a config whose attention heads split ``hidden_size`` evenly."""
    heads = config.num_attention_heads
    if config.hidden_size % heads:
        raise ValueError(f"hidden_size {config.hidden_size} is not a multiple of "
                         f"num_attention_heads {heads}")
    return heads, config.hidden_size // heads


def dot_attention(q, k, v, mask: AttentionMask, scale: float, bias=None,
                  dropout: Callable | None = None, softcap: float | None = None,
                  sinks=None):
    """Scaled dot-product attention with grouped-query heads, softmax in float32
    (``redray/models/attention.py`` chooses how: cuDNN's fused kernel, XLA, or blocks).

    q: (B, T, H, D); k, v: (B, S, KV, D) with H a multiple of KV (query head h reads
    key/value head h // (H // KV)); mask: an ``AttentionMask`` (chunked attention:
    ``mask.chunked``); bias: broadcastable to (B, H, T, S); dropout: applied to the
    attention probabilities; softcap: the scores soft-capped to (-softcap, softcap)
    (Gemma 2); sinks: (H,) a logit per query head joining each query's softmax as one
    more column, dropped after it (gpt-oss's attention sinks), or None.
    """
    return attend(q, k, v, mask, scale, bias=bias, dropout=dropout, softcap=softcap,
                  sinks=sinks)


def self_attention(q, k, v, mask: AttentionMask, scale: float, cache: dict | None, cache_index,
                   dropout: nnx.Dropout, train: bool, softcap: float | None = None,
                   sinks=None) -> tuple:
    """A decoder layer's attention over its new keys/values and those its KV cache holds.

    With a ``cache`` (the layer's {"k", "v"}), ``k`` and ``v`` are written into it at
    ``cache_index`` first and the queries read every slot; ``dropout`` drops attention
    probabilities in training; ``softcap``, ``sinks``: as ``dot_attention``'s. Returns
    (output (B, T, H, D), the new cache or None).
    """
    # a rate of 0 drops nothing: without it the scores need not be materialized (flash)
    drop = (lambda p: dropout(p, deterministic=False)) if train and dropout.rate > 0 else None
    if mask.kv_slots is not None:  # a sequence split over the context axis
        if drop is not None:
            raise ValueError(f"attention dropout ({dropout.rate}) is not available with "
                             "context_axis > 1: set the config's attention dropout to 0")
        out = context.attention(q, k, v, mask, scale, softcap, sinks=sinks)
        # a prefill: the prompt's keys and values into the cache, in the tokens' order
        if cache is None:
            return out, None
        slots = cache_length(cache)
        return out, update_cache(cache, context.in_order(k, slots), context.in_order(v, slots),
                                 0)
    if cache is None:
        return dot_attention(q, k, v, mask, scale, dropout=drop, softcap=softcap,
                             sinks=sinks), None
    if paged.is_paged(cache_index):  # a pool of pages (``redray/models/paged.py``)
        cache = paged.write(cache, cache_index, k, v, mask.kv_valid)
        return paged.attention(q, cache, cache_index, mask, scale, softcap, sinks), cache
    cache = update_cache(cache, k, v, cache_index)
    if isinstance(cache_index, int) and cache_index == 0 and mask.causal and not mask.segmented:
        # a prefill from slot 0: causal, its queries see none of the cache's later slots,
        # so they attend over their own keys (as cached), not the cache's whole length
        # (``generate``'s cache of prompt + new tokens: 1.4x the prefill's time on CPU)
        dtype, tokens = cache["k"].dtype, k.shape[1]
        mask = mask.replace(kv_valid=mask.kv_valid[:, :tokens])
        return dot_attention(q, k.astype(dtype), v.astype(dtype), mask, scale, dropout=drop,
                             softcap=softcap, sinks=sinks), cache
    if q.shape[1] <= DECODE_QUERIES:  # decoding: the cache read in its own layout
        return dense_attention(q, cache["k"], cache["v"], mask.dense(), scale, dropout=drop,
                               softcap=softcap, heads_first=True, sinks=sinks), cache
    k, v = cached_keys(cache)
    return dot_attention(q, k, v, mask, scale, dropout=drop, softcap=softcap,
                         sinks=sinks), cache


# The KV cache holds (batch, kv_heads, length, head_dim): a decoding step's attention
# then reads it with the heads as batch dimensions of two matmuls, where the tokens-first
# layout of the activations made XLA transpose the whole cache on every step (5x slower
# attention on XLA:CPU at 64 rows x 176 slots). Calls of more than this many queries (a
# prefill) see it as (batch, length, kv_heads, head_dim) for the fused kernels.
DECODE_QUERIES = 16


def update_cache(layer_cache: dict, k: jax.Array, v: jax.Array, index) -> dict:
    """A layer's cache with new keys/values (batch, tokens, kv_heads, head_dim) written
    from slot ``index`` on."""
    def write(old, new):
        new = jnp.swapaxes(new, -3, -2).astype(old.dtype)
        return jax.lax.dynamic_update_slice(old, new, (0, 0, index, 0))
    return {**layer_cache, "k": write(layer_cache["k"], k), "v": write(layer_cache["v"], v)}


def cached_keys(layer_cache: dict) -> tuple[jax.Array, jax.Array]:
    """A layer's cached keys and values as (batch, length, kv_heads, head_dim)."""
    return jnp.swapaxes(layer_cache["k"], -3, -2), jnp.swapaxes(layer_cache["v"], -3, -2)


def cache_length(cache) -> int:
    """The slots of a cache (a layer's, a list of layers', or a stacked one); a list's
    first attention layer's, where linear-attention layers hold a state of no length."""
    layer = cache if isinstance(cache, dict) else next(c for c in cache if "k" in c)
    return layer["k"].shape[-2]


def empty_cache(layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
                dtype=jnp.float32, stacked: bool = False) -> list[dict] | dict:
    """A zeroed KV cache: one {"k", "v"} of (batch, kv_heads, length, head_dim) per layer,
    or with ``stacked`` one {"k", "v"} of (layers, batch, ...) (for scanned blocks)."""
    shape = (batch, kv_heads, length, head_dim)
    if stacked:
        return {"k": jnp.zeros((layers, *shape), dtype), "v": jnp.zeros((layers, *shape), dtype)}
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(layers)]


# What a block keeps for the backward pass (``remat=`` of every model):
# "none": every activation (the most memory, no recomputation); "full": only the block's
# input, everything else recomputed (the least memory, a second forward pass);
# "dots": the outputs of its matmuls without batch dimensions (the projections and the
# MLP; attention scores and element-wise results are recomputed): most of the compute
# saved for a fraction of the memory; "offload": those same outputs moved to host
# memory ("pinned_host") and back, where the backend has it (GPU, TPU; XLA:CPU runs it
# as a copy).
REMAT_POLICIES = ("none", "full", "dots", "offload")


def remat_policy(remat) -> str:
    """A model's ``remat`` argument as a policy name: False/None -> "none", True -> "full",
    or one of ``REMAT_POLICIES``."""
    if remat is None or remat is False:
        return "none"
    if remat is True:
        return "full"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: use one of {', '.join(map(repr, REMAT_POLICIES))} "
                         "(True is 'full', False 'none')")
    return remat


def maybe_remat(fn: Callable, remat) -> Callable:
    """``fn`` rematerialized in the backward pass as the policy ``remat`` says."""
    policy = remat_policy(remat)
    if policy == "none":
        return fn
    if policy == "full":
        return nnx.remat(fn)
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if policy == "dots" \
        else jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return nnx.remat(fn, policy=saveable)


# ------------------------------------------------------------------ decoder plumbing
def decoder_masks(input_ids, attention_mask, cache, cache_index, window: int | None = None,
                  segment_ids=None):
    """(attention mask, position ids) for a decoder call, with or without a KV cache.

    ``attention_mask`` covers key slots: the sequence without a cache, the whole cache
    with one (None: every slot is real). ``segment_ids`` (batch, seq), for rows packed
    with several documents (``redray.data.pack``): a token attends only to earlier
    tokens of its own segment, positions restart at each segment, and segment 0 is
    padding (it attends to nothing real and nothing attends to it).
    """
    t = input_ids.shape[1]
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("segment_ids are for training and scoring packed rows; decode "
                             "one document per row with a cache")
        if attention_mask is None:
            attention_mask = (segment_ids != 0).astype(jnp.int32)
        mask = AttentionMask(attention_mask.astype(bool), query_slots(t, 0), segment_ids,
                             segment_ids, causal=True, window=window)
        return mask, segment_positions(segment_ids)
    if paged.is_paged(cache_index):  # ``attention_mask``: which new tokens are real
        valid = jnp.ones(input_ids.shape, bool) if attention_mask is None \
            else attention_mask.astype(bool)
        return (AttentionMask(valid, query_slots(t, 0), window=window),
                paged.positions(cache_index, valid))
    padded = attention_mask is not None
    if attention_mask is None:
        slots_total = t if cache is None else cache_length(cache)
        attention_mask = jnp.ones((input_ids.shape[0], slots_total), jnp.int32)
    slots = query_slots(t, cache_index)
    return (attention_mask_for(attention_mask, slots, window=window, padded=padded),
            positions_for(attention_mask, slots))


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's position inside its segment: 0 where a segment starts."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def make_blocks(make: Callable, count: int, rngs: nnx.Rngs, scan: bool):
    """``count`` blocks ``make(rngs)``: a list, or with ``scan`` one block whose every
    parameter has a leading layer axis of ``count`` (``run_blocks`` scans over it: the
    compiled program holds one block, whatever the depth)."""
    if not scan:
        return nnx.List([make(rngs) for _ in range(count)])

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count)
    def stacked(rngs):
        return make(rngs)

    return stacked(rngs)


@dataclasses.dataclass(frozen=True)
class LayerPattern:
    """Which kind each layer of a decoder is, and how its layers stack.

    Layers whose parameters differ (a dense MLP here, a mixture of experts there) cannot
    share one stacked block. A pattern finds the shortest way to stack them: its
    ``first`` layers apart (a list: DeepSeek's dense prefix, Qwen3-MoE's
    ``mlp_only_layers`` at the front), then the rest as one stack of a repeating
    ``period`` of consecutive layers (``Period``: Llama 4's dense and MoE layers in
    turn), so the compiled program holds ``first + period`` blocks whatever the depth.
    Every layer alike is a period of 1 and no first layers: the stack of blocks every
    family had before patterns.

    Attributes:
      kinds: each layer's kind (any names; equal names: equal parameters and code).
      first: the layers before the repeating part.
      period: the repeating part's length.
    """
    kinds: tuple[str, ...]
    first: int = 0
    period: int = 1

    @classmethod
    def of(cls, kinds) -> LayerPattern:
        """The pattern of ``kinds`` that holds the fewest distinct blocks (``first +
        period``; on a tie the shorter period: the longer stack, which pipeline stages
        can split)."""
        kinds = tuple(kinds)
        candidates = []
        for first in range(len(kinds)):
            rest = kinds[first:]
            period = next(p for p in range(1, len(rest) + 1)
                          if len(rest) % p == 0 and rest == rest[:p] * (len(rest) // p))
            candidates.append((first + period, period, first))
        _, period, first = min(candidates)
        return cls(kinds, first, period)

    @property
    def repeats(self) -> int:
        """How many times the period repeats (the stacked layer axis's length)."""
        return (len(self.kinds) - self.first) // self.period

    @property
    def body(self) -> tuple[str, ...]:
        """The kinds of one period."""
        return self.kinds[self.first:self.first + self.period]

    def place(self, layer: int, stack: str) -> tuple[str, int | None]:
        """Where layer ``layer`` of stacked blocks named ``stack`` lives: (the module
        path, the row of its stacked arrays or None)."""
        if layer < self.first:
            return f"first_{stack}/{layer}", None
        row, slot = divmod(layer - self.first, self.period)
        return (stack, row) if self.period == 1 else (f"{stack}/period/{slot}", row)


class Period(nnx.Module):
    """One period of a ``LayerPattern``: consecutive layers of differing kinds, run in
    turn (``period``: the blocks). Stacked over the pattern's repeats (``make_layers``),
    it is the block a scan, pipeline stages and 1F1B see; each of its layers gets its
    own entry of every per-layer input (the inputs arrive as (period,) arrays)."""

    def __init__(self, blocks: list):
        self.period = nnx.List(blocks)

    def __len__(self) -> int:
        return len(self.period)


def make_layers(make: Callable, kinds, rngs: nnx.Rngs, scan: bool) -> tuple:
    """The blocks of a decoder whose layers are ``kinds`` (a ``LayerPattern``'s),
    ``make(kind, rngs)`` building one: (the first layers as a list or None, the rest).
    Without ``scan`` every layer is in the second, a list; with it the rest is one
    stacked block (``make_blocks``), a ``Period`` of blocks where the period is longer
    than one layer."""
    pattern = LayerPattern.of(kinds)
    if not scan:
        return None, nnx.List([make(kind, rngs) for kind in pattern.kinds])
    first = nnx.List([make(kind, rngs) for kind in pattern.kinds[:pattern.first]]) \
        if pattern.first else None
    if pattern.period == 1:
        return first, make_blocks(lambda r: make(pattern.body[0], r), pattern.repeats, rngs,
                                  True)
    return first, make_blocks(lambda r: Period([make(kind, r) for kind in pattern.body]),
                              pattern.repeats, rngs, True)


def is_stacked(blocks) -> bool:
    """Whether ``blocks`` is one stacked block (``make_blocks(..., scan=True)``)."""
    return not isinstance(blocks, nnx.List)


class Embed(nnx.Embed):
    """``nnx.Embed`` (the same parameter, ``embedding``) whose lookup reads the table
    whole on its features under a plan (``gathered_features``): a token or position
    table, whose entries the model axis may split and whose features FSDP may.

    ``padding_idx``: a row whose lookups pass no gradient back to it, as torch's
    ``nn.Embedding(padding_idx=...)`` (``padding_row`` reads it from a config). A
    checkpoint's pad row is all zeros (``transformers`` zeroes it), so the hidden state
    of a pad token that leads its row stays exactly zero through every norm until
    attention mixes in other tokens, and a norm's backward at zero multiplies by
    ``1 / sqrt(epsilon)``: over four layers the row's gradient passed 1e21 and the
    gradient norm overflowed (Gemma 2). Its uses elsewhere (a tied LM head) still train
    it, as in torch.
    """

    def __init__(self, num_embeddings: int, features: int, *, padding_idx: int | None = None,
                 **kwargs):
        super().__init__(num_embeddings, features, **kwargs)
        self.padding_idx = padding_idx

    def __call__(self, inputs):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"an embedding looks up integer ids, got {inputs.dtype}")
        (table,) = self.promote_dtype((gathered_features(self.embedding[...]),),
                                      dtype=self.dtype, inexact=False)
        rows = jnp.take(table, inputs, axis=0)
        if self.padding_idx is None:
            return rows
        # a select, not a product: a pad position's cotangent is dropped even where it
        # is infinite
        return jnp.where((inputs == self.padding_idx)[..., None], jax.lax.stop_gradient(rows),
                         rows)


def padding_row(config) -> int | None:
    """The token embedding's padding row of a family whose Hugging Face model declares
    one (``nn.Embedding(..., padding_idx=config.pad_token_id)``): ``pad_token_id``,
    counted from the end when negative as torch does, or None."""
    pad, vocab_size = getattr(config, "pad_token_id", None), config.vocab_size
    if pad is None:
        return None
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) \
            or not -vocab_size <= pad < vocab_size:
        raise ValueError(f"{config.model_type} config: pad_token_id {pad!r} is not a row of the "
                         f"token embedding (vocab_size {vocab_size}); transformers refuses it "
                         "too: set it to a token id below vocab_size, or to None")
    return int(pad) % vocab_size


def run_blocks(blocks, x, args: tuple, cache, cache_index, train: bool, remat,
               per_layer: tuple = (), reports: bool = False):
    """Runs ``block(x, *args, *own, layer_cache, cache_index, train) -> (x, layer_cache)``
    in turn.

    ``per_layer``: inputs that differ by layer (Gemma's window and rotary table), each
    with one entry per block; block i gets entry i of each as ``own``. Stacked blocks
    take them as arrays, scanned over their leading axis with the blocks (a stacked
    ``Period``: arrays of one entry per layer, taken a period at a time). Without a
    cache each block may be rematerialized (training); with one, the new cache is
    collected. Stacked blocks run in one ``scan``; decoding, they run unrolled over a
    cache per layer (``_unrolled``), or scanned over a stacked one. Returns (x, new
    cache or None).

    Blocks may return a third output, a report of what they measured (a pytree: a
    mixture of experts' router statistics). With ``reports`` (and no cache) the reports
    of the blocks that give one come back stacked on a leading layer axis: returns (x,
    None, reports) (reports None where no block gives one).
    """
    x = constrain_rows(x)
    if is_stacked(blocks):
        if isinstance(blocks, Period):
            period = len(blocks)
            per_layer = tuple(jnp.reshape(jnp.asarray(a), (-1, period, *jnp.shape(a)[1:]))
                              for a in per_layer)
        return _scan_blocks(blocks, x, args, per_layer, cache, cache_index, train, remat,
                            reports)
    owns = list(zip(*per_layer)) if per_layer else [()] * len(blocks)
    if cache is None:
        step = maybe_remat(_training_call(train, reports), remat if train else "none")
        found = []
        for block, own in zip(blocks, owns):
            x, report = step(block, x, *args, *own)
            x = constrain_rows(x)
            found.append(report)
        return (x, None, _stacked_reports(found)) if reports else (x, None)
    return _decode_layers(blocks, owns, x, args, cache, cache_index, train)


def _stacked_reports(found: list):
    """The reports of the blocks that gave one, stacked on a leading layer axis (None
    where none did)."""
    found = [r for r in found if r is not None]
    return jax.tree.map(lambda *r: jnp.stack(r), *found) if found else None


def run_layers(first, blocks, x, args: tuple, cache, cache_index, train: bool, remat,
               per_layer: tuple = (), reports: bool = False):
    """``run_blocks`` over a pattern's layers (``make_layers``): the ``first`` layers
    (a list, or None), then ``blocks``. ``per_layer`` and a list ``cache`` hold every
    layer's entries, in the layers' order; the reports of both parts are joined."""
    if first is None:
        return run_blocks(blocks, x, args, cache, cache_index, train, remat, per_layer,
                          reports)
    n = len(first)
    x, head_cache, *head = run_blocks(first, x, args, None if cache is None else cache[:n],
                                      cache_index, train, remat,
                                      tuple(a[:n] for a in per_layer), reports)
    x, tail_cache, *tail = run_blocks(blocks, x, args, None if cache is None else cache[n:],
                                      cache_index, train, remat,
                                      tuple(a[n:] for a in per_layer), reports)
    new_cache = None if cache is None else [*head_cache, *tail_cache]
    if not reports:
        return x, new_cache
    parts = [r for r in (head[0], tail[0]) if r is not None]
    joined = jax.tree.map(lambda *r: jnp.concatenate(r), *parts) if parts else None
    return x, new_cache, joined


def _decode_layers(blocks, owns, x, args, cache: list, cache_index, train):
    """Each block in turn with its own layer's cache; returns (x, the new caches)."""
    new_cache = []
    for block, own, layer_cache in zip(blocks, owns, cache):
        x, layer_cache = block(x, *args, *own, layer_cache, cache_index, train)[:2]
        new_cache.append(layer_cache)
    return x, new_cache


def _training_call(train: bool, reports: bool) -> Callable:
    """A block's call without a cache, as (x, its report or None)."""
    def call(block, x, *args):
        out = block(x, *args, None, 0, train)
        return out[0], out[2] if reports and len(out) > 2 else None

    return call


def _period_call(step: Callable, shared: int) -> Callable:
    """``step`` (a block's call, maybe rematerialized) over each layer of a ``Period`` in
    turn: the first ``shared`` arguments every layer's, the rest (period,) arrays of
    which layer j takes entry j; returns (x, the layers' reports stacked or None)."""
    def call(period, x, *args):
        found = []
        for j, block in enumerate(period.period):
            x, report = step(block, x, *args[:shared], *(a[j] for a in args[shared:]))
            x = constrain_rows(x)
            found.append(report)
        return x, _stacked_reports(found)

    return call


def _scan_blocks(blocks, x, args: tuple, per_layer: tuple, cache, cache_index, train: bool,
                 remat, reports: bool):
    broadcast, scanned = (None,) * len(args), (0,) * len(per_layer)
    if cache is None:
        step = maybe_remat(_training_call(train, reports), remat if train else "none")
        if isinstance(blocks, Period):  # each layer of a period rematerialized alone
            step = _period_call(step, len(args))

        @nnx.scan(in_axes=(0, nnx.Carry, *broadcast, *scanned), out_axes=(nnx.Carry, 0),
                  unroll=loop_unroll())
        def forward(block, x, *a):
            x, report = step(block, x, *a)
            return constrain_rows(x), report

        @nnx.scan(in_axes=(0, nnx.Carry, *broadcast, *scanned, 0), out_axes=(nnx.Carry, 0),
                  unroll=loop_unroll())
        def padded(block, x, *a):  # the last input: whether the layer is real (a pad,
            *a, real = a           # parallelism.layer_order's, passes its input on)
            y, report = step(block, x, *a)
            return constrain_rows(jnp.where(real, y, x)), report

        def run(b, h, a, own, real=None):  # a stage's chunk (staged_layers.run_stages)
            if real is None:
                return forward(b, h, *a, *own)[0]
            return padded(b, h, *a, *own, real)[0]

        cut = blocks_cut()
        if cut is not None:  # a 1F1B step's head or tail pass (engine/one_f_one_b.py)
            cut.calls += 1
            if cut.calls > 1:
                raise ValueError("pipeline_schedule='1f1b' cuts a model at one stack of "
                                 "layers; this one runs several (an encoder-decoder): use "
                                 "pipeline_schedule='gpipe'")
            if reports:
                raise ValueError("aux=True (the experts' router statistics) is not available "
                                 "with pipeline_schedule='1f1b' yet: use 'gpipe'")
            if cut.output is not None:
                return cut.output, None
            _uncounted(blocks, train)
            cut.found = dict(blocks=blocks, x=x, args=args, per_layer=per_layer,
                             run=lambda *a, **k: _without_counts(run, *a, **k))
            return x, None
        staged = pipeline_stages(x.shape[0])
        if staged is not None:
            if reports:
                raise ValueError("aux=True (the experts' router statistics) is not available "
                                 "with pipeline stages yet: train with stage_axis=1")
            _uncounted(blocks, train)
            with traced(uncounted=True):
                x = staged_layers.run_stages(blocks, x, args, per_layer, train, run, *staged)
            return x, None
        with _in_layer_order(blocks) as ordered:
            x, found = forward(ordered, x, *args, *per_layer)
        if reports and isinstance(blocks, Period) and found is not None:
            # (repeats, reporting layers of a period, ...) -> one entry per layer
            found = jax.tree.map(lambda r: r.reshape(-1, *r.shape[2:]), found)
        return (x, None, found) if reports else (x, None)

    with _in_layer_order(blocks) as ordered:
        if isinstance(cache, list):  # decoding with a cache per layer: the layers unrolled
            return _unrolled(ordered, x, args, per_layer, cache, cache_index, train)
        return _scanned_decode(ordered, x, args, per_layer, cache, cache_index, train)


_TOLD_UNCOUNTED = False  # the line below, once a process


def _without_counts(run, *args, **kwargs):
    with traced(uncounted=True):
        return run(*args, **kwargs)


def _uncounted(blocks, train: bool) -> None:
    """The console's line, when a training step is traced, that pipeline stages leave
    the experts' correction biases as they are."""
    from redray.models import moe

    global _TOLD_UNCOUNTED
    if train and not _TOLD_UNCOUNTED and nnx.state(blocks, moe.ExpertLoad):
        _TOLD_UNCOUNTED = True
        print("redray: pipeline stages: the experts' correction biases stay as they are "
              "(auxiliary-loss-free balancing counts expert loads on plans without "
              "stage_axis only, for now)", file=sys.stderr, flush=True)


def _scanned_decode(blocks, x, args, per_layer, cache, cache_index, train):
    """Stacked blocks over a stacked cache (an encoder-decoder's). The cache is carried,
    not scanned over: a scanned output would be the whole cache rewritten on every
    call; carried, each layer writes its new tokens in place."""
    broadcast, scanned = (None,) * len(args), (0,) * len(per_layer)

    @nnx.scan(in_axes=(0, nnx.Carry, *broadcast, *scanned), out_axes=nnx.Carry)
    def decode(block, carry, *a):
        x, cache, layer = carry
        x, written = block(x, *a, jax.tree.map(lambda c: c[layer], cache), cache_index,
                           train)[:2]
        tokens = x.shape[1]

        def put(stacked, new):
            new = jax.lax.dynamic_slice_in_dim(new, cache_index, tokens, new.ndim - 2)
            return jax.lax.dynamic_update_slice(stacked, new[None], (layer, 0, 0, cache_index, 0))
        return x, {**cache, "k": put(cache["k"], written["k"]),
                   "v": put(cache["v"], written["v"])}, layer + 1

    x, cache, _ = decode(blocks, (x, cache, jnp.int32(0)), *args, *per_layer)
    return x, cache


def _unrolled(blocks, x, args, per_layer, cache: list, cache_index, train):
    """Stacked blocks run one by one, each with its own layer's cache. XLA:CPU copies a
    layer's slice of a stacked cache before attention reads it (a copy of the whole
    cache per decoding step, 3x the step's time at 64 rows x 176 slots); separate
    per-layer arrays are read and written in place."""
    per_layer = tuple(jnp.reshape(a, (-1, *a.shape[2:])) if isinstance(blocks, Period) else a
                      for a in per_layer)  # a period's (repeats, period) back to layers
    owns = [tuple(a[i] for a in per_layer) for i in range(len(cache))]
    return _decode_layers(split_layers(blocks), owns, x, args, cache, cache_index, train)


def split_layers(blocks) -> nnx.List:
    """Stacked ``blocks`` as a list of their layers (each parameter sliced on its layer
    axis), in the layers' own order.

    A decoding loop calls this once, outside the loop (``unstacked``): XLA does not
    hoist the slices of the loop's invariant stacked weights, so each step would copy
    every layer's weights before reading them (0.7 ms of a 1.4 ms step for one row of
    ``benchmarks/sampler.py``'s model on XLA:CPU)."""
    with _in_layer_order(blocks) as ordered:
        graphdef, state = nnx.split(ordered)
        count = jax.tree.leaves(state)[0].shape[0]
        rows = [nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], state))
                for i in range(count)]
    if isinstance(blocks, Period):  # a period's layers in turn, one block each
        rows = [block for period in rows for block in period.period]
    return nnx.List(rows)


@contextlib.contextmanager
def _in_layer_order(blocks):
    """Stacked ``blocks`` with their parameters in the layers' own order, for a pass
    that is not pipelined (a short batch, decoding) on a plan with circular repeats or
    pads, which holds them in ``parallelism.layer_order`` (a gather across the stages,
    the pads dropped); the blocks themselves elsewhere. What the pass changes in their
    other state (RNG counts) is written back on leaving."""
    stages, repeats, counts = stage_layout()
    if stages == 1:
        yield blocks
        return
    graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
    held = jax.tree.leaves(params)[0].shape[0]
    layers = stacked_count(held, counts, stages, repeats)
    if repeats == 1 and held == layers:
        yield blocks
        return
    positions = layer_positions(layers, stages, repeats)
    ordered = nnx.merge(graphdef,
                        jax.tree.map(lambda a: jnp.take(a, positions, axis=0), params), rest)
    yield ordered
    nnx.update(blocks, nnx.split(ordered, nnx.Param, ...)[2])


def causal_lm_inputs(config, batch: int = 2, seq: int = 8) -> dict:
    """Abstract inputs of a decoder-only LM, for tracing it once (automatic sharding)."""
    return {"input_ids": jax.ShapeDtypeStruct((batch, seq), jnp.int32)}
