"""T5 (and T5 v1.1 / Flan-T5): an encoder-decoder with relative position buckets.

The encoder reads the whole input (bidirectional buckets); the decoder is causal
(unidirectional buckets) and cross-attends to the encoder output. Only the first block
of each stack owns a relative-attention-bias table; every block of that stack adds the
same bias. Scores are not scaled by 1/sqrt(head_dim). Norms are RMS norms without bias.
The feed-forward is ``wo(act(wi(x)))`` or, for "gated-*" configs,
``wo(act(wi_0(x)) * wi_1(x))``. Original T5 ties the LM head to the shared embedding
and scales the decoder output by d_model**-0.5; v1.1 has its own head and no scaling.

Unlike the decoder-only families, the model is called with ``decoder_input_ids``, and
exposes ``encode`` / ``decode`` so that ``generate`` encodes once and decodes with a KV
cache (the cross-attention keys/values are computed once too, into the cache).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redray.models import layers
from redray.models.generate import special_tokens, decode_loop
from redray.models.hub import HFConfig, fused, gated, linear, plain, qkv
from redray.sharding.tracing import constrain_rows

# v4 checkpoints may hold the stacks' aliases of the shared embedding, and old ones a
# cross-attention bias table that T5 never uses.
IGNORED = (r"^(encoder|decoder)\.embed_tokens\.weight$",
           r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$")


def _config(config):
    return config.hf if isinstance(config, HFConfig) else config


def _feed_forward(c) -> tuple[bool, str]:
    """(gated, activation name) of a config's ``feed_forward_proj``."""
    proj = getattr(c, "feed_forward_proj", "relu")
    gated = getattr(c, "is_gated_act", proj.startswith("gated-"))
    act = getattr(c, "dense_act_fn", None) or proj.split("-")[-1]
    if proj == "gated-gelu":  # what transformers runs for this name (T5 v1.1)
        act = "gelu_new"
    return bool(gated), act


def _head(c) -> tuple[bool, bool]:
    """(LM head tied to the shared embedding, decoder output scaled by d_model**-0.5).

    transformers >= 5 keeps ``tie_word_embeddings`` always true and records what the
    checkpoint's config said in ``scale_decoder_outputs``: v1.1 checkpoints (false)
    carry their own ``lm_head.weight``. Older versions only have the tie flag.
    """
    tie = bool(getattr(c, "tie_word_embeddings", True))
    scale = bool(getattr(c, "scale_decoder_outputs", tie))
    return tie and scale, scale


def _normal(c, std: float):
    """T5's initializer: a normal of ``std`` times the config's ``initializer_factor``.

    The stds are those of Mesh TensorFlow and transformers (e.g. queries
    (d_model * d_kv)**-0.5, which stands in for the missing 1/sqrt(head_dim), and the
    shared embedding 1.0): a T5 built from a config trains from scratch as T5 does.
    """
    return nnx.initializers.normal(getattr(c, "initializer_factor", 1.0) * std)


def _norm_init(c):
    return nnx.initializers.constant(getattr(c, "initializer_factor", 1.0))


def relative_position_buckets(bidirectional: bool, num_buckets: int,
                              max_distance: int) -> np.ndarray:
    """Bucket of every relative position (key - query) in [-max_distance, max_distance].

    Half the buckets (per direction when bidirectional) are exact small distances, the
    rest logarithmic bins up to ``max_distance``; farther positions share the last
    bucket, so clipping a relative position into this range keeps its bucket. Computed
    in float32 as Mesh TensorFlow and transformers do, so the bin edges agree.
    """
    rel = np.arange(-max_distance, max_distance + 1)
    buckets = np.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (rel > 0) * n
        dist = np.abs(rel)
    else:
        dist = -np.minimum(rel, 0)
    exact = n // 2
    ratio = np.maximum(dist, 1).astype(np.float32) / np.float32(exact)
    log_bin = (np.log(ratio) / np.float32(math.log(max_distance / exact))
               * np.float32(n - exact)).astype(np.int64)
    large = np.minimum(exact + log_bin, n - 1)
    return buckets + np.where(dist < exact, dist, large)


def _parts_init(c, stds: tuple[float, ...], shape: tuple[int, ...], axis: int):
    """An initializer for a fused kernel of ``shape`` whose parts, side by side along
    ``axis``, each start with T5's own std (queries smaller than keys and values).
    ``nnx.LinearGeneral`` asks for it flattened to (inputs, outputs)."""
    def init(key, flat_shape, dtype=jnp.float32):
        piece = shape[:axis] + (1,) + shape[axis + 1:]
        keys = jax.random.split(key, len(stds))
        parts = [_normal(c, std)(k, piece, dtype) for std, k in zip(stds, keys)]
        return jnp.concatenate(parts, axis).reshape(flat_shape)

    return init


class Attention(nnx.Module):
    """Multi-head attention without score scaling; optionally owns the bias table.

    Self-attention computes Q, K and V with one kernel (d_model, heads, 3, d_kv);
    cross-attention its queries with ``q`` and the encoder's keys and values with one
    kernel ``kv`` (d_model, heads, 2, d_kv): under tensor parallelism each input's
    gradient then reaches one all-reduce.
    """

    def __init__(self, c, *, cross: bool, relative_bias: bool, rngs, dtype):
        heads, d = c.num_heads, c.d_kv
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        inputs, queries = c.d_model ** -0.5, (c.d_model * d) ** -0.5
        if cross:
            self.q = nnx.LinearGeneral(c.d_model, (heads, d), kernel_init=_normal(c, queries),
                                       **dense)
            self.kv = nnx.LinearGeneral(c.d_model, (heads, 2, d), kernel_init=_normal(c, inputs),
                                        **dense)
        else:
            self.qkv = layers.qkv_projection(c.d_model, heads, heads, d, kernel_init=_parts_init(
                c, (queries, inputs, inputs), (c.d_model, heads, 3, d), 2), **dense)
        self.o = nnx.LinearGeneral((heads, d), c.d_model, axis=(-2, -1),
                                   kernel_init=_normal(c, (heads * d) ** -0.5), **dense)
        if relative_bias:
            self.relative_attention_bias = relative_bias_table(c, rngs, dtype)
        self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)

    def queries_keys_values(self, x):
        """(q, k, v) of self-attention over ``x``."""
        return layers.split_qkv(self.qkv(x))

    def keys_values(self, source):
        """(k, v) of cross-attention over the encoder output ``source``."""
        kv = self.kv(source)
        return kv[..., 0, :], kv[..., 1, :]

    def __call__(self, q, k, v, mask, bias, train):
        drop = (lambda p: self.dropout(p, deterministic=False)) if train else None
        return self.o(layers.dot_attention(q, k, v, mask, 1.0, bias=bias, dropout=drop))


class MLP(nnx.Module):
    """T5's DenseReluDense: wi -> act -> wo, or gated: act(x wi_0) * (x wi_1), with wi_0
    and wi_1 in one kernel ``wi_gated`` (d_model, 2, d_ff)."""

    def __init__(self, c, *, rngs, dtype):
        self.gated, act = _feed_forward(c)
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        wi = dict(kernel_init=_normal(c, c.d_model ** -0.5), **dense)
        if self.gated:
            self.wi_gated = layers.gated_projection(c.d_model, c.d_ff, **wi)
        else:
            self.wi = nnx.Linear(c.d_model, c.d_ff, **wi)
        self.wo = nnx.Linear(c.d_ff, c.d_model, kernel_init=_normal(c, c.d_ff ** -0.5), **dense)
        self.act = layers.activation(act)
        self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)

    def __call__(self, x, train):
        if self.gated:
            h = constrain_rows(self.wi_gated(x), whole=False)
            h = self.act(h[..., 0, :]) * h[..., 1, :]
        else:
            h = self.act(constrain_rows(self.wi(x), whole=False))
        return self.wo(self.dropout(h, deterministic=not train))


def relative_bias_table(c, rngs, dtype) -> nnx.Embed:
    """The (buckets, heads) relative position bias of a stack's self-attention."""
    return nnx.Embed(c.relative_attention_num_buckets, c.num_heads,
                     embedding_init=_normal(c, c.d_model ** -0.5), dtype=dtype, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm self-attention, cross-attention (decoder only) and feed-forward."""

    def __init__(self, c, *, relative_bias: bool, cross: bool, rngs, dtype):
        norm = dict(epsilon=c.layer_norm_epsilon, scale_init=_norm_init(c), dtype=dtype, rngs=rngs)
        self.self_attn_norm = nnx.RMSNorm(c.d_model, **norm)
        self.self_attn = Attention(c, cross=False, relative_bias=relative_bias, rngs=rngs,
                                   dtype=dtype)
        if cross:
            self.cross_attn_norm = nnx.RMSNorm(c.d_model, **norm)
            self.cross_attn = Attention(c, cross=True, relative_bias=False, rngs=rngs,
                                        dtype=dtype)
        self.mlp_norm = nnx.RMSNorm(c.d_model, **norm)
        self.mlp = MLP(c, rngs=rngs, dtype=dtype)
        self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)

    def __call__(self, x, mask, bias, encoder_out, cross_mask, cache, cache_index, train):
        drop = lambda h: self.dropout(h, deterministic=not train)  # noqa: E731
        q, k, v = self.self_attn.queries_keys_values(self.self_attn_norm(x))
        new_cache = None
        if cache is not None:
            new_cache = layers.update_cache(cache, k, v, cache_index)
            k, v = layers.cached_keys(new_cache)
        x = x + drop(self.self_attn(q, k, v, mask, bias, train))
        if encoder_out is not None:
            if cache is not None and "cross_k" in cache:
                k, v = cache["cross_k"], cache["cross_v"]
            else:
                k, v = self.cross_attn.keys_values(encoder_out)
            q = self.cross_attn.q(self.cross_attn_norm(x))
            x = x + drop(self.cross_attn(q, k, v, cross_mask, None, train))
        return x + drop(self.mlp(self.mlp_norm(x), train)), new_cache


class Stack(nnx.Module):
    """The encoder (bidirectional) or the decoder (causal, cross-attending) stack."""

    def __init__(self, c, num_layers: int, *, decoder: bool, rngs, dtype, scan: bool = False):
        if scan:
            # every block alike (what a scan needs): the table the first block holds in
            # the listed form lives beside them
            self.relative_attention_bias = relative_bias_table(c, rngs, dtype)
            self.layers = layers.make_blocks(
                lambda r: Block(c, relative_bias=False, cross=decoder, rngs=r, dtype=dtype),
                num_layers, rngs, scan=True)
        else:
            self.layers = nnx.List([Block(c, relative_bias=i == 0, cross=decoder, rngs=rngs,
                                          dtype=dtype) for i in range(num_layers)])
        self.num_layers = num_layers
        self.final_layer_norm = nnx.RMSNorm(c.d_model, epsilon=c.layer_norm_epsilon,
                                            scale_init=_norm_init(c), dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)
        self.max_distance = c.relative_attention_max_distance
        self.buckets = tuple(int(b) for b in relative_position_buckets(
            not decoder, c.relative_attention_num_buckets, self.max_distance))

    def position_bias(self, q_slots, kv_len: int):
        """(1, heads, q, kv) bias from the first block's table, by slot distance.

        T5 measures distances between slots, not between real tokens: padding counts,
        as in transformers.
        """
        rel = jnp.arange(kv_len)[None, :] - q_slots[:, None]
        index = jnp.clip(rel, -self.max_distance, self.max_distance) + self.max_distance
        buckets = jnp.asarray(self.buckets, jnp.int32)[index]
        table = self.relative_attention_bias if layers.is_stacked(self.layers) else \
            self.layers[0].self_attn.relative_attention_bias
        values = table(buckets)
        return jnp.transpose(values, (2, 0, 1))[None]

    def __call__(self, x, mask, bias, encoder_out, cross_mask, cache, cache_index, train,
                 remat):
        x, new_cache = layers.run_blocks(self.layers, x, (mask, bias, encoder_out, cross_mask),
                                         cache, cache_index, train, remat)
        x = self.dropout(self.final_layer_norm(x), deterministic=not train)
        return x, new_cache


class Model(nnx.Module):
    """A T5 encoder-decoder (``T5ForConditionalGeneration``) from a ``transformers`` config.

    ``model(input_ids, attention_mask, decoder_input_ids=...)`` gives the decoder's
    logits (batch, dec_len, vocab). ``encode`` and ``decode`` run the halves;
    ``decode`` with ``cache=model.init_cache(...)`` and ``cache_index`` decodes
    incrementally and returns (logits, cache).
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, remat=False,
                 scan: bool | None = None):
        c = _config(config)
        scan = True if scan is None else bool(scan)  # T5's blocks differ in nothing
        self.config = HFConfig(c)
        self.dtype = dtype
        self.remat = layers.remat_policy(remat)
        self.shared = layers.Embed(c.vocab_size, c.d_model, embedding_init=_normal(c, 1.0),
                                dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(c.dropout_rate, rngs=rngs)
        self.encoder = Stack(c, c.num_layers, decoder=False, rngs=rngs, dtype=dtype, scan=scan)
        decoder_layers = getattr(c, "num_decoder_layers", None) or c.num_layers
        self.decoder = Stack(c, decoder_layers, decoder=True, rngs=rngs, dtype=dtype, scan=scan)
        self.tied, self.scale = _head(c)
        if not self.tied:
            self.lm_head = nnx.Linear(c.d_model, c.vocab_size, use_bias=False,
                                      kernel_init=_normal(c, 1.0), dtype=dtype, rngs=rngs)

    def __call__(self, input_ids, attention_mask=None, *, decoder_input_ids,
                 decoder_attention_mask=None, train: bool = False):
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        encoder_out = self.encode(input_ids, attention_mask, train=train)
        return self.decode(decoder_input_ids, encoder_out, attention_mask,
                           decoder_attention_mask=decoder_attention_mask, train=train)

    def encode(self, input_ids, attention_mask=None, train: bool = False):
        """Encoder hidden states (batch, seq, d_model); mask: 1 for real tokens."""
        t = input_ids.shape[1]
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        slots = jnp.arange(t)
        mask = layers.attention_mask_for(attention_mask, slots, causal=False)
        bias = self.encoder.position_bias(slots, t)
        x = self.dropout(self.shared(input_ids), deterministic=not train)
        return self.encoder(x, mask, bias, None, None, None, 0, train, self.remat)[0]

    def decode(self, decoder_input_ids, encoder_out, encoder_mask=None, *, cache=None,
               cache_index=0, decoder_attention_mask=None, train: bool = False):
        """Decoder logits (batch, dec_len, vocab), or (logits, cache) with a cache.

        Args:
          decoder_input_ids: (batch, dec_len), starting from the decoder start token.
          encoder_out: (batch, enc_len, d_model) from ``encode``.
          encoder_mask: (batch, enc_len) 1 for real encoder tokens.
          cache / cache_index: the decoder's KV cache and the slot of the first token.
          decoder_attention_mask: over decoder key slots (dec_len, or the cache length).
        """
        b, t = decoder_input_ids.shape
        if cache is None:
            kv_len = t
        else:
            kv_len = layers.cache_length(cache)
        if decoder_attention_mask is None:
            decoder_attention_mask = jnp.ones((b, kv_len), jnp.int32)
        if encoder_mask is None:
            encoder_mask = jnp.ones(encoder_out.shape[:2], jnp.int32)
        slots = layers.query_slots(t, cache_index)
        mask = layers.attention_mask_for(decoder_attention_mask, slots)
        cross_mask = layers.attention_mask_for(encoder_mask, slots, causal=False)
        bias = self.decoder.position_bias(slots, kv_len)
        x = self.dropout(self.shared(decoder_input_ids), deterministic=not train)
        x, new_cache = self.decoder(x, mask, bias, encoder_out, cross_mask, cache, cache_index,
                                    train, self.remat)
        if self.scale:
            x = x * self.config.d_model ** -0.5
        logits = self.shared.attend(x) if self.tied else self.lm_head(x)
        return logits if cache is None else (logits, new_cache)

    def init_cache(self, batch: int, length: int, dtype=None, encoder_out=None):
        """An empty decoder KV cache for ``batch`` sequences of up to ``length`` tokens.

        With ``encoder_out``, each layer's cross-attention keys/values are computed once
        and kept in the cache (``decode`` then reads them instead of recomputing).
        """
        c = self.config
        dtype = dtype or self.dtype
        stacked = layers.is_stacked(self.decoder.layers)
        cache = layers.empty_cache(self.decoder.num_layers, batch, length, c.num_heads,
                                   c.d_kv, dtype, stacked)
        if encoder_out is None:
            return cache
        if stacked:  # every layer's keys and values of the encoder output at once
            kernel = self.decoder.layers.cross_attn.kv.kernel[...]
            compute = self.dtype
            kv = jnp.einsum("bsm,lmhtd->lbshtd", encoder_out.astype(compute),
                            kernel.astype(compute))
            cache["cross_k"], cache["cross_v"] = (kv[..., 0, :].astype(dtype),
                                                  kv[..., 1, :].astype(dtype))
            return cache
        for layer_cache, block in zip(cache, self.decoder.layers):
            k, v = block.cross_attn.keys_values(encoder_out)
            layer_cache["cross_k"], layer_cache["cross_v"] = k.astype(dtype), v.astype(dtype)
        return cache


def scanned_path(path: str) -> str | None:
    """Where the scanned form keeps a parameter the listed form's weight table names
    elsewhere: the first block's relative position bias sits beside the blocks."""
    for stack in ("encoder", "decoder"):
        if path == f"{stack}/layers/0/self_attn/relative_attention_bias/embedding":
            return f"{stack}/relative_attention_bias/embedding"
    return None


def decoder_start_token(config) -> int:
    """The token decoding starts from: the config's, else the pad token (T5's), else 0."""
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None)
    return 0 if start is None else int(start)


def generate(model, input_ids, attention_mask=None, *, max_new_tokens: int, rng=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id=None, pad_token_id: int | None = None) -> jax.Array:
    """Encodes ``input_ids`` once and decodes up to ``max_new_tokens`` with a KV cache.

    Args:
      model: a redray T5 ``Model``.
      input_ids: (batch, enc_len) int; padding may sit on either side.
      attention_mask: (batch, enc_len) 1 for real tokens, 0 for padding.
      max_new_tokens: tokens to produce (the decoder start token is not returned).
      rng, temperature, top_k, top_p: sampling, as ``redray.models.generate``.
      eos_token_id, pad_token_id: default to the config's.

    Returns:
      (batch, max_new_tokens) int32; rows that emitted EOS continue with padding.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    batch = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    attention_mask = jnp.asarray(attention_mask, jnp.int32)
    eos_token_id, pad_token_id = special_tokens(model.config, eos_token_id, pad_token_id)
    encoder_out = model.encode(input_ids, attention_mask)
    # Slot 0 holds the start token and slot t + 1 the t-th new token; the last new
    # token is fed once more by the loop, hence the extra slot.
    cache = model.init_cache(batch, max_new_tokens + 1, encoder_out=encoder_out)
    start = jnp.full((batch, 1), decoder_start_token(model.config), jnp.int32)
    logits, cache = model.decode(start, encoder_out, attention_mask, cache=cache, cache_index=0)

    # rebuilt inside the loop's trace (NNX's scan of stacked layers refuses a module from
    # an outer trace), as redray.models.generate does
    graphdef, state = nnx.split(model)

    def step(token, cache, t):
        inner = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        logits, cache = inner.decode(token[:, None], encoder_out, attention_mask, cache=cache,
                                     cache_index=t + 1)
        return logits[:, -1], cache

    return decode_loop(step, logits[:, -1], cache, max_new_tokens=max_new_tokens, rng=rng,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def trace_inputs(config, batch: int = 2, seq: int = 8) -> dict:
    """Abstract inputs for tracing the model once (automatic sharding)."""
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return {"input_ids": ids, "decoder_input_ids": ids}


def weight_table(config) -> list:
    """Hugging Face tensor names <-> redray parameter paths."""
    c = _config(config)
    gated_mlp, _ = _feed_forward(c)
    tied, _ = _head(c)
    rows = [plain("shared.weight", "shared/embedding")]
    if not tied:
        # transformers 5 may save an untied config's head only as the shared embedding
        rows.append(linear("lm_head.weight", "lm_head/kernel", fallback="shared.weight"))
    decoder_layers = getattr(c, "num_decoder_layers", None) or c.num_layers
    for stack, n in (("encoder", c.num_layers), ("decoder", decoder_layers)):
        rows.append(plain(f"{stack}.final_layer_norm.weight", f"{stack}/final_layer_norm/scale"))
        for i in range(n):
            hf, me = f"{stack}.block.{i}.layer", f"{stack}/layers/{i}"
            sublayers = [("0", "SelfAttention", "self_attn")]
            if stack == "decoder":
                sublayers.append(("1", "EncDecAttention", "cross_attn"))
            for j, hf_name, name in sublayers:
                rows.append(plain(f"{hf}.{j}.layer_norm.weight", f"{me}/{name}_norm/scale"))
                module = lambda proj: f"{hf}.{j}.{hf_name}.{proj}"  # noqa: E731
                if name == "self_attn":
                    rows += qkv(tuple(map(module, "qkv")), f"{me}/self_attn/qkv", c.num_heads,
                                c.num_heads)
                else:  # keys and values of the encoder output: the Q/K/V layout without Q
                    path = f"{me}/cross_attn/kv/kernel"
                    rows += [linear(f"{module('q')}.weight", f"{me}/cross_attn/q/kernel"),
                             fused(path, 2, (1, 1), *(linear(f"{module(p)}.weight", path)
                                                      for p in "kv"))]
                rows.append(linear(f"{module('o')}.weight", f"{me}/{name}/o/kernel", in_dims=2))
            if i == 0:  # scanned_path: where the scanned form keeps it
                rows.append(plain(f"{hf}.0.SelfAttention.relative_attention_bias.weight",
                                  f"{me}/self_attn/relative_attention_bias/embedding"))
            ff = "2" if stack == "decoder" else "1"
            rows.append(plain(f"{hf}.{ff}.layer_norm.weight", f"{me}/mlp_norm/scale"))
            dense = f"{hf}.{ff}.DenseReluDense"
            if gated_mlp:
                rows += gated((f"{dense}.wi_0", f"{dense}.wi_1"), f"{me}/mlp/wi_gated")
            else:
                rows.append(linear(f"{dense}.wi.weight", f"{me}/mlp/wi/kernel"))
            rows.append(linear(f"{dense}.wo.weight", f"{me}/mlp/wo/kernel"))
    return rows
