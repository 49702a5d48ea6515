"""Generation with a KV cache: greedy or sampled, EOS stopping, left-padded prompts.

Everything is traceable: ``generate`` can run inside the user's ``predict`` and so on
the Predictor's sharded mesh. Prompts are left-padded to one length P, so every row
writes its t-th new token to cache slot P + t and one ``cache_index`` serves the batch.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx


def sample_token(logits: jax.Array, rng, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0) -> jax.Array:
    """Next token per row from (batch, vocab) logits.

    ``temperature == 0`` is greedy (argmax). Otherwise logits are divided by the
    temperature, restricted to the ``top_k`` largest (0: all) and to the smallest set
    whose probability reaches ``top_p`` (1.0: all), and sampled.
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits / temperature
    neg = jnp.finfo(jnp.float32).min
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, -1)
        sorted_logits = jnp.take_along_axis(logits, order, -1)
        probs = jax.nn.softmax(sorted_logits, -1)
        before = jnp.cumsum(probs, -1) - probs  # mass of strictly more likely tokens
        sorted_logits = jnp.where(before >= top_p, neg, sorted_logits)
        logits = jnp.full_like(logits, neg).at[jnp.arange(logits.shape[0])[:, None], order].set(
            sorted_logits)
    return jax.random.categorical(rng, logits, -1).astype(jnp.int32)


def decode_loop(step: Callable, first_logits: jax.Array, state, *, max_new_tokens: int,
                rng=None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                eos_token_id=None, pad_token_id: int = 0) -> jax.Array:
    """Samples up to ``max_new_tokens`` tokens; ``step(tokens, state, t) -> (logits, state)``.

    Rows that emitted ``eos_token_id`` continue with ``pad_token_id``; the loop ends
    early once every row is done. Returns (batch, max_new_tokens) int32.
    """
    batch = first_logits.shape[0]
    rng = jax.random.key(0) if rng is None else rng
    eos = jnp.asarray(-1 if eos_token_id is None else eos_token_id, jnp.int32).reshape(-1)
    out = jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32)

    def cond(carry):
        t, _, _, done, _ = carry
        return (t < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        t, logits, st, done, out = carry
        token = sample_token(logits, jax.random.fold_in(rng, t), temperature, top_k, top_p)
        token = jnp.where(done, pad_token_id, token)
        out = out.at[:, t].set(token)
        done = done | jnp.isin(token, eos)
        logits, st = step(token, st, t)
        return t + 1, logits, st, done, out

    carry = (jnp.zeros((), jnp.int32), first_logits, state, jnp.zeros((batch,), bool), out)
    return jax.lax.while_loop(cond, body, carry)[-1]


def generate(model, input_ids, attention_mask=None, *, max_new_tokens: int, rng=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id=None, pad_token_id: int | None = None) -> jax.Array:
    """Continues left-padded prompts with a decoder-only redray model.

    Args:
      model: a redray causal LM (``model(ids, attention_mask, cache=, cache_index=)``
        and ``model.init_cache(batch, length)``).
      input_ids: (batch, prompt_len) int, left-padded.
      attention_mask: (batch, prompt_len) 1 for real tokens, 0 for padding.
      max_new_tokens: tokens to add.
      rng: a ``jax.random`` key for sampling.
      temperature, top_k, top_p: sampling; ``temperature=0`` is greedy.
      eos_token_id: an int or list of ints that end a row; default: the config's.
      pad_token_id: what follows EOS; default: the config's pad, else EOS, else 0.

    Returns:
      (batch, max_new_tokens) int32 new tokens.

    An encoder-decoder model (T5) is handed to its family's ``generate``, which encodes
    the prompts once and decodes from the decoder start token.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        from redray.models.hub import family

        return family(model.config.model_type).generate(
            model, input_ids, attention_mask, max_new_tokens=max_new_tokens, rng=rng,
            temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
            pad_token_id=pad_token_id)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    batch, prompt = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    eos_token_id, pad_token_id = special_tokens(model.config, eos_token_id, pad_token_id)
    kv_valid = jnp.concatenate([jnp.asarray(attention_mask, jnp.int32),
                                jnp.ones((batch, max_new_tokens), jnp.int32)], 1)
    logits, cache = prompt_prefill(model, input_ids, kv_valid,
                                   model.init_cache(batch, prompt + max_new_tokens))
    # The model is rebuilt inside the loop's trace: NNX's own transforms refuse a module
    # from an outer trace. Its stacked layers are split before the loop (``unstacked``).
    graphdef, state = nnx.split(for_decoding(model))

    def step(token, cache, t):
        inner = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        logits, cache = inner(token[:, None], kv_valid, cache=cache, cache_index=prompt + t)
        return logits[:, -1], cache

    return decode_loop(step, logits, cache, max_new_tokens=max_new_tokens, rng=rng,
                       temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def prompt_prefill(model, input_ids, attention_mask, cache):
    """Prompts written into an empty ``cache`` from slot 0; returns (the logits of
    each row's last token (batch, vocab), the cache). The LM head runs on the last
    token only (a redray decoder's ``hidden=True`` and ``logits``): over every prompt
    token it would be a (batch, prompt, vocab) array of which one row per prompt is
    read (with a vocabulary of 150k, 600 kB a token in float32)."""
    head = getattr(model, "logits", None)
    if head is None:
        logits, cache = model(input_ids, attention_mask, cache=cache, cache_index=0)
        return logits[:, -1], cache
    hidden, cache = model(input_ids, attention_mask, cache=cache, cache_index=0, hidden=True)
    return head(hidden[:, -1:])[:, 0], cache


def for_decoding(model):
    """``model`` as a decoding loop should close over it: a redray decoder's stacked
    layers split once (``DecoderLM.unstacked``); any other model as it is."""
    unstacked = getattr(model, "unstacked", None)
    return model if unstacked is None else unstacked()


def special_tokens(config, eos_token_id, pad_token_id):
    """(eos, pad) ids: given ones, else the checkpoint's generation config's (all of
    ``generation_config.json``'s EOS ids: an instruct model's end-of-turn tokens), else
    the config's; pad falls back to EOS, then 0."""
    generation = getattr(config, "generation", None) or {}
    if eos_token_id is None:
        eos_token_id = generation.get("eos_token_id")
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = generation.get("pad_token_id")
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            first_eos = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) else eos_token_id
            pad_token_id = 0 if first_eos is None else first_eos
    return eos_token_id, int(pad_token_id)
